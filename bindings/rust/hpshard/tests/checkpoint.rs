// Checkpoints through the safe crate, and the engine's bucket cap: a tiny model trained
// over thread-ranks, saved in the background, loaded into fresh engines of the same
// topology (resuming bitwise) and of other stages and sharding degrees; inspect, verify,
// the saved engine options, safetensors export and import, partial loads, bad input
// refused with nothing changed; the safe views following the library's buckets.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hpshard::{
    host_sync_count_thread, host_sync_reset, Checkpoint, CheckpointOptions, CommOptions,
    Communicator, DType, DeviceType, Engine, EngineOptions, Error, LoadOptions, Optimizer,
    ParamFlags, Status, Store, View,
};

mod common;

const COMM_TIMEOUT: Duration = Duration::from_secs(20);
const RANKS_DEADLINE: Duration = Duration::from_secs(90);

/// (name, shape, unit) in registration order.
const MODEL: [(&str, &[i64], i32); 4] = [
    ("w0", &[40, 5], 0),
    ("b0", &[5], 0),
    ("w1", &[5, 3], 1),
    ("b1", &[3], 1),
];

fn numel(p: usize) -> usize {
    MODEL[p].1.iter().product::<i64>() as usize
}

fn unique(tag: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "rust-ckpt-{}-{}-{}",
        tag,
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

/// A fresh directory under the system's temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(unique(tag));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn expect_status<T>(result: hpshard::Result<T>, status: Status) -> Error {
    match result {
        Ok(_) => panic!("the call should fail with {:?}", status),
        Err(err) => {
            assert_eq!(err.status, status, "{}", err);
            assert!(!err.message.is_empty(), "{:?}", err);
            err
        }
    }
}

fn run_ranks<F, R>(world: i32, tag: &str, f: F) -> Vec<R>
where
    F: Fn(i32, Communicator) -> R + Send + Sync + 'static,
    R: Send + 'static,
{
    let url = format!("memory://{}", unique(tag));
    common::run_ranks_on(url, world, tag, "world", COMM_TIMEOUT, RANKS_DEADLINE, f)
}

fn one_rank(tag: &str) -> Communicator {
    let store = Store::open(&format!("memory://{}", unique(tag)), 0, COMM_TIMEOUT).unwrap();
    let options = CommOptions::new().timeout(COMM_TIMEOUT).name("solo");
    Communicator::create(&store, 0, 1, DeviceType::CPU, 0, Some(options)).unwrap()
}

fn initial(p: usize, k: usize) -> f32 {
    (0.4 * (k as f64 * 0.61 + p as f64).sin()) as f32
}

/// The data's part of every rank's gradient: the same on every rank, so a mean over any
/// number of ranks is the same value and any topology trains the same model.
fn target(p: usize, k: usize, step: usize) -> f32 {
    (k as f64 * 0.23 + 1.3 * step as f64 + p as f64).cos() as f32
}

fn adamw(stage: i32) -> EngineOptions {
    EngineOptions::default()
        .stage(stage)
        .optimizer(Optimizer::ADAMW)
        .learning_rate(0.02)
        .weight_decay(0.01)
}

/// Register the model, seal, and broadcast rank 0's values (`fill`, or the initial ones).
fn build(engine: &mut Engine<'_>, rank: i32, model: &[(&str, &[i64], i32)], fill: Option<f32>) {
    for (p, &(name, shape, unit)) in model.iter().enumerate() {
        assert_eq!(
            engine
                .add_param(name, shape, DType::FLOAT32, ParamFlags::NONE, unit)
                .unwrap(),
            p
        );
    }
    engine.seal().unwrap();
    for p in 0..model.len() {
        for (k, x) in engine.param(p).unwrap().iter_mut().enumerate() {
            *x = match (rank, fill) {
                (0, Some(v)) => v,
                (0, None) => initial(p, k),
                _ => 0.0,
            };
        }
    }
    engine.broadcast_parameters().unwrap();
}

/// Steps first .. first+steps-1: gradients 0.3 * p + target, checked in one by one.
fn train(engine: &mut Engine<'_>, first: usize, steps: usize) {
    for step in first..first + steps {
        for p in (0..MODEL.len()).rev() {
            let [param, grad] = engine.views([View::Param(p), View::Grad(p)]).unwrap();
            for k in 0..param.len() {
                grad[k] += 0.3 * param[k] + target(p, k, step);
            }
            engine.grad_ready(p, None).unwrap();
        }
        engine.release_parameters(1).unwrap();
        engine.release_parameters(0).unwrap();
        engine.step().unwrap();
    }
}

fn gathered(engine: &mut Engine<'_>, count: usize) -> Vec<Vec<f32>> {
    (0..count)
        .map(|p| engine.gather_parameter(p).unwrap())
        .collect()
}

fn assert_close(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    for (p, (g, w)) in got.iter().zip(want.iter()).enumerate() {
        for (k, (&g, &w)) in g.iter().zip(w.iter()).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs() + 1e-7,
                "{} {}[{}]: {} vs {}",
                what,
                MODEL[p].0,
                k,
                g,
                w
            );
        }
    }
}

#[test]
fn options_and_defaults() {
    assert_eq!(
        CheckpointOptions::library_defaults().unwrap(),
        CheckpointOptions::default()
    );
    assert_eq!(EngineOptions::library_defaults().unwrap().bucket_bytes, 0);
    assert_eq!(LoadOptions::default().allow_partial, false);
}

#[test]
fn save_then_resume_in_the_same_and_other_topologies() {
    let dir = TempDir::new("resume");
    let root = dir.path().join("ckpt");
    let first_root = root.clone();
    let first = run_ranks(2, "first", move |rank, mut comm| {
        let mut engine = Engine::new(&mut comm, None, adamw(2)).unwrap();
        build(&mut engine, rank, &MODEL, None);
        let options = CheckpointOptions::default().keep_last(2);
        let mut ckpt = Checkpoint::new(&mut engine, None, &first_root, options).unwrap();
        train(ckpt.engine(), 0, 3);
        let at_save = gathered(ckpt.engine(), MODEL.len());
        host_sync_reset().unwrap();
        let work = ckpt
            .save("step-3", &[("step", "3"), ("loader", "epoch 0 batch 7")])
            .unwrap();
        let syncs_of_save = host_sync_count_thread().unwrap();
        // The steps overlap the writing. The first parameter view after the save waits
        // for its snapshot (Engine::synchronize: host syncs); the next step never blocks.
        host_sync_reset().unwrap();
        train(ckpt.engine(), 3, 1);
        let syncs_of_first_step = host_sync_count_thread().unwrap();
        host_sync_reset().unwrap();
        train(ckpt.engine(), 4, 1);
        let syncs_of_steps = (syncs_of_first_step, host_sync_count_thread().unwrap());
        work.wait().unwrap();
        assert!(work.test().unwrap());
        expect_status(ckpt.save("step-3", &[]), Status::AlreadyExists);
        let fin = gathered(ckpt.engine(), MODEL.len());
        (at_save, fin, syncs_of_save, syncs_of_steps)
    });
    let (at_save, fin, _, _) = &first[0];
    for (rank, (a, f, save_syncs, step_syncs)) in first.iter().enumerate() {
        assert_eq!(a, at_save, "rank {}", rank);
        assert_eq!(f, fin, "rank {}", rank);
        assert_eq!(*save_syncs, 0, "rank {}: host syncs in save()", rank);
        assert!(
            step_syncs.0 > 0,
            "rank {}: the view after the save waited",
            rank
        );
        assert_eq!(
            step_syncs.1, 0,
            "rank {}: host syncs in the next step",
            rank
        );
    }
    assert_ne!(at_save[0][0], initial(0, 0));

    let info = Checkpoint::inspect(&root).unwrap();
    assert_eq!(info.name, "step-3");
    assert_eq!((info.mp, info.mp_rank, info.pp, info.pp_rank), (1, 0, 1, 0));
    assert_eq!(info.id.len(), 32);
    assert_eq!(
        (
            info.format_version,
            info.stage,
            info.sharding,
            info.dp,
            info.world,
            info.files
        ),
        (1, 2, 2, 1, 2, 2)
    );
    assert_eq!(info.tensors, 3 * MODEL.len() as u64 + 4);
    let elements: usize = (0..MODEL.len()).map(numel).sum();
    assert_eq!(info.bytes, 3 * 4 * elements as u64 + 4 + 4 + 8 + 8);
    assert!(info.created_unix_ns > 0);
    Checkpoint::verify(&root).unwrap();
    Checkpoint::verify(root.join("step-3")).unwrap();
    let saved = Checkpoint::read_engine_options(&root).unwrap();
    assert_eq!(saved, adamw(2));

    for &(stage, world) in [(2, 2), (3, 4), (3, 1)].iter() {
        let root = root.clone();
        let resumed = run_ranks(world, "resume", move |rank, mut comm| {
            let options = Checkpoint::read_engine_options(&root).unwrap().stage(stage);
            let mut engine = Engine::new(&mut comm, None, options).unwrap();
            build(&mut engine, rank, &MODEL, Some(7.0));
            let mut ckpt =
                Checkpoint::new(&mut engine, None, &root, CheckpointOptions::default()).unwrap();
            expect_status(ckpt.metadata("step"), Status::NotFound);
            ckpt.load(None, LoadOptions::default()).unwrap();
            let step: usize = ckpt.metadata("step").unwrap().parse().unwrap();
            assert_eq!(ckpt.metadata("loader").unwrap(), "epoch 0 batch 7");
            let loaded = gathered(ckpt.engine(), MODEL.len());
            train(ckpt.engine(), step, 2);
            (loaded, gathered(ckpt.engine(), MODEL.len()))
        });
        for (loaded, after) in resumed.iter() {
            assert_eq!(loaded, at_save, "stage {} over {}: loaded", stage, world);
            if (stage, world) == (2, 2) {
                assert_eq!(after, fin, "the same topology resumes bitwise");
            } else {
                assert_close(&format!("stage {} over {}", stage, world), after, fin);
            }
        }
    }
}

#[test]
fn safetensors_partial_loads_and_bad_input() {
    let dir = TempDir::new("bad");
    let root = dir.path();
    let mut comm = one_rank("bad");
    let mut engine = Engine::new(&mut comm, None, adamw(2)).unwrap();
    build(&mut engine, 0, &MODEL, None);
    let mut ckpt = Checkpoint::new(&mut engine, None, root, CheckpointOptions::default()).unwrap();
    train(ckpt.engine(), 0, 1);
    let saved = gathered(ckpt.engine(), MODEL.len());
    for name in ["../escape", ".hidden", "", "a/b", "nul\0"].iter() {
        expect_status(ckpt.save(name, &[]), Status::InvalidArgument);
    }
    expect_status(ckpt.save("m", &[("k", "v\0")]), Status::InvalidArgument);
    ckpt.save("one", &[("step", "1")]).unwrap().wait().unwrap();
    expect_status(
        ckpt.load(Some("absent"), LoadOptions::default()),
        Status::NotFound,
    );
    // In the middle of a step: refused.
    ckpt.engine().grad(3).unwrap();
    ckpt.engine().grad_ready(3, None).unwrap();
    expect_status(
        ckpt.load(Some("one"), LoadOptions::default()),
        Status::FailedPrecondition,
    );
    for p in (0..3).rev() {
        ckpt.engine().grad_ready(p, None).unwrap();
    }
    ckpt.engine().release_parameters(1).unwrap();
    ckpt.engine().release_parameters(0).unwrap();
    ckpt.engine().step().unwrap();
    let after = gathered(ckpt.engine(), MODEL.len());
    // A flipped byte: verify names the file; a load changes nothing.
    let data = root.join("one").join("rank-00000.bin");
    let mut blob = std::fs::read(&data).unwrap();
    blob[200] ^= 0x40;
    std::fs::write(&data, &blob).unwrap();
    let err = expect_status(Checkpoint::verify(root), Status::InvalidArgument);
    assert!(err.message.contains("rank-00000.bin"), "{}", err);
    expect_status(
        ckpt.load(Some("one"), LoadOptions::default()),
        Status::InvalidArgument,
    );
    assert_eq!(gathered(ckpt.engine(), MODEL.len()), after);
    blob[200] ^= 0x40;
    std::fs::write(&data, &blob).unwrap();
    Checkpoint::verify(root.join("one")).unwrap();
    // The parameters as safetensors.
    let model = root.join("model.safetensors");
    Checkpoint::export_safetensors(root.join("one"), &model, true).unwrap();
    expect_status(
        Checkpoint::export_safetensors(root.join("none"), root.join("x"), false),
        Status::NotFound,
    );
    drop(ckpt);
    drop(engine);

    // Imported into a fresh stage-3 engine.
    let mut fresh = Engine::new(&mut comm, None, adamw(3)).unwrap();
    build(&mut fresh, 0, &MODEL, Some(-1.0));
    let mut imported = Checkpoint::new(
        &mut fresh,
        None,
        root.join("other"),
        CheckpointOptions::default(),
    )
    .unwrap();
    imported
        .import_safetensors(&model, LoadOptions::default())
        .unwrap();
    assert_eq!(gathered(imported.engine(), MODEL.len()), saved);
    assert_eq!(imported.metadata("step").unwrap(), "1");
    expect_status(
        imported.import_safetensors(root.join("absent"), LoadOptions::default()),
        Status::NotFound,
    );
    drop(imported);
    drop(fresh);

    // An engine without b1: refused naming it, unless partial.
    let mut smaller = Engine::new(&mut comm, None, adamw(2)).unwrap();
    build(&mut smaller, 0, &MODEL[..3], Some(0.0));
    let mut partial =
        Checkpoint::new(&mut smaller, None, root, CheckpointOptions::default()).unwrap();
    let err = expect_status(
        partial.load(Some("one"), LoadOptions::default()),
        Status::InvalidArgument,
    );
    assert!(err.message.contains("b1"), "{}", err);
    assert_eq!(partial.engine().gather_parameter(0).unwrap()[0], 0.0);
    partial
        .load(
            Some("one"),
            LoadOptions {
                allow_partial: true,
            },
        )
        .unwrap();
    assert_eq!(gathered(partial.engine(), 3), saved[..3].to_vec());
    drop(partial);
    drop(smaller);

    expect_status(Checkpoint::inspect(root.join("none")), Status::NotFound);
    expect_status(
        Checkpoint::read_engine_options(root.join("none")),
        Status::NotFound,
    );
}

#[test]
fn a_group_of_another_size_is_refused() {
    let dir = TempDir::new("group");
    let root = dir.path().to_path_buf();
    let statuses = run_ranks(2, "group", move |rank, mut comm| {
        let solo = one_rank("solo");
        let mut engine = Engine::new(&mut comm, None, adamw(2)).unwrap();
        build(&mut engine, rank, &MODEL, None);
        let result = Checkpoint::new(
            &mut engine,
            Some(&solo),
            root.join(format!("r{}", rank)),
            CheckpointOptions::default(),
        );
        result.map(|_| ()).unwrap_err().status
    });
    assert_eq!(statuses, vec![Status::InvalidArgument; 2]);
}

#[test]
fn bucket_bytes_cuts_units_and_the_views_follow() {
    // w0 (800 bytes) fills a 1024-byte bucket: b0 starts the next one.
    let results = run_ranks(2, "buckets", |rank, mut comm| {
        let mut out = Vec::new();
        for &cap in [0u64, 1024].iter() {
            let mut engine = Engine::new(&mut comm, None, adamw(2).bucket_bytes(cap)).unwrap();
            build(&mut engine, rank, &MODEL, None);
            let buckets: Vec<usize> = (0..MODEL.len())
                .map(|p| engine.param_bucket(p).unwrap())
                .collect();
            expect_status(engine.param_bucket(MODEL.len()), Status::OutOfRange);
            assert_eq!(cap > 0, buckets[0] != buckets[1]);
            assert_ne!(buckets[0], buckets[2]);
            // w0 checked in alone: with the cap its bucket is complete and reducing, so
            // its gradient is refused; b0's, in the next bucket, is still free. Without
            // the cap both are in one incomplete bucket.
            for p in (0..MODEL.len()).rev() {
                if p == 1 {
                    continue;
                }
                engine.grad_ready(p, None).unwrap();
            }
            if cap > 0 {
                expect_status(engine.grad(0), Status::FailedPrecondition);
            } else {
                engine.grad(0).unwrap();
            }
            engine.grad(1).unwrap();
            engine.grad_ready(1, None).unwrap();
            expect_status(engine.grad(1), Status::FailedPrecondition);
            engine.release_parameters(1).unwrap();
            engine.release_parameters(0).unwrap();
            engine.step().unwrap();
            train(&mut engine, 1, 2);
            out.push(gathered(&mut engine, MODEL.len()));
        }
        out
    });
    for r in results.iter() {
        assert_eq!(r[0], r[1], "the cap changes the buckets, not the training");
    }
}

#[test]
fn checkpoint_is_send() {
    fn assert_send<T: Send>() {}
    assert_send::<Checkpoint<'static, 'static>>();
}

#[test]
fn an_engine_swapped_in_through_engine_is_not_saved_or_loaded() {
    // Safe code can swap another engine into the checkpoint's `engine()`: its views would
    // not know of the save reading the checkpoint's own engine. Refused until it is back.
    let dir = TempDir::new("swap");
    let root = dir.path().to_path_buf();
    let mut comm = one_rank("swap-a");
    let mut other_comm = one_rank("swap-b");
    let mut engine = Engine::new(&mut comm, None, adamw(2)).unwrap();
    build(&mut engine, 0, &MODEL, None);
    let mut other = Engine::new(&mut other_comm, None, adamw(2)).unwrap();
    build(&mut other, 0, &MODEL, Some(1.0));
    let mut ckpt = Checkpoint::new(&mut engine, None, &root, CheckpointOptions::default()).unwrap();
    std::mem::swap(ckpt.engine(), &mut other);
    let refused = expect_status(ckpt.save("a", &[]), Status::FailedPrecondition);
    assert!(refused.message.contains("swapped"), "{}", refused.message);
    expect_status(
        ckpt.load(None, LoadOptions::default()),
        Status::FailedPrecondition,
    );
    assert!(!root.join("a").exists());
    std::mem::swap(ckpt.engine(), &mut other);
    ckpt.save("a", &[]).unwrap().wait().unwrap();
    ckpt.load(Some("a"), LoadOptions::default()).unwrap();
}
