"""A DTensor wrapper's own torch-level metadata, which torch has no public setter for (tensor internals).

The wrapper (tensor.py) is a tensor of its own: torch's dispatch keys and guards read its
lazy bits, sizes and strides before our __torch_dispatch__ runs, so they must match what
the local shard says. The torch private calls this needs (from shardops._torch.dispatch) are
made here, beside tensor.py and used only by it and its seam (wrapping.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._torch.dispatch import DisableTorchDispatch, DisableTorchFunctionSubclass, set_conj, set_neg


def mirror_lazy_bits(wrapper: torch.Tensor, local: torch.Tensor) -> None:
    """Give a DTensor the lazy conjugate / negative bits its local tensor carries.

    `_conj` and `_neg_view` only set a bit on their (local) output. torch's Conjugate and
    Negative dispatch keys, which materialise the bit for ops that do not understand it,
    run before a subclass's __torch_dispatch__ and look at the wrapper: a wrapper without
    the bit would hand the raw, unconjugated values to every later op (f*f instead of
    conj(f)*f).
    """
    set_conj(wrapper, local.is_conj())
    set_neg(wrapper, local.is_neg())


def restride_wrapper(wrapper: torch.Tensor, size: Sequence[int], stride: Sequence[int]) -> None:
    """Give the wrapper tensor itself `size` and `stride`, as torch's in-place view would.

    An in-place view (squeeze_, unsqueeze_, transpose_, t_) changes its argument's sizes.
    The wrapper's are torch's own metadata: only `as_strided_` on the wrapper changes them,
    and that call must reach torch's kernel, not our __torch_function__ / __torch_dispatch__
    (which would plan it as a sharded op). torch has no public switch for the latter.
    """
    with DisableTorchFunctionSubclass(), DisableTorchDispatch():
        torch.ops.aten.as_strided_(wrapper, size, stride, wrapper.storage_offset())
