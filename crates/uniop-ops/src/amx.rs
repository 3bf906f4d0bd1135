//! Intel AMX (Advanced Matrix Extensions) tiles for the bf16 GEMM: `tdpbf16ps` multiplies a
//! 16 × 32 bf16 tile by a 32 × 16 one into 16 × 16 f32 sums — 8192 multiply-adds in one
//! instruction, about four times what AVX512-BF16's `vdpbf16ps` does in the same cycles. On CPUs
//! that have it (Intel Xeon since Sapphire Rapids) oneDNN uses it for torch's bf16 GEMMs, so
//! without it uniop's bf16 GEMM, attention and linear fall far behind torch there.
//!
//! Rust has no stable AMX intrinsics or feature detection (`x86_amx_intrinsics` is unstable), so
//! the CPU is asked through CPUID and the instructions are inline asm. Linux hands the 8 KiB tile
//! state to a process only after it asks (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); [`available`] asks
//! once and uses the tiles only if the kernel agreed, so a CPU or kernel without AMX falls back to
//! the AVX-512 micro-kernel instead of faulting.
//!
//! The block kernel keeps a 32 × 32 f32 result in four tiles (`tmm0..3`), the two 16-row halves of
//! A in `tmm4, tmm5` and the two 16-column halves of B in `tmm6, tmm7`, and walks k 16 words (32
//! bf16) at a time. B comes straight from the packed GEMM's panels, whose `[word][32 columns]`
//! rows of consecutive-k pairs are exactly AMX's pair-interleaved B layout; A needs rows of words
//! (the transpose of the AVX-512 kernel's A panels), which [`crate::packed_gemm`] packs for it.

#[cfg(target_arch = "x86_64")]
use crate::packed_gemm::LineBuf;

/// Rows of a tile, and 32-bit words in a tile row (64 bytes): one step of the block kernel takes
/// 16 words of k — 32 bf16.
pub(crate) const TILE_WORDS: usize = 16;
/// Rows and columns of the block kernel's f32 result (2 × 2 tiles).
pub(crate) const BLOCK: usize = 32;

/// Whether the CPU has AMX-TILE and AMX-BF16 and the OS lets this process use the tile state.
/// Asked once per process (the permission holds for all its threads).
pub(crate) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(detect)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::__cpuid_count;
    // CPUID leaf 7 EDX: bit 22 AMX-BF16, bit 24 AMX-TILE.
    let leaf7 = __cpuid_count(7, 0);
    let cpu_has = leaf7.edx & (1 << 22) != 0 && leaf7.edx & (1 << 24) != 0;
    // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): 0 when Linux grants the tile state.
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a syscall that takes two integers and changes only this process's permissions.
    cpu_has && unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) } == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// The tiles configured as the block kernel needs them, for as long as this value lives; dropping
/// it releases them (`tilerelease`), so the thread's tile state is back to its initial, cheap to
/// save, form between GEMMs.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Tiles(());

#[cfg(target_arch = "x86_64")]
impl Tiles {
    /// Loads the tile configuration: palette 1, all eight tiles 16 rows of 64 bytes.
    ///
    /// # Safety
    /// Only where [`available`] is true; no other tile user on this thread while the value lives.
    pub(crate) unsafe fn configure() -> Tiles {
        #[repr(C, align(64))]
        struct Config([u8; 64]);
        let mut config = Config([0; 64]);
        config.0[0] = 1;
        for tile in 0..8 {
            config.0[16 + 2 * tile] = (4 * TILE_WORDS) as u8;
            config.0[48 + tile] = TILE_WORDS as u8;
        }
        std::arch::asm!("ldtilecfg [{0}]", in(reg) config.0.as_ptr(), options(nostack, readonly));
        Tiles(())
    }

    /// Starts a 32 × 32 f32 block's sums at 0.
    pub(crate) fn zero(&self) {
        // SAFETY: the tiles are configured (`self` exists); no memory is touched.
        unsafe {
            std::arch::asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem))
        }
    }

    /// Starts a 32 × 32 f32 block's sums from `start`: 32 rows of 32 f32, `row_bytes` apart.
    ///
    /// # Safety
    /// `start` valid for 32 rows × 32 f32 at that stride.
    pub(crate) unsafe fn load(&self, (start, row_bytes): (*const f32, usize)) {
        std::arch::asm!(
            "tileloadd tmm0, [{c} + {s}*1]",
            "tileloadd tmm1, [{c} + {s}*1 + 64]",
            "tileloadd tmm2, [{c2} + {s}*1]",
            "tileloadd tmm3, [{c2} + {s}*1 + 64]",
            c = in(reg) start,
            c2 = in(reg) start.byte_add(TILE_WORDS * row_bytes),
            s = in(reg) row_bytes,
            options(nostack, readonly),
        );
    }

    /// Adds `A · B` to the block's sums: A is 32 rows of words `a_row_bytes` apart, B the packed
    /// GEMM's panel, rows of 32 words (128 bytes), and the walk takes `steps` steps of 16 words.
    /// The last step's B rows come from `b_last` instead when given (a copy of a ragged end,
    /// zero-padded to 16 rows, so that no row past the walk's end is read).
    ///
    /// A's tiles load with the T1 cache hint (`tileloaddt1`: lines not expected to be reused from
    /// L1 soon), without software prefetches. A block of A is read once per B panel and comes from
    /// L2 either way. This kernel used to load A plainly behind 32 prefetches per step (A's lines
    /// two steps ahead, into L1), and that ran 10-14% slower on one core here: 1024³ 2.44-2.72 →
    /// 2.13-2.32 ms, linear [512,1024]·[2048,1024]ᵀ 2.80-2.97 → 2.49-2.67, linear_silu_mul at the
    /// tiny Llama's [512,384] 1.11-1.20 → 0.95-1.04. The cause was not measured (no PMU counters
    /// in this VM). The likely one: the prefetches took L1's line-fill buffers, which B's tile
    /// loads need.
    ///
    /// # Safety
    /// A valid for 32 rows × `16 · steps` words, B for `16 · steps` rows (or one step fewer with
    /// `b_last` valid for 16 rows).
    pub(crate) unsafe fn add_product(
        &self,
        steps: usize,
        (a, a_row_bytes): (*const u32, usize),
        b: *const u32,
        b_last: Option<*const u32>,
    ) {
        for step in 0..steps {
            let b_step = match b_last {
                Some(last) if step + 1 == steps => last,
                _ => b.add(step * TILE_WORDS * BLOCK),
            };
            let a_step = a.add(step * TILE_WORDS);
            std::arch::asm!(
                "tileloaddt1 tmm4, [{a} + {sa}*1]",
                "tileloadd tmm6, [{b} + {sb}*1]",
                "tileloadd tmm7, [{b} + {sb}*1 + 64]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloaddt1 tmm5, [{a2} + {sa}*1]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a = in(reg) a_step,
                a2 = in(reg) a_step.byte_add(TILE_WORDS * a_row_bytes),
                sa = in(reg) a_row_bytes,
                b = in(reg) b_step,
                sb = in(reg) 4 * BLOCK,
                options(nostack, readonly),
            );
        }
    }

    /// Stores the block's sums: 32 rows of 32 f32, `row_bytes` apart.
    ///
    /// # Safety
    /// `result` valid for 32 rows × 32 f32 at that stride.
    pub(crate) unsafe fn store(&self, (result, row_bytes): (*mut f32, usize)) {
        std::arch::asm!(
            "tilestored [{c} + {s}*1], tmm0",
            "tilestored [{c} + {s}*1 + 64], tmm1",
            "tilestored [{c2} + {s}*1], tmm2",
            "tilestored [{c2} + {s}*1 + 64], tmm3",
            c = in(reg) result,
            c2 = in(reg) result.byte_add(TILE_WORDS * row_bytes),
            s = in(reg) row_bytes,
            options(nostack),
        );
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: the tiles were configured by `configure`; releasing them ends their use.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) }
    }
}

/// k-steps of the peak probe's walk: 32 rows of A (9 lines each, odd as the GEMM packs them, 18
/// KiB) and a 32-column panel of B (16 KiB) stay in L1 together.
const PROBE_STEPS: usize = 8;

/// The block kernel's throughput with its operands in L1: `rounds` walks of [`Tiles::add_product`]
/// over a fixed A block and B panel of small integers (exact in bf16 and in the f32 sums),
/// accumulating into one 32 × 32 block. Returns the flops done and the block, or None where the
/// tiles are unavailable. This is the ceiling a bf16 GEMM on one core can approach: its operands
/// stream from L2 instead and its sums go through an epilogue.
pub(crate) fn probe(rounds: usize) -> Option<(u64, Vec<f32>)> {
    if !available() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let row_words = (PROBE_STEPS | 1) * TILE_WORDS;
        let (a, b) = probe_operands(row_words);
        let mut sums = vec![0f32; BLOCK * BLOCK];
        // SAFETY: `available()` holds and nothing else uses tiles on this thread meanwhile; A has 32
        // rows of `row_words` ≥ 16 · PROBE_STEPS words, B 16 · PROBE_STEPS rows of 32 words, the
        // block 32 × 32 f32, each at the strides passed.
        unsafe {
            let tiles = Tiles::configure();
            tiles.zero();
            for _ in 0..rounds {
                tiles.add_product(PROBE_STEPS, (a.as_ptr(), 4 * row_words), b.as_ptr(), None);
            }
            tiles.store((sums.as_mut_ptr(), 4 * BLOCK));
        }
        let flops = (rounds * PROBE_STEPS * TILE_WORDS * 2 * BLOCK * BLOCK * 2) as u64;
        Some((flops, sums))
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("AMX is only detected on x86-64")
}

/// The probe's A rows (`row_words` words each, pairs of bf16) and B panel (`[word][32 columns]`),
/// on cache lines as the GEMM's are, holding bf16 integers in -3..=3: element `(r, e)` of A is
/// `(r + e) % 7 - 3`, element `(e, c)` of B `(2e + c) % 7 - 3`, for k index `e`.
#[cfg(target_arch = "x86_64")]
fn probe_operands(row_words: usize) -> (LineBuf<u32>, LineBuf<u32>) {
    let bf16 = |v: usize| u32::from(uniop::half::bf16::from_f32(v as f32 % 7.0 - 3.0).to_bits());
    let pair = |low: usize, high: usize| bf16(low) | bf16(high) << 16;
    let (mut a, mut b) = (LineBuf::default(), LineBuf::default());
    a.grow(BLOCK * row_words);
    b.grow(PROBE_STEPS * TILE_WORDS * BLOCK);
    for (i, word) in a.iter_mut().enumerate() {
        let (r, p) = (i / row_words, i % row_words);
        *word = pair(r + 2 * p, r + 2 * p + 1);
    }
    for (i, word) in b.iter_mut().enumerate() {
        let (p, c) = (i / BLOCK, i % BLOCK);
        *word = pair(4 * p + c, 4 * p + 2 + c);
    }
    (a, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_probe_sums_are_the_exact_products_of_its_operands() {
        let Some((flops, sums)) = probe(3) else {
            eprintln!("skipped: no AMX tiles on this machine");
            return;
        };
        assert_eq!(flops, 3 * 8 * 32 * 32 * 32 * 2);
        let value = |v: usize| (v % 7) as f64 - 3.0;
        for r in 0..BLOCK {
            for c in 0..BLOCK {
                // Each round adds the same product: 3 · Σₑ A[r][e] · B[e][c] over 16 · 8 words.
                let dot: f64 = (0..2 * PROBE_STEPS * TILE_WORDS).map(|e| value(r + e) * value(2 * e + c)).sum();
                assert_eq!(f64::from(sums[r * BLOCK + c]), 3.0 * dot, "sum ({r}, {c})");
            }
        }
    }
}
