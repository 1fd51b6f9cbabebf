// Stores, communicators, collectives, work, split and hybrid groups. Ranks are
// threads meeting through a "memory://<unique name>" store. Every multi-rank test
// is bounded: communicators time out after COMM_TIMEOUT, and run_ranks fails the
// test when the ranks have not all finished within RANKS_DEADLINE.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use hpshard::{
    host_sync_count_thread, Aborter, CommOptions, Communicator, DType, DeviceType, Error, Group,
    HybridGroup, ReduceOp, Status, Store, Stream, Topology, BF16, F16,
};

const WORLD: i32 = 4;
const COMM_TIMEOUT: Duration = Duration::from_secs(20);
const RANKS_DEADLINE: Duration = Duration::from_secs(90);
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

mod common;

fn unique_url(tag: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "memory://rust-{}-{}-{}",
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

/// `f(rank, comm)` on `world` thread-ranks (communicator timeout `timeout`), results by
/// rank; bounded by RANKS_DEADLINE (common::run_ranks_on).
fn run_ranks_with<F, R>(world: i32, tag: &str, timeout: Duration, f: F) -> Vec<R>
where
    F: Fn(i32, Communicator) -> R + Send + Sync + 'static,
    R: Send + 'static,
{
    common::run_ranks_on(
        unique_url(tag),
        world,
        tag,
        "rust-test",
        timeout,
        RANKS_DEADLINE,
        f,
    )
}

fn run_ranks<F, R>(tag: &str, f: F) -> Vec<R>
where
    F: Fn(i32, Communicator) -> R + Send + Sync + 'static,
    R: Send + 'static,
{
    run_ranks_with(WORLD, tag, COMM_TIMEOUT, f)
}

// ---------------------------------------------------------------------------------
// Store
// ---------------------------------------------------------------------------------

#[test]
fn store_set_get_add_wait_check() {
    let store = Store::open(&unique_url("store"), 0, Duration::from_secs(1)).unwrap();
    let binary = [b'a', 0, b'b'];
    store.set("k", &binary).unwrap();
    assert_eq!(
        store.get("k", Duration::from_secs(1)).unwrap(),
        binary.to_vec()
    );
    // Larger than the first buffer: the OUT_OF_RANGE sizing protocol.
    let big: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    store.set("big", &big).unwrap();
    assert_eq!(store.get("big", Duration::from_secs(1)).unwrap(), big);
    store.set("empty", &[]).unwrap();
    assert_eq!(
        store.get("empty", Duration::from_secs(1)).unwrap(),
        Vec::<u8>::new()
    );
    assert_eq!(store.add("n", 5).unwrap(), 5);
    assert_eq!(store.add("n", -2).unwrap(), 3);
    assert!(!store.check("missing").unwrap());
    assert!(store.check("k").unwrap());
    store.wait("k", Duration::from_secs(1)).unwrap();
    let err = expect_status(
        store.wait("missing", Duration::from_millis(50)),
        Status::Timeout,
    );
    assert!(err.message.contains("missing"), "{}", err);
    let err = expect_status(
        store.get("missing", Duration::from_millis(50)),
        Status::Timeout,
    );
    assert!(err.message.contains("missing"), "{}", err);
    expect_status(
        store.get("k", Duration::from_millis(0)),
        Status::InvalidArgument,
    );
    expect_status(
        store.wait("k", Duration::from_millis(0)),
        Status::InvalidArgument,
    );
    expect_status(store.set("a\0b", b"x"), Status::InvalidArgument);
    expect_status(
        Store::open("gopher://x", 0, Duration::from_secs(1)),
        Status::InvalidArgument,
    );
    expect_status(
        Store::open("memory://x", 0, Duration::from_secs(0)),
        Status::InvalidArgument,
    );
    assert!(!store.as_ptr().is_null());
    // Another open of the same name sees the same keys.
    let url = unique_url("store-shared");
    let a = Store::open(&url, 0, Duration::from_secs(1)).unwrap();
    let b = Store::open(&url, 1, Duration::from_secs(1)).unwrap();
    a.set("x", b"1").unwrap();
    assert_eq!(b.get("x", Duration::from_secs(1)).unwrap(), b"1".to_vec());
}

/// A scope's collectives take host slices: a CUDA communicator has none (it would have
/// handed host memory to NCCL as device memory). Runs where a CUDA device is present.
#[test]
fn a_device_communicator_has_no_slice_scope() {
    if hpshard::device_count(DeviceType::CUDA).unwrap_or(0) == 0 {
        return; // no CUDA device here: the GPU check runs it
    }
    let store = Store::open(&unique_url("cuda-scope"), 0, Duration::from_secs(10)).unwrap();
    let comm = Communicator::create(&store, 0, 1, DeviceType::CUDA, 0, None).unwrap();
    let send = [1.0f32; 4];
    let mut recv = [0.0f32; 4];
    let e = expect_status(
        comm.scope(|s| s.all_reduce(&send, &mut recv, ReduceOp::SUM)?.wait()),
        Status::InvalidArgument,
    );
    assert!(e.message().contains("host slices"), "{}", e.message());
}

#[test]
fn store_is_shared_by_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Store>();
    let store = Store::open(&unique_url("store-threads"), 0, Duration::from_secs(1)).unwrap();
    std::thread::scope(|s| {
        let store = &store;
        // A getter that waits for a key a later thread sets.
        let getter = s.spawn(move || store.get("late", Duration::from_secs(10)).unwrap());
        for _ in 0..4 {
            s.spawn(move || {
                for _ in 0..100 {
                    store.add("counter", 1).unwrap();
                }
            });
        }
        std::thread::sleep(Duration::from_millis(20));
        store.set("late", b"here").unwrap();
        assert_eq!(getter.join().unwrap(), b"here".to_vec());
    });
    assert_eq!(store.add("counter", 0).unwrap(), 400);
}

#[test]
fn store_abort_ends_a_rendezvous_waiting_for_a_rank_that_never_comes() {
    let store = Store::open(&unique_url("store-abort"), 0, OPEN_TIMEOUT).unwrap();
    let options = CommOptions::new().timeout(COMM_TIMEOUT);
    let start = Instant::now();
    let created = std::thread::scope(|s| {
        let store = &store;
        let rank =
            s.spawn(move || Communicator::create(store, 0, 2, DeviceType::CPU, 0, Some(options)));
        std::thread::sleep(Duration::from_millis(300));
        store.abort().unwrap();
        rank.join().unwrap()
    });
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    let err = expect_status(created, Status::Aborted);
    assert!(err.message.contains("abort"), "{}", err);
    // Every call after it, and aborting again is harmless.
    expect_status(store.set("k", b"v"), Status::Aborted);
    expect_status(store.get("k", Duration::from_millis(10)), Status::Aborted);
    store.abort().unwrap();
}

// ---------------------------------------------------------------------------------
// Collectives
// ---------------------------------------------------------------------------------

fn f32_input(rank: i32, i: usize) -> f32 {
    (rank + 1) as f32 * 0.5 + i as f32 - 3.0
}

fn i64_input(rank: i32, i: usize) -> i64 {
    // The sum over ranks is a multiple of 4, so avg is exact.
    rank as i64 * 4 + i as i64 * 3 - 5
}

fn reference<T: Copy>(
    ranks: i32,
    n: usize,
    input: impl Fn(i32, usize) -> T,
    op: impl Fn(T, T) -> T,
) -> Vec<T> {
    (0..n)
        .map(|i| (1..ranks).fold(input(0, i), |acc, r| op(acc, input(r, i))))
        .collect()
}

#[test]
fn all_reduce_sum_avg_max_min() {
    const N: usize = 8;
    run_ranks("all-reduce", |rank, comm| {
        assert_eq!(comm.rank().unwrap(), rank);
        assert_eq!(comm.size().unwrap(), WORLD);
        let w = WORLD as f32;
        let fs: Vec<f32> = (0..N).map(|i| f32_input(rank, i)).collect();
        let is: Vec<i64> = (0..N).map(|i| i64_input(rank, i)).collect();
        let mut f_out = vec![vec![0f32; N]; 4];
        let mut i_out = vec![vec![0i64; N]; 4];
        let mut in_place: Vec<i64> = is.clone();
        comm.scope(|s| {
            // Eight operations in flight at once, waited in reverse order.
            let mut works = Vec::new();
            for (out, op) in f_out.iter_mut().zip(ReduceOp::ALL.iter()) {
                works.push(s.all_reduce(&fs, out, *op)?);
            }
            for (out, op) in i_out.iter_mut().zip(ReduceOp::ALL.iter()) {
                works.push(s.all_reduce(&is, out, *op)?);
            }
            works.push(s.all_reduce_in_place(&mut in_place, ReduceOp::SUM)?);
            for w in works.iter().rev() {
                w.wait()?;
                assert!(w.test()?);
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(f_out[0], reference(WORLD, N, f32_input, |a, b| a + b));
        let avg: Vec<f32> = reference(WORLD, N, f32_input, |a, b| a + b)
            .iter()
            .map(|x| x / w)
            .collect();
        assert_eq!(f_out[1], avg);
        assert_eq!(f_out[2], reference(WORLD, N, f32_input, f32::max));
        assert_eq!(f_out[3], reference(WORLD, N, f32_input, f32::min));
        let sum = reference(WORLD, N, i64_input, |a, b| a + b);
        assert_eq!(i_out[0], sum);
        assert_eq!(
            i_out[1],
            sum.iter().map(|x| x / WORLD as i64).collect::<Vec<_>>()
        );
        assert_eq!(i_out[2], reference(WORLD, N, i64_input, std::cmp::max));
        assert_eq!(i_out[3], reference(WORLD, N, i64_input, std::cmp::min));
        assert_eq!(in_place, sum);
    });
}

#[test]
fn gather_scatter_broadcast_reduce() {
    run_ranks("gather", |rank, comm| {
        // all_gather of i32.
        let send: Vec<i32> = (0..3).map(|j| rank * 10 + j).collect();
        let mut gathered = vec![-1i32; 3 * WORLD as usize];
        // reduce_scatter of f64: 2 elements per rank.
        let big: Vec<f64> = (0..2 * WORLD).map(|i| (i * 4 + rank) as f64).collect();
        let mut scattered = [0f64; 2];
        // broadcast of u8 from rank 2.
        let mut bytes = if rank == 2 { [7u8, 8, 9] } else { [0u8; 3] };
        // reduce (max) of i32 to rank 1 only.
        let mine = [rank * 3, -rank];
        let mut reduced = [0i32; 2];
        comm.scope(|s| {
            let a = s.all_gather(&send, &mut gathered)?;
            let b = s.reduce_scatter(&big, &mut scattered, ReduceOp::SUM)?;
            let c = s.broadcast(&mut bytes, 2)?;
            let recv = if rank == 1 {
                Some(&mut reduced[..])
            } else {
                None
            };
            let d = s.reduce(&mine, recv, ReduceOp::MAX, 1)?;
            a.wait()?;
            b.wait()?;
            c.wait()?;
            d.wait()
        })
        .unwrap();
        let want: Vec<i32> = (0..WORLD)
            .flat_map(|r| (0..3).map(move |j| r * 10 + j))
            .collect();
        assert_eq!(gathered, want);
        for k in 0..2 {
            let slice = 2 * rank + k;
            let want: f64 = (0..WORLD).map(|q| (slice * 4 + q) as f64).sum();
            assert_eq!(scattered[k as usize], want);
        }
        assert_eq!(bytes, [7, 8, 9]);
        if rank == 1 {
            assert_eq!(reduced, [(WORLD - 1) * 3, 0]);
        } else {
            assert_eq!(reduced, [0, 0]);
        }
    });
}

#[test]
fn send_recv_ring_and_barrier() {
    run_ranks("ring", |rank, comm| {
        let next = (rank + 1) % WORLD;
        let prev = (rank + WORLD - 1) % WORLD;
        let sent = [rank as i64 * 10, -(rank as i64)];
        let mut got = [-1i64; 2];
        let stream = Stream::new(DeviceType::CPU, 0).unwrap();
        comm.scope(|s| {
            let a = s.send(&sent, next)?;
            let b = s.recv(&mut got, prev)?;
            b.wait_stream(&stream)?; // stream-side dependency, host not blocked
            stream.synchronize()?;
            a.wait()?;
            drop(b); // not waited on the host: the scope waits for it
            let barrier = s.barrier()?;
            barrier.wait()
        })
        .unwrap();
        assert_eq!(got, [prev as i64 * 10, -(prev as i64)]);
        // The unscoped barrier returns an owned Work.
        let work = comm.barrier(None).unwrap();
        work.wait().unwrap();
        assert!(work.test().unwrap());
        assert!(!work.as_ptr().is_null());
        // A ready stream: the operation starts after the stream's queued work.
        let ready = Stream::new(DeviceType::CPU, 0).unwrap();
        let mut total = [rank];
        comm.scope(|s| {
            s.set_ready_stream(Some(&ready));
            s.all_reduce_in_place(&mut total, ReduceOp::SUM)?.wait()
        })
        .unwrap();
        assert_eq!(total, [WORLD * (WORLD - 1) / 2]);
    });
}

#[test]
fn timed_wait_says_whether_the_operation_finished() {
    // Rank 0's receive is pending until rank 1 passes the barrier, which rank 0 reaches
    // only after a timed wait said false; then a timed wait sees it finish (one host sync).
    let pending = Arc::new(Barrier::new(2));
    run_ranks_with(2, "timed-wait", COMM_TIMEOUT, move |rank, comm| {
        if rank == 0 {
            let mut got = [-1i64];
            comm.scope(|s| {
                let r = s.recv(&mut got, 1)?;
                let start = Instant::now();
                let syncs = host_sync_count_thread().unwrap();
                assert!(!r.wait_timeout(Duration::from_millis(20))?);
                assert!(start.elapsed() >= Duration::from_millis(15));
                assert_eq!(host_sync_count_thread().unwrap(), syncs);
                pending.wait();
                assert!(r.wait_timeout(Duration::from_secs(60))?);
                assert_eq!(host_sync_count_thread().unwrap(), syncs + 1);
                Ok(())
            })
            .unwrap();
            assert_eq!(got, [42]);
        } else {
            pending.wait();
            comm.scope(|s| s.send(&[42i64], 0)?.wait()).unwrap();
        }
        let work = comm.barrier(None).unwrap();
        assert!(work.wait_timeout(Duration::from_secs(60)).unwrap());
    });
}

#[test]
fn raw_pointer_collectives() {
    run_ranks("raw", |rank, comm| {
        let send = [rank as f32; 4];
        let mut recv = [0f32; 4];
        let mut gathered = [0i64; WORLD as usize];
        let mine = [rank as i64];
        let mut scattered = [0i64; 1];
        let spread: Vec<i64> = (0..WORLD as i64).map(|i| i + rank as i64).collect();
        let mut bcast = [if rank == 0 { 42u8 } else { 0 }];
        let mut reduced = [0f32; 4];
        let mut ring = [0i32];
        let token = [rank];
        unsafe {
            let ptr = |p: *const f32| p as *const std::ffi::c_void;
            comm.all_reduce_raw(
                ptr(send.as_ptr()),
                recv.as_mut_ptr().cast(),
                4,
                DType::FLOAT32,
                ReduceOp::SUM,
                None,
            )
            .unwrap()
            .wait()
            .unwrap();
            comm.all_gather_raw(
                mine.as_ptr().cast(),
                1,
                gathered.as_mut_ptr().cast(),
                WORLD as u64,
                DType::INT64,
                None,
            )
            .unwrap()
            .wait()
            .unwrap();
            comm.reduce_scatter_raw(
                spread.as_ptr().cast(),
                WORLD as u64,
                scattered.as_mut_ptr().cast(),
                1,
                DType::INT64,
                ReduceOp::MIN,
                None,
            )
            .unwrap()
            .wait()
            .unwrap();
            comm.broadcast_raw(bcast.as_mut_ptr().cast(), 1, DType::UINT8, 0, None)
                .unwrap()
                .wait()
                .unwrap();
            let recv_ptr = if rank == 3 {
                reduced.as_mut_ptr().cast()
            } else {
                std::ptr::null_mut()
            };
            comm.reduce_raw(
                ptr(send.as_ptr()),
                recv_ptr,
                4,
                DType::FLOAT32,
                ReduceOp::SUM,
                3,
                None,
            )
            .unwrap()
            .wait()
            .unwrap();
            let stream = Stream::new(DeviceType::CPU, 0).unwrap();
            let s = comm
                .send_raw(
                    token.as_ptr().cast(),
                    1,
                    DType::INT32,
                    (rank + 1) % WORLD,
                    Some(&stream),
                )
                .unwrap();
            let r = comm
                .recv_raw(
                    ring.as_mut_ptr().cast(),
                    1,
                    DType::INT32,
                    (rank + WORLD - 1) % WORLD,
                    None,
                )
                .unwrap();
            r.wait_stream(&stream).unwrap();
            stream.synchronize().unwrap();
            s.wait().unwrap();
            r.wait().unwrap();
        }
        let sum = (WORLD * (WORLD - 1) / 2) as f32;
        assert_eq!(recv, [sum; 4]);
        assert_eq!(gathered.to_vec(), (0..WORLD as i64).collect::<Vec<_>>());
        assert_eq!(scattered, [rank as i64]);
        assert_eq!(bcast, [42]);
        assert_eq!(reduced, if rank == 3 { [sum; 4] } else { [0.0; 4] });
        assert_eq!(ring, [(rank + WORLD - 1) % WORLD]);
    });
}

#[test]
fn half_precision_bits_with_explicit_dtype() {
    run_ranks_with(2, "half", COMM_TIMEOUT, |rank, comm| {
        // 1.0 in fp16 is 0x3C00 and in bf16 0x3F80; rank 0's values are broadcast.
        let mut h: Vec<u16> = vec![if rank == 0 { 0x3C00 } else { 0 }; 3];
        let mut b: Vec<u16> = vec![if rank == 0 { 0x3F80 } else { 0 }; 3];
        let mut sum = [F16(0x3C00)]; // 1.0 + 1.0 = 2.0 = 0x4000
        comm.scope(|s| {
            s.broadcast(F16::from_bits_slice_mut(&mut h), 0)?.wait()?;
            s.broadcast(BF16::from_bits_slice_mut(&mut b), 0)?.wait()?;
            s.all_reduce_in_place(&mut sum, ReduceOp::SUM)?.wait()
        })
        .unwrap();
        assert_eq!(h, vec![0x3C00; 3]);
        assert_eq!(b, vec![0x3F80; 3]);
        assert_eq!(sum, [F16(0x4000)]);
        assert_eq!(F16::from_bits_slice(&h)[0], F16(0x3C00));
        assert_eq!(BF16::from_bits_slice(&b).len(), 3);
    });
}

// ---------------------------------------------------------------------------------
// Bad input, timeout, abort
// ---------------------------------------------------------------------------------

#[test]
fn bad_input_is_refused_with_nothing_sent() {
    run_ranks("bad-input", |rank, comm| {
        let send = [rank as f32; 8];
        let mut small = [0f32; 8 * WORLD as usize - 1];
        let mut out = [0f32; 8];
        let mut value = [rank];
        let before = host_sync_count_thread().unwrap();
        let err = comm
            .scope(|s| s.all_gather(&send, &mut small).map(|_| ()))
            .unwrap_err();
        assert_eq!(err.status, Status::InvalidArgument, "{}", err);
        assert!(err.message.contains("needs 32"), "{}", err);
        let err = comm
            .scope(|s| {
                s.all_reduce(&send, &mut out, ReduceOp::from_raw(9))
                    .map(|_| ())
            })
            .unwrap_err();
        assert_eq!(err.status, Status::InvalidArgument, "{}", err);
        assert!(err.message.contains("unknown reduction 9"), "{}", err);
        let err = comm
            .scope(|s| s.broadcast(&mut value, WORLD).map(|_| ()))
            .unwrap_err();
        assert_eq!(err.status, Status::OutOfRange, "{}", err);
        let err = comm.scope(|s| s.send(&send, -1).map(|_| ())).unwrap_err();
        assert_eq!(err.status, Status::OutOfRange, "{}", err);
        // Detected by the crate: lengths differ.
        let err = comm
            .scope(|s| {
                s.all_reduce(&send, &mut out[..7], ReduceOp::SUM)
                    .map(|_| ())
            })
            .unwrap_err();
        assert_eq!(err.status, Status::InvalidArgument, "{}", err);
        expect_status(
            comm.set_timeout(Duration::from_millis(0)),
            Status::InvalidArgument,
        );
        expect_status(comm.split(&[0, 1], "a\0b"), Status::InvalidArgument);
        // Nothing was sent and nothing waited: the next collective still matches up.
        assert_eq!(host_sync_count_thread().unwrap(), before);
        let mut total = [rank];
        comm.scope(|s| s.all_reduce_in_place(&mut total, ReduceOp::SUM)?.wait())
            .unwrap();
        assert_eq!(total, [WORLD * (WORLD - 1) / 2]);
        assert_eq!(format!("{:?}", ReduceOp::from_raw(9)), "ReduceOp(9)");
        assert_eq!(format!("{:?}", ReduceOp::AVG), "ReduceOp(avg)");
    });
}

#[test]
fn create_errors() {
    let store = Store::open(&unique_url("create-errors"), 0, OPEN_TIMEOUT).unwrap();
    expect_status(
        Communicator::create(&store, 5, 2, DeviceType::CPU, 0, None),
        Status::OutOfRange,
    );
    expect_status(
        Communicator::create(&store, 0, 1, DeviceType::from_raw(99), 0, None),
        Status::InvalidArgument,
    );
    let zero = CommOptions::new().timeout(Duration::from_millis(0));
    expect_status(
        Communicator::create(&store, 0, 1, DeviceType::CPU, 0, Some(zero)),
        Status::InvalidArgument,
    );
    expect_status(
        Communicator::create(
            &store,
            0,
            1,
            DeviceType::CPU,
            0,
            Some(CommOptions::new().name("a\0")),
        ),
        Status::InvalidArgument,
    );
    // A world of one works without peers, with default options and library defaults.
    let solo = Communicator::create(&store, 0, 1, DeviceType::CPU, 0, None).unwrap();
    assert_eq!((solo.rank().unwrap(), solo.size().unwrap()), (0, 1));
    let defaults = CommOptions::library_defaults().unwrap();
    assert!(defaults.timeout.unwrap() > Duration::from_secs(0));
    let store2 = Store::open(&unique_url("create-defaults"), 0, OPEN_TIMEOUT).unwrap();
    let solo2 = Communicator::create(
        &store2,
        0,
        1,
        DeviceType::CPU,
        0,
        Some(defaults.check_arguments(false)),
    )
    .unwrap();
    solo2.set_timeout(Duration::from_secs(5)).unwrap();
    let data = [1.5f64, 2.5];
    let mut out = [0f64; 2];
    solo2
        .scope(|s| s.all_reduce(&data, &mut out, ReduceOp::MAX)?.wait())
        .unwrap();
    assert_eq!(out, data);
}

#[test]
fn timeout_when_a_rank_never_joins() {
    let joined = Arc::new(Barrier::new(2));
    let results = run_ranks_with(
        2,
        "timeout",
        Duration::from_millis(200),
        move |rank, comm| {
            if rank == 1 {
                // Alive, connected, but never calls the collective.
                joined.wait();
                return None;
            }
            let send = [1i32; 4];
            let mut recv = [0i32; 4];
            let start = Instant::now();
            // Dropped without a wait: the scope's own wait reports the error.
            let implicit =
                comm.scope(|s| s.all_reduce(&send, &mut recv, ReduceOp::SUM).map(|_| ()));
            let elapsed = start.elapsed();
            // After a timeout the communicator is broken: later operations end too.
            let explicit = comm.scope(|s| s.barrier()?.wait());
            joined.wait();
            Some((explicit, implicit, elapsed))
        },
    );
    let (explicit, implicit, elapsed) = results.into_iter().next().unwrap().unwrap();
    let err = implicit.unwrap_err();
    assert_eq!(err.status, Status::Timeout, "{}", err);
    assert!(err.message.contains("all_reduce"), "{}", err);
    let err = explicit.unwrap_err();
    assert!(
        matches!(err.status, Status::Timeout | Status::Aborted),
        "{}",
        err
    );
    assert!(elapsed < Duration::from_secs(10), "{:?}", elapsed);
}

#[test]
fn abort_from_another_thread() {
    fn assert_send_sync<T: Send + Sync>() {}
    fn assert_send<T: Send>() {}
    assert_send_sync::<Aborter<'static>>();
    assert_send::<Communicator>();
    let finished = Arc::new(Barrier::new(2));
    let results = run_ranks_with(2, "abort", COMM_TIMEOUT, move |rank, comm| {
        if rank == 1 {
            finished.wait();
            return None;
        }
        let send = [1i64; 16];
        let mut recv = [0i64; 16];
        let start = Instant::now();
        let aborter = comm.aborter();
        let result = std::thread::scope(|t| {
            t.spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                aborter.abort().unwrap();
            });
            comm.scope(|s| s.all_reduce(&send, &mut recv, ReduceOp::SUM)?.wait())
        });
        let elapsed = start.elapsed();
        // Later operations end with ABORTED too.
        let later = comm.barrier(None).and_then(|w| w.wait());
        comm.abort().unwrap(); // idempotent, from the owning thread
        finished.wait();
        Some((result, later, elapsed))
    });
    let (result, later, elapsed) = results.into_iter().next().unwrap().unwrap();
    assert_eq!(result.unwrap_err().status, Status::Aborted);
    assert_eq!(later.unwrap_err().status, Status::Aborted);
    assert!(
        elapsed < Duration::from_secs(10),
        "aborted, not timed out: {:?}",
        elapsed
    );
}

#[test]
fn scope_waits_when_the_closure_panics() {
    let results = run_ranks_with(2, "panic", COMM_TIMEOUT, |rank, comm| {
        let send = [rank + 1; 1000];
        let mut recv = [0i32; 1000];
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            comm.scope(|s| -> hpshard::Result<()> {
                let w = s.all_reduce(&send, &mut recv, ReduceOp::SUM)?;
                std::mem::forget(w); // forgetting is harmless: the scope owns the handle
                panic!("after starting");
            })
        }));
        assert!(caught.is_err());
        recv[0] + recv[999]
    });
    assert_eq!(results, vec![6, 6]);
}

// ---------------------------------------------------------------------------------
// Split and hybrid groups
// ---------------------------------------------------------------------------------

#[test]
fn split_into_evens_and_odds() {
    run_ranks("split", |rank, comm| {
        let evens = comm.split(&[0, 2], "even").unwrap();
        let odds = comm.split(&[1, 3], "odd").unwrap();
        assert_eq!(evens.is_some(), rank % 2 == 0);
        assert_eq!(odds.is_some(), rank % 2 == 1);
        let mine = evens.or(odds).unwrap();
        assert_eq!(mine.rank().unwrap(), rank / 2);
        assert_eq!(mine.size().unwrap(), 2);
        let value = [rank as i64];
        let mut sum = [-1i64];
        mine.scope(|s| s.all_reduce(&value, &mut sum, ReduceOp::SUM)?.wait())
            .unwrap();
        assert_eq!(sum, [if rank % 2 == 0 { 2 } else { 4 }]);
        // Split with the communicator moved to another thread (Send).
        let handle = std::thread::spawn(move || {
            let mut v = [1i32];
            mine.scope(|s| s.all_reduce_in_place(&mut v, ReduceOp::SUM)?.wait())
                .unwrap();
            v[0]
        });
        assert_eq!(handle.join().unwrap(), 2);
    });
}

#[test]
fn hybrid_group_dp2_sharding2() {
    run_ranks("hybrid", |rank, comm| {
        let topology = Topology::new(2, 1, 2, 1, 1, WORLD, None).unwrap();
        let group = HybridGroup::create(&comm, &topology).unwrap();
        assert!(!group.as_ptr().is_null());
        let sharding = group.comm(Group::SHARDING).unwrap();
        let dp = group.comm(Group::DP).unwrap();
        let check = group.comm(Group::CHECK).unwrap();
        expect_status(group.comm(Group::from_raw(99)), Status::InvalidArgument);
        // One handle per communicator at a time: a second dp handle beside `dp` could be
        // sent to another thread and used there at once (it was handed out).
        expect_status(group.comm(Group::DP), Status::FailedPrecondition);
        let pp = group.comm(Group::PP).unwrap();
        drop(pp);
        let pp = group.comm(Group::PP).unwrap(); // the first is gone: taken again
        drop(pp);
        drop(group); // handles taken from it stay valid
        assert_eq!(sharding.size().unwrap(), 2);
        assert_eq!(
            sharding.rank().unwrap(),
            topology.coordinate(rank, Group::SHARDING).unwrap()
        );
        let mine = [1i64 << rank];
        let (mut s_sum, mut d_sum, mut c_sum) = ([0i64], [0i64], [0i64]);
        sharding
            .scope(|s| s.all_reduce(&mine, &mut s_sum, ReduceOp::SUM)?.wait())
            .unwrap();
        dp.scope(|s| s.all_reduce(&mine, &mut d_sum, ReduceOp::SUM)?.wait())
            .unwrap();
        check
            .scope(|s| s.all_reduce(&mine, &mut c_sum, ReduceOp::SUM)?.wait())
            .unwrap();
        // sharding groups {0,1} {2,3}; dp groups {0,2} {1,3}; check = sharding here.
        assert_eq!(s_sum, [if rank < 2 { 3 } else { 12 }]);
        assert_eq!(d_sum, [if rank % 2 == 0 { 5 } else { 10 }]);
        assert_eq!(c_sum, s_sum);
        let wrong = Topology::new(2, 1, 1, 1, 1, 2, None).unwrap();
        expect_status(HybridGroup::create(&comm, &wrong), Status::InvalidArgument);
    });
}

// ---------------------------------------------------------------------------------
// Device and transport
// ---------------------------------------------------------------------------------

/// What a group of `size` thread-ranks of this process uses: shared memory, unless it
/// is a single rank or HPS_COMM_SHM=0 (a non-zero integer keeps it on).
fn expected_transport(size: i32) -> &'static str {
    let shm_off = match std::env::var("HPS_COMM_SHM") {
        Ok(v) if !v.trim().is_empty() => v.trim().parse::<i64>().unwrap() == 0,
        _ => false,
    };
    if size < 2 || shm_off {
        "tcp"
    } else {
        "shm"
    }
}

#[test]
fn device_and_transport_of_cpu_communicators() {
    let got = run_ranks_with(2, "device", COMM_TIMEOUT, |_, comm| {
        assert_eq!(comm.device().unwrap(), (DeviceType::CPU, 0));
        comm.transport().unwrap()
    });
    assert_eq!(got, vec![expected_transport(2); 2]);
    let store = Store::open(&unique_url("device1"), 0, OPEN_TIMEOUT).unwrap();
    let comm = Communicator::create(&store, 0, 1, DeviceType::CPU, 0, None).unwrap();
    assert_eq!(comm.device().unwrap(), (DeviceType::CPU, 0));
    // A group of one has no peer to share memory with.
    assert_eq!(comm.transport().unwrap(), "tcp");
}

#[test]
fn finish_waits_for_queued_operations_and_an_aborter_ends_them() {
    let finished = Arc::new(Barrier::new(2));
    let results = run_ranks_with(2, "finish", COMM_TIMEOUT, move |rank, comm| {
        if rank == 1 {
            finished.wait();
            return None;
        }
        // A barrier rank 1 never joins: it would wait for the communicator's timeout.
        let pending = comm.barrier(None).unwrap();
        let start = Instant::now();
        let aborter = comm.aborter();
        let finish = std::thread::scope(|t| {
            t.spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                aborter.abort().unwrap();
            });
            comm.finish()
        });
        let elapsed = start.elapsed();
        let waited = pending.wait();
        finished.wait();
        Some((finish, waited, elapsed))
    });
    let (finish, waited, elapsed) = results.into_iter().next().unwrap().unwrap();
    assert!(finish.is_ok(), "{:?}", finish);
    assert_eq!(waited.unwrap_err().status, Status::Aborted);
    assert!(
        elapsed < COMM_TIMEOUT / 2,
        "aborted, not timed out: {:?}",
        elapsed
    );
}
