"""SHARDOPS_DEBUG=1 agreement checks: forced divergences are caught and named; agreement costs no counted bytes."""

import pytest
import torch

import shardops as so
from shardops.experimental import implicit_replication
from shardops.planner.choice import choosing
from shardops.world import current_comm


@pytest.fixture
def debug():
    so.set_debug(True)
    yield
    so.set_debug(False)


def test_plain_operand_that_differs_between_ranks_is_caught(debug):
    """Plain operands of more than one element raise anyway (torch's rule); inside implicit_replication
    the user vouches they are equal, and debug mode checks it."""

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(torch.ones(4), mesh, [so.Shard(0)])
        mine = torch.full((4,), float(mesh.get_rank()))  # not really replicated
        with implicit_replication():
            return x + mine

    with pytest.raises(so.ShardingError, match=r"plain tensor operand #1 is taken as Replicate but differs"):
        so.run(body, 2)


def test_a_zero_dim_plain_operand_that_differs_between_ranks_is_caught(debug):
    """0-d tensors are implicitly Replicate (as in torch): only debug mode can tell they differ."""

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(torch.ones(4), mesh, [so.Shard(0)])
        return x * torch.tensor(float(mesh.get_rank()))

    with pytest.raises(so.ShardingError, match=r"plain tensor operand #1 is taken as Replicate but differs"):
        so.run(body, 2)


def test_equal_plain_operands_pass_and_are_not_counted(debug):
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(torch.ones(4), mesh, [so.Shard(0)])
        with so.CommDebugMode() as comm, implicit_replication():
            y = x + torch.arange(4.0)
        return y.full_tensor().tolist(), comm.get_total_counts()

    assert so.run(body, 2) == [([1.0, 2.0, 3.0, 4.0], 0)] * 2


def test_ranks_choosing_different_plans_is_caught(debug):
    def skewed(ranked):  # rank 1 prefers the opposite order: a forced divergence
        return list(reversed(ranked)) if current_comm().rank == 1 else ranked

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(torch.ones(4, 2), mesh, [so.Shard(0)])
        y = so.distribute_tensor(torch.ones(4, 2), mesh, [so.Shard(1)])
        return x * y

    # uncached: ranks share one decision cache in the threads world, and each must decide
    with choosing(skewed, cache=False), pytest.raises(so.ShardingError, match="ranks chose different strategies"):
        so.run(body, 2)
