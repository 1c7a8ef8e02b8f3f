"""Data parallelism: shardops' fully_shard / replicate beside torch's fully_shard / DDP, as gloo processes.

    python -m benchmarks.fsdp [--dim 512] [--layers 8] [--seq 256] [--batch 4] [--steps 3] [--world 4] [--only fsdp|ddp]

The LLaMA-style model of `shardops.models` (float32, AdamW), pure data parallelism over
`--world` gloo processes, every side in the same run: torch `fully_shard` (FSDP2, a unit per
block and the root) against shardops `fully_shard` (the same units; and with torchtitan's
explicit prefetch chains: each block's gather starts while the previous one computes, both
ways), torch DDP against shardops `replicate` (25 MB buckets). Per side: the median step time
of the slowest rank (forward, backward, optimizer step; after one warm-up step), and the peak
of tensor storage one forward + backward allocates per rank beyond the resident parameters and
optimizer state (the CPU profiler's allocator events; the least of three steps, since a
collective's buffer freed on gloo's thread reads as held to the end), the largest rank's.
"""

from __future__ import annotations

import argparse
import statistics
import time
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


def _model(args: argparse.Namespace):
    from shardops.models import Llama, ModelArgs

    return Llama(
        ModelArgs(
            dim=args.dim,
            n_layers=args.layers,
            n_heads=max(1, args.dim // 64),
            vocab_size=args.vocab,
            hidden_dim=4 * args.dim,
            max_seq_len=args.seq,
        )
    )


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


def _side(side: str, args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from torch.autograd.profiler import profile

    torch.manual_seed(0)
    model = _wrap(side, _model(args))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)

    def step(profiled: bool = False) -> int:
        opt.zero_grad(set_to_none=True)
        with profile(profile_memory=True, enabled=profiled) as prof:
            logits = model(tokens)
            F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        opt.step()
        return _peak_tracked_bytes(prof) if profiled else 0

    step()  # warm-up: optimizer state, process groups
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    peak = min(step(profiled=True) for _ in range(3))
    peaks = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor([peak]))
    return {"ms": 1000 * statistics.median(times), "peak": max(int(p) for p in peaks)}


PAIRS = {
    "fsdp": ("shardops fully_shard", "torch fully_shard"),
    "fsdp+prefetch": ("shardops fully_shard + prefetch", "torch fully_shard"),
    "ddp": ("shardops replicate", "torch DDP"),
}


def _sides(args: argparse.Namespace) -> list[str]:
    wanted = (
        set(SIDES)
        if args.only is None
        else {s for key, pair in PAIRS.items() if key.startswith(args.only) for s in pair}
    )
    return [s for s in SIDES if s in wanted]


def _rank(args: argparse.Namespace) -> dict:
    return {side: _side(side, args) for side in _sides(args)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="per rank")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--only", choices=["fsdp", "ddp"], help="fully_shard's sides or DDP's (default: all)")
    args = parser.parse_args(argv)
    results = launch.run_gloo(_rank, args.world, args, timeout=3600)[0]
    params = sum(p.numel() for p in _model(args).parameters())
    print(
        f"LLaMA-style dim {args.dim} x {args.layers} layers, seq {args.seq}, batch {args.batch}/rank, "
        f"{params / 1e6:.1f}M parameters, {args.world} gloo processes"
    )
    print("| side | ms/step | peak tracked MiB/rank |\n|---|---|---|")
    for side in _sides(args):
        r = results[side]
        print(f"| {side} | {r['ms']:.0f} | {r['peak'] / 2**20:.1f} |")
    for key, (ours, theirs) in PAIRS.items():
        if args.only is not None and not key.startswith(args.only):
            continue
        print(
            f"{ours} / {theirs}: time {results[ours]['ms'] / results[theirs]['ms']:.2f}x, peak memory "
            f"{results[ours]['peak'] / results[theirs]['peak']:.2f}x"
        )


if __name__ == "__main__":
    main()
