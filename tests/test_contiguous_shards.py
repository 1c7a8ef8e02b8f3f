"""Redistributed shards are contiguous: torch's CPU native_layer_norm_backward reads mean/rstd
as contiguous memory, so a strided shard (a slice of a non-leading dim) would give wrong values."""

import torch

import shardops as so

aten = torch.ops.aten
R = so.Replicate()


def _layer_norm_backward_with_replicated_stats():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 8, generator=gen, dtype=torch.float64)
    grad = torch.randn(4, 6, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(8, generator=gen, dtype=torch.float64)
    _, mean, rstd = aten.native_layer_norm(x, [8], w, None, 1e-5)
    want = aten.native_layer_norm_backward(grad, x, [8], mean, rstd, w, None, [True, True, False])
    mesh = so.init_device_mesh("cpu", (4,))
    d = lambda t, p: so.distribute_tensor(t, mesh, [p])  # noqa: E731
    # mean/rstd replicated, grad and x sharded along the sequence: the stats are sliced on dim 1
    got = aten.native_layer_norm_backward(
        d(grad, so.Shard(1)), d(x, so.Shard(1)), [8], d(mean, R), d(rstd, R), d(w, R), None, [True, True, False]
    )
    return [(g.full_tensor(), t) for g, t in zip(got[:2], want[:2])]


def test_layer_norm_backward_on_sliced_stats_matches_torch():
    for pairs in so.run(_layer_norm_backward_with_replicated_stats, 4):
        for got, want in pairs:
            torch.testing.assert_close(got, want)


def _sliced_local_is_contiguous():
    mesh = so.init_device_mesh("cpu", (2,))
    x = so.distribute_tensor(torch.arange(24.0).reshape(4, 6), mesh, [R])
    inner = x.redistribute(placements=[so.Shard(1)]).to_local()
    outer = x.redistribute(placements=[so.Shard(0)]).to_local()
    return (
        inner.is_contiguous(),
        outer.is_contiguous(),
        outer.data_ptr() == x.to_local()[outer.shape[0] * mesh.get_coordinate()[0] :].data_ptr(),
    )


def test_slices_are_contiguous_and_copied_only_when_strided():
    for inner, outer, outer_is_view in so.run(_sliced_local_is_contiguous, 2):
        assert inner and outer
        assert outer_is_view  # a leading-dim slice is already contiguous: no copy
