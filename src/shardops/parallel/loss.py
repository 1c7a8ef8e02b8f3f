"""loss_parallel(): torch's context manager for cross-entropy on class-sharded logits.

shardops' cross-entropy and nll_loss are vocabulary-parallel on any DTensor already
(one round of small statistics forward, a local backward), so nothing has to be
switched on: code written for torch runs unchanged inside the block, forward and
backward, and outside it too. What the block adds: a plain-tensor target next to
logits whose batch is sharded (data parallelism on a (dp, tp) mesh) is taken as
this rank's shard of the target, laid out like the logits without the class dim
(torch refuses a plain target there and asks for a DTensor).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..errors import ShardingError
from ..placements import Placement, Replicate, Shard
from ..tensor import DTensor, from_local

__all__ = ["loss_parallel"]

_LOSSES = (F.cross_entropy, F.nll_loss)


def target_placements(input_placements: tuple[Placement, ...], class_dim: int) -> tuple[Placement, ...]:
    """The target's layout for logits laid out as given: the class dim dropped."""
    out: list[Placement] = []
    for p in input_placements:
        if p.is_shard() and p.dim != class_dim:
            out.append(Shard(p.dim - 1 if p.dim > class_dim else p.dim))
        else:
            out.append(Replicate())
    return tuple(out)


def _check_placements(placements: tuple[Placement, ...], class_dim: int) -> None:
    """torch's loss_parallel() refusal of a pending (Partial) mesh dim, as the same ValueError (torch's
    phrase first). Deliberately allowed here, where torch refuses: the class dim sharded over several
    mesh dims, or over none (shardops' cross-entropy is exact on any layout; docs/parallel.md)."""
    for i, p in enumerate(placements):
        if not (p.is_shard() or p.is_replicate()):
            raise ShardingError(
                f"loss_parallel() expects non-TP mesh dims to be Shard or Replicate, got {p} at dim {i}. shardops: "
                "the logits are a pending reduction there, not logits; redistribute them (to Replicate or Shard) first."
            )


class _TargetAsLocalShard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _LOSSES and len(args) >= 1 and isinstance(args[0], DTensor):
            args = list(args)
            logits = args[0]
            _check_placements(logits.placements, 1 if logits.ndim >= 2 else 0)
            if len(args) >= 2:
                args[1] = self._wrap(logits, args[1])
            elif "target" in kwargs:
                kwargs["target"] = self._wrap(logits, kwargs["target"])
        return func(*args, **kwargs)

    @staticmethod
    def _wrap(logits: DTensor, target):
        if isinstance(target, DTensor) or not isinstance(target, torch.Tensor):
            return target
        class_dim = 1 if logits.ndim >= 2 else 0
        placements = target_placements(logits.placements, class_dim)
        if all(p.is_replicate() for p in placements):
            return target  # a plain operand is taken as Replicate anyway
        return from_local(target, logits.device_mesh, placements)


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Loss parallelism as torch's `loss_parallel()`: F.cross_entropy / nn.CrossEntropyLoss on
    class-sharded DTensor logits, its backward inside or outside the block."""
    with _TargetAsLocalShard():
        yield
