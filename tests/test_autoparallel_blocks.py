"""so.autoparallel on repeated convolutional blocks: a channel-parallel pair inside a ResNet-style block is
found from the traced forward (not names, not call order), planned once for every block under wildcard
keys, chosen where it moves fewer bytes, exact in strict mode against single-device torch, and its
measured bytes are its prediction. A pair broken by an op that mixes the channels is not offered."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

import shardops as so
from shardops.autoparallel.structure import find_structure
from shardops.parallel import ChannelParallel, InputChannelParallel, OutputChannelParallel, parallelize_module
from test_autoparallel import _regression_loss, _same_pricing_from_metadata, _trains_exactly

F32 = 4
CHANNELS = 32


class _Unit(nn.Module):
    """conv -> norm -> relu -> (`between`) -> conv -> norm, added to the input (ResNet's basic block), under
    names no rule knows. Counts its forwards."""

    calls = 0

    def __init__(self, channels: int, norm, between=None):
        super().__init__()
        self.widen, self.settle = nn.Conv2d(channels, channels, 3, padding=1), norm(channels)
        self.narrow, self.calm = nn.Conv2d(channels, channels, 3, padding=1), norm(channels)
        self.between = between

    def forward(self, x):
        _Unit.calls += 1
        h = torch.relu(self.settle(self.widen(x)))
        if self.between is not None:
            h = self.between(h)
        return torch.relu(x + self.calm(self.narrow(h)))


def _group_norm(channels: int) -> nn.Module:
    return nn.GroupNorm(4, channels)


class _ResNet(nn.Module):
    """A stem conv, max pooling, `depth` repeated units, global average pooling and a Linear head."""

    def __init__(self, depth: int = 3, norm=_group_norm, between=None, channels: int = CHANNELS):
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.pool = nn.Conv2d(3, channels, 3, padding=1), nn.MaxPool2d(2)
        self.units = nn.ModuleList([_Unit(channels, norm, between) for _ in range(depth)])
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 4))

    def forward(self, x):
        h = self.pool(torch.relu(self.stem(x)))
        for unit in self.units:
            h = unit(h)
        return self.head(h)


PAIR = {
    "units.*.widen": "OutputChannelParallel()",
    "units.*.settle": "ChannelParallel()",
    "units.*.narrow": "InputChannelParallel()",
}


def _images(batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def _channel_candidates(plan):
    return [s for s in plan.considered if s.candidate.conv_pairs_tp]


def _expected_bytes(net: _ResNet, x: torch.Tensor, mesh_shape: tuple[int, ...]) -> int:
    """The channel-parallel plan's traffic on one rank, from shapes: per unit, the pair's Partial output
    all_reduced forward and its input gradient all_reduced backward (the unit's input, this rank's batch
    slice), and over a dp dim replicate's all_reduce of every gradient as the rank holds it (the pair's
    convolutions and norm split by channels over tp, the rest whole)."""
    tp = mesh_shape[-1]
    dp = math.prod(mesh_shape) // tp
    with torch.no_grad():
        unit_input = net.pool(torch.relu(net.stem(x)))
    pair = len(net.units) * 2 * unit_input.numel() // dp * F32
    if dp == 1:
        return pair
    split = {"widen.weight", "widen.bias", "settle.weight", "settle.bias", "narrow.weight"}  # in each unit
    grads = sum(
        p.numel() * F32 // (tp if n.startswith("units.") and n.split(".", 2)[2] in split else 1)
        for n, p in net.named_parameters()
    )
    return pair + grads


def test_a_pair_inside_repeated_blocks_is_found_from_the_traced_forward_under_wildcard_keys():
    """widen -> GroupNorm -> relu -> narrow inside each unit: one pair for all of them, keyed by the units'
    wildcard, its weights counted for every unit; the stem (max pooling after it) pairs with nothing."""
    net = _ResNet(depth=3)
    (pair,) = find_structure(net, (_images(),)).conv_pairs
    assert (pair.out_conv, pair.norms, pair.in_conv) == ("units.*.widen", ("units.*.settle",), "units.*.narrow")
    assert pair.weights == 3 * 2 * CHANNELS * CHANNELS * 9 and pair.groups == (4,)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
def test_the_blocks_channel_parallel_pair_is_chosen_where_it_moves_fewer_bytes_and_trains_exactly(mesh_shape):
    """Three units of 32 channels, 4 images of 8 x 8: each unit's two reductions (its input's size) against
    replicate's all_reduce of 57k parameters. The channel-parallel plan wins on (4,) and on (2, 2) (there
    beside replicate over dp), the residual stream between the units stays whole; priced from metadata
    exactly as run, and the step equals single-device torch's with its predicted bytes measured."""
    net, x = _ResNet(), _images()
    loss_fn = _regression_loss(4)
    plan = so.autoparallel(net, mesh_shape, (x,), loss_fn=loss_fn)
    replicate = next(s for s in plan.considered if s.candidate.tp_dim is None)
    assert replicate.measurement.total_bytes == sum(p.numel() * F32 for p in net.parameters())
    assert [s.candidate.conv_pairs_tp for s in _channel_candidates(plan)] == [(True,)]
    assert plan.candidate.conv_pairs_tp == (True,) and plan.candidate.tp_dim == len(mesh_shape) - 1, str(plan)
    assert {e.key: e.text for e in plan.chosen.entries} == PAIR
    assert plan.predicted_bytes == _expected_bytes(net, x, mesh_shape) < replicate.measurement.total_bytes
    _same_pricing_from_metadata(plan, net, mesh_shape, (x,), loss_fn=loss_fn)
    _trains_exactly(plan, net, x, loss_fn)


def test_batchnorm_units_split_by_channels_keep_the_whole_batch_statistics():
    """BatchNorm between the pair on (4,): tensor parallelism only, so each rank normalizes its channels over
    the whole batch, as one device does: the plan is exact against single-device torch."""
    net, x = _ResNet(norm=nn.BatchNorm2d), _images()
    loss_fn = _regression_loss(4)
    plan = so.autoparallel(net, (4,), (x,), loss_fn=loss_fn)
    assert plan.candidate.dims == ("tp",) and {e.key: e.text for e in plan.chosen.entries} == PAIR
    _trains_exactly(plan, net, x, loss_fn)


def test_planning_work_does_not_grow_with_the_number_of_units():
    """Structure and pricing see a 1- and a 2-unit copy only: planning 3 and 12 units runs the same number of
    unit forwards and gives the same plan keys."""
    x = _images()
    calls, keys = {}, {}
    for depth in (3, 12):
        net = _ResNet(depth)
        _Unit.calls = 0
        plan = so.autoparallel(net, (4,), (x,), loss_fn=_regression_loss(4), pricing="metadata")
        calls[depth], keys[depth] = _Unit.calls, plan.parallelize_plan.keys()
        assert plan.predicted_bytes == _expected_bytes(net, x, (4,))
    assert calls[3] == calls[12] > 0
    assert keys[3] == keys[12] == PAIR.keys()


class _Shuffle(nn.Module):
    """ShuffleNet's channel shuffle: the channels leave their places (same shape, so call order cannot tell)."""

    def forward(self, h):
        n, c, height, width = h.shape
        return h.view(n, 2, c // 2, height, width).transpose(1, 2).reshape(n, c, height, width)


class _CenterChannels(nn.Module):
    """Subtracts the mean over the channels at each position: each channel reads all the others."""

    def forward(self, h):
        return h - h.mean(1, keepdim=True)


@pytest.mark.parametrize("between", [_Shuffle, _CenterChannels], ids=["shuffle", "channel-mean"])
def test_a_pair_broken_by_an_op_mixing_the_channels_is_not_offered(between):
    """A functional op between the convolutions that mixes the channels (no module the call order sees):
    no pair, only data parallelism is searched."""
    net, x = _ResNet(between=between()), _images()
    assert find_structure(net, (x,)).conv_pairs == []
    plan = so.autoparallel(net, (4,), (x,), loss_fn=_regression_loss(4), pricing="metadata")
    assert all(s.candidate.tp_dim is None for s in plan.considered)


def test_the_shuffled_pair_split_by_channels_would_be_silently_wrong():
    """Why the shuffle breaks the pair: forced onto (2,) by hand, the channel-parallel styles run without
    error (shapes agree on each rank) and give another output than single-device torch."""
    net, x = _ResNet(depth=1, between=_Shuffle()), _images()
    expected = net(x).detach()

    def main():
        mesh = so.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        plan = {"units.0.widen": OutputChannelParallel(), "units.0.settle": ChannelParallel()}
        plan["units.0.narrow"] = InputChannelParallel()
        return parallelize_module(copy.deepcopy(net), mesh, plan)(x).detach()

    for got in so.run(main, 2):
        assert got.shape == expected.shape and not torch.allclose(got, expected, rtol=1e-3, atol=1e-4)


def test_a_convolution_whose_output_also_feeds_the_residual_pairs_with_nothing():
    """widen's output read by narrow and added to the unit's output too: on a rank it is only its channels
    there, so the pair is not offered."""

    class Leaky(_Unit):
        def forward(self, x):
            a = self.widen(x)
            return torch.relu(x + a + self.calm(self.narrow(torch.relu(self.settle(a)))))

    net = _ResNet()
    net.units = nn.ModuleList([Leaky(CHANNELS, _group_norm) for _ in range(3)])
    assert find_structure(net, (_images(),)).conv_pairs == []


class _TwoPairUnit(nn.Module):
    """Two residual halves in one unit, two pair kinds: a -> norm -> b (3 x 3), then a 1 x 1 bottleneck
    c -> d through 8 channels: little work, as much traffic split (the unit's input size, reduced)."""

    def __init__(self, channels: int):
        super().__init__()
        self.a, self.a_norm = nn.Conv2d(channels, channels, 3, padding=1), _group_norm(channels)
        self.b = nn.Conv2d(channels, channels, 3, padding=1)
        self.c, self.d = nn.Conv2d(channels, 8, 1), nn.Conv2d(8, channels, 1)

    def forward(self, x):
        x = torch.relu(x + self.b(torch.relu(self.a_norm(self.a(x)))))
        return x + self.d(torch.relu(self.c(x)))


def test_each_pair_kind_of_a_block_is_one_choice_taken_by_every_block():
    """Two pairs per unit, each split or not in every unit alike (wildcard keys). Splitting only the
    bottleneck leaves each rank most of the work (not considered); splitting both moves the bottleneck's
    reductions too, so the plan splits the 3 x 3 pair only: measured = predicted, exact in strict mode."""
    net, x = _ResNet(), _images()
    net.units = nn.ModuleList([_TwoPairUnit(CHANNELS) for _ in range(3)])
    loss_fn = _regression_loss(4)
    pairs = [(p.out_conv, p.in_conv) for p in find_structure(net, (x,)).conv_pairs]
    assert pairs == [("units.*.a", "units.*.b"), ("units.*.c", "units.*.d")]
    plan = so.autoparallel(net, (4,), (x,), loss_fn=loss_fn, pricing="metadata")
    channel = {s.candidate.conv_pairs_tp: s.measurement.total_bytes for s in _channel_candidates(plan)}
    reductions = 3 * 2 * x.shape[0] * CHANNELS * 4 * 4 * F32  # per pair kind: each unit's input size, both ways
    assert channel == {(True, True): 2 * reductions, (True, False): reductions}
    assert plan.candidate.conv_pairs_tp == (True, False)
    assert plan.parallelize_plan.keys() == {"units.*.a", "units.*.a_norm", "units.*.b"}
    _trains_exactly(plan, net, x, loss_fn)
