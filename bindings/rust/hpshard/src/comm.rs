//! Stores, rendezvous, communicators, collectives and work handles (the C API's
//! "Stores and rendezvous" and "Communicators and work" sections).
//!
//! See the crate documentation, "Collectives", for the soundness design.

use std::cell::{Cell, RefCell};
use std::ffi::{c_void, CString};
use std::fmt;
use std::marker::PhantomData;
use std::os::raw::c_char;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::half::{BF16, F16};
use crate::{check, static_str, sys, DType, DeviceType, Error, Result, Status, Stream};

// ---------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------

/// `s` as a C string; an interior NUL is [`Status::InvalidArgument`] (detected here,
/// nothing is called).
pub(crate) fn c_string(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| {
        Error::new(
            Status::InvalidArgument,
            format!("{} contains a NUL byte: {:?}", what, s),
        )
    })
}

/// A duration as the C API's `timeout_ms`: rounded up to whole milliseconds (so a
/// non-zero duration never becomes 0), saturating at `i64::MAX`. A zero duration
/// stays 0, which the library refuses with [`Status::InvalidArgument`].
pub(crate) fn timeout_ms(timeout: Duration) -> i64 {
    let nanos = timeout.as_nanos();
    let millis = nanos / 1_000_000 + if nanos % 1_000_000 != 0 { 1 } else { 0 };
    if millis > i64::MAX as u128 {
        i64::MAX
    } else {
        millis as i64
    }
}

/// The text of a fixed-size, NUL-terminated C char array (stops at the array's end).
fn char_array_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn null_handle(function: &str) -> Error {
    Error::new(
        Status::Internal,
        format!("{} returned OK and a NULL handle", function),
    )
}

// ---------------------------------------------------------------------------------
// Store
// ---------------------------------------------------------------------------------

/// A key-value store through which ranks meet (`hps_store_t`). Dropping it calls
/// `hps_store_destroy` (a serving TCP store stops serving once the other ranks have closed
/// theirs, or after its timeout: the drop waits for that).
///
/// `Send` and `Sync`: the C API documents store handles as usable from several
/// threads at once (ranks that are threads may share one).
pub struct Store {
    raw: NonNull<sys::hps_store_t>,
}

// SAFETY: hpshard.h: "a store handle may be used from several threads at once".
unsafe impl Send for Store {}
// SAFETY: as above; every method takes &self and the C functions are thread-safe.
unsafe impl Sync for Store {}

impl Store {
    /// Open the store at `url` as rank `rank` (`hps_store_open`), waiting up to
    /// `timeout` (rounded up to milliseconds) for a TCP server:
    /// `"memory://NAME"` (shared by every open of NAME in this process),
    /// `"file:///DIR"`, `"tcp://HOST:PORT"` (rank 0 serves).
    /// Errors: [`Status::InvalidArgument`] (malformed URL, unknown scheme, zero
    /// timeout), [`Status::Timeout`] (no server), [`Status::Unavailable`] (rank 0 cannot
    /// listen there), [`Status::FailedPrecondition`] (another job's store, or the job's store
    /// open in this process already: open it once and share it), [`Status::BackendError`].
    pub fn open(url: &str, rank: i32, timeout: Duration) -> Result<Store> {
        let url = c_string("store URL", url)?;
        let mut raw: *mut sys::hps_store_t = ptr::null_mut();
        // SAFETY: url is NUL-terminated and outlives the call; out-param is live.
        check(unsafe { sys::hps_store_open(url.as_ptr(), rank, timeout_ms(timeout), &mut raw) })?;
        match NonNull::new(raw) {
            Some(raw) => Ok(Store { raw }),
            None => Err(null_handle("hps_store_open")),
        }
    }

    /// The raw handle, still owned by `self`.
    pub fn as_ptr(&self) -> *mut sys::hps_store_t {
        self.raw.as_ptr()
    }

    /// Set `key` to `value` (binary-safe) (`hps_store_set`).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let key = c_string("store key", key)?;
        // SAFETY: live handle (thread-safe), key NUL-terminated, value valid for
        // value.len() bytes during the call (the store copies it).
        check(unsafe {
            sys::hps_store_set(
                self.raw.as_ptr(),
                key.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
            )
        })
    }

    /// Wait up to `timeout` for `key`, then return its value (`hps_store_get`).
    /// Values of any size are returned: when the value does not fit the buffer the
    /// library reports [`Status::OutOfRange`] with the size needed, and this call
    /// retries with a buffer of that size (again if the value grew meanwhile).
    /// Errors: [`Status::Timeout`] (naming the key), [`Status::InvalidArgument`]
    /// (zero timeout).
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let key = c_string("store key", key)?;
        let timeout = timeout_ms(timeout);
        let mut buffer: Vec<u8> = vec![0; 256];
        loop {
            let mut size: usize = 0;
            // SAFETY: live handle; buffer valid for buffer.len() bytes; out-param live.
            let raw = unsafe {
                sys::hps_store_get(
                    self.raw.as_ptr(),
                    key.as_ptr(),
                    timeout,
                    buffer.as_mut_ptr().cast(),
                    buffer.len(),
                    &mut size,
                )
            };
            if raw == sys::hps_status::HPS_STATUS_OK {
                buffer.truncate(size);
                return Ok(buffer);
            }
            if raw == sys::hps_status::HPS_STATUS_OUT_OF_RANGE && size > buffer.len() {
                buffer.resize(size, 0);
                continue;
            }
            return Err(Error::from_last_call(raw));
        }
    }

    /// Add `delta` to the integer at `key` (0 when unset) and return the new value
    /// (`hps_store_add`).
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let key = c_string("store key", key)?;
        let mut value: i64 = 0;
        // SAFETY: live handle, NUL-terminated key, live out-param.
        check(unsafe { sys::hps_store_add(self.raw.as_ptr(), key.as_ptr(), delta, &mut value) })?;
        Ok(value)
    }

    /// Wait up to `timeout` until `key` is set (`hps_store_wait`).
    /// Errors: [`Status::Timeout`] (naming the key), [`Status::InvalidArgument`].
    pub fn wait(&self, key: &str, timeout: Duration) -> Result<()> {
        let key = c_string("store key", key)?;
        // SAFETY: live handle, NUL-terminated key.
        check(unsafe { sys::hps_store_wait(self.raw.as_ptr(), key.as_ptr(), timeout_ms(timeout)) })
    }

    /// Abort the store (`hps_store_abort`): from now on every call on it, and every wait
    /// on it under way (within about 200 ms), ends with [`Status::Aborted`]; so does a
    /// [`Communicator::create`] over it that waits for ranks that never come. Callable
    /// from another thread while one is blocked on the store (the store is `Sync`); it
    /// cannot be undone (open a new store). Rank 0's TCP store, aborted, is dropped
    /// without waiting for the other ranks.
    pub fn abort(&self) -> Result<()> {
        // SAFETY: live handle; hps_store_abort is callable from any thread at any time.
        check(unsafe { sys::hps_store_abort(self.raw.as_ptr()) })
    }

    /// Whether `key` is set, without waiting (`hps_store_check`).
    pub fn check(&self, key: &str) -> Result<bool> {
        let key = c_string("store key", key)?;
        let mut present: i32 = 0;
        // SAFETY: live handle, NUL-terminated key, live out-param.
        check(unsafe { sys::hps_store_check(self.raw.as_ptr(), key.as_ptr(), &mut present) })?;
        Ok(present != 0)
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: we own the handle; &mut self means no other use is in progress.
        let _ = unsafe { sys::hps_store_destroy(self.raw.as_ptr()) };
    }
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Store").field(&self.raw).finish()
    }
}

// ---------------------------------------------------------------------------------
// Rendezvous
// ---------------------------------------------------------------------------------

/// Where this process sits in the job, as the environment says
/// (`hps_rendezvous_info_t`, copied into Rust types).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousInfo {
    /// This process's rank.
    pub rank: i32,
    /// The number of ranks.
    pub world_size: i32,
    /// The rank among the processes of this host.
    pub local_rank: i32,
    /// The URL to give [`Store::open`].
    pub store_url: String,
    /// Which variables were read: the family, then the variables, e.g.
    /// `"hpshard (HPS_RANK, HPS_WORLD_SIZE, HPS_STORE)"` or
    /// `"torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"`.
    pub source: String,
}

/// Read the rendezvous from the environment (`hps_rendezvous_info_init` with this
/// crate's struct size, then `hps_rendezvous_from_env`): `HPS_RANK` /
/// `HPS_WORLD_SIZE` / `HPS_STORE`, else torchrun's, Open MPI's or Slurm's variables.
/// Errors: [`Status::NotFound`] (none set), [`Status::InvalidArgument`] (a malformed
/// or missing variable, named in the message).
pub fn rendezvous_from_env() -> Result<RendezvousInfo> {
    // SAFETY: integers and char arrays; all-zero is valid.
    let mut raw: sys::hps_rendezvous_info_t = unsafe { std::mem::zeroed() };
    // SAFETY: `raw` is live and has the size passed.
    check(unsafe {
        sys::hps_rendezvous_info_init(&mut raw, std::mem::size_of::<sys::hps_rendezvous_info_t>())
    })?;
    // SAFETY: `raw` was initialised by hps_rendezvous_info_init.
    check(unsafe { sys::hps_rendezvous_from_env(&mut raw) })?;
    Ok(RendezvousInfo {
        rank: raw.rank,
        world_size: raw.world_size,
        local_rank: raw.local_rank,
        store_url: char_array_string(&raw.store_url),
        source: char_array_string(&raw.source),
    })
}

// ---------------------------------------------------------------------------------
// Reductions and elements
// ---------------------------------------------------------------------------------

/// A reduction (`hps_reduce_op_t`), a newtype over the C value: [`ReduceOp::from_raw`]
/// builds any value, the library rejects unknown ones with
/// [`Status::InvalidArgument`] (nothing is sent).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReduceOp(sys::hps_reduce_op_t);

impl ReduceOp {
    /// `HPS_REDUCE_SUM`.
    pub const SUM: ReduceOp = ReduceOp(sys::hps_reduce_op::HPS_REDUCE_SUM);
    /// `HPS_REDUCE_AVG`.
    pub const AVG: ReduceOp = ReduceOp(sys::hps_reduce_op::HPS_REDUCE_AVG);
    /// `HPS_REDUCE_MAX`.
    pub const MAX: ReduceOp = ReduceOp(sys::hps_reduce_op::HPS_REDUCE_MAX);
    /// `HPS_REDUCE_MIN`.
    pub const MIN: ReduceOp = ReduceOp(sys::hps_reduce_op::HPS_REDUCE_MIN);

    /// Every reduction these bindings know.
    pub const ALL: [ReduceOp; 4] = [ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX, ReduceOp::MIN];

    /// A reduction from its C value, known or not (unknown ones fail in the library).
    pub const fn from_raw(value: u32) -> ReduceOp {
        ReduceOp(sys::hps_reduce_op(value))
    }

    /// The C value.
    pub const fn raw(self) -> u32 {
        (self.0).0
    }
}

impl fmt::Debug for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ReduceOp::SUM => f.write_str("ReduceOp(sum)"),
            ReduceOp::AVG => f.write_str("ReduceOp(avg)"),
            ReduceOp::MAX => f.write_str("ReduceOp(max)"),
            ReduceOp::MIN => f.write_str("ReduceOp(min)"),
            other => write!(f, "ReduceOp({})", other.raw()),
        }
    }
}

/// An element type collectives accept in slices: the Rust type and its
/// [`DType`]. Implemented for `f32`, `f64`, `i32`, `i64`, `u8`, and for [`F16`] /
/// [`BF16`] (`u16` bits with an explicit half-precision dtype).
///
/// # Safety
/// `DTYPE.size()` must equal `size_of::<Self>()`, any bit pattern of that size must
/// be a valid `Self` (the library writes received bytes into the slice), and `Self`
/// must have no padding.
pub unsafe trait Element: Copy + 'static {
    /// The dtype the library reads and writes.
    const DTYPE: DType;
}

// SAFETY (all): plain numbers of the dtype's size, every bit pattern valid.
unsafe impl Element for f32 {
    const DTYPE: DType = DType::FLOAT32;
}
unsafe impl Element for f64 {
    const DTYPE: DType = DType::FLOAT64;
}
unsafe impl Element for i32 {
    const DTYPE: DType = DType::INT32;
}
unsafe impl Element for i64 {
    const DTYPE: DType = DType::INT64;
}
unsafe impl Element for u8 {
    const DTYPE: DType = DType::UINT8;
}
unsafe impl Element for F16 {
    const DTYPE: DType = DType::FLOAT16;
}
unsafe impl Element for BF16 {
    const DTYPE: DType = DType::BFLOAT16;
}

// ---------------------------------------------------------------------------------
// Communicator
// ---------------------------------------------------------------------------------

/// Options of [`Communicator::create`] (`hps_comm_options_t`). `None` fields keep
/// the library's defaults from `hps_comm_options_init` (which reads
/// `HPS_COMM_TIMEOUT_MS` and `HPS_COMM_CHECK`; timeout 300 s, checks on, name
/// "world").
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommOptions {
    /// Every operation ends by then with [`Status::Timeout`] (rounded up to ms).
    pub timeout: Option<Duration>,
    /// Whether ranks check they called the same collective.
    pub check_arguments: Option<bool>,
    /// The group's name in messages.
    pub name: Option<String>,
}

impl CommOptions {
    /// All defaults (same as `Default`).
    pub fn new() -> CommOptions {
        CommOptions::default()
    }

    /// The library's defaults as `hps_comm_options_init` reports them (environment
    /// included); `name` stays `None` ("world").
    pub fn library_defaults() -> Result<CommOptions> {
        let raw = raw_options()?;
        Ok(CommOptions {
            timeout: Some(Duration::from_millis(raw.timeout_ms.max(0) as u64)),
            check_arguments: Some(raw.check_arguments != 0),
            name: None,
        })
    }

    /// Builder: set the timeout.
    pub fn timeout(mut self, timeout: Duration) -> CommOptions {
        self.timeout = Some(timeout);
        self
    }

    /// Builder: set whether arguments are checked across ranks.
    pub fn check_arguments(mut self, check: bool) -> CommOptions {
        self.check_arguments = Some(check);
        self
    }

    /// Builder: set the group's name.
    pub fn name(mut self, name: &str) -> CommOptions {
        self.name = Some(name.to_string());
        self
    }
}

fn raw_options() -> Result<sys::hps_comm_options_t> {
    // SAFETY: integers and a NULL pointer; all-zero is valid.
    let mut raw: sys::hps_comm_options_t = unsafe { std::mem::zeroed() };
    // SAFETY: `raw` is live and has the size passed.
    check(unsafe {
        sys::hps_comm_options_init(&mut raw, std::mem::size_of::<sys::hps_comm_options_t>())
    })?;
    Ok(raw)
}

/// This rank's member of a group of ranks (`hps_comm_t`). Collectives run
/// asynchronously on the communicator's own stream: use [`Communicator::scope`]
/// (safe, borrowed slices) or the `unsafe` `*_raw` methods (raw pointers, an owned
/// [`Work`]). Dropping it calls `hps_comm_destroy`, which frees it after its queued
/// operations end.
///
/// `Send` but not `Sync` (one thread at a time). To abort it from another thread
/// while this one is blocked in it, take an [`Aborter`] with
/// [`Communicator::aborter`].
///
/// ```compile_fail
/// fn is_sync<T: Sync>() {}
/// is_sync::<hpshard::Communicator>(); // error: not Sync
/// ```
pub struct Communicator {
    raw: NonNull<sys::hps_comm_t>,
    // For a handle taken from a HybridGroup: the group's mark that a handle to this
    // communicator is out, cleared when this one is dropped (see HybridGroup::comm).
    taken: Option<Arc<AtomicBool>>,
}

// SAFETY: the C API allows a communicator to be used by one thread at a time, any
// thread. Every handle is the only one to its communicator (a HybridGroup hands out one
// per communicator at a time), so moving it moves all use of that communicator. Not Sync:
// concurrent use (other than hps_comm_abort, see Aborter) is not allowed.
unsafe impl Send for Communicator {}

pub(crate) fn comm_from_raw(raw: *mut sys::hps_comm_t, function: &str) -> Result<Communicator> {
    match NonNull::new(raw) {
        Some(raw) => Ok(Communicator { raw, taken: None }),
        None => Err(null_handle(function)),
    }
}

impl Communicator {
    /// Makes this handle the one its hybrid group handed out: `taken` (set) is cleared
    /// when it is dropped.
    pub(crate) fn hold_group_mark(&mut self, taken: Arc<AtomicBool>) {
        self.taken = Some(taken);
    }
}

/// The `hps_stream_t*` for an optional ready stream.
fn ready_ptr(ready: Option<&Stream>) -> *mut sys::hps_stream_t {
    match ready {
        Some(stream) => stream.raw.as_ptr(),
        None => ptr::null_mut(),
    }
}

impl Communicator {
    /// Create this rank's member of a group of `size` ranks meeting through `store`,
    /// on device (`device_type`, `device_index`) (`hps_comm_options_init`, then
    /// `hps_comm_create`). Collective: every rank calls it; blocks until all ranks
    /// connected or the timeout passed. The communicator keeps what it needs of the
    /// store, so `store` may be dropped afterwards.
    /// Errors: [`Status::InvalidArgument`], [`Status::OutOfRange`] (rank or device),
    /// [`Status::Unavailable`] (backend not built or loadable), [`Status::Timeout`],
    /// [`Status::BackendError`].
    pub fn create(
        store: &Store,
        rank: i32,
        size: i32,
        device_type: DeviceType,
        device_index: i32,
        options: Option<CommOptions>,
    ) -> Result<Communicator> {
        let mut name: Option<CString> = None;
        let mut raw_opts: Option<sys::hps_comm_options_t> = None;
        if let Some(options) = options {
            let mut raw = raw_options()?;
            if let Some(timeout) = options.timeout {
                raw.timeout_ms = timeout_ms(timeout);
            }
            if let Some(check_arguments) = options.check_arguments {
                raw.check_arguments = if check_arguments { 1 } else { 0 };
            }
            if let Some(n) = options.name.as_ref() {
                let n = c_string("communicator name", n)?;
                raw.name = n.as_ptr();
                name = Some(n); // keeps the pointer valid until after the call
            }
            raw_opts = Some(raw);
        }
        let opts_ptr: *const sys::hps_comm_options_t = match raw_opts.as_ref() {
            Some(raw) => raw,
            None => ptr::null(),
        };
        let mut raw: *mut sys::hps_comm_t = ptr::null_mut();
        // SAFETY: live store (thread-safe); options NULL or initialised, its name
        // (owned by `name`) alive during the call (the library copies it).
        check(unsafe {
            sys::hps_comm_create(
                store.raw.as_ptr(),
                rank,
                size,
                device_type.0,
                device_index,
                opts_ptr,
                &mut raw,
            )
        })?;
        drop(name);
        comm_from_raw(raw, "hps_comm_create")
    }

    /// The raw handle, still owned by `self`.
    pub fn as_ptr(&self) -> *mut sys::hps_comm_t {
        self.raw.as_ptr()
    }

    /// This rank's position (`hps_comm_rank`).
    pub fn rank(&self) -> Result<i32> {
        let mut rank: i32 = -1;
        // SAFETY: live handle, live out-param.
        check(unsafe { sys::hps_comm_rank(self.raw.as_ptr(), &mut rank) })?;
        Ok(rank)
    }

    /// The number of ranks (`hps_comm_size`).
    pub fn size(&self) -> Result<i32> {
        let mut size: i32 = -1;
        // SAFETY: live handle, live out-param.
        check(unsafe { sys::hps_comm_size(self.raw.as_ptr(), &mut size) })?;
        Ok(size)
    }

    /// The device the communicator was created on, as (type, index)
    /// (`hps_comm_device`). Collectives of a CUDA communicator take device memory: only
    /// the `*_raw` methods can pass it.
    pub fn device(&self) -> Result<(DeviceType, i32)> {
        let mut device_type = DeviceType::CPU.0;
        let mut index: i32 = -1;
        // SAFETY: live handle, live out-params.
        check(unsafe { sys::hps_comm_device(self.raw.as_ptr(), &mut device_type, &mut index) })?;
        Ok((DeviceType(device_type), index))
    }

    /// How collectives move data (`hps_comm_transport`): `"shm"` (CPU ranks all on this
    /// host, through shared memory), `"tcp"` (Gloo TCP; also a group of one rank, or
    /// `HPS_COMM_SHM=0`), `"self"` (a CPU group of one rank in a build without Gloo) or
    /// `"nccl"` (CUDA); later library versions may add names.
    pub fn transport(&self) -> Result<&'static str> {
        let mut name: *const c_char = ptr::null();
        // SAFETY: live handle, live out-param.
        check(unsafe { sys::hps_comm_transport(self.raw.as_ptr(), &mut name) })?;
        // SAFETY: the C API returns a static NUL-terminated constant of the library,
        // valid for the rest of the program (the library is never unloaded).
        Ok(unsafe { static_str(name) })
    }

    /// Change the timeout of later operations (`hps_comm_set_timeout`; rounded up
    /// to milliseconds). Errors: [`Status::InvalidArgument`] for a zero duration.
    pub fn set_timeout(&self, timeout: Duration) -> Result<()> {
        // SAFETY: live handle.
        check(unsafe { sys::hps_comm_set_timeout(self.raw.as_ptr(), timeout_ms(timeout)) })
    }

    /// Abort: pending and later operations end with [`Status::Aborted`], here and on
    /// every live communicator split from this one (`hps_comm_abort`; local and
    /// immediate). From another thread, use
    /// [`Communicator::aborter`].
    pub fn abort(&self) -> Result<()> {
        // SAFETY: live handle; hps_comm_abort is callable from any thread.
        check(unsafe { sys::hps_comm_abort(self.raw.as_ptr()) })
    }

    /// Block until the operations queued so far have ended, whatever their outcome
    /// (`hps_comm_finish`; each one's [`Work`] reports its error). Dropping the
    /// communicator waits for them too, but no [`Aborter`] can exist then: to close
    /// with a watchdog that can end an operation stuck on a rank that has gone, call
    /// this in a scope beside the aborter's thread, then drop.
    pub fn finish(&self) -> Result<()> {
        // SAFETY: live handle; this thread only, beside hps_comm_abort from any thread.
        check(unsafe { sys::hps_comm_finish(self.raw.as_ptr()) })
    }

    /// A handle that can only abort this communicator, `Send + Sync`, borrowing it
    /// (so the communicator cannot be dropped or moved while the aborter exists).
    /// Hand it to a watchdog thread with `std::thread::scope`.
    pub fn aborter(&self) -> Aborter<'_> {
        // SAFETY: the aborter borrows this communicator for its lifetime.
        unsafe { Aborter::new(self.raw) }
    }

    /// Collective split (`hps_comm_split`): every rank calls it with the same `ranks`
    /// (numbered in this communicator) in the same order. Members get `Some` new
    /// communicator (rank = position in `ranks`), the others `None`. Every rank takes
    /// part: ranks whose lists differ all get [`Status::InvalidArgument`] and nothing is
    /// made.
    pub fn split(&self, ranks: &[i32], name: &str) -> Result<Option<Communicator>> {
        let name = c_string("communicator name", name)?;
        let mut raw: *mut sys::hps_comm_t = ptr::null_mut();
        // SAFETY: live handle; ranks valid for ranks.len() entries; name NUL-terminated.
        check(unsafe {
            sys::hps_comm_split(
                self.raw.as_ptr(),
                ranks.as_ptr(),
                ranks.len(),
                name.as_ptr(),
                &mut raw,
            )
        })?;
        Ok(NonNull::new(raw).map(|raw| Communicator { raw, taken: None }))
    }

    /// Run `f` with a [`CommScope`] whose collectives borrow slices until the scope
    /// has waited for every operation started in it. When `f` returns (or unwinds),
    /// every operation not yet known to be finished is waited for
    /// (`hps_work_wait`), then every work handle is freed. Returns `f`'s error if it
    /// failed, else the first error of those final waits (of operations whose error
    /// the closure had not already been given), else `f`'s value. The slices are host
    /// memory, so only a CPU communicator has scopes: on another device it is
    /// [`Status::InvalidArgument`] before `f` runs (its collectives take device memory
    /// through the `*_raw` functions or DLPack tensors).
    ///
    /// ```no_run
    /// # fn main() -> hpshard::Result<()> {
    /// use hpshard::{Communicator, DeviceType, ReduceOp, Store};
    /// use std::time::Duration;
    /// let store = Store::open("memory://doc", 0, Duration::from_secs(10))?;
    /// let comm = Communicator::create(&store, 0, 1, DeviceType::CPU, 0, None)?;
    /// let send = [1.0f32, 2.0];
    /// let mut recv = [0.0f32; 2];
    /// comm.scope(|s| {
    ///     let w = s.all_reduce(&send, &mut recv, ReduceOp::SUM)?;
    ///     w.wait()
    /// })?;
    /// assert_eq!(recv, send);
    /// # Ok(())
    /// # }
    /// ```
    pub fn scope<'env, F, T>(&self, f: F) -> Result<T>
    where
        F: for<'scope> FnOnce(&'scope CommScope<'scope, 'env>) -> Result<T>,
    {
        let (device_type, index) = self.device()?;
        if device_type != DeviceType::CPU {
            return Err(Error::new(
                Status::InvalidArgument,
                format!(
                    "Communicator::scope: its collectives take host slices, but this \
                     communicator is on {device_type} {index} (use the *_raw collectives \
                     with device pointers, or DLPack tensors)"
                ),
            ));
        }
        let works: RefCell<Vec<Slot>> = RefCell::new(Vec::new());
        let mut guard = FinishGuard {
            works: &works,
            done: false,
        };
        let result = {
            let scope = CommScope {
                comm: self,
                works: &works,
                ready: Cell::new(None),
                _scope: PhantomData,
                _env: PhantomData,
            };
            f(&scope)
        };
        let finished = guard.finish();
        match result {
            Err(err) => Err(err),
            Ok(value) => finished.map(|()| value),
        }
    }

    /// A barrier (`hps_comm_barrier`): the work completes once every rank reached it.
    /// Safe: it touches no memory of the caller.
    pub fn barrier(&self, ready: Option<&Stream>) -> Result<Work<'_>> {
        let mut work: *mut sys::hps_work_t = ptr::null_mut();
        // SAFETY: live handles; no buffers.
        check(unsafe { sys::hps_comm_barrier(self.raw.as_ptr(), ready_ptr(ready), &mut work) })?;
        Work::from_raw(work, "hps_comm_barrier")
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // SAFETY: we own the handle; no Aborter or scope borrows it (&mut self). The
        // library frees it after its queued operations end.
        let _ = unsafe { sys::hps_comm_destroy(self.raw.as_ptr()) };
        if let Some(taken) = &self.taken {
            taken.store(false, Ordering::Release); // its group may hand it out again
        }
    }
}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Communicator").field(&self.raw).finish()
    }
}

/// Aborts a [`Communicator`] from any thread (`hps_comm_abort`), which is all it
/// can do. `Send + Sync` and `Copy`; it borrows the communicator, so it cannot
/// outlive it.
///
/// ```no_run
/// # fn main() -> hpshard::Result<()> {
/// # use hpshard::{Communicator, DeviceType, ReduceOp, Store};
/// # use std::time::Duration;
/// # let store = Store::open("memory://doc-abort", 0, Duration::from_secs(10))?;
/// # let comm = Communicator::create(&store, 0, 2, DeviceType::CPU, 0, None)?;
/// let aborter = comm.aborter();
/// std::thread::scope(|t| {
///     t.spawn(move || {
///         std::thread::sleep(Duration::from_secs(1));
///         aborter.abort()
///     });
///     comm.barrier(None)?.wait() // ends with Status::Aborted if a peer never comes
/// })
/// # }
/// ```
#[derive(Clone, Copy)]
pub struct Aborter<'comm> {
    raw: NonNull<sys::hps_comm_t>,
    _comm: PhantomData<&'comm ()>,
}

impl<'comm> Aborter<'comm> {
    /// # Safety
    /// `raw` must be a communicator that lives, unmoved, for all of `'comm`.
    pub(crate) unsafe fn new(raw: NonNull<sys::hps_comm_t>) -> Aborter<'comm> {
        Aborter {
            raw,
            _comm: PhantomData,
        }
    }
}

// SAFETY: the only call made through it is hps_comm_abort, documented as callable
// from any thread at any time while the communicator lives; the lifetime keeps the
// communicator alive (and unmoved) for as long as the aborter exists.
unsafe impl Send for Aborter<'_> {}
// SAFETY: as above.
unsafe impl Sync for Aborter<'_> {}

impl Aborter<'_> {
    /// Abort the communicator (`hps_comm_abort`): its pending and later operations
    /// end with [`Status::Aborted`].
    pub fn abort(&self) -> Result<()> {
        // SAFETY: the communicator is alive (borrowed); abort is any-thread.
        check(unsafe { sys::hps_comm_abort(self.raw.as_ptr()) })
    }
}

impl fmt::Debug for Aborter<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Aborter").field(&self.raw).finish()
    }
}

// ---------------------------------------------------------------------------------
// Work
// ---------------------------------------------------------------------------------

/// One asynchronous operation started by a `*_raw` method or
/// [`Communicator::barrier`] (`hps_work_t`). Dropping it frees the handle
/// (`hps_work_destroy`) without waiting: the operation goes on. Borrows its
/// communicator. `Send`, not `Sync`.
pub struct Work<'comm> {
    raw: NonNull<sys::hps_work_t>,
    _comm: PhantomData<&'comm ()>,
}

// SAFETY: one thread at a time per handle, any thread.
unsafe impl Send for Work<'_> {}

impl<'comm> Work<'comm> {
    pub(crate) fn from_raw(raw: *mut sys::hps_work_t, function: &str) -> Result<Work<'comm>> {
        match NonNull::new(raw) {
            Some(raw) => Ok(Work {
                raw,
                _comm: PhantomData,
            }),
            None => Err(null_handle(function)),
        }
    }

    /// The raw handle, still owned by `self`.
    pub fn as_ptr(&self) -> *mut sys::hps_work_t {
        self.raw.as_ptr()
    }

    /// Whether the operation finished, without blocking (`hps_work_test`; not a
    /// host sync). A finished operation that failed returns its error.
    pub fn test(&self) -> Result<bool> {
        work_test(self.raw)
    }

    /// Block until the operation finished and return how it ended
    /// (`hps_work_wait`; one host sync).
    pub fn wait(&self) -> Result<()> {
        work_wait(self.raw)
    }

    /// Block until the operation finished or `timeout` passed, whichever comes first:
    /// `true` when it finished (`hps_work_wait_timeout`; one host sync then), `false`
    /// when the timeout passed first. A finished operation that failed returns its error.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool> {
        work_wait_timeout(self.raw, timeout)
    }

    /// Make work queued on `stream` after this call wait for the operation, without
    /// blocking the host (`hps_work_wait_stream`).
    pub fn wait_stream(&self, stream: &Stream) -> Result<()> {
        work_wait_stream(self.raw, stream)
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        // SAFETY: we own the handle; freeing it does not stop or wait for the work.
        let _ = unsafe { sys::hps_work_destroy(self.raw.as_ptr()) };
    }
}

impl fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Work").field(&self.raw).finish()
    }
}

fn work_test(raw: NonNull<sys::hps_work_t>) -> Result<bool> {
    let mut completed: i32 = 0;
    // SAFETY: live handle used by this thread; live out-param.
    check(unsafe { sys::hps_work_test(raw.as_ptr(), &mut completed) })?;
    Ok(completed != 0)
}

fn work_wait(raw: NonNull<sys::hps_work_t>) -> Result<()> {
    // SAFETY: live handle used by this thread.
    check(unsafe { sys::hps_work_wait(raw.as_ptr()) })
}

fn work_wait_timeout(raw: NonNull<sys::hps_work_t>, timeout: Duration) -> Result<bool> {
    let mut completed: i32 = 0;
    // SAFETY: live handle used by this thread; live out-param.
    check(unsafe {
        sys::hps_work_wait_timeout(raw.as_ptr(), timeout_ms(timeout), &mut completed)
    })?;
    Ok(completed != 0)
}

fn work_wait_stream(raw: NonNull<sys::hps_work_t>, stream: &Stream) -> Result<()> {
    // SAFETY: live handles used by this thread.
    check(unsafe { sys::hps_work_wait_stream(raw.as_ptr(), stream.raw.as_ptr()) })
}

// ---------------------------------------------------------------------------------
// Scoped collectives
// ---------------------------------------------------------------------------------

/// What a scope knows of one operation it started.
struct Slot {
    /// None once freed (by the ScopedWork's drop after the operation finished).
    raw: Option<NonNull<sys::hps_work_t>>,
    /// Known to have finished (a wait or test said so).
    finished: bool,
    /// The closure has been given this operation's error already.
    reported: bool,
}

/// Waits for and frees every work of a scope; runs on unwinding too.
struct FinishGuard<'a> {
    works: &'a RefCell<Vec<Slot>>,
    done: bool,
}

impl FinishGuard<'_> {
    /// Wait for every operation not known finished, free every handle; the first
    /// error the closure had not seen.
    fn finish(&mut self) -> Result<()> {
        self.done = true;
        let mut first: Option<Error> = None;
        let slots = std::mem::take(&mut *self.works.borrow_mut());
        for slot in slots {
            let raw = match slot.raw {
                Some(raw) => raw,
                None => continue,
            };
            if !slot.finished {
                if let Err(err) = work_wait(raw) {
                    // hps_work_wait returns once the operation has finished, however
                    // it ended, unless waiting itself failed (a device error). Make
                    // sure: borrowed memory must not be handed back while in use.
                    if let Ok(false) = work_test(raw) {
                        eprintln!(
                            "hpshard: waiting at the end of Communicator::scope failed ({}) \
                             and the operation is still running; aborting because it may \
                             still use borrowed memory",
                            err
                        );
                        std::process::abort();
                    }
                    if first.is_none() && !slot.reported {
                        first = Some(err);
                    }
                }
            }
            // SAFETY: the operation finished; no ScopedWork can use the handle any more
            // (their lifetime ended with the closure; forgotten ones are never used).
            let _ = unsafe { sys::hps_work_destroy(raw.as_ptr()) };
        }
        match first {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }
}

impl Drop for FinishGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            // Unwinding out of the closure: errors are dropped, the wait is not.
            let _ = self.finish();
        }
    }
}

/// The handle given to the closure of [`Communicator::scope`]: start collectives on
/// slices that stay borrowed until the scope has waited for every operation.
///
/// Invariant in both lifetimes (like `std::thread::Scope`), so only slices that
/// outlive the whole scope can be passed:
///
/// ```compile_fail
/// # use hpshard::{Communicator, DeviceType, ReduceOp, Store};
/// # let store = Store::open("memory://cf1", 0, std::time::Duration::from_secs(1)).unwrap();
/// # let comm = Communicator::create(&store, 0, 1, DeviceType::CPU, 0, None).unwrap();
/// let send = [1i32; 4];
/// comm.scope(|s| {
///     let mut local = [0i32; 4];
///     s.all_reduce(&send, &mut local, ReduceOp::SUM)?.wait() // `local` does not live long enough
/// }).unwrap();
/// ```
///
/// and a receive buffer cannot be read (or dropped) before the scope ended, even
/// after waiting:
///
/// ```compile_fail
/// # use hpshard::{Communicator, DeviceType, ReduceOp, Store};
/// # let store = Store::open("memory://cf2", 0, std::time::Duration::from_secs(1)).unwrap();
/// # let comm = Communicator::create(&store, 0, 1, DeviceType::CPU, 0, None).unwrap();
/// let send = [1i32; 4];
/// let mut recv = [0i32; 4];
/// comm.scope(|s| {
///     let w = s.all_reduce(&send, &mut recv, ReduceOp::SUM)?;
///     println!("{}", recv[0]); // `recv` is still mutably borrowed
///     w.wait()
/// }).unwrap();
/// ```
pub struct CommScope<'scope, 'env: 'scope> {
    comm: &'scope Communicator,
    works: &'scope RefCell<Vec<Slot>>,
    ready: Cell<Option<&'scope Stream>>,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

fn len_error(what: &str, detail: String) -> Error {
    Error::new(Status::InvalidArgument, format!("{}: {}", what, detail))
}

impl<'scope, 'env> CommScope<'scope, 'env> {
    /// The communicator this scope runs on.
    pub fn communicator(&self) -> &'scope Communicator {
        self.comm
    }

    /// Make operations started after this call start after the work queued on
    /// `stream` (the C API's `ready` argument); `None` (the default) for none.
    pub fn set_ready_stream(&self, stream: Option<&'scope Stream>) {
        self.ready.set(stream);
    }

    /// Give the scope the C handle of an operation started in it.
    fn adopt(&self, work: Work<'_>) -> ScopedWork<'scope> {
        let raw = work.raw;
        std::mem::forget(work); // the scope destroys the handle now
        let mut works = self.works.borrow_mut();
        works.push(Slot {
            raw: Some(raw),
            finished: false,
            reported: false,
        });
        ScopedWork {
            raw,
            works: self.works,
            index: works.len() - 1,
        }
    }

    /// All-reduce in place (`hps_comm_all_reduce` with send == recv).
    pub fn all_reduce_in_place<T: Element>(
        &self,
        buffer: &'scope mut [T],
        op: ReduceOp,
    ) -> Result<ScopedWork<'scope>> {
        let p = buffer.as_mut_ptr();
        // SAFETY: as all_reduce; the C API allows send == recv.
        let work = unsafe {
            self.comm.all_reduce_raw(
                p as *const c_void,
                p.cast(),
                buffer.len() as u64,
                T::DTYPE,
                op,
                self.ready.get(),
            )
        }?;
        Ok(self.adopt(work))
    }

    /// A barrier (`hps_comm_barrier`).
    pub fn barrier(&self) -> Result<ScopedWork<'scope>> {
        let work = self.comm.barrier(self.ready.get())?;
        Ok(self.adopt(work))
    }
}

// ---------------------------------------------------------------------------------
// The collectives, each written once
// ---------------------------------------------------------------------------------

/// A collective's argument as the C function takes it.
trait CArg {
    type C;
    fn c(self) -> Self::C;
}

impl CArg for DType {
    type C = sys::hps_dtype_t;
    fn c(self) -> sys::hps_dtype_t {
        self.0
    }
}

impl CArg for ReduceOp {
    type C = sys::hps_reduce_op_t;
    fn c(self) -> sys::hps_reduce_op_t {
        self.0
    }
}

macro_rules! c_arg_as_is {
    ($($t:ty),*) => {
        $(impl CArg for $t {
            type C = $t;
            fn c(self) -> $t {
                self
            }
        })*
    };
}
c_arg_as_is!(u64, i32, *const c_void, *mut c_void, *const sys::DLTensor);

fn same_len(what: &str, send: usize, recv: usize) -> Result<()> {
    if send == recv {
        return Ok(());
    }
    Err(len_error(
        what,
        format!("send has {} elements, recv {}", send, recv),
    ))
}

/// Every collective from one entry: the `unsafe` method of [`Communicator`] on raw
/// pointers or DLPack tensors (`NAME = C function(parameters after the communicator)`),
/// which makes the C call, and optionally the safe method of [`CommScope`] on slices
/// borrowed for the scope, whose body checks the slices and calls the raw method
/// (`comm`, `ready` name the communicator and the scope's ready stream there).
macro_rules! collectives {
    ($(
        $(#[$doc:meta])*
        $raw:ident = $cfn:ident($($p:ident: $pt:ty),*)
        $(=> scoped {
            $(#[$sdoc:meta])*
            fn $name:ident<$T:ident>($($sp:ident: $spt:ty),*) |$comm:ident, $ready:ident| $body:block
        })?;
    )*) => {
        impl Communicator {
            $(
                $(#[$doc])*
                #[allow(clippy::too_many_arguments)]
                pub unsafe fn $raw(&self, $($p: $pt,)* ready: Option<&Stream>)
                    -> Result<Work<'_>> {
                    let mut work: *mut sys::hps_work_t = ptr::null_mut();
                    // SAFETY: the buffers are valid (and outputs unaliased) until the work
                    // completed, by the caller's promise; the handles are live.
                    check(unsafe {
                        sys::$cfn(self.raw.as_ptr(), $($p.c(),)* ready_ptr(ready), &mut work)
                    })?;
                    Work::from_raw(work, stringify!($cfn))
                }
            )*
        }

        impl<'scope, 'env> CommScope<'scope, 'env> {
            $($(
                $(#[$sdoc])*
                pub fn $name<$T: Element>(&self, $($sp: $spt),*) -> Result<ScopedWork<'scope>> {
                    let $comm = self.comm;
                    let $ready = self.ready.get();
                    // SAFETY: the slices are valid for their lengths of T::DTYPE (Element)
                    // and stay borrowed, outputs uniquely, until the scope has waited for
                    // the work.
                    #[allow(unused_unsafe)]
                    let work = unsafe { $body }?;
                    Ok(self.adopt(work))
                }
            )?)*
        }
    };
}

collectives! {
    /// All-reduce on raw pointers (`hps_comm_all_reduce`): `recv[i]` = `op` over
    /// ranks of `send[i]`, `count` elements of `dtype`; `send` may equal `recv`.
    ///
    /// # Safety
    /// `send` and `recv` must be valid for `count` elements of `dtype` (on the
    /// communicator's device), stay valid, and `recv` not otherwise accessed, until
    /// the returned work has completed (wait for it; dropping the [`Work`] does not).
    all_reduce_raw = hps_comm_all_reduce(send: *const c_void, recv: *mut c_void, count: u64,
                                         dtype: DType, op: ReduceOp)
    => scoped {
        /// `recv[i]` = `op` over ranks of `send[i]` (`hps_comm_all_reduce`). The lengths
        /// must be equal ([`Status::InvalidArgument`], nothing sent).
        fn all_reduce<T>(send: &'scope [T], recv: &'scope mut [T], op: ReduceOp) |comm, ready| {
            same_len("all_reduce", send.len(), recv.len())?;
            comm.all_reduce_raw(send.as_ptr().cast(), recv.as_mut_ptr().cast(), send.len() as u64,
                                T::DTYPE, op, ready)
        }
    };

    /// Reduce to `root` on raw pointers (`hps_comm_reduce`); `recv` may be NULL on
    /// other ranks.
    ///
    /// # Safety
    /// As [`Communicator::all_reduce_raw`].
    reduce_raw = hps_comm_reduce(send: *const c_void, recv: *mut c_void, count: u64,
                                 dtype: DType, op: ReduceOp, root: i32)
    => scoped {
        /// Reduce `send` over ranks into `root`'s `recv` (`hps_comm_reduce`). `recv` may
        /// be `None` on other ranks; when given, its length must equal `send`'s.
        fn reduce<T>(send: &'scope [T], recv: Option<&'scope mut [T]>, op: ReduceOp, root: i32)
        |comm, ready| {
            let recv_ptr: *mut c_void = match recv {
                Some(recv) => {
                    same_len("reduce", send.len(), recv.len())?;
                    recv.as_mut_ptr().cast()
                }
                None => ptr::null_mut(),
            };
            comm.reduce_raw(send.as_ptr().cast(), recv_ptr, send.len() as u64, T::DTYPE, op, root,
                            ready)
        }
    };

    /// Broadcast `root`'s buffer on raw pointers (`hps_comm_broadcast`).
    ///
    /// # Safety
    /// `buffer` valid for `count` elements of `dtype`, kept valid and not otherwise
    /// accessed until the work completed.
    broadcast_raw = hps_comm_broadcast(buffer: *mut c_void, count: u64, dtype: DType, root: i32)
    => scoped {
        /// Copy `root`'s `buffer` into every rank's (`hps_comm_broadcast`).
        fn broadcast<T>(buffer: &'scope mut [T], root: i32) |comm, ready| {
            comm.broadcast_raw(buffer.as_mut_ptr().cast(), buffer.len() as u64, T::DTYPE, root,
                               ready)
        }
    };

    /// All-gather on raw pointers (`hps_comm_all_gather`): rank r's `send_count`
    /// elements land at `recv + r * send_count`; `recv_count` is `recv`'s capacity.
    ///
    /// # Safety
    /// `send` valid for `send_count`, `recv` for `recv_count` elements, kept valid
    /// (and `recv` not otherwise accessed) until the work completed.
    all_gather_raw = hps_comm_all_gather(send: *const c_void, send_count: u64, recv: *mut c_void,
                                         recv_count: u64, dtype: DType)
    => scoped {
        /// Rank r's `send` lands at `recv[r * send.len()..]` (`hps_comm_all_gather`);
        /// `recv.len()` is the capacity the library checks (at least size × send.len(),
        /// else [`Status::InvalidArgument`] with nothing sent).
        fn all_gather<T>(send: &'scope [T], recv: &'scope mut [T]) |comm, ready| {
            comm.all_gather_raw(send.as_ptr().cast(), send.len() as u64, recv.as_mut_ptr().cast(),
                                recv.len() as u64, T::DTYPE, ready)
        }
    };

    /// Reduce-scatter on raw pointers (`hps_comm_reduce_scatter`): rank r receives
    /// the reduction of slice r (`recv_count` elements) of every rank's `send`.
    ///
    /// # Safety
    /// As [`Communicator::all_gather_raw`].
    reduce_scatter_raw = hps_comm_reduce_scatter(send: *const c_void, send_count: u64,
                                                 recv: *mut c_void, recv_count: u64,
                                                 dtype: DType, op: ReduceOp)
    => scoped {
        /// Rank r receives into `recv` the reduction of slice r (`recv.len()` elements)
        /// of every rank's `send` (`hps_comm_reduce_scatter`); `send.len()` must be at
        /// least size × recv.len().
        fn reduce_scatter<T>(send: &'scope [T], recv: &'scope mut [T], op: ReduceOp) |comm, ready| {
            comm.reduce_scatter_raw(send.as_ptr().cast(), send.len() as u64, recv.as_mut_ptr().cast(),
                                    recv.len() as u64, T::DTYPE, op, ready)
        }
    };

    /// Send `count` elements to `peer` on raw pointers (`hps_comm_send`).
    ///
    /// # Safety
    /// `buffer` valid for `count` elements, kept valid until the work completed.
    send_raw = hps_comm_send(buffer: *const c_void, count: u64, dtype: DType, peer: i32)
    => scoped {
        /// Send `buffer` to `peer` (`hps_comm_send`).
        fn send<T>(buffer: &'scope [T], peer: i32) |comm, ready| {
            comm.send_raw(buffer.as_ptr().cast(), buffer.len() as u64, T::DTYPE, peer, ready)
        }
    };

    /// Receive `count` elements from `peer` on raw pointers (`hps_comm_recv`).
    ///
    /// # Safety
    /// `buffer` valid for `count` elements, kept valid and not otherwise accessed
    /// until the work completed.
    recv_raw = hps_comm_recv(buffer: *mut c_void, count: u64, dtype: DType, peer: i32)
    => scoped {
        /// Receive `buffer.len()` elements from `peer` (`hps_comm_recv`).
        fn recv<T>(buffer: &'scope mut [T], peer: i32) |comm, ready| {
            comm.recv_raw(buffer.as_mut_ptr().cast(), buffer.len() as u64, T::DTYPE, peer, ready)
        }
    };

    /// All-reduce over DLPack tensors (`hps_comm_all_reduce_dlpack`): dtype, counts and
    /// device come from the tensors, checked by the library.
    ///
    /// # Safety
    /// The tensors must be valid DLTensors whose memory stays valid, and `recv`'s not
    /// otherwise accessed, until the work completed ([`crate::Tensor::as_dltensor`] of a
    /// view kept alive meets the first part).
    all_reduce_dlpack = hps_comm_all_reduce_dlpack(send: *const sys::DLTensor,
                                                   recv: *const sys::DLTensor, op: ReduceOp);
    /// Reduce to `root` over DLPack tensors (`hps_comm_reduce_dlpack`; `recv` may be
    /// NULL on other ranks).
    ///
    /// # Safety
    /// As [`Communicator::all_reduce_dlpack`].
    reduce_dlpack = hps_comm_reduce_dlpack(send: *const sys::DLTensor, recv: *const sys::DLTensor,
                                           op: ReduceOp, root: i32);
    /// Broadcast over a DLPack tensor (`hps_comm_broadcast_dlpack`).
    ///
    /// # Safety
    /// As [`Communicator::all_reduce_dlpack`].
    broadcast_dlpack = hps_comm_broadcast_dlpack(buffer: *const sys::DLTensor, root: i32);
    /// All-gather over DLPack tensors (`hps_comm_all_gather_dlpack`).
    ///
    /// # Safety
    /// As [`Communicator::all_reduce_dlpack`].
    all_gather_dlpack = hps_comm_all_gather_dlpack(send: *const sys::DLTensor,
                                                   recv: *const sys::DLTensor);
    /// Reduce-scatter over DLPack tensors (`hps_comm_reduce_scatter_dlpack`).
    ///
    /// # Safety
    /// As [`Communicator::all_reduce_dlpack`].
    reduce_scatter_dlpack = hps_comm_reduce_scatter_dlpack(send: *const sys::DLTensor,
                                                           recv: *const sys::DLTensor,
                                                           op: ReduceOp);
    /// Send a DLPack tensor to `peer` (`hps_comm_send_dlpack`).
    ///
    /// # Safety
    /// As [`Communicator::all_reduce_dlpack`].
    send_dlpack = hps_comm_send_dlpack(buffer: *const sys::DLTensor, peer: i32);
    /// Receive into a DLPack tensor from `peer` (`hps_comm_recv_dlpack`).
    ///
    /// # Safety
    /// As [`Communicator::all_reduce_dlpack`].
    recv_dlpack = hps_comm_recv_dlpack(buffer: *const sys::DLTensor, peer: i32);
}

impl fmt::Debug for CommScope<'_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CommScope")
            .field("comm", self.comm)
            .field("works", &self.works.borrow().len())
            .finish()
    }
}

/// An operation started in a [`Communicator::scope`]. The scope owns the C handle
/// until it ends; dropping a `ScopedWork` whose operation is known finished frees
/// the handle at once (`hps_work_destroy`), otherwise the scope waits for it and
/// frees it when it ends. Forgetting one (`mem::forget`) is harmless.
pub struct ScopedWork<'scope> {
    raw: NonNull<sys::hps_work_t>,
    works: &'scope RefCell<Vec<Slot>>,
    index: usize,
}

impl ScopedWork<'_> {
    fn note(&self, finished: bool, reported: bool) {
        let mut works = self.works.borrow_mut();
        let slot = &mut works[self.index];
        slot.finished |= finished;
        slot.reported |= reported;
    }

    /// Whether the operation finished, without blocking (`hps_work_test`). A
    /// finished operation that failed returns its error.
    pub fn test(&self) -> Result<bool> {
        let result = work_test(self.raw);
        match result {
            Ok(done) => self.note(done, false),
            Err(_) => self.note(false, true),
        }
        result
    }

    /// Block until the operation finished; how it ended (`hps_work_wait`, one host
    /// sync). The borrowed slices stay borrowed until the scope ends.
    pub fn wait(&self) -> Result<()> {
        let result = work_wait(self.raw);
        match result {
            Ok(()) => self.note(true, false),
            Err(_) => self.note(false, true),
        }
        result
    }

    /// Block until the operation finished or `timeout` passed: `true` when it finished
    /// (`hps_work_wait_timeout`, one host sync then), `false` when the timeout passed.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool> {
        let result = work_wait_timeout(self.raw, timeout);
        match result {
            Ok(done) => self.note(done, false),
            Err(_) => self.note(false, true),
        }
        result
    }

    /// Make work queued on `stream` after this call wait for the operation, without
    /// blocking the host (`hps_work_wait_stream`). The scope still waits on the host
    /// when it ends.
    pub fn wait_stream(&self, stream: &Stream) -> Result<()> {
        work_wait_stream(self.raw, stream)
    }
}

impl Drop for ScopedWork<'_> {
    fn drop(&mut self) {
        let mut works = self.works.borrow_mut();
        let slot = &mut works[self.index];
        if slot.finished {
            if let Some(raw) = slot.raw.take() {
                // SAFETY: the operation finished and this was the only user handle.
                let _ = unsafe { sys::hps_work_destroy(raw.as_ptr()) };
            }
        }
    }
}

impl fmt::Debug for ScopedWork<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ScopedWork").field(&self.raw).finish()
    }
}
