#!/usr/bin/env python3
"""The main job: a small GPT-style character-level language model (examples/python/gpt.py)
trained on the license texts Debian ships (/usr/share/common-licenses) through
hpshard.torch, ZeRO stage 3 over the ranks hpshard-run starts, beside an unsharded run of
the same model, seed and data.

    python3 train_gpt.py --reference-only --out DIR            # the unsharded run, 1 process
    hpshard-run -n 4 -- python3 train_gpt.py --out DIR         # the sharded run

The unsharded run (torch.optim.AdamW + clip_grad_norm_ on the whole batch) writes its
per-step losses to DIR/reference.json; the sharded run prints, per step, its loss beside
that one, the tokens per second and the host syncs the step caused (its forward, backward
and step()), and at the end draws both loss curves into DIR/loss.png. tools/run-demo runs
both and merges the timeline (HPS_TRACE).

Two runs whose sums are ordered differently agree to rounding for the first steps and then
part, as two unsharded torch runs do when one of them adds its batch in four pieces: the
training is chaotic at this learning rate. So the run fails (exits 1) when one of its first
--exact-steps losses differs from the unsharded one by more than 1e-5 relative, when the
mean loss of its last 50 steps differs from the unsharded run's by more than --tolerance,
when a step synced, or when the loss did not fall by --min-fall.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, parameter_count  # noqa: E402

TEXTS = "/usr/share/common-licenses"


def load_text(directory: str):
    files = sorted(f for f in glob.glob(os.path.join(directory, "*")) if os.path.isfile(f))
    if not files:
        sys.exit(f"train_gpt: no text files in {directory}")
    text = "".join(open(f, encoding="utf-8", errors="replace").read() for f in files)
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    return data, chars, files


def batch(data: torch.Tensor, step: int, size: int, context: int, seed: int):
    """The same windows of the text for every run: a generator seeded by (seed, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - context - 1, (size,), generator=g)
    x = torch.stack([data[s:s + context] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + context + 1] for s in starts.tolist()])
    return x, y


def build(args, vocab: int) -> GPT:
    torch.manual_seed(args.seed)
    return GPT(GPTConfig(vocab=vocab, context=args.context, width=args.width,
                         heads=args.heads, layers=args.layers))


def reference_run(args) -> int:
    data, chars, _ = load_text(args.text)
    model = build(args, len(chars))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = batch(data, step, args.batch, args.context, args.seed)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            print(f"unsharded step {step:4d}  loss {losses[-1]:.6f}", flush=True)
    seconds = time.perf_counter() - start
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump({"losses": losses, "seconds": seconds, "config": vars(args)}, f)
    print(f"unsharded: {args.steps} steps in {seconds:.1f} s, "
          f"{args.steps * args.batch * args.context / seconds:,.0f} tokens/s on one process")
    return 0


def sharded_run(args) -> int:
    import hpshard
    import hpshard.torch as hpt

    world = hpt.world_from_env()
    rank, size = world.rank, world.size
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    if args.batch % size:
        sys.exit(f"train_gpt: the batch of {args.batch} does not split over {size} ranks")
    reference_path = os.path.join(args.out, "reference.json")
    reference = None
    if os.path.exists(reference_path):
        with open(reference_path) as f:
            reference = json.load(f)
        checks = ("out", "tolerance", "reference_only", "exact_steps", "min_fall")
        mine = {k: v for k, v in vars(args).items() if k not in checks}
        theirs = {k: reference["config"].get(k) for k in mine}
        if mine != theirs:
            sys.exit(f"train_gpt: {reference_path} was made with other settings: {theirs}")
    data, chars, files = load_text(args.text)
    net = build(args, len(chars))
    params = parameter_count(net)
    model = hpt.ShardedModule(net, world, stage=args.stage, units=net.blocks,
                              optimizer="adamw", lr=args.lr, weight_decay=args.weight_decay,
                              clip_max_norm=args.clip, prefetch_window=3)

    def everyone(values, dtype=np.float64):
        """Each rank's values, rank by rank (outside the training step: it waits)."""
        send = np.asarray(values, dtype=dtype)
        out = np.zeros(send.size * size, dtype=dtype)
        world.all_gather(send, out).wait()
        return out.reshape(size, send.size)

    replica = 4 * 4 * params  # fp32 parameters, gradients and AdamW's two moments
    say(f"hpshard {hpshard.version()}: GPT of {args.layers} blocks, width {args.width}, "
        f"context {args.context}, {len(chars)} characters: {params:,} parameters (tied "
        f"output layer); stage {args.stage} over {size} CPU ranks (collectives over "
        f"{world.transport}), AdamW lr {args.lr}, clip {args.clip}, batch {args.batch} x "
        f"{args.context} characters of {TEXTS if args.text == TEXTS else args.text} "
        f"({len(files)} files, {data.numel():,} characters)")
    resident = everyone([model.resident_bytes], np.int64)[:, 0]
    say("resident bytes per rank at start (parameters, gradients, AdamW state): " +
        ", ".join(f"rank {r}: {int(b):,}" for r, b in enumerate(resident)) +
        f"; an unsharded replica: {replica:,} ({resident.max() / replica:.2f}x)")
    say(f"{'step':>5}  {'loss (sharded)':>14}  {'loss (1 rank)':>14}  {'rel diff':>9}  "
        f"{'tokens/s':>9}  host syncs in step")

    per_rank = args.batch // size
    losses, rates, worst, failures = [], [], 0.0, []
    peak = 0
    trained = 0.0
    for step in range(args.steps):
        x, y = batch(data, step, args.batch, args.context, args.seed)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        hpshard.host_sync_reset()
        start = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        model.step()
        seconds = time.perf_counter() - start
        syncs = hpshard.host_sync_count_thread()
        # Reporting, outside the step: every rank's loss, step time and syncs.
        peak = max(peak, model.resident_bytes)
        stats = everyone([loss.item(), seconds, syncs])
        global_loss = float(stats[:, 0].mean())
        step_seconds = float(stats[:, 1].max())
        step_syncs = int(stats[:, 2].sum())
        trained += step_seconds
        rate = args.batch * args.context / step_seconds
        losses.append(global_loss)
        rates.append(rate)
        ref = reference["losses"][step] if reference else float("nan")
        rel = abs(global_loss - ref) / abs(ref) if reference else float("nan")
        if reference and step < args.exact_steps:
            worst = max(worst, rel)
            if rel > 1e-5:
                failures.append(f"step {step}: loss {global_loss} vs unsharded {ref}")
        if step_syncs:
            failures.append(f"step {step}: {step_syncs} host syncs")
        say(f"{step:5d}  {global_loss:14.6f}  {ref:14.6f}  {rel:9.2e}  {rate:9.0f}  "
            f"{step_syncs}")

    peaks = everyone([peak], np.int64)[:, 0]
    count, ns = hpshard.dependency_wait_stats()
    model.close()  # collective: the module holds its full trained parameters again
    say(f"resident bytes per rank, the most seen after a step (full buffers pooled included): " +
        ", ".join(f"rank {r}: {int(b):,}" for r, b in enumerate(peaks)) +
        f" ({peaks.max() / replica:.2f}x an unsharded replica)")
    head = sum(losses[:10]) / min(10, len(losses))
    tail = sum(losses[-10:]) / min(10, len(losses))
    say(f"loss {head:.3f} (first 10 steps) -> {tail:.3f} (last 10) over {args.steps} steps; "
        f"{args.steps * args.batch * args.context / trained:,.0f} tokens/s over the run; "
        f"rank 0 waited {ns / 1e6:.1f} ms for gathers in {count} dependency waits")
    if tail > head - args.min_fall:
        failures.append(f"the loss did not fall by {args.min_fall} ({head:.3f} -> {tail:.3f})")
    if reference:
        window = min(50, args.steps)
        mine_late = sum(losses[-window:]) / window
        ref_late = sum(reference["losses"][-window:]) / window
        late = abs(mine_late - ref_late) / ref_late
        if late > args.tolerance:
            failures.append(f"mean loss of the last {window} steps {mine_late:.4f} vs "
                            f"unsharded {ref_late:.4f}")
        say(f"sharded vs unsharded: the first {min(args.exact_steps, args.steps)} losses within "
            f"{worst:.1e} relative (rounding); the mean of the last {window}: {mine_late:.4f} vs "
            f"{ref_late:.4f} ({late:.1e} relative, tolerance {args.tolerance:g}); unsharded run: "
            f"{reference['seconds']:.1f} s on one process")
    if rank == 0:
        path = os.path.join(args.out, "loss.png")
        draw(losses, reference["losses"] if reference else None, path, size, args.stage)
        say(f"loss curves: {path}")
    world.close()
    for f in failures[:10]:
        print(f, file=sys.stderr)
    return 1 if failures else 0


def draw(losses, reference, path, ranks, stage):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(range(len(losses)), losses, label=f"hpshard stage {stage}, {ranks} ranks",
            linewidth=1.6)
    if reference:
        ax.plot(range(len(reference)), reference, label="unsharded (torch.optim.AdamW)",
                linewidth=1.0, linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title("GPT, character level, /usr/share/common-licenses")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--stage", type=int, default=3, choices=(2, 3))
    ap.add_argument("--batch", type=int, default=16, help="sequences per step, all ranks")
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", default=TEXTS, help="a directory of text files")
    ap.add_argument("--out", default="hpshard-demo", help="where the files go")
    ap.add_argument("--tolerance", type=float, default=0.03,
                    help="largest relative difference of the late mean losses")
    ap.add_argument("--exact-steps", type=int, default=5,
                    help="first steps whose losses must agree within 1e-5 relative")
    ap.add_argument("--min-fall", type=float, default=0.5,
                    help="how much the mean loss must fall from the first 10 steps to the last")
    ap.add_argument("--reference-only", action="store_true",
                    help="run the unsharded model in this one process")
    args = ap.parse_args()
    torch.set_num_threads(1)
    return reference_run(args) if args.reference_only else sharded_run(args)


if __name__ == "__main__":
    sys.exit(main())
