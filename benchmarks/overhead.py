"""Per-op dispatch overhead on a cache hit: shardops vs torch DTensor vs the wrapper floor.

    python -m benchmarks.overhead [--iters 2000] [--repeats 7] [--ops add softmax_sharded ...]

Both systems run as rank 0 of 4 on torch's `fake` process group (collectives
complete without moving data), on tiny f32[8, 8] tensors, so what is timed is
the Python/dispatch cost per op, not the kernels:

- shardops: `init_process_group("fake", ...)` then `so.init_device_mesh("cpu",
  (4,))`, which runs shardops' collectives through torch.distributed
  (`shardops/comm/torch_dist.py`). Should that fail, the figures come from a
  one-rank threads world instead, and the table says so.
- DTensor: `torch.distributed.tensor` on the same process group.
- floor: `PassthroughTensor`, a do-nothing `__torch_dispatch__` wrapper (the
  least any Python tensor subclass pays); plain: eager torch on plain tensors.

Operands are Shard(0) (softmax_sharded: Shard(1), reduced over the sharded
dim, so a system must communicate or run a sharded algorithm). Every system is
timed in the same rounds, interleaved (a round times each (op, system) pair
once, rotating which system goes first), because the machine is shared: a
burst of load then hits every column alike. Each pair's figure is the median
over rounds of the median over batches of `BATCH` calls; garbage collection is
off inside a batch, as in `timeit`. Fallback warnings are silenced while
timing (their op names are recorded once instead).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import shardops as so
from benchmarks.dtensor_side import (
    DEFAULT_OVERHEAD_OPS,
    WORLD_SIZE,
    CollectiveCounter,
    PassthroughTensor,
    _op_table,
    _tiny_inputs,
)
from benchmarks.shardops_side import fallback_ops

BATCH = 20  # calls per timed batch: amortises perf_counter, short enough to dodge stalls
SYSTEMS = ("shardops", "DTensor", "floor", "plain")
# Targets: shardops / DTensor per op (no worse where no communication is needed; far less where DTensor redistributes).
TARGET_NO_COMM = 1.0
TARGET_DTENSOR_REDISTRIBUTES = 0.3
TARGET_FLOOR_NO_COMM = 1.3  # shardops / the do-nothing wrapper, where no communication is needed


# --- the operands of each system ------------------------------------------------------


def _dtensor_table() -> dict[str, Callable[[], Any]]:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    a, b = _tiny_inputs()
    # src_data_rank=None: each rank slices its own copy; the fake group would
    # otherwise "scatter" uninitialised memory (denormals and NaNs slow kernels).
    x = distribute_tensor(a, mesh, [Shard(0)], src_data_rank=None)
    y = distribute_tensor(b, mesh, [Shard(0)], src_data_rank=None)
    xs = distribute_tensor(a, mesh, [Shard(1)], src_data_rank=None)
    return _op_table(x, y, xs)


def _shardops_table(mesh_shape: tuple[int, ...]) -> dict[str, Callable[[], Any]]:
    mesh = so.init_device_mesh("cpu", mesh_shape)
    a, b = _tiny_inputs()
    x = so.distribute_tensor(a, mesh, [so.Shard(0)], src_data_rank=None)
    y = so.distribute_tensor(b, mesh, [so.Shard(0)], src_data_rank=None)
    xs = so.distribute_tensor(a, mesh, [so.Shard(1)], src_data_rank=None)
    return _op_table(x, y, xs)


def _plain_tables() -> dict[str, dict[str, Callable[[], Any]]]:
    a, b = _tiny_inputs()
    pa, pb = PassthroughTensor(a), PassthroughTensor(b)
    return {"floor": _op_table(pa, pb, pa), "plain": _op_table(a, b, a)}


# --- what one call communicates -------------------------------------------------------


def _shardops_comm(call: Callable[[], Any]) -> tuple[dict[str, int], list[str], str | None]:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with so.CommDebugMode() as comm:
                call()
    except Exception as e:  # noqa: BLE001 - shown in the table
        return {}, [], f"{type(e).__name__}: {e}"[:200]
    return comm.get_comm_counts(), fallback_ops(caught), None


def _dtensor_comm(call: Callable[[], Any]) -> tuple[dict[str, int], str | None]:
    counter = CollectiveCounter()
    try:
        with counter:
            call()
    except Exception as e:  # noqa: BLE001
        return {}, f"{type(e).__name__}: {e}"[:200]
    return counter.counts, None


# --- timing -----------------------------------------------------------------------------


def _time_batch(call: Callable[[], Any]) -> float:
    """Microseconds per call over one batch."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(BATCH):
            call()
        return (time.perf_counter() - start) / BATCH * 1e6
    finally:
        if gc_was_enabled:
            gc.enable()


def time_interleaved(
    tables: dict[str, dict[str, Callable[[], Any]]], ops: Sequence[str], iters: int, repeats: int
) -> dict[str, dict[str, float]]:
    """µs per call for every (system, op): median over `repeats` rounds of the
    median batch of `iters // BATCH` batches. Systems are interleaved within a round."""
    batches = max(1, iters // BATCH)
    systems = list(tables)
    for name in systems:  # warm caches (sharding propagation, allocator) before any timing
        for op in ops:
            for _ in range(max(10, iters // 20)):
                tables[name][op]()
    per_round: dict[str, dict[str, list[float]]] = {s: {op: [] for op in ops} for s in systems}
    for r in range(repeats):
        order = systems[r % len(systems) :] + systems[: r % len(systems)]
        for op in ops:
            for name in order:
                call = tables[name][op]
                per_round[name][op].append(statistics.median(_time_batch(call) for _ in range(batches)))
    return {s: {op: statistics.median(v) for op, v in per_round[s].items()} for s in systems}


# --- the measurement -------------------------------------------------------------------


def _measure_in_this_world(
    shardops_mesh: tuple[int, ...], ops: Sequence[str], iters: int, repeats: int
) -> dict[str, Any]:
    tables = {"shardops": _shardops_table(shardops_mesh), "DTensor": _dtensor_table(), **_plain_tables()}
    comm: dict[str, dict[str, Any]] = {"shardops": {}, "DTensor": {}}
    fallbacks: dict[str, list[str]] = {}
    errors: dict[str, str] = {}
    for op in ops:
        counts, fb, err = _shardops_comm(tables["shardops"][op])
        comm["shardops"][op], fallbacks[op] = counts, fb
        if err:
            errors[f"shardops {op}"] = err
        counts, err = _dtensor_comm(tables["DTensor"][op])
        comm["DTensor"][op] = counts
        if err:
            errors[f"DTensor {op}"] = err
    # A system that raises on an op is not timed on it.
    timed = {s: {op: c for op, c in t.items() if op in ops and f"{s} {op}" not in errors} for s, t in tables.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", so.FallbackWarning)
        us = _time_ragged(timed, ops, iters, repeats)
    return {"us": us, "comm": comm, "fallbacks": fallbacks, "errors": errors}


def _time_ragged(tables, ops, iters, repeats) -> dict[str, dict[str, float | None]]:
    """`time_interleaved` for tables that may lack some ops (None for those)."""
    out: dict[str, dict[str, float | None]] = {s: {op: None for op in ops} for s in tables}
    for op in ops:
        have = {s: {op: t[op]} for s, t in tables.items() if op in t}
        for s, v in time_interleaved(have, [op], iters, repeats).items():
            out[s][op] = v[op]
    return out


def measure_overhead(ops: Sequence[str] = DEFAULT_OVERHEAD_OPS, iters: int = 2000, repeats: int = 7) -> dict[str, Any]:
    """µs per op of every system, plus what one call of each op communicates.

    Returns {"ops", "us": {system: {op: µs or None}}, "comm": {"shardops"|"DTensor":
    {op: counts}}, "fallbacks": {op: [aten ops shardops replicated]}, "errors",
    "world": how shardops ran, "note": why it did not run on the fake group (or None),
    "iters", "repeats", "batch"}.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    unknown = [o for o in ops if o not in DEFAULT_OVERHEAD_OPS]
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}; known: {list(DEFAULT_OVERHEAD_OPS)}")
    if dist.is_initialized():
        raise RuntimeError("a torch process group is already initialised; destroy it first")
    dist.init_process_group("fake", rank=0, world_size=WORLD_SIZE, store=FakeStore())
    note = None
    world = f"shardops and DTensor: rank 0 of {WORLD_SIZE}, torch `fake` process group"
    try:
        try:
            result = _measure_in_this_world((WORLD_SIZE,), ops, iters, repeats)
        except Exception as e:  # noqa: BLE001 - fall back to a one-rank threads world, and say so
            note = (
                f"shardops on the fake process group failed ({type(e).__name__}: {e}); "
                "shardops measured in a 1-rank threads world"
            )
            world = f"shardops: 1-rank threads world (fallback); DTensor: rank 0 of {WORLD_SIZE}, fake process group"
            result = so.run(_measure_in_this_world, 1, (1,), ops, iters, repeats, timeout=3600)[0]
    finally:
        dist.destroy_process_group()
    return {
        **result,
        "ops": list(ops),
        "world": world,
        "note": note,
        "iters": iters,
        "repeats": repeats,
        "batch": BATCH,
    }


# --- report -------------------------------------------------------------------------------


def _fmt_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}×{v}" for k, v in sorted(counts.items())) or "none"


def overhead_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per op: figures, ratio shardops/DTensor, the target that applies and whether it is met."""
    rows = []
    for op in result["ops"]:
        us = {s: result["us"].get(s, {}).get(op) for s in SYSTEMS}
        dt_comm = result["comm"]["DTensor"].get(op, {})
        redistributes = bool(dt_comm)
        target = TARGET_DTENSOR_REDISTRIBUTES if redistributes else TARGET_NO_COMM
        ratio = us["shardops"] / us["DTensor"] if us["shardops"] and us["DTensor"] else None
        floor_ratio = us["shardops"] / us["floor"] if us["shardops"] and us["floor"] else None
        rows.append(
            {
                "op": op,
                "us": us,
                "ratio": ratio,
                "floor_ratio": floor_ratio,
                "floor_met": None if floor_ratio is None or redistributes else floor_ratio <= TARGET_FLOOR_NO_COMM,
                "dtensor_comm": dt_comm,
                "shardops_comm": result["comm"]["shardops"].get(op, {}),
                "shardops_fallbacks": result["fallbacks"].get(op, []),
                "target": target,
                "target_kind": "DTensor redistributes" if redistributes else "no communication",
                "met": None if ratio is None else ratio <= target,
            }
        )
    return rows


def _us(v: float | None) -> str:
    return "error" if v is None else f"{v:.1f}"


def format_overhead_table(result: dict[str, Any]) -> str:
    lines = [
        "| op | shardops (µs) | DTensor (µs) | ratio | target | floor (µs) | ÷ floor | plain torch (µs) | shardops "
        "comm | DTensor comm |",
        "|---|---:|---:|---:|---|---:|---:|---:|---|---|",
    ]
    for r in overhead_rows(result):
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}×"
        met = "n/a" if r["met"] is None else ("met" if r["met"] else "**MISSED**")
        to_floor = "—" if r["floor_ratio"] is None else f"{r['floor_ratio']:.2f}×"
        if r["floor_met"] is not None:
            to_floor += f" (≤ {TARGET_FLOOR_NO_COMM:g}×: {'met' if r['floor_met'] else '**MISSED**'})"
        so_comm = _fmt_counts(r["shardops_comm"])
        if r["shardops_fallbacks"]:
            so_comm += " (fallback: " + ", ".join(r["shardops_fallbacks"]) + ")"
        lines.append(
            f"| {r['op']} | {_us(r['us']['shardops'])} | {_us(r['us']['DTensor'])} | {ratio} | ≤ {r['target']:g}× "
            f"({r['target_kind']}): {met} | {_us(r['us']['floor'])} | {to_floor} | {_us(r['us']['plain'])} | {so_comm} "
            f"| {_fmt_counts(r['dtensor_comm'])} |"
        )
    text = "\n".join(lines)
    if result.get("note"):
        text += f"\n\nNote: {result['note']}"
    for where, err in result.get("errors", {}).items():
        text += f"\n\n{where} raised: {err}"
    return text


def overhead_caption(result: dict[str, Any]) -> str:
    return (
        f"{result['world']}; f32[8, 8], warm caches; median of {result['repeats']} interleaved rounds, "
        f"each the median batch of {result['batch']} calls ({result['iters']} calls per round)."
    )


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=2000, help="calls per (op, system) per round")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds")
    parser.add_argument(
        "--ops", nargs="*", default=list(DEFAULT_OVERHEAD_OPS), help=f"ops (default: {' '.join(DEFAULT_OVERHEAD_OPS)})"
    )
    args = parser.parse_args(argv)
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only add noise (and stall on a busy machine)
    try:
        result = measure_overhead(args.ops, args.iters, args.repeats)
    finally:
        torch.set_num_threads(threads)
    print(f"## Dispatch overhead per op ({overhead_caption(result)})\n")
    print(format_overhead_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
