//! Safe Rust wrapper over libhpshard's stable C API (`hpshard/hpshard.h`).
//!
//! * Every fallible C call returns [`Result<T>`]; on failure the [`Error`] carries the
//!   C status ([`Status`], unknown codes preserved) and the message that
//!   `hps_last_error_message()` gave right after the failing call (the message is
//!   thread-local in the C library, and it is read before any other hpshard call).
//! * Handles ([`Stream`], [`Event`]) are `NonNull` pointers owned by the wrapper;
//!   `Drop` calls `hps_stream_destroy` / `hps_event_destroy`.
//! * Enums of the C API are `#[repr(transparent)]` newtypes in `hpshard-sys`, so a
//!   value this crate does not know (from a newer library, or a bad value built with
//!   [`DType::from_raw`] to test error paths) is never undefined behaviour.
//!
//! This crate depends on std only and compiles with Rust 1.63 (Debian 12's rustc).
//!
//! # Threads
//!
//! The C API says: "one handle is used by one thread at a time; distinct handles may
//! be used concurrently", and the free functions (version, dtype, device and
//! host-sync queries) may be called from any thread. Hence [`Stream`] and [`Event`]
//! are `Send` (a handle may move to another thread) but not `Sync` (two threads may
//! not use one handle at the same time, which `&Stream` shared across threads would
//! allow, since every method takes `&self`).
//!
//! # Asynchronous copies
//!
//! `hps_memcpy_async` returns before the copy ran, so the memory must stay valid until
//! the stream has been synchronised. Two APIs exist:
//!
//! * [`memcpy_async`]: `unsafe`, raw pointers, the caller keeps the memory alive.
//! * [`Stream::scope`]: safe. The slices given to [`StreamScope::memcpy_async`] are
//!   borrowed for the whole scope, and `scope` synchronises the stream before it
//!   returns (also when the closure panics). This is the design of
//!   `std::thread::scope`. A guard object that synchronises in its `Drop` would not be
//!   sound: `std::mem::forget` is safe, so a forgotten guard would end the borrows
//!   while the copy may still write into the buffer. When that final synchronise
//!   fails, a fresh event recorded on the stream tells whether everything queued has
//!   completed (a CPU stream reports an operation's failure only then): if so the
//!   failure is kept for the next [`Stream::synchronize`]; if not (a device error) the
//!   process aborts rather than hand back memory a copy may still be writing.
//!
//! # Stores, communicators and topology
//!
//! [`Store`] (`Send + Sync`: the C API allows concurrent use), [`Communicator`]
//! (`Send`, not `Sync`), [`Topology`] (immutable, `Send + Sync`) and
//! [`HybridGroup`] wrap the communication section of the C API; enums
//! [`ReduceOp`] and [`Group`] are newtypes like [`DType`].
//! [`Communicator::abort`] is the one call the C API allows from any thread while
//! another thread uses the communicator: [`Communicator::aborter`] hands out an
//! [`Aborter`] (`Send + Sync + Copy`, can only abort) that borrows the communicator,
//! so it cannot outlive it; give it to a watchdog with `std::thread::scope`.
//!
//! # Collectives
//!
//! Every collective is asynchronous: the C API requires its buffers to stay valid
//! (and the receive buffer unaliased) until the operation completed. As for copies:
//!
//! * `unsafe` `*_raw` methods of [`Communicator`] on raw pointers return an owned
//!   [`Work`] (dropping it frees the handle, `hps_work_destroy`, without waiting).
//! * [`Communicator::scope`] is safe: the [`CommScope`] methods take typed slices
//!   ([`Element`]: `f32`, `f64`, `i32`, `i64`, `u8`, and `u16` bits as [`F16`] /
//!   [`BF16`]) borrowed for the whole scope, and return [`ScopedWork`]s. When the
//!   closure returns or unwinds, the scope waits (`hps_work_wait`) for every
//!   operation not yet known finished, also for works that were dropped or
//!   forgotten, because the scope, not the `ScopedWork`, owns the C handle. Errors
//!   of those final waits are returned from `scope` (the closure's own error
//!   first). `hps_work_wait` returns only once the operation finished, however it
//!   ended; should waiting itself fail with the operation still running (a device
//!   error, checked with `hps_work_test`), the process aborts rather than hand back
//!   memory the operation may still use.
//!
//! Each collective is written once, in the `collectives!` table of the `comm` module: an
//! entry gives the C function and the raw method's parameters, and the scoped method's
//! checks; the macro writes both methods (and the `unsafe` `*_dlpack` forms, which take
//! DLPack tensors: dtype, counts and device come from the tensors, checked by the
//! library).
//!
//! # DLPack tensors
//!
//! [`Engine::param_tensor`], [`Engine::grad_tensor`], [`Engine::loss_scale_tensors`] and
//! [`Clip::coefficient_tensor`] hand out [`Tensor`]s: DLPack views that keep their
//! engine's (or clip's) memory alive until dropped, also past the engine. A tensor gives
//! addresses and its description, and [`Tensor::into_raw`] hands it to another framework;
//! slices of engine memory come only from the engine's accessors, which borrow the engine
//! (so a slice cannot outlive the engine's borrow, nor meet its asynchronous work). Host
//! addresses, of tensors and of those slices, come from the library's one host/device
//! policy ([`Tensor::host_ptr`], `hps_dlpack_host_data`): device memory has none.
//!
//! # Hybrid global-norm clipping
//!
//! A [`Clip`] keeps the addresses of its gradients and uses them asynchronously on
//! every run, for as long as it exists. So it borrows its communicators and mutably
//! borrows every gradient given to [`Clip::add_tensor`] (typed slices of a
//! [`FloatElement`]: `f32`, `f64`, [`F16`], [`BF16`]) until it is dropped
//! (`hps_clip_destroy`). [`Clip::run`] synchronises the stream before it returns
//! the norm (one counted host sync per call), so no run is in flight once it
//! returned and forgetting the clip only leaks it; the `unsafe`
//! [`Clip::run_async`] does not synchronise. Flags are the bit set [`ClipFlags`].
//!
//! # Sharded training engine
//!
//! An [`Engine`] (stage 2: ZeRO-style sharded data parallelism) mutably borrows its
//! communicators for its whole life (so it can be `Send`; they stay usable on its
//! thread through [`Engine::sharding`] / [`Engine::dp`]). Its parameter and gradient
//! views are engine-owned memory that its streams use asynchronously; the safe views
//! ([`Engine::param`], [`Engine::grad`], [`Engine::views`]) borrow the engine mutably
//! and are handed out only once nothing in flight touches them: a parameter or
//! gradient view of a unit first waits for the unit's all-gather
//! ([`Engine::wait_parameters`], the wait the C API requires before forward anyway: a
//! dependency wait, not a host sync), and a unit's gradient views are refused from
//! the check-in that completes them on the last micro-batch ([`Engine::grad_ready`]:
//! the unit's reduction starts) until the next [`Engine::step`]. Raw addresses: [`Engine::param_ptr`] / [`Engine::grad_ptr`]. See
//! the `engine` module documentation for the full argument.
//!
//! Views and gradients are in the parameter's dtype: `f32` for float32, and the
//! `#[repr(transparent)]` `u16` newtypes [`F16`] / [`BF16`] for float16 / bfloat16
//! ([`Engine::param_f16`], [`Engine::grad_bf16`], generically [`Engine::param_as`] /
//! [`Engine::views_as`] over a [`ParamElement`], or [`Engine::typed_views`] for several
//! dtypes at once), under the same rules; a view of another type than the parameter's
//! dtype is refused. [`F16::from_f32`] / [`BF16::from_f32`] round to nearest even and
//! [`F16::to_f32`] / [`BF16::to_f32`] are exact, bit for bit as the C++ core converts.
//!
//! # Checkpoints
//!
//! A [`Checkpoint`] saves and loads one engine (`hps_checkpoint_t`): it borrows the
//! engine mutably for its life and hands it out through [`Checkpoint::engine`], so no
//! engine call runs beside a save, load or destruction, and the engine outlives it.
//! [`Checkpoint::save`] returns a [`Work`] at once (the steps that follow overlap the
//! writing); [`Checkpoint::load`] reads a checkpoint of any topology ([`LoadOptions`]:
//! partial loads). [`Checkpoint::inspect`], [`Checkpoint::verify`],
//! [`Checkpoint::read_engine_options`] and [`Checkpoint::export_safetensors`] work on a
//! path alone.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

use std::cell::Cell;
use std::ffi::CStr;
use std::fmt;
use std::marker::PhantomData;
use std::os::raw::c_char;
use std::ptr::{self, NonNull};

mod checkpoint;
mod clip;
mod comm;
mod engine;
mod half;
mod tensor;
mod topology;

pub use checkpoint::{Checkpoint, CheckpointInfo, CheckpointOptions, LoadOptions};
pub use clip::{Clip, ClipFlags, ClipOptions, FloatElement};
pub use comm::{
    rendezvous_from_env, Aborter, CommOptions, CommScope, Communicator, Element, ReduceOp,
    RendezvousInfo, ScopedWork, Store, Work,
};
pub use engine::{
    dependency_wait_stats, Engine, EngineOptions, Optimizer, ParamElement, ParamFlags, TypedView,
    View,
};
pub use half::{BF16, F16};
pub use tensor::Tensor;
pub use topology::{Group, HybridGroup, Topology};

/// The raw bindings this crate wraps.
pub use hpshard_sys as sys;

/// `HPS_VERSION_NUMBER` of the header these bindings were generated from
/// (`MAJOR * 10000 + MINOR * 100 + PATCH`). Compare with [`version_number`], the
/// loaded library's.
pub const BINDINGS_VERSION_NUMBER: u32 = sys::HPS_VERSION_NUMBER;

// ---------------------------------------------------------------------------------
// Status and errors
// ---------------------------------------------------------------------------------

/// Status of an hpshard call (`hps_status_t`). Codes unknown to this crate (a newer
/// library) are kept in [`Status::Unknown`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Status {
    /// `HPS_STATUS_OK` (0).
    Ok,
    /// `HPS_STATUS_INVALID_ARGUMENT` (1): null pointer, unknown enum value, bad size.
    InvalidArgument,
    /// `HPS_STATUS_OUT_OF_RANGE` (2): an index or a size beyond what exists.
    OutOfRange,
    /// `HPS_STATUS_NOT_FOUND` (3).
    NotFound,
    /// `HPS_STATUS_ALREADY_EXISTS` (4).
    AlreadyExists,
    /// `HPS_STATUS_FAILED_PRECONDITION` (5): a call in the wrong state or phase.
    FailedPrecondition,
    /// `HPS_STATUS_UNIMPLEMENTED` (6).
    Unimplemented,
    /// `HPS_STATUS_UNAVAILABLE` (7): a device or backend is not present.
    Unavailable,
    /// `HPS_STATUS_TIMEOUT` (8).
    Timeout,
    /// `HPS_STATUS_ABORTED` (9).
    Aborted,
    /// `HPS_STATUS_OUT_OF_MEMORY` (10).
    OutOfMemory,
    /// `HPS_STATUS_INTERNAL` (11): a bug in hpshard.
    Internal,
    /// `HPS_STATUS_BACKEND_ERROR` (12): CUDA, NCCL, Gloo or the OS reported an error.
    BackendError,
    /// A code this crate does not know. [`Status::from_code`] only produces it for
    /// codes not listed above.
    Unknown(u32),
}

impl Status {
    /// The status for a C code; unknown codes give [`Status::Unknown`].
    pub fn from_code(code: u32) -> Status {
        match code {
            0 => Status::Ok,
            1 => Status::InvalidArgument,
            2 => Status::OutOfRange,
            3 => Status::NotFound,
            4 => Status::AlreadyExists,
            5 => Status::FailedPrecondition,
            6 => Status::Unimplemented,
            7 => Status::Unavailable,
            8 => Status::Timeout,
            9 => Status::Aborted,
            10 => Status::OutOfMemory,
            11 => Status::Internal,
            12 => Status::BackendError,
            other => Status::Unknown(other),
        }
    }

    /// The status for a raw `hps_status_t`.
    pub fn from_raw(raw: sys::hps_status_t) -> Status {
        Status::from_code(raw.0)
    }

    /// The C code (`HPS_STATUS_*` value).
    pub fn code(self) -> u32 {
        match self {
            Status::Ok => 0,
            Status::InvalidArgument => 1,
            Status::OutOfRange => 2,
            Status::NotFound => 3,
            Status::AlreadyExists => 4,
            Status::FailedPrecondition => 5,
            Status::Unimplemented => 6,
            Status::Unavailable => 7,
            Status::Timeout => 8,
            Status::Aborted => 9,
            Status::OutOfMemory => 10,
            Status::Internal => 11,
            Status::BackendError => 12,
            Status::Unknown(code) => code,
        }
    }

    /// The raw `hps_status_t`.
    pub fn to_raw(self) -> sys::hps_status_t {
        sys::hps_status(self.code())
    }

    /// The library's English text for this status (see [`status_string`]).
    pub fn as_str(self) -> &'static str {
        status_string(self)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Static English text naming `status` (`hps_status_string`), e.g. "timeout";
/// "unknown status" for codes the library does not know.
pub fn status_string(status: Status) -> &'static str {
    // SAFETY: any status value is accepted; the result is static and never NULL.
    unsafe { static_str(sys::hps_status_string(status.to_raw())) }
}

/// The message of the last failing hpshard call on this thread
/// (`hps_last_error_message`), "" when none failed. [`Error`] already carries the
/// message of the call that produced it; this is for callers of [`sys`] functions.
pub fn last_error_message() -> String {
    // SAFETY: never NULL; valid until the next hpshard call on this thread, and it
    // is copied before any other call.
    unsafe { owned_string(sys::hps_last_error_message()) }
}

/// An error from an hpshard call: the C status and the library's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    /// The status the C function returned (never [`Status::Ok`] for a C failure).
    pub status: Status,
    /// `hps_last_error_message()` right after the failing call (or a message of this
    /// crate for an error it detects itself, e.g. slices of different lengths).
    pub message: String,
}

impl Error {
    /// An error with the given status and message.
    pub fn new(status: Status, message: impl Into<String>) -> Error {
        Error {
            status,
            message: message.into(),
        }
    }

    /// The error of a C call that just returned `raw`, with the thread's last error
    /// message. Must be called right after that call, before any other hpshard call.
    fn from_last_call(raw: sys::hps_status_t) -> Error {
        Error::new(Status::from_raw(raw), last_error_message())
    }

    /// The status.
    pub fn status(&self) -> Status {
        self.status
    }

    /// The C status code.
    pub fn code(&self) -> u32 {
        self.status.code()
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (code {})", self.status, self.status.code())?;
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {}

/// `Result` with hpshard's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Ok for `HPS_STATUS_OK`, else the error with the last error message. Call it
/// directly on a C call's return value.
/// A C options struct in zeroed heap memory that never moves, so its padding stays zero.
/// The library refuses a struct with a byte set past the last field it knows (a newer
/// caller's field), tail padding included; a Rust move or copy of the struct need not
/// copy its padding, so a struct built on the stack and moved may carry garbage there.
/// Fields are written in place through `DerefMut` (a field assignment writes that field
/// only).
pub(crate) struct ZeroedStruct<T> {
    ptr: NonNull<T>,
}

impl<T> ZeroedStruct<T> {
    /// # Safety
    /// All-zero bytes must be a valid `T` (a C struct of integers, floats, pointers and
    /// newtype enums), and `T` must not be zero-sized.
    pub(crate) unsafe fn new() -> ZeroedStruct<T> {
        let layout = std::alloc::Layout::new::<T>();
        // SAFETY: the caller promises a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) } as *mut T;
        match NonNull::new(raw) {
            Some(ptr) => ZeroedStruct { ptr },
            None => std::alloc::handle_alloc_error(layout),
        }
    }

    pub(crate) fn as_ptr(&self) -> *const T {
        self.ptr.as_ptr()
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut T {
        self.ptr.as_ptr()
    }
}

impl<T> std::ops::Deref for ZeroedStruct<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: allocated and zero-initialised (a valid T) in new, owned by self.
        unsafe { self.ptr.as_ref() }
    }
}

impl<T> std::ops::DerefMut for ZeroedStruct<T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in deref; &mut self is exclusive.
        unsafe { self.ptr.as_mut() }
    }
}

impl<T> Drop for ZeroedStruct<T> {
    fn drop(&mut self) {
        // SAFETY: allocated in new with this layout; T is plain data (no destructor).
        unsafe { std::alloc::dealloc(self.ptr.as_ptr() as *mut u8, std::alloc::Layout::new::<T>()) }
    }
}

fn check(raw: sys::hps_status_t) -> Result<()> {
    if raw == sys::hps_status::HPS_STATUS_OK {
        Ok(())
    } else {
        Err(Error::from_last_call(raw))
    }
}

/// # Safety
/// `p` is NULL or a NUL-terminated string that lives for the rest of the program.
unsafe fn static_str(p: *const c_char) -> &'static str {
    if p.is_null() {
        return "";
    }
    // SAFETY: by the caller's promise.
    unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("")
}

/// # Safety
/// `p` is NULL or a valid NUL-terminated string.
unsafe fn owned_string(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: by the caller's promise.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

// ---------------------------------------------------------------------------------
// Version
// ---------------------------------------------------------------------------------

/// "MAJOR.MINOR.PATCH" of the loaded library (`hps_version_string`).
pub fn version() -> &'static str {
    // SAFETY: static, never NULL.
    unsafe { static_str(sys::hps_version_string()) }
}

/// `HPS_VERSION_NUMBER` of the loaded library (`hps_version_number`).
pub fn version_number() -> u32 {
    // SAFETY: no arguments, infallible.
    unsafe { sys::hps_version_number() }
}

// ---------------------------------------------------------------------------------
// Data types
// ---------------------------------------------------------------------------------

/// An element type (`hps_dtype_t`). A newtype over the C value: [`DType::from_raw`]
/// builds any value, the library rejects unknown ones with
/// [`Status::InvalidArgument`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DType(sys::hps_dtype_t);

impl DType {
    /// `HPS_DTYPE_FLOAT32`.
    pub const FLOAT32: DType = DType(sys::hps_dtype::HPS_DTYPE_FLOAT32);
    /// `HPS_DTYPE_FLOAT64`.
    pub const FLOAT64: DType = DType(sys::hps_dtype::HPS_DTYPE_FLOAT64);
    /// `HPS_DTYPE_FLOAT16`.
    pub const FLOAT16: DType = DType(sys::hps_dtype::HPS_DTYPE_FLOAT16);
    /// `HPS_DTYPE_BFLOAT16`.
    pub const BFLOAT16: DType = DType(sys::hps_dtype::HPS_DTYPE_BFLOAT16);
    /// `HPS_DTYPE_INT32`.
    pub const INT32: DType = DType(sys::hps_dtype::HPS_DTYPE_INT32);
    /// `HPS_DTYPE_INT64`.
    pub const INT64: DType = DType(sys::hps_dtype::HPS_DTYPE_INT64);
    /// `HPS_DTYPE_UINT8`.
    pub const UINT8: DType = DType(sys::hps_dtype::HPS_DTYPE_UINT8);

    /// Every dtype these bindings know.
    pub const ALL: [DType; 7] = [
        DType::FLOAT32,
        DType::FLOAT64,
        DType::FLOAT16,
        DType::BFLOAT16,
        DType::INT32,
        DType::INT64,
        DType::UINT8,
    ];

    /// A dtype from its C value, known or not (unknown ones fail in the library).
    pub const fn from_raw(value: u32) -> DType {
        DType(sys::hps_dtype(value))
    }

    /// The C value.
    pub const fn raw(self) -> u32 {
        (self.0).0
    }

    /// Size of one element in bytes (`hps_dtype_size`).
    pub fn size(self) -> Result<usize> {
        let mut size: usize = 0;
        // SAFETY: out-param points to a live usize.
        check(unsafe { sys::hps_dtype_size(self.0, &mut size) })?;
        Ok(size)
    }

    /// Short name, e.g. "bfloat16" (`hps_dtype_name`).
    pub fn name(self) -> Result<&'static str> {
        let mut name: *const c_char = ptr::null();
        // SAFETY: out-param points to a live pointer; the result is static text.
        check(unsafe { sys::hps_dtype_name(self.0, &mut name) })?;
        // SAFETY: static, NUL-terminated text owned by the library.
        Ok(unsafe { static_str(name) })
    }
}

impl fmt::Debug for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Ok(name) => write!(f, "DType({})", name),
            Err(_) => write!(f, "DType({})", self.raw()),
        }
    }
}

// ---------------------------------------------------------------------------------
// Devices
// ---------------------------------------------------------------------------------

/// A device type (`hps_device_type_t`), a newtype over the C value.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceType(sys::hps_device_type_t);

impl DeviceType {
    /// `HPS_DEVICE_CPU`.
    pub const CPU: DeviceType = DeviceType(sys::hps_device_type::HPS_DEVICE_CPU);
    /// `HPS_DEVICE_CUDA`.
    pub const CUDA: DeviceType = DeviceType(sys::hps_device_type::HPS_DEVICE_CUDA);

    /// A device type from its C value, known or not.
    pub const fn from_raw(value: u32) -> DeviceType {
        DeviceType(sys::hps_device_type(value))
    }

    /// The C value.
    pub const fn raw(self) -> u32 {
        (self.0).0
    }

    /// How many devices of this type the process can use ([`device_count`]).
    pub fn count(self) -> Result<i32> {
        device_count(self)
    }
}

impl fmt::Debug for DeviceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            DeviceType::CPU => f.write_str("CPU"),
            DeviceType::CUDA => f.write_str("CUDA"),
            other => write!(f, "DeviceType({})", other.raw()),
        }
    }
}

impl fmt::Display for DeviceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            DeviceType::CPU => f.write_str("cpu"),
            DeviceType::CUDA => f.write_str("cuda"),
            other => write!(f, "device-type-{}", other.raw()),
        }
    }
}

/// How many devices of `device_type` this process can use (`hps_device_count`).
/// CPU: always 1. CUDA: 0 without CUDA support or a usable device.
pub fn device_count(device_type: DeviceType) -> Result<i32> {
    let mut count: i32 = 0;
    // SAFETY: out-param points to a live i32.
    check(unsafe { sys::hps_device_count(device_type.0, &mut count) })?;
    Ok(count)
}

/// Properties of one device (`hps_device_properties_t`, copied into Rust types).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceProperties {
    /// The device's type.
    pub device_type: DeviceType,
    /// The device's index within its type.
    pub index: i32,
    /// "cpu", "NVIDIA H200", ...
    pub name: String,
    /// Physical memory of the device in bytes.
    pub total_memory_bytes: u64,
    /// CUDA compute capability, major; 0 on CPU.
    pub compute_capability_major: i32,
    /// CUDA compute capability, minor; 0 on CPU.
    pub compute_capability_minor: i32,
    /// CUDA: streaming multiprocessors; CPU: hardware threads.
    pub multiprocessor_count: i32,
}

/// Properties of device (`device_type`, `index`): `hps_device_properties_init` with
/// this crate's struct size, then `hps_device_get_properties`.
/// Errors: [`Status::OutOfRange`] for no such device index.
pub fn device_properties(device_type: DeviceType, index: i32) -> Result<DeviceProperties> {
    // SAFETY: the struct is plain integers and a char array; all-zero is valid.
    let mut raw: sys::hps_device_properties_t = unsafe { std::mem::zeroed() };
    // SAFETY: `raw` is live and has the size passed.
    check(unsafe {
        sys::hps_device_properties_init(
            &mut raw,
            std::mem::size_of::<sys::hps_device_properties_t>(),
        )
    })?;
    // SAFETY: `raw` was initialised by hps_device_properties_init.
    check(unsafe { sys::hps_device_get_properties(device_type.0, index, &mut raw) })?;
    // The name is NUL-terminated by contract; stop at the array's end regardless.
    let name: Vec<u8> = raw
        .name
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Ok(DeviceProperties {
        device_type: DeviceType(raw.type_),
        index: raw.index,
        name: String::from_utf8_lossy(&name).into_owned(),
        total_memory_bytes: raw.total_memory_bytes,
        compute_capability_major: raw.compute_capability_major,
        compute_capability_minor: raw.compute_capability_minor,
        multiprocessor_count: raw.multiprocessor_count,
    })
}

// ---------------------------------------------------------------------------------
// Streams and events
// ---------------------------------------------------------------------------------

/// An ordered queue of work on one device (`hps_stream_t`). Dropping it finishes
/// the queued work, then frees it (`hps_stream_destroy`).
///
/// `Send` but not `Sync`: see the crate documentation, "Threads".
pub struct Stream {
    raw: NonNull<sys::hps_stream_t>,
    device_type: DeviceType,
    device_index: i32,
    // A failure the library reported to a synchronise of this crate's own (the end of a
    // scope) after everything queued had completed: the next `synchronize` returns it.
    deferred: Cell<Option<Error>>,
}

// SAFETY: the C API allows a handle to be used by any one thread at a time, so it may
// move between threads. Not `Sync`: concurrent use of one handle is not allowed.
unsafe impl Send for Stream {}

impl Stream {
    /// A stream on device (`device_type`, `index`) (`hps_stream_create`).
    /// Errors: [`Status::InvalidArgument`] (unknown type), [`Status::OutOfRange`]
    /// (no such device), [`Status::BackendError`].
    pub fn new(device_type: DeviceType, index: i32) -> Result<Stream> {
        let mut raw: *mut sys::hps_stream_t = ptr::null_mut();
        // SAFETY: out-param points to a live pointer.
        check(unsafe { sys::hps_stream_create(device_type.0, index, &mut raw) })?;
        match NonNull::new(raw) {
            Some(raw) => Ok(Stream {
                raw,
                device_type,
                device_index: index,
                deferred: Cell::new(None),
            }),
            None => Err(Error::new(
                Status::Internal,
                "hps_stream_create returned OK and a NULL stream",
            )),
        }
    }

    /// The raw handle, still owned by `self`.
    pub fn as_ptr(&self) -> *mut sys::hps_stream_t {
        self.raw.as_ptr()
    }

    /// The type of the device this stream was created on.
    pub fn device_type(&self) -> DeviceType {
        self.device_type
    }

    /// The index of the device this stream was created on.
    pub fn device_index(&self) -> i32 {
        self.device_index
    }

    /// Block until all work queued so far has completed (`hps_stream_synchronize`).
    /// Counts one host sync. A CPU stream returns the failure of an operation it waited
    /// for ([`Work::wait_stream`], a clip's reductions) once everything queued has
    /// completed; one that the end of a [`Stream::scope`] met comes from this call.
    pub fn synchronize(&self) -> Result<()> {
        let result = self.synchronize_here();
        match self.deferred.take() {
            None => result,
            Some(earlier) => {
                if let Err(later) = result {
                    self.deferred.set(Some(later));
                }
                Err(earlier)
            }
        }
    }

    // hps_stream_synchronize alone (no deferred failure).
    pub(crate) fn synchronize_here(&self) -> Result<()> {
        // SAFETY: live handle, used by this thread only (Stream is not Sync).
        check(unsafe { sys::hps_stream_synchronize(self.raw.as_ptr()) })
    }

    // After a failed synchronise: whether everything queued has completed all the same.
    // A CPU stream's synchronise returns an operation's failure only once it has (the
    // header's hps_stream_synchronize); after a device error nothing is known (false).
    pub(crate) fn drained_after_failure(&self) -> bool {
        match Event::new(self.device_type, self.device_index) {
            Ok(event) => event.record(self).is_ok() && event.synchronize().is_ok(),
            Err(_) => false,
        }
    }

    // The failure a synchronise of this crate's own met, for the next `synchronize`.
    pub(crate) fn defer(&self, err: Error) {
        if let Some(earlier) = self.deferred.take() {
            self.deferred.set(Some(earlier));
            return;
        }
        self.deferred.set(Some(err));
    }

    /// Make work queued after this call wait for `event`'s most recent record, without
    /// blocking the host (`hps_stream_wait_event`).
    /// Errors: [`Status::InvalidArgument`] (device mismatch),
    /// [`Status::FailedPrecondition`] (the event was never recorded).
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        // SAFETY: both handles live and not used by another thread.
        check(unsafe { sys::hps_stream_wait_event(self.raw.as_ptr(), event.raw.as_ptr()) })
    }

    /// Record `event` at the current end of this stream (same as [`Event::record`]).
    pub fn record(&self, event: &Event) -> Result<()> {
        event.record(self)
    }

    /// Run `f` with a [`StreamScope`] whose [`StreamScope::memcpy_async`] enqueues
    /// copies between borrowed slices; before `scope` returns (or unwinds) the stream
    /// is synchronised if any copy was enqueued, so the borrows end only after the
    /// copies completed. That final synchronise counts one host sync. A failure it
    /// meets once everything has completed (an operation the stream waited for failed)
    /// is returned by the next [`Stream::synchronize`]; if it cannot tell that the copies
    /// have stopped the process aborts (see the crate documentation, "Asynchronous
    /// copies").
    ///
    /// ```no_run
    /// # fn main() -> hpshard::Result<()> {
    /// use hpshard::{DeviceType, Stream};
    /// let stream = Stream::new(DeviceType::CPU, 0)?;
    /// let src = [1u8, 2, 3, 4];
    /// let mut dst = [0u8; 4];
    /// stream.scope(|s| s.memcpy_async(&mut dst, &src))?;
    /// assert_eq!(dst, src);
    /// # Ok(())
    /// # }
    /// ```
    pub fn scope<'env, F, R>(&self, f: F) -> R
    where
        F: for<'scope> FnOnce(&'scope StreamScope<'scope, 'env>) -> R,
    {
        let pending = Cell::new(false);
        let _guard = ScopeGuard {
            stream: self,
            pending: &pending,
        };
        let scope = StreamScope {
            stream: self,
            pending: &pending,
            _scope: PhantomData,
            _env: PhantomData,
        };
        f(&scope)
        // `scope`, then `_guard` drop here (also on unwinding): the guard synchronises.
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: we own the handle; nothing else uses it (we have &mut self). The C
        // function finishes queued work first and never fails for a live handle.
        let _ = unsafe { sys::hps_stream_destroy(self.raw.as_ptr()) };
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Stream").field(&self.raw).finish()
    }
}

/// Synchronises the stream when a [`Stream::scope`] ends. Private: user code only
/// ever sees `&StreamScope`, so it can neither forget nor drop this guard.
struct ScopeGuard<'a> {
    stream: &'a Stream,
    pending: &'a Cell<bool>,
}

impl Drop for ScopeGuard<'_> {
    fn drop(&mut self) {
        if !self.pending.get() {
            return;
        }
        if let Err(err) = self.stream.synchronize_here() {
            if self.stream.drained_after_failure() {
                // Nothing is in flight: the failure (of an operation the stream waited
                // for) is the next synchronize's to return.
                self.stream.defer(err);
                return;
            }
            // A copy may still be writing into memory whose borrow is about to end.
            eprintln!(
                "hpshard: synchronize at the end of Stream::scope failed ({}); \
                 aborting because enqueued copies may still use borrowed memory",
                err
            );
            std::process::abort();
        }
    }
}

/// The handle given to the closure of [`Stream::scope`]: enqueue copies between
/// slices that stay borrowed until the scope has synchronised the stream.
///
/// Invariant in both lifetimes (like `std::thread::Scope`), so a slice borrowed
/// inside the closure cannot be passed: it must outlive the whole scope.
///
/// A buffer that dies inside the scope is rejected at compile time:
///
/// ```compile_fail
/// # use hpshard::{DeviceType, Stream};
/// let stream = Stream::new(DeviceType::CPU, 0).unwrap();
/// let src = [1u8; 4];
/// stream.scope(|s| {
///     let mut local = [0u8; 4];
///     s.memcpy_async(&mut local, &src).unwrap(); // error: `local` does not live long enough
/// });
/// ```
///
/// and so is touching a destination before the scope has synchronised:
///
/// ```compile_fail
/// # use hpshard::{DeviceType, Stream};
/// let stream = Stream::new(DeviceType::CPU, 0).unwrap();
/// let src = [1u8; 4];
/// let mut dst = [0u8; 4];
/// stream.scope(|s| {
///     s.memcpy_async(&mut dst, &src).unwrap();
///     println!("{}", dst[0]); // error: `dst` is still mutably borrowed
/// });
/// ```
pub struct StreamScope<'scope, 'env: 'scope> {
    stream: &'scope Stream,
    pending: &'scope Cell<bool>,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

impl<'scope, 'env> StreamScope<'scope, 'env> {
    /// The stream this scope enqueues on (to record events, wait, synchronise).
    pub fn stream(&self) -> &'scope Stream {
        self.stream
    }

    /// Enqueue a copy of `src` into `dst` (`hps_memcpy_async`) and return without
    /// waiting. Both slices stay borrowed until the scope ends; read `dst` after
    /// [`Stream::scope`] returned. Errors: [`Status::InvalidArgument`] when the lengths
    /// differ (nothing is enqueued), or what the C call reports.
    pub fn memcpy_async(&self, dst: &'scope mut [u8], src: &'scope [u8]) -> Result<()> {
        if dst.len() != src.len() {
            return Err(Error::new(
                Status::InvalidArgument,
                format!(
                    "StreamScope::memcpy_async: dst has {} bytes, src has {}",
                    dst.len(),
                    src.len()
                ),
            ));
        }
        // Before the call: from here on the scope must synchronise.
        self.pending.set(true);
        // SAFETY: the slices are distinct (one is &mut) and stay borrowed, hence
        // valid, until the scope's guard synchronised the stream.
        unsafe { memcpy_async(dst.as_mut_ptr(), src.as_ptr(), src.len(), self.stream) }
    }
}

impl fmt::Debug for StreamScope<'_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamScope")
            .field("stream", self.stream)
            .field("pending", &self.pending.get())
            .finish()
    }
}

/// Enqueue a copy of `bytes` bytes from `src` to `dst` on `stream`
/// (`hps_memcpy_async`); returns without waiting. `bytes == 0` is a no-op.
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `bytes` bytes, as memory of
/// the stream's device (or host memory on CUDA, via unified addressing), the regions
/// must not overlap, and both must stay valid, and `dst` not otherwise accessed,
/// until the copy completed: synchronise the stream (or an event recorded after the
/// copy) before freeing or reading them. Dropping the stream also finishes the copy.
/// The safe alternative is [`Stream::scope`].
pub unsafe fn memcpy_async(
    dst: *mut u8,
    src: *const u8,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    // SAFETY: by the caller's promise; the stream handle is live.
    check(unsafe { sys::hps_memcpy_async(dst.cast(), src.cast(), bytes, stream.raw.as_ptr()) })
}

/// A point in a stream (`hps_event_t`). A new event has never been recorded.
/// Dropping it calls `hps_event_destroy`; streams already waiting on it still wait.
///
/// `Send` but not `Sync`: see the crate documentation, "Threads".
pub struct Event {
    raw: NonNull<sys::hps_event_t>,
}

// SAFETY: as for Stream: one thread at a time, any thread.
unsafe impl Send for Event {}

impl Event {
    /// An event on device (`device_type`, `index`) (`hps_event_create`).
    pub fn new(device_type: DeviceType, index: i32) -> Result<Event> {
        let mut raw: *mut sys::hps_event_t = ptr::null_mut();
        // SAFETY: out-param points to a live pointer.
        check(unsafe { sys::hps_event_create(device_type.0, index, &mut raw) })?;
        match NonNull::new(raw) {
            Some(raw) => Ok(Event { raw }),
            None => Err(Error::new(
                Status::Internal,
                "hps_event_create returned OK and a NULL event",
            )),
        }
    }

    /// The raw handle, still owned by `self`.
    pub fn as_ptr(&self) -> *mut sys::hps_event_t {
        self.raw.as_ptr()
    }

    /// Record this event at the current end of `stream` (`hps_event_record`); the
    /// host does not block. Errors: [`Status::InvalidArgument`] (device mismatch).
    pub fn record(&self, stream: &Stream) -> Result<()> {
        // SAFETY: both handles live and not used by another thread.
        check(unsafe { sys::hps_event_record(self.raw.as_ptr(), stream.raw.as_ptr()) })
    }

    /// Whether the most recent record has completed, without blocking
    /// (`hps_event_query`; not a host sync).
    /// Errors: [`Status::FailedPrecondition`] (never recorded).
    pub fn query(&self) -> Result<bool> {
        let mut completed: i32 = 0;
        // SAFETY: live handle; out-param points to a live i32.
        check(unsafe { sys::hps_event_query(self.raw.as_ptr(), &mut completed) })?;
        Ok(completed != 0)
    }

    /// Block until the most recent record has completed (`hps_event_synchronize`).
    /// Counts one host sync. Errors: [`Status::FailedPrecondition`] (never recorded).
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: live handle.
        check(unsafe { sys::hps_event_synchronize(self.raw.as_ptr()) })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: we own the handle and nothing else uses it.
        let _ = unsafe { sys::hps_event_destroy(self.raw.as_ptr()) };
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Event").field(&self.raw).finish()
    }
}

// ---------------------------------------------------------------------------------
// Host-sync counter
// ---------------------------------------------------------------------------------

/// Host syncs counted on the calling thread since it started or last called
/// [`host_sync_reset`] (`hps_host_sync_count_thread`).
pub fn host_sync_count_thread() -> Result<u64> {
    let mut count: u64 = 0;
    // SAFETY: out-param points to a live u64.
    check(unsafe { sys::hps_host_sync_count_thread(&mut count) })?;
    Ok(count)
}

/// Host syncs counted on all threads since the process started or the last
/// [`host_sync_reset`] (`hps_host_sync_count_total`).
pub fn host_sync_count_total() -> Result<u64> {
    let mut count: u64 = 0;
    // SAFETY: out-param points to a live u64.
    check(unsafe { sys::hps_host_sync_count_total(&mut count) })?;
    Ok(count)
}

/// Reset the total counter and this thread's counter (`hps_host_sync_reset`); other
/// threads' own counters are unchanged.
pub fn host_sync_reset() -> Result<()> {
    // SAFETY: no arguments.
    check(unsafe { sys::hps_host_sync_reset() })
}
