// Shared by the multi-rank test files: ranks as threads meeting through one store.

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use hpshard::{CommOptions, Communicator, DeviceType, Store};

const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `f(rank, comm)` on `world` thread-ranks of one communicator named `comm_name`
/// (created over the store at `url`, operations timing out after `timeout`) and returns
/// the results by rank. A panic in a rank fails the test, and so does a rank that has
/// not finished by `deadline` (its thread is left behind).
pub fn run_ranks_on<F, R>(
    url: String,
    world: i32,
    tag: &str,
    comm_name: &str,
    timeout: Duration,
    deadline: Duration,
    f: F,
) -> Vec<R>
where
    F: Fn(i32, Communicator) -> R + Send + Sync + 'static,
    R: Send + 'static,
{
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    for rank in 0..world {
        let (f, tx, url) = (f.clone(), tx.clone(), url.clone());
        let comm_name = comm_name.to_string();
        std::thread::Builder::new()
            .name(format!("{}-{}", tag, rank))
            .spawn(move || {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let store = Store::open(&url, rank, OPEN_TIMEOUT).unwrap();
                    let options = CommOptions::new().timeout(timeout).name(&comm_name);
                    let comm = Communicator::create(
                        &store,
                        rank,
                        world,
                        DeviceType::CPU,
                        0,
                        Some(options),
                    )
                    .unwrap();
                    drop(store); // the communicator keeps what it needs
                    f(rank, comm)
                }));
                let _ = tx.send((rank, result));
            })
            .unwrap();
    }
    drop(tx);
    let end = Instant::now() + deadline;
    let mut results: Vec<Option<R>> = (0..world).map(|_| None).collect();
    for _ in 0..world {
        let left = end.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, Ok(value))) => results[rank as usize] = Some(value),
            Ok((rank, Err(panic))) => {
                let text = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!("rank {} of {} panicked: {}", rank, tag, text);
            }
            Err(_) => panic!("{}: ranks did not finish within {:?}", tag, deadline),
        }
    }
    results.into_iter().map(|r| r.unwrap()).collect()
}
