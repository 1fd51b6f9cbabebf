#!/usr/bin/python3
"""torch side of `hpshard-bench clip`: torch.nn.utils.clip_grad_norm_ on the same tensors.

Reads a case file written by hpshard-bench, one model per line:

    INDEX ITERS WARMUP MAX_NORM DTYPE:COUNT DTYPE:COUNT ...

(DTYPE is float32 or bfloat16), builds one parameter per tensor with a gradient of that
dtype and count, and times clip_grad_norm_(params, MAX_NORM) on one intra-op thread
(hpshard's CPU clip runs on one stream thread). Writes one JSON object whose "results"
list holds one flat object per line:

    {"index": 0, "iters": 15, "seconds": 0.0123}

`seconds` is the median over iterations.

Usage: torch_clip.py --cases FILE --out FILE
"""
import argparse
import json
import math
import os
import statistics
import sys
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    results = []
    with open(args.cases) as cases:
        for line in cases:
            fields = line.split()
            if not fields:
                continue
            index, iters, warmup, max_norm = (int(fields[0]), int(fields[1]), int(fields[2]),
                                              float(fields[3]))
            params = []
            for k, item in enumerate(fields[4:]):
                dtype, count = item.split(":")
                p = torch.nn.Parameter(torch.zeros(int(count), dtype=dtypes[dtype]))
                # The same values hpshard-bench fills in: 0.05 sin(0.001 i + k).
                p.grad = (0.05 * torch.sin(0.001 * torch.arange(int(count), dtype=torch.float32)
                                           + k)).to(dtypes[dtype])
                params.append(p)
            times = []
            for it in range(warmup + iters):
                start = time.perf_counter()
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
                elapsed = time.perf_counter() - start
                if not math.isfinite(float(norm)):
                    raise RuntimeError("clip_grad_norm_ returned a non-finite norm")
                if it >= warmup:
                    times.append(elapsed)
            results.append({"index": index, "iters": iters, "seconds": statistics.median(times)})
            del params

    with open(args.out + ".tmp", "w") as out:
        out.write("{\n")
        out.write(f'"torch_version": {json.dumps(torch.__version__)},\n')
        out.write('"results": [\n')
        out.write(",\n".join(json.dumps(r) for r in results))
        out.write("\n]\n}\n")
    os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
