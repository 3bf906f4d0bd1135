//! Transposing 32-bit words, the step GEMMs need to turn an operand that is dense along k (a
//! row-major x, a weight in HF's `[out, in]` layout) into the layout their kernels stream.
//!
//! Done one word at a time, a transpose is a scattered store per word: it was a fifth of a bf16
//! linear's time. In AVX2 registers it goes 8 × 8 words at a time (24 shuffles for 64 words), and
//! only the ragged edges take the scalar loop.

/// `dst[p * dst_stride + j] = word p of line j`, for `lines` lines of `words` 32-bit words each,
/// line `j` starting `j · line_bytes` bytes after `src` (words need not be aligned).
///
/// # Safety
/// `src` readable and `dst` writable for those extents, and not overlapping.
pub(crate) unsafe fn transpose_words(
    dst: *mut u32,
    dst_stride: usize,
    src: *const u8,
    line_bytes: isize,
    lines: usize,
    words: usize,
) {
    let (lines8, words8) = if has_avx2() { (lines / 8 * 8, words / 8 * 8) } else { (0, 0) };
    if lines8 > 0 && words8 > 0 {
        by_8x8(dst, dst_stride, src, line_bytes, lines8, words8);
    }
    // The ragged edges: words past the last whole 8 of every line, and the lines past the last 8.
    for j in 0..lines {
        let line = src.offset(j as isize * line_bytes) as *const u32;
        let from = if j < lines8 { words8 } else { 0 };
        for p in from..words {
            *dst.add(p * dst_stride + j) = line.add(p).read_unaligned();
        }
    }
}

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| is_x86_feature_detected!("avx2"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// [`transpose_words`] for `lines` and `words` both multiples of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn by_8x8(dst: *mut u32, dst_stride: usize, src: *const u8, line_bytes: isize, lines: usize, words: usize) {
    use std::arch::x86_64::*;
    for j in (0..lines).step_by(8) {
        for p in (0..words).step_by(8) {
            let row =
                |i: usize| _mm256_loadu_si256(src.offset((j + i) as isize * line_bytes).add(4 * p) as *const __m256i);
            let (r0, r1, r2, r3, r4, r5, r6, r7) = (row(0), row(1), row(2), row(3), row(4), row(5), row(6), row(7));
            // Pairs of lines interleaved, then quads: u[q] holds words q and q + 4 of lines 0-3
            // (v[q] of lines 4-7); their 128-bit halves then give word q of all 8 lines.
            let (t0, t1) = (_mm256_unpacklo_epi32(r0, r1), _mm256_unpackhi_epi32(r0, r1));
            let (t2, t3) = (_mm256_unpacklo_epi32(r2, r3), _mm256_unpackhi_epi32(r2, r3));
            let (t4, t5) = (_mm256_unpacklo_epi32(r4, r5), _mm256_unpackhi_epi32(r4, r5));
            let (t6, t7) = (_mm256_unpacklo_epi32(r6, r7), _mm256_unpackhi_epi32(r6, r7));
            let u = [
                _mm256_unpacklo_epi64(t0, t2),
                _mm256_unpackhi_epi64(t0, t2),
                _mm256_unpacklo_epi64(t1, t3),
                _mm256_unpackhi_epi64(t1, t3),
            ];
            let v = [
                _mm256_unpacklo_epi64(t4, t6),
                _mm256_unpackhi_epi64(t4, t6),
                _mm256_unpacklo_epi64(t5, t7),
                _mm256_unpackhi_epi64(t5, t7),
            ];
            let out = dst.add(p * dst_stride + j);
            for q in 0..4 {
                let (low, high) =
                    (_mm256_permute2x128_si256::<0x20>(u[q], v[q]), _mm256_permute2x128_si256::<0x31>(u[q], v[q]));
                _mm256_storeu_si256(out.add(q * dst_stride) as *mut __m256i, low);
                _mm256_storeu_si256(out.add((q + 4) * dst_stride) as *mut __m256i, high);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn by_8x8(_: *mut u32, _: usize, _: *const u8, _: isize, _: usize, _: usize) {
    unreachable!("only called when AVX2 was detected")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_word_lands_transposed_with_ragged_edges_and_unaligned_lines() {
        for (lines, words) in [(8, 8), (32, 192), (19, 45), (7, 9), (16, 3), (1, 1), (0, 5)] {
            // Lines start 2 bytes into each 32-bit word: bf16 lines of odd length are unaligned.
            let line_bytes = 4 * words as isize + 2;
            let src: Vec<u8> = (0..2 + lines * line_bytes as usize).map(|i| (i * 7 % 251) as u8).collect();
            let base = src.as_ptr().wrapping_add(2);
            let dst_stride = lines + 3;
            let mut dst = vec![u32::MAX; words * dst_stride];
            unsafe { transpose_words(dst.as_mut_ptr(), dst_stride, base, line_bytes, lines, words) };
            for p in 0..words {
                for j in 0..dst_stride {
                    let want = if j < lines {
                        let at = 2 + j * line_bytes as usize + 4 * p;
                        u32::from_le_bytes(src[at..at + 4].try_into().unwrap())
                    } else {
                        u32::MAX // padding columns stay untouched
                    };
                    assert_eq!(dst[p * dst_stride + j], want, "{lines} lines x {words} words: word {p} of line {j}");
                }
            }
        }
    }
}
