"""Mixture-of-experts layer: expert parallelism vs the same experts tensor-parallel.

    python -m benchmarks.moe [--quick]

One MoE layer (`shardops.models_moe.MoE`: router, top-2 of E SwiGLU experts) on the
same global batch of tokens, forward + backward of a scalar loss, in 4 gloo processes:

- expert-parallel: mesh (4,), `ExpertParallel()`, tokens split over the 4 ranks,
  routed by all_to_all (counts, dispatch, combine; the two token all_to_alls mirrored
  in backward);
- tensor-parallel: mesh (1, 4), the same style with every expert sharded over tp
  (gate/up column-, down row-parallel), tokens on every rank, outputs all-reduced.

Bytes: what the busiest rank puts into collectives per step (exact, CommDebugMode).
Time: median step wall time over the repetitions (the slowest rank of each step).
Both are strict-mode runs, checked against the single-device loss.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from shardops.training.launch import run_gloo

SIZES = {
    "quick": {"tokens": 256, "dim": 64, "hidden": 128, "experts": 8, "top_k": 2, "reps": 5},
    "full": {"tokens": 2048, "dim": 256, "hidden": 512, "experts": 16, "top_k": 2, "reps": 10},
}


def _layer(size: dict[str, int]):
    import torch

    from shardops.models_moe import MoE, MoEArgs

    args = MoEArgs(dim=size["dim"], num_experts=size["experts"], top_k=size["top_k"], moe_hidden_dim=size["hidden"])
    layer = MoE(args)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    x = torch.randn(size["tokens"], size["dim"], generator=torch.Generator().manual_seed(1))
    return layer, x


def _rank(size: dict[str, int]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import shardops as so
    from shardops import Replicate, Shard
    from shardops.parallel import ExpertParallel, parallelize_module

    so.set_strict(True)
    ref_layer, x = _layer(size)
    reference = float((ref_layer(x) ** 2).mean().detach())
    out: dict[str, Any] = {}
    for name, shape, token_layout in (
        ("expert-parallel", (4,), [Shard(0)]),
        ("tensor-parallel", (1, 4), [Replicate(), Replicate()]),
    ):
        mesh = so.init_device_mesh("cpu", shape)
        layer, _ = _layer(size)
        parallelize_module(layer.experts, mesh, ExpertParallel())
        so.distribute_module(layer.router, mesh)
        xd = so.distribute_tensor(
            x, mesh, token_layout
        ).requires_grad_()  # a layer inside a model: its input's gradient too
        times, nbytes, loss = [], 0, None
        for _ in range(size["reps"] + 1):  # the first is a warm-up (plans, caches)
            layer.zero_grad(set_to_none=True)
            xd.grad = None
            dist.barrier()
            start = time.perf_counter()
            with so.CommDebugMode() as comm:
                loss = (layer(xd) ** 2).mean()
                loss.backward()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(float(elapsed))
            nbytes = comm.get_total_bytes()
        out[name] = {
            "bytes": nbytes,
            "counts": comm.get_comm_counts(),
            "ms": 1e3 * statistics.median(times[1:]),
            "loss_error": abs(float(loss.full_tensor().detach()) - reference) / max(abs(reference), 1e-12),
        }
    return out


def measure_moe(quick: bool = True) -> list[dict[str, Any]]:
    size = SIZES["quick" if quick else "full"]
    ranks = run_gloo(_rank, 4, size, timeout=600)
    rows = []
    for name in ("expert-parallel", "tensor-parallel"):
        per_rank = [r[name] for r in ranks]
        busiest = max(per_rank, key=lambda r: r["bytes"])
        rows.append(
            {
                "layout": name,
                "size": size,
                "bytes": busiest["bytes"],
                "counts": busiest["counts"],
                "ms": per_rank[0]["ms"],
                "exact": all(r["loss_error"] < 1e-4 for r in per_rank),
            }
        )
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    s = rows[0]["size"]
    head = (
        f"MoE layer, {s['tokens']} tokens x {s['dim']}, {s['experts']} experts of width {s['hidden']}, "
        f"top-{s['top_k']}, forward + backward, 4 gloo processes (bytes: busiest rank per step).\n\n| layout | bytes / "
        "step | collectives | step ms | exact |\n|---|---:|---|---:|---|\n"
    )
    lines = [
        f"| {r['layout']} | {r['bytes']:,} | {', '.join(f'{k} {v}' for k, v in sorted(r['counts'].items()))} | "
        f"{r['ms']:.1f} | {'yes' if r['exact'] else 'NO'} |"
        for r in rows
    ]
    return head + "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    rows = measure_moe(quick=args.quick)
    print(table(rows))
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
