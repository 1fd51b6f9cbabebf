#!/usr/bin/env python3
"""A model cut across tensor (mp) and pipeline (pp) parallelism, each part sharded by an
hpshard engine, with global-norm clipping and dynamic loss scaling over the whole model.

Every process is one rank of a dp x pp x sharding x mp topology. The part of the model at
pp stage p and mp rank m holds `w` (split across mp: HPS_PARAM_DISTRIBUTED, a slice per mp
rank) and `b` (replicated across mp). Each engine is given its mp and pp groups
(Engine.set_model_parallel_groups), so the clip coefficient comes from the norm of the
whole model and a non-finite gradient on one rank skips the step on all of them. Every
rank also computes the whole model in float64 NumPy and checks its own part against it
after every step.

    hpshard-run -n 4 -- python3 examples/python/hybrid_clip.py --pp 2 --mp 2
    hpshard-run -n 8 -- python3 examples/python/hybrid_clip.py --sharding 2 --pp 2 --mp 2

(with the package on the path, e.g. PYTHONPATH=<build>/bindings/python).
"""

import argparse
import math
import sys

import numpy as np

import hpshard
from hpshard import Engine, Group

W_SIZE, B_SIZE = 6, 3
LR, INITIAL_SCALE = 0.1, 1024.0


def initial(name, p, m):
    """The initial values of parameter `name` of part (p, m): b is the same across mp."""
    key = (1, p, m) if name == "w" else (2, p)
    return np.random.default_rng(key).uniform(-1, 1, W_SIZE if name == "w" else B_SIZE)


def gradient(name, step, p, m, replica):
    """What the framework at replica `replica` of part (p, m) computes in `step`; b's
    gradient is the same on every mp rank (replicated computation)."""
    key = (3, step, p, m, replica) if name == "w" else (4, step, p, replica)
    n = W_SIZE if name == "w" else B_SIZE
    return np.random.default_rng(key).normal(0, 1 + step, n)


def reference(args, replicas):
    """The whole model's parameters after each step, in float64: {(p, m): {name: values}}
    per step, and whether each step was skipped."""
    params = {(p, m): {n: initial(n, p, m) for n in ("w", "b")}
              for p in range(args.pp) for m in range(args.mp)}
    history, skipped = [], []
    for step in range(args.steps):
        mean = {(p, m): {n: np.mean([gradient(n, step, p, m, r) for r in range(replicas)],
                                    axis=0) for n in ("w", "b")} for (p, m) in params}
        skip = step == args.inf_step
        if not skip:
            # w's slices each count once; b once per pp stage (it is replicated across mp).
            norm2 = sum(float((g["w"] ** 2).sum()) for g in mean.values())
            norm2 += sum(float((mean[(p, 0)]["b"] ** 2).sum()) for p in range(args.pp))
            norm = math.sqrt(norm2)
            coef = args.clip / (max(norm, args.clip) + 1e-6) if args.clip > 0 else 1.0
            for key, part in params.items():
                for n in part:
                    part[n] = part[n] - LR * coef * mean[key][n]
        history.append({k: {n: v.copy() for n, v in part.items()} for k, part in params.items()})
        skipped.append(skip)
    return history, skipped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sharding", type=int, default=1)
    parser.add_argument("--mp", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3, choices=(2, 3))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--clip", type=float, default=0.5, help="max norm (0: no clipping)")
    parser.add_argument("--inf-step", type=int, default=2,
                        help="the step whose gradient is infinite on the last rank only (-1: none)")
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="largest relative difference from the reference accepted")
    args = parser.parse_args()

    info = hpshard.rendezvous_from_env()
    world_size = args.dp * args.pp * args.sharding * args.mp
    if info.world_size != world_size:
        print(f"hybrid_clip: {info.world_size} ranks started but dp x pp x sharding x mp is "
              f"{world_size}", file=sys.stderr)
        return 2
    rank = info.rank
    replicas = args.dp * args.sharding
    expected, skipped = reference(args, replicas)
    with hpshard.Store.open(info.store_url, rank) as store, \
            hpshard.Communicator.create(store, rank, world_size) as world, \
            hpshard.Topology(args.dp, args.pp, args.sharding, 1, args.mp, world_size) as topo:
        group = hpshard.HybridGroup.create(world, topo)
        p, m = topo.coordinate(rank, Group.PP), topo.coordinate(rank, Group.MP)
        replica = topo.coordinate(rank, Group.DP) * args.sharding + \
            topo.coordinate(rank, Group.SHARDING)
        sharding = group.comm(Group.SHARDING)
        dp = group.comm(Group.DP) if args.dp > 1 else None
        mp = group.comm(Group.MP) if args.mp > 1 else None
        pp = group.comm(Group.PP) if args.pp > 1 else None
        with Engine.create(sharding, dp, stage=args.stage, learning_rate=LR,
                           clip_max_norm=args.clip, dynamic_loss_scaling=True,
                           initial_loss_scale=INITIAL_SCALE, growth_interval=1000) as engine:
            engine.set_model_parallel_groups(mp, pp)
            index = {"w": engine.add_param("w", (W_SIZE,), distributed=True),
                     "b": engine.add_param("b", (B_SIZE,))}
            engine.seal()
            for n, i in index.items():
                engine.param(i)[...] = initial(n, p, m)
            engine.broadcast_parameters()
            worst = 0.0
            for step in range(args.steps):
                engine.wait_parameters(0)
                scale = engine.loss_scale
                for n, i in index.items():
                    g = gradient(n, step, p, m, replica) * scale
                    if step == args.inf_step and rank == world_size - 1 and n == "w":
                        g[0] = np.inf
                    engine.grad(i)[...] = g
                    engine.grad_ready(i)
                engine.release_parameters(0)
                engine.step()
                for n, i in index.items():
                    got = engine.gather_parameter(i).astype(np.float64)
                    want = expected[step][(p, m)][n]
                    error = float(np.max(np.abs(got - want) / (np.abs(want) + 1e-3)))
                    worst = max(worst, error)
                    if error > args.tolerance:
                        print(f"step {step}: {n} of part pp {p}, mp {m} is {got}, "
                              f"the whole-model reference {want}", file=sys.stderr)
                        return 1
                if rank == 0:
                    print(f"step {step}: "
                          f"{'skipped (a non-finite gradient on rank ' + str(world_size - 1) + ')' if skipped[step] else 'applied'}, "
                          f"loss scale now {engine.loss_scale:g}, skipped {engine.skipped_steps}")
            if engine.skipped_steps != sum(skipped):
                print(f"skipped {engine.skipped_steps} steps, the reference "
                      f"{sum(skipped)}", file=sys.stderr)
                return 1
        for c in (sharding, dp, mp, pp):
            if c is not None:
                c.close()
        group.close()
    if rank == 0:
        print(f"dp {args.dp} x pp {args.pp} x sharding {args.sharding} x mp {args.mp}, "
              f"stage {args.stage}: every part matches the whole-model float64 reference "
              f"(worst relative difference {worst:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
