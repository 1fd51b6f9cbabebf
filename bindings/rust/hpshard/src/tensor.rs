//! DLPack tensors (`DLManagedTensor`, the C API's "DLPack tensors" section): the views of
//! library memory that engines and clips hand out.
//!
//! A [`Tensor`] owns the library's reference that keeps the memory of its engine (or clip)
//! alive until the tensor is dropped (`hps_dlpack_release`), also past the engine's drop.
//! It gives out addresses and metadata, never slices: the engine's streams write that
//! memory asynchronously, and only the engine's own accessors ([`crate::Engine::param`]
//! and the others, which borrow the engine) know when nothing in flight touches it — so a
//! slice is tied to a borrow of its engine, and a tensor to nothing. Host addresses come
//! from the library's one host/device policy ([`Tensor::host_ptr`]). A tensor can be
//! handed to another framework (any DLPack consumer) with [`Tensor::into_raw`].

use std::ffi::c_void;
use std::fmt;
use std::ptr::NonNull;

use crate::{check, sys, DType, DeviceType, Error, Result, Status};

/// A DLPack view of library memory (`DLManagedTensor`), released when dropped.
///
/// `Send` and `Sync`: its deleter may run on any thread, and its methods only read the
/// tensor's description.
pub struct Tensor {
    raw: NonNull<sys::DLManagedTensor>,
}

// SAFETY: hps_dlpack_release (the deleter of the library's tensors) may run on any
// thread; the description read by the methods is immutable.
unsafe impl Send for Tensor {}
// SAFETY: as above: &Tensor only reads the description or asks the library's policy.
unsafe impl Sync for Tensor {}

impl Tensor {
    /// A tensor a library call just handed out through `out`.
    pub(crate) fn from_out(raw: *mut sys::DLManagedTensor, function: &str) -> Result<Tensor> {
        match NonNull::new(raw) {
            Some(raw) => Ok(Tensor { raw }),
            None => Err(Error::new(
                Status::Internal,
                format!("{} returned OK and a NULL tensor", function),
            )),
        }
    }

    /// Takes ownership of a `DLManagedTensor` (of any producer): dropping the result calls
    /// its deleter.
    ///
    /// # Safety
    /// `raw` must be a valid DLPack managed tensor that nothing else releases.
    pub unsafe fn from_raw(raw: NonNull<sys::DLManagedTensor>) -> Tensor {
        Tensor { raw }
    }

    /// Hands the tensor over (to another framework, which calls its deleter when done).
    pub fn into_raw(self) -> NonNull<sys::DLManagedTensor> {
        let raw = self.raw;
        std::mem::forget(self);
        raw
    }

    fn dl(&self) -> &sys::DLTensor {
        // SAFETY: the managed tensor is valid until it is released, which needs self.
        unsafe { &self.raw.as_ref().dl_tensor }
    }

    /// The `DLTensor` it describes, for the `*_dlpack` calls; valid while `self` is.
    pub fn as_dltensor(&self) -> *const sys::DLTensor {
        self.dl()
    }

    /// The shape (row-major, compact).
    pub fn shape(&self) -> &[i64] {
        let t = self.dl();
        if t.ndim <= 0 || t.shape.is_null() {
            return &[];
        }
        // SAFETY: `ndim` dimensions at `shape`, valid while the tensor is.
        unsafe { std::slice::from_raw_parts(t.shape, t.ndim as usize) }
    }

    /// The number of elements.
    pub fn numel(&self) -> u64 {
        self.shape().iter().map(|&d| d.max(0) as u64).product()
    }

    /// The element type, when it is one of hpshard's.
    pub fn dtype(&self) -> Option<DType> {
        // dlpack.h's DLDataTypeCode: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4.
        let d = self.dl().dtype;
        match (d.code, d.bits, d.lanes) {
            (2, 32, 1) => Some(DType::FLOAT32),
            (2, 64, 1) => Some(DType::FLOAT64),
            (2, 16, 1) => Some(DType::FLOAT16),
            (4, 16, 1) => Some(DType::BFLOAT16),
            (0, 32, 1) => Some(DType::INT32),
            (0, 64, 1) => Some(DType::INT64),
            (1, 8, 1) => Some(DType::UINT8),
            _ => None,
        }
    }

    /// Where the memory is, as (type, index): the CPU for host memory, CUDA device
    /// memory as such.
    pub fn device(&self) -> (DeviceType, i32) {
        let d = self.dl().device;
        if d.device_type == sys::DLDeviceType_kDLCUDA {
            (DeviceType::CUDA, d.device_id)
        } else {
            (DeviceType::CPU, 0)
        }
    }

    /// The data's address on [`Tensor::device`] (data + byte_offset), for that device's
    /// tools. Dereferencing it is the caller's `unsafe` business (see the module
    /// documentation).
    pub fn data_ptr(&self) -> *mut c_void {
        let t = self.dl();
        (t.data as *mut u8)
            .wrapping_add(t.byte_offset as usize)
            .cast()
    }

    /// The host address of the data (`hps_dlpack_host_data`, the library's host/device
    /// policy): [`Status::FailedPrecondition`] when the memory is not host memory.
    pub fn host_ptr(&self) -> Result<*mut c_void> {
        let mut data: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid DLTensor; live out-param.
        check(unsafe { sys::hps_dlpack_host_data(self.as_dltensor(), &mut data) })?;
        Ok(data)
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        // SAFETY: we own the reference; nothing uses the tensor after this.
        let _ = unsafe { sys::hps_dlpack_release(self.raw.as_ptr()) };
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("shape", &self.shape())
            .field("dtype", &self.dtype())
            .field("device", &self.device())
            .finish()
    }
}
