"""The hooks that drive a unit through a step, and the root that closes each backward.

pre-forward    the root's first forward finds every unit below it (lazy init); unshard
               (one all_gather, or finish its prefetch); start gathering
               set_modules_to_forward_prefetch's units; an autograd function on the
               inputs that need a gradient runs the unit's post-backward once their
               gradients are computed
post-forward   reshard if reshard_after_forward (free the unsharded storage); a hook on
               the outputs' gradients runs the unit's pre-backward
pre-backward   unshard again if resharded (finishing a prefetch); the root queues its
               end-of-backward callback; start gathering set_modules_to_backward_prefetch's
               units (asynchronous in the torch.distributed world)
post-backward  reshard; reduce-scatter the unit's gradients
end of backward (root) the post-backward of every unit whose inputs needed no gradient
               (the root's own, whose inputs are data), so nothing is left for the step
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook

from .._torch import pytree
from .._torch.autograd import queue_end_of_backward
from ._unit import FSDPUnit

STATE_ATTR = "_shardops_fsdp_state"


class RootState:
    """The units one root's forward runs, and whether its end-of-backward is queued."""

    def __init__(self, root: FSDPUnit) -> None:
        self.root = root
        self.units: list[FSDPUnit] = []
        self.callback_queued = False

    def finish_backward(self) -> None:
        self.callback_queued = False
        for unit in self.units:
            if unit.pending_backward or unit.holds_unsharded_grads():
                post_backward(unit)
            # several forwards before their backwards (micro-batches, a pipeline stage): a forward
            # whose backward has not run yet keeps the unit pending for that later backward
            unit.pending_backward = unit.inputs_pending > 0
            unit.forwards_in_pass = 0
            if unit.gathering is not None and not unit.pending_backward:
                unit.reshard()  # a prefetch whose backward never came


def unit_of(module: nn.Module) -> FSDPUnit | None:
    return module.__dict__.get(STATE_ATTR)


def install_hooks(module: nn.Module, unit: FSDPUnit) -> None:
    module.__dict__[STATE_ATTR] = unit
    module.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(_post_forward, prepend=False)


def _lazy_init(module: nn.Module, unit: FSDPUnit) -> None:
    """This unit is a root: the first unit whose forward runs with no root above it."""
    root = RootState(unit)
    for sub in module.modules():
        found = unit_of(sub)
        if found is not None and found.root is None and found not in root.units:
            found.root = root
            root.units.append(found)
    for found in root.units:
        if found.reshard_after_forward is None:
            found.reshard_after_forward = found is not unit  # the root's backward comes first: keep it gathered


def _pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    unit = unit_of(module)
    if unit.root is None:
        _lazy_init(module, unit)
    mp = unit.mp
    if mp.param_dtype is not None and mp.cast_forward_inputs:
        args, kwargs = _cast_floats((args, kwargs), mp.param_dtype)
    unit.unshard()
    _prefetch_for_forward(unit)
    if torch.is_grad_enabled():
        unit.pending_backward = True
        args, kwargs = _run_post_backward_after_inputs(unit, args, kwargs)
    return args, kwargs


def _post_forward(module: nn.Module, args: tuple, output: Any) -> Any:
    unit = unit_of(module)
    unit.forwards_in_pass += 1
    grad = torch.is_grad_enabled()
    if unit.forwards_in_pass >= len(unit.modules):
        unit.forwards_in_pass = 0
        if unit.reshard_after_forward or not grad:  # without autograd no backward will need it
            unit.reshard()
    if grad:
        tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, lambda grads: _pre_backward(unit), mode="any")
    if unit.mp.output_dtype is not None:
        output = _cast_floats(output, unit.mp.output_dtype)
    return output


def _pre_backward(unit: FSDPUnit) -> None:
    root = unit.root
    if root is not None and not root.callback_queued:
        root.callback_queued = True
        queue_end_of_backward(root.finish_backward)
    unit.unshard()
    _prefetch_for_backward(unit)


def _prefetch_for_backward(unit: FSDPUnit) -> None:
    """set_modules_to_backward_prefetch's units start gathering while this unit's backward computes."""
    for module in unit.backward_prefetch:
        target = unit_of(module)
        if target is not None and target.pending_backward:
            target.start_unshard()


def _prefetch_for_forward(unit: FSDPUnit) -> None:
    """set_modules_to_forward_prefetch's units start gathering while this unit's forward computes."""
    for module in unit.forward_prefetch:
        target = unit_of(module)
        if target is not None:
            target.start_unshard()


def post_backward(unit: FSDPUnit) -> None:
    """Reduce whatever gradients the unit's unsharded parameters hold now (none: nothing is sent).
    May run once per backward pass: each pass's gradients are reduced into the sharded `.grad`."""
    if not (unit.pending_backward or unit.holds_unsharded_grads()):
        return
    grads = unit.take_gradients()
    if unit.reshard_after_backward:
        unit.reshard()  # first: the unsharded parameters' memory is free before the reduction's buffers
    unit.reduce_gradients(grads)


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs; its backward runs once their gradients are complete,
    after every node of the unit's own backward (autograd runs later-created nodes first)."""

    @staticmethod
    def forward(ctx, unit: FSDPUnit, *inputs: torch.Tensor):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        unit = ctx.unit
        unit.inputs_pending -= 1
        if unit.inputs_pending <= 0:  # a grouped unit: after the last of its modules' backwards
            post_backward(unit)
        return (None, *grads)


def _run_post_backward_after_inputs(unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    flat, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return args, kwargs  # the root's end-of-backward runs this unit's post-backward
    unit.inputs_pending += 1
    outs = _PostBackward.apply(unit, *(flat[i] for i in positions))
    for i, t in zip(positions, outs):
        flat[i] = t
    return pytree.tree_unflatten(flat, spec)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return pytree.tree_map(cast, tree)
