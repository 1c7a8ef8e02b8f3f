"""torch DTensor compatibility of the core types: code written for
torch.distributed.tensor reads NormPartial as a Partial with a reduce_op, catches
ShardingError as a RuntimeError, and reads CommDebugMode counts per `with` block."""

from __future__ import annotations

import math

import pytest
import torch

import shardops as so
from shardops import NormPartial, Partial, Replicate, Shard
from shardops.placements import REDUCE_OPS

# ---------------------------------------------------------------- NormPartial is a Partial


@pytest.mark.parametrize(
    "p,op", [(2, "sum"), (1, "sum"), (0, "sum"), (3.5, "sum"), (math.inf, "max"), (-math.inf, "min")]
)
def test_norm_partial_is_a_partial_with_a_reduce_op(p, op):
    q = NormPartial(p)
    assert isinstance(q, Partial) and q.is_partial()
    assert q.reduce_op == op and q.reduce_op in REDUCE_OPS
    assert q.norm_type == float(p)


def test_norm_partial_equality_and_hash_keep_norm_type_apart():
    assert NormPartial(2) == NormPartial(2.0) and hash(NormPartial(2)) == hash(NormPartial(2.0))
    assert NormPartial(2) != NormPartial(3)
    assert NormPartial(1) != Partial("sum") and Partial("sum") != NormPartial(1)  # same reduce_op, other meaning
    assert len({NormPartial(1), Partial("sum"), NormPartial(2)}) == 3
    assert repr(NormPartial(2)) == "NormP(2)" and repr(NormPartial(1.5)) == "NormP(1.5)"


def test_reduce_op_of_a_pending_norm_is_readable_on_a_dtensor():
    """torch's DTensor tests read placements[0].reduce_op of a norm's result."""

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(torch.arange(24.0).reshape(4, 6), mesh, [Shard(1)])
        n = torch.linalg.vector_norm(x, 2, dim=1)
        pl = n.placements[0]
        return isinstance(pl, Partial), pl.reduce_op, n.full_tensor()

    for is_partial, op, value in so.run(body, world_size=4):
        assert is_partial and op == "sum"
        torch.testing.assert_close(value, torch.linalg.vector_norm(torch.arange(24.0).reshape(4, 6), 2, dim=1))


def test_norm_partial_algebra_reduces_to_the_norm_of_norms():
    parts = [torch.tensor([3.0, 0.5]), torch.tensor([4.0, 2.0]), torch.tensor([0.0, 1.0])]
    whole = torch.stack(parts)
    for p in (1.0, 2.0, 3.0, math.inf, -math.inf, 0.5):
        expected = torch.linalg.vector_norm(whole, p, dim=0)
        torch.testing.assert_close(NormPartial(p).reduce(parts), expected)
        torch.testing.assert_close(NormPartial(p).combine(whole), expected)


@pytest.mark.parametrize("placement", [Partial(op) for op in REDUCE_OPS] + [NormPartial(2), NormPartial(-1)])
def test_split_then_reduce_gives_the_value_back(placement):
    x = (
        torch.tensor([[1.5, -2.0], [0.25, 4.0]])
        if not isinstance(placement, NormPartial)
        else torch.tensor([[1.5, 2.0], [0.25, 4.0]])
    )
    pieces = [placement.split(x, c) for c in range(3)]
    torch.testing.assert_close(placement.reduce(pieces), x)


def test_nothing_redistributes_into_a_norm_partial():
    """NormPartial stays a source only: a Partial subclass must not make it a planner target."""

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(torch.ones(4), mesh, [Replicate()])
        with pytest.raises(so.ShardingError):
            x.redistribute(placements=[NormPartial(2)])
        return True

    assert all(so.run(body, world_size=2))


# ---------------------------------------------------------------- ShardingError


def test_sharding_error_is_caught_as_value_error_and_runtime_error():
    assert issubclass(so.ShardingError, ValueError) and issubclass(so.ShardingError, RuntimeError)
    assert issubclass(so.CollectiveError, RuntimeError)

    def body():
        a = so.distribute_tensor(torch.ones(4, 4), so.init_device_mesh("cpu", (4,)), [Shard(0)])
        b = so.distribute_tensor(torch.ones(4, 4), so.init_device_mesh("cpu", (2, 2)), [Shard(0), Replicate()])
        with pytest.raises(RuntimeError, match="different meshes"):
            a + b
        with pytest.raises(ValueError, match="different meshes"):
            a + b
        return True

    assert all(so.run(body, world_size=4))


# ---------------------------------------------------------------- CommDebugMode


def test_comm_debug_mode_counts_from_zero_on_each_entry():
    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
        comm = so.CommDebugMode()
        with comm:
            x.full_tensor()
        first = (comm.get_total_counts(), comm.get_comm_counts(), comm.get_total_bytes(), comm.get_rounds())
        with comm:
            x.full_tensor()
        second = (comm.get_total_counts(), comm.get_comm_counts(), comm.get_total_bytes(), comm.get_rounds())
        with comm:
            pass
        return first, second, comm.get_total_counts(), comm.get_total_bytes()

    for first, second, empty_count, empty_bytes in so.run(body, world_size=4):
        assert first == second == (1, {"all_gather": 1}, 16, 1)  # this rank's 1x4 f32 shard
        assert (empty_count, empty_bytes) == (0, 0)


# ---------------------------------------------------------------- torch-level entries bind once per call shape


def test_call_signature_binds_forms_and_caches_the_call_shape():
    from shardops.dispatch.schema import CallSignature

    def _unbiased(self, unbiased, *, dim=None, keepdim=False): ...  # noqa: E704
    def _general(self, dim=None, unbiased=None, keepdim=False, *, correction=None): ...  # noqa: E704

    _unbiased.accepts = lambda args, kwargs: len(args) > 1 and type(args[1]) is bool
    sig = CallSignature(_unbiased, _general, aliases={"input": "self"})
    x = torch.ones(2)
    assert sig.bind((x, True), {}) == {"self": x, "unbiased": True, "dim": None, "keepdim": False}
    assert sig.bind((x, 1), {"keepdim": True}) == {
        "self": x,
        "dim": 1,
        "unbiased": None,
        "keepdim": True,
        "correction": None,
    }
    assert sig.bind((), {"input": x, "correction": 0})["correction"] == 0
    assert sig.bind((x, 1, True, True, 5), {}) is None  # no form takes it: torch decides
    shapes = len(sig._shapes)
    assert sig.bind((x, 2), {"keepdim": False})["dim"] == 2 and len(sig._shapes) == shapes  # cached shape, new values


def test_every_torch_level_entry_comes_from_the_one_factory():
    from shardops.dispatch.registry import TORCH_FUNCTIONS

    families = [
        torch.sum,
        torch.Tensor.max,
        torch.var,
        torch.std_mean,
        torch.cumsum,
        torch.ops.aten.cummax.default,
        torch.norm,
        torch.linalg.vector_norm,
        torch.dist,
        torch.logsumexp,
        torch.cat,
        torch.topk,
        torch.sort,
        torch.nn.functional.rms_norm,
    ]
    assert all(TORCH_FUNCTIONS[f].__qualname__.startswith("torch_entry.") for f in families)
