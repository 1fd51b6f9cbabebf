#!/usr/bin/env python3
"""A small version of the main job (examples/c/train_mlp.c) through the Python binding: a
2-layer MLP whose forward and backward are written here in NumPy over the engine's
parameter and gradient views, trained with stage 2 over 2 thread-ranks of this process
(memory:// store), beside an unsharded single-process reference of the same model, data and
optimizer. Per step it prints both losses and the host syncs the step caused; it exits
non-zero when they differ by more than 1e-4 relative or a step synced.

    python3 examples/python/train_mlp.py [--steps N] [--ranks R]
                                         [--checkpoint-dir DIR [--save-every N] [--resume]]

With --checkpoint-dir, every --save-every steps the job saves a checkpoint in the background
(the steps that follow overlap its writing; the two newest are kept); --resume first loads
the newest one, whatever number of ranks saved it, and continues from the step its metadata
records, the unsharded reference replaying the steps before it.
"""
import argparse
import sys
import threading
import uuid

import numpy as np

import hpshard

IN, HIDDEN, OUT, BATCH = 8, 16, 1, 32
LR, MOMENTUM = np.float32(0.05), np.float32(0.9)
# (name, shape, unit): the engine's registration order
PARAMS = [("layer0.weight", (IN, HIDDEN), 0), ("layer0.bias", (HIDDEN,), 0),
          ("layer1.weight", (HIDDEN, OUT), 1), ("layer1.bias", (OUT,), 1)]


def batch(step):
    j = step * BATCH + np.arange(BATCH)
    x = np.sin(0.37 * j[:, None] + 0.91 * np.arange(IN)[None, :]).astype(np.float32)
    y = np.tanh(0.1 * np.sin(j) + x @ ((np.arange(IN) % 3 - 1) * 0.5)).astype(np.float32)
    return x, y[:, None]


def initial(name, shape):
    n = int(np.prod(shape))
    if name.endswith("bias"):
        return np.zeros(shape, dtype=np.float32)
    return (0.3 * np.sin(1.7 * np.arange(n) + len(name)) / np.sqrt(shape[0])) \
        .astype(np.float32).reshape(shape)


def forward_backward(p, g, x, y):
    """Adds the gradient of the mean loss over the samples given into g (a dict of arrays)
    in place and returns that mean loss. Each rank takes the mean over its own samples, as
    with DDP: the engine averages over the ranks."""
    h = np.tanh(x @ p["layer0.weight"] + p["layer0.bias"])
    out = h @ p["layer1.weight"] + p["layer1.bias"]
    diff = out - y
    n = x.shape[0]
    loss = float(0.5 * np.sum(diff.astype(np.float64) ** 2) / n)
    d_out = (diff / np.float32(n)).astype(np.float32)
    g["layer1.weight"] += h.T @ d_out
    g["layer1.bias"] += d_out.sum(axis=0)
    d_h = (d_out @ p["layer1.weight"].T) * (1.0 - h * h)
    g["layer0.weight"] += x.T @ d_h
    g["layer0.bias"] += d_h.sum(axis=0)
    return loss


class Reference:
    """Unsharded SGD with momentum (torch.optim.SGD rules), the full batch, one process."""

    def __init__(self):
        self.p = {n: initial(n, s) for n, s, _ in PARAMS}
        self.buf = {n: None for n, _, _ in PARAMS}

    def step(self, step):
        g = {n: np.zeros(s, dtype=np.float32) for n, s, _ in PARAMS}
        x, y = batch(step)
        loss = forward_backward(self.p, g, x, y)
        for n, _, _ in PARAMS:
            self.buf[n] = g[n].copy() if self.buf[n] is None else MOMENTUM * self.buf[n] + g[n]
            self.p[n] = self.p[n] - LR * self.buf[n]
        return loss


def rank_main(rank, size, url, args, report, failures):
    steps, first_step, saving = args.steps, 0, None
    store = hpshard.Store.open(url, rank, timeout_ms=30000)
    world = hpshard.Communicator.create(store, rank, size, timeout_ms=60000)
    with store, world:
        engine = hpshard.Engine.create(world, learning_rate=float(LR), momentum=float(MOMENTUM))
        with engine:
            index = {n: engine.add_param(n, s, unit=u) for n, s, u in PARAMS}
            engine.seal()
            for n, s, _ in PARAMS:  # views over the engine's memory, written in place
                engine.param(index[n])[...] = initial(n, s) if rank == 0 else 0.0
            engine.broadcast_parameters()  # rank 0's initial values everywhere
            checkpoint = None
            if args.checkpoint_dir:  # closing the engine closes it first
                checkpoint = hpshard.Checkpoint.create(engine, world, args.checkpoint_dir,
                                                       keep_last=2)
            if args.resume:  # the newest checkpoint, whatever number of ranks saved it
                checkpoint.load()
                first_step = int(checkpoint.metadata("step"))
                if rank == 0:
                    info = hpshard.checkpoint_inspect(args.checkpoint_dir)
                    report(f"resumed from checkpoint {info.name} (step {first_step}, saved by "
                           f"{info.world} ranks at stage {info.stage}) on {size} ranks")
            reference = Reference() if rank == 0 else None
            for step in range(first_step if rank == 0 else 0):
                reference.step(step)  # the resumed run's reference replays the steps before
            if rank == 0:
                report(f"hpshard {hpshard.version()}: stage 2 over {size} thread-ranks, "
                       f"SGD+momentum, MLP {IN}-{HIDDEN}-{OUT}, batch {BATCH}; "
                       f"{engine.resident_bytes} bytes resident on rank 0")
                report(f"{'step':>5}  {'loss (sharded)':>14}  {'loss (1 rank)':>14}  "
                       f"{'rel diff':>10}  host syncs in step")
            per_rank = BATCH // size
            for step in range(first_step, steps):
                hpshard.host_sync_reset()
                for unit in (0, 1):
                    engine.wait_parameters(unit)
                # The model's tensors ARE these views (fetched after the wait, as stage 3
                # needs); backward adds into the gradient views.
                p = {n: engine.param(i) for n, i in index.items()}
                g = {n: engine.grad(i) for n, i in index.items()}
                x, y = batch(step)
                sl = slice(rank * per_rank, (rank + 1) * per_rank)
                local = forward_backward(p, g, x[sl], y[sl])
                for n, _, _ in reversed(PARAMS):  # backward order
                    engine.grad_ready(index[n])
                for unit in (1, 0):
                    engine.release_parameters(unit)
                engine.step()
                syncs = hpshard.host_sync_count_thread()
                # Reporting only (outside the step): the global loss.
                send = np.array([local], dtype=np.float64)
                total = np.zeros(1, dtype=np.float64)
                world.all_reduce(send, total).wait()
                total /= size
                if rank == 0:
                    ref = reference.step(step)
                    rel = abs(total[0] - ref) / max(abs(ref), 1e-30)
                    report(f"{step:5d}  {total[0]:14.8f}  {ref:14.8f}  {rel:10.2e}  {syncs}")
                    if rel > 1e-4 or syncs != 0:
                        failures.append(f"step {step}: rel diff {rel:.2e}, {syncs} host syncs")
                if args.save_every > 0 and (step + 1) % args.save_every == 0:
                    # Returns at once; the next steps overlap the writing (a save still in
                    # flight is waited for first).
                    if saving is not None:
                        saving.wait()
                    saving = checkpoint.save(f"step-{step + 1}", {"step": str(step + 1)})
                    if rank == 0:
                        report(f"saving checkpoint step-{step + 1} in the background")
            if saving is not None:
                saving.wait()
                if rank == 0:
                    report("the last checkpoint is published")
            engine.synchronize()
            if rank == 0:
                count, ns = hpshard.dependency_wait_stats()
                report(f"dependency waits: {count}, {ns / 1e6:.3f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--checkpoint-dir", help="where checkpoints are saved and resumed from")
    ap.add_argument("--save-every", type=int, default=0, help="save every N steps")
    ap.add_argument("--resume", action="store_true", help="load the newest checkpoint first")
    args = ap.parse_args()
    if BATCH % args.ranks:
        sys.exit(f"the batch of {BATCH} does not split over {args.ranks} ranks")
    if (args.save_every > 0 or args.resume) and not args.checkpoint_dir:
        sys.exit("--save-every and --resume need --checkpoint-dir")
    url = f"memory://train-mlp-{uuid.uuid4().hex}"
    failures, errors = [], []
    lock = threading.Lock()

    def report(line):
        with lock:
            print(line, flush=True)

    def body(rank):
        try:
            rank_main(rank, args.ranks, url, args, report, failures)
        except BaseException as e:  # noqa: BLE001 — reported below
            errors.append(f"rank {rank}: {e!r}")

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(args.ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if any(t.is_alive() for t in threads):
        errors.append("ranks still running after 120 s")
    for line in errors + failures:
        print(line, file=sys.stderr)
    if errors or failures:
        print("sharded training diverged from the unsharded run, or a step synced",
              file=sys.stderr)
        return 1
    print("sharded and unsharded losses agree; no host sync in any step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
