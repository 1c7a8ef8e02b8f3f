"""Pipeline parallelism: shardops.pipelining beside torch.distributed.pipelining, as gloo processes.

    python -m benchmarks.pipelining [--quick | --tiny] [--schedules GPipe 1F1B ZBVZeroBubble]
                                    [--dim 512] [--layers 8] [--seq 256]

The LLaMA-style model of `shardops.models` (float32, AdamW) split by depth torchtitan-style (each
stage the model's own layers under their own names), pure pipeline parallelism over 4 gloo
processes, the same stages, schedule and micro-batches on both sides, built in the same run and
stepped in turn (one step of each side, the order alternating every step) so that both see the same load.
Per side and schedule: the median step time of the slowest rank (the schedule's step and the
optimizer step, after one warm-up step that also infers the shapes), and the p2p bytes all ranks
send per step (shardops: CommDebugMode's "send" bytes; torch: every tensor its schedule hands
to `isend`, counted by wrapping torch.distributed.isend), and whether both sides' losses agree.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from shardops.training.launch import run_gloo

SIZES = {
    "tiny": {
        "dim": 32,
        "layers": 8,
        "seq": 8,
        "batch": 8,
        "microbatches": 4,
        "vocab": 64,
        "steps": 1,
    },  # a smoke run: figures meaningless
    "quick": {"dim": 128, "layers": 8, "seq": 64, "batch": 8, "microbatches": 4, "vocab": 256, "steps": 6},
    "full": {"dim": 512, "layers": 8, "seq": 256, "batch": 8, "microbatches": 4, "vocab": 1024, "steps": 6},
}
SCHEDULES = ("GPipe", "1F1B", "ZBVZeroBubble")
WORLD = 4


def _model(size: dict[str, int]):
    from shardops.models import Llama, ModelArgs

    args = ModelArgs(
        dim=size["dim"],
        n_layers=size["layers"],
        n_heads=max(1, size["dim"] // 64),
        vocab_size=size["vocab"],
        hidden_dim=4 * size["dim"],
        max_seq_len=size["seq"],
    )
    return Llama(args, seed=0)


def _stage_module(size: dict[str, int], stage: int, num_stages: int):
    """Stage `stage` of `num_stages`: the model's own embedding/layers/norm/output, by their FQNs."""
    import torch
    from torch import nn

    class Stage(nn.Module):
        def __init__(self, model: Any, layer_ids: list[str], first: bool, last: bool) -> None:
            super().__init__()
            self.tok_embeddings = model.tok_embeddings if first else None
            self.layers = nn.ModuleDict({k: model.layers[k] for k in layer_ids})
            self.norm = model.norm if last else None
            self.output = model.output if last else None
            self.register_buffer("freqs_cis", model.freqs_cis, persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
            for layer in self.layers.values():
                h = layer(h, self.freqs_cis[: h.shape[1]])
            return self.output(self.norm(h)) if self.norm is not None else h

    per = size["layers"] // num_stages
    return Stage(
        _model(size), [str(i) for i in range(stage * per, (stage + 1) * per)], stage == 0, stage == num_stages - 1
    )


def _loss(logits: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _stage_indices(schedule: str, rank: int) -> list[int]:
    if schedule == "ZBVZeroBubble":
        return [rank, 2 * WORLD - 1 - rank]  # the V
    if schedule in ("GPipe", "1F1B"):
        return [rank]
    return [rank, rank + WORLD]  # looped: stage s on rank s % p


@contextmanager
def _torch_isend_bytes() -> Iterator[list[int]]:
    """Count the bytes of every tensor handed to torch.distributed.isend (torch's schedules send through it,
    batched or not). The wrapper replaces isend in both modules that name it, so torch's P2POp check and its
    schedules' comparisons with dist.isend still see one function."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original, sent = c10d.isend, [0]

    def isend(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        sent[0] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.isend = c10d.isend = isend
    try:
        yield sent
    finally:
        dist.isend = c10d.isend = original


class _Side:
    """One side's pipeline on this rank: its stages, schedule and optimizer."""

    def __init__(self, side: str, schedule: str, size: dict[str, int]) -> None:
        import torch
        import torch.distributed as dist

        rank = dist.get_rank()
        indices = _stage_indices(schedule, rank)
        num_stages = WORLD * len(indices)
        modules = [_stage_module(size, s, num_stages) for s in indices]
        if side == "torch":
            from torch.distributed.pipelining import PipelineStage
            from torch.distributed.pipelining.schedules import get_schedule_class
        else:
            from shardops.pipelining import PipelineStage
            from shardops.pipelining.schedules import get_schedule_class
        stages = [PipelineStage(m, s, num_stages, torch.device("cpu")) for m, s in zip(modules, indices)]
        cls = get_schedule_class(schedule)
        single = len(stages) == 1
        self.schedule = cls(stages[0] if single else stages, size["microbatches"], loss_fn=_loss)
        self.opt = torch.optim.AdamW([q for m in modules for q in m.parameters()], lr=1e-4)
        self.first, self.last = 0 in indices, num_stages - 1 in indices
        self.side = side

    def step(self, tokens: Any, target: Any) -> tuple[float, int, list[float]]:
        """(seconds, p2p bytes this rank sent, this rank's micro-batch losses) of one step."""
        import shardops as so

        losses: list[Any] = []
        self.opt.zero_grad(set_to_none=True)
        args = (tokens,) if self.first else ()
        kwargs = {"target": target, "losses": losses} if self.last else {}
        start = time.perf_counter()
        if self.side == "torch":
            with _torch_isend_bytes() as sent:
                self.schedule.step(*args, **kwargs)
            nbytes = sent[0]
        else:
            with so.CommDebugMode() as cm:
                self.schedule.step(*args, **kwargs)
            nbytes = sum(b for kind, b in cm.log if kind == "send")
        self.opt.step()
        return time.perf_counter() - start, nbytes, [float(x.detach()) for x in losses]


def _rank(size: dict[str, int], schedules: Sequence[str]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=g)
    target = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=g)
    out: dict[str, Any] = {}
    for schedule in schedules:
        sides = {name: _Side(name, schedule, size) for name in ("torch", "shardops")}
        seen: dict[str, dict[str, list]] = {name: {"s": [], "bytes": [], "losses": []} for name in sides}
        names = list(sides)
        for step in range(size["steps"] + 1):  # step 0: warm-up (shape inference, optimizer state)
            for name in names[step % 2 :] + names[: step % 2]:  # the order alternates: neither side always first
                side = sides[name]
                dist.barrier()
                seconds, nbytes, losses = side.step(tokens, target)
                slowest = torch.tensor([seconds])
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                sent = torch.tensor([nbytes])
                dist.all_reduce(sent)
                if step:
                    seen[name]["s"].append(slowest.item())
                    seen[name]["bytes"].append(int(sent.item()))
                seen[name]["losses"].append(losses)
        out[schedule] = seen
    return out


def measure_pipelining(
    size: str | dict[str, int] = "quick", schedules: Sequence[str] = SCHEDULES
) -> list[dict[str, Any]]:
    """One row per schedule; `size` a name of SIZES or such a dict."""
    size = SIZES[size] if isinstance(size, str) else size
    ranks = run_gloo(_rank, WORLD, size, list(schedules), timeout=3600)
    rows = []
    for schedule in schedules:
        per_side = {name: ranks[0][schedule][name] for name in ("torch", "shardops")}
        losses = {name: [x for r in ranks for x in sum(r[schedule][name]["losses"], [])] for name in per_side}
        agree = len(losses["torch"]) == len(losses["shardops"]) > 0 and all(
            abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses["shardops"], losses["torch"])
        )
        rows.append(
            {
                "schedule": schedule,
                "size": size,
                **{f"{name} ms": 1000 * statistics.median(s["s"]) for name, s in per_side.items()},
                **{f"{name} min ms": 1000 * min(s["s"]) for name, s in per_side.items()},
                "ratios": [a / b for a, b in zip(per_side["shardops"]["s"], per_side["torch"]["s"])],
                **{f"{name} bytes": s["bytes"] for name, s in per_side.items()},
                "losses agree": agree,
            }
        )
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    s = rows[0]["size"]
    head = (
        f"LLaMA-style dim {s['dim']} x {s['layers']} layers, seq {s['seq']}, batch {s['batch']} in {s['microbatches']} "
        f"micro-batches, {WORLD} gloo processes (pp={WORLD}; ZBV: 2 stages per rank); the two sides' steps "
        f"interleaved, {s['steps']} each after a warm-up. Step time of the slowest rank (median, least); the median "
        "of the per-step ratios (each step's); p2p bytes all ranks send per step.\n\n| schedule | torch ms (min) "
        "| shardops ms (min) | shardops / torch: median, min, per-step (each) | torch p2p bytes | shardops p2p bytes "
        "| losses agree |\n"
        "|---|---:|---:|---:|---:|---:|---|\n"
    )
    lines = []
    for r in rows:
        tb, sb = r["torch bytes"], r["shardops bytes"]
        tb_cell = f"{tb[0]:,}" if len(set(tb)) == 1 else str(tb)
        sb_cell = f"{sb[0]:,}" if len(set(sb)) == 1 else str(sb)
        lines.append(
            f"| {r['schedule']} | {r['torch ms']:.0f} ({r['torch min ms']:.0f}) | {r['shardops ms']:.0f} "
            f"({r['shardops min ms']:.0f}) | {r['shardops ms'] / r['torch ms']:.2f}x, "
            f"{r['shardops min ms'] / r['torch min ms']:.2f}x, {statistics.median(r['ratios']):.2f}x "
            f"({' '.join(f'{x:.2f}' for x in r['ratios'])}) | {tb_cell} | {sb_cell} | "
            f"{'yes' if r['losses agree'] else 'NO'} |"
        )
    return head + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"small sizes: {SIZES['quick']}")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: figures meaningless")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    for key in SIZES["full"]:
        parser.add_argument(f"--{key}", type=int, default=None)
    args = parser.parse_args(argv)
    size = dict(SIZES["tiny" if args.tiny else "quick" if args.quick else "full"])
    size.update({k: getattr(args, k) for k in size if getattr(args, k) is not None})
    print(table(measure_pipelining(size, args.schedules)))


if __name__ == "__main__":
    main()
