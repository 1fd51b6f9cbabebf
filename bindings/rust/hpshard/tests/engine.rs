// The sharded training engine: one rank, and two thread-ranks over a
// "memory://<unique name>" store trained with SGD (plain, momentum + weight decay,
// Nesterov, gradient accumulation) beside an unsharded reference computed here. Every
// multi-rank test is bounded: communicators time out after COMM_TIMEOUT, and
// run_ranks fails the test when the ranks have not all finished within RANKS_DEADLINE.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hpshard::{
    dependency_wait_stats, host_sync_count_thread, host_sync_reset, CommOptions, Communicator,
    DType, DeviceType, Engine, EngineOptions, Error, Group, HybridGroup, Optimizer, ParamFlags,
    Status, Store, Topology, TypedView, View, BF16, F16,
};

const COMM_TIMEOUT: Duration = Duration::from_secs(20);
const RANKS_DEADLINE: Duration = Duration::from_secs(60);
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);
const WORLD: i32 = 2;
const STEPS: usize = 3;

mod common;

fn unique_url(tag: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "memory://rust-engine-{}-{}-{}",
        tag,
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

fn expect_status<T>(result: hpshard::Result<T>, status: Status) -> Error {
    let err = match result {
        Ok(_) => panic!("the call should fail with {:?}", status),
        Err(err) => err,
    };
    assert_eq!(err.status, status, "{}", err);
    assert!(!err.message.is_empty(), "{:?}", err);
    err
}

/// A communicator of one rank (its own store).
fn one_rank(tag: &str) -> Communicator {
    let store = Store::open(&unique_url(tag), 0, OPEN_TIMEOUT).unwrap();
    let options = CommOptions::new().timeout(COMM_TIMEOUT).name("solo");
    Communicator::create(&store, 0, 1, DeviceType::CPU, 0, Some(options)).unwrap()
}

#[test]
fn grad_norm_is_the_clips_norm_and_needs_clipping() {
    let mut comm = one_rank("grad-norm");
    {
        let mut plain = Engine::new(&mut comm, None, EngineOptions::default()).unwrap();
        plain
            .add_param("w", &[2], DType::FLOAT32, ParamFlags::NONE, 0)
            .unwrap();
        plain.seal().unwrap();
        expect_status(plain.grad_norm(), Status::FailedPrecondition);
        expect_status(plain.grad_norm_tensor(), Status::FailedPrecondition);
    }
    let options = EngineOptions::default()
        .clip_max_norm(1.0)
        .dynamic_loss_scaling(true)
        .initial_loss_scale(4.0);
    let mut engine = Engine::new(&mut comm, None, options).unwrap();
    let w = engine
        .add_param("w", &[4], DType::FLOAT32, ParamFlags::NONE, 0)
        .unwrap();
    expect_status(engine.grad_norm_ptr(), Status::FailedPrecondition);
    engine.seal().unwrap();
    engine.broadcast_parameters().unwrap();
    let ptr = engine.grad_norm_ptr().unwrap();
    assert_eq!(
        engine.grad_norm_tensor().unwrap().data_ptr() as *const f32,
        ptr
    );
    let mut norms = Vec::new();
    for grads in [
        [3.0f32, 4.0, 0.0, 0.0],
        [f32::INFINITY, 1.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 2.0],
    ] {
        engine.wait_parameters(0).unwrap();
        norms.push(engine.grad_norm().unwrap());
        let scale = engine.loss_scale().unwrap();
        for (g, x) in engine.grad(w).unwrap().iter_mut().zip(grads) {
            *g += x * scale;
        }
        engine.grad_ready(w, None).unwrap();
        engine.release_parameters(0).unwrap();
        engine.step().unwrap();
    }
    // Right after a step, stage 2's grad_norm waits for it first (as loss_scale does).
    norms.push(engine.grad_norm().unwrap());
    assert_eq!(norms[..3], [0.0, 5.0, f32::INFINITY]);
    assert_eq!(norms[3], 2.0);
}

/// Run `f(rank, communicator)` on WORLD thread-ranks; their results in rank order.
fn run_ranks<F, R>(tag: &str, f: F) -> Vec<R>
where
    F: Fn(i32, Communicator) -> R + Send + Sync + 'static,
    R: Send + 'static,
{
    common::run_ranks_on(
        unique_url(tag),
        WORLD,
        tag,
        "sharding",
        COMM_TIMEOUT,
        RANKS_DEADLINE,
        f,
    )
}

// ---------------------------------------------------------------------------------
// The model and the unsharded reference
// ---------------------------------------------------------------------------------

/// (name, shape, unit). w0 (150 elements) is split across the two shards of unit 0's
/// buffer (128 + 22 with the default 256-byte alignment); b0 and w1 are not.
const PARAMS: [(&str, &[i64], i32); 3] =
    [("w0", &[10, 15], 0), ("b0", &[15], 0), ("w1", &[15, 3], 1)];

fn numel(p: usize) -> usize {
    PARAMS[p].1.iter().product::<i64>() as usize
}

fn initial(p: usize, k: usize) -> f32 {
    (0.5 + 0.01 * k as f32) * if p % 2 == 0 { 1.0 } else { -1.0 }
}

/// The gradient rank `rank` adds for element `k` of parameter `p` in step `step`,
/// micro-batch `micro`.
fn gradient(rank: i32, step: usize, micro: usize, p: usize, k: usize) -> f32 {
    ((rank as f32) * 0.7
        + (step as f32) * 1.3
        + (micro as f32) * 0.4
        + (p as f32) * 0.9
        + (k as f32) * 0.11)
        .sin()
}

/// The parameters before each step and after the last (STEPS + 1 snapshots), trained
/// unsharded: the mean gradient over the ranks and micro-batches, then torch-style SGD
/// in the library's operation order (f32).
fn reference(options: &EngineOptions) -> Vec<Vec<Vec<f32>>> {
    let micro = options.accumulation_steps as usize;
    let mut params: Vec<Vec<f32>> = (0..PARAMS.len())
        .map(|p| (0..numel(p)).map(|k| initial(p, k)).collect())
        .collect();
    let mut momentum: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let mut snapshots = vec![params.clone()];
    let scale = 1.0f32 / (WORLD as usize * micro) as f32;
    for step in 0..STEPS {
        for p in 0..PARAMS.len() {
            for k in 0..numel(p) {
                // The reduction sums the accumulated gradients of the ranks.
                let mut sum = 0.0f32;
                for rank in 0..WORLD {
                    let mut acc = 0.0f32;
                    for m in 0..micro {
                        acc += gradient(rank, step, m, p, k);
                    }
                    sum += acc;
                }
                let param = params[p][k];
                let g = sum * scale + options.weight_decay * param;
                let update = if options.momentum == 0.0 {
                    g
                } else {
                    let b = if step == 0 {
                        g
                    } else {
                        options.momentum * momentum[p][k] + g
                    };
                    momentum[p][k] = b;
                    if options.nesterov {
                        g + options.momentum * b
                    } else {
                        b
                    }
                };
                params[p][k] = param - options.learning_rate * update;
            }
        }
        snapshots.push(params.clone());
    }
    snapshots
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{}", what);
    for (k, (&g, &w)) in got.iter().zip(want.iter()).enumerate() {
        let tolerance = 1e-6 * w.abs().max(1.0);
        assert!(
            (g - w).abs() <= tolerance,
            "{}[{}]: got {}, want {} (tolerance {})",
            what,
            k,
            g,
            w,
            tolerance
        );
    }
}

/// What one rank reports.
struct RankResult {
    ranges: Vec<Range<u64>>,
    resident: u64,
    final_params: Vec<Vec<f32>>,
    syncs_after_step: Vec<u64>,
}

/// One rank: register, seal, broadcast rank 0's values, train STEPS steps, comparing the
/// parameters with the reference before every step.
fn train_rank(rank: i32, comm: Communicator, options: EngineOptions) -> RankResult {
    let want = reference(&options);
    let micro = options.accumulation_steps as usize;
    let mut comm = comm;
    let mut engine = Engine::new(&mut comm, None, options).unwrap();
    let mut index = Vec::new();
    for &(name, shape, unit) in PARAMS.iter() {
        index.push(
            engine
                .add_param(name, shape, DType::FLOAT32, ParamFlags::NONE, unit)
                .unwrap(),
        );
    }
    assert_eq!(index, vec![0, 1, 2]);
    engine.seal().unwrap();
    assert!(engine.is_sealed());
    for p in 0..PARAMS.len() {
        assert_eq!(engine.numel(p), Some(numel(p)));
        assert_eq!(engine.unit_of(p), Some(PARAMS[p].2));
        let view = engine.param(p).unwrap();
        assert!(
            view.iter().all(|&x| x == 0.0),
            "sealed buffers are zero-filled"
        );
        for (k, x) in view.iter_mut().enumerate() {
            // Rank 1 writes garbage: the broadcast must replace it.
            *x = if rank == 0 { initial(p, k) } else { 99.0 };
        }
    }
    engine.broadcast_parameters().unwrap();
    let resident = engine.resident_bytes().unwrap();
    let ranges: Vec<Range<u64>> = (0..PARAMS.len())
        .map(|p| engine.shard_range(p).unwrap())
        .collect();

    let mut syncs_after_step = Vec::new();
    for step in 0..STEPS {
        host_sync_reset().unwrap();
        for p in 0..PARAMS.len() {
            let view = engine.param(p).unwrap();
            assert_close(
                &format!("rank {} step {} {}", rank, step, PARAMS[p].0),
                view,
                &want[step][p],
            );
        }
        for m in 0..micro {
            // "Backward": the gradients, last unit first, added into the views.
            for p in (0..PARAMS.len()).rev() {
                let g = engine.grad(p).unwrap();
                if m == 0 {
                    assert!(
                        g.iter().all(|&x| x == 0.0),
                        "rank {} step {}: gradient {} is not zero at the start of the step",
                        rank,
                        step,
                        PARAMS[p].0
                    );
                }
                for (k, x) in g.iter_mut().enumerate() {
                    *x += gradient(rank, step, m, p, k);
                }
                engine.grad_ready(p, None).unwrap();
                // In this order w1 completes unit 1, b0 leaves unit 0 incomplete, w0
                // completes it.
                let completes_unit = p != 1;
                if m + 1 == micro && completes_unit {
                    // The unit's reduction started: its gradients are off limits.
                    for q in 0..PARAMS.len() {
                        if PARAMS[q].2 == PARAMS[p].2 {
                            expect_status(engine.grad(q), Status::FailedPrecondition);
                        }
                    }
                } else {
                    // Nothing reads it yet (on an earlier micro-batch, nothing at all).
                    engine.grad(p).unwrap();
                }
                // The parameters stay readable during backward.
                engine.param(p).unwrap();
            }
        }
        // The protocol of the C API (stage 3 frees the gathered units; stage 2: no-op).
        for unit in [0, 1].iter() {
            engine.release_parameters(*unit).unwrap();
        }
        engine.step().unwrap();
        syncs_after_step.push(host_sync_count_thread().unwrap());
    }
    let final_params: Vec<Vec<f32>> = (0..PARAMS.len())
        .map(|p| engine.param(p).unwrap().to_vec())
        .collect();
    // The views waited (dependency waits), never host-synced.
    assert_eq!(host_sync_count_thread().unwrap(), 0);
    engine.synchronize().unwrap();
    // A host sync (counted at least once: also its inner stream and work waits).
    assert!(host_sync_count_thread().unwrap() >= 1);
    for p in 0..PARAMS.len() {
        assert!(engine.grad(p).unwrap().iter().all(|&x| x == 0.0));
    }
    RankResult {
        ranges,
        resident,
        final_params,
        syncs_after_step,
    }
}

fn train_and_compare(tag: &str, options: EngineOptions) {
    let want = reference(&options);
    let results = run_ranks(tag, move |rank, comm| train_rank(rank, comm, options));
    for (rank, r) in results.iter().enumerate() {
        assert!(
            r.resident > 0,
            "rank {}: resident_bytes {}",
            rank,
            r.resident
        );
        assert_eq!(
            r.syncs_after_step,
            vec![0; STEPS],
            "rank {}: host syncs",
            rank
        );
        for p in 0..PARAMS.len() {
            assert_close(
                &format!("rank {} final {}", rank, PARAMS[p].0),
                &r.final_params[p],
                &want[STEPS][p],
            );
        }
    }
    // Every element of every parameter belongs to exactly one rank's shard.
    let mut split = false;
    for p in 0..PARAMS.len() {
        let mut owners = vec![0u32; numel(p)];
        for r in results.iter() {
            let range = &r.ranges[p];
            assert!(
                range.start <= range.end && range.end <= numel(p) as u64,
                "{:?}",
                range
            );
            for k in range.start..range.end {
                owners[k as usize] += 1;
            }
            if range.start != range.end && range.end - range.start != numel(p) as u64 {
                split = true;
            }
        }
        assert!(
            owners.iter().all(|&n| n == 1),
            "{}: owners per element {:?}",
            PARAMS[p].0,
            owners
        );
    }
    assert!(split, "w0 should be split across the two shards");
}

// ---------------------------------------------------------------------------------
// Training over two thread-ranks
// ---------------------------------------------------------------------------------

#[test]
fn sgd_matches_the_unsharded_reference() {
    let (waits_before, _) = dependency_wait_stats().unwrap();
    train_and_compare("sgd", EngineOptions::default().learning_rate(0.1));
    let (waits_after, _) = dependency_wait_stats().unwrap();
    assert!(waits_after >= waits_before);
}

#[test]
fn stage_3_matches_the_reference() {
    train_and_compare(
        "stage3",
        EngineOptions::default()
            .stage(3)
            .learning_rate(0.05)
            .momentum(0.9),
    );
}

#[test]
fn sgd_momentum_and_weight_decay_match_the_reference() {
    train_and_compare(
        "momentum",
        EngineOptions::default()
            .learning_rate(0.05)
            .momentum(0.9)
            .weight_decay(0.01),
    );
}

#[test]
fn nesterov_matches_the_reference() {
    train_and_compare(
        "nesterov",
        EngineOptions::default()
            .learning_rate(0.05)
            .momentum(0.8)
            .nesterov(true),
    );
}

/// Gradient accumulation over a one-unit model (two parameters): on the first
/// micro-batch the gradient views stay writable after check-in; on the last, they are
/// refused once the unit is complete. (Several units and dtypes:
/// half_precision_accumulation_matches_the_reference.)
#[test]
fn gradient_accumulation_matches_the_reference() {
    const MICRO: usize = 2;
    const SIZES: [usize; 2] = [40, 30];
    let lr = 0.1f32;
    let grad = |rank: i32, step: usize, m: usize, p: usize, k: usize| -> f32 {
        gradient(rank, step, m, p, k)
    };
    // Reference: p -= lr * (sum over ranks and micro-batches) / (ranks * micro-batches).
    let mut want: Vec<Vec<f32>> = SIZES
        .iter()
        .enumerate()
        .map(|(p, &n)| (0..n).map(|k| initial(p, k)).collect())
        .collect();
    for step in 0..STEPS {
        for (p, values) in want.iter_mut().enumerate() {
            for (k, v) in values.iter_mut().enumerate() {
                let mut sum = 0.0f32;
                for rank in 0..WORLD {
                    let mut acc = 0.0f32;
                    for m in 0..MICRO {
                        acc += grad(rank, step, m, p, k);
                    }
                    sum += acc;
                }
                *v -= lr * (sum * (1.0 / (WORLD as usize * MICRO) as f32));
            }
        }
    }
    let options = EngineOptions::default()
        .learning_rate(lr)
        .accumulation_steps(MICRO as i32);
    let results = run_ranks("accumulation", move |rank, comm| {
        let mut comm = comm;
        let mut engine = Engine::new(&mut comm, None, options).unwrap();
        for (p, &n) in SIZES.iter().enumerate() {
            let name = format!("p{}", p);
            engine
                .add_param(&name, &[n as i64], DType::FLOAT32, ParamFlags::NONE, 0)
                .unwrap();
        }
        engine.seal().unwrap();
        for p in 0..SIZES.len() {
            for (k, x) in engine.param(p).unwrap().iter_mut().enumerate() {
                *x = initial(p, k);
            }
        }
        for step in 0..STEPS {
            for m in 0..MICRO {
                for p in (0..SIZES.len()).rev() {
                    for (k, x) in engine.grad(p).unwrap().iter_mut().enumerate() {
                        *x += grad(rank, step, m, p, k);
                    }
                    engine.grad_ready(p, None).unwrap();
                }
                if m + 1 < MICRO {
                    engine.grad(0).unwrap();
                    engine.grad(1).unwrap();
                } else {
                    expect_status(engine.grad(0), Status::FailedPrecondition);
                    expect_status(engine.grad(1), Status::FailedPrecondition);
                }
            }
            engine.step().unwrap();
        }
        (0..SIZES.len())
            .map(|p| engine.param(p).unwrap().to_vec())
            .collect::<Vec<Vec<f32>>>()
    });
    for (rank, params) in results.iter().enumerate() {
        for p in 0..SIZES.len() {
            assert_close(&format!("rank {} p{}", rank, p), &params[p], &want[p]);
        }
    }
}

// ---------------------------------------------------------------------------------
// Options, flags, types
// ---------------------------------------------------------------------------------

#[test]
fn options_defaults_match_the_library() {
    let defaults = EngineOptions::library_defaults().unwrap();
    assert_eq!(defaults, EngineOptions::default());
    assert_eq!(defaults.stage, 2);
    assert_eq!(defaults.optimizer, Optimizer::SGD);
    assert_eq!(defaults.accumulation_steps, 1);
    let o = EngineOptions::new()
        .optimizer(Optimizer::ADAMW)
        .learning_rate(1e-3)
        .beta1(0.8)
        .beta2(0.99)
        .epsilon(1e-6)
        .weight_decay(0.1)
        .clip_max_norm(1.0)
        .deterministic_clip(true)
        .alignment_bytes(64);
    assert_eq!(o.optimizer, Optimizer::ADAMW);
    assert_eq!((o.beta1, o.beta2, o.epsilon), (0.8, 0.99, 1e-6));
    assert!(o.deterministic_clip);
    assert_eq!(o.alignment_bytes, 64);
    assert_eq!(EngineOptions::new().prefetch_window(3).prefetch_window, 3);
    assert_eq!(format!("{:?}", Optimizer::from_raw(7)), "Optimizer(7)");
    assert_eq!(Optimizer::ADAMW.raw(), 1);
}

#[test]
fn flags_are_a_bit_set() {
    assert_eq!(ParamFlags::FROZEN.bits(), 1);
    assert_eq!(ParamFlags::DISTRIBUTED.bits(), 2);
    assert_eq!(ParamFlags::NO_CLIP.bits(), 4);
    assert_eq!(ParamFlags::SHARED_NOT_FIRST.bits(), 8);
    assert_eq!(ParamFlags::NO_WEIGHT_DECAY.bits(), 16);
    assert_eq!(ParamFlags::ALL.bits(), 31);
    assert_eq!(ParamFlags::default(), ParamFlags::NONE);
    let mut f = ParamFlags::FROZEN | ParamFlags::NO_CLIP;
    assert!(f.contains(ParamFlags::FROZEN) && !f.contains(ParamFlags::DISTRIBUTED));
    f |= ParamFlags::from_bits(0x100);
    assert_eq!(format!("{:?}", f), "ParamFlags(FROZEN | NO_CLIP | 0x100)");
    assert_eq!(format!("{:?}", ParamFlags::NONE), "ParamFlags(NONE)");
}

#[test]
fn engine_is_send() {
    fn is_send<T: Send>() {}
    is_send::<Engine<'static>>();
}

// ---------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------

#[test]
fn bad_stages_and_optimizers_are_invalid() {
    let mut comm = one_rank("stage");
    // This library version implements stage 3 (the brief's Unimplemented is gone).
    drop(Engine::new(&mut comm, None, EngineOptions::default().stage(3)).unwrap());
    expect_status(
        Engine::new(&mut comm, None, EngineOptions::default().stage(5)),
        Status::InvalidArgument,
    );
    expect_status(
        Engine::new(
            &mut comm,
            None,
            EngineOptions::default().optimizer(Optimizer::from_raw(9)),
        ),
        Status::InvalidArgument,
    );
    expect_status(
        Engine::new(
            &mut comm,
            None,
            EngineOptions::default().accumulation_steps(0),
        ),
        Status::InvalidArgument,
    );
}

#[test]
fn bad_registrations() {
    let mut comm = one_rank("register");
    let mut engine = Engine::new(&mut comm, None, EngineOptions::default()).unwrap();
    expect_status(
        engine.add_param("h", &[4], DType::FLOAT64, ParamFlags::NONE, 0),
        Status::Unimplemented,
    );
    expect_status(
        engine.add_param("x", &[4], DType::FLOAT32, ParamFlags::from_bits(0x100), 0),
        Status::InvalidArgument,
    );
    expect_status(
        engine.add_param("nul\0name", &[4], DType::FLOAT32, ParamFlags::NONE, 0),
        Status::InvalidArgument,
    );
    // Nothing registered yet.
    expect_status(engine.seal(), Status::FailedPrecondition);
    expect_status(engine.param(0), Status::FailedPrecondition);
    assert_eq!(
        engine
            .add_param("w", &[4], DType::FLOAT32, ParamFlags::NONE, 0)
            .unwrap(),
        0
    );
    expect_status(
        engine.add_param("w", &[4], DType::FLOAT32, ParamFlags::NONE, 0),
        Status::AlreadyExists,
    );
    assert_eq!(
        engine
            .add_param("frozen", &[2], DType::FLOAT32, ParamFlags::FROZEN, 1)
            .unwrap(),
        1
    );
    assert_eq!(engine.param_count(), 2);
    expect_status(engine.shard_range(0), Status::FailedPrecondition);
    engine.seal().unwrap();
    expect_status(engine.seal(), Status::FailedPrecondition);
    expect_status(
        engine.add_param("late", &[4], DType::FLOAT32, ParamFlags::NONE, 0),
        Status::FailedPrecondition,
    );
    assert_eq!(engine.shard_range(0).unwrap(), 0..4);
    expect_status(engine.shard_range(2), Status::OutOfRange);
    // Frozen: no gradient, no check-in; its parameter view exists.
    expect_status(engine.grad(1), Status::FailedPrecondition);
    expect_status(engine.grad_ready(1, None), Status::FailedPrecondition);
    engine.param(1).unwrap();
    // An unknown index: the error names the C function of the view asked for.
    let err = expect_status(engine.param(2), Status::OutOfRange);
    assert!(err.message.starts_with("hps_engine_param: "), "{}", err);
    let err = expect_status(engine.grad(2), Status::OutOfRange);
    assert!(err.message.starts_with("hps_engine_grad: "), "{}", err);
    let err = expect_status(
        engine.views([View::Param(0), View::Grad(2)]),
        Status::OutOfRange,
    );
    assert!(err.message.starts_with("hps_engine_grad: "), "{}", err);
    expect_status(engine.grad_ready(2, None), Status::OutOfRange);
    expect_status(
        engine.views([View::Param(0), View::Param(0)]),
        Status::InvalidArgument,
    );
    {
        let [p, g, f] = engine
            .views([View::Param(0), View::Grad(0), View::Param(1)])
            .unwrap();
        assert_eq!((p.len(), g.len(), f.len()), (4, 4, 2));
    }
    expect_status(engine.wait_parameters(7), Status::NotFound);
    engine.wait_parameters(1).unwrap();
    assert!(!engine.is_poisoned());
}

#[test]
fn step_before_backward_and_grad_ready_twice() {
    let mut comm = one_rank("order");
    let mut engine = Engine::new(&mut comm, None, EngineOptions::default()).unwrap();
    engine
        .add_param("a", &[3], DType::FLOAT32, ParamFlags::NONE, 0)
        .unwrap();
    engine
        .add_param("b", &[2], DType::FLOAT32, ParamFlags::NONE, 0)
        .unwrap();
    expect_status(engine.step(), Status::FailedPrecondition); // not sealed
    engine.seal().unwrap();
    expect_status(engine.step(), Status::FailedPrecondition); // no gradient checked in
    engine.grad(0).unwrap()[0] = 1.0;
    engine.grad_ready(0, None).unwrap();
    expect_status(engine.grad_ready(0, None), Status::FailedPrecondition);
    expect_status(engine.step(), Status::FailedPrecondition); // b has not checked in
    assert!(!engine.is_poisoned());
    engine.grad_ready(1, None).unwrap();
    engine.step().unwrap();
    let p = engine.param(0).unwrap();
    assert!((p[0] - (-0.01)).abs() < 1e-7, "{}", p[0]);
    assert_eq!(p[1], 0.0);
    assert_eq!(engine.grad(0).unwrap()[0], 0.0);
}

#[test]
fn different_registrations_fail_to_seal() {
    let results = run_ranks("mismatch", |rank, comm| {
        let mut comm = comm;
        let mut engine = Engine::new(&mut comm, None, EngineOptions::default()).unwrap();
        let shape: &[i64] = if rank == 0 { &[4] } else { &[5] };
        engine
            .add_param("w", shape, DType::FLOAT32, ParamFlags::NONE, 0)
            .unwrap();
        let err = expect_status(engine.seal(), Status::InvalidArgument);
        assert!(!engine.is_sealed());
        (rank, err.message)
    });
    for (rank, message) in results {
        // It names the parameter and what differs, with this rank's value.
        let mine = if rank == 0 { "[4]" } else { "[5]" };
        let says = format!(
            "its parameter 0 'w' has another shape than this rank's {}",
            mine
        );
        assert!(message.contains(&says), "{}", message);
    }
}

#[test]
fn the_ready_stream_is_accepted() {
    let mut comm = one_rank("ready");
    let stream = hpshard::Stream::new(DeviceType::CPU, 0).unwrap();
    let mut engine = Engine::new(&mut comm, None, EngineOptions::default()).unwrap();
    engine
        .add_param("a", &[3], DType::FLOAT32, ParamFlags::NONE, 0)
        .unwrap();
    engine.seal().unwrap();
    engine.grad(0).unwrap().copy_from_slice(&[1.0, 2.0, 3.0]);
    engine.grad_ready(0, Some(&stream)).unwrap();
    engine.step().unwrap();
    // The sharding communicator stays usable on this thread.
    assert_eq!(engine.sharding().size().unwrap(), 1);
    assert!(engine.dp().is_none());
    let p = engine.param(0).unwrap().to_vec();
    assert_close("a", &p, &[-0.01, -0.02, -0.03]);
}

// ---------------------------------------------------------------------------------
// Dynamic loss scaling
// ---------------------------------------------------------------------------------

const LS_STEPS: usize = 5;
const LS_N: usize = 5;
const LS_LR: f32 = 0.1;

fn ls_initial(k: usize) -> f32 {
    -1.0 + 0.5 * k as f32
}

fn ls_gradient(rank: i32, step: usize, k: usize) -> f32 {
    ((k as f64 * 0.4 + step as f64 * 0.9 + rank as f64 * 0.3).cos() * (rank as f64 + 1.0)) as f32
}

#[test]
fn loss_scaling_options_and_bad_backoff() {
    let o = EngineOptions::new()
        .dynamic_loss_scaling(true)
        .initial_loss_scale(1024.0)
        .growth_factor(4.0)
        .backoff_factor(0.25)
        .growth_interval(7);
    assert!(o.dynamic_loss_scaling);
    assert_eq!(
        (
            o.initial_loss_scale,
            o.growth_factor,
            o.backoff_factor,
            o.growth_interval
        ),
        (1024.0, 4.0, 0.25, 7)
    );
    let d = EngineOptions::default();
    assert!(!d.dynamic_loss_scaling);
    assert_eq!(
        (
            d.initial_loss_scale,
            d.growth_factor,
            d.backoff_factor,
            d.growth_interval
        ),
        (65536.0, 2.0, 0.5, 2000)
    );
    let mut comm = one_rank("loss-scale-bad");
    expect_status(
        Engine::new(
            &mut comm,
            None,
            EngineOptions::default()
                .dynamic_loss_scaling(true)
                .backoff_factor(1.5),
        ),
        Status::InvalidArgument,
    );
    // Without loss scaling the scale is 1 and nothing is skipped.
    let mut engine = Engine::new(&mut comm, None, EngineOptions::default()).unwrap();
    engine
        .add_param("w", &[2], DType::FLOAT32, ParamFlags::NONE, 0)
        .unwrap();
    engine.seal().unwrap();
    assert_eq!(engine.loss_scale().unwrap(), 1.0);
    assert_eq!(engine.skipped_steps().unwrap(), 0);
}

#[test]
fn two_ranks_dynamic_loss_scaling_skips_the_non_finite_step() {
    let results = run_ranks("loss-scale", |rank, mut comm| {
        expect_status(
            Engine::new(
                &mut comm,
                None,
                EngineOptions::default()
                    .dynamic_loss_scaling(true)
                    .backoff_factor(1.5),
            ),
            Status::InvalidArgument,
        );
        let options = EngineOptions::default()
            .learning_rate(LS_LR)
            .dynamic_loss_scaling(true)
            .initial_loss_scale(1024.0)
            .growth_interval(2);
        let mut engine = Engine::new(&mut comm, None, options).unwrap();
        let w = engine
            .add_param("w", &[LS_N as i64], DType::FLOAT32, ParamFlags::NONE, 0)
            .unwrap();
        engine.seal().unwrap();
        for (k, p) in engine.param(w).unwrap().iter_mut().enumerate() {
            *p = if rank == 0 { ls_initial(k) } else { 0.0 };
        }
        engine.broadcast_parameters().unwrap();
        let mut scales = Vec::new();
        for step in 0..LS_STEPS {
            engine.wait_parameters(0).unwrap();
            let scale = engine.loss_scale().unwrap();
            scales.push(scale);
            let g = engine.grad(w).unwrap();
            for (k, g) in g.iter_mut().enumerate() {
                *g += ls_gradient(rank, step, k) * scale;
            }
            if step == 1 && rank == 1 {
                g[0] = f32::INFINITY;
            }
            engine.grad_ready(w, None).unwrap();
            engine.release_parameters(0).unwrap();
            engine.step().unwrap();
        }
        // No explicit wait: the accessor waits for the last step's update itself.
        let skipped = engine.skipped_steps().unwrap();
        engine.synchronize().unwrap();
        let params = engine.param(w).unwrap().to_vec();
        (scales, skipped, params)
    });
    let mut reference: Vec<f32> = (0..LS_N).map(ls_initial).collect();
    for step in 0..LS_STEPS {
        if step == 1 {
            continue; // skipped on every rank
        }
        for (k, r) in reference.iter_mut().enumerate() {
            let mean = (ls_gradient(0, step, k) + ls_gradient(1, step, k)) / 2.0;
            *r -= LS_LR * mean;
        }
    }
    for (rank, (scales, skipped, params)) in results.iter().enumerate() {
        assert_eq!(
            scales,
            &vec![1024.0, 1024.0, 512.0, 512.0, 1024.0],
            "rank {}",
            rank
        );
        assert_eq!(*skipped, 1, "rank {}", rank);
        for (k, (&got, &want)) in params.iter().zip(reference.iter()).enumerate() {
            assert!(
                (got - want).abs() <= 1e-6 * want.abs() + 1e-7,
                "rank {} w[{}]: {} vs {}",
                rank,
                k,
                got,
                want
            );
        }
    }
}

#[test]
fn half_precision_parameters_have_no_safe_f32_view() {
    let mut comm = one_rank("half-views");
    let mut engine = Engine::new(&mut comm, None, EngineOptions::default()).unwrap();
    let h = engine
        .add_param("h", &[4], DType::BFLOAT16, ParamFlags::NONE, 0)
        .unwrap();
    engine.seal().unwrap();
    expect_status(engine.param(h), Status::FailedPrecondition);
    expect_status(engine.grad(h), Status::FailedPrecondition);
    // The raw address is there, holding four bfloat16 bit patterns (zero at seal).
    let p = engine.param_ptr(h).unwrap() as *const u16;
    assert!(!p.is_null());
    // SAFETY: sealed, single rank, nothing in flight; 4 u16 elements at p.
    let first = unsafe { *p };
    assert_eq!(first, 0);
}

#[test]
fn gather_parameter_gives_rank_0s_values_on_every_rank() {
    let initial: Vec<f32> = (0..5).map(|k| 0.5 + k as f32 * 1.25).collect();
    let want = initial.clone();
    let results = run_ranks("gather", move |rank, mut comm| {
        let mut engine = Engine::new(&mut comm, None, EngineOptions::default()).unwrap();
        let w = engine
            .add_param("w", &[5], DType::FLOAT32, ParamFlags::NONE, 0)
            .unwrap();
        expect_status(engine.gather_parameter(w), Status::FailedPrecondition); // not sealed
        engine.seal().unwrap();
        if rank == 0 {
            engine.param(w).unwrap().copy_from_slice(&initial);
        }
        engine.broadcast_parameters().unwrap();
        let gathered = engine.gather_parameter(w).unwrap();
        let err = expect_status(engine.gather_parameter(3), Status::OutOfRange);
        assert_eq!(err.status.code(), 2);
        assert!(!engine.is_poisoned());
        gathered
    });
    for (rank, got) in results.iter().enumerate() {
        assert_eq!(got, &want, "rank {}", rank);
    }
}

#[test]
fn a_learning_rate_schedule_applies_to_the_next_steps() {
    let mut comm = one_rank("schedule");
    let mut engine = Engine::new(&mut comm, None, EngineOptions::default()).unwrap();
    let w = engine
        .add_param("w", &[3], DType::FLOAT32, ParamFlags::NONE, 0)
        .unwrap();
    expect_status(engine.set_learning_rate(-1.0), Status::InvalidArgument);
    expect_status(engine.set_learning_rate(f32::NAN), Status::InvalidArgument);
    engine.seal().unwrap();
    engine.broadcast_parameters().unwrap();
    for rate in [0.5f32, 0.25, 0.0] {
        engine.set_learning_rate(rate).unwrap();
        engine.wait_parameters(0).unwrap();
        engine.grad(w).unwrap().fill(1.0);
        engine.grad_ready(w, None).unwrap();
        engine.release_parameters(0).unwrap();
        engine.step().unwrap();
    }
    // SGD from zero with a gradient of 1: -(0.5 + 0.25 + 0), exactly.
    assert_eq!(engine.gather_parameter(w).unwrap(), vec![-0.75f32; 3]);
}

#[test]
fn no_weight_decay_parameters_are_not_decayed() {
    let mut comm = one_rank("no-decay");
    let options = EngineOptions::default()
        .learning_rate(0.5)
        .weight_decay(0.5);
    let mut engine = Engine::new(&mut comm, None, options).unwrap();
    let w = engine
        .add_param("w", &[2], DType::FLOAT32, ParamFlags::NONE, 0)
        .unwrap();
    let b = engine
        .add_param("b", &[2], DType::FLOAT32, ParamFlags::NO_WEIGHT_DECAY, 0)
        .unwrap();
    engine.seal().unwrap();
    for i in [w, b] {
        engine.param(i).unwrap().fill(2.0);
    }
    engine.broadcast_parameters().unwrap();
    engine.wait_parameters(0).unwrap();
    for i in [w, b] {
        engine.grad(i).unwrap().fill(1.0);
        engine.grad_ready(i, None).unwrap();
    }
    engine.release_parameters(0).unwrap();
    engine.step().unwrap();
    // SGD: w - lr (g + wd w) = 2 - 0.5 (1 + 1) and b - lr g = 2 - 0.5, exactly.
    assert_eq!(engine.gather_parameter(w).unwrap(), vec![1.0f32; 2]);
    assert_eq!(engine.gather_parameter(b).unwrap(), vec![1.5f32; 2]);
}

// ---------------------------------------------------------------------------------
// float16 / bfloat16 parameters through the safe views
// ---------------------------------------------------------------------------------

/// (name, shape, dtype, unit): each unit mixes dtypes, so each has two buckets (one per
/// dtype) that the library reduces independently. w0 (150 float16 elements) is split
/// across the two shards of its buffer.
const HALF_PARAMS: [(&str, &[i64], DType, i32); 4] = [
    ("w0", &[10, 15], DType::FLOAT16, 0),
    ("b0", &[15], DType::FLOAT32, 0),
    ("w1", &[15, 3], DType::BFLOAT16, 1),
    ("b1", &[3], DType::FLOAT16, 1),
];
const HALF_STEPS: usize = 4;
const HALF_LR: f32 = 0.05;
const HALF_MOMENTUM: f32 = 0.9;

fn half_numel(p: usize) -> usize {
    HALF_PARAMS[p].1.iter().product::<i64>() as usize
}

/// A value rounded to parameter `p`'s dtype, as f32.
fn rounded(p: usize, x: f32) -> f32 {
    let dtype = HALF_PARAMS[p].2;
    if dtype == DType::FLOAT16 {
        F16::from_f32(x).to_f32()
    } else if dtype == DType::BFLOAT16 {
        BF16::from_f32(x).to_f32()
    } else {
        x
    }
}

/// The gradient a rank adds for element `k` of parameter `p`, given the parameter's
/// value as its view shows it (the "forward" reads the views).
fn half_gradient(rank: i32, step: usize, micro: usize, p: usize, k: usize, value: f32) -> f32 {
    gradient(rank, step, micro, p, k) + 0.5 * value
}

/// The tolerance the README states ("Tolerances"): fp16 4e-3 and bf16 2e-2 relative
/// plus 1e-3 absolute against an fp32 run on the dtype-rounded gradients; fp32 1e-6.
fn half_tolerance(p: usize, want: f32) -> f32 {
    let dtype = HALF_PARAMS[p].2;
    if dtype == DType::FLOAT16 {
        4e-3 * want.abs() + 1e-3
    } else if dtype == DType::BFLOAT16 {
        2e-2 * want.abs() + 1e-3
    } else {
        1e-6 * want.abs().max(1.0)
    }
}

fn assert_half_close(what: &str, p: usize, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{}", what);
    for (k, (&g, &w)) in got.iter().zip(want.iter()).enumerate() {
        let tolerance = half_tolerance(p, w);
        assert!(
            (g - w).abs() <= tolerance,
            "{}[{}] ({:?}): got {}, want {} (tolerance {})",
            what,
            k,
            HALF_PARAMS[p].2,
            g,
            w,
            tolerance
        );
    }
}

/// The unsharded fp32 reference: fp32 master weights starting from the dtype-rounded
/// initial values; each rank's gradient accumulated in the parameter's dtype (rounded
/// after every addition, as into the views), from the dtype-rounded parameters; the
/// mean over ranks and micro-batches in fp32; torch-style SGD with momentum in fp32.
/// The masters before each step and after the last (HALF_STEPS + 1 snapshots).
fn half_reference(micro: usize) -> Vec<Vec<Vec<f32>>> {
    let mut masters: Vec<Vec<f32>> = (0..HALF_PARAMS.len())
        .map(|p| {
            (0..half_numel(p))
                .map(|k| rounded(p, initial(p, k)))
                .collect()
        })
        .collect();
    let mut momentum: Vec<Vec<f32>> = masters.iter().map(|m| vec![0.0; m.len()]).collect();
    let mut snapshots = vec![masters.clone()];
    let scale = 1.0f32 / (WORLD as usize * micro) as f32;
    for step in 0..HALF_STEPS {
        for p in 0..HALF_PARAMS.len() {
            for k in 0..half_numel(p) {
                let value = rounded(p, masters[p][k]);
                let mut sum = 0.0f32;
                for rank in 0..WORLD {
                    let mut local = 0.0f32;
                    for m in 0..micro {
                        local = rounded(p, local + half_gradient(rank, step, m, p, k, value));
                    }
                    sum += local;
                }
                let g = sum * scale;
                let b = if step == 0 {
                    g
                } else {
                    HALF_MOMENTUM * momentum[p][k] + g
                };
                momentum[p][k] = b;
                masters[p][k] -= HALF_LR * b;
            }
        }
        snapshots.push(masters.clone());
    }
    snapshots
}

/// Parameter `p`'s view as f32 values (whatever its dtype), through the typed views.
fn read_param(engine: &mut Engine<'_>, p: usize) -> Vec<f32> {
    let dtype = HALF_PARAMS[p].2;
    if dtype == DType::FLOAT16 {
        engine
            .param_f16(p)
            .unwrap()
            .iter()
            .map(|x| x.to_f32())
            .collect()
    } else if dtype == DType::BFLOAT16 {
        engine
            .param_bf16(p)
            .unwrap()
            .iter()
            .map(|x| x.to_f32())
            .collect()
    } else {
        engine.param(p).unwrap().to_vec()
    }
}

/// Whether the gradient view of `p` is refused with FailedPrecondition.
fn grad_refused(engine: &mut Engine<'_>, p: usize) -> bool {
    let [view] = match engine.typed_views([View::Grad(p)]) {
        Ok(views) => views,
        Err(err) => {
            assert_eq!(err.status, Status::FailedPrecondition, "{}", err);
            return true;
        }
    };
    assert_eq!(view.len(), half_numel(p));
    false
}

/// What one rank of the half-precision training reports.
struct HalfRankResult {
    /// gather_parameter: the fp32 master weights (float32: the parameter).
    masters: Vec<Vec<f32>>,
    /// The views after the last step, as f32.
    views: Vec<Vec<f32>>,
    /// The views' bits after the last step (float16 / bfloat16 parameters).
    view_bits: Vec<Vec<u16>>,
    syncs_after_step: Vec<u64>,
}

fn train_half_rank(rank: i32, comm: Communicator, options: EngineOptions) -> HalfRankResult {
    let micro = options.accumulation_steps as usize;
    let want = half_reference(micro);
    let mut comm = comm;
    let mut engine = Engine::new(&mut comm, None, options).unwrap();
    for (p, &(name, shape, dtype, unit)) in HALF_PARAMS.iter().enumerate() {
        assert_eq!(
            engine
                .add_param(name, shape, dtype, ParamFlags::NONE, unit)
                .unwrap(),
            p
        );
        assert_eq!(engine.dtype(p), Some(dtype));
    }
    engine.seal().unwrap();
    // Rank 0's initial values, written through the typed views; rank 1 writes garbage,
    // which the broadcast replaces.
    for p in 0..HALF_PARAMS.len() {
        let [view] = engine.typed_views([View::Param(p)]).unwrap();
        assert_eq!(view.dtype(), HALF_PARAMS[p].2);
        let value = |k: usize| if rank == 0 { initial(p, k) } else { 99.0 };
        match view {
            TypedView::F32(v) => {
                for (k, x) in v.iter_mut().enumerate() {
                    *x = value(k);
                }
            }
            TypedView::F16(v) => {
                assert!(v.iter().all(|&x| x == F16::ZERO), "zero-filled");
                for (k, x) in v.iter_mut().enumerate() {
                    *x = F16::from_f32(value(k));
                }
            }
            TypedView::BF16(v) => {
                assert!(v.iter().all(|&x| x == BF16::ZERO), "zero-filled");
                for (k, x) in v.iter_mut().enumerate() {
                    *x = BF16::from_f32(value(k));
                }
            }
        }
    }
    engine.broadcast_parameters().unwrap();
    let mut syncs_after_step = Vec::new();
    for step in 0..HALF_STEPS {
        host_sync_reset().unwrap();
        // "Forward": read every parameter through its view.
        let values: Vec<Vec<f32>> = (0..HALF_PARAMS.len())
            .map(|p| read_param(&mut engine, p))
            .collect();
        for p in 0..HALF_PARAMS.len() {
            let want_view: Vec<f32> = want[step][p].iter().map(|&x| rounded(p, x)).collect();
            assert_half_close(
                &format!("rank {} step {} {}", rank, step, HALF_PARAMS[p].0),
                p,
                &values[p],
                &want_view,
            );
        }
        for m in 0..micro {
            let last = m + 1 == micro;
            // "Backward", last parameter first; each gradient added into its view in
            // the parameter's dtype (rounded after the addition).
            for p in (0..HALF_PARAMS.len()).rev() {
                let dg = |k: usize| half_gradient(rank, step, m, p, k, values[p][k]);
                let dtype = HALF_PARAMS[p].2;
                if dtype == DType::FLOAT16 {
                    let [g] = engine.views_as::<F16, 1>([View::Grad(p)]).unwrap();
                    for (k, x) in g.iter_mut().enumerate() {
                        if m == 0 {
                            assert_eq!(*x, F16::ZERO, "step {} {} not zeroed", step, p);
                        }
                        *x = F16::from_f32(x.to_f32() + dg(k));
                    }
                } else if dtype == DType::BFLOAT16 {
                    let g = engine.grad_bf16(p).unwrap();
                    for (k, x) in g.iter_mut().enumerate() {
                        if m == 0 {
                            assert_eq!(*x, BF16::ZERO, "step {} {} not zeroed", step, p);
                        }
                        *x = BF16::from_f32(x.to_f32() + dg(k));
                    }
                } else {
                    let g = engine.grad_as::<f32>(p).unwrap();
                    for (k, x) in g.iter_mut().enumerate() {
                        if m == 0 {
                            assert_eq!(*x, 0.0, "step {} {} not zeroed", step, p);
                        }
                        *x += dg(k);
                    }
                }
                engine.grad_ready(p, None).unwrap();
                // Each parameter is alone in its bucket (unit, dtype): on the last
                // micro-batch its check-in starts the bucket's reduction and only its
                // own gradient is refused; the other dtype's bucket of the same unit
                // stays writable until it checks in.
                for q in 0..HALF_PARAMS.len() {
                    let reducing = last && q >= p;
                    assert_eq!(
                        grad_refused(&mut engine, q),
                        reducing,
                        "step {} micro {} after {} checked in: gradient of {}",
                        step,
                        m,
                        HALF_PARAMS[p].0,
                        HALF_PARAMS[q].0
                    );
                }
                // The parameters stay readable during backward.
                engine.typed_views([View::Param(p)]).unwrap();
            }
        }
        for unit in [0, 1].iter() {
            engine.release_parameters(*unit).unwrap();
        }
        engine.step().unwrap();
        syncs_after_step.push(host_sync_count_thread().unwrap());
    }
    let views: Vec<Vec<f32>> = (0..HALF_PARAMS.len())
        .map(|p| read_param(&mut engine, p))
        .collect();
    let view_bits: Vec<Vec<u16>> = (0..HALF_PARAMS.len())
        .map(|p| {
            let [view] = engine.typed_views([View::Param(p)]).unwrap();
            match view {
                TypedView::F16(v) => F16::to_bits_slice(v).to_vec(),
                TypedView::BF16(v) => BF16::to_bits_slice(v).to_vec(),
                TypedView::F32(_) => Vec::new(),
            }
        })
        .collect();
    assert_eq!(host_sync_count_thread().unwrap(), 0);
    for unit in [0, 1].iter() {
        engine.release_parameters(*unit).unwrap();
    }
    // Collective, host-blocking: the fp32 masters of the half-precision parameters.
    let masters: Vec<Vec<f32>> = (0..HALF_PARAMS.len())
        .map(|p| engine.gather_parameter(p).unwrap())
        .collect();
    assert!(!engine.is_poisoned());
    HalfRankResult {
        masters,
        views,
        view_bits,
        syncs_after_step,
    }
}

fn train_half_and_compare(tag: &str, options: EngineOptions) {
    let want = half_reference(options.accumulation_steps as usize);
    let results = run_ranks(tag, move |rank, comm| train_half_rank(rank, comm, options));
    for (rank, r) in results.iter().enumerate() {
        assert_eq!(
            r.syncs_after_step,
            vec![0; HALF_STEPS],
            "rank {}: host syncs",
            rank
        );
        for p in 0..HALF_PARAMS.len() {
            let what = format!("rank {} final {}", rank, HALF_PARAMS[p].0);
            assert_half_close(&what, p, &r.masters[p], &want[HALF_STEPS][p]);
            let want_view: Vec<f32> = want[HALF_STEPS][p].iter().map(|&x| rounded(p, x)).collect();
            assert_half_close(&what, p, &r.views[p], &want_view);
            // The library rounded its masters into the parameters exactly as from_f32
            // rounds them here (core/common/half.h, bit for bit).
            let dtype = HALF_PARAMS[p].2;
            let mine: Vec<u16> = r.masters[p]
                .iter()
                .map(|&x| {
                    if dtype == DType::FLOAT16 {
                        F16::from_f32(x).to_bits()
                    } else {
                        BF16::from_f32(x).to_bits()
                    }
                })
                .collect();
            if dtype == DType::FLOAT32 {
                assert_eq!(r.views[p], r.masters[p], "{}", what);
            } else {
                assert_eq!(r.view_bits[p], mine, "{}: views vs rounded masters", what);
            }
        }
        // Both ranks hold the same parameters.
        assert_eq!(r.view_bits, results[0].view_bits, "rank {}", rank);
    }
}

#[test]
fn half_precision_parameters_match_the_reference() {
    train_half_and_compare(
        "half",
        EngineOptions::default()
            .learning_rate(HALF_LR)
            .momentum(HALF_MOMENTUM),
    );
}

#[test]
fn half_precision_parameters_stage_3_match_the_reference() {
    train_half_and_compare(
        "half-stage3",
        EngineOptions::default()
            .stage(3)
            .learning_rate(HALF_LR)
            .momentum(HALF_MOMENTUM),
    );
}

/// Accumulation over two units of two dtypes each: on the first micro-batch every
/// gradient stays writable after its check-in (the micro-batch ends only when every
/// bucket is complete); on the last, each bucket's gradients are refused from its own
/// completion.
#[test]
fn half_precision_accumulation_matches_the_reference() {
    train_half_and_compare(
        "half-accumulation",
        EngineOptions::default()
            .learning_rate(HALF_LR)
            .momentum(HALF_MOMENTUM)
            .accumulation_steps(2),
    );
}

#[test]
fn typed_views_refuse_other_dtypes() {
    let mut comm = one_rank("typed-views");
    let mut engine = Engine::new(&mut comm, None, EngineOptions::default()).unwrap();
    let f = engine
        .add_param("f", &[4], DType::FLOAT32, ParamFlags::NONE, 0)
        .unwrap();
    let h = engine
        .add_param("h", &[3], DType::FLOAT16, ParamFlags::NONE, 0)
        .unwrap();
    let b = engine
        .add_param("b", &[2], DType::BFLOAT16, ParamFlags::NONE, 1)
        .unwrap();
    let frozen = engine
        .add_param("frozen", &[5], DType::FLOAT16, ParamFlags::FROZEN, 1)
        .unwrap();
    assert_eq!(engine.dtype(h), Some(DType::FLOAT16));
    assert_eq!(engine.dtype(9), None);
    engine.seal().unwrap();
    // Every mismatch is refused, naming both dtypes and the parameter.
    let err = expect_status(engine.param(h), Status::FailedPrecondition);
    assert!(
        err.message.contains("'h'")
            && err.message.contains("float16")
            && err.message.contains("float32")
            && err.message.contains("param_f16"),
        "{}",
        err.message
    );
    let err = expect_status(engine.grad_bf16(h), Status::FailedPrecondition);
    assert!(
        err.message.contains("bfloat16") && err.message.contains("grad_f16"),
        "{}",
        err.message
    );
    let err = expect_status(engine.param_f16(f), Status::FailedPrecondition);
    assert!(
        err.message.contains("is float32, not float16"),
        "{}",
        err.message
    );
    expect_status(engine.param_f16(b), Status::FailedPrecondition);
    expect_status(engine.grad_f16(b), Status::FailedPrecondition);
    expect_status(engine.param_bf16(f), Status::FailedPrecondition);
    expect_status(
        engine.views_as::<F16, 2>([View::Param(h), View::Param(b)]),
        Status::FailedPrecondition,
    );
    expect_status(
        engine.views_as::<F16, 2>([View::Param(h), View::Param(h)]),
        Status::InvalidArgument,
    );
    expect_status(
        engine.typed_views([View::Grad(f), View::Grad(f)]),
        Status::InvalidArgument,
    );
    // Frozen: a parameter view, no gradient; unknown indices are out of range.
    assert_eq!(engine.param_f16(frozen).unwrap().len(), 5);
    expect_status(engine.grad_f16(frozen), Status::FailedPrecondition);
    let err = expect_status(engine.param_f16(7), Status::OutOfRange);
    assert!(err.message.starts_with("hps_engine_param: "), "{}", err);
    let err = expect_status(engine.grad_bf16(7), Status::OutOfRange);
    assert!(err.message.starts_with("hps_engine_grad: "), "{}", err);
    // The right types are handed out, together.
    {
        let [pf, ph, pb, gf, gh, gb] = engine
            .typed_views([
                View::Param(f),
                View::Param(h),
                View::Param(b),
                View::Grad(f),
                View::Grad(h),
                View::Grad(b),
            ])
            .unwrap();
        assert_eq!(
            [pf.dtype(), ph.dtype(), pb.dtype()],
            [DType::FLOAT32, DType::FLOAT16, DType::BFLOAT16]
        );
        assert_eq!((gf.len(), gh.len(), gb.len()), (4, 3, 2));
        assert!(!gb.is_empty());
        let pf: &mut [f32] = pf.into_slice().unwrap();
        let ph = ph.into_slice::<BF16>().unwrap_err(); // not bfloat16: the view back
        let ph: &mut [F16] = ph.into_slice().unwrap();
        let gh: &mut [F16] = gh.into_slice().unwrap();
        let gb: &mut [BF16] = gb.into_slice().unwrap();
        pf[0] = 1.5;
        ph[1] = F16::from_f32(-2.0);
        gh[2] = F16::ONE;
        gb[0] = BF16::from_f32(0.5);
    }
    // The initial values seed the fp32 master weights of h and b.
    engine.broadcast_parameters().unwrap();
    {
        let [ph, gh] = engine
            .views_as::<F16, 2>([View::Param(h), View::Grad(h)])
            .unwrap();
        assert_eq!(ph.to_vec(), vec![F16::ZERO, F16(0xc000), F16::ZERO]);
        assert_eq!(gh[2], F16::ONE);
    }
    assert_eq!(engine.param(f).unwrap()[0], 1.5);
    assert_eq!(engine.grad_bf16(b).unwrap()[0].to_f32(), 0.5);
    // The f32 views (and views) keep refusing half-precision parameters.
    expect_status(
        engine.views([View::Param(f), View::Param(b)]),
        Status::FailedPrecondition,
    );
    // One step (one rank, lr 0.01): h -= 0.01 * g, rounded to float16 from the master.
    for p in [f, h, b].iter() {
        engine.grad_ready(*p, None).unwrap();
    }
    // Each bucket refused once complete: f and h share unit 0 but not a bucket.
    expect_status(engine.grad_f16(h), Status::FailedPrecondition);
    expect_status(engine.grad(f), Status::FailedPrecondition);
    engine.step().unwrap();
    let ph = engine.param_f16(h).unwrap().to_vec();
    assert_eq!(ph[1], F16(0xc000));
    assert_eq!(ph[2], F16::from_f32(-0.01));
    assert_eq!(engine.grad_f16(h).unwrap().to_vec(), vec![F16::ZERO; 3]);
    assert!(!engine.is_poisoned());
}

// ---------------------------------------------------------------------------------
// The engine's device
// ---------------------------------------------------------------------------------

#[test]
fn engine_device_is_the_sharding_communicators() {
    // CPU communicators: CPU engines, whose safe views work (the refusal off the CPU is
    // tested in the crate's unit tests: a CUDA engine needs a GPU).
    let devices = run_ranks("device", |_, mut comm| {
        let comm_device = comm.device().unwrap();
        let engine = Engine::new(&mut comm, None, EngineOptions::default()).unwrap();
        assert_eq!(engine.device(), comm_device);
        assert!(!engine.sharding().transport().unwrap().is_empty());
        engine.device()
    });
    assert_eq!(devices, vec![(DeviceType::CPU, 0); WORLD as usize]);
}

/// Two ranks as mp 2 (sharding 1): w is DISTRIBUTED (rank r holds w[2r], w[2r+1] of
/// [1, 2, 3, 4]), b replicated ([5, 6] on both). With the mp group given to the engine its
/// clip norm is sqrt(91) on both ranks, so after one SGD step at lr 1 every parameter is
/// -grad / sqrt(91); a rank's own norm would give another coefficient. Also the refusals.
#[test]
fn two_ranks_engine_clip_spans_the_mp_group() {
    let results = run_ranks("mp-clip", |rank, comm| {
        let topology = Topology::new(1, 1, 1, 1, 2, WORLD, None).unwrap();
        let group = HybridGroup::create(&comm, &topology).unwrap();
        let mut sharding = group.comm(Group::SHARDING).unwrap();
        let mut mp = group.comm(Group::MP).unwrap();
        // Another mp communicator (a group hands out one handle per communicator at a time).
        let other_group = HybridGroup::create(&comm, &topology).unwrap();
        let mut other_mp = other_group.comm(Group::MP).unwrap();
        let options = EngineOptions::library_defaults()
            .unwrap()
            .learning_rate(1.0)
            .clip_max_norm(1.0);
        let mut engine = Engine::new(&mut sharding, None, options).unwrap();
        engine
            .set_model_parallel_groups(Some(&mut mp), None)
            .unwrap();
        let w = engine
            .add_param("w", &[2], DType::FLOAT32, ParamFlags::DISTRIBUTED, 0)
            .unwrap();
        let b = engine
            .add_param("b", &[2], DType::FLOAT32, ParamFlags::NONE, 0)
            .unwrap();
        engine.seal().unwrap();
        expect_status(
            engine.set_model_parallel_groups(Some(&mut other_mp), None),
            Status::FailedPrecondition,
        );
        engine.broadcast_parameters().unwrap();
        engine.wait_parameters(0).unwrap();
        let r = rank as f32;
        engine
            .grad(w)
            .unwrap()
            .copy_from_slice(&[1.0 + 2.0 * r, 2.0 + 2.0 * r]);
        engine.grad(b).unwrap().copy_from_slice(&[5.0, 6.0]);
        engine.grad_ready(w, None).unwrap();
        engine.grad_ready(b, None).unwrap();
        engine.release_parameters(0).unwrap();
        engine.step().unwrap();
        let mut got = engine.gather_parameter(w).unwrap();
        got.extend(engine.gather_parameter(b).unwrap());
        got
    });
    let coef = 1.0 / (91f64.sqrt() + 1e-6);
    for (rank, got) in results.iter().enumerate() {
        let r = rank as f64;
        let expect = [-(1.0 + 2.0 * r), -(2.0 + 2.0 * r), -5.0, -6.0];
        for (g, e) in got.iter().zip(expect.iter()) {
            assert!(
                (f64::from(*g) - e * coef).abs() < 1e-6,
                "rank {}: {:?}, expected {:?} x {}",
                rank,
                got,
                expect,
                coef
            );
        }
    }
}

/// Rank 1 leaves after its last batch; rank 0 has one more, whose step's collectives fail
/// asynchronously (nothing in the step waits). Dropping the engine ignored that failure
/// (the update missing, unseen); `close` returns it, and `how` = "drop" checks that a
/// dropped engine writes it to stderr, "drop-seen" that it does not once a call on the
/// engine on another thread has returned it (the program was told).
fn last_step_whose_peer_left(stage: i32, how: &'static str) -> Vec<String> {
    let stepped = std::sync::Arc::new(std::sync::Barrier::new(2));
    run_ranks(
        &format!("last-step-{}-{}", how, stage),
        move |rank, mut comm| {
            let mut engine = Engine::new(
                &mut comm,
                None,
                EngineOptions::default().learning_rate(0.5).stage(stage),
            )
            .unwrap();
            let w = engine
                .add_param("w", &[64], DType::FLOAT32, ParamFlags::NONE, 0)
                .unwrap();
            engine.seal().unwrap();
            engine.broadcast_parameters().unwrap();
            for _ in 0..(if rank == 0 { 3 } else { 2 }) {
                engine.wait_parameters(0).unwrap();
                engine.grad(w).unwrap().fill(1.0);
                engine.grad_ready(w, None).unwrap();
                engine.release_parameters(0).unwrap();
                engine.step().unwrap();
            }
            stepped.wait(); // rank 0's last step is in flight; rank 1 leaves
            if rank == 1 {
                return "left".to_string();
            }
            match how {
                "close" => match engine.close() {
                    Ok(()) => "closed".to_string(),
                    Err(err) => format!("close: {:?}", err.status),
                },
                "drop-seen" => {
                    let seen = std::thread::scope(|s| {
                        s.spawn(|| engine.synchronize().map_err(|e| e.status))
                            .join()
                            .unwrap()
                    });
                    drop(engine);
                    format!("dropped after {:?}", seen)
                }
                _ => {
                    drop(engine);
                    "dropped".to_string()
                }
            }
        },
    )
}

#[test]
fn close_returns_the_failure_of_a_last_step_whose_peer_left() {
    for stage in [2, 3] {
        assert_eq!(
            last_step_whose_peer_left(stage, "close"),
            ["close: Aborted", "left"],
            "stage {}",
            stage
        );
    }
}

#[test]
fn a_dropped_engine_with_failed_work_says_so() {
    const CHILD: &str = "HPS_TEST_DROPPED_ENGINE_CHILD";
    match std::env::var(CHILD).as_deref() {
        Ok("drop") => {
            assert_eq!(last_step_whose_peer_left(3, "drop"), ["dropped", "left"]);
            return;
        }
        Ok(_) => {
            assert_eq!(
                last_step_whose_peer_left(3, "drop-seen"),
                ["dropped after Err(Aborted)", "left"]
            );
            return;
        }
        Err(_) => {}
    }
    // The line goes to the process's stderr: run this test alone in a child process.
    for (how, says) in [("drop", true), ("drop-seen", false)] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "a_dropped_engine_with_failed_work_says_so",
                "--nocapture",
            ])
            .env(CHILD, how)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{}: {}", how, stderr);
        assert_eq!(
            stderr.contains("hpshard: an engine dropped with failed work in flight"),
            says,
            "{}: {}",
            how,
            stderr
        );
    }
}

/// A watchdog holds the engine's aborter while this thread trains through `&mut engine`
/// (an aborter taken from `engine.sharding()` borrows the engine and cannot be used so);
/// its abort ends the training loop with `Status::Aborted`, and the aborter may outlive
/// the engine.
#[test]
fn a_watchdog_aborts_an_engine_that_trains() {
    let mut comm = one_rank("watchdog");
    let aborter;
    {
        let mut engine = Engine::new(&mut comm, None, EngineOptions::default()).unwrap();
        engine
            .add_param("w", &[1024], DType::FLOAT32, ParamFlags::NONE, 0)
            .unwrap();
        engine.seal().unwrap();
        aborter = engine.aborter();
        let (stepped, go) = std::sync::mpsc::channel::<()>();
        let ended: Result<(), Error> = std::thread::scope(|t| {
            t.spawn(move || {
                go.recv().unwrap(); // training has begun
                aborter.abort().unwrap();
            });
            let mut steps = 0u64;
            loop {
                engine.grad(0)?[0] = 1.0;
                engine.grad_ready(0, None)?;
                engine.step()?;
                steps += 1;
                if steps == 3 {
                    stepped.send(()).unwrap();
                }
                if steps > 1_000_000 {
                    panic!("the abort never ended the training loop");
                }
            }
        });
        let err = ended.unwrap_err();
        assert_eq!(err.status, Status::Aborted, "{}", err);
    }
    aborter.abort().unwrap(); // the communicator outlives the engine, and so may the aborter
}
