"""The convolutional family (ops/convolution.py, pooling.py, group_norm.py, batch_norm.py)
against single-device torch: values, gradients, layouts and bytes, in strict mode, with
uneven and empty shards (a batch of 5 over 4 ranks: 2, 2, 1, 0; 3 channels over 4 ranks).
End to end: a small CNN and ResNet-style blocks (GroupNorm, BatchNorm) with the batch
sharded on (2,) and (2, 2) meshes move no activation bytes, forward and backward.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardops as so
from matrix_harness import check, make, strict_mode
from shardops import Partial, Replicate, Shard

R = Replicate()
S = Shard
SUM = Partial("sum")
aten = torch.ops.aten


# ------------------------------------------------------------------ convolution


def _dt(t: object) -> so.DTensor:
    """`t`, an op's result on DTensors (or a DTensor's gradient): a DTensor."""
    assert isinstance(t, so.DTensor), type(t)
    return t


def conv2d(x, w, b=None):
    return F.conv2d(x, w, b, padding=1)


X = (5, 8, 6, 5)  # batch 5: uneven over 2 and 4 ranks, empty on the 4th of 4
W = (4, 8, 3, 3)


@pytest.mark.parametrize(
    "mesh, layouts, out",
    [
        ((4,), [(S(0),), (R,), (R,)], (S(0),)),  # batch: local
        ((4,), [(R,), (S(0),), (S(0),)], (S(1),)),  # output channels: local
        ((4,), [(S(1),), (S(1),), (R,)], (SUM,)),  # input channels: a contracting dim
        ((2, 2), [(S(0), S(1)), (R, S(1)), (R, R)], (S(0), SUM)),
        ((2, 2), [(S(0), S(0)), (R, R), (R, R)], (S(0), S(0))),
        ((2, 2), [(S(0), R), (R, S(0)), (R, S(0))], (S(0), S(1))),
    ],
)
def test_conv2d_layouts_move_nothing(mesh, layouts, out):
    r = check(conv2d, [make(X, 0), make(W, 1), make((4,), 2)], mesh, layouts)
    assert r.nbytes == 0, r.counts
    assert r.out_layout == out


@pytest.mark.parametrize("groups", [4, 8])
def test_grouped_conv_keeps_whole_groups_per_rank(groups):
    """groups 4 on 4 ranks: one group each; groups 8 (depthwise): two channels each."""
    fn = lambda x, w, b: F.conv2d(x, w, b, padding=1, groups=groups)  # noqa: E731
    fulls = [make(X, 3), make((8, 8 // groups, 3, 3), 4), make((8,), 5)]
    for mesh, layouts, out in [
        ((4,), [(S(1),), (S(0),), (S(0),)], (S(1),)),
        ((2, 2), [(S(0), S(1)), (R, S(0)), (R, S(0))], (S(0), S(1))),
    ]:
        r = check(fn, fulls, mesh, layouts)
        assert r.nbytes == 0, r.counts
        assert r.out_layout == out


def test_grouped_conv_across_group_boundaries_is_exact():
    """groups 2 over 4 ranks: no shard holds whole groups, so no local row; the planner moves the input."""
    fn = lambda x, w: F.conv2d(x, w, groups=2)  # noqa: E731
    check(fn, [make((2, 4, 4, 4), 6), make((4, 2, 3, 3), 7)], (4,), [(S(1),), (S(0),)], strict=False)


def test_grouped_conv_is_linear_in_a_pending_operand():
    fn = lambda x, w: F.conv2d(x, w, groups=2)  # noqa: E731
    fulls = [make((2, 4, 4, 4), 38), make((4, 2, 3, 3), 39)]
    for layouts in ([(SUM,), (R,)], [(R,), (SUM,)]):
        r = check(fn, fulls, (4,), layouts)
        assert r.nbytes == 0 and r.out_layout == (SUM,), r


@pytest.mark.parametrize(
    "layouts, out",
    [([(S(1),), (S(0),), (R,)], (SUM,)), ([(R,), (S(1),), (S(0),)], (S(1),)), ([(S(0),), (R,), (R,)], (S(0),))],
)
def test_transposed_conv(layouts, out):
    fn = lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, output_padding=1)  # noqa: E731
    r = check(fn, [make(X, 8), make((8, 3, 3, 3), 9), make((3,), 10)], (4,), layouts)
    assert r.nbytes == 0, r.counts
    assert r.out_layout == out


def test_conv1d_and_conv3d_over_a_sharded_batch():
    c1 = lambda x, w: F.conv1d(x, w, stride=2, dilation=2)  # noqa: E731
    r = check(c1, [make((5, 4, 9), 11), make((6, 4, 2), 12)], (4,), [(S(0),), (R,)])
    assert r.nbytes == 0 and r.out_layout == (S(0),)
    c3 = lambda x, w: F.conv3d(x, w, padding=1)  # noqa: E731
    r = check(c3, [make((3, 2, 3, 4, 3), 13), make((4, 2, 3, 3, 3), 14)], (2, 2), [(S(0), S(1)), (R, S(1))])
    assert r.nbytes == 0 and r.out_layout == (S(0), SUM)


def test_pointwise_conv_keeps_a_sharded_spatial_dim():
    """A 1x1 kernel with stride 1 and no padding reads only its own position: S(2) stays local."""
    fn = lambda x, w, b: F.conv2d(x, w, b)  # noqa: E731
    r = check(fn, [make((2, 4, 7, 5), 15), make((6, 4, 1, 1), 16), make((6,), 17)], (4,), [(S(2),), (R,), (R,)])
    assert r.nbytes == 0 and r.out_layout == (S(2),)


def test_channel_sharded_conv_sends_only_its_partial_reduction():
    x, w, b = make((4, 16, 6, 6), 18), make((4, 16, 3, 3), 19), make((4,), 20)
    want = F.conv2d(x, w, b, padding=1)

    def main():
        mesh = so.init_device_mesh("cpu", (4,))
        xd, wd = so.distribute_tensor(x, mesh, [S(1)]), so.distribute_tensor(w, mesh, [S(1)])
        bd = so.distribute_tensor(b, mesh, [R])
        with so.CommDebugMode() as comm:
            y = F.conv2d(xd, wd, bd, padding=1)
        assert comm.get_total_bytes() == 0 and y.placements == (SUM,), (comm.get_comm_counts(), y.placements)
        with so.CommDebugMode() as comm:
            full = y.redistribute(mesh, [R]).to_local()
        return full, dict(comm.get_comm_counts()), comm.get_total_bytes()

    with strict_mode():
        results = so.run(main, 4)
    for full, counts, nbytes in results:
        torch.testing.assert_close(full, want, rtol=2e-5, atol=2e-5)  # the bias added once
        assert counts == {"all_reduce": 1}
        assert nbytes == want.numel() * want.element_size()


def test_weight_gradient_of_a_batch_sharded_conv_is_pending():
    x, w, g = make((5, 3, 6, 6), 21), make((4, 3, 3, 3), 22), make((5, 4, 4, 4), 23)
    want = aten.convolution_backward(g, x, w, [4], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True])

    def main():
        mesh = so.init_device_mesh("cpu", (4,))
        gd, xd = so.distribute_tensor(g, mesh, [S(0)]), so.distribute_tensor(x, mesh, [S(0)])
        wd = so.distribute_tensor(w, mesh, [R])
        with so.CommDebugMode() as comm:
            outs = aten.convolution_backward(
                gd, xd, wd, [4], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True]
            )
        assert comm.get_total_bytes() == 0
        return [o.placements for o in outs], [o.full_tensor() for o in outs]

    with strict_mode():
        results = so.run(main, 4)
    for layouts, outs in results:
        assert layouts == [(S(0),), (SUM,), (SUM,)]
        for got, ref in zip(outs, want):
            torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------ pooling and upsampling

PLANE_OPS = {
    "max_pool2d": lambda x: F.max_pool2d(x, 3, stride=2, padding=1),
    "max_pool2d_indices": lambda x: F.max_pool2d(x, 2, return_indices=True)[1].to(x.dtype) + F.max_pool2d(x, 2),
    "avg_pool2d": lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False),
    "adaptive_avg_pool2d": lambda x: F.adaptive_avg_pool2d(x, (3, 2)),
    "adaptive_max_pool2d": lambda x: F.adaptive_max_pool2d(x, 3),
    "max_pool1d": lambda x: F.max_pool1d(x.flatten(2), 3),
    "avg_pool3d": lambda x: F.avg_pool3d(x.unsqueeze(2), (1, 2, 2)),
    "nearest": lambda x: F.interpolate(x, scale_factor=2),
    "bilinear": lambda x: F.interpolate(x, size=(5, 11), mode="bilinear", align_corners=True),
    "bicubic": lambda x: F.interpolate(x, size=(4, 3), mode="bicubic"),
    "linear1d": lambda x: F.interpolate(x.flatten(2), scale_factor=1.5, mode="linear"),
}


@pytest.mark.parametrize("name", sorted(PLANE_OPS))
def test_plane_ops_are_local_over_batch_and_channels(name):
    x = make((5, 3, 8, 7), 24)  # 3 channels over 4 ranks: one rank holds none
    for mesh, layout in [((4,), (S(0),)), ((4,), (S(1),)), ((2, 2), (S(0), S(1)))]:
        r = check(PLANE_OPS[name], [x], mesh, [layout])
        assert r.nbytes == 0, (layout, r.counts)
        assert r.out_layout == layout


# ------------------------------------------------------------------ group norm


@pytest.mark.parametrize(
    "mesh, layouts",
    [
        ((4,), [(S(0),), (R,), (R,)]),
        ((4,), [(S(1),), (S(0),), (S(0),)]),  # 4 groups over 4 ranks
        ((2, 2), [(S(0), S(1)), (R, S(0)), (R, S(0))]),
        ((2, 2), [(S(0), S(0)), (R, R), (R, R)]),
    ],
)
def test_group_norm_moves_nothing(mesh, layouts):
    fn = lambda x, w, b: F.group_norm(x, 4, w, b)  # noqa: E731
    r = check(fn, [make((5, 8, 4, 3), 25) * 3 + 7, make((8,), 26), make((8,), 27)], mesh, layouts)
    assert r.nbytes == 0, r.counts
    assert r.out_layout == layouts[0]


@pytest.mark.parametrize(
    "mesh, layouts", [((2, 2), [(S(0), S(2)), (R, R), (R, R)]), ((2, 2), [(S(1), S(3)), (S(0), R), (S(0), R)])]
)
def test_group_norm_over_a_sharded_plane_sends_only_its_statistics(mesh, layouts):
    """Spatial dims sharded (uneven: 3 rows over 2, 7 columns over 2): one all_gather of per
    (sample, group) (mean, M2) forward, one all_reduce of two per (sample, group) sums backward."""
    fn = lambda x, w, b: F.group_norm(x, 4, w, b)  # noqa: E731
    r = check(fn, [make((5, 8, 3, 7), 40) * 2 + 30, make((8,), 41), make((8,), 42)], mesh, layouts)
    assert r.out_layout == layouts[0]
    assert r.counts == {"all_gather": 1, "all_reduce": 1}, r.counts
    samples, groups = (3, 4) if layouts[0][0] == S(0) else (5, 2)  # rank 0's (sample, group) rows
    assert r.nbytes == 2 * (2 * 8 * samples * groups)


# ------------------------------------------------------------------ batch norm


def _batch_norm_run(mesh_shape, x_layout, stats_layout, training, x, w, b, rm, rv):
    """F.batch_norm on every rank (strict): output, gradients, running statistics,
    and the bytes of forward and backward."""
    g = make(x.shape, 28)

    def main():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        xd = so.distribute_tensor(x, mesh, list(x_layout)).requires_grad_()
        wd = so.distribute_tensor(w, mesh, list(stats_layout)).requires_grad_()
        bd = so.distribute_tensor(b, mesh, list(stats_layout)).requires_grad_()
        rmd, rvd = (
            so.distribute_tensor(rm, mesh, list(stats_layout)),
            so.distribute_tensor(rv, mesh, list(stats_layout)),
        )
        gd = so.distribute_tensor(g, mesh, list(x_layout))
        with so.CommDebugMode() as fwd:
            y = F.batch_norm(xd, rmd, rvd, wd, bd, training=training, momentum=0.3)
        with so.CommDebugMode() as bwd:
            y.backward(gd)
        assert rmd.placements == tuple(stats_layout)  # the buffers keep their layout
        grads = [t.grad.full_tensor() for t in (xd, wd, bd)]
        return (
            y.full_tensor(),
            grads,
            rmd.full_tensor(),
            rvd.full_tensor(),
            fwd.get_comm_counts(),
            fwd.get_total_bytes(),
            bwd.get_comm_counts(),
            bwd.get_total_bytes(),
        )

    with strict_mode():
        results = so.run(main, int(torch.tensor(mesh_shape).prod()))
    # torch in float64 on the same float32 data: its float32 CPU kernel is itself 1e-4 off for
    # data with a large mean (x * scale + shift cancels), the sharded algorithm is not
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    rm_ref, rv_ref = rm.double(), rv.double()
    want = F.batch_norm(xr, rm_ref, rv_ref, wr, br, training=training, momentum=0.3)
    want.backward(g.double())
    for y, grads, rmg, rvg, *_ in results:
        torch.testing.assert_close(y, want.float(), rtol=1e-5, atol=1e-5)
        for got, ref in zip(grads, (xr.grad, wr.grad, br.grad)):
            # the backward reads the float32 save_mean torch's API keeps (100 to 4e-6)
            torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(rmg, rm_ref.float())
        torch.testing.assert_close(rvg, rv_ref.float())
    return results[0][4:]


def _bn_data(c=6, mean=0.0):
    return make((5, c, 3, 4), 29) + mean, make((c,), 30), make((c,), 31), make((c,), 32), make((c,), 33).abs() + 0.5


@pytest.mark.parametrize(
    "mesh, x_layout", [((4,), (S(0),)), ((4,), (S(2),)), ((2, 2), (S(0), S(0))), ((2, 2), (S(0), S(3)))]
)
def test_training_batch_norm_uses_the_global_batch_statistics(mesh, x_layout):
    """Exact against torch on the global batch (uneven and empty shards, data with a large mean), in
    one all_gather of per-channel (mean, M2) forward and one all_reduce of two per-channel sums backward."""
    c = 6
    fwd, fwd_bytes, bwd, bwd_bytes = _batch_norm_run(mesh, x_layout, (R,) * len(mesh), True, *_bn_data(c, mean=100.0))
    assert dict(fwd) == {"all_gather": 1} and fwd_bytes == 2 * 8 * c  # (mean, M2) per channel, float64
    assert dict(bwd) == {"all_reduce": 1} and bwd_bytes == 2 * 8 * c  # (sum g, sum g*xhat) per channel, float64


@pytest.mark.parametrize("training", [True, False])
def test_channel_sharded_batch_norm_is_local(training):
    counts = _batch_norm_run((4,), (S(1),), (S(0),), training, *_bn_data(6))
    assert counts[1] == 0 and counts[3] == 0, counts


def test_eval_batch_norm_over_a_sharded_batch_is_local():
    """Running statistics: the forward is local; d_weight and d_bias stay pending through backward."""
    counts = _batch_norm_run((2, 2), (S(0), S(0)), (R, R), False, *_bn_data(6))
    assert counts[1] == 0 and counts[3] == 0, counts


def test_batch_norm_without_running_statistics():
    x, w, b = make((5, 4, 6), 34), make((4,), 35), make((4,), 36)
    fn = lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)  # noqa: E731
    check(fn, [x, w, b], (4,), [(S(0),), (R,), (R,)])  # the cost model may move this small x to S(1) instead


def test_batch_norm_in_eval_mode_without_running_statistics_raises():
    def main():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(make((4, 3, 2), 37), mesh, [S(0)])
        with pytest.raises(so.ShardingError, match="running statistics"):
            aten.native_batch_norm(x, None, None, None, None, False, 0.1, 1e-5)

    so.run(main, 2)


# ------------------------------------------------------------------ end to end


class Block(nn.Module):
    """A ResNet basic block: conv, norm, ReLU, conv, norm, the residual, ReLU."""

    def __init__(self, c: int, norm):
        super().__init__()
        self.conv1, self.n1 = nn.Conv2d(c, c, 3, padding=1, bias=False), norm(c)
        self.conv2, self.n2 = nn.Conv2d(c, c, 3, padding=1, bias=False), norm(c)

    def forward(self, x):
        return F.relu(x + self.n2(self.conv2(F.relu(self.n1(self.conv1(x))))))


def resnet(norm) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        norm(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        Block(8, norm),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


MODELS = {
    "small_cnn": lambda: nn.Sequential(
        nn.Conv2d(3, 6, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4)
    ),
    "resnet_group_norm": lambda: resnet(lambda c: nn.GroupNorm(2, c)),
    "resnet_batch_norm": lambda: resnet(nn.BatchNorm2d),
}


@pytest.mark.parametrize("mesh_shape, placements", [((2,), [S(0)]), ((2, 2), [S(0), S(0)])])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_cnn_with_a_sharded_batch_moves_no_activations(name, mesh_shape, placements):
    torch.manual_seed(0)
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    x = torch.randn(5, 3, 8, 8)  # batch 5: uneven over 2 and 4 ranks
    want = ref(x)
    want.square().sum().backward()
    channels = [m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm2d)]

    def main():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        m = so.distribute_module(copy.deepcopy(model), mesh)
        xd = so.distribute_tensor(x, mesh, placements)
        with so.CommDebugMode() as comm:
            y = m(xd)
            y.square().sum().backward()
        grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
        buffers = {n: b.full_tensor() for n, b in m.named_buffers()}
        return y.placements, y.full_tensor(), grads, buffers, dict(comm.get_comm_counts()), comm.get_total_bytes()

    with strict_mode():
        results = so.run(main, int(torch.tensor(mesh_shape).prod()))
    for layout, y, grads, buffers, counts, nbytes in results:
        assert layout == tuple(placements)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")  # noqa: B023 - called within this iteration
        for n, b in ref.named_buffers():
            torch.testing.assert_close(buffers[n], b, msg=lambda m: f"{n}: {m}")  # noqa: B023 - called within this iteration
        if (
            channels
        ):  # only the global batch statistics travel: one all_gather forward, one all_reduce backward per layer
            assert counts == {"all_gather": len(channels), "all_reduce": len(channels)}, counts
            assert nbytes == sum(2 * 8 * c + 2 * 8 * c for c in channels)
        else:
            assert nbytes == 0 and counts == {}, counts


def _resnet_step_in_a_process(norm_name: str):
    """One forward and backward of the BatchNorm / GroupNorm ResNet on this process's rank (gloo)."""
    torch.manual_seed(0)
    model = MODELS[norm_name]()
    x = torch.randn(5, 3, 8, 8)
    mesh = so.init_device_mesh("cpu", (2,))
    m = so.distribute_module(copy.deepcopy(model), mesh)
    xd = so.distribute_tensor(x, mesh, [S(0)])
    so.set_strict(True)
    try:
        with so.CommDebugMode() as comm:
            y = m(xd)
            y.square().sum().backward()
    finally:
        so.set_strict(False)
    grads = {n: _dt(p.grad).full_tensor() for n, p in m.named_parameters()}
    buffers = {n: _dt(b).full_tensor() for n, b in m.named_buffers()}
    return y.full_tensor(), grads, buffers, dict(comm.get_comm_counts()), comm.get_total_bytes()


@pytest.mark.parametrize("name", ["resnet_batch_norm"])
def test_resnet_under_gloo_matches_the_threads_world(name):
    from mp import run_gloo

    torch.manual_seed(0)
    ref = MODELS[name]()
    x = torch.randn(5, 3, 8, 8)
    want = ref(x)
    want.square().sum().backward()
    channels = [m.num_features for m in ref.modules() if isinstance(m, nn.BatchNorm2d)]
    for y, grads, buffers, counts, nbytes in run_gloo(_resnet_step_in_a_process, 2, name):
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5)
        for n, b in ref.named_buffers():
            torch.testing.assert_close(buffers[n], b)
        assert counts == {"all_gather": len(channels), "all_reduce": len(channels)}, counts
        assert nbytes == sum(2 * 8 * c + 2 * 8 * c for c in channels), counts
