//! Hybrid global-norm clipping (the C API's "Hybrid global-norm clipping" section).
//!
//! A [`Clip`] registers gradients, is sealed (collective over its mp group), then
//! clips them by their global L2 norm over the sharding, mp and pp groups: per
//! gradient the squared norm goes into D ([`ClipFlags::DISTRIBUTED`], split across
//! mp) or N (the rest); D is summed over sharding, mp and pp, N over sharding and
//! pp; `norm = sqrt(D + N)`, `coef = max_norm / (max(norm, max_norm) + 1e-6)`, and
//! every clipped gradient is multiplied by `coef`.
//!
//! # Soundness
//!
//! The library keeps the address of every registered gradient and reads and writes
//! it asynchronously, on the stream of each [`Clip::run`], for as long as the clip
//! exists. So a [`Clip`] mutably borrows every gradient given to
//! [`Clip::add_tensor`] for its whole lifetime: Rust can neither read, write, move
//! nor free a gradient until the clip is dropped, and two registrations of the same
//! memory are impossible. [`Clip::run`] synchronises the stream before it returns,
//! so no run is ever in flight once a safe call returned, and forgetting the clip
//! (`mem::forget` is safe) merely leaks it. The unsafe [`Clip::run_async`] skips
//! that synchronisation; its caller takes over the obligation.
//!
//! If a run fails, the library may already have started part of it (the local
//! partial sums on the stream, the reductions on the communicators' streams, which
//! use memory owned by the C clip). [`Clip::run`] still synchronises the stream, and
//! a clip whose run failed is leaked, not destroyed, when dropped (a few hundred
//! bytes), so a reduction still running can never write freed memory.

use std::cell::UnsafeCell;
use std::fmt;
use std::marker::PhantomData;
use std::ops::{BitOr, BitOrAssign};
use std::ptr::{self, NonNull};

use crate::comm::{Communicator, Element};
use crate::half::{BF16, F16};
use crate::{check, sys, DeviceType, Error, Result, Status, Stream, Tensor, ZeroedStruct};

// ---------------------------------------------------------------------------------
// Flags
// ---------------------------------------------------------------------------------

/// Flags of a registered gradient (`hps_clip_flag_t`, a bitwise or). Any bits can be
/// built with [`ClipFlags::from_bits`]; the library rejects bits it does not know
/// with [`Status::InvalidArgument`].
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ClipFlags(u32);

impl ClipFlags {
    /// No flag: counted in N (replicated across mp) and scaled.
    pub const NONE: ClipFlags = ClipFlags(0);
    /// `HPS_CLIP_DISTRIBUTED`: split across mp, its squared norm is summed over mp.
    pub const DISTRIBUTED: ClipFlags = ClipFlags(sys::hps_clip_flag::HPS_CLIP_DISTRIBUTED.0);
    /// `HPS_CLIP_NO_CLIP`: neither counted nor scaled (need_clip false).
    pub const NO_CLIP: ClipFlags = ClipFlags(sys::hps_clip_flag::HPS_CLIP_NO_CLIP.0);
    /// `HPS_CLIP_SHARED_NOT_FIRST`: a pipeline-shared copy, scaled but not counted.
    pub const SHARED_NOT_FIRST: ClipFlags =
        ClipFlags(sys::hps_clip_flag::HPS_CLIP_SHARED_NOT_FIRST.0);
    /// Every flag these bindings know.
    pub const ALL: ClipFlags =
        ClipFlags(ClipFlags::DISTRIBUTED.0 | ClipFlags::NO_CLIP.0 | ClipFlags::SHARED_NOT_FIRST.0);

    /// Flags from raw bits, known or not (unknown ones fail in the library).
    pub const fn from_bits(bits: u32) -> ClipFlags {
        ClipFlags(bits)
    }

    /// The raw bits.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Whether every bit of `other` is set in `self`.
    pub const fn contains(self, other: ClipFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether no bit is set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The bits of both.
    pub const fn union(self, other: ClipFlags) -> ClipFlags {
        ClipFlags(self.0 | other.0)
    }
}

impl BitOr for ClipFlags {
    type Output = ClipFlags;
    fn bitor(self, rhs: ClipFlags) -> ClipFlags {
        self.union(rhs)
    }
}

impl BitOrAssign for ClipFlags {
    fn bitor_assign(&mut self, rhs: ClipFlags) {
        self.0 |= rhs.0;
    }
}

impl fmt::Debug for ClipFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (ClipFlags::DISTRIBUTED, "DISTRIBUTED"),
            (ClipFlags::NO_CLIP, "NO_CLIP"),
            (ClipFlags::SHARED_NOT_FIRST, "SHARED_NOT_FIRST"),
        ];
        let mut parts: Vec<String> = Vec::new();
        for &(flag, name) in names.iter() {
            if self.contains(flag) {
                parts.push(name.to_string());
            }
        }
        let unknown = self.0 & !ClipFlags::ALL.0;
        if unknown != 0 {
            parts.push(format!("{:#x}", unknown));
        }
        if parts.is_empty() {
            parts.push("NONE".to_string());
        }
        write!(f, "ClipFlags({})", parts.join(" | "))
    }
}

// ---------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------

/// Options of [`Clip::new`] (`hps_clip_options_t`). `Default` is the library's
/// default (`max_norm` 1.0, not deterministic), as [`ClipOptions::library_defaults`]
/// reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClipOptions {
    /// The norm gradients are clipped to; must be positive and finite (else
    /// [`Clip::new`] fails with [`Status::InvalidArgument`]).
    pub max_norm: f64,
    /// Exact fixed-point partial sums: the norm is bitwise identical whatever the
    /// dp / sharding / mp / pp layout of the same gradients.
    pub deterministic: bool,
}

impl Default for ClipOptions {
    fn default() -> ClipOptions {
        ClipOptions {
            max_norm: 1.0,
            deterministic: false,
        }
    }
}

impl ClipOptions {
    /// Options clipping to `max_norm`, not deterministic.
    pub fn new(max_norm: f64) -> ClipOptions {
        ClipOptions {
            max_norm,
            deterministic: false,
        }
    }

    /// Builder: set deterministic mode.
    pub fn deterministic(mut self, deterministic: bool) -> ClipOptions {
        self.deterministic = deterministic;
        self
    }

    /// The library's defaults as `hps_clip_options_init` reports them.
    pub fn library_defaults() -> Result<ClipOptions> {
        let raw = raw_clip_options()?;
        Ok(ClipOptions {
            max_norm: raw.max_norm,
            deterministic: raw.deterministic != 0,
        })
    }
}

fn raw_clip_options() -> Result<ZeroedStruct<sys::hps_clip_options_t>> {
    // SAFETY: integers and a double; all-zero is valid. Its tail padding (past
    // `deterministic`) must stay zero: the library refuses a byte set there.
    let mut raw = unsafe { ZeroedStruct::<sys::hps_clip_options_t>::new() };
    // SAFETY: `raw` is live and has the size passed.
    check(unsafe {
        sys::hps_clip_options_init(
            raw.as_mut_ptr(),
            std::mem::size_of::<sys::hps_clip_options_t>(),
        )
    })?;
    Ok(raw)
}

// ---------------------------------------------------------------------------------
// Gradient element types
// ---------------------------------------------------------------------------------

mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for super::F16 {}
    impl Sealed for super::BF16 {}
}

/// The floating-point [`Element`]s a clip accepts as gradients: `f32`, `f64`,
/// [`F16`], [`BF16`]. Sealed.
pub trait FloatElement: Element + private::Sealed {}
impl FloatElement for f32 {}
impl FloatElement for f64 {}
impl FloatElement for F16 {}
impl FloatElement for BF16 {}

// ---------------------------------------------------------------------------------
// Clip
// ---------------------------------------------------------------------------------

/// A global-norm clip over up to three groups (`hps_clip_t`). Dropping it calls
/// `hps_clip_destroy` and only then ends the borrows of the communicators and of the
/// registered gradients (see the module documentation, "Soundness").
///
/// Use: [`Clip::new`], [`Clip::add_tensor`] for each gradient, [`Clip::seal`]
/// (collective over mp), then [`Clip::run`] as often as needed. The gradients are
/// host memory (Rust slices), so run the clip on a CPU stream; this library version
/// clips CPU gradients only.
///
/// Neither `Send` nor `Sync`: it borrows communicators, which one thread at a time
/// may use, and the C API allows one thread at a time per clip.
///
/// ```no_run
/// # fn main() -> hpshard::Result<()> {
/// use hpshard::{Clip, ClipFlags, ClipOptions, DeviceType, Stream};
/// let stream = Stream::new(DeviceType::CPU, 0)?;
/// let mut grads = [3.0f32, 4.0];
/// let mut frozen = [100.0f64];
/// let norm = {
///     let mut clip = Clip::new(None, None, None, ClipOptions::new(1.0))?;
///     clip.add_tensor(&mut grads, ClipFlags::NONE)?;
///     clip.add_tensor(&mut frozen, ClipFlags::NO_CLIP)?;
///     clip.seal()?;
///     clip.run(&stream, true)? // one host sync
/// }; // the clip is dropped: the gradients are readable again
/// assert!((norm - 5.0).abs() < 1e-6);
/// assert!((grads[0] - 3.0 / 5.000001).abs() < 1e-6);
/// assert_eq!(frozen, [100.0]);
/// # Ok(())
/// # }
/// ```
///
/// A gradient cannot be touched while it is registered:
///
/// ```compile_fail
/// # use hpshard::{Clip, ClipFlags, ClipOptions};
/// let mut grad = [3.0f32, 4.0];
/// let mut clip = Clip::new(None, None, None, ClipOptions::default()).unwrap();
/// clip.add_tensor(&mut grad, ClipFlags::NONE).unwrap();
/// println!("{}", grad[0]); // error: `grad` is still mutably borrowed by the clip
/// clip.seal().unwrap();
/// ```
///
/// nor die before the clip:
///
/// ```compile_fail
/// # use hpshard::{Clip, ClipFlags, ClipOptions};
/// let mut clip = Clip::new(None, None, None, ClipOptions::default()).unwrap();
/// {
///     let mut grad = vec![3.0f32, 4.0];
///     clip.add_tensor(&mut grad, ClipFlags::NONE).unwrap(); // error: does not live long enough
/// }
/// clip.seal().unwrap();
/// ```
pub struct Clip<'a> {
    raw: NonNull<sys::hps_clip_t>,
    /// Where the safe [`Clip::run`] has the norm written: a stable address.
    norm: Box<UnsafeCell<f32>>,
    tensors: usize,
    sealed: bool,
    /// A run failed: the library may still run a reduction on memory of the C clip,
    /// so Drop leaks the clip instead of destroying it.
    poisoned: bool,
    /// The communicators and the gradients, borrowed until the clip is dropped.
    _borrows: PhantomData<(&'a Communicator, &'a mut [u8])>,
}

fn comm_ptr(comm: Option<&Communicator>) -> *mut sys::hps_comm_t {
    match comm {
        Some(comm) => comm.as_ptr(),
        None => ptr::null_mut(),
    }
}

impl<'a> Clip<'a> {
    /// A clip over the `sharding`, `mp` and `pp` groups (`None`: not reduced over)
    /// (`hps_clip_options_init`, then `hps_clip_create`). The communicators stay
    /// borrowed until the clip is dropped.
    /// Errors: [`Status::InvalidArgument`] (`max_norm` not positive and finite),
    /// [`Status::Unimplemented`] (CUDA communicators: this version clips CPU
    /// gradients).
    pub fn new(
        sharding: Option<&'a Communicator>,
        mp: Option<&'a Communicator>,
        pp: Option<&'a Communicator>,
        options: ClipOptions,
    ) -> Result<Clip<'a>> {
        let mut raw_opts = raw_clip_options()?;
        raw_opts.max_norm = options.max_norm;
        raw_opts.deterministic = if options.deterministic { 1 } else { 0 };
        let mut raw: *mut sys::hps_clip_t = ptr::null_mut();
        // SAFETY: the communicators are live (borrowed for 'a, i.e. until the clip is
        // dropped, as the C API requires); options initialised; out-param live.
        check(unsafe {
            sys::hps_clip_create(
                comm_ptr(sharding),
                comm_ptr(mp),
                comm_ptr(pp),
                raw_opts.as_ptr(),
                &mut raw,
            )
        })?;
        match NonNull::new(raw) {
            Some(raw) => Ok(Clip {
                raw,
                norm: Box::new(UnsafeCell::new(f32::NAN)),
                tensors: 0,
                sealed: false,
                poisoned: false,
                _borrows: PhantomData,
            }),
            None => Err(Error::new(
                Status::Internal,
                "hps_clip_create returned OK and a NULL handle",
            )),
        }
    }

    /// The raw handle, still owned by `self`.
    pub fn as_ptr(&self) -> *mut sys::hps_clip_t {
        self.raw.as_ptr()
    }

    /// Register `grad` with `flags` (`hps_clip_add_tensor`). The slice stays mutably
    /// borrowed until the clip is dropped. Every mp rank must register the same
    /// number of gradients with the same flags, in the same order.
    /// Errors: [`Status::InvalidArgument`] (unknown flag bits),
    /// [`Status::FailedPrecondition`] (already sealed).
    pub fn add_tensor<T: FloatElement>(
        &mut self,
        grad: &'a mut [T],
        flags: ClipFlags,
    ) -> Result<()> {
        // SAFETY: live handle, used by this thread only (&mut self); `grad` is valid
        // for grad.len() elements of T::DTYPE and stays mutably borrowed, hence valid
        // and unaliased, for as long as the clip exists ('a). On failure the library
        // did not register it.
        check(unsafe {
            sys::hps_clip_add_tensor(
                self.raw.as_ptr(),
                grad.as_mut_ptr().cast(),
                grad.len() as u64,
                T::DTYPE.0,
                flags.bits(),
            )
        })?;
        self.tensors += 1;
        Ok(())
    }

    /// Register a gradient given as a DLPack tensor (`hps_clip_add_tensor_dlpack`): its
    /// dtype, count and device come from it, checked by the library.
    /// Errors: as [`Clip::add_tensor`], and [`Status::InvalidArgument`] for a tensor the
    /// library refuses (dtype, layout, device).
    ///
    /// # Safety
    /// `tensor` must be a valid DLTensor whose memory stays valid, and is not otherwise
    /// accessed while a run may write it, for as long as the clip exists.
    pub unsafe fn add_tensor_dlpack(
        &mut self,
        tensor: *const sys::DLTensor,
        flags: ClipFlags,
    ) -> Result<()> {
        // SAFETY: live handle (this thread: &mut self); the tensor by the caller's promise.
        check(unsafe { sys::hps_clip_add_tensor_dlpack(self.raw.as_ptr(), tensor, flags.bits()) })?;
        self.tensors += 1;
        Ok(())
    }

    /// Finish registration (`hps_clip_seal`). Collective over the clip's groups
    /// (sharding, mp, pp): every rank calls it; it blocks the host at set-up (counted
    /// host syncs) to compare the mp ranks' registrations.
    /// Errors: [`Status::InvalidArgument`] on every rank when the ranks of any mp group
    /// registered different gradients or flags (the clip stays unsealed), [`Status::FailedPrecondition`] (sealed
    /// twice), and the communicator's errors ([`Status::Timeout`], ...).
    pub fn seal(&mut self) -> Result<()> {
        // SAFETY: live handle, this thread only; the borrowed communicators are live.
        check(unsafe { sys::hps_clip_seal(self.raw.as_ptr()) })?;
        self.sealed = true;
        Ok(())
    }

    /// Clip the registered gradients once and return the global norm
    /// (`hps_clip_run` with a norm slot owned by the clip, then
    /// `hps_stream_synchronize`). With `scale` false the gradients are left alone and
    /// only the norm and the coefficient ([`Clip::coefficient_ptr`]) are computed.
    ///
    /// The safe API pays **one counted host sync per call**: the norm is written by
    /// the stream, and the stream is synchronised before the norm is read and before
    /// this returns, so no run is in flight afterwards. [`Clip::run_async`] does not
    /// synchronise.
    ///
    /// The gradients are host memory (Rust slices) and the norm slot too, so `stream`
    /// must be a CPU stream: another one is refused here with
    /// [`Status::InvalidArgument`], nothing enqueued. On a CPU stream the library
    /// runs its CPU path, and refuses a clip whose communicators are on another
    /// device.
    ///
    /// Errors: [`Status::FailedPrecondition`] (not sealed),
    /// [`Status::InvalidArgument`] (not a CPU stream), the communicators' errors.
    /// After a failed run the stream has been synchronised as well, and a failed
    /// reduction (a peer that aborted or timed out) is returned once nothing uses the
    /// gradients; when that cannot be told (a device error) the process aborts (work
    /// may still use the gradients, as for [`crate::Stream::scope`]).
    pub fn run(&mut self, stream: &Stream, scale: bool) -> Result<f32> {
        if stream.device_type() != DeviceType::CPU {
            return Err(Error::new(
                Status::InvalidArgument,
                format!(
                    "Clip::run: the gradients are host memory (Rust slices), so the safe run \
                     needs a CPU stream, not a stream on {:?} {}",
                    stream.device_type(),
                    stream.device_index()
                ),
            ));
        }
        let norm_ptr = self.norm.get();
        // SAFETY: the norm slot is owned by the clip (boxed: stable address) and not
        // read before the stream has been synchronised below; the gradients are
        // borrowed by the clip; the stream is synchronised before this returns.
        let result = unsafe { self.run_async(stream, norm_ptr, scale) };
        if let Err(err) = stream.synchronize_here() {
            if stream.drained_after_failure() {
                // Nothing uses the gradients any more: the run's failure is returned.
                result?;
                return Err(err);
            }
            eprintln!(
                "hpshard: synchronize after Clip::run failed ({}); aborting because the \
                 clip may still use the borrowed gradients",
                err
            );
            std::process::abort();
        }
        result?;
        // SAFETY: the stream was synchronised: the write of the norm happened before,
        // and nothing else writes the slot now.
        Ok(unsafe { *norm_ptr })
    }

    /// Enqueue one clip on `stream` (`hps_clip_run`) without blocking the host: the
    /// norm is written to `*norm_out` (when not NULL) once the stream gets there, and
    /// with `scale` the gradients are multiplied by the coefficient. No host sync.
    ///
    /// # Safety
    /// * `stream` is a CPU stream, or the registered gradients (host memory, as Rust
    ///   slices) are memory the stream's device may read and write asynchronously.
    /// * `norm_out` is NULL, or valid for writing an `f32` (memory of the stream's
    ///   device; host memory for a CPU stream) and not otherwise accessed until the
    ///   stream has been synchronised (or an event recorded after this call).
    /// * The stream must have been synchronised (or dropped, which finishes its
    ///   work) before the clip is dropped (that ends the gradients' borrows) and
    ///   before the clip is run on another stream. This holds even when this call
    ///   returns an error: part of the run may have been enqueued.
    /// * Until then, the clip's coefficient ([`Clip::coefficient_ptr`]) is not read
    ///   other than in stream order.
    pub unsafe fn run_async(
        &mut self,
        stream: &Stream,
        norm_out: *mut f32,
        scale: bool,
    ) -> Result<()> {
        // SAFETY: live handles, this thread only; the gradients are borrowed by the
        // clip; the rest by the caller's promise.
        let result = check(unsafe {
            sys::hps_clip_run(
                self.raw.as_ptr(),
                stream.as_ptr(),
                norm_out,
                if scale { 1 } else { 0 },
            )
        });
        if result.is_err() && self.sealed {
            // Reductions of a partly started run may still use the C clip's memory.
            self.poisoned = true;
        }
        result
    }

    /// The address of the latest coefficient (`hps_clip_coefficient`), memory of the
    /// gradients' device owned by the clip, valid in stream order after a run and
    /// while the clip lives: for an optimizer that folds the clip into its update.
    /// After [`Clip::run`] returned (a synchronised run on a CPU stream) it is host
    /// memory and may be read directly; 1.0 before any CPU run.
    pub fn coefficient_ptr(&self) -> Result<*const f32> {
        let mut coefficient: *const f32 = ptr::null();
        // SAFETY: live handle; out-param live.
        check(unsafe { sys::hps_clip_coefficient(self.raw.as_ptr(), &mut coefficient) })?;
        Ok(coefficient)
    }

    /// The latest coefficient as a DLPack view (`hps_clip_coefficient_dlpack`; f32, shape
    /// [1], on the gradients' device) that keeps the clip's memory alive until dropped,
    /// under the reading rule of [`Clip::coefficient_ptr`].
    pub fn coefficient_tensor(&self) -> Result<Tensor> {
        let mut t: *mut sys::DLManagedTensor = ptr::null_mut();
        // SAFETY: live handle; live out-param; the tensor is ours to release.
        check(unsafe { sys::hps_clip_coefficient_dlpack(self.raw.as_ptr(), &mut t) })?;
        Tensor::from_out(t, "hps_clip_coefficient_dlpack")
    }

    /// How many gradients were registered.
    pub fn tensor_count(&self) -> usize {
        self.tensors
    }

    /// Whether [`Clip::seal`] succeeded.
    pub fn is_sealed(&self) -> bool {
        self.sealed
    }
}

impl Drop for Clip<'_> {
    fn drop(&mut self) {
        if self.poisoned {
            // A failed run may have left a reduction running on the C clip's memory:
            // leak the clip (and the communicators it references) rather than free it.
            return;
        }
        // SAFETY: we own the handle; no run is in flight (safe runs synchronised,
        // run_async's caller promised to). Ends the borrows only after this call.
        let _ = unsafe { sys::hps_clip_destroy(self.raw.as_ptr()) };
    }
}

impl fmt::Debug for Clip<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Clip")
            .field("raw", &self.raw)
            .field("tensors", &self.tensors)
            .field("sealed", &self.sealed)
            .finish()
    }
}
