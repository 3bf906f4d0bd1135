//! # uniop-ops — the op library
//!
//! One file per op, each written only against `uniop`'s traits: schema, infer, plan (kernels per
//! dtype on the SPMD engine), f64 reference, example inputs. Adding an op means adding its file
//! and one line in [`builtin_ops`]; no frontend changes. Forms of one kernel share a file: an op's
//! train and packed forms (`linear_gated_mul.rs`), its activations (`gated_mul.rs`: `silu_mul`
//! and `gelu_mul`, the activation a type parameter, see `gate.rs`; `glu.rs`: `swiglu` and `geglu`).

/// Compiles a kernel function once per x86-64 level (AVX-512 "v4" with and without AVX512-BF16,
/// AVX2 "v3", baseline) and dispatches on the CPU at runtime. Everything the body inlines —
/// `#[inline(always)]` helpers, [`elementwise::Map1`]/[`elementwise::Map2`] methods, closures
/// defined in the body — is vectorized for that level. The BF16 level exists so that bf16's
/// native narrowing ([`uniop::FloatElement::narrow_lanes_natively`]) inlines into kernel loops;
/// in the other levels it would be a call.
#[macro_export]
macro_rules! simd_kernel {
    ($item:item) => {
        #[multiversion::multiversion(targets(
            "x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx512bf16+avx2+fma+f16c",
            "x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma+f16c",
            "x86_64+avx2+fma+f16c",
        ))]
        $item
    };
}

pub mod attention;
pub mod attention_backward;
mod attention_mask_grad;
mod broadcast_grad;
pub mod cast;
pub mod cast_backward;
pub mod cat;
pub mod cat_backward;
pub mod causal_softmax;
mod clamped_swiglu;
mod elementwise;
pub mod embedding;
pub mod embedding_backward;
#[cfg(target_arch = "x86_64")]
mod flash_avx2;
#[cfg(target_arch = "x86_64")]
mod flash_backward_avx2;
mod gate;
pub mod gated_mul;
pub mod gated_mul_backward;
pub mod gelu;
pub mod gelu_backward;
pub mod glu;
pub mod glu_backward;
pub mod kv_cache_append;
pub mod layer_norm;
pub mod layer_norm_backward;
pub mod linear;
pub mod linear_add;
pub mod linear_add_backward;
pub mod linear_backward;
pub mod linear_gated_mul;
pub mod linear_gated_mul_backward;
pub mod linear_int8;
pub mod linear_int8_backward;
pub mod linear_packed;
pub mod math;
pub mod matmul;
pub mod matmul_backward;
pub mod mul;
pub mod mul_backward;
pub mod pack_weight;
mod packed_gemm;
mod paired;
mod per_sample;
pub mod permute;
pub mod permute_backward;

pub mod add;
pub mod add_backward;
pub mod add_rms_norm;
pub mod add_rms_norm_backward;
mod amx;
pub mod argmax;
pub mod cross_entropy;
pub mod cross_entropy_backward;
pub mod rms_norm;
pub mod rms_norm_backward;
pub mod rope;
pub mod rope_backward;
pub mod rope_cos_sin;
#[cfg(target_arch = "x86_64")]
mod rows_avx2;
pub mod sample;
pub mod silu;
pub mod silu_backward;
mod skinny;
mod softcapped_swiglu;
pub mod softmax;
pub mod softmax_backward;
mod transpose;

use std::sync::Once;
use uniop::{Op, Registry};

/// Every built-in op, in registration order.
pub fn builtin_ops() -> Vec<Box<dyn Op>> {
    vec![
        Box::new(add::Add),
        Box::new(add_backward::AddBackward),
        Box::new(silu::Silu),
        Box::new(silu_backward::SiluBackward),
        Box::new(mul::Mul),
        Box::new(mul_backward::MulBackward),
        Box::new(cast::Cast),
        Box::new(cast_backward::CastBackward),
        Box::new(cat::Cat),
        Box::new(cat_backward::CatBackward),
        Box::new(permute::Permute),
        Box::new(permute_backward::PermuteBackward),
        Box::new(argmax::Argmax),
        Box::new(sample::Sample),
        Box::new(gelu::Gelu),
        Box::new(gelu_backward::GeluBackward),
        Box::new(matmul::Matmul),
        Box::new(matmul_backward::MatmulBackward),
        Box::new(linear::Linear),
        Box::new(linear_add::LinearAdd),
        Box::new(linear_add_backward::LinearAddBackward),
        Box::new(linear_backward::LinearBackward),
        Box::new(linear_int8::LinearInt8),
        Box::new(linear_int8_backward::LinearInt8Backward),
        Box::new(linear_gated_mul::LinearGatedMul::SILU),
        Box::new(linear_gated_mul::LinearGatedMul::SILU_TRAIN),
        Box::new(linear_gated_mul_backward::LinearGatedMulBackward::SILU),
        Box::new(linear_gated_mul::LinearGatedMul::GELU),
        Box::new(linear_gated_mul::LinearGatedMul::GELU_TRAIN),
        Box::new(linear_gated_mul_backward::LinearGatedMulBackward::GELU),
        Box::new(pack_weight::PackWeight),
        Box::new(linear_packed::LinearPacked::BIAS),
        Box::new(linear_packed::LinearPacked::RESIDUAL),
        Box::new(linear_gated_mul::LinearGatedMul::SILU_PACKED),
        Box::new(linear_gated_mul::LinearGatedMul::GELU_PACKED),
        Box::new(embedding::Embedding),
        Box::new(embedding_backward::EmbeddingBackward),
        Box::new(cross_entropy::CrossEntropy),
        Box::new(cross_entropy_backward::CrossEntropyBackward),
        Box::new(rms_norm::RmsNorm),
        Box::new(rms_norm_backward::RmsNormBackward),
        Box::new(add_rms_norm::AddRmsNorm),
        Box::new(add_rms_norm_backward::AddRmsNormBackward),
        Box::new(layer_norm::LayerNorm),
        Box::new(layer_norm_backward::LayerNormBackward),
        Box::new(rope::Rope),
        Box::new(rope_backward::RopeBackward),
        Box::new(rope_cos_sin::RopeCosSin),
        Box::new(gated_mul::GatedMul::SILU),
        Box::new(gated_mul_backward::GatedMulBackward::SILU),
        Box::new(gated_mul::GatedMul::GELU),
        Box::new(gated_mul_backward::GatedMulBackward::GELU),
        Box::new(glu::Glu::SWIGLU),
        Box::new(glu_backward::GluBackward::SWIGLU),
        Box::new(glu::Glu::GEGLU),
        Box::new(glu_backward::GluBackward::GEGLU),
        Box::new(paired::PairOp::<clamped_swiglu::Clamp>::OP),
        Box::new(paired::PairBackwardOp::<clamped_swiglu::Clamp>::OP),
        Box::new(paired::PairOp::<softcapped_swiglu::Softcaps>::OP),
        Box::new(paired::PairBackwardOp::<softcapped_swiglu::Softcaps>::OP),
        Box::new(kv_cache_append::KvCacheAppend),
        Box::new(attention::Attention),
        Box::new(attention_backward::AttentionBackward),
        Box::new(softmax::Softmax::SOFTMAX),
        Box::new(causal_softmax::CausalSoftmax),
        Box::new(softmax::Softmax::LOG_SOFTMAX),
        Box::new(softmax_backward::SoftmaxBackward::SOFTMAX),
        Box::new(softmax_backward::SoftmaxBackward::LOG_SOFTMAX),
    ]
}

/// The instruction sets the GEMM kernels run with on this CPU, per operand dtype:
/// `[("bfloat16", level), ("float32", level)]`, level `"amx"` (bf16 only: AMX tiles, with
/// AVX512-BF16 for few-row products), `"avx512"` (for bf16: AVX512-BF16's pair products, or on
/// Intel cores without AMX the pairs widened for FMAs, which run there at twice `vdpbf16ps`'s rate),
/// `"avx2"` (bf16 pairs widened for FMAs) or `"scalar"`. For f32 the level is that of the few-row
/// kernel and, at `"avx512"` and `"avx2"`, of the packed kernel that runs products with a k-dense
/// weight up to depth 2048; other f32 products run on the `gemm` crate, which picks its own.
/// Frameworks use this to choose between their GEMM and uniop's (`uniop.torch.patch_llama` keeps
/// torch's f32 GEMM for prefill on Intel CPUs and on CPUs without AVX-512).
pub fn gemm_kernels() -> [(&'static str, &'static str); 2] {
    use skinny::{Dots, Simd};
    let name = |s: Simd| match s {
        Simd::Avx512 => "avx512",
        Simd::Avx2 => "avx2",
        Simd::Scalar => "scalar",
    };
    let bf16 = if packed_gemm::bf16_on_amx() { "amx" } else { name(<uniop::half::bf16 as Dots>::best()) };
    [("bfloat16", bf16), ("float32", name(<f32 as Dots>::best()))]
}

/// Runs the bf16 GEMM's AMX block kernel `rounds` times on operands held in L1 and returns the
/// flops it did, or None where the CPU (or the OS) offers no AMX tiles: `uniop bench`'s tile peak,
/// the compute limit of bf16 GEMMs on such CPUs (the f32 FMA probe is not: a core's tile unit
/// does 16 times the multiply-adds per cycle of its two AVX-512 FMA pipes).
pub fn amx_probe(rounds: usize) -> Option<u64> {
    amx::probe(rounds).map(|(flops, _)| flops)
}

/// The bytes a kernel writes from which it writes them past the cache with non-temporal stores:
/// the size of this CPU's last-level cache, at most 32 MiB (below it, results stay cached for the
/// next op), unless `UNIOP_STREAMING_THRESHOLD` sets it.
pub fn streaming_threshold_bytes() -> usize {
    elementwise::streaming_threshold_bytes()
}

/// Registers the built-in ops in the global registry (idempotent, thread-safe).
pub fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let registry = Registry::global();
        for op in builtin_ops() {
            registry.register(op).expect("built-in op schemas are valid and unique");
        }
    });
}
