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
    DType, DeviceType, Engine, EngineOptions, Error, Optimizer, ParamFlags, Status, Store, View,
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
/// refused once the unit is complete. (One unit: this library version advances its
/// micro-batch counter whenever every bucket is complete at once, which with several
/// units happens after each unit's check-in; the views follow the library.)
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
    assert_eq!(ParamFlags::ALL.bits(), 15);
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
    expect_status(engine.param(2), Status::OutOfRange);
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
        err.message
    });
    for message in results {
        assert!(message.contains("different"), "{}", message);
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
