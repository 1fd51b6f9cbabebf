// Tests of the safe crate: every C function of hpshard.h is reached through it, bad
// input gives the documented statuses, and streams/events round-trip data.
//
// cargo runs the tests of this file on several threads. The host-sync *total* counter
// and hps_host_sync_reset are process-wide, so every test that synchronises or resets
// holds SYNC_LOCK.

use std::sync::{Mutex, MutexGuard};

use hpshard::{
    device_count, device_properties, host_sync_count_thread, host_sync_count_total,
    host_sync_reset, last_error_message, memcpy_async, status_string, version,
    version_number, DType, DeviceType, Error, Event, Status, Stream, BINDINGS_VERSION_NUMBER,
};

static SYNC_LOCK: Mutex<()> = Mutex::new(());

fn sync_lock() -> MutexGuard<'static, ()> {
    SYNC_LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn expect_err<T: std::fmt::Debug>(result: hpshard::Result<T>, status: Status, code: u32) -> Error {
    let err = result.expect_err("the call should fail");
    assert_eq!(err.status, status, "{}", err);
    assert_eq!(err.code(), code, "{}", err);
    assert!(!err.message.is_empty(), "a failing call sets a message: {:?}", err);
    err
}

#[test]
fn version_matches_header() {
    let v = version();
    let parts: Vec<u32> = v.split('.').map(|p| p.parse().expect("numeric part")).collect();
    assert_eq!(parts.len(), 3, "{}", v);
    assert_eq!(version_number(), parts[0] * 10000 + parts[1] * 100 + parts[2]);
    assert_eq!(version_number(), BINDINGS_VERSION_NUMBER, "library and bindings differ");
    let header = std::str::from_utf8(hpshard::sys::HPS_VERSION_STRING).unwrap();
    assert_eq!(header.trim_end_matches('\0'), v);
}

#[test]
fn status_codes_and_strings() {
    for code in 0..13u32 {
        let status = Status::from_code(code);
        assert_eq!(status.code(), code);
        assert!(!matches!(status, Status::Unknown(_)));
        assert_eq!(Status::from_raw(status.to_raw()), status);
        assert_ne!(status_string(status), "unknown status", "{:?}", status);
    }
    assert_eq!(status_string(Status::Ok), "ok");
    assert_eq!(status_string(Status::Timeout), "timeout");
    assert_eq!(Status::InvalidArgument.code(), 1);
    assert_eq!(Status::OutOfRange.code(), 2);
    assert_eq!(Status::FailedPrecondition.code(), 5);
    // A code from a newer library is preserved, not undefined behaviour.
    let unknown = Status::from_code(1000);
    assert_eq!(unknown, Status::Unknown(1000));
    assert_eq!(unknown.code(), 1000);
    assert_eq!(status_string(unknown), "unknown status");
    assert_eq!(unknown.to_string(), "unknown status");
}

#[test]
fn error_display_and_last_message() {
    let err = expect_err(DType::from_raw(99).size(), Status::InvalidArgument, 1);
    // The message is thread-local and still the one of the failing call.
    assert_eq!(last_error_message(), err.message);
    let text = err.to_string();
    assert!(text.contains("(code 1)"), "{}", text);
    assert!(text.contains(&err.message), "{}", text);
    let as_std: Box<dyn std::error::Error + Send + Sync> = Box::new(err.clone());
    assert_eq!(as_std.to_string(), text);
    let own = Error::new(Status::Internal, "x");
    assert_eq!(own.status(), Status::Internal);
    assert_eq!(own.message(), "x");
}

#[test]
fn dtypes() {
    let expected = [
        (DType::FLOAT32, 4, "float32"),
        (DType::FLOAT64, 8, "float64"),
        (DType::FLOAT16, 2, "float16"),
        (DType::BFLOAT16, 2, "bfloat16"),
        (DType::INT32, 4, "int32"),
        (DType::INT64, 8, "int64"),
        (DType::UINT8, 1, "uint8"),
    ];
    assert_eq!(DType::ALL.len(), expected.len());
    for (dtype, size, name) in expected.iter() {
        assert_eq!(dtype.size().unwrap(), *size, "{:?}", dtype);
        assert_eq!(dtype.name().unwrap(), *name);
        assert_eq!(DType::from_raw(dtype.raw()), *dtype);
        assert!(DType::ALL.contains(dtype));
    }
    assert_eq!(format!("{:?}", DType::BFLOAT16), "DType(bfloat16)");
}

#[test]
fn unknown_dtype_is_invalid_argument() {
    let bad = DType::from_raw(99);
    expect_err(bad.size(), Status::InvalidArgument, 1);
    expect_err(bad.name(), Status::InvalidArgument, 1);
    assert_eq!(format!("{:?}", bad), "DType(99)");
}

#[test]
fn devices() {
    assert_eq!(device_count(DeviceType::CPU).unwrap(), 1);
    assert_eq!(DeviceType::CPU.count().unwrap(), 1);
    let cuda = device_count(DeviceType::CUDA).unwrap();
    assert!(cuda >= 0);
    expect_err(device_count(DeviceType::from_raw(99)), Status::InvalidArgument, 1);

    let cpu = device_properties(DeviceType::CPU, 0).unwrap();
    assert_eq!(cpu.device_type, DeviceType::CPU);
    assert_eq!(cpu.index, 0);
    assert!(!cpu.name.is_empty());
    assert!(cpu.multiprocessor_count >= 1, "{:?}", cpu);
    assert_eq!(cpu.compute_capability_major, 0);
    assert_eq!(cpu.compute_capability_minor, 0);
    for index in 0..cuda {
        let props = device_properties(DeviceType::CUDA, index).unwrap();
        assert_eq!(props.device_type, DeviceType::CUDA);
        assert_eq!(props.index, index);
        assert!(props.total_memory_bytes > 0, "{:?}", props);
        assert!(props.compute_capability_major > 0, "{:?}", props);
        assert!(props.multiprocessor_count > 0, "{:?}", props);
    }
    expect_err(device_properties(DeviceType::from_raw(99), 0), Status::InvalidArgument, 1);
}

#[test]
fn invalid_device_index_is_out_of_range() {
    expect_err(device_properties(DeviceType::CPU, 1), Status::OutOfRange, 2);
    expect_err(device_properties(DeviceType::CUDA, 7), Status::OutOfRange, 2);
    expect_err(device_properties(DeviceType::CPU, -1), Status::OutOfRange, 2);
    expect_err(Stream::new(DeviceType::CPU, 1), Status::OutOfRange, 2);
    expect_err(Stream::new(DeviceType::CUDA, 7), Status::OutOfRange, 2);
    expect_err(Event::new(DeviceType::CPU, 1), Status::OutOfRange, 2);
    expect_err(Event::new(DeviceType::CUDA, 7), Status::OutOfRange, 2);
    expect_err(Stream::new(DeviceType::from_raw(99), 0), Status::InvalidArgument, 1);
    expect_err(Event::new(DeviceType::from_raw(99), 0), Status::InvalidArgument, 1);
}

#[test]
fn never_recorded_event_is_failed_precondition() {
    let _lock = sync_lock();
    let stream = Stream::new(DeviceType::CPU, 0).unwrap();
    let event = Event::new(DeviceType::CPU, 0).unwrap();
    let before = host_sync_count_thread().unwrap();
    expect_err(stream.wait_event(&event), Status::FailedPrecondition, 5);
    expect_err(event.synchronize(), Status::FailedPrecondition, 5);
    expect_err(event.query(), Status::FailedPrecondition, 5);
    // Failing calls block nothing.
    assert_eq!(host_sync_count_thread().unwrap(), before);
}

#[test]
fn stream_event_round_trip_counts_host_syncs() {
    let _lock = sync_lock();
    host_sync_reset().unwrap();
    assert_eq!(host_sync_count_thread().unwrap(), 0);
    assert_eq!(host_sync_count_total().unwrap(), 0);

    let stream = Stream::new(DeviceType::CPU, 0).unwrap();
    let other = Stream::new(DeviceType::CPU, 0).unwrap();
    let event = Event::new(DeviceType::CPU, 0).unwrap();
    let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    let mut dst = vec![0u8; src.len()];
    let mut syncs = 0u64;

    let completed = stream
        .scope(|s| -> hpshard::Result<bool> {
            s.memcpy_async(&mut dst, &src)?;
            event.record(s.stream())?;
            other.wait_event(&event)?; // ordered dependency, not a host sync
            event.synchronize()?;
            event.query()
        })
        .unwrap();
    syncs += 2; // event.synchronize + the scope's final synchronize
    assert!(completed, "query after synchronize");
    assert_eq!(dst, src);

    stream.record(&event).unwrap();
    stream.synchronize().unwrap();
    other.synchronize().unwrap();
    syncs += 2;
    assert!(event.query().unwrap());

    assert_eq!(host_sync_count_thread().unwrap(), syncs);
    assert_eq!(host_sync_count_total().unwrap(), syncs);
    host_sync_reset().unwrap();
    assert_eq!(host_sync_count_thread().unwrap(), 0);
}

#[test]
fn scope_without_copies_does_not_synchronize() {
    let _lock = sync_lock();
    let stream = Stream::new(DeviceType::CPU, 0).unwrap();
    let before = host_sync_count_thread().unwrap();
    let value = stream.scope(|s| {
        let _ = s.stream();
        42
    });
    assert_eq!(value, 42);
    // Lengths differ: nothing is enqueued, so nothing to wait for.
    let src = [1u8; 4];
    let mut dst = [0u8; 3];
    let result = stream.scope(|s| s.memcpy_async(&mut dst, &src));
    expect_err(result, Status::InvalidArgument, 1);
    assert_eq!(host_sync_count_thread().unwrap(), before);
}

#[test]
fn scope_synchronizes_when_the_closure_panics() {
    let _lock = sync_lock();
    let stream = Stream::new(DeviceType::CPU, 0).unwrap();
    let src = vec![9u8; 1 << 20];
    let mut dst = vec![0u8; src.len()];
    let before = host_sync_count_thread().unwrap();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        stream.scope(|s| {
            s.memcpy_async(&mut dst, &src).unwrap();
            panic!("after enqueueing");
        })
    }));
    assert!(result.is_err());
    assert_eq!(host_sync_count_thread().unwrap(), before + 1);
    assert_eq!(dst, src);
}

#[test]
fn raw_memcpy_async() {
    let _lock = sync_lock();
    let stream = Stream::new(DeviceType::CPU, 0).unwrap();
    let src: Vec<u8> = (0..255u8).collect();
    let mut dst = vec![0u8; src.len()];
    unsafe {
        memcpy_async(dst.as_mut_ptr(), src.as_ptr(), src.len(), &stream).unwrap();
    }
    stream.synchronize().unwrap();
    assert_eq!(dst, src);
    // bytes == 0 is a no-op, even with NULL pointers.
    unsafe { memcpy_async(std::ptr::null_mut(), std::ptr::null(), 0, &stream) }.unwrap();
    // NULL with bytes > 0 is rejected.
    let result = unsafe { memcpy_async(std::ptr::null_mut(), src.as_ptr(), 4, &stream) };
    expect_err(result, Status::InvalidArgument, 1);
}

#[test]
fn cross_stream_dependency_through_an_event() {
    let _lock = sync_lock();
    let first = Stream::new(DeviceType::CPU, 0).unwrap();
    let second = Stream::new(DeviceType::CPU, 0).unwrap();
    let event = Event::new(DeviceType::CPU, 0).unwrap();
    let src = vec![0x5au8; 1 << 16];
    let mut mid = vec![0u8; src.len()];
    let mut dst = vec![0u8; src.len()];
    unsafe {
        memcpy_async(mid.as_mut_ptr(), src.as_ptr(), src.len(), &first).unwrap();
        event.record(&first).unwrap();
        second.wait_event(&event).unwrap();
        memcpy_async(dst.as_mut_ptr(), mid.as_ptr(), mid.len(), &second).unwrap();
    }
    second.synchronize().unwrap();
    first.synchronize().unwrap();
    assert_eq!(dst, src);
    assert_eq!(mid, src);
}

#[test]
fn drop_frees_handles() {
    let _lock = sync_lock();
    for _ in 0..200 {
        let stream = Stream::new(DeviceType::CPU, 0).unwrap();
        let event = Event::new(DeviceType::CPU, 0).unwrap();
        event.record(&stream).unwrap();
        drop(stream); // finishes queued work, then frees
        assert!(event.query().unwrap());
        drop(event);
    }
    // Dropping a stream finishes an enqueued copy.
    let src = vec![3u8; 1 << 20];
    let mut dst = vec![0u8; src.len()];
    let stream = Stream::new(DeviceType::CPU, 0).unwrap();
    unsafe { memcpy_async(dst.as_mut_ptr(), src.as_ptr(), src.len(), &stream) }.unwrap();
    drop(stream);
    assert_eq!(dst, src);
    // An event dropped while a stream waits on it.
    let stream = Stream::new(DeviceType::CPU, 0).unwrap();
    let event = Event::new(DeviceType::CPU, 0).unwrap();
    event.record(&stream).unwrap();
    stream.wait_event(&event).unwrap();
    drop(event);
    stream.synchronize().unwrap();
}

#[test]
fn handles_are_send_and_used_from_other_threads() {
    fn assert_send<T: Send>() {}
    assert_send::<Stream>();
    assert_send::<Event>();
    let _lock = sync_lock();
    let workers: Vec<_> = (0..4u8)
        .map(|i| {
            let stream = Stream::new(DeviceType::CPU, 0).unwrap();
            let event = Event::new(DeviceType::CPU, 0).unwrap();
            std::thread::spawn(move || {
                let src = vec![i; 1000];
                let mut dst = vec![0u8; 1000];
                stream.scope(|s| s.memcpy_async(&mut dst, &src)).unwrap();
                event.record(&stream).unwrap();
                event.synchronize().unwrap();
                assert_eq!(dst, src);
                host_sync_count_thread().unwrap()
            })
        })
        .collect();
    for worker in workers {
        // The scope's synchronize and event.synchronize, on the worker's own counter.
        assert_eq!(worker.join().unwrap(), 2);
    }
}

/// Every function of the C header is called by name in the safe crate's sources (a
/// collective by its entry `name = hps_...(...)` in the `collectives!` table).
#[test]
fn every_c_function_is_wrapped() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let header_path = root.join("../../../capi/include/hpshard/hpshard.h");
    let header = std::fs::read_to_string(&header_path).expect("read hpshard.h");
    let mut functions = Vec::new();
    for chunk in header.split("HPS_API ").skip(1) {
        let decl = chunk.split('(').next().unwrap();
        let name = decl.split_whitespace().last().unwrap().trim_start_matches('*');
        if name.starts_with("hps_") {
            functions.push(name.to_string());
        }
    }
    assert!(functions.len() >= 20, "found only {:?}", functions);
    let mut sources = String::new();
    for entry in std::fs::read_dir(root.join("src")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().map_or(false, |e| e == "rs") {
            sources.push_str(&std::fs::read_to_string(&path).unwrap());
        }
    }
    let missing: Vec<&String> = functions
        .iter()
        .filter(|f| {
            !sources.contains(&format!("sys::{}(", f)) && !sources.contains(&format!("= {}(", f))
        })
        .collect();
    assert!(missing.is_empty(), "C functions without a Rust wrapper: {:?}", missing);
}
