"""The same layouts, ops and autograd under torch.distributed (gloo, 4 processes on 127.0.0.1)."""

import pytest
import torch

import shardops as so
from mp import run_gloo
from redistribute_cases import bytes_per_case, run_cases


def _pointwise_and_autograd(mesh_shape):
    mesh = so.init_device_mesh("cpu", mesh_shape)
    g = torch.Generator().manual_seed(5)
    a, b, c = (torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in ((7, 5), (5,), (7, 1)))
    pa = [so.Shard(0)] + [so.Shard(1)] * (len(mesh_shape) - 1)
    da = so.distribute_tensor(a.detach(), mesh, pa).requires_grad_()
    db = so.distribute_tensor(
        b.detach(), mesh, [so.Shard(0)] + [so.Replicate()] * (len(mesh_shape) - 1)
    ).requires_grad_()
    dc = so.distribute_tensor(c.detach(), mesh, [so.Replicate()] * len(mesh_shape)).requires_grad_()
    out = da * db + dc.exp() - 2
    (out * out).full_tensor().sum().backward()
    ref = ((a * b + c.exp() - 2) ** 2).sum()
    ga, gb, gc = torch.autograd.grad(ref, (a, b, c))
    return [
        torch.allclose(out.full_tensor(), a * b + c.exp() - 2),
        torch.allclose(da.grad.full_tensor(), ga),
        torch.allclose(db.grad.full_tensor(), gb),
        torch.allclose(dc.grad.full_tensor(), gc),
        da.grad.placements == da.placements,
    ]


def _interop_round_trip():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    tmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    full = torch.arange(35.0).reshape(7, 5)
    results = []
    for placements in ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()]):
        t = distribute_tensor(full, tmesh, placements)
        ours = so.from_torch(t)
        back = so.to_torch(ours)
        same_storage = back._local_tensor.untyped_storage().data_ptr() == t._local_tensor.untyped_storage().data_ptr()
        results.append(
            (
                same_storage,
                torch.equal(ours.full_tensor(), full),
                isinstance(back, TorchDTensor),
                back.placements == t.placements,
            )
        )
    local = torch.ones(3) * (tmesh.get_rank() + 1)
    p = TorchDTensor.from_local(local, tmesh, [Partial(), Replicate()])
    ours = so.from_torch(p)
    results.append(
        (
            ours.placements == (so.Partial(), so.Replicate()),
            torch.equal(ours.full_tensor(), p.full_tensor()),
            True,
            True,
        )
    )
    return results


def program():
    return {
        "redistribute_4": run_cases(23, (4,), 60),
        "redistribute_2x2": run_cases(29, (2, 2), 60),
        "pointwise_4": _pointwise_and_autograd((4,)),
        "pointwise_2x2": _pointwise_and_autograd((2, 2)),
        "interop": _interop_round_trip(),
        "bytes_2x2": bytes_per_case(31, (2, 2), 40),
    }


@pytest.fixture(scope="module")
def results():
    return run_gloo(program, 4, timeout=240)


@pytest.mark.parametrize("mesh", ["4", "2x2"])
def test_random_redistributions_under_gloo(results, mesh):
    # same values, local shards and exact byte counts (padding excluded) as in the threads world
    assert all(r[f"redistribute_{mesh}"] == [] for r in results)


@pytest.mark.parametrize("mesh", ["4", "2x2"])
def test_pointwise_autograd_under_gloo(results, mesh):
    for r in results:
        assert all(r[f"pointwise_{mesh}"])


def test_interop_round_trip_shares_storage(results):
    for r in results:
        for case in r["interop"]:
            assert all(case), case


def test_byte_counts_equal_threads_world(results):
    threads = so.run(bytes_per_case, 4, 31, (2, 2), 40)
    gloo = [r["bytes_2x2"] for r in results]
    assert gloo == threads
    assert sum(map(sum, gloo)) > 0


def test_to_torch_in_threads_world_raises():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        return so.to_torch(so.distribute_tensor(torch.ones(2), mesh, [so.Shard(0)]))

    with pytest.raises(so.ShardingError, match="no torch process group"):
        so.run(body, 2)
