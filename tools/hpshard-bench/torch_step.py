#!/usr/bin/python3
"""torch side of `hpshard-bench step`: DDP + ZeroRedundancyOptimizer + clip_grad_norm_.

The same MLP as hpshard-bench (depth Linear(width, width) layers, ReLU between them,
loss = mean over samples of 1/2 |out - target|^2), the same batch per rank, ranks as
processes (torch.multiprocessing, backend gloo, tcp://127.0.0.1), each with
torch.set_num_threads(--threads). One step: zero_grad, forward, backward (DDP all-reduces
the gradients), clip_grad_norm_ (when --clip > 0), ZeroRedundancyOptimizer.step()
(Adam or SGD on the rank's shard, then the parameter broadcasts).

Timing as hpshard-bench: per repetition a barrier, then --steps steps, the slowest rank's
time / steps; the median over --reps repetitions after --warmup. `compute_seconds`: the
same for forward + backward alone (DDP no_sync, no optimizer), alternated with the steps.
Writes one JSON object on one line:

    {"torch_version": "1.13.1", "ranks": 2, "seconds": 0.12, "compute_seconds": 0.05}

Usage: torch_step.py --ranks N --width W --depth D --batch B --steps S --reps R
                     --warmup U --clip X --optimizer adam|sgd --threads T --out FILE
"""
import argparse
import json
import os
import statistics
import sys
import time

from torch_ranks import free_port, run_ranks


def rank_main(rank, args, port, queue):
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ranks)
    torch.manual_seed(0)
    layers = []
    for l in range(args.depth):
        layers.append(torch.nn.Linear(args.width, args.width))
        if l + 1 < args.depth:
            layers.append(torch.nn.ReLU())
    model = DDP(torch.nn.Sequential(*layers))
    if args.optimizer == "adam":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                      lr=1e-3)
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                      lr=0.01, momentum=0.9)
    k = torch.arange(args.width, dtype=torch.float32)

    def batch(step):
        sample = (step * 4096 + rank * 64 + torch.arange(args.batch, dtype=torch.float32))[:, None]
        return torch.sin(0.37 * sample + 0.91 * k), 0.5 * torch.cos(0.23 * sample + 0.7 * k)

    def forward_backward(step):
        x, y = batch(step)
        out = model(x)
        loss = 0.5 * ((out - y) ** 2).sum() / args.batch
        loss.backward()

    def train_step(step):
        opt.zero_grad(set_to_none=False)
        forward_backward(step)
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()

    def compute_step(step):
        with model.no_sync():
            forward_backward(step)

    times = {"step": [], "compute": []}
    step_index = 0
    for rep in range(args.warmup + args.reps):
        order = ["step", "compute"] if rep % 2 == 0 else ["compute", "step"]
        for which in order:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                (train_step if which == "step" else compute_step)(step_index)
                step_index += 1
            elapsed = torch.tensor([(time.perf_counter() - start) / args.steps],
                                   dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rep >= args.warmup:
                times[which].append(elapsed.item())
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put({"seconds": statistics.median(times["step"]),
                   "compute_seconds": statistics.median(times["compute"])})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch

    result = run_ranks(rank_main, args.ranks, args, free_port())
    if result is None:
        print("torch_step.py: a rank failed", file=sys.stderr)
        return 1
    result.update({"torch_version": torch.__version__, "ranks": args.ranks})
    with open(args.out + ".tmp", "w") as out:
        out.write(json.dumps(result) + "\n")
    os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
