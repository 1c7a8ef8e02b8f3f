"""What the search needs to know about a model: its repeated blocks, the Linear groups inside
a block, the norms, the embeddings and the output head, and how each module is called
(positional inputs, or the keyword of its first input: transformers calls its attention with
`hidden_states=`), recorded on one single-device forward of the example.

The stack of blocks may sit anywhere in the tree (transformers' `model.layers`); plan keys are
full paths (`model.layers.*.self_attn.q_proj`)."""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn as nn

from .conv_pairs import ConvPair, find_conv_pairs
from .dataflow import linear_pairs

__all__ = ["Experts", "LinearGroup", "ModelStructure", "find_blocks", "find_experts", "find_structure", "truncated"]

NORMS = (nn.LayerNorm, nn.RMSNorm)
# parameter-free modules that act on each element alone: a feature-sharded activation stays sharded through them
ELEMENTWISE = (
    nn.ReLU,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.LeakyReLU,
    nn.ELU,
    nn.Mish,
    nn.Softplus,
    nn.Hardswish,
    nn.Identity,
    nn.Dropout,
)


@dataclass(frozen=True)
class LinearGroup:
    """A module of a block holding Linears that can go tensor-parallel as a pair: the `colwise`
    ones split their output features, `rowwise` takes those features back to the model dim."""

    name: str  # relative to the block, e.g. "attention"
    colwise: tuple[str, ...]
    rowwise: str
    n_inputs: int  # positional inputs it is called with (the first is the residual stream)
    weights: int  # in_features * out_features summed over its Linears (matmul work per token)
    input_kwarg: str | None = None  # the residual stream's keyword when it is called with keywords only


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts layer of a block, found by its shapes and calls: a module whose parameters
    are all stacked over `num_experts` (dim 0, >= 3 dims: one matrix per expert), called with three
    positional inputs (tokens, expert ids, their weights: the experts interface ExpertParallel
    takes), beside a router: a sibling module holding a [num_experts, hidden] matrix."""

    name: str  # the experts module, relative to the block ("mlp.experts")
    moe: str  # the module holding the experts and the router ("mlp"), relative to the block
    num_experts: int
    weights: int  # elements of the stacked weights (every expert's matrices)


@dataclass
class ModelStructure:
    blocks: str | None  # the container of repeated blocks ("layers", "h"), None if there is none
    n_blocks: int = 0
    groups: list[LinearGroup] = field(default_factory=list)
    block_norms: list[str] = field(default_factory=list)
    embeddings: list[str] = field(default_factory=list)
    head: str | None = None
    head_weights: int = 0
    final_norms: list[str] = field(default_factory=list)
    # matmul weights no style splits, every rank computing with all of them: per block (nn.MultiheadAttention's
    # in_proj_weight, a Linear outside the groups) and outside the blocks (besides the head and embeddings)
    block_other_weights: int = 0
    other_weights: int = 0
    # without blocks: (column-parallel, row-parallel) Linear pairs of an nn.Sequential, full paths, and their weights
    pairs: list[tuple[str, str]] = field(default_factory=list)
    pair_weights: list[int] = field(default_factory=list)
    # mixture-of-experts layers of a block (stacked expert weights and a router): expert-parallel candidates
    experts: list[Experts] = field(default_factory=list)
    conv_pairs: list[ConvPair] = field(default_factory=list)  # convolution pairs by channels (conv_pairs.py)
    positions_from_stream: bool = False  # sizes positions by the embeddings' output: no sequence parallelism

    @property
    def transformer(self) -> bool:
        """Whether the tensor-parallel templates apply: blocks with Linear groups, embeddings and a head."""
        return bool(self.blocks and self.groups and self.embeddings and self.head)


def _is_norm(module: nn.Module) -> bool:
    """torch's norms, and a model's own (transformers' LlamaRMSNorm): a leaf named *Norm with 1-d parameters."""
    if isinstance(module, NORMS):
        return True
    params = list(module.parameters(recurse=False))
    return (
        "norm" in type(module).__name__.lower()
        and not list(module.children())
        and bool(params)
        and all(p.ndim == 1 for p in params)
    )


def _call_arity(model: nn.Module, example_inputs: tuple) -> tuple[dict[str, tuple[int, str | None]], list[str]]:
    """Per module name: positional inputs, and the first keyword when there are none; and the order
    in which modules are called. From one forward of the example without gradients."""
    arity: dict[str, tuple[int, str | None]] = {}
    order: list[str] = []

    def record(name, args, kwargs):
        first_kw = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None) if not args else None
        arity.setdefault(name, (len(args), first_kw))
        order.append(name)

    handles = []
    for name, sub in model.named_modules():
        handles.append(
            sub.register_forward_pre_hook(
                lambda m, args, kwargs, name=name: record(name, args, kwargs), with_kwargs=True
            )
        )
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    return arity, order


def _rowwise_of(linears: dict[str, nn.Linear]) -> str:
    """The Linear that maps the group's features back to its input width (the first Linear's
    in_features): the one of another shape than the first (SwiGLU's w2, GPT-2's c_proj), or, if
    every shape is alike (q, k, v, o), the last one."""
    names = list(linears)
    width = linears[names[0]].in_features
    back = [n for n in names[1:] if linears[n].out_features == width]
    reshaped = [n for n in back if linears[n].in_features != width]
    return reshaped[0] if reshaped else back[-1] if back else names[-1]


def _matmul_weights(module: nn.Module, skip: set[str]) -> int:
    """Elements of the weights `module` and its submodules (but those named in `skip`) multiply with:
    every parameter of >= 2 dims a module owns, read through a child or directly (nn.MultiheadAttention's
    in_proj_weight); embedding tables are looked up, not multiplied."""
    total = 0
    for name, sub in module.named_modules():
        if name in skip or any(name.startswith(s + ".") for s in skip) or isinstance(sub, nn.Embedding):
            continue
        total += sum(p.numel() for p in sub.parameters(recurse=False) if p.ndim >= 2)
    return total


CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _signature(module: nn.Module) -> tuple:
    """What makes two blocks alike: their class and every parameter's name, shape and dtype."""
    return type(module), tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())


def find_blocks(model: nn.Module) -> tuple[str | None, int]:
    """The stack of repeated blocks, recognised by structure, not by name: the first container
    (ModuleList, ModuleDict, or a Sequential of two or more) whose children all have submodules and
    one signature (class and parameter shapes). (path, number of blocks), or (None, 0)."""
    for name, child in model.named_modules():
        if not isinstance(child, CONTAINERS) or len(child) == 0:
            continue
        if isinstance(child, nn.Sequential) and len(child) < 2:
            continue
        kids = list(child.children())
        if all(list(k.children()) for k in kids) and len({_signature(k) for k in kids}) == 1:
            return name, len(kids)
    return None, 0


def truncated(model: nn.Module, blocks: str, k: int) -> nn.Module:
    """A copy of `model` with its first `k` repeated blocks only (the forward loops over the container,
    or calls it). Only those blocks are copied: the cost does not grow with the model's depth."""
    parent_path, _, attr = blocks.rpartition(".")
    parent = model.get_submodule(parent_path)
    container = getattr(parent, attr)
    items = list(container.named_children())[:k]
    short: nn.Module
    if isinstance(container, nn.ModuleDict):
        short = nn.ModuleDict(dict(items))
    elif isinstance(container, nn.Sequential):
        short = nn.Sequential(OrderedDict(items))
    else:
        short = nn.ModuleList([m for _, m in items])
    parent._modules[attr] = short  # swapped in for the copy only
    try:
        return copy.deepcopy(model)
    finally:
        parent._modules[attr] = container


def find_structure(model: nn.Module, example_inputs: tuple) -> ModelStructure:
    blocks, n_blocks = find_blocks(model)
    # the call records come from a forward of at most two blocks: planning time independent of depth
    probe = truncated(model, blocks, 2) if blocks is not None and n_blocks > 2 else model
    arity, _ = _call_arity(probe, example_inputs)
    structure = ModelStructure(blocks=blocks, n_blocks=n_blocks)
    structure.conv_pairs = find_conv_pairs(probe, example_inputs, blocks, n_blocks)  # inside the blocks too
    if blocks is not None:
        container = model.get_submodule(blocks)
        first_name, first = next(iter(container.named_children()))
        structure.experts = find_experts(first, f"{blocks}.{first_name}", arity)
        _read_block(structure, first, f"{blocks}.{first_name}", arity)
        if not structure.groups:  # Linears feeding Linears (nn.TransformerEncoderLayer's linear1 -> linear2)
            _read_block_pairs(structure, first, linear_pairs(probe, f"{blocks}.{first_name}", example_inputs))
    for name, child in model.named_modules():
        if blocks is not None and (name == blocks or name.startswith(blocks + ".")):
            continue  # inside the blocks: read from the first block above
        if isinstance(child, nn.Embedding):
            structure.embeddings.append(name)
        elif isinstance(child, nn.Linear):
            structure.head, structure.head_weights = (
                name,
                child.in_features * child.out_features,
            )  # the last Linear outside the blocks
        elif _is_norm(child):
            structure.final_norms.append(name)
    skip = {n for n in (structure.blocks, structure.head) if n is not None}
    structure.other_weights = _matmul_weights(model, skip)
    if structure.blocks is None:
        for name, child in model.named_modules():
            if isinstance(child, nn.Sequential):
                _read_pairs(structure, child, f"{name}." if name else "")
    elif not structure.transformer and not structure.pairs:  # blocks of Sequential MLPs: their pairs, per block
        _, first = next(iter(model.get_submodule(structure.blocks).named_children()))
        for name, child in first.named_modules():
            if isinstance(child, nn.Sequential):
                prefix = f"{structure.blocks}.*." + (f"{name}." if name else "")
                _read_pairs(structure, child, prefix, structure.n_blocks)
    return structure


def _read_pairs(structure: ModelStructure, seq: nn.Sequential, prefix: str, copies: int = 1) -> None:
    """Column/row-parallel pairs of a Sequential, from its Linears' shapes: a Linear, then (past elementwise
    modules only) a Linear taking its output features; the features between them stay sharded."""
    pending: tuple[str, nn.Linear] | None = None  # a Linear whose output may feed the next one
    for name, child in seq.named_children():
        if isinstance(child, nn.Linear):
            if pending is not None and pending[1].out_features == child.in_features:
                structure.pairs.append((prefix + pending[0], prefix + name))
                structure.pair_weights.append(
                    copies * (pending[1].in_features * pending[1].out_features + child.in_features * child.out_features)
                )
                pending = None
            else:
                pending = (name, child)
        elif not isinstance(child, ELEMENTWISE):
            pending = None


def _read_block_pairs(structure: ModelStructure, block: nn.Module, pairs: list[tuple[str, str]]) -> None:
    """Column/row-parallel pairs among a block's Linears (at any depth), from the traced forward
    (dataflow.py): the second takes the first's output features through elementwise ops only. Plan keys
    take the blocks' wildcard (`encoder.layers.*.linear1`)."""
    stack = structure.blocks
    for producer, consumer in pairs:
        # dataflow.py pairs Linears only
        a, b = cast(nn.Linear, block.get_submodule(producer)), cast(nn.Linear, block.get_submodule(consumer))
        structure.pairs.append((f"{stack}.*.{producer}", f"{stack}.*.{consumer}"))
        weights = a.in_features * a.out_features + b.in_features * b.out_features
        structure.pair_weights.append(structure.n_blocks * weights)


def _read_block(
    structure: ModelStructure, block: nn.Module, path: str, arity: dict[str, tuple[int, str | None]]
) -> None:
    for name, child in block.named_children():
        if _is_norm(child):
            structure.block_norms.append(name)
            continue
        linears = {n: c for n, c in child.named_children() if isinstance(c, nn.Linear)}
        # a group: Linears, besides parameter-free children only (dropout, an activation module)
        others = [c for c in child.children() if not isinstance(c, nn.Linear)]
        if len(linears) >= 2 and not any(list(c.parameters()) for c in others):
            rowwise = _rowwise_of(linears)
            colwise = tuple(n for n in linears if n != rowwise)
            weights = sum(c.in_features * c.out_features for c in linears.values())
            n_inputs, kwarg = arity.get(f"{path}.{name}", (1, None))
            structure.groups.append(LinearGroup(name, colwise, rowwise, n_inputs, weights, kwarg))
    grouped = {f"{g.name}.{lin}" for g in structure.groups for lin in (*g.colwise, g.rowwise)}
    # the experts' matmul work is counted apart (expert parallelism splits it; compute_share)
    structure.block_other_weights = _matmul_weights(block, grouped | {e.name for e in structure.experts})


def _stacked_over(module: nn.Module) -> int | None:
    """The number of experts a module's own parameters are all stacked over (dim 0 of every one, each
    of >= 3 dims: a matrix per expert), or None."""
    params = list(module.parameters(recurse=False))
    if not params or any(p.ndim < 3 for p in params) or list(module.parameters()) != params:
        return None
    counts = {p.shape[0] for p in params}
    return counts.pop() if len(counts) == 1 and params[0].shape[0] >= 2 else None


def _routes_to(module: nn.Module, num_experts: int, hidden: int) -> bool:
    """Whether `module` holds a router's matrix: [num_experts, hidden] (nn.Linear(hidden, num_experts)
    or a model's own router module)."""
    return any(p.ndim == 2 and tuple(p.shape) == (num_experts, hidden) for p in module.parameters())


def find_experts(block: nn.Module, path: str, arity: dict[str, tuple[int, str | None]]) -> list[Experts]:
    """The block's mixture-of-experts layers, by structure: stacked expert weights called as
    experts(tokens, ids, weights), with a router sibling (see Experts). A ModuleList of separate
    expert MLPs is not one (ExpertParallel shards stacked weights)."""
    found = []
    for name, sub in block.named_modules():
        num = _stacked_over(sub)
        if num is None or not name or arity.get(f"{path}.{name}", (0, None))[0] != 3:
            continue
        parent_name, _, own = name.rpartition(".")
        parent = block.get_submodule(parent_name) if parent_name else block
        widths = {s for p in sub.parameters() for s in p.shape[1:]}  # the hidden size is one of them
        siblings = [c for n, c in parent.named_children() if n != own]
        if any(_routes_to(c, num, width) for c in siblings for width in widths):
            weights = sum(p.numel() for p in sub.parameters())
            found.append(Experts(name, parent_name, num, weights))
    return found
