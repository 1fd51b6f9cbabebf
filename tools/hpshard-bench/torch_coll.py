#!/usr/bin/python3
"""torch.distributed (gloo) side of `hpshard-bench coll`.

Runs the same cases as hpshard-bench at one world size, ranks as processes
(torch.multiprocessing) over a TCP rendezvous on 127.0.0.1, and writes one JSON object
whose "results" list holds one flat object per line (hpshard-bench reads it line by line):

    {"op": "all_gather", "count": 131072, "iters": 40, "seconds": 0.0012, "error": null}

`count` is the element count of the call (per rank for all_gather and reduce_scatter);
`seconds` is the median over iterations of the slowest rank, null when torch's gloo
backend refuses the op (torch 1.13 has no gloo reduce_scatter).

Usage: torch_coll.py --ranks N --dtype float32 --cases op:count:iters:warmup,... --out FILE
"""
import argparse
import json
import os
import statistics
import sys
import time

from torch_ranks import free_port, run_ranks


def parse_cases(text):
    cases = []
    for item in text.split(","):
        op, count, iters, warmup = item.split(":")
        cases.append((op, int(count), int(iters), int(warmup)))
    return cases


def rank_main(rank, args, port, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ranks)
    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    n = args.ranks
    results = []
    for op, count, iters, warmup in parse_cases(args.cases):
        if op in ("all_gather", "reduce_scatter"):
            send = torch.ones(count if op == "all_gather" else count * n, dtype=dtype)
            parts = [torch.empty(count, dtype=dtype) for _ in range(n)]
        else:
            send = torch.ones(count, dtype=dtype)
        recv = torch.empty(count, dtype=dtype)

        def run():
            if op == "all_reduce":
                recv.copy_(send)  # out of place, as hpshard and Gloo are measured
                dist.all_reduce(recv)
            elif op == "all_gather":
                dist.all_gather(parts, send)
            elif op == "reduce_scatter":
                dist.reduce_scatter(recv, list(send.chunk(n)))
            elif op == "broadcast":
                dist.broadcast(recv, src=0)
            else:
                raise ValueError(op)

        error = None
        try:
            run()
        except RuntimeError as e:  # refused locally, on every rank alike
            error = str(e).splitlines()[0]
        slowest = []
        if error is None:
            for it in range(warmup + iters):
                dist.barrier()
                start = time.perf_counter()
                run()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if it >= warmup:
                    slowest.append(elapsed.item())
        results.append({"op": op, "count": count, "iters": iters,
                        "seconds": statistics.median(slowest) if slowest else None,
                        "error": error})
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(results)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch

    results = run_ranks(rank_main, args.ranks, args, free_port())
    if results is None:
        print("torch_coll.py: a rank failed", file=sys.stderr)
        return 1
    with open(args.out + ".tmp", "w") as out:
        out.write("{\n")
        out.write(f'"torch_version": {json.dumps(torch.__version__)},\n')
        out.write(f'"ranks": {args.ranks},\n')
        out.write('"results": [\n')
        out.write(",\n".join(json.dumps(r) for r in results))
        out.write("\n]\n}\n")
    os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
