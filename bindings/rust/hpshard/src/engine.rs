//! The sharded training engine (the C API's "Sharded training engine" section):
//! ZeRO-style stage 2 over a sharding group (and an optional dp group above it) for a
//! framework that keeps its own forward and backward (and stage 3).
//!
//! An [`Engine`] registers parameters ([`Engine::add_param`]), is sealed (collective),
//! takes rank 0's initial values ([`Engine::broadcast_parameters`]), and then, per
//! step: forward reads the parameter views, backward adds into the gradient views and
//! checks each gradient in ([`Engine::grad_ready`]), and [`Engine::step`] enqueues the
//! optimizer on this rank's shard and the all-gathers of the parameters, without
//! blocking the host.
//!
//! # Soundness of the views
//!
//! The parameter and gradient views are memory owned by the C engine that its streams
//! read and write asynchronously:
//!
//! * after [`Engine::grad_ready`] completes a unit's bucket on the last micro-batch,
//!   that bucket's reduce-scatter (on the sharding communicator's stream) reads the
//!   unit's gradients;
//! * [`Engine::step`] enqueues, on the engine's optimizer stream, after each bucket's
//!   reduction, the zeroing of every gradient, then the optimizer on this rank's
//!   shard of the parameters, then the in-place all-gather of every unit's
//!   parameters, which writes the whole parameter buffer.
//!
//! The C API's ordering gives: once [`Engine::wait_parameters`] of a unit returned OK
//! after a successful step, that unit's all-gather has completed, and so have the
//! optimizer and the zeroing of all gradients before it (the all-gather is enqueued
//! behind them on the optimizer stream). From then until the next `grad_ready` that
//! may start the unit's reduction, or the next `step`, nothing in flight touches the
//! unit's parameters or gradients.
//!
//! Every call that starts asynchronous work takes `&mut self`, and every safe view
//! ([`Engine::param`], [`Engine::grad`], [`Engine::views`], and their typed forms
//! below) borrows the engine mutably for as long as it lives, so no such call can
//! happen while a view exists.
//! Before handing a view out, the engine makes sure nothing in flight touches it,
//! from a mirror of the engine's state kept by this wrapper:
//!
//! * a **parameter** view of unit `u` is given after [`Engine::wait_parameters`]`(u)`
//!   (called by the accessor when a step happened since the last successful wait of
//!   `u`). That is the wait the C API requires before forward anyway: it is a
//!   *dependency wait* ([`dependency_wait_stats`]), not a host sync, so a step driven
//!   through the safe views keeps [`crate::host_sync_count_thread`] at 0;
//! * a **gradient** view of unit `u` is given after the same wait (which also proves
//!   the previous step's zeroing done), and is refused with
//!   [`Status::FailedPrecondition`] from the [`Engine::grad_ready`] that completes
//!   `u`'s gradients on the last micro-batch of a step (the one that starts the
//!   reduction of `u`'s bucket) until that step ([`Engine::step`]) and the wait: the
//!   reduction may be reading it. On earlier micro-batches of gradient accumulation
//!   nothing is launched and the gradients stay accessible. The wrapper mirrors the
//!   library's bucket bookkeeping to know when that is: the library's flat buffers of
//!   trainable parameters, as [`Engine::seal`] reads them from the library
//!   ([`Engine::param_bucket`]; by default one per unit and dtype, so a unit holding
//!   float32 and float16 parameters has two, and more with
//!   [`EngineOptions::bucket_bytes`]), each reduced independently, complete when each
//!   of its parameters checked in once, the micro-batch counter advancing when every
//!   bucket is complete. Only the gradients of the bucket whose reduction started are
//!   refused.
//!
//! Stage 3 keeps only this rank's shards: a unit's full parameters exist between
//! [`Engine::wait_parameters`] (which gathers them) and
//! [`Engine::release_parameters`] (which frees them), and each completed gradient
//! buffer is handed to its reduction (the next [`Engine::grad`] gets a fresh, zeroed
//! one). So in stage 3 the views call `wait_parameters` of the unit every time (a no-op
//! while it is gathered), take every address after all their waits (the library
//! refuses the address of a unit that is not gathered), and cannot outlive a release
//! (it takes `&mut self`). The gradient refusal above is kept (conservative).
//!
//! Distinct parameters have disjoint memory, and parameters and gradients live in
//! distinct buffers, so [`Engine::views`] may hand out several views at once (it
//! refuses the same view twice). No extra host sync is needed, but for one case: a
//! checkpoint's save ([`crate::Checkpoint::save`]) copies this rank's state, the
//! parameters' shards among it, on a stream of its own, ordered before the next step's
//! update but not before the views; so the first parameter view after a save, when no
//! step (or synchronisation) came in between, synchronises the engine first
//! ([`Engine::synchronize`]: counted host syncs). A view taken after the next step needs
//! no more than its wait.
//!
//! A `step`, `grad_ready` or `broadcast_parameters` that fails in a way that may have
//! left part of its work in flight (any status but [`Status::FailedPrecondition`] /
//! [`Status::OutOfRange`], which the library reports before starting anything)
//! *poisons* the engine: the safe views are refused from then on, and the engine is
//! leaked rather than destroyed when dropped (as [`crate::Clip`] does), so nothing in
//! flight can ever touch freed memory.
//!
//! The raw pointers of [`Engine::param_ptr`] / [`Engine::grad_ptr`] carry none of
//! these guarantees: dereferencing them is the caller's `unsafe` business.
//!
//! # Devices
//!
//! An engine works where its sharding communicator does ([`Engine::device`]). Over a
//! CUDA communicator the parameters, gradients and loss scale are device memory, which
//! a slice must never point at: every safe view and [`Engine::loss_scale`] /
//! [`Engine::skipped_steps`] is then refused with [`Status::FailedPrecondition`], and
//! [`Engine::param_ptr`], [`Engine::grad_ptr`] and [`Engine::loss_scale_ptrs`] hand
//! out the device pointers for the device's own tools.
//!
//! # Element types of the views
//!
//! Views and gradients are in the parameter's dtype (the C API: float16 and bfloat16
//! parameters have float16 / bfloat16 views and gradients; the reductions add in fp32
//! and the optimizer keeps fp32 master weights). Each safe view is typed by a
//! [`ParamElement`]: `f32` ([`Engine::param`], [`Engine::grad`], [`Engine::views`]),
//! [`F16`] ([`Engine::param_f16`], [`Engine::grad_f16`]), [`BF16`]
//! ([`Engine::param_bf16`], [`Engine::grad_bf16`]), or generically
//! [`Engine::param_as`], [`Engine::grad_as`], [`Engine::views_as`]. A request whose
//! type is not the parameter's dtype is refused with [`Status::FailedPrecondition`]
//! and a message naming both dtypes. [`Engine::typed_views`] hands out views of
//! several dtypes at once (a [`TypedView`] each), for models mixing them. All of them
//! follow the rules above, unchanged.
//!
//! # Communicators and threads
//!
//! The engine uses its communicators on every call (seal, broadcast, reductions,
//! all-gathers), so it borrows them **mutably** for its whole life: that makes it
//! sound for [`Engine`] to be `Send` (a `&Communicator` kept by another thread would
//! otherwise let two threads use one communicator at once, which the C API forbids; for
//! the same reason [`crate::HybridGroup::comm`] hands out one handle per communicator at
//! a time).
//! The communicators stay usable on the engine's thread through
//! [`Engine::sharding`] / [`Engine::dp`] (e.g. to all-reduce a loss, or to take an
//! [`crate::Aborter`] for a watchdog). Not `Sync`: one thread at a time per engine.

use std::collections::HashSet;
use std::ffi::c_void;
use std::fmt;
use std::ops::{BitOr, BitOrAssign, Range};
use std::ptr::{self, NonNull};
use std::time::Duration;

use crate::comm::{c_string, Aborter, Communicator, Element};
use crate::half::{BF16, F16};
use crate::{check, sys, DType, DeviceType, Error, Result, Status, Stream, Tensor};

// ---------------------------------------------------------------------------------
// Optimizer
// ---------------------------------------------------------------------------------

/// The optimizer the engine steps with (`hps_optimizer_t`). A newtype over the C value:
/// [`Optimizer::from_raw`] builds any value, the library rejects unknown ones with
/// [`Status::InvalidArgument`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Optimizer(sys::hps_optimizer_t);

impl Optimizer {
    /// `HPS_OPTIMIZER_SGD`: momentum, weight decay, nesterov (`torch.optim.SGD`).
    pub const SGD: Optimizer = Optimizer(sys::hps_optimizer::HPS_OPTIMIZER_SGD);
    /// `HPS_OPTIMIZER_ADAMW`: decoupled weight decay (`torch.optim.AdamW`).
    pub const ADAMW: Optimizer = Optimizer(sys::hps_optimizer::HPS_OPTIMIZER_ADAMW);

    /// An optimizer from its C value, known or not (unknown ones fail in the library).
    pub const fn from_raw(value: u32) -> Optimizer {
        Optimizer(sys::hps_optimizer(value))
    }

    /// The C value.
    pub const fn raw(self) -> u32 {
        (self.0).0
    }
}

impl fmt::Debug for Optimizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Optimizer::SGD => f.write_str("Optimizer::SGD"),
            Optimizer::ADAMW => f.write_str("Optimizer::ADAMW"),
            other => write!(f, "Optimizer({})", other.raw()),
        }
    }
}

// ---------------------------------------------------------------------------------
// Parameter flags
// ---------------------------------------------------------------------------------

/// Flags of a registered parameter (`hps_param_flag_t`, a bitwise or). Any bits can be
/// built with [`ParamFlags::from_bits`]; the library rejects bits it does not know
/// with [`Status::InvalidArgument`].
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ParamFlags(u32);

impl ParamFlags {
    /// No flag: trained, counted in clipping.
    pub const NONE: ParamFlags = ParamFlags(0);
    /// `HPS_PARAM_FROZEN`: not trainable, no gradient, never updated.
    pub const FROZEN: ParamFlags = ParamFlags(sys::hps_param_flag::HPS_PARAM_FROZEN.0);
    /// `HPS_PARAM_DISTRIBUTED`: split across mp (for clipping).
    pub const DISTRIBUTED: ParamFlags = ParamFlags(sys::hps_param_flag::HPS_PARAM_DISTRIBUTED.0);
    /// `HPS_PARAM_NO_CLIP`: excluded from gradient clipping.
    pub const NO_CLIP: ParamFlags = ParamFlags(sys::hps_param_flag::HPS_PARAM_NO_CLIP.0);
    /// `HPS_PARAM_SHARED_NOT_FIRST`: a pipeline-shared copy, not counted in the norm.
    pub const SHARED_NOT_FIRST: ParamFlags =
        ParamFlags(sys::hps_param_flag::HPS_PARAM_SHARED_NOT_FIRST.0);
    /// `HPS_PARAM_NO_WEIGHT_DECAY`: the optimizer's weight decay skips it (biases, norms).
    pub const NO_WEIGHT_DECAY: ParamFlags =
        ParamFlags(sys::hps_param_flag::HPS_PARAM_NO_WEIGHT_DECAY.0);
    /// Every flag these bindings know.
    pub const ALL: ParamFlags = ParamFlags(
        ParamFlags::FROZEN.0
            | ParamFlags::DISTRIBUTED.0
            | ParamFlags::NO_CLIP.0
            | ParamFlags::SHARED_NOT_FIRST.0
            | ParamFlags::NO_WEIGHT_DECAY.0,
    );

    /// Flags from raw bits, known or not (unknown ones fail in the library).
    pub const fn from_bits(bits: u32) -> ParamFlags {
        ParamFlags(bits)
    }

    /// The raw bits.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Whether every bit of `other` is set in `self`.
    pub const fn contains(self, other: ParamFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether no bit is set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The bits of both.
    pub const fn union(self, other: ParamFlags) -> ParamFlags {
        ParamFlags(self.0 | other.0)
    }
}

impl BitOr for ParamFlags {
    type Output = ParamFlags;
    fn bitor(self, rhs: ParamFlags) -> ParamFlags {
        self.union(rhs)
    }
}

impl BitOrAssign for ParamFlags {
    fn bitor_assign(&mut self, rhs: ParamFlags) {
        self.0 |= rhs.0;
    }
}

impl fmt::Debug for ParamFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (ParamFlags::FROZEN, "FROZEN"),
            (ParamFlags::DISTRIBUTED, "DISTRIBUTED"),
            (ParamFlags::NO_CLIP, "NO_CLIP"),
            (ParamFlags::SHARED_NOT_FIRST, "SHARED_NOT_FIRST"),
            (ParamFlags::NO_WEIGHT_DECAY, "NO_WEIGHT_DECAY"),
        ];
        let mut parts: Vec<String> = Vec::new();
        for &(flag, name) in names.iter() {
            if self.contains(flag) {
                parts.push(name.to_string());
            }
        }
        let unknown = self.0 & !ParamFlags::ALL.0;
        if unknown != 0 {
            parts.push(format!("{:#x}", unknown));
        }
        if parts.is_empty() {
            parts.push("NONE".to_string());
        }
        write!(f, "ParamFlags({})", parts.join(" | "))
    }
}

// ---------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------

/// Options of [`Engine::new`] (`hps_engine_options_t`). `Default` is the library's
/// default (what `hps_engine_options_init` sets, as [`EngineOptions::library_defaults`]
/// reports it): stage 2, SGD, learning rate 0.01, no momentum, no weight decay, AdamW
/// betas (0.9, 0.999) and epsilon 1e-8, no clipping, one micro-batch per step,
/// 256-byte alignment, a stage-3 window of 2 units, no dynamic loss scaling (initial
/// scale 65536, growth factor 2, backoff factor 0.5, growth interval 2000). Builder
/// setters change one field each.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineOptions {
    /// The ZeRO stage: 2 (full parameters resident) or 3 (only this rank's shards;
    /// a unit's parameters exist between [`Engine::wait_parameters`] and
    /// [`Engine::release_parameters`]); other values are [`Status::InvalidArgument`].
    pub stage: i32,
    /// The optimizer.
    pub optimizer: Optimizer,
    /// Learning rate (both optimizers).
    pub learning_rate: f32,
    /// SGD momentum.
    pub momentum: f32,
    /// Weight decay (SGD: L2 added to the gradient; AdamW: decoupled).
    pub weight_decay: f32,
    /// SGD: Nesterov momentum.
    pub nesterov: bool,
    /// AdamW beta1.
    pub beta1: f32,
    /// AdamW beta2.
    pub beta2: f32,
    /// AdamW epsilon.
    pub epsilon: f32,
    /// > 0: global-norm clipping to this norm, folded into the optimizer; 0: none.
    pub clip_max_norm: f64,
    /// The clip norm is bitwise independent of the layout.
    pub deterministic_clip: bool,
    /// Micro-batches per step (gradient accumulation), at least 1.
    pub accumulation_steps: i32,
    /// Alignment of each parameter in the flat buffers, in bytes.
    pub alignment_bytes: u64,
    /// Stage 3: units live at once, prefetch included.
    pub prefetch_window: i32,
    /// Dynamic loss scaling: multiply the loss by [`Engine::loss_scale`]; a step with
    /// non-finite gradients is skipped on every rank ([`Engine::skipped_steps`]).
    pub dynamic_loss_scaling: bool,
    /// The loss scale to start from.
    pub initial_loss_scale: f32,
    /// Applied to the scale after `growth_interval` good steps in a row.
    pub growth_factor: f32,
    /// Applied to the scale on a skipped step.
    pub backoff_factor: f32,
    /// Good steps in a row before the scale grows.
    pub growth_interval: i32,
    /// > 0: a flat buffer (bucket) of a unit's parameters of one dtype holds at most
    /// this many bytes (a parameter larger than it gets one of its own), so one unit is
    /// reduced in several collectives overlapping its backward
    /// ([`Engine::param_bucket`]); 0: one bucket per unit and dtype.
    pub bucket_bytes: u64,
}

impl Default for EngineOptions {
    fn default() -> EngineOptions {
        EngineOptions {
            stage: 2,
            optimizer: Optimizer::SGD,
            learning_rate: 0.01,
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            clip_max_norm: 0.0,
            deterministic_clip: false,
            accumulation_steps: 1,
            alignment_bytes: 256,
            prefetch_window: 2,
            dynamic_loss_scaling: false,
            initial_loss_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            bucket_bytes: 0,
        }
    }
}

impl EngineOptions {
    /// The defaults ([`Default`]).
    pub fn new() -> EngineOptions {
        EngineOptions::default()
    }

    /// The library's defaults as `hps_engine_options_init` reports them.
    pub fn library_defaults() -> Result<EngineOptions> {
        Ok(EngineOptions::from_raw(&raw_engine_options()?))
    }

    /// The fields of a C options struct.
    pub(crate) fn from_raw(raw: &sys::hps_engine_options_t) -> EngineOptions {
        EngineOptions {
            stage: raw.stage,
            optimizer: Optimizer(raw.optimizer),
            learning_rate: raw.learning_rate,
            momentum: raw.momentum,
            weight_decay: raw.weight_decay,
            nesterov: raw.nesterov != 0,
            beta1: raw.beta1,
            beta2: raw.beta2,
            epsilon: raw.epsilon,
            clip_max_norm: raw.clip_max_norm,
            deterministic_clip: raw.deterministic_clip != 0,
            accumulation_steps: raw.accumulation_steps,
            alignment_bytes: raw.alignment_bytes,
            prefetch_window: raw.prefetch_window,
            dynamic_loss_scaling: raw.dynamic_loss_scaling != 0,
            initial_loss_scale: raw.initial_loss_scale,
            growth_factor: raw.growth_factor,
            backoff_factor: raw.backoff_factor,
            growth_interval: raw.growth_interval,
            bucket_bytes: raw.bucket_bytes,
        }
    }

    /// Builder: the ZeRO stage.
    pub fn stage(mut self, stage: i32) -> EngineOptions {
        self.stage = stage;
        self
    }
    /// Builder: the optimizer.
    pub fn optimizer(mut self, optimizer: Optimizer) -> EngineOptions {
        self.optimizer = optimizer;
        self
    }
    /// Builder: the learning rate.
    pub fn learning_rate(mut self, learning_rate: f32) -> EngineOptions {
        self.learning_rate = learning_rate;
        self
    }
    /// Builder: SGD momentum.
    pub fn momentum(mut self, momentum: f32) -> EngineOptions {
        self.momentum = momentum;
        self
    }
    /// Builder: weight decay.
    pub fn weight_decay(mut self, weight_decay: f32) -> EngineOptions {
        self.weight_decay = weight_decay;
        self
    }
    /// Builder: SGD Nesterov momentum.
    pub fn nesterov(mut self, nesterov: bool) -> EngineOptions {
        self.nesterov = nesterov;
        self
    }
    /// Builder: AdamW beta1.
    pub fn beta1(mut self, beta1: f32) -> EngineOptions {
        self.beta1 = beta1;
        self
    }
    /// Builder: AdamW beta2.
    pub fn beta2(mut self, beta2: f32) -> EngineOptions {
        self.beta2 = beta2;
        self
    }
    /// Builder: AdamW epsilon.
    pub fn epsilon(mut self, epsilon: f32) -> EngineOptions {
        self.epsilon = epsilon;
        self
    }
    /// Builder: global-norm clipping to `max_norm` (0: none).
    pub fn clip_max_norm(mut self, max_norm: f64) -> EngineOptions {
        self.clip_max_norm = max_norm;
        self
    }
    /// Builder: deterministic clip norm.
    pub fn deterministic_clip(mut self, deterministic: bool) -> EngineOptions {
        self.deterministic_clip = deterministic;
        self
    }
    /// Builder: micro-batches per step.
    pub fn accumulation_steps(mut self, steps: i32) -> EngineOptions {
        self.accumulation_steps = steps;
        self
    }
    /// Builder: stage 3's window of live units.
    pub fn prefetch_window(mut self, units: i32) -> EngineOptions {
        self.prefetch_window = units;
        self
    }
    /// Builder: parameter alignment in the flat buffers, in bytes.
    pub fn alignment_bytes(mut self, bytes: u64) -> EngineOptions {
        self.alignment_bytes = bytes;
        self
    }
    /// Builder: dynamic loss scaling on or off.
    pub fn dynamic_loss_scaling(mut self, enabled: bool) -> EngineOptions {
        self.dynamic_loss_scaling = enabled;
        self
    }
    /// Builder: the initial loss scale.
    pub fn initial_loss_scale(mut self, scale: f32) -> EngineOptions {
        self.initial_loss_scale = scale;
        self
    }
    /// Builder: the factor the scale grows by after `growth_interval` good steps.
    pub fn growth_factor(mut self, factor: f32) -> EngineOptions {
        self.growth_factor = factor;
        self
    }
    /// Builder: the factor the scale backs off by on a skipped step.
    pub fn backoff_factor(mut self, factor: f32) -> EngineOptions {
        self.backoff_factor = factor;
        self
    }
    /// Builder: good steps in a row before the scale grows.
    pub fn growth_interval(mut self, steps: i32) -> EngineOptions {
        self.growth_interval = steps;
        self
    }
    /// Builder: the cap on a bucket's bytes (0: one bucket per unit and dtype).
    pub fn bucket_bytes(mut self, bytes: u64) -> EngineOptions {
        self.bucket_bytes = bytes;
        self
    }

    fn to_raw(self) -> Result<sys::hps_engine_options_t> {
        let mut raw = raw_engine_options()?;
        raw.stage = self.stage;
        raw.optimizer = self.optimizer.0;
        raw.learning_rate = self.learning_rate;
        raw.momentum = self.momentum;
        raw.weight_decay = self.weight_decay;
        raw.nesterov = if self.nesterov { 1 } else { 0 };
        raw.beta1 = self.beta1;
        raw.beta2 = self.beta2;
        raw.epsilon = self.epsilon;
        raw.clip_max_norm = self.clip_max_norm;
        raw.deterministic_clip = if self.deterministic_clip { 1 } else { 0 };
        raw.accumulation_steps = self.accumulation_steps;
        raw.alignment_bytes = self.alignment_bytes;
        raw.prefetch_window = self.prefetch_window;
        raw.dynamic_loss_scaling = if self.dynamic_loss_scaling { 1 } else { 0 };
        raw.initial_loss_scale = self.initial_loss_scale;
        raw.growth_factor = self.growth_factor;
        raw.backoff_factor = self.backoff_factor;
        raw.growth_interval = self.growth_interval;
        raw.bucket_bytes = self.bucket_bytes;
        Ok(raw)
    }
}

pub(crate) fn raw_engine_options() -> Result<sys::hps_engine_options_t> {
    // SAFETY: integers, floats and a newtype enum over an integer; all-zero is valid.
    let mut raw: sys::hps_engine_options_t = unsafe { std::mem::zeroed() };
    // SAFETY: `raw` is live and has the size passed.
    check(unsafe {
        sys::hps_engine_options_init(&mut raw, std::mem::size_of::<sys::hps_engine_options_t>())
    })?;
    Ok(raw)
}

// ---------------------------------------------------------------------------------
// Dependency-wait statistics
// ---------------------------------------------------------------------------------

/// Dependency waits so far, process-wide, and the time blocked in them
/// (`hps_dependency_wait_stats`). [`Engine::wait_parameters`] (also when called by the
/// view accessors) counts here when the all-gather had not arrived yet; these are not
/// host syncs.
pub fn dependency_wait_stats() -> Result<(u64, Duration)> {
    let mut count: u64 = 0;
    let mut nanoseconds: u64 = 0;
    // SAFETY: out-params point to live u64s.
    check(unsafe { sys::hps_dependency_wait_stats(&mut count, &mut nanoseconds) })?;
    Ok((count, Duration::from_nanos(nanoseconds)))
}

// ---------------------------------------------------------------------------------
// Views
// ---------------------------------------------------------------------------------

/// One view requested from [`Engine::views`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum View {
    /// The parameter view of this index.
    Param(usize),
    /// The gradient view of this index.
    Grad(usize),
}

impl View {
    fn index(self) -> usize {
        match self {
            View::Param(index) | View::Grad(index) => index,
        }
    }
}

mod private {
    use super::{TypedView, BF16, F16};

    pub trait Sealed: Sized {
        /// The slice of a [`TypedView`] of this type, or the view back.
        fn from_typed_view<'a>(
            view: TypedView<'a>,
        ) -> std::result::Result<&'a mut [Self], TypedView<'a>>;
    }
    impl Sealed for f32 {
        fn from_typed_view<'a>(
            view: TypedView<'a>,
        ) -> std::result::Result<&'a mut [f32], TypedView<'a>> {
            match view {
                TypedView::F32(slice) => Ok(slice),
                other => Err(other),
            }
        }
    }
    impl Sealed for F16 {
        fn from_typed_view<'a>(
            view: TypedView<'a>,
        ) -> std::result::Result<&'a mut [F16], TypedView<'a>> {
            match view {
                TypedView::F16(slice) => Ok(slice),
                other => Err(other),
            }
        }
    }
    impl Sealed for BF16 {
        fn from_typed_view<'a>(
            view: TypedView<'a>,
        ) -> std::result::Result<&'a mut [BF16], TypedView<'a>> {
            match view {
                TypedView::BF16(slice) => Ok(slice),
                other => Err(other),
            }
        }
    }
}

/// The element types of the engine's safe views, one per parameter dtype the engine
/// accepts: `f32` (float32), [`F16`] (float16), [`BF16`] (bfloat16). Sealed.
///
/// [`Engine::param_as`], [`Engine::grad_as`] and [`Engine::views_as`] hand out
/// `&mut [T]` for a parameter registered with dtype [`Element::DTYPE`] of `T`, and
/// refuse any other.
pub trait ParamElement: Element + private::Sealed {}
impl ParamElement for f32 {}
impl ParamElement for F16 {}
impl ParamElement for BF16 {}

/// One view of [`Engine::typed_views`], typed by its parameter's dtype.
#[derive(Debug, PartialEq)]
pub enum TypedView<'a> {
    /// A float32 parameter's view.
    F32(&'a mut [f32]),
    /// A float16 parameter's view.
    F16(&'a mut [F16]),
    /// A bfloat16 parameter's view.
    BF16(&'a mut [BF16]),
}

impl<'a> TypedView<'a> {
    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            TypedView::F32(_) => DType::FLOAT32,
            TypedView::F16(_) => DType::FLOAT16,
            TypedView::BF16(_) => DType::BFLOAT16,
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            TypedView::F32(s) => s.len(),
            TypedView::F16(s) => s.len(),
            TypedView::BF16(s) => s.len(),
        }
    }

    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The slice, when its element type is `T`; otherwise the view back.
    ///
    /// ```no_run
    /// # fn f(engine: &mut hpshard::Engine<'_>) -> hpshard::Result<()> {
    /// use hpshard::{View, F16};
    /// let [w, b] = engine.typed_views([View::Param(0), View::Param(1)])?;
    /// let w: &mut [F16] = w.into_slice().expect("w is float16");
    /// let b: &mut [f32] = b.into_slice().expect("b is float32");
    /// # let _ = (w, b);
    /// # Ok(())
    /// # }
    /// ```
    pub fn into_slice<T: ParamElement>(self) -> std::result::Result<&'a mut [T], TypedView<'a>> {
        T::from_typed_view(self)
    }
}

// ---------------------------------------------------------------------------------
// Engine
// ---------------------------------------------------------------------------------

/// What the wrapper knows of a registered parameter.
#[derive(Debug, Clone)]
struct ParamInfo {
    name: String,
    numel: usize,
    /// The element type of its views and gradient.
    dtype: DType,
    /// Index into `Engine::units`.
    unit: usize,
    /// Whether it has a gradient (not frozen).
    trainable: bool,
    /// Index into `Engine::buckets`, from the seal; `None` when frozen (no gradient)
    /// or before the seal.
    bucket: Option<usize>,
}

/// Where the gradients of a bucket stand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GradState {
    /// Nothing in flight reads or writes them.
    Idle,
    /// A gradient of the unit checked in on the last micro-batch: the bucket's
    /// reduction may be running (or start with a later check-in) until the step.
    Reducing,
    /// A step was enqueued after the reduction: the zeroing is in flight until a
    /// successful wait_parameters of the unit (or synchronize).
    Zeroing,
}

/// The mirror of one unit's state.
#[derive(Debug, Clone)]
struct UnitState {
    id: i32,
    /// A step happened since the last successful wait of this unit: its all-gather may
    /// still be writing the parameters.
    gather_pending: bool,
}

/// The mirror of one bucket: the library's flat buffer of some trainable parameters of
/// one unit and one dtype (all of them, unless `bucket_bytes` cut the unit), reduced
/// together.
#[derive(Debug, Clone)]
struct BucketState {
    /// Index into `Engine::units`.
    unit: usize,
    dtype: DType,
    /// Parameters of the bucket.
    trainable: usize,
    /// Of those, checked in during the current micro-batch.
    checked_in: usize,
    /// Every parameter checked in during the current micro-batch (the library's flag;
    /// the micro-batch ends when every bucket is complete).
    complete: bool,
    grads: GradState,
}

/// A sharded training engine, stage 2 or 3 (`hps_engine_t`). [`Engine::close`] or a drop
/// calls `hps_engine_destroy` (which finishes what is in flight) and only then ends the
/// borrows of the communicators; `close` returns what that work ended with. A poisoned
/// engine is leaked instead (see the module documentation, "Soundness of the views").
///
/// `Send` (it borrows its communicators mutably), not `Sync` (one thread at a time).
///
/// ```no_run
/// # fn main() -> hpshard::Result<()> {
/// use std::time::Duration;
/// use hpshard::{Communicator, DType, DeviceType, Engine, EngineOptions, ParamFlags, Store};
/// let store = Store::open("memory://doc-engine", 0, Duration::from_secs(5))?;
/// let mut comm = Communicator::create(&store, 0, 1, DeviceType::CPU, 0, None)?;
/// let mut engine = Engine::new(&mut comm, None, EngineOptions::default().learning_rate(0.5))?;
/// let w = engine.add_param("w", &[2], DType::FLOAT32, ParamFlags::NONE, 0)?;
/// engine.seal()?;
/// engine.param(w)?.copy_from_slice(&[1.0, 2.0]);
/// engine.broadcast_parameters()?;
/// for _ in 0..3 {
///     let [p, g] = engine.views([hpshard::View::Param(w), hpshard::View::Grad(w)])?;
///     for (g, p) in g.iter_mut().zip(p.iter()) {
///         *g += 2.0 * *p; // d/dp of p^2
///     }
///     engine.grad_ready(w, None)?;
///     engine.step()?; // returns at once
/// }
/// let p = engine.param(w)?; // waits for the last all-gather (a dependency wait)
/// assert!((p[0] - 0.0).abs() < 1e-6);
/// # Ok(())
/// # }
/// ```
///
/// A view keeps the engine borrowed, so no call that starts asynchronous work can
/// happen while it lives:
///
/// ```compile_fail
/// # fn f(engine: &mut hpshard::Engine<'_>) -> hpshard::Result<()> {
/// let g = engine.grad(0)?;
/// engine.grad_ready(0, None)?; // error: `*engine` is already borrowed mutably
/// g[0] += 1.0;
/// # Ok(())
/// # }
/// ```
///
/// and the communicators cannot be used from elsewhere while the engine lives:
///
/// ```compile_fail
/// # fn f(comm: &mut hpshard::Communicator) -> hpshard::Result<()> {
/// let engine = hpshard::Engine::new(comm, None, Default::default())?;
/// comm.barrier(None)?; // error: `*comm` is borrowed mutably by the engine
/// drop(engine);
/// # Ok(())
/// # }
/// ```
pub struct Engine<'c> {
    raw: NonNull<sys::hps_engine_t>,
    sharding: &'c mut Communicator,
    dp: Option<&'c mut Communicator>,
    /// The tensor- and pipeline-parallel groups (`set_model_parallel_groups`), borrowed
    /// like the others while the engine lives.
    mp: Option<&'c mut Communicator>,
    pp: Option<&'c mut Communicator>,
    accumulation_steps: i32,
    stage: i32,
    /// broadcast_parameters succeeded (stage 3 gathers only from then on).
    initialised: bool,
    params: Vec<ParamInfo>,
    units: Vec<UnitState>,
    buckets: Vec<BucketState>,
    /// The library's micro-batch counter, mirrored.
    micro_batch: i32,
    sealed: bool,
    /// A checkpoint's save copies this rank's state, parameters included, on a stream
    /// ordered before the next step's update but not before the views: until a step
    /// or a synchronisation, a parameter view synchronises first.
    snapshot_pending: bool,
    /// Work may have been left in flight by a failed call: no safe views, leak on drop.
    poisoned: bool,
    /// `hps_engine_destroy` has run (or the engine was leaked): by `close` or Drop.
    destroyed: bool,
    /// The sharding communicator's device (`hps_engine_device`), fixed at creation: the
    /// safe views exist only on the CPU.
    device: (DeviceType, i32),
}

// SAFETY: the C API allows an engine to be used by one thread at a time, any thread.
// The communicators it uses are borrowed mutably, and each handle is the only one to its
// communicator (HybridGroup::comm hands out one at a time), so no other thread can use them
// meanwhile; the views it hands out borrow the engine. Not Sync: every method that
// calls the library would otherwise be callable from two threads at once.
unsafe impl Send for Engine<'_> {}

fn comm_ptr(comm: &Option<&mut Communicator>) -> *mut sys::hps_comm_t {
    match comm {
        Some(comm) => comm.as_ptr(),
        None => ptr::null_mut(),
    }
}

/// Whether a failed call was refused before the library started anything.
fn refused_before_starting(err: &Error) -> bool {
    matches!(err.status, Status::FailedPrecondition | Status::OutOfRange)
}

impl<'c> Engine<'c> {
    /// An engine sharding over `sharding`, with an optional `dp` group above it
    /// (`hps_engine_options_init`, then `hps_engine_create`). Both communicators stay
    /// mutably borrowed until the engine is dropped; use them meanwhile through
    /// [`Engine::sharding`] / [`Engine::dp`].
    /// Errors: [`Status::InvalidArgument`] (bad options), [`Status::Unimplemented`]
    /// (CUDA communicators in a build without CUDA kernels).
    pub fn new(
        sharding: &'c mut Communicator,
        dp: Option<&'c mut Communicator>,
        options: EngineOptions,
    ) -> Result<Engine<'c>> {
        Engine::create(sharding, dp, options, None)
    }

    /// As [`Engine::new`], with the framework's compute stream (`compute_stream` of the
    /// engine options): a stream on the engine's device, which the library keeps alive
    /// for the engine (it may be dropped after this call). A CPU engine's framework
    /// computes on the calling thread, whose calls order the engine's work: a CPU stream
    /// is checked and kept, not used.
    /// Errors: as [`Engine::new`]; [`Status::InvalidArgument`] for a stream on another
    /// device.
    pub fn with_compute_stream(
        sharding: &'c mut Communicator,
        dp: Option<&'c mut Communicator>,
        options: EngineOptions,
        compute_stream: &Stream,
    ) -> Result<Engine<'c>> {
        Engine::create(sharding, dp, options, Some(compute_stream))
    }

    fn create(
        sharding: &'c mut Communicator,
        dp: Option<&'c mut Communicator>,
        options: EngineOptions,
        compute_stream: Option<&Stream>,
    ) -> Result<Engine<'c>> {
        let mut raw_opts = options.to_raw()?;
        if let Some(stream) = compute_stream {
            raw_opts.compute_stream = stream.as_ptr();
        }
        let mut raw: *mut sys::hps_engine_t = ptr::null_mut();
        // SAFETY: the communicators are live and borrowed until the engine is dropped
        // (the C API: they must outlive it); options initialised; out-param live.
        check(unsafe {
            sys::hps_engine_create(sharding.as_ptr(), comm_ptr(&dp), &raw_opts, &mut raw)
        })?;
        let raw = match NonNull::new(raw) {
            Some(raw) => raw,
            None => {
                return Err(Error::new(
                    Status::Internal,
                    "hps_engine_create returned OK and a NULL handle",
                ))
            }
        };
        let mut device_type = DeviceType::CPU.0;
        let mut device_index: i32 = -1;
        // SAFETY: live handle (just created, this thread only); out-params live.
        let queried = check(unsafe {
            sys::hps_engine_device(raw.as_ptr(), &mut device_type, &mut device_index)
        });
        if let Err(err) = queried {
            // SAFETY: we own the handle; nothing was started on it.
            let _ = unsafe { sys::hps_engine_destroy(raw.as_ptr()) };
            return Err(err);
        }
        Ok(Engine {
            raw,
            sharding,
            dp,
            mp: None,
            pp: None,
            accumulation_steps: options.accumulation_steps,
            stage: options.stage,
            initialised: false,
            params: Vec::new(),
            units: Vec::new(),
            buckets: Vec::new(),
            micro_batch: 0,
            sealed: false,
            snapshot_pending: false,
            poisoned: false,
            destroyed: false,
            device: (DeviceType(device_type), device_index),
        })
    }

    /// The raw handle, still owned by `self`.
    pub fn as_ptr(&self) -> *mut sys::hps_engine_t {
        self.raw.as_ptr()
    }

    /// The device of the sharding communicator, as (type, index) (`hps_engine_device`,
    /// queried at creation): where the parameters, gradients and loss scale live. Only
    /// on [`DeviceType::CPU`] are the safe views, [`Engine::loss_scale`] and
    /// [`Engine::skipped_steps`] available (module documentation, "Devices").
    pub fn device(&self) -> (DeviceType, i32) {
        self.device
    }

    /// The sharding communicator, for use on this thread while the engine lives (e.g.
    /// to all-reduce a loss; a watchdog takes [`Engine::aborter`]).
    pub fn sharding(&self) -> &Communicator {
        self.sharding
    }

    /// An [`Aborter`] of the sharding communicator for a watchdog thread. It borrows the
    /// communicator the engine borrows (for `'c`), not the engine, so this thread goes on
    /// training through `&mut self` while the watchdog holds it. Its abort ends the
    /// engine's pending and later work with [`Status::Aborted`] on this rank (a sealed
    /// engine's communicators fail together), as [`Communicator::abort`] does.
    ///
    /// ```no_run
    /// # fn main() -> hpshard::Result<()> {
    /// # use hpshard::{Communicator, DeviceType, Engine, EngineOptions, Store};
    /// # use std::time::Duration;
    /// # let store = Store::open("memory://doc-engine-abort", 0, Duration::from_secs(10))?;
    /// # let mut comm = Communicator::create(&store, 0, 1, DeviceType::CPU, 0, None)?;
    /// let mut engine = Engine::new(&mut comm, None, EngineOptions::default())?;
    /// // ... add_param, seal ...
    /// let aborter = engine.aborter();
    /// std::thread::scope(|t| {
    ///     t.spawn(move || {
    ///         std::thread::sleep(Duration::from_secs(60));
    ///         aborter.abort() // a step stuck on a rank that has gone ends now
    ///     });
    ///     engine.synchronize() // ... the training loop, through &mut engine
    /// })
    /// # }
    /// ```
    pub fn aborter(&self) -> Aborter<'c> {
        // SAFETY: the engine holds `&'c mut Communicator`: the communicator lives, unmoved,
        // for all of 'c, also once the engine is dropped (its borrow lasts 'c); its handle
        // is never null.
        unsafe { Aborter::new(NonNull::new_unchecked(self.sharding.as_ptr())) }
    }

    /// The dp communicator, if any (see [`Engine::sharding`]).
    pub fn dp(&self) -> Option<&Communicator> {
        match &self.dp {
            Some(comm) => Some(&**comm),
            None => None,
        }
    }

    /// Register a parameter before [`Engine::seal`] and return its index (registration
    /// order) (`hps_engine_add_param`). `unit` is the layer whose forward uses it (its
    /// parameters are gathered together). Every rank must register the same
    /// parameters in the same order.
    /// Errors: [`Status::InvalidArgument`] (bad shape, unknown flag bits, interior
    /// NUL in `name`), [`Status::AlreadyExists`] (name), [`Status::FailedPrecondition`]
    /// (sealed), [`Status::Unimplemented`] (a dtype other than float32, float16 and
    /// bfloat16). The views of a parameter are typed by its dtype: `f32`
    /// ([`Engine::param`]), [`F16`] ([`Engine::param_f16`]), [`BF16`]
    /// ([`Engine::param_bf16`]).
    pub fn add_param(
        &mut self,
        name: &str,
        shape: &[i64],
        dtype: DType,
        flags: ParamFlags,
        unit: i32,
    ) -> Result<usize> {
        let c_name = c_string("parameter name", name)?;
        let mut index: usize = 0;
        // SAFETY: live handle, this thread only (&mut self); name NUL-terminated and
        // shape valid for shape.len() elements during the call (copied); out-param live.
        check(unsafe {
            sys::hps_engine_add_param(
                self.raw.as_ptr(),
                c_name.as_ptr(),
                shape.as_ptr(),
                shape.len(),
                dtype.0,
                flags.bits(),
                unit,
                &mut index,
            )
        })?;
        let mut numel: Option<usize> = Some(1);
        for &d in shape {
            numel = match (numel, usize::try_from(d)) {
                (Some(n), Ok(d)) => n.checked_mul(d),
                _ => None,
            };
        }
        let numel = match numel {
            Some(n) if index == self.params.len() => n,
            _ => {
                // The library accepted what this wrapper cannot describe: refuse every
                // view rather than guess a length.
                self.poisoned = true;
                return Err(Error::new(
                    Status::Internal,
                    format!(
                        "hps_engine_add_param accepted '{}' (shape {:?}) as index {}, which this \
                         wrapper cannot describe",
                        name, shape, index
                    ),
                ));
            }
        };
        let trainable = !flags.contains(ParamFlags::FROZEN);
        let u = match self.units.iter().position(|s| s.id == unit) {
            Some(u) => u,
            None => {
                self.units.push(UnitState {
                    id: unit,
                    gather_pending: false,
                });
                self.units.len() - 1
            }
        };
        self.params.push(ParamInfo {
            name: name.to_string(),
            numel,
            dtype,
            unit: u,
            trainable,
            bucket: None,
        });
        Ok(index)
    }

    /// In a hybrid topology with tensor (`mp`) or pipeline (`pp`) parallelism, before
    /// [`Engine::seal`]: this rank's mp and pp groups
    /// (`hps_engine_set_model_parallel_groups`; either may be `None`). The clip norm then
    /// sums DISTRIBUTED gradients over mp and every counted gradient over pp, and a
    /// non-finite gradient on any rank of the sharding, dp, mp or pp groups skips the step
    /// on all of them; without it both span the sharding and dp groups only. Every rank
    /// calls it alike; `seal` is then collective over these groups too and checks that
    /// each group's members share every other coordinate. The groups stay borrowed while
    /// the engine lives.
    /// Errors: [`Status::InvalidArgument`] (another device, the engine's own sharding or
    /// dp communicator, mp and pp the same, a hybrid group's communicator of another axis),
    /// [`Status::FailedPrecondition`] (sealed).
    pub fn set_model_parallel_groups(
        &mut self,
        mp: Option<&'c mut Communicator>,
        pp: Option<&'c mut Communicator>,
    ) -> Result<()> {
        // SAFETY: live handle, this thread only; the communicators are live and stay
        // borrowed until the engine is dropped.
        check(unsafe {
            sys::hps_engine_set_model_parallel_groups(
                self.raw.as_ptr(),
                comm_ptr(&mp),
                comm_ptr(&pp),
            )
        })?;
        self.mp = mp;
        self.pp = pp;
        Ok(())
    }

    /// Lay the parameters out and allocate the (zero-filled) buffers
    /// (`hps_engine_seal`). Collective over the sharding and dp groups (and those of
    /// [`Engine::set_model_parallel_groups`]); blocks the host once, at set-up.
    /// Errors: [`Status::InvalidArgument`] (ranks registered different parameters),
    /// [`Status::FailedPrecondition`] (no parameters, sealed twice), the
    /// communicators' errors. From here on the engine's communicators fail together: an
    /// operation that fails on one ends the others (`hps_engine_seal`).
    pub fn seal(&mut self) -> Result<()> {
        // SAFETY: live handle, this thread only; the borrowed communicators are live.
        check(unsafe { sys::hps_engine_seal(self.raw.as_ptr()) })?;
        self.sealed = true;
        // The mirror of the buckets: the library's, as it laid them out.
        let mut ids: Vec<usize> = Vec::new();
        for index in 0..self.params.len() {
            if !self.params[index].trainable {
                continue;
            }
            let id = match self.param_bucket(index) {
                Ok(id) => id,
                Err(err) => {
                    // Without the layout the views cannot be guarded: refuse them.
                    self.poisoned = true;
                    return Err(err);
                }
            };
            let b = match ids.iter().position(|&known| known == id) {
                Some(b) => b,
                None => {
                    ids.push(id);
                    let info = &self.params[index];
                    self.buckets.push(BucketState {
                        unit: info.unit,
                        dtype: info.dtype,
                        trainable: 0,
                        checked_in: 0,
                        complete: false,
                        grads: GradState::Idle,
                    });
                    self.buckets.len() - 1
                }
            };
            self.buckets[b].trainable += 1;
            self.params[index].bucket = Some(b);
        }
        Ok(())
    }

    /// The flat buffer (bucket) holding parameter `index` (`hps_engine_param_bucket`),
    /// numbered from 0 across the engine, the same on every rank: a bucket's gradients
    /// are reduced by one collective, started when all of its parameters checked in
    /// ([`EngineOptions::bucket_bytes`]).
    /// Errors: [`Status::FailedPrecondition`] (not sealed), [`Status::OutOfRange`].
    pub fn param_bucket(&self, index: usize) -> Result<usize> {
        let mut bucket: usize = 0;
        // SAFETY: live handle; out-param live. Not Sync: this thread only.
        check(unsafe { sys::hps_engine_param_bucket(self.raw.as_ptr(), index, &mut bucket) })?;
        Ok(bucket)
    }

    /// Every rank's parameters become its groups' source rank's (rank 0's)
    /// (`hps_engine_broadcast_parameters`). Collective, host-blocking, set-up only.
    /// Errors: [`Status::FailedPrecondition`] (not sealed), the communicators' errors
    /// (these poison the engine: a broadcast may still be writing the parameters).
    pub fn broadcast_parameters(&mut self) -> Result<()> {
        // SAFETY: live handle, this thread only; no view exists (&mut self).
        let result = check(unsafe { sys::hps_engine_broadcast_parameters(self.raw.as_ptr()) });
        match &result {
            Ok(()) => self.initialised = true,
            Err(err) => {
                if !refused_before_starting(err) {
                    self.poisoned = true;
                }
            }
        }
        result
    }

    /// Wait until the last step's all-gather of `unit`'s parameters has arrived
    /// (`hps_engine_wait_parameters`): the C API's required wait before the forward of
    /// `unit`. A dependency wait ([`dependency_wait_stats`]), not a host sync. The
    /// view accessors call it themselves when needed.
    /// Errors: [`Status::NotFound`] (no such unit), [`Status::FailedPrecondition`]
    /// (not sealed), the error of the all-gather.
    pub fn wait_parameters(&mut self, unit: i32) -> Result<()> {
        // SAFETY: live handle, this thread only.
        check(unsafe { sys::hps_engine_wait_parameters(self.raw.as_ptr(), unit) })?;
        if let Some(u) = self.units.iter().position(|s| s.id == unit) {
            self.units[u].gather_pending = false;
            for bucket in self.buckets.iter_mut().filter(|b| b.unit == u) {
                if bucket.grads == GradState::Zeroing {
                    bucket.grads = GradState::Idle;
                }
            }
        }
        Ok(())
    }

    /// After the forward or the backward of `unit` (`hps_engine_release_parameters`):
    /// stage 3 frees its full parameters (the views of the unit end with the borrow of
    /// the engine, so none can outlive this); stage 2 moves nothing. At both stages the
    /// unit is then out of use: a checkpoint's load is refused while a unit is between its
    /// wait and its release (stage 2: or the step).
    /// Errors: [`Status::NotFound`], [`Status::FailedPrecondition`] (stage 3: gradients
    /// taken in this backward that have not all checked in).
    pub fn release_parameters(&mut self, unit: i32) -> Result<()> {
        // SAFETY: live handle, this thread only; no view exists (&mut self).
        check(unsafe { sys::hps_engine_release_parameters(self.raw.as_ptr(), unit) })
    }

    /// Parameter `index`'s gradient is complete for this micro-batch
    /// (`hps_engine_grad_ready`). When the last parameter of a bucket (by default the
    /// unit's trainable parameters of one dtype: [`Engine::param_bucket`]) checks in on
    /// the last micro-batch, the
    /// bucket's reduction starts (after the buckets ahead of it in the library's
    /// reduction order, the latest-registered parameter's first); from then until the next [`Engine::step`] (and the
    /// wait after it), the bucket's gradient views are refused. `ready`: the stream
    /// the gradient was produced on (the reduction waits for its work queued so far),
    /// or `None` when this thread wrote it (the safe views).
    /// Errors: [`Status::FailedPrecondition`] (checked in twice, frozen, not sealed),
    /// [`Status::OutOfRange`] (no such index), the communicator's errors (these
    /// poison the engine).
    pub fn grad_ready(&mut self, index: usize, ready: Option<&Stream>) -> Result<()> {
        let ready_ptr = match ready {
            Some(stream) => stream.as_ptr(),
            None => ptr::null_mut(),
        };
        let last = self.micro_batch >= self.accumulation_steps - 1;
        // SAFETY: live handles, this thread only; no view exists (&mut self). The
        // library records the ready stream's position during the call.
        let result =
            check(unsafe { sys::hps_engine_grad_ready(self.raw.as_ptr(), index, ready_ptr) });
        let bucket = self.params.get(index).and_then(|p| p.bucket);
        let b = match (result, bucket) {
            (Ok(()), Some(b)) => b,
            (Ok(()), None) => {
                self.poisoned = true;
                return Err(Error::new(
                    Status::Internal,
                    format!(
                        "hps_engine_grad_ready accepted parameter {}, unknown or frozen here",
                        index
                    ),
                ));
            }
            (Err(err), _) => {
                // FailedPrecondition / OutOfRange: refused, nothing changed. Otherwise the
                // bucket was complete and its reduction failed to start, maybe in part.
                if !refused_before_starting(&err) {
                    self.poisoned = true;
                    if let Some(b) = bucket {
                        self.buckets[b].grads = GradState::Reducing;
                    }
                }
                return Err(err);
            }
        };
        // Mirror the library's bucket bookkeeping (its buckets, read at the seal): the
        // library refuses a second check-in of a parameter in one micro-batch, and any
        // check-in into a bucket already complete in this micro-batch, without changing
        // anything, so a count per bucket is exact.
        let bucket = &mut self.buckets[b];
        bucket.checked_in += 1;
        if bucket.checked_in < bucket.trainable {
            return Ok(());
        }
        // The bucket is complete: on the last micro-batch its reduction started.
        bucket.checked_in = 0;
        bucket.complete = true;
        if last {
            bucket.grads = GradState::Reducing;
        }
        // The micro-batch ends when every bucket is complete (on the last one, the
        // buckets stay complete until the step).
        if !last && self.buckets.iter().all(|b| b.complete) {
            self.micro_batch += 1;
            for bucket in self.buckets.iter_mut() {
                bucket.complete = false;
            }
        }
        Ok(())
    }

    /// Enqueue the optimizer step on this rank's shards and the parameter all-gathers
    /// (`hps_engine_step`); returns at once, no host sync. Every unit's parameter
    /// views then wait for its all-gather (a dependency wait) when next taken.
    /// Errors: [`Status::FailedPrecondition`] (a gradient has not checked in: step
    /// before backward; nothing was started), others (these poison the engine).
    pub fn step(&mut self) -> Result<()> {
        // SAFETY: live handle, this thread only; no view exists (&mut self).
        let result = check(unsafe { sys::hps_engine_step(self.raw.as_ptr()) });
        match &result {
            Ok(()) => {
                // The update, and so every later all-gather, is ordered after a save's
                // snapshot: the views' waits cover it from here on.
                self.snapshot_pending = false;
                for unit in self.units.iter_mut() {
                    unit.gather_pending = true;
                }
                for bucket in self.buckets.iter_mut() {
                    if bucket.grads == GradState::Reducing {
                        bucket.grads = GradState::Zeroing;
                    }
                    bucket.checked_in = 0;
                    bucket.complete = false;
                }
                self.micro_batch = 0;
            }
            Err(err) => {
                if !refused_before_starting(err) {
                    // Part of the step may have been enqueued.
                    for unit in self.units.iter_mut() {
                        unit.gather_pending = true;
                    }
                    self.poisoned = true;
                }
            }
        }
        result
    }

    /// Set the learning rate of the steps enqueued from now on
    /// (`hps_engine_set_learning_rate`): a schedule sets it before each step, the same on
    /// every rank; no host sync. Errors: [`Status::InvalidArgument`] (negative or not
    /// finite; nothing changed).
    pub fn set_learning_rate(&mut self, learning_rate: f32) -> Result<()> {
        // SAFETY: live handle, this thread only.
        check(unsafe { sys::hps_engine_set_learning_rate(self.raw.as_ptr(), learning_rate) })
    }

    /// The mirror after a full synchronisation: every all-gather and zeroing done
    /// (reductions started since the last step stay: they belong to the next step).
    fn nothing_in_flight(&mut self) {
        self.snapshot_pending = false;
        for unit in self.units.iter_mut() {
            unit.gather_pending = false;
        }
        for bucket in self.buckets.iter_mut() {
            if bucket.grads == GradState::Zeroing {
                bucket.grads = GradState::Idle;
            }
        }
    }

    /// Block until everything in flight has finished (`hps_engine_synchronize`; counted
    /// host syncs, one per queue it drains): for shutdown, checkpoints and tests. Afterwards the views
    /// need no wait (except gradients checked in since the last step, whose reduction
    /// belongs to the next step).
    pub fn synchronize(&mut self) -> Result<()> {
        // SAFETY: live handle, this thread only.
        check(unsafe { sys::hps_engine_synchronize(self.raw.as_ptr()) })?;
        self.nothing_in_flight();
        Ok(())
    }

    /// A copy of the full value of parameter `index` (`numel(index)` elements; float16 /
    /// bfloat16 parameters give their fp32 master weights), for saving or evaluation
    /// (`hps_engine_gather_parameter`). Collective over the sharding group: every rank
    /// calls it with the same index. It first finishes everything in flight (each wait
    /// a counted host sync), as [`Engine::synchronize`] does.
    /// Errors: [`Status::OutOfRange`] (no such index), [`Status::FailedPrecondition`]
    /// (not sealed; stage 3: before [`Engine::broadcast_parameters`]), the
    /// communicators' errors (these poison the engine).
    pub fn gather_parameter(&mut self, index: usize) -> Result<Vec<f32>> {
        // An unknown index still reaches the library, which refuses it (OutOfRange)
        // with its own message; `out` must not be NULL, so it gets one element.
        let numel = self.params.get(index).map_or(0, |p| p.numel);
        let mut out = vec![0f32; numel.max(1)];
        // SAFETY: live handle, this thread only; no view exists (&mut self). `out` holds
        // at least `numel` f32s and is only written during the call.
        let result = check(unsafe {
            sys::hps_engine_gather_parameter(
                self.raw.as_ptr(),
                index,
                out.as_mut_ptr(),
                numel as u64,
            )
        });
        match &result {
            Ok(()) => {
                // The library synchronised first: nothing is in flight any more.
                self.nothing_in_flight();
            }
            Err(err) => {
                if !refused_before_starting(err) {
                    self.poisoned = true;
                }
            }
        }
        result?;
        out.truncate(numel);
        Ok(out)
    }

    /// A checkpoint's save started a snapshot of this rank's state (see the module
    /// documentation, "Soundness of the views").
    pub(crate) fn snapshot_started(&mut self) {
        self.snapshot_pending = true;
    }

    /// A checkpoint's load or import replaced the state: every unit's parameter views
    /// wait for the unit again before they are handed out.
    pub(crate) fn state_loaded(&mut self) {
        for unit in self.units.iter_mut() {
            unit.gather_pending = true;
        }
    }

    /// Bytes this rank holds: parameters, gradients and optimizer state, and at stage 3
    /// the full buffers of gathered units and those kept pooled for the next gather
    /// (`hps_engine_resident_bytes`).
    pub fn resident_bytes(&self) -> Result<u64> {
        let mut bytes: u64 = 0;
        // SAFETY: live handle; out-param live. Not Sync: this thread only.
        check(unsafe { sys::hps_engine_resident_bytes(self.raw.as_ptr(), &mut bytes) })?;
        Ok(bytes)
    }

    /// The element range of parameter `index` that this rank's shard holds and updates
    /// (`hps_engine_shard_range`); empty when none.
    /// Errors: [`Status::FailedPrecondition`] (not sealed), [`Status::OutOfRange`].
    pub fn shard_range(&self, index: usize) -> Result<Range<u64>> {
        let (mut begin, mut end) = (0u64, 0u64);
        // SAFETY: live handle; out-params live.
        check(unsafe {
            sys::hps_engine_shard_range(self.raw.as_ptr(), index, &mut begin, &mut end)
        })?;
        Ok(begin..end)
    }

    /// The current loss scale (1 without dynamic loss scaling), read from the engine's
    /// memory (`hps_engine_loss_scale`): multiply the loss by it before backward.
    ///
    /// The optimizer's stream updates it in each [`Engine::step`]; the update has landed
    /// once [`Engine::wait_parameters`] of a unit returned after the step (the unit's
    /// all-gather is enqueued behind the optimizer). When a step happened since the last
    /// successful wait of every unit, stage 2 makes that wait here on its first unit (a
    /// dependency wait, no host sync) and stage 3 refuses (it would gather a unit out of
    /// the caller's order): call [`Engine::wait_parameters`] first.
    /// Errors: [`Status::FailedPrecondition`] (stage 3 with the step's update possibly in
    /// flight, poisoned engine), the errors of [`Engine::wait_parameters`].
    pub fn loss_scale(&mut self) -> Result<f32> {
        let (scale, _) = self.readable_loss_scale_ptrs("Engine::loss_scale")?;
        // SAFETY: `scale` points to an f32 owned by the engine, valid until it is
        // destroyed (the borrow of `self` prevents that during the read). No update is in
        // flight (checked by loss_scale_ptrs), and none can start during this call.
        Ok(unsafe { *scale })
    }

    /// The number of steps skipped for non-finite gradients (`hps_engine_loss_scale`),
    /// under the same rule as [`Engine::loss_scale`].
    pub fn skipped_steps(&mut self) -> Result<i64> {
        let (_, skipped) = self.readable_loss_scale_ptrs("Engine::skipped_steps")?;
        // SAFETY: as in loss_scale: an i64 owned by the engine, no update in flight.
        Ok(unsafe { *skipped })
    }

    /// With clipping: the global norm of the last step's unscaled mean gradients, the one
    /// the clip used (`hps_engine_grad_norm`; 0 before the first step; Inf or NaN for a
    /// step with a non-finite gradient that counts), read from the engine's memory under
    /// the rule and checks of [`Engine::loss_scale`].
    /// Errors: [`Status::FailedPrecondition`] (no clipping: the engine computes the norm
    /// only to clip; and as [`Engine::loss_scale`]).
    pub fn grad_norm(&mut self) -> Result<f32> {
        let norm = self.grad_norm_ptr()?;
        self.readable_loss_scale_ptrs("Engine::grad_norm")?;
        // SAFETY: `norm` points to an f32 owned by the engine, valid until it is destroyed
        // (the borrow of `self` prevents that during the read). It is engine memory on the
        // engine's device like the loss scale, which readable_loss_scale_ptrs proved host
        // memory with no step in flight (the step writes the norm before the loss scale's
        // update); none can start during this call.
        Ok(unsafe { *norm })
    }

    /// The address of the f32 gradient norm (`hps_engine_grad_norm`) on the engine's
    /// [`Engine::device`], owned by the engine and valid until it is dropped; reading
    /// through it is under [`Engine::loss_scale_ptrs`]' rule.
    pub fn grad_norm_ptr(&self) -> Result<*const f32> {
        let mut norm: *const f32 = ptr::null();
        // SAFETY: live handle; live out-param. Only an address is returned.
        check(unsafe { sys::hps_engine_grad_norm(self.raw.as_ptr(), &mut norm) })?;
        if norm.is_null() {
            return Err(Error::new(
                Status::Internal,
                "hps_engine_grad_norm returned OK and a NULL address",
            ));
        }
        Ok(norm)
    }

    /// The gradient norm as a DLPack view (f32, shape [1]; `hps_engine_grad_norm_dlpack`)
    /// that keeps the engine's memory alive; read it under [`Engine::grad_norm_ptr`]'s rule.
    pub fn grad_norm_tensor(&self) -> Result<Tensor> {
        let mut t: *mut sys::DLManagedTensor = ptr::null_mut();
        // SAFETY: live handle; live out-param; the tensor is ours to release.
        check(unsafe { sys::hps_engine_grad_norm_dlpack(self.raw.as_ptr(), &mut t) })?;
        Tensor::from_out(t, "hps_engine_grad_norm_dlpack")
    }

    /// The addresses of the loss scale and the skipped-step count, after making sure they
    /// are host memory and no step's update of them is in flight. `what`: the caller,
    /// for messages.
    fn readable_loss_scale_ptrs(&mut self, what: &str) -> Result<(*const f32, *const i64)> {
        // The library's host/device policy first: device memory has no host read.
        let (scale, skipped) = self.loss_scale_tensors()?;
        for t in [&scale, &skipped] {
            t.host_ptr().map_err(|e| {
                Error::new(
                    e.status(),
                    format!("{}: {} (Engine::loss_scale_ptrs)", what, e.message()),
                )
            })?;
        }
        if self.poisoned {
            return Err(Error::new(
                Status::FailedPrecondition,
                "engine: an earlier call failed with work possibly in flight; the loss scale \
                 is no longer readable",
            ));
        }
        // After a successful step every unit has gather_pending set; a successful wait of
        // any unit (or synchronize) clears it and proves the step's optimizer done.
        if !self.units.is_empty() && self.units.iter().all(|u| u.gather_pending) {
            if self.stage != 2 {
                return Err(Error::new(
                    Status::FailedPrecondition,
                    "engine: the last step's loss-scale update may be in flight; call \
                     wait_parameters of a unit first",
                ));
            }
            let unit = self.units[0].id;
            self.wait_parameters(unit)?;
        }
        self.loss_scale_ptrs()
    }

    /// The addresses of the f32 loss scale and the i64 skipped-step count
    /// (`hps_engine_loss_scale`), on the engine's [`Engine::device`] (device pointers on
    /// a CUDA engine), owned by the engine and valid until it is dropped.
    ///
    /// Getting the pointers is safe; reading through them is not: the optimizer's
    /// stream updates both in every [`Engine::step`], and the update has landed only
    /// once [`Engine::wait_parameters`] of a unit returned after the step (see
    /// [`Engine::loss_scale`], which makes those checks on the CPU).
    pub fn loss_scale_ptrs(&self) -> Result<(*const f32, *const i64)> {
        let mut scale: *const f32 = ptr::null();
        let mut skipped: *const i64 = ptr::null();
        // SAFETY: live handle; out-params live. Only addresses are returned. Not Sync:
        // this thread only.
        check(unsafe { sys::hps_engine_loss_scale(self.raw.as_ptr(), &mut scale, &mut skipped) })?;
        if scale.is_null() || skipped.is_null() {
            return Err(Error::new(
                Status::Internal,
                "hps_engine_loss_scale returned OK and a NULL address",
            ));
        }
        Ok((scale, skipped))
    }

    /// The loss scale (f32, shape [1]) and the skipped-step count (i64, shape [1]) as
    /// DLPack views (`hps_engine_loss_scale_dlpack`) that keep the engine's memory alive.
    /// Reading them is under [`Engine::loss_scale_ptrs`]' rule.
    pub fn loss_scale_tensors(&self) -> Result<(Tensor, Tensor)> {
        let mut scale: *mut sys::DLManagedTensor = ptr::null_mut();
        let mut skipped: *mut sys::DLManagedTensor = ptr::null_mut();
        // SAFETY: live handle; live out-params; the tensors are ours to release.
        check(unsafe {
            sys::hps_engine_loss_scale_dlpack(self.raw.as_ptr(), &mut scale, &mut skipped)
        })?;
        let scale = Tensor::from_out(scale, "hps_engine_loss_scale_dlpack")?;
        let skipped = Tensor::from_out(skipped, "hps_engine_loss_scale_dlpack")?;
        Ok((scale, skipped))
    }

    /// Parameter `index` as a DLPack view (`hps_engine_param_dlpack`): its dtype and
    /// shape, on [`Engine::device`]. The [`Tensor`] keeps the engine's memory alive until
    /// it is dropped, also past the engine; it gives addresses, not slices (module
    /// [`crate::Tensor`]): the safe slices are [`Engine::param`] and the others. Stage 3:
    /// only while the unit is gathered.
    /// Errors: as [`Engine::param_ptr`]; stage 3: [`Status::FailedPrecondition`] for a
    /// unit that is not gathered.
    pub fn param_tensor(&self, index: usize) -> Result<Tensor> {
        let mut t: *mut sys::DLManagedTensor = ptr::null_mut();
        // SAFETY: live handle; live out-param; the tensor is ours to release.
        check(unsafe { sys::hps_engine_param_dlpack(self.raw.as_ptr(), index, &mut t) })?;
        Tensor::from_out(t, "hps_engine_param_dlpack")
    }

    /// Parameter `index`'s gradient as a DLPack view (`hps_engine_grad_dlpack`), under the
    /// rules of [`Engine::param_tensor`]. Errors: as [`Engine::grad_ptr`].
    pub fn grad_tensor(&self, index: usize) -> Result<Tensor> {
        let mut t: *mut sys::DLManagedTensor = ptr::null_mut();
        // SAFETY: live handle; live out-param; the tensor is ours to release.
        check(unsafe { sys::hps_engine_grad_dlpack(self.raw.as_ptr(), index, &mut t) })?;
        Tensor::from_out(t, "hps_engine_grad_dlpack")
    }

    /// How many parameters were registered.
    pub fn param_count(&self) -> usize {
        self.params.len()
    }

    /// The number of elements of parameter `index` (its views' length).
    pub fn numel(&self, index: usize) -> Option<usize> {
        self.params.get(index).map(|p| p.numel)
    }

    /// The unit parameter `index` was registered with.
    pub fn unit_of(&self, index: usize) -> Option<i32> {
        self.params.get(index).map(|p| self.units[p.unit].id)
    }

    /// The dtype parameter `index` was registered with: the element type of its views
    /// and gradient (`f32`, [`F16`] or [`BF16`]).
    pub fn dtype(&self, index: usize) -> Option<DType> {
        self.params.get(index).map(|p| p.dtype)
    }

    /// Whether [`Engine::seal`] succeeded.
    pub fn is_sealed(&self) -> bool {
        self.sealed
    }

    /// Whether a failed call may have left work in flight: the safe views are refused
    /// and the engine is leaked when dropped.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    /// The address of parameter `index`'s view (`hps_engine_param`), `numel(index)`
    /// `f32`s owned by the engine on its [`Engine::device`] (host memory on the CPU, a
    /// device pointer on CUDA), valid until it is dropped.
    ///
    /// Getting the pointer is safe; using it is not: the engine's streams write the
    /// parameters asynchronously (the all-gather after [`Engine::step`], until
    /// [`Engine::wait_parameters`] of the unit returned). Read or write through it
    /// only between that wait and the next step, never while a safe view of the same
    /// memory exists, and not after the engine is dropped.
    /// For a float16 / bfloat16 parameter the address holds `numel(index)` 16-bit
    /// elements: cast the pointer (or use the safe [`Engine::param_f16`] /
    /// [`Engine::param_bf16`]).
    /// Errors: [`Status::FailedPrecondition`] (not sealed), [`Status::OutOfRange`].
    pub fn param_ptr(&self, index: usize) -> Result<*mut f32> {
        Ok(self.param_data(index)?.cast())
    }

    /// The address of parameter `index`'s gradient view (`hps_engine_grad`),
    /// `numel(index)` elements of the parameter's dtype (`f32`s for float32; cast the
    /// pointer for float16 / bfloat16) owned by the engine. As for
    /// [`Engine::param_ptr`], using it is the caller's responsibility: the gradient is
    /// read by its bucket's reduction from the check-in that completes the bucket on
    /// the last micro-batch, and zeroed by the step, until [`Engine::wait_parameters`]
    /// of the unit after that step.
    /// Errors: [`Status::FailedPrecondition`] (frozen parameter, not sealed),
    /// [`Status::OutOfRange`].
    pub fn grad_ptr(&self, index: usize) -> Result<*mut f32> {
        Ok(self.grad_data(index)?.cast())
    }

    fn param_data(&self, index: usize) -> Result<*mut c_void> {
        let mut data: *mut c_void = ptr::null_mut();
        // SAFETY: live handle; out-param live. Only an address is returned.
        check(unsafe { sys::hps_engine_param(self.raw.as_ptr(), index, &mut data) })?;
        Ok(data)
    }

    fn grad_data(&self, index: usize) -> Result<*mut c_void> {
        let mut data: *mut c_void = ptr::null_mut();
        // SAFETY: live handle; out-param live. Only an address is returned.
        check(unsafe { sys::hps_engine_grad(self.raw.as_ptr(), index, &mut data) })?;
        Ok(data)
    }

    /// The parameter view of `index`, a float32 parameter, after making sure nothing
    /// in flight writes it: [`Engine::wait_parameters`] of its unit if a step happened
    /// since the last wait (a dependency wait, no host sync). Valid while the engine
    /// stays borrowed.
    /// Errors: as [`Engine::param_ptr`] and [`Engine::wait_parameters`];
    /// [`Status::FailedPrecondition`] on a poisoned engine, or when the parameter is
    /// not float32 (see [`Engine::param_f16`], [`Engine::param_bf16`]).
    pub fn param(&mut self, index: usize) -> Result<&mut [f32]> {
        self.param_as::<f32>(index)
    }

    /// The gradient view of `index`, a float32 parameter (zero at the start of every
    /// step; backward adds into it), after [`Engine::wait_parameters`] of its unit if
    /// a step happened since (that wait proves the step's zeroing done).
    /// Errors: [`Status::FailedPrecondition`] when its bucket's gradients all checked
    /// in on the last micro-batch of the current step (the reduction may be reading
    /// them; call [`Engine::step`] first), frozen parameter, not sealed, poisoned, not
    /// float32 (see [`Engine::grad_f16`], [`Engine::grad_bf16`]);
    /// [`Status::OutOfRange`].
    pub fn grad(&mut self, index: usize) -> Result<&mut [f32]> {
        self.grad_as::<f32>(index)
    }

    /// The parameter view of `index`, a float16 parameter: as [`Engine::param`], with
    /// [`F16`] elements (convert with [`F16::to_f32`] / [`F16::from_f32`], which round
    /// as the library does).
    ///
    /// The engine keeps fp32 master weights for float16 / bfloat16 parameters: they
    /// are taken from the views by [`Engine::broadcast_parameters`] (write the initial
    /// values before it), and every [`Engine::step`] rounds the updated masters into
    /// the views. So a value written into a half-precision parameter view after the
    /// broadcast is lost at the next step; [`Engine::gather_parameter`] returns the
    /// masters.
    /// Errors: as [`Engine::param`]; [`Status::FailedPrecondition`] when the parameter
    /// is not float16.
    ///
    /// ```no_run
    /// # fn f(engine: &mut hpshard::Engine<'_>) -> hpshard::Result<()> {
    /// use hpshard::F16;
    /// for (k, w) in engine.param_f16(0)?.iter_mut().enumerate() {
    ///     *w = F16::from_f32(0.01 * k as f32);
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn param_f16(&mut self, index: usize) -> Result<&mut [F16]> {
        self.param_as::<F16>(index)
    }

    /// The parameter view of `index`, a bfloat16 parameter: as [`Engine::param`], with
    /// [`BF16`] elements (master weights: see [`Engine::param_f16`]).
    /// Errors: as [`Engine::param`]; [`Status::FailedPrecondition`] when the parameter
    /// is not bfloat16.
    pub fn param_bf16(&mut self, index: usize) -> Result<&mut [BF16]> {
        self.param_as::<BF16>(index)
    }

    /// The gradient view of `index`, a float16 parameter (its gradient is float16 too):
    /// as [`Engine::grad`], with [`F16`] elements. Backward adds into it in f32 and
    /// rounds: `*g = F16::from_f32(g.to_f32() + dg)`.
    /// Errors: as [`Engine::grad`]; [`Status::FailedPrecondition`] when the parameter
    /// is not float16.
    pub fn grad_f16(&mut self, index: usize) -> Result<&mut [F16]> {
        self.grad_as::<F16>(index)
    }

    /// The gradient view of `index`, a bfloat16 parameter (its gradient is bfloat16
    /// too): as [`Engine::grad`], with [`BF16`] elements.
    /// Errors: as [`Engine::grad`]; [`Status::FailedPrecondition`] when the parameter
    /// is not bfloat16.
    pub fn grad_bf16(&mut self, index: usize) -> Result<&mut [BF16]> {
        self.grad_as::<BF16>(index)
    }

    /// The parameter view of `index` with elements `T`, which must be the parameter's
    /// dtype (`f32`: float32, [`F16`]: float16, [`BF16`]: bfloat16): [`Engine::param`],
    /// [`Engine::param_f16`] and [`Engine::param_bf16`] for generic code.
    pub fn param_as<T: ParamElement>(&mut self, index: usize) -> Result<&mut [T]> {
        let [view] = self.views_as::<T, 1>([View::Param(index)])?;
        Ok(view)
    }

    /// The gradient view of `index` with elements `T`, the parameter's dtype (see
    /// [`Engine::param_as`], [`Engine::grad`]).
    pub fn grad_as<T: ParamElement>(&mut self, index: usize) -> Result<&mut [T]> {
        let [view] = self.views_as::<T, 1>([View::Grad(index)])?;
        Ok(view)
    }

    /// Several views of float32 parameters at once (forward and backward need the
    /// parameters of several units and the gradients together), each made safe as by
    /// [`Engine::param`] / [`Engine::grad`]. Distinct views never overlap; asking for
    /// one view twice is [`Status::InvalidArgument`]. [`Engine::views_as`] is the same
    /// for float16 / bfloat16 parameters, [`Engine::typed_views`] for several dtypes at
    /// once.
    ///
    /// ```no_run
    /// # fn f(engine: &mut hpshard::Engine<'_>) -> hpshard::Result<()> {
    /// use hpshard::View;
    /// let [w, b, gw, gb] = engine.views([View::Param(0), View::Param(1), View::Grad(0), View::Grad(1)])?;
    /// # let _ = (w, b, gw, gb);
    /// # Ok(())
    /// # }
    /// ```
    pub fn views<const N: usize>(&mut self, requests: [View; N]) -> Result<[&mut [f32]; N]> {
        self.views_as::<f32, N>(requests)
    }

    /// Several views at once, all with elements `T` (every requested parameter must
    /// have `T`'s dtype), made safe as by [`Engine::views`].
    ///
    /// ```no_run
    /// # fn f(engine: &mut hpshard::Engine<'_>) -> hpshard::Result<()> {
    /// use hpshard::{View, BF16};
    /// let [p, g] = engine.views_as::<BF16, 2>([View::Param(0), View::Grad(0)])?;
    /// for (g, p) in g.iter_mut().zip(p.iter()) {
    ///     *g = BF16::from_f32(g.to_f32() + 2.0 * p.to_f32()); // d/dp of p^2
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn views_as<T: ParamElement, const N: usize>(
        &mut self,
        requests: [View; N],
    ) -> Result<[&mut [T]; N]> {
        let pointers = self.prepare_views(&requests, Some(T::DTYPE))?;
        let views: Vec<&mut [T]> = pointers
            .into_iter()
            .map(|(data, numel, _)| {
                // SAFETY: see raw_view; the dtype of every requested parameter was checked
                // to be T::DTYPE, and T is the one ParamElement of that dtype.
                unsafe { raw_view::<T>(data, numel) }
            })
            .collect();
        into_array(views)
    }

    /// Several views at once, of parameters of any dtypes, each a [`TypedView`] of its
    /// parameter's dtype, made safe as by [`Engine::views`] (for a model mixing
    /// float32 and half-precision parameters).
    ///
    /// ```no_run
    /// # fn f(engine: &mut hpshard::Engine<'_>) -> hpshard::Result<()> {
    /// use hpshard::{TypedView, View, F16};
    /// let [w, b] = engine.typed_views([View::Param(0), View::Param(1)])?;
    /// if let (TypedView::F16(w), TypedView::F32(b)) = (w, b) {
    ///     b[0] += w[0].to_f32();
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn typed_views<const N: usize>(
        &mut self,
        requests: [View; N],
    ) -> Result<[TypedView<'_>; N]> {
        let pointers = self.prepare_views(&requests, None)?;
        let mut views: Vec<TypedView<'_>> = Vec::with_capacity(N);
        for (data, numel, dtype) in pointers {
            // SAFETY (each): see raw_view; the element type is the parameter's dtype.
            let view = if dtype == DType::FLOAT32 {
                TypedView::F32(unsafe { raw_view::<f32>(data, numel) })
            } else if dtype == DType::FLOAT16 {
                TypedView::F16(unsafe { raw_view::<F16>(data, numel) })
            } else if dtype == DType::BFLOAT16 {
                TypedView::BF16(unsafe { raw_view::<BF16>(data, numel) })
            } else {
                return Err(Error::new(
                    Status::Internal,
                    format!(
                        "Engine::typed_views: the library accepted a parameter of dtype {}, \
                         which has no view type here",
                        dtype_name(dtype)
                    ),
                ));
            };
            views.push(view);
        }
        into_array(views)
    }

    /// The checks, waits and addresses of the safe views: for each request, the
    /// address, the length and the dtype of its elements, once nothing in flight
    /// touches it (module documentation, "Soundness of the views"). `want`: the dtype
    /// every requested parameter must have (`None`: any).
    fn prepare_views(
        &mut self,
        requests: &[View],
        want: Option<DType>,
    ) -> Result<Vec<(*mut c_void, usize, DType)>> {
        if self.poisoned {
            return Err(Error::new(
                Status::FailedPrecondition,
                "engine: an earlier call failed with work possibly in flight; the safe views \
                 are no longer available",
            ));
        }
        let mut seen: HashSet<View> = HashSet::new();
        for &request in requests.iter() {
            if let (Some(info), Some(want)) = (self.params.get(request.index()), want) {
                if info.dtype != want {
                    return Err(Error::new(
                        Status::FailedPrecondition,
                        format!(
                            "engine: parameter {} ('{}') is {}, not {}: its views are {} \
                             (Engine::{}, views_as::<{}>, typed_views)",
                            request.index(),
                            info.name,
                            dtype_name(info.dtype),
                            dtype_name(want),
                            element_name(info.dtype),
                            accessor_name(request, info.dtype),
                            element_name(info.dtype),
                        ),
                    ));
                }
            }
            if !seen.insert(request) {
                return Err(Error::new(
                    Status::InvalidArgument,
                    format!("Engine::views: {:?} requested twice", request),
                ));
            }
        }
        // 1. What each view needs; 2. the waits; 3. the addresses, taken after every
        // wait (in stage 3 a wait may move or free other units' parameters: an
        // address taken afterwards is refused by the library rather than dangling).
        let mut infos: Vec<(usize, DType)> = Vec::with_capacity(requests.len());
        let mut waits: Vec<i32> = Vec::new();
        for &request in requests.iter() {
            let index = request.index();
            let info = match self.params.get(index) {
                Some(info) => info,
                None => {
                    // Not registered: the library reports it (out of range, not sealed),
                    // from the function of the request's kind.
                    match request {
                        View::Param(_) => self.param_data(index)?,
                        View::Grad(_) => self.grad_data(index)?,
                    };
                    return Err(Error::new(
                        Status::OutOfRange,
                        format!("engine: no parameter {}", index),
                    ));
                }
            };
            let unit = &self.units[info.unit];
            // Frozen parameters have no bucket: the library refuses their gradient.
            let bucket = info.bucket.map(|b| &self.buckets[b]);
            let mut zeroing = false;
            if let (View::Grad(_), Some(bucket)) = (request, bucket) {
                if bucket.grads == GradState::Reducing {
                    return Err(Error::new(
                        Status::FailedPrecondition,
                        format!(
                            "engine: the {} gradients of unit {} all checked in on the last \
                             micro-batch; their reduction may be reading them until step() (and \
                             the wait for the unit's parameters after it)",
                            dtype_name(bucket.dtype),
                            unit.id
                        ),
                    ));
                }
                zeroing = bucket.grads == GradState::Zeroing;
            }
            let wait = if self.stage == 2 {
                unit.gather_pending || zeroing
            } else {
                // Stage 3: the unit's parameters exist only while it is gathered; the
                // wait gathers it (a no-op while it is live). Before the broadcast the
                // views are the initial values, which nothing in flight touches.
                self.initialised
            };
            if wait && !waits.contains(&unit.id) {
                waits.push(unit.id);
            }
            infos.push((info.numel, info.dtype));
        }
        if self.snapshot_pending && requests.iter().any(|r| matches!(r, View::Param(_))) {
            self.synchronize()?;
        }
        for &unit in waits.iter() {
            self.wait_parameters(unit)?;
        }
        // The host address of each view: the library's host/device policy decides
        // (device memory has no host view); the views last while the engine is borrowed.
        let mut pointers: Vec<(*mut c_void, usize, DType)> = Vec::with_capacity(requests.len());
        for (&request, &(numel, dtype)) in requests.iter().zip(infos.iter()) {
            let tensor = match request {
                View::Param(index) => self.param_tensor(index)?,
                View::Grad(index) => self.grad_tensor(index)?,
            };
            let data = tensor.host_ptr().map_err(|e| {
                Error::new(
                    e.status(),
                    format!(
                        "Engine views (param, grad, views, typed_views, ...): {} (use \
                         Engine::param_ptr / Engine::grad_ptr or the tensors)",
                        e.message()
                    ),
                )
            })?;
            pointers.push((data, numel, dtype));
        }
        Ok(pointers)
    }
}

/// A view of `numel` elements `T` at `data`, for the engine's safe views.
///
/// # Safety
/// `data` is null, or the address of `numel` elements of `T`'s dtype owned by the
/// engine (as [`Engine::prepare_views`] returns it, for a parameter of dtype
/// `T::DTYPE`), and the returned slice must not outlive the mutable borrow of the
/// engine that the caller holds.
unsafe fn raw_view<'a, T: ParamElement>(data: *mut c_void, numel: usize) -> &'a mut [T] {
    if numel == 0 || data.is_null() {
        // SAFETY: an empty slice at a dangling, aligned address.
        unsafe { std::slice::from_raw_parts_mut(NonNull::<T>::dangling().as_ptr(), 0) }
    } else {
        // SAFETY: the engine owns `numel` elements of T's dtype at `data` (f32, or u16
        // bits for F16 / BF16, which are #[repr(transparent)] over u16 with every bit
        // pattern valid), aligned for their size (each parameter starts a whole number
        // of elements into a buffer the library allocated with malloc's alignment),
        // valid until the engine is destroyed, which
        // the borrow of the engine prevents while the view lives. Nothing in flight
        // touches them (checked by prepare_views: the unit's all-gather and zeroing
        // completed, its bucket's reduction not started; stage 3: the unit is gathered
        // and this buffer not handed to a reduction), and nothing can start one while
        // the engine is borrowed (every such call takes &mut self). Distinct requests
        // are disjoint memory (distinct parameters lie apart in the flat buffers;
        // parameters and gradients are separate buffers), and duplicates were refused.
        unsafe { std::slice::from_raw_parts_mut(data.cast::<T>(), numel) }
    }
}

fn into_array<T, const N: usize>(views: Vec<T>) -> Result<[T; N]> {
    match views.try_into() {
        Ok(array) => Ok(array),
        Err(_) => Err(Error::new(
            Status::Internal,
            "Engine::views: length mismatch",
        )),
    }
}

/// "float32", "float16", ... (the library's names), for messages.
fn dtype_name(dtype: DType) -> String {
    match dtype.name() {
        Ok(name) => name.to_string(),
        Err(_) => format!("{:?}", dtype),
    }
}

/// The Rust element type of a dtype's views, for messages.
fn element_name(dtype: DType) -> &'static str {
    if dtype == DType::FLOAT32 {
        "f32"
    } else if dtype == DType::FLOAT16 {
        "F16"
    } else if dtype == DType::BFLOAT16 {
        "BF16"
    } else {
        "none"
    }
}

/// The accessor of a request for a parameter of this dtype (`param_f16`), for messages.
fn accessor_name(request: View, dtype: DType) -> &'static str {
    let param = matches!(request, View::Param(_));
    if dtype == DType::FLOAT16 {
        if param {
            "param_f16"
        } else {
            "grad_f16"
        }
    } else if dtype == DType::BFLOAT16 {
        if param {
            "param_bf16"
        } else {
            "grad_bf16"
        }
    } else if param {
        "param"
    } else {
        "grad"
    }
}

impl Engine<'_> {
    /// Finishes what is in flight and frees the engine (`hps_engine_destroy`), returning
    /// what that work ended with: `Ok`, or its first failure — with uneven data, the
    /// collectives of a last step whose peers had left (its update is missing), which no
    /// other call reports once the program stops calling. Dropping the engine does the
    /// same and, when the destroy fails and no call on the engine that runs or waits for
    /// its work (step, synchronize, ...; any thread) has returned an error before
    /// (`hps_engine_failures_returned`),
    /// writes the failure to stderr (a Drop cannot return it): call `close` to handle it. A poisoned engine is leaked, as by Drop, and
    /// `close` returns `Ok` (the failed call returned its error).
    pub fn close(mut self) -> Result<()> {
        self.destroy()
    }

    /// How many calls on the engine that run or wait for its work returned an error
    /// (`hps_engine_failures_returned`): the program has been told of a failure when not 0.
    fn failures_returned(&self) -> u64 {
        let mut count = 0u64;
        // SAFETY: the handle is live (not destroyed); the out-pointer is a valid u64.
        let status = unsafe { sys::hps_engine_failures_returned(self.raw.as_ptr(), &mut count) };
        if check(status).is_err() {
            return 0; // unreadable: report rather than hide a failure
        }
        count
    }

    fn destroy(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.destroyed, true) {
            return Ok(());
        }
        if self.poisoned || self.buckets.iter().any(|b| b.grads == GradState::Reducing) {
            // A failed call may have left work in flight on the engine's memory, or a
            // reduction started by grad_ready has not been consumed by a step (this
            // library version's destroy does not wait for such reductions): leak the
            // engine (it keeps the communicators' internals alive) rather than free
            // memory that may still be read or written.
            return Ok(());
        }
        // SAFETY: we own the handle; no view exists (&mut self). The C function
        // finishes what is in flight, then frees the engine; only afterwards do the
        // borrows of the communicators end. It is never called again (`destroyed`).
        check(unsafe { sys::hps_engine_destroy(self.raw.as_ptr()) })
    }
}

impl Drop for Engine<'_> {
    fn drop(&mut self) {
        let seen = self.destroyed || self.failures_returned() != 0;
        if let Err(err) = self.destroy() {
            if !seen {
                eprintln!(
                    "hpshard: an engine dropped with failed work in flight (its last steps' \
                     updates may be missing): {}",
                    err
                );
            }
        }
    }
}

impl fmt::Debug for Engine<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("raw", &self.raw)
            .field("params", &self.params.len())
            .field("sealed", &self.sealed)
            .field("poisoned", &self.poisoned)
            .field("device", &self.device)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Store;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn views_and_loss_scale_ask_the_librarys_policy() {
        // The views' host addresses come from the library's policy (hps_dlpack_host_data):
        // on a CPU engine, the very memory of the pointer accessors.
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let url = format!(
            "memory://rust-engine-unit-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        );
        let store = Store::open(&url, 0, Duration::from_secs(10)).unwrap();
        let mut comm = Communicator::create(&store, 0, 1, DeviceType::CPU, 0, None).unwrap();
        let options = EngineOptions::default().dynamic_loss_scaling(true);
        let mut engine = Engine::new(&mut comm, None, options).unwrap();
        assert_eq!(engine.device(), (DeviceType::CPU, 0));
        let w = engine
            .add_param("w", &[2], DType::FLOAT32, ParamFlags::NONE, 0)
            .unwrap();
        engine.seal().unwrap();
        let p = engine.param_ptr(w).unwrap();
        assert_eq!(engine.param(w).unwrap().as_ptr(), p as *const f32);
        assert_eq!(engine.loss_scale().unwrap(), 65536.0);
        let (scale, _) = engine.loss_scale_ptrs().unwrap();
        let (t, _) = engine.loss_scale_tensors().unwrap();
        assert_eq!(t.host_ptr().unwrap() as *const f32, scale);
    }
}
