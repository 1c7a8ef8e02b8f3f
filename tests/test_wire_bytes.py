"""CommDebugMode's two byte figures on uneven shards, in both worlds.

`get_total_bytes()` is logical (padding excluded); `get_wire_bytes()` is what this rank hands
the transport: c10d's single-tensor all_gather and reduce_scatter need equal sizes, so an uneven
call is padded to the largest member. Under torch.distributed the wire figure is checked against
the bytes of the c10d calls that really run (read by the same dispatch mode the training
comparison uses for torch DTensor's side); the threads world reports the same figures.

7 rows of 2 float32 over 3 ranks: shards of 3, 3 and 1 rows (24, 24 and 8 bytes).
"""

from __future__ import annotations

import torch

import shardops as so
from mp import run_gloo  # tests/ is not a package: pytest put tests/ on sys.path
from shardops import Partial, Replicate, Shard

ROWS = [3, 3, 1]
ROW_BYTES = 2 * 4


def _uneven_program() -> dict:
    """On each rank: an uneven all_gather (Shard(0) -> Replicate) and reduce_scatter (Partial -> Shard(0))."""
    from shardops.training.torch_side import _ByteCounter

    mesh = so.init_device_mesh("cpu", (3,))
    full = torch.arange(14.0).reshape(7, 2)
    out = {}
    sources: dict[str, tuple[so.DTensor, list[so.Placement], torch.Tensor]] = {
        "all_gather": (so.distribute_tensor(full, mesh, [Shard(0)]), [Replicate()], full),
        "reduce_scatter": (so.DTensor.from_local(full, mesh, [Partial("sum")]), [Shard(0)], 3 * full),
        # no backend reduces int16: an all_to_all of the padded chunks, reduced locally
        # (as every reduce_scatter on gloo)
        "reduce_scatter int16": (
            so.DTensor.from_local(full.short(), mesh, [Partial("sum")]),
            [Shard(0)],
            3 * full.short(),
        ),
    }
    for name, (x, target, want) in sources.items():
        counter = _ByteCounter()
        with so.CommDebugMode() as comm, counter:
            y = x.redistribute(mesh, target)
        torch.testing.assert_close(y.full_tensor(), want)
        out[name] = (
            comm.get_comm_counts(),
            comm.get_total_bytes(),
            comm.get_wire_bytes(),
            sum(n for _, n in counter.sent),
        )
    return out


def _expected(rank: int) -> dict:
    largest = max(ROWS) * ROW_BYTES
    return {
        "all_gather": ({"all_gather": 1}, ROWS[rank] * ROW_BYTES, largest),
        "reduce_scatter": ({"reduce_scatter": 1}, sum(ROWS) * ROW_BYTES, 3 * largest),
        "reduce_scatter int16": ({"reduce_scatter": 1}, sum(ROWS) * ROW_BYTES // 2, 3 * largest // 2),
    }


def test_threads_world_reports_the_padded_wire_figure():
    for rank, got in enumerate(so.run(_uneven_program, 3)):
        assert {k: v[:3] for k, v in got.items()} == _expected(rank)
        assert all(v[3] == 0 for v in got.values())  # no c10d call in the threads world


def test_gloo_wire_bytes_are_the_bytes_handed_to_c10d():
    for rank, got in enumerate(run_gloo(_uneven_program, 3, timeout=180)):
        assert {k: v[:3] for k, v in got.items()} == _expected(rank)
        for name, (_, _, wire, c10d_bytes) in got.items():
            assert wire == c10d_bytes, (rank, name)
