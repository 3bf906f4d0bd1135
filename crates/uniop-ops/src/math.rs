//! Vectorizable math for kernels. `f32::exp` calls libm per element and blocks vectorization;
//! these are branch-free polynomial versions that LLVM turns into SIMD inside `simd::dispatch`.

/// e^x in f32, relative error ≈ 2 ulp over the range; saturates outside [-87, 88].
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let k = (x * LOG2E + 0.5).floor();
    let r = x - k * LN2_HI - k * LN2_LO;
    // Cephes expf minimax polynomial.
    // `mul_add` becomes one FMA in the AVX2/AVX-512 kernel builds.
    let mut p = 1.987_569_1e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let y = (p * r).mul_add(r, r) + 1.0;
    // 2^k built from bits. `k as i32` would be a saturating (scalar) conversion; adding 1.5·2^23
    // instead puts k in the low mantissa bits, which stays a vector integer op.
    const MAGIC: f32 = 12_582_912.0;
    let k_bits = (k + MAGIC).to_bits().wrapping_sub(MAGIC.to_bits());
    let scale = f32::from_bits(k_bits.wrapping_add(127) << 23);
    y * scale
}

/// silu(x) = x · sigmoid(x).
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// sigmoid(x) = 1 / (1 + e^-x).
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// Gradients of `silu(g) · u` for upstream `d`: returns `(d_g, d_u)`.
/// d silu(g)/dg = s · (1 + g · (1 − s)) with s = sigmoid(g).
#[inline(always)]
pub fn silu_mul_grad(d: f32, g: f32, u: f32) -> (f32, f32) {
    let s = sigmoid(g);
    (d * u * s * (1.0 + g * (1.0 - s)), d * g * s)
}

/// f64 versions for references.
pub mod exact {
    pub fn sigmoid(x: f64) -> f64 {
        1.0 / (1.0 + (-x).exp())
    }
    pub fn silu(x: f64) -> f64 {
        x * sigmoid(x)
    }
    pub fn silu_mul_grad(d: f64, g: f64, u: f64) -> (f64, f64) {
        let s = sigmoid(g);
        (d * u * s * (1.0 + g * (1.0 - s)), d * g * s)
    }
}

#[cfg(test)]
mod tests {
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
        assert_eq!(super::exp(-1000.0), super::exp(-87.0));
        assert!(super::silu(-200.0).abs() < 1e-30 && super::silu(200.0) == 200.0);
    }
}
