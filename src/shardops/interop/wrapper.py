"""A DTensor wrapper's own sizes and strides (torch private dispatch guards, kept in interop)."""
from __future__ import annotations

from typing import Sequence

import torch


def restride_wrapper(wrapper: torch.Tensor, size: Sequence[int], stride: Sequence[int]) -> None:
    """Give the wrapper tensor itself `size` and `stride`, as torch's in-place view would.

    An in-place view (squeeze_, unsqueeze_, transpose_, t_) changes its argument's sizes.
    The wrapper's are torch's own metadata: only `as_strided_` on the wrapper changes them,
    and that call must reach torch's kernel, not our __torch_function__ / __torch_dispatch__
    (which would plan it as a sharded op). torch has no public switch for the latter, hence
    this module.
    """
    with torch._C.DisableTorchFunctionSubclass(), torch._C._DisableTorchDispatch():
        torch.ops.aten.as_strided_(wrapper, size, stride, wrapper.storage_offset())
