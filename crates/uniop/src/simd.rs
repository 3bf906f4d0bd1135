//! Runtime SIMD dispatch on stable Rust.
//!
//! Kernels are written as plain loops over fixed-width chunks (`[f32; 16]` accumulators and
//! `chunks_exact`), which LLVM vectorizes well — *if* it may use wide registers. [`dispatch`] runs
//! a closure inside a function compiled for the best instruction set this CPU has (x86-64-v4 with
//! AVX-512, or v3 with AVX2/FMA); helpers the closure calls must be `#[inline(always)]` so they
//! are compiled there too. `UNIOP_SIMD=scalar|v3|v4` caps the level (for testing every path).

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Scalar,
    /// AVX2 + FMA + F16C (x86-64-v3).
    V3,
    /// AVX-512 F/BW/VL/DQ (x86-64-v4).
    V4,
}

impl Level {
    pub fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::V3 => "x86-64-v3 (AVX2+FMA)",
            Level::V4 => "x86-64-v4 (AVX-512)",
        }
    }
}

fn detect() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        let v3 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
        let v4 = v3
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512dq");
        if v4 {
            Level::V4
        } else if v3 {
            Level::V3
        } else {
            Level::Scalar
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    Level::Scalar
}

/// The level kernels run at: what the CPU has, capped by `UNIOP_SIMD`.
pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = match std::env::var("UNIOP_SIMD").as_deref() {
            Ok("scalar") => Level::Scalar,
            Ok("v3") => Level::V3,
            _ => Level::V4,
        };
        detect().min(cap)
    })
}

/// Runs `f` compiled for the best available instruction set.
#[inline(always)]
pub fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        match level() {
            // SAFETY: the level was detected at runtime, so the CPU supports these features.
            Level::V4 => unsafe { run_v4(f) },
            Level::V3 => unsafe { run_v3(f) },
            Level::Scalar => f(),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi1,bmi2,lzcnt,popcnt")]
unsafe fn run_v4<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,bmi1,bmi2,lzcnt,popcnt")]
unsafe fn run_v3<R>(f: impl FnOnce() -> R) -> R {
    f()
}
