"""The single-device reference of a training comparison, with the dropout masks the sharded side draws.

Without dropout the reference is plain single-device training from the same initial weights.

With dropout, single-device torch draws its masks from torch's CPU generator; shardops' random
ops on DTensors use a layout-invariant counter-based generator (shardops/rng.py): after
`torch.manual_seed(s)` every mesh and layout draws the same global mask, which is not torch's.
So the reference trains on plain tensors, on one device, exactly as without dropout, except that
each `nn.Dropout` takes its mask from shardops' generator: the same draw on a one-rank mesh (the
whole tensor on one rank), in the same order, from the same seed. It then checks the sharded run's
arithmetic and that its masks are those of the global tensor, whatever the tensor-parallel layout.

Under data parallelism (fully_shard / replicate) activations carry each rank's own batch slice,
and every rank, seeded alike, draws the same mask for its slice (as torch's ranks do): the
reference draws the mask of one slice and repeats it over the dp slices of the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..mesh import init_device_mesh
from ..placements import Replicate
from ..tensor import DTensor, distribute_tensor
from .config import RunSpec, build
from .loop import train_reference


class LayoutInvariantDropout(torch.nn.Module):
    """`nn.Dropout` on a plain tensor with shardops' mask of the same global tensor."""

    def __init__(self, p: float, mesh: Any, dp: int = 1) -> None:
        super().__init__()
        self.p = p
        self.mesh = mesh
        self.dp = dp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        one_slice = (x.shape[0] // self.dp, *x.shape[1:])  # what each data-parallel rank draws for
        ones = distribute_tensor(torch.ones(one_slice, dtype=x.dtype), self.mesh, [Replicate()])
        dropped = F.dropout(ones, self.p, training=True)
        assert isinstance(dropped, DTensor)  # an op on a DTensor gives one
        scaled_mask = dropped.to_local()  # 0 or 1/(1-p)
        return x * scaled_mask.repeat(self.dp, *([1] * (x.ndim - 1)))


def reference(spec: RunSpec) -> dict[str, Any]:
    """Single-device training of `spec` (records, final parameters, first gradients); with dropout,
    shardops' masks (see the module docstring)."""
    if spec.cfg.dropout == 0:
        return train_reference(build(spec), spec.cfg, spec.batch_size, spec.steps, spec.lr)
    from ..world import run

    return run(_reference_with_shardops_masks, 1, spec, timeout=600)[0]


def _reference_with_shardops_masks(spec: RunSpec) -> dict[str, Any]:
    torch.manual_seed(spec.seed)  # as every rank of the sharded run
    mesh = init_device_mesh("cpu", (1,))
    model = build(spec)
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Dropout):
            parent, _, leaf = name.rpartition(".")
            setattr(
                model.get_submodule(parent) if parent else model, leaf, LayoutInvariantDropout(module.p, mesh, spec.dp)
            )
    return train_reference(model, spec.cfg, spec.batch_size, spec.steps, spec.lr)
