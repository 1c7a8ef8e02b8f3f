"""The main job: train a GPT-2-style model on a (dp, tp) = (2, 2) mesh, beside torch DTensor.

    shardops demo                        # threads world (4 ranks in this process), strict mode
    shardops demo --model llama --size medium --steps 40 --mesh 4
    shardops demo --ops                  # the math-op demo (softmax, cross-entropy, norms, top-k...)
    shardops demo --steps 20 --save-every 5 --checkpoint ckpt   # saves after steps 5, 10, 15, 20
    shardops demo --steps 30 --resume ckpt                       # continues at step 20, bit for bit
    torchrun --nproc-per-node 4 -m shardops.demo   # shardops over torch.distributed (gloo)

1. shardops: the torchtitan-style plan through `shardops.parallel` on mesh["tp"], then
   `shardops.fsdp.replicate` (`--dp-mode shard`: `fully_shard` per block, then the root) on
   mesh["dp"], each rank on its own batch slice; AdamW, strict mode (any fallback is an error),
   dropout and attention on DTensors;
2. torch DTensor: the same model and plan through `torch.distributed.tensor.parallel`, then
   torch's own replicate / fully_shard, in 4 gloo processes, measured with its own
   CommDebugMode — without dropout and with attention on local shards, the part of the job torch
   runs on CPU (`RunSpec.as_torch_runs_it` says why);
3. each column checked against single-device training of the whole batch, from the same initial
   weights (shardops' with shardops' dropout masks, each dp slice's: training/reference.py), the
   measured errors printed beside the tolerance;
4. a table per step part: collectives and bytes handed to the transport on the busiest rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..training import report
from ..training.config import SIZES, RunSpec
from ..training.reference import reference
from ..training.shardops_side import Checkpointing, NothingToResume

DEFAULT_DROPOUT = 0.1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="shardops demo", description=__doc__.split("\n")[0])
    p.add_argument("--ops", action="store_true", help="run the math-op demo instead of training")
    p.add_argument(
        "--device", default="cpu", help="--ops only: where the tensors live (cpu or cuda); training runs on CPU"
    )
    p.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--size", choices=sorted(SIZES), default="small", help="model size (default: small)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--mesh", default="2x2", help="mesh shape: 2x2 (dp x tp) or 4 (tp only)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument(
        "--dp-mode",
        choices=("replicate", "shard"),
        default="replicate",
        help="data parallelism over dp: replicate (DDP) or shard (fully_shard per block, then the root)",
    )
    p.add_argument(
        "--dropout", type=float, default=DEFAULT_DROPOUT, help=f"GPT-2's dropout (default {DEFAULT_DROPOUT})"
    )
    p.add_argument(
        "--local-attention", action="store_true", help="q/k/v as local shards (default: rotary and SDPA on DTensors)"
    )
    p.add_argument("--no-torch", action="store_true", help="skip torch DTensor's side")
    p.add_argument(
        "--save-every", type=int, default=0, metavar="N", help="save a checkpoint every N steps (into --checkpoint DIR)"
    )
    p.add_argument(
        "--checkpoint", metavar="DIR", help="where --save-every saves (each save replaces the last, atomically)"
    )
    p.add_argument(
        "--resume", metavar="DIR", help="load model, optimizer, random state and step from DIR and continue to --steps"
    )
    args = p.parse_args(argv)
    if args.save_every < 0:
        p.error(f"--save-every must be >= 0, got {args.save_every}")
    if args.save_every and not args.checkpoint:
        p.error("--save-every needs --checkpoint DIR")
    if args.checkpoint and not args.save_every:
        p.error("--checkpoint DIR is where --save-every N saves: give N")
    if args.resume and not os.path.isdir(args.resume):
        p.error(f"--resume {args.resume}: no such checkpoint directory")
    return args


def checkpointing_from(args: argparse.Namespace) -> Checkpointing:
    return Checkpointing(save_every=args.save_every, path=args.checkpoint, resume=args.resume)


def spec_from(args: argparse.Namespace) -> RunSpec:
    mesh = tuple(int(n) for n in args.mesh.lower().split("x"))
    cfg = replace(SIZES[args.size], dropout=args.dropout if args.model == "gpt2" else 0.0)
    return RunSpec(
        model=args.model,
        cfg=cfg,
        mesh_shape=mesh,
        batch_size=args.batch,
        steps=args.steps,
        local_attention=args.local_attention,
        dp_mode=args.dp_mode,
    )


def _reference_words(spec: RunSpec) -> str:
    masks = f"dropout {spec.cfg.dropout:g} with shardops' masks" if spec.cfg.dropout else "no dropout"
    return f"{masks}, same initial weights"


def run_shardops(
    spec: RunSpec, console: Any, checkpointing: Checkpointing = Checkpointing()
) -> tuple[list[dict[str, Any]], float]:
    import shardops as so

    from ..training.shardops_side import train_rank

    with report.progress(console, spec.steps) as advance:
        start = time.perf_counter()
        so.set_strict(True)
        try:
            results = so.run(train_rank, spec.world_size, spec, advance, False, checkpointing, timeout=600)
        finally:
            so.set_strict(False)
    return results, time.perf_counter() - start


def resumed_reference(spec: RunSpec, ours: dict[str, Any]) -> dict[str, Any]:
    """The single-device reference of the whole run, its records cut to the steps a resumed run ran:
    a resumed run is checked against the run that was never stopped."""
    ref = reference(spec)
    return {**ref, "records": ref["records"][ours["first_step"] :]}


def _resumed_words(spec: RunSpec, ours: dict[str, Any]) -> str:
    words = _reference_words(spec)
    if ours["first_step"]:
        words += f"; resumed at step {ours['first_step']}, against the run never stopped"
    return words


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ops:
        from . import ops

        return ops.main(["--device", args.device])
    if args.device != "cpu":
        raise SystemExit(f"shardops demo: --device {args.device} applies to --ops; the training demo runs on CPU")
    spec = spec_from(args)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return _torchrun_main(spec, checkpointing_from(args))
    console = report.console()
    console.print(report.header(spec))
    try:
        ours, ours_seconds = run_shardops(spec, console, checkpointing_from(args))
    except NothingToResume as e:
        console.print(f"[red]shardops demo --resume: {e}")
        return 2
    checks = [
        report.check(
            "shardops",
            _resumed_words(spec, ours[0]),
            ours[0]["records"],
            ours[0]["params"],
            resumed_reference(spec, ours[0]),
        )
    ]
    theirs, theirs_seconds = None, None
    if not args.no_torch:
        from ..training import torch_side

        torch_spec = spec.as_torch_runs_it()
        with console.status(f"torch DTensor: the same model and plan in {spec.world_size} gloo processes..."):
            start = time.perf_counter()
            theirs = torch_side.train(torch_spec)
            theirs_seconds = time.perf_counter() - start
        words = _reference_words(torch_spec)
        if torch_spec != spec:
            words += "; torch runs without dropout and with local attention on CPU"
        checks.append(
            report.check("torch DTensor", words, theirs[0]["records"], theirs[0]["params"], reference(torch_spec))
        )
    console.print(report.parts_table(spec, ours, theirs))
    world = f"threads world, {spec.world_size} ranks in one process"
    console.print(report.summary(ours, theirs, checks, world, ours_seconds, theirs_seconds))
    return 0 if all(c.ok for c in checks) else 1


def _torchrun_main(spec: RunSpec, checkpointing: Checkpointing) -> int:
    import torch
    import torch.distributed as dist

    import shardops as so

    from ..training.shardops_side import train_rank

    dist.init_process_group("gloo")
    try:
        so.set_strict(True)
        start = time.perf_counter()
        result = train_rank(spec, checkpointing=checkpointing)
        seconds = time.perf_counter() - start
        so.set_strict(False)
        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, result["records"])  # the busiest rank's bytes, as in the threads world
        ok = torch.tensor([1.0])
        if dist.get_rank() == 0:
            console = report.console()
            console.print(report.header(spec))
            check = report.check(
                "shardops",
                _resumed_words(spec, result),
                result["records"],
                result["params"],
                resumed_reference(spec, result),
            )
            ok[0] = float(check.ok)
            everyone = [{"records": r} for r in records]
            console.print(report.parts_table(spec, everyone, None))
            world = f"torch.distributed {dist.get_backend()}, {dist.get_world_size()} processes"
            console.print(report.summary(everyone, None, [check], world, seconds, None))
        dist.broadcast(ok, 0)
        # every rank past its last collective before any tears gloo down (a fresh-clone run saw a rank abort at exit)
        dist.barrier()
        return 0 if ok.item() else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
