"""shardops' side of the training comparison: the same model and plan through
`shardops.parallel`, in the threads world (`so.run`) or one process per rank.

Data parallelism: `data_parallel(model, mesh, mode)` over the dp mesh dim. A
replicated weight's gradient stays pending (Partial(sum)) after backward and is
resolved once, on its first read by the optimizer — so the grad_sync part is
empty here and its bytes show up in the optimizer part.

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
from .. import parallel as so_parallel
from ..comm.base import CommDebugMode
from ..mesh import init_device_mesh
from ..placements import Replicate, Shard
from ..tensor import DTensor, from_local
from .config import RunSpec, build, plan
from .loop import StepRecord, Steps, batch


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
    tp_mesh = mesh["tp"] if spec.dp > 1 else mesh
    so_parallel.parallelize_module(model, tp_mesh, plan(spec, so_parallel))
    if spec.dp > 1:
        so_parallel.data_parallel(model, mesh, mode=spec.dp_mode)
    return model


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
    rows = spec.batch_size // spec.dp
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
        inputs, targets = (t[dp_rank * rows : (dp_rank + 1) * rows] for t in batch(spec.cfg, spec.batch_size, step))
        if spec.dp > 1:  # this dp rank's rows of the target, said explicitly (as torch's loss_parallel asks)
            targets = from_local(targets, mesh, [Shard(0), Replicate()])
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
            run.finish((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
        run.done()
        progress["step"] = step + 1
        if checkpointing.due(step + 1):
            so_checkpoint.save(state, checkpointing.path)
    params = {n: _full(p) for n, p in model.named_parameters()}
    return {"records": run.records, "params": params, "grads": grads, "first_step": first}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
