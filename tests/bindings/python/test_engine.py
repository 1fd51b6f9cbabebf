"""Hybrid global-norm clipping and the sharded training engine through the Python binding:
hpshard.Clip / hpshard.Engine (and the capi functions under them). Ranks are threads meeting
through a memory:// store; every multi-rank test is bounded by thread join timeouts."""

import ctypes
import gc
import math
import os
import signal
import threading
import time
import uuid
import weakref

import numpy as np
import pytest

import hpshard
from hpshard import (Clip, ClipFlag, ClipOptions, Communicator, DType, Engine, EngineOptions,
                     Optimizer, ParamFlag, Store, Stream, capi)
from test_comm import run_ranks, status_of, unique_url

INVALID_ARGUMENT = 1
OUT_OF_RANGE = 2
NOT_FOUND = 3
FAILED_PRECONDITION = 5
UNIMPLEMENTED = 6


def world(rank, url, size=2):
    store = Store.open(url, rank, timeout_ms=10000)
    comm = Communicator.create(store, rank, size, timeout_ms=20000)
    return store, comm


# ---- clip: the low-level layer -------------------------------------------------------------
def test_capi_clip_options():
    o = capi.clip_options_init(capi.clip_options_struct_size())
    assert o.struct_size == capi.clip_options_struct_size()
    assert o.max_norm == 1.0 and o.deterministic == 0
    assert status_of(lambda: capi.clip_options_init(3)) == INVALID_ARGUMENT
    assert ClipOptions.struct_size() == capi.clip_options_struct_size()
    assert ClipOptions.defaults() == ClipOptions(max_norm=1.0, deterministic=False)
    o.max_norm = 0.0
    assert status_of(lambda: capi.ClipHandle.create(None, None, None, o)) == INVALID_ARGUMENT
    assert capi.HPS_CLIP_DISTRIBUTED == 1 and capi.HPS_CLIP_NO_CLIP == 2
    assert capi.HPS_CLIP_SHARED_NOT_FIRST == 4
    assert not hasattr(capi, "HPS_CLIP_FLAG_FORCE32")


def test_capi_clip_round_trip_and_buffer_checks():
    clip = capi.ClipHandle.create(None, None, None, None)  # default options
    s = capi.StreamHandle.create(capi.HPS_DEVICE_CPU, 0)
    g = np.array([3.0, 4.0], dtype=np.float32)
    with pytest.raises(ValueError):  # 3 float32 do not fit in 2
        clip.add_tensor(g, 3, capi.HPS_DTYPE_FLOAT32, 0)
    with pytest.raises(ValueError):  # read-only
        clip.add_tensor(bytes(8), 2, capi.HPS_DTYPE_FLOAT32, 0)
    assert status_of(lambda: clip.add_tensor(None, 2, capi.HPS_DTYPE_FLOAT32, 0)) \
        == INVALID_ARGUMENT
    clip.add_tensor(g, 2, capi.HPS_DTYPE_FLOAT32, 0)
    clip.seal()
    with pytest.raises(ValueError):  # no room for one float32
        clip.run(s, bytearray(2), 1)
    norm = np.zeros(1, dtype=np.float32)
    clip.run(s, norm, 1)
    s.synchronize()
    assert abs(norm[0] - 5.0) < 1e-6
    address = clip.coefficient()
    assert isinstance(address, int) and address != 0
    view = clip.coefficient_dlpack()  # a "dltensor" capsule
    assert capi.dlpack_host_data(view) == address


# ---- clip: one rank ----------------------------------------------------------------------
def test_clip_single_rank():
    grads = np.array([3.0, 4.0], dtype=np.float32)
    frozen = np.array([100.0, 100.0], dtype=np.float32)
    shared = np.array([0.0], dtype=np.float64)
    with Clip(max_norm=1.0) as clip, Stream() as stream:
        assert clip.options == ClipOptions(1.0, False)
        clip.add_tensor(grads)
        clip.add_tensor(frozen, clip=False)
        clip.add_tensor(shared, shared_not_first=True)
        norm = np.full(1, -1.0, dtype=np.float32)
        assert status_of(lambda: clip.run(stream, norm)) == FAILED_PRECONDITION
        clip.seal()
        assert status_of(clip.seal) == FAILED_PRECONDITION
        assert status_of(lambda: clip.add_tensor(grads)) == FAILED_PRECONDITION
        hpshard.host_sync_reset()
        clip.run(stream, norm)
        assert hpshard.host_sync_count_thread() == 0  # nothing blocks the host
        stream.synchronize()
        assert abs(norm[0] - 5.0) < 1e-6
        coef = 1.0 / (5.0 + 1e-6)
        np.testing.assert_allclose(grads, [3.0 * coef, 4.0 * coef], rtol=1e-6)
        np.testing.assert_array_equal(frozen, [100.0, 100.0])  # NO_CLIP: untouched
        c = clip.coefficient()
        assert c.shape == (1,) and c.dtype == np.float32 and not c.flags.writeable
        assert abs(c[0] - coef) < 1e-6
        assert clip.coefficient_address == c.ctypes.data
        t = clip.coefficient_tensor()
        assert t.__dlpack_device__() == (1, 0) and t.shape == (1,)
        assert np.from_dlpack(t)[0] == c[0]
        # scale=False: the norm only (of the already scaled gradients), nothing scaled
        before = grads.copy()
        clip.run(stream, norm, scale=False)
        clip.run(stream)  # norm_out None
        stream.synchronize()
        assert abs(norm[0] - 1.0) < 1e-5
        np.testing.assert_allclose(grads, before * (1.0 / (float(np.linalg.norm(before)) + 1e-6)),
                                   rtol=1e-5)
    assert clip.closed
    clip.close()  # harmless


def test_clip_keeps_its_gradients_alive():
    clip = Clip(max_norm=10.0)
    g = np.ones(4, dtype=np.float32)
    ref = weakref.ref(g)
    clip.add_tensor(g)
    del g
    gc.collect()
    assert ref() is not None  # the clip still holds it
    clip.close()
    gc.collect()
    assert ref() is None


def test_clip_bad_input():
    assert status_of(lambda: Clip(max_norm=0.0)) == INVALID_ARGUMENT
    assert status_of(lambda: Clip(max_norm=float("inf"))) == INVALID_ARGUMENT
    with Clip() as clip:
        assert status_of(lambda: clip.add_tensor(np.array([1, 2], dtype=np.int32))) \
            == INVALID_ARGUMENT
        assert status_of(lambda: clip.add_tensor(np.zeros(2, np.float32), flags=64)) \
            == INVALID_ARGUMENT
        with pytest.raises(ValueError):
            clip.add_tensor(np.zeros(4, np.float32)[::2])  # not contiguous
        with Stream() as stream:
            assert status_of(lambda: clip.run(stream)) == FAILED_PRECONDITION  # before seal
            with pytest.raises(ValueError):
                clip.run(stream, np.zeros(1, np.float64))
        with pytest.raises(TypeError):
            clip.run("not a stream")
    with pytest.raises(TypeError):
        Clip(mp="not a communicator")


def clip_mp_rank(mismatched):
    def rank(r, url):
        w = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)[2 * r:2 * r + 2].copy()
        b = np.array([5.0, 6.0], dtype=np.float32)
        store, mp = world(r, url)
        with store, mp, Stream() as stream:
            clip = Clip(mp=mp, max_norm=100.0, deterministic=True)
            distributed = not (mismatched and r == 1)
            clip.add_tensor(w, distributed=distributed)
            clip.add_tensor(b)
            norm = np.full(1, -1.0, dtype=np.float32)
            if mismatched:
                with pytest.raises(hpshard.Error) as info:
                    clip.seal()
                assert info.value.status == INVALID_ARGUMENT
                assert "mp" in info.value.message
                assert status_of(lambda: clip.run(stream, norm)) == FAILED_PRECONDITION
            else:
                clip.seal()
                clip.run(stream, norm)
                stream.synchronize()
            assert not clip.closed
        assert clip.closed  # closing the communicator closed the clip first
        return float(norm[0])
    return rank


def test_clip_two_ranks_mp_group():
    norms = run_ranks(2, clip_mp_rank(False), "clip-mp")
    # sqrt(1 + 4 + 9 + 16 + 25 + 36): w counted once in halves, b once though on both ranks
    assert abs(norms[0] - math.sqrt(91.0)) < 1e-5
    assert norms[0] == norms[1]


def test_clip_mp_ranks_with_different_flags():
    run_ranks(2, clip_mp_rank(True), "clip-mismatch")


# ---- engine: the low-level layer ---------------------------------------------------------
def test_engine_learning_rate_is_checked():
    store = Store.open(f"memory://lr-{uuid.uuid4().hex}", 0, timeout_ms=5000)
    with store, Communicator.create(store, 0, 1) as comm, Engine.create(comm) as engine:
        for bad in (-1.0, float("nan"), float("inf")):
            assert status_of(lambda: engine.set_learning_rate(bad)) == INVALID_ARGUMENT
        engine.set_learning_rate(0.0)


def test_capi_engine_options_and_null_handles():
    o = capi.engine_options_init(capi.engine_options_struct_size())
    assert o.struct_size == capi.engine_options_struct_size()
    assert o.stage == 2 and o.optimizer == capi.HPS_OPTIMIZER_SGD
    assert o.accumulation_steps == 1 and o.alignment_bytes > 0
    assert abs(o.learning_rate - 0.01) < 1e-7 and abs(o.beta2 - 0.999) < 1e-7
    o.momentum = 0.5
    assert o.momentum == 0.5
    assert status_of(lambda: capi.engine_options_init(3)) == INVALID_ARGUMENT
    assert EngineOptions.struct_size() == capi.engine_options_struct_size()
    # An older caller's struct_size (0.1.0's, before compute_stream) is accepted.
    assert EngineOptions.struct_size(96) == 96
    assert not o.has_compute_stream()
    d = EngineOptions.defaults()
    assert d.stage == 2 and d.optimizer == Optimizer.SGD and d.accumulation_steps == 1
    assert d.prefetch_window == o.prefetch_window >= 1
    assert status_of(lambda: capi.EngineHandle.create(None, None, None)) == INVALID_ARGUMENT
    assert "sharding is NULL" in hpshard.last_error_message()
    count, ns = capi.dependency_wait_stats()
    assert count >= 0 and ns >= 0
    assert hpshard.dependency_wait_stats()[0] >= count
    assert (capi.HPS_PARAM_FROZEN, capi.HPS_PARAM_DISTRIBUTED, capi.HPS_PARAM_NO_CLIP,
            capi.HPS_PARAM_SHARED_NOT_FIRST, capi.HPS_PARAM_NO_WEIGHT_DECAY) == (1, 2, 4, 8, 16)
    assert (Optimizer.SGD, Optimizer.ADAMW) == (0, 1)
    assert int(ParamFlag.FROZEN | ParamFlag.NO_CLIP) == 5


def test_engine_single_rank_views_and_errors():
    store, comm = world(0, f"memory://py-engine1-{uuid.uuid4().hex}", size=1)
    with store, comm:
        with pytest.raises(TypeError):
            Engine.create("not a communicator")
        assert status_of(lambda: Engine.create(comm, stage=4)) == INVALID_ARGUMENT
        engine = Engine.create(comm, learning_rate=0.5)
        with engine:
            w = engine.add_param("w", (2, 3), unit=0)
            b = engine.add_param("b", [3], dtype=np.float32, unit=1)
            f = engine.add_param("frozen", (2,), frozen=True, unit=1)
            assert (w, b, f) == (0, 1, 2) and engine.num_params == 3
            assert engine.name(1) == "b"
            assert status_of(lambda: engine.add_param("w", (1,))) == 4  # ALREADY_EXISTS
            assert status_of(lambda: engine.add_param("h", (2,), dtype=DType.FLOAT64)) \
                == UNIMPLEMENTED
            assert status_of(lambda: engine.add_param("u", (2,), flags=1 << 10)) \
                == INVALID_ARGUMENT
            assert status_of(lambda: engine.param(w)) == FAILED_PRECONDITION  # not sealed
            assert status_of(engine.step) == FAILED_PRECONDITION
            engine.seal()
            assert status_of(lambda: engine.add_param("late", (1,))) == FAILED_PRECONDITION
            p = engine.param(w)
            assert p.shape == (2, 3) and p.dtype == np.float32 and p.flags.writeable
            np.testing.assert_array_equal(p, np.zeros((2, 3)))  # zero-filled
            p[:] = np.arange(6, dtype=np.float32).reshape(2, 3)
            again = engine.param(w)
            assert again.ctypes.data == p.ctypes.data  # a view, not a copy
            np.testing.assert_array_equal(again, p)
            assert status_of(lambda: engine.grad(f)) == FAILED_PRECONDITION  # frozen
            assert status_of(lambda: engine.param(99)) == OUT_OF_RANGE
            assert status_of(lambda: engine.shard_range(99)) == OUT_OF_RANGE
            assert engine.shard_range(w) == (0, 6)  # one rank holds everything
            assert engine.resident_bytes > 0
            assert status_of(lambda: engine.wait_parameters(7)) == NOT_FOUND
            assert status_of(lambda: engine.release_parameters(7)) == NOT_FOUND
            for unit in (0, 1):
                engine.wait_parameters(unit)
                engine.release_parameters(unit)  # stage 2: nothing
                engine.wait_parameters(unit)
            engine.grad(w)[:] += 1.0
            engine.grad(b)[:] += 2.0
            assert status_of(lambda: engine.grad_ready(f)) == FAILED_PRECONDITION  # frozen
            assert status_of(lambda: engine.grad_ready(99)) == OUT_OF_RANGE
            with Stream() as ready:
                engine.grad_ready(w, ready)  # produced on a stream
                engine.grad_ready(b)
                engine.step()
                engine.synchronize()
            engine.wait_parameters(0)
            np.testing.assert_allclose(engine.param(w),
                                       np.arange(6).reshape(2, 3) - 0.5, rtol=1e-6)
            np.testing.assert_allclose(engine.param(b), [-1.0] * 3, rtol=1e-6)
            view = engine.grad(b)
        assert engine.closed
        engine.close()  # harmless
        del view


def test_views_kept_past_close_let_the_communicator_go():
    """Rank 1 closes its engine (or clip) and communicator while it still holds views of
    their memory: it has left, and rank 0's next collective learns it at once (ABORTED)
    rather than at its 20 s timeout; the views still read the step's values."""
    left, checked = threading.Event(), threading.Event()

    def rank(r, url):
        store, comm = world(r, url)
        with store:
            engine = Engine.create(comm, clip_max_norm=1.0)
            w = engine.add_param("w", (4,))
            engine.seal()
            engine.broadcast_parameters()
            engine.wait_parameters(0)
            engine.grad(w)[:] = 1.0
            engine.grad_ready(w)
            engine.step()
            engine.wait_parameters(0)
            clip = Clip(comm)
            grad = np.array([3.0, 4.0], np.float32)
            clip.add_tensor(grad)
            clip.seal()
            with Stream() as stream:
                clip.run(stream)
                stream.synchronize()
            if r == 1:
                views = (engine.param(w), engine.grad_norm_tensor().numpy(), clip.coefficient())
                engine.close()
                clip.close()
                comm.close()
                left.set()
                assert checked.wait(30)
                np.testing.assert_allclose(views[0], [-0.005] * 4, rtol=1e-5)  # 0 - 0.01 * 1/2
                assert views[1][0] == 2.0  # the norm of the mean gradient
                assert abs(views[2][0] - 1 / math.sqrt(50)) < 1e-6
                return None
            assert left.wait(30)
            start = time.monotonic()
            try:
                comm.all_reduce(np.ones(1, np.float32), np.zeros(1, np.float32)).wait()
                code = 0
            except hpshard.Error as e:
                code = e.status_name
            checked.set()
            engine.close()
            clip.close()
            comm.close()
            return code, time.monotonic() - start

    (code, seconds), _ = run_ranks(2, rank, "views-let-go")
    assert code == "ABORTED" and seconds < 10


def test_engine_view_keeps_the_engine_alive():
    store, comm = world(0, f"memory://py-engine-ref-{uuid.uuid4().hex}", size=1)
    with store, comm:
        engine = Engine.create(comm)
        engine.add_param("w", (4,))
        engine.seal()
        view = engine.param(0)
        ref = weakref.ref(engine)
        del engine
        gc.collect()
        assert ref() is not None and not ref().closed
        view[:] = 3.0
        assert ref().param(0)[2] == 3.0
        del view
        gc.collect()
        assert ref() is None  # collected (and destroyed) once the views are gone


# ---- engine: two thread-ranks against an unsharded reference -----------------------------
SHAPES = {"layer0.weight": ((3, 4), 0), "layer0.bias": ((4,), 0), "layer1.weight": ((4, 2), 1)}
LR = 0.1
STEPS = 3


def initial(name):
    shape, _ = SHAPES[name]
    n = int(np.prod(shape))
    return (np.sin(np.arange(n, dtype=np.float32) * 0.7 + len(name))).reshape(shape) \
        .astype(np.float32)


def gradient(name, step, rank):
    shape, _ = SHAPES[name]
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.float32)
    return (np.cos(i * 0.3 + step * 1.1 + rank * 0.5 + len(name)) * (rank + 1)) \
        .astype(np.float32).reshape(shape)


def schedule(step):
    """A warm-up of the learning rate over the steps (set before each)."""
    return LR * (step + 1) / STEPS


def test_engine_two_ranks_sgd_matches_unsharded_reference():
    def rank(r, url):
        store, comm = world(r, url)
        with store, comm:
            engine = Engine.create(comm, learning_rate=LR)
            with engine:
                index = {n: engine.add_param(n, shape, unit=unit)
                         for n, (shape, unit) in SHAPES.items()}
                engine.seal()
                for n, i in index.items():
                    engine.param(i)[...] = initial(n) if r == 0 else 0.0
                engine.broadcast_parameters()
                for n, i in index.items():
                    np.testing.assert_array_equal(engine.param(i), initial(n))
                ranges = {n: engine.shard_range(i) for n, i in index.items()}
                syncs = []
                for step in range(STEPS):
                    hpshard.host_sync_reset()
                    engine.set_learning_rate(schedule(step))  # a schedule, without a sync
                    for unit in (0, 1):
                        engine.wait_parameters(unit)
                    for n in reversed(list(index)):  # backward order
                        g = engine.grad(index[n])
                        np.testing.assert_array_equal(g, 0.0)  # zero at every step's start
                        g += gradient(n, step, r)
                        engine.grad_ready(index[n])
                    for unit in (1, 0):
                        engine.release_parameters(unit)
                    engine.step()
                    syncs.append(hpshard.host_sync_count_thread())
                engine.synchronize()
                for unit in (0, 1):
                    engine.wait_parameters(unit)
                final = {n: engine.param(i).copy() for n, i in index.items()}
                waits = hpshard.dependency_wait_stats()
            return final, syncs, ranges, waits

    results = run_ranks(2, rank, "engine-sgd")
    reference = {n: initial(n) for n in SHAPES}
    for step in range(STEPS):
        for n in SHAPES:
            mean = (gradient(n, step, 0) + gradient(n, step, 1)) / np.float32(2)
            reference[n] = (reference[n] - np.float32(schedule(step)) * mean).astype(np.float32)
    for r, (final, syncs, ranges, waits) in enumerate(results):
        assert syncs == [0] * STEPS, f"rank {r}: host syncs in step() {syncs}"
        for n in SHAPES:
            np.testing.assert_allclose(final[n], reference[n], rtol=1e-6, atol=1e-7,
                                       err_msg=f"rank {r} {n}")
        assert waits[0] >= 0 and waits[1] >= 0
    # The two ranks' shards cover every parameter exactly once.
    for n, (shape, _) in SHAPES.items():
        size = int(np.prod(shape))
        covered = np.zeros(size, dtype=int)
        for _, _, ranges, _ in results:
            begin, end = ranges[n]
            assert 0 <= begin <= end <= size
            covered[begin:end] += 1
        assert (covered == 1).all(), f"{n}: {covered}"


def test_engine_two_ranks_gather_parameter():
    initial = (np.arange(5, dtype=np.float32) * np.float32(1.25) + np.float32(0.5))

    def rank(r, url):
        store, comm = world(r, url)
        with store, comm:
            with Engine.create(comm) as engine:
                w = engine.add_param("w", (5,))
                assert status_of(lambda: engine.gather_parameter(w)) == FAILED_PRECONDITION
                engine.seal()
                engine.param(w)[...] = initial if r == 0 else 0.0
                engine.broadcast_parameters()
                got = engine.gather_parameter(w)
                assert status_of(lambda: engine.gather_parameter(3)) == OUT_OF_RANGE
                # The low-level call refuses a buffer too small for count.
                with pytest.raises(ValueError):
                    engine._h().gather_parameter(w, np.empty(2, np.float32), 5)
                return got

    for r, got in enumerate(run_ranks(2, rank, "engine-gather")):
        assert got.dtype == np.float32 and got.shape == (5,), f"rank {r}"
        np.testing.assert_array_equal(got, initial, err_msg=f"rank {r}")


LS_STEPS = 5
LS_SHAPE = (5,)


def ls_gradient(step, rank):
    i = np.arange(LS_SHAPE[0], dtype=np.float32)
    return (np.cos(i * 0.4 + step * 0.9 + rank * 0.3) * (rank + 1)).astype(np.float32)


def test_engine_options_loss_scaling_defaults():
    d = EngineOptions.defaults()
    assert d.dynamic_loss_scaling is False
    assert (d.initial_loss_scale, d.growth_factor, d.backoff_factor, d.growth_interval) \
        == (65536.0, 2.0, 0.5, 2000)
    o = EngineOptions()
    assert (o.dynamic_loss_scaling, o.initial_loss_scale, o.growth_factor, o.backoff_factor,
            o.growth_interval) == (False, 65536.0, 2.0, 0.5, 2000)


def test_engine_two_ranks_dynamic_loss_scaling():
    initial_w = np.linspace(-1.0, 1.0, LS_SHAPE[0], dtype=np.float32)

    def rank(r, url):
        store, comm = world(r, url)
        with store, comm:
            assert status_of(lambda: Engine.create(comm, dynamic_loss_scaling=True,
                                                   backoff_factor=1.5)) == INVALID_ARGUMENT
            with Engine.create(comm, learning_rate=LR, dynamic_loss_scaling=True,
                               initial_loss_scale=1024.0, growth_interval=2) as engine:
                w = engine.add_param("w", LS_SHAPE)
                engine.seal()
                engine.param(w)[...] = initial_w if r == 0 else 0.0
                engine.broadcast_parameters()
                scales = []
                for step in range(LS_STEPS):
                    engine.wait_parameters(0)
                    scale = engine.loss_scale
                    scales.append(scale)
                    g = engine.grad(w)
                    g += ls_gradient(step, r) * np.float32(scale)
                    if step == 1 and r == 1:
                        g[0] = np.inf
                    engine.grad_ready(w)
                    engine.release_parameters(0)
                    engine.step()
                engine.wait_parameters(0)
                skipped = engine.skipped_steps
                engine.synchronize()
                return scales, skipped, engine.param(w).copy()

    results = run_ranks(2, rank, "engine-loss-scale")
    reference = initial_w.copy()
    for step in range(LS_STEPS):
        if step == 1:
            continue  # skipped on every rank
        mean = (ls_gradient(step, 0) + ls_gradient(step, 1)) / np.float32(2)
        reference = (reference - np.float32(LR) * mean).astype(np.float32)
    for r, (scales, skipped, final) in enumerate(results):
        assert scales == [1024.0, 1024.0, 512.0, 512.0, 1024.0], f"rank {r}: {scales}"
        assert skipped == 1, f"rank {r}"
        np.testing.assert_allclose(final, reference, rtol=1e-6, atol=1e-7, err_msg=f"rank {r}")


def test_grad_norm_is_the_clips_norm_of_each_step_and_needs_clipping():
    """Engine.grad_norm: the global norm of each step's unscaled mean gradients (two ranks,
    dynamic loss scaling), against NumPy in float64; Inf for the step with an infinite
    gradient; 0.0 before the first step; refused before seal and without clipping."""
    def rank(r, url):
        store, comm = world(r, url)
        with store, comm:
            with Engine.create(comm, learning_rate=LR) as plain:
                plain.add_param("w", LS_SHAPE)
                plain.seal()
                assert status_of(lambda: plain.grad_norm) == FAILED_PRECONDITION
            with Engine.create(comm, learning_rate=LR, clip_max_norm=100.0,
                               dynamic_loss_scaling=True, initial_loss_scale=8.0) as engine:
                w = engine.add_param("w", LS_SHAPE)
                assert status_of(lambda: engine.grad_norm) == FAILED_PRECONDITION
                engine.seal()
                engine.broadcast_parameters()
                assert engine.grad_norm_address != 0
                norms = []
                for step in range(LS_STEPS):
                    engine.wait_parameters(0)
                    norms.append(engine.grad_norm)
                    g = engine.grad(w)
                    g += ls_gradient(step, r) * np.float32(engine.loss_scale)
                    if step == 2 and r == 0:
                        g[3] = np.inf
                    engine.grad_ready(w)
                    engine.release_parameters(0)
                    engine.step()
                engine.synchronize()
                norms.append(engine.grad_norm)
                return norms

    results = run_ranks(2, rank, "engine-grad-norm")
    expected = [0.0]
    for step in range(LS_STEPS):
        mean = (ls_gradient(step, 0).astype(np.float64) + ls_gradient(step, 1)) / 2
        expected.append(np.inf if step == 2 else float(np.sqrt(np.sum(mean * mean))))
    for r, norms in enumerate(results):
        np.testing.assert_allclose(norms, expected, rtol=1e-6, err_msg=f"rank {r}")


def test_engine_two_ranks_bad_input():
    def rank(r, url):
        store, comm = world(r, url)
        with store, comm:
            # a parameter registered differently on the two ranks: seal fails on both
            with Engine.create(comm) as bad:
                bad.add_param("w", (4,) if r == 0 else (5,))
                assert status_of(bad.seal) == INVALID_ARGUMENT
            # the rest on a good engine
            with Engine.create(comm) as engine:
                assert status_of(lambda: engine.add_param("h", (2,), dtype=np.float64)) \
                    == UNIMPLEMENTED
                # a and a2 share unit 0's bucket, b has unit 1's
                a = engine.add_param("a", (4,), unit=0)
                a2 = engine.add_param("a2", (3,), unit=0)
                b = engine.add_param("b", (2,), unit=1)
                engine.seal()
                engine.broadcast_parameters()
                assert status_of(engine.step) == FAILED_PRECONDITION  # before backward
                assert status_of(lambda: engine.wait_parameters(5)) == NOT_FOUND
                engine.wait_parameters(0)
                engine.wait_parameters(1)
                engine.grad(a)[:] += 1.0
                engine.grad_ready(a)
                # twice in one micro-batch (its bucket still waits for a2)
                assert status_of(lambda: engine.grad_ready(a)) == FAILED_PRECONDITION
                engine.grad(a2)[:] += 1.0
                engine.grad_ready(a2)
                assert status_of(engine.step) == FAILED_PRECONDITION  # b not checked in
                engine.grad(b)[:] += 1.0
                engine.grad_ready(b)
                engine.step()
                engine.synchronize()
            assert not comm.closed
            return True

    assert run_ranks(2, rank, "engine-bad") == [True, True]


def test_a_failed_dp_group_fails_the_sharding_group_with_it():
    """A dp group fails (rank 0 makes a call rank 1 does not) while the sharding group is
    healthy. The engine's groups fail together: rank 1's step is refused, or its
    synchronize() reports the failure, without waiting for rank 0, which steps `delay` later
    and is refused too. (Before the groups failed together, rank 1's synchronize waited for
    its all-gather over the sharding group, and an earlier version returned at the dp error
    and freed memory the all-gather still wrote.) Rank 0 then leaves its `with` blocks
    (closing its communicators) while rank 1 may still be in a collective: rank 1 gets an
    error, not a crash."""
    delay = 1.5
    n = 1 << 20

    def rank(r, url):
        store = Store.open(url, r, timeout_ms=10000)
        sharding = Communicator.create(store, r, 2, timeout_ms=20000, name="sharding")
        dp = Communicator.create(store, r, 2, timeout_ms=20000, name="dp")
        with store, sharding, dp, Engine.create(sharding, dp, stage=2) as engine:
            w = engine.add_param("w", (n,))
            engine.seal()
            engine.param(w)[:] = 1
            engine.broadcast_parameters()
            engine.wait_parameters(0)
            if r == 0:
                x = np.zeros(3, np.float32)
                # never waited (kept: a dropped work waits): rank 1 makes no such call
                extra = dp.all_reduce(x, x)  # noqa: F841
            engine.grad(w)[:] = 1
            engine.grad_ready(w)
            engine.release_parameters(0)
            if r == 0:
                time.sleep(delay)
            t0 = time.monotonic()
            try:
                engine.step()
                engine.synchronize()
            except hpshard.Error as e:
                return (time.monotonic() - t0, str(e))
            return (time.monotonic() - t0, "completed")

    results = run_ranks(2, rank, "dp-fail")
    assert all(message != "completed" for _, message in results), results
    assert results[1][0] < delay * 0.6, results  # it did not wait for rank 0's step
    assert "group 'dp'" in results[1][1], results


def test_a_reduction_is_refused_once_the_dp_group_has_failed():
    """Both ranks' dp group has failed (a call they disagree on), and with it the engine's
    sharding group: grad_ready() is refused its reduce-scatter, naming the dp failure, and
    nothing reads the gradients after it, so rank 0's close returns at once although rank 1
    comes `delay` later. (Before the groups failed together the reduce-scatter started over
    the sharding group and read the gradients until rank 1 came: a close once freed them
    under it.)"""
    delay = 1.5

    def rank(r, url):
        store = Store.open(url, r, timeout_ms=10000)
        sharding = Communicator.create(store, r, 2, timeout_ms=20000, name="sharding")
        dp = Communicator.create(store, r, 2, timeout_ms=20000, name="dp")
        with store, sharding, dp:
            engine = Engine.create(sharding, dp, stage=2)
            w = engine.add_param("w", (1 << 20,))
            engine.seal()
            engine.broadcast_parameters()
            engine.wait_parameters(0)
            x = np.zeros(3 + r, np.float32)
            with pytest.raises(hpshard.Error):
                dp.all_reduce(x, x).wait()
            engine.grad(w)[:] = 1
            if r == 1:
                time.sleep(delay)
            with pytest.raises(hpshard.Error) as refused:
                engine.grad_ready(w)
            assert "group 'sharding'" in str(refused.value), refused.value
            assert "group 'dp'" in str(refused.value), refused.value
            t0 = time.monotonic()
            try:
                engine.close()
            except hpshard.Error:
                pass
            return time.monotonic() - t0

    closed_after = run_ranks(2, rank, "dp-refused")
    assert closed_after[0] < delay * 0.6, closed_after


def test_closing_the_communicator_closes_the_engine_first():
    store, comm = world(0, f"memory://py-engine-close-{uuid.uuid4().hex}", size=1)
    with store:
        engine = Engine.create(comm)
        comm.close()
        assert engine.closed
        with pytest.raises(ValueError):
            engine.seal()


def test_engine_half_precision_views_have_their_dtype():
    """Stage 2 fp16/bf16 parameters: float16 views, and uint16 bit patterns for bfloat16."""
    store = hpshard.Store.open(f"memory://half-views-{uuid.uuid4().hex}", 0, timeout_ms=5000)
    with store, hpshard.Communicator.create(store, 0, 1) as comm:
        with hpshard.Engine.create(comm) as engine:
            h = engine.add_param("h", (3,), dtype=np.float16)
            b = engine.add_param("b", (2, 2), dtype=DType.BFLOAT16)
            engine.seal()
            assert engine.param(h).dtype == np.float16 and engine.param(h).shape == (3,)
            assert engine.grad(b).dtype == np.uint16 and engine.grad(b).shape == (2, 2)
            engine.param(h)[:] = [1.5, -2.0, 0.25]
            engine.param(b)[:] = 0x3F80  # 1.0 in bfloat16
            engine.broadcast_parameters()
            assert list(engine.param(h)) == [1.5, -2.0, 0.25]
            assert int(engine.param(b)[1, 1]) == 0x3F80



def _to_bf16_bits(x):
    """float32 -> bfloat16 bit patterns, rounded to nearest even (finite inputs)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _from_bf16_bits(b):
    return (np.asarray(b, np.uint16).astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_engine_half_precision_rounds_once_per_sharding_group(stage, dtype):
    """sharding 2 x dp 2, one fp16/bf16 parameter, SGD lr 1 from zero: the master after one
    step is minus the reduced gradient, which the README ("Tolerances") defines as each
    sharding group's sum rounded once to the dtype, the dp replicas' rounded sums added in
    fp32, then the mean taken in fp32. Bitwise, and not the once-rounded sum of all four."""
    n = 4099
    rng = np.random.default_rng(20261202 + stage)
    raw = rng.standard_normal((4, n)).astype(np.float32)
    if dtype == "bfloat16":
        bits = _to_bf16_bits(raw)
        values = _from_bf16_bits(bits)
        rounded = lambda x: _from_bf16_bits(_to_bf16_bits(x))  # noqa: E731
        param_dtype, grads = DType.BFLOAT16, bits
    else:
        values = raw.astype(np.float16).astype(np.float32)
        rounded = lambda x: np.asarray(x, np.float32).astype(np.float16).astype(np.float32)  # noqa: E731
        param_dtype, grads = np.float16, values.astype(np.float16)

    def body(rank, url):
        store, world_comm = world(rank, url, size=4)
        with store, world_comm, hpshard.Topology(2, 1, 2, 1, 1, 4) as topo:
            group = hpshard.HybridGroup.create(world_comm, topo)
            sharding, dp = group.comm(hpshard.Group.SHARDING), group.comm(hpshard.Group.DP)
            with Engine.create(sharding, dp, stage=stage, learning_rate=1.0) as engine:
                i = engine.add_param("w", (n,), dtype=param_dtype)
                engine.seal()
                engine.broadcast_parameters()
                engine.wait_parameters(0)
                engine.grad(i)[...] = grads[rank]
                engine.grad_ready(i)
                engine.release_parameters(0)
                engine.step()
                master = np.array(engine.gather_parameter(i), dtype=np.float32)
                shards = topo.group_ranks(hpshard.Group.SHARDING, rank)
                return master, shards

    results = run_ranks(4, body, f"half-rounding-{stage}-{dtype}")
    groups = sorted({tuple(shards) for _, shards in results})
    assert len(groups) == 2
    replica_sums = [rounded(values[list(g)].sum(axis=0, dtype=np.float32)) for g in groups]
    expected = -((replica_sums[0] + replica_sums[1]) * np.float32(0.25))
    once = -rounded(values.sum(axis=0, dtype=np.float32) * np.float32(0.25))
    for master, _ in results:
        np.testing.assert_array_equal(master, expected)
    assert np.count_nonzero(expected != once) > n // 10  # the two rules differ here

# ---- the engine's device and the host/device policy -------------------------------------
class _FakeDLPack:
    """A DLPack tensor of another framework, built by hand (ctypes): any device type, over
    host memory it owns, so no GPU is needed to show where the library draws the line."""

    class Device(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]

    class DataType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

    class Tensor(ctypes.Structure):
        pass

    Tensor._fields_ = [("data", ctypes.c_void_p), ("device", Device), ("ndim", ctypes.c_int),
                       ("dtype", DataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                       ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
                       ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]

    def __init__(self, device_type, device_id=0, n=2):
        self.data = (ctypes.c_float * n)()
        self.shape = (ctypes.c_int64 * 1)(n)
        self.t = self.Tensor()
        self.t.data = ctypes.addressof(self.data)
        self.t.device = self.Device(device_type, device_id)
        self.t.ndim = 1
        self.t.dtype = self.DataType(2, 32, 1)  # float32
        self.t.shape = self.shape

    def __dlpack__(self, stream=None):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
        return new(ctypes.addressof(self.t), b"dltensor", None)

    def __dlpack_device__(self):
        return (self.t.device.device_type, self.t.device.device_id)


def test_host_device_policy_is_the_c_layers():
    # hps_dlpack_host_data decides, once: host memory has a host view, device memory none.
    cpu = _FakeDLPack(1)
    assert capi.dlpack_host_data(cpu.__dlpack__()) == ctypes.addressof(cpu.data)
    for fake, name in ((_FakeDLPack(2, 1), "cuda:1"), (_FakeDLPack(7), "dlpack-device-type-7:0")):
        with pytest.raises(hpshard.FailedPreconditionError) as info:
            capi.dlpack_host_data(fake.__dlpack__())
        assert info.value.status == FAILED_PRECONDITION
        assert name in info.value.message and "not the host" in info.value.message


def test_engine_views_refused_off_the_cpu():
    # A CUDA engine cannot be created without a GPU: a view whose export hands out a CUDA
    # tensor shows that the binding's host views ask the library's policy (the memory is
    # host memory here, so nothing would crash without it: a missing check fails the test).
    store, comm = world(0, f"memory://py-engine-guard-{uuid.uuid4().hex}", size=1)
    with store, comm, Engine.create(comm, dynamic_loss_scaling=True) as engine:
        w = engine.add_param("w", (2,))
        engine.seal()
        assert engine.param(w).shape == (2,)  # on the CPU: views
        assert engine.loss_scale == 65536.0 and engine.skipped_steps == 0
        fake = _FakeDLPack(2, 0)
        view = hpshard.Tensor(engine, lambda h: fake.__dlpack__(), (2,), DType.FLOAT32,
                              "Engine.param(0)")
        with pytest.raises(hpshard.FailedPreconditionError) as info:
            view.numpy()
        assert "cuda:0" in info.value.message and "Engine.param(0)" in info.value.message
        # A collective refuses a tensor that is not on the communicator's device.
        with pytest.raises(hpshard.InvalidArgumentError) as info:
            comm.all_reduce(fake, _FakeDLPack(2, 0))
        assert "on cuda:0 but the operation runs on cpu:0" in info.value.message
        # The addresses stay available.
        assert engine.param_address(w) == engine._h().param(w) != 0
        assert engine.grad_address(w) == engine._h().grad(w) != 0
        scale, skipped = engine.loss_scale_addresses
        assert scale != 0 and skipped != 0


def test_engine_device_is_the_sharding_communicators():
    def rank(r, url):
        store, comm = world(r, url)
        with store, comm, Engine.create(comm) as engine:
            assert engine.device == comm.device == (hpshard.DeviceType.CPU, 0)
            assert tuple(engine._h().device()) == (capi.HPS_DEVICE_CPU, 0)
            return engine.device

    assert run_ranks(2, rank, "engine-device") == [(hpshard.DeviceType.CPU, 0)] * 2


def test_engine_bucket_bytes_cuts_units_and_trains_the_same():
    # a: 1200 bytes, over the cap alone; b (800) starts the next bucket; c would end at
    # 1064 bytes (b padded to 256 floats): a third; d is unit 1.
    specs = [("a", (300,), 0), ("b", (200,), 0), ("c", (10,), 0), ("d", (50,), 1)]

    def rank(r, url):
        store, comm = world(r, url)
        out = []
        with store, comm:
            for cap in (0, 1024):
                options = EngineOptions.defaults()
                options.learning_rate, options.momentum, options.bucket_bytes = 0.05, 0.9, cap
                with Engine.create(comm, options=options) as engine:
                    idx = [engine.add_param(n, s, unit=u) for n, s, u in specs]
                    assert status_of(lambda: engine.param_bucket(0)) == FAILED_PRECONDITION
                    engine.seal()
                    assert status_of(lambda: engine.param_bucket(len(specs))) == OUT_OF_RANGE
                    buckets = [engine.param_bucket(i) for i in idx]
                    for i, (n, s, _) in zip(idx, specs):
                        engine.param(i)[...] = np.sin(np.arange(s[0]) + len(n)) if r == 0 else 0
                    engine.broadcast_parameters()
                    for step in range(3):
                        for unit in (0, 1):
                            engine.wait_parameters(unit)
                        for i in reversed(idx):
                            g = engine.grad(i)
                            g += np.cos(np.arange(g.size) * 0.1 + step + r + i) \
                                .astype(np.float32) + np.float32(0.2) * engine.param(i)
                            engine.grad_ready(i)
                        for unit in (1, 0):
                            engine.release_parameters(unit)
                        engine.step()
                    out.append((buckets, [engine.gather_parameter(i) for i in idx]))
        return out

    for (plain, plain_params), (capped, capped_params) in run_ranks(2, rank, "buckets"):
        assert plain[0] == plain[1] == plain[2] and len(set(plain)) == 2
        assert len(set(capped)) == 4
        for a, b in zip(plain_params, capped_params):
            np.testing.assert_array_equal(a, b)


def test_no_weight_decay_parameters_are_not_decayed():
    """AdamW, lr 0.1, wd 0.5, one step from 2 with gradient 1: 2·0.95 − 0.1 decayed,
    2 − 0.1 without decay (m̂/√v̂ = 1 on the first step; ε makes the last digits)."""
    store, comm = world(0, f"memory://py-no-decay-{uuid.uuid4().hex}", size=1)
    with store, comm:
        with Engine.create(comm, None, stage=2, optimizer=Optimizer.ADAMW, learning_rate=0.1,
                           weight_decay=0.5) as e:
            w = e.add_param("w", (3,))
            b = e.add_param("b", (3,), weight_decay=False)
            e.seal()
            for i in (w, b):
                e.param(i)[:] = 2
            e.broadcast_parameters()
            e.wait_parameters(0)
            for i in (w, b):
                e.grad(i)[:] = 1
                e.grad_ready(i)
            e.release_parameters(0)
            e.step()
            np.testing.assert_allclose(e.gather_parameter(w), 2 * 0.95 - 0.1, rtol=1e-6)
            np.testing.assert_allclose(e.gather_parameter(b), 2 - 0.1, rtol=1e-6)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_model_without_trainable_parameters_steps_and_stays(stage):
    """Every parameter frozen: no gradient can check in, so every step() is due (it was
    refused as 'before backward finished'); the parameters stay, with clipping and dynamic
    loss scaling on, over two ranks."""
    def rank_main(rank, url):
        store, comm = world(rank, url)
        with store, comm, Engine.create(comm, None, stage=stage, clip_max_norm=1.0,
                                        dynamic_loss_scaling=True) as e:
            w = e.add_param("w", (5,), frozen=True)
            e.seal()
            if rank == 0:
                e.param(w)[:] = np.arange(5, dtype=np.float32)
            e.broadcast_parameters()
            for _ in range(3):
                e.wait_parameters(0)
                e.release_parameters(0)
                e.step()
            e.synchronize()
            return e.gather_parameter(w)

    for got in run_ranks(2, rank_main, f"frozen-{stage}"):
        np.testing.assert_array_equal(got, np.arange(5, dtype=np.float32))



@pytest.mark.parametrize("stage", [2, 3])
def test_loss_scale_read_after_a_frozen_units_wait_is_the_last_steps(stage):
    # The loss scale is read after the step's wait_parameters. A unit holding only frozen
    # parameters has no all-gather after the update: its wait must still follow the step,
    # or the scale read is the one before it (the loss scaled by it, the gradients
    # unscaled by the next one). A large trainable buffer keeps the optimizer busy.
    store = Store.open(f"memory://frozen-scale-{uuid.uuid4().hex}", 0, timeout_ms=5000)
    comm = Communicator.create(store, 0, 1)
    e = Engine.create(comm, stage=stage, learning_rate=0.1, dynamic_loss_scaling=True,
                      initial_loss_scale=8.0, growth_interval=1)
    try:
        frozen = e.add_param("embedding", (64,), frozen=True, unit=0)
        w = e.add_param("w", (1 << 21,), unit=1)
        e.seal()
        e.broadcast_parameters()
        seen = []
        for _ in range(6):
            e.wait_parameters(0)
            seen.append(e.loss_scale)
            assert e.param(frozen).shape == (64,)
            e.release_parameters(0)
            e.wait_parameters(1)
            e.grad(w)[...] = np.float32(seen[-1])
            e.grad_ready(w)
            e.release_parameters(1)
            e.step()
        e.synchronize()
        assert seen == [8.0 * 2**k for k in range(6)]
        assert e.loss_scale == 8.0 * 2**6
    finally:
        e.close()
        comm.close()
        store.close()


# ---- the engine inside a hybrid topology: its clip and skip span mp and pp -----------------
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("pp,sharding,mp", [(1, 2, 2), (2, 2, 1), (2, 1, 2)])
def test_engine_clip_and_skip_span_the_model_parallel_groups(stage, pp, sharding, mp):
    """Four ranks as pp × sharding × mp; each (pp, mp) coordinate holds its part of the model:
    w (DISTRIBUTED: a slice per mp rank), b (replicated across mp: the same gradient on every
    mp rank), s (SHARED_NOT_FIRST: scaled, not counted), n (NO_CLIP). The clip coefficient
    comes from a NumPy norm of the whole model (DESIGN.md "Hybrid clipping"); then a
    non-finite gradient on the last rank alone skips the step on all four."""
    sizes = {"w": 5, "b": 3, "s": 2, "n": 2}
    rng = np.random.default_rng(20261203 + 10 * stage + pp)
    while True:
        # Gradients per (pp, sharding rank, mp): b's are drawn per (pp, sharding rank) only.
        g = {name: rng.standard_normal((pp, sharding, mp, n)).astype(np.float32)
             for name, n in sizes.items()}
        g["b"][:, :, 1:, :] = g["b"][:, :, :1, :]
        mean = {name: v.astype(np.float64).mean(axis=1) for name, v in g.items()}  # [pp][mp]
        norm2 = (mean["w"] ** 2).sum() + (mean["b"][:, 0, :] ** 2).sum()
        max_norm = 0.5 * math.sqrt(norm2)  # binding: the coefficient is about 0.5
        coef = max_norm / (max(math.sqrt(norm2), max_norm) + 1e-6)
        local = [(mean["w"][p, m] ** 2).sum() + (mean["b"][p, m] ** 2).sum()
                 for p in range(pp) for m in range(mp)]
        # Gradients where each part's own norm would give another coefficient.
        if all(max_norm / max(math.sqrt(x), max_norm) > coef + 0.05 for x in local):
            break

    def body(rank, url):
        store, world_comm = world(rank, url, size=4)
        with store, world_comm, hpshard.Topology(1, pp, sharding, 1, mp, 4) as topo:
            group = hpshard.HybridGroup.create(world_comm, topo)
            p, s, m = (topo.coordinate(rank, a) for a in (hpshard.Group.PP,
                                                           hpshard.Group.SHARDING,
                                                           hpshard.Group.MP))
            with Engine.create(group.comm(hpshard.Group.SHARDING), stage=stage,
                               learning_rate=1.0, clip_max_norm=max_norm,
                               dynamic_loss_scaling=True, initial_loss_scale=1.0,
                               growth_interval=1000) as engine:
                engine.set_model_parallel_groups(group.comm(hpshard.Group.MP),
                                                 group.comm(hpshard.Group.PP))
                index = {
                    "w": engine.add_param("w", (5,), distributed=True),
                    "b": engine.add_param("b", (3,)),
                    "s": engine.add_param("s", (2,), shared_not_first=True),
                    "n": engine.add_param("n", (2,), clip=False),
                }
                engine.seal()
                engine.broadcast_parameters()  # every parameter starts at zero

                def one_step(poison):
                    engine.wait_parameters(0)
                    for name, i in index.items():
                        grad = g[name][p, s, m].copy()
                        if poison and name == "w":
                            grad[1] = np.inf
                        engine.grad(i)[...] = grad
                        engine.grad_ready(i)
                    engine.release_parameters(0)
                    engine.step()

                one_step(False)
                after_one = {name: engine.gather_parameter(i) for name, i in index.items()}
                one_step(rank == 3)
                engine.wait_parameters(0)
                scale, skipped = engine.loss_scale, engine.skipped_steps
                engine.release_parameters(0)
                after_two = {name: engine.gather_parameter(i) for name, i in index.items()}
                return (p, m), after_one, after_two, scale, skipped

    for (p, m), after_one, after_two, scale, skipped in run_ranks(4, body, f"mp-pp-{stage}-{pp}"):
        for name in sizes:
            factor = 1.0 if name == "n" else coef
            np.testing.assert_allclose(after_one[name], -factor * mean[name][p, m], rtol=2e-6,
                                       atol=1e-7, err_msg=f"{name} at pp {p}, mp {m}")
            np.testing.assert_array_equal(after_two[name], after_one[name])
        assert (scale, skipped) == (0.5, 1)


def test_engine_model_parallel_groups_are_checked():
    """Refusals of hps_engine_set_model_parallel_groups, and seal()'s collective checks: a
    group that is not an axis of the topology, and mp ranks whose flags differ."""

    def body(rank, url):
        store, world_comm = world(rank, url, size=4)
        with store, world_comm, hpshard.Topology(1, 1, 2, 1, 2, 4) as topo:
            group = hpshard.HybridGroup.create(world_comm, topo)
            sharding, mp = group.comm(hpshard.Group.SHARDING), group.comm(hpshard.Group.MP)
            out = {}
            with Engine.create(sharding) as engine:
                out["sharding"] = status_of(lambda: engine.set_model_parallel_groups(sharding))
                out["same"] = status_of(lambda: engine.set_model_parallel_groups(mp, mp))
                # A hybrid group's communicator of another axis: the mp group as pp, the
                # sep group as mp (the norm would sum over the wrong ranks).
                with pytest.raises(hpshard.Error) as axis:
                    engine.set_model_parallel_groups(None, mp)
                out["mp_as_pp"] = (axis.value.status, axis.value.message)
                out["sep_as_mp"] = status_of(lambda: engine.set_model_parallel_groups(
                    group.comm(hpshard.Group.SEP), None))
                out["clip_mp_as_pp"] = status_of(lambda: Clip(sharding, None, mp))
                # One communicator as two axes: each gradient averaged twice (the engine's
                # update was halved), a norm's partials counted twice (the clip's).
                out["same_dp"] = status_of(lambda: Engine.create(sharding, sharding))
                out["clip_same"] = [status_of(lambda a=a: Clip(*a)) for a in
                                    ((sharding, sharding, None), (sharding, None, sharding),
                                     (None, mp, mp))]
                with pytest.raises(TypeError):
                    engine.set_model_parallel_groups("mp")
            with Engine.create(sharding) as engine:  # the world is no axis: sharding differs
                engine.set_model_parallel_groups(world_comm, None)
                engine.add_param("w", (4,), distributed=True)
                with pytest.raises(hpshard.Error) as info:
                    engine.seal()
                out["world"] = (info.value.status, info.value.message)
            with Engine.create(sharding) as engine:  # sharding rank 1 sets no mp group
                if topo.coordinate(rank, hpshard.Group.SHARDING) == 0:
                    engine.set_model_parallel_groups(mp, None)
                engine.add_param("w", (4,))
                began = time.monotonic()
                with pytest.raises(hpshard.Error) as info:
                    engine.seal()
                out["omitted"] = (info.value.status, info.value.message,
                                  time.monotonic() - began)
            with Engine.create(sharding) as engine:  # mp rank 1 says w is not DISTRIBUTED
                engine.set_model_parallel_groups(mp, None)
                engine.add_param("w", (4,), distributed=topo.coordinate(rank, hpshard.Group.MP) == 0)
                with pytest.raises(hpshard.Error) as info:
                    engine.seal()
                out["flags"] = (info.value.status, info.value.message)
            with Engine.create(sharding) as engine:
                engine.set_model_parallel_groups(mp, None)
                engine.add_param("w", (4,), distributed=True)
                engine.seal()
                out["sealed"] = status_of(lambda: engine.set_model_parallel_groups(mp, None))
            return out

    for out in run_ranks(4, body, "mp-checks"):
        assert out["sharding"] == INVALID_ARGUMENT and out["same"] == INVALID_ARGUMENT
        assert out["mp_as_pp"][0] == INVALID_ARGUMENT and "'mp' group, not its pp" in \
            out["mp_as_pp"][1]
        assert out["sep_as_mp"] == INVALID_ARGUMENT
        assert out["clip_mp_as_pp"] == INVALID_ARGUMENT
        assert out["same_dp"] == INVALID_ARGUMENT
        assert out["clip_same"] == [INVALID_ARGUMENT] * 3
        assert out["world"][0] == INVALID_ARGUMENT and "coordinates" in out["world"][1]
        assert out["flags"][0] == INVALID_ARGUMENT and "DISTRIBUTED" in out["flags"][1]
        # Named at once on every rank (the ranks with an mp group waited in seal's mp check
        # for peers that never came, then read "destroyed its communicator before joining").
        status, message, seconds = out["omitted"]
        assert status == INVALID_ARGUMENT and seconds < 10, out["omitted"]
        assert "set model-parallel groups of sizes mp" in message and "mp 1, pp 1" in \
            message and "mp 2, pp 1" in message, message
        assert out["sealed"] == FAILED_PRECONDITION


def test_engine_seal_refuses_hand_split_groups_of_the_wrong_size():
    """Three ranks split by hand: mp groups {0, 1} and {2}, pp groups {0, 2} and {1}. The
    members of each group share the other coordinates (every rank is rank 0 of its size-1
    groups), so only the sizes give it away: rank 0's mp group has 2 ranks, its pp peer
    rank 2's has 1. Seal is refused on every rank."""

    def body(rank, url):
        store, world_comm = world(rank, url, size=3)
        with store, world_comm:
            own = [world_comm.split([r], f"self{r}") for r in range(3)][rank]
            mp = [world_comm.split(g, "mp") for g in ([0, 1], [2])]
            pp = [world_comm.split(g, "pp") for g in ([0, 2], [1])]
            mp = next(c for c in mp if c is not None)
            pp = next(c for c in pp if c is not None)
            with own, mp, pp, Engine.create(own) as engine:
                engine.set_model_parallel_groups(mp, pp)
                engine.add_param("w", (4,))
                with pytest.raises(hpshard.Error) as info:
                    engine.seal()
                return info.value.status, info.value.message

    for rank, (status, message) in enumerate(run_ranks(3, body, "mp-hand-split")):
        assert status == INVALID_ARGUMENT, (rank, message)
        assert "in groups of other sizes" in message, (rank, message)


def test_engine_seal_refused_on_one_mp_group_is_refused_on_every_rank_at_once():
    """pp 2 x mp 2: only pp stage 0's mp group registers different flags. Every rank gets
    INVALID_ARGUMENT at once (pp stage 1's ranks waited in seal's pp collective for the
    communicator's timeout, 20 s here, and got TIMEOUT), and the groups stay usable: a
    fresh engine on them seals and steps."""

    def body(rank, url):
        store, world_comm = world(rank, url, size=4)
        with store, world_comm, hpshard.Topology(1, 2, 1, 1, 2, 4) as topo:
            group = hpshard.HybridGroup.create(world_comm, topo)
            sharding = group.comm(hpshard.Group.SHARDING)
            mp, pp = group.comm(hpshard.Group.MP), group.comm(hpshard.Group.PP)
            out = {}
            with Engine.create(sharding, learning_rate=1.0, clip_max_norm=1.0) as engine:
                engine.set_model_parallel_groups(mp, pp)
                engine.add_param("w", (3,), distributed=rank != 0)
                began = time.monotonic()
                with pytest.raises(hpshard.Error) as info:
                    engine.seal()
                out["refused"] = (info.value.status, info.value.message,
                                  time.monotonic() - began)
            with Engine.create(sharding, learning_rate=1.0, clip_max_norm=1.0) as engine:
                engine.set_model_parallel_groups(mp, pp)
                engine.add_param("w", (3,), distributed=True)
                engine.seal()
                engine.grad(0)[:] = 1.0
                engine.grad_ready(0)
                engine.step()
                engine.synchronize()
                out["param"] = np.array(engine.param(0), dtype=np.float64)
            return out

    outs = run_ranks(4, body, "mp-refused-everywhere")
    for rank, out in enumerate(outs):
        status, message, seconds = out["refused"]
        assert status == INVALID_ARGUMENT, (rank, message)
        assert seconds < 10, (rank, seconds, message)
        if rank < 2:  # the mp group that found it names it
            assert "DISTRIBUTED" in message
        else:
            assert "refused on every rank" in message and "clip flags" in message
        # Unit gradients of w (distributed) over mp 2 and pp 2: the norm is sqrt(3 * 2 * 2)
        # (pp's other stage holds the same w), so the coefficient clips it to 1.
        np.testing.assert_allclose(out["param"], -1.0 / math.sqrt(12), rtol=1e-5)


# ---- fork(): handles belong to the process that made them ---------------------------------
FORKED_WITH_AN_ENGINE_OPEN = r"""
import os, sys, threading
import numpy as np
import hpshard
from hpshard import Communicator, Engine, Store

url = sys.argv[1]
# rank 1 joins the all-reduce only after the child has gone: it is in flight across the fork
joined = threading.Event()
def peer():
    with Store.open(url + "-pair", 1) as st, Communicator.create(st, 1, 2) as c:
        joined.wait()
        c.all_reduce(np.ones(1, np.float32), np.zeros(1, np.float32)).wait()
t = threading.Thread(target=peer)
t.start()
pair_store = Store.open(url + "-pair", 0)
pair = Communicator.create(pair_store, 0, 2)
store = Store.open(url, 0)
comm = Communicator.create(store, 0, 1)
engine = Engine.create(comm, learning_rate=0.5, stage=int(sys.argv[2]))
w = engine.add_param("w", (4,), unit=0)
engine.seal()
engine.broadcast_parameters()
engine.wait_parameters(0)
engine.grad(w)[:] = 1.0
engine.grad_ready(w)
engine.release_parameters(0)
engine.step()
total = np.zeros(1, np.float32)
pending = pair.all_reduce(np.ones(1, np.float32), total)
pid = os.fork()
if pid == 0:
    try:
        engine.step()
        print("child: the parent's engine stepped", flush=True)
    except hpshard.FailedPreconditionError as e:
        if "made before this process was forked" in str(e):
            print("child: refused", flush=True)
    with Store.open(url + "-child", 0) as st, Communicator.create(st, 0, 1) as c:
        out = np.zeros(1, np.float32)
        c.all_reduce(np.full(1, 3.0, np.float32), out).wait()
        print("child: own communicator", out[0], flush=True)
    sys.exit(0)  # the interpreter's exit lets go of the parent's handles
_, status = os.waitpid(pid, 0)
print("child status", status, flush=True)
joined.set()
pending.wait()
t.join()
engine.wait_parameters(0)
print("parent", total[0], engine.param(w)[0], flush=True)
"""


@pytest.mark.parametrize("stage", [2, 3])
def test_a_forked_child_is_refused_the_parents_handles_and_exits(stage):
    """A child forked while an engine was stepping and a collective waited for a peer hung
    at exit: the handles' destructors waited for worker threads the child does not have.
    Now the parent's handles are refused in the child and let go without waiting, the
    child's own work, and the parent goes on."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", FORKED_WITH_AN_ENGINE_OPEN,
                           f"memory://fork-{uuid.uuid4().hex}", str(stage)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    assert done.stdout.splitlines() == [
        "child: refused", "child: own communicator 3.0", "child status 0",
        "parent 2.0 -0.5"], (done.stdout, done.stderr)


# ---- a failed last step is not a success -------------------------------------------------
A_RANK_LEAVES_BEFORE_THE_LAST_STEP = r"""
import sys, threading
from hpshard import Communicator, Engine, Store

url, how = sys.argv[1], sys.argv[2]
kept = []
stepped = threading.Event()  # rank 0 has enqueued its last step: its failure is in flight
def rank(r):
    store = Store.open(url, r)
    world = Communicator.create(store, r, 2, timeout_ms=20000)
    engine = Engine.create(world, learning_rate=0.5, stage=int(sys.argv[3]))
    w = engine.add_param("w", (64,), unit=0)
    engine.seal()
    engine.broadcast_parameters()
    for _ in range(3 if r == 0 else 2):  # uneven data: rank 0 has one batch more
        engine.wait_parameters(0)
        engine.grad(w)[:] = 1.0
        engine.grad_ready(w)
        engine.release_parameters(0)
        engine.step()
    if r == 1:
        stepped.wait()
        world.close()  # it is done: its engine goes with it
        store.close()
        return
    stepped.set()
    if how == "close":
        try:
            world.close()
        except Exception as e:
            print("close raised", type(e).__name__, flush=True)
    elif how == "collect":
        del engine
        import gc
        gc.collect()
        world.close()
    elif how == "with":
        try:
            with engine:
                raise SystemExit(0)  # a program leaving by sys.exit(0)
        except BaseException as e:
            print("with raised", type(e).__name__, type(e.__context__).__name__, flush=True)
        world.close()
    elif how == "unrelated":  # another handle's error tells the program nothing of this
        try:
            Store.open("nosuchscheme://x", 0)
        except Exception as e:
            print("unrelated", type(e).__name__, flush=True)
        try:
            world.close()
        except Exception as e:
            print("close raised", type(e).__name__, flush=True)
    elif how == "other-thread":  # the failure reached the program on another thread
        def wait():
            try:
                engine.synchronize()
            except Exception as e:
                print("synchronize raised", type(e).__name__, flush=True)
        waiter = threading.Thread(target=wait)
        waiter.start()
        waiter.join()
        try:
            world.close()
            print("close quiet", flush=True)
        except Exception as e:
            print("close raised", type(e).__name__, flush=True)
    else:
        kept.append((store, world, engine))  # a training loop's end: nothing closed
threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("loop done", flush=True)
"""


@pytest.mark.parametrize("how", ["close", "exit", "with", "collect", "unrelated",
                                 "other-thread"])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_last_step_that_failed_is_not_a_success(how, stage):
    """Rank 1 leaves after its last batch; rank 0 has one more, whose step's collectives
    fail (asynchronously: nothing in the step waits). Nothing raised: the communicator's
    close() returned, and a program that closed nothing exited 0 with the step's update
    missing (process red team). close() raises the engine's failure now, and the exit
    check reports an engine left open with failed work and exits 1. Whether the program
    was told is the engine's own (hps_engine_failures_returned): an unrelated error on the
    thread that made it used to silence the close, and a failure already raised to another
    thread was raised again."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", A_RANK_LEAVES_BEFORE_THE_LAST_STEP,
                           f"memory://last-step-{uuid.uuid4().hex}", how, str(stage)],
                          capture_output=True, text=True, timeout=120)
    if how == "close":
        assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
        assert done.stdout.splitlines() == ["close raised AbortedError", "loop done"], (
            done.stdout, done.stderr)
    elif how == "unrelated":
        assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
        assert done.stdout.splitlines() == ["unrelated InvalidArgumentError",
                                            "close raised AbortedError", "loop done"], (
            done.stdout, done.stderr)
    elif how == "other-thread":
        assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
        assert done.stdout.splitlines() == ["synchronize raised AbortedError", "close quiet",
                                            "loop done"], (done.stdout, done.stderr)
    elif how == "collect":  # an engine garbage-collected without close(): it was silent
        assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
        assert done.stdout.splitlines() == ["loop done"], (done.stdout, done.stderr)
        assert "hpshard: an engine garbage-collected without close() had failed work in " \
            "flight" in done.stderr, done.stderr
    elif how == "with":  # a with-block left by sys.exit(0) hid the failure (exit 0)
        assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
        assert done.stdout.splitlines() == ["with raised AbortedError SystemExit",
                                            "loop done"], (done.stdout, done.stderr)
    else:
        assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
        assert done.stdout.splitlines() == ["loop done"], (done.stdout, done.stderr)
        assert "hpshard: the program ended with 1 open engine(s) whose work in flight " \
            "failed" in done.stderr, done.stderr


# ---- stage 3: a unit in use across a step; a micro-batch past the step's last --------------
def _sgd_reference(initial, grads_per_step, lr):
    """float64 SGD without momentum: each step subtracts lr times the mean over ranks and
    micro-batches of the gradients given for it."""
    p = np.array(initial, dtype=np.float64)
    history = []
    for grads in grads_per_step:
        p = p - lr * np.mean(np.array(grads, dtype=np.float64), axis=0)
        history.append(p.copy())
    return history


def test_stage3_unit_in_use_across_a_step_sees_the_update():
    """A unit gathered and never released (a forward whose backward did not come) kept the
    parameters from before the step: every later wait_parameters returned them, and the
    forward computed on them for good, while the shards moved on."""
    steps, lr, n = 4, 0.25, 7
    rng = np.random.default_rng(11)
    init = rng.standard_normal((2, n)).astype(np.float32)  # units 0 and 1, one param each
    grads = rng.standard_normal((steps, 2, 2, n)).astype(np.float32)  # step, rank, param

    def rank(r, url):
        store, comm = world(r, url)
        seen = []
        with store, comm, Engine.create(comm, stage=3, learning_rate=lr) as engine:
            a = engine.add_param("a", (n,), unit=0)
            b = engine.add_param("b", (n,), unit=1)
            engine.seal()
            engine.param(a)[:] = init[0]
            engine.param(b)[:] = init[1]
            engine.broadcast_parameters()
            for s in range(steps):
                for unit, i in ((0, a), (1, b)):
                    engine.wait_parameters(unit)
                    seen.append((s, i, engine.param(i).copy()))
                for unit, i in ((1, b), (0, a)):
                    engine.grad(i)[:] += grads[s, r, i]
                    engine.grad_ready(i)
                    if unit == 1:  # unit 0 is never released
                        engine.release_parameters(unit)
                engine.step()
            engine.wait_parameters(0)
            engine.wait_parameters(1)
            seen.append((steps, a, engine.param(a).copy()))
            seen.append((steps, b, engine.param(b).copy()))
        return seen

    results = run_ranks(2, rank)
    for i in (0, 1):
        expected = [init[i].astype(np.float64)] + _sgd_reference(
            init[i], [grads[s, :, i] for s in range(steps)], lr)
        for seen in results:
            got = [v for (s, k, v) in seen if k == i]
            assert len(got) == steps + 1
            for s in range(steps + 1):
                np.testing.assert_allclose(got[s], expected[s], rtol=1e-6, atol=1e-6,
                                           err_msg=f"param {i} before step {s}")
    for s in range(len(results[0])):
        np.testing.assert_array_equal(results[0][s][2], results[1][s][2])


@pytest.mark.parametrize("accumulation", [1, 2])
def test_stage3_gradient_past_the_last_micro_batch_is_refused_and_changes_nothing(accumulation):
    """A micro-batch past the step's last got its gradient view (the check-in was refused),
    and what was added into it went into the next step's first micro-batch."""
    lr, n = 0.5, 5

    def rank(r, url):
        store, comm = world(r, url)
        with store, comm, Engine.create(comm, stage=3, learning_rate=lr,
                                        accumulation_steps=accumulation) as engine:
            w = engine.add_param("w", (n,), unit=0)
            engine.seal()
            engine.broadcast_parameters()
            for s in range(2):
                for _ in range(accumulation):
                    engine.wait_parameters(0)
                    engine.grad(w)[:] += 1.0
                    engine.grad_ready(w)
                    engine.release_parameters(0)
                if s == 0:  # one micro-batch too many
                    engine.wait_parameters(0)
                    with pytest.raises(hpshard.FailedPreconditionError,
                                       match="'w' asked for after the last micro-batch"):
                        engine.grad(w)
                    engine.release_parameters(0)  # nothing taken: released as usual
                engine.step()
            engine.wait_parameters(0)
            return engine.param(w).copy()

    for got in run_ranks(2, rank):
        np.testing.assert_array_equal(got, np.full(n, -2 * lr, np.float32))


def test_a_second_check_in_names_the_gradients_the_micro_batch_still_waits_for():
    store, comm = world(0, f"memory://py-engine-due-{uuid.uuid4().hex}", size=1)
    with store, comm, Engine.create(comm, stage=2, accumulation_steps=2) as engine:
        a = engine.add_param("a", (3,), unit=0)
        engine.add_param("b", (3,), unit=0)
        engine.seal()
        engine.broadcast_parameters()
        engine.wait_parameters(0)
        engine.grad_ready(a)
        with pytest.raises(hpshard.FailedPreconditionError,
                           match=r"'a' checked in twice in one micro-batch \(micro-batch 1 of 2 "
                                 r"has not had 'b' checked in\)"):
            engine.grad_ready(a)


FORKED_INSIDE_WITH_BLOCKS = r"""
import os, sys
from hpshard import Communicator, Store

with Store.open(sys.argv[1], 0) as st, Communicator.create(st, 0, 1) as comm:
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # leaves both blocks by SystemExit: they abort what is pending
    _, status = os.waitpid(pid, 0)
    print("child status", status, flush=True)
"""


def test_a_forked_child_leaving_with_blocks_by_sys_exit_exits_cleanly():
    """Leaving a Communicator's or Store's with block by SystemExit aborts them first; in a
    forked child that abort was refused (the parent's handle) and the child exited 1 with a
    traceback."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", FORKED_INSIDE_WITH_BLOCKS,
                           f"memory://fork-with-{uuid.uuid4().hex}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    assert done.stdout.splitlines() == ["child status 0"], (done.stdout, done.stderr)
    assert done.stderr == "", done.stderr


def test_a_rank_that_shares_no_group_with_a_rank_that_left_is_told():
    """dp 2 x sharding 2, stage 2; the rank that shares no group with rank 0 leaves after one
    step, the others take a second. Its peers saw their collectives with it fail, yet still
    ran the step's later collectives with rank 0, on their healthy groups, with data the
    failed ones never finished: rank 0 completed with every value wrong and was told nothing
    (retest red team). An engine's groups now fail together, so rank 0's synchronize
    raises."""
    left = threading.Barrier(4)

    def body(rank, url):
        store, world_comm = world(rank, url, size=4)
        with store, world_comm, hpshard.Topology(2, 1, 2, 1, 1, 4) as topo:
            group = hpshard.HybridGroup.create(world_comm, topo)
            near = set(topo.group_ranks(hpshard.Group.SHARDING, 0)) | set(
                topo.group_ranks(hpshard.Group.DP, 0))
            leaver = next(r for r in range(4) if r not in near)
            engine = Engine.create(group.comm(hpshard.Group.SHARDING),
                                   group.comm(hpshard.Group.DP), stage=2, learning_rate=1.0)
            i = engine.add_param("w", (64,))
            engine.seal()
            engine.broadcast_parameters()
            for _ in range(1 if rank == leaver else 2):
                engine.wait_parameters(0)
                engine.grad(i)[...] = 1.0
                engine.grad_ready(i)
                engine.release_parameters(0)
                engine.step()
            left.wait(60)  # the second step is enqueued on every other rank
            told = False
            if rank != leaver:
                try:
                    engine.synchronize()
                except hpshard.Error:
                    told = True
            try:
                engine.close()
                group.close()
            except hpshard.Error:
                pass
            return told

    assert run_ranks(4, body, "hybrid-left")[0]


def _one_step(engine):
    """Unit 0's forward and backward (gradient 1) and the step, with parameter 0."""
    engine.wait_parameters(0)
    engine.grad(0)[...] += 1.0
    engine.grad_ready(0)
    engine.release_parameters(0)
    engine.step()


def _started_engine(comm, **options):
    """An engine of one parameter (8 elements), sealed and broadcast."""
    engine = Engine.create(comm, **options)
    engine.add_param("w", (8,))
    engine.seal()
    engine.broadcast_parameters()
    return engine


def _late_peer(url, late):
    """Rank 1 on a thread of its own: a step with rank 0, then a second once ``late`` is
    set (learning rate 1, gradient 1: the parameter ends at -2)."""
    def body():
        store, comm = world(1, url)
        with store, comm, _started_engine(comm, learning_rate=1.0) as engine:
            _one_step(engine)
            late.wait(60)
            _one_step(engine)
            engine.synchronize()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("call", ["wait_parameters", "synchronize", "gather_parameter", "close"])
def test_ctrl_c_while_the_engine_waits_for_a_late_peer_aborts_its_communicators(stage, call):
    """The main thread's engine waits for a peer that is alive but late (its step's
    collectives wait for it). These calls block in the library, so SIGINT's
    KeyboardInterrupt waited for them: the communicator's timeout (300 s by default), the
    second and later Ctrl-C too. Now Ctrl-C aborts the engine's communicators at once: the
    call raises KeyboardInterrupt within a second, the late peer's next collective fails at
    once instead of after its own timeout, and a wake-up fd the program had set gets the
    signal's byte and is set back."""
    from test_comm import JOIN_S, seconds_to_interrupt
    url = f"memory://ctrl-c-{uuid.uuid4().hex}"
    late = threading.Event()
    peer = {}

    def late_peer():
        try:
            store, comm = world(1, url)
            with store, comm, _started_engine(comm, stage=stage) as engine:
                _one_step(engine)
                late.wait(JOIN_S)
                start = time.monotonic()
                try:
                    _one_step(engine)
                    engine.synchronize()
                except hpshard.Error as e:
                    peer["failed"] = (time.monotonic() - start, e)
        except hpshard.Error:
            pass  # the close after the failure, or set-up: asserted on below

    thread = threading.Thread(target=late_peer, daemon=True)
    thread.start()
    program_read, program_write = os.pipe()
    os.set_blocking(program_write, False)
    signal.set_wakeup_fd(program_write)
    try:
        store, comm = world(0, url)
        with store, comm:
            engine = _started_engine(comm, stage=stage)
            _one_step(engine)
            _one_step(engine)  # the peer is late: this step's collectives wait for it
            blocked = {"wait_parameters": lambda: engine.wait_parameters(0),
                       "synchronize": engine.synchronize,
                       "gather_parameter": lambda: engine.gather_parameter(0),
                       "close": engine.close}[call]
            elapsed = seconds_to_interrupt(blocked, after=0.3)
            assert elapsed < 3.0, elapsed
            with pytest.raises(hpshard.AbortedError):
                comm.barrier().wait()
            late.set()
            thread.join(JOIN_S)
    finally:
        late.set()
        assert signal.set_wakeup_fd(-1) == program_write  # set back
        got = os.read(program_read, 64)
        os.close(program_read)
        os.close(program_write)
    assert not thread.is_alive()
    assert bytes([signal.SIGINT]) in got  # passed on
    seconds, error = peer["failed"]
    assert seconds < 5.0, (seconds, error)  # its timeout is 20 s
    assert "aborted" in str(error), error


def test_ctrl_c_under_a_programs_own_handler_aborts_nothing():
    """A program's own SIGINT handler may mean to go on (finish the step, save and stop):
    the engine's wait is not aborted, the handler runs when the call returns, and the
    training goes on."""
    url = f"memory://ctrl-c-own-{uuid.uuid4().hex}"
    late = threading.Event()
    seen = []
    thread = _late_peer(url, late)
    main = threading.main_thread().ident
    previous = signal.signal(signal.SIGINT, lambda *_: seen.append(time.monotonic()))
    try:
        store, comm = world(0, url)
        with store, comm, _started_engine(comm, learning_rate=1.0) as engine:
            _one_step(engine)
            _one_step(engine)
            threading.Timer(0.2, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
            threading.Timer(0.8, late.set).start()
            start = time.monotonic()
            engine.synchronize()
            assert time.monotonic() - start >= 0.7
            assert len(seen) == 1
            engine.wait_parameters(0)
            np.testing.assert_array_equal(engine.param(0), -2.0)  # two steps of lr 1
    finally:
        signal.signal(signal.SIGINT, previous)
        late.set()
        thread.join(60)


def test_a_signal_before_an_engine_call_does_not_abort_it():
    """A SIGINT whose byte reached the binding's pipe before the call (one that came as the
    last call ended, its KeyboardInterrupt caught by a program that then saves) is not the
    call's: the watcher aborted the save that followed (red team). Here the byte is written
    before the call by hand; the call waits for its late peer and completes. And the
    main-thread calls leave no cycle holding the engine (each call's frame held itself)."""
    url = f"memory://ctrl-c-stale-{uuid.uuid4().hex}"
    late = threading.Event()
    thread = _late_peer(url, late)
    gc.disable()
    try:
        store, comm = world(0, url)
        with store, comm:
            engine = _started_engine(comm, learning_rate=1.0)
            _one_step(engine)
            _one_step(engine)
            hpshard._CtrlC._start()
            os.write(hpshard._CtrlC._write, bytes([signal.SIGINT]))  # a signal's, earlier
            threading.Timer(0.5, late.set).start()
            engine.synchronize()
            engine.wait_parameters(0)
            np.testing.assert_array_equal(engine.param(0), -2.0)
            gone = weakref.ref(engine)
            engine.close()
            del engine
            assert gone() is None, "a cycle still holds the engine"
    finally:
        gc.enable()
        late.set()
        thread.join(60)


@pytest.mark.parametrize("closing", ["engine", "communicator"])
def test_a_close_on_another_thread_waits_for_the_call_under_way(closing):
    # Rank 0's gather_parameter waits for rank 1, which joins a second later; meanwhile
    # another thread of rank 0 closes the engine (or the communicator, which closes it). The
    # close waits for the call under way (it destroyed the engine under it before: every call
    # but the Store's and the Checkpoint's went uncounted), the gather completes with the
    # right values, and the next call is refused as closed.
    def rank(r, url):
        store, comm = world(r, url)
        engine = Engine.create(comm, stage=3)
        engine.add_param("w", [7])
        engine.seal()
        engine.param(0)[:] = np.arange(7, dtype=np.float32) if r == 0 else 0
        engine.broadcast_parameters()
        if r == 1:
            time.sleep(1.0)
            out = engine.gather_parameter(0)
            engine.close()
            comm.close()
            store.close()
            return out
        got, gathered_at = [], []

        def gather():
            got.append(engine.gather_parameter(0))
            gathered_at.append(time.monotonic())

        caller = threading.Thread(target=gather)
        caller.start()
        time.sleep(0.3)  # the call is under way, waiting for rank 1
        (engine if closing == "engine" else comm).close()
        closed_at = time.monotonic()
        caller.join(30)
        assert not caller.is_alive() and got, "the gather did not complete"
        assert closed_at >= gathered_at[0], "the close returned while the call ran"
        with pytest.raises(ValueError, match="closed"):
            engine.step()
        comm.close()
        store.close()
        return got[0]

    for out in run_ranks(2, rank, tag="close-waits"):
        np.testing.assert_array_equal(out, np.arange(7, dtype=np.float32))


@pytest.mark.parametrize("kind", ["engine", "communicator", "clip", "stream", "work"])
def test_a_close_waits_for_every_counted_call(kind):
    # Every handle's calls into its C handle are counted (Handle._using, _counted): a close
    # on another thread waits until none is under way. Only Store and Checkpoint waited
    # before; the others destroyed the C handle under a running call.
    store = Store.open(unique_url("close-counted"), 0)
    comm = Communicator.create(store, 0, 1)
    if kind == "engine":
        handle = Engine.create(comm)
    elif kind == "communicator":
        handle = comm
    elif kind == "clip":
        handle = Clip()
    elif kind == "stream":
        handle = Stream()
    else:
        data = np.ones(4, np.float32)
        handle = comm.all_reduce(data, data)
    try:
        with handle._using():  # a call under way on this thread
            closer = threading.Thread(target=handle.close)
            closer.start()
            closer.join(0.5)
            assert closer.is_alive(), "the close did not wait for the call under way"
            assert handle.closed  # no new call starts meanwhile
            with pytest.raises(ValueError, match="closed"):
                handle._counted().resident_bytes()
        closer.join(30)
        assert not closer.is_alive()
    finally:
        comm.close()
        store.close()
