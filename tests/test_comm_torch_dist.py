"""The torch.distributed communicator on 4 gloo processes, checked against the threads world.

Every program below runs twice: once per rank in 4 gloo processes (`run_gloo`)
and once per rank in the threads world (`shardops.run`). Both must give the same
values, and CommDebugMode the same counts, bytes and rounds.
"""

from __future__ import annotations

import time
import zlib

import pytest
import torch

from mp import RankFailure, run_gloo  # tests/ is not a package: pytest put tests/ on sys.path
from shardops.comm import CommDebugMode, Group
from shardops.mesh import DeviceMesh, init_device_mesh
from shardops.world import current_comm, in_threads_world, run

DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
)
# One dtype per path through the communicator (bool cast, native, gathered fallback, complex as reals):
# enough for checks of group resolution and order, where every dtype would only cost time.
FEW_DTYPES = (torch.bool, torch.int16, torch.float32, torch.complex64)
OPS = ("sum", "avg", "max", "min", "product")


# ------------------------------------------------------------------ programs (run on every rank)


def _data(shape, dtype, *salt) -> torch.Tensor:
    """Per-rank data: small integers (sums and products exact in every dtype), or random bools."""
    # crc32, not hash(): str hashes differ between processes
    gen = torch.Generator().manual_seed(zlib.crc32(repr((current_comm().rank, tuple(shape), dtype, salt)).encode()))
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    low = 0 if dtype == torch.uint8 else -3
    x = torch.randint(low, 4, shape, generator=gen)
    if dtype.is_complex:
        return torch.complex(x.float(), torch.randint(-3, 4, shape, generator=gen).float()).to(dtype)
    return x.to(dtype)


def _exercise(group: Group, tag: str, out: dict, dtypes=DTYPES) -> None:
    """Every collective of the protocol over `group`, with uneven and empty shapes, every dtype and op."""
    comm = current_comm()
    n, me = group.size, group.index(comm.rank)
    for dtype in dtypes:
        ops = ("sum", "avg", "product") if dtype.is_complex else OPS  # no order on complex numbers
        for op in ops:
            out[tag, "all_reduce", dtype, op] = comm.all_reduce(_data((3, 5), dtype, op), op, group)
            chunks = [_data((i % 3, 2), dtype, op, i) for i in range(n)]  # member 0's chunk is empty
            out[tag, "reduce_scatter", dtype, op] = comm.reduce_scatter(chunks, op, group)
        shapes = [(i % 3, 4) for i in range(n)]
        out[tag, "all_gather", dtype] = comm.all_gather(_data(shapes[me], dtype), group, shapes)
        out[tag, "all_gather_empty", dtype] = comm.all_gather(_data((0, 2), dtype), group, [(0, 2)] * n)
        out[tag, "all_gather_even", dtype] = comm.all_gather(_data((2, 3), dtype), group)
        # member i sends member j a chunk of (i + 2j) % 3 rows
        sends = [_data(((me + 2 * j) % 3, 2), dtype, j) for j in range(n)]
        recv = [((i + 2 * me) % 3, 2) for i in range(n)]
        out[tag, "all_to_all", dtype] = comm.all_to_all(sends, group, recv)
        out[tag, "broadcast", dtype] = comm.broadcast(_data((2, 3), dtype), n - 1, group)
        out[tag, "broadcast0d", dtype] = comm.broadcast(_data((), dtype), 0, group)
        out[tag, "all_reduce0d", dtype] = comm.all_reduce(_data((), dtype), "sum", group)
    gen = torch.Generator().manual_seed(comm.rank)
    out[tag, "randn_sum"] = comm.all_reduce(torch.randn(64, dtype=torch.float64, generator=gen), "sum", group)
    out[tag, "randn_avg"] = comm.all_reduce(torch.randn(64, generator=gen), "avg", group)
    out[tag, "randn_rs"] = comm.reduce_scatter([torch.randn(7 + i, generator=gen) for i in range(n)], "sum", group)
    comm.barrier(group)


def _groups_of(mesh: DeviceMesh) -> dict[str, Group]:
    groups = {f"dim{d}": mesh.group(d) for d in range(mesh.ndim)}
    if mesh.ndim == 2:
        groups["dims01"] = mesh.group((0, 1))
        groups["dims10"] = mesh.group((1, 0))  # member order differs from torch's group-rank order
    return groups


def _run_groups(groups: dict[str, Group], every_dtype=("dim0", "dim1", "pair"), few_dtypes=FEW_DTYPES) -> dict:
    out: dict = {}
    for tag, group in groups.items():
        with CommDebugMode() as mode:
            _exercise(group, tag, out, DTYPES if tag in every_dtype else few_dtypes)
        out[tag, "comm"] = (
            mode.get_comm_counts(),
            mode.get_total_counts(),
            mode.get_total_bytes(),
            mode.get_rounds(),
            mode.log,
        )
    return out


def program_meshes() -> dict:
    out: dict = {}
    for shape in [(4,), (2, 2)]:
        mesh = init_device_mesh("cpu", shape)
        out.update({(shape, *k): v for k, v in _run_groups(_groups_of(mesh)).items()})
        out[shape, "groups"] = {tag: g.ranks for tag, g in _groups_of(mesh).items()}
        if not in_threads_world():
            import torch.distributed as dist

            comm = current_comm()
            out[shape, "torch_order"] = {
                tag: tuple(dist.get_process_group_ranks(comm.process_group(g)))  # type: ignore[attr-defined]  # a TorchDistComm
                for tag, g in _groups_of(mesh).items()
            }
    # Groups not along mesh dims: ranks {1, 3} and {0, 2}, listed against torch's order.
    # In torch this is a new process group that only its members create.
    rank = current_comm().rank
    out.update(_run_groups({"pair": Group((3, 1) if rank % 2 else (2, 0))}))
    # A mesh built by hand has no torch DeviceMesh: its groups too are made by their members alone.
    by_hand = DeviceMesh("cpu", [[2, 0], [3, 1]])
    by_hand_groups = {"hand0": by_hand.group(0), "hand1": by_hand.group(1)}
    out.update(_run_groups(by_hand_groups, every_dtype=()))
    out["by_hand", "groups"] = {tag: g.ranks for tag, g in by_hand_groups.items()}
    out.update(_async_handed_over())
    return out


def _async_handed_over() -> dict:
    """reduce_scatter_async and all_gather_async give the synchronous calls' results; in the
    torch.distributed world the async works free what was handed over (waited: the reduce_scatter's
    chunks; released: the all_gather's input and its result's buffer), on this thread."""
    comm = current_comm()
    group = comm.world_group()
    n = group.size
    out: dict = {}
    for op in ("sum", "max"):
        chunks = [_data((i % 3, 2), torch.float32, "async", op, i) for i in range(n)]
        handed = [c.clone() for c in chunks]
        got = comm.reduce_scatter_async(handed, op, group).wait()
        out["rs_async", op] = got
        out["rs_async_equal", op] = torch.equal(got, comm.reduce_scatter(chunks, op, group))
        if not in_threads_world():
            out["rs_async_freed", op] = all(c.untyped_storage().nbytes() == 0 for c in handed)
    shapes = [(i % 3 + 1, 4) for i in range(n)]
    x = _data(shapes[group.index(comm.rank)], torch.float32, "gather_async")
    work = comm.all_gather_async(x, group, shapes)
    gathered = work.wait()
    out["ag_async"] = [t.clone() for t in gathered]
    work.release()
    if not in_threads_world():
        out["ag_async_freed"] = x.untyped_storage().nbytes() == 0 and gathered[0].untyped_storage().nbytes() == 0
    return out


def program_from_torch() -> dict:
    """A torch DeviceMesh (made by torch in the gloo world, by hand in the threads world) as a shardops mesh."""
    out: dict = {}
    rank = current_comm().rank
    cases = {"init": ([[0, 1], [2, 3]], ("dp", "tp")), "scrambled": ([[3, 0], [1, 2]], ("x", "y"))}
    for name, (ranks, names) in cases.items():
        if in_threads_world():
            mesh = DeviceMesh("cpu", ranks, names)
        else:
            from torch.distributed.device_mesh import DeviceMesh as TorchMesh
            from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

            if name == "init":
                tmesh = torch_init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
            else:
                tmesh = TorchMesh("cpu", torch.tensor(ranks), mesh_dim_names=names)
            mesh = DeviceMesh.from_torch(tmesh)
            out[name, "torch_view"] = (
                tuple(tmesh.shape),
                tmesh.mesh_dim_names,
                list(tmesh.get_coordinate() or ()),
                tmesh.mesh.tolist(),
            )
        out[name, "view"] = (
            mesh.shape,
            mesh.mesh_dim_names,
            mesh.get_coordinate(),
            mesh.mesh.tolist(),
            mesh.get_rank(),
        )
        groups = _groups_of(mesh)
        for dim_name in names:
            sub = mesh[dim_name]
            out[name, "sub", dim_name] = (sub.shape, sub.mesh.tolist(), sub.get_coordinate())
            groups[f"sub_{dim_name}"] = sub.group(0)
        out.update(
            {
                (name, *k): v
                for k, v in _run_groups(groups, every_dtype=(), few_dtypes=(torch.bool, torch.float32)).items()
            }
        )
    out["rank"] = rank
    return out


def program_all() -> dict:
    # One gloo session for both programs: process start-up is most of a test's time.
    return {"meshes": program_meshes(), "from_torch": program_from_torch()}


def program_absent_peer(pg_timeout: float) -> tuple[str, float]:
    """Rank 3 never joins its group's collective: its partner must raise, not hang."""
    mesh = init_device_mesh("cpu", (2, 2))
    group = mesh.group(1)  # {0, 1} and {2, 3}: a torch sub-group, not the default group
    comm = current_comm()
    if comm.rank == 3:
        time.sleep(pg_timeout + 1.0)
        return "absent", 0.0
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4), "sum", group)
    except Exception as e:  # noqa: BLE001 - the point of the test
        return type(e).__name__, time.monotonic() - start
    return "ok", time.monotonic() - start


def program_rank_dies() -> None:
    mesh = init_device_mesh("cpu", (2,))
    if current_comm().rank == 1:
        import os

        os._exit(7)
    current_comm().all_reduce(torch.ones(2), "sum", mesh.group(0))


def program_rank_raises() -> None:
    if current_comm().rank == 1:
        raise KeyError("rank one is unhappy")
    current_comm().all_reduce(torch.ones(2), "sum", init_device_mesh("cpu", (2,)).group(0))


def program_dry_run() -> dict:
    """Every collective over every group of a (2, 2, 4) mesh: shapes, dtypes and comm figures."""
    mesh = init_device_mesh("cpu", (2, 2, 4))
    comm = current_comm()
    out: dict = {}
    all_dims: list[int | tuple[int, ...]] = [0, 1, 2, (0, 2), (2, 0), (0, 1, 2)]
    for dims in all_dims:
        group = mesh.group(dims)
        n, me = group.size, group.index(comm.rank)
        with CommDebugMode() as mode:
            results = [
                comm.all_reduce(torch.ones(3, dtype=torch.bool), "sum", group),
                comm.all_reduce(torch.ones(3, dtype=torch.int16), "avg", group),
                *comm.all_gather(torch.ones(me % 3, 2), group, [(i % 3, 2) for i in range(n)]),
                comm.reduce_scatter([torch.ones(i % 2, 3) for i in range(n)], "max", group),
                *comm.all_to_all(
                    [torch.ones((me + j) % 2) for j in range(n)], group, [((i + me) % 2,) for i in range(n)]
                ),
                comm.broadcast(torch.ones(2, dtype=torch.complex64), n - 1, group),
            ]
            comm.barrier(group)
        out[dims] = (
            [(r.dtype, tuple(r.shape)) for r in results],
            mode.get_comm_counts(),
            mode.get_total_bytes(),
            mode.get_rounds(),
        )
    return out


# ------------------------------------------------------------------ comparison


def _assert_same(gloo: dict, threads: dict, rank: int) -> None:
    assert gloo.keys() >= threads.keys(), sorted(map(str, threads.keys() - gloo.keys()))[:5]
    for key, want in threads.items():
        got = gloo[key]
        where = f"rank {rank}, {key}"
        if isinstance(want, list) and want and isinstance(want[0], torch.Tensor):
            assert len(got) == len(want), where
            for g, w in zip(got, want):
                _assert_tensor(g, w, key, where)
        elif isinstance(want, torch.Tensor):
            _assert_tensor(got, want, key, where)
        else:
            assert got == want, f"{where}: gloo {got} != threads {want}"


def _assert_tensor(got: torch.Tensor, want: torch.Tensor, key: tuple, where: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{where}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
    )
    inexact = any(isinstance(k, str) and k.startswith("randn") for k in key)
    # gloo adds in its own order; integer-valued data makes every other sum exact
    tol = dict(rtol=1e-6, atol=1e-6) if inexact else dict(rtol=0, atol=0)
    torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m: f"{where}: {m}", **tol)


# ------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def gloo_results() -> list[dict]:
    return run_gloo(program_all, 4)


def test_every_collective_matches_threads_world(gloo_results):
    gloo = [r["meshes"] for r in gloo_results]
    threads = run(program_meshes, 4)
    for rank in range(4):
        _assert_same(gloo[rank], threads[rank], rank)
        out = gloo[rank]
        # torch numbers the mesh-dim groups of init_device_mesh in mesh order
        for shape in [(4,), (2, 2)]:
            groups, torch_order = out[shape, "groups"], out[shape, "torch_order"]
            for tag in ("dim0", "dim1", "dims01"):
                if tag in groups:
                    assert torch_order[tag] == groups[tag], (rank, shape, tag)
            if "dims10" in groups:
                assert sorted(torch_order["dims10"]) == sorted(groups["dims10"])
                assert torch_order["dims10"] != groups["dims10"]
    # the counting is the same figure everywhere; spot-check its meaning on one case
    counts, total, nbytes, rounds, log = gloo[0][(4,), "dim0", "comm"]
    assert total == rounds == len(log) == sum(counts.values())
    assert counts["all_to_all"] == counts["broadcast"] / 2 == len(DTYPES)


def test_async_works_free_what_was_handed_over(gloo_results):
    """(The values are compared with the threads world's by test_every_collective_matches_threads_world.)"""
    for r in gloo_results:
        out = r["meshes"]
        assert out["rs_async_equal", "sum"] and out["rs_async_equal", "max"]
        assert out["rs_async_freed", "sum"] and out["rs_async_freed", "max"] and out["ag_async_freed"]


def test_from_torch_device_mesh(gloo_results):
    gloo = [r["from_torch"] for r in gloo_results]
    threads = run(program_from_torch, 4)
    for rank in range(4):
        out = gloo[rank]
        assert out["rank"] == rank
        _assert_same(out, threads[rank], rank)
        for name in ("init", "scrambled"):
            # shape, dim names, coordinate and rank layout as torch's DeviceMesh has them
            assert out[name, "view"][:4] == out[name, "torch_view"], (rank, name)


def test_absent_peer_raises_after_timeout():
    pg_timeout = 1.5
    results = run_gloo(program_absent_peer, 4, pg_timeout, timeout=60, pg_timeout=pg_timeout)
    assert results[0][0] == results[1][0] == "ok"
    assert results[3][0] == "absent"
    kind, waited = results[2]
    assert kind == "CollectiveError" and pg_timeout * 0.8 <= waited < pg_timeout * 2.5, results[2]


def test_run_gloo_reports_a_dead_rank():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 exited \(code 7\)"):
        run_gloo(program_rank_dies, 2, timeout=60)
    assert time.monotonic() - start < 30


def test_run_gloo_reports_a_raising_rank():
    with pytest.raises(RankFailure, match=r"(?s)rank 1 raised:.*KeyError: 'rank one is unhappy'"):
        run_gloo(program_rank_raises, 2, timeout=60)


def test_fake_backend_dry_run():
    """torch's `fake` backend: one process plays rank 5 of 16; collectives move nothing but keep every shape."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    want = run(program_dry_run, 16)[5]
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
    try:
        got = program_dry_run()
    finally:
        dist.destroy_process_group()
    assert got == want


def test_cpu_tensor_on_an_nccl_only_group_raises_saying_which_backend_to_use():
    """shardops sends some metadata as CPU tensors: an nccl-only group must say how to init
    instead of failing inside nccl."""
    from shardops.comm.torch_dist import _c10d, _TorchGroup
    from shardops.errors import CollectiveError

    called = []
    g = _TorchGroup(pg=None, ranks=(0, 1), pg_index=(0, 1))
    g._backends["cpu"] = "nccl"  # what backend_for reads off a group made by init_process_group("nccl")
    with pytest.raises(CollectiveError, match=r"all_gather of a CPU tensor .*cpu:gloo,cuda:nccl"):
        _c10d("all_gather", g, lambda *a, **k: called.append(a), torch.zeros(2, dtype=torch.uint8))
    assert not called
    g._backends["cpu"] = "gloo"  # "cpu:gloo,cuda:nccl": CPU tensors go over gloo
    _c10d("all_gather", g, lambda *a, **k: called.append(a), torch.zeros(2, dtype=torch.uint8))
    assert len(called) == 1
