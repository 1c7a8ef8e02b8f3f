"""Data parallelism: shardops' fully_shard / replicate beside torch's fully_shard / DDP, as gloo processes.

    python -m benchmarks.fsdp [--quick] [--dim 512] [--layers 8] [--seq 256] [--batch 4] [--steps 6]
                              [--world 4] [--only fsdp fsdp+prefetch ddp]

The LLaMA-style model of `shardops.models` (float32, AdamW), pure data parallelism over
`--world` gloo processes: torch `fully_shard` (FSDP2, a unit per block and the root) against
shardops `fully_shard` (the same units; and with torchtitan's explicit prefetch chains), torch
DDP against shardops `replicate` (25 MB buckets). Every side is built in the same processes
and the sides' steps are interleaved (one step of each side per round, the order rotating every
round), so a change of the machine's load hits all of them alike. Per side: the median and the
least step time of the slowest rank (forward, backward, optimizer step; after one warm-up step
of each side), the median of the per-round ratios to the torch side it is paired with (and each
round's), the median CPU time of the slowest rank's process (all its threads: far less
disturbed than the wall clock by the machine's other load), the
bytes one step sends per rank (shardops: CommDebugMode's wire bytes; torch: the c10d
collectives' tensors, as torch pads them; both counted on the same step), and the peak of
tensor storage one forward + backward allocates per rank beyond the resident parameters and
optimizer state (the CPU profiler's allocator events; the least of three steps), the largest
rank's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from shardops.training import launch

SIDES = (
    "torch fully_shard",
    "shardops fully_shard",
    "shardops fully_shard + prefetch",
    "torch DDP",
    "shardops replicate",
)
PAIRS = {
    "fsdp": ("shardops fully_shard", "torch fully_shard"),
    "fsdp+prefetch": ("shardops fully_shard + prefetch", "torch fully_shard"),
    "ddp": ("shardops replicate", "torch DDP"),
}
SIZES = {
    "tiny": {"dim": 32, "layers": 2, "seq": 8, "batch": 2, "vocab": 64, "steps": 1},  # a smoke run: figures meaningless
    "quick": {"dim": 128, "layers": 4, "seq": 64, "batch": 4, "vocab": 256, "steps": 6},
    "full": {"dim": 512, "layers": 8, "seq": 256, "batch": 4, "vocab": 1024, "steps": 6},
}


def _model(size: dict[str, int]):
    from .pipelining import _model as llama_of_size  # the same LLaMA of a size, seed 0

    return llama_of_size(size)


def _wrap(side: str, model: Any) -> Any:
    import shardops as so

    if side == "torch fully_shard":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    elif side.startswith("shardops fully_shard"):
        from shardops.fsdp import fully_shard

        mesh = so.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    elif side == "torch DDP":
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    else:
        from shardops.fsdp import replicate

        return replicate(
            model, device_mesh=so.init_device_mesh("cpu", (torch.distributed.get_world_size(),)), bucket_cap_mb=25
        )
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if side.endswith("+ prefetch"):  # torchtitan's chains: each block gathers the next one ahead, both ways
        blocks = list(model.layers.values())
        for prev, nxt in zip(blocks, blocks[1:]):
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])
    return model


def _peak_tracked_bytes(prof: Any) -> int:
    live = peak = 0
    for _, n in sorted((e.start_ns(), e.nbytes()) for e in prof.kineto_results.events() if e.name() == "[memory]"):
        live += n
        peak = max(peak, live)
    return peak


@contextmanager
def _torch_c10d_bytes() -> Iterator[list[int]]:
    """Bytes per rank of the c10d collectives run inside: what each call hands the backend (an
    all_gather its padded input, a reduce_scatter its padded input, an all_reduce its buffer).
    A dispatch mode on this thread: torch's FSDP and DDP call c10d from it on CPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    c10d = torch.ops.c10d
    sent_arg = {c10d._allgather_base_.default: 1, c10d._reduce_scatter_base_.default: 1, c10d.allreduce_.default: 0}

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sent = [0]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            index = sent_arg.get(func)
            if index is not None:
                ts = args[index] if isinstance(args[index], (list, tuple)) else [args[index]]
                self.sent[0] += sum(t.numel() * t.element_size() for t in ts)
            return func(*args, **(kwargs or {}))

    with Count() as mode:
        yield mode.sent


class _Side:
    """One side's model, optimizer and step on this rank."""

    def __init__(self, side: str, size: dict[str, int]) -> None:
        import torch.distributed as dist

        torch.manual_seed(0)
        self.name = side
        self.model = _wrap(side, _model(size))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(dist.get_rank())
        self.tokens = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=g)

    def step(self, profiled: bool = False) -> int:
        from torch.autograd.profiler import profile

        self.opt.zero_grad(set_to_none=True)
        with profile(profile_memory=True, enabled=profiled) as prof:
            logits = self.model(self.tokens)
            F.cross_entropy(logits.flatten(0, 1), self.tokens.flatten()).backward()
        self.opt.step()
        return _peak_tracked_bytes(prof) if profiled else 0

    def counted_step(self) -> int:
        """One step; the bytes it sent from this rank."""
        import shardops as so

        if self.name.startswith("torch"):
            with _torch_c10d_bytes() as sent:
                self.step()
            return sent[0]
        with so.CommDebugMode() as cm:
            self.step()
        return cm.wire_bytes


def _timed(side: _Side) -> tuple[float, float]:
    """The slowest rank's seconds for one step of `side`: wall clock, and the CPU time of the
    rank's process (every thread: the collectives' backend threads too), which the machine's
    other load disturbs far less than the wall clock."""
    import torch.distributed as dist

    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    side.step()
    elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed[0].item(), elapsed[1].item()


def _gather_max(value: int) -> int:
    import torch.distributed as dist

    values = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([value]))
    return max(int(v) for v in values)


def _rank(size: dict[str, int], names: list[str]) -> dict:
    sides = [_Side(name, size) for name in names]
    for side in sides:
        side.step()  # warm-up: optimizer state, process groups, lazy init
    times: dict[str, list[tuple[float, float]]] = {s.name: [] for s in sides}
    for round_ in range(size["steps"]):
        k = round_ % len(sides)
        for side in sides[k:] + sides[:k]:  # the order rotates: no side always runs first
            times[side.name].append(_timed(side))
    out = {}
    for side in sides:
        sent = _gather_max(side.counted_step())
        peak = _gather_max(min(side.step(profiled=True) for _ in range(3)))
        wall, cpu = zip(*times[side.name])
        out[side.name] = {"s": list(wall), "cpu_s": list(cpu), "bytes": sent, "peak": peak}
    return out


def _sides(only: Sequence[str] | None) -> list[str]:
    wanted = {s for key, pair in PAIRS.items() if only is None or key in only for s in pair}
    return [s for s in SIDES if s in wanted]


def measure_fsdp(
    size: str | dict[str, int] = "quick", only: Sequence[str] | None = None, world: int = 4
) -> dict[str, Any]:
    """Every side's step times (seconds, per round), bytes and peak; `size` a name of SIZES or such a dict."""
    size = dict(SIZES[size]) if isinstance(size, str) else size
    names = _sides(only)
    results = launch.run_gloo(_rank, world, size, names, timeout=3600)[0]
    params = sum(p.numel() for p in _model(size).parameters())
    return {"size": size, "world": world, "params": params, "only": only, "sides": results}


def table(measured: dict[str, Any]) -> str:
    s, sides = measured["size"], measured["sides"]
    head = (
        f"LLaMA-style dim {s['dim']} x {s['layers']} layers, seq {s['seq']}, batch {s['batch']}/rank, "
        f"{measured['params'] / 1e6:.1f}M parameters, {measured['world']} gloo processes; the sides' steps "
        f"interleaved, {s['steps']} each after a warm-up. Step time of the slowest rank; bytes one step sends per "
        "rank; peak tracked tensor memory per rank.\n\n"
        "| side | median ms | min ms | median CPU ms | bytes/step/rank | peak tracked MiB/rank |\n"
        "|---|---:|---:|---:|---:|---:|\n"
    )
    rows = [
        f"| {name} | {1000 * statistics.median(r['s']):.0f} | {1000 * min(r['s']):.0f} | "
        f"{1000 * statistics.median(r['cpu_s']):.0f} | {r['bytes']:,} | {r['peak'] / 2**20:.1f} |"
        for name, r in sides.items()
    ]
    ratios = []
    for ours, theirs in PAIRS.values():
        if ours in sides and theirs in sides:
            a, b = sides[ours], sides[theirs]
            per_round = [x / y for x, y in zip(a["s"], b["s"])]
            ratios.append(
                f"| {ours} / {theirs} | {statistics.median(a['s']) / statistics.median(b['s']):.2f}x | "
                f"{min(a['s']) / min(b['s']):.2f}x | {statistics.median(per_round):.2f}x "
                f"({', '.join(f'{r:.2f}' for r in per_round)}) | "
                f"{statistics.median(a['cpu_s']) / statistics.median(b['cpu_s']):.2f}x | {a['peak'] / b['peak']:.2f}x |"
            )
    ratio_head = (
        "\n\n| pair | median time | min time | median of per-round ratios (each round) | median CPU time | "
        "peak memory |\n|---|---:|---:|---:|---:|---:|\n"
    )
    return head + "\n".join(rows) + ratio_head + "\n".join(ratios)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"small sizes: {SIZES['quick']}")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: figures meaningless")
    for key in SIZES["full"]:
        parser.add_argument(f"--{key}", type=int, default=None)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--only", nargs="+", choices=list(PAIRS), help="these pairs of sides (default: all)")
    args = parser.parse_args(argv)
    size = dict(SIZES["tiny" if args.tiny else "quick" if args.quick else "full"])
    size.update({k: getattr(args, k) for k in size if getattr(args, k) is not None})
    print(table(measure_fsdp(size, args.only, args.world)))


if __name__ == "__main__":
    main()
