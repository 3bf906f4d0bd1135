//! Element types.
//!
//! `DType` is the runtime tag carried by tensor metadata; [`Element`] ties a Rust type to its tag so
//! kernels can be written once, generically, and dispatched by tag. Half-precision types compute in
//! f32 ([`FloatElement`] converts whole slices at a time, which is where SIMD conversion pays).

use crate::error::{Error, ErrorCode, Result};
use half::{bf16, f16};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F16,
    BF16,
    F64,
    I8,
    I32,
    I64,
    U8,
    Bool,
}

/// DLPack type codes (`DLDataTypeCode`).
pub const DLPACK_INT: u8 = 0;
pub const DLPACK_UINT: u8 = 1;
pub const DLPACK_FLOAT: u8 = 2;
pub const DLPACK_BFLOAT: u8 = 4;
pub const DLPACK_BOOL: u8 = 6;

impl DType {
    pub const ALL: [DType; 9] =
        [DType::F32, DType::F16, DType::BF16, DType::F64, DType::I8, DType::I32, DType::I64, DType::U8, DType::Bool];

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 | DType::Bool => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    /// The name used in schemas, the CLI and messages (torch's spelling).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F64 => "float64",
            DType::I8 => "int8",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::Bool => "bool",
        }
    }

    /// The short spelling used in tables and profiles (`f32`, `bf16`, `i64`, …).
    pub fn short_name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
            DType::I8 => "i8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::Bool => "bool",
        }
    }

    /// Parses `float32`/`f32`, `bfloat16`/`bf16`, `half`, `int64`/`i64`, … (case-insensitive).
    pub fn parse(s: &str) -> Result<DType> {
        let lower = s.to_ascii_lowercase();
        let dtype = match lower.as_str() {
            "float32" | "f32" | "float" => DType::F32,
            "float16" | "f16" | "half" => DType::F16,
            "bfloat16" | "bf16" => DType::BF16,
            "float64" | "f64" | "double" => DType::F64,
            "int8" | "i8" => DType::I8,
            "int32" | "i32" | "int" => DType::I32,
            "int64" | "i64" | "long" => DType::I64,
            "uint8" | "u8" => DType::U8,
            "bool" => DType::Bool,
            _ => {
                return Err(Error::new(
                    ErrorCode::DType,
                    format!("unknown dtype '{s}': expected one of float32, float16, bfloat16, float64, int8, int32, int64, uint8, bool"),
                ))
            }
        };
        Ok(dtype)
    }

    /// DLPack `(code, bits)`; bf16 is `kDLBfloat`, f16 is `kDLFloat` with 16 bits.
    pub fn dlpack(self) -> (u8, u8) {
        let bits = (self.size() * 8) as u8;
        let code = match self {
            DType::F32 | DType::F16 | DType::F64 => DLPACK_FLOAT,
            DType::BF16 => DLPACK_BFLOAT,
            DType::I8 | DType::I32 | DType::I64 => DLPACK_INT,
            DType::U8 => DLPACK_UINT,
            DType::Bool => DLPACK_BOOL,
        };
        (code, bits)
    }

    pub fn from_dlpack(code: u8, bits: u8) -> Result<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.dlpack() == (code, bits))
            .ok_or_else(|| Error::new(ErrorCode::DType, format!("unsupported DLPack dtype (code {code}, bits {bits})")))
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that can live in a uniop tensor.
pub trait Element: Copy + Default + PartialEq + fmt::Debug + Send + Sync + 'static {
    const DTYPE: DType;
    fn to_f64(self) -> f64;
    /// Converts with the type's usual rounding (round-to-nearest-even for floats, saturating
    /// truncation for integers).
    fn from_f64(v: f64) -> Self;
    /// Integer value: exact for integers (so i64 keeps all 64 bits), truncated toward zero and
    /// saturated for floats (NaN → 0), 0/1 for bool.
    fn to_i64(self) -> i64;
    /// From an integer: two's-complement wrapping into narrower integers (C and torch casts),
    /// nearest value for floats, `!= 0` for bool.
    fn from_i64(v: i64) -> Self;
}

macro_rules! int_element {
    ($($t:ty => $d:ident),*) => {$(
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn to_f64(self) -> f64 { self as f64 }
            fn from_f64(v: f64) -> Self { v as $t }
            fn to_i64(self) -> i64 { self as i64 }
            fn from_i64(v: i64) -> Self { v as $t }
        }
    )*};
}
int_element!(i8 => I8, i32 => I32, i64 => I64, u8 => U8);

impl Element for bool {
    const DTYPE: DType = DType::Bool;
    fn to_f64(self) -> f64 {
        self as u8 as f64
    }
    fn from_f64(v: f64) -> Self {
        v != 0.0
    }
    fn to_i64(self) -> i64 {
        self as i64
    }
    fn from_i64(v: i64) -> Self {
        v != 0
    }
}

impl Element for f64 {
    const DTYPE: DType = DType::F64;
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
    fn to_i64(self) -> i64 {
        self as i64
    }
    fn from_i64(v: i64) -> Self {
        v as f64
    }
}

/// Floating-point elements that kernels compute in f32 (f64 computes in f64 via the reference path).
pub trait FloatElement: Element {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    /// Widens a whole slice (`src.len() == dst.len()`); the bulk form lets conversions vectorize.
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Narrows a whole slice with round-to-nearest-even.
    fn narrow(src: &[f32], dst: &mut [Self]);
    /// `N` elements widened, returned by value: inlined into a kernel's step loop, the lanes stay
    /// in vector registers (the slice form's runtime length and CPU-feature branch keep its
    /// destination in memory, and reloading just-stored vectors stalls Zen cores).
    ///
    /// Plain loops here, not `array::from_fn`: that is a call the compiler may leave out of line,
    /// and out of line it is built for the baseline target, not the kernel's (rope's 32-lane steps
    /// ran through a scalar `try_from_fn` that way).
    #[inline(always)]
    fn widen_lanes<const N: usize>(src: &[Self; N]) -> [f32; N] {
        let mut out = [0f32; N];
        for (o, s) in out.iter_mut().zip(src) {
            *o = s.to_f32();
        }
        out
    }
    /// `N` results narrowed with round-to-nearest-even, returned by value (as [`Self::widen_lanes`]).
    #[inline(always)]
    fn narrow_lanes<const N: usize>(src: &[f32; N]) -> [Self; N] {
        let mut out = [Self::default(); N];
        for (o, &s) in out.iter_mut().zip(src) {
            *o = Self::from_f32(s);
        }
        out
    }
    /// Whether this CPU converts between f32 and `Self` with an instruction per vector that
    /// kernels can use — the `*_natively` methods below:
    /// - bf16 on AVX512-BF16 CPUs narrows with `vcvtneps2bf16` (one op per 16 lanes where the bit
    ///   conversion of [`Self::from_f32`] takes nine); it widens with its usual shift.
    /// - f16 on AVX-512 CPUs narrows with `vcvtps2ph` and widens with F16C's `vcvtph2ps` (one op
    ///   per 16 lanes where the bit conversion of [`Self::to_f32`] takes about ten).
    ///
    /// Kernels bound by their op count run faster this way; they choose once per loop with this,
    /// because a branch per step would keep each step's lanes in memory. (AVX2 CPUs, which have
    /// F16C too, keep the bit conversions their kernels were tuned with: not measured here.)
    #[inline(always)]
    fn converts_natively() -> bool {
        false
    }
    /// `src` narrowed by the CPU's instruction, 16 lanes at a time on 512-bit registers (`N` must
    /// be a multiple of 16: checked at compile time). It rounds as [`Self::from_f32`] does, except
    /// that bf16's turns f32 subnormals (below 1.2e-38 in magnitude) into zeros of their sign.
    ///
    /// By value, so that lanes a kernel computes in a step loop never touch memory: narrowing from
    /// the stored f32 step instead (the instruction reloading it) made bf16 rms_norm take
    /// 0.045–0.052 ms in cache against 0.033, rope at [1, 32, 512, 128] 0.35 against 0.28 (one
    /// thread, Zen 4).
    ///
    /// # Safety
    /// Only where [`Self::converts_natively`] is true: kernels check that once per loop, not per
    /// step. (The default, for types without such an instruction, is the exact lane narrowing.)
    #[inline(always)]
    unsafe fn narrow_lanes_natively<const N: usize>(src: [f32; N]) -> [Self; N] {
        Self::narrow_lanes(&src)
    }
    /// [`Self::to_f32`] by the CPU's instruction (exact, as it is). Written per element so that
    /// kernels' element loops can use it: LLVM vectorizes f16's to `vcvtph2ps` over 16 lanes.
    ///
    /// # Safety
    /// As [`Self::narrow_lanes_natively`]. (The default is [`Self::to_f32`]: f32's and bf16's
    /// widening needs no instruction, so theirs may run anywhere.)
    #[inline(always)]
    unsafe fn to_f32_natively(self) -> f32 {
        self.to_f32()
    }
    /// [`Self::widen_lanes`] by [`Self::to_f32_natively`].
    ///
    /// # Safety
    /// As [`Self::to_f32_natively`].
    #[inline(always)]
    unsafe fn widen_lanes_natively<const N: usize>(src: &[Self; N]) -> [f32; N] {
        let mut out = [0f32; N];
        for (o, s) in out.iter_mut().zip(src) {
            *o = s.to_f32_natively();
        }
        out
    }
    /// `Some` when the element *is* f32, so kernels can skip the staging copy.
    fn as_f32_slice(s: &[Self]) -> Option<&[f32]>;
    fn as_f32_slice_mut(s: &mut [Self]) -> Option<&mut [f32]>;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_i64(self) -> i64 {
        self.to_f64() as i64
    }
    fn from_i64(v: i64) -> Self {
        Self::from_f64(v as f64)
    }
}

impl FloatElement for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    #[inline(always)]
    fn as_f32_slice(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
    #[inline(always)]
    fn as_f32_slice_mut(s: &mut [f32]) -> Option<&mut [f32]> {
        Some(s)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn to_i64(self) -> i64 {
        self.to_f64() as i64
    }
    fn from_i64(v: i64) -> Self {
        Self::from_f64(v as f64)
    }
}

impl FloatElement for f16 {
    // Scalar conversions, and through them the default lane forms, are the branch-free bit
    // conversions below, which vectorize: no call (`half`'s conversions are calls, and a call
    // anywhere in a kernel's loop — even on a path not taken — makes it keep its constants and
    // lanes in memory) and no CPU-feature branch per step (a branch per step between them and
    // `vcvtph2ps` kept the step's lanes in memory: rms_norm ran 0.065 → 0.080 ms). F16C's
    // instructions are the `*_natively` forms, which kernels choose once per loop.
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_bits(f32_to_f16_bits(v))
    }
    #[inline(always)]
    fn widen(src: &[f16], dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if src.len() >= 16 && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512 F (checked just above; std caches the check).
            unsafe { widen_f16_avx512(src, dst) };
            return;
        }
        // `half` detects F16C once per slice and converts 8 lanes at a time.
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst)
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [f16]) {
        #[cfg(target_arch = "x86_64")]
        if src.len() >= 16 && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: as in `widen`.
            unsafe { narrow_f16_avx512(src, dst) };
            return;
        }
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src)
    }
    /// On AVX-512 CPUs (all of which have F16C); AVX2 ones keep the staged form their kernels
    /// were tuned with.
    #[inline(always)]
    fn converts_natively() -> bool {
        #[cfg(target_arch = "x86_64")]
        return std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("f16c");
        #[cfg(not(target_arch = "x86_64"))]
        false
    }
    #[inline(always)]
    unsafe fn narrow_lanes_natively<const N: usize>(src: [f32; N]) -> [Self; N] {
        // SAFETY: the caller checked `converts_natively` (false off x86-64), so the CPU has the
        // instruction's features.
        #[cfg(target_arch = "x86_64")]
        return narrow_f16_native(src);
        #[cfg(not(target_arch = "x86_64"))]
        Self::narrow_lanes(&src)
    }
    #[inline(always)]
    unsafe fn to_f32_natively(self) -> f32 {
        // SAFETY: as in `narrow_lanes_natively`.
        #[cfg(target_arch = "x86_64")]
        return f16_to_f32_native(self);
        #[cfg(not(target_arch = "x86_64"))]
        self.to_f32()
    }
    fn as_f32_slice(_: &[f16]) -> Option<&[f32]> {
        None
    }
    fn as_f32_slice_mut(_: &mut [f16]) -> Option<&mut [f32]> {
        None
    }
}

// Why these conversions are written here with `#[inline]` + `#[target_feature]`: a kernel's
// AVX-512 build (`simd_kernel!` in uniop-ops) inlines them, so a 64-lane step converts in
// registers. An out-of-line conversion (the `half` crate's, or one needing features the kernel
// lacks) is a call inside the hot loop, and a call clobbers every vector register: the kernel
// then spilled its values and reloaded its constants around each one, which made f16 kernels
// about 2× slower than f32 ones on data in cache. (For bf16, AVX512-BF16's `vcvtneps2bf16` was
// measured too: no faster here than the integer rounding of `narrow_bf16_avx512`, which needs no
// subnormal fix-up.)

/// f16 → f32, exact, branch-free (so a lane loop vectorizes): the f16 exponent and mantissa
/// shifted into f32 position form a value 2^112 too small — for f16 subnormals an f32 subnormal —
/// which one multiply rebiases exactly; infinities and NaNs get the all-ones exponent instead.
#[inline(always)]
fn f16_bits_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let magnitude = (h & 0x7fff) << 13;
    let finite = f32::from_bits(magnitude) * f32::from_bits(0x7780_0000); // · 2^112
    let wide = if h & 0x7c00 == 0x7c00 { magnitude | 0x7f80_0000 } else { finite.to_bits() };
    f32::from_bits(wide | (h & 0x8000) << 16)
}

/// f32 → f16 with round-to-nearest-even, branch-free: overflow goes to infinity and NaN stays a
/// quiet NaN; results too small for a normal f16 are rounded by one float add that lines the
/// value up with the f16 subnormal step (the FPU rounds it to nearest even).
#[inline(always)]
fn f32_to_f16_bits(v: f32) -> u16 {
    const F16_OVERFLOW: u32 = (127 + 16) << 23; // 65536.0: rounds to infinity from here on
    const MIN_NORMAL: u32 = 113 << 23; // 2^-14
    const SUBNORMAL_MAGIC: u32 = ((127 - 15) + (23 - 10) + 1) << 23; // 0.5: ulp lines up with 2^-24
    let bits = v.to_bits();
    let sign = (bits >> 16) & 0x8000;
    let x = bits & 0x7fff_ffff;
    let special = if x > 0x7f80_0000 { 0x7e00 } else { 0x7c00 };
    let small = (f32::from_bits(x) + f32::from_bits(SUBNORMAL_MAGIC)).to_bits().wrapping_sub(SUBNORMAL_MAGIC);
    let odd = (x >> 13) & 1;
    let normal = x.wrapping_sub((127 - 15) << 23).wrapping_add(0xfff + odd) >> 13;
    let magnitude = if x >= F16_OVERFLOW {
        special
    } else if x < MIN_NORMAL {
        small
    } else {
        normal
    };
    (magnitude | sign) as u16
}

/// f16 → f32, 16 lanes per `vcvtph2ps` (exact).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn widen_f16_avx512(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm512_cvtph_ps, _mm512_storeu_ps};
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 16 <= n {
        let h = _mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i);
        _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
        i += 16;
    }
    for j in i..n {
        dst[j] = src[j].to_f32();
    }
}

/// f32 → f16, 16 lanes per `vcvtps2ph`, rounding to nearest even like `f16::from_f32`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn narrow_f16_avx512(src: &[f32], dst: &mut [f16]) {
    use std::arch::x86_64::{
        __m256i, _mm256_storeu_si256, _mm512_cvtps_ph, _mm512_loadu_ps, _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT,
    };
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 16 <= n {
        let v = _mm512_loadu_ps(src.as_ptr().add(i));
        let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
        _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, h);
        i += 16;
    }
    for j in i..n {
        dst[j] = f16::from_f32(src[j]);
    }
}

/// `src` narrowed 16 lanes at a time by `sixteen`, which narrows one 512-bit register of f32 (an
/// instruction's intrinsic, bit-cast to the element type). Inlined into its `#[target_feature]`
/// callers, whose features `sixteen`'s intrinsic needs.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn narrow_by_registers<T: Copy + Default, const N: usize>(
    src: [f32; N],
    sixteen: impl Fn(std::arch::x86_64::__m512) -> [T; 16],
) -> [T; N] {
    const { assert!(N.is_multiple_of(16), "whole groups of 16 lanes") };
    let mut out = [T::default(); N];
    for (o, s) in out.chunks_exact_mut(16).zip(src.chunks_exact(16)) {
        let lanes: [f32; 16] = s.try_into().expect("16 lanes");
        // SAFETY: [f32; 16] and __m512 are the same 64 plain bytes.
        o.copy_from_slice(&sixteen(unsafe { std::mem::transmute::<[f32; 16], std::arch::x86_64::__m512>(lanes) }));
    }
    out
}

/// f32 → f16 with AVX-512's `vcvtps2ph`, 16 lanes per instruction, rounding to nearest even: the
/// same bits as [`f32_to_f16_bits`] (NaN payloads aside).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn narrow_f16_native<const N: usize>(src: [f32; N]) -> [f16; N] {
    use std::arch::x86_64::{__m256i, _mm512_cvtps_ph, _MM_FROUND_TO_NEAREST_INT};
    // SAFETY: __m256i and [f16; 16] are the same 32 plain bytes.
    narrow_by_registers(src, |v| unsafe {
        std::mem::transmute::<__m256i, [f16; 16]>(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
    })
}

/// f16 → f32 with F16C's `vcvtph2ps` on one lane. Written on one element, it is LLVM's plain
/// half-to-float extension, which its loop vectorizer widens to `vcvtph2ps` over 16 lanes (the
/// narrowing intrinsic is not: a loop narrowing this way stays scalar).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "f16c")]
#[inline]
fn f16_to_f32_native(h: f16) -> f32 {
    use std::arch::x86_64::{_mm_cvtph_ps, _mm_cvtsi32_si128, _mm_cvtss_f32};
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h.to_bits() as i32)))
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn to_i64(self) -> i64 {
        self.to_f64() as i64
    }
    fn from_i64(v: i64) -> Self {
        Self::from_f64(v as f64)
    }
}

/// bf16 → f32 is a shift; written on bits so the loop vectorizes.
#[inline(always)]
fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 → bf16 with round-to-nearest-even; NaN stays a (quiet) NaN. Branch-free so it vectorizes.
#[inline(always)]
fn f32_to_bf16_bits(v: f32) -> u16 {
    let bits = v.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    let nan = (bits >> 16) | 0x40;
    if v.is_nan() {
        nan as u16
    } else {
        rounded as u16
    }
}

/// f32 → bf16 for AVX-512, 16 lanes at a time, same rounding as [`f32_to_bf16_bits`].
///
/// Written with intrinsics because the auto-vectorized form stores through `vpmovdw` with a memory
/// operand, which is microcoded on AMD Zen 4/5 and made bf16 kernels 3× slower than f32 ones.
/// Here the 16 results are gathered into one 256-bit register with `vpermw` and stored plainly.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn narrow_bf16_avx512(src: &[f32], dst: &mut [bf16]) {
    use std::arch::x86_64::{
        _mm512_add_epi32, _mm512_and_si512, _mm512_castps_si512, _mm512_castsi512_si256, _mm512_cmp_ps_mask,
        _mm512_loadu_ps, _mm512_mask_mov_epi32, _mm512_or_si512, _mm512_permutexvar_epi16, _mm512_set1_epi32,
        _mm512_set_epi16, _mm512_srli_epi32, _CMP_UNORD_Q,
    };
    let ones = _mm512_set1_epi32(1);
    let bias = _mm512_set1_epi32(0x7fff);
    let quiet = _mm512_set1_epi32(0x0040_0000);
    // Word indices of the high halves of the 16 dwords, packed into the low 256 bits.
    let high_halves = _mm512_set_epi16(
        31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5,
        3, 1,
    );
    narrow_by_sixteen(src, dst, |at| {
        let v = _mm512_loadu_ps(at);
        let bits = _mm512_castps_si512(v);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), ones);
        let rounded = _mm512_add_epi32(bits, _mm512_add_epi32(bias, lsb));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        let out = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, quiet));
        _mm512_castsi512_si256(_mm512_permutexvar_epi16(high_halves, out))
    });
}

/// f32 → bf16 with AVX512-BF16's `vcvtneps2bf16`, 16 lanes per instruction (see
/// [`FloatElement::narrow_lanes_natively`] for how its rounding differs).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512bf16,avx512f")]
#[inline]
unsafe fn narrow_bf16_native<const N: usize>(src: [f32; N]) -> [bf16; N] {
    use std::arch::x86_64::{__m256bh, _mm512_cvtneps_pbh};
    // SAFETY: __m256bh and [bf16; 16] are the same 32 plain bytes.
    narrow_by_registers(src, |v| unsafe { std::mem::transmute::<__m256bh, [bf16; 16]>(_mm512_cvtneps_pbh(v)) })
}

/// Narrows `src` into `dst` (up to the shorter one) sixteen lanes at a time with `sixteen`, which
/// loads 16 f32 at its pointer and returns their bf16 bits in order; the ragged tail with the
/// scalar conversion. Inlined into its `#[target_feature]` callers, whose features the
/// intrinsics in it and in `sixteen` need.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn narrow_by_sixteen(src: &[f32], dst: &mut [bf16], sixteen: impl Fn(*const f32) -> std::arch::x86_64::__m256i) {
    use std::arch::x86_64::{__m256i, _mm256_storeu_si256};
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 16 <= n {
        _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, sixteen(src.as_ptr().add(i)));
        i += 16;
    }
    for j in i..n {
        dst[j] = bf16::from_bits(f32_to_bf16_bits(src[j]));
    }
}

/// f32 → bf16 for AVX2 CPUs without AVX-512, 16 lanes at a time, same rounding as
/// [`f32_to_bf16_bits`]: 9 vector ops per 8 lanes where the auto-vectorized form takes about 14
/// (it narrows the NaN mask and both candidate results separately, in 128-bit halves). bf16
/// kernels on AVX2 are bound by their op count (silu, softmax, ...), so this shows in them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn narrow_bf16_avx2(src: &[f32], dst: &mut [bf16]) {
    use std::arch::x86_64::_mm256_loadu_ps;
    narrow_by_sixteen(src, dst, |at| bf16x16_avx2(_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))));
}

/// 16 f32 lanes (`low`, then `high`) as 16 bf16 in one register, rounded as [`f32_to_bf16_bits`]
/// (NaNs kept, quieted): [`narrow_bf16_avx2`]'s step, public for AVX2 kernels that keep their
/// results in registers (uniop-ops' softmax row passes).
///
/// # Safety
/// Only on CPUs with AVX2 (a caller built without the feature must check it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub fn bf16x16_avx2(low: std::arch::x86_64::__m256, high: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::{_mm256_packus_epi32, _mm256_permute4x64_epi64};
    // The in-lane pack gives [low 0-3, high 0-3 | low 4-7, high 4-7]; the permute puts the four
    // quarters back in order.
    _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(bf16_bits_avx2(low), bf16_bits_avx2(high)))
}

/// 16 f32 lanes as 16 bf16, rounded as [`bf16x16_avx2`]: `even` holds elements 0, 2, …, 14 and
/// `odd` elements 1, 3, …, 15. It undoes the widening of one 16-element register by a shift left
/// (the even elements) and a mask (the odd ones), so an elementwise kernel that widens that way
/// stores with one shift, one `and` and one `or`, and no shuffle: on Zen 3 shifts and shuffles
/// share two of the four vector pipes, where they bound the bf16 loops with little arithmetic
/// (rope).
///
/// # Safety
/// Only on CPUs with AVX2 (a caller built without the feature must check it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub fn bf16x16_even_odd_avx2(
    even: std::arch::x86_64::__m256,
    odd: std::arch::x86_64::__m256,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::{_mm256_and_si256, _mm256_or_si256, _mm256_set1_epi32, _mm256_srli_epi32};
    let high_half = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    _mm256_or_si256(_mm256_srli_epi32::<16>(bf16_high_avx2(even)), _mm256_and_si256(bf16_high_avx2(odd), high_half))
}

/// The bf16 bits of 8 f32 lanes, in the low halves of 32-bit lanes (so `packus` cannot saturate).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn bf16_bits_avx2(v: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256i {
    std::arch::x86_64::_mm256_srli_epi32::<16>(bf16_high_avx2(v))
}

/// The bf16 bits of 8 f32 lanes, rounded as [`f32_to_bf16_bits`], in the high halves of 32-bit
/// lanes (the low halves are left over from the rounding). The rounding adds `0x7fff` plus the
/// lowest kept bit, that bit found by a compare rather than a shift (see
/// [`bf16x16_even_odd_avx2`]); NaNs keep their high half, quieted.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn bf16_high_avx2(v: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::{
        _mm256_add_epi32, _mm256_and_si256, _mm256_blendv_epi8, _mm256_castps_si256, _mm256_cmp_ps, _mm256_cmpeq_epi32,
        _mm256_or_si256, _mm256_set1_epi32, _mm256_setzero_si256, _CMP_UNORD_Q,
    };
    let bits = _mm256_castps_si256(v);
    // −1 where the lowest kept bit is 0: `bits + 0x8000 − 1`, else `bits + 0x8000`.
    let even_kept = _mm256_cmpeq_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x1_0000)), _mm256_setzero_si256());
    let rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x8000)), even_kept);
    let quiet_nan = _mm256_or_si256(bits, _mm256_set1_epi32(0x40_0000));
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    _mm256_blendv_epi8(rounded, quiet_nan, nan)
}

/// Whether bf16 narrowing takes [`narrow_bf16_avx2`] (AVX-512 CPUs have their own routes).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn narrows_on_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && !std::arch::is_x86_feature_detected!("avx512bw")
}

impl FloatElement for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_bits(f32_to_bf16_bits(v))
    }
    #[inline(always)]
    fn widen(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = bf16_bits_to_f32(s.to_bits());
        }
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [bf16]) {
        #[cfg(target_arch = "x86_64")]
        if src.len() >= 16 && std::arch::is_x86_feature_detected!("avx512bw") {
            // SAFETY: the CPU has AVX-512 F+BW (checked just above; the check is cached by std).
            unsafe { narrow_bf16_avx512(src, dst) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if src.len() >= 16 && narrows_on_avx2() {
            // SAFETY: the CPU has AVX2 (checked just above).
            unsafe { narrow_bf16_avx2(src, dst) };
            return;
        }
        for (d, s) in dst.iter_mut().zip(src) {
            *d = bf16::from_bits(f32_to_bf16_bits(*s));
        }
    }
    #[inline(always)]
    fn narrow_lanes<const N: usize>(src: &[f32; N]) -> [Self; N] {
        let mut out = [bf16::ZERO; N];
        #[cfg(target_arch = "x86_64")]
        if N >= 16 && narrows_on_avx2() {
            // SAFETY: the CPU has AVX2 (checked just above). Inlined into a kernel's AVX2 build.
            unsafe { narrow_bf16_avx2(src, &mut out) };
            return out;
        }
        for (o, &s) in out.iter_mut().zip(src) {
            *o = bf16::from_bits(f32_to_bf16_bits(s));
        }
        out
    }
    #[inline(always)]
    fn converts_natively() -> bool {
        #[cfg(target_arch = "x86_64")]
        return std::arch::is_x86_feature_detected!("avx512bf16") && std::arch::is_x86_feature_detected!("avx512vl");
        #[cfg(not(target_arch = "x86_64"))]
        false
    }
    #[inline(always)]
    unsafe fn narrow_lanes_natively<const N: usize>(src: [f32; N]) -> [Self; N] {
        // SAFETY: the caller checked `converts_natively` (false off x86-64), so the CPU has the
        // instruction's features.
        #[cfg(target_arch = "x86_64")]
        return narrow_bf16_native(src);
        #[cfg(not(target_arch = "x86_64"))]
        Self::narrow_lanes(&src)
    }
    fn as_f32_slice(_: &[bf16]) -> Option<&[f32]> {
        None
    }
    fn as_f32_slice_mut(_: &mut [bf16]) -> Option<&mut [f32]> {
        None
    }
}

/// Runs `$body` with `$T` bound to the Rust element type of any dtype.
#[macro_export]
macro_rules! dispatch_element {
    ($dtype:expr, |$T:ident| $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F16 => {
                type $T = $crate::half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::half::bf16;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::I8 => {
                type $T = i8;
                $body
            }
            $crate::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::U8 => {
                type $T = u8;
                $body
            }
            $crate::DType::Bool => {
                type $T = bool;
                $body
            }
        }
    };
}

/// Runs `$body` with `$T` bound to the Rust type of a float dtype (f32, f16, bf16), or returns a
/// dtype error naming `$op`/`$arg`. f64 is deliberately absent: it is the reference dtype.
#[macro_export]
macro_rules! with_float_dtype {
    ($dtype:expr, $op:expr, $arg:expr, |$T:ident| $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F16 => {
                type $T = $crate::half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::half::bf16;
                $body
            }
            other => {
                return Err($crate::Error::arg(
                    $crate::ErrorCode::DType,
                    $op,
                    $arg,
                    "one of float32, float16, bfloat16",
                    other,
                ))
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_dlpack_codes() {
        assert_eq!(DType::BF16.size(), 2);
        assert_eq!(DType::BF16.dlpack(), (DLPACK_BFLOAT, 16));
        assert_eq!(DType::F16.dlpack(), (DLPACK_FLOAT, 16));
        for d in DType::ALL {
            let (c, b) = d.dlpack();
            assert_eq!(DType::from_dlpack(c, b).unwrap(), d);
            assert_eq!(DType::parse(d.name()).unwrap(), d);
        }
        assert_eq!(DType::parse("float8").unwrap_err().code(), ErrorCode::DType);
    }

    #[test]
    fn bf16_conversion_matches_half_crate() {
        // Walk a spread of bit patterns, including ties, subnormals, infinities and NaN.
        let mut bits = 0u32;
        while bits < u32::MAX - 0x0001_2345 {
            let v = f32::from_bits(bits);
            let ours = bf16::from_f32(v);
            let theirs = <bf16 as FloatElement>::from_f32(v);
            if v.is_nan() {
                assert!(theirs.is_nan());
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{v:e}");
            }
            bits += 0x0001_2345;
        }
        let src = [1.0f32, 1.0 + 1.0 / 256.0, -2.5, f32::INFINITY];
        let mut mid = [bf16::ZERO; 4];
        let mut back = [0f32; 4];
        bf16::narrow(&src, &mut mid);
        bf16::widen(&mid, &mut back);
        assert_eq!(back, [1.0, 1.0, -2.5, f32::INFINITY]);

        // The bulk (SIMD) narrow agrees bit for bit with the scalar one, NaNs included.
        let many: Vec<f32> = (0..4099u32)
            .map(|i| match i % 7 {
                0 => f32::NAN,
                1 => -f32::from_bits(i.wrapping_mul(0x9e37_79b9) >> 1),
                _ => f32::from_bits(i.wrapping_mul(0x9e37_79b9) >> 1),
            })
            .collect();
        let mut bulk = vec![bf16::ZERO; many.len()];
        bf16::narrow(&many, &mut bulk);
        for (v, b) in many.iter().zip(&bulk) {
            assert_eq!(b.to_bits(), f32_to_bf16_bits(*v), "{v:e}");
        }
    }

    /// Values a vector conversion could get wrong: subnormals (hardware conversions may flush them), the
    /// largest subnormal and smallest normal, ties, overflow to infinity, NaN — spread over
    /// several 16-lane groups plus a ragged tail.
    fn awkward_f32s() -> Vec<f32> {
        let mut v: Vec<f32> = (0..103).map(|i| (i as f32 - 51.0) * 0.37).collect();
        v[3] = f32::from_bits(1);
        v[17] = -f32::from_bits(0x007f_ffff);
        v[18] = f32::MIN_POSITIVE;
        v[40] = 1.0 + 1.0 / 256.0;
        v[41] = 65520.0;
        v[64] = f32::NAN;
        v[65] = -f32::INFINITY;
        v[101] = 3e-39;
        v
    }

    /// The AVX2 narrowings, called directly so that AVX-512 machines (which route around them)
    /// check them too: bit for bit the scalar conversion on the awkward values, on pseudo-random
    /// bit patterns of both signs, on ties to either side and on NaNs with payloads that plain
    /// rounding would carry into inf or past the sign bit. The even/odd form takes each 16 values
    /// split into its even and odd elements, as its callers widen them.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_bf16_narrowing_matches_the_scalar_one() {
        use std::arch::x86_64::{__m256i, _mm256_loadu_ps, _mm256_storeu_si256};
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let mut src = awkward_f32s();
        src.extend((0..4099u32).map(|i| f32::from_bits(i.wrapping_mul(0x9e37_79b9))));
        let edges = [0x7f80_0001u32, 0xff80_7fff, 0x7fc0_0000, 0x7f7f_ffff, 0x7fff_ffff, 0xffff_8000];
        src.extend(edges.into_iter().chain([0x3f80_8000, 0x3f81_8000, 0xbf80_8000, 0xbf81_8000]).map(f32::from_bits));
        let want = |v: &f32| f32_to_bf16_bits(*v);
        let mut bulk = vec![bf16::ZERO; src.len()];
        // SAFETY: AVX2 was detected above.
        unsafe { narrow_bf16_avx2(&src, &mut bulk) };
        for (v, b) in src.iter().zip(&bulk) {
            assert_eq!(b.to_bits(), want(v), "{v:e} ({:#010x})", v.to_bits());
        }
        // Padded to whole sixteens, so the edge values at the end are checked here too.
        src.resize(src.len().next_multiple_of(16), 0.0);
        for sixteen in src.chunks_exact(16) {
            let [even, odd]: [Vec<f32>; 2] = [0, 1].map(|k| sixteen.iter().skip(k).step_by(2).copied().collect());
            let mut got = [0u16; 16];
            // SAFETY: AVX2 was detected above; each Vec holds 8 f32, `got` 16 bf16.
            unsafe {
                let bits = bf16x16_even_odd_avx2(_mm256_loadu_ps(even.as_ptr()), _mm256_loadu_ps(odd.as_ptr()));
                _mm256_storeu_si256(got.as_mut_ptr() as *mut __m256i, bits);
            }
            assert_eq!(got.to_vec(), sixteen.iter().map(want).collect::<Vec<_>>(), "{sixteen:?}");
        }
    }

    /// The native (AVX512-BF16) step narrowing: bit for bit the scalar conversion on every value
    /// but f32 subnormals, which become zeros of their sign. (CPUs without it: nothing to check.)
    #[test]
    fn native_bf16_narrowing_matches_the_scalar_one_but_flushes_subnormals() {
        if !bf16::converts_natively() {
            return;
        }
        let mut src = awkward_f32s();
        src.extend((0..4099u32).map(|i| f32::from_bits(i.wrapping_mul(0x9e37_79b9))));
        src.extend([0x7f80_0001u32, 0xff80_7fff, 0x7fc0_0000, 0x7f7f_ffff, 0x8000_0001].map(f32::from_bits));
        for step in src.chunks_exact(64) {
            let step: &[f32; 64] = step.try_into().unwrap();
            // SAFETY: `converts_natively` was checked above.
            let out = unsafe { bf16::narrow_lanes_natively(*step) };
            for (v, b) in step.iter().zip(&out) {
                let want = if v.is_subnormal() { (v.to_bits() >> 16) as u16 & 0x8000 } else { f32_to_bf16_bits(*v) };
                assert_eq!(b.to_bits(), want, "{v:e} ({:#010x})", v.to_bits());
            }
        }
    }

    /// The native f16 step narrowing (AVX-512's `vcvtps2ph`) rounds exactly as the bit
    /// conversion, subnormals, overflow and ties included; NaNs stay NaNs. (CPUs without it:
    /// nothing to check.)
    #[test]
    fn native_f16_narrowing_matches_the_scalar_one() {
        if !f16::converts_natively() {
            return;
        }
        let mut src = awkward_f32s();
        src.extend((0..4099u32).map(|i| f32::from_bits(i.wrapping_mul(0x9e37_79b9))));
        src.extend((0..1024u32).map(|i| f32::from_bits(0x3300_0000 + i * 0x0001_1000)));
        for step in src.chunks_exact(64) {
            let step: &[f32; 64] = step.try_into().unwrap();
            // SAFETY: `converts_natively` was checked above.
            let out = unsafe { f16::narrow_lanes_natively(*step) };
            for (v, h) in step.iter().zip(&out) {
                if v.is_nan() {
                    assert!(h.is_nan(), "{v:e}");
                } else {
                    assert_eq!(h.to_bits(), f32_to_f16_bits(*v), "{v:e} ({:#010x})", v.to_bits());
                }
            }
        }
    }

    #[test]
    fn native_f16_widening_matches_the_bit_conversion_on_every_f16() {
        if !f16::converts_natively() {
            return;
        }
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        for step in all.chunks_exact(64) {
            let step: &[f16; 64] = step.try_into().unwrap();
            // SAFETY: `converts_natively` was checked above.
            let (lanes, one) = unsafe { (f16::widen_lanes_natively(step), step[7].to_f32_natively()) };
            assert_eq!(one.to_bits(), lanes[7].to_bits());
            for (h, w) in step.iter().zip(lanes) {
                let exact = f16_bits_to_f32(h.to_bits());
                if h.is_nan() {
                    // The instruction quiets signalling NaNs; sign and payload bits stay.
                    assert!(w.is_nan() && w.is_sign_negative() == h.is_sign_negative(), "{:#06x}", h.to_bits());
                    assert_eq!(w.to_bits() | 0x0040_0000, exact.to_bits() | 0x0040_0000, "{:#06x}", h.to_bits());
                } else {
                    assert_eq!(w.to_bits(), exact.to_bits(), "{:#06x}", h.to_bits());
                    assert_eq!(w, h.to_f64() as f32, "{:#06x}", h.to_bits());
                }
            }
        }
    }

    #[test]
    fn bulk_bf16_narrowing_is_exact_on_subnormals() {
        let src = awkward_f32s();
        let mut bulk = vec![bf16::ZERO; src.len()];
        bf16::narrow(&src, &mut bulk);
        for (v, b) in src.iter().zip(&bulk) {
            assert_eq!(b.to_bits(), f32_to_bf16_bits(*v), "{v:e}");
        }
    }

    #[test]
    fn bulk_f16_conversions_match_scalar_ones() {
        let src = awkward_f32s();
        let mut bulk = vec![f16::ZERO; src.len()];
        f16::narrow(&src, &mut bulk);
        for (v, h) in src.iter().zip(&bulk) {
            let want = f16::from_f32(*v);
            assert!(h.to_bits() == want.to_bits() || (v.is_nan() && h.is_nan()), "{v:e}: {h} vs {want}");
        }
        // Every f16 bit pattern widens exactly (subnormals, infinities and NaNs included).
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let mut wide = vec![0f32; all.len()];
        f16::widen(&all, &mut wide);
        for (h, w) in all.iter().zip(&wide) {
            assert!(w.to_bits() == h.to_f32().to_bits() || (h.is_nan() && w.is_nan()), "{h}");
        }
    }

    /// The by-value lane forms kernels step with agree bit for bit with the slice forms.
    fn lane_forms_match_slice_forms<T: FloatElement>() {
        let src = awkward_f32s();
        for step in src.chunks_exact(32) {
            let step: &[f32; 32] = step.try_into().unwrap();
            let narrowed = T::narrow_lanes(step);
            let mut want = [T::default(); 32];
            T::narrow(step, &mut want);
            assert!(narrowed.iter().zip(&want).all(|(a, b)| a == b || (a.to_f32().is_nan() && b.to_f32().is_nan())));
            let widened = T::widen_lanes(&narrowed);
            let mut want = [0f32; 32];
            T::widen(&narrowed, &mut want);
            assert!(widened.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())));
        }
    }

    #[test]
    fn branch_free_f16_conversions_match_half() {
        for h in (0..=u16::MAX).map(f16::from_bits) {
            let (got, want) = (f16_bits_to_f32(h.to_bits()), h.to_f32());
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{h}");
        }
        let mut bits = 0u32;
        let mut values = awkward_f32s();
        values.extend([65504.0, 65519.99, 65520.0, 1e9, 5.96e-8, 2.98e-8, 2.99e-8, 6.1e-5, 6.09e-5, -0.0]);
        loop {
            values.push(f32::from_bits(bits));
            bits = match bits.checked_add(0x1357) {
                Some(b) => b,
                None => break,
            };
        }
        for v in values {
            let (got, want) = (f16::from_bits(f32_to_f16_bits(v)), f16::from_f32(v));
            assert!(got.to_bits() == want.to_bits() || (v.is_nan() && got.is_nan()), "{v:e}: {got} vs {want}");
        }
    }

    #[test]
    fn lane_forms_match_slice_forms_for_every_float_type() {
        lane_forms_match_slice_forms::<f32>();
        lane_forms_match_slice_forms::<f16>();
        lane_forms_match_slice_forms::<bf16>();
    }
}
