//! Checkpoints (the C API's "Checkpoints" section): sharded, asynchronous, atomic,
//! verified checkpoints of an [`Engine`], loadable into any topology
//! (docs/checkpoints.md).
//!
//! A [`Checkpoint`] borrows its engine mutably for its whole life, and hands it out again
//! through [`Checkpoint::engine`] for training: so the engine outlives the checkpoint (as
//! the C API requires), and no engine call can run beside a save, a load or the
//! checkpoint's destruction. [`Checkpoint::save`] returns at once with a [`Work`] that
//! completes when the checkpoint is published on every rank; the steps that follow
//! overlap the writing. The save copies this rank's state on a stream of its own, ordered
//! before the engine's next update: the engine's first parameter view after a save
//! therefore synchronises first (counted host syncs) unless a step came in between (the
//! `engine` module's "Soundness of the views"). Paths are Unix paths (their bytes, without a NUL).

use std::ffi::CString;
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::ptr::{self, NonNull};
use std::time::Duration;

use crate::comm::{c_string, timeout_ms, Communicator, Work};
use crate::engine::{raw_engine_options, EngineOptions};
use crate::{check, sys, Engine, Error, Result, Status, ZeroedStruct};

/// A path as the C API takes it; a NUL byte in it is [`Status::InvalidArgument`].
fn c_path(what: &str, path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        Error::new(
            Status::InvalidArgument,
            format!("{} contains a NUL byte: {:?}", what, path),
        )
    })
}

/// Text of a C char array, up to its first NUL (lossy UTF-8).
fn c_text(chars: &[std::os::raw::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Options of [`Checkpoint::new`] (`hps_checkpoint_options_t`). `Default` is the
/// library's (as [`CheckpointOptions::library_defaults`] reports it): keep every
/// checkpoint, 1 MiB chunks, 30 minutes per agreement of the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointOptions {
    /// > 0: after a save is published, delete this model's checkpoints under the root
    /// beyond the newest `keep_last` (a part of a model cut across mp and pp keeps at least
    /// 2; another model's are kept); 0: keep all.
    pub keep_last: i32,
    /// Ranges are checksummed in chunks of this many bytes.
    pub chunk_bytes: u64,
    /// Bound on each agreement among the ranks of a save or a load.
    pub timeout: Duration,
}

impl Default for CheckpointOptions {
    fn default() -> CheckpointOptions {
        CheckpointOptions {
            keep_last: 0,
            chunk_bytes: 1 << 20,
            timeout: Duration::from_millis(1_800_000),
        }
    }
}

impl CheckpointOptions {
    /// The library's defaults as `hps_checkpoint_options_init` reports them.
    pub fn library_defaults() -> Result<CheckpointOptions> {
        let raw = raw_options()?;
        Ok(CheckpointOptions {
            keep_last: raw.keep_last,
            chunk_bytes: raw.chunk_bytes,
            timeout: Duration::from_millis(raw.timeout_ms.max(0) as u64),
        })
    }

    /// Builder: how many checkpoints to keep (0: all).
    pub fn keep_last(mut self, keep_last: i32) -> CheckpointOptions {
        self.keep_last = keep_last;
        self
    }

    /// Builder: the checksummed chunk size.
    pub fn chunk_bytes(mut self, bytes: u64) -> CheckpointOptions {
        self.chunk_bytes = bytes;
        self
    }

    /// Builder: the bound on each agreement of the ranks.
    pub fn timeout(mut self, timeout: Duration) -> CheckpointOptions {
        self.timeout = timeout;
        self
    }
}

fn raw_options() -> Result<ZeroedStruct<sys::hps_checkpoint_options_t>> {
    // SAFETY: integers only; all-zero is valid.
    let mut raw = unsafe { ZeroedStruct::<sys::hps_checkpoint_options_t>::new() };
    // SAFETY: `raw` is live and has the size passed.
    check(unsafe {
        sys::hps_checkpoint_options_init(
            raw.as_mut_ptr(),
            std::mem::size_of::<sys::hps_checkpoint_options_t>(),
        )
    })?;
    Ok(raw)
}

/// Options of [`Checkpoint::load`] and [`Checkpoint::import_safetensors`]
/// (`hps_checkpoint_load_options_t`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Tensors the source lacks stay unchanged and tensors the engine lacks are
    /// skipped, instead of an error naming them.
    pub allow_partial: bool,
}

impl LoadOptions {
    fn to_raw(self) -> Result<ZeroedStruct<sys::hps_checkpoint_load_options_t>> {
        // SAFETY: integers only; all-zero is valid. Its tail padding must stay zero.
        let mut raw = unsafe { ZeroedStruct::<sys::hps_checkpoint_load_options_t>::new() };
        // SAFETY: `raw` is live and has the size passed.
        check(unsafe {
            sys::hps_checkpoint_load_options_init(
                raw.as_mut_ptr(),
                std::mem::size_of::<sys::hps_checkpoint_load_options_t>(),
            )
        })?;
        raw.allow_partial = if self.allow_partial { 1 } else { 0 };
        Ok(raw)
    }
}

/// What a checkpoint holds (`hps_checkpoint_info_t`; [`Checkpoint::inspect`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// Its name.
    pub name: String,
    /// 32 hex digits.
    pub id: String,
    /// The format's version.
    pub format_version: i32,
    /// The stage of the engine that wrote it.
    pub stage: i32,
    /// Its sharding degree.
    pub sharding: i32,
    /// Its dp degree.
    pub dp: i32,
    /// The ranks that saved it.
    pub world: i32,
    /// Its data files.
    pub files: i32,
    /// Its logical tensors (parameters, masters, optimizer state, step scalars).
    pub tensors: u64,
    /// The tensor data in its data files, in bytes.
    pub bytes: u64,
    /// When it was published, in nanoseconds since the Unix epoch.
    pub created_unix_ns: i64,
    /// The part of a model cut across mp and pp it holds: the mp degree (1: none)...
    pub mp: i32,
    /// ...and coordinate,
    pub mp_rank: i32,
    /// the pp degree (1: none)...
    pub pp: i32,
    /// ...and coordinate.
    pub pp_rank: i32,
}

/// A checkpoint handle of one engine (`hps_checkpoint_t`): saves it under a root
/// directory every rank sees, and loads checkpoints of any topology into it. Dropping it
/// calls `hps_checkpoint_destroy`, which waits for a save in flight. `Send` when the
/// engine is (it borrows it mutably), not `Sync`.
///
/// ```no_run
/// # fn main() -> hpshard::Result<()> {
/// use std::time::Duration;
/// use hpshard::{Checkpoint, CheckpointOptions, Communicator, DType, DeviceType, Engine};
/// use hpshard::{EngineOptions, LoadOptions, ParamFlags, Store};
/// let store = Store::open("memory://doc-checkpoint", 0, Duration::from_secs(5))?;
/// let mut comm = Communicator::create(&store, 0, 1, DeviceType::CPU, 0, None)?;
/// let mut engine = Engine::new(&mut comm, None, EngineOptions::default())?;
/// let w = engine.add_param("w", &[2], DType::FLOAT32, ParamFlags::NONE, 0)?;
/// engine.seal()?;
/// engine.broadcast_parameters()?;
/// let mut ckpt = Checkpoint::new(&mut engine, None, "/tmp/doc-ckpt", CheckpointOptions::default())?;
/// ckpt.engine().grad(w)?[0] = 1.0;
/// ckpt.engine().grad_ready(w, None)?;
/// ckpt.engine().step()?;
/// let work = ckpt.save("step-1", &[("step", "1")])?; // returns at once
/// work.wait()?; // published on every rank
/// ckpt.load(None, LoadOptions::default())?; // the latest
/// assert_eq!(ckpt.metadata("step")?, "1");
/// # Ok(())
/// # }
/// ```
///
/// While it lives, the engine is reached only through it:
///
/// ```compile_fail
/// # fn f(engine: &mut hpshard::Engine<'_>) -> hpshard::Result<()> {
/// let ckpt = hpshard::Checkpoint::new(engine, None, "/tmp/x", Default::default())?;
/// engine.step()?; // error: `*engine` is borrowed mutably by the checkpoint
/// drop(ckpt);
/// # Ok(())
/// # }
/// ```
pub struct Checkpoint<'e, 'c> {
    raw: NonNull<sys::hps_checkpoint_t>,
    engine: &'e mut Engine<'c>,
    // The engine the library's checkpoint saves: `engine` must still hold it (safe code
    // can `std::mem::swap` another engine in through `engine()`).
    engine_raw: *mut sys::hps_engine_t,
}

// SAFETY: the C API allows a checkpoint handle to be used by one thread at a time, any
// thread; the engine it saves is borrowed mutably with it (and is Send), and its saves
// write on a thread of the library's own. Not Sync: every method calls the library.
unsafe impl Send for Checkpoint<'_, '_> {}

impl<'e, 'c> Checkpoint<'e, 'c> {
    /// A checkpoint of `engine` saving under `root` (created when missing)
    /// (`hps_checkpoint_create`). Collective over `group`: a CPU communicator of exactly
    /// the ranks holding the engine's state (its sharding x dp ranks); `None` is the
    /// engine's sharding communicator (an engine without a dp group).
    /// Errors: [`Status::InvalidArgument`] (a group of another size or device, bad
    /// options, a NUL in `root`), [`Status::Unimplemented`] (an engine without checkpoint
    /// support), [`Status::BackendError`] (the root cannot be created).
    pub fn new(
        engine: &'e mut Engine<'c>,
        group: Option<&'e Communicator>,
        root: impl AsRef<Path>,
        options: CheckpointOptions,
    ) -> Result<Checkpoint<'e, 'c>> {
        let root = c_path("checkpoint root", root.as_ref())?;
        let mut raw_opts = raw_options()?;
        raw_opts.keep_last = options.keep_last;
        raw_opts.chunk_bytes = options.chunk_bytes;
        raw_opts.timeout_ms = timeout_ms(options.timeout);
        let group = match group {
            Some(comm) => comm.as_ptr(),
            None => engine.sharding().as_ptr(),
        };
        let mut raw: *mut sys::hps_checkpoint_t = ptr::null_mut();
        // SAFETY: live handles used by this thread (the engine is borrowed mutably, the
        // group outlives the checkpoint); root NUL-terminated; options initialised;
        // out-param live.
        check(unsafe {
            sys::hps_checkpoint_create(
                engine.as_ptr(),
                group,
                root.as_ptr(),
                raw_opts.as_ptr(),
                &mut raw,
            )
        })?;
        match NonNull::new(raw) {
            Some(raw) => {
                let engine_raw = engine.as_ptr();
                Ok(Checkpoint {
                    raw,
                    engine,
                    engine_raw,
                })
            }
            None => Err(Error::new(
                Status::Internal,
                "hps_checkpoint_create returned OK and a NULL handle",
            )),
        }
    }

    /// The engine, for training between saves and loads. An engine swapped in through it
    /// (`std::mem::swap`) is not the one the checkpoint saves: saves and loads are then
    /// refused with [`Status::FailedPrecondition`] until the checkpoint's own engine is
    /// back (the views of the one swapped in would not know of the save reading them).
    pub fn engine(&mut self) -> &mut Engine<'c> {
        self.engine
    }

    // FAILED_PRECONDITION when `engine` no longer holds the engine the library saves.
    fn check_own_engine(&self, call: &str) -> Result<()> {
        if self.engine.as_ptr() == self.engine_raw {
            return Ok(());
        }
        Err(Error::new(
            Status::FailedPrecondition,
            format!(
                "Checkpoint::{}: another engine was swapped in through Checkpoint::engine(); \
                 the checkpoint saves and loads the engine it was created with",
                call
            ),
        ))
    }

    /// The raw handle, still owned by `self`.
    pub fn as_ptr(&self) -> *mut sys::hps_checkpoint_t {
        self.raw.as_ptr()
    }

    /// Start saving checkpoint `root/name` (`[A-Za-z0-9._-]`, 1..200 characters, not
    /// starting with '.', not "latest" nor beginning "latest.tmp") with `metadata` (key,
    /// value pairs, e.g. the framework's step and data-loader position), after the step
    /// whose state it saves
    /// (`hps_checkpoint_save`). Returns at once: the [`Work`] completes when the checkpoint
    /// is published on every rank, or returns how it failed (the same error on every
    /// rank; nothing is published then; [`Status::Timeout`] naming the holder when another
    /// job's save held the root's save lock for half the timeout). A save while another is
    /// in flight first waits
    /// for it (one host sync). Errors: [`Status::InvalidArgument`] (name, metadata, a NUL
    /// in them), [`Status::AlreadyExists`] (that name exists),
    /// [`Status::FailedPrecondition`] (the engine has no state yet, or another engine was
    /// swapped in through [`Checkpoint::engine`]).
    pub fn save(&mut self, name: &str, metadata: &[(&str, &str)]) -> Result<Work<'static>> {
        self.check_own_engine("save")?;
        let c_name = c_string("checkpoint name", name)?;
        let mut keys: Vec<CString> = Vec::with_capacity(metadata.len());
        let mut values: Vec<CString> = Vec::with_capacity(metadata.len());
        for &(key, value) in metadata.iter() {
            keys.push(c_string("metadata key", key)?);
            values.push(c_string("metadata value", value)?);
        }
        let key_ptrs: Vec<*const std::os::raw::c_char> = keys.iter().map(|k| k.as_ptr()).collect();
        let value_ptrs: Vec<*const std::os::raw::c_char> =
            values.iter().map(|v| v.as_ptr()).collect();
        let mut work: *mut sys::hps_work_t = ptr::null_mut();
        // SAFETY: live handles, this thread only (the engine is borrowed mutably); the
        // strings live during the call (copied); out-param live.
        check(unsafe {
            sys::hps_checkpoint_save(
                self.raw.as_ptr(),
                c_name.as_ptr(),
                key_ptrs.as_ptr(),
                value_ptrs.as_ptr(),
                metadata.len(),
                &mut work,
            )
        })?;
        self.engine.snapshot_started();
        Work::from_raw(work, "hps_checkpoint_save")
    }

    /// Load checkpoint `root/name`, or the one `root/latest` names when `name` is `None`,
    /// into the engine, whatever sharding and dp degrees, stage and parameter dtypes wrote
    /// it (a part of a model cut across mp and pp loads only its own part's, and all
    /// parts load checkpoints of one name or none changes; with `None` and the parts'
    /// `latest` apart, the newest checkpoint every part holds) (`hps_checkpoint_load`). Collective, host-blocking; between steps (stage 3: after
    /// [`Engine::broadcast_parameters`]). Errors: [`Status::NotFound`] (no such
    /// checkpoint, a missing file), [`Status::InvalidArgument`] (corrupt, truncated or
    /// mismatched data, another model), [`Status::FailedPrecondition`] (in the middle of a
    /// step); no rank's engine changed then.
    pub fn load(&mut self, name: Option<&str>, options: LoadOptions) -> Result<()> {
        self.check_own_engine("load")?;
        let c_name = match name {
            Some(name) => Some(c_string("checkpoint name", name)?),
            None => None,
        };
        let raw_opts = options.to_raw()?;
        // SAFETY: live handles, this thread only (the engine is borrowed mutably, no view
        // exists); name NUL-terminated or NULL; options initialised.
        check(unsafe {
            sys::hps_checkpoint_load(
                self.raw.as_ptr(),
                c_name.as_ref().map_or(ptr::null(), |n| n.as_ptr()),
                raw_opts.as_ptr(),
            )
        })?;
        self.engine.state_loaded();
        Ok(())
    }

    /// Initialise the engine's parameters (and fp32 masters) from the safetensors file
    /// `path`, whose tensors carry the parameters' names; each rank reads only its shard;
    /// optimizer state and step counts stay (`hps_checkpoint_import_safetensors`).
    /// Collective, host-blocking; errors as [`Checkpoint::load`].
    pub fn import_safetensors(
        &mut self,
        path: impl AsRef<Path>,
        options: LoadOptions,
    ) -> Result<()> {
        self.check_own_engine("import_safetensors")?;
        let path = c_path("safetensors path", path.as_ref())?;
        let raw_opts = options.to_raw()?;
        // SAFETY: as in load.
        check(unsafe {
            sys::hps_checkpoint_import_safetensors(
                self.raw.as_ptr(),
                path.as_ptr(),
                raw_opts.as_ptr(),
            )
        })?;
        self.engine.state_loaded();
        Ok(())
    }

    /// The value of metadata `key` of the last successful load or import
    /// (`hps_checkpoint_metadata`; lossy UTF-8). Errors: [`Status::NotFound`] (no such
    /// key, or nothing loaded).
    pub fn metadata(&self, key: &str) -> Result<String> {
        let c_key = c_string("metadata key", key)?;
        let mut length: usize = 0;
        // SAFETY: live handle (not Sync: this thread only); NULL buffer of capacity 0
        // asks for the length; out-param live.
        check(unsafe {
            sys::hps_checkpoint_metadata(
                self.raw.as_ptr(),
                c_key.as_ptr(),
                ptr::null_mut(),
                0,
                &mut length,
            )
        })?;
        let mut buffer: Vec<u8> = vec![0; length + 1];
        // SAFETY: as above; `buffer` holds length + 1 bytes, the capacity passed.
        check(unsafe {
            sys::hps_checkpoint_metadata(
                self.raw.as_ptr(),
                c_key.as_ptr(),
                buffer.as_mut_ptr() as *mut std::os::raw::c_char,
                buffer.len(),
                &mut length,
            )
        })?;
        buffer.truncate(length);
        Ok(String::from_utf8_lossy(&buffer).into_owned())
    }

    /// Read the manifest of the checkpoint at `path` (a checkpoint directory, or a root
    /// whose `latest` is read), checking it but not the data (`hps_checkpoint_inspect`).
    /// Errors: [`Status::NotFound`], [`Status::InvalidArgument`].
    pub fn inspect(path: impl AsRef<Path>) -> Result<CheckpointInfo> {
        let path = c_path("checkpoint path", path.as_ref())?;
        // SAFETY: integers and char arrays; all-zero is valid.
        let mut info: sys::hps_checkpoint_info_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is live and has the size passed; path NUL-terminated.
        check(unsafe {
            sys::hps_checkpoint_info_init(
                &mut info,
                std::mem::size_of::<sys::hps_checkpoint_info_t>(),
            )
        })?;
        // SAFETY: as above.
        check(unsafe { sys::hps_checkpoint_inspect(path.as_ptr(), &mut info) })?;
        Ok(CheckpointInfo {
            name: c_text(&info.name),
            id: c_text(&info.id),
            format_version: info.format_version,
            stage: info.stage,
            sharding: info.sharding,
            dp: info.dp,
            world: info.world,
            files: info.files,
            tensors: info.tensors,
            bytes: info.bytes,
            created_unix_ns: info.created_unix_ns,
            mp: info.mp,
            mp_rank: info.mp_rank,
            pp: info.pp,
            pp_rank: info.pp_rank,
        })
    }

    /// Check every data file's header and size and every chunk's checksum of the
    /// checkpoint at `path` (`hps_checkpoint_verify`). Errors: [`Status::NotFound`],
    /// [`Status::InvalidArgument`] naming the file and tensor.
    pub fn verify(path: impl AsRef<Path>) -> Result<()> {
        let path = c_path("checkpoint path", path.as_ref())?;
        // SAFETY: NUL-terminated path.
        check(unsafe { sys::hps_checkpoint_verify(path.as_ptr()) })
    }

    /// The engine options the checkpoint at `path` was saved with (stage, optimizer and
    /// its hyperparameters, clipping, accumulation, alignment, prefetch window, loss
    /// scaling), every other field the library's default: give them to [`Engine::new`] to
    /// resume with the same engine (`hps_checkpoint_read_engine_options`).
    /// Errors: [`Status::NotFound`], [`Status::InvalidArgument`].
    pub fn read_engine_options(path: impl AsRef<Path>) -> Result<EngineOptions> {
        let path = c_path("checkpoint path", path.as_ref())?;
        let mut raw = raw_engine_options()?;
        // SAFETY: `raw` initialised with its size; path NUL-terminated.
        check(unsafe { sys::hps_checkpoint_read_engine_options(path.as_ptr(), &mut raw) })?;
        Ok(EngineOptions::from_raw(&raw))
    }

    /// Write the parameters of the checkpoint at `path` as one safetensors file `out`
    /// (replaced atomically), each under its own name, in its dtype or with `fp32` as
    /// float32 (from the fp32 masters where the checkpoint has them); every chunk read is
    /// checked (`hps_checkpoint_export_safetensors`). Errors: [`Status::NotFound`],
    /// [`Status::InvalidArgument`], [`Status::BackendError`].
    pub fn export_safetensors(
        path: impl AsRef<Path>,
        out: impl AsRef<Path>,
        fp32: bool,
    ) -> Result<()> {
        let path = c_path("checkpoint path", path.as_ref())?;
        let out = c_path("safetensors path", out.as_ref())?;
        // SAFETY: NUL-terminated paths.
        check(unsafe {
            sys::hps_checkpoint_export_safetensors(
                path.as_ptr(),
                out.as_ptr(),
                if fp32 { 1 } else { 0 },
            )
        })
    }
}

impl Drop for Checkpoint<'_, '_> {
    fn drop(&mut self) {
        // SAFETY: we own the handle; the engine is still borrowed (nothing else uses it).
        // The C function waits for a save in flight, then frees the handle.
        let _ = unsafe { sys::hps_checkpoint_destroy(self.raw.as_ptr()) };
    }
}

impl fmt::Debug for Checkpoint<'_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checkpoint")
            .field("raw", &self.raw)
            .finish()
    }
}
