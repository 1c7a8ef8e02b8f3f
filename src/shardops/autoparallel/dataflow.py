"""Which module feeds which, read from the ops one forward runs (the traced graph), not from names or
call order: a column/row-parallel pair (two Linears; two convolutions split by channels) needs the
second one's input to be the first one's output through feature-preserving ops only (an activation,
dropout, a product with itself: `fc2(gelu(fc1(x)))`; for channels also a channel norm module:
`conv2(relu(norm(conv1(x))))`), so that its features stay sharded all the way (each rank computes its
own slice of them), and that output to reach nothing else (each rank holds only its slice).

One forward of the example without gradients, under a dispatch mode that sees every aten op: each
tensor a watched producer returns is marked with its name; an op tagged pointwise (or dropout, a copy,
a view of the same shape) whose marked inputs all come from one producer, at that input's shape, and
whose other inputs are scalars or constant along the features, passes the mark on; a `passing` module
(a channel norm) passes its input's mark to its output. Any other op on a marked tensor (a softmax, a
transpose, a sum over features, a residual add of an unmarked full-width tensor) makes the producer's
features *escape* (there each rank would hold only its slice of them): it pairs with nothing. A
producer called on a marked tensor records what fed it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn

from .._torch.dispatch import TorchDispatchMode

__all__ = ["Flow", "linear_pairs", "traced_pairs"]

# not tagged pointwise, but they keep every element where it was
_PASS_THROUGH = {"native_dropout", "dropout", "clone", "_to_copy", "detach", "alias", "contiguous"}


@dataclass(frozen=True)
class Flow:
    """A pair the traced forward shows: `consumer`'s input is `producer`'s output, through `between`."""

    producer: str
    between: tuple[str, ...]  # the passing modules (channel norms) its features went through, in call order
    consumer: str


def _op_keeps_features(func, out: torch.Tensor, source_shape: torch.Size) -> bool:
    """Whether `func` maps each element of a marked input of `source_shape` to the same element of `out`."""
    if tuple(out.shape) != tuple(source_shape):
        return False
    name = func.overloadpacket.__name__
    if torch.Tag.pointwise in func.tags or name in _PASS_THROUGH:
        return True
    return bool(getattr(func, "is_view", False)) and name in ("view", "reshape", "_unsafe_view", "expand")


def _constant_along(t: torch.Tensor, dim: int) -> bool:
    """Whether `t`, broadcast against a tensor whose features are its dim `dim` (negative), is one value
    along them: a scalar, a per-sample scale (size 1 there), or a tensor not reaching that dim."""
    return t.ndim < -dim or t.shape[dim] == 1


class _FeatureFlow(TorchDispatchMode):
    """Passes each producer's mark from an op's inputs to its output where the op keeps features in place;
    records the producers whose features escape."""

    def __init__(self, feature_dim: dict[str, int]) -> None:
        super().__init__()
        self.feature_dim = feature_dim  # producer -> the (negative) dim of its output's features
        self.mark: dict[int, str] = {}  # id(tensor) -> the producer whose features it holds
        self.alive: list[torch.Tensor] = []  # marked tensors kept alive: their ids stay theirs
        self.escaped: set[str] = set()
        self.inside = 0  # watched module calls running (their hooks judge what their ops do to a mark)

    def set(self, t: torch.Tensor, name: str) -> None:
        self.mark[id(t)] = name
        self.alive.append(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        marked = [a for a in inputs if id(a) in self.mark]
        if not marked:
            return out
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        sources = {self.mark[id(a)] for a in marked}
        kept = False
        if len(sources) == 1 and isinstance(first, torch.Tensor):
            dim = self.feature_dim[next(iter(sources))]
            # the other inputs: scalars, per-sample scales, nothing full-width along the features
            others_fit = all(a.ndim == 0 or _constant_along(a, dim) for a in inputs if id(a) not in self.mark)
            kept = others_fit and _op_keeps_features(func, first, marked[0].shape)
        if kept:
            self.set(first, sources.pop())
        elif not self.inside:  # a softmax, a mean over the features, a residual add: each rank lacks the rest
            self.escaped |= sources
            if id(first) in self.mark:  # an in-place op: its result holds no slice of features any more
                del self.mark[id(first)]
        return out


def _feature_dim(module: nn.Module) -> int:
    """The (negative) dim of a producer's output features: a Linear's last, a convolution's channels."""
    kernel = getattr(module, "kernel_size", None)  # a convolution's: (N, C, *spatial) or unbatched (C, *spatial)
    return -(len(kernel) + 1) if isinstance(kernel, tuple) else -1


def _outputs(value) -> list[torch.Tensor]:
    """The tensors a forward returns (in tuples, lists, dicts, or an output object's fields)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _outputs(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _outputs(v)]
    return [t for t in vars(value).values() if isinstance(t, torch.Tensor)] if hasattr(value, "__dict__") else []


def traced_pairs(
    model: nn.Module,
    example_inputs: tuple,
    producers: Mapping[str, nn.Module],
    pairs_with: Callable[[nn.Module, nn.Module], bool],
    passing: Mapping[str, nn.Module] | None = None,
) -> list[Flow]:
    """The pairs of `producers` (name -> module of `model`) one forward of the example shows, in call
    order: the consumer's input is the producer's output through feature-preserving ops and `passing`
    modules only, `pairs_with(producer, consumer)` holds, both are called once, and the producer's
    features reach nothing else. A module is in at most one pair. The model's buffers (BatchNorm's
    running statistics) are as they were before."""
    passing = passing or {}
    flow = _FeatureFlow({n: _feature_dim(m) for n, m in producers.items()})
    calls: Counter[str] = Counter()
    feeds: list[tuple[str, str]] = []  # (producer, consumer) as called
    between: dict[str, list[str]] = {}  # producer -> the passing modules its features went through
    entered: list[str | None] = []  # per watched call running: the mark of its input

    def before(name: str, args: tuple) -> None:
        calls[name] += 1
        x = args[0] if args else None
        source = flow.mark.get(id(x)) if isinstance(x, torch.Tensor) else None
        entered.append(source)
        flow.inside += 1
        if source is not None and name in producers:
            feeds.append((source, name))

    def after(name: str, output) -> None:
        flow.inside -= 1
        source = entered.pop()
        if name in producers and isinstance(output, torch.Tensor):
            flow.set(output, name)
        elif name in passing and source is not None:
            if isinstance(output, torch.Tensor) and source in flow.feature_dim:
                flow.set(output, source)
                between.setdefault(source, []).append(name)
            else:
                flow.escaped.add(source)

    watched = {**producers, **passing}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    handles = []
    for name, module in watched.items():
        handles.append(module.register_forward_pre_hook(lambda m, args, name=name: before(name, args)))
        handles.append(module.register_forward_hook(lambda m, args, out, name=name: after(name, out)))
    try:
        with torch.no_grad(), flow:
            result = model(*example_inputs)
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
    flow.escaped |= {flow.mark[id(t)] for t in _outputs(result) if id(t) in flow.mark}  # returned sharded
    fed = Counter(p for p, _ in feeds)
    pairs: list[Flow] = []
    used: set[str] = set()
    for producer, consumer in feeds:
        once = calls[producer] == calls[consumer] == 1 and all(calls[n] == 1 for n in between.get(producer, ()))
        alone = fed[producer] == 1 and producer not in flow.escaped
        if once and alone and not {producer, consumer} & used and producer != consumer:
            if pairs_with(producers[producer], producers[consumer]):
                pairs.append(Flow(producer, tuple(between.get(producer, ())), consumer))
                used.update((producer, consumer))
    return pairs


def linear_pairs(model: nn.Module, scope: str, example_inputs: tuple) -> list[tuple[str, str]]:
    """(producer, consumer) paths, relative to `scope` (a module of `model`), of the Linears inside it
    whose consumer's input is the producer's output through feature-preserving ops only, in call order;
    a Linear is in at most one pair. From one forward of `model` on the example."""
    block = model.get_submodule(scope)
    prefix = f"{scope}." if scope else ""
    linears = {prefix + n: m for n, m in block.named_modules() if isinstance(m, nn.Linear) and n}
    flows = traced_pairs(model, example_inputs, linears, lambda a, b: a.out_features == b.in_features)
    return [(f.producer[len(prefix) :], f.consumer[len(prefix) :]) for f in flows]
