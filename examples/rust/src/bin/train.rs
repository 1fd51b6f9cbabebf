//! Trains a 2-layer MLP (tanh hidden layer, mean squared error) with the sharded
//! training engine, stage 2, over two ranks that are threads meeting through a
//! memory:// store: forward and backward in plain Rust over the engine's views, each
//! rank on its half of the batch. Prints the loss per step beside an unsharded
//! single-thread reference and the host syncs per step; exits non-zero when a loss
//! differs from the reference by more than 1e-4 relative.
use std::time::Duration;

use hpshard::{
    CommOptions, Communicator, DType, DeviceType, Engine, EngineOptions, ParamFlags, Store, View,
};

const WORLD: usize = 2;
const BATCH: usize = 16; // global batch, split evenly over the ranks
const IN: usize = 6;
const HIDDEN: usize = 12;
const OUT: usize = 3;
const STEPS: usize = 8;
const LR: f32 = 0.1;
const MOMENTUM: f32 = 0.9;

/// The parameters: w1 [IN, HIDDEN], b1 [HIDDEN] (unit 0), w2 [HIDDEN, OUT], b2 [OUT]
/// (unit 1).
#[derive(Clone)]
struct Mlp {
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
}

fn initial_mlp() -> Mlp {
    let v = |n: usize, seed: f32, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32) * 0.37 + seed).sin() * scale)
            .collect()
    };
    Mlp {
        w1: v(IN * HIDDEN, 0.1, 0.5),
        b1: v(HIDDEN, 1.7, 0.1),
        w2: v(HIDDEN * OUT, 2.3, 0.5),
        b2: v(OUT, 3.1, 0.1),
    }
}

/// Sample `n` of the data set: an input and a target that is a smooth function of it.
fn sample(n: usize) -> ([f32; IN], [f32; OUT]) {
    let mut x = [0.0f32; IN];
    for (i, v) in x.iter_mut().enumerate() {
        *v = ((n * IN + i) as f32 * 0.71).sin();
    }
    let mut y = [0.0f32; OUT];
    for (o, v) in y.iter_mut().enumerate() {
        *v = (x[o] + 0.5 * x[o + 3]).tanh() - 0.2 * x[(o + 1) % IN];
    }
    (x, y)
}

/// Forward and backward over `samples` of batch `step`: returns the mean loss over
/// them and adds d(mean loss)/d(parameter) into the gradients.
#[allow(clippy::too_many_arguments)]
fn forward_backward(
    w1: &[f32],
    b1: &[f32],
    w2: &[f32],
    b2: &[f32],
    gw1: &mut [f32],
    gb1: &mut [f32],
    gw2: &mut [f32],
    gb2: &mut [f32],
    samples: std::ops::Range<usize>,
    step: usize,
) -> f32 {
    let count = samples.len() as f32;
    let mut loss = 0.0f32;
    for n in samples {
        let (x, y) = sample(step * BATCH + n);
        let mut h = [0.0f32; HIDDEN];
        for (j, hj) in h.iter_mut().enumerate() {
            let mut z = b1[j];
            for i in 0..IN {
                z += x[i] * w1[i * HIDDEN + j];
            }
            *hj = z.tanh();
        }
        let mut dy = [0.0f32; OUT];
        for o in 0..OUT {
            let mut out = b2[o];
            for j in 0..HIDDEN {
                out += h[j] * w2[j * OUT + o];
            }
            let err = out - y[o];
            loss += err * err / (OUT as f32 * count);
            dy[o] = 2.0 * err / (OUT as f32 * count);
        }
        let mut dh = [0.0f32; HIDDEN];
        for j in 0..HIDDEN {
            for o in 0..OUT {
                gw2[j * OUT + o] += h[j] * dy[o];
                dh[j] += w2[j * OUT + o] * dy[o];
            }
        }
        for (o, g) in gb2.iter_mut().enumerate() {
            *g += dy[o];
        }
        for j in 0..HIDDEN {
            let dz = dh[j] * (1.0 - h[j] * h[j]);
            gb1[j] += dz;
            for i in 0..IN {
                gw1[i * HIDDEN + j] += x[i] * dz;
            }
        }
    }
    loss
}

/// The unsharded reference: one thread, the whole batch, torch-style SGD with momentum.
fn reference_losses() -> Vec<f32> {
    let mut m = initial_mlp();
    let mut buffers = [
        vec![0.0f32; m.w1.len()],
        vec![0.0f32; m.b1.len()],
        vec![0.0f32; m.w2.len()],
        vec![0.0f32; m.b2.len()],
    ];
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let mut g = [
            vec![0.0f32; m.w1.len()],
            vec![0.0f32; m.b1.len()],
            vec![0.0f32; m.w2.len()],
            vec![0.0f32; m.b2.len()],
        ];
        let [gw1, gb1, gw2, gb2] = &mut g;
        losses.push(forward_backward(
            &m.w1,
            &m.b1,
            &m.w2,
            &m.b2,
            gw1,
            gb1,
            gw2,
            gb2,
            0..BATCH,
            step,
        ));
        let params = [&mut m.w1, &mut m.b1, &mut m.w2, &mut m.b2];
        for (p, param) in params.into_iter().enumerate() {
            for k in 0..param.len() {
                let b = if step == 0 {
                    g[p][k]
                } else {
                    MOMENTUM * buffers[p][k] + g[p][k]
                };
                buffers[p][k] = b;
                param[k] -= LR * b;
            }
        }
    }
    losses
}

/// One rank: (loss on its half of the batch, host syncs of the step) per step.
fn rank_main(rank: usize, url: &str) -> hpshard::Result<Vec<(f32, u64)>> {
    let store = Store::open(url, rank as i32, Duration::from_secs(10))?;
    let options = CommOptions::new()
        .timeout(Duration::from_secs(30))
        .name("sharding");
    let mut comm = Communicator::create(
        &store,
        rank as i32,
        WORLD as i32,
        DeviceType::CPU,
        0,
        Some(options),
    )?;
    let options = EngineOptions::default()
        .learning_rate(LR)
        .momentum(MOMENTUM);
    let mut engine = Engine::new(&mut comm, None, options)?;
    let f = DType::FLOAT32;
    let none = ParamFlags::NONE;
    let w1 = engine.add_param("w1", &[IN as i64, HIDDEN as i64], f, none, 0)?;
    let b1 = engine.add_param("b1", &[HIDDEN as i64], f, none, 0)?;
    let w2 = engine.add_param("w2", &[HIDDEN as i64, OUT as i64], f, none, 1)?;
    let b2 = engine.add_param("b2", &[OUT as i64], f, none, 1)?;
    engine.seal()?;
    if rank == 0 {
        let m = initial_mlp();
        engine.param(w1)?.copy_from_slice(&m.w1);
        engine.param(b1)?.copy_from_slice(&m.b1);
        engine.param(w2)?.copy_from_slice(&m.w2);
        engine.param(b2)?.copy_from_slice(&m.b2);
    }
    engine.broadcast_parameters()?; // rank 0's initial values everywhere
    let local = BATCH / WORLD;
    let mut per_step = Vec::new();
    for step in 0..STEPS {
        hpshard::host_sync_reset()?;
        // The views wait for the last step's all-gathers (dependency waits, not host
        // syncs); the gradient views are zero at the start of the step.
        let loss = {
            let [pw1, pb1, pw2, pb2, gw1, gb1, gw2, gb2] = engine.views([
                View::Param(w1),
                View::Param(b1),
                View::Param(w2),
                View::Param(b2),
                View::Grad(w1),
                View::Grad(b1),
                View::Grad(w2),
                View::Grad(b2),
            ])?;
            forward_backward(
                pw1,
                pb1,
                pw2,
                pb2,
                gw1,
                gb1,
                gw2,
                gb2,
                rank * local..(rank + 1) * local,
                step,
            )
        };
        // Check in, last layer first: unit 1's reduction starts while unit 0 checks in.
        for &index in [b2, w2, b1, w1].iter() {
            engine.grad_ready(index, None)?;
        }
        engine.step()?; // returns at once
        per_step.push((loss, hpshard::host_sync_count_thread()?));
    }
    engine.synchronize()?;
    Ok(per_step)
}

fn main() {
    let url = format!("memory://rust-train-{}", std::process::id());
    let results: Vec<hpshard::Result<Vec<(f32, u64)>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..WORLD)
            .map(|rank| {
                let url = url.clone();
                s.spawn(move || rank_main(rank, &url))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    });
    let mut ranks = Vec::new();
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Ok(r) => ranks.push(r),
            Err(err) => {
                eprintln!("rank {}: {}", rank, err);
                std::process::exit(1);
            }
        }
    }
    let reference = reference_losses();
    println!(
        "hpshard {} (rust): 2-layer MLP, stage 2 over {} thread-ranks, SGD lr={} momentum={}",
        hpshard::version(),
        WORLD,
        LR,
        MOMENTUM
    );
    println!("step  loss(sharded)  loss(reference)  rel.diff  host syncs/step");
    let mut ok = true;
    for step in 0..STEPS {
        // Equal halves of the batch: the global mean loss is the mean of the ranks'.
        let sharded = ranks.iter().map(|r| r[step].0).sum::<f32>() / WORLD as f32;
        let syncs = ranks.iter().map(|r| r[step].1).max().unwrap_or(0);
        let want = reference[step];
        let diff = ((sharded - want) / want.abs().max(1e-12)).abs();
        let good = diff <= 1e-4;
        ok &= good;
        println!(
            "{:4}  {:13.7}  {:15.7}  {:8.1e}  {}{}",
            step,
            sharded,
            want,
            diff,
            syncs,
            if good { "" } else { "  MISMATCH" }
        );
    }
    let (waits, blocked) = hpshard::dependency_wait_stats().unwrap_or((0, Duration::ZERO));
    println!("dependency waits: {} ({:?} blocked)", waits, blocked);
    if reference[STEPS - 1] >= reference[0] {
        println!("the loss did not decrease");
        ok = false;
    }
    println!("equal={}", ok);
    if !ok {
        std::process::exit(1);
    }
}
