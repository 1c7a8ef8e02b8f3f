"""The views between matrix products (ops/_view_layout.py, ops/views.py), gradient buffers
(new_zeros/new_empty_strided & co) and StridedShard through pointwise ops.

The layout math is checked against an oracle that enumerates every element a rank holds
(placements.local_shape_and_offset / dim_positions, themselves checked against torch): a
claimed output layout must put exactly the same global elements, in the same local order,
on every rank. Then real views run against single-device torch with bytes asserted.
"""

import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F

import shardops as so
from matrix_harness import check, make, strict_mode
from shardops import Partial, Replicate, Shard, ShardingError, StridedShard
from shardops.ops._view_layout import view_layout
from shardops.placements import dim_positions

R = Replicate()
S = Shard


def _held(shape, mesh_shape, coord, placements) -> list[int]:
    """Row-major global flat indices this rank holds, in its local order."""
    per_dim = [list(dim_positions(n, d, mesh_shape, coord, placements)) for d, n in enumerate(shape)]
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    return [sum(i * s for i, s in zip(idx, strides)) for idx in itertools.product(*per_dim)]


def _oracle_ok(src, dst, mesh_shape, pin, pout) -> bool:
    return all(
        _held(src, mesh_shape, c, pin) == _held(dst, mesh_shape, c, pout)
        for c in itertools.product(*[range(n) for n in mesh_shape])
    )


VIEW_CASES = [  # (src, dst): merges, splits, heads, size-1 dims
    ((3, 10, 8), (30, 8)),
    ((4, 10, 8), (40, 8)),
    ((30, 8), (3, 10, 8)),
    ((40, 8), (4, 10, 8)),
    ((2, 5, 12), (2, 5, 3, 4)),
    ((2, 5, 8), (2, 5, 2, 4)),
    ((2, 5, 3, 4), (2, 5, 12)),
    ((4, 6), (24,)),
    ((24,), (2, 3, 4)),
    ((2, 3, 4), (6, 4)),
    ((2, 3, 4), (2, 12)),
    ((1, 6, 4), (6, 4)),
    ((6, 4), (1, 6, 1, 4)),
    ((1, 2, 2, 2), (1, 2, 4)),
    ((2, 1, 3), (6, 1)),
    ((4, 1), (2, 2, 1)),
    ((3, 1), (3, 1, 1)),
    ((1, 1, 6), (1, 6)),  # size-1 dims kept
]


def _random_layouts(src, mesh_shape, rng, k):
    opts = (
        [R, Partial("sum")]
        + [S(d) for d in range(len(src))]
        + [StridedShard(d, f) for d in range(len(src)) for f in (2, 3) if src[d] % f == 0]
    )
    return [tuple(rng.choice(opts) for _ in mesh_shape) for _ in range(k)]


@pytest.mark.parametrize("src,dst", VIEW_CASES, ids=lambda v: "x".join(map(str, v)))
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (2, 3)], ids=lambda m: "x".join(map(str, m)))
def test_view_layout_matches_element_oracle(src, dst, mesh_shape):
    rng = random.Random(hash((src, dst, mesh_shape)) % 1000)
    layouts = _random_layouts(src, mesh_shape, rng, 30)
    layouts += [tuple(S(d) for d in c) for c in itertools.product(range(len(src)), repeat=len(mesh_shape))]
    found = 0
    for pin in layouts:
        pout = view_layout(src, dst, mesh_shape, pin)
        if pout is not None:
            found += 1
            assert _oracle_ok(src, dst, mesh_shape, pin, pout), (pin, pout)
    assert found  # every case has some layout that maps


@pytest.mark.parametrize(
    "mesh_shape,pin,want",
    [
        ((4,), (S(1),), (StridedShard(0, 3),)),  # [3,10,8] s-sharded -> [30,8]
        ((4,), (S(0),), None),  # 3 batches on 4 ranks: chunks of 10 rows are not chunks of 30
        ((2, 2), (S(1), S(1)), (StridedShard(0, 3), StridedShard(0, 3))),
    ],
)
def test_merge_batch_and_sequence(mesh_shape, pin, want):
    assert view_layout((3, 10, 8), (30, 8), mesh_shape, pin) == want


def test_merge_fsdp_and_sequence_parallel():
    """dp shards the batch, tp the sequence: tp's split factor is the batches dp leaves each rank."""
    assert view_layout((4, 10, 8), (40, 8), (2, 2), (S(0), S(1))) == (S(0), StridedShard(0, 2))
    assert view_layout((2, 10, 8), (20, 8), (2, 2), (S(0), S(1))) == (S(0), S(0))
    assert view_layout((40, 8), (4, 10, 8), (2, 2), (S(0), StridedShard(0, 2))) == (S(0), S(1))


@pytest.mark.parametrize(
    "h,heads,mesh_shape,want",
    [
        (12, 3, (4,), None),  # 3 heads on 4 ranks: chunks of 3 columns cut heads of 4
        (16, 4, (4,), (S(2),)),
        (66, 6, (4,), None),  # 6 heads on 4 ranks (2,2,2,0) vs 66 columns (17,17,17,15)
        (64, 8, (2, 2), (S(2), S(2))),
    ],
)
def test_split_heads_out_of_sharded_hidden(h, heads, mesh_shape, want):
    pin = (S(2),) * len(mesh_shape)
    assert view_layout((2, 5, h), (2, 5, heads, h // heads), mesh_shape, pin) == want


# ------------------------------------------------------------------ running views, values and bytes


def _split_heads(heads, how="view"):
    def fn(x):
        b, s, h = x.shape
        return getattr(x, how)(b, s, heads, h // heads).transpose(1, 2) * 2

    return fn


@pytest.mark.parametrize(
    "mesh_shape,layout,heads,moves",
    [
        ((4,), (S(2),), 4, False),
        ((2, 2), (S(0), S(2)), 4, False),
        ((4,), (S(1),), 4, False),
        ((2, 2), (S(2), S(2)), 4, False),
        ((4,), (S(2),), 3, True),
        ((2, 2), (S(2), S(2)), 2, False),  # the second cut lands inside a head: S(3)
    ],
)
def test_split_heads_runs(mesh_shape, layout, heads, moves):
    """A view that would move data raises (a view aliases its input); reshape moves it."""
    r = check(_split_heads(heads, "reshape"), [make((4, 6, 12), 0)], mesh_shape, [layout])
    assert (r.nbytes > 0) == moves, r.counts
    if moves:
        with pytest.raises(ShardingError, match="a view must alias its input"):
            check(_split_heads(heads), [make((4, 6, 12), 0)], mesh_shape, [layout])
    else:
        assert check(_split_heads(heads), [make((4, 6, 12), 0)], mesh_shape, [layout]).nbytes == 0


@pytest.mark.parametrize(
    "mesh_shape,layout",
    [((4,), (S(1),)), ((2, 2), (S(0), S(1))), ((2, 2), (S(1), S(0))), ((2, 2), (S(1), S(1))), ((4,), (S(0),))],
)
def test_merge_batch_sequence_then_pointwise_and_back_moves_nothing(mesh_shape, layout):
    """FSDP+SP activations: merged, through pointwise ops on a StridedShard, split back."""
    w = make((8,), 3)

    def replicated(x):  # beside a DTensor, a constant is a Replicate DTensor (torch's rule for mixed operands)
        return (
            so.DTensor.from_local(w, x.device_mesh, [Replicate()] * x.device_mesh.ndim)
            if isinstance(x, so.DTensor)
            else w
        )

    fn = lambda x: (torch.tanh(x.reshape(-1, 8)) * replicated(x) + 1).view(4, 10, 8).flatten(0, 1).unflatten(0, (4, 10))  # noqa: E731
    r = check(fn, [make((4, 10, 8), 0)], mesh_shape, [layout])
    assert r.nbytes == 0, r.counts
    assert r.out_layout == layout


def test_uneven_merge_is_exact_though_it_moves():
    r = check(lambda x: x.reshape(30, 8) * 3, [make((3, 10, 8), 0)], (4,), [(S(0),)])
    assert r.nbytes > 0


# ------------------------------------------------------------------ gradient buffers


@pytest.mark.parametrize("layout", [(S(0),), (S(1),), (Partial("sum"),), (StridedShard(0, 2),)])
def test_gradient_buffers_keep_self_layout(layout):
    full = make((6, 10), 0)

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(full, mesh, list(layout))
        with so.CommDebugMode() as comm:
            buf = x.new_empty_strided((6, 10), (1, 6))
            buf.copy_(x)
            zeros = x.new_zeros((6, 10))
            other = x.new_zeros((3,))
            empty = torch.empty_like(x)
        return (
            comm.get_total_bytes(),
            buf.placements,
            zeros.placements,
            other.placements,
            empty.placements,
            buf.full_tensor(),
            zeros.full_tensor(),
            buf.stride(),
        )

    with strict_mode():
        results = so.run(body, world_size=4)
    for nbytes, buf_l, zeros_l, other_l, empty_l, buf, zeros, stride in results:
        assert nbytes == 0
        assert buf_l == layout and empty_l == layout
        assert zeros_l == (R,) if layout[0].is_partial() else zeros_l == layout
        assert other_l == (R,)
        assert stride == (1, 6)
        torch.testing.assert_close(buf, full)
        assert not zeros.any()


def test_vector_matmul_in_place_squeeze_keeps_metadata():
    r = check(torch.matmul, [make((6,), 0), make((6, 7), 1)], (4,), [(R,), (S(1),)])
    assert r.nbytes == 0 and r.out_layout == (S(0),)


def _attention_block(x, w):
    """Heads out of a sharded hidden dim, scores, softmax, values, heads merged back, output projection."""
    b, s, h = x.shape
    q = x.view(b, s, 4, h // 4).transpose(1, 2)
    att = torch.softmax(torch.einsum("bhsd,bhtd->bhst", q, q) / 2, dim=-1) @ q
    return F.linear(att.transpose(1, 2).reshape(b, s, h), w)


@pytest.mark.parametrize("mesh_shape,layouts", [((4,), [(S(2),), (S(1),)]), ((2, 2), [(S(0), S(2)), (R, S(1))])])
def test_heads_split_attention_and_merge_back_moves_nothing(mesh_shape, layouts):
    r = check(_attention_block, [make((2, 5, 16), 0), make((6, 16), 1)], mesh_shape, layouts)
    assert r.nbytes == 0, r.counts
    assert r.out_layout[-1] == Partial("sum")
    assert r.grad_layouts[0] == tuple(layouts[0])
    assert r.grad_layouts[1][-1] == S(1)  # a data-parallel (Replicate) weight dim may hold a pending sum
