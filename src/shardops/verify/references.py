"""Samples made ready once per op and dtype: the ones torch accepts, with torch's results and gradients.

For each dtype in DTYPES, up to SAMPLES_PER_DTYPE samples from the op's
generator (samples.py); torch computes the reference outputs and, where it can
differentiate the op, the input gradients of sum(out * g) for a fixed random g.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch

from .._torch import pytree
from ..notation import tensor_text
from . import samples
from .targets import Target

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.int64, torch.bool)
SAMPLES_PER_DTYPE = 3


@dataclass
class Prepared:
    """A sample in one dtype that single-device torch accepts, with its reference results."""

    sample: samples.Sample
    dtype: torch.dtype
    tensors: list[torch.Tensor]  # tensor leaves of (args, kwargs), in pytree order
    tree: Any
    leaves: list[Any]
    ref_out: list[Any]
    grad_out: list[torch.Tensor | None]  # g per output leaf (None: not differentiated)
    ref_grads: list[torch.Tensor | None] | None  # per tensor leaf; None: no gradient check

    @property
    def label(self) -> str:
        shapes = ", ".join(tensor_text(t) for t in self.tensors)
        statics = [repr(v) for v in self.leaves if not isinstance(v, torch.Tensor)]
        return f"{shapes}" + (f"; {', '.join(statics)}" if statics else "")


def call(fn, tree, leaves):
    args, kwargs = pytree.tree_unflatten(leaves, tree)
    return fn(*args, **kwargs)


def differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def reference(
    target: Target, tree, leaves: list[Any], grad_out: list[torch.Tensor | None] | None, g: torch.Generator | None
):
    """The op on full tensors: output leaves, the g used per output, and input gradients of sum(out * g)."""
    with torch.no_grad():
        out = pytree.tree_leaves(call(target.reference, tree, leaves))
    try:
        grad_out, grads = _reference_grads(target, tree, leaves, grad_out, g)
    except Exception:  # noqa: BLE001 - torch cannot differentiate this op: values only
        grad_out, grads = [None] * len(out), None
    return out, grad_out, grads


def _reference_grads(target: Target, tree, leaves: list[Any], grad_out, g):
    """g per output (drawn now unless given) and d sum(out * g) / d input, one per tensor leaf (None: no check)."""
    inputs = [x.detach().clone().requires_grad_(True) if differentiable(x) else x for x in leaves]
    with torch.enable_grad():
        got = pytree.tree_leaves(call(target.reference, tree, inputs))
    if grad_out is None:
        grad_out = [
            samples.make_tensor(o.shape, o.dtype, g) if differentiable(o) and o.requires_grad else None for o in got
        ]
    terms = [
        (o * w).sum()
        for o, w in zip(got, grad_out)
        if w is not None and isinstance(o, torch.Tensor) and o.requires_grad
    ]
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if not terms or not wrt:
        return [None] * len(got), None
    grads = iter(torch.autograd.grad(sum(terms), wrt, allow_unused=True))
    return grad_out, [next(grads) if x.requires_grad else None for x in inputs if isinstance(x, torch.Tensor)]


def prepare(target: Target, seed: int) -> tuple[list[Prepared], str | None]:
    """Every (sample, dtype) the reference accepts; the first rejection's reason if none is accepted."""
    prepared, reason = [], None
    if target.generator is None:
        return [], "no sample generator matches this op (add a row to verify_samples.SAMPLES)"
    for dtype in DTYPES:
        g = torch.Generator().manual_seed(seed_key(target.name, dtype, seed))
        for k in range(SAMPLES_PER_DTYPE):
            try:
                s = target.generator(target.fn, dtype, g, k)
                if s is None:
                    continue
                leaves, tree = pytree.tree_flatten((s.args, s.kwargs))
                out, grad_out, grads = reference(target, tree, leaves, None, g)
            except Exception as e:  # noqa: BLE001 - torch rejects this sample (dtype, domain): not a failure
                reason = reason or f"torch rejects every sample ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
                continue
            tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
            if (
                not s.check_values
                or not any(t.is_floating_point() for t in tensors)
                or target.reference is not target.fn
            ):
                grads = None  # a hand-written reference stands in for an op torch cannot run, let alone differentiate
            prepared.append(Prepared(s, dtype, tensors, tree, leaves, out, grad_out, grads))
    return prepared, (None if prepared else reason or "the generator gave no sample for any dtype")


def seed_key(*parts: Any) -> int:
    return zlib.crc32("|".join(map(str, parts)).encode())
