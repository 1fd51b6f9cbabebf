#!/usr/bin/python3
"""`hpshard-bench torch`: sharded data parallelism of one PyTorch transformer, with the same
torch forward and backward for every contender, so the comparison measures what happens
around the compute (gradient reduction, the optimizer, parameter gathering), not whose
matrix multiply is faster.

The model is examples/python/gpt.py (tied output layer). Contenders, at each world size:

  hpshard stage 2     hpshard.torch.ShardedModule(stage=2), AdamW + clip in the engine
  hpshard stage 3     hpshard.torch.ShardedModule(stage=3), units = the blocks
  torch ZeRO          DDP + ZeroRedundancyOptimizer(AdamW) + clip_grad_norm_ (gloo)
  torch DDP           DDP + AdamW + clip_grad_norm_, unsharded (gloo)
  torch FSDP          only where torch.distributed.fsdp imports (not Debian's 1.13 on 3.11)
  compute alone       the same forward and backward without any communication (the floor)

Ranks are processes (spawned here), each with one torch intra-op thread; every process
runs every contender, and the contenders take turns repetition by repetition (the order
rotating), so machine noise falls on all of them alike. A repetition: a barrier, --steps
steps, the slowest rank's time / steps; each figure is the median over --reps repetitions
after --warmup. "x ZeRO" is the median over repetitions of the contender's time / torch
ZeRO's in the same repetition (the pairs ran back to back, so load that comes and goes on
a shared machine falls on both); the targets are judged on it. Resident bytes per rank: what
each contender holds for training on rank 0 after a step — hpshard: the engine's own count
(shards, gathered units, buffer pool); torch: the parameter, gradient and optimizer-state
tensors it holds (DDP's bucket buffers
not included, which favours torch). Host syncs: hpshard's counter over a step (0 is the
design); torch's collectives block the host in every step (DDP waits for its all-reduces
at the end of backward, ZeRO for its broadcasts) and are not counted.

Prints one table per world size; --json FILE writes every figure as one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time

from torch_ranks import free_port, run_ranks


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not hasattr(t, "storage"):
            continue
        key = (t.storage().data_ptr(), t.storage().size())
        if key in seen or key[1] == 0:
            continue
        seen.add(key)
        total += t.storage().size() * t.element_size()
    return total


def optimizer_tensors(opt):
    # ZeroRedundancyOptimizer keeps its shard's state in the optimizer it wraps.
    inner = getattr(opt, "optim", opt)
    for state in inner.state.values():
        for v in state.values():
            if hasattr(v, "storage"):
                yield v


def rank_main(rank, args, ports, queue):
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, args.model_dir)
    from gpt import GPT, GPTConfig, parameter_count

    import hpshard
    import hpshard.torch as hpt

    torch.set_num_threads(1)
    n = args.ranks
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                            world_size=n)
    store = hpshard.Store.open(f"tcp://127.0.0.1:{ports[1]}", rank)
    world = hpshard.Communicator.create(store, rank, n, name="world")
    config = GPTConfig(vocab=args.vocab, context=args.context, width=args.width,
                       heads=args.heads, layers=args.layers)

    def build():
        torch.manual_seed(0)
        return GPT(config)

    adamw = dict(lr=1e-3, weight_decay=0.01)
    contenders = {}
    for stage in (2, 3):
        net = build()
        model = hpt.ShardedModule(net, world, stage=stage, units=net.blocks, optimizer="adamw",
                                  clip_max_norm=args.clip, prefetch_window=args.prefetch_window,
                                  **adamw)

        def hps_step(batch, model=model):
            loss = model(*batch)
            loss.backward()
            model.step()

        contenders[f"hpshard stage {stage}"] = (hps_step, model)

    def torch_contender(sharded):
        ddp = DDP(build())
        params = list(ddp.parameters())
        if sharded:
            opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **adamw)
        else:
            opt = torch.optim.AdamW(params, **adamw)

        def step(batch):
            opt.zero_grad(set_to_none=False)
            loss = ddp(*batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, args.clip)
            opt.step()

        return step, (ddp, opt)

    contenders["torch ZeRO"] = torch_contender(True)
    contenders["torch DDP"] = torch_contender(False)
    fsdp_note = "torch.distributed.fsdp imports: not measured by this version"
    try:
        import torch.distributed.fsdp  # noqa: F401
    except Exception as e:  # noqa: BLE001 — why FSDP is absent goes into the report
        fsdp_note = f"torch.distributed.fsdp does not import ({type(e).__name__}: " \
                    f"{str(e)[:120]})"
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        fsdp = FSDP(build())
        fopt = torch.optim.AdamW(fsdp.parameters(), **adamw)

        def fsdp_step(batch):
            fopt.zero_grad(set_to_none=False)
            loss = fsdp(*batch)
            loss.backward()
            fsdp.clip_grad_norm_(args.clip)
            fopt.step()

        contenders["torch FSDP"] = (fsdp_step, (fsdp, fopt))
        fsdp_note = "torch FSDP measured"

    plain = build()

    def compute_step(batch):
        plain.zero_grad(set_to_none=False)
        plain(*batch).backward()

    contenders["compute alone"] = (compute_step, plain)

    def batch_of(step):
        g = torch.Generator().manual_seed(step * 64 + rank)
        x = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g)
        return x[:, :-1], x[:, 1:]

    names = list(contenders)
    times = {k: [] for k in names}
    syncs = {k: [] for k in names}
    step_index = 0
    for rep in range(args.warmup + args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            fn, _ = contenders[name]
            dist.barrier()
            hpshard.host_sync_reset()
            start = time.perf_counter()
            for _ in range(args.steps):
                fn(batch_of(step_index))
                step_index += 1
            elapsed = torch.tensor([(time.perf_counter() - start) / args.steps],
                                   dtype=torch.float64)
            counted = hpshard.host_sync_count_thread()
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rep >= args.warmup:
                times[name].append(elapsed.item())
                syncs[name].append(counted / args.steps)

    resident = {}
    for name in names:
        _, obj = contenders[name]
        if name.startswith("hpshard"):
            resident[name] = obj.resident_bytes
        elif name == "compute alone":
            resident[name] = tensor_bytes(list(obj.parameters()) +
                                          [p.grad for p in obj.parameters()])
        else:
            module, opt = obj
            resident[name] = tensor_bytes(list(module.parameters()) +
                                          [p.grad for p in module.parameters()] +
                                          list(optimizer_tensors(opt)))
    params = parameter_count(build())
    # The live window of stage 3: prefetch_window units of full fp32 parameters and
    # gradients, the largest unit (a block, or the rest: embeddings and the last norm).
    net3 = contenders["hpshard stage 3"][1].module
    blocks = [sum(p.numel() for p in b.parameters()) for b in net3.blocks]
    rest = sum(p.numel() for p in net3.parameters()) - sum(blocks)
    window = args.prefetch_window * max(blocks + [rest]) * 4 * 2
    for name in names:
        if name.startswith("hpshard"):
            contenders[name][1].close()
    dist.barrier()
    world.close()
    store.close()
    dist.destroy_process_group()
    if rank == 0:
        queue.put({"ranks": n, "parameters": params, "fsdp": fsdp_note,
                   "window_bytes": window,
                   "contenders": {k: {"seconds": statistics.median(times[k]),
                                      "repetitions": times[k],
                                      "resident_bytes": resident[k],
                                      "host_syncs_per_step": max(syncs[k])
                                      if k.startswith("hpshard") else None}
                                  for k in names}})


def run_world(args, n):
    a = argparse.Namespace(**vars(args))
    a.ranks = n
    result = run_ranks(rank_main, n, a, (free_port(), free_port()))
    if result is None:
        raise SystemExit(f"torch_peer.py: a rank failed at {n} ranks")
    return result


LABELS = {
    "hpshard stage 2": "hpshard stage 2 (hpshard.torch, AdamW + clip in the engine)",
    "hpshard stage 3": "hpshard stage 3 (hpshard.torch, units = blocks)",
    "torch ZeRO": "torch DDP + ZeroRedundancyOptimizer(AdamW) + clip_grad_norm_",
    "torch DDP": "torch DDP + AdamW + clip_grad_norm_ (unsharded)",
    "torch FSDP": "torch FSDP + AdamW",
    "compute alone": "forward + backward alone (no communication, no optimizer)",
}


def report(args, worlds, info):
    out = []
    if not args.bench_header:  # else hpshard-bench prints the header all its reports have
        out.append(f"# hpshard-bench torch — {info['date']} — {info['machine']}")
        out.append(f"# {info['command']}")
    out.append(f"# torch {info['torch']}, 1 intra-op thread per rank, ranks as processes; "
               f"{worlds[0]['fsdp'] if worlds else ''}")
    verdicts = []
    for w in worlds:
        n = w["ranks"]
        c = w["contenders"]
        zero_reps = c["torch ZeRO"]["repetitions"]
        for v in c.values():
            v["ratio_to_zero"] = statistics.median(
                a / b for a, b in zip(v["repetitions"], zero_reps))
        ddp_bytes = c["torch DDP"]["resident_bytes"]
        out.append("")
        out.append(f"## GPT width {args.width}, {args.layers} blocks, context {args.context}, "
                   f"{args.batch} sequences per rank, {w['parameters']:,} parameters — {n} ranks")
        out.append(f"{'contender':<64} {'step ms':>9} {'x ZeRO':>7} {'resident B/rank':>16} "
                   f"{'host syncs/step':>19}  repetitions ms")
        for k, v in c.items():
            hs = "0" if v["host_syncs_per_step"] == 0 else (
                f"{v['host_syncs_per_step']:g}" if v["host_syncs_per_step"] is not None
                else "blocking, uncounted")
            if k == "compute alone":
                hs = "-"
            reps = " ".join(f"{t * 1e3:.0f}" for t in v["repetitions"])
            out.append(f"{LABELS[k]:<64} {v['seconds'] * 1e3:9.1f} {v['ratio_to_zero']:7.2f} "
                       f"{v['resident_bytes']:16,} {hs:>19}  {reps}")
        s2 = c["hpshard stage 2"]["ratio_to_zero"]
        s3 = c["hpshard stage 3"]["ratio_to_zero"]
        bound = ddp_bytes / n + w["window_bytes"]
        r3 = c["hpshard stage 3"]["resident_bytes"]
        verdict = {"ranks": n, "stage2_vs_zero": s2, "stage3_vs_zero": s3,
                   "stage2_target_met": s2 <= 0.9, "stage3_target_met": s3 <= 1.0,
                   "stage3_resident": r3, "stage3_resident_bound": bound,
                   "stage3_resident_met": r3 <= bound}
        verdicts.append(verdict)
        out.append(f"targets: stage 2 <= 0.90x ZeRO: {s2:.2f}x "
                   f"{'met' if s2 <= 0.9 else 'MISSED'}; stage 3 <= 1.00x ZeRO: {s3:.2f}x "
                   f"{'met' if s3 <= 1.0 else 'MISSED'}; stage 3 resident <= DDP/{n} + window "
                   f"({bound:,.0f} B): {r3:,} {'met' if r3 <= bound else 'MISSED'}")
    return "\n".join(out), verdicts


def count(least):
    """An argparse type: a decimal integer of at least `least`."""
    def parse(text):
        if not text.isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {least}")
        return int(text)
    return parse


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number > 0")
    return value


def output_target(path):
    """The file --json replaces (a symbolic link followed), or why it cannot be written: as
    the C++ families, checked before anything runs."""
    if not path:
        return None, "an empty path"
    target = os.path.realpath(path) if os.path.islink(path) else path
    if os.path.islink(path) and not os.path.exists(target):
        return None, f"{path!r}: a symbolic link to nothing that exists"
    if os.path.exists(target) and not os.path.isfile(target):
        return None, (f"{path!r}: it is not a regular file (a directory, a device, a FIFO or a "
                      "socket); the output is written beside it and renamed there")
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(parent):
        return None, f"{path!r}: its directory {parent!r} does not exist"
    return target, None


def write_json(target, doc):
    """Writes `doc` beside `target` under a name of its own, then renames it over `target`."""
    directory, name = os.path.split(os.path.abspath(target))
    fd, temporary = tempfile.mkstemp(prefix=name + ".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(temporary, 0o644 & ~mask)  # as open() would make it (mkstemp: 0600)
        os.replace(temporary, target)
    except BaseException:
        os.unlink(temporary)
        raise


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4")
    # Defaults: a model wide enough, and a batch small enough, that what happens around
    # the compute (reduction, optimizer, gathers) is a fair part of the step on CPU.
    ap.add_argument("--width", type=count(1), default=256)
    ap.add_argument("--layers", type=count(1), default=3)
    ap.add_argument("--heads", type=count(1), default=4)
    ap.add_argument("--context", type=count(1), default=32)
    ap.add_argument("--vocab", type=count(1), default=96)
    ap.add_argument("--batch", type=count(1), default=1, help="sequences per rank per step")
    ap.add_argument("--steps", type=count(1), default=3)
    ap.add_argument("--reps", type=count(1), default=5)
    ap.add_argument("--warmup", type=count(0), default=1)
    ap.add_argument("--clip", type=positive_float, default=1.0)
    ap.add_argument("--prefetch-window", type=count(0), default=3)
    ap.add_argument("--model-dir", required=True, help="where gpt.py is")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--bench-header", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.width % args.heads:
        ap.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    json_target = None
    if args.json is not None:
        json_target, why = output_target(args.json)
        if why:
            ap.error(f"--json: {why}")
    try:
        ranks = [int(r) for r in args.ranks.split(",") if r]
    except ValueError:
        ap.error(f"--ranks: {args.ranks!r} is not a list of integers")
    if not ranks or any(r < 1 or r > 16 for r in ranks):
        ap.error("--ranks: world sizes from 1 to 16")
    repeated = sorted({r for r in ranks if ranks.count(r) > 1})
    if repeated:
        ap.error(f"--ranks: {repeated[0]} is given twice")
    try:
        import torch
        import hpshard.torch  # noqa: F401
    except ImportError as e:
        sys.exit(f"hpshard-bench torch: cannot import {e.name or e}: this family needs PyTorch "
                 "and hpshard's Python module (Debian: apt-get install python3-torch "
                 "python3-hpshard)")
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": f"{platform.node()}, {os.cpu_count()} CPUs, load "
                       f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}",
            "command": "hpshard-bench torch " + " ".join(sys.argv[1:]),
            "torch": torch.__version__}
    worlds = []
    for n in ranks:
        if not args.quiet:
            print(f"[hpshard-bench] torch family, {n} ranks", file=sys.stderr, flush=True)
        worlds.append(run_world(args, n))
    text, verdicts = report(args, worlds, info)
    print(text)
    if json_target:
        doc = {"tool": "hpshard-bench", "family": "torch", **info,
               "config": {k: v for k, v in vars(args).items()
                          if k not in ("json", "quiet", "bench_header")},
               "results": worlds, "targets": verdicts}
        write_json(json_target, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
