"""shardops' side of the training comparison: the same model and plan through
`shardops.parallel`, in the threads world (`so.run`) or one process per rank.

Data parallelism as torch writes it: the plan on mesh["tp"], then `shardops.fsdp`'s
`fully_shard` (per block, then the root) or `replicate` on mesh["dp"]. Only parameters are
distributed: each rank feeds its own batch slice, activations carry the local batch, and the
gradients are reduce-scattered / all-reduced (averaged over dp) during backward (as on torch's
side) and the optimizer step sends nothing. The loss each step records is the global batch's:
the ranks' means averaged over dp, in the same all_reduce as the loss's own pending tp sum.

Bytes are CommDebugMode's wire figure (`get_wire_bytes()`): what this rank hands
the transport, uneven gathers padded, as torch's side is counted.

Checkpoints (`Checkpointing`): every `save_every` steps the model, the optimizer, each
rank's random state and the step counter go to `shardops.checkpoint.save`; `resume`
loads them and continues at the saved step, bit for bit the run that was not stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .. import checkpoint as so_checkpoint
from .. import fsdp as so_fsdp
from .. import parallel as so_parallel
from ..comm.base import CommDebugMode
from ..mesh import init_device_mesh
from ..placements import Partial, Replicate
from ..tensor import DTensor, from_local
from .config import RunSpec, apply_data_parallel, build, plan, replicate_norms_off_plan
from .loop import StepRecord, Steps


class ShardopsMeter:
    """so.CommDebugMode as a training-loop meter (wire bytes)."""

    def __enter__(self) -> ShardopsMeter:
        self._comm = CommDebugMode()
        self._comm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._comm.__exit__(*exc)

    def counts(self) -> dict[str, int]:
        return dict(self._comm.get_comm_counts())

    def bytes(self) -> int:
        return int(self._comm.get_wire_bytes())


class NothingToResume(ValueError):
    """The checkpoint to resume was saved at or after the last step asked for."""


@dataclass(frozen=True)
class Checkpointing:
    """Where and when a run saves (`save_every` steps into `path`; 0: never), and what it resumes from."""

    save_every: int = 0
    path: str | None = None
    resume: str | None = None

    def __post_init__(self) -> None:
        if self.save_every < 0:
            raise ValueError(f"save_every must be >= 0, got {self.save_every}")
        if self.save_every and not self.path:
            raise ValueError("saving every N steps needs a checkpoint directory (--checkpoint DIR)")

    def due(self, steps_done: int) -> bool:
        return bool(self.save_every) and steps_done % self.save_every == 0


def parallelize(spec: RunSpec, model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """The tensor-parallel plan on mesh["tp"], then data parallelism on mesh["dp"] (torchtitan's order)."""
    tp_mesh = mesh["tp"] if spec.dp > 1 else mesh
    so_parallel.parallelize_module(model, tp_mesh, plan(spec, so_parallel))
    replicate_norms_off_plan(spec, model, tp_mesh, so_parallel.distribute_module)
    if spec.dp > 1:
        apply_data_parallel(spec, model, mesh["dp"], so_fsdp.fully_shard, so_fsdp.replicate)
    return model


def global_loss(loss: torch.Tensor, mesh: Any, spec: RunSpec) -> float:
    """The whole batch's loss from this rank's mean: averaged over dp (even slices), as one device reads it."""
    if spec.dp == 1:
        return (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()
    # the dp average and the loss's own pending tp reduction (if any) in one read over the whole mesh
    tp_placements = list(loss.placements) if isinstance(loss, DTensor) else [Replicate()]
    local = loss.to_local() if isinstance(loss, DTensor) else loss
    return from_local(local.detach() / spec.dp, mesh, [Partial("sum"), *tp_placements]).full_tensor().item()


def train_rank(
    spec: RunSpec,
    on_step: Callable[[int, StepRecord], None] | None = None,
    first_grads: bool = False,
    checkpointing: Checkpointing = Checkpointing(),
) -> dict[str, Any]:
    """One rank of shardops training (inside so.run, or a torch.distributed process); rank 0 calls
    `on_step(step, record)`. The result's records cover the steps this call ran: from
    `first_step` (0, or the step a resumed checkpoint was saved at) to `spec.steps`.

    `first_grads`: also return the first step's gradients as full tensors (their reads then count in
    that step's backward part: for tests, not for measurements).
    """
    torch.manual_seed(spec.seed)  # DTensor dropout masks: the same counter-based stream on every rank
    names = ("dp", "tp") if len(spec.mesh_shape) == 2 else ("tp",)
    mesh = init_device_mesh("cpu", spec.mesh_shape, mesh_dim_names=names)
    model = parallelize(spec, build(spec), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    dp_rank = mesh.own_coordinate()[0] if spec.dp > 1 else 0
    progress = {"step": 0}
    state = {"model": model, "optim": opt, "rng": so_checkpoint.RandomState(), "progress": progress}
    if checkpointing.resume:
        so_checkpoint.load(state, checkpointing.resume)
    first = progress["step"]
    if first >= spec.steps:
        raise NothingToResume(
            f"the checkpoint {checkpointing.resume} was saved after step {first}: nothing left of {spec.steps} steps "
            "(raise --steps)"
        )
    report = (lambda i, record: on_step(first + i, record)) if on_step is not None and mesh.get_rank() == 0 else None
    run = Steps(ShardopsMeter, report)
    grads: dict[str, torch.Tensor] = {}
    for step in range(first, spec.steps):
        run.start()
        inputs, targets = spec.local_batch(step, dp_rank)
        with run.timed("zero_grad"):
            opt.zero_grad()
        with run.timed("forward"):
            logits = model(inputs)
        with run.timed("loss"), so_parallel.loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
        with run.timed("backward"):
            with so_parallel.loss_parallel():
                loss.backward()
            if first_grads and step == first:
                grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        with run.timed("optimizer"):
            opt.step()
        with run.timed("loss_read"):
            run.finish(global_loss(loss, mesh, spec))
        run.done()
        progress["step"] = step + 1
        if checkpointing.due(step + 1):
            so_checkpoint.save(state, checkpointing.path)
    params = {n: _full(p) for n, p in model.named_parameters()}
    return {"records": run.records, "params": params, "grads": grads, "first_step": first}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
