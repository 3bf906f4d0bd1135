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
    /// zero-padded to 16 rows, so that no row past the walk's end is read). `a_next` is where the
    /// next block's A rows start, same stride: their first lines are prefetched as this walk ends.
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
        a_next: *const u32,
    ) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        const AHEAD: usize = 2;
        for step in 0..steps {
            // A's lines two steps on (past the walk's end, the next block's) into L1: A streams
            // from L2, and the GEMM ran 25-30% slower without this (tile loads alone leave the
            // hardware prefetchers behind). Prefetches never fault, so the addresses only wrap.
            let ahead = if step + AHEAD < steps {
                a.wrapping_add((step + AHEAD) * TILE_WORDS)
            } else {
                a_next.wrapping_add((step + AHEAD - steps) * TILE_WORDS)
            };
            for row in 0..BLOCK {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_byte_add(row * a_row_bytes) as *const i8);
            }
            let b_step = match b_last {
                Some(last) if step + 1 == steps => last,
                _ => b.add(step * TILE_WORDS * BLOCK),
            };
            let a_step = a.add(step * TILE_WORDS);
            std::arch::asm!(
                "tileloadd tmm4, [{a} + {sa}*1]",
                "tileloadd tmm6, [{b} + {sb}*1]",
                "tileloadd tmm7, [{b} + {sb}*1 + 64]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm5, [{a2} + {sa}*1]",
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
