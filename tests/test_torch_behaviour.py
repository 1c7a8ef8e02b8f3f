"""Behaviours torch's own DTensor tests pin, each written here from the behaviour (docs/parallel.md,
"Differences from torch DTensor", lists where shardops differs on purpose and why).

Errors: where torch raises another built-in class than ValueError at that point, shardops'
error is also an instance of that class, and its message starts with torch's phrase.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardops as so
from shardops import Partial, Replicate, Shard
from shardops.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    loss_parallel,
    parallelize_module,
)


def _mesh(shape=(4,), names=None):
    return so.init_device_mesh("cpu", shape, mesh_dim_names=names)


def _strict(fn):
    def body():
        so.set_strict(True)
        try:
            return fn()
        finally:
            so.set_strict(False)

    return body


def test_index_put_with_the_index_off_the_sharded_dim_stays_sharded():
    x = torch.arange(32.0).reshape(4, 8)
    idx, values = torch.tensor([0, 2]), torch.ones(2, 8)

    def rank():
        mesh = _mesh()
        dx = so.distribute_tensor(x, mesh, [Shard(1)])
        didx, dvalues = (
            so.DTensor.from_local(t, mesh, [Replicate()]) for t in (idx, values)
        )  # torch's test: DTensors too
        with so.CommDebugMode() as comm:
            y = torch.index_put(dx, (didx,), dvalues)
        return y.placements, y.full_tensor(), comm.get_total_bytes()

    for placements, full, nbytes in so.run(_strict(rank), 4):
        assert placements == (Shard(1),) and nbytes == 0
        assert torch.equal(full, torch.index_put(x, (idx,), values))


def test_aten_linear_called_directly_is_sharded_like_f_linear():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, generator=g)

    def rank():
        mesh = _mesh()
        dx = so.distribute_tensor(x, mesh, [Replicate()])
        dw, db = so.distribute_tensor(w, mesh, [Shard(0)]), so.distribute_tensor(b, mesh, [Shard(0)])
        with so.CommDebugMode() as comm:
            y = torch.ops.aten.linear.default(dx, dw, db)
        return y.placements, y.full_tensor(), comm.get_total_bytes()

    for placements, full, nbytes in so.run(_strict(rank), 4):
        assert placements == (Shard(1),) and nbytes == 0
        torch.testing.assert_close(full, F.linear(x, w, b))


def test_view_of_an_uneven_shard_shares_storage_where_the_layout_allows():
    """Splitting dims of an unevenly sharded tensor is a view of the same storage, as torch's. Merging
    the sharded dim with the next (6 rows over 4 ranks, then flattened) cannot keep torch.chunk's layout
    without moving data: the view raises, as torch 2.13's strict view does (a copy would miss in-place
    ops); reshape moves the data (tests/test_views_alias.py runs both beside torch's DTensor)."""
    x = torch.arange(24.0).reshape(6, 4)

    def rank():
        dx = so.distribute_tensor(x, _mesh(), [Shard(0)])
        split = dx.view(3, 2, 4)
        same = split.to_local().numel() == 0 or split.to_local().data_ptr() == dx.to_local().data_ptr()
        try:
            dx.view(24)
            refused = False
        except so.ShardingError:
            refused = True
        return split.placements, same, split.full_tensor(), refused, dx.reshape(24).full_tensor()

    for placements, same, split, refused, flat in so.run(rank, 4):
        assert placements == (Shard(0),) and same
        assert torch.equal(split, x.view(3, 2, 4)) and refused and torch.equal(flat, x.view(24))


def test_device_mesh_is_a_context_manager_for_the_parallel_api():
    def rank():
        mesh = _mesh()
        lin = nn.Linear(8, 4)
        with mesh as entered:
            parallelize_module(lin, None, ColwiseParallel())
        return entered is mesh, lin.weight.device_mesh == mesh, lin.weight.placements

    for entered, same_mesh, placements in so.run(rank, 4):
        assert entered and same_mesh and placements == (Shard(0),)


def test_partial_has_torchs_public_class_attributes():
    assert Partial.LINEAR_REDUCE_OPS == ("sum", "avg")
    assert set(Partial.ALL_REDUCE_OPS) == {"sum", "avg", "min", "max", "product"}
    assert Partial("max").reduce_op not in Partial.LINEAR_REDUCE_OPS


def test_loss_parallel_refuses_pending_logits_with_torchs_value_error():
    def rank():
        logits = so.from_local(torch.randn(4, 8), _mesh(), [Partial()])
        with loss_parallel():
            F.cross_entropy(logits, torch.zeros(4, dtype=torch.long))

    with pytest.raises(ValueError, match="loss_parallel\\(\\) expects non-TP mesh dims to be Shard or Replicate"):
        so.run(rank, 4)


def test_loss_parallel_on_logits_with_an_unsharded_class_dim_is_exact():
    """Deliberate: torch refuses (exactly one mesh dim must shard the class dim);
    shardops' loss is exact on any layout."""
    g = torch.Generator().manual_seed(1)
    logits, target = torch.randn(8, 5, generator=g), torch.randint(0, 5, (8,), generator=g)

    def rank():
        mesh = _mesh()
        dl = so.distribute_tensor(logits, mesh, [Shard(0)])
        with loss_parallel():
            return F.cross_entropy(dl, so.distribute_tensor(target, mesh, [Shard(0)])).full_tensor()

    for loss in so.run(rank, 4):
        torch.testing.assert_close(loss, F.cross_entropy(logits, target))


@pytest.mark.parametrize(
    "make, phrase",
    [
        (
            lambda: PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(),)),
            "input_layouts and desired_input_layouts should have same length!",
        ),
        (lambda: PrepareModuleInput(input_layouts=Shard(0)), "desired module inputs should not be None!"),
        (
            lambda: PrepareModuleOutput(output_layouts=(Shard(0), Shard(1)), desired_output_layouts=(Replicate(),)),
            "output_layouts and desired_output_layouts should have same length!",
        ),
    ],
)
def test_prepare_module_layouts_that_do_not_pair_raise_assertion_error(make, phrase):
    with pytest.raises(AssertionError, match=phrase) as info:
        make()
    assert isinstance(info.value, so.ShardingError)


def test_mixing_meshes_says_sharding_propagation_failed():
    def rank():
        a = so.distribute_tensor(torch.ones(4), _mesh(), [Shard(0)])
        b = so.distribute_tensor(torch.ones(4), _mesh((2, 2)), [Shard(0), Replicate()])
        return a + b

    with pytest.raises(RuntimeError, match="Sharding propagation failed") as info:
        so.run(rank, 4)
    assert "different meshes" in str(info.value)


@pytest.mark.parametrize("strict", [False, True])
def test_embedding_max_norm_on_a_column_sharded_table_raises_not_implemented(strict):
    """Renormalising rows of a table sharded on the embedding dim: no sharded strategy (torch has none either),
    torch's message (test_sharded_embedding_colwise_max_norm_errors)."""
    table = torch.randn(10, 8)

    def rank():
        mesh = _mesh()
        w = so.distribute_tensor(table, mesh, [Shard(1)])
        F.embedding(so.DTensor.from_local(torch.tensor([[1, 2], [3, 4]]), mesh, [Replicate()]), w, max_norm=1.0)

    with pytest.raises(
        NotImplementedError, match=r"aten\.embedding_renorm_\.default does not have a sharding strategy registered\."
    ) as info:
        so.run(_strict(rank) if strict else rank, 4)
    assert isinstance(info.value, so.ShardingError)


def test_sort_backward_of_an_empty_sharded_tensor():
    def rank():
        dx = so.distribute_tensor(torch.zeros(0), _mesh(), [Shard(0)]).requires_grad_()
        values, _ = torch.sort(dx)
        values.sum().backward()
        return dx.grad.shape, dx.grad.placements

    for shape, placements in so.run(rank, 4):
        assert shape == (0,) and placements == (Shard(0),)


def test_aten_linear_under_inference_mode_shards_like_matmul():
    """torch's test_aten_linear: under inference_mode aten.linear reaches DTensor dispatch whole; a
    row-sharded weight still gives a Shard(2) output (no gather), equal to single device."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, 47, 64, generator=g), torch.randn(64, 64, generator=g)

    def rank():
        mesh = _mesh()
        dx, dw = so.distribute_tensor(x, mesh, [Replicate()]), so.distribute_tensor(w, mesh, [Shard(0)])
        with so.CommDebugMode() as comm, torch.inference_mode():
            out = F.linear(dx, dw)
            placements, nbytes = out.placements, comm.get_total_bytes()
        return placements, nbytes, out.full_tensor()

    for placements, nbytes, full in so.run(_strict(rank), 4):
        assert placements == (Shard(2),) and nbytes == 0
        torch.testing.assert_close(full, F.linear(x, w))


def test_loss_parallel_plain_target_on_a_batch_sharded_mesh_asks_for_a_dtensor():
    """torch's test_loss_parallel_plain_tensor_target_rejected_on_multi_dim: a plain target next to logits
    whose batch is sharded is ambiguous (global or this rank's piece): ValueError, 'requires a DTensor'."""
    g = torch.Generator().manual_seed(4)
    x, target = torch.randn(8, 16, generator=g), torch.randint(0, 16, (8,), generator=g)

    def rank():
        dx = so.distribute_tensor(x, _mesh((2, 2), ("dp", "tp")), [Shard(0), Shard(1)])
        with loss_parallel():
            F.cross_entropy(dx, target, reduction="sum")

    with pytest.raises(ValueError, match=r"loss_parallel\(\) requires a DTensor \(not a plain torch.Tensor\)"):
        so.run(rank, 4)


def test_loss_parallel_plain_target_next_to_batch_sharded_logits_on_one_dim():
    """torch's test_loss_parallel, logits sharded on the batch dim of a 1-d mesh: a plain target raises
    a ValueError naming loss_parallel (no silent batch-size mismatch)."""
    x, target = torch.randn(8, 16), torch.randint(0, 16, (8,))

    def rank():
        dx = so.distribute_tensor(x, _mesh(), [Shard(0)])
        with loss_parallel():
            F.cross_entropy(dx, target)

    with pytest.raises(ValueError, match="loss_parallel"):
        so.run(rank, 4)


def test_loss_parallel_takes_a_plain_replicated_target_and_weight_as_torch_does():
    g = torch.Generator().manual_seed(5)
    x, target, weight = (
        torch.randn(8, 16, generator=g),
        torch.randint(0, 16, (8,), generator=g),
        torch.rand(16, generator=g) + 0.5,
    )

    def rank():
        mesh = _mesh((2, 2), ("dp", "tp"))
        dx = so.distribute_tensor(x, mesh, [Replicate(), Shard(1)]).requires_grad_()
        dt = so.distribute_tensor(target, mesh, [Replicate(), Replicate()])
        with loss_parallel():
            plain = F.cross_entropy(dx, target, weight, reduction="sum")  # plain target and weight: Replicate
            as_dtensors = F.cross_entropy(dx, dt, weight, reduction="sum")
            plain.backward()
        return plain.full_tensor(), as_dtensors.full_tensor(), dx.grad.full_tensor()

    ref_x = x.clone().requires_grad_()
    want = F.cross_entropy(ref_x, target, weight, reduction="sum")
    want.backward()
    for plain, as_dtensors, grad in so.run(rank, 4):
        torch.testing.assert_close(plain, want.detach())
        torch.testing.assert_close(as_dtensors, want.detach())
        torch.testing.assert_close(grad, ref_x.grad)
