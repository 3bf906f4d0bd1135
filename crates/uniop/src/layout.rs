//! Tensor layouts: shape, strides (in elements) and offset.
//!
//! A stride of 0 is a broadcast; a 0-size dimension makes an empty tensor that every op accepts.
//! All size arithmetic is overflow-checked because shapes arrive from C callers and files, and a
//! wrapped multiplication would turn into an out-of-bounds write.

use crate::dtype::DType;
use crate::error::{Error, ErrorCode, Result};
use std::fmt;
use std::sync::Arc;

#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    /// The shape followed by the strides, shared: layouts are cloned into every executor binding
    /// and every kernel's arguments, and copying them was most of a tiny op's phase-1 cost.
    dims: Arc<[usize]>,
    offset: usize,
}

impl Default for Layout {
    /// A scalar (rank 0).
    fn default() -> Layout {
        Layout::from_parts(&[], &[], 0)
    }
}

/// Formats a shape as `[4, 4096]`.
pub struct ShapeDisplay<'a>(pub &'a [usize]);

impl fmt::Display for ShapeDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, "]")
    }
}

fn overflow(what: &str, shape: &[usize]) -> Error {
    Error::new(ErrorCode::Shape, format!("{what} of shape {} overflows usize", ShapeDisplay(shape)))
}

/// Number of elements, or a shape error on overflow.
pub fn checked_numel(shape: &[usize]) -> Result<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| overflow("element count", shape))
}

fn check_ranks(shape: &[usize], strides: &[usize]) -> Result<()> {
    if shape.len() != strides.len() {
        return Err(Error::new(
            ErrorCode::Shape,
            format!(
                "shape {} has rank {} but strides {} have rank {}",
                ShapeDisplay(shape),
                shape.len(),
                ShapeDisplay(strides),
                strides.len()
            ),
        ));
    }
    Ok(())
}

/// Storage elements a view needs: `offset + Σ (dim-1)·stride + 1`, or 0 for an empty view.
fn storage_extent(shape: &[usize], strides: &[usize], offset: usize) -> Result<usize> {
    if shape.contains(&0) {
        return Ok(0);
    }
    let mut last = offset;
    for (&d, &s) in shape.iter().zip(strides) {
        last = (d - 1)
            .checked_mul(s)
            .and_then(|x| x.checked_add(last))
            .ok_or_else(|| overflow("storage extent", shape))?;
    }
    last.checked_add(1).ok_or_else(|| overflow("storage extent", shape))
}

/// [`storage_extent`] in bytes of `dtype`.
fn storage_bytes(shape: &[usize], strides: &[usize], offset: usize, dtype: DType) -> Result<usize> {
    storage_extent(shape, strides, offset)?.checked_mul(dtype.size()).ok_or_else(|| overflow("byte size", shape))
}

/// Row-major strides for `shape`, overflow-checked.
pub fn contiguous_strides(shape: &[usize]) -> Result<Vec<usize>> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1usize;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc = acc.checked_mul(shape[i].max(1)).ok_or_else(|| overflow("strides", shape))?;
    }
    Ok(strides)
}

/// NumPy/torch broadcasting of two shapes (aligned at the trailing dimension).
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i < rank - a.len() { 1 } else { a[i - (rank - a.len())] };
        let db = if i < rank - b.len() { 1 } else { b[i - (rank - b.len())] };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

impl Layout {
    /// Ranks must agree (callers check). An empty view keeps neither offset nor strides: it
    /// addresses no storage (its extent is 0), yet kernels walk its rows — `[5, 0]` has five,
    /// each empty — and slice each from its offset (`storage[offset..][..0]`), which must not
    /// lie past the zero-length buffer. With both at 0 every row starts at element 0. (Empty
    /// views count as contiguous and dense whatever their strides, as torch's do.)
    fn from_parts(shape: &[usize], strides: &[usize], offset: usize) -> Layout {
        debug_assert_eq!(shape.len(), strides.len());
        if shape.contains(&0) {
            let dims = shape.iter().copied().chain(std::iter::repeat_n(0, shape.len())).collect();
            return Layout { dims, offset: 0 };
        }
        Layout { dims: shape.iter().chain(strides).copied().collect(), offset }
    }

    /// A contiguous row-major layout.
    pub fn contiguous(shape: &[usize]) -> Result<Layout> {
        checked_numel(shape)?;
        Ok(Layout::from_parts(shape, &contiguous_strides(shape)?, 0))
    }

    /// A strided layout; checks only that ranks agree and that the extent does not overflow.
    /// Whether it fits a particular buffer is [`Layout::check_fits`]'s job.
    pub fn strided(shape: &[usize], strides: &[usize], offset: usize) -> Result<Layout> {
        check_ranks(shape, strides)?;
        storage_extent(shape, strides, offset)?;
        Ok(Layout::from_parts(shape, strides, offset))
    }

    pub fn shape(&self) -> &[usize] {
        &self.dims[..self.rank()]
    }
    pub fn strides(&self) -> &[usize] {
        &self.dims[self.rank()..]
    }
    pub fn offset(&self) -> usize {
        self.offset
    }
    pub fn rank(&self) -> usize {
        self.dims.len() / 2
    }
    /// Element count (cannot overflow: checked at construction).
    pub fn numel(&self) -> usize {
        self.shape().iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.shape().contains(&0)
    }

    /// Number of storage elements needed to hold every element of this view:
    /// `offset + Σ (dim-1)·stride + 1`, or 0 for an empty view.
    pub fn storage_extent(&self) -> Result<usize> {
        storage_extent(self.shape(), self.strides(), self.offset)
    }

    /// Checks that the view stays inside a buffer of `len_bytes` holding `dtype` elements.
    pub fn check_fits(&self, dtype: DType, len_bytes: usize) -> Result<()> {
        let need = storage_bytes(self.shape(), self.strides(), self.offset, dtype)?;
        if need > len_bytes {
            return Err(Error::new(
                ErrorCode::Shape,
                format!("view {self} of {dtype} needs {need} bytes of storage but the buffer holds {len_bytes}"),
            ));
        }
        Ok(())
    }

    /// Row-major contiguous (size-1 dims may have any stride; an empty view always is).
    pub fn is_contiguous(&self) -> bool {
        if self.is_empty() {
            return true;
        }
        let mut expected = 1;
        for (&d, &s) in self.shape().iter().zip(self.strides()).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected *= d;
        }
        true
    }

    /// No two elements share an address: taken in order of stride, each dim's stride reaches past
    /// every offset the smaller-strided dims span. Exact for every permuted, sliced, padded or
    /// broadcast layout; an interleaving of dims that happens not to collide fails it too (no
    /// framework makes one).
    pub fn is_non_overlapping(&self) -> bool {
        if self.is_empty() {
            return true;
        }
        let mut dims: smallvec::SmallVec<[(usize, usize); 8]> =
            self.shape().iter().zip(self.strides()).filter(|(&d, _)| d > 1).map(|(&d, &s)| (s, d)).collect();
        dims.sort_unstable();
        // One past the largest offset the dims so far reach; a valid layout's extent fits a usize.
        let mut span = 1usize;
        for (stride, size) in dims {
            if stride < span {
                return false;
            }
            span += stride * (size - 1);
        }
        true
    }

    /// The elements, in some order, fill `[offset, storage_extent)` exactly (contiguous up to a
    /// permutation of dims): the range of storage elements they cover, `None` when they do not.
    pub fn dense_range(&self) -> Option<std::ops::Range<usize>> {
        let extent = self.storage_extent().ok()?;
        (self.is_empty() || (self.is_non_overlapping() && extent - self.offset == self.numel()))
            .then_some(self.offset.min(extent)..extent)
    }

    /// The last dimension is dense (stride 1, or size ≤ 1), so each row is a plain slice.
    pub fn is_inner_contiguous(&self) -> bool {
        match (self.shape().last(), self.strides().last()) {
            (Some(&d), Some(&s)) => d <= 1 || s == 1,
            _ => true,
        }
    }

    /// Broadcasts this layout to `shape` by giving new and size-1 dims stride 0.
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Layout> {
        let fail = || {
            Error::new(
                ErrorCode::Shape,
                format!("cannot broadcast shape {} to {}", ShapeDisplay(self.shape()), ShapeDisplay(shape)),
            )
        };
        if shape.len() < self.rank() {
            return Err(fail());
        }
        let lead = shape.len() - self.rank();
        let mut strides = vec![0; shape.len()];
        for i in 0..self.rank() {
            let (d, s) = (self.shape()[i], self.strides()[i]);
            strides[lead + i] = if d == shape[lead + i] {
                s
            } else if d == 1 {
                0
            } else {
                return Err(fail());
            };
        }
        Ok(Layout::from_parts(shape, &strides, self.offset))
    }

    /// Storage offset (in elements) of the element at linear row-major index `i`.
    pub fn offset_of_linear(&self, mut i: usize) -> usize {
        let mut off = self.offset;
        for (&d, &s) in self.shape().iter().zip(self.strides()).rev() {
            if d == 0 {
                return off;
            }
            off += (i % d) * s;
            i /= d;
        }
        off
    }

    /// Views the tensor as `[rows, cols]` over the last dim; returns `(rows, cols)`.
    pub fn rows_cols(&self) -> (usize, usize) {
        let cols = self.shape().last().copied().unwrap_or(1);
        let rows = self.shape()[..self.rank().saturating_sub(1)].iter().product();
        (rows, cols)
    }

    /// The layout of the rows: this layout without its last dim, each element standing for the
    /// start of one row. Kernels walking rows take [`StridedRuns::broadcast`] with `inner_dims` 1
    /// instead, which reads the same offsets without building this layout (an allocation) in
    /// every block.
    pub fn rows_layout(&self) -> Layout {
        self.outer_layout(1)
    }

    /// This layout without its last `inner_dims` dims: each element stands for the start of one
    /// slice over them (a row of a norm over several trailing dims), walked as [`rows_layout`]'s.
    /// With `inner_dims` at or past the rank no dims are left: the whole tensor is one slice.
    ///
    /// [`rows_layout`]: Layout::rows_layout
    pub fn outer_layout(&self, inner_dims: usize) -> Layout {
        let lead = self.rank().saturating_sub(inner_dims);
        Layout::from_parts(&self.shape()[..lead], &self.strides()[..lead], self.offset)
    }

    /// Storage offset of the first element of row `r` in the `[rows, cols]` view.
    pub fn row_offset(&self, r: usize) -> usize {
        self.outer_offset(r, 1)
    }

    /// Storage offset of element 0 of the `r`-th slice over the last `inner_dims` dims (the
    /// leading dims may have any strides).
    pub fn outer_offset(&self, r: usize, inner_dims: usize) -> usize {
        let lead = self.rank().saturating_sub(inner_dims);
        let mut off = self.offset;
        let mut rem = r;
        for k in (0..lead).rev() {
            let d = self.shape()[k];
            off += (rem % d) * self.strides()[k];
            rem /= d;
        }
        off
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", ShapeDisplay(self.shape()))?;
        if !self.is_contiguous() || self.offset != 0 {
            write!(f, " strides {} offset {}", ShapeDisplay(self.strides()), self.offset)?;
        }
        Ok(())
    }
}

impl fmt::Debug for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Layout(shape {}, strides {}, offset {})",
            ShapeDisplay(self.shape()),
            ShapeDisplay(self.strides()),
            self.offset
        )
    }
}

/// What every frontend and `infer` talks about: dtype plus layout, no data.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorMeta {
    pub dtype: DType,
    pub layout: Layout,
}

impl TensorMeta {
    /// A dense tensor's description; an error when its element count or its byte size overflows
    /// (no buffer could hold it, and sizes computed from it later would wrap).
    pub fn contiguous(dtype: DType, shape: &[usize]) -> Result<TensorMeta> {
        let meta = TensorMeta { dtype, layout: Layout::contiguous(shape)? };
        meta.contiguous_bytes()?;
        Ok(meta)
    }
    /// The same description, borrowed.
    pub fn as_meta_ref(&self) -> MetaRef<'_> {
        MetaRef { dtype: self.dtype, shape: self.shape(), strides: self.layout.strides(), offset: self.layout.offset }
    }
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }
    pub fn rank(&self) -> usize {
        self.layout.rank()
    }
    pub fn numel(&self) -> usize {
        self.layout.numel()
    }
    /// Bytes of a contiguous tensor with this shape and dtype (overflow-checked).
    pub fn contiguous_bytes(&self) -> Result<usize> {
        self.numel().checked_mul(self.dtype.size()).ok_or_else(|| overflow("byte size", self.shape()))
    }
}

impl fmt::Display for TensorMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.dtype, self.layout)
    }
}

/// Walks `N` layouts over one shape — each of that shape, or broadcast to it in place
/// ([`StridedRuns::broadcast`]) — in row-major order as runs along the innermost dimension: the
/// building block of every elementwise kernel.
///
/// Dimensions that are contiguous with their neighbour in *all* operands are merged first, so a
/// dense tensor becomes a single run however many dims it has.
///
/// The merged dims live inline (no allocation) up to `RUN_DIMS`: small launches build one
/// of these per call, and a heap vector per operand cost more than the merge itself.
#[derive(Clone, Debug)]
pub struct StridedRuns<const N: usize> {
    shape: RunDims,
    strides: [RunDims; N],
    offsets: [usize; N],
}

/// Merged dims kept inline by [`StridedRuns`]; more spill to the heap.
const RUN_DIMS: usize = 4;
type RunDims = smallvec::SmallVec<[usize; RUN_DIMS]>;

impl<const N: usize> StridedRuns<N> {
    /// Same-shaped layouts (already broadcast).
    pub fn new(layouts: [&Layout; N]) -> Self {
        Self::broadcast(layouts[0].shape(), 0, layouts)
    }

    /// The walk of `layouts` each broadcast to `shape` (NumPy's rules: dims aligned at the end, a
    /// dim of 1 stretched with stride 0) over `shape` without its last `inner_dims` dims. With
    /// `inner_dims > 0` it visits the start of each slice over those dims — the rows of a norm
    /// over several trailing dims — and the layouts' inner dims need not agree (rms_norm's rstd
    /// keeps them as 1). The same walk as `StridedRuns::new` over each layout's
    /// `broadcast_to(shape)` and [`Layout::outer_layout`], without building those layouts: a heap
    /// allocation or two each, in every block of every launch, which took half of a tiny
    /// `rms_norm` launch's instructions (2,064 → 1,083 under callgrind). One difference: where
    /// `shape` is empty only past the walked dims, each operand's slices still start where its
    /// own strides put them (rms_norm's rstd over rows of no elements gets one value per row),
    /// while `broadcast_to` lays out an empty result at offset 0.
    pub fn broadcast(shape: &[usize], inner_dims: usize, layouts: [&Layout; N]) -> Self {
        let shape0 = &shape[..shape.len().saturating_sub(inner_dims)];
        // Operand k's stride along dim d of `shape`: 0 where it is stretched.
        let stride = |k: usize, d: usize| {
            let l = layouts[k];
            debug_assert!(l.rank() <= shape.len(), "{l} broadcast to {}", ShapeDisplay(shape));
            match d.checked_sub(shape.len() - l.rank()) {
                Some(i) if l.shape()[i] == shape[d] => l.strides()[i],
                Some(i) => {
                    debug_assert_eq!(l.shape()[i], 1, "{l} broadcast to {}", ShapeDisplay(shape));
                    0
                }
                None => 0,
            }
        };
        let mut shape = RunDims::new();
        let mut strides: [RunDims; N] = std::array::from_fn(|_| RunDims::new());
        for d in 0..shape0.len() {
            let size = shape0[d];
            if size == 1 {
                continue;
            }
            let mergeable =
                !shape.is_empty() && (0..N).all(|k| strides[k].last().copied() == Some(stride(k, d) * size));
            if mergeable {
                *shape.last_mut().unwrap() *= size;
                for k in 0..N {
                    *strides[k].last_mut().unwrap() = stride(k, d);
                }
            } else {
                shape.push(size);
                for k in 0..N {
                    strides[k].push(stride(k, d));
                }
            }
        }
        if shape0.contains(&0) {
            shape = smallvec::smallvec![0];
            strides = std::array::from_fn(|_| smallvec::smallvec![1]);
        }
        if shape.is_empty() {
            shape.push(1);
            for s in strides.iter_mut() {
                s.push(1);
            }
        }
        StridedRuns { shape, strides, offsets: std::array::from_fn(|k| layouts[k].offset()) }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Innermost strides of the merged view (one per operand).
    pub fn inner_strides(&self) -> [usize; N] {
        std::array::from_fn(|k| *self.strides[k].last().unwrap())
    }

    /// The runs covering linear elements `[start, end)`: each run's offset in every operand and
    /// its length.
    ///
    /// An iterator, not a callback, so that kernels loop over runs in their own body. A
    /// multiversioned kernel (the `multiversion` crate) is compiled with its target features, but
    /// a closure it defines is not (the crate nests the body in a plain function): a closure too
    /// large to inline ran at the baseline instruction set, `f32::mul_add` as a libm call — f16
    /// and bf16 gelu_backward ran 55x slower that way.
    #[inline(always)]
    pub fn runs(&self, start: usize, end: usize) -> Runs<'_, N> {
        Runs { walk: self, next: start, end }
    }
}

/// Iterator over the runs of a [`StridedRuns`]: see [`StridedRuns::runs`].
pub struct Runs<'a, const N: usize> {
    walk: &'a StridedRuns<N>,
    next: usize,
    end: usize,
}

impl<const N: usize> Iterator for Runs<'_, N> {
    type Item = ([usize; N], usize);

    #[inline(always)]
    fn next(&mut self) -> Option<([usize; N], usize)> {
        if self.next >= self.end {
            return None;
        }
        let w = self.walk;
        let inner = *w.shape.last().unwrap();
        let len = (inner - self.next % inner).min(self.end - self.next);
        let mut rem = self.next;
        let mut offsets = w.offsets;
        for d in (0..w.shape.len()).rev() {
            let idx = rem % w.shape[d];
            rem /= w.shape[d];
            for (offset, strides) in offsets.iter_mut().zip(&w.strides) {
                *offset += idx * strides[d];
            }
        }
        self.next += len;
        Some((offsets, len))
    }
}

impl StridedRuns<2> {
    /// Copies elements `range` of the source view (operand 1) to the destination view
    /// (operand 0), `elem_size` bytes each, run by run.
    ///
    /// # Safety
    /// `dst` and `src` must be the storages the two layouts describe, valid for every offset
    /// they reach, and no other thread may write the destination elements of `range`.
    #[inline(always)]
    pub unsafe fn copy(&self, dst: *mut u8, src: *const u8, elem_size: usize, range: std::ops::Range<usize>) {
        let [ds, ss] = self.inner_strides();
        for ([d, s], len) in self.runs(range.start, range.end) {
            if ds == 1 && ss == 1 {
                std::ptr::copy_nonoverlapping(src.add(s * elem_size), dst.add(d * elem_size), len * elem_size);
            } else {
                for j in 0..len {
                    std::ptr::copy_nonoverlapping(
                        src.add((s + j * ss) * elem_size),
                        dst.add((d + j * ds) * elem_size),
                        elem_size,
                    );
                }
            }
        }
    }
}

/// A copy into a contiguous destination from a source whose last dim is dense, taken as a
/// transpose of whole rows (runs of the last dim) in square-ish tiles where walking the
/// destination in order would not read the source in order. A permute that keeps the last dim
/// in place is the case: at HF's `[B, S, H, D]` → `[B, H, S, D]`, the ordered walk reads one
/// 256-byte bf16 row every `H · D` elements (8 KiB), and the other way every `S · D` (512 KiB),
/// a new page per row that the prefetchers never follow. In tiles of `T × T` rows, the reads run
/// along `T` rows that neighbour in the source as the writes run along `T` of the destination
/// (`uniop bench --ops permute`, that shape, 2 threads: bf16 0.94 -> 0.69 ms, f32 2.03 ->
/// 1.44 ms).
#[derive(Clone, Debug)]
pub struct RowTiles {
    shape: Vec<usize>,
    /// The source's strides (in elements) and offset, and the destination's.
    src_strides: Vec<usize>,
    src_offset: usize,
    dst_strides: Vec<usize>,
    dst_offset: usize,
    /// The destination dim just outside the row (`rank - 2`), and the one whose rows lie next to
    /// each other in the source: the tile's two sides.
    along_dst: usize,
    along_src: usize,
    tile: usize,
    /// Tiles of `along_src` rows per index of the other dims.
    src_tiles: usize,
}

impl RowTiles {
    /// The tiling of a copy from `src` into `dst` (same shape), or None where the ordered walk of
    /// [`StridedRuns`] already reads in order, or the tiles do not apply: a destination that is
    /// not contiguous, a source whose last dim is not dense, or rows whose neighbours in the
    /// destination are also their closest neighbours in the source.
    pub fn new(dst: &Layout, src: &Layout, elem_size: usize) -> Option<RowTiles> {
        let (shape, strides) = (src.shape(), src.strides());
        let rank = shape.len();
        if rank < 3 || !dst.is_contiguous() || strides[rank - 1] != 1 || shape.contains(&0) {
            return None;
        }
        let along_dst = rank - 2;
        let along_src = (0..rank - 1).filter(|&d| shape[d] > 1).min_by_key(|&d| strides[d])?;
        if along_src == along_dst || shape[along_dst] == 1 {
            return None;
        }
        // About a page of each side's rows per tile line.
        let tile = (4096 / (shape[rank - 1] * elem_size).max(1)).clamp(2, 64);
        Some(RowTiles {
            shape: shape.to_vec(),
            src_strides: strides.to_vec(),
            src_offset: src.offset(),
            dst_strides: dst.strides().to_vec(),
            dst_offset: dst.offset(),
            along_dst,
            along_src,
            tile,
            src_tiles: shape[along_src].div_ceil(tile),
        })
    }

    /// Units of work: a tile's worth of `along_src` rows (with all of `along_dst`) for each
    /// index of the other dims. Blocks split them like elements.
    pub fn items(&self) -> usize {
        let others: usize = (0..self.shape.len() - 1)
            .filter(|&d| d != self.along_src && d != self.along_dst)
            .map(|d| self.shape[d])
            .product();
        others * self.src_tiles
    }

    /// Copies work items `items` (of [`RowTiles::items`]), `elem_size` bytes per element.
    ///
    /// # Safety
    /// `dst` and `src` must be the storages the two layouts describe, valid for every offset
    /// they reach, and no other thread may write the destination rows of `items`.
    pub unsafe fn copy(&self, dst: *mut u8, src: *const u8, elem_size: usize, items: std::ops::Range<usize>) {
        let rank = self.shape.len();
        let (a, b, t) = (self.along_src, self.along_dst, self.tile);
        let row_bytes = self.shape[rank - 1] * elem_size;
        for item in items {
            let (mut rest, a0) = (item / self.src_tiles, item % self.src_tiles * t);
            let (mut from, mut to) = (self.src_offset, self.dst_offset);
            for d in (0..rank - 1).rev().filter(|&d| d != a && d != b) {
                let i = rest % self.shape[d];
                rest /= self.shape[d];
                from += i * self.src_strides[d];
                to += i * self.dst_strides[d];
            }
            let a_rows = a0..(a0 + t).min(self.shape[a]);
            for b0 in (0..self.shape[b]).step_by(t) {
                for i in a_rows.clone() {
                    for j in b0..(b0 + t).min(self.shape[b]) {
                        let s = from + i * self.src_strides[a] + j * self.src_strides[b];
                        let o = to + i * self.dst_strides[a] + j * self.dst_strides[b];
                        std::ptr::copy_nonoverlapping(src.add(s * elem_size), dst.add(o * elem_size), row_bytes);
                    }
                }
            }
        }
    }
}

/// A tensor's dtype and layout over borrowed dims: what a frontend reads off a caller's tensor
/// before building a [`TensorMeta`] — or instead of building one, when the call's [`signature`]
/// finds a cached plan: a `TensorMeta`'s dims are shared, so making one is an allocation, and
/// on a tiny op's repeated call that was the biggest part of the frontend's cost.
///
/// [`signature`]: crate::executor::signature
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetaRef<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    /// In elements, one per dim.
    pub strides: &'a [usize],
    pub offset: usize,
}

impl MetaRef<'_> {
    /// Bytes of storage the view needs (its offset included; 0 when it is empty), with the same
    /// checks as [`Layout::strided`]: ranks agree, nothing overflows.
    pub fn storage_bytes(&self) -> Result<usize> {
        check_ranks(self.shape, self.strides)?;
        storage_bytes(self.shape, self.strides, self.offset, self.dtype)
    }

    pub fn to_meta(&self) -> Result<TensorMeta> {
        Ok(TensorMeta { dtype: self.dtype, layout: Layout::strided(self.shape, self.strides, self.offset)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn empty_views_start_every_row_at_element_zero() {
        for l in [Layout::strided(&[5, 0], &[8, 2], 3).unwrap(), Layout::contiguous(&[2, 0, 7]).unwrap()] {
            assert_eq!((l.offset(), l.strides().iter().all(|&s| s == 0)), (0, true), "{l}");
            assert_eq!(l.storage_extent().unwrap(), 0);
            assert!(l.is_contiguous() && l.dense_range() == Some(0..0));
        }
        let rows = Layout::strided(&[5, 0], &[8, 2], 3).unwrap().rows_layout();
        assert!((0..5).all(|r| rows.offset_of_linear(r) == 0), "a row of [5, 0] past an empty buffer's start");
    }

    #[test]
    fn meta_ref_storage_bytes_checks_like_a_strided_layout() {
        let view = |shape: &'static [usize], strides: &'static [usize]| MetaRef {
            dtype: DType::F32,
            shape,
            strides,
            offset: 0,
        };
        // [2, 3] rows 4 apart: the last element is at 1·4 + 2·1.
        assert_eq!(view(&[2, 3], &[4, 1]).storage_bytes().unwrap(), 4 * 7);
        assert_eq!(view(&[2, 0], &[4, 1]).storage_bytes().unwrap(), 0);
        let e = view(&[2, 3], &[1]).storage_bytes().unwrap_err();
        assert_eq!(e.message(), "shape [2, 3] has rank 2 but strides [1] have rank 1");
        assert_eq!(view(&[2, 3], &[usize::MAX / 2, 1]).storage_bytes().unwrap_err().code(), ErrorCode::Shape);
        assert_eq!(view(&[usize::MAX / 2], &[1]).storage_bytes().unwrap_err().code(), ErrorCode::Shape);
        let meta = view(&[2, 3], &[4, 1]).to_meta().unwrap();
        assert_eq!((meta.shape(), meta.layout.strides()), (&[2, 3][..], &[4, 1][..]));
        assert_eq!(meta.as_meta_ref().storage_bytes().unwrap(), 4 * 7);
    }

    #[test]
    fn overlapping_and_dense_layouts() {
        let l = |shape: &[usize], strides: &[usize], offset| Layout::strided(shape, strides, offset).unwrap();
        // Permuted, padded and sliced layouts, and size-1 dims of any stride, do not overlap.
        assert!(l(&[4, 3], &[1, 4], 0).is_non_overlapping());
        assert!(l(&[4, 3], &[5, 1], 2).is_non_overlapping());
        assert!(l(&[4, 1, 3], &[3, 0, 1], 0).is_non_overlapping());
        // A broadcast dim, and strides too small for the dim below, do.
        assert!(!l(&[4, 3], &[0, 1], 0).is_non_overlapping());
        assert!(!l(&[2, 2], &[1, 1], 0).is_non_overlapping());
        assert!(!l(&[3, 4], &[3, 1], 0).is_non_overlapping());
        // Dense: contiguous up to a permutation of dims, from its offset.
        assert_eq!(l(&[4, 3], &[1, 4], 2).dense_range(), Some(2..14));
        assert_eq!(l(&[4, 3], &[5, 1], 0).dense_range(), None);
        assert_eq!(l(&[4, 3], &[0, 1], 0).dense_range(), None);
        assert_eq!(l(&[4, 0], &[1, 4], 7).dense_range(), Some(0..0));
    }

    #[test]
    fn contiguous_and_extent() {
        let l = Layout::contiguous(&[2, 3, 4]).unwrap();
        assert_eq!(l.strides(), &[12, 4, 1]);
        assert!(l.is_contiguous());
        assert_eq!(l.storage_extent().unwrap(), 24);
        let empty = Layout::contiguous(&[2, 0, 4]).unwrap();
        assert_eq!(empty.storage_extent().unwrap(), 0);
        assert_eq!(empty.numel(), 0);
        assert!(empty.is_contiguous(), "empty views need no staging copy");
    }

    #[test]
    fn overflow_is_a_shape_error() {
        let e = Layout::contiguous(&[usize::MAX / 2, 3]).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Shape);
        assert!(e.message().contains("overflows"), "{e}");
        let e = Layout::strided(&[2, 2], &[usize::MAX, 1], 0).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Shape);
        // Elements that can be counted but not stored: 2⁶² f32 are 2⁶⁴ bytes.
        let e = TensorMeta::contiguous(DType::F32, &[1 << 62]).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Shape);
        assert!(e.message().contains("byte size"), "{e}");
        assert!(TensorMeta::contiguous(DType::U8, &[1 << 62]).is_ok(), "2⁶² bytes have a size");
    }

    #[test]
    fn outer_layout_drops_the_inner_dims_and_keeps_the_offset() {
        let l = Layout::strided(&[2, 3, 4], &[20, 5, 1], 7).unwrap();
        let outer = l.outer_layout(2);
        assert_eq!((outer.shape(), outer.strides(), outer.offset()), (&[2][..], &[20][..], 7));
        assert_eq!(l.outer_layout(1).shape(), l.rows_layout().shape());
        assert_eq!(l.outer_layout(0).strides(), l.strides());
        let whole = l.outer_layout(5);
        assert_eq!((whole.rank(), whole.numel(), whole.offset()), (0, 1, 7));
    }

    #[test]
    fn fits_checks_buffer() {
        let l = Layout::strided(&[2, 2], &[4, 1], 1).unwrap();
        assert!(l.check_fits(DType::F32, 4 * 7).is_ok());
        let e = l.check_fits(DType::F32, 4 * 6).unwrap_err();
        assert!(e.message().contains("needs 28 bytes"), "{e}");
    }

    #[test]
    fn broadcast_rules() {
        assert_eq!(broadcast_shapes(&[4, 1, 3], &[5, 1]), Some(vec![4, 5, 3]));
        assert_eq!(broadcast_shapes(&[2, 3], &[4]), None);
        assert_eq!(broadcast_shapes(&[0, 3], &[1, 3]), Some(vec![0, 3]));
        let l = Layout::contiguous(&[3, 1]).unwrap().broadcast_to(&[2, 3, 4]).unwrap();
        assert_eq!(l.strides(), &[0, 1, 0]);
        assert!(Layout::contiguous(&[3]).unwrap().broadcast_to(&[4]).is_err());
    }

    /// A copy of the `src` view of `storage` (elements of `elem` bytes) into a contiguous buffer:
    /// by tiles, cut into three ranges of items as blocks would, where they apply, else None; and
    /// by the ordered walk.
    fn copies(storage: &[u8], src: &Layout, elem: usize) -> (Option<Vec<u8>>, Vec<u8>) {
        let dst = Layout::contiguous(src.shape()).unwrap();
        let mut walked = vec![0u8; dst.numel() * elem];
        let runs = StridedRuns::<2>::new([&dst, src]);
        // SAFETY: `storage` holds every offset of `src` (the callers build it so), `walked` all of `dst`.
        unsafe { runs.copy(walked.as_mut_ptr(), storage.as_ptr(), elem, 0..dst.numel()) };
        let tiled = RowTiles::new(&dst, src, elem).map(|tiles| {
            let mut out = vec![0u8; dst.numel() * elem];
            let n = tiles.items();
            for part in [0..n / 3, n / 3..n / 2, n / 2..n] {
                // SAFETY: as above.
                unsafe { tiles.copy(out.as_mut_ptr(), storage.as_ptr(), elem, part) };
            }
            out
        });
        (tiled, walked)
    }

    #[test]
    fn row_tiles_apply_only_where_the_ordered_walk_reads_out_of_order() {
        let hf = Layout::strided(&[1, 32, 2048, 128], &[8_388_608, 128, 4096, 1], 0).unwrap();
        let dst = Layout::contiguous(hf.shape()).unwrap();
        let tiles = RowTiles::new(&dst, &hf, 2).expect("[B, S, H, D] read as [B, H, S, D]");
        // 256-byte rows: tiles of 16 rows, 2 of them along the 32 heads.
        assert_eq!(tiles.items(), 2);
        // The last dim moved, a source already in order, and a strided destination.
        let moved = Layout::strided(&[4, 3, 5], &[15, 1, 3], 0).unwrap();
        assert!(RowTiles::new(&Layout::contiguous(&[4, 3, 5]).unwrap(), &moved, 4).is_none());
        let ordered = Layout::contiguous(&[4, 3, 5]).unwrap();
        assert!(RowTiles::new(&ordered, &ordered, 4).is_none());
        let padded = Layout::strided(&[1, 32, 2048, 128], &[16_777_216, 524_288, 256, 1], 0).unwrap();
        assert!(RowTiles::new(&padded, &hf, 2).is_none());
    }

    fn linear_offsets(l: &Layout) -> Vec<usize> {
        (0..l.numel()).map(|i| l.offset_of_linear(i)).collect()
    }

    fn runs_offsets(l: &Layout, start: usize, end: usize) -> Vec<usize> {
        let runs = StridedRuns::<1>::new([l]);
        let inner = runs.inner_strides()[0];
        let mut out = Vec::new();
        for ([o], len) in runs.runs(start, end) {
            out.extend((0..len).map(|j| o + j * inner));
        }
        out
    }

    fn arb_layout() -> impl Strategy<Value = Layout> {
        prop::collection::vec((0usize..4, 0usize..7), 0..5).prop_flat_map(|dims| {
            let shape: Vec<usize> = dims.iter().map(|d| d.0).collect();
            let strides: Vec<usize> = dims.iter().map(|d| d.1).collect();
            (Just(shape), Just(strides), 0usize..5)
                .prop_map(|(shape, strides, off)| Layout::strided(&shape, &strides, off).unwrap())
        })
    }

    proptest! {
        /// Walking operands broadcast in place, over the slices of the last `inner` dims, visits
        /// the elements of their broadcast layouts' outer layouts, in order: here a strided layout,
        /// a contiguous one of its shape, and a smaller one stretched to it (its first dim left
        /// out, its even-sized dims as 1 but 0 kept: an operand of an empty shape is itself empty,
        /// since `broadcast_to` lays an empty result out as offset 0, while the walk keeps each
        /// operand's own strides).
        #[test]
        fn broadcast_runs_walk_the_outer_layouts_of_the_broadcast_ones(
            l in arb_layout(), inner in 0usize..6, cut in 0usize..1000
        ) {
            let shape = l.shape();
            let dense = Layout::contiguous(shape).unwrap();
            let small: Vec<usize> = shape.iter().skip(1).map(|&d| if d > 0 && d % 2 == 0 { 1 } else { d }).collect();
            let small = Layout::contiguous(&small).unwrap();
            let outer = [&l, &dense, &small].map(|x| x.broadcast_to(shape).unwrap().outer_layout(inner));
            let want: Vec<[usize; 3]> =
                (0..outer[0].numel()).map(|i| outer.each_ref().map(|o| o.offset_of_linear(i))).collect();
            let runs = StridedRuns::broadcast(shape, inner, [&l, &dense, &small]);
            let steps = runs.inner_strides();
            let cut = cut % (want.len() + 1);
            let mut got = Vec::new();
            for (start, end) in [(0, cut), (cut, want.len())] {
                for (o, len) in runs.runs(start, end) {
                    got.extend((0..len).map(|j| std::array::from_fn(|k| o[k] + j * steps[k])));
                }
            }
            prop_assert_eq!(got, want);
        }

        #[test]
        fn runs_visit_every_element_in_order(l in arb_layout(), cut in 0usize..1000) {
            let all = linear_offsets(&l);
            let n = all.len();
            let cut = if n == 0 { 0 } else { cut % (n + 1) };
            let mut got = runs_offsets(&l, 0, cut);
            got.extend(runs_offsets(&l, cut, n));
            prop_assert_eq!(got, all);
        }

        /// A layout passing the non-overlap test has distinct offsets (the test is sound), and a
        /// dense one's offsets are exactly its range.
        #[test]
        fn non_overlap_test_is_sound_and_dense_ranges_are_exact(l in arb_layout()) {
            let mut offsets = linear_offsets(&l);
            offsets.sort_unstable();
            let distinct = offsets.windows(2).all(|w| w[0] < w[1]);
            if l.is_non_overlapping() {
                prop_assert!(distinct, "{l:?}");
            }
            if let Some(range) = l.dense_range() {
                prop_assert_eq!(offsets, range.collect::<Vec<_>>());
            }
        }

        #[test]
        fn extent_bounds_every_offset(l in arb_layout()) {
            let extent = l.storage_extent().unwrap();
            for off in linear_offsets(&l) {
                prop_assert!(off < extent);
            }
        }

        #[test]
        fn broadcast_is_symmetric_and_consistent(a in prop::collection::vec(0usize..4, 0..4), b in prop::collection::vec(0usize..4, 0..4)) {
            let ab = broadcast_shapes(&a, &b);
            prop_assert_eq!(&ab, &broadcast_shapes(&b, &a));
            if let Some(shape) = ab {
                let la = Layout::contiguous(&a).unwrap().broadcast_to(&shape).unwrap();
                let lb = Layout::contiguous(&b).unwrap().broadcast_to(&shape).unwrap();
                // Every broadcast offset points inside the original storage.
                for off in linear_offsets(&la) { prop_assert!(off < a.iter().product::<usize>().max(1)); }
                for off in linear_offsets(&lb) { prop_assert!(off < b.iter().product::<usize>().max(1)); }
            }
        }

        /// Any permutation of the dims before a dense last one, at padded strides and an offset:
        /// the tiled copy equals the ordered walk's.
        #[test]
        fn row_tiles_copy_like_the_ordered_walk(
            dims in prop::collection::vec(1usize..80, 2..5),
            row in 1usize..6,
            seed in any::<u64>(),
            pad in 0usize..3,
            offset in 0usize..4,
            elem in prop::sample::select(vec![1usize, 2, 4]),
        ) {
            // Storage dims `dims ++ [row]`, each dim's stride padded by `pad` elements.
            let mut shape = dims.clone();
            shape.push(row);
            let mut strides = vec![1; shape.len()];
            for d in (0..shape.len() - 1).rev() {
                strides[d] = strides[d + 1] * shape[d + 1] + pad;
            }
            let storage_len = offset + (0..shape.len()).map(|d| (shape[d] - 1) * strides[d]).sum::<usize>() + 1;
            let storage: Vec<u8> = (0..storage_len * elem).map(|i| (i as u64).wrapping_mul(seed | 1).to_le_bytes()[3]).collect();
            // A seeded shuffle of the leading dims.
            let mut order: Vec<usize> = (0..dims.len()).collect();
            let mut state = seed;
            for i in (1..order.len()).rev() {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                order.swap(i, (state >> 33) as usize % (i + 1));
            }
            order.push(dims.len());
            let src = Layout::strided(
                &order.iter().map(|&d| shape[d]).collect::<Vec<_>>(),
                &order.iter().map(|&d| strides[d]).collect::<Vec<_>>(),
                offset,
            ).unwrap();
            let (tiled, walked) = copies(&storage, &src, elem);
            if let Some(tiled) = tiled {
                prop_assert_eq!(tiled, walked);
            }
        }

        #[test]
        fn row_offsets_match_linear(l in arb_layout()) {
            let (rows, cols) = l.rows_cols();
            if cols > 0 {
                for r in 0..rows {
                    prop_assert_eq!(l.row_offset(r), l.offset_of_linear(r * cols));
                }
            }
        }
    }
}
