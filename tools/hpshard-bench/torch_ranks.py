"""Ranks as processes for the torch sides of hpshard-bench (torch_coll.py, torch_step.py and
torch_peer.py import it from the folder they are in).

`run_ranks(target, n, *args)` spawns n processes, each running target(rank, *args, queue),
and returns the first object a rank puts on `queue`, or None when a rank fails. However the
script ends (a failed rank, an exception, KeyboardInterrupt), no rank outlives it: the ranks
left are killed, never waited for. A rank stuck in a blocking call of torch's C++ code (a
TCPStore rendezvous waiting for a peer that is gone) does not return to Python on SIGINT, so
waiting for it, as multiprocessing does for its children at exit, waited out torch's
rendezvous timeout (30 minutes).

A rank ends with the process that spawned it (PR_SET_PDEATHSIG), and SIGINT ends a rank at
once (its default action) instead of raising KeyboardInterrupt where Python may not see it.
"""
import multiprocessing
import os
import signal
import socket
from queue import Empty


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(target, parent, rank, args, queue):
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent ended before the request
        os._exit(1)
    target(rank, *args, queue)


def run_ranks(target, n, *args):
    """target(rank, *args, queue) in n spawned processes; the first object put on the queue, or
    None when a rank failed (the others are killed then)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_entry, args=(target, os.getpid(), r, args, queue))
             for r in range(n)]
    finished = False
    try:
        for p in procs:
            p.start()
        result = None
        while result is None:
            try:
                result = queue.get(timeout=1.0)
            except Empty:
                if any(p.exitcode not in (None, 0) for p in procs) or all(
                        p.exitcode is not None for p in procs):
                    return None
        for p in procs:
            p.join()
        finished = all(p.exitcode == 0 for p in procs)
        return result if finished else None
    finally:
        if not finished:
            for p in procs:
                if p.pid is not None and p.exitcode is None:
                    p.kill()
            for p in procs:
                if p.pid is not None:
                    p.join()
