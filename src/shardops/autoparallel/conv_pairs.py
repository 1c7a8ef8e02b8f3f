"""Channel-parallel candidates for convolutional models: pairs of convolutions split by channels.

A pair is read from the order the structure forward called the modules (not from names): an
ungrouped convolution, then (past elementwise modules and channel norms only: ReLU, GroupNorm,
BatchNorm) an ungrouped convolution of the same dimensionality taking its output channels. On the
tensor-parallel dim the first goes `OutputChannelParallel`, the norms between `ChannelParallel`,
the second `InputChannelParallel` (parallel/conv_style.py): the pair sends the reduction of the
second's output forward and of the first's input gradient backward, and nothing between them.

A pair is usable on a tensor-parallel size n when every GroupNorm between holds whole groups per
rank (n divides its group count) and the first convolution has at least n output channels. What
runs between two module calls but is no module (a functional op, a residual add) is not seen here:
a pair it breaks fails on shapes (a rank's channels meeting the whole tensor) in both pricings, or,
where shapes happen to agree, on values in the run pricing (the default on a real model).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch.nn as nn

from ..parallel import ChannelParallel, InputChannelParallel, OutputChannelParallel

__all__ = ["ConvPair", "conv_pair_entries", "conv_pair_flags", "conv_work_saved", "find_conv_pairs"]

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
CHANNEL_NORMS = (nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
MAX_CONV_PAIRS_SEARCHED = 3  # every on/off combination of this many pairs; beyond, all of them on only


@dataclass(frozen=True)
class ConvPair:
    out_conv: str  # split by output channels (full path)
    norms: tuple[str, ...]  # channel norms called between the two
    in_conv: str  # split by input channels
    weights: int  # weight elements of both convolutions (the work measure compute_share uses)
    channels: int  # the channels between them
    groups: tuple[int, ...]  # the GroupNorms' group counts


def _leaf(module: nn.Module) -> bool:
    return not list(module.children())


def find_conv_pairs(model: nn.Module, order: list[str], elementwise: tuple[type, ...]) -> list[ConvPair]:
    """The convolution pairs of `model` from the call order of its modules (each called once); modules of
    the `elementwise` classes may stand between a pair's convolutions."""
    if not any(isinstance(m, CONVS) for m in model.modules()):
        return []
    modules = dict(model.named_modules())
    calls = [n for n in order if n in modules and _leaf(modules[n])]
    once = {n for n in calls if calls.count(n) == 1}
    pairs: list[ConvPair] = []
    pending: tuple[str, nn.modules.conv._ConvNd] | None = None
    norms: list[str] = []
    for name in calls:
        module = modules[name]
        if isinstance(module, nn.modules.conv._ConvNd) and module.groups == 1 and name in once:
            prev = pending[1] if pending is not None else None
            if (
                prev is not None
                and pending is not None
                and len(prev.kernel_size) == len(module.kernel_size)
                and prev.out_channels == module.in_channels
            ):
                weights = prev.weight.numel() + module.weight.numel()
                groups = tuple(modules[n].num_groups for n in norms if isinstance(modules[n], nn.GroupNorm))
                pairs.append(ConvPair(pending[0], tuple(norms), name, weights, prev.out_channels, groups))
                pending = None
            else:
                pending = (name, module)
            norms = []
        elif isinstance(module, CHANNEL_NORMS) and name in once and pending is not None:
            norms.append(name)
        elif not isinstance(module, elementwise):
            pending, norms = None, []
    return pairs


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
