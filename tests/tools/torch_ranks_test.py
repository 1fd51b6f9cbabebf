"""Tests of tools/hpshard-bench/torch_ranks.py, the rank processes of hpshard-bench's torch
sides: no rank outlives the script that spawned it, whether a rank fails, the script is
interrupted while a rank ignores the interrupt (as one blocked in torch's TCPStore does), or
the script is killed. Needs no torch.

Usage: python3 torch_ranks_test.py TOOLS_BENCH_DIR
(run as `... driver MODE PIDS_FILE`, it is the script under test.)
"""
import os
import signal
import subprocess
import sys
import time


def rank_result(rank, pids, queue):
    if rank == 0:
        queue.put({"ranks": "done", "rank": rank})


def rank_sleeps(rank, pids, queue):
    with open(pids, "a") as f:
        f.write(f"{os.getpid()}\n")
    if rank == 0:  # as a rank inside a blocking C++ call: SIGINT changes nothing for it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    time.sleep(600)


def rank_fails(rank, pids, queue):
    with open(pids, "a") as f:
        f.write(f"{os.getpid()}\n")
    if rank == 1:
        time.sleep(0.5)
        sys.exit(3)
    time.sleep(600)


def driver(mode, pids):
    from torch_ranks import run_ranks
    target = {"result": rank_result, "sleeps": rank_sleeps, "fails": rank_fails}[mode]
    result = run_ranks(target, 2, pids)
    print(f"result: {result!r}", flush=True)
    return 0


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start(bench_dir, mode, pids):
    env = dict(os.environ, PYTHONPATH=bench_dir)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "driver", mode, pids],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def wait_for_ranks(pids, n=2, limit=60.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if os.path.exists(pids):
            with open(pids) as f:
                found = [int(line) for line in f if line.strip()]
            if len(found) >= n:
                return found
        time.sleep(0.05)
    raise AssertionError(f"the ranks did not start within {limit} s")


def ended(proc, what, limit=20.0):
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"{what}: the script did not end within {limit} s")
    return proc.returncode, out


def no_rank_left(found, what):
    deadline = time.monotonic() + 5.0
    while any(alive(p) for p in found) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in found if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"{what}: ranks {left} outlived the script"


def main(bench_dir, scratch):
    # A result: the first object a rank puts, once every rank ended well.
    proc = start(bench_dir, "result", os.path.join(scratch, "none"))
    rc, out = ended(proc, "result")
    assert rc == 0 and "result: {'ranks': 'done', 'rank': 0}" in out, (rc, out)

    # SIGINT to the script's group while rank 0 ignores it: the script ends (interrupted)
    # and kills rank 0 instead of waiting for it. The old loops waited for it at exit.
    pids = os.path.join(scratch, "interrupted")
    proc = start(bench_dir, "sleeps", pids)
    found = wait_for_ranks(pids)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    rc, out = ended(proc, "SIGINT")
    assert rc != 0 and "KeyboardInterrupt" in out, (rc, out)
    no_rank_left(found, "SIGINT")

    # A rank that fails: None, and the rank still running is killed.
    pids = os.path.join(scratch, "fails")
    proc = start(bench_dir, "fails", pids)
    found = wait_for_ranks(pids)
    rc, out = ended(proc, "a failed rank")
    assert rc == 0 and "result: None" in out, (rc, out)
    no_rank_left(found, "a failed rank")

    # SIGKILL to the script alone: its ranks end with it.
    pids = os.path.join(scratch, "killed")
    proc = start(bench_dir, "sleeps", pids)
    found = wait_for_ranks(pids)
    proc.kill()
    ended(proc, "SIGKILL")
    no_rank_left(found, "SIGKILL")
    print("torch_ranks: ok")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "driver":
        sys.exit(driver(sys.argv[2], sys.argv[3]))
    import tempfile
    with tempfile.TemporaryDirectory() as scratch:
        sys.exit(main(os.path.abspath(sys.argv[1]), scratch))
