"""The benchmark case table, shared by the DTensor side and the shardops side.

A case is library-neutral: its inputs are plain tensors built from a seeded
`torch.Generator`, its placements are short strings (`"S(1)"`, `"R"`) that
each side turns into its own placement objects with `parse_placements`, and
its `fn` uses only plain `torch` / `torch.nn.functional` calls plus
`materialize` (`.full_tensor()` on a distributed tensor, identity on a plain
one) and `.backward()`. So the same `fn` runs on torch DTensors, on shardops
DTensors and, as the single-device reference, on plain tensors.

What the measured region of `fn` contains depends on `kind`:

- "reduction": the op and `.full_tensor()` of its (small) result;
- "scan": the op only; its full-size output stays distributed;
- "fwd_bwd": the forward op, a reduction of its output to a scalar loss,
  `.full_tensor()` of that scalar, and `.backward()`; neither the full output
  nor the full gradients are materialised.

`lower_bound_bytes(mesh_shape)` is a rough floor for the bytes one rank must
put into one round of collectives: the reduced per-row values (for example one
f32 partial sum per row this rank holds), not the rows themselves.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

MESH_SHAPES: tuple[tuple[int, ...], ...] = ((4,), (2, 2))

Kind = Literal["reduction", "scan", "fwd_bwd"]
PlacementSpec = tuple[str, ...]  # one short string per mesh dim, e.g. ("S(0)", "S(1)")


def materialize(t: Any) -> Any:
    """`.full_tensor()` of a distributed tensor; a plain tensor as it is.

    Tuples (e.g. `torch.max(x, 1)`'s values and indices) are materialised
    element by element.
    """
    if isinstance(t, tuple):
        return tuple(materialize(v) for v in t)
    return t.full_tensor() if hasattr(t, "full_tensor") else t


_SHARD_RE = re.compile(r"S\((\d+)\)")


def parse_placements(spec: Sequence[str], shard: Callable[[int], Any], replicate: Callable[[], Any]) -> list[Any]:
    """Turn `("S(0)", "R")` into `[shard(0), replicate()]` of either library."""
    out = []
    for s in spec:
        m = _SHARD_RE.fullmatch(s)
        if m:
            out.append(shard(int(m.group(1))))
        elif s == "R":
            out.append(replicate())
        else:
            raise ValueError(f"unknown placement spec {s!r}; use 'S(<dim>)' or 'R'")
    return out


@dataclass(frozen=True, eq=False)  # eq=False: identity hash; `placements` is a dict
class Case:
    """One benchmark case.

    name:        unique id, used on the command line and in tables.
    build:       generator -> the global inputs (plain tensors, same on every rank).
    fn:          (*inputs) -> outputs to check; see the module docstring.
    placements:  mesh shape -> one PlacementSpec per input.
    kind:        "reduction", "scan" or "fwd_bwd".
    reduce_dims: dims of input 0 the op combines across (defines "rows").
    floor_row_bytes: bytes per local row of the reduced values one round must move.
    floor_per_element: the floor is per element of the local row shard instead
        (sort: every value may have to change rank, (n-1)/n of them on average).
    grad_inputs: indices of inputs that get `requires_grad` (fwd_bwd cases).
    rtol, atol_scaled: see `close`.
    """

    name: str
    build: Callable[[torch.Generator], tuple[torch.Tensor, ...]]
    fn: Callable[..., Any]
    placements: dict[tuple[int, ...], tuple[PlacementSpec, ...]]
    kind: Kind
    reduce_dims: tuple[int, ...]
    floor_row_bytes: int
    floor_per_element: bool = False
    grad_inputs: tuple[int, ...] = ()
    seed: int = 0
    rtol: float = 1e-5
    atol_scaled: float = 2e-6
    notes: str = ""
    # torch's best equivalent when it is not DTensor's default path: measured too, on the same
    # case, and the one shardops is compared with ("loss_parallel": torch.distributed.tensor.parallel.loss_parallel)
    dtensor_best: str | None = None

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The global inputs, freshly built from the case's seeded generator."""
        return self.build(torch.Generator().manual_seed(self.seed))

    def placement_specs(self, mesh_shape: Sequence[int]) -> tuple[PlacementSpec, ...]:
        return self.placements[tuple(mesh_shape)]

    def close(self, actual: torch.Tensor | None, expected: torch.Tensor | None) -> bool:
        """Whether a result matches single-device torch.

        Integers, bools and indices must be equal. Floats pass when
        |actual - expected| <= rtol * |expected| + atol_scaled * max|expected|
        elementwise (NaN and inf where expected has them): the absolute part
        scales with the tensor, because a fixed atol is vacuous for a
        gradient of 1e-6-sized entries and too strict for sums near 1e2.
        The defaults leave at least a 4x margin over single-device f32's own error
        against float64 on every case.
        """
        if actual is None or expected is None:
            return actual is None and expected is None
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            return False
        if not expected.is_floating_point():
            return torch.equal(actual, expected)
        finite = expected[torch.isfinite(expected)]
        scale = finite.abs().max().item() if finite.numel() else 0.0
        return bool(
            torch.isclose(actual, expected, rtol=self.rtol, atol=self.atol_scaled * scale, equal_nan=True).all()
        )

    def lower_bound_bytes(self, mesh_shape: Sequence[int]) -> int:
        """Rough floor of the bytes one rank sends per round (see module docstring)."""
        mesh_shape = tuple(mesh_shape)
        shape = tuple(self.inputs()[0].shape)
        spec = self.placement_specs(mesh_shape)[0]
        row_split = 1  # ranks that split the rows (non-reduced dims)
        red_split = 1  # ranks that split each row (reduced dims)
        for size, p in zip(mesh_shape, spec):
            m = _SHARD_RE.fullmatch(p)
            if m is None:
                continue
            if int(m.group(1)) in self.reduce_dims:
                red_split *= size
            else:
                row_split *= size
        rows = math.prod(s for d, s in enumerate(shape) if d not in self.reduce_dims)
        local_rows = math.ceil(rows / row_split)
        if not self.floor_per_element:
            return local_rows * self.floor_row_bytes
        row_len = math.prod(shape[d] for d in self.reduce_dims)
        local_row_len = math.ceil(row_len / red_split)
        return local_rows * local_row_len * self.floor_row_bytes * (red_split - 1) // red_split


# --- inputs -----------------------------------------------------------------

ROWS, COLS = 8, 4096  # reductions, scans, sort/top-k: f32[8, 4096], reduce dim 1
VOCAB = 32000  # cross-entropy: f32[8, 32000] logits
NORM_SHAPE = (8, 16, 1024)  # layer_norm / rms_norm, normalised dim 2
IGNORE_INDEX = -100
HISTC_BINS = 10
TOPK_K = 5
NORM_EPS = 1e-5

# Row layouts: mesh (4,) shards the reduced dim; mesh (2, 2) also shards the
# rows on the first mesh dim (data parallel x tensor parallel), which is the
# layout a 2-D training job has.
_ROW_1D = {(4,): (("S(1)",),), (2, 2): (("S(0)", "S(1)"),)}
_ROW_2D_WITH_UPSTREAM = {(4,): (("S(1)",), ("S(1)",)), (2, 2): (("S(0)", "S(1)"), ("S(0)", "S(1)"))}


def _randn_rows(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    return (torch.randn(ROWS, COLS, generator=g),)


def _near_one_rows(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    # cumprod of randn under/overflows within a few hundred steps, which makes
    # any comparison vacuous; factors near 1 keep the products finite.
    return (1.0 + 0.01 * torch.randn(ROWS, COLS, generator=g),)


def _rows_and_upstream(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    # The second tensor weights the output before summing it to a loss; with a
    # plain .sum() the softmax gradient would be exactly zero.
    return torch.randn(ROWS, COLS, generator=g), torch.randn(ROWS, COLS, generator=g)


def _ce_inputs(g: torch.Generator, *, weighted: bool, ignored: bool) -> tuple[torch.Tensor, ...]:
    logits = torch.randn(ROWS, VOCAB, generator=g)
    target = torch.randint(0, VOCAB, (ROWS,), generator=g)
    if ignored:
        target[::3] = IGNORE_INDEX
    if not weighted:
        return logits, target
    weight = torch.rand(VOCAB, generator=g) + 0.5
    return logits, target, weight


def _norm_inputs(g: torch.Generator, *, with_bias: bool) -> tuple[torch.Tensor, ...]:
    hidden = NORM_SHAPE[-1]
    x = torch.randn(*NORM_SHAPE, generator=g)
    upstream = torch.randn(*NORM_SHAPE, generator=g)
    weight = 1.0 + 0.1 * torch.randn(hidden, generator=g)
    if not with_bias:
        return x, upstream, weight
    bias = 0.1 * torch.randn(hidden, generator=g)
    return x, upstream, weight, bias


# --- functions under test ---------------------------------------------------


def _softmax_loss(x, upstream):
    loss = (torch.softmax(x, dim=1) * upstream).sum()
    loss_full = materialize(loss)
    loss_full.backward()
    return loss_full


def _log_softmax_loss(x, upstream):
    loss = (F.log_softmax(x, dim=1) * upstream).sum()
    loss_full = materialize(loss)
    loss_full.backward()
    return loss_full


def _cross_entropy_loss(logits, target, weight=None, ignore_index=IGNORE_INDEX):
    loss = F.cross_entropy(logits, target, weight=weight, ignore_index=ignore_index)
    loss_full = materialize(loss)
    loss_full.backward()
    return loss_full


def _layer_norm_loss(x, upstream, weight, bias):
    y = F.layer_norm(x, (x.shape[-1],), weight, bias, eps=NORM_EPS)
    loss_full = materialize((y * upstream).sum())
    loss_full.backward()
    return loss_full


def _rms_norm_loss(x, upstream, weight):
    y = F.rms_norm(x, (x.shape[-1],), weight, eps=NORM_EPS)
    loss_full = materialize((y * upstream).sum())
    loss_full.backward()
    return loss_full


def _reduction(
    name: str, op: Callable[[torch.Tensor], Any], row_bytes: int, *, build=_randn_rows, notes: str = ""
) -> Case:
    return Case(
        name=name,
        build=build,
        fn=lambda x: materialize(op(x)),
        placements=_ROW_1D,
        kind="reduction",
        reduce_dims=(1,),
        floor_row_bytes=row_bytes,
        notes=notes,
    )


def _scan(
    name: str, op: Callable[[torch.Tensor], Any], row_bytes: int, *, build=_randn_rows, per_element: bool = False
) -> Case:
    return Case(
        name=name,
        build=build,
        fn=op,
        placements=_ROW_1D,
        kind="scan",
        reduce_dims=(1,),
        floor_row_bytes=row_bytes,
        floor_per_element=per_element,
    )


def _ce_case(name: str, *, weighted: bool, ignored: bool) -> Case:
    n_inputs = 3 if weighted else 2
    one_d = (("S(1)",), ("R",), ("R",))[:n_inputs]
    two_d = (("S(0)", "S(1)"), ("S(0)", "R"), ("R", "R"))[:n_inputs]
    return Case(
        name=name,
        build=lambda g: _ce_inputs(g, weighted=weighted, ignored=ignored),
        fn=_cross_entropy_loss,
        placements={(4,): one_d, (2, 2): two_d},
        kind="fwd_bwd",
        reduce_dims=(1,),
        floor_row_bytes=4,  # one log-sum-exp per row
        grad_inputs=(0,),
        seed=1,
        dtensor_best="loss_parallel",
    )


def _norm_case(name: str, fn: Callable[..., Any], *, with_bias: bool, row_bytes: int) -> Case:
    n_rep = 2 if with_bias else 1
    x1, x2 = ("S(2)",), ("S(0)", "S(2)")
    return Case(
        name=name,
        build=lambda g: _norm_inputs(g, with_bias=with_bias),
        fn=fn,
        placements={(4,): (x1, x1) + (("R",),) * n_rep, (2, 2): (x2, x2) + (("R", "R"),) * n_rep},
        kind="fwd_bwd",
        reduce_dims=(2,),
        floor_row_bytes=row_bytes,
        grad_inputs=(0, 2, 3) if with_bias else (0, 2),
        seed=2,
    )


CASES: list[Case] = [
    # Linear reductions: one f32 partial per row.
    _reduction("sum", lambda x: torch.sum(x, dim=1), 4),
    _reduction("mean", lambda x: torch.mean(x, dim=1), 4),
    # Index reductions: the int64 index per row (the value can travel in another round).
    _reduction("argmax", lambda x: torch.argmax(x, dim=1), 8),
    _reduction("max.dim", lambda x: torch.max(x, dim=1), 12),
    # Scans: only the shard totals cross ranks; the output stays sharded.
    _scan("cumsum", lambda x: torch.cumsum(x, dim=1), 4),
    _scan("cumprod", lambda x: torch.cumprod(x, dim=1), 4, build=_near_one_rows),
    _scan("cummax", lambda x: torch.cummax(x, dim=1), 12),
    # Moments and norms.
    _reduction("var", lambda x: torch.var(x, dim=1), 4),
    _reduction("std", lambda x: torch.std(x, dim=1), 4),
    _reduction("var_mean", lambda x: torch.var_mean(x, dim=1), 8),
    _reduction("vector_norm", lambda x: torch.linalg.vector_norm(x, dim=1), 4),
    _reduction("logsumexp", lambda x: torch.logsumexp(x, dim=1), 4),
    Case(
        name="histc",
        build=_randn_rows,
        fn=lambda x: materialize(torch.histc(x, bins=HISTC_BINS)),
        placements=_ROW_1D,
        kind="reduction",
        reduce_dims=(0, 1),
        floor_row_bytes=HISTC_BINS * 4,  # the f32 histogram; the (min, max) round is smaller
        notes="no min/max given: the range is data dependent",
    ),
    # Softmax family, forward and backward.
    Case(
        name="softmax",
        build=_rows_and_upstream,
        fn=_softmax_loss,
        placements=_ROW_2D_WITH_UPSTREAM,
        kind="fwd_bwd",
        reduce_dims=(1,),
        floor_row_bytes=4,
        grad_inputs=(0,),
    ),
    Case(
        name="log_softmax",
        build=_rows_and_upstream,
        fn=_log_softmax_loss,
        placements=_ROW_2D_WITH_UPSTREAM,
        kind="fwd_bwd",
        reduce_dims=(1,),
        floor_row_bytes=4,
        grad_inputs=(0,),
    ),
    # Vocabulary-parallel cross-entropy: logits Shard(1), target replicated.
    _ce_case("cross_entropy", weighted=False, ignored=False),
    _ce_case("cross_entropy.weight", weighted=True, ignored=False),
    _ce_case("cross_entropy.ignore_index", weighted=False, ignored=True),
    _ce_case("cross_entropy.weight_ignore_index", weighted=True, ignored=True),
    # Normalisation over a sharded hidden dim.
    _norm_case("layer_norm", _layer_norm_loss, with_bias=True, row_bytes=8),  # mean and M2 per row
    _norm_case("rms_norm", _rms_norm_loss, with_bias=False, row_bytes=4),  # sum of squares per row
    # Selection.
    _reduction("topk", lambda x: torch.topk(x, TOPK_K, dim=1), TOPK_K * 12),  # k (value, int64 index) pairs
    _scan("sort", lambda x: torch.sort(x, dim=1), 4, per_element=True),  # f32 values; indices follow from them
]

CASES_BY_NAME: dict[str, Case] = {c.name: c for c in CASES}
if len(CASES_BY_NAME) != len(CASES):
    raise RuntimeError("benchmark case names must be unique")


def select_cases(names: Sequence[str] | None = None) -> list[Case]:
    """The cases named (in the order given), or all of them."""
    if names is None:
        return list(CASES)
    unknown = [n for n in names if n not in CASES_BY_NAME]
    if unknown:
        raise ValueError(f"unknown benchmark case(s) {unknown}; known: {sorted(CASES_BY_NAME)}")
    return [CASES_BY_NAME[n] for n in names]


# --- attention (F.scaled_dot_product_attention, forward and backward) --------

ATTENTION_SHAPE = (2, 8, 32, 16)  # q, k, v: [batch, heads, sequence, head dim]


def _attention_inputs(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(*ATTENTION_SHAPE, generator=g) for _ in range(4))  # q, k, v, upstream


def _attention_loss(q, k, v, upstream, *, causal: bool):
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    loss_full = materialize((out * upstream).sum())
    loss_full.backward()
    return loss_full


def _attention_case(
    name: str, layouts: dict[tuple[int, ...], tuple[str, ...]], causal: bool, reduce_dims, row_bytes: int, notes: str
) -> Case:
    return Case(
        name=name,
        build=_attention_inputs,
        fn=lambda q, k, v, u: _attention_loss(q, k, v, u, causal=causal),
        placements={mesh: (spec,) * 4 for mesh, spec in layouts.items()},
        kind="fwd_bwd",
        reduce_dims=reduce_dims,
        floor_row_bytes=row_bytes,
        grad_inputs=(0, 1, 2),
        seed=3,
        notes=notes,
    )


# Heads or batch sharded are local in shardops (0 B, tests/test_attention.py); they are not
# rows here because torch DTensor 2.13 traces the CPU flash op's decomposition for every
# candidate placement there (minutes on a loaded 2-core machine, past the threaded world's
# timeout) and then raises NotImplementedError in the backward.
ATTENTION_CASES = [
    # Sequence sharded (context parallel), causal: K and V must reach every query shard once.
    _attention_case(
        "attention.context",
        {(4,): ("S(2)",), (2, 2): ("S(0)", "S(2)")},
        True,
        (2,),
        2 * 8 * 4,
        "q, k, v sharded on the sequence: floor = each rank's K and V (8 positions per row on 4 ranks; "
        "rough on (2, 2), where a rank holds 16)",
    ),
]
CASES.extend(ATTENTION_CASES)
CASES_BY_NAME.update({c.name: c for c in ATTENTION_CASES})


# --- matrix products and embeddings ----------------------------------------
#
# Megatron-style tensor parallelism: column-parallel then row-parallel linears, heads-
# sharded attention scores, a vocabulary-parallel embedding. Measured forward and
# backward; the floor is the f32 loss scalar every case materialises.
MM_SHAPE, MM_HIDDEN, MM_FFN, MM_HEADS = (4, 64, 256), 256, 512, 8
EMB_VOCAB, EMB_IDS = 8000, (8, 64)


def _mm_loss(y, upstream):
    loss_full = materialize((y * upstream).sum())
    loss_full.backward()
    return loss_full


def _column_linear_loss(x, w, b, upstream):
    return _mm_loss(F.linear(x, w, b), upstream)


def _row_linear_loss(x, w, upstream):
    return _mm_loss(F.linear(x, w), upstream)


def _mlp_loss(x, w1, b1, w2, upstream):
    return _mm_loss(F.linear(F.gelu(F.linear(x, w1, b1)), w2), upstream)


def _scores_loss(q, k, upstream):
    return _mm_loss(torch.einsum("bhsd,bhtd->bhst", q, k), upstream)


def _embedding_loss(w, ids, upstream):
    return _mm_loss(F.embedding(ids, w), upstream)


def _mm_inputs(*shapes):
    return lambda g: tuple(torch.randn(s, generator=g) / math.sqrt(s[-1]) for s in shapes)


def _embedding_inputs(g):
    return (
        torch.randn(EMB_VOCAB, MM_HIDDEN, generator=g),
        torch.randint(0, EMB_VOCAB, EMB_IDS, generator=g),
        torch.randn(EMB_IDS + (MM_HIDDEN,), generator=g),
    )


def _matrix_case(name, build, fn, p1, p2, grads, notes=""):
    return Case(
        name=name,
        build=build,
        fn=fn,
        placements={(4,): p1, (2, 2): p2},
        kind="fwd_bwd",
        reduce_dims=tuple(range(len(MM_SHAPE))),
        floor_row_bytes=4,
        grad_inputs=grads,
        seed=3,
        rtol=1e-4,
        atol_scaled=1e-5,
        notes=notes,
    )


_B, _S, _H = MM_SHAPE
MATRIX_CASES = [
    _matrix_case(
        "linear.column",
        _mm_inputs(MM_SHAPE, (MM_FFN, _H), (MM_FFN,), (_B, _S, MM_FFN)),
        _column_linear_loss,
        (("R",), ("S(0)",), ("S(0)",), ("S(2)",)),
        (("S(0)", "R"), ("R", "S(0)"), ("R", "S(0)"), ("S(0)", "S(2)")),
        (1, 2),
    ),
    _matrix_case(
        "linear.row",
        _mm_inputs((_B, _S, MM_FFN), (_H, MM_FFN), MM_SHAPE),
        _row_linear_loss,
        (("S(2)",), ("S(1)",), ("R",)),
        (("S(0)", "S(2)"), ("R", "S(1)"), ("S(0)", "R")),
        (0, 1),
    ),
    _matrix_case(
        "mlp.megatron",
        _mm_inputs(MM_SHAPE, (MM_FFN, _H), (MM_FFN,), (_H, MM_FFN), MM_SHAPE),
        _mlp_loss,
        (("R",), ("S(0)",), ("S(0)",), ("S(1)",), ("R",)),
        (("S(0)", "R"), ("R", "S(0)"), ("R", "S(0)"), ("R", "S(1)"), ("S(0)", "R")),
        (1, 2, 3),
        notes="column -> GELU -> row; x does not require grad",
    ),
    _matrix_case(
        "einsum.heads",
        _mm_inputs((_B, MM_HEADS, _S, 32), (_B, MM_HEADS, _S, 32), (_B, MM_HEADS, _S, _S)),
        _scores_loss,
        (("S(1)",), ("S(1)",), ("S(1)",)),
        (("S(0)", "S(1)"), ("S(0)", "S(1)"), ("S(0)", "S(1)")),
        (0, 1),
    ),
    _matrix_case(
        "embedding.vocab",
        _embedding_inputs,
        _embedding_loss,
        (("S(0)",), ("R",), ("R",)),
        (("R", "S(0)"), ("S(0)", "R"), ("S(0)", "R")),
        (0,),
    ),
]
CASES.extend(MATRIX_CASES)
CASES_BY_NAME.update({c.name: c for c in MATRIX_CASES})
