"""Predicted step time of a candidate plan, from metadata: one rank's forward + loss, backward,
gradient resolution and optimizer step, priced with the link model (cost.py) and a compute model.

The profile comes from one rank of the dry world (comm/dry.py) on META tensors, the very step the
byte pricing runs (measure.py):

- every collective with its kind, its full (gathered/reduced) size and the mesh dims its group
  spans (the dry communicator's `_impl` methods see the group; `record` sees only bytes);
- every aten kernel the rank runs on its local tensors (a dispatch mode below DTensor: an op on
  DTensors is let through to shardops' dispatch, whose local kernels the mode then sees), with its
  FLOPs (torch.utils.flop_counter's formulas) or, for an op without a formula, the bytes it reads
  and writes; and how many ops went through shardops' DTensor dispatch;
- the optimizer step itself, run on the rank's parameters (META DTensors or plain tensors) after the
  dry backward, its kernels and DTensor calls counted as the step's (its first step, which allocates
  the states, not counted); and the bytes autograd keeps for backward (saved_tensors_hooks).

Time per part, on the busiest rank, nothing overlapped (replicate's bucket all_reduces start during
backward, but a bucket starts when its last gradient is ready: a model of one bucket overlaps nothing):

    compute = FLOPs / flop_rate + bytes / bandwidth + kernels x kernel_overhead + DTensor ops x dispatch_overhead
    comm    = sum over collectives of cost.collective_time (ring model: alpha per step, bytes / beta)
              + collectives x sync_wait (the wait for the last peer: ranks sharing cores arrive skewed)

The compute constants and the gloo link are fitted on this machine by `fit()` (4 gloo processes on
127.0.0.1; `shardops autoplan --fit`) and kept as the "gloo-localhost" presets.
"""

from __future__ import annotations

import copy
import json
import math
import os
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from .. import caches
from .._torch.dispatch import TorchDispatchMode
from ..comm.dry import DryCommunicator
from ..cost import PRESETS, Link, collective_time, joint_collective_time
from ..dispatch.core import FallbackWarning
from ..dispatch.registry import TORCH_FUNCTIONS
from ..errors import ShardingError
from ..mesh import init_device_mesh
from ..tensor import DTensor
from ..world import run_dry
from . import device_kernels

__all__ = [
    "COMPUTE_PRESETS",
    "Compute",
    "PartProfile",
    "StepProfile",
    "StepTime",
    "extrapolate_profile",
    "predict",
    "profile_dry",
    "resolve_compute",
]

PARTS = ("forward + loss", "backward", "gradient sync", "optimizer step")


@dataclass(frozen=True)
class Compute:
    """What one rank's local work costs: the roofline's two rates and two per-call overheads."""

    flop_rate: float  # FLOP/s of kernels with a FLOP formula (matmul, convolution, attention)
    bandwidth: float  # bytes/s streamed by every other kernel (elementwise, reductions, copies)
    kernel_overhead: float  # seconds per aten kernel call (dispatcher and Python around it)
    dispatch_overhead: float  # seconds per op through shardops' DTensor dispatch, beyond its kernels
    conv_rate: float | None = None  # FLOP/s of convolutions (CPU kernels run them slower); None: flop_rate
    # seconds per collective call beyond the link model: the wait for the last peer to arrive. Ranks that
    # share cores (4 gloo processes on 2) reach each collective skewed by about a scheduler slice, whatever
    # its size; on devices of their own ranks arrive together (0)
    sync_wait: float = 0.0

    def __repr__(self) -> str:
        return (
            f"Compute({self.flop_rate / 1e9:.3g} GFLOP/s, {self.bandwidth / 1e9:.3g} GB/s, "
            f"{self.kernel_overhead * 1e6:.3g}us/kernel, {self.dispatch_overhead * 1e6:.3g}us/DTensor call, "
            f"conv {(self.conv_rate or self.flop_rate) / 1e9:.3g} GFLOP/s, "
            f"{self.sync_wait * 1e6:.3g}us wait/collective)"
        )


# NOTE: "gloo-localhost" is fitted by fit_timing.fit() on the 2-core development machine, idle
# (docs/autoparallel.md, "Predicted against measured", run 3): 4 gloo processes on 127.0.0.1, one torch
# thread each; rates from bursts between barriers on every rank at once (the job's own ranks sharing the
# cores in them) slowed by the in-step factor, per-kernel, per-DTensor-call and per-collective costs from
# the calibration workloads' steps. A machine's load moves these figures by 2x: refit (`shardops autoplan
# --fit`) where it matters. "cpu" is a generic one-core CPU; "gpu" an H100-class device for meta plans
# (rough public figures); neither waits at a collective.
COMPUTE_PRESETS: dict[str, Compute] = {
    "gloo-localhost": Compute(21.1e9, 15.2e9, 11.2e-6, 128e-6, conv_rate=23.8e9, sync_wait=8.72e-3),
    "cpu": Compute(50e9, 10e9, 5e-6, 40e-6),
    "gpu": Compute(400e12, 2e12, 10e-6, 40e-6),
}
FITTED_FILE = "SHARDOPS_TIMING_PRESET"  # env var: a JSON file `fit(save=...)` wrote, read at import


def resolve_compute(compute: str | Compute | None, links: tuple[Link, ...]) -> Compute:
    """A Compute from a preset name or an instance; None: "gloo-localhost" for gloo-localhost links,
    "gpu" with nvlink or ib links, else "cpu"."""
    if isinstance(compute, Compute):
        return compute
    if compute is None:
        if links and links[0] == PRESETS.get("gloo-localhost"):
            compute = "gloo-localhost"
        elif any(link in (PRESETS["nvlink"], PRESETS["ib"]) for link in links):
            compute = "gpu"  # the links of a GPU cluster: its devices compute
        else:
            compute = "cpu"
    if compute not in COMPUTE_PRESETS:
        raise ShardingError(f"unknown compute preset {compute!r}; use one of {sorted(COMPUTE_PRESETS)} or Compute(...)")
    return COMPUTE_PRESETS[compute]


# ------------------------------------------------------------------------------------------ the profile


@dataclass
class PartProfile:
    """One part of one rank's step; every figure adds up over repeated blocks (linear in depth)."""

    flops: float = 0.0  # kernels with a FLOP formula, but convolutions
    conv_flops: float = 0.0  # convolutions, forward and backward
    streamed_bytes: float = 0.0  # bytes read and written by the kernels without one
    kernels: int = 0  # aten kernel calls on local tensors
    # DTensor calls: aten ops through shardops' DTensor dispatch, and the torch-level calls shardops
    # implements itself (TORCH_FUNCTIONS); a torch-level call that goes on to the dispatch counts once
    dtensor_ops: int = 0
    # (kind, full bytes, group size per spanned mesh dim, spanned mesh dims) -> calls
    collectives: Counter = field(default_factory=Counter)

    @property
    def rounds(self) -> int:
        return sum(self.collectives.values())


@dataclass
class StepProfile:
    parts: dict[str, PartProfile] = field(default_factory=lambda: {p: PartProfile() for p in PARTS})
    activation_bytes: int = 0  # tensors autograd keeps from forward for backward, this rank's local bytes


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds per part (compute, communication) on one rank."""

    compute: dict[str, float]
    comm: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.compute.values()) + sum(self.comm.values())

    def part(self, name: str) -> float:
        return self.compute[name] + self.comm[name]


def _mesh_dims(ranks: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The mesh dims a group of global ranks spans (row-major mesh over the world) and its size on each."""
    coords = [_coordinate(r, mesh_shape) for r in ranks]
    dims = tuple(d for d in range(len(mesh_shape)) if len({c[d] for c in coords}) > 1)
    return dims, tuple(len({c[d] for c in coords}) for d in dims)


def _coordinate(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(rank % size)
        rank //= size
    return tuple(reversed(out))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TimedDryCommunicator(DryCommunicator):
    """The dry communicator, also logging each collective's full size and group into `profile`."""

    def __init__(self, rank: int, world_size: int, mesh_shape: tuple[int, ...]) -> None:
        super().__init__(rank, world_size)
        self.mesh_shape = mesh_shape
        self.part: PartProfile | None = None  # where the running part's collectives go

    def _log(self, kind: str, full: int, ranks: tuple[int, ...]) -> None:
        if self.part is not None:
            dims, sizes = _mesh_dims(ranks, self.mesh_shape)
            self.part.collectives[(kind, full, sizes, dims)] += 1

    def _all_reduce(self, t, op, group):
        self._log("all_reduce", _nbytes(t), group.ranks)
        return super()._all_reduce(t, op, group)

    def _all_gather(self, t, group, shapes):
        self._log("all_gather", sum(math.prod(s) for s in shapes) * t.element_size(), group.ranks)
        return super()._all_gather(t, group, shapes)

    def _reduce_scatter(self, chunks, op, group):
        self._log("reduce_scatter", sum(_nbytes(c) for c in chunks), group.ranks)
        return super()._reduce_scatter(chunks, op, group)

    def _all_to_all(self, chunks, group, recv_shapes):
        self._log("all_to_all", sum(_nbytes(c) for c in chunks), group.ranks)
        return super()._all_to_all(chunks, group, recv_shapes)

    def _broadcast(self, t, src_index, group):
        self._log("broadcast", _nbytes(t), group.ranks)
        return super()._broadcast(t, src_index, group)

    def _batch_isend_irecv(self, ops):
        for p2p in ops:
            if p2p.kind == "send":
                peers = (self.rank, p2p.peer)
                self._log("send", _nbytes(p2p.tensor), peers)
        return super()._batch_isend_irecv(ops)


def _cpu_flash_attention(query, key, value, *_, **__) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_attention_backward(grad_out, query, key, value, *_, **__) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# FLOP formulas torch's counter lacks: the CPU kernels of scaled_dot_product_attention (torch counts the
# CUDA ones only), which the dry step runs as the CPU step does (device_kernels.py)
aten = torch.ops.aten
EXTRA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_attention_backward,
}


class KernelCounter(TorchDispatchMode):
    """Every aten kernel on plain tensors: FLOPs (torch's formulas) or streamed bytes; ops on DTensors
    are only counted and passed on (NotImplemented: shardops' dispatch runs them, its kernels come back here)."""

    def __init__(self) -> None:
        super().__init__()
        self.part = PartProfile()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            self.part.dtensor_ops += 1
            return NotImplemented
        out = func(*args, **kwargs)
        self.part.kernels += 1
        formula = flop_registry.get(func.overloadpacket)
        extra = EXTRA_FLOPS.get(func.overloadpacket)
        if formula is not None or extra is not None:
            flops = formula(*args, **kwargs, out_val=out) if formula is not None else extra(*args, **kwargs)
            if "convolution" in func.overloadpacket.__name__:
                self.part.conv_flops += flops
            else:
                self.part.flops += flops
        elif not _moves_nothing(func):
            tensors = [a for a in (*args, *kwargs.values(), out) if isinstance(a, torch.Tensor)]
            tensors += [
                t for a in (*args, out) if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)
            ]
            self.part.streamed_bytes += sum(_nbytes(t) for t in tensors)
        return out


class DTensorCalls(TorchFunctionMode):
    """Torch-level calls on DTensors that shardops implements itself (its TORCH_FUNCTIONS: the outermost
    only, the mode is off inside each). Any other torch-level call passes through DTensor.__torch_function__
    in C to the aten dispatch, where KernelCounter counts its op once: counting it here too charged one op
    twice (and every `p.grad` read or `is_complex()` as an op)."""

    def __init__(self, part: PartProfile) -> None:
        super().__init__()
        self.part = part

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in TORCH_FUNCTIONS and any(issubclass(t, DTensor) for t in types):
            self.part.dtensor_ops += 1
        return func(*args, **(kwargs or {}))


def _moves_nothing(func) -> bool:
    """Views and allocations: no data read or written."""
    name = func.overloadpacket.__name__
    return bool(getattr(func, "is_view", False)) or name.startswith(("empty", "detach", "_to_copy", "lift"))


def _profile_step(
    model, mesh_shape, mesh_names, apply_fn, feed_fn, example, loss_fn, comm: TimedDryCommunicator, optimizer
):
    from .measure import SavedActivations, _replicated_like  # as in the byte pricing

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=mesh_names)
    m = copy.deepcopy(model)
    apply_fn(m, mesh)
    local = feed_fn(mesh, example)  # this rank's batch slice, as measure's step
    profile = StepProfile()
    saved = SavedActivations()  # the byte pricing's own count (its memory figure)

    @contextmanager
    def part(name: str) -> Iterator[None]:
        counter = KernelCounter()
        counter.part = comm.part = profile.parts[name]
        with DTensorCalls(counter.part), counter:
            yield

    with part("forward + loss"), saved:
        out = m(*local)
        loss = loss_fn(out, *_replicated_like(out, local))
    with part("backward"):
        loss.backward()
    with part("gradient sync"), torch.no_grad():
        for p in m.parameters():
            if isinstance(p.grad, DTensor):
                p.grad.to_local()
    # the optimizer step as it runs on this rank's parameters (DTensors or plain): its kernels and DTensor
    # calls counted like the step's; the first step, which allocates the states, is not a step's steady work
    opt = _make_optimizer(optimizer, [p for p in m.parameters() if p.requires_grad and p.grad is not None])
    opt.step()
    with part("optimizer step"):
        opt.step()
    comm.part = None
    profile.activation_bytes = saved.bytes
    return profile


def _make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=False)
    raise ShardingError(f"step time: unknown optimizer {name!r}; use 'adamw' or 'sgd'")


def profile_dry(
    model, mesh_shape, mesh_names, apply_fn, feed_fn, example, loss_fn, *, optimizer: str = "adamw", warm: bool = True
) -> StepProfile:
    """Rank 0's step profile in the dry world (META model and example, see measure_dry). `warm`: run
    the step once unprofiled first, so that the planner's own shape inference (which runs aten ops on
    global shapes, once per new op and layout) is cached and not counted; False where the byte pricing
    just ran the same step."""
    world = math.prod(mesh_shape)
    device_kernels.install()
    args = (model, mesh_shape, mesh_names, apply_fn, feed_fn, example, loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        for _ in range(2 if warm else 1):
            comm = TimedDryCommunicator(0, world, mesh_shape)
            profile = run_dry(_profile_step, comm, *args, comm, optimizer)
    return profile


def extrapolate_profile(one: StepProfile, two: StepProfile, n_blocks: int) -> StepProfile:
    """The n-block model's profile from a 1-block and a 2-block copy (every figure is linear in depth)."""
    k = n_blocks - 1
    out = StepProfile(activation_bytes=one.activation_bytes + k * (two.activation_bytes - one.activation_bytes))
    for name in PARTS:
        a, b = one.parts[name], two.parts[name]
        coll = Counter(
            {
                key: a.collectives[key] + k * (b.collectives[key] - a.collectives[key])
                for key in a.collectives | b.collectives
            }
        )
        out.parts[name] = PartProfile(
            a.flops + k * (b.flops - a.flops),
            a.conv_flops + k * (b.conv_flops - a.conv_flops),
            a.streamed_bytes + k * (b.streamed_bytes - a.streamed_bytes),
            a.kernels + k * (b.kernels - a.kernels),
            a.dtensor_ops + k * (b.dtensor_ops - a.dtensor_ops),
            +coll,  # drops keys extrapolated to zero
        )
    return out


# ------------------------------------------------------------------------------------------ the prediction


def collectives_time(part: PartProfile, links: tuple[Link, ...]) -> float:
    total = 0.0
    for (kind, full, sizes, dims), calls in part.collectives.items():
        if kind == "send":
            link = links[dims[0]] if dims else links[0]
            one = link.latency + full / link.bandwidth
        elif len(dims) == 1:
            one = collective_time(kind, full, sizes[0], links[dims[0]])
        else:
            one = joint_collective_time(kind, full, sizes, [links[d] for d in dims])
        total += calls * one
    return total


def compute_time(part: PartProfile, compute: Compute) -> float:
    return (
        part.flops / compute.flop_rate
        + part.conv_flops / (compute.conv_rate or compute.flop_rate)
        + part.streamed_bytes / compute.bandwidth
        + part.kernels * compute.kernel_overhead
        + part.dtensor_ops * compute.dispatch_overhead
    )


def predict(profile: StepProfile, links: tuple[Link, ...], compute: Compute) -> StepTime:
    """Seconds per part of one rank's step under the link and compute models."""
    return StepTime(
        {n: compute_time(p, compute) for n, p in profile.parts.items()},
        {n: collectives_time(p, links) + p.rounds * compute.sync_wait for n, p in profile.parts.items()},
    )


def install(link: Link, compute: Compute) -> None:
    """Make these the "gloo-localhost" link and compute presets."""
    PRESETS["gloo-localhost"] = link
    COMPUTE_PRESETS["gloo-localhost"] = compute
    caches.invalidate()  # a plan priced under the old link model is stale


def _load_saved() -> None:
    path = os.environ.get(FITTED_FILE)
    if path and Path(path).is_file():
        data = json.loads(Path(path).read_text())
        compute = Compute(**data["compute"])
        latency, bandwidth = data["link"]
        install(Link(latency, bandwidth, compute.bandwidth), compute)


_load_saved()
