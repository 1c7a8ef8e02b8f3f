"""What each rank thread's own random state costs per op, inside so.run.

    python -m benchmarks.rank_random [--iters 2000] [--repeats 7]

Inside `so.run` a dispatch mode on each rank thread's mode stack hands the rank's
generator to random ops (shardops/interop/rank_random.py); every aten op of a rank
thread passes through it. Timed here, in a one-rank threads world, with the mode
("on") and without it ("off": the shared generator of before), interleaved in the
same rounds: plain-tensor ops (add, a random op, F.dropout) and DTensor ops on a
cache hit (add, softmax over a sharded dim, F.dropout). Medians of per-call µs of
the rank thread's CPU time (a shared machine's load does not count).
Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import shardops as so
from shardops import Shard


def _cases() -> dict[str, Callable[[], Any]]:
    mesh = so.init_device_mesh("cpu", (1,))
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    x = so.distribute_tensor(torch.randn(8, 8), mesh, [Shard(1)])
    y = so.distribute_tensor(torch.randn(8, 8), mesh, [Shard(1)])
    return {
        "plain add": lambda: a + b,
        "plain rand": lambda: torch.rand(8, 8),
        "plain F.dropout": lambda: F.dropout(a, 0.1),
        "DTensor add": lambda: x + y,
        "DTensor softmax(dim=1)": lambda: torch.softmax(x, 1),
        "DTensor F.dropout": lambda: F.dropout(x, 0.1),
    }


def _per_call_us(call: Callable[[], Any], iters: int) -> float:
    gc.disable()
    try:
        start = time.thread_time()  # this thread's CPU time: other processes' load does not count
        for _ in range(iters):
            call()
        return 1e6 * (time.thread_time() - start) / iters
    finally:
        gc.enable()


def _measure(iters: int, repeats: int) -> dict[str, dict[str, float]]:
    cases = _cases()
    times: dict[str, dict[str, list[float]]] = {name: {"on": [], "off": []} for name in cases}
    mode = torch._C._pop_torch_dispatch_stack(None)  # this rank's mode, put back for the "on" turns
    try:
        for round_ in range(repeats):
            for setting in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
                with _mode(mode) if setting == "on" else contextlib.nullcontext():
                    for name, call in cases.items():
                        call()  # warm: the decision caches
                        times[name][setting].append(_per_call_us(call, iters))
    finally:
        torch._C._push_on_torch_dispatch_stack(mode)
    return {name: {s: statistics.median(v) for s, v in by.items()} for name, by in times.items()}


@contextlib.contextmanager
def _mode(mode: Any):
    torch._C._push_on_torch_dispatch_stack(mode)
    try:
        yield
    finally:
        torch._C._pop_torch_dispatch_stack(None)


def measure_rank_random(iters: int = 2000, repeats: int = 7) -> dict[str, dict[str, float]]:
    return so.run(_measure, 1, iters, repeats, timeout=3600)[0]


def format_table(result: dict[str, dict[str, float]]) -> str:
    lines = ["| op (f32[8, 8]) | µs/call, rank state on | µs/call, off | extra µs |", "|---|---|---|---|"]
    for name, t in result.items():
        lines.append(f"| {name} | {t['on']:.1f} | {t['off']:.1f} | {t['on'] - t['off']:+.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(format_table(measure_rank_random(args.iters, args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
