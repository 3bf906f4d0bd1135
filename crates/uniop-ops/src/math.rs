//! Vectorizable math for kernels. `f32::exp` calls libm per element and blocks vectorization;
//! these are branch-free polynomial versions that LLVM turns into SIMD inside `simd::dispatch`.
//! Functions generic over `T: Element` are for results stored as `T`: for 16-bit types they use
//! [`exp_coarse`], whose error is far below what the storage keeps.

use uniop::Element;

/// Sum of a kernel's partial-sum lanes, combined pairwise: log2(N) dependent steps that LLVM
/// turns into vector shuffles, where `iter().sum()` is a chain of N dependent scalar adds (float
/// addition is not reassociated). That chain is ~200 cycles for 64 lanes: a row cost that
/// dominated rms_norm on 384-wide rows (512x384 bf16: 68 µs on one thread, 15 of them the row data).
#[inline(always)]
pub fn sum_lanes<const N: usize>(lanes: [f32; N]) -> f32 {
    combine_lanes(lanes, |a, b| a + b)
}

/// Maximum of a kernel's partial-maximum lanes, pairwise (see [`sum_lanes`]); NaN lanes are
/// skipped, as `f32::max` does.
#[inline(always)]
pub fn max_lanes<const N: usize>(lanes: [f32; N]) -> f32 {
    combine_lanes(lanes, f32::max)
}

/// `lanes` folded pairwise with `f` (see [`sum_lanes`]).
#[inline(always)]
pub(crate) fn combine_lanes<const N: usize>(mut lanes: [f32; N], f: impl Fn(f32, f32) -> f32) -> f32 {
    const { assert!(N.is_power_of_two(), "lane counts are powers of two") };
    let mut half = N / 2;
    while half > 0 {
        for i in 0..half {
            lanes[i] = f(lanes[i], lanes[i + half]);
        }
        half /= 2;
    }
    lanes[0]
}

/// `c[0] + c[1]·x + … + c[5]·x⁵` given `x2 = x·x`, in Estrin's order: three FMAs deep instead
/// of Horner's five. The elementwise kernels that call these are bound by dependency chains, not
/// by op count: on Zen 3 gelu_backward's loop kept only about two 8-lane vectors in flight, each
/// waiting on exp's and erf's long Horner chains.
#[inline(always)]
fn estrin(x: f32, x2: f32, c: [f32; 6]) -> f32 {
    let (lo, mid, hi) = (c[1].mul_add(x, c[0]), c[3].mul_add(x, c[2]), c[5].mul_add(x, c[4]));
    hi.mul_add(x2, mid).mul_add(x2, lo)
}

/// e^x in f32, relative error ≈ 2 ulp over [-87, 88]; saturates above 88 and is exactly 0 from
/// about −87.7 down (see [`times_pow2`]), −∞ included.
///
/// Written for the op count and the chain length of the vectorized loop, which bound the
/// elementwise kernels that call it on AVX2 (its polynomial in Estrin's order, `estrin`):
/// `k = round(x·log2 e)` comes out of one FMA
/// with the 1.5·2²³ shift, which also leaves `k` in the low mantissa bits for building 2^k (no
/// float→int conversion, which Rust makes saturating and scalar); the reduction `x − k·ln 2` is
/// two FMAs (Cody–Waite: ln 2 split in a short high part, exact in `k·hi`, and the rest).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(EXP_LOW, 88.0);
    let shifted = x.mul_add(LOG2E, EXP_SHIFT);
    let k = shifted - EXP_SHIFT;
    let r = (-k).mul_add(LN2_HI, x);
    let r = (-k).mul_add(LN2_LO, r);
    // Cephes expf minimax polynomial; `mul_add` is one FMA in the AVX2/AVX-512 kernel builds.
    let r2 = r * r;
    let p = estrin(r, r2, [0.5, 1.666_666_5e-1, 4.166_579_6e-2, 8.333_452e-3, 1.398_199_9e-3, 1.987_569_1e-4]);
    times_pow2(p.mul_add(r2, r), shifted)
}

/// The exps' lower clamp: x·log2 e rounds to k = −127 there, whose 2^k [`times_pow2`] builds as 0.
pub(crate) const EXP_LOW: f32 = -88.0;

/// 1.5·2²³: adding it to x·log2 e rounds that to an integer k, left in the low mantissa bits.
pub(crate) const EXP_SHIFT: f32 = 12_582_912.0;

/// What [`times_pow2`] subtracts from the shifted value's bits to leave k + 127, 2^k's exponent
/// bits.
pub(crate) const POW2_BIAS: u32 = EXP_SHIFT.to_bits() - 127;

/// `(1 + t)·2^k` in one FMA, with `k` in `shifted`'s low mantissa bits (`x·log2 e +`
/// [`EXP_SHIFT`]) and 2^k built as the exponent bits `k + 127`, bit for bit `(1 + t)` rounded
/// and then scaled wherever the result is a normal number. At k = −127 (x clamped to
/// [`EXP_LOW`]) those bits are 0 and so is the result: masked (−∞) scores get probabilities of
/// exactly 0, as in torch, not the clamp's near-least-normal value, which softmax's `1/sum` turned
/// into subnormal products that each took a microcode assist (bf16 softmax `[4096, 4096]` with
/// half of each row masked: 7.1 ms against 5.7 unmasked).
#[inline(always)]
fn times_pow2(t: f32, shifted: f32) -> f32 {
    let scale = f32::from_bits(shifted.to_bits().wrapping_sub(POW2_BIAS) << 23);
    t.mul_add(scale, scale)
}

/// tanh's odd Taylor series through x¹¹, as coefficients of powers of x².
const TANH_SERIES: [f32; 6] = [1.0, -1.0 / 3.0, 2.0 / 15.0, -17.0 / 315.0, 62.0 / 2835.0, -1382.0 / 155_925.0];

/// tanh(x) in f32 to about 2 ulp, branch-free (both forms are computed and one is selected, so a
/// loop of it vectorizes): below |x| = 0.3 its odd Taylor series through x¹¹ (the next term is
/// under 1e-8 of the result there), above it `1 − 2/(e^{2|x|} + 1)` with x's sign, where the
/// subtraction cancels at most 1.3 bits. NaN for NaN; ±1 from |x| ≈ 9 on.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let s = x * x;
    let near = x * estrin(s, s * s, TANH_SERIES);
    let far = (1.0 - 2.0 / (exp(2.0 * a) + 1.0)).copysign(x);
    if a < 0.3 {
        near
    } else {
        far
    }
}

/// e^x to about 1e-5 relative error (9.4e-6 measured over [-87, 0]), for results that are
/// stored as f16 or bf16, whose rounding is coarser by 100x (f16) to 400x (bf16): the error
/// changes a stored result by one unit in its last place in at most about 1% (f16) or 0.25%
/// (bf16) of the elements where it lands near a rounding boundary.
/// Saturates above 88; exactly 0 from about −87.7 down, as [`exp`].
///
/// Cheaper than [`exp`] on the FMA pipes, which bound the exp loops on AVX-512 (Zen 4 runs each
/// 512-bit FMA as two 256-bit halves): 7 multiply-class ops instead of 11 — a degree-4
/// polynomial fitted for relative error with its first two terms exact (`1 + r`) and a
/// one-constant reduction.
#[inline(always)]
pub fn exp_coarse(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2: f32 = std::f32::consts::LN_2;
    let x = x.clamp(EXP_LOW, 88.0);
    let shifted = x.mul_add(LOG2E, EXP_SHIFT);
    let k = shifted - EXP_SHIFT;
    let r = (-k).mul_add(LN2, x);
    let r2 = r * r;
    let q = 4.127_732e-2f32.mul_add(r2, 1.675_342_8e-1f32.mul_add(r, 0.500_051_1));
    times_pow2(q.mul_add(r2, r), shifted)
}

/// [`exp_coarse`] for results stored as a 16-bit `T` (f16, bf16), [`exp`] for any wider one.
#[inline(always)]
pub fn exp_for<T: Element>(x: f32) -> f32 {
    if T::DTYPE.size() == 2 {
        exp_coarse(x)
    } else {
        exp(x)
    }
}

/// silu(x) = x · sigmoid(x), for a result stored as `T` (its exp: [`exp_for`]).
#[inline(always)]
pub fn silu<T: Element>(x: f32) -> f32 {
    x / (1.0 + exp_for::<T>(-x))
}

/// Below this, [`sigmoid`] is taken as 0: it is under 1.6e-28 there, and the products it scales
/// (silu's gradient `d · u · s`, under 1e-25 · |d · u|) would otherwise fall to subnormal numbers
/// for a share of a wide input's elements (|x| in the tens: gates of unnormalised inputs), each of
/// which costs a microcode assist — silu_mul_backward over 2048 × 11008 bf16 gates of standard
/// deviation 64 ran 135 ms against 11 at deviation 1 to 16.
const SIGMOID_ZERO_BELOW: f32 = -64.0;

/// sigmoid(x) = 1 / (1 + e^-x), for a result stored as `T`; 0 below [`SIGMOID_ZERO_BELOW`].
#[inline(always)]
pub fn sigmoid<T: Element>(x: f32) -> f32 {
    if x < SIGMOID_ZERO_BELOW {
        0.0
    } else {
        1.0 / (1.0 + exp_for::<T>(-x))
    }
}

/// tanh(x) as a fraction `(n, d)`, `n / d` = tanh(x) and `d` in [1, 2], for a result stored as
/// `T` (its exp: [`exp_for`]): for code that takes several quotients and can join their
/// divisions into one (a division is among the costliest ops of these loops). Below |x| = 0.3 the series
/// of [`tanh`] over 1, above it `(1 − e^{−2|x|}) / (1 + e^{−2|x|})` with x's sign (cancelling at
/// most 1.3 bits). NaN for NaN.
#[inline(always)]
pub fn tanh_fraction<T: Element>(x: f32) -> (f32, f32) {
    let s = x * x;
    let near = x * estrin(s, s * s, TANH_SERIES);
    let e = exp_for::<T>(-2.0 * x.abs());
    if x.abs() < 0.3 {
        (near, 1.0)
    } else {
        ((1.0 - e).copysign(x), 1.0 + e)
    }
}

/// sigmoid(x) as a fraction `(n, d)` (see [`tanh_fraction`]): `n` 1, or 0 where [`sigmoid`] is
/// 0; `d = 1 + e^−x` with the exponent bounded by 64, so that `d` stays below 1e28 and products of
/// a few such denominators stay finite.
#[inline(always)]
pub fn sigmoid_fraction<T: Element>(x: f32) -> (f32, f32) {
    let d = 1.0 + exp_for::<T>((-x).min(-SIGMOID_ZERO_BELOW));
    (if x < SIGMOID_ZERO_BELOW { 0.0 } else { 1.0 }, d)
}

/// d silu(g)/dg = s · (1 + g · (1 − s)) with s = sigmoid(g), given s.
#[inline(always)]
fn silu_grad_of(g: f32, s: f32) -> f32 {
    s * (1.0 + g * (1.0 - s))
}

/// d silu(x)/dx, for a result stored as `T`.
#[inline(always)]
pub fn silu_grad<T: Element>(x: f32) -> f32 {
    silu_grad_of(x, sigmoid::<T>(x))
}

/// Gradients of `silu(g) · u` for upstream `d`: returns `(d_g, d_u)`.
#[inline(always)]
pub fn silu_mul_grad<T: Element>(d: f32, g: f32, u: f32) -> (f32, f32) {
    let s = sigmoid::<T>(g);
    (d * u * silu_grad_of(g, s), d * g * s)
}

/// `|erf(x)|` = |x|·P(x²)/Q(x²) for |x| ≤ 4 (beyond, 1 in f32), branch-free; absolute error
/// ≤ 4e-7 with f32 rounding; NaN for NaN. The magnitude only: gelu, its caller, folds the sign
/// away. A rational form rather than the usual `1 − t·poly(t)·e^(−x²)` (Abramowitz & Stegun
/// 7.1.26, t = 1/(1 + px)) because that needs a division *and* an exp: this one is ten FMAs and
/// one division, which halves gelu's compute. Coefficients from `scripts/fit_erf.py` (a
/// minimax-weighted least-squares fit of erf's relative error).
#[inline(always)]
fn erf_abs(x: f32) -> f32 {
    // P(0) is erf'(0) = 2/√pi (the fit lands within an ulp of it).
    const ERF_P: [f32; 6] =
        [std::f32::consts::FRAC_2_SQRT_PI, 1.9353212e-01, 5.3099733e-02, 3.882705e-03, 2.84538e-04, 1.986709e-06];
    const ERF_Q: [f32; 6] = [1.0e+00, 5.048459e-01, 1.1534438e-01, 1.5205983e-02, 1.1853907e-03, 3.7417944e-05];
    // `if` rather than `f32::min`: one `vminps` that keeps a NaN (min() would add a NaN fix-up).
    let at_most = |v: f32, cap: f32| if v > cap { cap } else { v };
    let a = at_most(x.abs(), 4.0);
    let s = a * a;
    let s2 = s * s;
    // The fit may overshoot 1 by an ulp or two near the clamp; erf never does.
    at_most(a * estrin(s, s2, ERF_P) / estrin(s, s2, ERF_Q), 1.0)
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_CUBIC: f32 = 0.044_715;

/// gelu(x): `x·Φ(x)` exactly (`tanh_approx = false`) or with the tanh approximation, written
/// as `x·sigmoid(2u)` (= `0.5x(1 + tanh u)` without the cancellation of `1 + tanh u` at large −x).
#[inline(always)]
pub fn gelu<T: Element>(x: f32, tanh_approx: bool) -> f32 {
    if tanh_approx {
        x * sigmoid::<T>(2.0 * SQRT_2_OVER_PI * GELU_CUBIC.mul_add(x * x * x, x))
    } else {
        // x/2 + x/2·erf(x/√2) as one FMA; x/2 and erf share their sign, so the product is
        // |x/2|·|erf| and erf's copysign drops out.
        let half = 0.5 * x;
        half.abs().mul_add(erf_abs(x * std::f32::consts::FRAC_1_SQRT_2), half)
    }
}

/// d gelu(x) / dx for the same two forms.
#[inline(always)]
pub fn gelu_grad<T: Element>(x: f32, tanh_approx: bool) -> f32 {
    if tanh_approx {
        // With s = sigmoid(2u): 0.5(1 + tanh u) = s and 1 − tanh²u = 4s(1 − s).
        let s = sigmoid::<T>(2.0 * SQRT_2_OVER_PI * GELU_CUBIC.mul_add(x * x * x, x));
        s + 2.0 * x * s * (1.0 - s) * SQRT_2_OVER_PI * (3.0 * GELU_CUBIC).mul_add(x * x, 1.0)
    } else {
        // Φ(x) + x·φ(x), with Φ built from φ (Abramowitz & Stegun 26.2.17, |error| < 7.5e-8):
        // Φ(|x|) = 1 − φ(x)·t·B(t), t = 1/(1 + 0.2316419·|x|). One division and a degree-4
        // polynomial that share φ's exp, instead of erf's rational function beside it.
        const B: [f32; 5] = [0.319_381_53, -0.356_563_78, 1.781_477_9, -1.821_256, 1.330_274_4];
        // φ(x) = e^(−x²/2 + ln(1/√(2π))): the normalization rides in exp's argument (one FMA).
        const LN_INV_SQRT_2PI: f32 = -0.918_938_5;
        // Past |x| = 12, φ(x) < 2.2e-32 and x·φ(x) and the tail are taken as 0: as exp nears its
        // floor, the tail's product would fall to a subnormal number, whose microcode assist made
        // gelu_backward over 2048 × 11008 bf16 inputs of standard deviation 64 take 121 ms
        // against 8 at deviation 1.
        let pdf = if x.abs() > 12.0 { 0.0 } else { exp_for::<T>((x * x).mul_add(-0.5, LN_INV_SQRT_2PI)) };
        let t = 1.0 / 0.231_641_9f32.mul_add(x.abs(), 1.0);
        let t2 = t * t;
        let b = B[4].mul_add(t2, B[3].mul_add(t, B[2])).mul_add(t2, B[1].mul_add(t, B[0]));
        let tail = pdf * t * b;
        let cdf = if x >= 0.0 { 1.0 - tail } else { tail };
        x.mul_add(pdf, cdf)
    }
}

/// Largest |angle| [`sin_cos`] is written for: `k = round(a·2/π)` stays under 2²⁰, so its
/// products with the two leading parts of π/2 (31 and 32 significant bits) are exact.
pub const SIN_COS_MAX: f64 = 1.5e6;

/// `(sin a, cos a)` in f64 for |a| ≤ [`SIN_COS_MAX`], within a few f64 ulps of libm's (rounded
/// to f32, within one f32 ulp: tested). Branch-free, so a loop over it vectorizes (std's
/// `sin`/`cos` are libm calls per element: rope_cos_sin spent ~12 ns on each). `k = round(a·2/π)`
/// comes out of the 1.5·2⁵² shift, which also leaves `k mod 4` (the quadrant) in the low mantissa
/// bits; `a − k·π/2` is Cody–Waite with π/2 in three parts (the first two short enough that their
/// products with `k` are exact); fdlibm's minimax polynomials take sin and cos on [−π/4, π/4],
/// and the quadrant swaps and negates them.
#[inline(always)]
pub fn sin_cos(a: f64) -> (f64, f64) {
    const SHIFT: f64 = 6_755_399_441_055_744.0; // 1.5 · 2^52
    const PIO2_HI: f64 = 1.570_796_326_734_125_6;
    const PIO2_MID: f64 = 6.077_100_506_303_966e-11;
    const PIO2_LO: f64 = 2.022_266_248_711_166_5e-21;
    const S: [f64; 6] = [
        -1.666_666_666_666_663_2e-1,
        8.333_333_333_322_49e-3,
        -1.984_126_982_985_795e-4,
        2.755_731_370_707_006_8e-6,
        -2.505_076_025_340_686_3e-8,
        1.589_690_995_211_55e-10,
    ];
    const C: [f64; 6] = [
        4.166_666_666_666_66e-2,
        -1.388_888_888_887_411e-3,
        2.480_158_728_947_673e-5,
        -2.755_731_435_139_066_3e-7,
        2.087_572_321_298_175e-9,
        -1.135_964_755_778_819_5e-11,
    ];
    let shifted = a.mul_add(std::f64::consts::FRAC_2_PI, SHIFT);
    let quadrant = shifted.to_bits() & 3;
    let k = shifted - SHIFT;
    let r = ((a - k * PIO2_HI) - k * PIO2_MID) - k * PIO2_LO;
    let z = r * r;
    let horner =
        |c: [f64; 6]| c[5].mul_add(z, c[4]).mul_add(z, c[3]).mul_add(z, c[2]).mul_add(z, c[1]).mul_add(z, c[0]);
    let sin_r = (z * r).mul_add(horner(S), r);
    let cos_r = (z * z).mul_add(horner(C), (-0.5f64).mul_add(z, 1.0));
    // Quadrant q: sin a = (sin r, cos r, −sin r, −cos r)[q], cos a = (cos r, −sin r, −cos r, sin r)[q].
    let (sin_a, cos_a) = if quadrant & 1 == 0 { (sin_r, cos_r) } else { (cos_r, sin_r) };
    let negate = |v: f64, sign: u64| f64::from_bits(v.to_bits() ^ (sign & 2) << 62);
    (negate(sin_a, quadrant), negate(cos_a, quadrant + 1))
}

/// f64 versions for references.
pub mod exact {
    unsafe extern "C" {
        /// C99 `erf` from the system libm (std links it on every platform we build for).
        safe fn erf(x: f64) -> f64;
    }

    /// The error function, from libm (an implementation independent of gelu's `erf_abs`).
    pub fn erf_f64(x: f64) -> f64 {
        erf(x)
    }

    pub fn gelu(x: f64, tanh_approx: bool) -> f64 {
        if tanh_approx {
            0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
        } else {
            0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))
        }
    }
    pub fn gelu_grad(x: f64, tanh_approx: bool) -> f64 {
        if tanh_approx {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let t = (c * (x + 0.044715 * x.powi(3))).tanh();
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
        } else {
            let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
            0.5 * (1.0 + erf(x / std::f64::consts::SQRT_2)) + x * pdf
        }
    }
    pub fn sigmoid(x: f64) -> f64 {
        1.0 / (1.0 + (-x).exp())
    }
    pub fn silu(x: f64) -> f64 {
        x * sigmoid(x)
    }
    pub fn silu_grad(x: f64) -> f64 {
        let s = sigmoid(x);
        s * (1.0 + x * (1.0 - s))
    }
    pub fn silu_mul_grad(d: f64, g: f64, u: f64) -> (f64, f64) {
        (d * u * silu_grad(g), d * g * sigmoid(g))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sin_cos_is_libms_to_a_few_ulps_over_its_range() {
        // Every quadrant, both signs, the points next to multiples of π/2 and the range's ends.
        let near_quarters = (0..1300).flat_map(|k| {
            let q = k as f64 * std::f64::consts::FRAC_PI_2 * 731.0;
            [q, q.next_up(), q.next_down(), -q]
        });
        let sweep = (0..20_000).map(|i| (i as f64 * 0.618_034).mul_add(75.0, -7.5e5));
        for a in near_quarters.chain(sweep).chain([0.0, -0.0, super::SIN_COS_MAX, -super::SIN_COS_MAX]) {
            let (s, c) = super::sin_cos(a);
            assert!((s - a.sin()).abs() <= 4e-16, "sin {a}: {s} vs {}", a.sin());
            assert!((c - a.cos()).abs() <= 4e-16, "cos {a}: {c} vs {}", a.cos());
        }
    }

    #[test]
    fn tanh_is_within_a_few_ulps_of_f64_tanh_on_both_forms() {
        // Both sides of the switch at 0.3, the tiny, the saturated, and a sweep over both signs.
        let around_switch = (0..2000).map(|i| 0.29 + i as f32 * 1e-5);
        let sweep = (0..40_000).map(|i| (i as f32 - 20_000.0) * 6e-4);
        for x in around_switch.chain(sweep).chain([0.0, -0.0, 1e-30, -1e-7, 9.5, -40.0, 1e30, f32::INFINITY]) {
            let (got, want) = (super::tanh(x), (x as f64).tanh());
            let ulp = (want.abs() as f32).max(f32::MIN_POSITIVE).next_up() - (want.abs() as f32).max(f32::MIN_POSITIVE);
            assert!((got as f64 - want).abs() <= 3.0 * ulp as f64, "tanh {x}: {got} vs {want}");
            assert_eq!(got.is_sign_negative(), x.is_sign_negative(), "tanh {x}: sign of {got}");
        }
        assert!(super::tanh(f32::NAN).is_nan());
    }

    #[test]
    fn lanes_combine_to_their_sum_and_maximum() {
        let lanes: [f32; 64] = std::array::from_fn(|i| (i as f32 * 0.37).sin() * 100.0);
        let want: f64 = lanes.iter().map(|&v| v as f64).sum();
        assert!((super::sum_lanes(lanes) as f64 - want).abs() < 1e-3, "{} vs {want}", super::sum_lanes(lanes));
        let max = lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(super::max_lanes(lanes), max);
        // As `f32::max`: a NaN lane is skipped, and lanes that saw nothing stay -inf.
        let mut with_nan = lanes;
        with_nan[5] = f32::NAN;
        assert_eq!(super::max_lanes(with_nan), max);
        assert_eq!(super::max_lanes([f32::NEG_INFINITY; 16]), f32::NEG_INFINITY);
        assert_eq!(super::sum_lanes([0.5f32; 16]), 8.0);
    }

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let got = super::exp(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max((got - want).abs() / want);
            x += 0.0137;
        }
        assert!(worst < 4.0 * f32::EPSILON as f64, "worst relative error {worst:e}");
        assert_underflows_to_zero(super::exp);
        assert!(super::silu::<f32>(-200.0).abs() < 1e-30 && super::silu::<f32>(200.0) == 200.0);
    }

    /// Below −87 (e^x under f32's least normal number from about −87.3): within that least normal
    /// value of e^x and never negative, then exactly 0 — −∞ (a masked score) included.
    fn assert_underflows_to_zero(exp: fn(f32) -> f32) {
        let mut x = -87.0f32;
        while x > -90.0 {
            let got = exp(x);
            assert!(got >= 0.0 && (got as f64 - (x as f64).exp()).abs() < f32::MIN_POSITIVE as f64, "e^{x} = {got:e}");
            x -= 0.003;
        }
        for x in [-87.8, -88.0, -1000.0, f32::MIN, f32::NEG_INFINITY] {
            assert_eq!(exp(x).to_bits(), 0, "e^{x}");
        }
    }

    /// Within 1e-5 everywhere (so within a hundredth of an f16 unit, a 400th of a bf16 one), and
    /// the stored 16-bit results agree with the accurate exp's in nearly every element.
    #[test]
    fn coarse_exp_is_accurate_enough_for_16_bit_results() {
        use uniop::half::{bf16, f16};
        let (mut worst, mut f16_differ, mut bf16_differ, mut n) = (0.0f64, 0, 0, 0);
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, fine) = (super::exp_coarse(x), super::exp(x));
            let want = (x as f64).exp();
            worst = worst.max((got as f64 - want).abs() / want);
            f16_differ += (f16::from_f32(got) != f16::from_f32(fine)) as usize;
            bf16_differ += (bf16::from_f32(got) != bf16::from_f32(fine)) as usize;
            n += 1;
            x += 0.000_37;
        }
        assert!(worst < 1e-5, "worst relative error {worst:e}");
        assert!(f16_differ * 100 < n && bf16_differ * 400 < n, "{f16_differ} f16 and {bf16_differ} bf16 of {n}");
        assert_underflows_to_zero(super::exp_coarse);
        assert!(super::exp_coarse(88.0).is_finite());
        assert_eq!(super::exp_coarse(0.0), 1.0);
        // NaN stays NaN, including NaNs widened from f16/bf16 with payloads.
        for nan in [f32::NAN, -f32::NAN, f16::from_bits(0x7e01).to_f32(), bf16::from_bits(0xffc1).to_f32()] {
            assert!(super::exp_coarse(nan).is_nan() && super::exp_coarse(nan - 1.0).is_nan(), "{:#x}", nan.to_bits());
        }
    }

    #[test]
    fn erf_is_accurate_bounded_and_keeps_nan() {
        // Every 2^-14 over [-6, 6]: past the clamp at 4, through the fit's worst region (3–4).
        for i in -(6 << 14)..=(6 << 14) {
            let x = i as f32 / (1 << 14) as f32;
            let (got, want) = (super::erf_abs(x), super::exact::erf_f64(x as f64).abs());
            assert!((got as f64 - want).abs() < 4e-7 && got <= 1.0, "|erf({x})| = {got}, want {want}");
        }
        assert!(super::erf_abs(f32::NAN).is_nan() && super::gelu::<f32>(f32::NAN, false).is_nan());
        assert_eq!((super::erf_abs(f32::INFINITY), super::erf_abs(f32::NEG_INFINITY)), (1.0, 1.0));
        assert_eq!(super::erf_abs(-0.0), 0.0);
        assert_eq!(super::erf_abs(-1e-30), 1e-30 * std::f32::consts::FRAC_2_SQRT_PI);
    }

    #[test]
    fn erf_and_gelu_match_f64() {
        use uniop::half::{bf16, f16};
        for i in -800..=800 {
            let x = i as f32 * 0.01;
            for tanh in [false, true] {
                let (g, w) = (super::gelu::<f32>(x, tanh) as f64, super::exact::gelu(x as f64, tanh));
                assert!((g - w).abs() < 1e-6 * (1.0 + w.abs()), "gelu({x}, {tanh}): {g} vs {w}");
                let (g, w) = (super::gelu_grad::<f32>(x, tanh) as f64, super::exact::gelu_grad(x as f64, tanh));
                assert!((g - w).abs() < 1e-6 * (1.0 + w.abs()), "gelu'({x}, {tanh}): {g} vs {w}");
                // For 16-bit results (coarse exp): within 1e-5, a hundredth of an f16 unit.
                let (g, w) = (super::gelu_grad::<bf16>(x, tanh) as f64, super::exact::gelu_grad(x as f64, tanh));
                assert!((g - w).abs() < 1e-5 * (1.0 + w.abs()), "bf16 gelu'({x}, {tanh}): {g} vs {w}");
                let (g, w) = (super::silu::<f16>(x) as f64, super::exact::silu(x as f64));
                assert!((g - w).abs() < 1e-5 * (1.0 + w.abs()), "f16 silu({x}): {g} vs {w}");
                let (g, w) =
                    (super::silu_mul_grad::<bf16>(1.5, x, -0.5), super::exact::silu_mul_grad(1.5, x as f64, -0.5));
                assert!((g.0 as f64 - w.0).abs() < 1e-5 * (1.0 + w.0.abs()), "bf16 silu_mul_grad({x}): {g:?} vs {w:?}");
            }
        }
    }
}
