"""The decision cache and the torch-level parse cache: keyed by everything that changes a
decision, bounded, and a hit gives the same values, layouts and gradients as a miss."""

from __future__ import annotations

import pytest
import torch

import shardops as so
from shardops import Replicate, Shard, caches
from shardops.dispatch import core
from shardops.dispatch.registry import TORCH_FUNCTIONS
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
        weights = so.distribute_tensor(torch.arange(8.0, dtype=torch.float64), mesh, [Replicate()])
        (w.sum(1) * weights).sum().backward()
        return plain, w.grad.placements, w.grad.full_tensor()

    want_grad = torch.arange(8.0, dtype=torch.float64)[:, None].expand(8, 6)
    for plain, layout, grad in so.run(body, world_size=4):
        for got in plain:
            torch.testing.assert_close(got, data.sum(1))
        assert layout == (Shard(1),)
        torch.testing.assert_close(grad, want_grad)
    assert TORCH_FUNCTIONS[torch.Tensor.sum].not_ours  # the no-grad calls were remembered


# -- float arguments: keyed on what a decision reads of them, never on data (issue 42 item 12)


def test_a_new_pointwise_scalar_each_step_reuses_the_decision():
    """AdamW's addcdiv_(value=-step_size) and div(denom, bias_correction): a new float each step is data."""
    data = torch.randn(8, 6, dtype=torch.float64)
    scalars = [0.5 + k / 7 for k in range(20)]

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(data, mesh, [Shard(0)])
        sizes, outs = [], []
        for s in scalars:
            y = (x / s).addcdiv_(x, x + 2.0, value=-s)
            outs.append(y.full_tensor())
            sizes.append(len(core._CACHE))
        return sizes, outs

    caches.invalidate()
    for sizes, outs in so.run(body, world_size=2):
        assert sizes[2:] == [sizes[1]] * (len(sizes) - 2), sizes  # flat once the op's reads are learned
        for s, got in zip(scalars, outs):
            torch.testing.assert_close(got, (data / s).addcdiv_(data, data + 2.0, value=-s))


def test_a_scalar_whose_sign_changes_the_plan_still_decides_anew():
    """mul(P(max), c) stays pending as P(max) for c > 0, becomes P(min) for c < 0, and resolves for NaN:
    a decision cached for one sign must not serve another (a wrong hit gives max where min is right)."""
    parts = [torch.randn(4, 3, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    total = torch.maximum(parts[0], parts[1])
    scalars = [2.0, 3.5, -1.5, -4.0, 0.0, 5.0, -2.0, float("nan")]

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.DTensor.from_local(parts[mesh.get_rank()], mesh, [so.Partial("max")])
        return [(x * c).full_tensor() for c in scalars], [(x * c).placements for c in (2.0, -2.0)]

    caches.invalidate()
    for outs, layouts in so.run(body, world_size=2):
        assert layouts == [(so.Partial("max"),), (so.Partial("min"),)]  # the value did reach the rule
        for c, got in zip(scalars, outs):
            torch.testing.assert_close(got, total * c, equal_nan=True)


def test_a_float_the_rule_reads_exactly_is_keyed_on_its_value():
    """vector_norm's ord picks the pending norm (NormPartial(ord)): each ord its own decision."""
    data = torch.randn(8, 6, dtype=torch.float64)
    ords = [2.0, 3.0, 1.5, 2.0, 3.0]

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(data, mesh, [Shard(0)])
        return [torch.linalg.vector_norm(x, o).full_tensor() for o in ords]

    caches.invalidate()
    for outs in so.run(body, world_size=2):
        for o, got in zip(ords, outs):
            torch.testing.assert_close(got, torch.linalg.vector_norm(data, o))


def test_a_float_a_sharded_algorithm_reads_is_keyed_on_its_value():
    """uniform_'s algorithm reads from/to off its decision's schema when it runs (after the key is built)."""
    bounds = [(0.0, 1.0), (5.0, 6.0), (-3.0, -2.5)]

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(torch.zeros(64, 4), mesh, [Shard(0)])
        return [x.uniform_(lo, hi).full_tensor() for lo, hi in bounds]

    caches.invalidate()
    for outs in so.run(body, world_size=2):
        for (lo, hi), got in zip(bounds, outs):
            assert lo <= got.min() and got.max() <= hi, (lo, hi, got.min(), got.max())


def _demo_training_cache_sizes(steps: int, mesh_shape: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """The demo's shardops training loop (GPT-2, dropout, AdamW, strict mode): decision cache size
    and this process's resident memory (KB) after every step."""
    from dataclasses import replace

    from shardops.training.config import SIZES, RunSpec
    from shardops.training.shardops_side import train_rank

    spec = RunSpec(
        model="gpt2", cfg=replace(SIZES["tiny"], dropout=0.1), mesh_shape=mesh_shape, batch_size=4, steps=steps
    )
    sizes, rss = [], []

    def on_step(step, record):
        sizes.append(len(core._CACHE))
        with open("/proc/self/statm") as f:
            rss.append(int(f.read().split()[1]) * 4)

    caches.invalidate()
    strict = core._state["strict"]
    so.set_strict(True)  # as the demo trains
    try:
        so.run(lambda: train_rank(spec, on_step=on_step), world_size=spec.world_size)
    finally:
        so.set_strict(strict)
    return sizes, rss


def test_the_decision_cache_is_flat_over_a_training_run():
    sizes, _ = _demo_training_cache_sizes(50, (2,))
    assert sizes[10:] == [sizes[10]] * (len(sizes) - 10), sizes


@pytest.mark.slow
def test_the_decision_cache_is_flat_over_1000_adamw_steps_of_the_demo():
    """Issue 42's acceptance run: the demo's (2, 2) mesh, 1,000 steps (about 12 minutes on 2 cores)."""
    sizes, rss = _demo_training_cache_sizes(1000, (2, 2))
    print(f"decision cache: {sizes[10]} after step 10, {sizes[-1]} after step 1000; RSS {rss[10]} KB -> {rss[-1]} KB")
    assert sizes[10:] == [sizes[10]] * (len(sizes) - 10)
