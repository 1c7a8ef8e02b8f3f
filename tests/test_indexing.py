"""Indexing, slicing, padding and reordering ops (ops/indexing.py) against single-device torch.

Every case runs in strict mode (no fallback) with values and gradients compared, on meshes (4,)
and (2, 2), even and uneven shards. Along a dim the op does not touch, the op moves nothing:
0 bytes per rank forward and backward (asserted). Along the op's dim the result is exact
whatever the cost model picks (re-indexing all_to_all, pick -> Partial(sum), or a gather).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import shardops as so
from index_harness import S0, S1, R, check, run_sharded
from shardops import Partial, Shard

aten = torch.ops.aten
GEN = torch.Generator().manual_seed(0)
IDX = torch.tensor([0, 3, 3, 11, 7, 1])
GIDX = torch.tensor([[0, 5, 5, 2]])
SIDX = torch.tensor([[0, 5], [7, 7]])
AIDX = torch.tensor([0, 4, 4])


def _x(rows: int, cols: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(rows, cols, generator=GEN, dtype=torch.float64).to(dtype)


# name -> (fn, extra DTensor inputs' shapes given x's shape (they share x's layout), dim the op works along)
CASES = {
    "slice": (lambda x: x[:, 2:9], [], 1),
    "slice_step": (lambda x: x[:, 1:11:3], [], 1),
    "select": (lambda x: x.select(1, 3), [], 1),
    "select_negative": (lambda x: x.select(1, -2), [], 1),
    "narrow": (lambda x: x.narrow(1, 5, 4), [], 1),
    "pad": (lambda x: F.pad(x, (1, 2)), [], 1),
    "pad_value": (lambda x: F.pad(x, (2, 1), value=1.5), [], 1),
    "crop": (lambda x: F.pad(x, (-1, -2)), [], 1),
    "flip": (lambda x: x.flip(1), [], 1),
    "roll": (lambda x: x.roll(3, 1), [], 1),
    "roll_negative": (lambda x: x.roll(-5, 1), [], 1),
    "repeat": (lambda x: x.repeat(1, 2), [], 1),
    "index_select": (lambda x: x.index_select(1, IDX), [], 1),
    "index": (lambda x: x[:, IDX], [], 1),
    "gather": (lambda x: x.gather(1, GIDX.expand(x.shape[0], 4)), [], 1),
    "scatter_value": (lambda x: x.scatter(1, SIDX.repeat(x.shape[0] // 2 + 1, 1)[: x.shape[0]], 1.5), [], 1),
    "scatter_src": (
        lambda x, s: x.scatter(1, SIDX.repeat(x.shape[0] // 2 + 1, 1)[: x.shape[0]], s),
        [lambda r, c: (r, 2)],
        1,
    ),
    "scatter_add": (
        lambda x, s: x.scatter_add(1, SIDX.repeat(x.shape[0] // 2 + 1, 1)[: x.shape[0]], s),
        [lambda r, c: (r, 2)],
        1,
    ),
    "scatter_reduce": (
        lambda x, s: x.scatter_reduce(1, SIDX.repeat(x.shape[0] // 2 + 1, 1)[: x.shape[0]], s, "amax"),
        [lambda r, c: (r, 2)],
        1,
    ),
    "index_add": (lambda x, s: x.index_add(1, AIDX, s, alpha=2.0), [lambda r, c: (r, 3)], 1),
    # along dim 0 (index_put takes leading indices): the untouched dim is 1
    "index_put": (lambda x, v: x.index_put((torch.tensor([1, 4, 2]),), v), [lambda r, c: (3, c)], 0),
    "index_put_accumulate": (
        lambda x, v: x.index_put((torch.tensor([1, 1, 6]),), v, accumulate=True),
        [lambda r, c: (3, c)],
        0,
    ),
    "index_dim0": (lambda x: x[torch.tensor([5, 0, 0, 7])], [], 0),
    "flip_dim0": (lambda x: x.flip(0), [], 0),
}

SHAPES = {"even": (8, 12), "uneven": (10, 13)}


def _inputs(name: str, shape_kind: str) -> list[torch.Tensor]:
    _, extra, _ = CASES[name]
    rows, cols = SHAPES[shape_kind]
    return [_x(rows, cols)] + [_x(*make(rows, cols)) for make in extra]


@pytest.mark.parametrize("shape_kind", sorted(SHAPES))
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_untouched_dim_is_local(name, mesh_shape, shape_kind):
    """Sharded along the dim the op does not touch: exact, and 0 bytes forward and backward."""
    fn, _, op_dim = CASES[name]
    other = Shard(1 - op_dim)
    tensors = _inputs(name, shape_kind)
    layout = [other] * len(mesh_shape)  # (2, 2): the untouched dim nested over both mesh dims
    got = check(fn, tensors, mesh_shape, [layout] * len(tensors), fwd_bytes=0, bwd_bytes=0)
    assert other in got["layout"], f"the output left the untouched dim's shard: {got['layout']}"


SHARDED_LAYOUTS = {(4,): [[S1]], (2, 2): [[S0, S1], [S1, S1]]}


@pytest.mark.parametrize("shape_kind", sorted(SHAPES))
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_dim_is_exact(name, mesh_shape, shape_kind):
    """Sharded along the op's own dim (and both dims): values and gradients equal torch's, strict mode."""
    fn, _, op_dim = CASES[name]
    tensors = _inputs(name, shape_kind)
    for layout in SHARDED_LAYOUTS[mesh_shape]:
        layout = [Shard(op_dim if p == S1 else 1 - op_dim) for p in layout]
        check(fn, tensors, mesh_shape, [layout] * len(tensors))


def test_replicated_input_stays_replicated_and_moves_nothing():
    """A forward op on a replica keeps a replica (as torch): its backward then moves nothing either."""
    x = _x(10, 13)
    for name in ("flip", "roll", "pad", "repeat", "index_select", "slice"):
        got = check(CASES[name][0], [x], (4,), [[R]], fwd_bytes=0, bwd_bytes=0)
        assert got["layout"] == (R,), name


def test_flip_of_a_sharded_dim_moves_only_rows_that_change_owner():
    """flip over a dim sharded evenly on 4 ranks: rank r's rows go to rank 3-r, each rank sends its shard once
    and keeps Shard(1) (no gather); on 10 columns (3,3,3,1) the reversed layout is still plain Shard."""
    x = _x(6, 8, torch.float32)
    got = run_sharded(lambda t: aten.flip.default(t, [1]), [x], (4,), [[S1]], grad=False)
    assert got["layout"] == (S1,)
    assert got["fwd"] == 6 * 2 * 4  # one shard of 6x2 float32
    assert torch.equal(got["value"], x.flip(1))
    x = _x(6, 10, torch.float32)
    got = run_sharded(lambda t: aten.flip.default(t, [1]), [x], (4,), [[S1]], grad=False)
    assert torch.equal(got["value"], x.flip(1)) and got["layout"] in ((S1,), (R,), (S0,))


def test_gather_like_ops_on_the_sharded_dim_pick_into_a_pending_sum():
    """index_select / x[:, idx] / gather along the sharded dim: every rank picks what it owns -> P(sum), 0 bytes."""
    x = _x(10, 13)
    for name in ("index_select", "index", "gather"):
        got = check(CASES[name][0], [x], (4,), [[S1]], fwd_bytes=0, bwd_bytes=0)
        assert got["layout"] == (Partial("sum"),), name
        assert got["grad_layouts"][0] == (S1,), name


def test_scatter_on_the_sharded_dim_is_applied_by_the_owner():
    """scatter along the sharded dim with a replicated index: each rank writes the entries it owns (0 bytes)."""
    x = _x(10, 13)
    got = check(CASES["scatter_value"][0], [x], (4,), [[S1]], fwd_bytes=0, bwd_bytes=0)
    assert got["layout"] == (S1,)


def test_slice_backward_of_a_slice_along_an_unsharded_dim_is_local():
    """The issue's example: x[:, :512] of a 64x1024 x sharded on dim 0 gathered the gradient (32 KiB)."""
    x = _x(64, 1024, torch.float32)
    got = check(lambda t: t[:, :512], [x], (4,), [[S0]], fwd_bytes=0, bwd_bytes=0)
    assert got["grad_layouts"][0] == (S0,)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_and_bool_tensors(dtype):
    x = (_x(10, 13) * 3).to(dtype)
    for name in ("flip", "roll", "pad", "index_select", "index", "slice", "repeat"):
        for layout in ([S0], [S1]):
            check(CASES[name][0], [x], (4,), [layout], grad=False, fwd_bytes=0 if layout == [S0] else None)


def test_in_place_scatter_and_index_put_keep_the_layout():
    x = _x(10, 13)
    idx = SIDX.repeat(5, 1)

    def body():
        so.set_strict(True)
        try:
            mesh = so.init_device_mesh("cpu", (4,))
            out = []
            index = so.distribute_tensor(idx, mesh, [R])  # index tensors beside DTensors: DTensors too (torch's rule)
            rows = so.distribute_tensor(torch.tensor([1, 2]), mesh, [R])
            for pl in ([S0], [S1]):
                d = so.distribute_tensor(x, mesh, pl)
                d.scatter_(1, index, 2.5)
                d.index_put_((rows,), torch.tensor(7.0, dtype=torch.float64))
                out.append((d.placements, d.full_tensor()))
            return out
        finally:
            so.set_strict(False)

    want = x.clone().scatter_(1, idx, 2.5)
    want.index_put_((torch.tensor([1, 2]),), torch.tensor(7.0, dtype=torch.float64))
    for placements, value in so.run(body, 4)[0]:
        assert placements in ((S0,), (S1,))
        assert torch.equal(value, want)


def test_rotary_style_3d_slicing_and_cat():
    """x[..., :h] / x[..., h:] and the rotate-half of GPT-NeoX rotary, heads sharded: local, 0 bytes."""
    x = torch.randn(2, 6, 8, 10, generator=GEN, dtype=torch.float64)

    def rotate_half(t):
        h = t.shape[-1] // 2
        return torch.cat([-t[..., h:], t[..., :h]], dim=-1)

    check(rotate_half, [x], (4,), [[Shard(2)]], fwd_bytes=0, bwd_bytes=0)
    check(rotate_half, [x], (2, 2), [[Shard(0), Shard(1)]], fwd_bytes=0, bwd_bytes=0)


def test_select_and_slice_of_the_sharded_dim():
    """select: the owner returns the row, the others zeros -> P(sum), 0 bytes either way; a slice whose
    kept columns already sit on the ranks that own them in the output moves nothing either."""
    x = _x(10, 12)
    got = check(lambda t: t.select(1, 7), [x], (4,), [[S1]], fwd_bytes=0, bwd_bytes=0)
    assert got["layout"] == (Partial("sum"),) and got["grad_layouts"][0] == (S1,)
    got = check(lambda t: t[:, 1:11:3], [x], (4,), [[S1]], fwd_bytes=0, bwd_bytes=0)  # columns 1, 4, 7, 10
    assert got["layout"] == (S1,)
    got = check(lambda t: t.narrow(1, 2, 8), [x], (4,), [[S1]])
    assert got["layout"] == (S1,) and got["fwd"] <= 10 * 2 * 8 * 2  # at most two shards' worth change owner


# ------------------------------------------------------------------ re-index with a sharded index (a hang, fixed)


def _forced_move_index_select(x_full, index, mesh_shape, x_layout, index_layout, norm_dim=None):
    """index_select(x, 0, index) with the re-index algorithm forced; x is NormP(2) on `norm_dim` if given
    (rank-local pieces 0.6 x and 0.8 x: the full tensor is |x|). Returns every rank's (layout, counts, value)."""
    from shardops.ops.indexing import LABEL_MOVE
    from shardops.placements import NormPartial
    from shardops.verify import forcing

    def body():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        plain = [R if p == "N" else p for p in x_layout]
        x = so.distribute_tensor(x_full, mesh, plain)
        if norm_dim is not None:
            scale = 0.6 if mesh.get_coordinate()[norm_dim] == 0 else 0.8
            x = so.DTensor.from_local(x.to_local() * scale, mesh, [NormPartial(2) if p == "N" else p for p in x_layout])
        i = so.distribute_tensor(index, mesh, index_layout)
        with so.CommDebugMode() as comm:
            y = torch.index_select(x, 0, i)
        return y.placements, comm.get_comm_counts(), y.full_tensor()

    with forcing.forcing(LABEL_MOVE):
        return so.run(body, math.prod(mesh_shape), timeout=20)


def test_reindex_with_the_index_sharded_on_an_earlier_mesh_dim_keeps_every_rank_in_step():
    """verify's `--op torch.index_select --mesh 2x2x2 --case 3`: x f64[8, 6] (R, S(0), NormP(2)), index [2]
    (R, S(0), R). The planner pairs the re-index row (mesh dim 1) with the index-sharded row (mesh dim 0), so
    each rank holds one index entry; the ranks that needed no move used to skip the all_to_all the others
    waited in (CollectiveError after the timeout). Now each rank re-indexes its own index piece: exact."""
    x = torch.randn(8, 6, generator=GEN, dtype=torch.float64)
    index = torch.tensor([3, 6])
    results = _forced_move_index_select(x, index, (2, 2, 2), [R, S0, "N"], [R, S0, R], norm_dim=2)
    for _, _, value in results:
        torch.testing.assert_close(value, x.abs().index_select(0, index))
    assert any("all_to_all" in counts for _, counts, _ in results), "the forced re-index algorithm did not run"


@pytest.mark.parametrize("index_layout", [[S0, R], [R, S0]], ids=["index-first", "index-second"])
@pytest.mark.parametrize("x_layout", [[S0, R], [R, S0], [S0, S0]], ids=["S0,R", "R,S0", "S0,S0"])
def test_reindex_with_a_sharded_index_is_exact_in_any_mesh_dim_order(x_layout, index_layout):
    """The re-index algorithm next to an index sharded on either mesh dim (an index cut after a re-index cut
    gathers the small index first), uneven rows and index: every rank agrees and the values are torch's."""
    x = torch.randn(10, 3, generator=GEN, dtype=torch.float64)
    index = torch.tensor([9, 0, 4, 4, 7])
    for _, _, value in _forced_move_index_select(x, index, (2, 2), x_layout, index_layout):
        torch.testing.assert_close(value, x.index_select(0, index))
