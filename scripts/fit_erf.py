#!/usr/bin/env python3
"""Derives the rational erf approximation in crates/uniop-ops/src/math.rs.

erf(x) = x · P(x²) / Q(x²) on [0, 4] (past 4, erf(x) rounds to 1 in f32), P and Q of degree 5,
Q(0) = 1. Fitted by linearized least squares on the relative error of erf, reweighted toward
minimax (Loeffler's 1/Q and Lawson's error weights), in a scaled variable so the system is well
conditioned. Prints the coefficients for the kernel and the f64 error of the fit; the kernel's f32
error (rounding included) is checked by the tests in math.rs against libm. The kernel spells
P(0) as the constant 2/sqrt(pi), which the fit lands within an f32 ulp of.

Usage: python scripts/fit_erf.py   (NumPy only; not run by the build or the tests)
"""
import math

import numpy as np

CLAMP = 4.0
DEGREE_P, DEGREE_Q = 5, 5


def fit(rounds=60, points=4000):
    x = CLAMP * (1 - np.cos(np.linspace(0, np.pi, points))) / 2
    x = x[x > 0]
    s = (x / CLAMP) ** 2
    f = np.array([math.erf(v) / v for v in x])
    powers = np.vstack([s**i for i in range(max(DEGREE_P, DEGREE_Q) + 1)]).T
    # Unknowns p_0..p_DP, q_1..q_DQ: P(s) − f·(Q(s) − 1) = f.
    system = np.hstack([powers[:, : DEGREE_P + 1], -f[:, None] * powers[:, 1 : DEGREE_Q + 1]])
    lawson, q_prev, best = np.ones_like(s), np.ones_like(s), None
    for _ in range(rounds):
        weight = lawson / (q_prev * f)
        sol, *_ = np.linalg.lstsq(system * weight[:, None], f * weight, rcond=None)
        p, q = sol[: DEGREE_P + 1], np.concatenate([[1.0], sol[DEGREE_P + 1 :]])
        q_prev = powers[:, : DEGREE_Q + 1] @ q
        err = np.abs(powers[:, : DEGREE_P + 1] @ p / q_prev - f) / f
        if best is None or err.max() < best[0]:
            best = (err.max(), p, q)
        lawson = lawson * np.sqrt(err / err.max()) + 1e-12
        lawson /= lawson.sum()
    err, p, q = best
    # Back from s = x²/CLAMP² to powers of x².
    unscale = [CLAMP ** (-2 * i) for i in range(max(DEGREE_P, DEGREE_Q) + 1)]
    return err, [c * u for c, u in zip(p, unscale)], [c * u for c, u in zip(q, unscale)]


def main():
    err, p, q = fit()
    print(f"max relative error of the fit (f64): {err:.2e}")
    for name, coeffs in (("ERF_P", p), ("ERF_Q", q)):
        # Shortest literals that round-trip through f32 (Rust wants a digit after the point).
        literals = [np.format_float_scientific(np.float32(c), unique=True).replace(".e", ".0e") for c in coeffs]
        print(f"const {name}: [f32; {len(coeffs)}] = [{', '.join(literals)}];")


if __name__ == "__main__":
    main()
