"""Stores, rendezvous, communicators, work, topology and hybrid groups through the Python
binding: ranks are threads meeting through a memory:// store (the wrapper releases the
GIL in every blocking call). Every multi-rank test is bounded by thread join timeouts."""

import gc
import itertools
import os
import signal
import threading
import time
import uuid
import weakref

import numpy as np
import pytest

import hpshard
from hpshard import Communicator, DType, Group, HybridGroup, ReduceOp, Store, Topology, capi

INVALID_ARGUMENT = 1
OUT_OF_RANGE = 2
NOT_FOUND = 3
TIMEOUT = 8
ABORTED = 9
WORLD = 4
JOIN_S = 60.0


def unique_url(tag):
    return f"memory://py-{tag}-{uuid.uuid4().hex}"


def run_ranks(n, fn, tag="ranks", timeout_s=JOIN_S):
    """Run fn(rank, url) on n threads; fail when one is still running after timeout_s,
    re-raise the first rank's exception; the ranks' results in rank order."""
    url = unique_url(tag)
    results = [None] * n
    errors = [None] * n

    def body(r):
        try:
            results[r] = fn(r, url)
        except BaseException as e:  # noqa: BLE001 — reported below
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"rank{r}")
               for r in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        pytest.fail(f"ranks still running after {timeout_s} s: {hung}")
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError(f"rank {r} failed: {e!r}") from e
    return results


def world(rank, url, size=WORLD, **kw):
    store = Store.open(url, rank, timeout_ms=10000)
    kw.setdefault("timeout_ms", 20000)
    comm = Communicator.create(store, rank, size, **kw)
    return store, comm


def status_of(call):
    with pytest.raises(hpshard.Error) as info:
        call()
    return info.value.status


# ---- all_reduce over dtypes and ops ------------------------------------------------------
def rank_data(rank, dtype, n=16):
    i = np.arange(n)
    # Multiples of 4: the average over 4 ranks is exact for integers too.
    return (((i * 7 + rank * 13) % 17 - 8) * 4).astype(dtype)


REFERENCE = {ReduceOp.SUM: lambda a: a.sum(axis=0),
             ReduceOp.AVG: lambda a: a.sum(axis=0) // WORLD if a.dtype.kind == "i"
             else a.sum(axis=0) / WORLD,
             ReduceOp.MAX: lambda a: a.max(axis=0),
             ReduceOp.MIN: lambda a: a.min(axis=0)}


def test_all_reduce_ops_and_dtypes():
    combos = list(itertools.product([np.float32, np.int64], list(ReduceOp)))

    def rank(r, url):
        store, comm = world(r, url, name="py-world")
        with store, comm:
            assert comm.rank == r and comm.size == WORLD
            out = []
            for dtype, op in combos:
                send = rank_data(r, dtype)
                recv = np.zeros_like(send)
                with comm.all_reduce(send, recv, op=op) as work:
                    work.wait()
                    assert work.test() is True
                out.append(recv)
            # in place
            buf = np.full(8, r + 1, dtype=np.float32)
            comm.all_reduce(buf, buf).wait()
            assert np.all(buf == 10)
            return out

    results = run_ranks(WORLD, rank, "allreduce")
    for k, (dtype, op) in enumerate(combos):
        ref = REFERENCE[op](np.stack([rank_data(r, dtype) for r in range(WORLD)]))
        for r in range(WORLD):
            assert results[r][k].dtype == np.dtype(dtype)
            np.testing.assert_array_equal(results[r][k], ref.astype(dtype), f"{dtype} {op!r}")


# ---- the other collectives ---------------------------------------------------------------
def test_collectives():
    def rank(r, url):
        store, comm = world(r, url)
        with store, comm:
            send = np.arange(8, dtype=np.float32) + r * 100
            gathered = np.zeros(8 * WORLD, dtype=np.float32)
            comm.all_gather(send, gathered).wait()
            np.testing.assert_array_equal(
                gathered, np.concatenate([np.arange(8, dtype=np.float32) + q * 100
                                          for q in range(WORLD)]))

            big = (np.arange(2 * WORLD, dtype=np.int64) + 1) * (r + 1)
            scattered = np.zeros(2, dtype=np.int64)
            comm.reduce_scatter(big, scattered, op=ReduceOp.SUM).wait()
            total = sum(q + 1 for q in range(WORLD))
            np.testing.assert_array_equal(scattered, (np.arange(2) + 2 * r + 1) * total)

            value = np.array([77 if r == 2 else 0], dtype=np.int32)
            comm.broadcast(value, root=2).wait()
            assert value[0] == 77

            mine = np.array([r + 1.0, -r], dtype=np.float64)
            reduced = np.zeros(2, dtype=np.float64) if r == 1 else None
            comm.reduce(mine, reduced, root=1, op=ReduceOp.MAX).wait()
            if r == 1:
                np.testing.assert_array_equal(reduced, [WORLD, 0.0])

            # send / recv around the ring, the receive waited through a stream
            sent = np.array([r * 10], dtype=np.int64)
            got = np.array([-1], dtype=np.int64)
            s = comm.send(sent, (r + 1) % WORLD)
            rv = comm.recv(got, (r + WORLD - 1) % WORLD)
            with hpshard.Stream() as stream:
                rv.wait_stream(stream)
                stream.synchronize()
            assert got[0] == ((r + WORLD - 1) % WORLD) * 10
            s.wait()
            rv.close()
            s.close()

            with comm.barrier() as b:
                b.wait()
            b.close()  # closing again is harmless
            return True

    assert run_ranks(WORLD, rank, "collectives") == [True] * WORLD


def test_split():
    def rank(r, url):
        store, comm = world(r, url)
        with store, comm:
            evens = comm.split([0, 2], "even")
            odds = comm.split([1, 3])  # the name may be left out
            assert odds is None or odds.name == "world.split"
            assert (evens is not None) == (r % 2 == 0)
            assert (odds is not None) == (r % 2 == 1)
            sub = evens or odds
            with sub:
                assert sub.size == 2 and sub.rank == r // 2
                mine = np.array([r], dtype=np.int64)
                total = np.zeros(1, dtype=np.int64)
                sub.all_reduce(mine, total).wait()
            assert sub.closed
            return int(total[0])

    assert run_ranks(WORLD, rank, "split") == [2, 4, 2, 4]


def test_hybrid_group_dp2_sharding2():
    def rank(r, url):
        store, comm = world(r, url)
        with store, comm, Topology(2, 1, 2, 1, 1, WORLD) as topo:
            with HybridGroup.create(comm, topo) as hg:
                sharding = hg.comm(Group.SHARDING)
                dp = hg.comm(Group.DP)
            assert hg.closed  # handles taken from it stay valid
            with sharding, dp:
                assert sharding.size == 2 and dp.size == 2
                mine = np.array([1 << r], dtype=np.int64)
                s_sum = np.zeros(1, dtype=np.int64)
                d_sum = np.zeros(1, dtype=np.int64)
                sharding.all_reduce(mine, s_sum).wait()
                dp.all_reduce(mine, d_sum).wait()
                expect_s = sum(1 << q for q in topo.group_ranks(Group.SHARDING, r))
                expect_d = sum(1 << q for q in topo.group_ranks(Group.DP, r))
                return int(s_sum[0]), int(d_sum[0]), expect_s, expect_d

    res = run_ranks(WORLD, rank, "hybrid")
    # sharding groups {0,1} and {2,3}; dp groups {0,2} and {1,3}
    assert [x[0] for x in res] == [3, 3, 12, 12]
    assert [x[1] for x in res] == [5, 10, 5, 10]
    assert all(x[0] == x[2] and x[1] == x[3] for x in res)


def test_closing_world_closes_its_hybrid_groups_first():
    def rank(r, url):
        store, comm = world(r, url, size=2)
        topo = Topology(1, 1, 2, 1, 1, 2)
        hg = HybridGroup.create(comm, topo)
        comm.close()
        assert hg.closed
        store.close()
        topo.close()
        return True

    assert run_ranks(2, rank, "hgclose") == [True, True]


# ---- bad input ------------------------------------------------------------------------------
def test_bad_input_is_refused_with_nothing_sent():
    def rank(r, url):
        store, comm = world(r, url)
        with store, comm:
            send = np.arange(8, dtype=np.float32)
            small = np.zeros(8 * WORLD - 1, dtype=np.float32)
            with pytest.raises(hpshard.InvalidArgumentError) as info:
                comm.all_gather(send, small)
            assert info.value.status == INVALID_ARGUMENT
            assert "needs 32" in info.value.message
            recv = np.zeros(8, dtype=np.float32)
            assert status_of(lambda: comm.all_reduce(send, recv, op=9)) == INVALID_ARGUMENT
            assert "9" in hpshard.last_error_message()
            assert status_of(lambda: comm.broadcast(recv, root=WORLD)) == OUT_OF_RANGE
            assert status_of(lambda: comm.reduce(send, recv, root=-1)) == OUT_OF_RANGE
            assert status_of(lambda: comm.set_timeout(0)) == INVALID_ARGUMENT
            # wrong dtype / size / kind of NumPy buffer: refused before the library
            with pytest.raises(TypeError):
                comm.all_reduce(send, np.zeros(8, dtype=np.int64))
            with pytest.raises(ValueError):
                comm.all_reduce(send, np.zeros(9, dtype=np.float32))
            with pytest.raises(TypeError):
                comm.all_reduce(np.zeros(8, dtype=np.int16), np.zeros(8, dtype=np.int16))
            with pytest.raises(TypeError):
                comm.all_reduce(send, [0.0] * 8)
            ro = np.zeros(8, dtype=np.float32)
            ro.flags.writeable = False
            with pytest.raises(ValueError):
                comm.all_reduce(send, ro)
            with pytest.raises(ValueError):
                comm.broadcast(np.zeros(16, dtype=np.float32)[::2], root=0)
            with pytest.raises(TypeError):
                comm.all_reduce(send, recv, ready="stream")
            # the low-level wrapper refuses counts that do not fit the buffers
            with pytest.raises(ValueError):
                comm._h().all_reduce(send, recv, 9, capi.HPS_DTYPE_FLOAT32,
                                     capi.HPS_REDUCE_SUM, None)
            with pytest.raises(ValueError):
                comm._h().recv(b"read-only", 1, capi.HPS_DTYPE_UINT8, 0, None)
            # nothing was sent: the next collective matches on every rank
            mine = np.array([r], dtype=np.int64)
            total = np.zeros(1, dtype=np.int64)
            comm.all_reduce(mine, total).wait()
            # explicit dtype: bfloat16 payload in uint16 storage
            bf = np.full(4, 0x3F80, dtype=np.uint16)  # 1.0 in bfloat16
            comm.all_reduce(bf, bf, op=ReduceOp.MAX, dtype=DType.BFLOAT16).wait()
            assert np.all(bf == 0x3F80)
            return int(total[0])

    assert run_ranks(WORLD, rank, "badinput") == [6] * WORLD


def test_wait_timeout_when_a_rank_never_joins():
    finished = threading.Event()

    def rank(r, url):
        store, comm = world(r, url, size=2)
        with store, comm:
            comm.set_timeout(200)
            if r == 0:
                send = np.ones(4, dtype=np.float32)
                recv = np.zeros(4, dtype=np.float32)
                work = comm.all_reduce(send, recv)
                t0 = time.monotonic()
                try:
                    with pytest.raises(hpshard.Error) as info:
                        work.wait()
                finally:
                    finished.set()
                elapsed = time.monotonic() - t0
                work.close()
                return info.value.status, elapsed
            # rank 1 never joins, but stays alive until rank 0 has finished
            assert finished.wait(JOIN_S)
            return None

    status, elapsed = run_ranks(2, rank, "timeout")[0]
    assert status == TIMEOUT
    assert elapsed < 10.0


def test_abort_from_another_thread():
    finished = threading.Event()

    def rank(r, url):
        store, comm = world(r, url, size=2)
        with store, comm:
            if r == 0:
                send = np.ones(4, dtype=np.float32)
                recv = np.zeros(4, dtype=np.float32)
                work = comm.all_reduce(send, recv)
                aborter = threading.Timer(0.1, comm.abort)
                aborter.start()
                try:
                    with pytest.raises(hpshard.Error) as info:
                        work.wait()
                finally:
                    finished.set()
                    aborter.join(JOIN_S)
                # later operations end with ABORTED too (refused at once, or when waited)
                assert status_of(lambda: comm.barrier().wait()) == ABORTED
                work.close()
                return info.value.status
            assert finished.wait(JOIN_S)
            return None

    assert run_ranks(2, rank, "abort")[0] == ABORTED


# ---- work keeps its buffers ------------------------------------------------------------
def test_work_keeps_buffers_until_waited():
    def rank(r, url):
        store, comm = world(r, url, size=2)
        with store, comm:
            send = np.arange(1024, dtype=np.float64)
            recv = np.zeros(1024, dtype=np.float64)
            refs = weakref.ref(send), weakref.ref(recv)
            work = comm.all_reduce(send, recv)
            del send, recv
            gc.collect()
            assert all(ref() is not None for ref in refs)
            with pytest.raises(ValueError):  # pending: still exported
                refs[1]().resize(8, refcheck=False)
            recv = refs[1]()
            work.wait()
            result = recv.copy()
            del recv
            gc.collect()
            assert all(ref() is None for ref in refs)
            work.close()
            # close() of a pending work waits for it, then lets the buffers go
            a = np.ones(4, dtype=np.int32)
            w2 = comm.all_reduce(a, a)
            ref = weakref.ref(a)
            del a
            w2.close()
            gc.collect()
            assert ref() is None and w2.closed
            with pytest.raises(ValueError):
                w2.wait()
            return result

    res = run_ranks(2, rank, "keep")
    np.testing.assert_array_equal(res[0], np.arange(1024) * 2.0)


def seconds_to_interrupt(call, after=0.2):
    """Runs ``call`` in the main thread with SIGINT sent to it ``after`` seconds in; it must
    raise KeyboardInterrupt. The seconds from the start to the raise."""
    main = threading.main_thread().ident
    assert threading.get_ident() == main, "signals reach the main thread only"
    timer = threading.Timer(after, lambda: signal.pthread_kill(main, signal.SIGINT))
    start = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            call()
        return time.monotonic() - start
    finally:
        timer.cancel()


def test_an_interrupted_call_has_ended_when_its_exception_is_raised():
    """The binding's interruptible calls run the library call on a helper thread; on Ctrl-C
    they abort it and wait for it to end before raising. They waited with Thread.join, which
    a KeyboardInterrupt inside it breaks (CPython 3.11 marks the thread stopped): the second
    join returned at once and the caller went on while the call still ran (an import
    restoring the engine's values after the caller read them). Here the call takes 0.3 s to
    end after its abort."""
    aborted, ended = threading.Event(), threading.Event()

    def call():
        aborted.wait(JOIN_S)
        time.sleep(0.3)
        ended.set()

    elapsed = seconds_to_interrupt(lambda: hpshard._interruptible(call, aborted.set), after=0.2)
    assert ended.is_set(), "KeyboardInterrupt was raised while the call still ran"
    assert 0.4 < elapsed < 3.0, elapsed
    assert hpshard._interruptible(lambda: 42, aborted.set) == 42
    with pytest.raises(ValueError):
        hpshard._interruptible(lambda: int("x"), aborted.set)


@pytest.mark.parametrize("kind", ["memory", "tcp"])
def test_ctrl_c_ends_a_rendezvous_waiting_for_a_rank_that_never_comes(kind):
    """Communicator.create blocked in the library until its timeout (here 20 s) whatever
    the signals: now SIGINT raises KeyboardInterrupt within a slice and leaves the store
    aborted (Error ABORTED from then on); a new store works. From another thread create
    is the plain call, and Store.abort from this thread ends it the same way."""
    url = unique_url("rendezvous") if kind == "memory" else free_tcp_url()
    with Store.open(url, 0) as store:
        elapsed = seconds_to_interrupt(
            lambda: Communicator.create(store, 0, 2, timeout_ms=20000), after=0.3)
        assert elapsed < 3.0, elapsed
        with pytest.raises(hpshard.Error) as e:
            store.get("anything", 100)
        assert e.value.status == ABORTED and "aborted" in str(e.value)
        with pytest.raises(hpshard.Error) as e:
            store.set("k", b"v")
        assert e.value.status == ABORTED
    with Store.open(unique_url("after"), 0) as store:
        errors = []

        def rank():
            try:
                Communicator.create(store, 0, 2, timeout_ms=20000)
            except BaseException as e:  # noqa: BLE001 — checked below
                errors.append(e)

        thread = threading.Thread(target=rank, daemon=True)
        start = time.monotonic()
        thread.start()
        time.sleep(0.3)
        store.abort()
        thread.join(JOIN_S)
        assert not thread.is_alive() and time.monotonic() - start < 3.0
        assert len(errors) == 1 and isinstance(errors[0], hpshard.Error), errors
        assert errors[0].status == ABORTED, errors[0]
    with Store.open(unique_url("fresh"), 0) as store:
        with Communicator.create(store, 0, 1) as comm:
            assert comm.size == 1


def free_tcp_url():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_ctrl_c_ends_a_tcp_store_open_waiting_for_its_server():
    """A rank other than 0 opening a TCP store whose rank 0 has not started waited in the
    library for its timeout (here 20 s) whatever the signals. On the main thread it now
    waits for the server in slices: SIGINT raises KeyboardInterrupt within one; with no
    server, Error TIMEOUT after the open's timeout, naming the address; a server that starts
    during the wait is joined, and the store works."""
    url = free_tcp_url()
    elapsed = seconds_to_interrupt(lambda: Store.open(url, 1, timeout_ms=20000), after=0.3)
    assert elapsed < 3.0, elapsed
    start = time.monotonic()
    with pytest.raises(hpshard.Error) as e:
        Store.open(url, 1, timeout_ms=600)
    assert 0.5 < time.monotonic() - start < 5.0
    assert e.value.status == TIMEOUT and url[len("tcp://"):] in e.value.message, e.value
    served = {}

    def rank0():
        time.sleep(0.5)
        served["store"] = Store.open(url, 0, timeout_ms=20000)
        served["store"].set("from0", b"hello")

    thread = threading.Thread(target=rank0, daemon=True)
    thread.start()
    with Store.open(url, 1, timeout_ms=20000) as store:
        assert store.get("from0", 20000) == b"hello"
        thread.join(JOIN_S)
        served["store"].close()


def test_ctrl_c_ends_a_tcp_store_open_whose_socket_listens_before_its_store_serves():
    """hpshard-run binds and listens on rank 0's socket before rank 0 starts: the kernel
    accepts connections at once, so the wait for the server passed and the library's
    handshake waited for the store's greeting the whole timeout, whatever the signals
    (process red team). The wait now lasts until the server greets: SIGINT ends it within a
    slice; with no store ever serving, TIMEOUT saying so (a store that takes the socket
    over is joined: every launcher test's rank 1 does)."""
    import socket
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # as hpshard-run does: nothing accepts yet
    url = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    try:
        elapsed = seconds_to_interrupt(lambda: Store.open(url, 1, timeout_ms=20000), after=0.5)
        assert elapsed < 3.0, elapsed
        with pytest.raises(hpshard.Error) as e:
            Store.open(url, 1, timeout_ms=700)
        assert e.value.status == TIMEOUT and "sent no greeting" in e.value.message, e.value
    finally:
        listener.close()


@pytest.mark.parametrize("suffix", ["/path", "?x", "#f"])
def test_a_tcp_url_the_library_refuses_is_refused_at_once(suffix):
    """The wait for a TCP store's server (above) is only for URLs the library takes: one
    with a path, a query, a fragment or a user is refused at once (INVALID_ARGUMENT naming
    it), not after the whole timeout as TIMEOUT."""
    url = free_tcp_url()
    port = url.rsplit(":", 1)[1]
    for bad in (url + suffix, url.replace("tcp://", "tcp://user@"), f"tcp://[localhost]:{port}",
                f"tcp://[127.0.0.1]:{port}", f"tcp://[::1%]:{port}"):
        start = time.monotonic()
        with pytest.raises(hpshard.InvalidArgumentError):
            Store.open(bad, 1, timeout_ms=20000)
        assert time.monotonic() - start < 2.0, bad
    # A name Python's resolver refuses (IDNA) is the library's to judge: an hpshard.Error.
    with pytest.raises(hpshard.Error):
        Store.open(f"tcp://a..b:{port}", 1, timeout_ms=300)


@pytest.mark.parametrize("call", ["split", "hybrid_group", "engine_seal"])
def test_ctrl_c_ends_a_set_up_waiting_for_a_rank_and_aborts_its_groups(call):
    """A split (and a hybrid group's creation) waits in the store for the members, an
    engine's seal in collectives for the other ranks; they waited for the communicator's
    timeout (here 20 s) whatever the signals. SIGINT now raises KeyboardInterrupt within a
    slice and aborts the group split from (the engine's groups)."""
    url = unique_url(call)
    go = threading.Event()
    errors = []

    def peer():  # joins the world, never the split
        try:
            store, comm = world(1, url, size=2)
            with store, comm:
                go.wait(JOIN_S)
        except BaseException as e:  # noqa: BLE001 — reported below
            errors.append(e)

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    store, comm = world(0, url, size=2)
    try:
        with store, comm, Topology(1, 1, 2, 1, 1, 2) as topo:
            if call == "split":
                elapsed = seconds_to_interrupt(lambda: comm.split([0, 1], "never"), after=0.3)
            elif call == "hybrid_group":
                elapsed = seconds_to_interrupt(lambda: HybridGroup.create(comm, topo),
                                               after=0.3)
            else:
                with hpshard.Engine.create(comm) as engine:
                    engine.add_param("w", (4,))
                    elapsed = seconds_to_interrupt(engine.seal, after=0.3)
            assert elapsed < 3.0, elapsed
            assert status_of(lambda: comm.barrier().wait()) == ABORTED
    finally:
        go.set()
    thread.join(JOIN_S)
    assert not thread.is_alive() and not errors, errors


def test_ctrl_c_interrupts_a_wait_and_the_work_keeps_its_buffers():
    """Work.wait() is made of short timed waits, so SIGINT in the main thread raises
    KeyboardInterrupt within a slice (it used to wait for the operation, here up to the
    communicator's 20 s timeout); the receive goes on with its buffer kept, and a later
    wait() finishes it. wait(timeout) says False while the operation is pending."""
    url = unique_url("sigint")
    go = threading.Event()
    errors = []

    def peer():
        try:
            store, comm = world(1, url, size=2)
            with store, comm:
                go.wait(JOIN_S)
                comm.send(np.full(4, 42.0), 0).wait()
        except BaseException as e:  # noqa: BLE001 — reported below
            errors.append(e)

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    store, comm = world(0, url, size=2)
    with store, comm:
        got = np.zeros(4)
        work = comm.recv(got, 1)
        ref = weakref.ref(got)
        start = time.monotonic()
        assert work.wait(timeout=0.05) is False
        assert 0.04 < time.monotonic() - start < 1.0
        assert work.wait(timeout=-1) is False and work.wait(timeout=0) is False
        with pytest.raises(ValueError):
            work.wait(timeout=float("nan"))
        try:
            elapsed = seconds_to_interrupt(work.wait)
            assert elapsed < 2.0, elapsed
            # close() waits the same way: interrupted, the Work stays open.
            seconds_to_interrupt(work.close)
        finally:
            go.set()
        assert not work.closed
        del got
        gc.collect()
        got = ref()
        assert got is not None  # still the receive's
        assert work.wait(timeout=float("inf")) is True
        np.testing.assert_array_equal(got, [42.0] * 4)
        work.close()
    thread.join(JOIN_S)
    assert not thread.is_alive() and not errors, errors


CTRL_C_WITH_A_PENDING_OPERATION = """
import signal, sys, threading, time
import numpy as np
from hpshard import Communicator, Store
url, how = sys.argv[1], sys.argv[2]
ready = threading.Event()

def peer():  # alive, and never joins the receive below
    store = Store.open(url, 1, timeout_ms=10000)
    comm = Communicator.create(store, 1, 2, timeout_ms=60000)
    ready.set()
    time.sleep(3600)

threading.Thread(target=peer, daemon=True).start()
main = threading.main_thread().ident
with Store.open(url, 0, timeout_ms=10000) as store:
    if how == "close":
        comm = Communicator.create(store, 0, 2, timeout_ms=60000)
        ready.wait()
        work = comm.recv(np.zeros(4), 1)
        threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
        try:
            comm.close()
        except KeyboardInterrupt:
            print("close interrupted", comm.closed, flush=True)
            raise
    with Communicator.create(store, 0, 2, timeout_ms=60000) as comm:
        ready.wait()
        work = comm.recv(np.zeros(4), 1)
        if how != "exit":
            threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
        if how == "wait":
            work.wait()
        elif how == "exit":
            sys.exit(3)
        else:
            time.sleep(30)
"""


@pytest.mark.parametrize("store", ["memory", "tcp"])
@pytest.mark.parametrize("how", ["wait", "elsewhere", "exit", "close"])
def test_ctrl_c_with_an_operation_pending_ends_the_program_at_once(how, store):
    """Ctrl-C with a receive pending whose peer is alive but never sends. Leaving
    ``with Communicator...`` by the KeyboardInterrupt (raised in Work.wait or elsewhere)
    or by sys.exit closed the communicator, whose close waited for the receive up to the
    communicator's 60 s timeout; the exit then aborts it first. A close() waiting for it
    could not be interrupted; Ctrl-C now aborts it, completes the close and raises. Over a
    TCP store, rank 0's store then waited for the peer to close its connection, up to the
    store's 10 s: the exit aborts the store too, and it waits for no one."""
    import subprocess
    import sys
    url = unique_url("exit") if store == "memory" else free_tcp_url()
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_WITH_A_PENDING_OPERATION, url, how],
        capture_output=True, text=True, timeout=50)
    elapsed = time.monotonic() - start
    assert elapsed < 7.0, (elapsed, done.stderr)
    if how == "exit":
        assert done.returncode == 3, (done.returncode, done.stderr)
    else:
        assert done.returncode == -signal.SIGINT, (done.returncode, done.stderr)
        assert "KeyboardInterrupt" in done.stderr, done.stderr
    if how == "close":
        assert "close interrupted True" in done.stdout, (done.stdout, done.stderr)


# ---- the GIL -----------------------------------------------------------------------------
def test_blocking_calls_release_the_gil():
    """While one thread blocks in the library, another runs Python code."""
    ticks = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1

    with Store.open(unique_url("gil"), 0, timeout_ms=1000) as store:
        counter = threading.Thread(target=count, daemon=True)
        counter.start()
        try:
            time.sleep(0.05)
            before = ticks[0]
            with pytest.raises(hpshard.Error) as info:
                store.wait("never-set", timeout_ms=400)
            during = ticks[0] - before
        finally:
            stop.set()
            counter.join(JOIN_S)
    assert info.value.status == TIMEOUT
    assert during > 1000, during


def test_communicator_create_from_threads_needs_the_gil_released():
    # Two thread-ranks: a create holding the GIL would never see its peer.
    def rank(r, url):
        store, comm = world(r, url, size=2, timeout_ms=5000)
        with store, comm:
            return comm.rank, comm.size, repr(comm)

    res = run_ranks(2, rank, "gil2", timeout_s=30)
    assert [x[:2] for x in res] == [(0, 2), (1, 2)]


# ---- stores and rendezvous ------------------------------------------------------------
def test_store():
    url = unique_url("store")
    with Store.open(url, 0, timeout_ms=1000) as store, Store.open(url, 1) as other:
        binary = b"a\0b\0\xff"
        store.set("k", binary)
        assert other.get("k", timeout_ms=1000) == binary
        big = bytes(range(256)) * 10  # larger than the wrapper's first buffer
        store.set("big", bytearray(big))
        assert other.get("big") == big
        store.set("empty", b"")
        assert other.get("empty") == b""
        store.set("text", "héllo")
        assert store.get("text") == "héllo".encode()
        assert store.add("n", 5) == 5
        assert other.add("n", -2) == 3
        assert store.add("n") == 4
        assert store.check("k") is True
        assert store.check("missing") is False
        store.wait("k", timeout_ms=1000)
        with pytest.raises(hpshard.Error) as info:
            store.wait("missing", timeout_ms=50)
        assert info.value.status == TIMEOUT and "missing" in info.value.message
        with pytest.raises(hpshard.Error) as info:
            store.get("missing", timeout_ms=50)
        assert info.value.status == TIMEOUT
        assert status_of(lambda: store.get("k", timeout_ms=0)) == INVALID_ARGUMENT
        with pytest.raises(TypeError):
            store.set("k", 12)
    assert store.closed
    store.close()
    with pytest.raises(ValueError):
        store.get("k")
    assert status_of(lambda: Store.open("gopher://x", 0)) == INVALID_ARGUMENT
    assert status_of(lambda: Store.open(url, 0, timeout_ms=0)) == INVALID_ARGUMENT


@pytest.mark.parametrize("abort", ["none", "before", "during"])
def test_closing_a_store_waits_for_calls_under_way_on_other_threads(abort):
    """A store is used from several threads at once: close() destroyed the native store
    under another thread's get (and a Communicator.create waiting for ranks), which then ran
    in freed memory. The close now waits for them to return; abort() ends them at once,
    also from another thread while the close waits (it raised ValueError: closed)."""
    abort_first = abort != "none"
    store = Store.open(unique_url("close-while-used"), 0)
    errors = {}

    def getter():
        try:
            store.get("never", 1500)
        except BaseException as e:  # noqa: BLE001 — checked below
            errors["get"] = e

    def creator():
        try:
            Communicator.create(store, 0, 2, timeout_ms=1500)  # rank 1 never comes
        except BaseException as e:  # noqa: BLE001 — checked below
            errors["create"] = e

    threads = [threading.Thread(target=f, daemon=True) for f in (getter, creator)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    start = time.monotonic()
    watchdog = None
    if abort == "before":
        store.abort()
    elif abort == "during":
        watchdog = threading.Timer(0.3, store.abort)
        watchdog.start()
    store.close()
    took = time.monotonic() - start
    if watchdog is not None:
        watchdog.join()
        assert took < 1.2, took  # ended by the abort, not the 1.5 s waits
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive()
    for what in ("get", "create"):
        e = errors[what]
        assert isinstance(e, hpshard.Error), (what, e)
        assert e.status == (ABORTED if abort_first else TIMEOUT), (what, e)
    if not abort_first:
        assert took > 0.8, took  # it waited for the calls
    assert store.closed
    with pytest.raises(ValueError):
        store.get("k", 10)


def test_store_get_waits_for_a_value_set_by_another_thread():
    url = unique_url("storewait")
    with Store.open(url, 0) as a, Store.open(url, 1) as b:
        setter = threading.Timer(0.1, lambda: b.set("late", b"x" * 1000))
        setter.start()
        try:
            assert a.get("late", timeout_ms=10000) == b"x" * 1000
        finally:
            setter.join(JOIN_S)


RENDEZVOUS_VARS = ["HPS_RANK", "HPS_WORLD_SIZE", "HPS_STORE", "HPS_LOCAL_RANK", "RANK",
                   "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                   "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                   "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
                   "SLURM_LOCALID"]


def test_rendezvous_from_env(monkeypatch):
    for v in RENDEZVOUS_VARS:
        monkeypatch.delenv(v, raising=False)
    assert status_of(hpshard.rendezvous_from_env) == NOT_FOUND
    monkeypatch.setenv("HPS_RANK", "2")
    monkeypatch.setenv("HPS_WORLD_SIZE", "4")
    monkeypatch.setenv("HPS_STORE", "file:///tmp/hps-store")
    info = hpshard.rendezvous_from_env()
    assert isinstance(info, hpshard.RendezvousInfo)
    assert (info.rank, info.world_size) == (2, 4)
    assert info.store_url == "file:///tmp/hps-store"
    assert info.source and info.local_rank >= 0
    monkeypatch.setenv("HPS_RANK", "9")
    with pytest.raises(hpshard.Error) as err:
        hpshard.rendezvous_from_env()
    assert err.value.status in (INVALID_ARGUMENT, OUT_OF_RANGE)
    assert hpshard.rendezvous_info_struct_size() == capi.rendezvous_struct_size()
    assert status_of(lambda: hpshard.rendezvous_info_struct_size(3)) == INVALID_ARGUMENT


def test_comm_options_struct():
    o = capi.comm_options_init(capi.comm_options_struct_size())
    assert o.struct_size == capi.comm_options_struct_size()
    assert o.timeout_ms > 0 and o.check_arguments in (0, 1)
    o.name = "x" * 1000
    assert o.name == "x" * 1000
    o.name = None
    assert o.name is None
    with pytest.raises(hpshard.Error):
        capi.comm_options_init(3)


# ---- topology --------------------------------------------------------------------------
SHAPES = [(2, 2, 2, 1, 1), (1, 2, 1, 2, 2), (3, 1, 2, 1, 2), (1, 1, 1, 1, 1), (2, 3, 1, 1, 2)]
AXES = [Group.DP, Group.PP, Group.SHARDING, Group.SEP, Group.MP]


def formula(c, deg):
    d, p, s, e, m = c
    _, P, S, E, M = deg
    return (((d * P + p) * S + s) * E + e) * M + m


@pytest.mark.parametrize("deg", SHAPES)
def test_topology_matches_the_rank_formula(deg):
    world_size = int(np.prod(deg))
    with Topology(*deg, world_size=world_size) as topo:
        assert [topo.degree(a) for a in AXES] == list(deg)
        coords = {}
        for c in itertools.product(*[range(x) for x in deg]):
            rank = formula(c, deg)
            coords[rank] = c
            assert topo.rank_of(*c) == rank
            assert tuple(topo.coordinate(rank, a) for a in AXES) == c
        assert sorted(coords) == list(range(world_size))
        for rank, c in coords.items():
            for k, axis in enumerate(AXES):  # the axis group: vary only that axis
                expect = sorted(formula(c[:k] + (v,) + c[k + 1:], deg) for v in range(deg[k]))
                assert topo.group_ranks(axis, rank) == expect
            assert topo.group_ranks(Group.CHECK, rank) == sorted(
                q for q, cq in coords.items() if cq[0] == c[0])
            assert topo.group_ranks(Group.SHARDING_CHECK, rank) == sorted(
                q for q, cq in coords.items() if cq[2] == c[2])
            P = deg[1]
            prev = formula(c[:1] + ((c[1] - 1) % P,) + c[2:], deg)
            nxt = formula(c[:1] + ((c[1] + 1) % P,) + c[2:], deg)
            assert topo.pipeline_neighbors(rank) == (prev, nxt)


def test_topology_large_group_and_bad_input():
    with Topology(1, 1, 100, 1, 1, 100) as topo:  # more ranks than the first buffer holds
        assert topo.group_ranks(Group.SHARDING, 42) == list(range(100))
        assert status_of(lambda: topo.coordinate(100, Group.DP)) == OUT_OF_RANGE
        assert status_of(lambda: topo.rank_of(0, 0, 100, 0, 0)) == OUT_OF_RANGE
        assert status_of(lambda: topo.degree(Group.CHECK)) == INVALID_ARGUMENT
        assert status_of(lambda: topo.group_ranks(Group.DP, 100)) == OUT_OF_RANGE
        assert status_of(lambda: topo.group_ranks(9, 0)) == INVALID_ARGUMENT
    with Topology(1, 1, 2, 1, 2, 4, order="mp,sharding,dp,pp,sep") as topo:
        assert topo.group_ranks(Group.SHARDING, 0) == [0, 1]
    assert status_of(lambda: Topology(2, 2, 1, 1, 1, 8)) == INVALID_ARGUMENT
    assert status_of(lambda: Topology(1, 1, 1, 1, 1, 1, order="dp,dp,sharding,sep,mp")) \
        == INVALID_ARGUMENT
    t = Topology(1, 1, 1, 1, 1, 1)
    t.close()
    t.close()
    with pytest.raises(ValueError):
        t.degree(Group.DP)


def test_enums_match_the_header():
    assert [int(o) for o in ReduceOp] == [0, 1, 2, 3]
    assert [int(g) for g in Group] == [0, 1, 2, 3, 4, 5, 6]
    assert capi.HPS_REDUCE_MIN == 3 and capi.HPS_GROUP_SHARDING_CHECK == 6
    assert not hasattr(capi, "HPS_REDUCE_OP_FORCE32")
    assert not hasattr(capi, "HPS_GROUP_FORCE32")


# ---- device and transport ------------------------------------------------------------------
def expected_transport(size):
    """What a group of `size` thread-ranks of this process uses: shared memory, unless it is
    a single rank or HPS_COMM_SHM=0 (a non-zero integer keeps it on)."""
    shm = os.environ.get("HPS_COMM_SHM", "").strip()
    if size < 2 or (shm and int(shm) == 0):
        return "tcp"
    return "shm"


def test_capi_comm_null_handle_arguments():
    # A handle argument that is None reaches the library as NULL and is refused.
    assert status_of(lambda: capi.CommHandle.create(None, 0, 1, capi.HPS_DEVICE_CPU, 0,
                                                    None)) == INVALID_ARGUMENT
    assert "store is NULL" in hpshard.last_error_message()


def test_device_and_transport_of_cpu_communicators():
    def rank(r, url):
        store, comm = world(r, url, size=2)
        with store, comm:
            kind, index = comm._h().device()
            assert (kind, index) == (capi.HPS_DEVICE_CPU, 0)
            assert comm.device == (hpshard.DeviceType.CPU, 0)
            assert isinstance(comm.device[0], hpshard.DeviceType)
            assert comm.transport == comm._h().transport() == expected_transport(2)
            return comm.transport

    assert run_ranks(2, rank, "device") == [expected_transport(2)] * 2
    store, comm = world(0, unique_url("device1"), size=1)
    with store, comm:
        assert comm.device == (hpshard.DeviceType.CPU, 0)
        assert comm.transport == "tcp"  # a group of one has no peer to share memory with


def run_two_threads(rank):
    """rank(0) and rank(1) on two threads (each opens its own store and communicator);
    fails unless both end within 40 s."""
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert not any(t.is_alive() for t in threads)


def test_a_second_close_returns_only_once_the_first_has_closed_the_communicator():
    """Rank 0 queues an all-reduce rank 1 joins only 1 s later, then closes (waiting for
    it); a close from a second thread meanwhile returned at once, before the communicator
    was gone. It now returns once the first close is done."""
    url = unique_url("second-close")
    out = {}

    def rank(r):
        store = Store.open(url, r, timeout_ms=10000)
        comm = Communicator.create(store, r, 2, timeout_ms=8000)
        buf = np.ones(4, np.float32)
        if r == 1:
            time.sleep(1.0)
            comm.all_reduce(buf, buf).wait()
        else:
            work = comm.all_reduce(buf, buf)
            first = threading.Thread(target=comm.close)
            first.start()
            time.sleep(0.2)
            start = time.monotonic()
            comm.close()  # the second
            out["second_s"] = time.monotonic() - start
            out["first_alive"] = first.is_alive()
            first.join()
            work.wait()
        comm.close()
        store.close()

    run_two_threads(rank)
    assert out["first_alive"] is False, out
    assert out["second_s"] > 0.4, out


@pytest.mark.parametrize("op", ["all_reduce", "recv"])
def test_abort_from_another_thread_ends_a_close_waiting_on_a_stuck_operation(op):
    """Rank 0 queues an all-reduce (or a receive) rank 1 never joins, then closes: the close
    waits for the operation (8 s timeout), and abort() from a watchdog thread ends that wait
    at once (hps_comm_finish before the destroy; abort never overlaps the destroy itself).
    After the close, abort() raises ValueError (closed). hps_comm_finish returned before a
    receive had ended (the waiter thread completes sends and receives), so the destroy
    waited for it, out of abort's reach, the whole timeout."""
    url = unique_url("abort-close")
    closed = threading.Event()
    out = {}

    def rank(r):
        store = Store.open(url, r, timeout_ms=10000)
        comm = Communicator.create(store, r, 2, timeout_ms=8000)
        if r == 1:
            closed.wait(30)
        else:
            buf = np.ones(4, np.float32)
            work = comm.all_reduce(buf, buf) if op == "all_reduce" else comm.recv(buf, 1)
            watchdog = threading.Timer(0.3, comm.abort)
            watchdog.start()
            start = time.monotonic()
            comm.close()
            out["close_s"] = time.monotonic() - start
            watchdog.join()
            with pytest.raises(hpshard.Error) as info:
                work.wait()
            out["status"] = info.value.status
            with pytest.raises(ValueError):
                comm.abort()
            closed.set()
        comm.close()
        store.close()

    run_two_threads(rank)
    assert out["close_s"] < 4.0, out  # not the 8 s timeout
    assert out["status"] == 9  # ABORTED


def test_bytes_are_refused_where_text_is_taken():
    """A bytes key or name is a TypeError: str() sent its repr ("b'ready'"), so a peer's
    check('ready') never saw it and a parameter was registered as "b'w'"."""
    store, comm = world(0, unique_url("bytes-names"), size=1)
    with store, comm:
        for call in (lambda: store.set(b"ready", b"1"), lambda: store.check(b"ready"),
                     lambda: store.add(bytearray(b"n"), 1), lambda: comm.split([0], b"part")):
            with pytest.raises(TypeError, match="not (bytes|bytearray)"):
                call()
        assert not store.check("b'ready'")
        with hpshard.Engine.create(comm) as engine:
            with pytest.raises(TypeError):
                engine.add_param(b"w", (3,))
            assert engine.add_param("w", (3,)) == 0


def test_none_and_other_objects_are_refused_where_text_is_taken():
    """None (or a number) as a key, name, URL or axis order is a TypeError naming it: str()
    sent None as the text "None" (C refuses NULL, Java throws NullPointerException), so
    store.set(None, ...) set the key "None" and add_param(None) registered 'None'. Where
    None is documented as the default (a communicator's or split's name, the order) it
    stays the default."""
    url = unique_url("none-names")
    with pytest.raises(TypeError, match="^Store.open: the url must be str, not None$"):
        Store.open(None, 0)
    with pytest.raises(TypeError, match="^Topology: the order must be str, not int$"):
        Topology(1, 1, 1, 1, 1, 1, order=5)
    with Topology(1, 1, 1, 1, 1, 1, order=None) as topo:
        assert topo.degree(Group.DP) == 1
    store, comm = world(0, url, size=1)
    with store, comm:
        calls = {"Store.set": lambda k: store.set(k, b"v"),
                 "Store.get": lambda k: store.get(k, 100),
                 "Store.add": lambda k: store.add(k, 1),
                 "Store.wait": lambda k: store.wait(k, 100),
                 "Store.check": store.check}
        for what, call in calls.items():
            for key in (None, 7):
                kind = "None" if key is None else "int"
                with pytest.raises(TypeError, match=f"^{what}: the key must be str, not {kind}$"):
                    call(key)
        assert not store.check("None") and not store.check("7")
        with pytest.raises(TypeError, match="^Communicator.split: the name must be str, not int"):
            comm.split([0], 5)
        with comm.split([0], None) as part:  # the default name
            assert part.name == "world.split"
        with Store.open(unique_url("none-comm"), 0) as other:
            with pytest.raises(TypeError, match="^Communicator.create: the name must be str"):
                Communicator.create(other, 0, 1, name=3)
        with hpshard.Engine.create(comm) as engine:
            for name in (None, 1.5):
                with pytest.raises(TypeError, match="^Engine.add_param: the name must be str"):
                    engine.add_param(name, (2,))
            assert engine.num_params == 0
            assert engine.add_param("w", (2,)) == 0
