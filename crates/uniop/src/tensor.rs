//! Tensors as data: borrowed views ([`TensorRef`], [`TensorMut`]) and runtime-owned [`Tensor`]s.
//!
//! A view is a buffer plus a [`TensorMeta`]; constructing one checks that every element the layout
//! can address lies inside the buffer and that the buffer is aligned for the dtype, so kernels can
//! index without bounds anxiety. Views carry lifetimes like slices do: no raw pointers in the safe
//! API.

use crate::dtype::{DType, Element};
use crate::error::{Error, ErrorCode, Result};
use crate::layout::{Layout, TensorMeta};
use crate::runtime::{Allocator, DeviceBuffer, MemPolicy};
use std::marker::PhantomData;

pub(crate) fn check_view(meta: &TensorMeta, ptr: *const u8, len_bytes: usize) -> Result<()> {
    meta.layout.check_fits(meta.dtype, len_bytes)?;
    if !(ptr as usize).is_multiple_of(meta.dtype.size()) {
        return Err(Error::new(
            ErrorCode::ParamInvalid,
            format!("data at {ptr:p} is not aligned to {} bytes as {} requires", meta.dtype.size(), meta.dtype),
        ));
    }
    Ok(())
}

fn check_elem<T: Element>(meta: &TensorMeta) -> Result<()> {
    if meta.dtype != T::DTYPE {
        return Err(Error::new(ErrorCode::DType, format!("tensor holds {} but was read as {}", meta.dtype, T::DTYPE)));
    }
    Ok(())
}

/// A read-only tensor view borrowing its storage for `'a`.
#[derive(Clone, Debug)]
pub struct TensorRef<'a> {
    ptr: *const u8,
    len: usize,
    meta: TensorMeta,
    _life: PhantomData<&'a [u8]>,
}

// SAFETY: a TensorRef is a shared borrow of plain bytes, like `&[u8]`.
unsafe impl Send for TensorRef<'_> {}
unsafe impl Sync for TensorRef<'_> {}

/// A writable tensor view borrowing its storage exclusively for `'a`.
#[derive(Debug)]
pub struct TensorMut<'a> {
    ptr: *mut u8,
    len: usize,
    meta: TensorMeta,
    _life: PhantomData<&'a mut [u8]>,
}

// SAFETY: a TensorMut is an exclusive borrow of plain bytes, like `&mut [u8]`.
unsafe impl Send for TensorMut<'_> {}
unsafe impl Sync for TensorMut<'_> {}

fn byte_len<T>(data: &[T]) -> usize {
    std::mem::size_of_val(data)
}

impl<'a> TensorRef<'a> {
    /// A contiguous view; `data.len()` must equal the element count.
    pub fn new<T: Element>(data: &'a [T], shape: &[usize]) -> Result<Self> {
        let meta = TensorMeta::contiguous(T::DTYPE, shape)?;
        if meta.numel() != data.len() {
            return Err(Error::new(
                ErrorCode::Shape,
                format!("shape {} needs {} elements but the data holds {}", meta.layout, meta.numel(), data.len()),
            ));
        }
        Ok(TensorRef { ptr: data.as_ptr() as *const u8, len: byte_len(data), meta, _life: PhantomData })
    }

    /// A strided view into `data` (strides and offset in elements).
    pub fn strided<T: Element>(data: &'a [T], shape: &[usize], strides: &[usize], offset: usize) -> Result<Self> {
        let meta = TensorMeta { dtype: T::DTYPE, layout: Layout::strided(shape, strides, offset)? };
        Self::from_bytes_typed(data.as_ptr() as *const u8, byte_len(data), meta)
    }

    /// A view over raw bytes with an explicit dtype and layout (how frontends bind foreign data).
    pub fn from_bytes(data: &'a [u8], meta: TensorMeta) -> Result<Self> {
        Self::from_bytes_typed(data.as_ptr(), data.len(), meta)
    }

    fn from_bytes_typed(ptr: *const u8, len: usize, meta: TensorMeta) -> Result<Self> {
        check_view(&meta, ptr, len)?;
        Ok(TensorRef { ptr, len, meta, _life: PhantomData })
    }

    /// # Safety
    /// `ptr..ptr+len` must be readable and unchanged for `'a`, and `meta` must fit it
    /// (use [`TensorRef::from_bytes`] when a slice is at hand).
    pub unsafe fn from_raw(ptr: *const u8, len: usize, meta: TensorMeta) -> Result<Self> {
        Self::from_bytes_typed(ptr, len, meta)
    }

    /// A view the executor already checked when it was bound: kernels read their inputs through
    /// this on every launch, where checking the layout again was a tenth of a tiny op's run.
    ///
    /// # Safety
    /// As [`TensorRef::from_raw`], and the view must have passed its checks.
    pub(crate) unsafe fn from_checked(ptr: *const u8, len: usize, meta: TensorMeta) -> Self {
        debug_assert!(check_view(&meta, ptr, len).is_ok());
        TensorRef { ptr, len, meta, _life: PhantomData }
    }

    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }
    pub fn layout(&self) -> &Layout {
        &self.meta.layout
    }
    pub fn dtype(&self) -> DType {
        self.meta.dtype
    }
    pub fn shape(&self) -> &[usize] {
        self.meta.shape()
    }
    /// The storage's first byte, for kernels that move elements of any dtype as bytes (the
    /// layout's offsets count from here).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
    pub(crate) fn byte_len(&self) -> usize {
        self.len
    }

    /// The whole underlying storage as `T` (index it with the layout's offsets).
    pub fn storage<T: Element>(&self) -> Result<&'a [T]> {
        check_elem::<T>(&self.meta)?;
        // SAFETY: alignment and size were checked at construction; the borrow lives for 'a.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr as *const T, self.len / std::mem::size_of::<T>()) })
    }

    /// Row `r` of the `[rows, cols]` view. The last dim must be dense.
    pub fn row<T: Element>(&self, r: usize) -> &'a [T] {
        debug_assert!(self.meta.layout.is_inner_contiguous());
        let cols = self.meta.layout.rows_cols().1;
        let start = self.meta.layout.row_offset(r);
        &self.storage::<T>().expect("row(): dtype checked by the kernel's dispatch")[start..start + cols]
    }

    /// Elements in logical row-major order, converted to f64 (for references and checks).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        crate::dispatch_element!(self.meta.dtype, |T| {
            let data = self.storage::<T>().expect("dtype matches");
            (0..self.meta.numel()).map(|i| data[self.meta.layout.offset_of_linear(i)].to_f64()).collect()
        })
    }

    /// Elements in logical row-major order.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let data = self.storage::<T>()?;
        Ok((0..self.meta.numel()).map(|i| data[self.meta.layout.offset_of_linear(i)]).collect())
    }
}

impl<'a> TensorMut<'a> {
    pub fn new<T: Element>(data: &'a mut [T], shape: &[usize]) -> Result<Self> {
        let (len, meta) = {
            let r = TensorRef::new(&*data, shape)?;
            (r.len, r.meta)
        };
        Ok(TensorMut { ptr: data.as_mut_ptr() as *mut u8, len, meta, _life: PhantomData })
    }

    pub fn strided<T: Element>(data: &'a mut [T], shape: &[usize], strides: &[usize], offset: usize) -> Result<Self> {
        let (len, meta) = {
            let r = TensorRef::strided(&*data, shape, strides, offset)?;
            (r.len, r.meta)
        };
        Ok(TensorMut { ptr: data.as_mut_ptr() as *mut u8, len, meta, _life: PhantomData })
    }

    pub fn from_bytes(data: &'a mut [u8], meta: TensorMeta) -> Result<Self> {
        check_view(&meta, data.as_ptr(), data.len())?;
        Ok(TensorMut { ptr: data.as_mut_ptr(), len: data.len(), meta, _life: PhantomData })
    }

    /// # Safety
    /// `ptr..ptr+len` must be writable and not accessed through anything else for `'a`.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize, meta: TensorMeta) -> Result<Self> {
        check_view(&meta, ptr, len)?;
        Ok(TensorMut { ptr, len, meta, _life: PhantomData })
    }

    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }
    pub fn dtype(&self) -> DType {
        self.meta.dtype
    }
    pub fn shape(&self) -> &[usize] {
        self.meta.shape()
    }
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    pub(crate) fn byte_len(&self) -> usize {
        self.len
    }

    /// A read-only view of the same data for a shorter borrow.
    pub fn as_ref(&self) -> TensorRef<'_> {
        TensorRef { ptr: self.ptr, len: self.len, meta: self.meta.clone(), _life: PhantomData }
    }

    /// A shorter exclusive borrow, so one `TensorMut` can be passed to several calls.
    pub fn reborrow(&mut self) -> TensorMut<'_> {
        TensorMut { ptr: self.ptr, len: self.len, meta: self.meta.clone(), _life: PhantomData }
    }

    pub fn storage_mut<T: Element>(&mut self) -> Result<&mut [T]> {
        check_elem::<T>(&self.meta)?;
        // SAFETY: alignment and size checked at construction; exclusive borrow.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, self.len / std::mem::size_of::<T>()) })
    }
}

/// A tensor whose storage comes from the runtime's caching allocator (not `Clone`: it owns its
/// storage exclusively, so handing out a [`TensorMut`] through `&mut self` is sound).
pub struct Tensor {
    buf: DeviceBuffer,
    meta: TensorMeta,
}

impl Tensor {
    /// Uninitialised-content (but allocated) contiguous tensor. Content is whatever the cached
    /// block held; use [`Tensor::zeros`] when that matters.
    pub fn empty(dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let meta = TensorMeta::contiguous(dtype, shape)?;
        Self::with_meta(meta)
    }

    /// A tensor with an explicit (possibly strided) layout; storage covers the layout's extent.
    pub fn with_meta(meta: TensorMeta) -> Result<Tensor> {
        let bytes = meta
            .layout
            .storage_extent()?
            .checked_mul(meta.dtype.size())
            .ok_or_else(|| Error::new(ErrorCode::Shape, format!("byte size of {meta} overflows")))?;
        let buf = Allocator::global().allocate(bytes, MemPolicy::HugeFirst)?;
        Ok(Tensor { buf, meta })
    }

    pub fn zeros(dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let t = Self::empty(dtype, shape)?;
        // SAFETY: `t` is exclusively owned and no kernel has seen it yet.
        unsafe { t.buf.as_mut_slice() }.fill(0);
        Ok(t)
    }

    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Tensor> {
        let src = TensorRef::new(data, shape)?;
        let t = Self::empty(T::DTYPE, shape)?;
        // SAFETY: fresh, exclusively owned buffer of exactly this size.
        unsafe { t.buf.as_mut_slice() }.copy_from_slice(unsafe { std::slice::from_raw_parts(src.ptr, src.len) });
        Ok(t)
    }

    /// An owned copy of a view with the same layout (the storage its layout spans is copied).
    pub fn copy_of(src: &TensorRef<'_>) -> Result<Tensor> {
        let mut t = Self::with_meta(src.meta.clone())?;
        t.copy_from(src)?;
        Ok(t)
    }

    /// Overwrites this tensor's storage with `src`'s, which must have the same meta.
    pub fn copy_from(&mut self, src: &TensorRef<'_>) -> Result<()> {
        if src.meta != self.meta {
            return Err(Error::invalid(format!("copy_from: expected a view like {}, got {}", self.meta, src.meta)));
        }
        let bytes = self.meta.layout.storage_extent()? * self.meta.dtype.size();
        // SAFETY: both views were checked to span their layout's extent, and `&mut self` owns the
        // destination exclusively.
        unsafe { self.buf.as_mut_slice()[..bytes].copy_from_slice(std::slice::from_raw_parts(src.ptr, bytes)) };
        Ok(())
    }

    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }
    pub fn dtype(&self) -> DType {
        self.meta.dtype
    }
    pub fn shape(&self) -> &[usize] {
        self.meta.shape()
    }
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.buf
    }

    pub fn view(&self) -> TensorRef<'_> {
        TensorRef { ptr: self.buf.as_ptr(), len: self.buf.len(), meta: self.meta.clone(), _life: PhantomData }
    }

    pub fn view_mut(&mut self) -> TensorMut<'_> {
        TensorMut { ptr: self.buf.as_ptr(), len: self.buf.len(), meta: self.meta.clone(), _life: PhantomData }
    }

    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.view().to_vec()
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({})", self.meta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_check_bounds_and_dtype() {
        let data = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let t = TensorRef::new(&data, &[2, 3]).unwrap();
        assert_eq!(t.row::<f32>(1), &[4.0, 5.0, 6.0]);
        let tt = TensorRef::strided(&data, &[3, 2], &[1, 3], 0).unwrap();
        assert_eq!(tt.to_vec::<f32>().unwrap(), vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        assert_eq!(TensorRef::new(&data, &[4, 2]).unwrap_err().code(), ErrorCode::Shape);
        assert_eq!(TensorRef::strided(&data, &[2, 3], &[3, 1], 1).unwrap_err().code(), ErrorCode::Shape);
        assert_eq!(t.storage::<i32>().unwrap_err().code(), ErrorCode::DType);
        let bytes = [0u8; 9];
        let meta = TensorMeta::contiguous(DType::F32, &[2]).unwrap();
        let misaligned = if (bytes.as_ptr() as usize).is_multiple_of(4) { &bytes[1..] } else { &bytes[..] };
        let e = TensorRef::from_bytes(misaligned, meta).unwrap_err();
        assert!(e.message().contains("not aligned"), "{e}");
    }

    #[test]
    fn owned_tensor_round_trip() {
        let t = Tensor::from_slice(&[1i64, -2, 3], &[3]).unwrap();
        assert_eq!(t.to_vec::<i64>().unwrap(), vec![1, -2, 3]);
        let z = Tensor::zeros(DType::BF16, &[0, 5]).unwrap();
        assert_eq!(z.view().to_f64_vec(), Vec::<f64>::new());
    }
}
