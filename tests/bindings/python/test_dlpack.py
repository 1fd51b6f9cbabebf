"""DLPack through the Python binding: engine and clip views as hpshard.Tensor that
numpy.from_dlpack and torch.from_dlpack (when Debian's python3-torch is installed) take
without a copy and that write through to the engine; views that keep the engine's memory
alive past close() and refuse to be used after it (never a crash); collectives and
Clip.add_tensor over any object with __dlpack__; the compute_stream option."""

import gc
import inspect
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

import hpshard
from hpshard import Clip, Communicator, DType, Engine, Store, Stream

try:
    import torch
except ImportError:  # Debian's python3-torch is optional
    torch = None

FAILED_PRECONDITION = 5
needs_torch = pytest.mark.skipif(torch is None, reason="python3-torch is not installed")


def one_rank(tag):
    url = f"memory://py-dlpack-{tag}-{uuid.uuid4().hex}"
    store = Store.open(url, 0, timeout_ms=10000)
    return store, Communicator.create(store, 0, 1, timeout_ms=20000)


class OnlyDLPack:
    """An object that offers its data through __dlpack__ only (no buffer protocol)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def sgd_step(engine, grads):
    """One step of a single-rank engine whose units are its parameter indices."""
    for i, g in enumerate(grads):
        engine.wait_parameters(0)
        engine.grad(i)[...] = g
        engine.grad_ready(i)
    engine.step()
    engine.wait_parameters(0)


def test_numpy_from_dlpack_views_write_through():
    # NumPy 1.24's from_dlpack makes read-only arrays (DLPack 0.6 has no read-only flag,
    # so NumPy assumes one): they show what the engine writes, without a copy; the
    # writable NumPy view is Tensor.numpy() (Engine.param / grad).
    store, comm = one_rank("numpy")
    with store, comm, Engine.create(comm, learning_rate=0.5) as engine:
        w = engine.add_param("w", (2, 3))
        h = engine.add_param("h", (4,), dtype=DType.FLOAT16)
        engine.seal()
        t = engine.param_tensor(w)
        assert t.shape == (2, 3) and t.dtype == DType.FLOAT32
        assert t.__dlpack_device__() == (1, 0)  # kDLCPU
        p = np.from_dlpack(t)
        assert p.shape == (2, 3) and p.dtype == np.float32
        assert p.ctypes.data == engine.param_address(w)  # no copy
        t.numpy()[...] = 1.0  # the writable view of the same memory
        assert (p == 1.0).all()
        ph = np.from_dlpack(engine.param_tensor(h))
        assert ph.dtype == np.float16 and ph.shape == (4,)
        engine.param_tensor(h).numpy()[...] = 2.0
        engine.broadcast_parameters()
        g = np.from_dlpack(engine.grad_tensor(w))
        assert g.ctypes.data == engine.grad_address(w)
        sgd_step(engine, [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4)])
        np.testing.assert_allclose(engine.gather_parameter(w),
                                   1.0 - 0.5 * np.arange(6).reshape(2, 3), rtol=1e-6)
        # The arrays made before the step see the stepped values: they are the memory.
        np.testing.assert_allclose(p, 1.0 - 0.5 * np.arange(6).reshape(2, 3), rtol=1e-6)
        np.testing.assert_allclose(ph.astype(np.float32), [1.5] * 4)


@needs_torch
def test_torch_from_dlpack_views_write_through():
    store, comm = one_rank("torch")
    with store, comm, Engine.create(comm, learning_rate=0.25) as engine:
        w = engine.add_param("w", (3,))
        b = engine.add_param("b", (2,), dtype=DType.BFLOAT16)
        engine.seal()
        p = torch.from_dlpack(engine.param_tensor(w))
        assert p.dtype == torch.float32 and tuple(p.shape) == (3,)
        assert p.data_ptr() == engine.param_address(w)
        p.fill_(2.0)
        pb = torch.from_dlpack(engine.param_tensor(b))
        assert pb.dtype == torch.bfloat16  # DLPack carries bfloat16, unlike NumPy
        pb.fill_(1.0)
        engine.broadcast_parameters()
        engine.wait_parameters(0)
        torch.from_dlpack(engine.grad_tensor(w)).copy_(torch.tensor([4.0, 0.0, -4.0]))
        engine.grad_ready(w)
        engine.grad_ready(b)
        engine.step()
        engine.wait_parameters(0)
        assert p.tolist() == [1.0, 2.0, 3.0]
        assert engine.param(b).tolist() == [0x3F80, 0x3F80]  # bf16 bits of 1.0, unchanged


def test_views_outlive_close_without_crashing():
    # The scenario of the issue: Communicator.close() closes its engines while a NumPy view
    # is held. In a child process, so a crash fails this test instead of the run.
    code = textwrap.dedent("""
        import gc, uuid, numpy as np, hpshard
        url = "memory://py-dlpack-close-" + uuid.uuid4().hex
        store = hpshard.Store.open(url, 0, timeout_ms=10000)
        comm = hpshard.Communicator.create(store, 0, 1)
        engine = hpshard.Engine.create(comm, stage=2)
        engine.add_param("w", (1 << 16,))
        engine.seal()
        view = engine.param(0)
        view[:] = 7.0
        grad = engine.grad_tensor(0)
        comm.close()  # closes the engine too
        store.close()
        assert engine.closed
        del engine
        gc.collect()
        for _ in range(3):  # the memory is still the engine's, alive for the view
            view[:] += 1.0
            assert float(view.sum()) == (7.0 + _ + 1) * (1 << 16)
        try:
            grad.numpy()
        except ValueError as e:
            assert "closed" in str(e)
        else:
            raise AssertionError("a view of a closed engine was exported")
        del view, grad
        gc.collect()
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr)


def test_tensor_of_a_closed_engine_raises_and_released_units_are_refused():
    store, comm = one_rank("closed")
    with store, comm:
        engine = Engine.create(comm, stage=3)
        engine.add_param("a", (4,), unit=0)
        engine.add_param("b", (4,), unit=1)
        engine.seal()
        engine.broadcast_parameters()
        t = engine.param_tensor(1)
        with pytest.raises(hpshard.FailedPreconditionError):  # unit 1 is not gathered
            t.numpy()
        engine.wait_parameters(1)
        a = t.numpy()
        a[:] = 1.0
        engine.release_parameters(1)
        with pytest.raises(hpshard.FailedPreconditionError):  # released: refused again
            np.from_dlpack(t)
        engine.close()
        for use in (t.numpy, t.__dlpack__, lambda: np.from_dlpack(t)):
            with pytest.raises(ValueError, match="closed hpshard.Engine"):
                use()
        del a
        gc.collect()


def test_collectives_take_dlpack_objects():
    store, comm = one_rank("coll")
    with store, comm:
        send = OnlyDLPack(np.arange(6, dtype=np.float64))
        out = np.zeros(6, dtype=np.float64)
        comm.all_reduce(send, OnlyDLPack(out)).wait()
        np.testing.assert_array_equal(out, np.arange(6))
        gathered = np.zeros(6, dtype=np.float64)
        comm.all_gather(send, OnlyDLPack(gathered)).wait()
        np.testing.assert_array_equal(gathered, np.arange(6))
        comm.broadcast(OnlyDLPack(out), root=0).wait()
        # The library checks what DLPack says: a dtype mismatch, a short recv.
        with pytest.raises(hpshard.InvalidArgumentError, match="float64 but recv is float32"):
            comm.all_reduce(send, OnlyDLPack(np.zeros(6, np.float32)))
        with pytest.raises(hpshard.InvalidArgumentError, match="send has 6 elements, recv 5"):
            comm.all_reduce(send, OnlyDLPack(np.zeros(5, np.float64)))
        with pytest.raises(hpshard.InvalidArgumentError, match="not contiguous"):
            comm.broadcast(OnlyDLPack(np.zeros(8)[::2]), root=0)
        # An engine's gradient view is a collective buffer as it is.
        with Engine.create(comm) as engine:
            engine.add_param("w", (3,))
            engine.seal()
            engine.grad(0)[:] = [1.0, 2.0, 3.0]
            total = np.zeros(3, np.float32)
            comm.all_reduce(engine.grad_tensor(0), OnlyDLPack(total)).wait()
            np.testing.assert_array_equal(total, [1.0, 2.0, 3.0])


@needs_torch
def test_collectives_and_clip_take_torch_tensors():
    store, comm = one_rank("torch-coll")
    with store, comm:
        send = torch.arange(4, dtype=torch.float32)
        recv = torch.zeros(4)
        comm.all_reduce(send, recv).wait()
        assert recv.tolist() == [0.0, 1.0, 2.0, 3.0]
        half = torch.ones(4, dtype=torch.bfloat16)
        comm.all_reduce(half, half).wait()  # bfloat16 straight from DLPack
        assert half.float().tolist() == [1.0] * 4
        grad = torch.tensor([3.0, 4.0])
        with Clip(comm, max_norm=1.0) as clip, Stream() as stream:
            clip.add_tensor(grad)
            clip.seal()
            norm = np.zeros(1, np.float32)
            clip.run(stream, norm)
            stream.synchronize()
            assert abs(norm[0] - 5.0) < 1e-6
            assert abs(float(grad[0]) - 0.6) < 1e-6  # scaled in place
            coef = torch.from_dlpack(clip.coefficient_tensor())
            assert abs(float(coef[0]) - 0.2) < 1e-6


def test_clip_takes_dlpack_objects():
    grad = np.array([3.0, 4.0], dtype=np.float32)
    with Clip(max_norm=1.0) as clip, Stream() as stream:
        clip.add_tensor(OnlyDLPack(grad))
        with pytest.raises(hpshard.InvalidArgumentError, match="unknown clip flag bits"):
            clip.add_tensor(OnlyDLPack(grad), flags=64)
        clip.seal()
        clip.run(stream)
        stream.synchronize()
        np.testing.assert_allclose(grad, [0.6, 0.8], rtol=1e-5)


# Run in a child: before the check, Clip.run scaled the gradient's freed memory (a heap
# corrupted, glibc aborting at exit), which must not take the test process with it.
_MOVED_GRADIENT = """
import numpy as np, hpshard
from hpshard import Clip, Stream
{setup}
kept = np.array([3.0, 4.0], np.float32)
with Clip(max_norm=1.0) as clip, Stream() as stream:
    clip.add_tensor(kept)               # tensor 0, through the buffer protocol
    clip.add_tensor(obj)                # tensor 1, through DLPack
    clip.seal()
    {touch}                             # writes in place keep the memory: runs
    clip.run(stream); stream.synchronize()
    assert kept[0] < 3.0, kept          # that run scaled
    before = kept.copy()
    {move}
    norm = np.full(1, -1.0, np.float32)
    try:
        clip.run(stream, norm)
        stream.synchronize()
        print("ran")
    except hpshard.FailedPreconditionError as e:
        stream.synchronize()
        assert "Clip.run: tensor 1 (" in e.message, e.message
        assert norm[0] == -1.0 and kept.tolist() == before.tolist(), (norm, kept)
        print("refused")
"""


def _run_moved_gradient(setup, touch, move):
    code = _MOVED_GRADIENT.format(setup=setup, touch=touch, move=move)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "refused", (r.returncode, r.stdout, r.stderr)


@needs_torch
@pytest.mark.parametrize("move", ["g.resize_(1 << 20); g.zero_()",
                                  "g.set_(torch.zeros(2))",
                                  "g.storage().resize_(0); g.storage().resize_(1)"])
def test_clip_refuses_a_torch_gradient_whose_memory_moved(move):
    # Clip keeps registered gradients' memory in place: torch lets a DLPack gradient be
    # resized (its storage reallocated, the registered memory freed) or given another
    # storage; run() then refuses, naming the tensor, and touches nothing.
    _run_moved_gradient("import torch\ng = torch.tensor([3.0, 4.0]); obj = g",
                        "g.mul_(2.0); g[1:].zero_()", move)


def test_clip_refuses_a_dlpack_gradient_whose_memory_moved():
    # Any other DLPack producer: a fresh export's address and shape are compared (here a
    # NumPy array offered through __dlpack__ only, resized without the reference check).
    setup = (inspect.getsource(OnlyDLPack)
             + "g = np.array([3.0, 4.0], np.float32); obj = OnlyDLPack(g)")
    _run_moved_gradient(setup, "g *= 2.0", "g.resize((1 << 20,), refcheck=False)")


def test_loss_scale_views_and_compute_stream():
    store, comm = one_rank("scale")
    with store, comm, Stream() as compute:
        with Engine.create(comm, dynamic_loss_scaling=True, initial_loss_scale=8.0,
                           compute_stream=compute) as engine:
            assert engine.options.compute_stream is compute
            engine.add_param("w", (2,))
            engine.seal()
            assert engine.loss_scale == 8.0 and engine.skipped_steps == 0
            s = np.from_dlpack(engine.loss_scale_tensor())
            assert s.ctypes.data == engine.loss_scale_addresses[0] and s[0] == 8.0
            k = engine.skipped_steps_tensor().numpy()
            assert k.dtype == np.int64 and not k.flags.writeable
        with pytest.raises(TypeError):
            Engine.create(comm, compute_stream="not a stream")


def test_read_only_views_are_refused_where_written():
    # The engine's loss scale, skipped-step count and norm, and a clip's coefficient, are
    # read-only views: refused as what a collective or a clip writes (as their read-only
    # NumPy arrays are), taken as what it reads; the engine's values are unchanged.
    store, comm = one_rank("read-only")
    with store, comm, Engine.create(comm, dynamic_loss_scaling=True, initial_loss_scale=8.0,
                                    clip_max_norm=1.0) as engine:
        engine.add_param("w", (2,))
        engine.seal()
        scale, skipped = engine.loss_scale_tensor(), engine.skipped_steps_tensor()
        norm = engine.grad_norm_tensor()
        before = (engine.loss_scale, engine.skipped_steps, engine.grad_norm)
        one_f, one_i = np.array([7.0], np.float32), np.array([-5], np.int64)
        attempts = [
            ("all_reduce: recv", lambda: comm.all_reduce(one_f, scale)),
            ("reduce: recv", lambda: comm.reduce(one_f, norm, root=0)),
            ("broadcast: buffer", lambda: comm.broadcast(skipped, root=0)),
            ("all_gather: recv", lambda: comm.all_gather(one_i, skipped)),
            ("reduce_scatter: recv", lambda: comm.reduce_scatter(one_f, scale)),
            ("recv: buffer", lambda: comm.recv(scale, peer=0)),
        ]
        for what, call in attempts:
            with pytest.raises(ValueError, match=f"^{what} is read-only"):
                call()
        with Clip(max_norm=1.0) as clip:
            with pytest.raises(ValueError, match="Clip.add_tensor: grad is read-only"):
                clip.add_tensor(scale)
        assert (engine.loss_scale, engine.skipped_steps) == before[:2]
        assert np.isnan(engine.grad_norm) == np.isnan(before[2])
        # As a send, a read-only view is read.
        total = np.zeros(1, np.float32)
        comm.all_reduce(scale, total).wait()
        assert total[0] == 8.0
