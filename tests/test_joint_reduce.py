"""Pending partials on several mesh dims resolve in ONE all_reduce over the joint group,
and a sharded algorithm's collectives over several mesh dims are priced as one."""

import math

import pytest
import torch

import shardops as so
from shardops import cost
from shardops.mesh import DeviceMesh
from shardops.planner.pricing import comm_time
from shardops.planner.rows import row
from shardops.redistribute import plan
from shardops.spec import TensorMeta, TensorSpec, contiguous_stride

R = so.Replicate()
FULL = torch.arange(-15.0, 15.0, dtype=torch.float64).reshape(6, 5)  # integer values: every sum below is exact


def _resolve(placements, part, target, mesh_shape=(2, 2)):
    """Each rank holds part(full, rank); redistribute to `target`: (full tensor, counts, rounds, bytes)."""

    def body():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        rank = mesh.get_rank()
        base = so.distribute_tensor(FULL, mesh, [R if p.is_partial() else p for p in placements]).to_local()
        x = so.DTensor.from_local(part(base, rank), mesh, placements, shape=FULL.shape)
        with so.CommDebugMode() as comm:
            y = x.redistribute(placements=target)
        local_bytes = base.numel() * base.element_size()
        return y.full_tensor(), comm.get_comm_counts(), comm.get_rounds(), comm.get_total_bytes(), local_bytes

    return so.run(body, math.prod(mesh_shape))


def _check_one_all_reduce(results, want):
    for full, counts, rounds, nbytes, local_bytes in results:
        assert torch.equal(full, want)
        assert dict(counts) == {"all_reduce": 1}
        assert rounds == 1
        assert nbytes == local_bytes  # the input sent once, not once per mesh dim


def test_sum_on_two_mesh_dims_is_one_all_reduce():
    # ranks hold full * (rank + 1): the true value is full * (1 + 2 + 3 + 4)
    results = _resolve([so.Partial("sum")] * 2, lambda x, r: x * (r + 1), [R, R])
    _check_one_all_reduce(results, FULL * 10)


def test_max_on_two_mesh_dims_is_one_all_reduce():
    results = _resolve([so.Partial("max")] * 2, lambda x, r: x - r, [R, R])  # rank 0 holds the max
    _check_one_all_reduce(results, FULL)


def test_avg_on_two_mesh_dims_is_one_all_reduce():
    results = _resolve([so.Partial("avg")] * 2, lambda x, r: x + (r - 1.5), [R, R])  # offsets average to 0
    _check_one_all_reduce(results, FULL)


def test_norm_partial_on_two_mesh_dims_is_one_all_reduce():
    # four ranks hold |full| / 2: the 2-norm over them is |full| (squares of halves of integers are exact)
    results = _resolve([so.NormPartial(2)] * 2, lambda x, r: x.abs() / 2, [R, R])
    _check_one_all_reduce(results, FULL.abs())


def test_joint_group_skips_the_sharded_mesh_dim():
    # (2,2,2): pending on mesh dims 0 and 2, rows sharded on mesh dim 1: one all_reduce over dims 0+2
    placements = [so.Partial("sum"), so.Shard(0), so.Partial("sum")]
    results = _resolve(placements, lambda x, r: x * (r + 1), [R, so.Shard(0), R], mesh_shape=(2, 2, 2))
    # rank r = 4*c0 + 2*c1 + c2; the ranks sharing c1 hold (r + 1) for r in {c1*2 + 0, +1, +4, +5}
    for _full, counts, rounds, nbytes, local_bytes in results:
        assert dict(counts) == {"all_reduce": 1} and rounds == 1 and nbytes == local_bytes
    want = torch.cat(
        [FULL[:3] * sum(2 * 0 + k + 1 for k in (0, 1, 4, 5)), FULL[3:] * sum(2 * 1 + k + 1 for k in (0, 1, 4, 5))]
    )
    for full, *_ in results:
        assert torch.equal(full, want)


def _planning_spec(mesh_shape, placements, shape=(1024, 1024)):
    mesh = DeviceMesh("cpu", torch.arange(math.prod(mesh_shape)).reshape(mesh_shape))
    return TensorSpec(mesh, tuple(placements), TensorMeta(shape, contiguous_stride(shape), torch.float32))


def test_plan_is_one_joint_step_priced_as_one_collective():
    spec = _planning_spec((8, 8, 8, 8), [so.Partial("sum")] * 4)
    p = plan(spec, [R] * 4, "threads")
    assert len(p.steps) == 1 and p.steps[0].joint == (0, 1, 2, 3) and p.rounds == 1
    link = cost.PRESETS["threads"]
    nbytes = 1024 * 1024 * 4
    # hierarchical latency (4 x 7 steps), every byte over the group once: (N-1)/N of it
    want = 2 * (4 * 7 * link.latency + (4095 / 4096) * nbytes / link.bandwidth)
    assert p.time == pytest.approx(want, rel=1e-12)
    per_dim = sum(2 * (7 * link.latency + 7 / 8 * nbytes / link.bandwidth) for _ in range(4))
    assert p.time < per_dim


def test_algorithm_collectives_over_two_mesh_dims_are_priced_as_one():
    def algorithm(ctx, x):  # pragma: no cover - never run, only priced
        return x

    piece = 4096.0
    gather = row(so.Shard(1), so.Shard(1), algorithm, comm=[("all_gather", piece)])
    local = row(so.Shard(0), so.Shard(0))
    link = cost.PRESETS["gloo"]
    links = (link, link, link)
    # dims 0 and 2 run the algorithm: one all_gather over their 2*4 = 8 ranks
    got = comm_time((gather, local, gather), (2, 3, 4), links)
    want = (1 + 3) * link.latency + 7 * piece / link.bandwidth  # 7 pieces received, hierarchical latency
    assert got == pytest.approx(want, rel=1e-12)
    # one mesh dim: the plain ring formula
    assert comm_time((gather, local, local), (2, 3, 4), links) == pytest.approx(
        link.latency + piece / link.bandwidth, rel=1e-12
    )
