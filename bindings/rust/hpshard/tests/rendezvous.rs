// Tests that change the process environment (rendezvous_from_env, communicator
// defaults). They live in their own test binary so that no other test's C calls
// read the environment (getenv) while these change it; within this binary ENV_LOCK
// serialises them.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use hpshard::{rendezvous_from_env, CommOptions, Status};

static ENV_LOCK: Mutex<()> = Mutex::new(());

fn env_lock() -> MutexGuard<'static, ()> {
    ENV_LOCK
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

const RENDEZVOUS_VARS: [&str; 16] = [
    "HPS_RANK",
    "HPS_WORLD_SIZE",
    "HPS_LOCAL_RANK",
    "HPS_STORE",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "HPS_COMM_TIMEOUT_MS",
];

fn clear_env() {
    for var in RENDEZVOUS_VARS.iter() {
        std::env::remove_var(var);
    }
}

#[test]
fn rendezvous_from_hpshard_run_variables() {
    let _lock = env_lock();
    clear_env();
    let err = rendezvous_from_env().expect_err("nothing set");
    assert_eq!(err.status, Status::NotFound, "{}", err);
    assert!(!err.message.is_empty());

    std::env::set_var("HPS_RANK", "2");
    std::env::set_var("HPS_WORLD_SIZE", "4");
    std::env::set_var("HPS_STORE", "file:///tmp/hps-rust-store");
    let info = rendezvous_from_env().unwrap();
    assert_eq!(info.rank, 2);
    assert_eq!(info.world_size, 4);
    assert_eq!(info.local_rank, 2, "defaults to the rank");
    assert_eq!(info.store_url, "file:///tmp/hps-rust-store");
    assert!(info.source.contains("HPS_RANK"), "{:?}", info);

    std::env::set_var("HPS_LOCAL_RANK", "1");
    assert_eq!(rendezvous_from_env().unwrap().local_rank, 1);

    // A rank outside the world is refused and names the variable.
    std::env::set_var("HPS_RANK", "9");
    let err = rendezvous_from_env().expect_err("rank 9 of 4");
    assert_eq!(err.status, Status::InvalidArgument, "{}", err);
    assert!(err.message.contains("HPS_RANK"), "{}", err);
    std::env::set_var("HPS_RANK", "two");
    assert_eq!(
        rendezvous_from_env().unwrap_err().status,
        Status::InvalidArgument
    );
    clear_env();
}

#[test]
fn rendezvous_from_torchrun_variables() {
    let _lock = env_lock();
    clear_env();
    std::env::set_var("RANK", "1");
    std::env::set_var("WORLD_SIZE", "2");
    std::env::set_var("MASTER_ADDR", "127.0.0.1");
    std::env::set_var("MASTER_PORT", "29517");
    let info = rendezvous_from_env().unwrap();
    assert_eq!((info.rank, info.world_size), (1, 2));
    assert_eq!(info.store_url, "tcp://127.0.0.1:29517");
    assert!(info.source.contains("torchrun"), "{:?}", info);
    std::env::remove_var("MASTER_PORT");
    let err = rendezvous_from_env().unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument, "{}", err);
    assert!(err.message.contains("MASTER_PORT"), "{}", err);
    clear_env();
}

#[test]
fn comm_options_defaults_read_the_environment() {
    let _lock = env_lock();
    clear_env();
    let defaults = CommOptions::library_defaults().unwrap();
    assert_eq!(defaults.timeout, Some(Duration::from_millis(300_000)));
    assert_eq!(defaults.check_arguments, Some(true));
    assert_eq!(defaults.name, None);
    std::env::set_var("HPS_COMM_TIMEOUT_MS", "1234");
    let defaults = CommOptions::library_defaults().unwrap();
    assert_eq!(defaults.timeout, Some(Duration::from_millis(1234)));
    clear_env();
}
