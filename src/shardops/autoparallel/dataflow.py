"""Which Linear feeds which, read from the ops one forward runs (the traced graph), not from names or
call order: a column/row-parallel pair needs the second Linear's input to be the first one's output
through elementwise ops only (an activation, dropout, a product with itself: `fc2(gelu(fc1(x)))`),
so that its features stay sharded all the way (each rank computes its own slice of them).

One forward of the example without gradients, under a dispatch mode that sees every aten op: each
tensor a watched Linear returns is marked with its name; an op tagged pointwise (or dropout, a copy,
a view that keeps the last dim) whose marked inputs all come from one Linear, at that input's shape,
passes the mark on; anything else (a softmax, a transpose, a sum over features, a residual add of an
unmarked full-width tensor) drops it. A Linear called on a marked tensor of its input width pairs
with the Linear that marked it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .._torch.dispatch import TorchDispatchMode

__all__ = ["linear_pairs"]

# not tagged pointwise, but they keep every element where it was
_PASS_THROUGH = {"native_dropout", "dropout", "clone", "_to_copy", "detach", "alias", "contiguous"}


def _op_keeps_features(func, args: tuple, out: torch.Tensor, source_shape: torch.Size) -> bool:
    """Whether `func` maps each feature of a marked input of `source_shape` to the same feature of `out`."""
    if tuple(out.shape) != tuple(source_shape):
        return False
    name = func.overloadpacket.__name__
    if torch.Tag.pointwise in func.tags or name in _PASS_THROUGH:
        return True
    return bool(getattr(func, "is_view", False)) and name in ("view", "reshape", "_unsafe_view", "expand")


class _FeatureFlow(TorchDispatchMode):
    """Passes each Linear's mark from an op's inputs to its output where the op keeps features in place."""

    def __init__(self) -> None:
        super().__init__()
        self.mark: dict[int, str] = {}  # id(tensor) -> the Linear whose features it holds
        self.alive: list[torch.Tensor] = []  # marked tensors kept alive: their ids stay theirs

    def set(self, t: torch.Tensor, name: str) -> None:
        self.mark[id(t)] = name
        self.alive.append(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        marked = [a for a in inputs if id(a) in self.mark]
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if not marked or not isinstance(first, torch.Tensor):
            return out
        sources = {self.mark[id(a)] for a in marked}
        # the other inputs may only scale per sample or element-wide by a scalar: no full-width unmarked tensor
        others_fit = all(a.ndim == 0 or a.shape[-1] == 1 for a in inputs if id(a) not in self.mark)
        if len(sources) == 1 and others_fit and _op_keeps_features(func, args, first, marked[0].shape):
            self.set(first, sources.pop())
        return out


def linear_pairs(model: nn.Module, scope: str, example_inputs: tuple) -> list[tuple[str, str]]:
    """(producer, consumer) paths, relative to `scope` (a module of `model`), of the Linears inside it
    whose consumer's input is the producer's output through feature-preserving ops only, in call order;
    a Linear is in at most one pair. From one forward of `model` on the example."""
    block = model.get_submodule(scope)
    linears = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear) and n}
    flow = _FeatureFlow()
    pairs: list[tuple[str, str]] = []
    used: set[str] = set()

    def before(name: str, module: nn.Linear, args: tuple) -> None:
        x = args[0] if args else None
        source = flow.mark.get(id(x)) if isinstance(x, torch.Tensor) else None
        if source is None or source in used or name in used or source == name:
            return
        if linears[source].out_features == module.in_features:
            pairs.append((source, name))
            used.update((source, name))

    def after(name: str, output) -> None:
        if isinstance(output, torch.Tensor):
            flow.set(output, name)

    handles = []
    for name, lin in linears.items():
        handles.append(lin.register_forward_pre_hook(lambda m, args, name=name: before(name, m, args)))
        handles.append(lin.register_forward_hook(lambda m, args, out, name=name: after(name, out)))
    try:
        with torch.no_grad(), flow:
            model(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    return pairs
