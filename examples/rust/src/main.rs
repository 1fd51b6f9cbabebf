//! Prints the hpshard version, the devices, and does a stream/event round trip.
use hpshard::{DeviceType, Event, Stream};

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
    Ok(())
}
