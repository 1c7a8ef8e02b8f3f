"""`x[basic index] = value` on a DTensor sharded along an indexed dim: each rank writes its part.

Basic indexing (ints and slices, with Ellipsis) along a sharded dim would otherwise go
through slice/select, which along a sharded dim build new data (ops/indexing.py), and the
write through it is refused (tensor.py). Here each rank intersects the index with the rows
it holds along every dim and writes those elements of the broadcast value into its own
shard: exact, no collective for a scalar or a replicated value (a sharded DTensor value is
gathered first). Anything else (advanced or boolean indices, None, a pending self, autograd
through the write, a plain tensor value of more than 0 dims) takes torch's path.
"""

from __future__ import annotations

from typing import Any

import torch

from ..dispatch.registry import torch_level
from ..dispatch.schema import CallSignature
from ..placements import Placement, Shard, StridedShard
from ..wrapping import local_of, spec_of
from .indexing import _positions

_PLAIN_VALUES = (int, float, bool, complex)


def _setitem_call(self, indices, values): ...  # noqa: E704  (Tensor.__setitem__'s form)


def _per_dim(index: Any, ndim: int) -> list[int | slice] | None:
    """The index as one int or slice per dim; None where it is not basic (tensors, lists, None, bools)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(i is None or isinstance(i, bool) or not isinstance(i, (int, slice, type(Ellipsis))) for i in items):
        return None
    if any(
        isinstance(i, slice) and not all(v is None or type(v) is int for v in (i.start, i.stop, i.step)) for i in items
    ):
        return None
    if sum(i is Ellipsis for i in items) > 1:
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at : at + 1] = [slice(None)] * (ndim - len(items) + 1)
    if len(items) > ndim:
        return None  # torch raises its own IndexError
    return items + [slice(None)] * (ndim - len(items))


def _sharded_dims(placements: tuple[Placement, ...]) -> set[int]:
    return {p.dim for p in placements if isinstance(p, (Shard, StridedShard))}


def _parse_setitem(b: dict, *_) -> tuple | None:
    """(x, per-dim index, value) where each rank can write its part; None: torch's path."""
    from ..tensor import DTensor

    x, value = b["self"], b["values"]
    if type(x) is not DTensor or x._copied_view is not None:  # a copy's writes must reach dispatch's refusal
        return None
    spec = spec_of(x)
    items = _per_dim(b["indices"], x.ndim)
    if items is None or any(p.is_partial() for p in spec.placements):
        return None
    if not any(items[d] != slice(None) for d in _sharded_dims(spec.placements)):
        return None  # every sharded dim kept whole: the local view aliases, torch's path writes through it
    if torch.is_grad_enabled() and (x.requires_grad or getattr(value, "requires_grad", False)):
        return None  # autograd must record the write
    if isinstance(value, DTensor):
        if spec_of(value).mesh != spec.mesh:
            return None
    elif not isinstance(value, _PLAIN_VALUES) and not (isinstance(value, torch.Tensor) and value.ndim == 0):
        return None
    return x, items, value


def _write_locally(x, items: list[int | slice], value: Any) -> None:
    """Write the elements of `value` (broadcast to the selection) that land in this rank's shard."""
    from ..tensor import DTensor

    spec, local = spec_of(x), local_of(x)
    mesh, coord = spec.mesh, spec.mesh.get_coordinate()
    sharded = _sharded_dims(spec.placements)
    selection, where, taken = [], [], []
    for d, item in enumerate(items):
        n = spec.shape[d]
        if isinstance(item, int):
            if not -n <= item < n:
                raise IndexError(f"index {item} is out of bounds for dimension {d} with size {n}")
            start, stop, step = item % n, item % n + 1, 1
        else:
            start, stop, step = item.indices(n)
            if step <= 0:
                raise ValueError("step must be greater than zero")
            selection.append(len(range(start, stop, step)))
        held = _positions(n, d, spec.placements, mesh, coord) if d in sharded else torch.arange(local.shape[d])
        hit = ((held >= start) & (held < stop) & ((held - start) % step == 0)).nonzero().flatten()
        where.append(hit)  # this rank's local positions along d that the index selects
        taken.append((held[hit] - start) // step)  # their positions in the selection
    whole = value.full_tensor() if isinstance(value, DTensor) else torch.as_tensor(value)
    whole = whole.to(dtype=local.dtype, device=local.device)
    while whole.ndim > len(selection) and whole.shape[0] == 1:
        whole = whole[0]  # torch drops leading size-1 dims of the value
    whole = whole.expand(selection)
    for d, item in enumerate(items):
        if isinstance(item, int):
            whole = whole.unsqueeze(d)  # the selected element's dim, back as size 1
    with torch.no_grad():
        local[_outer(where)] = whole[_outer(taken)]


def _outer(per_dim: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Index tensors that select the outer product of per-dim positions (one broadcast dim each)."""
    ndim = len(per_dim)
    return tuple(p.view([-1 if k == d else 1 for k in range(ndim)]) for d, p in enumerate(per_dim))


torch_level(torch.Tensor.__setitem__, signature=CallSignature(_setitem_call), apply=_write_locally)(_parse_setitem)
