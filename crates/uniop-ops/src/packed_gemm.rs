//! Packed GEMM with f32 sums, our own for two cases the `gemm` crate serves badly: bf16 operands
//! (it has no bf16 path) and, on AVX-512 and AVX2 CPUs, f32 with B dense along k — a weight in
//! HF's `[N, K]` layout — which it ran at 55–65% of its row-major speed for k ≥ 1000 (and which
//! otherwise costs a transposed copy of the weight per row band before its own packing).
//!
//! The structure is the usual BLIS one: B is packed into 32-column panels, `MC`-row blocks of A
//! into 8-row panels, and an 8 × 32 micro-kernel keeps its tile in 16 registers while it walks a
//! `KC`-deep slice of a B panel. B's panels are packed at the product's whole depth, so a slice is
//! a contiguous run of its panel and the layout does not depend on the slice depth: a weight can be
//! packed once, ahead of all its products (`pack_weight`, [`PackedWeight`]). Panels hold 32-bit
//! *words*: one f32, or for bf16 a pair of consecutive-k elements, because AVX512-BF16's
//! `vdpbf16ps` multiplies pairs and adds both products to an f32 lane — B panels store rows `2p`
//! and `2p+1` interleaved per column and A panels store each row's `(2p, 2p+1)` pair as one word
//! to broadcast. Packing a k-dense operand is then a transpose of words either way. Tiles deeper
//! than one slice are carried between slices in an f32 scratch block, so the output (f32 or bf16)
//! is rounded once.
//!
//! On Intel cores without AMX, whose `vdpbf16ps` issues at half their FMA rate, and on CPUs
//! without AVX512-BF16, bf16 runs the same panels through FMAs instead ([`Micro::Widened`]): A's
//! block is widened to f32 once per slice, each B panel's slice once before the row panels that
//! read it, and the f32 micro-kernel of the CPU's level multiplies them.
//!
//! bf16 on CPUs with AMX runs on its tiles instead ([`crate::amx`]): the same B panels, whose
//! `[word][32 columns]` rows are AMX's pair-interleaved layout already, times A packed as rows of
//! words, 32 × 32 output blocks at a time — several times the `vdpbf16ps` kernel's throughput.
//!
//! On AVX2 the f32 micro-kernel walks its 8 × 32 tile in four 4 × 16 parts (16 registers do not
//! hold the whole tile). Widening once per block instead of per step (the AVX2 kernel used to
//! widen each pair word it multiplied) runs bf16 as fast as f32 there: a 1024-deep `linear` of 512
//! rows and 2048 columns took 36–39 ms on one Zen 3 core before, 26–27 after. Below AVX2 a portable micro-kernel
//! multiplies the words, bf16 pairs included; it covers the packing in tests, and f32 products go
//! to the `gemm` crate on such CPUs. Scratch lives in per-thread buffers reused across calls, like
//! the `gemm` crate's.

use crate::matmul::{Dst, Mat};
use crate::skinny::{Dots, Simd};
use std::cell::RefCell;
use uniop::half::{bf16, f16};
use uniop::{DType, Element};

/// Rows and columns of the register tile.
const MR: usize = 8;
const NR: usize = 32;
/// Depth of one packed slice in words for the SIMD micro-kernels (512 bf16 or 256 f32: a 32 KiB
/// B panel either way, which stays in L1 while the A panels stream past it).
const KC_WORDS: usize = 256;
/// Depth of one packed slice in words for AMX (2048 bf16). A 32-row block of A and a 32-column
/// panel of B are 32 KiB each already at 256 words, more than L1 holds beside each other, so deeper
/// slices save the carried sums' tile stores and loads: 2048³ bf16 ran 0.78x -> 0.86x torch's oneDNN
/// here, [512,4096]x[4096,11008] 0.79x -> 0.87x. With A's tiles loaded under the T1 hint (see
/// [`crate::amx::Tiles::add_product`]), 256-, 512- and 1024-word slices ran level on one core
/// (1024³: 2.25-2.37, 2.20-2.38 and 2.13-2.32 ms over 12 alternations), although at 256 words B's
/// panel (32 KiB) could stay in L1 for the next blocks of A.
const KC_AMX_WORDS: usize = 1024;
/// Rows of A packed at once, and columns of B.
const MC: usize = 64;
const NC: usize = 512;

/// What the micro-kernel does with its finished tile.
#[derive(Clone, Copy)]
pub(crate) enum Sink {
    /// More slices follow: keep the f32 tile in the scratch block.
    Scratch,
    /// Last slice: write `rows × cols` to the output, adding to it when accumulating.
    Output { rows: usize, cols: usize, accumulate: bool },
}

/// Output element types: f32 for attention scores and f32 GEMMs' callers, bf16 for bf16 ops, f16
/// for f16 ops' few-row products ([`crate::skinny`]; the packed kernels never see f16).
pub(crate) trait GemmOut: Copy + 'static {
    /// bf16: picks the bf16 vector store.
    const IS_BF16: bool;
    /// f32: sums may be kept in (and added into) the output itself.
    const IS_F32: bool;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl GemmOut for f32 {
    const IS_BF16: bool = false;
    const IS_F32: bool = true;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl GemmOut for bf16 {
    const IS_BF16: bool = true;
    const IS_F32: bool = false;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl GemmOut for f16 {
    const IS_BF16: bool = false;
    const IS_F32: bool = false;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// Operand element types: how `PER_WORD` consecutive-k elements become one packed 32-bit word,
/// and the AVX-512 micro-kernel that multiplies such words. Their micro-kernel level is
/// [`Dots::best`].
pub(crate) trait Packed: Element + Dots {
    /// Elements along k per packed word: 2 for bf16 (a `vdpbf16ps` pair), 1 for f32.
    const PER_WORD: usize;
    /// The element's bits in the low part of a word.
    fn bits(self) -> u32;
    /// A word's elements as f32 (f32's second is 0): the portable micro-kernel's operands.
    fn widen(word: u32) -> [f32; 2];
    /// The words of `W` columns at `first` (columns contiguous) and the `PER_WORD - 1` rows after
    /// it, `rs` elements apart.
    ///
    /// # Safety
    /// `first` valid for `W` elements in each of those rows.
    unsafe fn row_words<const W: usize>(out: &mut [u32], first: *const Self, rs: isize);
    /// [`micro_avx512`] with this type's word product.
    ///
    /// # Safety
    /// The CPU has the level ([`Packed::level`] is `Avx512`); panels as in [`gemm_rows_packed`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn micro_avx512<O: GemmOut>(
        words: usize,
        a: *const u32,
        b: *const u32,
        carried: Option<*const f32>,
        sink: Sink,
        c_tile: *mut f32,
        out: Dst<O>,
    );
}

impl Packed for bf16 {
    const PER_WORD: usize = 2;
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
    fn widen(word: u32) -> [f32; 2] {
        [f32::from_bits(word << 16), f32::from_bits(word & 0xffff_0000)]
    }
    unsafe fn row_words<const W: usize>(out: &mut [u32], first: *const bf16, rs: isize) {
        interleave::<W>(out, first as *const u16, first.offset(rs) as *const u16);
    }
    unsafe fn micro_avx512<O: GemmOut>(
        words: usize,
        a: *const u32,
        b: *const u32,
        carried: Option<*const f32>,
        sink: Sink,
        c_tile: *mut f32,
        out: Dst<O>,
    ) {
        micro_avx512_bf16(words, a, b, carried, sink, c_tile, out)
    }
}

impl Packed for f32 {
    const PER_WORD: usize = 1;
    fn bits(self) -> u32 {
        self.to_bits()
    }
    fn widen(word: u32) -> [f32; 2] {
        [f32::from_bits(word), 0.0]
    }
    unsafe fn row_words<const W: usize>(out: &mut [u32], first: *const f32, _: isize) {
        std::ptr::copy_nonoverlapping(first as *const u32, out.as_mut_ptr(), W);
    }
    unsafe fn micro_avx512<O: GemmOut>(
        words: usize,
        a: *const u32,
        b: *const u32,
        carried: Option<*const f32>,
        sink: Sink,
        c_tile: *mut f32,
        out: Dst<O>,
    ) {
        micro_avx512_f32(words, a, b, carried, sink, c_tile, out)
    }
}

#[derive(Default)]
struct Scratch {
    /// Packed A block: `MC / MR` panels of `[words][MR]` words (twice as many rows for the widened
    /// kernel, and the block and one B panel's slice widened after them).
    a: LineBuf<u32>,
    /// Packed B block: `NC / NR` panels of `[words][NR]` words, each as deep as the product.
    b: LineBuf<u32>,
    /// f32 tiles carried between slices: `[row of the row block][NC]`.
    c: LineBuf<f32>,
    /// Finished f32 sums of [`gemm_rows_pairs`]: `[row][packed column]`.
    sums: LineBuf<f32>,
}

/// A scratch buffer of 4-byte elements that starts on a cache line, so that every 64-byte row of
/// a packed panel's tile or vector load is one line of memory. A `Vec<u32>`'s allocation is only
/// 16-byte aligned: each such row then spanned two lines, and the AMX GEMM ran 20-25% slower
/// (2048³ bf16 on one thread: 0.59x -> 0.74x torch's oneDNN).
#[derive(Default)]
pub(crate) struct LineBuf<T> {
    lines: Vec<Line<T>>,
}

#[repr(C, align(64))]
#[derive(Clone, Copy, Default)]
struct Line<T>([T; 16]);

impl<T: Copy + Default> LineBuf<T> {
    /// Makes room for at least `len` elements (never shrinks; new elements are zero).
    pub(crate) fn grow(&mut self, len: usize) {
        const { assert!(std::mem::size_of::<T>() == 4, "a line holds 16 four-byte elements") };
        if self.lines.len() * 16 < len {
            self.lines.resize(len.div_ceil(16), Line::default());
        }
    }
}

impl<T> std::ops::Deref for LineBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: a `Line<T>` is 16 `T`s and, for the 4-byte `T`s used here, no padding.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const T, self.lines.len() * 16) }
    }
}

impl<T> std::ops::DerefMut for LineBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as `deref`, under the exclusive borrow of the lines.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut T, self.lines.len() * 16) }
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// The micro-kernel a product runs on: AMX tiles (bf16 on CPUs that have them) or a SIMD level.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Micro {
    Amx,
    Simd(Simd),
    /// bf16 pair words widened to f32 and multiplied with the f32 micro-kernel of this level: on
    /// AVX-512 Intel cores without AMX ([`bf16_on_fma`]) and on CPUs whose best is AVX2.
    Widened(Simd),
}

impl Micro {
    /// Words of k in one packed slice for this micro-kernel.
    fn slice_words(self) -> usize {
        match self {
            Micro::Amx => KC_AMX_WORDS,
            Micro::Simd(_) => KC_WORDS,
            // Widened, a slice's B panel is as large as an f32 one of KC_WORDS (32 KiB).
            Micro::Widened(_) => KC_WORDS / 2,
        }
    }

    /// Rows of A per packed block.
    fn block_rows(self) -> usize {
        match self {
            // Each widened B panel slice then serves 16 row panels: at 8 (64 rows), widening it took
            // 13% of the product's time, and 1024x4096 bf16 `linear_packed` ran 135 -> 141-144
            // GFLOP/s on one core (256x512: 148 -> 155).
            Micro::Widened(_) => 2 * MC,
            Micro::Amx | Micro::Simd(_) => MC,
        }
    }

    /// The SIMD level of the few-row dot products, which AMX products hand their skinny cases to.
    fn simd(self) -> Simd {
        match self {
            Micro::Amx => Simd::Avx512,
            Micro::Simd(simd) | Micro::Widened(simd) => simd,
        }
    }
}

/// Whether bf16 products run on AMX tiles here (they need AVX512-BF16's conversions too).
pub(crate) fn bf16_on_amx() -> bool {
    <bf16 as Dots>::best() == Simd::Avx512 && crate::amx::available()
}

/// Whether bf16 products multiply their pairs as f32 FMAs ([`Micro::Widened`]) rather than
/// with `vdpbf16ps`: on Intel cores without AMX. Their `vdpbf16ps` issues at half the rate of
/// their two 512-bit FMA pipes, so its 32 products per instruction bring no more than an FMA's
/// 16 (one Xeon core: ~90 GFLOP/s against ~170; 2048x4096 bf16 `linear` ran at 161 GFLOP/s on two
/// cores, f32's at 286). Zen 4 runs `vdpbf16ps` at twice its FMA rate and keeps it.
pub(crate) fn bf16_on_fma() -> bool {
    static INTEL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    <bf16 as Dots>::best() == Simd::Avx512 && !bf16_on_amx() && *INTEL.get_or_init(intel)
}

/// Whether the CPU's vendor id (CPUID leaf 0: EBX, EDX, ECX) is Intel's.
#[cfg(target_arch = "x86_64")]
fn intel() -> bool {
    let leaf0 = std::arch::x86_64::__cpuid(0);
    [leaf0.ebx, leaf0.edx, leaf0.ecx].map(u32::to_le_bytes).concat() == *b"GenuineIntel"
}

#[cfg(not(target_arch = "x86_64"))]
fn intel() -> bool {
    false
}

/// The least depth at which AMX takes a product of k-dense operands transposed: each 32 × 32
/// output block's transpose costs about 70 / k of its products (the tiny Llama's 384-deep
/// linears ran 1.3x torch's untransposed, 1.0-1.2x transposed).
const AMX_TRANSPOSED_MIN_K: usize = 1024;

/// Whether `threads` blocks should split a `dtype` product of `rows` rows and `n` columns by
/// columns rather than rows. bf16 (at every level: AMX, AVX512-BF16, widened) and f32 on AVX-512 or
/// AVX2 pack B (or copy it, transposed) in every block that multiplies it, which costs as much as a
/// fifth of the products when the rows are few against the columns; bands of columns give each
/// block only its share to pack. f32 on 2 threads of an AMX Xeon, row bands' time over column
/// bands' (median of 6 alternated runs): `linear` `[512, 384] · [384, 1024]ᵀ` 1.03,
/// `linear_silu_mul` 1.035, `matmul` `[512, 1024] · [1024, 4096]` 1.12. bf16 on 2 threads of a Zen
/// 4 with AVX512-BF16 (best of 3 processes alternated): `linear` `[64, 2880] · [5760, 2880]ᵀ`
/// 7.36–7.78 → 6.09–6.65 ms (the weight stored `[K, N]`: 8.03–8.48 → 6.83–8.33), `[256, 2880]`
/// 1.07x, `[128, 384] · [1024, 384]ᵀ` 1.05x, `[512, 4096] · [4096, 4096]ᵀ` 1.03x.
pub(crate) fn split_columns(dtype: DType, rows: usize, n: usize, threads: usize) -> bool {
    let packs_per_block = match dtype {
        DType::BF16 => true,
        DType::F32 => <f32 as Dots>::best() != Simd::Scalar,
        _ => false,
    };
    packs_per_block && rows <= n / threads
}

/// The micro-kernels this CPU runs for `E`, best first: what a test can force here.
#[cfg(test)]
fn micro_kernels<E: Packed>() -> impl Iterator<Item = Micro> {
    let pairs = E::PER_WORD == 2;
    let amx = (pairs && bf16_on_amx()).then_some(Micro::Amx);
    // Pairs widen for the f32 kernel of each vector level; AVX2 has no pair-word kernel of its own.
    let widened = Simd::up_to(E::best()).filter(move |&s| pairs && s != Simd::Scalar).map(Micro::Widened);
    let simd = Simd::up_to(E::best()).filter(move |&s| !pairs || s != Simd::Avx2).map(Micro::Simd);
    amx.into_iter().chain(widened).chain(simd)
}

#[cfg(test)]
thread_local! {
    /// Tests run each micro-kernel the machine has, not only its best.
    static FORCED: std::cell::Cell<Option<Micro>> = const { std::cell::Cell::new(None) };
}

/// The micro-kernel to run: the CPU's best for `E` (tests may force a lower one).
fn micro_kernel<E: Packed>() -> Micro {
    #[cfg(test)]
    if let Some(forced) = FORCED.with(|f| f.get()) {
        return forced;
    }
    if E::PER_WORD == 2 && bf16_on_amx() {
        Micro::Amx
    } else if E::PER_WORD == 2 && (bf16_on_fma() || E::best() == Simd::Avx2) {
        Micro::Widened(E::best())
    } else {
        Micro::Simd(E::best())
    }
}

/// `dst[rows] = lhs[rows] · rhs` (`+=` with `accumulate`), `k`-deep, `n` columns; bf16 or f32
/// operands, f32 sums, one rounding to `O` at the end.
///
/// # Safety
/// As [`crate::matmul::gemm_rows`]: all three matrices valid for the extents and strides, and
/// rows `rows` of `dst` untouched by anyone else meanwhile.
pub(crate) unsafe fn gemm_rows_packed<E: Packed, O: GemmOut>(
    rows: std::ops::Range<usize>,
    n: usize,
    k: usize,
    dst: Dst<O>,
    lhs: Mat<E>,
    rhs: Mat<E>,
    accumulate: bool,
) {
    if rows.is_empty() || n == 0 {
        return;
    }
    let micro = micro_kernel::<E>();
    if crate::skinny::applies(&rows, lhs, rhs) {
        return crate::skinny::skinny(rows, n, k, dst, lhs, rhs, accumulate, micro.simd());
    }
    if E::DTYPE == DType::BF16 && crate::skinny::applies_to_lines(&rows, lhs, rhs) {
        return crate::skinny::skinny_lines(rows, n, k, dst, lhs.cast(), rhs.cast(), accumulate, micro.simd());
    }
    let deep = k >= AMX_TRANSPOSED_MIN_K;
    let transposed = micro == Micro::Amx && deep && lhs.cs == 1 && rhs.rs == 1 && rhs.cs != 1 && rows.len() <= n;
    let (rows, n, dst, lhs, rhs) = if transposed {
        // Both operands dense along k (x times a `[N, K]` weight): AMX's A operand is rows of k
        // pairs, a copy of such rows, while its B operand is k-pair-interleaved columns, a
        // transpose of them. So the product is taken transposed, `dstᵀ = rhsᵀ · lhsᵀ`: the larger
        // operand is copied and only the smaller one transposed (for `linear` at 512 rows the
        // weight's transpose had a fifth of the samples, a quarter of the GEMM's time), at the
        // price of transposing each 32 × 32 block of the output.
        let transpose = |m: Mat<E>| Mat { ptr: m.ptr, rs: m.cs, cs: m.rs };
        let lhs_rows = Mat { ptr: lhs.ptr.offset(rows.start as isize * lhs.rs), ..lhs };
        let dst_rows = Dst { ptr: dst.ptr.offset(rows.start as isize * dst.rs), rs: dst.cs, cs: dst.rs };
        (0..n, rows.len(), dst_rows, transpose(rhs), transpose(lhs_rows))
    } else {
        (rows, n, dst, lhs, rhs)
    };
    SCRATCH.with_borrow_mut(|s| {
        let Scratch { a, b, c, .. } = s;
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            let block = BlockOfB::Unpacked(Columns::One(rhs), (jc, nc), b);
            multiply(rows.clone(), (jc, nc), k, dst, lhs, block, accumulate, micro, (a, c));
        }
    });
}

/// K slices of `slice_words` words (the last may be shorter) for a depth of `k` elements: their
/// count and each one's `(first element, elements)`. k == 0 still gets one (empty) slice so the
/// output is written.
fn slices<E: Packed>(k: usize, slice_words: usize) -> (usize, impl Fn(usize) -> (usize, usize)) {
    let kc_max = slice_words * E::PER_WORD;
    (k.div_ceil(kc_max).max(1), move |si: usize| (si * kc_max, kc_max.min(k - si * kc_max)))
}

/// Words one column block of `nc` columns of a `k`-deep B takes packed: whole panels, each
/// `k` deep.
fn column_block_words<E: Packed>(k: usize, nc: usize) -> usize {
    nc.next_multiple_of(NR) * k.div_ceil(E::PER_WORD)
}

/// The B of a product as its columns are packed: one matrix, or two with the same shape whose
/// products are taken together in pairs of half panels — `HALF` columns of the first, then the
/// same columns of the second — so that every tile holds both sums of its `HALF` outputs.
#[derive(Clone, Copy)]
enum Columns<E> {
    One(Mat<E>),
    Pairs(Mat<E>, Mat<E>),
}

/// Columns of each matrix in one half of a paired panel.
pub(crate) const HALF: usize = NR / 2;

/// Packs columns `jc..jc + nc` of `rhs`, rows `k0..k0 + kc` of its depth, into `out` as whole
/// panels, panel after panel, each `[word][NR]` for those `kc` (see [`PackedBlock`]).
unsafe fn pack_columns<E: Packed>(
    out: &mut [u32],
    rhs: Columns<E>,
    (k0, kc): (usize, usize),
    (jc, nc): (usize, usize),
) {
    if kc == 0 {
        // Nothing to pack, and `out` may be a thread's scratch that no product has grown yet (a
        // paired block's second half would then start past its end).
        return;
    }
    match rhs {
        Columns::One(m) => pack::<E, NR>(out, NR, m, k0, kc, jc, nc),
        Columns::Pairs(first, second) => {
            pack::<E, HALF>(out, NR, first, k0, kc, jc, nc);
            pack::<E, HALF>(&mut out[HALF..], NR, second, k0, kc, jc, nc);
        }
    }
}

/// A B operand packed once for several products with different A rows (attention's K and V
/// tiles, which every query tile of their head multiplies): the panels [`gemm_rows_packed`]
/// would pack on each call. The buffer is reused across packs.
#[derive(Default)]
pub(crate) struct PackedRhs {
    words: LineBuf<u32>,
    n: usize,
    k: usize,
}

impl PackedRhs {
    /// Packs `rhs` (`k × n`).
    ///
    /// # Safety
    /// `rhs` must be valid for `k × n` elements at its strides.
    pub unsafe fn pack<E: Packed>(&mut self, rhs: Mat<E>, n: usize, k: usize) {
        let blocks = (0..n).step_by(NC).map(|jc| (jc, NC.min(n - jc)));
        self.words.grow(blocks.clone().map(|(_, nc)| column_block_words::<E>(k, nc)).sum());
        let mut at = 0;
        for (jc, nc) in blocks {
            pack_columns::<E>(&mut self.words[at..], Columns::One(rhs), (0, k), (jc, nc));
            at += column_block_words::<E>(k, nc);
        }
        (self.n, self.k) = (n, k);
    }
}

/// One column block of B as [`multiply`] gets it.
enum BlockOfB<'a, E> {
    /// Packed ahead at its whole depth: a packed weight, attention's K or V, a block several
    /// chunks of rows multiply.
    Packed(&'a [u32], PackedBlock),
    /// Columns `(jc, nc)` of these, packed by `multiply` into the buffer. A row-major B is packed
    /// one slice of the depth at a time, just before the row panels that read it, where every row
    /// block takes a slice before the next one: the slice's packed words (512 KiB for 512 columns)
    /// are then written to and read from L2, where the whole depth's (2.9 MiB for a 2880-deep bf16
    /// weight's 512 columns) went out to L3 and came back — bf16 `[2880, 5760]` weights times 16
    /// to 64 rows ran 0.95–0.97x the time (the packing took a third of it; with the packing's
    /// prefetch, 0.86–0.93x). A B dense along k is packed at its whole depth all the same: its
    /// lines' runs, cut to a slice's 1 KiB, ran 1–2% slower.
    Unpacked(Columns<E>, (usize, usize), &'a mut LineBuf<u32>),
}

impl<'a, E: Packed> BlockOfB<'a, E> {
    /// The block packed at its whole depth of `k`.
    unsafe fn packed_whole(self, k: usize) -> BlockOfB<'a, E> {
        match self {
            BlockOfB::Packed(..) => self,
            BlockOfB::Unpacked(columns, (jc, nc), buf) => {
                let width = columns.packed_width(nc);
                buf.grow(column_block_words::<E>(k, width));
                pack_columns::<E>(buf, columns, (0, k), (jc, nc));
                BlockOfB::Packed(buf, PackedBlock::new::<E>(width, k))
            }
        }
    }

    /// Whether the block is B's columns as they lie, dense along them (a row-major B).
    fn dense_along_columns(&self) -> bool {
        match self {
            BlockOfB::Packed(..) => false,
            BlockOfB::Unpacked(Columns::One(m) | Columns::Pairs(m, _), ..) => m.cs == 1 && m.rs != 1,
        }
    }

    fn reborrow(&mut self) -> BlockOfB<'_, E> {
        match self {
            BlockOfB::Packed(words, packed) => BlockOfB::Packed(words, *packed),
            BlockOfB::Unpacked(columns, from, buf) => BlockOfB::Unpacked(*columns, *from, buf),
        }
    }
}

impl<E> Columns<E> {
    /// Packed columns that `nc` columns (of each matrix of a pair) take: whole panels.
    fn packed_width(&self, nc: usize) -> usize {
        match self {
            Columns::One(_) => nc.next_multiple_of(NR),
            Columns::Pairs(..) => nc.div_ceil(HALF) * NR,
        }
    }
}

/// Columns of each weight in one packed panel: [`NR`], or [`HALF`] of each of two paired ones.
pub(crate) fn panel_columns(paired: bool) -> usize {
    if paired {
        HALF
    } else {
        NR
    }
}

/// The `pack_weight` layout of a `[n, k]` weight (or a pair of them), as a tensor of the weight's
/// dtype: `[panels, words, NR, per_word]`, `per_word` elements along k making one 32-bit word (2
/// for bf16, 1 for 4-byte and wider types), each panel `NR` columns (or `HALF` of each weight of a
/// pair), zero-padded to whole words and panels. It is the layout [`pack_columns`] gives a
/// product's column blocks, so a product reads it in place.
pub(crate) fn packed_weight_shape(elem_size: usize, n: usize, k: usize, paired: bool) -> [usize; 4] {
    let per_word = (4 / elem_size).max(1);
    [n.div_ceil(panel_columns(paired)), k.div_ceil(per_word), NR, per_word]
}

/// A weight packed ahead of its products (by [`pack_weight_panels`]): its words from `words` on,
/// `n` columns (of each weight, when `paired`) `k` deep. Only its words' bits are read: a packed
/// tensor of the weight's dtype need not be aligned to words.
#[derive(Clone, Copy)]
pub(crate) struct PackedWeight {
    pub words: *const u8,
    pub n: usize,
    pub k: usize,
    pub paired: bool,
}

impl PackedWeight {
    /// The same weight from output column `c` (a multiple of the panel width) on.
    pub(crate) fn columns_from<E: Packed>(self, c: usize) -> PackedWeight {
        debug_assert!(c.is_multiple_of(panel_columns(self.paired)));
        let panel_words = NR * self.k.div_ceil(E::PER_WORD);
        // SAFETY of later reads: the caller's column is inside the packed weight.
        let bytes = 4 * (c / panel_columns(self.paired)) * panel_words;
        PackedWeight { words: self.words.wrapping_add(bytes), n: self.n - c, ..self }
    }

    /// The packed words of the column block at `jc` (`width` packed columns), in place when they
    /// are aligned, else copied into `scratch`.
    ///
    /// # Safety
    /// The block lies inside the packed weight.
    unsafe fn block<'a, E: Packed>(&self, jc: usize, width: usize, scratch: &'a mut LineBuf<u32>) -> &'a [u32] {
        let len = width * self.k.div_ceil(E::PER_WORD);
        if len == 0 {
            return &[];
        }
        let start = self.columns_from::<E>(jc).words;
        if (start as usize).is_multiple_of(4) {
            return std::slice::from_raw_parts(start as *const u32, len);
        }
        scratch.grow(len);
        std::ptr::copy_nonoverlapping(start, scratch.as_mut_ptr() as *mut u8, 4 * len);
        &scratch[..len]
    }
}

/// Packs panels `panels` of `first` (`[k, n]` as read, any strides), paired with `second` when
/// given, into `out` (that range of panels, in the layout of [`packed_weight_shape`]).
///
/// # Safety
/// The weights valid for `k × n` elements at their strides; `out` writable for the panels' words.
pub(crate) unsafe fn pack_weight_panels<E: Packed>(
    out: *mut u8,
    first: Mat<E>,
    second: Option<Mat<E>>,
    (n, k): (usize, usize),
    panels: std::ops::Range<usize>,
) {
    let width = panel_columns(second.is_some());
    let (jc, nc) = (panels.start * width, (panels.end * width).min(n).saturating_sub(panels.start * width));
    let len = panels.len() * NR * k.div_ceil(E::PER_WORD);
    if nc == 0 || len == 0 {
        return;
    }
    let columns = second.map_or(Columns::One(first), |second| Columns::Pairs(first, second));
    if (out as usize).is_multiple_of(4) {
        // SAFETY: aligned, and writable for `len` words (the caller's panels).
        return pack_columns::<E>(std::slice::from_raw_parts_mut(out as *mut u32, len), columns, (0, k), (jc, nc));
    }
    SCRATCH.with_borrow_mut(|s| {
        s.b.grow(len);
        pack_columns::<E>(&mut s.b[..len], columns, (0, k), (jc, nc));
        std::ptr::copy_nonoverlapping(s.b.as_ptr() as *const u8, out, 4 * len);
    });
}

/// [`gemm_rows_packed`] against a weight packed ahead ([`PackedWeight`], not paired):
/// `dst[rows] = lhs[rows] · weightᵀ` over its `n` columns. Any rows go through the packed kernel:
/// the few-row dot products stream an unpacked weight, which a packed one is not.
///
/// # Safety
/// As [`gemm_rows_packed`]; `rhs` packed from elements of type `E`, valid for its extents.
pub(crate) unsafe fn gemm_rows_packed_weight<E: Packed, O: GemmOut>(
    rows: std::ops::Range<usize>,
    dst: Dst<O>,
    lhs: Mat<E>,
    rhs: PackedWeight,
    accumulate: bool,
) {
    debug_assert!(!rhs.paired);
    if rows.is_empty() || rhs.n == 0 {
        return;
    }
    let micro = micro_kernel::<E>();
    SCRATCH.with_borrow_mut(|s| {
        let Scratch { a, b, c, .. } = s;
        for jc in (0..rhs.n).step_by(NC) {
            let nc = NC.min(rhs.n - jc);
            let block =
                BlockOfB::Packed(rhs.block::<E>(jc, nc.next_multiple_of(NR), b), PackedBlock::new::<E>(nc, rhs.k));
            multiply(rows.clone(), (jc, nc), rhs.k, dst, lhs, block, accumulate, micro, (a, c));
        }
    });
}

/// Where the products of [`gemm_rows_prepacked`] may start inside the packed B: a multiple of
/// this many columns (whole panels) and as many rows of its depth (whole words).
pub(crate) const PREPACKED_STEP: usize = NR;

/// [`gemm_rows_packed`] with a B packed beforehand: `dst[rows, cols] (+)= lhs[rows, depth] ·
/// B[depth, cols]`, a window of `rhs` — all of it, or less: a causal attention tile whose queries
/// see only the first keys of a key tile multiplies only those (the leading `cols` of the scores,
/// or the leading `depth` of `P·V`), one whose mask hides a key tile's first keys from every
/// query starts past them. `lhs` is addressed from column 0 (its columns `depth` are read), `dst`
/// from column 0 (its columns `cols` are written).
///
/// # Safety
/// As [`gemm_rows_packed`]; `rhs` packed from elements of type `E`.
pub(crate) unsafe fn gemm_rows_prepacked<E: Packed, O: GemmOut>(
    rows: std::ops::Range<usize>,
    (cols, depth): (std::ops::Range<usize>, std::ops::Range<usize>),
    dst: Dst<O>,
    lhs: Mat<E>,
    rhs: &PackedRhs,
    accumulate: bool,
) {
    assert!(
        cols.end <= rhs.n && depth.end <= rhs.k,
        "{depth:?} x {cols:?} is not inside the packed {} x {}",
        rhs.k,
        rhs.n
    );
    assert!(
        cols.start.is_multiple_of(PREPACKED_STEP) && depth.start.is_multiple_of(PREPACKED_STEP),
        "a prepacked product starts on whole panels and words, not at {depth:?} x {cols:?}"
    );
    if rows.is_empty() || cols.is_empty() {
        return;
    }
    let micro = micro_kernel::<E>();
    let lhs = Mat { ptr: lhs.ptr.offset(depth.start as isize * lhs.cs), ..lhs };
    let (k, from) = (depth.len(), depth.start / E::PER_WORD);
    SCRATCH.with_borrow_mut(|s| {
        let Scratch { a, c, .. } = s;
        let mut at = 0;
        for jc in (0..cols.end).step_by(NC) {
            let block = PackedBlock { from, ..PackedBlock::new::<E>(NC.min(rhs.n - jc), rhs.k) };
            let (first, end) = (cols.start.max(jc), cols.end.min(jc + NC));
            if first < end {
                let b = BlockOfB::Packed(&rhs.words[at + (first - jc) / NR * block.words * NR..], block);
                multiply(rows.clone(), (first, end - first), k, dst, lhs, b, accumulate, micro, (a, c));
            }
            at += column_block_words::<E>(rhs.k, block.nc);
        }
    });
}

/// Columns of each product that [`gemm_rows_pairs`] takes per column block, and so hands over per
/// row at most: a whole block of packed columns.
pub(crate) const PAIRED_COLUMNS: usize = NC / 2;

/// Output rows a [`gemm_rows_pairs`] product holds sums for at once (with 256 columns of each
/// matrix, 512 × 512 f32: 1 MiB). The sums take each slice of k in turn ([`multiply`]), so the
/// chunk is how many rows one B slice serves from L2 before the next: at 128 rows a 4096-deep
/// product walked its 8 MiB column block from L3 four times as often. One core,
/// `linear_silu_mul_packed` x 512 x 4096, 128 against 512 rows alternated three times: f32 705-744
/// against 642-649 ms, bf16 659-687 against 641-656; 512 x 384 level.
const PAIR_ROWS: usize = 512;

/// Whether [`gemm_rows_pairs`] is the way to take products of `rows` rows here: not for the few
/// rows whose products the skinny kernels take by streaming the weights.
///
/// Deep bf16 products on AMX, which [`gemm_rows_packed`] would take transposed, are paired all
/// the same: taken one by one (transposed) and combined after, TinyLlama-1.1B's gate/up at 512
/// rows (2048 → 5632) ran 15.3 ms against the pair's 16.8, but any split of that route into
/// chunks small enough for scratch copies the weights once per chunk (37 ms in 32-row chunks).
pub(crate) fn pairs_apply(rows: usize) -> bool {
    rows > crate::skinny::SKINNY_ROWS
}

/// The products `lhs[rows] · first` and `lhs[rows] · second` (`k`-deep, `n` columns each; bf16
/// or f32 operands, f32 sums) taken as one with [`Columns::Pairs`]: A is packed once for both,
/// and each output row's sums are handed to `finish(row, first column, sums)` while they are in
/// cache, `sums` holding them in pairs of `HALF`-column groups — columns `c..c + HALF` of the
/// first product at `sums[2c..2c + HALF]`, of the second at `sums[2c + HALF..2c + 2 · HALF]`
/// (`c` a multiple of `HALF`; the last group's columns past the block's end are padding). For
/// a gated activation (`linear_silu_mul`), whose factors are two products of the same input.
///
/// # Safety
/// As [`gemm_rows_packed`] for both products (without a destination); a packed pair (`Packed`)
/// valid for its extents.
pub(crate) unsafe fn gemm_rows_pairs<E: Packed>(
    rows: std::ops::Range<usize>,
    n: usize,
    k: usize,
    lhs: Mat<E>,
    weights: PairedWeights<E>,
    mut finish: impl FnMut(usize, usize, &[f32]),
) {
    if rows.is_empty() || n == 0 {
        return;
    }
    let micro = micro_kernel::<E>();
    SCRATCH.with_borrow_mut(|s| {
        let Scratch { a, b, c, sums } = s;
        sums.grow(PAIR_ROWS * NC);
        for jc in (0..n).step_by(PAIRED_COLUMNS) {
            let nc = PAIRED_COLUMNS.min(n - jc);
            let width = nc.div_ceil(HALF) * NR;
            let mut block = match weights {
                PairedWeights::Weights(first, second) => BlockOfB::Unpacked(Columns::Pairs(first, second), (jc, nc), b),
                PairedWeights::Packed(w) => {
                    BlockOfB::Packed(w.block::<E>(jc, width, b), PackedBlock::new::<E>(width, k))
                }
            };
            if rows.len() > PAIR_ROWS {
                // Several chunks of rows multiply the block: packed once, at its whole depth, for all.
                block = block.packed_whole(k);
            }
            for ic in rows.clone().step_by(PAIR_ROWS) {
                let mc = PAIR_ROWS.min(rows.end - ic);
                let dst = Dst { ptr: sums.as_mut_ptr(), rs: width as isize, cs: 1 };
                let lhs = Mat { ptr: lhs.ptr.offset(ic as isize * lhs.rs), ..lhs };
                multiply(0..mc, (0, width), k, dst, lhs, block.reborrow(), false, micro, (a, c));
                for (r, row_sums) in sums.chunks_exact(width).take(mc).enumerate() {
                    finish(ic + r, jc, row_sums);
                }
            }
        }
    });
}

/// The two weights of [`gemm_rows_pairs`]: to pack block by block, or packed ahead as a pair.
#[derive(Clone, Copy)]
pub(crate) enum PairedWeights<E> {
    Weights(Mat<E>, Mat<E>),
    Packed(PackedWeight),
}

impl<E> PairedWeights<E> {
    /// The same weights as elements of `U` (for generic code that has checked `E` is `U`).
    pub(crate) fn cast<U>(self) -> PairedWeights<U> {
        match self {
            PairedWeights::Weights(first, second) => PairedWeights::Weights(first.cast(), second.cast()),
            PairedWeights::Packed(w) => PairedWeights::Packed(w),
        }
    }
}

impl<E: Packed> PairedWeights<E> {
    /// The same weights from output column `c` on (a multiple of [`HALF`]).
    pub(crate) fn columns_from(self, c: usize) -> PairedWeights<E> {
        match self {
            PairedWeights::Weights(first, second) => {
                let shift = |m: Mat<E>| Mat { ptr: m.ptr.wrapping_offset(c as isize * m.cs), ..m };
                PairedWeights::Weights(shift(first), shift(second))
            }
            PairedWeights::Packed(w) => PairedWeights::Packed(w.columns_from::<E>(c)),
        }
    }
}

/// How one column block of B lies packed (by [`pack_columns`]): `nc` columns as whole panels,
/// panel after panel, each `[word][NR]` words for the block's whole depth of `words` words. A
/// product walks a panel slice by slice, each slice a contiguous run of it, and may walk only the
/// leading part of the depth or of the columns. The layout does not depend on the slice depth, so
/// one packing serves every micro-kernel.
#[derive(Clone, Copy)]
struct PackedBlock {
    nc: usize,
    words: usize,
    /// The word of the depth a product starts from (see [`gemm_rows_prepacked`]).
    from: usize,
}

impl PackedBlock {
    fn new<E: Packed>(nc: usize, k: usize) -> PackedBlock {
        PackedBlock { nc, words: k.div_ceil(E::PER_WORD), from: 0 }
    }

    /// Where slice `si` (of `slice_words`-word slices) of the panel at column `jr` starts.
    fn panel(self, jr: usize, si: usize, slice_words: usize) -> usize {
        (jr / NR * self.words + self.from + si * slice_words) * NR
    }
}

/// Rows `rows` of `dst`'s columns `jc..jc + nc` from `lhs`, `k` deep, and B's block packed in
/// `b`: packs A a row block at a time into `a`, carries deep tiles in `c` (or, for f32 outputs
/// with dense rows, in the output).
#[allow(clippy::too_many_arguments)]
unsafe fn multiply<E: Packed, O: GemmOut>(
    rows: std::ops::Range<usize>,
    (jc, nc): (usize, usize),
    k: usize,
    dst: Dst<O>,
    lhs: Mat<E>,
    rhs: BlockOfB<'_, E>,
    accumulate: bool,
    micro: Micro,
    (a, c): (&mut LineBuf<u32>, &mut LineBuf<f32>),
) {
    let simd = match micro {
        #[cfg(target_arch = "x86_64")]
        Micro::Amx => {
            let BlockOfB::Packed(b, packed) = rhs.packed_whole(k) else { unreachable!("packed_whole packs") };
            return multiply_amx::<E, O>(rows, (jc, nc), k, dst, lhs, (b, packed), accumulate, (a, c));
        }
        Micro::Simd(simd) => simd,
        Micro::Widened(simd) => simd,
        #[cfg(not(target_arch = "x86_64"))]
        Micro::Amx => unreachable!("AMX is only detected on x86-64"),
    };
    let slice_words = micro.slice_words();
    let (n_slices, slice) = slices::<E>(k, slice_words);
    // A's packed block, then for the widened kernel the same block as f32 and one B panel's slice
    // as f32 after it.
    let widened = matches!(micro, Micro::Widened(_));
    let block_rows = micro.block_rows();
    let block_words = block_rows * slice_words;
    let wide_b_at = 3 * block_words;
    a.grow(if widened { wide_b_at + 2 * slice_words * NR } else { block_words });
    // A deep product into f32 rows adds each slice's sums to the output, slice after slice, and so
    // multiplies every row block by one B slice (512 KiB for f32) while it is in L2. Carrying the
    // sums in the scratch block instead walks B's whole depth for each row block — 8 MiB at
    // k = 4096, from L3 every 64 rows: on one core (rows x k x columns, f32) 1024 x 4096 x 8192
    // ran 509-540 ms against 472-496, 128 x 4096 x 8192 78-79 against 69-70, 512 x 1024 x 2048
    // 15.6 against 14.9; 512 x 384 x 768 level. A bf16 output is rounded once, from sums carried
    // in f32.
    let sums_in_output = O::IS_F32 && dst.cs == 1 && n_slices > 1;
    if n_slices > 1 && !sums_in_output {
        c.grow(block_rows * NC);
    }
    let n_blocks = rows.len().div_ceil(block_rows);
    // Row blocks that each walk every slice (bf16 sums carried in scratch) need B's whole depth
    // packed ahead, else a row-major B is packed slice by slice as the loop reaches each (see
    // `BlockOfB::Unpacked`).
    let by_slice = (sums_in_output || n_blocks == 1) && rhs.dense_along_columns();
    let mut rhs = if by_slice { rhs } else { rhs.packed_whole(k) };
    if let BlockOfB::Unpacked(columns, (_, cols), buf) = &mut rhs {
        buf.grow(column_block_words::<E>(slice_words * E::PER_WORD, columns.packed_width(*cols)));
    }
    let mut packed_slice = None;
    for step in 0..n_blocks * n_slices {
        let (block, si) =
            if sums_in_output { (step % n_blocks, step / n_blocks) } else { (step / n_slices, step % n_slices) };
        let ic = rows.start + block * block_rows;
        let mc = block_rows.min(rows.end - ic);
        let (pc, kc) = slice(si);
        // B's packed words, their layout and which of their slices this one is.
        let (b, packed, packed_si) = match &mut rhs {
            BlockOfB::Packed(b, packed) => (&**b, *packed, si),
            BlockOfB::Unpacked(columns, from, buf) => {
                if packed_slice != Some(si) {
                    pack_columns::<E>(buf, *columns, (pc, kc), *from);
                    packed_slice = Some(si);
                }
                (&buf[..], PackedBlock::new::<E>(nc, kc), 0)
            }
        };
        pack::<E, MR>(a, MR, Mat { ptr: lhs.ptr, rs: lhs.cs, cs: lhs.rs }, pc, kc, ic, mc);
        let words = kc.div_ceil(E::PER_WORD);
        if widened {
            debug_assert_eq!(E::PER_WORD, 2, "only bf16 pairs are widened for FMAs");
            // Once per block, not per B panel: every panel of the block reuses it.
            let (packed_a, wide) = a.split_at_mut(block_words);
            widen_pair_rows::<MR>(&packed_a[..mc.next_multiple_of(MR) * words], wide);
        }
        for jr in (0..nc).step_by(NR) {
            let mut b_panel = b.as_ptr().add(packed.panel(jr, packed_si, slice_words));
            if widened {
                // Once per panel slice, ahead of the row panels that all read it from L1.
                let wide_b = &mut a[wide_b_at..];
                widen_pair_rows::<NR>(std::slice::from_raw_parts(b_panel, words * NR), wide_b);
                b_panel = wide_b.as_ptr();
            }
            for ir in (0..mc).step_by(MR) {
                let a_panel = a.as_ptr().add(ir * words);
                let c_tile = c.as_mut_ptr().wrapping_add(ir * NC + jr);
                let (tile_rows, tile_cols) = (MR.min(mc - ir), NR.min(nc - jr));
                let sink = if sums_in_output || si + 1 == n_slices {
                    let accumulate = accumulate || (sums_in_output && si > 0);
                    Sink::Output { rows: tile_rows, cols: tile_cols, accumulate }
                } else {
                    Sink::Scratch
                };
                let carried = (si > 0 && !sums_in_output).then_some(c_tile as *const f32);
                let out = Dst { ptr: dst.ptr.offset((ic + ir) as isize * dst.rs + (jc + jr) as isize * dst.cs), ..dst };
                if sums_in_output && si > 0 {
                    // The sums this tile adds to were last touched a whole B slice ago (L3):
                    // fetched during its k loop, not after it (2% at k = 4096).
                    prefetch_rows(out, tile_rows);
                }
                if widened {
                    let a_wide = a.as_ptr().add(block_words + 2 * ir * words);
                    if simd == Simd::Avx512 {
                        micro_avx512_widened(2 * words, a_wide, b_panel, carried, sink, c_tile, out);
                    } else {
                        micro_avx2(2 * words, a_wide, b_panel, carried, sink, c_tile, out);
                    }
                } else if simd == Simd::Avx512 {
                    E::micro_avx512(words, a_panel, b_panel, carried, sink, c_tile, out);
                } else if simd == Simd::Avx2 {
                    debug_assert_eq!(E::PER_WORD, 1, "AVX2 multiplies bf16 pairs widened");
                    micro_avx2(words, a_panel, b_panel, carried, sink, c_tile, out);
                } else {
                    let mut tile = [[0f32; NR]; MR];
                    micro_portable::<E>(words, a_panel, b_panel, carried, &mut tile);
                    finish(&tile, sink, c_tile, out);
                }
            }
        }
    }
}

/// Asks for the first `rows` rows of a tile of `NR` outputs to be brought into L1 ahead of use.
fn prefetch_rows<T>(out: Dst<T>, rows: usize) {
    for i in 0..rows {
        prefetch_line_run(out.ptr.wrapping_offset(i as isize * out.rs) as *const u8, NR * std::mem::size_of::<T>());
    }
}

/// Rows of A an AMX product packs per slice (520 KiB at the full slice depth, in L2): each B
/// panel's slice is then read by four 32-row blocks in turn before the next (64 and 128 rows ran
/// 2-10% faster than 256 and 512 on the Llama shapes; 64 ran no faster than 128 with deep slices).
const MC_AMX: usize = 128;

/// [`multiply`] on AMX tiles (bf16): for each slice of k, A's row block is packed as rows of
/// words ([`pack_word_rows`]), and each B panel multiplies it 32 rows at a time, the 32 × 32
/// sums carried between slices in the scratch block and rounded into the output after the last.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn multiply_amx<E: Packed, O: GemmOut>(
    rows: std::ops::Range<usize>,
    (jc, nc): (usize, usize),
    k: usize,
    dst: Dst<O>,
    lhs: Mat<E>,
    (b, packed): (&[u32], PackedBlock),
    accumulate: bool,
    (a, c): (&mut LineBuf<u32>, &mut LineBuf<f32>),
) {
    use crate::amx::{Tiles, BLOCK, TILE_WORDS};
    use std::arch::x86_64::*;
    #[repr(C, align(64))]
    struct Aligned<T>(T);
    let slice_words = Micro::Amx.slice_words();
    let (n_slices, slice) = slices::<E>(k, slice_words);
    a.grow(MC_AMX * (slice_words + TILE_WORDS));
    if n_slices > 1 {
        c.grow(MC_AMX * NC);
    }
    let mut block = Aligned([[0f32; BLOCK]; BLOCK]);
    let mut transposed = Aligned([[0f32; BLOCK]; BLOCK]);
    // A ragged last step of B rows, zero-padded to a whole step.
    let mut b_last = Aligned([0u32; TILE_WORDS * NR]);
    let tiles = Tiles::configure();
    for ic in (rows.start..rows.end).step_by(MC_AMX) {
        let mc = MC_AMX.min(rows.end - ic);
        for si in 0..n_slices {
            let (pc, kc) = slice(si);
            let row_words = pack_word_rows(a, lhs, pc, kc, ic, mc);
            let words = kc.div_ceil(E::PER_WORD);
            let steps = words.div_ceil(TILE_WORDS);
            let last_slice = si + 1 == n_slices;
            for jr in (0..nc).step_by(NR) {
                let b_panel = b.as_ptr().add(packed.panel(jr, si, slice_words));
                let ragged = (words % TILE_WORDS != 0).then(|| {
                    let done = (steps - 1) * TILE_WORDS;
                    let ragged = (words - done) * NR;
                    std::ptr::copy_nonoverlapping(b_panel.add(done * NR), b_last.0.as_mut_ptr(), ragged);
                    b_last.0[ragged..].fill(0);
                    b_last.0.as_ptr()
                });
                for ir in (0..mc).step_by(BLOCK) {
                    let carried = (c.as_mut_ptr().wrapping_add(ir * NC + jr), 4 * NC);
                    let corner = dst.ptr.offset((ic + ir) as isize * dst.rs + (jc + jr) as isize * dst.cs);
                    // A whole block of a row-major f32 output (attention's scores and P·V sums):
                    // the tiles start from it when accumulating and end in it, with no epilogue
                    // (which cost about as much as the products at attention's 128-deep k).
                    let in_place = O::IS_F32 && dst.cs == 1 && dst.rs > 0 && mc - ir >= BLOCK && nc - jr >= NR;
                    let in_place = in_place.then_some((corner as *mut f32, 4 * dst.rs as usize));
                    match (si, in_place) {
                        (0, Some(output)) if accumulate => tiles.load((output.0, output.1)),
                        (0, _) => tiles.zero(),
                        _ => tiles.load((carried.0, carried.1)),
                    }
                    tiles.add_product(steps, (a.as_ptr().add(ir * row_words), 4 * row_words), b_panel, ragged);
                    if !last_slice {
                        tiles.store(carried);
                        continue;
                    }
                    if let Some(output) = in_place {
                        tiles.store(output);
                        continue;
                    }
                    tiles.store((block.0.as_mut_ptr() as *mut f32, 4 * BLOCK));
                    let (mut rows, mut cols) = (BLOCK.min(mc - ir), NR.min(nc - jr));
                    let mut out = Dst { ptr: corner, ..dst };
                    let mut result = &block.0;
                    if dst.rs == 1 && dst.cs != 1 {
                        // A transposed product (see `gemm_rows_packed`): the output's rows are the
                        // block's columns, so the block is transposed to store whole rows.
                        let (to, from) = (transposed.0.as_mut_ptr() as *mut u32, block.0.as_ptr() as *const u8);
                        crate::transpose::transpose_words(to, BLOCK, from, 4 * BLOCK as isize, BLOCK, BLOCK);
                        (result, rows, cols, out) = (&transposed.0, cols, rows, Dst { ptr: corner, rs: dst.cs, cs: 1 });
                    }
                    for r0 in (0..rows).step_by(MR) {
                        let acc: [[__m512; 2]; MR] = std::array::from_fn(|i| {
                            let row = result[r0 + i].as_ptr();
                            [_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(16))]
                        });
                        let out = Dst { ptr: out.ptr.offset(r0 as isize * out.rs), ..out };
                        let sink = Sink::Output { rows: MR.min(rows - r0), cols, accumulate };
                        store_avx512(&acc, sink, std::ptr::null_mut(), out);
                    }
                }
            }
        }
    }
}

/// Packs rows `r0..r0 + rows` × k `k0..k0 + kc` of `m` as AMX's A operand: each row's
/// consecutive-k pairs as words, rows padded with zero words to whole tile steps and zero rows
/// to whole blocks. Returns the words per row.
#[cfg(target_arch = "x86_64")]
unsafe fn pack_word_rows<E: Packed>(out: &mut [u32], m: Mat<E>, k0: usize, kc: usize, r0: usize, rows: usize) -> usize {
    use crate::amx::{BLOCK, TILE_WORDS};
    const LINE: usize = 16;
    let words = kc.div_ceil(E::PER_WORD);
    // An odd number of 64-byte lines per row: a tile's 16 rows then fall in different cache sets
    // (at a power-of-two stride they share a few, and a 4 KiB one puts all 16 in one).
    let row_words = match words.div_ceil(TILE_WORDS) {
        0 => 0,
        lines => (lines | 1) * TILE_WORDS,
    };
    if row_words == 0 {
        return 0;
    }
    let out = &mut out[..rows.next_multiple_of(BLOCK) * row_words];
    let block = Mat { ptr: m.ptr.offset(r0 as isize * m.rs + k0 as isize * m.cs), ..m };
    let mut first_generic_row = 0;
    if m.cs == 1 {
        // k-dense rows (x, P, dS): each row's pairs are already words in memory.
        for (i, row) in out.chunks_exact_mut(row_words).take(rows).enumerate() {
            let halves = row.as_mut_ptr() as *mut u16;
            std::ptr::copy_nonoverlapping(block.ptr.offset(i as isize * m.rs) as *const u16, halves, kc);
            std::slice::from_raw_parts_mut(halves.add(kc), 2 * row_words - kc).fill(0);
        }
        first_generic_row = rows;
    } else if m.rs == 1 && kc.is_multiple_of(E::PER_WORD) {
        // Dense along the rows (a transposed operand: dS^T, P^T, dy^T, a^T): 16 rows' words of
        // one pair of k lines at a time, from the two lines' contiguous halves, gathered 16 pairs
        // deep and transposed into the rows (stored one word at a time, the rows' scattered
        // stores had a tenth of linear_backward's samples). The pairs of lines are the outer
        // walk, so each line is read once, in order, for all the row groups (row groups outside
        // read each line 32 bytes at a time, a new page per line at a 4 KiB stride).
        let mut lines = [[0u32; LINE]; LINE];
        let whole_groups = rows - rows % LINE;
        for p0 in (0..words).step_by(LINE) {
            let depth = LINE.min(words - p0);
            for i0 in (0..whole_groups).step_by(LINE) {
                for (p, line) in lines.iter_mut().enumerate().take(depth) {
                    let pair = block.ptr.offset(i0 as isize + (E::PER_WORD * (p0 + p)) as isize * m.cs);
                    E::row_words::<LINE>(line, pair, m.cs);
                }
                let (to, from) = (out[i0 * row_words + p0..].as_mut_ptr(), lines.as_ptr() as *const u8);
                crate::transpose::transpose_words(to, row_words, from, 4 * LINE as isize, depth, LINE);
            }
        }
        for row in out.chunks_exact_mut(row_words).take(whole_groups) {
            row[words..].fill(0);
        }
        first_generic_row = whole_groups;
    }
    for (i, row) in out.chunks_exact_mut(row_words).enumerate().take(rows).skip(first_generic_row) {
        for (p, word) in row.iter_mut().enumerate() {
            let bits = |e: usize| bits_or_zero(block, i, E::PER_WORD * p + e, rows, kc) << (16 * e);
            *word = (0..E::PER_WORD).fold(0, |acc, e| acc | bits(e));
        }
    }
    out[rows * row_words..].fill(0);
    row_words
}

/// Element `(r, c)` of a strided matrix as a word's low bits, or 0 outside `rows × cols` (padding).
#[inline(always)]
unsafe fn bits_or_zero<E: Packed>(m: Mat<E>, r: usize, c: usize, rows: usize, cols: usize) -> u32 {
    if r < rows && c < cols {
        (*m.ptr.offset(r as isize * m.rs + c as isize * m.cs)).bits()
    } else {
        0
    }
}

/// Packs rows `k0..k0+kc` (the reduction index) × columns `c0..c0+cols` of `m` as `W`-column panels
/// of `[word][column]` words (a bf16 word's low half: the even row), zero-padded to whole words and
/// panels, each panel's rows `stride` words apart (`W`, or `NR` for the halves of a paired panel:
/// [`Columns::Pairs`]). B packs itself (`W = NR`); A packs its transpose (`W = MR`), so both
/// micro-kernel operands come from one routine.
#[allow(clippy::too_many_arguments)]
unsafe fn pack<E: Packed, const W: usize>(
    out: &mut [u32],
    stride: usize,
    m: Mat<E>,
    k0: usize,
    kc: usize,
    c0: usize,
    cols: usize,
) {
    let words = kc.div_ceil(E::PER_WORD);
    if words == 0 || cols == 0 {
        return;
    }
    let panels = cols.div_ceil(W);
    // The first word of each panel's row `p`.
    let row = |panel: usize, p: usize| (panel * words + p) * stride;
    assert!(out.len() >= row(panels - 1, words - 1) + W, "packed panels overrun their buffer");
    let block = Mat { ptr: m.ptr.offset(k0 as isize * m.rs + c0 as isize * m.cs), ..m };
    let whole_panels = if kc.is_multiple_of(E::PER_WORD) { cols / W } else { 0 };
    let mut first_panel = 0;
    if m.cs == 1 && m.rs != 1 && whole_panels > 0 {
        // Dense along the columns (a row-major B, a transposed A): word by word across all whole
        // panels so each row is read once, in order (panel by panel, a 4 KiB row stride defeated
        // the prefetcher and the loads missed). Each row is a short run (1 KiB of bf16 for 512
        // columns) a whole row stride from the last, which the hardware prefetchers did not see
        // coming: the rows `PACK_AHEAD_WORDS` words on are asked for while these are packed. bf16
        // `[2880, 5760]` weights times 16, 64 and 256 rows ran 0.88x, 0.94x and 0.98x the time
        // without (medians of 8 alternations in one process).
        let row_bytes = whole_panels * W * std::mem::size_of::<E>();
        for p in 0..words {
            let from = block.ptr.offset((E::PER_WORD * p) as isize * m.rs);
            if p + PACK_AHEAD_WORDS < words {
                let ahead = from.wrapping_offset((E::PER_WORD * PACK_AHEAD_WORDS) as isize * m.rs);
                for r in 0..E::PER_WORD {
                    prefetch_line_run(ahead.wrapping_offset(r as isize * m.rs) as *const u8, row_bytes);
                }
            }
            for panel in 0..whole_panels {
                E::row_words::<W>(&mut out[row(panel, p)..][..W], from.add(panel * W), m.rs);
            }
        }
        first_panel = whole_panels;
    }
    for panel in first_panel..panels {
        let first = panel * W;
        if panel < whole_panels && m.rs == 1 {
            // Dense along k (x's rows, a transposed weight's columns): the panel is the transpose
            // of W lines of words.
            let lines = block.ptr.offset(first as isize * m.cs) as *const u8;
            let line_bytes = m.cs * std::mem::size_of::<E>() as isize;
            let to = out[row(panel, 0)..].as_mut_ptr();
            crate::transpose::transpose_words(to, stride, lines, line_bytes, W, words);
        } else {
            for p in 0..words {
                for (j, w) in out[row(panel, p)..][..W].iter_mut().enumerate() {
                    *w = (0..E::PER_WORD).fold(0, |acc, e| {
                        acc | bits_or_zero(block, E::PER_WORD * p + e, first + j, kc, cols) << (16 * e)
                    });
                }
            }
        }
    }
}

/// How far ahead of its packing a row-major operand's rows are prefetched, in words (2 for bf16:
/// 4 rows). 2 and 4 ran level; 8 and 16 lost a few percent of their gain at 64 rows.
const PACK_AHEAD_WORDS: usize = 2;

/// Asks for the `bytes` from `start` to be brought into L1 ahead of use.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn prefetch_line_run(start: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..bytes).step_by(64) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(line) as *const i8) };
    }
}

/// `words[j] = even[j] | odd[j] << 16` for `W` columns (a multiple of 8): SSE2's word unpacking
/// where x86-64 guarantees it (LLVM left the plain loop scalar).
#[inline(always)]
unsafe fn interleave<const W: usize>(words: &mut [u32], even: *const u16, odd: *const u16) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        for c in (0..W).step_by(8) {
            let e = _mm_loadu_si128(even.add(c) as *const __m128i);
            let o = _mm_loadu_si128(odd.add(c) as *const __m128i);
            let dst = words.as_mut_ptr().add(c) as *mut __m128i;
            _mm_storeu_si128(dst, _mm_unpacklo_epi16(e, o));
            _mm_storeu_si128(dst.add(1), _mm_unpackhi_epi16(e, o));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    for (j, w) in words[..W].iter_mut().enumerate() {
        *w = *even.add(j) as u32 | (*odd.add(j) as u32) << 16;
    }
}

/// Writes a finished tile: to the scratch block, or rounded to the output.
unsafe fn finish<O: GemmOut>(tile: &[[f32; NR]; MR], sink: Sink, c_tile: *mut f32, out: Dst<O>) {
    match sink {
        Sink::Scratch => {
            for (i, row) in tile.iter().enumerate() {
                std::ptr::copy_nonoverlapping(row.as_ptr(), c_tile.add(i * NC), NR);
            }
        }
        Sink::Output { rows, cols, accumulate } => {
            for (i, row) in tile.iter().enumerate().take(rows) {
                let base = out.ptr.offset(i as isize * out.rs);
                for (j, &v) in row.iter().enumerate().take(cols) {
                    let o = base.offset(j as isize * out.cs);
                    *o = O::from_f32(if accumulate { (*o).to_f32() + v } else { v });
                }
            }
        }
    }
}

/// `carried + Σ_p a[p] ⊗ b[p]` over `words` packed words with `vdpbf16ps` (pair products).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn micro_avx512_bf16<O: GemmOut>(
    words: usize,
    a: *const u32,
    b: *const u32,
    carried: Option<*const f32>,
    sink: Sink,
    c_tile: *mut f32,
    out: Dst<O>,
) {
    use std::arch::x86_64::*;
    let pairs = |w: __m512i| std::mem::transmute::<__m512i, __m512bh>(w);
    let dot = |acc, a: __m512i, b: __m512i| _mm512_dpbf16_ps(acc, pairs(a), pairs(b));
    micro_avx512(words, a, b, carried, sink, c_tile, out, dot)
}

/// The same sums as [`micro_avx512_bf16`] with FMAs ([`Micro::Widened`]), over bf16 pairs
/// widened beforehand by [`widen_pair_rows`]: `a` and `b` hold f32 rows, `values` of them (two per
/// pair word), so this is [`micro_avx512_f32`], compiled with AVX512-BF16 for a bf16 output's
/// rounding (the f32 one runs on AVX-512 CPUs without it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn micro_avx512_widened<O: GemmOut>(
    values: usize,
    a: *const u32,
    b: *const u32,
    carried: Option<*const f32>,
    sink: Sink,
    c_tile: *mut f32,
    out: Dst<O>,
) {
    micro_avx512(values, a, b, carried, sink, c_tile, out, f32_product)
}

/// Widens rows of `W` bf16 pair words (`[pair][W]`, a packed panel's layout; `W` a multiple of
/// 8) into f32 rows `[2·pair + (0 even, 1 odd)][W]`, the layout of an f32 panel twice as deep: a
/// pair's even element is its word shifted left by 16, its odd one the word with the low half
/// cleared. Written with vector intrinsics: LLVM made the plain loop's stores scatters.
///
/// # Safety
/// The CPU has AVX2 (every widened kernel's CPU does); `out` holds twice `words`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_pair_rows<const W: usize>(words: &[u32], out: &mut [u32]) {
    use std::arch::x86_64::*;
    assert!(W.is_multiple_of(8) && out.len() >= 2 * words.len());
    let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    for (p, row) in words.chunks_exact(W).enumerate() {
        let (even, odd) = (out.as_mut_ptr().add(2 * p * W), out.as_mut_ptr().add((2 * p + 1) * W));
        for c in (0..W).step_by(8) {
            let v = _mm256_loadu_si256(row.as_ptr().add(c) as *const __m256i);
            _mm256_storeu_si256(even.add(c) as *mut __m256i, _mm256_slli_epi32::<16>(v));
            _mm256_storeu_si256(odd.add(c) as *mut __m256i, _mm256_and_si256(v, high));
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn widen_pair_rows<const W: usize>(_: &[u32], _: &mut [u32]) {
    unreachable!("the widened kernel runs on x86-64 only")
}

/// The same for f32 words, with FMAs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn micro_avx512_f32<O: GemmOut>(
    words: usize,
    a: *const u32,
    b: *const u32,
    carried: Option<*const f32>,
    sink: Sink,
    c_tile: *mut f32,
    out: Dst<O>,
) {
    micro_avx512(words, a, b, carried, sink, c_tile, out, f32_product)
}

/// One step's product of f32 words: `acc + a ⊗ b` as an FMA.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn f32_product(
    acc: std::arch::x86_64::__m512,
    a: std::arch::x86_64::__m512i,
    b: std::arch::x86_64::__m512i,
) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // SAFETY: inlined only into the two f32-word kernels above, which bring AVX-512.
    unsafe { _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc) }
}

/// `carried + Σ_p a[p] ⊗ b[p]` with `product(acc, a word broadcast, 16 b words)` per step, then
/// the tile goes to `sink` — with vector stores for scratch tiles and whole tiles of a row-major
/// output. Inlined into the callers above, which bring the target features.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn micro_avx512<O: GemmOut>(
    words: usize,
    a: *const u32,
    b: *const u32,
    carried: Option<*const f32>,
    sink: Sink,
    c_tile: *mut f32,
    out: Dst<O>,
    product: impl Fn(
        std::arch::x86_64::__m512,
        std::arch::x86_64::__m512i,
        std::arch::x86_64::__m512i,
    ) -> std::arch::x86_64::__m512,
) {
    use std::arch::x86_64::*;
    let mut acc = start_tile(carried);
    for p in 0..words {
        let bp = b.add(p * NR);
        let b0 = _mm512_loadu_si512(bp as *const __m512i);
        let b1 = _mm512_loadu_si512(bp.add(16) as *const __m512i);
        for (i, row) in acc.iter_mut().enumerate() {
            let ai = _mm512_set1_epi32(*a.add(p * MR + i) as i32);
            row[0] = product(row[0], ai, b0);
            row[1] = product(row[1], ai, b1);
        }
    }
    store_avx512(&acc, sink, c_tile, out);
}

/// A tile's registers at its first step: the sums `carried` from earlier slices, or zeros.
/// Inlined into the AVX-512 micro-kernels, which bring the target features.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn start_tile(carried: Option<*const f32>) -> [[std::arch::x86_64::__m512; 2]; MR] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    if let Some(c) = carried {
        for (i, row) in acc.iter_mut().enumerate() {
            row[0] = _mm512_loadu_ps(c.add(i * NC));
            row[1] = _mm512_loadu_ps(c.add(i * NC + 16));
        }
    }
    acc
}

/// Writes a finished `MR × NR` tile held in registers to `sink`: vector stores for scratch tiles
/// and whole tiles of a row-major output, [`finish`] for the rest. Inlined into callers that
/// bring AVX-512 (and AVX512-BF16 for a bf16 output).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn store_avx512<O: GemmOut>(
    acc: &[[std::arch::x86_64::__m512; 2]; MR],
    sink: Sink,
    c_tile: *mut f32,
    out: Dst<O>,
) {
    use std::arch::x86_64::*;
    match sink {
        Sink::Scratch => {
            for (i, row) in acc.iter().enumerate() {
                _mm512_storeu_ps(c_tile.add(i * NC), row[0]);
                _mm512_storeu_ps(c_tile.add(i * NC + 16), row[1]);
            }
        }
        Sink::Output { rows: MR, cols: NR, accumulate } if out.cs == 1 && O::IS_BF16 => {
            for (i, row) in acc.iter().enumerate() {
                let o = out.ptr.offset(i as isize * out.rs) as *mut __m256i;
                for (half, &v) in row.iter().enumerate() {
                    let v = if accumulate {
                        let old = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(o.add(half))));
                        _mm512_add_ps(v, _mm512_castsi512_ps(old))
                    } else {
                        v
                    };
                    _mm256_storeu_si256(o.add(half), std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v)));
                }
            }
        }
        Sink::Output { rows: MR, cols: NR, accumulate } if out.cs == 1 && O::IS_F32 => {
            for (i, row) in acc.iter().enumerate() {
                let o = out.ptr.offset(i as isize * out.rs) as *mut f32;
                for (half, &v) in row.iter().enumerate() {
                    let v = if accumulate { _mm512_add_ps(v, _mm512_loadu_ps(o.add(16 * half))) } else { v };
                    _mm512_storeu_ps(o.add(16 * half), v);
                }
            }
        }
        Sink::Output { .. } => {
            let mut tile = [[0f32; NR]; MR];
            for (row, t) in acc.iter().zip(tile.iter_mut()) {
                _mm512_storeu_ps(t.as_mut_ptr(), row[0]);
                _mm512_storeu_ps(t.as_mut_ptr().add(16), row[1]);
            }
            finish(&tile, sink, c_tile, out);
        }
    }
}

/// Off x86-64 no AVX-512 or AVX2 micro-kernel is ever selected (the levels come from CPU detection); these
/// stand in for them so that the callers read the same on every target.
#[cfg(not(target_arch = "x86_64"))]
macro_rules! unreachable_micro_kernels {
    ($($name:ident),*) => {$(
        unsafe fn $name<O: GemmOut>(
            _: usize,
            _: *const u32,
            _: *const u32,
            _: Option<*const f32>,
            _: Sink,
            _: *mut f32,
            _: Dst<O>,
        ) {
            unreachable!("x86-64 micro-kernels are only selected on CPUs that have their instructions")
        }
    )*};
}

#[cfg(not(target_arch = "x86_64"))]
unreachable_micro_kernels!(micro_avx512_bf16, micro_avx512_widened, micro_avx512_f32, micro_avx2);

/// The f32 sums of [`micro_avx512_f32`] with AVX2 and FMA (bf16 pairs come here widened, see
/// [`Micro::Widened`]). Sixteen registers hold a 4 × 16 part of the tile at a time (8 sums, one B
/// row's 16 columns in two registers, and a broadcast A element), so the tile is walked in four
/// parts, each over all words; a part's packed B columns (16 KiB for a full slice) stay in L1
/// meanwhile. Each finished part goes to `sink` with vector stores where the tile is whole and the
/// output row-major (the scalar [`finish`] of every f32 tile took a fifth of a 384-deep product's
/// time), else through [`finish`] once the tile is complete.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn micro_avx2<O: GemmOut>(
    words: usize,
    a: *const u32,
    b: *const u32,
    carried: Option<*const f32>,
    sink: Sink,
    c_tile: *mut f32,
    out: Dst<O>,
) {
    use std::arch::x86_64::*;
    const ROWS: usize = 4;
    const COLS: usize = 16;
    // Stored straight from the registers for the outputs add_store16 has a form for (f32, bf16).
    let whole_rows =
        matches!(sink, Sink::Output { rows: MR, cols: NR, .. }) && out.cs == 1 && (O::IS_F32 || O::IS_BF16);
    let mut edge_tile = [[0f32; NR]; MR];
    for r0 in (0..MR).step_by(ROWS) {
        for c0 in (0..NR).step_by(COLS) {
            let mut acc = [[_mm256_setzero_ps(); 2]; ROWS];
            if let Some(c) = carried {
                for (i, row) in acc.iter_mut().enumerate() {
                    for (h, v) in row.iter_mut().enumerate() {
                        *v = _mm256_loadu_ps(c.add((r0 + i) * NC + c0 + 8 * h));
                    }
                }
            }
            for p in 0..words {
                let bp = b.add(p * NR + c0) as *const f32;
                let ap = a.add(p * MR + r0) as *const f32;
                let (b0, b1) = (_mm256_loadu_ps(bp), _mm256_loadu_ps(bp.add(8)));
                for (i, row) in acc.iter_mut().enumerate() {
                    let ai = _mm256_broadcast_ss(&*ap.add(i));
                    row[0] = _mm256_fmadd_ps(ai, b0, row[0]);
                    row[1] = _mm256_fmadd_ps(ai, b1, row[1]);
                }
            }
            for (i, &[lo, hi]) in acc.iter().enumerate() {
                let (r, c) = (r0 + i, c0);
                match sink {
                    Sink::Scratch => {
                        _mm256_storeu_ps(c_tile.add(r * NC + c), lo);
                        _mm256_storeu_ps(c_tile.add(r * NC + c + 8), hi);
                    }
                    Sink::Output { accumulate, .. } if whole_rows => {
                        let o = out.ptr.offset(r as isize * out.rs).add(c);
                        if O::IS_BF16 {
                            add_store16(o as *mut uniop::half::bf16, [lo, hi], accumulate);
                        } else {
                            add_store16(o as *mut f32, [lo, hi], accumulate);
                        }
                    }
                    Sink::Output { .. } => {
                        _mm256_storeu_ps(edge_tile[r].as_mut_ptr().add(c), lo);
                        _mm256_storeu_ps(edge_tile[r].as_mut_ptr().add(c + 8), hi);
                    }
                }
            }
        }
    }
    if matches!(sink, Sink::Output { .. }) && !whole_rows {
        finish(&edge_tile, sink, c_tile, out);
    }
}

/// Stores 16 sums at `o` (adding them to what it holds when `accumulate`), narrowed to `R`.
/// Inlined into [`micro_avx2`], which brings AVX2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn add_store16<R: crate::rows_avx2::Row>(o: *mut R, [lo, hi]: [std::arch::x86_64::__m256; 2], accumulate: bool) {
    use std::arch::x86_64::_mm256_add_ps;
    let (lo, hi) =
        if accumulate { (_mm256_add_ps(lo, R::load8(o)), _mm256_add_ps(hi, R::load8(o.add(8)))) } else { (lo, hi) };
    R::store16(o, lo, hi, false);
}

/// The same sums as [`micro_avx512`] in plain Rust.
unsafe fn micro_portable<E: Packed>(
    words: usize,
    a: *const u32,
    b: *const u32,
    carried: Option<*const f32>,
    tile: &mut [[f32; NR]; MR],
) {
    if let Some(c) = carried {
        for (i, row) in tile.iter_mut().enumerate() {
            std::ptr::copy_nonoverlapping(c.add(i * NC), row.as_mut_ptr(), NR);
        }
    }
    for p in 0..words {
        let bp = std::slice::from_raw_parts(b.add(p * NR), NR);
        for (i, row) in tile.iter_mut().enumerate() {
            let [a0, a1] = E::widen(*a.add(p * MR + i));
            for (acc, &bj) in row.iter_mut().zip(bp) {
                let [b0, b1] = E::widen(bj);
                *acc += a0 * b0 + a1 * b1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ops::Range;

    /// The vendor id read from CPUID's registers (their order is EBX, EDX, ECX) is the one Linux
    /// names, so [`bf16_on_fma`] picks FMAs on Intel's cores and only there.
    #[test]
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    fn intel_is_the_vendor_linux_names() {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
        let vendor = cpuinfo
            .lines()
            .find_map(|line| line.strip_prefix("vendor_id"))
            .map(|v| v.trim_start_matches([' ', '\t', ':']));
        assert_eq!(intel(), vendor.map(str::trim) == Some("GenuineIntel"), "vendor_id {vendor:?}");
        if intel() && !bf16_on_amx() && <bf16 as Dots>::best() == Simd::Avx512 {
            assert_eq!(micro_kernel::<bf16>(), Micro::Widened(Simd::Avx512));
        }
    }

    fn values<E: Packed>(n: usize, seed: u64) -> Vec<E> {
        let mut rng = uniop::verify::Rng::new(seed);
        (0..n).map(|_| E::from_f64(rng.uniform())).collect()
    }

    fn check(m: usize, k: usize, n: usize, a_col_major: bool, b_col_major: bool, accumulate: bool) {
        check_as::<bf16>(m, k, n, a_col_major, b_col_major, accumulate);
        check_as::<f32>(m, k, n, a_col_major, b_col_major, accumulate);
    }

    /// Runs the GEMM on `[m, k]` (row-major or column-major) × `[k, n]` (either) and compares every
    /// element with an f64 sum of the same `E` values, for every micro-kernel the CPU has for `E`.
    fn check_as<E: Packed>(m: usize, k: usize, n: usize, a_col_major: bool, b_col_major: bool, accumulate: bool) {
        let (a, b) = (values::<E>(m * k, 1), values::<E>(k * n, 2));
        let strides = |rows: usize, cols: usize, col_major: bool| {
            if col_major {
                (1isize, rows as isize)
            } else {
                (cols as isize, 1isize)
            }
        };
        let ((ars, acs), (brs, bcs)) = (strides(m, k, a_col_major), strides(k, n, b_col_major));
        let get = |x: &[E], rs: isize, cs: isize, r: usize, c: usize| {
            x[(r as isize * rs + c as isize * cs) as usize].to_f64()
        };
        let start: Vec<f32> = (0..m * n).map(|i| (i % 7) as f32 - 3.0).collect();
        for micro in micro_kernels::<E>() {
            let mut out = start.clone();
            let dst = Dst { ptr: out.as_mut_ptr(), rs: n as isize, cs: 1 };
            let (lhs, rhs) = (Mat { ptr: a.as_ptr(), rs: ars, cs: acs }, Mat { ptr: b.as_ptr(), rs: brs, cs: bcs });
            // Three calls over row bands, as SPMD blocks would make them: the first packs B itself,
            // the second takes it packed beforehand (as attention's reused K/V tiles), the third
            // packed ahead as a weight (`pack_weight`), in two column bands.
            FORCED.with(|f| f.set(Some(micro)));
            let mut packed = PackedRhs::default();
            let (bands, weight) = ([0, m / 3, 2 * m / 3, m], PackedWeightBuf::pack(rhs, None, n, k, m % 2 == 1));
            unsafe {
                gemm_rows_packed(bands[0]..bands[1], n, k, dst, lhs, rhs, accumulate);
                packed.pack(rhs, n, k);
                gemm_rows_prepacked(bands[1]..bands[2], (0..n, 0..k), dst, lhs, &packed, accumulate);
                let split = if n > NR { NR } else { 0 };
                for (c0, c1) in [(0, split), (split, n)] {
                    let w = PackedWeight { n: c1, ..weight.view() }.columns_from::<E>(c0);
                    let dst = Dst { ptr: dst.ptr.add(c0), ..dst };
                    gemm_rows_packed_weight(bands[2]..bands[3], dst, lhs, w, accumulate);
                }
            }
            let start_at = |at: usize| if accumulate { start[at] as f64 } else { 0.0 };
            let what = format!("{:?} {micro:?} {m}x{k}x{n}", E::DTYPE);
            let (a_at, b_at) = (|i, p| get(&a, ars, acs, i, p), |p, j| get(&b, brs, bcs, p, j));
            assert_product(&out, (m, k, n), (a_at, b_at), start_at, &what);
        }
        FORCED.with(|f| f.set(None));
    }

    /// Asserts that row-major `out` (`m × n`) holds `start(i·n + j) + Σ_p a(i, p)·b(p, j)` over
    /// `k`, within an f32 sum's error.
    fn assert_product(
        out: &[f32],
        (m, k, n): (usize, usize, usize),
        (a, b): (impl Fn(usize, usize) -> f64, impl Fn(usize, usize) -> f64),
        start: impl Fn(usize) -> f64,
        what: &str,
    ) {
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k).map(|p| a(i, p) * b(p, j)).sum::<f64>() + start(i * n + j);
                let got = out[i * n + j] as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * (k as f64).sqrt() * (1.0 + want.abs()),
                    "{what} at ({i}, {j}): got {got}, want {want}"
                );
            }
        }
    }

    #[test]
    fn matches_f64_across_edges_slices_and_layouts() {
        // Odd k (a half-filled pair), k spanning several slices, ragged row and column panels.
        check(19, 7, 45, false, false, false);
        check(70, 600, 37, false, false, true);
        check(9, 513, 70, true, true, false);
        check(33, 64, 2100, false, true, false);
        check(8, 256, 32, true, false, true);
        // A row-major B packed slice by slice, the last slice ragged and of an odd depth.
        check(9, 1037, 70, false, false, true);
        // Several of AMX's deeper slices: whole ones and a ragged last (k-dense B), an odd k.
        check(40, 2100, 40, false, true, true);
        check(33, 4099, 20, true, false, false);
        // k-dense operands (row-major A, column-major B) with whole and ragged 8-pair groups.
        check(20, 100, 64, false, true, false);
        // k-dense operands with a first band of fewer rows than columns, at least
        // AMX_TRANSPOSED_MIN_K deep (AMX takes the product transposed): two row blocks of the
        // transposed product, ragged column blocks, accumulate, an odd k; and an unequal k-dense
        // pair with more rows than columns (not transposed).
        check(150, 1030, 170, false, true, true);
        check(99, 1101, 40, false, true, false);
        check(600, 40, 33, false, true, false);
        // Column-major A over more than one AMX row block: 16-row groups from pairs of k lines
        // and a ragged rest, ragged tile steps.
        check(800, 40, 33, true, false, true);
    }

    #[test]
    fn paired_products_hand_every_output_both_sums_once() {
        // Several row chunks (PAIR_ROWS) and a ragged one, ragged half panels (n not a multiple of
        // 16), two column blocks, k spanning several slices; k-dense (a weight) and row-major B.
        for (m, k, n) in [(1100, 300, 45), (40, 2100, 300), (33, 33, 16), (5, 9, 1)] {
            for b_col_major in [true, false] {
                pairs_case::<bf16>(m, k, n, b_col_major);
                pairs_case::<f32>(m, k, n, b_col_major);
            }
        }
    }

    #[test]
    fn empty_paired_products_on_a_fresh_thread_are_zero() {
        // k = 0 on a thread whose scratch no product has grown yet (a pool worker's first job):
        // nothing to pack, and every sum is 0.
        std::thread::spawn(|| {
            pairs_case::<bf16>(6, 0, 40, true);
            pairs_case::<f32>(6, 0, 40, true);
        })
        .join()
        .unwrap();
    }

    /// A weight packed by [`pack_weight_panels`] in two calls (as two blocks of the op), into a
    /// buffer whose words are not aligned when `unaligned`.
    struct PackedWeightBuf {
        bytes: Vec<u8>,
        at: usize,
        n: usize,
        k: usize,
        paired: bool,
    }

    impl PackedWeightBuf {
        fn pack<E: Packed>(first: Mat<E>, second: Option<Mat<E>>, n: usize, k: usize, unaligned: bool) -> Self {
            let paired = second.is_some();
            let [panels, words, lanes, per_word] = packed_weight_shape(std::mem::size_of::<E>(), n, k, paired);
            assert_eq!(per_word, E::PER_WORD);
            let panel_bytes = 4 * words * lanes;
            let mut bytes = vec![0xa5u8; panels * panel_bytes + 8];
            let at = (bytes.as_ptr() as usize).next_multiple_of(4) - bytes.as_ptr() as usize + 2 * unaligned as usize;
            for part in [0..panels / 2, panels / 2..panels] {
                let out = bytes[at + part.start * panel_bytes..].as_mut_ptr();
                unsafe { pack_weight_panels::<E>(out, first, second, (n, k), part) };
            }
            PackedWeightBuf { bytes, at, n, k, paired }
        }

        fn view(&self) -> PackedWeight {
            PackedWeight { words: self.bytes[self.at..].as_ptr(), n: self.n, k: self.k, paired: self.paired }
        }
    }

    fn pairs_case<E: Packed>(m: usize, k: usize, n: usize, b_col_major: bool) {
        let a = values::<E>(m * k, 7);
        let (first, second) = (values::<E>(k * n, 8), values::<E>(k * n, 9));
        let (brs, bcs) = if b_col_major { (1, k as isize) } else { (n as isize, 1) };
        let at = |b: &[E], p: usize, j: usize| b[(p as isize * brs + j as isize * bcs) as usize].to_f64();
        let b = |b: &[E]| Mat { ptr: b.as_ptr(), rs: brs, cs: bcs };
        let weights =
            [false, true].map(|unaligned| PackedWeightBuf::pack(b(&first), Some(b(&second)), n, k, unaligned));
        let sources = [
            PairedWeights::Weights(b(&first), b(&second)),
            PairedWeights::Packed(weights[0].view()),
            PairedWeights::Packed(weights[1].view()),
        ];
        for (micro, source) in micro_kernels::<E>().flat_map(|micro| sources.map(|s| (micro, s))) {
            FORCED.with(|f| f.set(Some(micro)));
            let mut sums = [vec![f32::NAN; m * n], vec![f32::NAN; m * n]];
            let lhs = Mat { ptr: a.as_ptr(), rs: k as isize, cs: 1 };
            unsafe {
                gemm_rows_pairs(0..m, n, k, lhs, source, |r, c, paired| {
                    assert_eq!(c % HALF, 0, "a row's sums start on a group");
                    for j in c..n.min(c + paired.len() / 2) {
                        let (group, within) = ((j - c) / HALF, (j - c) % HALF);
                        for (product, out) in sums.iter_mut().enumerate() {
                            assert!(out[r * n + j].is_nan(), "({r}, {j}) handed over twice");
                            out[r * n + j] = paired[2 * HALF * group + HALF * product + within];
                        }
                    }
                });
            }
            let packed = matches!(source, PairedWeights::Packed(_));
            let what = format!("{:?} {micro:?} {m}x{k}x{n} pairs, packed ahead: {packed}", E::DTYPE);
            let a_at = |i: usize, p: usize| a[i * k + p].to_f64();
            assert_product(&sums[0], (m, k, n), (a_at, |p, j| at(&first, p, j)), |_| 0.0, &what);
            assert_product(&sums[1], (m, k, n), (a_at, |p, j| at(&second, p, j)), |_| 0.0, &what);
        }
        FORCED.with(|f| f.set(None));
    }

    #[test]
    fn few_rows_with_k_contiguous_operands_take_dot_products() {
        // Row bands of at most SKINNY_ROWS with A row-major and B column-major (a weight in
        // [N, K] layout) run the dot-product path: k under, at and over one 32-wide step, column
        // counts not a multiple of 4, accumulate; m = 7 splits into a 2-row and a 5-row band;
        // several runs of RUN columns, the last ragged.
        check(1, 700, 45, false, true, false);
        check(3, 32, 9, false, true, true);
        check(4, 1, 5, false, true, false);
        check(7, 95, 66, false, true, false);
        check(2, 384, 2 * crate::skinny::RUN + 7, false, true, true);
    }

    #[test]
    fn few_rows_with_a_row_major_b_scale_its_lines() {
        // Row bands of at most SKINNY_ROWS with both operands row-major (decode's P · V) run the
        // line path in bf16: odd k (a last line without a partner), k = 1, column chunks whole,
        // ragged above and below 32 and several of them, accumulate; the first band of each
        // `check` is m / 3 rows (1 to 4 here).
        check(3, 7, 45, false, false, false);
        check(12, 64, 130, false, false, true);
        check(9, 1, 20, false, false, false);
        check(6, 301, 64, false, false, true);
        // A B past the cache (1 MiB) walked in blocks of lines, the last one odd and short.
        check(3, 701, 760, false, false, true);
        check(12, 701, 760, false, false, false);
    }

    #[test]
    fn empty_product_writes_zero_or_keeps_the_output() {
        check(5, 0, 9, false, false, false);
        check(5, 0, 9, false, false, true);
    }

    #[test]
    fn bf16_output_is_rounded_once() {
        // 16 × 64 whole tiles take the vector store, the 4-row and 8-column edges the scalar one.
        for (m, k, n, accumulate) in [(4, 1000, 40, false), (16, 1000, 64, false), (20, 300, 72, true)] {
            bf16_output_case(m, k, n, accumulate, false);
        }
    }

    #[test]
    fn bf16_output_products_over_blocks_layouts_and_ragged_steps() {
        // The bf16 epilogue over several row blocks and a ragged last one, ragged column panels,
        // an odd k (a half-filled last pair) and a last tile step of a few words, k-dense B (a
        // weight in [N, K] layout) and row-major B, accumulate; at least AMX_TRANSPOSED_MIN_K deep
        // with fewer rows than columns (on AMX taken transposed, each block transposed on its way
        // to the bf16 rows); two slices.
        for (m, k, n, accumulate, b_col_major) in [
            (100, 384, 72, false, true),
            (70, 301, 45, true, false),
            (33, 64, 130, true, true),
            (40, 1030, 70, false, true),
            (64, 2100, 40, true, true),
            // Row-major B over several slices: packed slice by slice (one row block; a ragged
            // odd last slice) and at its whole depth (several row blocks carry their sums).
            (40, 1031, 70, false, false),
            (130, 1031, 45, true, false),
        ] {
            bf16_output_case(m, k, n, accumulate, b_col_major);
        }
    }

    #[test]
    fn prepacked_products_walk_a_window_of_b() {
        // (m, walked depth × columns, packed k × n): one slice and block with an odd walked depth,
        // whose last pair's other half is a real element of B that A's zero padding must cancel;
        // two slices and three column blocks packed, a part of each walked; one slice walked of
        // three; a walk ending inside a 16-word tile step; AMX's deeper slices, one and part of the
        // next walked of three. Then the same walks started past leading panels and words (a mask
        // hiding a key tile's first keys): from a later panel, a later column block, deep in the
        // first slice, in the second. Past an even walked depth, before the walked depth and before
        // the walked columns B holds NaN (as a KV cache past a row's length may), A too before the
        // walked depth: no kernel may read it.
        let cases = [
            (19, (0..7, 0..45), (9, 64)),
            (40, (0..601, 0..530), (700, 1100)),
            (17, (0..300, 0..33), (1100, 40)),
            (35, (0..100, 0..50), (130, 64)),
            (17, (0..2100, 0..33), (4200, 40)),
            (19, (0..7, 32..45), (9, 64)),
            (40, (32..601, 544..1030), (700, 1100)),
            (17, (256..300, 0..33), (1100, 40)),
            (35, (64..100, 32..50), (130, 64)),
            (17, (1024..2100, 0..33), (4200, 40)),
        ];
        for (m, walked, packed) in cases {
            for b_col_major in [false, true] {
                window_case::<bf16>(m, walked.clone(), packed, b_col_major);
                window_case::<f32>(m, walked.clone(), packed, b_col_major);
            }
        }
    }

    fn window_case<E: Packed>(
        m: usize,
        (depth, cols): (Range<usize>, Range<usize>),
        (pk, pn): (usize, usize),
        b_col_major: bool,
    ) {
        let (k, n, nan) = (depth.end, cols.end, E::from_f64(f64::NAN));
        let (mut a, mut b) = (values::<E>(m * k, 5), values::<E>(pk * pn, 6));
        let (brs, bcs) = if b_col_major { (1, pk as isize) } else { (pn as isize, 1) };
        let b_index = |p: usize, j: usize| (p as isize * brs + j as isize * bcs) as usize;
        let after = if k.is_multiple_of(2) { k } else { pk };
        for (p, j) in (0..pk).flat_map(|p| (0..pn).map(move |j| (p, j))) {
            if p < depth.start || p >= after || j < cols.start {
                b[b_index(p, j)] = nan;
            }
        }
        for (i, p) in (0..m).flat_map(|i| (0..depth.start).map(move |p| (i, p))) {
            a[i * k + p] = nan;
        }
        let untouched = 7.0;
        let a_at = |i: usize, p: usize| if depth.contains(&p) { a[i * k + p].to_f64() } else { 0.0 };
        let b_at =
            |p: usize, j: usize| if depth.contains(&p) && cols.contains(&j) { b[b_index(p, j)].to_f64() } else { 0.0 };
        let start = |at: usize| if cols.contains(&(at % n)) { 0.0 } else { untouched };
        for micro in micro_kernels::<E>() {
            FORCED.with(|f| f.set(Some(micro)));
            let mut out = vec![untouched as f32; m * n];
            let mut packed = PackedRhs::default();
            unsafe {
                packed.pack(Mat { ptr: b.as_ptr(), rs: brs, cs: bcs }, pn, pk);
                let (dst, lhs) = (
                    Dst { ptr: out.as_mut_ptr(), rs: n as isize, cs: 1 },
                    Mat { ptr: a.as_ptr(), rs: k as isize, cs: 1 },
                );
                gemm_rows_prepacked(0..m, (cols.clone(), depth.clone()), dst, lhs, &packed, false);
            }
            let what = format!("{:?} {micro:?} {depth:?} x {cols:?} of {pk}x{pn}", E::DTYPE);
            assert_product(&out, (m, k, n), (a_at, b_at), start, &what);
        }
        FORCED.with(|f| f.set(None));
    }

    /// [`gemm_rows_packed`] into a bf16 output, for every micro-kernel the CPU has, into a
    /// row-major output (whole tiles take the kernels' vector stores) and a column-major one
    /// (element by element): each element is its f32 sum (plus the old output when accumulating)
    /// rounded once.
    fn bf16_output_case(m: usize, k: usize, n: usize, accumulate: bool, b_col_major: bool) {
        let (a, b) = (values::<bf16>(m * k, 3), values::<bf16>(k * n, 4));
        let (brs, bcs) = if b_col_major { (1, k) } else { (n, 1) };
        let start: Vec<bf16> = (0..m * n).map(|i| bf16::from_f32((i % 5) as f32 - 2.0)).collect();
        for micro in micro_kernels::<bf16>() {
            for out_col_major in [false, true] {
                // Output element (i, j) lives at i·rs + j·cs.
                let (rs, cs) = if out_col_major { (1, m) } else { (n, 1) };
                let mut out = vec![bf16::ZERO; m * n];
                for (at, &v) in start.iter().enumerate() {
                    out[at / n * rs + at % n * cs] = v;
                }
                FORCED.with(|f| f.set(Some(micro)));
                unsafe {
                    gemm_rows_packed(
                        0..m,
                        n,
                        k,
                        Dst { ptr: out.as_mut_ptr(), rs: rs as isize, cs: cs as isize },
                        Mat { ptr: a.as_ptr(), rs: k as isize, cs: 1 },
                        Mat { ptr: b.as_ptr(), rs: brs as isize, cs: bcs as isize },
                        accumulate,
                    )
                };
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 =
                            (0..k).map(|p| a[i * k + p].to_f64() * b[p * brs + j * bcs].to_f64()).sum::<f64>()
                                + if accumulate { start[i * n + j].to_f64() } else { 0.0 };
                        // One rounding of an f32 sum: within a bf16 ulp (plus the f32 sum's own error).
                        let what = format!(
                            "{micro:?} {m}x{k}x{n} (B column-major: {b_col_major}, output column-major: \
                             {out_col_major}) at ({i}, {j})"
                        );
                        let got = out[i * rs + j * cs].to_f64();
                        assert!((got - want).abs() <= 2f64.powi(-8) * want.abs() + 1e-4, "{what}");
                    }
                }
            }
        }
        FORCED.with(|f| f.set(None));
    }
}
