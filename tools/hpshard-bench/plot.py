#!/usr/bin/python3
"""Charts of `hpshard-bench ... --plot FILE.png`, drawn from the JSON the bench writes.

    plot.py BENCH.json OUT.png

- coll: bus bandwidth against message size, one line per implementation (hpshard, Gloo
  direct, Open MPI, torch), one panel per operation and world size;
- step: time per step of each contender split into compute (forward + backward alone),
  communication waits, optimizer (where measured apart) and the rest, one group of bars per
  world size; with --scale, time per parameter against the parameter count instead;
- clip: the clip's bandwidth beside the copy's per model, the folded clip's step time
  beside the step without it, and each CPU kernel's bandwidth beside its copy.

Uses Debian's python3-matplotlib (Agg backend, no display needed).
"""
import json
import sys

try:
    import matplotlib
except ImportError:
    sys.exit("hpshard-bench --plot needs matplotlib (Debian: apt-get install python3-matplotlib)")

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DPI = 80
COLORS = {"hpshard": "tab:blue", "gloo": "tab:orange", "mpi": "tab:green", "torch": "tab:red",
          "copy": "tab:gray"}


def footer(fig, doc):
    fig.text(0.01, 0.005,
             f"{doc.get('date', '')}  {doc.get('machine', '')}  cpu kernels "
             f"{doc.get('cpu_kernels', {}).get('isa', '?')}  load "
             f"{doc.get('load_average', {}).get('start', -1):.1f}",
             fontsize=7, color="dimgray")


def size_label(b):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= div:
            return f"{b / div:g} {unit}"
    return f"{b} B"


def plot_coll(doc, out):
    results = doc["results"]
    ops = list(dict.fromkeys(r["op"] for r in results))
    ranks = sorted({r["ranks"] for r in results})
    fig, axes = plt.subplots(len(ops), len(ranks), figsize=(4.2 * len(ranks), 2.8 * len(ops)),
                             squeeze=False)
    lines = (("hpshard", "hpshard_busbw", "hpshard"), ("gloo", "gloo_busbw", "Gloo direct"),
             ("mpi", "mpi_busbw", "Open MPI"), ("torch", "torch_busbw", "torch gloo"))
    for r in results:
        ax = axes[ops.index(r["op"])][ranks.index(r["ranks"])]
        sizes = [row["bytes"] for row in r["rows"]]
        for key, field, label in lines:
            ys = [row.get(field) for row in r["rows"]]
            pts = [(x, y) for x, y in zip(sizes, ys) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label,
                        color=COLORS[key])
        ax.set_xscale("log", base=2)
        ax.set_title(f"{r['op']}, {r['ranks']} ranks", fontsize=9)
        ax.set_ylabel("busbw GB/s", fontsize=8)
        ticks = sizes[::max(1, len(sizes) // 5)]
        ax.set_xticks(ticks)
        ax.set_xticklabels([size_label(t) for t in ticks], fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"hpshard-bench coll: bus bandwidth, transport {doc['config']['transport']}",
                 fontsize=10)
    footer(fig, doc)
    fig.tight_layout(rect=(0, 0.02, 1, 0.97))
    fig.savefig(out, dpi=DPI)


def plot_step(doc, out):
    results = [r for r in doc["results"] if "split" in r]
    if doc["config"].get("scale"):
        ranks = sorted({r["ranks"] for r in results})
        fig, axes = plt.subplots(1, len(ranks), figsize=(4.2 * len(ranks), 3.4), squeeze=False)
        for ax, n in zip(axes[0], ranks):
            rows = sorted((r for r in results if r["ranks"] == n), key=lambda r: r["parameters"])
            xs = [r["parameters"] for r in rows]
            for key, label in (("stage2", "stage 2"), ("stage3", "stage 3"),
                               ("unsharded", "unsharded")):
                ax.plot(xs, [r[f"{key}_ns_per_parameter"] for r in rows], marker="o", label=label)
            ax.set_xscale("log")
            ax.set_ylim(bottom=0)
            ax.set_title(f"{n} rank{'s' if n > 1 else ''}", fontsize=9)
            ax.set_xlabel("parameters", fontsize=8)
            ax.set_ylabel("ns per parameter per step", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle("hpshard-bench step --scale: time per parameter", fontsize=10)
    else:
        parts = (("compute", "compute (fwd+bwd alone)", "tab:blue"),
                 ("communication_waits", "communication waits", "tab:red"),
                 ("optimizer", "optimizer", "tab:green"),
                 ("rest", "rest (optimizer, enqueue, drain)", "tab:gray"))
        contenders = ("stage2", "stage3", "unsharded", "torch")
        fig, ax = plt.subplots(figsize=(max(5.0, 2.6 * len(results)), 3.8))
        width = 0.2
        labels_done = set()
        for i, r in enumerate(results):
            for k, name in enumerate(contenders):
                split = r["split"].get(name)
                if split is None:
                    continue
                x = i + (k - 1.5) * width
                bottom = 0.0
                for key, label, color in parts:
                    h = split[key] * 1e3
                    ax.bar(x, h, width * 0.9, bottom=bottom, color=color,
                           label=None if label in labels_done else label)
                    labels_done.add(label)
                    bottom += h
                ax.text(x, bottom, name, ha="center", va="bottom", fontsize=6, rotation=90)
        ax.set_xticks(range(len(results)))
        ax.set_xticklabels([f"{r['ranks']} ranks\n{r['parameters'] / 1e6:.1f} M params"
                            for r in results], fontsize=8)
        ax.set_ylabel("ms per step", fontsize=8)
        ax.margins(y=0.2)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
        fig.suptitle("hpshard-bench step: time per step split", fontsize=10)
    footer(fig, doc)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(out, dpi=DPI)


def plot_clip(doc, out):
    rows = doc["results"]
    kernels = doc.get("kernels", [])
    panels = 3 if kernels else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.4 * panels, 3.6), squeeze=False)
    ax = axes[0][0]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["copy_bandwidth"] for r in rows], 0.4, label="copy (2S/t)",
           color=COLORS["copy"])
    ax.bar([x + 0.2 for x in xs], [r["clip_bandwidth"] for r in rows], 0.4,
           label="clip (3S/t)", color=COLORS["hpshard"])
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["model"] for r in rows], fontsize=7)
    ax.set_ylabel("GB/s", fontsize=8)
    ax.set_title("clip (norm + scale) beside a copy", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[0][1]
    ax.bar([x - 0.2 for x in xs], [r["step_seconds"] * 1e3 for r in rows], 0.4,
           label="step (unscale + AdamW)", color=COLORS["copy"])
    ax.bar([x + 0.2 for x in xs], [r["step_clip_seconds"] * 1e3 for r in rows], 0.4,
           label="step + folded clip", color=COLORS["hpshard"])
    for x, r in zip(xs, rows):
        ax.text(x + 0.2, r["step_clip_seconds"] * 1e3, f"{r['fold_ratio']:.2f}x", ha="center",
                va="bottom", fontsize=7)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["model"] for r in rows], fontsize=7)
    ax.set_ylabel("ms", fontsize=8)
    ax.set_title("the clip folded into the step", fontsize=9)
    ax.legend(fontsize=7)
    if kernels:
        ax = axes[0][2]
        names = [f"{k['kernel']} {k['dtype'].replace('float', 'fp').replace('bfp16', 'bf16')}"
                 for k in kernels]
        ys = range(len(kernels))
        ax.barh([y + 0.2 for y in ys], [k["copy_bandwidth"] for k in kernels], 0.4,
                label="copy", color=COLORS["copy"])
        ax.barh([y - 0.2 for y in ys], [k["bandwidth"] for k in kernels], 0.4, label="kernel",
                color=COLORS["hpshard"])
        ax.set_yticks(list(ys))
        ax.set_yticklabels(names, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("GB/s (bytes read + written / t)", fontsize=8)
        ax.set_title(f"CPU kernels ({doc['cpu_kernels']['isa']}) beside a copy", fontsize=9)
        ax.legend(fontsize=7)
    for a in axes[0]:
        a.tick_params(labelsize=7)
        a.grid(alpha=0.3)
    fig.suptitle("hpshard-bench clip", fontsize=10)
    footer(fig, doc)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(out, dpi=DPI)


def shrink(path):
    """Stores the chart with a 64-colour palette (a quarter of the bytes: the charts are
    committed to docs/); left as drawn where Pillow is missing."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=64)
    small.save(path, optimize=True)


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        doc = json.load(f)
    family = doc.get("family")
    draw = {"coll": plot_coll, "step": plot_step, "clip": plot_clip}.get(family)
    if draw is None or "results" not in doc:
        print(f"plot.py: no chart for family {family!r} (or no results)", file=sys.stderr)
        return 1
    draw(doc, sys.argv[2])
    shrink(sys.argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
