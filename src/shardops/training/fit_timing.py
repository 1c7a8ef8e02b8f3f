"""Fitting the "gloo-localhost" link and compute presets of the step-time model (autoparallel/timing.py)
by measuring them: 4 gloo processes on 127.0.0.1. A tool (it launches processes through the training
launcher), so it lives on the tools side; the library only reads the presets it installs.

    shardops autoplan --fit [FILE]      # or fit_timing.fit(save=FILE)
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn

from ..autoparallel.timing import Compute, DTensorCalls, KernelCounter, PartProfile, install, predict, profile_dry
from ..cost import Link
from ..mesh import init_device_mesh
from ..placements import Replicate
from ..tensor import DTensor

__all__ = ["calibration_model", "fit"]


def _repeat(fn: Callable[[], object], times: int) -> None:
    for _ in range(times):
        fn()


def _burst(fn: Callable[[], object], times: int, barrier: Callable[[], object]) -> None:
    _repeat(fn, times)
    barrier()


def _timed(fn: Callable[[], object], reps: int, before: Callable[[], object] | None = None) -> float:
    """Median seconds of `fn` over `reps` calls (a shared machine: the median resists the others' bursts);
    `before` runs untimed before each (a barrier: every rank starts together)."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


ALL_REDUCE_SIZES = (4, 16 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)  # bytes


def _fit_rank(reps: int) -> dict:
    """On every gloo rank at once: all_reduce times per size, and the compute constants under the same load."""
    from ..world import current_comm

    comm = current_comm()
    group = comm.world_group()
    out: dict = {"all_reduce": {}}
    for size in ALL_REDUCE_SIZES:
        t = torch.ones(size // 4)
        comm.barrier(group)
        out["all_reduce"][size] = _timed(partial(comm.all_reduce, t, "sum", group), reps)
    # compute: bursts of a few milliseconds at full speed, started together on every rank after a barrier and
    # ended by a barrier, as a step's compute runs between its collectives; the burst's cost is that time less
    # an empty barrier-to-barrier's. So it takes in what a step pays: the job's own ranks sharing the cores (4
    # ranks on 2 cores), and the scheduler running a rank woken from a collective at once, where a long
    # CPU-bound block gets only a loaded machine's fair share (long blocks over-predicted small models' compute
    # 6-13x). Per call, median burst.
    a = torch.randn(256, 256)
    big = torch.randn(1 << 18)
    tiny = torch.ones(1)
    mesh = init_device_mesh("cpu", (comm.world_size,))
    dt = DTensor.from_local(torch.ones(1), mesh, [Replicate()])
    dt + dt  # planned once: the cached decision is what a training step pays
    out["dtensor_calls"] = _dtensor_calls(lambda: dt + dt)  # as the step profile counts them
    image, kernel = torch.randn(8, 16, 32, 32), torch.randn(32, 16, 3, 3)
    blocks: dict[str, tuple[Callable[[], object], int]] = {
        "matmul_s": (lambda: a @ a, 6),
        "conv_s": (lambda: torch.nn.functional.conv2d(image, kernel, padding=1), 3),
        "add_s": (lambda: big + big, 12),
        "kernel_s": (lambda: tiny + tiny, 300),
        "dtensor_s": (lambda: dt + dt, 30),
    }
    barrier = partial(comm.barrier, group)
    empty = _timed(barrier, max(reps, 5), before=barrier)  # barrier to barrier, nothing between
    for key, (fn, loop) in blocks.items():
        burst = _timed(partial(_burst, fn, loop, barrier), max(reps, 5), before=barrier)
        out[key] = max(burst - empty, 1e-9) / loop
    return out


def _dtensor_calls(fn: Callable[[], object]) -> int:
    """DTensor calls of `fn` as the step profile counts them (timing.DTensorCalls and KernelCounter)."""
    part = PartProfile()
    counter = KernelCounter()
    counter.part = part
    with DTensorCalls(part), counter:
        fn()
    return part.dtensor_ops


def fit(
    world_size: int = 4, reps: int = 30, save: str | os.PathLike | None = None, calibrate: bool = True
) -> tuple[Link, Compute]:
    """Measure the gloo link (alpha, beta of the ring model's all_reduce, least squares over sizes) and
    the compute constants on `world_size` gloo processes on 127.0.0.1 (one torch thread each, every
    rank busy at once), install them as the "gloo-localhost" presets, and return them. `calibrate`:
    the DTensor dispatch overhead from a measured training step of a calibration model instead (see
    `_calibrated`: a DTensor op in a step costs more than a cached one in a loop).
    `save`: also write them as JSON (read at import when SHARDOPS_TIMING_PRESET names the file)."""
    from .launch import run_gloo

    results = run_gloo(_fit_rank, world_size, reps, timeout=600)
    n = world_size
    # the busiest rank of each figure, as the step time is the slowest rank's
    sizes = list(ALL_REDUCE_SIZES)
    times = [max(r["all_reduce"][s] for r in results) for s in sizes]
    # t = 2(n-1) alpha + 2(n-1)/n bytes / beta: least squares in (alpha, 1/beta)
    xs = [(2.0 * (n - 1), 2 * (n - 1) / n * s) for s in sizes]
    alpha, inv_beta = _least_squares(xs, times)
    link = Link(max(alpha, 1e-7), 1.0 / max(inv_beta, 1e-12), 0.0)
    matmul, conv, add, kernel, dtensor = (
        max(r[k] for r in results) for k in ("matmul_s", "conv_s", "add_s", "kernel_s", "dtensor_s")
    )
    compute = Compute(
        flop_rate=2 * 256**3 / matmul,
        bandwidth=3 * (1 << 18) * 4 / max(add - kernel, 1e-9),
        kernel_overhead=kernel,
        dispatch_overhead=max(dtensor - kernel, 0.0) / max(results[0]["dtensor_calls"], 1),
        conv_rate=2 * 8 * 32 * 16 * 9 * 32 * 32 / conv,
    )
    link = Link(link.latency, link.bandwidth, compute.bandwidth)
    if calibrate:
        compute = _calibrated(compute, link, world_size, reps)
    install(link, compute)
    if save is not None:
        Path(save).write_text(json.dumps({"link": [link.latency, link.bandwidth], "compute": compute.__dict__}))
    return link, compute


def calibration_model() -> tuple[nn.Module, torch.Tensor]:
    """A model none of the validation benchmarks uses: Linear-GELU-Linear, LayerNorm, Linear-GELU-Linear."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(128, 512),
        nn.GELU(),
        nn.Linear(512, 128),
        nn.LayerNorm(128),
        nn.Linear(128, 512),
        nn.GELU(),
        nn.Linear(512, 128),
    )
    return net, torch.randn(32, 128, generator=torch.Generator().manual_seed(1))


def _square_mean(out, *_):
    return (out**2).mean()


def _calibration_candidates():
    from ..autoparallel.candidates import Candidate

    return [Candidate(("dp",)), Candidate(("tp",), pairs_tp=(True, True))]


def _apply_fn(model: nn.Module, example: tuple, cand) -> Callable:
    from ..autoparallel.candidates import plan_entries
    from ..autoparallel.plan import apply_candidate
    from ..autoparallel.structure import find_structure

    structure = find_structure(model, example)
    entries = plan_entries(structure, cand)
    return lambda m, mesh: apply_candidate(m, mesh, cand, entries, structure.blocks)


def _calibration_rank(steps: int) -> list[float]:
    """On one gloo rank: each calibration candidate trained `steps` steps, in alternation; median seconds."""
    from ..autoparallel.plan import batch_feed, mesh_names_for
    from ..world import current_comm

    net, x = calibration_model()
    runs = []
    for cand in _calibration_candidates():
        shape = (current_comm().world_size,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=mesh_names_for(cand))
        m = _apply_fn(net, (x,), cand)(copy.deepcopy(net), mesh)
        (local,) = batch_feed(shape, cand)(mesh, (x,))  # this rank's batch slice
        runs.append((m, local, torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False)))
    comm = current_comm()
    times: list[list[float]] = [[] for _ in runs]
    for step in range(steps + 2):
        for i, (m, local, opt) in enumerate(runs):
            comm.barrier(comm.world_group())
            t0 = time.perf_counter()
            _square_mean(m(local)).backward()
            opt.step()
            opt.zero_grad()
            if step >= 2:
                times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _calibrated(compute: Compute, link: Link, world_size: int, reps: int) -> Compute:
    """The dispatch overhead that makes the calibration model's predicted steps its measured ones (least
    squares over its candidates), every other figure as measured; the microbenchmark's where it is larger."""
    from dataclasses import replace

    from ..autoparallel.measure import on_meta
    from ..autoparallel.plan import batch_feed, mesh_names_for
    from .launch import run_gloo

    net, x = calibration_model()
    meta, example = on_meta(net, (x,))
    profiles = [
        profile_dry(
            meta,
            (world_size,),
            mesh_names_for(c),
            _apply_fn(meta, example, c),
            batch_feed((world_size,), c),
            example,
            _square_mean,
        )
        for c in _calibration_candidates()
    ]
    measured = [max(ts) for ts in zip(*run_gloo(_calibration_rank, world_size, max(reps // 2, 5), timeout=600))]
    base = replace(compute, dispatch_overhead=0.0)
    residual = [m - predict(p, (link,), base).total for m, p in zip(measured, profiles)]
    ops = [sum(part.dtensor_ops for part in p.parts.values()) for p in profiles]
    fitted = sum(r * d for r, d in zip(residual, ops)) / sum(d * d for d in ops)
    return replace(compute, dispatch_overhead=max(fitted, compute.dispatch_overhead))


def _least_squares(xs: list[tuple[float, float]], ys: list[float]) -> tuple[float, float]:
    """(a, b) minimizing sum (a x0 + b x1 - y)^2 / y^2 (relative error: small and large sizes alike)."""
    w = [1 / (y * y) for y in ys]
    s00 = sum(wi * x0 * x0 for wi, (x0, _) in zip(w, xs))
    s01 = sum(wi * x0 * x1 for wi, (x0, x1) in zip(w, xs))
    s11 = sum(wi * x1 * x1 for wi, (_, x1) in zip(w, xs))
    r0 = sum(wi * x0 * y for wi, (x0, _), y in zip(w, xs, ys))
    r1 = sum(wi * x1 * y for wi, (_, x1), y in zip(w, xs, ys))
    det = s00 * s11 - s01 * s01
    return (r0 * s11 - r1 * s01) / det, (s00 * r1 - s01 * r0) / det
