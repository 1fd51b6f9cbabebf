// Hybrid global-norm clipping: one rank without groups, and two thread-ranks forming
// an mp group over a "memory://<unique name>" store. Every multi-rank test is bounded:
// communicators time out after COMM_TIMEOUT, and run_ranks fails the test when the
// ranks have not all finished within RANKS_DEADLINE.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hpshard::{
    host_sync_count_thread, Clip, ClipFlags, ClipOptions, Communicator, DeviceType, Error, Status,
    Stream, BF16, F16,
};

const COMM_TIMEOUT: Duration = Duration::from_secs(20);
const RANKS_DEADLINE: Duration = Duration::from_secs(60);

mod common;

/// 1 / (5 + 1e-6): the coefficient for a norm of 5 and max_norm 1.
const COEF_5: f64 = 1.0 / 5.000001;

fn unique_url(tag: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "memory://rust-clip-{}-{}-{}",
        tag,
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

fn expect_status<T: std::fmt::Debug>(result: hpshard::Result<T>, status: Status) -> Error {
    let err = result.expect_err("the call should fail");
    assert_eq!(err.status, status, "{}", err);
    assert!(!err.message.is_empty(), "{:?}", err);
    err
}

fn cpu_stream() -> Stream {
    Stream::new(DeviceType::CPU, 0).unwrap()
}

fn close(a: f32, b: f64) -> bool {
    (a as f64 - b).abs() <= 1e-6 * b.abs().max(1.0)
}

/// The coefficient the clip holds, read after a synchronised run.
fn coefficient(clip: &Clip<'_>) -> f32 {
    let p = clip.coefficient_ptr().unwrap();
    assert!(!p.is_null());
    // SAFETY: host memory owned by the clip (CPU clip); every run was synchronised.
    unsafe { *p }
}

// ---------------------------------------------------------------------------------
// Options and flags
// ---------------------------------------------------------------------------------

#[test]
fn options_defaults_match_the_library() {
    let defaults = ClipOptions::library_defaults().unwrap();
    assert_eq!(defaults, ClipOptions::default());
    assert_eq!(defaults.max_norm, 1.0);
    assert!(!defaults.deterministic);
    let o = ClipOptions::new(2.5).deterministic(true);
    assert_eq!(o.max_norm, 2.5);
    assert!(o.deterministic);
}

#[test]
fn flags_are_a_bit_set() {
    assert_eq!(ClipFlags::DISTRIBUTED.bits(), 1);
    assert_eq!(ClipFlags::NO_CLIP.bits(), 2);
    assert_eq!(ClipFlags::SHARED_NOT_FIRST.bits(), 4);
    assert_eq!(ClipFlags::ALL.bits(), 7);
    assert!(ClipFlags::NONE.is_empty());
    assert_eq!(ClipFlags::default(), ClipFlags::NONE);
    let mut f = ClipFlags::DISTRIBUTED | ClipFlags::SHARED_NOT_FIRST;
    assert!(f.contains(ClipFlags::DISTRIBUTED));
    assert!(!f.contains(ClipFlags::NO_CLIP));
    f |= ClipFlags::NO_CLIP;
    assert_eq!(f, ClipFlags::ALL);
    assert_eq!(
        format!("{:?}", ClipFlags::DISTRIBUTED | ClipFlags::from_bits(0x40)),
        "ClipFlags(DISTRIBUTED | 0x40)"
    );
    assert_eq!(format!("{:?}", ClipFlags::NONE), "ClipFlags(NONE)");
    assert_eq!(ClipFlags::from_bits(0x40).bits(), 0x40);
}

// ---------------------------------------------------------------------------------
// One rank, no groups
// ---------------------------------------------------------------------------------

#[test]
fn single_rank_norm_scale_no_clip_and_shared_not_first() {
    let stream = cpu_stream();
    let mut grads = [3.0f32, 4.0];
    let mut frozen = [100.0f32, 100.0];
    let mut shared = [7.0f64];
    let norm;
    let coef;
    {
        let mut clip = Clip::new(None, None, None, ClipOptions::new(1.0)).unwrap();
        clip.add_tensor(&mut grads, ClipFlags::NONE).unwrap();
        clip.add_tensor(&mut frozen, ClipFlags::NO_CLIP).unwrap();
        clip.add_tensor(&mut shared, ClipFlags::SHARED_NOT_FIRST)
            .unwrap();
        assert_eq!(clip.tensor_count(), 3);
        assert!(!clip.is_sealed());
        clip.seal().unwrap();
        assert!(clip.is_sealed());
        // Before any run the coefficient is 1.
        assert_eq!(coefficient(&clip), 1.0);
        let before = host_sync_count_thread().unwrap();
        norm = clip.run(&stream, true).unwrap();
        // The safe run pays exactly one host sync: the stream synchronisation.
        assert_eq!(host_sync_count_thread().unwrap() - before, 1);
        coef = coefficient(&clip);
    }
    // SHARED_NOT_FIRST is not counted (7 would make it sqrt(74)), NO_CLIP neither.
    assert!((norm - 5.0).abs() < 1e-6, "norm {}", norm);
    assert!(close(coef, COEF_5), "coefficient {}", coef);
    assert!(close(grads[0], 3.0 * COEF_5), "{:?}", grads);
    assert!(close(grads[1], 4.0 * COEF_5), "{:?}", grads);
    assert_eq!(frozen, [100.0, 100.0]);
    // ... but SHARED_NOT_FIRST is scaled.
    assert!((shared[0] - 7.0 * COEF_5).abs() < 1e-12, "{:?}", shared);
}

#[test]
fn norm_below_max_norm_and_scale_false() {
    let stream = cpu_stream();
    let mut grads = [3.0f32, 4.0];
    {
        let mut clip = Clip::new(None, None, None, ClipOptions::new(1.0)).unwrap();
        clip.add_tensor(&mut grads, ClipFlags::NONE).unwrap();
        clip.seal().unwrap();
        // scale = false: the norm and the coefficient only.
        let norm = clip.run(&stream, false).unwrap();
        assert!((norm - 5.0).abs() < 1e-6);
        assert!(close(coefficient(&clip), COEF_5));
    }
    assert_eq!(grads, [3.0, 4.0]);
    {
        // max_norm 10 > 5: coef = 10 / (10 + 1e-6), practically 1.
        let mut clip = Clip::new(None, None, None, ClipOptions::new(10.0)).unwrap();
        clip.add_tensor(&mut grads, ClipFlags::NONE).unwrap();
        clip.seal().unwrap();
        assert!((clip.run(&stream, true).unwrap() - 5.0).abs() < 1e-6);
        assert!(close(coefficient(&clip), 10.0 / 10.000001));
    }
    assert!(close(grads[0], 3.0 * 10.0 / 10.000001));
}

#[test]
fn run_async_counts_no_host_sync() {
    let stream = cpu_stream();
    let mut grads = [3.0f32, 4.0];
    let mut norm = -1.0f32;
    {
        let mut clip = Clip::new(None, None, None, ClipOptions::new(1.0)).unwrap();
        clip.add_tensor(&mut grads, ClipFlags::NONE).unwrap();
        clip.seal().unwrap();
        let before = host_sync_count_thread().unwrap();
        // SAFETY: `norm` outlives the clip and is read only after the synchronise
        // below, which also comes before the clip is dropped.
        unsafe { clip.run_async(&stream, &mut norm, true) }.unwrap();
        assert_eq!(host_sync_count_thread().unwrap(), before);
        stream.synchronize().unwrap();
        assert_eq!(host_sync_count_thread().unwrap() - before, 1);
        // A NULL norm is allowed.
        // SAFETY: as above; synchronised before the clip is dropped.
        unsafe { clip.run_async(&stream, std::ptr::null_mut(), false) }.unwrap();
        stream.synchronize().unwrap();
    }
    assert!((norm - 5.0).abs() < 1e-6, "norm {}", norm);
    assert!(close(grads[0], 3.0 * COEF_5));
}

#[test]
fn zero_gradients() {
    let stream = cpu_stream();
    let mut grads = [0.0f32; 3];
    let mut empty: [f32; 0] = [];
    let (norm, coef);
    {
        let mut clip = Clip::new(None, None, None, ClipOptions::new(1.0)).unwrap();
        clip.add_tensor(&mut grads, ClipFlags::NONE).unwrap();
        clip.add_tensor(&mut empty, ClipFlags::NONE).unwrap();
        clip.seal().unwrap();
        norm = clip.run(&stream, true).unwrap();
        coef = coefficient(&clip);
    }
    assert_eq!(norm, 0.0);
    assert!(close(coef, 1.0 / 1.000001), "coefficient {}", coef);
    assert_eq!(grads, [0.0; 3]);
}

#[test]
fn nan_gradient_gives_nan_norm() {
    let stream = cpu_stream();
    let mut grads = [f32::NAN, 1.0];
    let mut other = [2.0f64];
    let norm;
    {
        let mut clip = Clip::new(None, None, None, ClipOptions::new(1.0)).unwrap();
        clip.add_tensor(&mut grads, ClipFlags::NONE).unwrap();
        clip.add_tensor(&mut other, ClipFlags::NONE).unwrap();
        clip.seal().unwrap();
        norm = clip.run(&stream, true).unwrap();
    }
    assert!(norm.is_nan(), "norm {}", norm);
    assert!(
        grads[1].is_nan() && other[0].is_nan(),
        "{:?} {:?}",
        grads,
        other
    );
}

#[test]
fn infinite_gradient_gives_coefficient_zero() {
    let stream = cpu_stream();
    let mut grads = [f32::INFINITY, 1.0];
    let mut other = [2.0f64, -3.0];
    let (norm, coef);
    {
        let mut clip = Clip::new(None, None, None, ClipOptions::new(1.0)).unwrap();
        clip.add_tensor(&mut grads, ClipFlags::NONE).unwrap();
        clip.add_tensor(&mut other, ClipFlags::NONE).unwrap();
        clip.seal().unwrap();
        norm = clip.run(&stream, true).unwrap();
        coef = coefficient(&clip);
    }
    assert!(norm.is_infinite() && norm > 0.0, "norm {}", norm);
    assert_eq!(coef, 0.0);
    assert_eq!(grads[1], 0.0);
    assert_eq!(other[0], 0.0);
    assert_eq!(other[1], 0.0); // -0.0 == 0.0
}

#[test]
fn half_precision_gradients() {
    let stream = cpu_stream();
    // 3.0 and 4.0 as float16 (0x4200, 0x4400) and as bfloat16 (0x4040, 0x4080).
    let mut h = [F16(0x4200), F16(0x4400)];
    let mut b = [BF16(0x4040), BF16(0x4080)];
    {
        let mut clip = Clip::new(None, None, None, ClipOptions::new(100.0)).unwrap();
        clip.add_tensor(&mut h, ClipFlags::NONE).unwrap();
        clip.add_tensor(&mut b, ClipFlags::NONE).unwrap();
        clip.seal().unwrap();
        let norm = clip.run(&stream, false).unwrap();
        // sqrt(9 + 16 + 9 + 16)
        assert!((norm as f64 - 50f64.sqrt()).abs() < 1e-5, "norm {}", norm);
    }
    assert_eq!(h, [F16(0x4200), F16(0x4400)]);
    assert_eq!(b, [BF16(0x4040), BF16(0x4080)]);
}

#[test]
fn bad_input() {
    for &max_norm in [0.0, -1.0, f64::NAN, f64::INFINITY].iter() {
        let err = expect_status(
            Clip::new(None, None, None, ClipOptions::new(max_norm)),
            Status::InvalidArgument,
        );
        assert!(err.message.contains("max_norm"), "{}", err);
    }
    let stream = cpu_stream();
    let mut grads = [3.0f32, 4.0];
    let mut unknown = [1.0f32];
    let mut late = [1.0f32];
    let mut high_bit = [0.0f32];
    let mut clip = Clip::new(None, None, None, ClipOptions::default()).unwrap();
    let err = expect_status(
        clip.add_tensor(&mut unknown, ClipFlags::from_bits(64)),
        Status::InvalidArgument,
    );
    assert!(err.message.contains("flag"), "{}", err);
    expect_status(
        clip.add_tensor(
            &mut high_bit,
            ClipFlags::DISTRIBUTED | ClipFlags::from_bits(1 << 31),
        ),
        Status::InvalidArgument,
    );
    assert_eq!(clip.tensor_count(), 0);
    clip.add_tensor(&mut grads, ClipFlags::NONE).unwrap();
    expect_status(clip.run(&stream, true), Status::FailedPrecondition);
    clip.seal().unwrap();
    expect_status(clip.seal(), Status::FailedPrecondition);
    expect_status(
        clip.add_tensor(&mut late, ClipFlags::NONE),
        Status::FailedPrecondition,
    );
    assert_eq!(clip.tensor_count(), 1);
    // The safe run needs a CPU stream (the gradients are host memory); checked
    // where a CUDA device exists.
    if let Ok(cuda) = Stream::new(DeviceType::CUDA, 0) {
        let err = expect_status(clip.run(&cuda, true), Status::InvalidArgument);
        assert!(err.message.contains("CPU stream"), "{}", err);
    }
    // Still usable after the refused calls.
    assert!((clip.run(&stream, true).unwrap() - 5.0).abs() < 1e-6);
    drop(clip);
    assert_eq!(unknown, [1.0]);
    assert_eq!(late, [1.0]);
    assert!(close(grads[0], 3.0 * COEF_5));
}

// ---------------------------------------------------------------------------------
// Two thread-ranks forming an mp group
// ---------------------------------------------------------------------------------

fn run_ranks<F, R>(tag: &str, f: F) -> Vec<R>
where
    F: Fn(i32, Communicator) -> R + Send + Sync + 'static,
    R: Send + 'static,
{
    common::run_ranks_on(
        unique_url(tag),
        2,
        tag,
        "mp",
        COMM_TIMEOUT,
        RANKS_DEADLINE,
        f,
    )
}

/// The model: w (distributed, 4 elements split 2 + 2 over mp) and b (replicated).
const W: [f32; 4] = [1.0, 2.0, 3.0, 4.0];
const B: [f32; 2] = [5.0, 6.0];

/// One mp rank: clip its half of w (DISTRIBUTED) and all of b; (norm, w, b).
fn mp_clip(rank: i32, comm: &Communicator, options: ClipOptions) -> (f32, Vec<f32>, Vec<f32>) {
    let r = rank as usize;
    let mut w = W[2 * r..2 * r + 2].to_vec();
    let mut b = B.to_vec();
    let stream = cpu_stream();
    let norm;
    {
        let mut clip = Clip::new(None, Some(comm), None, options).unwrap();
        clip.add_tensor(&mut w, ClipFlags::DISTRIBUTED).unwrap();
        clip.add_tensor(&mut b, ClipFlags::NONE).unwrap();
        clip.seal().unwrap();
        norm = clip.run(&stream, true).unwrap();
    }
    (norm, w, b)
}

/// The deterministic norm of the whole model on one rank without groups.
fn single_rank_deterministic_norm() -> f32 {
    let stream = cpu_stream();
    let mut w = W;
    let mut b = B;
    let mut clip = Clip::new(
        None,
        None,
        None,
        ClipOptions::new(100.0).deterministic(true),
    )
    .unwrap();
    clip.add_tensor(&mut w, ClipFlags::DISTRIBUTED).unwrap();
    clip.add_tensor(&mut b, ClipFlags::NONE).unwrap();
    clip.seal().unwrap();
    clip.run(&stream, false).unwrap()
}

#[test]
fn mp_group_float_mode() {
    let results = run_ranks("float", |rank, comm| {
        mp_clip(rank, &comm, ClipOptions::new(1.0))
    });
    // sqrt(1 + 4 + 9 + 16 + 25 + 36): w counted once in pieces, b once though on both.
    let expected = 91f64.sqrt();
    let coef = 1.0 / (expected + 1e-6);
    for (rank, (norm, w, b)) in results.iter().enumerate() {
        assert!(
            (*norm as f64 - expected).abs() < 1e-5,
            "rank {}: norm {}",
            rank,
            norm
        );
        assert_eq!(norm.to_bits(), results[0].0.to_bits());
        for (i, &x) in w.iter().enumerate() {
            assert!(
                close(x, W[2 * rank + i] as f64 * coef),
                "rank {}: w {:?}",
                rank,
                w
            );
        }
        for (i, &x) in b.iter().enumerate() {
            assert!(close(x, B[i] as f64 * coef), "rank {}: b {:?}", rank, b);
        }
    }
}

#[test]
fn mp_group_deterministic_mode_is_layout_independent() {
    let reference = single_rank_deterministic_norm();
    assert!(
        (reference as f64 - 91f64.sqrt()).abs() < 1e-5,
        "{}",
        reference
    );
    let results = run_ranks("deterministic", |rank, comm| {
        mp_clip(rank, &comm, ClipOptions::new(100.0).deterministic(true))
    });
    for (rank, (norm, w, b)) in results.iter().enumerate() {
        // Bitwise the single-rank value, on both ranks.
        assert_eq!(
            norm.to_bits(),
            reference.to_bits(),
            "rank {}: {} vs {}",
            rank,
            norm,
            reference
        );
        // max_norm 100 > norm: coef = 100 / (100 + 1e-6), the gradients barely move.
        assert!(close(w[0], W[2 * rank] as f64), "rank {}: {:?}", rank, w);
        assert!(close(b[1], B[1] as f64), "rank {}: {:?}", rank, b);
    }
}

#[test]
fn mp_group_mismatched_flags_fail_seal() {
    let results = run_ranks("mismatch", |rank, comm| {
        let r = rank as usize;
        let mut w = W[2 * r..2 * r + 2].to_vec();
        let mut b = B.to_vec();
        let stream = cpu_stream();
        {
            let mut clip = Clip::new(None, Some(&comm), None, ClipOptions::new(1.0)).unwrap();
            // Rank 1 forgets DISTRIBUTED.
            let flags = if rank == 1 {
                ClipFlags::NONE
            } else {
                ClipFlags::DISTRIBUTED
            };
            clip.add_tensor(&mut w, flags).unwrap();
            clip.add_tensor(&mut b, ClipFlags::NONE).unwrap();
            let err = expect_status(clip.seal(), Status::InvalidArgument);
            assert!(err.message.contains("mp"), "{}", err);
            assert!(!clip.is_sealed());
            expect_status(clip.run(&stream, true), Status::FailedPrecondition);
        }
        (w, b)
    });
    for (rank, (w, b)) in results.iter().enumerate() {
        assert_eq!(w[..], W[2 * rank..2 * rank + 2], "rank {}", rank);
        assert_eq!(b[..], B[..], "rank {}", rank);
    }
}

// A peer that aborted is an ordinary failure: Clip::run returns it (it aborted the whole
// process), and a Stream::scope after a failed operation the stream waited for ends
// normally, its failure kept for the next Stream::synchronize (the process aborted too).
#[test]
fn a_peer_that_aborted_is_returned_not_a_process_abort() {
    use hpshard::Store;
    let url = unique_url("peer-aborted");
    let s0 = Store::open(&url, 0, COMM_TIMEOUT).unwrap();
    let s1 = Store::open(&url, 1, COMM_TIMEOUT).unwrap();
    let peer = std::thread::spawn(move || {
        let c1 = Communicator::create(&s1, 1, 2, DeviceType::CPU, 0, None).unwrap();
        let mut g1 = vec![3.0f32, 4.0];
        let mut clip = Clip::new(Some(&c1), None, None, ClipOptions::new(1.0)).unwrap();
        clip.add_tensor(&mut g1, ClipFlags::NONE).unwrap();
        clip.seal().unwrap();
        c1.abort().unwrap(); // goes away without clipping
    });
    let c0 = Communicator::create(&s0, 0, 2, DeviceType::CPU, 0, None).unwrap();
    let stream = Stream::new(DeviceType::CPU, 0).unwrap();
    let mut g0 = vec![3.0f32, 4.0];
    {
        let mut clip = Clip::new(Some(&c0), None, None, ClipOptions::new(1.0)).unwrap();
        clip.add_tensor(&mut g0, ClipFlags::NONE).unwrap();
        clip.seal().unwrap();
        peer.join().unwrap();
        let failed = clip.run(&stream, true).unwrap_err();
        assert_eq!(failed.status, Status::Aborted, "{}", failed.message);
    }
    let c2_url = unique_url("scope-after-failure");
    let t0 = Store::open(&c2_url, 0, COMM_TIMEOUT).unwrap();
    let t1 = Store::open(&c2_url, 1, COMM_TIMEOUT).unwrap();
    let peer = std::thread::spawn(move || {
        let c1 = Communicator::create(&t1, 1, 2, DeviceType::CPU, 0, None).unwrap();
        c1.abort().unwrap();
    });
    let c = Communicator::create(&t0, 0, 2, DeviceType::CPU, 0, None).unwrap();
    peer.join().unwrap();
    let w = c.barrier(None).unwrap();
    w.wait_stream(&stream).unwrap();
    assert_eq!(w.wait().unwrap_err().status, Status::Aborted);
    let src = [1u8, 2, 3, 4];
    let mut dst = [0u8; 4];
    stream.scope(|s| s.memcpy_async(&mut dst, &src)).unwrap();
    assert_eq!(dst, src);
    let kept = stream.synchronize().unwrap_err();
    assert_eq!(kept.status, Status::Aborted, "{}", kept.message);
    stream.synchronize().unwrap(); // reported once
}
