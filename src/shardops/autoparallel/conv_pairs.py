"""Channel-parallel candidates for convolutional models: pairs of convolutions split by channels.

A pair is read from the traced forward (dataflow.py), not from names or call order: an ungrouped
convolution whose output reaches an ungrouped convolution of the same dimensionality taking its
channels, through feature-preserving ops (ReLU, dropout) and channel norm modules (GroupNorm,
BatchNorm) only, and reaches nothing else (a residual add of it, a channel shuffle, a mean over the
channels between them: no pair). On the tensor-parallel dim the first goes `OutputChannelParallel`, the
norms between `ChannelParallel`, the second `InputChannelParallel` (parallel/conv_style.py): the pair
sends the reduction of the second's output forward and of the first's input gradient backward, and
nothing between them; the second's output is whole (replicated), as is the input of the first.

Inside repeated blocks a pair is read from the first block (and found alike in the second, where the
structure forward ran two), its plan keys take the blocks' wildcard (`layers.*.conv1`) and one on/off
choice covers every block: the tensors at the blocks' boundaries (the residual stream) stay whole.
A pair that spans blocks, or runs from outside the blocks into them, is not offered.

A pair is usable on a tensor-parallel size n when every GroupNorm between holds whole groups per
rank (n divides its group count) and the first convolution has at least n output channels.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import cast

import torch.nn as nn

from ..parallel import ChannelParallel, InputChannelParallel, OutputChannelParallel
from .dataflow import Flow, traced_pairs

__all__ = ["ConvPair", "conv_pair_entries", "conv_pair_flags", "conv_work_saved", "find_conv_pairs"]

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
CHANNEL_NORMS = (nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
MAX_CONV_PAIRS_SEARCHED = 3  # every on/off combination of this many pairs; beyond, all of them on only


@dataclass(frozen=True)
class ConvPair:
    out_conv: str  # split by output channels (plan key: a full path, or the blocks' wildcard `layers.*.conv1`)
    norms: tuple[str, ...]  # channel norms its channels go through on the way to the second
    in_conv: str  # split by input channels
    weights: int  # weight elements of both convolutions, every block's (the work measure compute_share uses)
    channels: int  # the channels between them
    groups: tuple[int, ...]  # the GroupNorms' group counts


def _conv(module: nn.Module) -> nn.Conv2d:
    return cast(nn.Conv2d, module)  # any of CONVS: the attributes read here are common to all


def _pairs_with(first: nn.Module, second: nn.Module) -> bool:
    """Whether `second` takes `first`'s output channels (same dimensionality)."""
    a, b = _conv(first), _conv(second)
    return len(a.kernel_size) == len(b.kernel_size) and a.out_channels == b.in_channels


def _in_block(f: Flow, blocks: str) -> tuple[str, Flow] | None:
    """(the block's name, the flow with paths inside that block) when every module of `f` is in one
    block of the stack `blocks`, else None."""
    inside = []
    for name in (f.producer, *f.between, f.consumer):
        if not name.startswith(blocks + "."):
            return None
        inside.append(name[len(blocks) + 1 :].partition("."))
    if len({block for block, _, _ in inside}) != 1:
        return None
    rest = [path for _, _, path in inside]
    return inside[0][0], Flow(rest[0], tuple(rest[1:-1]), rest[-1])


def _prefixed(f: Flow, prefix: str) -> Flow:
    return Flow(prefix + f.producer, tuple(prefix + n for n in f.between), prefix + f.consumer)


def _touches(f: Flow, blocks: str) -> bool:
    return any(n.startswith(blocks + ".") for n in (f.producer, *f.between, f.consumer))


def find_conv_pairs(model: nn.Module, example_inputs: tuple, blocks: str | None, n_blocks: int) -> list[ConvPair]:
    """The convolution pairs of `model` (the structure forward's: at most two of its `n_blocks` repeated
    blocks in `blocks`) from one traced forward of the example: pairs outside the blocks by their paths,
    pairs inside them by wildcard keys (`blocks.*.conv1`), found alike in every block the forward ran."""
    modules = dict(model.named_modules())
    convs = {n: m for n, m in modules.items() if isinstance(m, CONVS) and m.groups == 1}
    if not convs:
        return []
    norms = {n: m for n, m in modules.items() if isinstance(m, CHANNEL_NORMS)}
    flows = traced_pairs(model, example_inputs, convs, _pairs_with, norms)
    pairs = [_pair(f, f, modules, 1) for f in flows if blocks is None or not _touches(f, blocks)]
    if blocks is None:
        return pairs
    per_block: dict[str, list[Flow]] = {}  # block name -> its pairs, paths inside the block
    for f in flows:
        found = _in_block(f, blocks)
        if found is not None:
            per_block.setdefault(found[0], []).append(found[1])
    ran = [name for name, _ in model.get_submodule(blocks).named_children()]
    for f in per_block.get(ran[0], []):
        if all(f in per_block.get(name, []) for name in ran[1:]):
            traced = _prefixed(f, f"{blocks}.{ran[0]}.")
            pairs.append(_pair(_prefixed(f, f"{blocks}.*."), traced, modules, n_blocks))
    return pairs


def _pair(keys: Flow, traced: Flow, modules: dict[str, nn.Module], copies: int) -> ConvPair:
    """The pair planned under `keys` (a flow's paths, or their blocks' wildcard) as `traced` ran; its
    weights counted `copies` times (once per repeated block)."""
    first, second = _conv(modules[traced.producer]), _conv(modules[traced.consumer])
    weights = copies * (first.weight.numel() + second.weight.numel())
    groups = tuple(m.num_groups for n in traced.between if isinstance(m := modules[n], nn.GroupNorm))
    return ConvPair(keys.producer, keys.between, keys.consumer, weights, first.out_channels, groups)


def usable(pair: ConvPair, tp: int) -> bool:
    """Whether `tp` ranks can split the pair: whole groups per rank in every GroupNorm, a channel each."""
    return pair.channels >= tp and all(g % tp == 0 for g in pair.groups)


def conv_pair_flags(pairs: list[ConvPair], tp: int) -> list[tuple[bool, ...]]:
    """The on/off choices per pair on a tensor-parallel size (at least one on; unusable pairs off)."""
    ok = [usable(p, tp) for p in pairs]
    if not any(ok):
        return []
    n = sum(ok)
    choices = itertools.product((True, False), repeat=n) if n <= MAX_CONV_PAIRS_SEARCHED else [(True,) * n]
    out = []
    for flags in choices:
        if any(flags):
            it = iter(flags)
            out.append(tuple(next(it) if good else False for good in ok))
    return out


def conv_work_saved(pairs: list[ConvPair], flags: tuple[bool, ...], tp: int) -> float:
    """The weight elements a rank no longer computes with, for compute_share (a split pair: 1/tp of them)."""
    return sum(p.weights * (1 - 1 / tp) for p, on in zip(pairs, flags) if on)


def conv_pair_entries(pairs: list[ConvPair], flags: tuple[bool, ...]) -> list[tuple[str, str, type]]:
    """(plan key, style text, style class) of the split pairs (the rest stays replicated: plain on every rank)."""
    entries: list[tuple[str, str, type]] = []
    for pair, on in zip(pairs, flags):
        if on:
            entries.append((pair.out_conv, "OutputChannelParallel()", OutputChannelParallel))
            entries += [(norm, "ChannelParallel()", ChannelParallel) for norm in pair.norms]
            entries.append((pair.in_conv, "InputChannelParallel()", InputChannelParallel))
    return entries
