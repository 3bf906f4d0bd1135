/* uniop C API. Generated from crates/uniop-capi by `cargo run -p uniop-capi --features header --bin uniop-header`; do not edit. */

#ifndef UNIOP_H
#define UNIOP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// Bumped when a struct layout or a signature of this header changes incompatibly (2: `add`'s alpha
// became a `uniopScalar`; 3: cross_entropy, its backward and the backwards summing parameter
// gradients gained `batch_dims`; 4: so did linear_silu_mul_backward and linear_gelu_mul_backward, with
// `needs_dx`, `needs_dgate_weight` and `needs_dup_weight`; linear_backward and linear_add_backward
// gained `needs_dx` and `needs_dweight`, matmul_backward `needs_da` and `needs_db`; 5:
// attention_backward gained `batch_dims`; 6: so did permute and permute_backward).
#define UNIOP_ABI_VERSION 6

// A point in a stream's work, for ordering and timing (opaque).
typedef struct uniopEventObj uniopEventObj;

// A planned op call: phase 1's result, launched by phase 2 (opaque).
typedef struct uniopExecutor uniopExecutor;

// Integers passed as one argument (aclnn's `aclIntArray`), for `int[]` arguments such as
// `permute`'s dims (opaque). The values are copied.
typedef struct uniopIntArray uniopIntArray;

// A number passed by value of any dtype (aclnn's `aclScalar`), for `Scalar` arguments such as
// `add`'s alpha (opaque). Integers stay exact.
typedef struct uniopScalar uniopScalar;

// An ordered queue of work (opaque).
typedef struct uniopStreamObj uniopStreamObj;

// A strided view of caller-owned memory (opaque).
typedef struct uniopTensor uniopTensor;

// Tensors passed as one argument (aclnn's `aclTensorList`), e.g. `cat`'s inputs (opaque).
// Like aclnn, the list owns its tensors: destroying it destroys them.
typedef struct uniopTensorList uniopTensorList;

// Result of every call: `UNIOP_SUCCESS` or an error code.
typedef int32_t uniopStatus;

typedef uniopStreamObj *uniopStream;

// Element types, numbered like `aclDataType`.
typedef int32_t uniopDataType;

typedef uniopEventObj *uniopEvent;

// `aclrtMalloc`'s policies: huge pages first (falling back to normal pages), huge only, normal only.
typedef int32_t uniopMemMallocPolicy;

// Copy directions (all plain copies on the CPU device; checked for source compatibility).
typedef int32_t uniopMemcpyKind;

// Allocator counters, in bytes and calls (six of them; `uniopGetMemStat` reads each).
typedef struct {
  uint64_t allocated;
  uint64_t reserved;
  uint64_t peakAllocated;
  uint64_t allocCount;
  uint64_t freeCount;
  uint64_t liveBuffers;
} uniopMemStats;

// One allocator counter, for `uniopGetMemStat`: a number, not a struct field, so that counters
// added later reach C callers without changing any struct's size.
typedef int32_t uniopMemStat;

// A device kernel for the direct call: runs once per block with its index and the block count.
typedef void (*uniopKernelFn)(uint32_t block_idx, uint32_t block_num, void *args);

// Memory formats, numbered like `aclFormat`; uniop tensors are plain strided (`ND`) arrays.
typedef int32_t uniopFormat;

#define UNIOP_SUCCESS 0

#define UNIOP_ERROR_PARAM_NULLPTR 161001

#define UNIOP_ERROR_PARAM_INVALID 161002

#define UNIOP_ERROR_DTYPE 161003

#define UNIOP_ERROR_SHAPE 161004

#define UNIOP_ERROR_WORKSPACE_TOO_SMALL 161005

#define UNIOP_ERROR_RUNTIME 361001

#define UNIOP_ERROR_INTERNAL 561000

#define UNIOP_MEM_MALLOC_HUGE_FIRST 0

#define UNIOP_MEM_MALLOC_HUGE_ONLY 1

#define UNIOP_MEM_MALLOC_NORMAL_ONLY 2

#define UNIOP_MEMCPY_HOST_TO_HOST 0

#define UNIOP_MEMCPY_HOST_TO_DEVICE 1

#define UNIOP_MEMCPY_DEVICE_TO_HOST 2

#define UNIOP_MEMCPY_DEVICE_TO_DEVICE 3

// Bytes in blocks currently handed out.
#define UNIOP_MEM_STAT_ALLOCATED 0

// Bytes held from the OS: handed out plus cached.
#define UNIOP_MEM_STAT_RESERVED 1

// The most bytes handed out at once since start (or the last peak reset).
#define UNIOP_MEM_STAT_PEAK_ALLOCATED 2

// Allocations served.
#define UNIOP_MEM_STAT_ALLOC_COUNT 3

// Buffers freed (returned to the cache).
#define UNIOP_MEM_STAT_FREE_COUNT 4

// Live buffers (allocations minus frees).
#define UNIOP_MEM_STAT_LIVE_BUFFERS 5

// Bytes the callers asked for (before rounding), currently live.
#define UNIOP_MEM_STAT_REQUESTED 6

// Allocations served from the cache instead of the OS.
#define UNIOP_MEM_STAT_CACHE_HITS 7

// Blocks obtained from the OS.
#define UNIOP_MEM_STAT_OS_ALLOCS 8

// Times the OS refused a block and the cache was returned to it before asking again: a loop that
// keeps raising this runs at its memory limit.
#define UNIOP_MEM_STAT_ALLOC_RETRIES 9

// Allocations that failed even after that.
#define UNIOP_MEM_STAT_OOMS 10

#define UNIOP_FLOAT 0

#define UNIOP_FLOAT16 1

#define UNIOP_INT8 2

#define UNIOP_INT32 3

#define UNIOP_UINT8 4

#define UNIOP_INT64 9

#define UNIOP_DOUBLE 11

#define UNIOP_BOOL 12

#define UNIOP_BF16 27

#define UNIOP_FORMAT_ND 2

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// The message of the calling thread's most recent failed call ("" when none). Valid until the
// thread's next failing call.
const char *uniopGetRecentErrMsg(void);

// `UNIOP_ABI_VERSION` of the loaded library, to compare with the header's.
uint32_t uniopGetAbiVersion(void);

// Phase 1 of `add(Tensor a, Tensor b, *, Scalar alpha=1) -> (Tensor out)`.
//
// Elementwise a + alpha * b. `a` and `b` broadcast against each other (trailing dims aligned,
// size-1 or missing dims stretch) and must share a dtype. Integer dtypes need an integral alpha
// and wrap on overflow.
uniopStatus uniopAddGetWorkspaceSize(const uniopTensor *a,
                                     const uniopTensor *b,
                                     const uniopScalar *alpha,
                                     uniopTensor *out,
                                     uint64_t *workspaceSize,
                                     uniopExecutor **executor);

// Phase 2 of `add`: launches the executor from `uniopAddGetWorkspaceSize` on `stream`.
uniopStatus uniopAdd(void *workspace,
                     uint64_t workspaceSize,
                     uniopExecutor *executor,
                     uniopStream stream);

// Phase 1 of `add_backward(Tensor dout, Tensor a, Tensor b, Scalar alpha=1, bool needs_da=True, bool needs_db=True) -> (Tensor da, Tensor db)`.
//
// Gradient of add: da = dout and db = alpha * dout, each summed over the dims its operand was
// broadcast along (so da has a's shape, db b's). A gradient whose needs_d<operand> is false comes
// back empty ([0]). Deterministic (no atomics).
uniopStatus uniopAddBackwardGetWorkspaceSize(const uniopTensor *dout,
                                             const uniopTensor *a,
                                             const uniopTensor *b,
                                             const uniopScalar *alpha,
                                             bool needs_da,
                                             bool needs_db,
                                             uniopTensor *da,
                                             uniopTensor *db,
                                             uint64_t *workspaceSize,
                                             uniopExecutor **executor);

// Phase 2 of `add_backward`: launches the executor from `uniopAddBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopAddBackward(void *workspace,
                             uint64_t workspaceSize,
                             uniopExecutor *executor,
                             uniopStream stream);

// Phase 1 of `add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps=1e-6) -> (Tensor y, Tensor rstd, Tensor sum)`.
//
// Fused residual add + RMSNorm (aclnn AddRmsNorm): sum = x + residual (rounded to the input
// dtype), y = rms_norm(sum, weight, eps), rstd as rms_norm returns it. x and residual share shape
// and dtype; weight as for rms_norm. The backward is add_rms_norm_backward (rms_norm's on sum,
// plus the gradient of sum itself, for both inputs).
uniopStatus uniopAddRmsNormGetWorkspaceSize(const uniopTensor *x,
                                            const uniopTensor *residual,
                                            const uniopTensor *weight,
                                            double eps,
                                            uniopTensor *y,
                                            uniopTensor *rstd,
                                            uniopTensor *sum,
                                            uint64_t *workspaceSize,
                                            uniopExecutor **executor);

// Phase 2 of `add_rms_norm`: launches the executor from `uniopAddRmsNormGetWorkspaceSize` on `stream`.
uniopStatus uniopAddRmsNorm(void *workspace,
                            uint64_t workspaceSize,
                            uniopExecutor *executor,
                            uniopStream stream);

// Phase 1 of `add_rms_norm_backward(Tensor dy, Tensor dsum, Tensor sum, Tensor weight, Tensor rstd, int batch_dims=0) -> (Tensor dx, Tensor dresidual, Tensor dweight)`.
//
// Gradients of add_rms_norm: dx = dresidual = rms_norm_backward's dx on sum + dsum, dweight as
// rms_norm_backward's (dtype of weight; per sample with batch_dims), from the upstream gradients
// dy and dsum and the rstd and sum the forward returned.
uniopStatus uniopAddRmsNormBackwardGetWorkspaceSize(const uniopTensor *dy,
                                                    const uniopTensor *dsum,
                                                    const uniopTensor *sum,
                                                    const uniopTensor *weight,
                                                    const uniopTensor *rstd,
                                                    int64_t batch_dims,
                                                    uniopTensor *dx,
                                                    uniopTensor *dresidual,
                                                    uniopTensor *dweight,
                                                    uint64_t *workspaceSize,
                                                    uniopExecutor **executor);

// Phase 2 of `add_rms_norm_backward`: launches the executor from `uniopAddRmsNormBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopAddRmsNormBackward(void *workspace,
                                    uint64_t workspaceSize,
                                    uniopExecutor *executor,
                                    uniopStream stream);

// Phase 1 of `argmax(Tensor x, int dim=-1, bool keepdim=False) -> (Tensor indices)`.
//
// int64 index of the maximum along dim (first on ties; a NaN counts as the maximum), as
// torch.argmax with a dim. keepdim keeps the reduced dim as size 1.
uniopStatus uniopArgmaxGetWorkspaceSize(const uniopTensor *x,
                                        int64_t dim,
                                        bool keepdim,
                                        uniopTensor *indices,
                                        uint64_t *workspaceSize,
                                        uniopExecutor **executor);

// Phase 2 of `argmax`: launches the executor from `uniopArgmaxGetWorkspaceSize` on `stream`.
uniopStatus uniopArgmax(void *workspace,
                        uint64_t workspaceSize,
                        uniopExecutor *executor,
                        uniopStream stream);

// Phase 1 of `attention(Tensor q, Tensor k, Tensor v, Tensor? kv_lens=None, bool causal=False, float? scale=None, Tensor? mask=None, float? softcap=None, Tensor? sinks=None) -> (Tensor out, Tensor lse)`.
//
// Scaled dot-product attention, flash-style (O(tile) memory, never the Sq x Sk scores). q [B, Hq,
// Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (any strides, dense last dim), B any number of
// leading batch dims (up to 4, as SDPA's [..., H, S, D]); Hkv divides Hq (GQA). kv_lens (int [B])
// limits each batch row to its first keys (KV-cache decode). causal aligns bottom-right: query i
// sees key j iff j <= i + len - Sq (torch is_causal when Sq == Sk). scale defaults to 1/sqrt(D).
// mask (broadcastable to [B, Hq, Sq, Sk], as SDPA's attn_mask: bool, true = attend; or
// float32/float16/bfloat16, added to the scaled scores; -inf and the dtype's lowest value,
// transformers 4.x's padding, hide) applies on top of kv_lens and causal (key tiles it hides from
// a whole query tile are skipped, and the keys up to the first one some query of a tile's product
// sees, in 32-key panels: a sliding window or a document mask costs the keys it shows); the K/V
// rows of hidden keys it does not skip must be finite. softcap (Gemma 2's attn_logit_softcapping)
// caps the scaled scores to softcap * tanh(score / softcap) before the mask adds. sinks (float
// [Hq], GPT-OSS's attention sinks) adds one logit per q head to each query's softmax, of a key
// with value 0. lse: float32 log-sum-exp of the (capped, masked) scaled scores and the sink per
// query (-inf, with out = 0, for a query that sees no key and has no sink).
uniopStatus uniopAttentionGetWorkspaceSize(const uniopTensor *q,
                                           const uniopTensor *k,
                                           const uniopTensor *v,
                                           const uniopTensor *kv_lens,
                                           bool causal,
                                           const double *scale,
                                           const uniopTensor *mask,
                                           const double *softcap,
                                           const uniopTensor *sinks,
                                           uniopTensor *out,
                                           uniopTensor *lse,
                                           uint64_t *workspaceSize,
                                           uniopExecutor **executor);

// Phase 2 of `attention`: launches the executor from `uniopAttentionGetWorkspaceSize` on `stream`.
uniopStatus uniopAttention(void *workspace,
                           uint64_t workspaceSize,
                           uniopExecutor *executor,
                           uniopStream stream);

// Phase 1 of `attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? kv_lens=None, bool causal=False, float? scale=None, Tensor? mask=None, bool needs_dmask=False, float? softcap=None, Tensor? sinks=None, int batch_dims=0) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dmask, Tensor dsinks)`.
//
// Gradients of attention from its saved out and lse (same mask, scale, softcap and sinks rules).
// dk/dv sum over the q heads of each kv-head group; keys past kv_lens get zero gradient. dmask is
// the gradient of a float mask (its shape and dtype: the score gradient summed over the dims the
// mask is broadcast along) when needs_dmask, else an empty tensor; asking for it adds two tile
// products to the five (about half the time again). dsinks is the gradient of sinks (their shape
// and dtype) when given, else an empty tensor. dmask and dsinks sum over every batch row, or per
// sample with batch_dims: then they are q.shape[:batch_dims] + their argument's shape (the mask
// must not reach into those dims). Deterministic (no atomics).
uniopStatus uniopAttentionBackwardGetWorkspaceSize(const uniopTensor *dout,
                                                   const uniopTensor *q,
                                                   const uniopTensor *k,
                                                   const uniopTensor *v,
                                                   const uniopTensor *out,
                                                   const uniopTensor *lse,
                                                   const uniopTensor *kv_lens,
                                                   bool causal,
                                                   const double *scale,
                                                   const uniopTensor *mask,
                                                   bool needs_dmask,
                                                   const double *softcap,
                                                   const uniopTensor *sinks,
                                                   int64_t batch_dims,
                                                   uniopTensor *dq,
                                                   uniopTensor *dk,
                                                   uniopTensor *dv,
                                                   uniopTensor *dmask,
                                                   uniopTensor *dsinks,
                                                   uint64_t *workspaceSize,
                                                   uniopExecutor **executor);

// Phase 2 of `attention_backward`: launches the executor from `uniopAttentionBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopAttentionBackward(void *workspace,
                                   uint64_t workspaceSize,
                                   uniopExecutor *executor,
                                   uniopStream stream);

// Phase 1 of `cast(Tensor x, ScalarType dtype) -> (Tensor y)`.
//
// Converts x to dtype (any pair of the 9 dtypes). Integers/bool to integers wrap (two's
// complement), floats to integers truncate toward zero and saturate (NaN -> 0), anything to bool
// is != 0, to floats rounds to nearest even.
uniopStatus uniopCastGetWorkspaceSize(const uniopTensor *x,
                                      uniopDataType dtype,
                                      uniopTensor *y,
                                      uint64_t *workspaceSize,
                                      uniopExecutor **executor);

// Phase 2 of `cast`: launches the executor from `uniopCastGetWorkspaceSize` on `stream`.
uniopStatus uniopCast(void *workspace,
                      uint64_t workspaceSize,
                      uniopExecutor *executor,
                      uniopStream stream);

// Phase 1 of `cast_backward(Tensor dy, Tensor x) -> (Tensor dx)`.
//
// Gradient of cast between float dtypes: dx = dy converted to x's dtype (rounding to nearest
// even). dy and x share a shape; both are float.
uniopStatus uniopCastBackwardGetWorkspaceSize(const uniopTensor *dy,
                                              const uniopTensor *x,
                                              uniopTensor *dx,
                                              uint64_t *workspaceSize,
                                              uniopExecutor **executor);

// Phase 2 of `cast_backward`: launches the executor from `uniopCastBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopCastBackward(void *workspace,
                              uint64_t workspaceSize,
                              uniopExecutor *executor,
                              uniopStream stream);

// Phase 1 of `cat(Tensor[] tensors, int dim=0) -> (Tensor out)`.
//
// Joins tensors along dim (negative counts from the end), as torch.cat: at least one tensor, all
// of one dtype and rank, equal sizes in every other dim; inputs may have any strides. Any dtype.
uniopStatus uniopCatGetWorkspaceSize(const uniopTensorList *tensors,
                                     int64_t dim,
                                     uniopTensor *out,
                                     uint64_t *workspaceSize,
                                     uniopExecutor **executor);

// Phase 2 of `cat`: launches the executor from `uniopCatGetWorkspaceSize` on `stream`.
uniopStatus uniopCat(void *workspace,
                     uint64_t workspaceSize,
                     uniopExecutor *executor,
                     uniopStream stream);

// Phase 1 of `cat_backward(Tensor dout, Tensor[] tensors, int dim=0) -> (Tensor[] dtensors)`.
//
// Gradient of cat: dout split along dim into one contiguous gradient per tensor of the join, sized
// as that tensor (tensors and dim as given to cat; only the tensors' shapes are read). dout may
// have any strides. Any dtype.
uniopStatus uniopCatBackwardGetWorkspaceSize(const uniopTensor *dout,
                                             const uniopTensorList *tensors,
                                             int64_t dim,
                                             const uniopTensorList *dtensors,
                                             uint64_t *workspaceSize,
                                             uniopExecutor **executor);

// Phase 2 of `cat_backward`: launches the executor from `uniopCatBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopCatBackward(void *workspace,
                             uint64_t workspaceSize,
                             uniopExecutor *executor,
                             uniopStream stream);

// Phase 1 of `causal_softmax(Tensor x) -> (Tensor y)`.
//
// Softmax over the last dim of x [..., Sq, Sk] with a causal mask aligned bottom-right: row i sees
// columns j <= i + Sk - Sq (torch is_causal when Sq == Sk); masked entries are 0, a row seeing
// nothing is all 0. Gradient: softmax_backward (dim -1).
uniopStatus uniopCausalSoftmaxGetWorkspaceSize(const uniopTensor *x,
                                               uniopTensor *y,
                                               uint64_t *workspaceSize,
                                               uniopExecutor **executor);

// Phase 2 of `causal_softmax`: launches the executor from `uniopCausalSoftmaxGetWorkspaceSize` on `stream`.
uniopStatus uniopCausalSoftmax(void *workspace,
                               uint64_t workspaceSize,
                               uniopExecutor *executor,
                               uniopStream stream);

// Phase 1 of `clamped_swiglu(Tensor x, float alpha=1.702, float limit=7.0, float up_shift=1.0, bool interleaved=True, bool limit_after_act=False) -> (Tensor out)`.
//
// A mixture-of-experts' clamped gated activation: the last dim of x (even size) holds gate and up
// values, interleaved (pairs 2i, 2i+1: GPT-OSS) or as its two halves (i, n/2 + i:
// interleaved=False, as DeepSeek V4 stores them); g = min(gate, limit), u = clamp(up, -limit,
// limit), out = (u + up_shift) * g * sigmoid(alpha * g), with the last dim halved. GPT-OSS's
// defaults; DeepSeek V4's silu(g) * u is alpha=1, up_shift=0. limit_after_act=True bounds the
// activation instead of the gate: out = (u + up_shift) * min(gate * sigmoid(alpha * gate), limit)
// (Step 3.7, Ling). limit >= 0 (inf: no clamp). f16/bf16 compute in float32.
uniopStatus uniopClampedSwigluGetWorkspaceSize(const uniopTensor *x,
                                               double alpha,
                                               double limit,
                                               double up_shift,
                                               bool interleaved,
                                               bool limit_after_act,
                                               uniopTensor *out,
                                               uint64_t *workspaceSize,
                                               uniopExecutor **executor);

// Phase 2 of `clamped_swiglu`: launches the executor from `uniopClampedSwigluGetWorkspaceSize` on `stream`.
uniopStatus uniopClampedSwiglu(void *workspace,
                               uint64_t workspaceSize,
                               uniopExecutor *executor,
                               uniopStream stream);

// Phase 1 of `clamped_swiglu_backward(Tensor dout, Tensor x, float alpha=1.702, float limit=7.0, float up_shift=1.0, bool interleaved=True, bool limit_after_act=False) -> (Tensor dx)`.
//
// Gradient of clamped_swiglu: d gate = dout * (u + up_shift) * s * (1 + alpha * g * (1 - s)) where
// gate < limit (limit_after_act: where g * s < limit), d up = dout * act where |up| < limit, act =
// g * s as the forward bounds it (0 where a clamp cut the value or left it on a bound, as torch's
// clamp), with s = sigmoid(alpha * g) on the clamped g, u; dx lays them out as x (interleaved or
// halves). dout has clamped_swiglu's output shape.
uniopStatus uniopClampedSwigluBackwardGetWorkspaceSize(const uniopTensor *dout,
                                                       const uniopTensor *x,
                                                       double alpha,
                                                       double limit,
                                                       double up_shift,
                                                       bool interleaved,
                                                       bool limit_after_act,
                                                       uniopTensor *dx,
                                                       uint64_t *workspaceSize,
                                                       uniopExecutor **executor);

// Phase 2 of `clamped_swiglu_backward`: launches the executor from `uniopClampedSwigluBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopClampedSwigluBackward(void *workspace,
                                       uint64_t workspaceSize,
                                       uniopExecutor *executor,
                                       uniopStream stream);

// Phase 1 of `cross_entropy(Tensor logits, Tensor target, int ignore_index=-100, int batch_dims=0) -> (Tensor loss, Tensor lse)`.
//
// Mean cross-entropy of logits [..., C] against int targets [...], skipping targets equal to
// ignore_index (torch.nn.functional.cross_entropy, reduction='mean'). Returns the float32 scalar
// loss and the per-row float32 log-sum-exp for cross_entropy_backward. With batch_dims, one mean
// per sample: the loss is logits.shape[:batch_dims].
uniopStatus uniopCrossEntropyGetWorkspaceSize(const uniopTensor *logits,
                                              const uniopTensor *target,
                                              int64_t ignore_index,
                                              int64_t batch_dims,
                                              uniopTensor *loss,
                                              uniopTensor *lse,
                                              uint64_t *workspaceSize,
                                              uniopExecutor **executor);

// Phase 2 of `cross_entropy`: launches the executor from `uniopCrossEntropyGetWorkspaceSize` on `stream`.
uniopStatus uniopCrossEntropy(void *workspace,
                              uint64_t workspaceSize,
                              uniopExecutor *executor,
                              uniopStream stream);

// Phase 1 of `cross_entropy_backward(Tensor dloss, Tensor logits, Tensor target, Tensor lse, int ignore_index=-100, int batch_dims=0) -> (Tensor dlogits)`.
//
// Gradient of cross_entropy (mean): dlogits = dloss / n * (softmax(logits) - onehot(target)) on
// counted rows, 0 on ignored rows. dloss is the float32 scalar upstream gradient (one per sample
// with batch_dims, then n counts the sample's rows); lse is cross_entropy's second output.
uniopStatus uniopCrossEntropyBackwardGetWorkspaceSize(const uniopTensor *dloss,
                                                      const uniopTensor *logits,
                                                      const uniopTensor *target,
                                                      const uniopTensor *lse,
                                                      int64_t ignore_index,
                                                      int64_t batch_dims,
                                                      uniopTensor *dlogits,
                                                      uint64_t *workspaceSize,
                                                      uniopExecutor **executor);

// Phase 2 of `cross_entropy_backward`: launches the executor from `uniopCrossEntropyBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopCrossEntropyBackward(void *workspace,
                                      uint64_t workspaceSize,
                                      uniopExecutor *executor,
                                      uniopStream stream);

// Phase 1 of `embedding(Tensor weight, Tensor indices, int padding_idx=-1) -> (Tensor out)`.
//
// Gathers rows of weight [V, H] by int32/int64 indices of any shape: out[..., :] =
// weight[indices[...], :]. An out-of-range index fails the launch with a runtime error.
// padding_idx (-1 = none) matters for the backward only.
uniopStatus uniopEmbeddingGetWorkspaceSize(const uniopTensor *weight,
                                           const uniopTensor *indices,
                                           int64_t padding_idx,
                                           uniopTensor *out,
                                           uint64_t *workspaceSize,
                                           uniopExecutor **executor);

// Phase 2 of `embedding`: launches the executor from `uniopEmbeddingGetWorkspaceSize` on `stream`.
uniopStatus uniopEmbedding(void *workspace,
                           uint64_t workspaceSize,
                           uniopExecutor *executor,
                           uniopStream stream);

// Phase 1 of `embedding_backward(Tensor dout, Tensor indices, Tensor weight, int padding_idx=-1, int batch_dims=0) -> (Tensor dweight)`.
//
// Gradient of embedding: dweight[v] = sum of dout rows whose index is v (0 for padding_idx and
// unused rows). dout has shape [*indices.shape, H]; weight (the forward's table, [V, H]) gives the
// shape of dweight and is not read. With batch_dims, one table gradient per sample:
// indices.shape[:batch_dims] + [V, H]. Deterministic: contributions are summed in token order in
// float32.
uniopStatus uniopEmbeddingBackwardGetWorkspaceSize(const uniopTensor *dout,
                                                   const uniopTensor *indices,
                                                   const uniopTensor *weight,
                                                   int64_t padding_idx,
                                                   int64_t batch_dims,
                                                   uniopTensor *dweight,
                                                   uint64_t *workspaceSize,
                                                   uniopExecutor **executor);

// Phase 2 of `embedding_backward`: launches the executor from `uniopEmbeddingBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopEmbeddingBackward(void *workspace,
                                   uint64_t workspaceSize,
                                   uniopExecutor *executor,
                                   uniopStream stream);

// Phase 1 of `geglu(Tensor x, int dim=-1, str approximate='none', bool activate_left=False) -> (Tensor out)`.
//
// GeGLU with aclnn semantics: x splits into halves a, b along dim (size must be even); out = a *
// gelu(b), or gelu(a) * b when activate_left, with dim halved. approximate 'none' or 'tanh' as
// torch.nn.functional.gelu's. f16/bf16 compute in float32.
uniopStatus uniopGegluGetWorkspaceSize(const uniopTensor *x,
                                       int64_t dim,
                                       const char *approximate,
                                       bool activate_left,
                                       uniopTensor *out,
                                       uint64_t *workspaceSize,
                                       uniopExecutor **executor);

// Phase 2 of `geglu`: launches the executor from `uniopGegluGetWorkspaceSize` on `stream`.
uniopStatus uniopGeglu(void *workspace,
                       uint64_t workspaceSize,
                       uniopExecutor *executor,
                       uniopStream stream);

// Phase 1 of `geglu_backward(Tensor dout, Tensor x, int dim=-1, str approximate='none', bool activate_left=False) -> (Tensor dx)`.
//
// Gradient of geglu: dx holds d/db = dout * a * gelu'(b) in its second half along dim and d/da =
// dout * gelu(b) in its first (the halves' roles swapped when activate_left). dout has geglu's
// output shape.
uniopStatus uniopGegluBackwardGetWorkspaceSize(const uniopTensor *dout,
                                               const uniopTensor *x,
                                               int64_t dim,
                                               const char *approximate,
                                               bool activate_left,
                                               uniopTensor *dx,
                                               uint64_t *workspaceSize,
                                               uniopExecutor **executor);

// Phase 2 of `geglu_backward`: launches the executor from `uniopGegluBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopGegluBackward(void *workspace,
                               uint64_t workspaceSize,
                               uniopExecutor *executor,
                               uniopStream stream);

// Phase 1 of `gelu(Tensor x, str approximate='none') -> (Tensor y)`.
//
// Elementwise x * Phi(x) (approximate='none', erf form) or 0.5x(1 + tanh(sqrt(2/pi)(x +
// 0.044715x^3))) (approximate='tanh'), as torch.nn.functional.gelu. Any shape and strides.
uniopStatus uniopGeluGetWorkspaceSize(const uniopTensor *x,
                                      const char *approximate,
                                      uniopTensor *y,
                                      uint64_t *workspaceSize,
                                      uniopExecutor **executor);

// Phase 2 of `gelu`: launches the executor from `uniopGeluGetWorkspaceSize` on `stream`.
uniopStatus uniopGelu(void *workspace,
                      uint64_t workspaceSize,
                      uniopExecutor *executor,
                      uniopStream stream);

// Phase 1 of `gelu_backward(Tensor dy, Tensor x, str approximate='none') -> (Tensor dx)`.
//
// Gradient of gelu: dx = dy * gelu'(x) for the same approximate form. dy and x share shape and
// dtype.
uniopStatus uniopGeluBackwardGetWorkspaceSize(const uniopTensor *dy,
                                              const uniopTensor *x,
                                              const char *approximate,
                                              uniopTensor *dx,
                                              uint64_t *workspaceSize,
                                              uniopExecutor **executor);

// Phase 2 of `gelu_backward`: launches the executor from `uniopGeluBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopGeluBackward(void *workspace,
                              uint64_t workspaceSize,
                              uniopExecutor *executor,
                              uniopStream stream);

// Phase 1 of `gelu_mul(Tensor gate, Tensor up, str approximate='none') -> (Tensor out)`.
//
// gelu(gate, approximate) * up elementwise (HF GemmaMLP's act_fn(gate_proj(x)) * up_proj(x);
// approximate 'none' or 'tanh' as torch.nn.functional.gelu's, Gemma's gelu_pytorch_tanh is
// 'tanh'). gate and up share shape and dtype; any strides. f16/bf16 compute in float32.
uniopStatus uniopGeluMulGetWorkspaceSize(const uniopTensor *gate,
                                         const uniopTensor *up,
                                         const char *approximate,
                                         uniopTensor *out,
                                         uint64_t *workspaceSize,
                                         uniopExecutor **executor);

// Phase 2 of `gelu_mul`: launches the executor from `uniopGeluMulGetWorkspaceSize` on `stream`.
uniopStatus uniopGeluMul(void *workspace,
                         uint64_t workspaceSize,
                         uniopExecutor *executor,
                         uniopStream stream);

// Phase 1 of `gelu_mul_backward(Tensor dout, Tensor gate, Tensor up, str approximate='none') -> (Tensor dgate, Tensor dup)`.
//
// Gradients of gelu_mul for the upstream gradient dout: dgate = dout * up * gelu'(gate), dup =
// dout * gelu(gate), for the same approximate form. All three inputs share shape and dtype.
uniopStatus uniopGeluMulBackwardGetWorkspaceSize(const uniopTensor *dout,
                                                 const uniopTensor *gate,
                                                 const uniopTensor *up,
                                                 const char *approximate,
                                                 uniopTensor *dgate,
                                                 uniopTensor *dup,
                                                 uint64_t *workspaceSize,
                                                 uniopExecutor **executor);

// Phase 2 of `gelu_mul_backward`: launches the executor from `uniopGeluMulBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopGeluMulBackward(void *workspace,
                                 uint64_t workspaceSize,
                                 uniopExecutor *executor,
                                 uniopStream stream);

// Phase 1 of `kv_cache_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor positions) -> ()`.
//
// In place: k_cache[b, :, positions[b] + t] = k[b, :, t] (and v likewise) for caches [B, Hkv,
// S_max, D] and new rows [B, Hkv, S_new, D], any strides; positions int32/int64 [B]. After it,
// sequence b's cache length (attention's kv_lens) is positions[b] + S_new. A position that does
// not fit fails the launch with a runtime error before any row is written.
// float32/float16/bfloat16/int8.
uniopStatus uniopKvCacheAppendGetWorkspaceSize(uniopTensor *k_cache,
                                               uniopTensor *v_cache,
                                               const uniopTensor *k,
                                               const uniopTensor *v,
                                               const uniopTensor *positions,
                                               uint64_t *workspaceSize,
                                               uniopExecutor **executor);

// Phase 2 of `kv_cache_append`: launches the executor from `uniopKvCacheAppendGetWorkspaceSize` on `stream`.
uniopStatus uniopKvCacheAppend(void *workspace,
                               uint64_t workspaceSize,
                               uniopExecutor *executor,
                               uniopStream stream);

// Phase 1 of `layer_norm(Tensor x, Tensor weight, Tensor? bias=None, float eps=1e-5) -> (Tensor y, Tensor mean, Tensor rstd)`.
//
// Layer normalization (torch.nn.functional.layer_norm): y = (x - mean) / sqrt(var + eps) * weight,
// plus bias, over the trailing dims matching weight's shape, var biased (divided by n). mean and
// rstd (float32, normalized dims kept as 1) are returned for the backward. weight: same dtype as
// x, or float32; bias (optional): weight's shape and dtype. f16/bf16 accumulate in float32; the
// variance is summed around the mean (a second pass over the row in cache), so a large common
// offset costs no precision.
uniopStatus uniopLayerNormGetWorkspaceSize(const uniopTensor *x,
                                           const uniopTensor *weight,
                                           const uniopTensor *bias,
                                           double eps,
                                           uniopTensor *y,
                                           uniopTensor *mean,
                                           uniopTensor *rstd,
                                           uint64_t *workspaceSize,
                                           uniopExecutor **executor);

// Phase 2 of `layer_norm`: launches the executor from `uniopLayerNormGetWorkspaceSize` on `stream`.
uniopStatus uniopLayerNorm(void *workspace,
                           uint64_t workspaceSize,
                           uniopExecutor *executor,
                           uniopStream stream);

// Phase 1 of `layer_norm_backward(Tensor dy, Tensor x, Tensor weight, Tensor mean, Tensor rstd, int batch_dims=0) -> (Tensor dx, Tensor dweight, Tensor dbias)`.
//
// Gradients of layer_norm: dx (dtype of x), dweight and dbias (dtype of weight; dbias = dy summed
// over rows, to ignore when the layer has no bias), from the upstream gradient dy and the mean and
// rstd saved by the forward. dweight and dbias sum over all rows, or per sample with batch_dims:
// then they are x.shape[:batch_dims] + weight's shape. Deterministic: the dweight and dbias
// partials are per block, summed in a fixed order.
uniopStatus uniopLayerNormBackwardGetWorkspaceSize(const uniopTensor *dy,
                                                   const uniopTensor *x,
                                                   const uniopTensor *weight,
                                                   const uniopTensor *mean,
                                                   const uniopTensor *rstd,
                                                   int64_t batch_dims,
                                                   uniopTensor *dx,
                                                   uniopTensor *dweight,
                                                   uniopTensor *dbias,
                                                   uint64_t *workspaceSize,
                                                   uniopExecutor **executor);

// Phase 2 of `layer_norm_backward`: launches the executor from `uniopLayerNormBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopLayerNormBackward(void *workspace,
                                   uint64_t workspaceSize,
                                   uniopExecutor *executor,
                                   uniopStream stream);

// Phase 1 of `linear(Tensor x, Tensor weight, Tensor? bias=None) -> (Tensor y)`.
//
// y = x @ weight^T + bias, weight [out_features, in_features] (torch.nn.functional.linear / HF
// layout); x [..., in_features]; bias optional [out_features]. bfloat16 via uniop's packed GEMM
// (AVX512-BF16, AMX tiles, or FMAs on widened pairs; float32 sums); float32 via it too on
// AVX-512/AVX2 CPUs (64 rows or more, in_features up to 2048), else via the gemm crate, as
// float16; few rows run as dot products.
uniopStatus uniopLinearGetWorkspaceSize(const uniopTensor *x,
                                        const uniopTensor *weight,
                                        const uniopTensor *bias,
                                        uniopTensor *y,
                                        uint64_t *workspaceSize,
                                        uniopExecutor **executor);

// Phase 2 of `linear`: launches the executor from `uniopLinearGetWorkspaceSize` on `stream`.
uniopStatus uniopLinear(void *workspace,
                        uint64_t workspaceSize,
                        uniopExecutor *executor,
                        uniopStream stream);

// Phase 1 of `linear_add(Tensor x, Tensor weight, Tensor residual) -> (Tensor y)`.
//
// y = residual + x @ weight^T, weight [out_features, in_features] (HF layout), x [...,
// in_features], residual [..., out_features] (x's leading dims): a projection joining the residual
// stream (HF Llama's `residual + down_proj(h)`) in one pass, the sum rounded once.
uniopStatus uniopLinearAddGetWorkspaceSize(const uniopTensor *x,
                                           const uniopTensor *weight,
                                           const uniopTensor *residual,
                                           uniopTensor *y,
                                           uint64_t *workspaceSize,
                                           uniopExecutor **executor);

// Phase 2 of `linear_add`: launches the executor from `uniopLinearAddGetWorkspaceSize` on `stream`.
uniopStatus uniopLinearAdd(void *workspace,
                           uint64_t workspaceSize,
                           uniopExecutor *executor,
                           uniopStream stream);

// Phase 1 of `linear_add_backward(Tensor dy, Tensor x, Tensor weight, int batch_dims=0, bool needs_dx=True, bool needs_dweight=True) -> (Tensor dx, Tensor dweight, Tensor dresidual)`.
//
// Gradients of linear_add: dx = dy @ weight, dweight = dy^T @ x (summed over all leading dims of
// x; per sample with batch_dims: x.shape[:batch_dims] + [out_features, in_features]), dresidual =
// dy. needs_dx=False leaves dx out (returned empty, [0]), needs_dweight=False dweight.
uniopStatus uniopLinearAddBackwardGetWorkspaceSize(const uniopTensor *dy,
                                                   const uniopTensor *x,
                                                   const uniopTensor *weight,
                                                   int64_t batch_dims,
                                                   bool needs_dx,
                                                   bool needs_dweight,
                                                   uniopTensor *dx,
                                                   uniopTensor *dweight,
                                                   uniopTensor *dresidual,
                                                   uint64_t *workspaceSize,
                                                   uniopExecutor **executor);

// Phase 2 of `linear_add_backward`: launches the executor from `uniopLinearAddBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopLinearAddBackward(void *workspace,
                                   uint64_t workspaceSize,
                                   uniopExecutor *executor,
                                   uniopStream stream);

// Phase 1 of `linear_add_packed(Tensor x, Tensor packed_weight, int out_features, Tensor residual) -> (Tensor y)`.
//
// linear_add with its weight packed ahead: y = residual + x @ weight^T for packed_weight =
// pack_weight(weight), weight [out_features, in_features]; x [..., in_features], residual [...,
// out_features]. bfloat16 and float32, for prefill-sized x.
uniopStatus uniopLinearAddPackedGetWorkspaceSize(const uniopTensor *x,
                                                 const uniopTensor *packed_weight,
                                                 int64_t out_features,
                                                 const uniopTensor *residual,
                                                 uniopTensor *y,
                                                 uint64_t *workspaceSize,
                                                 uniopExecutor **executor);

// Phase 2 of `linear_add_packed`: launches the executor from `uniopLinearAddPackedGetWorkspaceSize` on `stream`.
uniopStatus uniopLinearAddPacked(void *workspace,
                                 uint64_t workspaceSize,
                                 uniopExecutor *executor,
                                 uniopStream stream);

// Phase 1 of `linear_backward(Tensor dy, Tensor x, Tensor weight, int batch_dims=0, bool needs_dx=True, bool needs_dweight=True) -> (Tensor dx, Tensor dweight, Tensor dbias)`.
//
// Gradients of linear: dx = dy @ weight, dweight = dy^T @ x (summed over all leading dims of x),
// dbias = dy summed over rows (ignore it when the layer has no bias). With batch_dims, dweight and
// dbias are per sample: x.shape[:batch_dims] + their shape. needs_dx=False leaves dx out (returned
// empty, [0]), needs_dweight=False dweight (a frozen weight): each half of the work.
uniopStatus uniopLinearBackwardGetWorkspaceSize(const uniopTensor *dy,
                                                const uniopTensor *x,
                                                const uniopTensor *weight,
                                                int64_t batch_dims,
                                                bool needs_dx,
                                                bool needs_dweight,
                                                uniopTensor *dx,
                                                uniopTensor *dweight,
                                                uniopTensor *dbias,
                                                uint64_t *workspaceSize,
                                                uniopExecutor **executor);

// Phase 2 of `linear_backward`: launches the executor from `uniopLinearBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopLinearBackward(void *workspace,
                                uint64_t workspaceSize,
                                uniopExecutor *executor,
                                uniopStream stream);

// Phase 1 of `linear_gelu_mul(Tensor x, Tensor gate_weight, Tensor up_weight, str approximate='none') -> (Tensor y)`.
//
// y = gelu(x @ gate_weight^T, approximate) * (x @ up_weight^T): HF GemmaMLP's act_fn(gate_proj(x)) *
// up_proj(x) in one op (no biases; Gemma's gelu_pytorch_tanh is approximate='tanh'), as
// linear_silu_mul with GELU: weights [intermediate_size, hidden_size], x [..., hidden_size], both
// products as one GEMM. linear_gelu_mul_train returns the products for the backward.
uniopStatus uniopLinearGeluMulGetWorkspaceSize(const uniopTensor *x,
                                               const uniopTensor *gate_weight,
                                               const uniopTensor *up_weight,
                                               const char *approximate,
                                               uniopTensor *y,
                                               uint64_t *workspaceSize,
                                               uniopExecutor **executor);

// Phase 2 of `linear_gelu_mul`: launches the executor from `uniopLinearGeluMulGetWorkspaceSize` on `stream`.
uniopStatus uniopLinearGeluMul(void *workspace,
                               uint64_t workspaceSize,
                               uniopExecutor *executor,
                               uniopStream stream);

// Phase 1 of `linear_gelu_mul_backward(Tensor dy, Tensor x, Tensor gate_weight, Tensor up_weight, Tensor? gate=None, Tensor? up=None, str approximate='none', int batch_dims=0, bool needs_dx=True, bool needs_dgate_weight=True, bool needs_dup_weight=True) -> (Tensor dx, Tensor dgate_weight, Tensor dup_weight)`.
//
// Gradients of linear_gelu_mul (and linear_gelu_mul_train), as linear_silu_mul_backward's with
// gelu(g, approximate) for silu(g): dg = dy * u * gelu'(g), du = dy * gelu(g); dx = dg @
// gate_weight + du @ up_weight, dgate_weight = dg^T @ x, dup_weight = du^T @ x (per sample with
// batch_dims; each left out, returned empty, when its needs_ flag is False).
uniopStatus uniopLinearGeluMulBackwardGetWorkspaceSize(const uniopTensor *dy,
                                                       const uniopTensor *x,
                                                       const uniopTensor *gate_weight,
                                                       const uniopTensor *up_weight,
                                                       const uniopTensor *gate,
                                                       const uniopTensor *up,
                                                       const char *approximate,
                                                       int64_t batch_dims,
                                                       bool needs_dx,
                                                       bool needs_dgate_weight,
                                                       bool needs_dup_weight,
                                                       uniopTensor *dx,
                                                       uniopTensor *dgate_weight,
                                                       uniopTensor *dup_weight,
                                                       uint64_t *workspaceSize,
                                                       uniopExecutor **executor);

// Phase 2 of `linear_gelu_mul_backward`: launches the executor from `uniopLinearGeluMulBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopLinearGeluMulBackward(void *workspace,
                                       uint64_t workspaceSize,
                                       uniopExecutor *executor,
                                       uniopStream stream);

// Phase 1 of `linear_gelu_mul_packed(Tensor x, Tensor packed_weight, int out_features, str approximate='none') -> (Tensor y)`.
//
// linear_gelu_mul with its weights packed ahead: y = gelu(x @ gate_weight^T, approximate) * (x @
// up_weight^T) for packed_weight = pack_weight(gate_weight, up_weight), out_features =
// intermediate_size. bfloat16 and float32, for prefill-sized x.
uniopStatus uniopLinearGeluMulPackedGetWorkspaceSize(const uniopTensor *x,
                                                     const uniopTensor *packed_weight,
                                                     int64_t out_features,
                                                     const char *approximate,
                                                     uniopTensor *y,
                                                     uint64_t *workspaceSize,
                                                     uniopExecutor **executor);

// Phase 2 of `linear_gelu_mul_packed`: launches the executor from `uniopLinearGeluMulPackedGetWorkspaceSize` on `stream`.
uniopStatus uniopLinearGeluMulPacked(void *workspace,
                                     uint64_t workspaceSize,
                                     uniopExecutor *executor,
                                     uniopStream stream);

// Phase 1 of `linear_gelu_mul_train(Tensor x, Tensor gate_weight, Tensor up_weight, str approximate='none') -> (Tensor y, Tensor gate, Tensor up)`.
//
// linear_gelu_mul for training: y as linear_gelu_mul's, plus the products gate = x @ gate_weight^T
// and up = x @ up_weight^T (rounded to x's dtype; not differentiable), which
// linear_gelu_mul_backward takes instead of recomputing them.
uniopStatus uniopLinearGeluMulTrainGetWorkspaceSize(const uniopTensor *x,
                                                    const uniopTensor *gate_weight,
                                                    const uniopTensor *up_weight,
                                                    const char *approximate,
                                                    uniopTensor *y,
                                                    uniopTensor *gate,
                                                    uniopTensor *up,
                                                    uint64_t *workspaceSize,
                                                    uniopExecutor **executor);

// Phase 2 of `linear_gelu_mul_train`: launches the executor from `uniopLinearGeluMulTrainGetWorkspaceSize` on `stream`.
uniopStatus uniopLinearGeluMulTrain(void *workspace,
                                    uint64_t workspaceSize,
                                    uniopExecutor *executor,
                                    uniopStream stream);

// Phase 1 of `linear_int8(Tensor x, Tensor weight, Tensor scales, Tensor? bias=None) -> (Tensor y)`.
//
// y = x @ (weight * scales[:, None])^T + bias: a linear layer with an int8 weight [out_features,
// in_features] quantized per output feature (weight-only int8, as torchao's int8_weight_only and
// torch.ops.aten._weight_int8pack_mm). x [..., in_features] float32/float16/bfloat16; scales
// [out_features] of x's dtype or float32; bias optional [out_features] of x's dtype. Up to 32 rows
// (decode) run as dot products that widen the weight as they read it (float32 sums; half a bf16
// weight's bytes); more rows dequantize chunks of the weight to x's dtype and run linear's GEMM.
uniopStatus uniopLinearInt8GetWorkspaceSize(const uniopTensor *x,
                                            const uniopTensor *weight,
                                            const uniopTensor *scales,
                                            const uniopTensor *bias,
                                            uniopTensor *y,
                                            uint64_t *workspaceSize,
                                            uniopExecutor **executor);

// Phase 2 of `linear_int8`: launches the executor from `uniopLinearInt8GetWorkspaceSize` on `stream`.
uniopStatus uniopLinearInt8(void *workspace,
                            uint64_t workspaceSize,
                            uniopExecutor *executor,
                            uniopStream stream);

// Phase 1 of `linear_int8_backward(Tensor dy, Tensor x, Tensor weight, Tensor scales, int batch_dims=0, bool needs_dx=True, bool needs_dscales=True) -> (Tensor dx, Tensor dscales, Tensor dbias)`.
//
// Gradients of linear_int8 (the int8 weight is frozen: it has none): dx = dy @ (weight * scales[:,
// None]), dscales[j] = sum over rows of dy[:, j] * (x @ weight[j]), dbias = dy summed over rows
// (ignore it when the layer has no bias). With batch_dims, dscales and dbias are per sample:
// x.shape[:batch_dims] + [out_features]. needs_dx=False leaves dx out, needs_dscales=False dscales
// (frozen scales: it costs the forward's products again); each comes back empty, [0].
uniopStatus uniopLinearInt8BackwardGetWorkspaceSize(const uniopTensor *dy,
                                                    const uniopTensor *x,
                                                    const uniopTensor *weight,
                                                    const uniopTensor *scales,
                                                    int64_t batch_dims,
                                                    bool needs_dx,
                                                    bool needs_dscales,
                                                    uniopTensor *dx,
                                                    uniopTensor *dscales,
                                                    uniopTensor *dbias,
                                                    uint64_t *workspaceSize,
                                                    uniopExecutor **executor);

// Phase 2 of `linear_int8_backward`: launches the executor from `uniopLinearInt8BackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopLinearInt8Backward(void *workspace,
                                    uint64_t workspaceSize,
                                    uniopExecutor *executor,
                                    uniopStream stream);

// Phase 1 of `linear_packed(Tensor x, Tensor packed_weight, int out_features, Tensor? bias=None) -> (Tensor y)`.
//
// linear with its weight packed ahead: y = x @ weight^T + bias for packed_weight =
// pack_weight(weight), weight [out_features, in_features]; x [..., in_features]; bias optional
// [out_features]. bfloat16 and float32, for prefill-sized x (few rows are faster through linear).
uniopStatus uniopLinearPackedGetWorkspaceSize(const uniopTensor *x,
                                              const uniopTensor *packed_weight,
                                              int64_t out_features,
                                              const uniopTensor *bias,
                                              uniopTensor *y,
                                              uint64_t *workspaceSize,
                                              uniopExecutor **executor);

// Phase 2 of `linear_packed`: launches the executor from `uniopLinearPackedGetWorkspaceSize` on `stream`.
uniopStatus uniopLinearPacked(void *workspace,
                              uint64_t workspaceSize,
                              uniopExecutor *executor,
                              uniopStream stream);

// Phase 1 of `linear_silu_mul(Tensor x, Tensor gate_weight, Tensor up_weight) -> (Tensor y)`.
//
// y = silu(x @ gate_weight^T) * (x @ up_weight^T): HF LlamaMLP's act_fn(gate_proj(x)) * up_proj(x)
// in one op (no biases). Weights [intermediate_size, hidden_size] (HF layout), x [...,
// hidden_size]. Both products run as one GEMM (x packed once, f32 sums, silu*mul applied before
// the single rounding). Under autograd its backward recomputes the products; linear_silu_mul_train
// returns them instead.
uniopStatus uniopLinearSiluMulGetWorkspaceSize(const uniopTensor *x,
                                               const uniopTensor *gate_weight,
                                               const uniopTensor *up_weight,
                                               uniopTensor *y,
                                               uint64_t *workspaceSize,
                                               uniopExecutor **executor);

// Phase 2 of `linear_silu_mul`: launches the executor from `uniopLinearSiluMulGetWorkspaceSize` on `stream`.
uniopStatus uniopLinearSiluMul(void *workspace,
                               uint64_t workspaceSize,
                               uniopExecutor *executor,
                               uniopStream stream);

// Phase 1 of `linear_silu_mul_backward(Tensor dy, Tensor x, Tensor gate_weight, Tensor up_weight, Tensor? gate=None, Tensor? up=None, int batch_dims=0, bool needs_dx=True, bool needs_dgate_weight=True, bool needs_dup_weight=True) -> (Tensor dx, Tensor dgate_weight, Tensor dup_weight)`.
//
// Gradients of linear_silu_mul (and linear_silu_mul_train): with g = x @ gate_weight^T, u = x @
// up_weight^T (given as gate and up, both or neither, else recomputed), dg = dy * u * silu'(g), du
// = dy * silu(g); dx = dg @ gate_weight + du @ up_weight, dgate_weight = dg^T @ x, dup_weight =
// du^T @ x (summed over all leading dims of x; with batch_dims, per sample: x.shape[:batch_dims] +
// the weight's shape). needs_dx / needs_dgate_weight / needs_dup_weight=False leave that gradient
// out (returned empty, [0]): frozen weights save two of the products.
uniopStatus uniopLinearSiluMulBackwardGetWorkspaceSize(const uniopTensor *dy,
                                                       const uniopTensor *x,
                                                       const uniopTensor *gate_weight,
                                                       const uniopTensor *up_weight,
                                                       const uniopTensor *gate,
                                                       const uniopTensor *up,
                                                       int64_t batch_dims,
                                                       bool needs_dx,
                                                       bool needs_dgate_weight,
                                                       bool needs_dup_weight,
                                                       uniopTensor *dx,
                                                       uniopTensor *dgate_weight,
                                                       uniopTensor *dup_weight,
                                                       uint64_t *workspaceSize,
                                                       uniopExecutor **executor);

// Phase 2 of `linear_silu_mul_backward`: launches the executor from `uniopLinearSiluMulBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopLinearSiluMulBackward(void *workspace,
                                       uint64_t workspaceSize,
                                       uniopExecutor *executor,
                                       uniopStream stream);

// Phase 1 of `linear_silu_mul_packed(Tensor x, Tensor packed_weight, int out_features) -> (Tensor y)`.
//
// linear_silu_mul with its weights packed ahead: y = silu(x @ gate_weight^T) * (x @ up_weight^T)
// for packed_weight = pack_weight(gate_weight, up_weight), out_features = intermediate_size.
// bfloat16 and float32, for prefill-sized x (few rows are faster through linear_silu_mul).
uniopStatus uniopLinearSiluMulPackedGetWorkspaceSize(const uniopTensor *x,
                                                     const uniopTensor *packed_weight,
                                                     int64_t out_features,
                                                     uniopTensor *y,
                                                     uint64_t *workspaceSize,
                                                     uniopExecutor **executor);

// Phase 2 of `linear_silu_mul_packed`: launches the executor from `uniopLinearSiluMulPackedGetWorkspaceSize` on `stream`.
uniopStatus uniopLinearSiluMulPacked(void *workspace,
                                     uint64_t workspaceSize,
                                     uniopExecutor *executor,
                                     uniopStream stream);

// Phase 1 of `linear_silu_mul_train(Tensor x, Tensor gate_weight, Tensor up_weight) -> (Tensor y, Tensor gate, Tensor up)`.
//
// linear_silu_mul for training: y as linear_silu_mul's, plus the products gate = x @ gate_weight^T
// and up = x @ up_weight^T (rounded to x's dtype; not differentiable), which
// linear_silu_mul_backward takes instead of recomputing them: four products in the backward
// instead of six, for two [..., intermediate_size] tensors kept in between.
uniopStatus uniopLinearSiluMulTrainGetWorkspaceSize(const uniopTensor *x,
                                                    const uniopTensor *gate_weight,
                                                    const uniopTensor *up_weight,
                                                    uniopTensor *y,
                                                    uniopTensor *gate,
                                                    uniopTensor *up,
                                                    uint64_t *workspaceSize,
                                                    uniopExecutor **executor);

// Phase 2 of `linear_silu_mul_train`: launches the executor from `uniopLinearSiluMulTrainGetWorkspaceSize` on `stream`.
uniopStatus uniopLinearSiluMulTrain(void *workspace,
                                    uint64_t workspaceSize,
                                    uniopExecutor *executor,
                                    uniopStream stream);

// Phase 1 of `log_softmax(Tensor x, int dim=-1) -> (Tensor y)`.
//
// x - max - log(sum(exp(x - max))) along dim, as torch.log_softmax. Any dim; f16/bf16 compute in
// float32.
uniopStatus uniopLogSoftmaxGetWorkspaceSize(const uniopTensor *x,
                                            int64_t dim,
                                            uniopTensor *y,
                                            uint64_t *workspaceSize,
                                            uniopExecutor **executor);

// Phase 2 of `log_softmax`: launches the executor from `uniopLogSoftmaxGetWorkspaceSize` on `stream`.
uniopStatus uniopLogSoftmax(void *workspace,
                            uint64_t workspaceSize,
                            uniopExecutor *executor,
                            uniopStream stream);

// Phase 1 of `log_softmax_backward(Tensor dy, Tensor y, int dim=-1) -> (Tensor dx)`.
//
// Gradient of log_softmax from its output y: dx = dy - exp(y) * sum(dy) along dim.
uniopStatus uniopLogSoftmaxBackwardGetWorkspaceSize(const uniopTensor *dy,
                                                    const uniopTensor *y,
                                                    int64_t dim,
                                                    uniopTensor *dx,
                                                    uint64_t *workspaceSize,
                                                    uniopExecutor **executor);

// Phase 2 of `log_softmax_backward`: launches the executor from `uniopLogSoftmaxBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopLogSoftmaxBackward(void *workspace,
                                    uint64_t workspaceSize,
                                    uniopExecutor *executor,
                                    uniopStream stream);

// Phase 1 of `matmul(Tensor a, Tensor b) -> (Tensor out)`.
//
// Batched matrix product a [..., M, K] x b [..., K, N] -> [..., M, N]; batch dims broadcast
// (torch.matmul for rank >= 2); any strides, so transposed operands cost nothing. float32 via the
// gemm crate, float32 with b dense along K via uniop's packed GEMM on AVX-512/AVX2 CPUs, float16
// on the float32 kernels (operands widened, sums rounded once), bfloat16 via uniop's packed GEMM
// (AVX512-BF16, AMX tiles, or FMAs on widened pairs; float32 sums), inside uniop's SPMD blocks.
uniopStatus uniopMatmulGetWorkspaceSize(const uniopTensor *a,
                                        const uniopTensor *b,
                                        uniopTensor *out,
                                        uint64_t *workspaceSize,
                                        uniopExecutor **executor);

// Phase 2 of `matmul`: launches the executor from `uniopMatmulGetWorkspaceSize` on `stream`.
uniopStatus uniopMatmul(void *workspace,
                        uint64_t workspaceSize,
                        uniopExecutor *executor,
                        uniopStream stream);

// Phase 1 of `matmul_backward(Tensor dout, Tensor a, Tensor b, bool needs_da=True, bool needs_db=True) -> (Tensor da, Tensor db)`.
//
// Gradients of matmul: da = dout @ b^T and db = a^T @ dout per batch, summed over the batches each
// operand was broadcast to (da and db have a's and b's shapes). Deterministic (no atomics). A
// gradient whose needs_d<operand> is false comes back empty ([0]) and costs nothing.
uniopStatus uniopMatmulBackwardGetWorkspaceSize(const uniopTensor *dout,
                                                const uniopTensor *a,
                                                const uniopTensor *b,
                                                bool needs_da,
                                                bool needs_db,
                                                uniopTensor *da,
                                                uniopTensor *db,
                                                uint64_t *workspaceSize,
                                                uniopExecutor **executor);

// Phase 2 of `matmul_backward`: launches the executor from `uniopMatmulBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopMatmulBackward(void *workspace,
                                uint64_t workspaceSize,
                                uniopExecutor *executor,
                                uniopStream stream);

// Phase 1 of `mul(Tensor a, Tensor b) -> (Tensor out)`.
//
// Elementwise a * b; a and b broadcast against each other and share a dtype.
uniopStatus uniopMulGetWorkspaceSize(const uniopTensor *a,
                                     const uniopTensor *b,
                                     uniopTensor *out,
                                     uint64_t *workspaceSize,
                                     uniopExecutor **executor);

// Phase 2 of `mul`: launches the executor from `uniopMulGetWorkspaceSize` on `stream`.
uniopStatus uniopMul(void *workspace,
                     uint64_t workspaceSize,
                     uniopExecutor *executor,
                     uniopStream stream);

// Phase 1 of `mul_backward(Tensor dout, Tensor a, Tensor b, bool needs_da=True, bool needs_db=True) -> (Tensor da, Tensor db)`.
//
// Gradient of mul: da = dout * b and db = dout * a, each summed over the dims its operand was
// broadcast along (so da has a's shape, db b's). A gradient whose needs_d<operand> is false comes
// back empty ([0]). Deterministic (no atomics).
uniopStatus uniopMulBackwardGetWorkspaceSize(const uniopTensor *dout,
                                             const uniopTensor *a,
                                             const uniopTensor *b,
                                             bool needs_da,
                                             bool needs_db,
                                             uniopTensor *da,
                                             uniopTensor *db,
                                             uint64_t *workspaceSize,
                                             uniopExecutor **executor);

// Phase 2 of `mul_backward`: launches the executor from `uniopMulBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopMulBackward(void *workspace,
                             uint64_t workspaceSize,
                             uniopExecutor *executor,
                             uniopStream stream);

// Phase 1 of `pack_weight(Tensor weight, Tensor? up_weight=None) -> (Tensor packed_weight)`.
//
// A linear weight [out_features, in_features] (HF layout) packed once for linear_packed /
// linear_add_packed, or with up_weight (same shape) a gate/up pair for linear_silu_mul_packed:
// [panels, words, 32, per_word] in the weight's dtype, per_word input features a 32-bit word (2
// for bfloat16, 1 for float32), 32 output features a panel (16 of each weight for a pair),
// zero-padded. Saves the GEMM re-packing the weight in every call; for prefill-sized products.
uniopStatus uniopPackWeightGetWorkspaceSize(const uniopTensor *weight,
                                            const uniopTensor *up_weight,
                                            uniopTensor *packed_weight,
                                            uint64_t *workspaceSize,
                                            uniopExecutor **executor);

// Phase 2 of `pack_weight`: launches the executor from `uniopPackWeightGetWorkspaceSize` on `stream`.
uniopStatus uniopPackWeight(void *workspace,
                            uint64_t workspaceSize,
                            uniopExecutor *executor,
                            uniopStream stream);

// Phase 1 of `permute(Tensor x, int[] dims, int batch_dims=0) -> (Tensor out)`.
//
// A contiguous copy of x with its dims reordered: out.shape[i] = x.shape[dims[i]] (torch's
// x.permute(dims).contiguous()). dims is a permutation of x's dims; negative values count from the
// end. With batch_dims, x's first batch_dims dims stay in place and dims permutes the others (its
// non-negative values counted from the first of them). x may have any strides. Any dtype.
uniopStatus uniopPermuteGetWorkspaceSize(const uniopTensor *x,
                                         const uniopIntArray *dims,
                                         int64_t batch_dims,
                                         uniopTensor *out,
                                         uint64_t *workspaceSize,
                                         uniopExecutor **executor);

// Phase 2 of `permute`: launches the executor from `uniopPermuteGetWorkspaceSize` on `stream`.
uniopStatus uniopPermute(void *workspace,
                         uint64_t workspaceSize,
                         uniopExecutor *executor,
                         uniopStream stream);

// Phase 1 of `permute_backward(Tensor dout, int[] dims, int batch_dims=0) -> (Tensor dx)`.
//
// Gradient of permute: dx = dout with the inverse permutation of dims applied (contiguous); dims
// and batch_dims as given to permute. Any dtype.
uniopStatus uniopPermuteBackwardGetWorkspaceSize(const uniopTensor *dout,
                                                 const uniopIntArray *dims,
                                                 int64_t batch_dims,
                                                 uniopTensor *dx,
                                                 uint64_t *workspaceSize,
                                                 uniopExecutor **executor);

// Phase 2 of `permute_backward`: launches the executor from `uniopPermuteBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopPermuteBackward(void *workspace,
                                 uint64_t workspaceSize,
                                 uniopExecutor *executor,
                                 uniopStream stream);

// Phase 1 of `rms_norm(Tensor x, Tensor weight, float eps=1e-6) -> (Tensor y, Tensor rstd)`.
//
// Root-mean-square normalization (LLaMA's RMSNorm): y = x / sqrt(mean(x^2) + eps) * weight over
// the trailing dims matching weight's shape. rstd (float32, normalized dims kept as 1) is returned
// for the backward. weight: same dtype as x, or float32. f16/bf16 accumulate in float32.
uniopStatus uniopRmsNormGetWorkspaceSize(const uniopTensor *x,
                                         const uniopTensor *weight,
                                         double eps,
                                         uniopTensor *y,
                                         uniopTensor *rstd,
                                         uint64_t *workspaceSize,
                                         uniopExecutor **executor);

// Phase 2 of `rms_norm`: launches the executor from `uniopRmsNormGetWorkspaceSize` on `stream`.
uniopStatus uniopRmsNorm(void *workspace,
                         uint64_t workspaceSize,
                         uniopExecutor *executor,
                         uniopStream stream);

// Phase 1 of `rms_norm_backward(Tensor dy, Tensor x, Tensor weight, Tensor rstd, int batch_dims=0) -> (Tensor dx, Tensor dweight)`.
//
// Gradients of rms_norm: dx (dtype of x) and dweight (dtype of weight), from the upstream gradient
// dy and the rstd saved by the forward. dweight sums over all rows, or per sample with batch_dims:
// then it is x.shape[:batch_dims] + weight's shape. Deterministic: dweight partials are per block,
// summed in a fixed order.
uniopStatus uniopRmsNormBackwardGetWorkspaceSize(const uniopTensor *dy,
                                                 const uniopTensor *x,
                                                 const uniopTensor *weight,
                                                 const uniopTensor *rstd,
                                                 int64_t batch_dims,
                                                 uniopTensor *dx,
                                                 uniopTensor *dweight,
                                                 uint64_t *workspaceSize,
                                                 uniopExecutor **executor);

// Phase 2 of `rms_norm_backward`: launches the executor from `uniopRmsNormBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopRmsNormBackward(void *workspace,
                                 uint64_t workspaceSize,
                                 uniopExecutor *executor,
                                 uniopStream stream);

// Phase 1 of `rope(Tensor x, Tensor cos, Tensor sin, str mode='half', bool per_pair=False) -> (Tensor out)`.
//
// Rotary position embedding. cos/sin: [..., W], broadcasting against x with its last dim replaced
// by W. The rotary dim R (even, <= head dim; the rest passes through) is W: one value per rotated
// element, in the rotated part's layout (HF's tables), or with per_pair 2W: one value per pair
// (flash-attn's, vLLM's, GPT-OSS's tables). mode 'half' pairs i with i+R/2 (HF/NeoX rotate_half),
// 'interleave' pairs 2i with 2i+1 (GPT-J). cos/sin in x's dtype or float32.
uniopStatus uniopRopeGetWorkspaceSize(const uniopTensor *x,
                                      const uniopTensor *cos,
                                      const uniopTensor *sin,
                                      const char *mode,
                                      bool per_pair,
                                      uniopTensor *out,
                                      uint64_t *workspaceSize,
                                      uniopExecutor **executor);

// Phase 2 of `rope`: launches the executor from `uniopRopeGetWorkspaceSize` on `stream`.
uniopStatus uniopRope(void *workspace,
                      uint64_t workspaceSize,
                      uniopExecutor *executor,
                      uniopStream stream);

// Phase 1 of `rope_backward(Tensor dout, Tensor cos, Tensor sin, str mode='half', bool per_pair=False) -> (Tensor dx)`.
//
// Gradient of rope: applies the transposed rotation to dout (same cos/sin/mode/per_pair rules as
// rope).
uniopStatus uniopRopeBackwardGetWorkspaceSize(const uniopTensor *dout,
                                              const uniopTensor *cos,
                                              const uniopTensor *sin,
                                              const char *mode,
                                              bool per_pair,
                                              uniopTensor *dx,
                                              uint64_t *workspaceSize,
                                              uniopExecutor **executor);

// Phase 2 of `rope_backward`: launches the executor from `uniopRopeBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopRopeBackward(void *workspace,
                              uint64_t workspaceSize,
                              uniopExecutor *executor,
                              uniopStream stream);

// Phase 1 of `rope_cos_sin(Tensor positions, int dim, float theta=10000.0, str mode='half', ScalarType? dtype=None, Tensor? inv_freq=None, bool per_pair=False, float scale=1.0) -> (Tensor cos, Tensor sin)`.
//
// cos/sin tables for rope from integer positions (any shape; output [..., dim]), HF's default
// rotary embedding: inv_freq = 1/theta^(2j/dim), angle = position * inv_freq in float32. mode
// 'half' lays the dim/2 frequencies out twice (cat), 'interleave' repeats each in place. dtype:
// float32 (default), float16, bfloat16. inv_freq (float32 [dim/2], optional) replaces
// 1/theta^(2j/dim): a model's own table (HF's scaled ropes, or its default one as torch's pow
// rounded it) gives its angles exactly. per_pair: one column per frequency (output [..., dim/2],
// either mode), rope's per_pair tables. scale multiplies both tables in float32 (HF YaRN's
// attention factor).
uniopStatus uniopRopeCosSinGetWorkspaceSize(const uniopTensor *positions,
                                            int64_t dim,
                                            double theta,
                                            const char *mode,
                                            const uniopDataType *dtype,
                                            const uniopTensor *inv_freq,
                                            bool per_pair,
                                            double scale,
                                            uniopTensor *cos,
                                            uniopTensor *sin,
                                            uint64_t *workspaceSize,
                                            uniopExecutor **executor);

// Phase 2 of `rope_cos_sin`: launches the executor from `uniopRopeCosSinGetWorkspaceSize` on `stream`.
uniopStatus uniopRopeCosSin(void *workspace,
                            uint64_t workspaceSize,
                            uniopExecutor *executor,
                            uniopStream stream);

// Phase 1 of `sample(Tensor logits, float temperature=1.0, int top_k=0, float top_p=1.0, int seed=0) -> (Tensor tokens)`.
//
// One int64 token per row of logits [..., V] from softmax(logits / temperature), filtered to the
// top_k (0 = off) most likely and then the top_p nucleus (1 = off); temperature 0 is greedy.
// Seeded and reproducible: row r uses its own random stream from (seed, r).
uniopStatus uniopSampleGetWorkspaceSize(const uniopTensor *logits,
                                        double temperature,
                                        int64_t top_k,
                                        double top_p,
                                        int64_t seed,
                                        uniopTensor *tokens,
                                        uint64_t *workspaceSize,
                                        uniopExecutor **executor);

// Phase 2 of `sample`: launches the executor from `uniopSampleGetWorkspaceSize` on `stream`.
uniopStatus uniopSample(void *workspace,
                        uint64_t workspaceSize,
                        uniopExecutor *executor,
                        uniopStream stream);

// Phase 1 of `silu(Tensor x) -> (Tensor y)`.
//
// Elementwise x / (1 + exp(-x)), as torch.nn.functional.silu. Any shape and strides.
uniopStatus uniopSiluGetWorkspaceSize(const uniopTensor *x,
                                      uniopTensor *y,
                                      uint64_t *workspaceSize,
                                      uniopExecutor **executor);

// Phase 2 of `silu`: launches the executor from `uniopSiluGetWorkspaceSize` on `stream`.
uniopStatus uniopSilu(void *workspace,
                      uint64_t workspaceSize,
                      uniopExecutor *executor,
                      uniopStream stream);

// Phase 1 of `silu_backward(Tensor dy, Tensor x) -> (Tensor dx)`.
//
// Gradient of silu: dx = dy * s * (1 + x * (1 - s)) with s = sigmoid(x). dy and x share shape and
// dtype.
uniopStatus uniopSiluBackwardGetWorkspaceSize(const uniopTensor *dy,
                                              const uniopTensor *x,
                                              uniopTensor *dx,
                                              uint64_t *workspaceSize,
                                              uniopExecutor **executor);

// Phase 2 of `silu_backward`: launches the executor from `uniopSiluBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopSiluBackward(void *workspace,
                              uint64_t workspaceSize,
                              uniopExecutor *executor,
                              uniopStream stream);

// Phase 1 of `silu_mul(Tensor gate, Tensor up) -> (Tensor out)`.
//
// silu(gate) * up elementwise (HF LlamaMLP's act_fn(gate_proj(x)) * up_proj(x)). gate and up share
// shape and dtype; any strides. f16/bf16 compute in float32.
uniopStatus uniopSiluMulGetWorkspaceSize(const uniopTensor *gate,
                                         const uniopTensor *up,
                                         uniopTensor *out,
                                         uint64_t *workspaceSize,
                                         uniopExecutor **executor);

// Phase 2 of `silu_mul`: launches the executor from `uniopSiluMulGetWorkspaceSize` on `stream`.
uniopStatus uniopSiluMul(void *workspace,
                         uint64_t workspaceSize,
                         uniopExecutor *executor,
                         uniopStream stream);

// Phase 1 of `silu_mul_backward(Tensor dout, Tensor gate, Tensor up) -> (Tensor dgate, Tensor dup)`.
//
// Gradients of silu_mul for the upstream gradient dout: dgate = dout * up * s * (1 + gate * (1 -
// s)) with s = sigmoid(gate), dup = dout * silu(gate). All three inputs share shape and dtype.
uniopStatus uniopSiluMulBackwardGetWorkspaceSize(const uniopTensor *dout,
                                                 const uniopTensor *gate,
                                                 const uniopTensor *up,
                                                 uniopTensor *dgate,
                                                 uniopTensor *dup,
                                                 uint64_t *workspaceSize,
                                                 uniopExecutor **executor);

// Phase 2 of `silu_mul_backward`: launches the executor from `uniopSiluMulBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopSiluMulBackward(void *workspace,
                                 uint64_t workspaceSize,
                                 uniopExecutor *executor,
                                 uniopStream stream);

// Phase 1 of `softcapped_swiglu(Tensor x, float gate_softcap=4.0, float up_softcap=25.0, bool interleaved=False) -> (Tensor out)`.
//
// Inkling 2's experts' gated activation: the last dim of x (even size) holds gate and up values,
// as its two halves (i, n/2 + i) or interleaved (pairs 2i, 2i+1: interleaved=True); out =
// gate_softcap * tanh(gate / gate_softcap) * sigmoid(gate) * up_softcap * tanh(up / up_softcap),
// with the last dim halved (the sigmoid sees the raw gate). Caps finite and > 0. f16/bf16 compute
// in float32.
uniopStatus uniopSoftcappedSwigluGetWorkspaceSize(const uniopTensor *x,
                                                  double gate_softcap,
                                                  double up_softcap,
                                                  bool interleaved,
                                                  uniopTensor *out,
                                                  uint64_t *workspaceSize,
                                                  uniopExecutor **executor);

// Phase 2 of `softcapped_swiglu`: launches the executor from `uniopSoftcappedSwigluGetWorkspaceSize` on `stream`.
uniopStatus uniopSoftcappedSwiglu(void *workspace,
                                  uint64_t workspaceSize,
                                  uniopExecutor *executor,
                                  uniopStream stream);

// Phase 1 of `softcapped_swiglu_backward(Tensor dout, Tensor x, float gate_softcap=4.0, float up_softcap=25.0, bool interleaved=False) -> (Tensor dx)`.
//
// Gradient of softcapped_swiglu: with tg = tanh(gate / gate_softcap), tu = tanh(up / up_softcap),
// s = sigmoid(gate), d gate = dout * up_softcap * tu * s * (1 - tg^2 + gate_softcap * tg * (1 -
// s)), d up = dout * gate_softcap * tg * s * (1 - tu^2); dx lays them out as x (halves or
// interleaved). dout has softcapped_swiglu's output shape.
uniopStatus uniopSoftcappedSwigluBackwardGetWorkspaceSize(const uniopTensor *dout,
                                                          const uniopTensor *x,
                                                          double gate_softcap,
                                                          double up_softcap,
                                                          bool interleaved,
                                                          uniopTensor *dx,
                                                          uint64_t *workspaceSize,
                                                          uniopExecutor **executor);

// Phase 2 of `softcapped_swiglu_backward`: launches the executor from `uniopSoftcappedSwigluBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopSoftcappedSwigluBackward(void *workspace,
                                          uint64_t workspaceSize,
                                          uniopExecutor *executor,
                                          uniopStream stream);

// Phase 1 of `softmax(Tensor x, int dim=-1) -> (Tensor y)`.
//
// exp(x - max) / sum(exp(x - max)) along dim, as torch.softmax. Any dim; f16/bf16 compute in
// float32.
uniopStatus uniopSoftmaxGetWorkspaceSize(const uniopTensor *x,
                                         int64_t dim,
                                         uniopTensor *y,
                                         uint64_t *workspaceSize,
                                         uniopExecutor **executor);

// Phase 2 of `softmax`: launches the executor from `uniopSoftmaxGetWorkspaceSize` on `stream`.
uniopStatus uniopSoftmax(void *workspace,
                         uint64_t workspaceSize,
                         uniopExecutor *executor,
                         uniopStream stream);

// Phase 1 of `softmax_backward(Tensor dy, Tensor y, int dim=-1) -> (Tensor dx)`.
//
// Gradient of softmax from its output y: dx = y * (dy - sum(dy * y)) along dim.
uniopStatus uniopSoftmaxBackwardGetWorkspaceSize(const uniopTensor *dy,
                                                 const uniopTensor *y,
                                                 int64_t dim,
                                                 uniopTensor *dx,
                                                 uint64_t *workspaceSize,
                                                 uniopExecutor **executor);

// Phase 2 of `softmax_backward`: launches the executor from `uniopSoftmaxBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopSoftmaxBackward(void *workspace,
                                 uint64_t workspaceSize,
                                 uniopExecutor *executor,
                                 uniopStream stream);

// Phase 1 of `swiglu(Tensor x, int dim=-1) -> (Tensor out)`.
//
// SwiGLU with aclnn semantics: x splits into halves a, b along dim (size must be even); out =
// silu(a) * b, with dim halved. f16/bf16 compute in float32.
uniopStatus uniopSwigluGetWorkspaceSize(const uniopTensor *x,
                                        int64_t dim,
                                        uniopTensor *out,
                                        uint64_t *workspaceSize,
                                        uniopExecutor **executor);

// Phase 2 of `swiglu`: launches the executor from `uniopSwigluGetWorkspaceSize` on `stream`.
uniopStatus uniopSwiglu(void *workspace,
                        uint64_t workspaceSize,
                        uniopExecutor *executor,
                        uniopStream stream);

// Phase 1 of `swiglu_backward(Tensor dout, Tensor x, int dim=-1) -> (Tensor dx)`.
//
// Gradient of swiglu: dx holds d/da = dout * b * silu'(a) in its first half along dim and d/db =
// dout * silu(a) in its second half. dout has swiglu's output shape.
uniopStatus uniopSwigluBackwardGetWorkspaceSize(const uniopTensor *dout,
                                                const uniopTensor *x,
                                                int64_t dim,
                                                uniopTensor *dx,
                                                uint64_t *workspaceSize,
                                                uniopExecutor **executor);

// Phase 2 of `swiglu_backward`: launches the executor from `uniopSwigluBackwardGetWorkspaceSize` on `stream`.
uniopStatus uniopSwigluBackward(void *workspace,
                                uint64_t workspaceSize,
                                uniopExecutor *executor,
                                uniopStream stream);

// Registers the built-in ops. Optional (every call initializes on demand); idempotent.
uniopStatus uniopInit(void);

// Drains the default stream, returns cached memory to the OS and prints a report of buffers
// still allocated to stderr (the leak report).
uniopStatus uniopFinalize(void);

// Selects the device; the CPU device is 0 (the only one in this build).
uniopStatus uniopSetDevice(int32_t deviceId);

uniopStatus uniopCreateStream(uniopStream *stream);

// Waits for the stream's work, then destroys it.
uniopStatus uniopDestroyStream(uniopStream stream);

// Blocks until the stream's work is done; reports the first error of its asynchronous work.
uniopStatus uniopSynchronizeStream(uniopStream stream);

// Work enqueued on `stream` later waits for `event`'s latest record.
uniopStatus uniopStreamWaitEvent(uniopStream stream, uniopEvent event);

uniopStatus uniopCreateEvent(uniopEvent *event);

uniopStatus uniopDestroyEvent(uniopEvent event);

uniopStatus uniopRecordEvent(uniopEvent event, uniopStream stream);

// `*done` = 1 when the event's latest record has completed, else 0.
uniopStatus uniopQueryEvent(uniopEvent event, int32_t *done);

uniopStatus uniopSynchronizeEvent(uniopEvent event);

// Milliseconds between two completed records.
uniopStatus uniopEventElapsedTime(float *ms, uniopEvent start, uniopEvent end);

// Device memory from the caching allocator (64-byte aligned), under `policy`.
uniopStatus uniopMalloc(void **devPtr, size_t size, uniopMemMallocPolicy policy);

uniopStatus uniopFree(void *devPtr);

// Host memory (the same allocator on the CPU device), freed with `uniopFreeHost`.
uniopStatus uniopMallocHost(void **hostPtr, size_t size);

uniopStatus uniopFreeHost(void *hostPtr);

// Copies `count` bytes; `kind` is checked but every direction is a host copy on the CPU device.
uniopStatus uniopMemcpy(void *dst,
                        size_t destMax,
                        const void *src,
                        size_t count,
                        uniopMemcpyKind kind);

// Enqueues the copy on `stream`; both buffers must stay valid until it has run.
uniopStatus uniopMemcpyAsync(void *dst,
                             size_t destMax,
                             const void *src,
                             size_t count,
                             uniopMemcpyKind kind,
                             uniopStream stream);

// Free and total physical memory of the device (the machine's RAM for the CPU device).
uniopStatus uniopGetMemInfo(size_t *free, size_t *total);

uniopStatus uniopGetMemStats(uniopMemStats *stats);

// One allocator counter (a `UNIOP_MEM_STAT_*` number) into `*value`.
uniopStatus uniopGetMemStat(uniopMemStat stat, uint64_t *value);

// Writes the allocator's summary table, NUL-terminated and truncated to `len` bytes; `*needed`
// (when not NULL) receives the full size including the NUL.
uniopStatus uniopMemorySummary(char *buf, size_t len, size_t *needed);

// Starts recording every launch in the process — op launches from any frontend, staging copies
// and kernel direct calls — with its op, tensors, bytes, block count, stream and time. Fails
// when a profiler is already recording.
uniopStatus uniopProfilerStart(void);

// Stops recording and keeps the profile for `uniopProfilerSummary` / `uniopProfilerWriteTrace`
// (replacing the previous one). Launches still queued are not recorded: synchronize first.
uniopStatus uniopProfilerStop(void);

// Writes the last profile's op summary (launch time per op, step and tensor signature, longest
// first; `top` rows, 0 for all) like `uniopMemorySummary`: truncated to `len` bytes,
// NUL-terminated, full size with the NUL in `*needed` when not NULL.
uniopStatus uniopProfilerSummary(size_t top, char *buf, size_t len, size_t *needed);

// Writes the last profile as Chrome trace JSON (open in chrome://tracing or ui.perfetto.dev)
// to the file at `path`.
uniopStatus uniopProfilerWriteTrace(const char *path);

// Kernel direct call: enqueues `blockDim` instances of `kernel(blockIdx, blockDim, args)` on
// `stream`, spread over the compute pool. `args` must stay valid until the launch has run.
uniopStatus uniopLaunchKernel(uniopKernelFn kernel,
                              uint32_t blockDim,
                              void *args,
                              uniopStream stream);

// Loads a Rust op library (a crate built as a `cdylib` that exports its ops with
// `uniop::export_ops!`) and registers its ops; they are then callable through
// `uniopOpGetWorkspaceSize` by name. Fails with `UNIOP_ERROR_PARAM_INVALID` when the file is not
// such a library, or was built for another plugin ABI, compiler or uniop version.
uniopStatus uniopLoadOpLibrary(const char *path);

// Describes `tensorData` as a strided view (`stride` may be NULL for contiguous), `offset`
// elements into a storage of `storageDims`. Returns NULL on bad arguments (see
// `uniopGetRecentErrMsg`).
uniopTensor *uniopCreateTensor(const int64_t *viewDims,
                               uint64_t viewDimsNum,
                               uniopDataType dataType,
                               const int64_t *stride,
                               int64_t offset,
                               uniopFormat format,
                               const int64_t *storageDims,
                               uint64_t storageDimsNum,
                               void *tensorData);

uniopStatus uniopDestroyTensor(const uniopTensor *tensor);

// Reads one value of `dataType` at `value` (FLOAT, FLOAT16, BF16, DOUBLE, INT8, INT32, INT64,
// UINT8 or BOOL) into a scalar. Returns NULL on bad arguments (see `uniopGetRecentErrMsg`).
uniopScalar *uniopCreateScalar(const void *value, uniopDataType dataType);

uniopStatus uniopDestroyScalar(const uniopScalar *scalar);

// Copies `size` integers from `value` (NULL allowed when `size` is 0). Returns NULL on bad
// arguments (see `uniopGetRecentErrMsg`).
uniopIntArray *uniopCreateIntArray(const int64_t *value, uint64_t size);

uniopStatus uniopDestroyIntArray(const uniopIntArray *array);

// Groups `size` tensor descriptors (each live; the same one may repeat) into a list that takes
// them over. Returns NULL on bad arguments (see `uniopGetRecentErrMsg`).
uniopTensorList *uniopCreateTensorList(const uniopTensor *const *value, uint64_t size);

// Destroys the list and the tensors in it (each once).
uniopStatus uniopDestroyTensorList(const uniopTensorList *list);

// Phase 1 by op name: binds `inputs` (the tensors the op reads, schema order; NULL for an
// absent optional), `attrs` (`"name=value, ..."`, may be NULL) and `outputs` (tensors the op
// updates in place, then its returns, each in memory of its own), checks them, plans, and
// returns the workspace size and a single-use executor.
uniopStatus uniopOpGetWorkspaceSize(const char *opName,
                                    const uniopTensor *const *inputs,
                                    uint64_t numInputs,
                                    const char *attrs,
                                    const uniopTensor *const *outputs,
                                    uint64_t numOutputs,
                                    uint64_t *workspaceSize,
                                    uniopExecutor **executor);

// Phase 2: launches the executor on `stream` (NULL: default) with `workspace`. A single-use
// executor is consumed by a successful launch; a repeatable one stays until destroyed.
uniopStatus uniopOpRun(void *workspace,
                       uint64_t workspaceSize,
                       uniopExecutor *executor,
                       uniopStream stream);

// Lets the executor launch any number of times (aclnn's `aclSetAclOpExecutorRepeatable`).
uniopStatus uniopSetExecutorRepeatable(uniopExecutor *executor);

uniopStatus uniopDestroyExecutor(uniopExecutor *executor);

// Points input `index` of a repeatable executor at new memory laid out like the planned one.
uniopStatus uniopSetInputTensorAddr(uniopExecutor *executor, uint64_t index, void *addr);

// Points output `index` (in-place tensors first, then returns) at new memory.
uniopStatus uniopSetOutputTensorAddr(uniopExecutor *executor, uint64_t index, void *addr);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* UNIOP_H */
