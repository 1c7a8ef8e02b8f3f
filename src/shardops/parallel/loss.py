"""loss_parallel(): torch's context manager for cross-entropy on class-sharded logits.

shardops' cross-entropy and nll_loss are vocabulary-parallel on any DTensor already
(one round of small statistics forward, a local backward), so nothing has to be
switched on: code written for torch runs unchanged inside the block, forward and
backward, and outside it too. What the block adds is torch's handling of plain
operands: a plain `weight`, and a plain target where the logits' layout asks for a
replicated one, are made Replicate DTensors on the logits' mesh (explicitly, with
from_local: the caller vouches that every rank holds the same values, as torch
assumes). A plain target next to logits whose batch (or any non-class dim) is
sharded raises torch's ValueError: it could be the global target or this rank's
piece, so it must come as a DTensor (`DTensor.from_local(target, mesh, placements)`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..errors import ShardingError
from ..placements import Placement, Replicate, Shard, StridedShard
from ..tensor import DTensor, from_local

__all__ = ["loss_parallel"]

_LOSSES = (F.cross_entropy, F.nll_loss)


def target_placements(input_placements: tuple[Placement, ...], class_dim: int) -> tuple[Placement, ...]:
    """The target's layout for logits laid out as given: the class dim dropped."""
    out: list[Placement] = []
    for p in input_placements:
        if isinstance(p, (Shard, StridedShard)) and p.dim != class_dim:
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


class _PlainOperandsAsTorch(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _LOSSES and len(args) >= 1 and isinstance(args[0], DTensor):
            args = list(args)
            logits = args[0]
            _check_placements(logits.placements, 1 if logits.ndim >= 2 else 0)
            if len(args) >= 2:
                args[1] = _target_dtensor(logits, args[1])
            elif "target" in kwargs:
                kwargs["target"] = _target_dtensor(logits, kwargs["target"])
            if len(args) >= 3:
                args[2] = _replicated(logits, args[2])
            elif kwargs.get("weight") is not None:
                kwargs["weight"] = _replicated(logits, kwargs["weight"])
        return func(*args, **kwargs)


def _target_dtensor(logits: DTensor, target):
    """A plain target as a DTensor laid out like the logits without the class dim: Replicate only
    (torch's rule); one that would be sharded is ambiguous (global, or this rank's piece?) and raises."""
    if isinstance(target, DTensor) or not isinstance(target, torch.Tensor):
        return target
    placements = target_placements(logits.placements, 1 if logits.ndim >= 2 else 0)
    if any(p.is_shard() for p in placements):
        raise ShardingError(
            "loss_parallel() requires a DTensor (not a plain torch.Tensor) when the derived placements "
            f"{list(placements)} contain Shard: the logits {list(logits.placements)} shard a non-class dim (e.g. the "
            "batch or the sequence), so a plain target could be the global one or this rank's piece. Wrap it "
            f"with DTensor.from_local(target, mesh, {list(placements)}) (this rank's piece) or distribute_tensor (the "
            "global one)."
        )
    return _replicated(logits, target)


def _replicated(logits: DTensor, t):
    """A plain tensor as a Replicate DTensor on the logits' mesh (each rank's copy,
    as torch's loss_parallel takes it)."""
    if isinstance(t, DTensor) or not isinstance(t, torch.Tensor):
        return t
    return from_local(t, logits.device_mesh, [Replicate()] * logits.device_mesh.ndim)


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Loss parallelism as torch's `loss_parallel()`: F.cross_entropy / nn.CrossEntropyLoss on
    class-sharded DTensor logits, its backward inside or outside the block."""
    with _PlainOperandsAsTorch():
        yield
