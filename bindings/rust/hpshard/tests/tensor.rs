//! DLPack views through the Rust crate: `Tensor`s that describe engine and clip memory and
//! keep it alive past the engine; the library's host/device policy; collectives and clip
//! registration over DLPack tensors; the compute stream option.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hpshard::{
    sys, Clip, ClipFlags, ClipOptions, CommOptions, Communicator, DType, DeviceType, Engine,
    EngineOptions, ParamFlags, ReduceOp, Status, Store, Stream, Tensor,
};

fn one_rank(tag: &str) -> Communicator {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let url = format!(
        "memory://rust-tensor-{}-{}-{}",
        tag,
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    );
    let store = Store::open(&url, 0, Duration::from_secs(10)).unwrap();
    let options = CommOptions::new().timeout(Duration::from_secs(20));
    Communicator::create(&store, 0, 1, DeviceType::CPU, 0, Some(options)).unwrap()
}

/// A DLPack tensor of another framework, built by hand over `data`, on `device_type`
/// (dlpack.h: 1 CPU, 2 CUDA): no GPU is needed to see where the library draws the line.
struct Foreign {
    managed: Box<sys::DLManagedTensor>,
    _shape: Box<[i64; 1]>,
}

impl Foreign {
    fn new(data: &mut [f32], device_type: sys::DLDeviceType) -> Foreign {
        let mut shape = Box::new([data.len() as i64]);
        let managed = Box::new(sys::DLManagedTensor {
            dl_tensor: sys::DLTensor {
                data: data.as_mut_ptr().cast(),
                device: sys::DLDevice {
                    device_type,
                    device_id: 0,
                },
                ndim: 1,
                dtype: sys::DLDataType {
                    code: 2,
                    bits: 32,
                    lanes: 1,
                }, // float32
                shape: shape.as_mut_ptr(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: None, // the Box owns it
        });
        Foreign {
            managed,
            _shape: shape,
        }
    }

    fn tensor(&mut self) -> Tensor {
        // SAFETY: valid while `self` lives (the tests drop the Tensor first); no deleter,
        // so the Tensor's release does nothing.
        unsafe { Tensor::from_raw(std::ptr::NonNull::from(&mut *self.managed)) }
    }
}

#[test]
fn views_describe_the_memory_and_keep_it_alive() {
    let mut comm = one_rank("alive");
    let options = EngineOptions::default().learning_rate(0.5);
    let mut engine = Engine::new(&mut comm, None, options).unwrap();
    let w = engine
        .add_param("w", &[2, 3], DType::FLOAT32, ParamFlags::NONE, 0)
        .unwrap();
    let h = engine
        .add_param("h", &[4], DType::BFLOAT16, ParamFlags::NONE, 0)
        .unwrap();
    engine.seal().unwrap();
    engine.param(w).unwrap().fill(1.0);
    engine.broadcast_parameters().unwrap();
    let p = engine.param_tensor(w).unwrap();
    assert_eq!(p.shape(), &[2, 3]);
    assert_eq!(p.numel(), 6);
    assert_eq!(p.dtype(), Some(DType::FLOAT32));
    assert_eq!(p.device(), (DeviceType::CPU, 0));
    assert_eq!(p.data_ptr(), engine.param_ptr(w).unwrap().cast());
    assert_eq!(p.host_ptr().unwrap(), p.data_ptr());
    assert_eq!(
        engine.grad_tensor(h).unwrap().dtype(),
        Some(DType::BFLOAT16)
    );
    for (k, g) in engine.grad(w).unwrap().iter_mut().enumerate() {
        *g = k as f32;
    }
    engine.grad_ready(w, None).unwrap();
    engine.grad_ready(h, None).unwrap();
    engine.step().unwrap();
    engine.wait_parameters(0).unwrap();
    drop(engine); // the tensor keeps the engine's memory
    drop(comm);
    let data = p.host_ptr().unwrap() as *const f32;
    // SAFETY: 6 f32s of host memory the tensor keeps alive; nothing writes them now.
    let stepped = unsafe { std::slice::from_raw_parts(data, 6) }.to_vec();
    let want: Vec<f32> = (0..6).map(|k| 1.0 - 0.5 * k as f32).collect();
    assert_eq!(stepped, want);
    drop(p); // the last reference: the engine goes
}

#[test]
fn stage_three_views_exist_while_the_unit_is_gathered() {
    let mut comm = one_rank("stage3");
    let mut engine = Engine::new(&mut comm, None, EngineOptions::default().stage(3)).unwrap();
    engine
        .add_param("a", &[4], DType::FLOAT32, ParamFlags::NONE, 0)
        .unwrap();
    engine
        .add_param("b", &[4], DType::FLOAT32, ParamFlags::NONE, 1)
        .unwrap();
    engine.seal().unwrap();
    engine.broadcast_parameters().unwrap();
    let err = engine.param_tensor(1).unwrap_err();
    assert_eq!(err.status(), Status::FailedPrecondition, "{}", err);
    engine.wait_parameters(1).unwrap();
    assert_eq!(engine.param_tensor(1).unwrap().numel(), 4);
    engine.release_parameters(1).unwrap();
    assert_eq!(
        engine.param_tensor(1).unwrap_err().status(),
        Status::FailedPrecondition
    );
}

#[test]
fn the_host_device_policy_is_the_librarys() {
    let mut data = [3.0f32, 4.0];
    let mut cuda = Foreign::new(&mut data, sys::DLDeviceType_kDLCUDA);
    {
        let t = cuda.tensor();
        assert_eq!(t.device(), (DeviceType::CUDA, 0));
        let err = t.host_ptr().unwrap_err();
        assert_eq!(err.status(), Status::FailedPrecondition);
        assert!(err.message().contains("cuda:0"), "{}", err);
        let comm = one_rank("policy");
        // SAFETY: the tensors' memory outlives the (refused) call.
        let err = unsafe {
            comm.all_reduce_dlpack(t.as_dltensor(), t.as_dltensor(), ReduceOp::SUM, None)
        }
        .unwrap_err();
        assert_eq!(err.status(), Status::InvalidArgument);
        assert!(
            err.message()
                .contains("on cuda:0 but the operation runs on cpu:0"),
            "{}",
            err
        );
    }
    let mut cpu = Foreign::new(&mut data, sys::DLDeviceType_kDLCPU);
    let t = cpu.tensor();
    assert_eq!(t.host_ptr().unwrap(), t.data_ptr());
}

#[test]
fn collectives_and_the_clip_take_dlpack_tensors() {
    let comm = one_rank("coll");
    let mut send = [1.0f32, 2.0];
    let mut recv = [0.0f32; 2];
    let mut s = Foreign::new(&mut send, sys::DLDeviceType_kDLCPU);
    let mut r = Foreign::new(&mut recv, sys::DLDeviceType_kDLCPU);
    let (st, rt) = (s.tensor(), r.tensor());
    // SAFETY: both tensors' memory lives until the works completed (waited below).
    unsafe {
        comm.all_reduce_dlpack(st.as_dltensor(), rt.as_dltensor(), ReduceOp::SUM, None)
            .unwrap()
            .wait()
            .unwrap();
        comm.broadcast_dlpack(rt.as_dltensor(), 0, None)
            .unwrap()
            .wait()
            .unwrap();
        comm.all_gather_dlpack(st.as_dltensor(), rt.as_dltensor(), None)
            .unwrap()
            .wait()
            .unwrap();
        comm.reduce_scatter_dlpack(st.as_dltensor(), rt.as_dltensor(), ReduceOp::MAX, None)
            .unwrap()
            .wait()
            .unwrap();
        comm.reduce_dlpack(st.as_dltensor(), rt.as_dltensor(), ReduceOp::SUM, 0, None)
            .unwrap()
            .wait()
            .unwrap();
    }
    drop((st, rt));
    assert_eq!(recv, [1.0, 2.0]);
    let stream = Stream::new(DeviceType::CPU, 0).unwrap();
    let mut grad = [3.0f32, 4.0];
    let mut g = Foreign::new(&mut grad, sys::DLDeviceType_kDLCPU);
    let gt = g.tensor();
    let mut clip = Clip::new(Some(&comm), None, None, ClipOptions::new(1.0)).unwrap();
    // SAFETY: the gradient outlives the clip (dropped at the end of this block's scope).
    unsafe { clip.add_tensor_dlpack(gt.as_dltensor(), ClipFlags::NONE) }.unwrap();
    clip.seal().unwrap();
    let norm = clip.run(&stream, true).unwrap();
    assert!((norm - 5.0).abs() < 1e-6);
    let coefficient = clip.coefficient_tensor().unwrap();
    assert_eq!(coefficient.shape(), &[1]);
    drop(clip);
    // SAFETY: the tensor keeps the clip's memory; the run has finished.
    let c = unsafe { *(coefficient.host_ptr().unwrap() as *const f32) };
    assert!((c - 0.2).abs() < 1e-6);
    drop(gt);
    assert!((grad[0] - 0.6).abs() < 1e-6);
}

#[test]
fn compute_stream_and_loss_scale_views() {
    let mut comm = one_rank("compute");
    let stream = Stream::new(DeviceType::CPU, 0).unwrap();
    let options = EngineOptions::default()
        .dynamic_loss_scaling(true)
        .initial_loss_scale(8.0);
    let mut engine = Engine::with_compute_stream(&mut comm, None, options, &stream).unwrap();
    drop(stream); // the library keeps it for the engine
    engine
        .add_param("w", &[2], DType::FLOAT32, ParamFlags::NONE, 0)
        .unwrap();
    engine.seal().unwrap();
    assert_eq!(engine.loss_scale().unwrap(), 8.0);
    let (scale, skipped) = engine.loss_scale_tensors().unwrap();
    assert_eq!(scale.dtype(), Some(DType::FLOAT32));
    assert_eq!(skipped.dtype(), Some(DType::INT64));
    assert_eq!(
        scale.host_ptr().unwrap() as *const f32,
        engine.loss_scale_ptrs().unwrap().0
    );
}
