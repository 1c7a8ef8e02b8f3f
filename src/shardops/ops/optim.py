"""Optimizer ops torch.optim reaches that the pointwise table does not cover.

- `_foreach_maximum_` / `_foreach_minimum_` (AdamW amsgrad with foreach): the in-place
  list ops have no single-tensor in-place twin in aten, so each element runs as
  `clamp_min_` / `clamp_max_` (scalar forms) or `copy_(maximum(a, b))` (list form).
- `_fused_adam(w)_`, `_fused_sgd_`, `_fused_adagrad_` (fused=True): elementwise within each
  parameter's group (param, grad, states), so the fused kernel runs on the local
  shards as they are, provided every tensor of a group is laid out like its
  parameter. A gradient in another layout (a pending Partial(sum)) is moved to the
  parameter's layout first, as any other read of it would; states in another layout
  than their parameter are refused (they are made by zeros_like(param), so this
  means a user moved them).
"""

from __future__ import annotations

from typing import Any

import torch

from ..dispatch.registry import decomposition
from ..errors import ShardingError

aten = torch.ops.aten


def _foreach_extremum_(clamp_, binary):
    def run(selves, others):
        for i, s in enumerate(selves):
            other = others[i] if isinstance(others, (list, tuple)) else others
            if isinstance(other, torch.Tensor):
                s.copy_(binary(s, other))
            else:
                clamp_(s, other)
        return None  # torch requires None from an in-place foreach op

    return run


decomposition(aten._foreach_maximum_)(_foreach_extremum_(aten.clamp_min_, aten.maximum))  # every overload (a packet)
decomposition(aten._foreach_minimum_)(_foreach_extremum_(aten.clamp_max_, aten.minimum))


def _fused_on_shards(op):
    """Run a fused optimizer kernel on each rank's shards (see module doc)."""

    def run(params, *lists_and_rest: Any, **kwargs: Any):
        lists = [a for a in lists_and_rest if isinstance(a, (list, tuple))]
        rest = [a for a in lists_and_rest if not isinstance(a, (list, tuple))]
        if rest:
            raise ShardingError(f"{op}: unexpected positional arguments {rest}")
        grads_index = 0  # every fused optimizer's second list argument is the gradients
        with torch.no_grad():
            local_lists = [[_local(p) for p in params]]
            for k, tensors in enumerate(lists):
                local_lists.append(
                    [
                        _group_local(op, t, params[i] if i < len(params) else None, k == grads_index)
                        for i, t in enumerate(tensors)
                    ]
                )
            op(*local_lists, **{k: _local(v) for k, v in kwargs.items()})
        return None

    return run


for _packet in (aten._fused_adam_, aten._fused_adamw_, aten._fused_sgd_, aten._fused_adagrad_):
    for _name in _packet.overloads():
        decomposition(getattr(_packet, _name))(_fused_on_shards(getattr(_packet, _name)))


def _group_local(op, t, param, is_grad: bool):
    """`t`'s local shard, laid out like its parameter (a gradient is moved there; a state must already be)."""
    from ..tensor import DTensor

    if (
        isinstance(t, DTensor)
        and isinstance(param, DTensor)
        and t.ndim == param.ndim
        and t.placements != param.placements
    ):
        if not is_grad:
            raise ShardingError(
                f"{op}: optimizer state {list(t.placements)} is laid out unlike its parameter "
                f"{list(param.placements)}; make states with zeros_like(param), or redistribute them"
            )
        t = t.redistribute(placements=param.placements)
    return _local(t)


def _local(t):
    from ..tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
