"""Random ops: a sharded draw beside torch's own kernel on the same shard size.

    python -m benchmarks.random_ops            # 4M-element f32 shards, 4 ranks
    python -m benchmarks.random_ops --quick    # fewer repetitions

Each rank of a 4-rank threads world holds a 4M-element f32 shard (Shard(0) of a
[4 * 2048, 2048] tensor). The ranks take turns (a barrier between turns), so the
timed rank has the CPU to itself, as it would on its own device. Rows: shardops'
`F.dropout` on the DTensor (empty_like, the counter-based bernoulli_, div_, mul)
and its bare `bernoulli_`, beside torch's `bernoulli_` and `F.dropout` on a plain
tensor of the shard's size. Target: the DTensor dropout within 3x of torch's
bernoulli_ on the shard (it does strictly more work: the scale and the multiply).
Medians of rank 0's timings; timings are reported, never asserted in tests.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

TARGET_RATIO = 3.0  # DTensor dropout / torch bernoulli_ on the same shard size
WORLD = 4


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm: decision cache, allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_random(rows_per_rank: int = 2048, cols: int = 2048, repeats: int = 7) -> dict[str, Any]:
    import shardops as so
    from shardops import Shard

    def body():
        mesh = so.init_device_mesh("cpu", (WORLD,))
        group = mesh.group(0)
        x = so.DTensor.from_local(torch.ones(rows_per_rank, cols), mesh, [Shard(0)])
        plain = torch.ones(rows_per_rank, cols)
        cases = {
            "shardops F.dropout(p=0.1), DTensor S(0)": lambda: F.dropout(x, 0.1),
            "shardops bernoulli_(0.9), DTensor S(0)": lambda: x.bernoulli_(0.9),
            "torch bernoulli_(0.9), plain shard": lambda: plain.bernoulli_(0.9),
            "torch F.dropout(p=0.1), plain shard": lambda: F.dropout(plain, 0.1),
        }
        torch.manual_seed(0)
        x.bernoulli_(0.9)  # together: a rank's first DTensor draw takes rank 0's state (a collective)
        out = {}
        for name, fn in cases.items():
            for turn in range(WORLD):  # one rank at a time: every rank issues the same draws
                mesh.comm.barrier(group)
                if turn == mesh.get_rank():
                    seconds = _median_seconds(fn, repeats)
            out[name] = seconds
        return out

    from shardops.dispatch import core

    debug = core._state["debug"]
    so.set_debug(False)  # its per-op cross-rank checks need every rank in step; the ranks take turns here
    try:
        per_rank = so.run(body, WORLD, timeout=600)
    finally:
        so.set_debug(debug)
    ms = {name: 1e3 * s for name, s in per_rank[0].items()}
    base = ms["torch bernoulli_(0.9), plain shard"]
    rows = [{"case": name, "ms": t, "ratio": t / base} for name, t in ms.items()]
    dropout = rows[0]["ratio"]
    return {
        "numel_per_shard": rows_per_rank * cols,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "dropout_ratio": dropout,
        "met": dropout <= TARGET_RATIO,
    }


def format_random_table(r: dict[str, Any]) -> str:
    lines = ["| case | ms (rank 0, median) | ÷ torch bernoulli_ |", "|---|---|---|"]
    lines += [f"| {row['case']} | {row['ms']:.2f} | {row['ratio']:.2f}× |" for row in r["rows"]]
    verdict = "met" if r["met"] else "**MISSED**"
    lines.append(
        f"\nTarget: DTensor dropout ≤ {TARGET_RATIO:g}× torch's bernoulli_ on a {r['numel_per_shard']:,}-element "
        f"shard: {r['dropout_ratio']:.2f}× ({verdict}; {r['threads']} torch threads)."
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    r = measure_random(repeats=3) if args.quick else measure_random()
    print(format_random_table(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
