"""The dry world (comm/dry.py, world.run_dry): one rank of a world of any size on META tensors,
whose collectives are counted exactly as the threads world counts them and move nothing."""

from __future__ import annotations

import pytest
import torch

import shardops as so
from shardops import Replicate, Shard
from shardops.comm.dry import DryCommunicator
from shardops.world import run_dry

CASES = [
    ((4,), (8, 6), (Shard(0),), (Replicate(),)),
    ((4,), (5, 6), (Shard(0),), (Shard(1),)),  # uneven: 2, 1, 1, 1 rows
    ((2, 2), (8, 6), (Shard(0), Shard(1)), (Replicate(), Replicate())),
    ((2, 2), (6, 8), (Replicate(), Shard(0)), (Shard(1), Shard(0))),
]


def _redistribute(shape, tensor_shape, src, dst, device):
    mesh = so.init_device_mesh("cpu", shape)
    x = torch.zeros(tensor_shape, device=device)
    dt = so.distribute_tensor(x, mesh, src)
    with so.CommDebugMode() as mode:
        out = dt.redistribute(mesh, dst)
    return (
        mode.get_total_bytes(),
        mode.get_wire_bytes(),
        mode.get_rounds(),
        tuple(out.to_local().shape),
        tuple(out.placements),
    )


@pytest.mark.parametrize("mesh_shape, tensor_shape, src, dst", CASES)
def test_a_dry_rank_counts_what_the_same_rank_of_the_threads_world_counts(mesh_shape, tensor_shape, src, dst):
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) > 1 else 1)
    threads = so.run(_redistribute, world, mesh_shape, tensor_shape, src, dst, "cpu")
    for rank in (0, world - 1):
        comm = DryCommunicator(rank, world)
        dry = run_dry(_redistribute, comm, mesh_shape, tensor_shape, src, dst, "meta")
        assert dry == threads[rank], (rank, dry, threads[rank])


def test_uneven_shares_are_noticed():
    comm = DryCommunicator(0, 4)
    run_dry(_redistribute, comm, (4,), (8, 6), (Shard(0),), (Replicate(),), "meta")
    assert comm.symmetric
    comm = DryCommunicator(0, 4)
    run_dry(_redistribute, comm, (4,), (5, 6), (Shard(0),), (Replicate(),), "meta")
    assert not comm.symmetric


def test_a_tensor_with_values_is_refused():
    with pytest.raises(so.ShardingError, match="meta tensors only"):
        run_dry(_redistribute, DryCommunicator(0, 4), (4,), (8, 6), (Shard(0),), (Replicate(),), "cpu")


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(so.ShardingError, match="not in a world of 4"):
        DryCommunicator(4, 4)
