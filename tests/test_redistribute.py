"""Redistribution between random layouts in the threads world: values, local shards and byte counts."""

import math

import pytest
import torch

import shardops as so
from redistribute_cases import run_cases

MESHES = [(1,), (2,), (3,), (4,), (8,), (2, 2), (2, 3), (2, 2, 2)]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: "x".join(map(str, m)))
def test_random_redistributions(mesh_shape):
    # 8 meshes x 70 triples = 560 random (shape, source, target) cases
    failures = so.run(run_cases, math.prod(mesh_shape), 11, mesh_shape, 70)
    assert failures == [[]] * math.prod(mesh_shape)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("seed", range(1, 6))
def test_random_redistributions_slow(mesh_shape, seed):
    failures = so.run(run_cases, math.prod(mesh_shape), 100 + seed, mesh_shape, 200)
    assert failures == [[]] * math.prod(mesh_shape)


def _shard_to_shard_uses_all_to_all():
    mesh = so.init_device_mesh("cpu", (4,))
    full = torch.arange(8 * 12.0).reshape(8, 12)
    x = so.distribute_tensor(full, mesh, [so.Shard(0)])
    with so.CommDebugMode() as comm:
        y = x.redistribute(placements=[so.Shard(1)])
    return comm.get_comm_counts(), comm.get_total_bytes(), torch.equal(y.full_tensor(), full)


def test_shard_to_shard_is_one_all_to_all():
    counts, nbytes, ok = so.run(_shard_to_shard_uses_all_to_all, 4)[0]
    assert counts == {"all_to_all": 1}
    assert nbytes == 2 * 12 * 4 * 3 // 4  # my 2x12 rows, 3 of 4 column chunks leave this rank
    assert ok


def _partial_to_shard_is_reduce_scatter():
    mesh = so.init_device_mesh("cpu", (4,))
    local = torch.ones(8, 3)
    x = so.DTensor.from_local(local, mesh, [so.Partial()])
    with so.CommDebugMode() as comm:
        y = x.redistribute(placements=[so.Shard(0)])
    return comm.get_comm_counts(), y.to_local().tolist()


def test_partial_to_shard_is_one_reduce_scatter():
    counts, local = so.run(_partial_to_shard_is_reduce_scatter, 4)[0]
    assert counts == {"reduce_scatter": 1}
    assert local == [[4.0] * 3] * 2


def test_redistribute_to_norm_partial_is_refused():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(torch.ones(4), mesh, [so.Shard(0)])
        x.redistribute(placements=[so.NormPartial(2)])

    with pytest.raises(so.ShardingError, match="NormPartial"):
        so.run(body, 2)


def test_redistribute_rejects_wrong_placement_count():
    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        x = so.distribute_tensor(torch.ones(4), mesh, [so.Shard(0), so.Replicate()])
        x.redistribute(placements=[so.Replicate()])

    with pytest.raises(so.ShardingError, match="one placement per mesh dim"):
        so.run(body, 4)


def _two_branches_share_one_gradient():
    """y = a.redistribute(S(0)) + b.redistribute(S(0)): autograd hands y's one gradient to both
    redistribute backwards (GPT-2's token + position embeddings); 7 rows over 4 ranks (uneven, one empty)."""
    mesh = so.init_device_mesh("cpu", (4,))
    g = torch.Generator().manual_seed(0)
    full_a, full_b, weight = (torch.randn(3, 5, generator=g) for _ in range(3))
    a, b = (so.distribute_tensor(t, mesh, [so.Replicate()]).requires_grad_() for t in (full_a, full_b))
    y = a.redistribute(placements=[so.Shard(0)]) + b.redistribute(placements=[so.Shard(0)])
    loss = (y * so.distribute_tensor(weight, mesh, [so.Replicate()])).sum()
    with so.CommDebugMode() as comm:
        loss.backward()
    a_grad, b_grad = a.grad.full_tensor().clone(), b.grad.full_tensor().clone()
    a.grad.to_local().mul_(2)  # the two gradients are never aliases of one another
    return comm.get_comm_counts(), comm.get_total_bytes(), weight, a_grad, b_grad, b.grad.full_tensor().clone()


def test_one_gradient_reaching_two_redistribute_backwards_is_moved_once():
    for counts, _nbytes, weight, a_grad, b_grad, b_grad_after in so.run(_two_branches_share_one_gradient, 4):
        ref_a, ref_b = (torch.zeros(3, 5, requires_grad=True) for _ in range(2))
        ((ref_a + ref_b) * weight).sum().backward()  # single-device torch
        assert torch.allclose(a_grad, ref_a.grad) and torch.allclose(b_grad, ref_b.grad)
        assert torch.equal(b_grad_after, b_grad)
        assert counts.get("all_gather") == 1, counts  # torch's DTensor gathers the same gradient twice


def _gpt2_backward_counts(mesh_shape):
    import torch.nn.functional as F

    from parallel_harness import tiny_model

    model, vocab = tiny_model("gpt2", mesh_shape)
    tokens, targets = (torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(s)) for s in (0, 1))
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(0, 1))
    with so.CommDebugMode() as comm:
        loss.backward()
    return comm.get_comm_counts(), model.args.n_layers


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_gpt2_gathers_its_embeddings_shared_gradient_once(mesh_shape):
    """The sequence-parallel plan reduce-scatters both embeddings and, per block, the attention and MLP
    outputs; backward gathers each of those gradients back, the embeddings' one gradient once (torch's
    DTensor gathers it twice), with or without data parallel (which averages it per branch)."""
    counts, n_layers = so.run(_gpt2_backward_counts, 4, mesh_shape)[0]
    assert counts["all_gather"] == 1 + 2 * n_layers, counts
