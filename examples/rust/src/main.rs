//! Prints the hpshard version, the devices, does a stream/event round trip, and an
//! all_reduce over two ranks that are threads meeting through a memory:// store.
use std::time::Duration;

use hpshard::{CommOptions, Communicator, DeviceType, Event, ReduceOp, Store, Stream};

fn main() -> hpshard::Result<()> {
    println!("hpshard {} (rust)", hpshard::version());

    for device_type in [DeviceType::CPU, DeviceType::CUDA].iter().copied() {
        let count = hpshard::device_count(device_type)?;
        println!("{} devices: {}", device_type, count);
        for index in 0..count {
            let p = hpshard::device_properties(device_type, index)?;
            println!(
                "  {}:{} \"{}\" memory={} bytes compute={}.{} multiprocessors={}",
                p.device_type,
                p.index,
                p.name,
                p.total_memory_bytes,
                p.compute_capability_major,
                p.compute_capability_minor,
                p.multiprocessor_count
            );
        }
    }

    hpshard::host_sync_reset()?;
    let stream = Stream::new(DeviceType::CPU, 0)?;
    let event = Event::new(DeviceType::CPU, 0)?;
    let src: Vec<u8> = (0..=255u8).collect();
    let mut dst = vec![0u8; src.len()];
    // The scope synchronises the stream before the borrows of src and dst end.
    stream.scope(|s| -> hpshard::Result<()> {
        s.memcpy_async(&mut dst, &src)?;
        event.record(s.stream())
    })?;
    event.synchronize()?;
    let completed = event.query()?;
    let ok = dst == src;
    println!(
        "round trip: {} bytes copied, equal={} event_completed={} host_syncs={}",
        dst.len(),
        ok,
        completed,
        hpshard::host_sync_count_thread()?
    );
    if !ok || !completed {
        std::process::exit(1);
    }

    // Two thread-ranks: each sums [rank + 1; 4] over the group.
    let url = format!("memory://hpshard-example-{}", std::process::id());
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let url = url.clone();
            std::thread::spawn(move || -> hpshard::Result<Vec<f32>> {
                let store = Store::open(&url, rank, Duration::from_secs(10))?;
                let options = CommOptions::new().timeout(Duration::from_secs(20));
                let comm =
                    Communicator::create(&store, rank, 2, DeviceType::CPU, 0, Some(options))?;
                let send = [(rank + 1) as f32; 4];
                let mut recv = [0f32; 4];
                // The scope waits for the operation before the borrows of send/recv end.
                comm.scope(|s| s.all_reduce(&send, &mut recv, ReduceOp::SUM)?.wait())?;
                Ok(recv.to_vec())
            })
        })
        .collect();
    let mut sums_ok = true;
    for (rank, handle) in ranks.into_iter().enumerate() {
        let sums = handle.join().expect("rank thread panicked")?;
        sums_ok &= sums.iter().all(|&x| x == 3.0);
        println!("rank {} all_reduce(sum): {:?}", rank, sums);
    }
    println!("all_reduce over 2 thread-ranks: equal={}", sums_ok);
    if !sums_ok {
        std::process::exit(1);
    }
    Ok(())
}
