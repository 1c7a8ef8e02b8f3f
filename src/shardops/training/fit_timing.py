"""Fitting the "gloo-localhost" link and compute presets of the step-time model (autoparallel/timing.py)
by measuring them: 4 gloo processes on 127.0.0.1. A tool (it launches processes through the training
launcher), so it lives on the tools side; the library only reads the presets it installs.

    shardops autoplan --fit [FILE]      # or fit_timing.fit(save=FILE)

One gloo run, one torch thread per process, takes round after round (so every figure is measured under
the same load: a shared machine's load moves them by 2x):

- an all_reduce of each size from 4 B to 4 MiB: the link's alpha and beta (least squares of the ring model);
- a burst of one kernel on every rank at once, barrier to barrier: the FLOP/s of matmuls and of
  convolutions and the bytes/s of streaming kernels, as a step's compute runs between its collectives
  (the job's own ranks sharing the cores are in the figures);
- one training step of each calibration workload (small models none of the validation benchmarks uses,
  data and tensor parallel): how much slower than in the bursts a step's kernels run (operands out of
  cache) and the costs per aten kernel, per DTensor call and per collective call, by non-negative least
  squares of their measured steps (the slowest rank's, median over rounds) against their dry-run
  profiles. A kernel inside a training step (module calls, autograd) costs more than one in a loop, and
  the wait at a collective (ranks sharing cores arrive skewed by about a scheduler slice) exists only in
  a step.

Workloads of the caller's (`fit_and_measure(workloads=...)`) are stepped in the same rounds, so a
benchmark measures them under the load the fit saw.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from ..autoparallel.timing import Compute, DTensorCalls, KernelCounter, PartProfile, StepProfile, install, predict
from ..cost import Link
from ..mesh import init_device_mesh
from ..placements import Replicate
from ..tensor import DTensor

__all__ = ["FitResult", "StepMeasure", "Workload", "calibration_workloads", "fit", "fit_and_measure"]

ALL_REDUCE_SIZES = (4, 16 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)  # bytes
WARMUP_ROUNDS = 2
STREAMED = 1 << 20  # elements of the streaming burst's operands


@dataclass(frozen=True)
class Workload:
    """A model trained under one candidate plan: `build()` gives (model, global example inputs, loss_fn);
    picklable (a module-level function or a partial of one), it is built again in each gloo process."""

    name: str
    build: Callable[[], tuple[nn.Module, tuple, Callable]]
    candidate: Any  # autoparallel.candidates.Candidate


@dataclass(frozen=True)
class StepMeasure:
    """A workload's measured step: the slowest rank's, median over rounds; per part (forward + loss,
    backward, optimizer step with gradient resolution) the slowest rank's, median over rounds."""

    total: float
    parts: tuple[float, float, float]


@dataclass(frozen=True)
class FitResult:
    link: Link
    compute: Compute
    measured: list[StepMeasure]  # the caller's workloads, in order


# ------------------------------------------------------------------------------------------ calibration


def _square_mean(out, *_):
    return (out**2).mean()


def _example(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _two_pairs(width: int, hidden: int, middle: str, batch: int) -> tuple[nn.Module, tuple, Callable]:
    """Linear-GELU-Linear, `middle` (a LayerNorm or a GELU), Linear-GELU-Linear: two tensor-parallel pairs."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(width, hidden),
        nn.GELU(),
        nn.Linear(hidden, width),
        nn.LayerNorm(width) if middle == "layernorm" else nn.GELU(),
        nn.Linear(width, hidden),
        nn.GELU(),
        nn.Linear(hidden, width),
    )
    return net, (_example(batch, width),), _square_mean


def _calibration_wide() -> tuple[nn.Module, tuple, Callable]:
    """One wide pair on a small batch: the gradient all_reduce and the optimizer's streaming dominate."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 1536), nn.ReLU(), nn.Linear(1536, 512))
    return net, (_example(8, 512),), _square_mean


def _calibration_deep() -> tuple[nn.Module, tuple, Callable]:
    """Ten narrow Linear-Tanh-LayerNorm layers: many small kernels, little work in each."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(10):
        layers += [nn.Linear(32, 32), nn.Tanh(), nn.LayerNorm(32)]
    return nn.Sequential(*layers), (_example(16, 32),), _square_mean


def _calibration_conv() -> tuple[nn.Module, tuple, Callable]:
    """Two 3x3 convolutions with a GroupNorm between: convolution FLOPs, a channel-parallel pair."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(4, 24, 3, padding=1),
        nn.GroupNorm(4, 24),
        nn.ReLU(),
        nn.Conv2d(24, 24, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(96, 8),
    )
    return net, (_example(16, 4, 24, 24),), _square_mean


def calibration_workloads() -> list[Workload]:
    """The fit's workloads: each feature of the profile (kernels, DTensor calls, collective calls, FLOPs,
    convolution FLOPs, streamed bytes) large in one of them, data parallel and tensor parallel."""
    from ..autoparallel.candidates import Candidate

    dp, two_pairs = Candidate(("dp",)), Candidate(("tp",), pairs_tp=(True, True))
    mlp = partial(_two_pairs, 128, 512, "layernorm", 32)  # matmuls and a norm, a medium batch
    heavy = partial(_two_pairs, 256, 1024, "gelu", 256)  # matmul FLOPs dominate, operands out of cache
    return [
        Workload("mlp", mlp, dp),
        Workload("mlp", mlp, two_pairs),
        Workload("wide", _calibration_wide, dp),
        Workload("wide", _calibration_wide, Candidate(("tp",), pairs_tp=(True,))),
        Workload("deep", _calibration_deep, dp),
        Workload("heavy", heavy, dp),
        Workload("heavy", heavy, two_pairs),
        Workload("conv", _calibration_conv, dp),
        Workload("conv", _calibration_conv, Candidate(("tp",), conv_pairs_tp=(True,))),
    ]


def _applied(workload: Workload, model: nn.Module, example: tuple, world_size: int):
    """(apply_fn(model, mesh), feed_fn(mesh, example), mesh dim names) of the workload's candidate."""
    from ..autoparallel.candidates import plan_entries
    from ..autoparallel.plan import apply_candidate, batch_feed, mesh_names_for
    from ..autoparallel.structure import find_structure

    cand = workload.candidate
    structure = find_structure(model, example)
    entries = plan_entries(structure, cand)

    def apply(m: nn.Module, mesh) -> nn.Module:
        return apply_candidate(m, mesh, cand, entries, structure.blocks)

    return apply, batch_feed((world_size,), cand), mesh_names_for(cand)


def profile_workload(workload: Workload, world_size: int) -> StepProfile:
    """The workload's dry-run step profile on META tensors (what the planner prices)."""
    from ..autoparallel.measure import on_meta
    from ..autoparallel.timing import profile_dry

    net, example, loss_fn = workload.build()
    meta, meta_example = on_meta(net, example)
    apply, feed, names = _applied(workload, meta, meta_example, world_size)
    return profile_dry(meta, (world_size,), names, apply, feed, meta_example, loss_fn)


# ------------------------------------------------------------------------------------------ on every rank


def _burst(fn: Callable[[], object], times: int, barrier: Callable[[], object]) -> None:
    for _ in range(times):
        fn()
    barrier()


def _dtensor_calls(fn: Callable[[], object]) -> int:
    """DTensor calls of `fn` as the step profile counts them (timing.DTensorCalls and KernelCounter)."""
    part = PartProfile()
    counter = KernelCounter()
    counter.part = part
    with DTensorCalls(part), counter:
        fn()
    return part.dtensor_ops


def _bursts(world_size: int) -> tuple[dict[str, tuple[Callable[[], object], int]], int]:
    """Per figure, (a kernel call, calls per burst); and the DTensor calls one `dt + dt` counts as."""
    a = torch.randn(256, 256)
    big = torch.randn(STREAMED)  # 4 MiB operands, 12 MiB moved per add: beyond the caches a loop would run in
    tiny = torch.ones(1)
    mesh = init_device_mesh("cpu", (world_size,))
    dt = DTensor.from_local(torch.ones(1), mesh, [Replicate()])
    dt + dt  # planned once: the cached decision is what a training step pays
    image, kernel = torch.randn(8, 16, 32, 32), torch.randn(32, 16, 3, 3)
    bursts: dict[str, tuple[Callable[[], object], int]] = {
        "matmul_s": (lambda: a @ a, 6),
        "conv_s": (lambda: torch.nn.functional.conv2d(image, kernel, padding=1), 3),
        "add_s": (lambda: big + big, 8),
        "kernel_s": (lambda: tiny + tiny, 300),
        "dtensor_s": (lambda: dt + dt, 30),
    }
    return bursts, _dtensor_calls(lambda: dt + dt)


def _prepare(workload: Workload, world_size: int):
    """(model under the plan, this rank's inputs, loss_fn, optimizer) on this gloo rank."""
    net, example, loss_fn = workload.build()
    apply, feed, names = _applied(workload, net, example, world_size)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=names)
    model = apply(copy.deepcopy(net), mesh)
    local = feed(mesh, example)
    return model, local, loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)


def _step(model, local, loss_fn, optimizer) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    loss = loss_fn(model(*local), *local)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optimizer.step()  # a pending gradient resolves on its first read: in this part
    optimizer.zero_grad()
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def _fit_rank(rounds: int, workloads: list[Workload]) -> dict:
    """On every gloo rank at once, round after round: each all_reduce size, each burst, one step of
    each workload, every one started by a barrier. Raw seconds per round (warm-up rounds dropped)."""
    from ..world import current_comm

    comm = current_comm()
    group = comm.world_group()
    barrier = partial(comm.barrier, group)
    bursts, dtensor_calls = _bursts(comm.world_size)
    runs = [_prepare(w, comm.world_size) for w in workloads]
    tensors = {size: torch.ones(size // 4) for size in ALL_REDUCE_SIZES}
    out: dict = {
        "all_reduce": {size: [] for size in ALL_REDUCE_SIZES},
        "bursts": {key: [] for key in bursts},
        "empty": [],
        "steps": [[] for _ in runs],
        "dtensor_calls": dtensor_calls,
    }
    for r in range(rounds + WARMUP_ROUNDS):
        keep = r >= WARMUP_ROUNDS
        for size, t in tensors.items():
            barrier()
            t0 = time.perf_counter()
            comm.all_reduce(t, "sum", group)
            if keep:
                out["all_reduce"][size].append(time.perf_counter() - t0)
        barrier()
        t0 = time.perf_counter()
        barrier()  # barrier to barrier, nothing between: what a burst's time is less
        if keep:
            out["empty"].append(time.perf_counter() - t0)
        for key, (fn, loop) in bursts.items():
            barrier()
            t0 = time.perf_counter()
            _burst(fn, loop, barrier)
            if keep:
                out["bursts"][key].append((time.perf_counter() - t0, loop))
        for i, run in enumerate(runs):
            barrier()
            times = _step(*run)
            if keep:
                out["steps"][i].append(times)
    return out


# ------------------------------------------------------------------------------------------ the fit


def _slowest_median(per_rank: Sequence[Sequence[float]]) -> float:
    """Per round the slowest rank, median over rounds."""
    return statistics.median(max(values) for values in zip(*per_rank))


def _link(results: list[dict], n: int) -> Link:
    """alpha and beta of t = 2(n-1) alpha + 2(n-1)/n bytes / beta, least squares in (alpha, 1/beta)."""
    sizes = list(ALL_REDUCE_SIZES)
    times = [_slowest_median([r["all_reduce"][s] for r in results]) for s in sizes]
    xs = [(2.0 * (n - 1), 2 * (n - 1) / n * s) for s in sizes]
    alpha, inv_beta = _least_squares(xs, times)
    return Link(max(alpha, 1e-7), 1.0 / max(inv_beta, 1e-12), 0.0)


def _rates(results: list[dict]) -> Compute:
    """The rates from the bursts (each burst less an empty barrier-to-barrier, per call); the per-call
    overheads as a loop measures them (the fit of the steps replaces them)."""
    empty = _slowest_median([r["empty"] for r in results])

    def per_call(key: str) -> float:
        loop = results[0]["bursts"][key][0][1]
        burst = _slowest_median([[t for t, _ in r["bursts"][key]] for r in results])
        return max(burst - empty, 1e-9) / loop

    matmul, conv, add, kernel, dtensor = (per_call(k) for k in ("matmul_s", "conv_s", "add_s", "kernel_s", "dtensor_s"))
    return Compute(
        flop_rate=2 * 256**3 / matmul,
        bandwidth=3 * STREAMED * 4 / max(add - kernel, 1e-9),
        kernel_overhead=kernel,
        dispatch_overhead=max(dtensor - kernel, 0.0) / max(results[0]["dtensor_calls"], 1),
        conv_rate=2 * 8 * 32 * 16 * 9 * 32 * 32 / conv,
    )


def _measured(results: list[dict], i: int) -> StepMeasure:
    steps = [r["steps"][i] for r in results]  # per rank, per round: (forward, backward, optimizer)
    total = _slowest_median([[sum(t) for t in rank] for rank in steps])
    parts = tuple(_slowest_median([[t[p] for t in rank] for rank in steps]) for p in range(3))
    return StepMeasure(total, parts)  # type: ignore[arg-type]


def _fitted_overheads(rates: Compute, link: Link, profiles: list[StepProfile], measured: list[float]) -> Compute:
    """The in-step slowdown of the rates, kernel_overhead, dispatch_overhead and sync_wait: non-negative
    least squares (relative error) of each calibration step's measured time less its collectives' link
    time, against its compute priced at the bursts' rates and its counts of kernels, DTensor calls and
    collective calls. The slowdown is at least 1: a step's kernels, their operands out of cache, run no
    faster than a loop of one kernel."""
    bare = replace(rates, kernel_overhead=0.0, dispatch_overhead=0.0, sync_wait=0.0)
    rows, rhs = [], []
    for profile, seconds in zip(profiles, measured):
        t = predict(profile, (link,), bare)
        parts = profile.parts.values()
        counts = [sum(p.kernels for p in parts), sum(p.dtensor_ops for p in parts), sum(p.rounds for p in parts)]
        rows.append([sum(t.compute.values()) / seconds, *(c / seconds for c in counts)])
        rhs.append((seconds - sum(t.comm.values())) / seconds)
    a, b = np.array(rows, dtype=float), np.array(rhs)
    slowdown, kernel, dispatch, wait = _nonnegative_least_squares(a, b)
    if slowdown < 1.0:  # fix it at 1, the rest fitted to what the rates leave
        slowdown = 1.0
        kernel, dispatch, wait = _nonnegative_least_squares(a[:, 1:], b - a[:, 0])
    return replace(
        rates,
        flop_rate=rates.flop_rate / slowdown,
        conv_rate=(rates.conv_rate or rates.flop_rate) / slowdown,
        bandwidth=rates.bandwidth / slowdown,
        kernel_overhead=kernel,
        dispatch_overhead=dispatch,
        sync_wait=wait,
    )


def fit_and_measure(
    world_size: int = 4, rounds: int = 15, workloads: Sequence[Workload] = (), save: str | os.PathLike | None = None
) -> FitResult:
    """Fit the "gloo-localhost" presets on `world_size` gloo processes on 127.0.0.1 (see the module
    docstring), install them, and return them with the measured steps of `workloads`, trained in the
    same rounds as the fit's own. `save`: also write the presets as JSON (read at import when
    SHARDOPS_TIMING_PRESET names the file)."""
    from .launch import run_gloo

    calibration = calibration_workloads()
    everything = [*calibration, *workloads]
    results = run_gloo(_fit_rank, world_size, rounds, everything, timeout=1800)
    link = _link(results, world_size)
    rates = _rates(results)
    link = Link(link.latency, link.bandwidth, rates.bandwidth)
    measured = [_measured(results, i) for i in range(len(everything))]
    profiles = [profile_workload(w, world_size) for w in calibration]
    compute = _fitted_overheads(rates, link, profiles, [m.total for m in measured[: len(calibration)]])
    install(link, compute)
    if save is not None:
        Path(save).write_text(json.dumps({"link": [link.latency, link.bandwidth], "compute": compute.__dict__}))
    return FitResult(link, compute, measured[len(calibration) :])


def fit(world_size: int = 4, rounds: int = 15, save: str | os.PathLike | None = None) -> tuple[Link, Compute]:
    """Measure and install the "gloo-localhost" link and compute presets (fit_and_measure, no workloads
    of the caller's)."""
    result = fit_and_measure(world_size, rounds, (), save)
    return result.link, result.compute


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


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> list[float]:
    """x >= 0 minimizing |a x - b| (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    active: list[int] = []  # the coordinates free to be positive
    x = np.zeros(n)
    for _ in range(3 * n):
        gradient = a.T @ (b - a @ x)
        candidates = [j for j in range(n) if j not in active and gradient[j] > 1e-12]
        if not candidates:
            break
        active.append(max(candidates, key=lambda j: gradient[j]))
        while True:
            trial = np.zeros(n)
            trial[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
            if all(trial[j] > 0 for j in active):
                x = trial
                break
            # step from x toward the trial point until a coordinate reaches zero, and drop it
            step = min(x[j] / (x[j] - trial[j]) for j in active if trial[j] <= 0)
            x = x + step * (trial - x)
            active = [j for j in active if x[j] > 1e-15]
    return [float(v) for v in x]
