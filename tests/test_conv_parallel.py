"""Channel-parallel convolution pairs (OutputChannelParallel -> [ReLU, ChannelParallel norm] ->
InputChannelParallel): forward and backward equal single-device torch's, and the only traffic is the
pair's Partial reduction (conv k+1's output forward, conv k's input gradient backward), sized here."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn as nn

import shardops as so
from parallel_harness import count_step, strict
from shardops.parallel import (
    ChannelParallel,
    ColwiseParallel,
    InputChannelParallel,
    OutputChannelParallel,
    parallelize_module,
)
from test_autoparallel import _regression_loss, _same_pricing_from_metadata, _SmallResNet

F32 = 4


class ConvPair(nn.Module):
    """conv k -> norm -> ReLU -> conv k+1 (a ResNet block's body without its residual)."""

    def __init__(self, c_in: int, c_mid: int, c_out: int, norm: nn.Module | None = None, dims: int = 2):
        super().__init__()
        torch.manual_seed(0)
        conv = {1: nn.Conv1d, 2: nn.Conv2d, -2: nn.ConvTranspose2d}[dims]
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


@pytest.mark.parametrize("dims, x_shape", [(1, (2, 3, 9)), (-2, (2, 3, 5, 4))], ids=["conv1d", "conv_transpose2d"])
def test_a_conv1d_or_transposed_pair_splits_like_a_conv2d_pair(dims, x_shape):
    """Conv1d, and ConvTranspose2d (its weight [in, out, k, k]: output channels on dim 1, input on dim 0)."""
    model = ConvPair(3, 6, 5, dims=dims)
    x = torch.randn(*x_shape, generator=torch.Generator().manual_seed(1))
    ref_out, ref_dx, ref_grads = _reference(model, x)
    for fwd, bwd, _, out, dx, grads, _ in _sharded_step(model, x, 2):
        assert fwd == [("all_reduce", ref_out.numel() * F32)] and bwd == [("all_reduce", x.numel() * F32)]
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-5)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5, msg=name)


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


# ---- so.autoparallel's channel-parallel candidates (autoparallel/conv_pairs.py)


def _channel_candidates(plan):
    return [s for s in plan.considered if s.candidate.conv_pairs_tp]


def _expected_pair_bytes(net, x, dp: int) -> int:
    """The split pair's traffic on one rank, from shapes: its Partial output all_reduced forward and its input
    gradient all_reduced backward (the block's input: this rank's batch slice), plus replicate's all_reduce over
    dp of every gradient as the rank holds it (the pair's parameters split by channels over tp)."""
    with torch.no_grad():
        block_input = net.pool(torch.relu(net.stem(x)))  # what conv1 reads and conv2 writes: same shape here
    pair = 2 * block_input.numel() // dp * F32
    if dp == 1:
        return pair
    tp = 4 // dp
    split = {"block.conv1.weight", "block.conv1.bias", "block.norm1.weight", "block.norm1.bias", "block.conv2.weight"}
    grads = sum(p.numel() * F32 // (tp if n in split else 1) for n, p in net.named_parameters())
    return pair + grads


def _train_candidate(plan, scored, net, x, loss_fn):
    """The candidate applied as the plan would be, strict mode: single-device loss and gradients, and its bytes."""
    chosen = dataclasses.replace(plan, chosen=scored)
    ref = copy.deepcopy(net)
    ref_loss = loss_fn(ref(x), x)
    ref_loss.backward()

    def main():
        model = chosen.apply(copy.deepcopy(net))
        local = chosen.local_batch(x)
        with strict():
            return count_step(model, local, lambda out: loss_fn(out, local))

    results = so.run(main, 4)
    dp = math.prod(plan.mesh_shape[d] for d in scored.candidate.dp_dims)
    # each dp rank's loss is its slice's mean (tp ranks of one slice alike): their mean is the batch's
    torch.testing.assert_close(torch.stack([r[1] for r in results]).mean(), ref_loss.detach(), rtol=1e-4, atol=1e-6)
    for sent, _, grads in results:
        assert sent == scored.measurement.total_bytes
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    return dp


def test_autoparallel_prices_the_resnet_blocks_conv_pair_by_channels_and_keeps_replicate_on_2x2():
    """The ResNet-style CNN's block (conv1 -> GroupNorm(2) -> ReLU -> conv2) is a channel-parallel pair on a
    tp dim of 2: priced from metadata exactly as run, trained exactly; replicate wins on bytes (the block's
    activations it reduces, 2 x 2 KB, plus the other gradients, outweigh the 1,460 parameters' all_reduce)."""
    net = _SmallResNet()
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    loss_fn = _regression_loss(4)
    kwargs = {"loss_fn": loss_fn, "memory_per_rank": 10**9}  # a limit: fully_shard's candidates are searched too
    plan = so.autoparallel(net, (2, 2), (x,), **kwargs)
    assert {s.candidate.dp_mode for s in plan.considered} == {"replicate", "fully_shard"}
    channel = _channel_candidates(plan)
    assert [s.candidate.conv_pairs_tp for s in channel] == [(True,)] * 3  # replicate, fully_shard x 2 over dp
    assert all(s.measurement.feasible for s in channel)
    entries = {e.key: e.text for e in channel[0].entries}
    assert entries == {
        "block.conv1": "OutputChannelParallel()",
        "block.norm1": "ChannelParallel()",
        "block.conv2": "InputChannelParallel()",
    }
    replicate_pair = next(s for s in channel if s.candidate.dp_mode == "replicate")
    assert replicate_pair.measurement.total_bytes == _expected_pair_bytes(net, x, dp=2)
    assert plan.candidate.dims == ("dp", "dp") and plan.candidate.dp_mode == "replicate"
    assert plan.predicted_bytes == sum(p.numel() * F32 for p in net.parameters()) < _expected_pair_bytes(net, x, 2)
    assert "block.conv1: (not in plan)\n    runner-up" in plan.explain()
    _same_pricing_from_metadata(plan, net, (2, 2), (x,), **kwargs)
    _train_candidate(plan, replicate_pair, net, x, loss_fn)


@pytest.mark.parametrize("mesh_shape", [(4,), (8,)], ids=["4", "8"])
def test_a_groupnorm_of_two_groups_rules_the_pair_out_on_four_and_eight_ranks(mesh_shape):
    """GroupNorm(2, 8) between the convs: 4 or 8 ranks cannot each hold whole groups, so no channel-parallel
    candidate exists there (the norm would need the whole channels of a group)."""
    net = _SmallResNet()
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    plan = so.autoparallel(net, mesh_shape, (x,), loss_fn=_regression_loss(4), pricing="metadata")
    assert not _channel_candidates(plan) and set(plan.candidate.dims) == {"dp"}


class _WideResNet(nn.Module):
    """The same shape of network with 32 channels and a small batch: its gradients outweigh its activations."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.pool = nn.Conv2d(3, 32, 3, padding=1), nn.MaxPool2d(2)
        self.conv1, self.norm1 = nn.Conv2d(32, 32, 3, padding=1), nn.GroupNorm(4, 32)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4))

    def forward(self, x):
        h = self.pool(torch.relu(self.stem(x)))
        return self.head(torch.relu(h + self.conv2(torch.relu(self.norm1(self.conv1(h))))))


def test_autoparallel_chooses_the_channel_parallel_pair_where_it_moves_fewer_bytes():
    """On (4,) with 32 channels and 4 images of 8 x 8: the pair's two reductions (4 x 32 x 4 x 4 floats each)
    against replicate's all_reduce of 19k parameters: the channel-parallel plan wins, and trains exactly."""
    net = _WideResNet()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    loss_fn = _regression_loss(4)
    plan = so.autoparallel(net, (4,), (x,), loss_fn=loss_fn)
    assert plan.candidate.dims == ("tp",) and plan.candidate.conv_pairs_tp == (True,)
    activation = 4 * 32 * 4 * 4 * F32
    assert plan.predicted_bytes == 2 * activation < sum(p.numel() * F32 for p in net.parameters())
    assert "'conv1': OutputChannelParallel()" in str(plan)
    _train_candidate(plan, plan.chosen, net, x, loss_fn)
