"""nll_loss / cross_entropy (ops/losses.py with ops/softmax.py) against single-device torch.

Every case runs the loss forward, materialises it (`full_tensor()`), and runs backward
from the materialised value; the loss and the input's gradient must equal torch's.
Layouts: the class dim sharded (vocabulary parallel), batch dims sharded with the
target sharded alike or replicated, both on a 2-D mesh, and replicated.
"""

import contextlib
import math
import random
import warnings

import pytest
import torch
import torch.nn.functional as F

import shardops as so
from planner_harness import inputs_stay_put
from shardops import Replicate, Shard

REDUCTIONS = ("none", "mean", "sum")
PLACEMENTS = {"S0": Shard(0), "S1": Shard(1), "S2": Shard(2), "R": Replicate()}
IGNORE = {"noignore": None, "ignore-100": -100, "ignore3": 3}  # 3 is also a real class


def _target_placement(p, class_dim=1):
    """The target's placement 'alike' the input's: batch dims follow, the class dim is replicated."""
    if not p.is_shard() or p.dim == class_dim:
        return Replicate()
    return Shard(p.dim if p.dim < class_dim else p.dim - 1)


def _replicated(t, mesh):
    """A plain tensor every rank holds alike, as a Replicate DTensor (plain operands of more than one
    dim next to DTensors raise, as in torch); 0-d tensors and None pass as they are."""
    if t is None or t.ndim == 0:
        return t
    return so.from_local(t, mesh, [Replicate()] * mesh.ndim)


def _inputs(shape, *, weighted, ignore, soft=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = shape[1] if len(shape) > 1 else shape[0]
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    tshape = shape[:1] + shape[2:] if len(shape) > 1 else ()
    if soft:
        target = torch.softmax(torch.randn(shape, generator=g, dtype=torch.float64), 1 if len(shape) > 1 else 0)
    else:
        target = torch.randint(0, c, tshape, generator=g)
        if ignore == -100:
            target.view(-1)[::3] = -100
        elif ignore == 3:
            target.view(-1)[::4] = 3
    weight = torch.rand(c, generator=g, dtype=torch.float64) + 0.5 if weighted else None
    upstream = torch.randn(tshape, generator=g, dtype=torch.float64)
    return x, target, weight, upstream


def _kwargs(reduction, weight, ignore, smoothing):
    kw = {"reduction": reduction, "weight": weight}
    if ignore is not None:
        kw["ignore_index"] = ignore
    if smoothing:
        kw["label_smoothing"] = smoothing
    return kw


def _loss_case(
    fn, shape, mesh_shape, x_layout, target_layout, weight_layout, reduction, weighted, ignore, smoothing, soft
):
    mesh = so.init_device_mesh("cpu", mesh_shape)
    x, target, weight, upstream = _inputs(shape, weighted=weighted, ignore=ignore, soft=soft)
    xd = so.distribute_tensor(x, mesh, x_layout).requires_grad_()
    td = so.distribute_tensor(target, mesh, target_layout) if target_layout is not None else _replicated(target, mesh)
    wd = (
        so.distribute_tensor(weight, mesh, weight_layout)
        if weighted and weight_layout is not None
        else _replicated(weight, mesh)
    )
    loss = getattr(F, fn)(xd, td, **_kwargs(reduction, wd, ignore, smoothing))
    value = loss.full_tensor()
    value.backward(upstream if reduction == "none" else None)
    with torch.no_grad():
        return loss.placements, xd.placements, xd.grad.placements, value.detach(), xd.grad.full_tensor()


def _check(
    fn,
    shape,
    mesh_shape,
    x_layout,
    target_alike=True,
    reduction="mean",
    weighted=False,
    ignore=None,
    smoothing=0.0,
    soft=False,
    weight_layout=None,
    keeps_layout=False,
    tol=1e-10,
):
    x_pl = [PLACEMENTS[p] if isinstance(p, str) else p for p in x_layout]
    class_dim = 1 if len(shape) > 1 else 0
    if isinstance(target_alike, (list, tuple)):
        t_pl = list(target_alike)  # explicit target placements
    else:
        t_pl = [_target_placement(p, class_dim) for p in x_pl] if target_alike and not soft else None
    if t_pl is not None and len(shape) == 1:
        t_pl = None  # a 0-d target cannot be sharded
    with inputs_stay_put() if keeps_layout else contextlib.nullcontext():
        results = so.run(
            _loss_case,
            math.prod(mesh_shape),
            fn,
            shape,
            mesh_shape,
            x_pl,
            t_pl,
            weight_layout,
            reduction,
            weighted,
            ignore,
            smoothing,
            soft,
        )
    x, target, weight, upstream = _inputs(shape, weighted=weighted, ignore=ignore, soft=soft)
    x = x.requires_grad_()
    ref = getattr(F, fn)(x, target, **_kwargs(reduction, weight, ignore, smoothing))
    ref.backward(upstream if reduction == "none" else None)
    for _loss_pl, xd_pl, g_pl, value, grad in results:
        torch.testing.assert_close(value, ref.detach(), rtol=tol, atol=tol, equal_nan=True)
        torch.testing.assert_close(grad, x.grad, rtol=tol, atol=tol, equal_nan=True)
        if keeps_layout:
            assert g_pl == xd_pl, "the input's gradient keeps the input's layout"
    return results


# ------------------------------------------------------------------ the grid

SHAPES = {"8x16": (8, 16), "8x16x12": (8, 16, 12)}


def _layouts(shape):
    names = [n for n in PLACEMENTS if n == "R" or int(n[1]) < len(shape)]
    return {(4,): [(a,) for a in names], (2, 2): [(a, b) for a in names for b in names]}


def _grid():
    cases = []
    for fn in ("nll_loss", "cross_entropy"):
        for sname, shape in SHAPES.items():
            for mesh_shape, layouts in _layouts(shape).items():
                for layout in layouts:
                    for alike in (True, False):
                        for reduction in REDUCTIONS:
                            for weighted in (False, True):
                                for iname, ignore in IGNORE.items():
                                    ident = "-".join(
                                        [
                                            fn,
                                            sname,
                                            "x".join(map(str, mesh_shape)),
                                            ".".join(layout),
                                            "target-alike" if alike else "target-R",
                                            reduction,
                                            "weight" if weighted else "noweight",
                                            iname,
                                        ]
                                    )
                                    cases.append(
                                        pytest.param(
                                            fn, shape, mesh_shape, layout, alike, reduction, weighted, ignore, id=ident
                                        )
                                    )
    return cases


GRID = _grid()
SAMPLE = random.Random(7).sample(GRID, 24)


@pytest.mark.parametrize("sharded", [False, True], ids=["cost-model", "inputs-stay"])
@pytest.mark.parametrize("fn,shape,mesh_shape,layout,alike,reduction,weighted,ignore", SAMPLE)
def test_loss_matches_torch_sample(fn, shape, mesh_shape, layout, alike, reduction, weighted, ignore, sharded):
    _check(fn, shape, mesh_shape, layout, alike, reduction, weighted, ignore, keeps_layout=sharded)


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["cost-model", "inputs-stay"])
@pytest.mark.parametrize("fn,shape,mesh_shape,layout,alike,reduction,weighted,ignore", GRID)
def test_loss_matches_torch_grid(fn, shape, mesh_shape, layout, alike, reduction, weighted, ignore, sharded):
    _check(fn, shape, mesh_shape, layout, alike, reduction, weighted, ignore, keeps_layout=sharded)


# ------------------------------------------------------------------ every layout kind, always run

KINDS = [
    # (fn, shape, mesh, layout, target alike, reduction, weighted, ignore)
    ("cross_entropy", (8, 16), (4,), ("S1",), False, "mean", True, -100),  # vocabulary parallel
    ("nll_loss", (8, 16), (4,), ("S1",), False, "none", True, 3),
    ("cross_entropy", (8, 16), (4,), ("S0",), True, "sum", True, -100),  # batch parallel, target sharded
    ("nll_loss", (8, 16), (4,), ("S0",), False, "mean", True, 3),  # batch parallel, target replicated
    ("cross_entropy", (8, 16, 12), (4,), ("S2",), True, "none", False, -100),  # nll_loss2d, spatial dim sharded
    ("cross_entropy", (8, 16, 12), (4,), ("S1",), False, "mean", True, 3),  # nll_loss2d, vocabulary parallel
    ("cross_entropy", (8, 16), (2, 2), ("S0", "S1"), True, "mean", True, -100),  # dp x tp
    ("nll_loss", (8, 16, 12), (2, 2), ("S2", "S1"), True, "sum", True, 3),
    ("cross_entropy", (8, 16, 12), (2, 2), ("S1", "S1"), False, "none", True, 3),  # classes over both mesh dims
    ("cross_entropy", (5, 3), (4,), ("S1",), False, "mean", True, -100),  # an empty class shard
    ("nll_loss", (3, 7, 2), (2, 2), ("S0", "S2"), True, "mean", True, -100),  # uneven and empty batch shards
    ("cross_entropy", (16,), (4,), ("S0",), False, "mean", True, -100),  # 1-d input, 0-d target
]


@pytest.mark.parametrize("sharded", [False, True], ids=["cost-model", "inputs-stay"])
@pytest.mark.parametrize(
    "fn,shape,mesh_shape,layout,alike,reduction,weighted,ignore", KINDS, ids=lambda v: str(v).replace(" ", "")
)
def test_loss_layout_kinds(fn, shape, mesh_shape, layout, alike, reduction, weighted, ignore, sharded):
    _check(fn, shape, mesh_shape, layout, alike, reduction, weighted, ignore, keeps_layout=sharded)


@pytest.mark.parametrize("sharded", [False, True], ids=["cost-model", "inputs-stay"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    "shape,layout,target_layout",
    [
        ((2, 2), ("S0", "R"), [Replicate(), Shard(0)]),  # found by tests/test_properties.py
        ((6, 5), ("S0", "S0"), [Replicate(), Shard(0)]),
        ((6, 5, 4), ("S2", "S0"), [Replicate(), Shard(0)]),
    ],
    ids=lambda v: str(v).replace(" ", ""),
)
def test_target_cut_across_nested_batch_shards(shape, layout, target_layout, reduction, sharded):
    """self's batch dim nested over both mesh dims, the target R then S(0): the target's chunks do
    not hold self's rows and must be gathered, not sliced. (x's layout changes here: the
    free slice of x to S(0) on mesh dim 1 is the only way that moves nothing big.)"""
    with inputs_stay_put() if sharded else contextlib.nullcontext():
        _check("nll_loss", shape, (2, 2), layout, target_layout, reduction, True, -100)
        _check("cross_entropy", shape, (2, 2), layout, target_layout, reduction, False, 1)


@pytest.mark.parametrize("sharded", [False, True], ids=["cost-model", "inputs-stay"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(2,), (6, 9), (4, 9, 3)], ids=lambda v: "x".join(map(str, v)))
def test_weight_cut_across_nested_class_shards(shape, reduction, sharded):
    """Classes nested over both mesh dims, the weight R then S(0) (found by tests/test_properties.py):
    the weight's chunk does not hold the rank's classes and must be gathered, not sliced."""
    with inputs_stay_put() if sharded else contextlib.nullcontext():
        _check(
            "nll_loss",
            shape,
            (2, 2),
            ("S0" if len(shape) == 1 else "S1", "R"),
            False,
            reduction,
            True,
            -100,
            weight_layout=[Replicate(), Shard(0)],
        )


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_loss_all_targets_ignored(reduction):
    """mean over no target is 0/0 = NaN in torch; the gradient is 0."""

    def all_ignored(shape, mesh_shape, reduction):
        mesh = so.init_device_mesh("cpu", mesh_shape)
        x = so.distribute_tensor(torch.randn(shape, dtype=torch.float64), mesh, [Shard(1)]).requires_grad_()
        loss = F.cross_entropy(x, _replicated(torch.full(shape[:1], -100), mesh), reduction=reduction)
        v = loss.full_tensor()
        v.sum().backward()
        return v.detach(), x.grad.full_tensor()

    for value, grad in so.run(all_ignored, 4, (6, 9), (4,), reduction):
        ref = F.cross_entropy(torch.zeros(6, 9), torch.full((6,), -100), reduction=reduction)
        torch.testing.assert_close(value, ref.double(), equal_nan=True)
        assert torch.equal(grad, torch.zeros(6, 9, dtype=torch.float64))


def test_weight_sharded_like_the_classes():
    """A weight laid out Shard(0) next to Shard(1) logits is used as local slices (no gather)."""
    for reduction in REDUCTIONS:
        _check(
            "cross_entropy",
            (8, 16),
            (4,),
            ("S1",),
            False,
            reduction,
            True,
            3,
            weight_layout=[Shard(0)],
            keeps_layout=True,
        )
        _check(
            "nll_loss",
            (8, 16, 12),
            (2, 2),
            ("S0", "S1"),
            True,
            reduction,
            True,
            -100,
            weight_layout=[Replicate(), Shard(0)],
            keeps_layout=True,
        )


# ------------------------------------------------------------------ label smoothing, probability targets


@pytest.mark.parametrize("sharded", [False, True], ids=["cost-model", "inputs-stay"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    "shape,mesh_shape,layout",
    [((8, 16), (4,), ("S1",)), ((8, 16), (4,), ("S0",)), ((8, 16), (4,), ("R",)), ((8, 16, 12), (2, 2), ("S0", "S1"))],
    ids=lambda v: str(v).replace(" ", ""),
)
def test_label_smoothing(shape, mesh_shape, layout, reduction, sharded):
    """Adds sum over classes of log-probs x weight, weight.gather(0, target), masked_fill_ (torch 2.13 CPU)."""
    # With a weight, reduction="mean" and ignore_index, torch's formula calls masked_select (an output
    # whose size depends on the data, no sharded strategy) unless a dispatch mode is active: inside
    # so.run one is (each rank thread's random state), and torch takes its masked_select-free formula.
    with warnings.catch_warnings():
        warnings.simplefilter("error", so.FallbackWarning)
        _check("cross_entropy", shape, mesh_shape, layout, True, reduction, True, 3, smoothing=0.1)
    _check(
        "cross_entropy", shape, mesh_shape, layout, True, reduction, False, -100, smoothing=0.3, keeps_layout=sharded
    )


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(1, 1), (8, 16)], ids=lambda v: "x".join(map(str, v)))
def test_label_smoothing_with_sharded_weight(shape, reduction):
    """weight.gather(0, target) on a sharded weight: picks from the owning shard, P(sum)."""
    _check(
        "cross_entropy",
        shape,
        (2, 2),
        ("R", "R"),
        False,
        reduction,
        True,
        -100,
        smoothing=0.1,
        weight_layout=[Replicate(), Shard(0)],
    )
    _check("cross_entropy", shape, (4,), ("S1",), False, reduction, True, 0, smoothing=0.1, weight_layout=[Shard(0)])


@pytest.mark.parametrize("weighted", [False, True], ids=["noweight", "weight"])
@pytest.mark.parametrize("layout", [("S1",), ("S0", "S1")], ids=lambda v: ".".join(v))
@pytest.mark.parametrize("sharded", [False, True], ids=["cost-model", "inputs-stay"])
def test_probability_targets(layout, weighted, sharded):
    """Float targets: log_softmax, mul (by target and weight), sum, neg, div (torch 2.13 CPU)."""
    mesh_shape = (4,) if len(layout) == 1 else (2, 2)
    _check(
        "cross_entropy",
        (8, 16),
        mesh_shape,
        layout,
        False,
        "mean",
        weighted,
        None,
        smoothing=0.2,
        soft=True,
        keeps_layout=sharded,
    )
    _check(
        "cross_entropy", (8, 16, 3), mesh_shape, layout, False, "sum", weighted, None, soft=True, keeps_layout=sharded
    )
    _check("cross_entropy", (8, 16), mesh_shape, layout, False, "none", weighted, None, soft=True, keeps_layout=sharded)


# ------------------------------------------------------------------ the large vocabulary

VOCAB = 32001  # over 4 ranks: 8001, 8001, 8001, 7998 classes


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_vocab_32001_over_4_ranks(reduction):
    results = _check("cross_entropy", (8, VOCAB), (4,), ("S1",), False, reduction, True, -100, tol=1e-9)
    for loss_pl, x_pl, g_pl, _, _ in results:
        assert x_pl == g_pl == (Shard(1),)
        assert loss_pl == ((so.Partial("sum"),) if reduction != "none" else (so.Partial("sum"),))


# ------------------------------------------------------------------ bytes and rounds

ROWS, CLASSES, IGNORE_INDEX = 8, 32000, -100


def _ce_bytes_case():
    mesh = so.init_device_mesh("cpu", (4,))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(ROWS, CLASSES, generator=g)
    target = torch.randint(0, CLASSES, (ROWS,), generator=g)
    target[::3] = IGNORE_INDEX
    weight = torch.rand(CLASSES, generator=g) + 0.5
    x = so.distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
    with so.CommDebugMode() as comm:
        loss = F.cross_entropy(
            x, _replicated(target, mesh), weight=_replicated(weight, mesh), ignore_index=IGNORE_INDEX
        )
        value = loss.full_tensor()
        forward_rounds = comm.get_rounds()
        value.backward()
    ref_x = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_x, target, weight=weight, ignore_index=IGNORE_INDEX)
    ref.backward()
    return (
        comm.get_comm_counts(),
        comm.get_total_bytes(),
        forward_rounds,
        x.grad.placements,
        torch.allclose(value, ref),
        torch.allclose(x.grad.full_tensor(), ref_x.grad, atol=1e-7),
    )


def test_cross_entropy_bytes_and_rounds():
    """Vocabulary-parallel f32[8, 32000] Shard(1), target replicated, weight, ignore_index, mean:
    forward = the (max, sum exp) pairs (1 all_gather) + materialising the P(sum) scalar loss
    (1 all_reduce); nll_loss forward and backward are local; the log_softmax backward
    all-reduces sum(grad) per row."""
    forward = ROWS * 2 * 4 + 4  # f32 pair per row, then the f32 scalar loss
    backward = ROWS * 4  # f32 sum(grad) per row
    for counts, nbytes, rounds, grad_pl, loss_ok, grad_ok in so.run(_ce_bytes_case, 4):
        assert counts == {"all_gather": 1, "all_reduce": 2}
        assert nbytes == forward + backward <= 1024
        assert rounds == 2
        assert grad_pl == (Shard(1),)
        assert loss_ok and grad_ok


# ------------------------------------------------------------------ bad input

BAD_CLASSES = 32000  # large enough that the sharded rows beat gathering the logits


def _bad_target_case(target, fn, x_layout, t_layout):
    mesh = so.init_device_mesh("cpu", (4,))
    g = torch.Generator().manual_seed(0)
    x = so.distribute_tensor(torch.randn(8, BAD_CLASSES, generator=g), mesh, x_layout)
    t = so.distribute_tensor(target, mesh, t_layout) if t_layout is not None else _replicated(target, mesh)
    return getattr(F, fn)(x, t).full_tensor()


@pytest.mark.parametrize("fn", ["cross_entropy", "nll_loss"])
@pytest.mark.parametrize("bad", [BAD_CLASSES, -1, 12345678], ids=lambda v: f"target{v}")
@pytest.mark.parametrize(
    "x_layout,t_layout", [([Shard(1)], None), ([Shard(0)], [Shard(0)])], ids=["vocab-parallel", "batch-parallel"]
)
def test_target_out_of_range_names_the_op(fn, bad, x_layout, t_layout):
    target = torch.tensor([0, 3, 1, 2, 7, bad, 9, 5])
    with pytest.raises(IndexError):
        getattr(F, fn)(torch.randn(8, BAD_CLASSES), target)  # torch's own behaviour
    # With a sharded target only the rank holding the bad value raises; the others are released.
    with pytest.raises(
        so.ShardingError,
        match=rf"nll_loss_forward.default: target value {bad} is out of range for {BAD_CLASSES} classes",
    ):
        so.run(_bad_target_case, 4, target, fn, x_layout, t_layout)


@pytest.mark.parametrize(
    "target,error",
    [
        (torch.tensor([0, 3, 9]), (ValueError, "batch_size")),
        (torch.zeros(8, 2, dtype=torch.long), (RuntimeError, "multi-target not supported")),
        (torch.tensor([0.0, 3.0, 1.0, 2.0, 0.0, 3.0, 1.0, 2.0]), (RuntimeError, "Long")),
    ],
    ids=["wrong-batch", "wrong-rank", "float-target-for-class-indices"],
)
def test_bad_target_raises_torchs_error(target, error):
    kind, message = error
    with pytest.raises(kind, match=message):
        F.nll_loss(torch.randn(8, BAD_CLASSES), target)
    with pytest.raises(kind, match=message):
        so.run(_bad_target_case, 4, target, "nll_loss", [Shard(1)], None)
