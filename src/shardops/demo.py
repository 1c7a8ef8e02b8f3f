"""The main job: train a LLaMA-style model on a (dp, tp) = (2, 2) mesh, beside torch DTensor.

    shardops demo                        # threads world (4 ranks in this process), strict mode
    shardops demo --model gpt2 --size medium --steps 40 --mesh 4
    shardops demo --ops                  # the math-op demo (softmax, cross-entropy, norms, top-k...)
    torchrun --nproc-per-node 4 -m shardops.demo   # shardops over torch.distributed (gloo)

1. single-device training from the same initial weights (the reference);
2. shardops: the torchtitan-style plan through `shardops.parallel`, data parallel
   over dp, AdamW, strict mode (any fallback is an error), a progress bar;
3. torch DTensor: the same model and plan through `torch.distributed.tensor.parallel`
   in 4 gloo processes, measured with its own CommDebugMode;
4. a table per step part (collectives and bytes on the busiest rank, both systems),
   and the check: every loss and the final parameters equal the reference.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Sequence

import torch

from .training import report
from .training.config import SIZES, RunSpec
from .training.loop import reference_parts, run_steps


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="shardops demo", description=__doc__.split("\n")[0])
    p.add_argument("--ops", action="store_true", help="run the math-op demo instead of training")
    p.add_argument("--model", choices=("llama", "gpt2"), default="llama")
    p.add_argument("--size", choices=sorted(SIZES), default="small", help="model size (default: small)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--mesh", default="2x2", help="mesh shape: 2x2 (dp x tp) or 4 (tp only)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dp-mode", choices=("replicate", "shard"), default="replicate")
    p.add_argument("--dtensor-attention", action="store_true", help="keep q/k/v as DTensors (rotary and SDPA on DTensors; torch cannot run this on CPU)")
    p.add_argument("--no-torch", action="store_true", help="skip torch DTensor's side")
    return p.parse_args(argv)


def spec_from(args: argparse.Namespace) -> RunSpec:
    mesh = tuple(int(n) for n in args.mesh.lower().split("x"))
    return RunSpec(
        model=args.model, cfg=SIZES[args.size], mesh_shape=mesh, batch_size=args.batch, steps=args.steps,
        local_attention=not args.dtensor_attention, dp_mode=args.dp_mode,
    )


def reference(spec: RunSpec) -> dict[str, Any]:
    """Single-device training from the same initial weights: losses, final parameters, first gradients."""
    from .training.config import build

    model = build(spec)
    grads: dict[str, torch.Tensor] = {}
    records = run_steps(reference_parts(model, spec.cfg, spec.batch_size, spec.lr, grads), spec.steps)
    return {"records": records, "params": {n: p.detach().clone() for n, p in model.named_parameters()}, "grads": grads}


def run_shardops(spec: RunSpec, console: Any) -> tuple[list[dict[str, Any]], float]:
    import shardops as so

    from .training.shardops_side import train_rank

    with report.progress(console, spec.steps) as advance:
        start = time.perf_counter()
        so.set_strict(True)
        try:
            results = so.run(train_rank, _world(spec), spec, advance, timeout=600)
        finally:
            so.set_strict(False)
    return results, time.perf_counter() - start


def _world(spec: RunSpec) -> int:
    n = 1
    for d in spec.mesh_shape:
        n *= d
    return n


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ops:
        from . import demo_ops

        return demo_ops.main([])
    spec = spec_from(args)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return _torchrun_main(spec)
    console = report.console()
    console.print(report.header(spec))
    ref = reference(spec)
    ours, ours_seconds = run_shardops(spec, console)
    theirs = None
    if not args.no_torch:
        from .training import torch_side

        with console.status("torch DTensor: the same model and plan in 4 gloo processes..."):
            start = time.perf_counter()
            theirs = torch_side.train(spec)
            theirs_seconds = time.perf_counter() - start
    check = report.check(spec, ours, ref)
    console.print(report.parts_table(spec, ours, theirs))
    console.print(report.summary(spec, ours, theirs, check, ours_seconds, theirs_seconds if theirs else None))
    return 0 if check.ok else 1


def _torchrun_main(spec: RunSpec) -> int:
    import torch.distributed as dist

    import shardops as so

    from .training.shardops_side import train_rank

    dist.init_process_group("gloo")
    try:
        so.set_strict(True)
        result = train_rank(spec)
        ref = reference(spec) if dist.get_rank() == 0 else None
        if dist.get_rank() == 0:
            console = report.console()
            check = report.check(spec, [result], ref)
            console.print(report.parts_table(spec, [result], None))
            console.print(report.summary(spec, [result], None, check, sum(r.seconds for r in result["records"]), None))
            return 0 if check.ok else 1
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
