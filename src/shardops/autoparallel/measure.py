"""Pricing a candidate: one forward + loss + backward + gradient resolution on the threads
world, counted with CommDebugMode on every rank, the values checked against single-device torch.
Each rank runs the model on its own batch slice (torch's data parallelism): the mean of the ranks'
losses and every gradient (averaged by replicate/fully_shard) equal the single-device step's; with
BatchNorm in training mode, torch's data-parallel step's (each rank's batch statistics, computed on one
device slice by slice).

Pricing by running the step (rather than by a separate formula) makes the prediction the
very figure the applied plan produces on the same global batch: shardops' planner chooses
every op's layout from metadata, deterministically, so the step's collectives depend on
shapes, placements and the link model only, never on values or timing.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..comm.base import CommDebugMode
from ..comm.dry import DryCommunicator
from ..dispatch.core import FallbackWarning
from ..fsdp._state import unit_of
from ..mesh import init_device_mesh
from ..parallel.expert import DRY_ROUTING_ATTR
from ..placements import Replicate
from ..tensor import DTensor, from_local
from ..world import run, run_dry
from . import device_kernels

__all__ = [
    "Measurement",
    "Reference",
    "SavedActivations",
    "expert_routing",
    "extrapolate",
    "give_routing",
    "local_parameter_bytes",
    "measure",
    "measure_dry",
    "on_meta",
    "reference_step",
    "uses_batch_statistics",
]

PARTS = ("forward + loss", "backward", "gradient sync")


@dataclass
class Measurement:
    bytes_per_part: dict[str, int] = field(default_factory=dict)  # busiest rank per part
    rounds_per_part: dict[str, int] = field(default_factory=dict)
    total_bytes: int = 0  # busiest rank over the whole step
    total_rounds: int = 0
    # parameters, gradients, AdamW's two states, fully_shard's gathered units, activations kept for backward
    memory_per_rank: int = 0  # on the largest rank
    parameter_bytes: int = 0  # the largest rank's local parameters: every one the model holds, once
    error: str | None = None  # why the candidate cannot be used (raised, fell back, or wrong values)
    activation_bytes: int = 0  # the largest rank's tensors autograd keeps from forward for backward

    @property
    def feasible(self) -> bool:
        return self.error is None


@dataclass
class Reference:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]


BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)  # SyncBatchNorm is none of them


def uses_batch_statistics(model: nn.Module) -> bool:
    """A BatchNorm in training mode normalizes by its batch's statistics: under data parallelism, each
    rank's own batch slice's (torch's DDP/FSDP without SyncBatchNorm), not the global batch's."""
    return any(isinstance(m, BATCH_NORMS) and m.training for m in model.modules())


def reference_step(model: nn.Module, example: tuple, loss_fn: Callable, dp_ranks: int = 1) -> Reference:
    """The single-device step on the global batch; with `dp_ranks` > 1, torch's data-parallel step as one
    device computes it: the model on each rank's batch slice (its own BatchNorm statistics), the slices'
    mean loss, whose gradients are the data-parallel ranks' averaged ones."""
    ref = copy.deepcopy(model)
    if dp_ranks == 1:
        loss = loss_fn(ref(*example), *example)
    else:
        slices = [_batch_slice(example, i, dp_ranks) for i in range(dp_ranks)]
        loss = torch.stack([loss_fn(ref(*local), *local) for local in slices]).mean()
    loss.backward()
    return Reference(loss.detach(), {n: None if p.grad is None else p.grad.detach() for n, p in ref.named_parameters()})


def _batch_slice(example: tuple, index: int, n: int) -> tuple:
    """Slice `index` of `n` of every tensor input's batch dim (torch.chunk's cut, as plan.local_batch)."""
    return tuple(x.chunk(n)[index] if isinstance(x, torch.Tensor) and x.ndim > 0 else x for x in example)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _replicated_like(out, example: tuple) -> tuple:
    """The example (the global batch, the same on every rank) as Replicate DTensors on the mesh of a
    DTensor output, for a loss that meets both (a plain tensor meeting a DTensor raises)."""
    dt = out if isinstance(out, DTensor) else getattr(out, "logits", None)
    if not isinstance(dt, DTensor):
        return example
    mesh = dt.device_mesh
    return tuple(
        from_local(t, mesh, [Replicate()] * mesh.ndim)
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
        else t
        for t in example
    )


class SavedActivations:
    """Counts what autograd keeps from a forward for its backward (torch.autograd.graph.saved_tensors_hooks):
    the local bytes on this rank of every distinct saved tensor, the model's parameters excepted (they
    are counted as parameters). Works on META tensors too (shapes only)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._seen: set[int] = set()  # ids of the tensors saved so far (the graph keeps them alive)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter) or id(t) in self._seen:
            return t
        self._seen.add(id(t))
        local = t.to_local() if isinstance(t, DTensor) else t
        self.bytes += local.numel() * local.element_size()
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _rank_step(model, mesh_shape, mesh_names, apply_fn, feed_fn, example, loss_fn, ref: Reference):
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=mesh_names)
    m = copy.deepcopy(model)
    apply_fn(m, mesh)
    local = feed_fn(mesh, example)  # this rank's batch slice
    with CommDebugMode() as fwd, SavedActivations() as saved:
        out = m(*local)
        loss = loss_fn(out, *_replicated_like(out, local))
    with CommDebugMode() as bwd:
        loss.backward()
    with CommDebugMode() as sync, torch.no_grad():
        for p in m.parameters():
            if isinstance(p.grad, DTensor):
                p.grad.to_local()  # the first read resolves a pending gradient to its parameter's layout
    counts = {part: (c.get_total_bytes(), c.get_rounds()) for part, c in zip(PARTS, (fwd, bwd, sync))}
    with torch.no_grad():
        error = _compare_grads(m, ref)
    params = local_parameter_bytes(m)
    return StepResult(counts, params, gathered_peak_bytes(m), error, _full(loss.detach()), saved.bytes)


@dataclass
class StepResult:
    """One rank's step: bytes and rounds per part, its parameters' bytes, fully_shard's gathered peak."""

    counts: dict[str, tuple[int, int]]
    parameter_bytes: int
    gathered_bytes: int
    error: str | None
    loss: torch.Tensor
    activation_bytes: int = 0  # kept from forward for backward


def gathered_peak_bytes(model: nn.Module) -> int:
    """Bytes of unsharded parameters fully_shard holds at once, at the peak: the root unit (its forward
    encloses every other's) and every unit kept gathered after its forward, plus the largest unit that
    reshards (gathered alone for its forward and again for its backward). 0 without fully_shard."""
    units = [u for u in dict.fromkeys(unit_of(sub) for sub in model.modules()) if u is not None]
    if not units:
        return 0

    def size(unit) -> int:
        return sum(math.prod(p.unsharded_shape) * p.dtype.itemsize for p in unit.params)

    root = unit_of(model)
    held = sum(size(u) for u in units if u is root or not u.reshard_after_forward)
    return held + max((size(u) for u in units if u is not root and u.reshard_after_forward), default=0)


def local_parameter_bytes(model: nn.Module) -> int:
    """This rank's bytes of every parameter the model holds (a tied one once), whichever module reads it."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def _compare_loss(results: list[StepResult], ref: Reference) -> str | None:
    """The ranks' mean loss (each its batch slice's mean; tp ranks alike) against the single-device one."""
    if ref.loss.is_meta:
        return None
    loss = torch.stack([r.loss for r in results]).mean()
    if not torch.allclose(loss, ref.loss, rtol=1e-4, atol=1e-5):
        return f"loss {loss.item():.6g} (the ranks' mean) differs from single-device {ref.loss.item():.6g}"
    return None


def _compare_grads(m: nn.Module, ref: Reference) -> str | None:
    if ref.loss.is_meta:  # the dry world has no values: every gradient present, of its parameter's shape
        for name, p in m.named_parameters():
            want = ref.grads.get(name)
            if (want is None) != (p.grad is None):
                return f"gradient of {name} is {'missing' if p.grad is None else 'unexpected'}"
            if want is not None and p.grad is not None and tuple(p.grad.shape) != tuple(want.shape):
                return f"gradient of {name} has shape {tuple(p.grad.shape)}, not {tuple(want.shape)}"
        return None
    for name, p in m.named_parameters():
        want = ref.grads.get(name)
        got = None if p.grad is None else _full(p.grad)
        if (want is None) != (got is None):
            return f"gradient of {name} is {'missing' if got is None else 'unexpected'}"
        if want is not None and got is not None and not torch.allclose(got, want, rtol=1e-3, atol=1e-5):
            return f"gradient of {name} differs from single-device"
    return None


def measure(model, mesh_shape, mesh_names, apply_fn, feed_fn, example, loss_fn, ref: Reference) -> Measurement:
    """Run the candidate's step on a threads world of the mesh's size; errors make it infeasible.
    `feed_fn(mesh, example)` gives a rank its batch slice."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)  # a plan that only works by gathering is not a plan
            args = (model, mesh_shape, mesh_names, apply_fn, feed_fn, example, loss_fn, ref)
            results = run(_rank_step, math.prod(mesh_shape), *args)
    except Exception as exc:  # noqa: BLE001  (any failure of a candidate rules it out, with its reason)
        return Measurement(error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return _busiest(results, _compare_loss(results, ref))


def expert_routing(model: nn.Module, experts: list[str], example: tuple) -> dict[str, torch.Tensor]:
    """Per experts module (full path), the expert ids [tokens, k] its router gave on one single-device
    forward of the global example (no gradients): what the dry world routes by (give_routing)."""
    ids: dict[str, torch.Tensor] = {}

    def record(name: str, args: tuple) -> None:  # returns None: the call's inputs stay as they are
        ids.setdefault(name, args[1].detach().clone())

    handles = [
        model.get_submodule(name).register_forward_pre_hook(lambda m, args, name=name: record(name, args))
        for name in experts
    ]
    try:
        with torch.no_grad():
            model(*example)
    finally:
        for h in handles:
            h.remove()
    return ids


class _ExpertsOnMeta:
    """An experts module's forward on META tensors, where the routing has no values: its output's shape
    (tokens x width), depending on the tokens, their weights and every expert weight (each gets a gradient).
    It moves nothing, as the module's own forward on one rank; its FLOPs and kept activations are not the
    real ones. ExpertParallel replaces it (its dry routing sends what the recorded ids send)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if not hidden.is_meta:
            return type(self.module).forward(self.module, hidden, top_k_index, top_k_weights)
        anchor = sum(p.reshape(-1)[:0].sum() for p in self.module.parameters(recurse=False))
        return hidden * top_k_weights.sum(-1, keepdim=True).to(hidden.dtype) + anchor


def give_routing(meta_model: nn.Module, routing: dict[str, torch.Tensor]) -> nn.Module:
    """Hand each experts module of a META model its recorded ids (ExpertParallel's dry routing reads
    them) and a forward that runs on meta tensors (_ExpertsOnMeta); modules missing from a truncated
    copy are skipped."""
    for name, ids in routing.items():
        try:
            sub = meta_model.get_submodule(name)
        except AttributeError:
            continue
        sub.__dict__[DRY_ROUTING_ATTR] = ids
        sub.forward = _ExpertsOnMeta(sub)
    return meta_model


def on_meta(model: nn.Module, example: tuple) -> tuple[nn.Module, tuple]:
    """A META copy of the model and the example (shapes, dtypes and module tree kept, no data)."""
    # a deepcopy whose memo maps each parameter and buffer to an empty meta twin: no data copied, and
    # tied weights (GPT-2's wte and lm_head) stay one parameter (Module.to("meta") unties them)
    memo: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        memo.setdefault(id(p), nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
    for b in model.buffers():
        memo.setdefault(id(b), torch.empty_like(b, device="meta"))
    meta_model = copy.deepcopy(model, memo)
    meta_example = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in example)
    return meta_model, meta_example


def measure_dry(model, mesh_shape, mesh_names, apply_fn, feed_fn, example, loss_fn, ref: Reference) -> Measurement:
    """The same step as `measure`, as one rank at a time of a dry world (comm/dry.py): META model
    and example, collectives counted and moving nothing; no world of the mesh's size.

    Rank 0 first. If every collective it joined split evenly, every rank sends what it sends; else
    every rank of a world of at most ALL_RANKS_PRICED (expert parallelism's all_to_alls follow the
    routing: any rank may be the busiest), or the last rank of a larger one: an uneven split gives the
    first ranks the larger shares, the last the smaller (or none); the busiest rank's figure is the largest."""
    world = math.prod(mesh_shape)
    device_kernels.install()  # sdpa picks the mesh device's backend, as on the threads world
    results = []
    others = range(1, world) if world <= ALL_RANKS_PRICED else (world - 1,)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            for rank in dict.fromkeys((0, *others)):
                comm = DryCommunicator(rank, world)
                args = (model, mesh_shape, mesh_names, apply_fn, feed_fn, example, loss_fn, ref)
                results.append(run_dry(_rank_step, comm, *args))
                if comm.symmetric:
                    break
    except Exception as exc:  # noqa: BLE001
        return Measurement(error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return _busiest(results)


ALL_RANKS_PRICED = 16  # an uneven dry step on at most this many ranks is priced on every rank


def _busiest(results: list[StepResult], loss_error: str | None = None) -> Measurement:
    errors = [r.error for r in results if r.error] + ([loss_error] if loss_error else [])
    out = Measurement(error=errors[0] if errors else None)
    for part in PARTS:
        out.bytes_per_part[part] = max(r.counts[part][0] for r in results)
        out.rounds_per_part[part] = max(r.counts[part][1] for r in results)
    out.total_bytes = max(sum(r.counts[p][0] for p in PARTS) for r in results)
    out.total_rounds = max(sum(r.counts[p][1] for p in PARTS) for r in results)
    out.parameter_bytes = max(r.parameter_bytes for r in results)
    out.activation_bytes = max(r.activation_bytes for r in results)
    # parameters, gradients and AdamW's two states alike (each 1/dp under fully_shard), its gathered units,
    # and the activations kept for backward (all held at once at the end of forward: their sum bounds the peak)
    out.memory_per_rank = max(4 * r.parameter_bytes + r.gathered_bytes + r.activation_bytes for r in results)
    return out


def extrapolate(one: Measurement, two: Measurement, n_blocks: int) -> Measurement:
    """The n-block model's figures from a 1-block and a 2-block copy: every block adds the same
    collectives (same shapes, same styles), so each figure is linear in the number of blocks."""
    if not one.feasible or not two.feasible:
        return Measurement(error=one.error or two.error)

    def line(a: int, b: int) -> int:
        return a + (n_blocks - 1) * (b - a)

    return Measurement(
        {p: line(one.bytes_per_part[p], two.bytes_per_part[p]) for p in PARTS},
        {p: line(one.rounds_per_part[p], two.rounds_per_part[p]) for p in PARTS},
        line(one.total_bytes, two.total_bytes),
        line(one.total_rounds, two.total_rounds),
        line(one.memory_per_rank, two.memory_per_rank),
        line(one.parameter_bytes, two.parameter_bytes),
        activation_bytes=line(one.activation_bytes, two.activation_bytes),
    )
