//! The Rust consumer of the installed crates: a one-rank engine step.
use std::time::Duration;

use hpshard::{Communicator, DType, DeviceType, Engine, EngineOptions, ParamFlags, Store};

fn main() -> hpshard::Result<()> {
    let store = Store::open("memory://package-rust", 0, Duration::from_secs(10))?;
    let mut comm = Communicator::create(&store, 0, 1, DeviceType::CPU, 0, None)?;
    let mut engine = Engine::new(&mut comm, None, EngineOptions::default().learning_rate(0.5))?;
    let w = engine.add_param("w", &[2], DType::FLOAT32, ParamFlags::NONE, 0)?;
    engine.seal()?;
    engine.param(w)?.fill(1.0);
    engine.broadcast_parameters()?;
    engine.grad(w)?.copy_from_slice(&[2.0, 4.0]);
    engine.grad_ready(w, None)?;
    engine.step()?;
    let got = engine.gather_parameter(w)?;
    assert_eq!(got, vec![0.0, -1.0]);
    println!("rust consumer: hpshard {}", hpshard::version());
    Ok(())
}
