"""Channel-parallel styles for convolutional models (torch has none): Megatron's column/row pair on channels.

A convolution is a matrix product per output position, with the output channels as its
columns and the input channels as its contracting dim (ops/convolution.py). So a pair of
convolutions splits like a pair of Linears:

    OutputChannelParallel   conv k      weight Shard(out), bias Shard(0)   input Replicate  ->  output Shard(1)
    ChannelParallel         between     parameters Shard(0) (GroupNorm's whole groups, BatchNorm's channels)
    InputChannelParallel    conv k+1    weight Shard(in), bias Replicate   input Shard(1)   ->  Partial(sum)
                                        -> output_layouts: Replicate (all_reduce) or Shard(1) (reduce_scatter)

Between the two, elementwise modules (ReLU) and a `ChannelParallel` norm run on each rank's
channels with no collective; the pair sends one reduction of conv k+1's output forward, and
backward one of conv k's input gradient (the Partial d_x of an output-channel-sharded conv),
as ColwiseParallel/RowwiseParallel do for a Linear pair. (out, in) are the weight's dims (0, 1),
(1, 0) for a transposed convolution. Grouped convolutions are not supported (an output channel
reads only its own group's inputs: use whole-group layouts through distribute_module instead).

Local tensors between boundaries (`use_local_output=True`, the default, as torch's styles) are
this rank's channels; the next boundary takes the global channel count from its module, so
uneven splits (torch.chunk's: the first ranks hold one more) are exact. Each style needs a 1-d mesh.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..placements import Placement, Replicate, Shard
from ..tensor import DTensor, distribute_tensor, from_local
from ._layout import move
from .distribute import distribute_module
from .style import ParallelStyle, _distribute_params, _first_input, _OneInOneOutStyle, _prepare_output

__all__ = ["ChannelParallel", "InputChannelParallel", "OutputChannelParallel"]

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_CHANNEL_NORMS = (nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _check_mesh(style: ParallelStyle, module: nn.Module, mesh: DeviceMesh) -> None:
    if mesh.ndim != 1:
        raise ShardingError(
            f"{type(style).__name__} on {type(module).__name__}: needs a 1-d mesh, got {mesh}; "
            'pass the channel-parallel sub-mesh (mesh["tp"])'
        )


def _channels_in(module: nn.Module) -> int:
    """The channel count (dim 1) of the module's input."""
    if isinstance(module, nn.GroupNorm):
        return module.num_channels
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return module.num_features
    if not isinstance(module, nn.modules.conv._ConvNd):
        raise ShardingError(f"channel-parallel styles: {type(module).__name__} is no convolution or channel norm")
    return module.in_channels


def _as_input(module: nn.Module, x, mesh: DeviceMesh, layout: Placement) -> DTensor:
    """A DTensor input as it is; a plain one is this rank's piece in `layout`, its global channel count the
    module's (so an uneven channel split, torch.chunk's, is read right)."""
    if isinstance(x, DTensor):
        return x
    if not isinstance(x, torch.Tensor):
        raise ShardingError(
            f"{type(module).__name__}: expected a tensor input at a parallel boundary, got {type(x).__name__}"
        )
    shape = None
    if isinstance(layout, Shard) and x.ndim >= 2 and layout.dim % x.ndim == 1:
        shape = (x.shape[0], _channels_in(module), *x.shape[2:])
    return from_local(x, mesh, [layout], shape=shape)


def _prepare_input(input_layout: Placement, desired: Placement, mod, inputs, mesh):
    x = _as_input(mod, _first_input(mod, inputs), mesh, input_layout)
    return move(mod, x, mesh, (desired,))


class _ChannelStyle(_OneInOneOutStyle):
    """One input, one output; parameters laid out per name, the input moved to one layout."""

    _modules: tuple[type, ...] = _CONV

    def _layouts_for(self, module: nn.Module) -> tuple[dict[str, Placement], Placement]:
        """(parameter placements, the input layout the module computes on)."""
        raise NotImplementedError

    def _check(self, module: nn.Module, mesh: DeviceMesh) -> None:
        _check_mesh(self, module, mesh)
        if not isinstance(module, self._modules):
            names = ", ".join(t.__name__ for t in self._modules)
            raise ShardingError(f"{type(self).__name__} supports {names}, not {type(module).__name__}")
        if isinstance(module, _CONV) and module.groups != 1:
            raise ShardingError(
                f"{type(self).__name__}: {type(module).__name__} has groups={module.groups}; channel-parallel "
                "styles split ungrouped convolutions only (an output channel of a grouped one reads only its "
                "group's inputs); leave it replicated or lay out whole groups with distribute_module"
            )

    def _partition(self, module: nn.Module, mesh: DeviceMesh, params: dict[str, Placement]) -> None:
        _distribute_params(module, mesh, params, self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check(module, device_mesh)
        params, desired = self._layouts_for(module)
        return distribute_module(
            module,
            device_mesh,
            lambda name, m, mesh: self._partition(m, mesh, params) if m is module else None,
            partial(_prepare_input, self.input_layouts[0], desired),
            partial(_prepare_output, self.output_layouts, self.use_local_output),
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts[0]}, output_layouts={self.output_layouts[0]}, "
            f"use_local_output={self.use_local_output})"
        )


def _weight_dims(module: nn.Module) -> tuple[int, int]:
    """(output-channel dim, input-channel dim) of a convolution's weight."""
    return (1, 0) if module.transposed else (0, 1)


class OutputChannelParallel(_ChannelStyle):
    """A convolution split by output channels (ColwiseParallel's analogue): weight Shard(out), bias Shard(0).

    Input: `input_layouts` (default Replicate), moved to Replicate. Output: this rank's output
    channels, `output_layouts` (default Shard(1)); a local tensor when `use_local_output`.
    Its backward's input gradient is Partial(sum): reduced where the input's layout asks (one
    all_reduce for a Replicate input that needs a gradient).
    """

    _default_input = Replicate()
    _default_output = Shard(1)

    def _layouts_for(self, module):
        out_dim, _ = _weight_dims(module)
        return {"weight": Shard(out_dim), "bias": Shard(0)}, Replicate()


class InputChannelParallel(_ChannelStyle):
    """A convolution split by input channels (RowwiseParallel's analogue): weight Shard(in), bias Replicate.

    Input: `input_layouts` (default Shard(1): a plain tensor is this rank's channels), moved to
    Shard(1). The output is Partial(sum) (the bias added once), moved to `output_layouts`
    (default Replicate: one all_reduce; Shard(1): one reduce_scatter); local when `use_local_output`.
    """

    _default_input = Shard(1)
    _default_output = Replicate()

    def _layouts_for(self, module):
        _, in_dim = _weight_dims(module)
        return {"weight": Shard(in_dim), "bias": Replicate()}, Shard(1)


class ChannelParallel(_ChannelStyle):
    """A norm on channel-sharded activations (SequenceParallel's analogue on channels): parameters (and
    BatchNorm's running statistics) Shard(0), input and output Shard(1), no collective.

    GroupNorm: each rank must hold whole groups (`num_groups` divisible by the mesh size), else
    ShardingError; BatchNorm: its per-channel statistics over the rank's whole batch (no collective).
    Input: `input_layouts` (default Shard(1)); output `output_layouts` (default Shard(1)), local
    when `use_local_output`.
    """

    _default_input = Shard(1)
    _default_output = Shard(1)
    _modules = _CHANNEL_NORMS

    def _check(self, module, mesh):
        super()._check(module, mesh)
        if isinstance(module, nn.GroupNorm) and module.num_groups % mesh.size() != 0:
            raise ShardingError(
                f"ChannelParallel: GroupNorm has {module.num_groups} groups, which {mesh.size()} ranks cannot hold "
                "whole (each rank normalizes its own groups); use a mesh size dividing the group count, or leave "
                "the norm replicated"
            )

    def _layouts_for(self, module):
        return {"*": Shard(0)}, Shard(1)

    def _partition(self, module, mesh, params):
        super()._partition(module, mesh, params)
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.ndim == 1:  # BatchNorm's running statistics: per channel
                module.register_buffer(name, distribute_tensor(buf, mesh, [Shard(0)], src_data_rank=self.src_data_rank))
