"""The DTensor side of the benchmarks: a few cases, quickly, with real properties."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# benchmarks/ sits at the repository root, beside src/; make it importable
# however pytest was started.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.cases import CASES, MESH_SHAPES, select_cases  # noqa: E402
from benchmarks.dtensor_side import (  # noqa: E402
    CollectiveCounter,
    _measure_on_rank,
    _reference,
    collective_kind,
    dtensor_dispatch_overhead,
    floor_overhead,
    measure_dtensor,
    run_threaded,
)

from bench_harness import RAISED, raising_case  # noqa: E402

ROW_F32 = 4096 // 4 * 8 * 4  # bytes of one rank's f32[8, 1024] shard of an f32[8, 4096] tensor


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, tuple[int, ...]], dict]:
    return {(r["case"], r["mesh"]): r for r in measure_dtensor(["sum", "softmax"], MESH_SHAPES)}


def test_softmax_over_shard1_gathers_the_shard_and_matches_torch():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 4096, generator=g)
    expected = torch.softmax(x, dim=1)

    def per_rank(rank: int):
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        mesh = init_device_mesh("cpu", (4,))
        dx = distribute_tensor(x, mesh, [Shard(1)])
        with CollectiveCounter() as counter:
            y = torch.softmax(dx, dim=1)
        return counter, y.full_tensor()  # type: ignore[attr-defined]  # torch's DTensor: its ops' stubs say Tensor

    results = run_threaded(per_rank)
    for counter, full in results:
        torch.testing.assert_close(full, expected)
        assert counter.bytes > 0
        assert counter.counts.get("all_gather", 0) >= 1
    # DTensor replicates the softmax dim: each rank sends at least its whole shard.
    assert results[0][0].bytes >= ROW_F32


def test_sum_over_sharded_dim_all_reduces_one_f32_per_row(rows):
    r = rows[("sum", (4,))]
    assert r["status"] == "ok" and r["correct"] is True and r["error"] is None
    assert r["counts"] == {"all_reduce": 1}
    assert r["bytes"] == 8 * 4 == r["lower_bound_bytes"]
    assert r["rounds"] == 1 and r["backward_rounds"] == 0


def test_softmax_fwd_bwd_rows_are_consistent(rows):
    for mesh in MESH_SHAPES:
        r = rows[("softmax", mesh)]
        assert r["correct"] is True, r
        assert r["rounds"] == len(r["calls"]) == sum(r["counts"].values())
        assert r["bytes"] == sum(c["bytes"] for c in r["calls"])
        assert 0 < r["backward_rounds"] < r["rounds"]
        # Forward and backward each gather a full row shard; the floor is far below.
        assert r["bytes"] >= 2 * ROW_F32 > r["lower_bound_bytes"]


def test_a_raising_op_is_recorded_not_propagated():
    case = raising_case()

    def per_rank(rank: int):
        from torch.distributed.tensor import init_device_mesh

        return _measure_on_rank(case, init_device_mesh("cpu", (4,)), ([], []))

    for r in run_threaded(per_rank):
        assert r["correct"] is None and r["rounds"] == 0
        assert r["error"] == RAISED


def test_case_table_is_complete_and_runs_single_device():
    names = [c.name for c in CASES]
    for required in (
        "sum",
        "cumsum",
        "var_mean",
        "histc",
        "softmax",
        "cross_entropy",
        "layer_norm",
        "rms_norm",
        "sort",
    ):
        assert required in names
    for case in CASES:
        inputs = case.inputs()
        for mesh in MESH_SHAPES:
            specs = case.placement_specs(mesh)
            assert len(specs) == len(inputs) and all(len(s) == len(mesh) for s in specs), case.name
            assert case.lower_bound_bytes(mesh) > 0
        outs, grads = _reference(case)
        assert outs and all(g is not None for g in grads), case.name
        # Same seed, same inputs: the table is deterministic.
        assert all(torch.equal(a, b) for a, b in zip(inputs, case.inputs()))


def test_close_rejects_a_small_error_in_small_entries():
    case = select_cases(["cross_entropy"])[0]
    expected = torch.tensor([0.125, 4e-6, -0.125])
    assert case.close(expected.clone(), expected)
    assert not case.close(expected * torch.tensor([1.0, 1.5, 1.0]), expected)
    assert not case.close(expected.double(), expected)
    assert case.close(torch.tensor([3, 1]), torch.tensor([3, 1]))
    assert not case.close(torch.tensor([3, 2]), torch.tensor([3, 1]))


def test_collective_kind_names():
    assert collective_kind("all_gather_into_tensor_coalesced") == "all_gather"
    assert collective_kind("reduce_scatter_tensor") == "reduce_scatter"
    assert collective_kind("allreduce_") == "all_reduce"
    assert collective_kind("alltoall_base_") == "all_to_all"
    assert collective_kind("wait_tensor") is None


def test_overheads_are_positive_for_every_op():
    ops = ("add", "sum_dim", "softmax_sharded")
    for figures in (dtensor_dispatch_overhead(ops, iters=20, repeats=2), floor_overhead(ops, iters=20, repeats=2)):
        assert set(figures) == set(ops)
        assert all(v > 0 for v in figures.values())
