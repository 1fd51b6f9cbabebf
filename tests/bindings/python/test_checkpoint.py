"""Checkpoints through the Python binding: hpshard.Checkpoint and the checkpoint-file
functions. A tiny model is trained through the engine over thread-ranks, saved in the
background, and loaded into fresh engines of the same topology (resuming bitwise) and of
other stages and sharding degrees; inspect, verify, the saved engine options, safetensors
export and import, partial loads, and bad input raising the library's errors with nothing
changed."""

import contextlib
import json
import os
import pathlib
import shutil
import struct
import subprocess
import threading
import time
import uuid

import numpy as np
import pytest

import hpshard
from hpshard import Checkpoint, Communicator, Engine, Optimizer, Store
from test_comm import JOIN_S, run_ranks, seconds_to_interrupt, status_of
from test_engine import world

INVALID_ARGUMENT = 1
NOT_FOUND = 3
ALREADY_EXISTS = 4
FAILED_PRECONDITION = 5

# (name, shape, unit) in registration order.
MODEL = [("w0", (64, 6), 0), ("b0", (6,), 0), ("w1", (6, 3), 1), ("b1", (3,), 1)]


def initial(name, shape):
    n = int(np.prod(shape))
    return (0.4 * np.sin(np.arange(n) * 0.61 + len(name) + ord(name[0]))).astype(
        np.float32).reshape(shape)


def target(name, shape, step):
    """The data's part of every rank's gradient: the same on every rank, so a mean over any
    number of ranks is the same value and any topology trains the same model."""
    n = int(np.prod(shape))
    return np.cos(np.arange(n) * 0.23 + 1.3 * step + ord(name[1])).astype(np.float32) \
        .reshape(shape)


def build(comm, stage=2, dp=None, options=None, model=MODEL, fill=None, **kwargs):
    """An engine over `comm` with `model` registered and sealed, rank 0's `fill` (default:
    the initial values) broadcast to every rank."""
    if options is not None:
        options.stage = stage
        engine = Engine.create(comm, dp, options=options)
    else:
        engine = Engine.create(comm, dp, optimizer=Optimizer.ADAMW, learning_rate=0.02,
                               weight_decay=0.01, stage=stage, **kwargs)
    index = {n: engine.add_param(n, s, unit=u) for n, s, u in model}
    engine.seal()
    for n, s, _ in model:
        value = initial(n, s) if fill is None else np.full(s, fill, dtype=np.float32)
        engine.param(index[n])[...] = value if comm.rank == 0 else np.float32(0)
    engine.broadcast_parameters()
    return engine, index


def train(engine, index, first, steps, model=MODEL):
    """Steps first .. first+steps-1: gradients 0.3 * p + target, checked in one by one."""
    shapes = {n: s for n, s, _ in model}
    for step in range(first, first + steps):
        for unit in (0, 1):
            engine.wait_parameters(unit)
        p = {n: engine.param(i) for n, i in index.items()}
        for n in reversed(list(index)):
            g = engine.grad(index[n])
            g += np.float32(0.3) * p[n] + target(n, shapes[n], step)
            engine.grad_ready(index[n])
        for unit in (1, 0):
            engine.release_parameters(unit)
        engine.step()


def gathered(engine, index):
    return {n: engine.gather_parameter(i) for n, i in index.items()}


def assert_same(a, b, exact=True, what=""):
    assert a.keys() == b.keys()
    for n in a:
        if exact:
            np.testing.assert_array_equal(a[n], b[n], err_msg=f"{what} {n}")
        else:
            np.testing.assert_allclose(a[n], b[n], rtol=1e-6, atol=1e-7, err_msg=f"{what} {n}")


def one_param_engine(comm, value, **options):
    """An SGD engine (unless `options` say otherwise) over `comm` holding one parameter "w"
    of `value`'s shape, set to `value`: the engine and the parameter's index."""
    e = Engine.create(comm, **{"optimizer": Optimizer.SGD, **options})
    i = e.add_param("w", value.shape)
    e.seal()
    e.param(i)[...] = value
    e.broadcast_parameters()
    return e, i


def one_step(e, i, gradient):
    """One step of a one_param_engine whose gradient is `gradient`."""
    e.wait_parameters(0)
    e.grad(i)[...] = gradient
    e.grad_ready(i)
    e.release_parameters(0)
    e.step()


def test_options_and_info_structs():
    assert hpshard.EngineOptions.defaults().bucket_bytes == 0
    assert hpshard.CheckpointInfo.struct_size() >= 297
    assert status_of(lambda: hpshard.CheckpointInfo.struct_size(8)) == INVALID_ARGUMENT
    o = hpshard.capi.checkpoint_options_init(hpshard.capi.checkpoint_options_struct_size())
    assert (o.keep_last, o.chunk_bytes) == (0, 1 << 20) and o.timeout_ms > 0
    lo = hpshard.capi.checkpoint_load_options_init(
        hpshard.capi.checkpoint_load_options_struct_size())
    assert lo.allow_partial == 0


def test_save_then_resume_in_the_same_and_other_topologies(tmp_path):
    root = tmp_path / "ckpt"
    saved_steps, more = 3, 2

    def first_run(r, url):
        store, comm = world(r, url)
        with store, comm:
            engine, index = build(comm)
            with engine, Checkpoint.create(engine, comm, root, keep_last=3) as ckpt:
                train(engine, index, 0, saved_steps)
                engine.set_learning_rate(0.015)  # a schedule's next rate, which is saved
                at_save = gathered(engine, index)
                hpshard.host_sync_reset()
                work = ckpt.save(f"step-{saved_steps}", {"step": str(saved_steps),
                                                          "loader": "epoch 0 batch 7"})
                train(engine, index, saved_steps, more)  # overlaps the writing
                syncs = hpshard.host_sync_count_thread()
                work.wait()
                assert work.test()
                assert status_of(lambda: ckpt.save(f"step-{saved_steps}").wait()) \
                    == ALREADY_EXISTS
                final = gathered(engine, index)
        return at_save, final, syncs

    results = run_ranks(2, first_run, "ckpt-first")
    at_save, final, syncs = results[0]
    assert [s for _, _, s in results] == [0, 0], "host syncs in the steps after the save"
    assert_same(results[1][0], at_save)
    assert_same(results[1][1], final)
    assert not np.array_equal(at_save["w0"], initial("w0", (64, 6)))

    info = hpshard.checkpoint_inspect(root)
    assert (info.name, info.stage, info.sharding, info.dp, info.world, info.files) == \
        (f"step-{saved_steps}", 2, 2, 1, 2, 2)
    assert info.format_version == 1 and len(info.id) == 32 and info.created_unix_ns > 0
    # Per parameter: param, exp_avg, exp_avg_sq (float32); four step scalars.
    assert info.tensors == 3 * len(MODEL) + 4
    assert info.bytes == 3 * 4 * sum(int(np.prod(s)) for _, s, _ in MODEL) + 4 + 4 + 8 + 8
    hpshard.checkpoint_verify(root)
    hpshard.checkpoint_verify(root / f"step-{saved_steps}")
    options = hpshard.checkpoint_read_engine_options(root)
    assert options.optimizer == Optimizer.ADAMW and options.stage == 2
    assert options.learning_rate == np.float32(0.015) and options.weight_decay == np.float32(0.01)

    def resume(stage, size):
        def rank(r, url):
            store, comm = world(r, url, size)
            with store, comm:
                engine, index = build(comm, stage, options=hpshard.checkpoint_read_engine_options(
                    root), fill=7.0)
                with engine, Checkpoint.create(engine, comm, root) as ckpt:
                    assert status_of(lambda: ckpt.metadata("step")) == NOT_FOUND
                    ckpt.load()  # latest
                    step = int(ckpt.metadata("step"))
                    assert ckpt.metadata("loader") == "epoch 0 batch 7"
                    loaded = gathered(engine, index)
                    train(engine, index, step, more)
                    return loaded, gathered(engine, index)
        return run_ranks(size, rank, f"ckpt-resume-{stage}-{size}")

    # The same topology resumes bitwise: parameters and optimizer state.
    for loaded, resumed in resume(2, 2):
        assert_same(loaded, at_save, what="stage 2, 2 ranks, loaded")
        assert_same(resumed, final, what="stage 2, 2 ranks, resumed")
    # Other sharding degrees and stage 3: the same parameters, the same training.
    for stage, size in ((3, 4), (3, 1), (2, 1)):
        for loaded, resumed in resume(stage, size):
            assert_same(loaded, at_save, what=f"stage {stage}, {size} ranks, loaded")
            assert_same(resumed, final, exact=False, what=f"stage {stage}, {size} ranks")


def single_rank(tag):
    store = Store.open(f"memory://py-ckpt-{tag}-{uuid.uuid4().hex}", 0)
    return store, Communicator.create(store, 0, 1)


@contextlib.contextmanager
def mp2_part(rank, url):
    """Rank ``rank`` of two thread-ranks as mp 2 (sharding 1): a sealed engine of that
    part holding one DISTRIBUTED parameter ``w`` of 3 (index 0), its sharding communicator
    and the world communicator."""
    store, world_comm = world(rank, url, size=2)
    with store, world_comm, hpshard.Topology(1, 1, 1, 1, 2, 2) as topo:
        group = hpshard.HybridGroup.create(world_comm, topo)
        sharding = group.comm(hpshard.Group.SHARDING)
        with Engine.create(sharding, learning_rate=1.0) as engine:
            engine.set_model_parallel_groups(group.comm(hpshard.Group.MP), None)
            engine.add_param("w", (3,), distributed=True)
            engine.seal()
            yield engine, sharding, world_comm


def test_export_import_safetensors_and_metadata(tmp_path):
    store, comm = single_rank("export")
    with store, comm:
        engine, index = build(comm)
        with engine, Checkpoint.create(engine, comm, tmp_path) as ckpt:
            train(engine, index, 0, 2)
            saved = gathered(engine, index)
            ckpt.save("two", {"step": "2"}).wait()
            out = tmp_path / "model.safetensors"
            hpshard.checkpoint_export_safetensors(tmp_path / "two", out, fp32=True)
            # The file as the format says: header length, JSON header, raw data.
            raw = out.read_bytes()
            (length,) = struct.unpack("<Q", raw[:8])
            header = json.loads(raw[8:8 + length])
            for n, s, _ in MODEL:
                entry = header[n]
                assert entry["dtype"] == "F32" and tuple(entry["shape"]) == s
                begin, end = entry["data_offsets"]
                data = np.frombuffer(raw[8 + length + begin:8 + length + end], np.float32)
                np.testing.assert_array_equal(data.reshape(s), saved[n])
            assert header["__metadata__"]["step"] == "2"
            # Imported into a fresh engine: the parameters, and the file's metadata.
            fresh, findex = build(comm, fill=-1.0)
            with fresh, Checkpoint.create(fresh, comm, tmp_path / "other") as other:
                other.import_safetensors(out)
                assert_same(gathered(fresh, findex), saved)
                assert other.metadata("step") == "2"
                assert status_of(lambda: other.import_safetensors(tmp_path / "absent")) \
                    == NOT_FOUND
    assert status_of(lambda: hpshard.checkpoint_export_safetensors(
        tmp_path / "absent", tmp_path / "x.safetensors")) == NOT_FOUND
    # A path holding a NUL is refused (as os.open refuses it), not cut short at the NUL:
    # it would name another checkpoint or file.
    cut = str(tmp_path / "two") + "\0/../elsewhere"
    for call in (lambda: hpshard.checkpoint_inspect(cut),
                 lambda: hpshard.checkpoint_verify(cut),
                 lambda: hpshard.checkpoint_export_safetensors(tmp_path / "two",
                                                               str(out) + "\0.evil"),
                 lambda: Store.open("memory://nul\0name", 0)):
        with pytest.raises(ValueError, match="NUL"):
            call()


def test_none_and_other_objects_are_refused_where_a_name_or_path_is_taken(tmp_path):
    """None (or a number, or bytes) as a checkpoint name, metadata key or path is a
    TypeError naming it: str() sent None as the text "None", so save(None) published a
    checkpoint named "None" while load(None) means the latest. load(None) still does."""
    store, comm = single_rank("none-names")
    with store, comm:
        engine, index = build(comm)
        with engine:
            with pytest.raises(TypeError, match="^Checkpoint.create: the root must be str, bytes "
                                                "or os.PathLike, not None$"):
                Checkpoint.create(engine, comm, None)
            with Checkpoint.create(engine, comm, tmp_path) as ckpt:
                train(engine, index, 0, 1)
                before = sorted(os.listdir(tmp_path))
                for name in (None, 3):
                    with pytest.raises(TypeError, match="^Checkpoint.save: the name must be str"):
                        ckpt.save(name)
                assert sorted(os.listdir(tmp_path)) == before
                ckpt.save("one", {"step": "1"}).wait()
                saved = gathered(engine, index)
                train(engine, index, 1, 1)
                engine.synchronize()
                with pytest.raises(TypeError, match="^Checkpoint.load: the name must be str, "
                                                    "not int$"):
                    ckpt.load(3)
                ckpt.load(None)  # the latest
                assert_same(gathered(engine, index), saved)
                with pytest.raises(TypeError, match="^Checkpoint.metadata: the key must be str, "
                                                    "not None$"):
                    ckpt.metadata(None)
                assert ckpt.metadata("step") == "1"
                with pytest.raises(TypeError, match="^Checkpoint.import_safetensors: the path "
                                                    "must be str, bytes or os.PathLike, not "
                                                    "None$"):
                    ckpt.import_safetensors(None)
    one, out = tmp_path / "one", tmp_path / "one.safetensors"
    calls = {"checkpoint_inspect: the path": hpshard.checkpoint_inspect,
             "checkpoint_verify: the path": hpshard.checkpoint_verify,
             "checkpoint_read_engine_options: the path": hpshard.checkpoint_read_engine_options,
             "checkpoint_export_safetensors: the path":
                 lambda p: hpshard.checkpoint_export_safetensors(p, out),
             "checkpoint_export_safetensors: out":
                 lambda p: hpshard.checkpoint_export_safetensors(one, p)}
    for what, call in calls.items():
        for bad, kind in ((None, "None"), (5, "int"), (bytearray(b"/tmp"), "bytearray")):
            with pytest.raises(TypeError, match=f"^{what} must be str, bytes or os.PathLike, "
                                                f"not {kind}$"):
                call(bad)
    assert hpshard.checkpoint_inspect(one).name == "one"  # an os.PathLike still goes
    assert not out.exists() and "None" not in os.listdir(tmp_path)


def test_paths_that_are_not_utf8_reach_their_files(tmp_path):
    """A root whose name is not UTF-8 (as os.listdir gives it: str with surrogates, or
    bytes) is the same directory for every call. The str was refused as "argument 1 of type
    'char const *'", and bytes were refused."""
    root = os.path.join(os.fsencode(tmp_path), b"ckpt-\xff\xfe")
    os.mkdir(root)
    as_str = os.fsdecode(root)
    assert "\udcff" in as_str
    store, comm = single_rank("not-utf8")
    with store, comm:
        engine, index = build(comm)
        with engine:
            with Checkpoint.create(engine, comm, as_str) as ckpt:
                train(engine, index, 0, 1)
                ckpt.save("one", {"step": "1"}).wait()
            with Checkpoint.create(engine, comm, root) as ckpt:
                ckpt.load("one")
                assert ckpt.metadata("step") == "1"
    one = os.path.join(root, b"one")
    assert b"one" in os.listdir(root)
    for path in (one, os.fsdecode(one), pathlib.Path(os.fsdecode(one))):
        assert hpshard.checkpoint_inspect(path).name == "one"
        hpshard.checkpoint_verify(path)
    out = os.path.join(os.fsencode(tmp_path), b"model-\xff.safetensors")
    hpshard.checkpoint_export_safetensors(os.fsdecode(one), out)
    assert os.path.getsize(out) > 8
    with pytest.raises(ValueError, match="a path holds a NUL character"):
        hpshard.checkpoint_inspect(one + b"\0/x")


def test_partial_load_and_bad_input_change_nothing(tmp_path):
    store, comm = single_rank("bad")
    with store, comm:
        engine, index = build(comm)
        with engine, Checkpoint.create(engine, comm, tmp_path) as ckpt:
            train(engine, index, 0, 1)
            saved = gathered(engine, index)
            # Names and metadata the library refuses, the library's errors.
            for name in ("../escape", ".hidden", "", "a/b", "latest.tmp"):
                with pytest.raises(hpshard.InvalidArgumentError) as e:
                    ckpt.save(name)
                assert e.value.status == INVALID_ARGUMENT
            with pytest.raises(TypeError):
                ckpt.save("typed", {"step": 1})
            with pytest.raises(ValueError):
                ckpt.save("nul", {"step": "1\0"})
            ckpt.save("one", {"step": "1"}).wait()
            with pytest.raises(hpshard.AlreadyExistsError):
                ckpt.save("one").wait()
            with pytest.raises(hpshard.NotFoundError) as e:
                ckpt.load("absent")
            assert e.value.status == NOT_FOUND and "absent" in e.value.message
            train(engine, index, 1, 1)
            # In the middle of a step: refused, the step goes on.
            for unit in (0, 1):
                engine.wait_parameters(unit)
            engine.grad_ready(index["b1"])
            assert status_of(lambda: ckpt.load("one")) == FAILED_PRECONDITION
            for n in ("w1", "b0", "w0"):
                engine.grad_ready(index[n])
            for unit in (1, 0):
                engine.release_parameters(unit)
            engine.step()
            after = gathered(engine, index)
            # A flipped byte: verify names the file; a load changes nothing.
            data = tmp_path / "one" / "rank-00000.bin"
            blob = bytearray(data.read_bytes())
            blob[200] ^= 0x40
            data.write_bytes(bytes(blob))
            with pytest.raises(hpshard.InvalidArgumentError) as e:
                hpshard.checkpoint_verify(tmp_path / "one")
            assert "rank-00000.bin" in e.value.message
            assert status_of(lambda: ckpt.load("one")) == INVALID_ARGUMENT
            assert_same(gathered(engine, index), after)
            blob[200] ^= 0x40
            data.write_bytes(bytes(blob))
            hpshard.checkpoint_verify(tmp_path / "one")

        # Another model: one parameter more. Refused naming it, unless partial.
        extra = MODEL + [("extra", (5,), 1)]
        bigger, bindex = build(comm, model=extra, fill=2.0)
        with bigger, Checkpoint.create(bigger, comm, tmp_path) as ckpt:
            before = gathered(bigger, bindex)
            with pytest.raises(hpshard.InvalidArgumentError) as e:
                ckpt.load("one")
            assert "extra" in e.value.message
            assert_same(gathered(bigger, bindex), before)
            ckpt.load("one", allow_partial=True)
            loaded = gathered(bigger, bindex)
            np.testing.assert_array_equal(loaded.pop("extra"), np.full(5, 2.0, np.float32))
            assert_same(loaded, saved)

        # A group of another size; a closed handle.
        with pytest.raises(TypeError):
            Checkpoint.create(engine, None, tmp_path)
    assert status_of(lambda: hpshard.checkpoint_inspect(tmp_path / "nothing")) == NOT_FOUND
    assert status_of(lambda: hpshard.checkpoint_read_engine_options(tmp_path / "nothing")) \
        == NOT_FOUND
    with pytest.raises(ValueError):
        ckpt.load("one")


def test_group_of_another_size_is_refused(tmp_path):
    def rank(r, url):
        store, comm = world(r, url)
        with store, comm:
            solo_store = Store.open(f"{url}-solo-{r}", 0)
            solo = Communicator.create(solo_store, 0, 1)
            with solo_store, solo:
                engine, _ = build(comm)
                with engine:
                    with pytest.raises(hpshard.InvalidArgumentError) as e:
                        Checkpoint.create(engine, solo, tmp_path / f"r{r}")
                    return e.value.status

    assert run_ranks(2, rank, "ckpt-group") == [INVALID_ARGUMENT] * 2


def test_a_group_of_the_longest_name_takes_a_checkpoint(tmp_path):
    """A communicator name the header takes (1 to 1024 bytes, 'é' straddling the cut) makes
    a checkpoint: its own group's name is cut to fit (it was name + '.checkpoint', refused
    past 1024 bytes)."""
    for name in ("n" * 1024, "n" * 1012 + "é" * 6):
        url = f"memory://ckpt-long-{uuid.uuid4().hex}"
        with Store.open(url, 0) as store, \
                Communicator.create(store, 0, 1, name=name) as comm:
            engine, _ = build(comm)
            with engine, Checkpoint.create(engine, comm, tmp_path / str(len(name))) as ckpt:
                ckpt.save("a").wait()


def test_metadata_too_large_for_the_readers_is_refused_before_anything_is_written(tmp_path):
    """Each entry within its limits, but together more than the 64 MiB of JSON the manifest
    and an export's safetensors header carry (a control character is 6 bytes there): the
    save is refused at once (it published a manifest its own load refused, past 1 GiB, or an
    export that import_safetensors refused, past 100 MiB)."""
    url = f"memory://ckpt-meta-{uuid.uuid4().hex}"
    with Store.open(url, 0) as store, Communicator.create(store, 0, 1) as comm:
        engine, _ = build(comm)
        with engine, Checkpoint.create(engine, comm, tmp_path) as ckpt:
            for metadata in ({f"k{i}": "v" * (1 << 20) for i in range(65)},
                             {f"k{i}": "\x01" * (1 << 20) for i in range(11)}):
                with pytest.raises(hpshard.InvalidArgumentError, match="more than the 67108864"):
                    ckpt.save("a", metadata)
                assert not (tmp_path / "a").exists()
            ckpt.save("a", {f"k{i}": "\x01" * (1 << 20) for i in range(10)}).wait()
            ckpt.load("a")


def test_closing_the_engine_closes_its_checkpoints_first(tmp_path):
    store, comm = single_rank("close")
    with store, comm:
        engine, index = build(comm)
        ckpt = Checkpoint.create(engine, comm, tmp_path)
        train(engine, index, 0, 1)
        work = ckpt.save("s")
        engine.close()  # waits for the save through the checkpoint's close
        assert ckpt.closed and engine.closed
        work.wait()
        assert os.path.exists(tmp_path / "s" / "manifest.json")
        hpshard.checkpoint_verify(tmp_path / "s")
        other, _ = build(comm)
        ckpt = Checkpoint.create(other, comm, tmp_path)
    assert ckpt.closed and other.closed  # closing the communicator closed both


@pytest.mark.parametrize("stage", [2, 3])
def test_an_engine_without_loss_scaling_keeps_scale_one_after_loading_a_scaled_run(tmp_path,
                                                                                  stage):
    # The checkpoint's loss scale is the saving engine's; an engine without dynamic loss
    # scaling multiplies no loss, so it must keep dividing gradients by 1, not by the
    # saved scale.
    def engine(comm, scaled):
        return one_param_engine(comm, np.ones(4, np.float32), stage=stage, learning_rate=0.1,
                                dynamic_loss_scaling=scaled, initial_loss_scale=1024.0)

    step = one_step

    store, comm = single_rank("unscaled")
    with store, comm:
        e, i = engine(comm, True)
        with e, Checkpoint.create(e, comm, tmp_path) as ck:
            step(e, i, 1024.0)  # the loss scaled by 1024: an unscaled gradient of 1
            ck.save("scaled").wait()
        e, i = engine(comm, False)
        with e, Checkpoint.create(e, comm, tmp_path) as ck:
            ck.load("scaled")
            assert e.loss_scale == 1.0
            step(e, i, 1.0)
            np.testing.assert_allclose(e.gather_parameter(i), np.full(4, 0.8, np.float32),
                                       rtol=1e-6)
        # The other way: an engine with loss scaling loading a run without it starts its
        # scaling afresh (its initial scale), not at the saved scale of 1.
        e, i = engine(comm, False)
        with e, Checkpoint.create(e, comm, tmp_path) as ck:
            step(e, i, 1.0)
            ck.save("unscaled").wait()
        e, i = engine(comm, True)
        with e, Checkpoint.create(e, comm, tmp_path) as ck:
            ck.load("unscaled")
            assert e.loss_scale == 1024.0
            step(e, i, 1024.0)  # the loss scaled by 1024
            np.testing.assert_allclose(e.gather_parameter(i), np.full(4, 0.8, np.float32),
                                       rtol=1e-6)
            assert e.skipped_steps == 0


def test_a_load_keeps_the_engines_options_and_restores_its_state(tmp_path):
    # The saving engine ran SGD with momentum 0.9 at rate 0.1 and weight decay 0.5; the
    # loading one is made with rate 0.3, momentum 0.5, no decay, then set to rate 0.25. The
    # step after the load must use the loading engine's options on the saved momentum
    # buffer and parameters, as torch's SGD does once it has loaded a state and its
    # schedule has set the rate.
    def engine(comm, **options):
        return one_param_engine(comm, np.array([1.0, -2.0, 0.5], np.float32), **options)

    step = one_step

    g1 = np.array([0.5, 1.0, -1.5])
    g2 = np.array([2.0, -0.25, 0.75])
    p = np.array([1.0, -2.0, 0.5])
    d = g1 + 0.5 * p  # the saving engine's first step: coupled decay 0.5, buffer = d
    buf, p = d, p - 0.1 * d
    store, comm = single_rank("options")
    with store, comm:
        e, i = engine(comm, learning_rate=0.1, momentum=0.9, weight_decay=0.5)
        with e, Checkpoint.create(e, comm, tmp_path) as ck:
            step(e, i, g1)
            ck.save("sgd").wait()
            np.testing.assert_allclose(e.gather_parameter(i), p, rtol=1e-6)
        e, i = engine(comm, learning_rate=0.3, momentum=0.5)
        e.set_learning_rate(0.25)
        with e, Checkpoint.create(e, comm, tmp_path) as ck:
            ck.load("sgd")
            np.testing.assert_allclose(e.gather_parameter(i), p, rtol=1e-6)
            step(e, i, g2)
            buf = 0.5 * buf + g2  # the loading engine's momentum, no decay
            np.testing.assert_allclose(e.gather_parameter(i), p - 0.25 * buf, rtol=1e-6)
        saved = hpshard.checkpoint_read_engine_options(tmp_path / "sgd")
        assert (saved.learning_rate, saved.momentum, saved.weight_decay) == pytest.approx(
            (0.1, 0.9, 0.5))


def test_a_part_is_refused_at_a_root_holding_a_whole_models_checkpoints(tmp_path):
    """A whole model's root has no claim file: a part's engine there was accepted, claimed
    the root, and its rotation deleted the whole model's checkpoints (and `latest` named the
    part's). It is refused, naming the checkpoint, and nothing under the root changes. A
    root holding only this part's own checkpoints (its claim file lost) is taken again."""
    root = tmp_path / "root"
    store, comm = single_rank("whole-root")
    with store, comm, Engine.create(comm, learning_rate=1.0) as whole:
        whole.add_param("w", (3,))
        whole.seal()
        with Checkpoint.create(whole, comm, root) as ckpt:
            ckpt.save("whole-1").wait()
            ckpt.save("whole-2").wait()
    before = sorted(os.listdir(root))

    def body(rank, url):
        with mp2_part(rank, url) as (engine, sharding, world_comm):
            with pytest.raises(hpshard.Error) as info:
                Checkpoint.create(engine, sharding, root, keep_last=1)
            own = tmp_path / f"part{rank}"
            with Checkpoint.create(engine, sharding, own) as ckpt:
                ckpt.save("p").wait()
            os.remove(own / ".hpshard-part")
            stale, fresh = own / ".hpshard-part.tmp-stale", own / ".hpshard-part.tmp-fresh"
            stale.write_text("left by a crash\n")  # two hours old: removed
            os.utime(stale, (time.time() - 7200, time.time() - 7200))
            fresh.write_text("another claim's, under way\n")  # kept
            with Checkpoint.create(engine, sharding, own, keep_last=1) as ckpt:
                ckpt.save("q").wait()
            return info.value.status, info.value.message, sorted(os.listdir(own))

    for rank, (status, message, own) in enumerate(run_ranks(2, body, "ckpt-part-on-whole")):
        assert status == 1, message  # INVALID_ARGUMENT
        assert "checkpoint 'whole-" in message and "of the whole model" in message, message
        assert f"mp rank {rank} of 2" in message, message
        # keep_last=1, but a part keeps two (the one before its newest too)
        assert own == [".hpshard-part", ".hpshard-part.tmp-fresh", "latest", "p", "q"], own
    assert sorted(os.listdir(root)) == before == ["latest", "whole-1", "whole-2"]
    assert hpshard.checkpoint_inspect(root / "whole-2").format_version == 1
    assert (root / "latest").read_text().strip() == "whole-2"


def test_the_parts_of_a_model_load_the_same_checkpoint_or_none_does(tmp_path):
    """mp 2: both parts save s1, then only part 0 publishes s2 (part 1's save died), so
    their `latest` name different checkpoints. Loading `latest` used to mix the two steps
    silently, then to refuse: it loads s1, the newest checkpoint both parts hold. A name one
    part lacks fails there and ends ABORTED on the other part, unchanged too; a name both
    hold loads."""

    def body(rank, url):
        with mp2_part(rank, url) as (engine, sharding, world_comm):
            w = 0
            out = {}
            with Checkpoint.create(engine, sharding, tmp_path / f"part{rank}") as ckpt:
                engine.param(w)[...] = 1.0
                ckpt.save("s1", {"step": "1"}).wait()
                engine.param(w)[...] = 2.0
                if rank == 0:
                    ckpt.save("s2", {"step": "2"}).wait()
                engine.param(w)[...] = 7.0
                with pytest.raises(hpshard.Error) as info:
                    ckpt.load("s2")
                out["s2"] = (info.value.status, info.value.message, engine.param(w).copy())
                ckpt.load()
                out["latest"] = (ckpt.metadata("step"), engine.param(w).copy())
                engine.param(w)[...] = 7.0
                ckpt.load("s1")
                out["s1"] = engine.param(w).copy()
            return out

    for rank, out in enumerate(run_ranks(2, body, "ckpt-parts-agree")):
        step, after = out["latest"]
        assert step == "1"
        np.testing.assert_array_equal(after, [1.0] * 3)
        status, message, after = out["s2"]
        if rank == 0:
            assert status == 9 and "failed on another part" in message, message  # ABORTED
        else:
            assert status == 3, message  # NOT_FOUND
        np.testing.assert_array_equal(after, [7.0] * 3)
        np.testing.assert_array_equal(out["s1"], [1.0] * 3)


def test_ctrl_c_interrupts_a_close_waiting_for_a_save_and_leaves_the_checkpoint_open(tmp_path):
    """Rank 0 (the main thread) saves while rank 1 has not called save yet, then closes the
    checkpoint: the close waits for the save in Work.wait's slices, so SIGINT raises
    KeyboardInterrupt at once (it used to wait for the save, here until the checkpoint's
    20 s timeout) and the checkpoint stays open. Rank 1 saves; the next close finishes and
    the checkpoint is published."""
    url = f"memory://py-ckpt-sigint-{uuid.uuid4().hex}"
    go = threading.Event()
    errors = []

    def peer():
        try:
            store, comm = world(1, url)
            with store, comm, Engine.create(comm) as engine:
                engine.add_param("w", (8,))
                engine.seal()
                with Checkpoint.create(engine, comm, tmp_path, timeout_ms=20000) as ckpt:
                    go.wait(60)
                    ckpt.save("s").wait()
        except BaseException as e:  # noqa: BLE001 — reported below
            errors.append(e)

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    store, comm = world(0, url)
    with store, comm, Engine.create(comm) as engine:
        engine.add_param("w", (8,))
        engine.seal()
        ckpt = Checkpoint.create(engine, comm, tmp_path, timeout_ms=20000)
        save = ckpt.save("s")
        try:
            elapsed = seconds_to_interrupt(ckpt.close)
            assert not ckpt.closed
        finally:
            go.set()
        assert elapsed < 2.0, elapsed
        ckpt.close()
        assert ckpt.closed
        assert save.wait() is True
    thread.join(60)
    assert not thread.is_alive() and not errors, errors
    assert (tmp_path / "latest").read_text().strip() == "s"
    hpshard.checkpoint_verify(tmp_path / "s")


@pytest.mark.parametrize("call", ["create", "load", "import"])
def test_ctrl_c_ends_a_checkpoint_call_waiting_for_a_rank_and_aborts_its_groups(tmp_path, call):
    """Checkpoint.create, load and import_safetensors are collective: on rank 0 (the main
    thread) they waited for a rank 1 that never called them until the checkpoint's timeout
    (here 20 s) whatever the signals. SIGINT now raises KeyboardInterrupt within a slice,
    aborts the group, and a load or import has changed nothing."""
    url = f"memory://py-ckpt-ctrl-c-{call}-{uuid.uuid4().hex}"
    saved, go = threading.Event(), threading.Event()
    errors = []
    export = tmp_path / "model.safetensors"

    def peer():  # saves with rank 0, never joins the call under test
        try:
            store, comm = world(1, url)
            with store, comm, Engine.create(comm) as engine:
                engine.add_param("w", (8,))
                engine.seal()
                if call != "create":
                    with Checkpoint.create(engine, comm, tmp_path, timeout_ms=20000) as ckpt:
                        ckpt.save("s").wait()
                        saved.set()
                        go.wait(JOIN_S)
                else:
                    go.wait(JOIN_S)
        except BaseException as e:  # noqa: BLE001 — reported below
            errors.append(e)

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    store, comm = world(0, url)
    try:
        with store, comm, Engine.create(comm) as engine:
            engine.add_param("w", (8,))
            engine.seal()
            if call == "create":
                elapsed = seconds_to_interrupt(
                    lambda: Checkpoint.create(engine, comm, tmp_path, timeout_ms=20000), after=0.3)
            else:
                ckpt = Checkpoint.create(engine, comm, tmp_path, timeout_ms=20000)
                engine.param(0)[...] = 1.0
                ckpt.save("s").wait()
                assert saved.wait(JOIN_S)
                hpshard.checkpoint_export_safetensors(tmp_path / "s", export)
                engine.param(0)[...] = 7.0
                if call == "load":
                    elapsed = seconds_to_interrupt(lambda: ckpt.load("s"), after=0.3)
                else:
                    elapsed = seconds_to_interrupt(lambda: ckpt.import_safetensors(export),
                                                   after=0.3)
                np.testing.assert_array_equal(engine.param(0), [7.0] * 8)
                ckpt.close()
            assert elapsed < 3.0, elapsed
            assert status_of(lambda: comm.barrier().wait()) == 9  # ABORTED
    finally:
        go.set()
    thread.join(JOIN_S)
    assert not thread.is_alive() and not errors, errors


def test_a_manifests_strings_reach_no_message_as_control_bytes(tmp_path):
    """A manifest's name, format and metadata keys are the writer's: edited to hold terminal
    escapes they are refused (the name is a checkpoint name) or shown escaped, in the
    library's errors and in hpshard-ckpt's output; a parameter name with a control
    character is refused at registration (a checkpoint naming it would not load)."""
    store, comm = single_rank("ckpt-escapes")
    with store, comm, Engine.create(comm) as engine:
        with pytest.raises(hpshard.Error) as info:
            engine.add_param("w\x1b[2J", (3,))
        assert info.value.status == 1 and "\\x1b" in info.value.message, info.value.message
        engine.add_param("w", (3,))
        engine.seal()
        with Checkpoint.create(engine, comm, tmp_path / "root") as ckpt:
            ckpt.save("a").wait()
    source = tmp_path / "root" / "a"
    for what in ("name", "format", "metadata"):
        copy = tmp_path / what / "a"
        shutil.copytree(source, copy)
        with open(copy / "manifest.json") as f:
            manifest = json.load(f)
        # Without its own checksum (as manifests were written before it), the edit reaches the
        # checks of each field; with it, the checksum alone refuses the edit.
        del manifest["manifest_xxh3"]
        if what == "metadata":
            manifest["metadata"] = {"k\x1b[2J": 1}
        else:
            manifest[what] = "x\x1b[2J\x1b[31mRED"
        with open(copy / "manifest.json", "w") as f:
            json.dump(manifest, f)
        with pytest.raises(hpshard.Error) as info:
            hpshard.checkpoint_inspect(copy)
        assert "\x1b" not in info.value.message and "\\x1b" in info.value.message, \
            info.value.message
        tool = os.environ.get("HPS_CKPT_TOOL")  # set by ctest
        if tool:
            for command in (["inspect", str(copy)], ["list", str(copy.parent)]):
                shown = subprocess.run([tool, *command], capture_output=True)
                assert b"\x1b" not in shown.stdout + shown.stderr, (command, shown)
            # The library's message is escaped once: the tool shows it as it is, not
            # escaped again ("\\x1b").
            failed = subprocess.run([tool, "inspect", str(copy)], capture_output=True)
            assert failed.returncode == 1, failed
            assert b"\\x1b" in failed.stderr and b"\\\\x1b" not in failed.stderr, failed
            # So is list's, for a manifest it cannot list and for a `latest` it cannot read.
            listed = subprocess.run([tool, "list", str(copy.parent)], capture_output=True)
            assert b"not listed" in listed.stderr and b"\\\\x1b" not in listed.stderr, listed
    (tmp_path / "name" / "latest").write_bytes(b"a\x1b[2J\n")
    tool = os.environ.get("HPS_CKPT_TOOL")
    if tool:
        listed = subprocess.run([tool, "list", str(tmp_path / "name")], capture_output=True)
        assert b"\\x1b" in listed.stderr and b"\\\\x1b" not in listed.stderr, listed


def test_a_part_of_a_model_cut_across_mp_saves_and_loads_only_into_its_own_part(tmp_path):
    """Two ranks as mp 2 (sharding 1): each part's engine saves under its own root, which
    it claims (another part's engine, or a whole model's, is refused there: the rotation and
    `latest` would take the other's checkpoints); the manifest records the part (mp rank of
    degree); a part's checkpoint loads back into it, and copied into the other part's root
    its load is refused naming both parts, the engine unchanged."""

    def body(rank, url):
        with mp2_part(rank, url) as (engine, sharding, world_comm):
            w = 0
            engine.param(w)[...] = [rank + 1.0, rank + 2.0, rank + 3.0]
            engine.broadcast_parameters()
            own = tmp_path / f"mp{rank}"
            with Checkpoint.create(engine, sharding, own) as ckpt:
                ckpt.save("a", {"note": "red\x1b[31m\nline\\"}).wait()
                engine.param(w)[...] = 0.0
                ckpt.load("a")
                loaded = engine.param(w).copy()
            with open(own / "a" / "manifest.json") as f:
                part = json.load(f)["topology"]
            world_comm.barrier().wait()  # the other part's checkpoint is published
            other = tmp_path / f"mp{1 - rank}"
            with pytest.raises(hpshard.Error) as claimed:
                Checkpoint.create(engine, sharding, other)
            assert claimed.value.status == 1 and "own root" in claimed.value.message
            copied = tmp_path / f"copied{rank}"
            shutil.copytree(other / "a", copied / "a")
            with pytest.raises(hpshard.Error) as held:  # a root holding the other part's
                Checkpoint.create(engine, sharding, copied)
            assert held.value.status == 1 and "own root" in held.value.message
            shutil.rmtree(copied / "a")
            with Checkpoint.create(engine, sharding, copied) as ckpt:
                shutil.copytree(other / "a", copied / "a")  # put there after the claim
                with pytest.raises(hpshard.Error) as info:
                    ckpt.load("a")
                # A part's safetensors export names its part: the other part's is
                # refused, this part's initialises it.
                hpshard.checkpoint_export_safetensors(other / "a", tmp_path / f"o{rank}.st")
                hpshard.checkpoint_export_safetensors(own / "a", tmp_path / f"m{rank}.st")
                with pytest.raises(hpshard.Error) as imported:
                    ckpt.import_safetensors(tmp_path / f"o{rank}.st")
                assert imported.value.status == 1 and \
                    f"exported from the model's part at mp rank {1 - rank} of 2" in \
                    imported.value.message, imported.value.message
                np.testing.assert_array_equal(engine.param(w), loaded)
                engine.param(w)[...] = 0.0
                ckpt.import_safetensors(tmp_path / f"m{rank}.st")
                np.testing.assert_array_equal(engine.param(w), loaded)
                # A file that names no part (a whole model's export: how a 0.3 part
                # checkpoint, recorded as the whole model, moves over) is taken by a part.
                raw = (tmp_path / f"m{rank}.st").read_bytes()
                n = int.from_bytes(raw[:8], "little")
                header = json.loads(raw[8:8 + n])
                for key in ("hpshard_mp", "hpshard_mp_rank", "hpshard_pp", "hpshard_pp_rank"):
                    del header["__metadata__"][key]
                text = json.dumps(header).encode()
                (tmp_path / f"n{rank}.st").write_bytes(
                    len(text).to_bytes(8, "little") + text + raw[8 + n:])
                engine.param(w)[...] = 0.0
                ckpt.import_safetensors(tmp_path / f"n{rank}.st")
                np.testing.assert_array_equal(engine.param(w), loaded)
            return loaded, part, info.value.status, info.value.message, engine.param(w).copy()

    for rank, (loaded, part, status, message, after) in enumerate(
            run_ranks(2, body, "ckpt-mp-part")):
        np.testing.assert_array_equal(loaded, [rank + 1.0, rank + 2.0, rank + 3.0])
        assert (part["mp"], part["mp_rank"], part["pp"], part["pp_rank"]) == (2, rank, 1, 0)
        assert status == 1, message  # INVALID_ARGUMENT
        assert f"mp rank {1 - rank} of 2" in message and f"mp rank {rank} of 2" in message
        np.testing.assert_array_equal(after, loaded)
    info = hpshard.checkpoint_inspect(tmp_path / "mp1" / "a")
    assert (info.mp, info.mp_rank, info.pp, info.pp_rank) == (2, 1, 1, 0)
    # A part's manifest is format version 2 (a reader without parts refuses it); claiming
    # version 1, or a whole model claiming 2, is refused.
    assert info.format_version == 2
    manifest_path = tmp_path / "mp1" / "a" / "manifest.json"
    written = manifest_path.read_text()
    manifest = json.loads(written)
    # A hand edit of the part it records: the manifest's own checksum refuses it (before
    # the checksum, this loaded part 1's data as part 0's and verify passed).
    manifest["topology"]["mp_rank"] = 0
    manifest_path.write_text(json.dumps(manifest, indent=1))
    with pytest.raises(hpshard.Error) as info:
        hpshard.checkpoint_inspect(tmp_path / "mp1" / "a")
    assert info.value.status == 1 and "the manifest's checksum" in info.value.message, \
        info.value.message
    with pytest.raises(hpshard.Error):
        hpshard.checkpoint_verify(tmp_path / "mp1" / "a")
    manifest = json.loads(written)
    del manifest["manifest_xxh3"]  # as written before the field: each field's checks
    manifest["format_version"] = 1
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(hpshard.Error) as info:
        hpshard.checkpoint_inspect(tmp_path / "mp1" / "a")
    assert "a part of a model (mp or pp above 1) is version 2" in info.value.message
    manifest["format_version"] = 2
    manifest_path.write_text(json.dumps(manifest))
    store, comm = single_rank("whole-on-part")
    with store, comm, Engine.create(comm) as whole:
        whole.add_param("w", (3,))
        whole.seal()
        with pytest.raises(hpshard.Error) as info:
            Checkpoint.create(whole, comm, tmp_path / "mp0")
        assert "the whole model" in info.value.message and "mp rank 0 of 2" in info.value.message
    tool = os.environ.get("HPS_CKPT_TOOL")  # set by ctest
    if tool:
        shown = subprocess.run([tool, "inspect", str(tmp_path / "mp1" / "a")], check=True,
                               capture_output=True).stdout
        assert b"mp rank 1 of 2, pp rank 0 of 1" in shown, shown
        manifest_path.write_text(written)
        listed = subprocess.run([tool, "list", str(tmp_path / "mp1")], check=True,
                                capture_output=True).stdout
        assert b"(part: mp rank 1 of 2, pp rank 0 of 1)" in listed, listed
        verified = subprocess.run([tool, "verify", str(tmp_path / "mp1" / "a")], check=True,
                                  capture_output=True).stdout
        assert b"and the manifest's own checksum" in verified, verified
        exported = subprocess.run(
            [tool, "export", str(tmp_path / "mp1" / "a"), str(tmp_path / "part.st")],
            check=True, capture_output=True).stdout
        assert b"(part: mp rank 1 of 2, pp rank 0 of 1)" in exported, exported
        # The writer's metadata cannot reach the terminal as control bytes.
        assert b"metadata note = red\\x1b[31m\\x0aline\\\\\n" in shown, shown
        assert b"\x1b" not in shown


def test_a_close_on_another_thread_waits_for_a_load_under_way(tmp_path):
    """Closing the checkpoint while another thread loads (a misuse: one thread at a time)
    waits for the load to return, as a Store's close does; it freed the handle under the
    load, which then crashed the process (SIGSEGV). Saves from two threads take turns."""
    big = [("w", (1 << 21,), 0), ("b", (3,), 1)]
    store, comm = single_rank("close-race")
    with store, comm:
        engine, index = build(comm, model=big)
        with engine:
            with Checkpoint.create(engine, comm, tmp_path) as ckpt:
                works = []
                savers = [threading.Thread(target=lambda t=t: works.append(ckpt.save(f"s{t}")))
                          for t in range(2)]
                for t in savers:
                    t.start()
                for t in savers:
                    t.join()
                for w in works:
                    w.wait()
            for delay in (0.0, 0.002, 0.01):
                ckpt = Checkpoint.create(engine, comm, tmp_path)
                outcome = []

                def load():
                    try:
                        ckpt.load("s0")
                        outcome.append("loaded")
                    except ValueError:  # the close came first
                        outcome.append("closed")

                loader = threading.Thread(target=load)
                loader.start()
                time.sleep(delay)
                ckpt.close()
                loader.join()
                assert outcome in (["loaded"], ["closed"]), outcome
                assert ckpt.closed
    assert sorted(os.listdir(tmp_path))[-2:] == ["s0", "s1"]
