"""Channel-parallel convolution pairs (OutputChannelParallel -> [ReLU, ChannelParallel norm] ->
InputChannelParallel): forward and backward equal single-device torch's, and the only traffic is the
pair's Partial reduction (conv k+1's output forward, conv k's input gradient backward), sized here."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import shardops as so
from parallel_harness import strict
from shardops.parallel import (
    ChannelParallel,
    ColwiseParallel,
    InputChannelParallel,
    OutputChannelParallel,
    parallelize_module,
)

F32 = 4


class ConvPair(nn.Module):
    """conv k -> norm -> ReLU -> conv k+1 (a ResNet block's body without its residual)."""

    def __init__(self, c_in: int, c_mid: int, c_out: int, norm: nn.Module | None = None, dims: int = 2):
        super().__init__()
        torch.manual_seed(0)
        conv = {1: nn.Conv1d, 2: nn.Conv2d}[dims]
        self.conv1 = conv(c_in, c_mid, 3, padding=1)
        self.norm = norm if norm is not None else nn.Identity()
        self.conv2 = conv(c_mid, c_out, 3, padding=1)

    def forward(self, x):
        return self.conv2(torch.relu(self.norm(self.conv1(x))))


def _plan(model: ConvPair, output=None) -> dict:
    plan = {
        "conv1": OutputChannelParallel(),
        "conv2": InputChannelParallel(output_layouts=output, use_local_output=output is None),
    }
    if not isinstance(model.norm, nn.Identity):
        plan["norm"] = ChannelParallel()
    return plan


def _reference(model: nn.Module, x: torch.Tensor):
    model, x = copy.deepcopy(model), x.clone().requires_grad_()
    out = model(x)
    (out * _weights(out)).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def _weights(out: torch.Tensor) -> torch.Tensor:
    """A fixed, non-uniform upstream gradient (so a wrong channel order cannot cancel out)."""
    return torch.linspace(-1, 1, out.numel()).reshape(out.shape)


def _full(t):
    return t.full_tensor() if isinstance(t, so.DTensor) else t


def _sharded_step(model: nn.Module, x: torch.Tensor, world: int, output=None):
    def main():
        mesh = so.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        m = parallelize_module(copy.deepcopy(model), mesh, _plan(model, output))
        local_x = x.clone().requires_grad_()
        with strict():
            with so.CommDebugMode() as fwd:
                out = m(local_x)
            full_out = _full(out)
            weights = _weights(full_out)
            if isinstance(out, so.DTensor):  # reduce-scattered output: this rank's channels of the weights
                weights = so.distribute_tensor(weights, mesh, out.placements)
            with so.CommDebugMode() as bwd:
                (out * weights).sum().backward()
            with so.CommDebugMode() as sync, torch.no_grad():
                grads = {
                    n: p.grad.to_local() if isinstance(p.grad, so.DTensor) else p.grad for n, p in m.named_parameters()
                }
        full_grads = {n: _full(p.grad) for n, p in m.named_parameters()}
        return fwd.log, bwd.log, sync.log, full_out.detach(), local_x.grad, full_grads, grads

    return so.run(main, world)


@pytest.mark.parametrize(
    "world, c_in, c_mid, c_out, norm",
    [
        (2, 3, 8, 6, lambda: nn.GroupNorm(4, 8)),
        (4, 3, 8, 6, lambda: nn.GroupNorm(4, 8)),
        (2, 3, 7, 5, None),  # uneven: 4 + 3 channels
        (4, 2, 10, 3, None),  # uneven: 3, 3, 3, 1
        (4, 3, 8, 4, lambda: nn.BatchNorm2d(8)),
    ],
    ids=["2-groupnorm", "4-groupnorm", "2-uneven", "4-uneven", "4-batchnorm"],
)
def test_a_conv_pair_split_by_channels_equals_torch_and_sends_only_its_partial_reduction(
    world, c_in, c_mid, c_out, norm
):
    model = ConvPair(c_in, c_mid, c_out, norm() if norm else None)
    x = torch.randn(2, c_in, 6, 5, generator=torch.Generator().manual_seed(1))
    ref_out, ref_dx, ref_grads = _reference(model, x)
    out_bytes = x.shape[0] * c_out * x.shape[2] * x.shape[3] * F32  # conv k+1's output: Partial -> Replicate
    dx_bytes = x.numel() * F32  # conv k's input gradient: Partial -> Replicate (the input is replicated)
    for fwd, bwd, sync, out, dx, grads, _ in _sharded_step(model, x, world):
        assert fwd == [("all_reduce", out_bytes)]
        assert bwd == [("all_reduce", dx_bytes)]
        assert sync == []
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-5)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5, msg=name)


def test_parameters_are_laid_out_by_channels_and_batchnorm_running_statistics_follow():
    model = ConvPair(3, 8, 4, nn.BatchNorm2d(8))
    x = torch.randn(2, 3, 6, 5, generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(model)
    reference(x)

    def main():
        mesh = so.init_device_mesh("cpu", (2,))
        m = parallelize_module(copy.deepcopy(model), mesh, _plan(model))
        with strict():
            m(x)
        return {n: (p.placements, _full(p).detach()) for n, p in [*m.named_parameters(), *m.named_buffers()]}

    for layouts in so.run(main, 2):
        assert layouts["conv1.weight"][0] == (so.Shard(0),) and layouts["conv1.bias"][0] == (so.Shard(0),)
        assert layouts["conv2.weight"][0] == (so.Shard(1),) and layouts["conv2.bias"][0] == (so.Replicate(),)
        assert layouts["norm.running_mean"][0] == (so.Shard(0),)
        for name, value in [*reference.named_parameters(), *reference.named_buffers()]:
            if name != "norm.num_batches_tracked":
                torch.testing.assert_close(layouts[name][1], value.detach(), msg=name)


def test_a_reduce_scattered_output_sends_one_reduce_scatter_of_the_output():
    """output_layouts=Shard(1): the Partial output is reduce-scattered over its channels instead."""
    model = ConvPair(3, 8, 6, nn.GroupNorm(2, 8))
    x = torch.randn(2, 3, 6, 5, generator=torch.Generator().manual_seed(1))
    ref_out, ref_dx, ref_grads = _reference(model, x)
    out_bytes = x.shape[0] * 6 * x.shape[2] * x.shape[3] * F32  # a reduce_scatter counts its whole input
    for fwd, bwd, _, out, dx, grads, _ in _sharded_step(model, x, 2, output=so.Shard(1)):
        assert fwd == [("reduce_scatter", out_bytes)]
        # the reduce_scatter's transpose (an all_gather counts its shard), then conv k's input gradient
        assert bwd == [("all_gather", out_bytes // 2), ("all_reduce", x.numel() * F32)]
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-5)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5, msg=name)


def test_a_conv1d_pair_splits_like_a_conv2d_pair():
    model = ConvPair(3, 6, 5, dims=1)
    x = torch.randn(2, 3, 9, generator=torch.Generator().manual_seed(1))
    ref_out, ref_dx, _ = _reference(model, x)
    for fwd, bwd, _, out, dx, _, _ in _sharded_step(model, x, 2):
        assert fwd == [("all_reduce", 2 * 5 * 9 * F32)] and bwd == [("all_reduce", x.numel() * F32)]
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "style, module, message",
    [
        (OutputChannelParallel, lambda: nn.Linear(4, 4), "supports Conv1d"),
        (InputChannelParallel, lambda: nn.Conv2d(4, 4, 3, groups=2), "groups=2"),
        (ChannelParallel, lambda: nn.GroupNorm(2, 8), "2 groups, which 4 ranks cannot hold whole"),
        (ColwiseParallel, lambda: nn.Conv2d(4, 4, 3), "supports nn.Linear"),
    ],
)
def test_a_module_the_style_cannot_split_raises_a_sharding_error(style, module, message):
    def main():
        mesh = so.init_device_mesh("cpu", (4,))
        with pytest.raises(so.ShardingError, match=message):
            parallelize_module(module(), mesh, style())

    so.run(main, 4)


def test_a_channel_style_needs_a_one_dimensional_mesh():
    def main():
        mesh = so.init_device_mesh("cpu", (2, 2))
        with pytest.raises(so.ShardingError, match="needs a 1-d mesh"):
            OutputChannelParallel()._apply(nn.Conv2d(4, 4, 3), mesh)

    so.run(main, 4)
