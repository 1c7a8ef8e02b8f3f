"""shardops' side of the training comparison: the same model and plan through
`shardops.parallel`, in the threads world (`so.run`) or one process per rank.

Data parallelism: `data_parallel(model, mesh, mode)` over the dp mesh dim. A
replicated weight's gradient stays pending (Partial(sum)) after backward and is
resolved once, on its first read by the optimizer — so the grad_sync part is
empty here and its bytes show up in the optimizer part.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import parallel as so_parallel
from ..comm.base import CommDebugMode
from ..mesh import init_device_mesh
from ..tensor import DTensor
from .config import RunSpec, build, plan
from .loop import StepRecord, batch, run_steps, step_parts


class ShardopsMeter:
    """so.CommDebugMode as a training-loop meter."""

    def __enter__(self) -> "ShardopsMeter":
        self._comm = CommDebugMode()
        self._comm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._comm.__exit__(*exc)

    def counts(self) -> dict[str, int]:
        return dict(self._comm.get_comm_counts())

    def bytes(self) -> int:
        return int(self._comm.get_total_bytes())


def parallelize(spec: RunSpec, model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    tp_mesh = mesh["tp"] if spec.dp > 1 else mesh
    so_parallel.parallelize_module(model, tp_mesh, plan(spec, so_parallel))
    if spec.dp > 1:
        so_parallel.data_parallel(model, mesh, mode=spec.dp_mode)
    return model


def train_rank(spec: RunSpec, on_step: Callable[[int, StepRecord], None] | None = None, first_grads: bool = False) -> dict[str, Any]:
    """One rank of shardops training (inside so.run, or a torch.distributed process); rank 0 calls `on_step`.

    `first_grads`: also return the first step's gradients as full tensors (their reads then count in
    that step's backward part: for tests, not for measurements).
    """
    names = ("dp", "tp") if len(spec.mesh_shape) == 2 else ("tp",)
    mesh = init_device_mesh("cpu", spec.mesh_shape, mesh_dim_names=names)
    model = parallelize(spec, build(spec), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    dp_rank = mesh.get_coordinate()[0] if spec.dp > 1 else 0
    rows = spec.batch_size // spec.dp

    def forward(s: dict) -> None:
        inputs, targets = batch(spec.cfg, spec.batch_size, s["step"])
        s["inputs"] = inputs[dp_rank * rows : (dp_rank + 1) * rows]
        s["targets"] = targets[dp_rank * rows : (dp_rank + 1) * rows]
        s["logits"] = model(s["inputs"])

    def loss(s: dict) -> None:
        with so_parallel.loss_parallel():
            s["loss"] = F.cross_entropy(s["logits"].flatten(0, 1), s["targets"].flatten(0, 1))

    grads: dict[str, torch.Tensor] = {}

    def backward(s: dict) -> None:
        with so_parallel.loss_parallel():
            s["loss"].backward()
        if first_grads and s["step"] == 0:
            grads.update({n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})

    def loss_read(s: dict) -> None:
        value = s["loss"].full_tensor() if isinstance(s["loss"], DTensor) else s["loss"]
        s["loss_value"] = value.item()

    parts = step_parts(opt, forward, loss, backward, loss_read)
    records = run_steps(parts, spec.steps, ShardopsMeter, on_step if mesh.get_rank() == 0 else None)
    params = {n: _full(p) for n, p in model.named_parameters()}
    return {"records": records, "params": params, "grads": grads}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
