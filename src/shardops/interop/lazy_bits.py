"""The lazy conjugate / negative bits of a DTensor wrapper (torch private setters, kept in interop)."""
from __future__ import annotations

import torch


def mirror_lazy_bits(wrapper: torch.Tensor, local: torch.Tensor) -> None:
    """Give a DTensor the lazy conjugate / negative bits its local tensor carries.

    `_conj` and `_neg_view` only set a bit on their (local) output. torch's Conjugate and
    Negative dispatch keys, which materialise the bit for ops that do not understand it,
    run before a subclass's __torch_dispatch__ and look at the wrapper: a wrapper without
    the bit would hand the raw, unconjugated values to every later op (f*f instead of
    conj(f)*f). torch has no public setter for these bits, hence this module.
    """
    torch._C._set_conj(wrapper, local.is_conj())
    torch._C._set_neg(wrapper, local.is_neg())
