"""Checkpoint throughput: shardops.checkpoint beside torch.distributed.checkpoint, as gloo processes.

    python -m benchmarks.checkpoint [--mib 256] [--tensors 8] [--repeats 3] [--world 4]

The same state on both sides: `--tensors` float32 tensors of `--mib` MiB in all, sharded
Shard(0) over a (world,) mesh (torch DTensors for torch's side, shardops DTensors for
shardops'), each rank holding its shard only. Measured per rank, in MB/s of the bytes that
rank holds (the slowest rank's time, after a barrier; median over repeats):

- save: `shardops.checkpoint.save` (atomic: staging directory + swap) vs `dcp.save`;
- load, same layout: `shardops.checkpoint.load` vs `dcp.load` (both read whole boxes);
- load, resharded onto (2, world/2) Shard(0), Shard(1): shardops reads only each rank's byte
  ranges; torch's FileSystemReader reads every saved box it touches whole, then narrows.

Both write torch's DCP format (`FileSystemWriter`), so the save figures differ by the
coordination and the atomic commit only. Files go to a temporary directory (page cache:
these are not disk figures).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from shardops.training import launch

MB = 1e6


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def rank_main(directory: str, mib: int, tensors: int, repeats: int) -> dict[str, Any]:
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Shard as TShard

    import shardops as so
    from shardops import Shard

    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # dcp.save over its last repeat
    world, rank = dist.get_world_size(), dist.get_rank()
    cols = 1024
    rows = max(world, (mib * (1 << 20)) // (4 * cols * tensors) // world * world)
    local_rows = rows // world
    gen = torch.Generator().manual_seed(rank)
    locals_ = [torch.randn(local_rows, cols, generator=gen) for _ in range(tensors)]
    so_mesh = so.init_device_mesh("cpu", (world,))
    t_mesh = init_device_mesh("cpu", (world,))
    so_state = {f"w{i}": so.DTensor.from_local(t, so_mesh, [Shard(0)]) for i, t in enumerate(locals_)}
    t_state = {
        f"w{i}": TorchDTensor.from_local(t.clone(), t_mesh, [TShard(0)], run_check=False) for i, t in enumerate(locals_)
    }
    my_bytes = sum(t.nbytes for t in locals_)

    grid = (2, world // 2)
    so_grid = so.init_device_mesh("cpu", grid)
    t_grid = init_device_mesh("cpu", grid)
    so_resharded = {
        k: so.DTensor.from_local(
            torch.empty(rows // 2, cols // grid[1]), so_grid, [Shard(0), Shard(1)], shape=(rows, cols)
        )
        for k in so_state
    }
    t_resharded = {
        k: TorchDTensor.from_local(
            torch.empty(rows // 2, cols // grid[1]), t_grid, [TShard(0), TShard(1)], run_check=False
        )
        for k in t_state
    }
    so_same = {k: so.DTensor.from_local(torch.empty(local_rows, cols), so_mesh, [Shard(0)]) for k in so_state}
    t_same = {
        k: TorchDTensor.from_local(torch.empty(local_rows, cols), t_mesh, [TShard(0)], run_check=False) for k in t_state
    }
    resharded_bytes = sum(t.to_local().nbytes for t in so_resharded.values())

    so_dir, t_dir = os.path.join(directory, "shardops"), os.path.join(directory, "torch")
    cases = {
        "save": (
            lambda: so.checkpoint.save(so_state, so_dir),
            lambda: dcp.save(t_state, checkpoint_id=t_dir),
            my_bytes,
        ),
        "load, same layout": (
            lambda: so.checkpoint.load(so_same, so_dir),
            lambda: dcp.load(t_same, checkpoint_id=t_dir),
            my_bytes,
        ),
        f"load, resharded onto {grid}": (
            lambda: so.checkpoint.load(so_resharded, so_dir),
            lambda: dcp.load(t_resharded, checkpoint_id=t_dir),
            resharded_bytes,
        ),
    }
    times: dict[str, dict[str, list[float]]] = {name: {"shardops": [], "torch": []} for name in cases}
    for r in range(repeats + 1):  # the first round warms up
        for name, (so_fn, t_fn, _) in cases.items():
            order = [("shardops", so_fn), ("torch", t_fn)] if r % 2 else [("torch", t_fn), ("shardops", so_fn)]
            for system, fn in order:
                seconds = _timed(fn)
                if r:
                    times[name][system].append(seconds)
    correct = all(torch.equal(so_same[k].to_local(), so_state[k].to_local()) for k in so_state)
    correct &= all(torch.equal(t_same[k].to_local(), t_state[k].to_local()) for k in t_state)
    return {
        "rows": [
            (
                name,
                nbytes / MB,
                nbytes / MB / statistics.median(times[name]["shardops"]),
                nbytes / MB / statistics.median(times[name]["torch"]),
            )
            for name, (_, _, nbytes) in cases.items()
        ],
        "total_mib": rows * cols * 4 * tensors / (1 << 20),
        "correct": correct,
    }


def report(result: dict[str, Any], world: int) -> str:
    lines = [
        f"Checkpoint throughput, {world} gloo processes, {result['total_mib']:.0f} MiB of float32 in all (MB/s per "
        "rank, higher is better)",
        "",
        "| case | MB per rank | shardops | torch DCP | shardops / torch |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, mb, ours, theirs in result["rows"]:
        lines.append(f"| {name} | {mb:.1f} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f} |")
    lines.append("")
    lines.append(f"loaded values equal the saved ones: {result['correct']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world", type=int, default=4)
    args = parser.parse_args(argv)
    directory = tempfile.mkdtemp(prefix="shardops-ckpt-bench-")
    try:
        result = launch.run_gloo(rank_main, args.world, directory, args.mib, args.tensors, args.repeats, timeout=1800)[
            0
        ]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(report(result, args.world))
    return 0 if result["correct"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
