"""The decision cache and the torch-level parse cache: keyed by everything that changes a
decision, bounded, and a hit gives the same values, layouts and gradients as a miss."""
from __future__ import annotations

import torch

import shardops as so
from shardops import Replicate, Shard
from shardops.dispatch import core
from shardops.dispatch.registry import TORCH_FUNCTIONS
from shardops import caches
from shardops.spec import TensorMeta, TensorSpec


def test_equal_specs_share_a_key_and_different_ones_do_not():
    mesh = so.DeviceMesh("cpu", [0, 1, 2, 3])
    meta = TensorMeta((8, 4), (4, 1), torch.float32)
    a, b = TensorSpec(mesh, (Shard(0),), meta), TensorSpec(mesh, (Shard(0),), meta)
    assert a.key == b.key and a == b
    assert TensorSpec(mesh, (Replicate(),), meta).key != a.key
    assert TensorSpec(mesh, (Shard(0),), TensorMeta((8, 4), (4, 1), torch.float64)).key != a.key


def test_list_arguments_of_the_same_leaves_do_not_share_a_decision():
    leaves_a, tree_a = core.flatten_args((1, [0, 1], []), {})
    leaves_b, tree_b = core.flatten_args((1, [0], [1]), {})
    assert leaves_a == leaves_b and core.tree_key(tree_a) != core.tree_key(tree_b)
    assert core.unflatten_args(leaves_a, tree_a) == ((1, [0, 1], []), {})
    assert core.unflatten_args(leaves_b, tree_b) == ((1, [0], [1]), {})


def test_the_decision_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(core, "MAX_DECISIONS", 3)
    caches.invalidate()

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        outs = []
        for n in range(2, 8):  # six shapes: six decisions, three kept
            x = so.distribute_tensor(torch.arange(float(n * 3)).reshape(n, 3), mesh, [Shard(0)])
            outs.append((x * 2).full_tensor())
        return outs, len(core._CACHE)

    for outs, size in so.run(body, world_size=2):
        assert size <= 3
        for n, got in zip(range(2, 8), outs):
            torch.testing.assert_close(got, torch.arange(float(n * 3)).reshape(n, 3) * 2)
    caches.invalidate()


def test_a_cached_not_ours_parse_does_not_capture_a_call_that_needs_a_gradient():
    """sum(dim=1) without a gradient is left to torch's path and cached so; the same call shape
    with requires_grad must still take the sharded backward (gradient in the input's layout)."""
    data = torch.randn(8, 6, dtype=torch.float64)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(data, mesh, [Shard(1)])
        plain = [x.sum(1).full_tensor() for _ in range(3)]  # the parse cache's hit path
        w = so.distribute_tensor(data, mesh, [Shard(1)]).requires_grad_()
        (w.sum(1) * torch.arange(8.0, dtype=torch.float64)).sum().backward()
        return plain, w.grad.placements, w.grad.full_tensor()

    want_grad = torch.arange(8.0, dtype=torch.float64)[:, None].expand(8, 6)
    for plain, layout, grad in so.run(body, world_size=4):
        for got in plain:
            torch.testing.assert_close(got, data.sum(1))
        assert layout == (Shard(1),)
        torch.testing.assert_close(grad, want_grad)
    assert TORCH_FUNCTIONS[torch.Tensor.sum].not_ours  # the no-grad calls were remembered
