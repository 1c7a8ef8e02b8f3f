"""The threads world: so.run, meshes, collectives that disagree, ranks that fail or never arrive."""

import time

import pytest
import torch

import shardops as so


def test_run_returns_each_ranks_result_and_mesh_queries():
    def body():
        mesh = so.init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]
        return (
            mesh.get_rank(),
            mesh.get_coordinate(),
            tp.shape,
            tp.get_coordinate(),
            mesh.size(),
            mesh.size(1),
            tp.mesh.tolist(),
        )

    out = so.run(body, 6)
    assert [o[0] for o in out] == list(range(6))
    assert out[4][1] == [1, 1] and out[4][2] == (3,) and out[4][3] == [1]
    assert out[4][4] == 6 and out[4][5] == 3 and out[4][6] == [3, 4, 5]


def test_mesh_shape_must_match_world():
    with pytest.raises(so.ShardingError, match="world has 4"):
        so.run(lambda: so.init_device_mesh("cpu", (3,)), 4)


def test_rank_threads_inherit_grad_mode():
    with torch.no_grad():
        assert so.run(torch.is_grad_enabled, 2) == [False, False]
    assert so.run(torch.is_grad_enabled, 2) == [True, True]


def test_mismatched_collectives_raise_on_every_rank():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        comm, group = mesh.comm, mesh.group(0)
        try:
            if mesh.get_rank() == 0:
                comm.all_reduce(torch.ones(3), "sum", group)
            else:
                comm.all_reduce(torch.ones(4), "sum", group)
        except so.CollectiveError as e:
            return str(e)
        return "no error"

    msgs = so.run(body, 2)
    assert all("mismatched collectives" in m and "rank 0" in m and "rank 1" in m for m in msgs)


def test_different_collective_kinds_raise():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        comm, group = mesh.comm, mesh.group(0)
        if mesh.get_rank() == 0:
            comm.all_reduce(torch.ones(2), "sum", group)
        else:
            comm.all_gather(torch.ones(2), group)

    with pytest.raises(so.CollectiveError, match="all_reduce.*all_gather|mismatched"):
        so.run(body, 2)


def test_rank_that_raises_releases_waiting_ranks_at_once():
    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        if mesh.get_rank() == 2:
            raise RuntimeError("boom on rank 2")
        x = so.distribute_tensor(torch.ones(8), mesh, [so.Shard(0)], src_data_rank=None)
        return x.full_tensor()

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="boom on rank 2"):
        so.run(body, 4, timeout=30)
    assert time.monotonic() - start < 5  # released at once, not after the 30 s timeout


def test_rank_that_never_arrives_times_out_everywhere():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        if mesh.get_rank() == 1:
            return "skipped the collective"
        return mesh.comm.all_reduce(torch.ones(1), "sum", mesh.group(0))

    start = time.monotonic()
    with pytest.raises(so.CollectiveError, match=r"did not arrive within the timeout"):
        so.run(body, 2, timeout=0.5)
    assert time.monotonic() - start < 5


def test_world_usable_after_a_failure():
    with pytest.raises(RuntimeError):
        so.run(lambda: (_ for _ in ()).throw(RuntimeError("x")), 2)
    assert so.run(lambda: so.init_device_mesh("cpu", (2,)).get_rank(), 2) == [0, 1]


def test_no_world_outside_run():
    with pytest.raises(so.ShardingError, match="shardops.run"):
        so.init_device_mesh("cpu", (1,))


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "product"])
def test_all_reduce_ops_over_mesh_dims(op):
    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        r = mesh.get_rank()
        t = torch.tensor([float(r + 1), float(-r)])
        return [mesh.comm.all_reduce(t, op, mesh.group(d)).tolist() for d in (0, 1, (0, 1))]

    out = so.run(body, 4)
    vals = {r: torch.tensor([float(r + 1), float(-r)]) for r in range(4)}
    ref = {
        "sum": lambda ts: sum(ts),
        "avg": lambda ts: sum(ts) / len(ts),
        "max": lambda ts: torch.stack(ts).amax(0),
        "min": lambda ts: torch.stack(ts).amin(0),
        "product": lambda ts: torch.stack(ts).prod(0),
    }[op]
    for r in range(4):
        i, j = divmod(r, 2)
        assert out[r][0] == ref([vals[j], vals[2 + j]]).tolist()
        assert out[r][1] == ref([vals[2 * i], vals[2 * i + 1]]).tolist()
        assert out[r][2] == ref([vals[k] for k in range(4)]).tolist()


def test_comm_debug_mode_counts_bytes_and_rounds():
    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        comm, group = mesh.comm, mesh.group(0)
        with so.CommDebugMode() as c:
            comm.all_gather(torch.ones(mesh.get_rank() + 1), group, shapes=[(1,), (2,), (3,), (4,)])
            comm.all_reduce(torch.ones(3), "sum", group)
            comm.broadcast(torch.ones(5), 1, group)
            comm.all_to_all([torch.ones(2) for _ in range(4)], group, [(2,)] * 4)
            comm.reduce_scatter([torch.ones(2) for _ in range(4)], "sum", group)
        return c.get_comm_counts(), c.get_total_bytes(), c.get_rounds()

    out = so.run(body, 4)
    for r, (counts, nbytes, rounds) in enumerate(out):
        assert counts == {"all_gather": 1, "all_reduce": 1, "broadcast": 1, "all_to_all": 1, "reduce_scatter": 1}
        assert nbytes == 4 * ((r + 1) + 3 + (5 if r == 1 else 0) + 2 * 3 + 2 * 4)
        assert rounds == 5
