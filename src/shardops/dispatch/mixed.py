"""Plain torch.Tensor operands next to DTensors in one op: torch DTensor's rule.

A plain tensor holds whatever this rank computed; nothing says it is equal on
every rank, so taking it as Replicate can label rank-varying data as one global
tensor (a silently wrong result). As torch does, only a tensor of one element
(a 0-d scalar tensor, or a numel-1 tensor with a warning) and the 1-d empty
placeholder torch.cat skips (no values, no layout) are taken as Replicate; any
other plain operand raises, naming the op and the ways to convert it. Inside
`implicit_replication()` (torch's experimental opt-in) every plain operand is
taken as Replicate: the caller vouches that the ranks hold equal copies
(`so.set_debug(True)` checks it).

The switch is a context variable: per rank thread under `so.run` (each rank
thread starts from a copy of its caller's context, so a block around `so.run`
reaches every rank), per process under torchrun.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from .._torch.autograd import in_backward
from ..errors import ShardingError

_IMPLICIT = ContextVar("shardops_implicit_replication", default=False)


@contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside the block, plain tensors mixed with DTensors are taken as Replicate (torch's
    `torch.distributed.tensor.experimental.implicit_replication`). The caller vouches that every
    rank holds the same values; where they differ the results are wrong (`so.set_debug(True)`
    raises instead, naming the operand)."""
    token = _IMPLICIT.set(True)
    try:
        yield
    finally:
        _IMPLICIT.reset(token)


def implicit_replication_enabled() -> bool:
    return _IMPLICIT.get()


def check_plain_operand(func, t: torch.Tensor) -> None:
    """Raise unless the plain tensor `t`, an operand of `func` beside DTensors, may be taken as Replicate
    (as torch, on a one-rank mesh too: the code must not change meaning when the mesh grows)."""
    if t.numel() == 1:
        if t.ndim == 1:  # torch's warning, for the same case
            warnings.warn(
                f"{func}: a plain tensor with one element and ndim=1 is taken as a replicated DTensor; "
                "make it a 0-d tensor, or a DTensor with DTensor.from_local.",
                stacklevel=3,
            )
        return
    if _IMPLICIT.get() or t.shape == (0,):  # (0,): the empty placeholder torch.cat skips (a cache's first keys)
        return
    if in_backward():
        # torch's derivative formulas make constant tensors from saved shapes (index_put's zeros for its
        # values, prod's ones): plain, the same on every rank, beside the DTensor gradients
        return
    raise ShardingError(
        f"{func}: got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor before calling "
        f"distributed operators! (a plain tensor of shape {list(t.shape)} met a DTensor; shardops cannot know whether "
        "it holds the same values on every rank.) Convert it with DTensor.from_local(t, mesh, placements) (this rank's "
        "piece) or so.distribute_tensor; if a module's forward reads its parameters outside a parallel style (e.g. "
        "nn.MultiheadAttention reads out_proj.weight without calling out_proj), give that module a style in the plan; "
        "where every rank holds the same values, shardops.experimental.implicit_replication() takes them as Replicate."
    )
