"""Attention: F.scaled_dot_product_attention on sharded q, k, v (forward and backward).

On CPU (torch 2.13) `F.scaled_dot_product_attention` reaches
`_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale)`
-> (out, logsumexp) and its `_backward`. A bool mask is first turned additive with `where`;
is_causal and attn_mask may be combined (both apply); GQA (fewer K/V heads) goes into the
kernel as it is. With dropout_p > 0 it decomposes before dispatch (bmm, _safe_softmax,
bernoulli_, ...) and those ops' own rows serve it. Inputs are [B, H, L, D] (inputs of other
ndims take torch's math path, which decomposes too). The CPU kernel dies (SIGFPE) on empty
heads, queries or keys, so an empty shard never reaches it.

Rows for one mesh dim (q, k, v, [mask] -> out, logsumexp; the mask's dims line up with the
score's [B, H, L, S] from the right and stay Replicate where they broadcast):

    batch    q S(0)  k S(0)  v S(0)  mask S(b)   -> out S(0)  lse S(0)   local
    heads    q S(1)  k S(1)  v S(1)  mask S(h)   -> S(1)                 local (GQA: only on mesh dims
                                                                         where q and K/V heads split
                                                                         evenly and aligned)
    GQA      q S(1)  k R     v R     mask S(h)   -> S(1)                 local, each rank picks the K/V
                                                                         heads its q heads use
    queries  q S(2)  k R     v R     mask S(l)   -> S(2)                 local, causal mask offset by the
                                                                         shard's global position
    context  q S(2)  k S(2)  v S(2)  mask S(l)   -> S(2)                 one all_gather of K and V (packed)

Backward (grad, q, k, v, out, lse, [mask] -> dq, dk, dv) mirrors them; where K/V are
Replicate their gradients come out Partial(sum), in the context row one reduce_scatter of
dK and dV (packed) returns them to their owners.

Causal offset without a materialised mask: a shard holding query rows [a, b) sees keys
[0, a) entirely and keys [a, b) with the kernel's own top-left causal mask; the two chunks'
(out, logsumexp) merge by log-sum-exp (the softmax family's (max, sum exp) algebra), and in
backward each chunk's kernel takes the merged out and logsumexp, so the chunks' dq add up and
their dk/dv are the exact gradients of their keys. Keys >= b are never touched.

`F.scaled_dot_product_attention` on DTensors enters `_Attention` (an autograd.Function) from
__torch_function__. The planner chooses from the forward op's rows, keeping q's shards where
they are (the caller's parallelism; only K, V and the mask move); the Function runs that row's
algorithm and keeps the K/V it gathered, so a context-parallel step moves K and V once (one
all_gather) and their gradients once (one reduce_scatter). The aten backward op called on its
own (a decomposition, verify) gathers K and V again. Gradients come back in the inputs' layouts
and memory order (q/k/v are often transposed views of [B, L, H, D] activations).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .. import caches
from ..dispatch import core
from ..dispatch.mixed import implicit_replication
from ..dispatch.registry import call_default, strategy, torch_level
from ..dispatch.schema import CallSignature, OpSchema, static_key
from ..errors import ShardingError
from ..placements import Partial, Placement, Replicate, Shard, StridedShard, without_partials
from ..planner.choice import CHOICE_HOOKS, candidates
from ..planner.rows import Candidate, Row, row
from ..redistribute import redistribute_local
from ..spec import TensorMeta, TensorSpec, contiguous_stride
from ..tensor import DTensor, distribute_tensor
from ..wrapping import shard_in, spec_of, wrap
from ._shard_stats import ShardLine, grad_local, resolve_partials, shard_line
from .common import global_positions, mesh_dims_sharding
from .softmax import opmath_dtype

aten = torch.ops.aten
R = Replicate()
P_SUM = Partial("sum")
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
BATCH, HEADS, SEQ = 0, 1, 2  # dims of q/k/v [B, H, L, D] and of the logsumexp [B, H, L]

LABEL_LOCAL = "sharded attention: local"
LABEL_CONTEXT = "context-parallel attention: all_gather K and V once (packed)"
LABEL_CONTEXT_BACKWARD = "context-parallel attention backward: all_gather K and V, reduce_scatter dK and dV"


# ------------------------------------------------------------------ local math (plain tensors)


def _key_chunks(q_start: int, q_rows: int, keys: int, is_causal: bool) -> list[tuple[int, int, bool]]:
    """(first key, end key, causal) of the chunks query rows [a, a + q_rows) attend to."""
    if not is_causal:
        return [(0, keys, False)]
    a, b = min(q_start, keys), min(q_start + q_rows, keys)
    chunks = [(0, a, False), (a, b, True)]
    return [c for c in chunks if c[1] > c[0]]


def _mask_columns(mask: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    return None if mask is None else mask.narrow(-1, start, end - start)


def _sees_a_key(mask: torch.Tensor, causal: bool, lse_shape: Sequence[int]) -> torch.Tensor:
    """Per query row of a chunk: does it see any key? (The CPU kernel gives lse 0 to a row that sees none.)"""
    visible = mask > -math.inf
    if causal:
        rows, cols = visible.shape[-2:]
        visible = visible & torch.ones(rows, cols, dtype=torch.bool, device=mask.device).tril()
    return visible.any(-1).expand(lse_shape)


def _empty_forward(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # The CPU kernel dies (SIGFPE) on empty heads, queries or keys: an empty shard never reaches it.
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    return out, torch.zeros(q.shape[:-1], dtype=opmath_dtype(q.dtype), device=q.device)


def rows_forward(q, k, v, *, q_start: int, is_causal: bool, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) of query rows at global positions [q_start, ...) against all keys k, v."""
    if q.numel() == 0 or k.shape[SEQ] == 0 or q.shape[HEADS] == 0:
        return _empty_forward(q, v)
    chunks = _key_chunks(q_start, q.shape[SEQ], k.shape[SEQ], is_causal)
    results = []
    for start, end, causal in chunks:
        kc, vc = k.narrow(SEQ, start, end - start), v.narrow(SEQ, start, end - start)
        results.append(FLASH(q, kc, vc, 0.0, causal, attn_mask=_mask_columns(mask, start, end), scale=scale))
    if len(results) == 1:
        return results[0]
    lses = []
    for (start, end, causal), (_, lse) in zip(chunks, results):
        if mask is not None:  # a row the mask hides from the whole chunk: the kernel says lse 0, it means -inf
            columns = mask.narrow(-1, start, end - start)  # _mask_columns
            lse = torch.where(_sees_a_key(columns, causal, lse.shape), lse, -math.inf)
        lses.append(lse)
    lse = torch.logsumexp(torch.stack(lses), 0)
    finite = lse > -math.inf
    safe = torch.where(finite, lse, 0.0)
    out = sum(torch.exp(c - safe).unsqueeze(-1) * o.to(lse.dtype) for c, (o, _) in zip(lses, results))
    # rows that see no key at all: 0 and lse 0, as the kernel gives them
    return torch.where(finite.unsqueeze(-1), out, 0.0).to(q.dtype), torch.where(finite, lse, 0.0)


def rows_backward(grad, q, k, v, out, lse, *, q_start: int, is_causal: bool, mask, scale):
    """(dq, dk, dv) of rows_forward: dk/dv over all keys (the contribution of these query rows)."""
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    if q.numel() == 0 or k.shape[SEQ] == 0 or q.shape[HEADS] == 0:
        return torch.zeros_like(q), dk, dv
    dq: torch.Tensor | None = None
    grad, out, lse = grad.contiguous(), out.contiguous(), lse.contiguous()
    for start, end, causal in _key_chunks(q_start, q.shape[SEQ], k.shape[SEQ], is_causal):
        kc, vc = k.narrow(SEQ, start, end - start), v.narrow(SEQ, start, end - start)
        gq, gk, gv = FLASH_BACKWARD(
            grad, q, kc, vc, out, lse, 0.0, causal, attn_mask=_mask_columns(mask, start, end), scale=scale
        )
        dq = gq if dq is None else dq + gq
        dk.narrow(SEQ, start, end - start).copy_(gk)
        dv.narrow(SEQ, start, end - start).copy_(gv)
    assert dq is not None  # k.shape[SEQ] > 0: at least one key chunk
    return dq.contiguous(), dk, dv


# ------------------------------------------------------------------ layouts: heads, keys along the sequence


def _q_start(q_spec: TensorSpec) -> int:
    pos = global_positions(q_spec, SEQ)
    return pos[0] if len(pos) else q_spec.shape[SEQ]


def _kv_head_index(q_spec: TensorSpec, k_spec: TensorSpec) -> torch.Tensor | None:
    """GQA with q heads sharded and K/V heads whole: the K/V head each local q head uses (None: nothing to pick)."""
    hq, hk = q_spec.shape[HEADS], k_spec.shape[HEADS]
    if hq == hk or not mesh_dims_sharding(q_spec, HEADS) or mesh_dims_sharding(k_spec, HEADS):
        return None
    group = hq // hk
    return torch.tensor([h // group for h in global_positions(q_spec, HEADS)], dtype=torch.int64)


def _sizes_along(local: torch.Tensor, line: ShardLine) -> list[int]:
    """Element counts of every line member's piece (shaped like `local` but for the line's dim)."""
    per_position = math.prod(s for d, s in enumerate(local.shape) if d != line.dim)
    return [n * per_position for n in line.sizes]


def gather_keys(
    k: torch.Tensor, v: torch.Tensor, k_spec: TensorSpec
) -> tuple[torch.Tensor, torch.Tensor, ShardLine | None]:
    """K and V whole along the sequence: ONE all_gather of both (packed), uneven shards included."""
    line = shard_line(k_spec, SEQ)
    if not line.mesh_dims:
        return k, v, None
    nk, nv = _sizes_along(k, line), _sizes_along(v, line)
    mesh = k_spec.mesh
    packed = torch.cat([k.reshape(-1), v.reshape(-1).to(k.dtype)])
    parts = mesh.comm.all_gather(packed, mesh.group(line.mesh_dims), shapes=[(a + b,) for a, b in zip(nk, nv)])
    order = sorted(range(len(parts)), key=lambda m: line.starts[m])

    def piece(m: int, like: torch.Tensor, offset: int, count: int) -> torch.Tensor:
        shape = list(like.shape)
        shape[SEQ] = line.sizes[m]
        return parts[m][offset : offset + count].reshape(shape)

    k_full = torch.cat([piece(m, k, 0, nk[m]) for m in order], SEQ)
    v_full = torch.cat([piece(m, v, nk[m], nv[m]) for m in order], SEQ).to(v.dtype)
    return k_full, v_full, line


def scatter_key_grads(dk: torch.Tensor, dv: torch.Tensor, line: ShardLine) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's dK/dV contributions summed onto the keys' owners: ONE reduce_scatter of both (packed)."""
    chunks = []
    for m in range(len(line.starts)):
        start, size = line.starts[m], line.sizes[m]
        chunks.append(
            torch.cat([dk.narrow(SEQ, start, size).reshape(-1), dv.narrow(SEQ, start, size).reshape(-1).to(dk.dtype)])
        )
    mesh = line.spec.mesh
    mine = mesh.comm.reduce_scatter(chunks, "sum", mesh.group(line.mesh_dims))
    k_shape, v_shape = list(dk.shape), list(dv.shape)
    k_shape[SEQ] = v_shape[SEQ] = line.sizes[line.me]
    nk = math.prod(k_shape)
    return mine[:nk].reshape(k_shape), mine[nk:].reshape(v_shape).to(dv.dtype)


def _pick_heads(k: torch.Tensor, v: torch.Tensor, heads: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if heads is None:
        return k, v
    heads = heads.to(k.device)  # planned on the host from the layout (metadata, no read of data)
    return k.index_select(HEADS, heads), v.index_select(HEADS, heads)


def _sum_heads(
    dk: torch.Tensor, dv: torch.Tensor, heads: torch.Tensor | None, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of picked heads summed back onto the K/V heads (a Partial(sum) over the q-head shards)."""
    if heads is None:
        return dk, dv
    shape_k, shape_v = list(dk.shape), list(dv.shape)
    shape_k[HEADS] = shape_v[HEADS] = kv_heads
    heads = heads.to(dk.device)
    return dk.new_zeros(shape_k).index_add_(HEADS, heads, dk), dv.new_zeros(shape_v).index_add_(HEADS, heads, dv)


def _call_options(is_causal: bool, attn_mask, scale) -> dict[str, Any]:
    return {"is_causal": bool(is_causal), "mask": attn_mask, "scale": scale}


# ------------------------------------------------------------------ sharded algorithms of the aten ops


def _forward_sharded(ctx, q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    q_spec, k_spec = ctx.in_specs[0], ctx.in_specs[1]
    k, v, line = gather_keys(k, v, k_spec)
    heads = _kv_head_index(q_spec, k_spec)
    k, v = _pick_heads(k, v, heads)
    options = {"q_start": _q_start(q_spec), **_call_options(is_causal, attn_mask, scale)}
    out, lse = rows_forward(q, k, v, **options)
    keep = getattr(ctx, "keep", None)
    if keep is not None:  # `_Attention` keeps what its backward reuses (the gathered K/V above all)
        keep.update(k=k, v=v, line=line, heads=heads, options=options)
    return out, lse


def _backward_sharded(ctx, grad, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    q_spec, k_spec = ctx.in_specs[1], ctx.in_specs[2]
    kv_heads = k.shape[HEADS]
    k, v, line = gather_keys(k, v, k_spec)
    heads = _kv_head_index(q_spec, k_spec)
    k, v = _pick_heads(k, v, heads)
    dq, dk, dv = rows_backward(
        grad, q, k, v, out, lse, q_start=_q_start(q_spec), **_call_options(is_causal, attn_mask, scale)
    )
    dk, dv = _sum_heads(dk, dv, heads, kv_heads)
    if line is not None:
        dk, dv = scatter_key_grads(dk, dv, line)
    return dq, dk, dv


# ------------------------------------------------------------------ rules


def _mask_placement(mask: TensorSpec | None, score_dim: int) -> Placement | None:
    """The mask's placement for a row sharding score dim `score_dim` of [B, H, L, S] (None: no mask)."""
    if mask is None:
        return None
    d = score_dim - (4 - mask.ndim)
    return Shard(d) if d >= 0 and mask.shape[d] > 1 else R


def _gqa_head_dims(q: TensorSpec, k: TensorSpec) -> list[int]:
    """GQA (fewer K/V heads): the mesh dims that may shard q and K/V heads alike.

    Each rank's q heads must use exactly its own K/V heads: both counts split evenly over
    the product of every mesh dim that shards them (nested or not). Mesh dims where K/V
    heads are sharded now come first (the caller's layout), then the others in order,
    each kept while both counts still divide.
    """
    hq, hk = q.shape[HEADS], k.shape[HEADS]
    mesh_shape = q.mesh.shape
    current = [i for i, p in enumerate(k.placements) if p == Shard(HEADS)]
    chosen, product = [], 1
    for i in current + [i for i in range(len(mesh_shape)) if i not in current]:
        if hq % (product * mesh_shape[i]) == 0 and hk % (product * mesh_shape[i]) == 0:
            chosen.append(i)
            product *= mesh_shape[i]
    if not chosen:  # one mesh dim alone may still align uneven chunks (see _aligned_chunks)
        first = next(
            (i for i in current + list(range(len(mesh_shape))) if _aligned_chunks(hq, hk, mesh_shape[i])), None
        )
        chosen = [first] if first is not None else []
    return sorted(chosen)


def _aligned_chunks(hq: int, hk: int, n: int) -> bool:
    """Uneven head shards that still align (q 6, K/V 3 over 4 ranks: q 2,2,2,0 and K/V 1,1,1,0): torch.chunk's
    pieces of q are the group size times K/V's, so rank r's q heads use exactly its own K/V heads."""
    return n > 1 and hq % hk == 0 and -(-hq // n) == (hq // hk) * -(-hk // n)


def _shard_bytes(spec: TensorSpec, n: int) -> float:
    """Bytes of one rank's piece of `spec` sharded on its sequence over n ranks (other dims as they are now)."""
    others = math.prod(
        size
        for size, p in zip(spec.mesh.shape, spec.placements)
        if isinstance(p, (Shard, StridedShard)) and p.dim != SEQ
    )
    return spec.numel * spec.itemsize / max(others, 1) / n


def _applicable(schema: OpSchema, q: TensorSpec, k: TensorSpec, v: TensorSpec) -> bool:
    return (
        q.ndim == 4 and k.ndim == 4 and v.ndim == 4 and not schema.arg("dropout_p") and q.shape[BATCH] == k.shape[BATCH]
    )


def _attention_rows(schema: OpSchema, q, k, v, mask, backward: bool) -> list[Row]:
    """Rows of the forward (outputs out, lse) or the backward (outputs dq, dk, dv); inputs built by `inputs`."""

    def inputs(pq: Placement, pkv: Placement, score_dim: int) -> list[Placement]:
        pm = _mask_placement(mask, score_dim)
        tail = [pm] if pm is not None else []
        if backward:  # grad, q, k, v, out, lse
            return [pq, pq, pkv, pkv, pq, pq] + tail
        return [pq, pkv, pkv] + tail

    def outputs(pq: Placement, pkv: Placement) -> list[Placement]:
        return [pq, pkv, pkv] if backward else [pq, pq]

    def grad_of(pkv: Placement) -> Placement:
        return P_SUM if pkv.is_replicate() and backward else pkv

    algorithm = _backward_sharded if backward else _forward_sharded
    batch, heads, seq = Shard(BATCH), Shard(HEADS), Shard(SEQ)
    rows = [row(outputs(batch, batch), inputs(batch, batch, BATCH), algorithm, label=LABEL_LOCAL)]
    if q.shape[HEADS] == k.shape[HEADS]:
        rows.append(row(outputs(heads, heads), inputs(heads, heads, HEADS), algorithm, label=LABEL_LOCAL))
    else:  # GQA: K/V heads sharded alike on the mesh dims that keep the groups aligned, else replicated
        for i in _gqa_head_dims(q, k):
            rows.append(
                row(outputs(heads, heads), inputs(heads, heads, HEADS), algorithm, label=LABEL_LOCAL, mesh_dim=i)
            )
        rows.append(row(outputs(heads, grad_of(R)), inputs(heads, R, HEADS), algorithm, label=LABEL_LOCAL))
    rows.append(row(outputs(seq, grad_of(R)), inputs(seq, R, SEQ), algorithm, label=LABEL_LOCAL))
    rows += _context_rows(q, k, v, outputs(seq, seq), inputs(seq, seq, SEQ), algorithm, backward)
    return rows


def _context_rows(q, k, v, outs, ins, algorithm, backward: bool) -> list[Row]:
    """The context-parallel row, one per mesh dim: its collectives are priced with that dim's size."""
    rows = []
    for i, n in enumerate(k.mesh.shape):
        gathered = _shard_bytes(k, n) + _shard_bytes(v, n)
        comm = [("all_gather", gathered)]
        if backward:
            comm.append(("reduce_scatter", gathered * n))
        label = LABEL_CONTEXT_BACKWARD if backward else LABEL_CONTEXT
        rows.append(row(outs, ins, algorithm, comm=comm, label=label, mesh_dim=i))
    return rows


@strategy(FLASH, algorithms=[LABEL_LOCAL, LABEL_CONTEXT])
def _forward_rule(schema: OpSchema) -> list[Row]:
    q, k, v = schema.tensor_specs[:3]
    if not _applicable(schema, q, k, v):
        return []
    return _attention_rows(schema, q, k, v, schema.arg("attn_mask"), backward=False)


@strategy(FLASH_BACKWARD, algorithms=[LABEL_LOCAL, LABEL_CONTEXT_BACKWARD])
def _backward_rule(schema: OpSchema) -> list[Row]:
    q, k, v = schema.tensor_specs[1:4]
    if not _applicable(schema, q, k, v):
        return []
    return _attention_rows(schema, q, k, v, schema.arg("attn_mask"), backward=True)


# ------------------------------------------------------------------ F.scaled_dot_product_attention on DTensors


def _layout_of(x, placements) -> tuple[torch.Tensor, TensorSpec]:
    """This rank's piece of DTensor `x` in `placements`, and the spec it then has."""
    spec = spec_of(x).with_placements(placements)
    return shard_in(x, placements), spec


def _dense_order(shape: Sequence[int], stride: Sequence[int]) -> list[int] | None:
    """The dims from outermost to innermost where `stride` is a dense layout of `shape` (None: it is not)."""
    order = sorted(range(len(shape)), key=lambda d: stride[d], reverse=True)
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and stride[d] != expected:
            return None
        expected *= shape[d]
    return order


def _wrap(local: torch.Tensor, like: TensorSpec, placements: Sequence[Placement], dtype: torch.dtype | None = None):
    """`local` as a DTensor laid out in memory like `like` (dense in the same dim order, else contiguous).

    autograd copies a leaf's gradient whose strides differ from the leaf's (new_empty_strided +
    copy_); q/k/v are often transposed views of [B, L, H, D] activations, so their gradients
    keep the inputs' dim order, as torch's CPU flash backward gives them.
    """
    dtype = like.dtype if dtype is None else dtype
    order = _dense_order(like.shape, like.meta.stride)
    if order is None:
        stride, local = contiguous_stride(like.shape), local.contiguous()
    else:
        stride = like.meta.stride
        inverse = sorted(range(len(order)), key=order.__getitem__)
        local = local.permute(order).contiguous().permute(inverse)
    meta = TensorMeta(like.shape, tuple(stride), dtype)
    return wrap(local.to(dtype), TensorSpec(like.mesh, tuple(placements), meta))


def _grad_home(local: torch.Tensor, computed: Sequence[Placement], x_spec: TensorSpec):
    """An input's gradient: on mesh dims where the input is sharded, back in its own shards;
    where it is replicated, a pending Partial(sum) stays pending (as torch's DTensor does)."""
    target = tuple(
        mine if mine.is_shard() else (got if got.is_partial() else R) for mine, got in zip(x_spec.placements, computed)
    )
    spec = TensorSpec(
        x_spec.mesh, tuple(computed), TensorMeta(x_spec.shape, contiguous_stride(x_spec.shape), local.dtype)
    )
    if target != tuple(computed):
        local = redistribute_local(local.contiguous(), spec, target)
    return _wrap(local, x_spec, target, x_spec.dtype)


class _Attention(torch.autograd.Function):
    """Attention whose backward reuses the K/V gathered in forward (one all_gather, one reduce_scatter per step)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal: bool, scale, plan: tuple):
        layouts, algorithm = plan
        q_l, q_spec = _layout_of(q, layouts[0])
        k_l, k_spec = _layout_of(k, layouts[1])
        v_l, v_spec = _layout_of(v, layouts[2])
        m_l = shard_in(mask, layouts[3]) if mask is not None else None
        # the forward op's own algorithm (verify records and forces it there), keeping its gathered K/V
        run = core.AlgoContext(None, (q_spec, k_spec, v_spec), (), FLASH)  # type: ignore[arg-type]  # reads no schema
        kept: dict[str, Any] = {}
        run.keep = kept
        out, lse = (algorithm or _forward_sharded)(run, q_l, k_l, v_l, 0.0, is_causal, attn_mask=m_l, scale=scale)
        ctx.save_for_backward(q_l, kept["k"], kept["v"], out, lse)
        ctx.options, ctx.line, ctx.heads = kept["options"], kept["line"], kept["heads"]
        ctx.layouts, ctx.inputs = layouts, (spec_of(q), spec_of(k), spec_of(v))
        ctx.kv_heads = k.shape[HEADS]
        out_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
        ctx.out_spec = TensorSpec(q_spec.mesh, layouts[0], TensorMeta(out_shape, contiguous_stride(out_shape), q.dtype))
        return _wrap(out, ctx.out_spec, layouts[0])

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None,) * 7
        q_l, k_full, v_full, out, lse = ctx.saved_tensors
        g = grad_local(grad, ctx.out_spec, ctx.layouts[0]).to(out.dtype)
        dq, dk, dv = rows_backward(g, q_l, k_full, v_full, out, lse, **ctx.options)
        dq = _grad_home(dq, ctx.layouts[0], ctx.inputs[0]) if ctx.needs_input_grad[0] else None
        if not (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):  # frozen K/V: no reduce_scatter
            return dq, None, None, None, None, None, None
        dk, dv = _sum_heads(dk, dv, ctx.heads, ctx.kv_heads)
        if ctx.line is not None:
            dk, dv = scatter_key_grads(dk, dv, ctx.line)
        # K/V replicated where q is sharded: each rank holds its query rows' share of their gradient
        kv_grad = tuple(
            P_SUM if pkv.is_replicate() and pq.is_shard() else pkv for pkv, pq in zip(ctx.layouts[1], ctx.layouts[0])
        )
        return (
            dq,
            _grad_home(dk, kv_grad, ctx.inputs[1]),
            _grad_home(dv, kv_grad, ctx.inputs[2]),
            None,
            None,
            None,
            None,
        )


def _sdpa_call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *, enable_gqa=False): ...  # noqa: E704  (torch's form)


def _check_like_torch(b: dict[str, Any]) -> None:
    """torch's own validation of the call, run on meta tensors: bad input is refused before any data moves."""
    meta: dict[str, Any] = {
        n: torch.empty(b[n].shape, dtype=b[n].dtype, device="meta") for n in ("query", "key", "value")
    }
    mask = b["attn_mask"]
    if mask is not None:
        meta["attn_mask"] = torch.empty(mask.shape, dtype=mask.dtype, device="meta")
        # torch's CPU path takes a mask and is_causal together (both apply); its meta path refuses
        # the pair, so the mask's shape is checked without the causal flag
        meta["is_causal"] = False
    try:
        call_default(F.scaled_dot_product_attention, (), {**b, **meta})
    except (RuntimeError, ValueError) as e:
        shapes = [tuple(b[n].shape) for n in ("query", "key", "value")]
        raise ShardingError(f"scaled_dot_product_attention on {shapes}: torch refuses this call: {e}") from e


def _additive(mask, dtype: torch.dtype):
    """A bool mask as the additive one SDPA builds (0 where kept, -inf where masked)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(
        mask,
        torch.zeros((), dtype=dtype, device=mask.device),
        torch.full((), -math.inf, dtype=dtype, device=mask.device),
    )


def _served(b: dict[str, Any]) -> bool:
    """Calls `_Attention` serves: DTensor q, k, v of [B, H, L, D], no dropout, a mask that needs no gradient."""
    q, k, v, mask = b["query"], b["key"], b["value"], b["attn_mask"]
    if not all(isinstance(t, DTensor) for t in (q, k, v)) or b["dropout_p"]:
        return False
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.requires_grad):
        return False
    same = q.shape[BATCH] == k.shape[BATCH] == v.shape[BATCH] and k.shape[:3] == v.shape[:3]
    return q.ndim == k.ndim == v.ndim == 4 and same and (mask is None or mask.ndim in (2, 4))


def _resolved(x: DTensor) -> DTensor:
    """`x` with pending reductions resolved, through autograd (the gradient flows back to the pending input)."""
    target = without_partials(spec_of(x).placements)
    return x if target == spec_of(x).placements else x.redistribute(placements=target)


def _keeping_queries(decision: core.Decision) -> Candidate:
    """The cheapest candidate that leaves q's shards where they are.

    The query's layout is the caller's choice of parallelism (sequence/context, heads, batch)
    and the output inherits it: only K, V and the mask move. Without this the cost model,
    which prices bytes and not idle ranks, would all_to_all a long sequence onto a batch of 1.
    Where no row keeps q (e.g. q sharded on its head dim), the cheapest of all.
    """
    mine = decision.in_specs[0].placements

    def keeps_queries(c: Candidate) -> bool:
        return all(got == had for got, had in zip(c.inputs[0], mine) if had.is_shard())

    chosen = decision.candidate
    assert chosen is not None  # a decision that is not a fallback has its candidate
    if keeps_queries(chosen):
        return chosen
    out_shapes = [(m.shape, m.dtype.itemsize) for m in decision.out_metas]
    kept = candidates(_forward_rule(decision.schema), decision.in_specs, out_shapes, filter_fn=keeps_queries, limit=1)
    return kept[0] if kept else chosen


# (q, k, v, mask layouts and shapes, causal, scale, link model) -> (input layouts, algorithm)
_PLANS: dict[tuple, tuple] = {}
caches.register("attention plans", _PLANS.clear)


def _plan(
    q: DTensor, k: DTensor, v: DTensor, mask: DTensor | None, causal: bool, scale, b: dict[str, Any]
) -> tuple | None:
    """(input layouts, the forward op's algorithm) chosen from its rows; None: no rows apply (torch's path then).

    Cached like dispatch's decisions, except while verify's choice hooks steer the planner.
    """
    key = (
        spec_of(q).key,
        spec_of(k).key,
        spec_of(v).key,
        None if mask is None else spec_of(mask).key,
        causal,
        static_key(scale),
        caches.EPOCH[0],
    )
    plan = None if CHOICE_HOOKS else _PLANS.get(key)
    if plan is None:
        _check_like_torch(b)
        leaves, tree = core.flatten_args(
            (spec_of(q), spec_of(k), spec_of(v), 0.0, causal),
            {"attn_mask": None if mask is None else spec_of(mask), "scale": scale},
        )
        tensor_pos = [i for i, t in enumerate(leaves) if isinstance(t, TensorSpec)]
        decision = core.decide(FLASH, leaves, tree, tensor_pos)
        if decision.fallback:
            return None
        best = _keeping_queries(decision)
        plan = (tuple(best.inputs) + ((None,) if mask is None else ()), best.algorithm)
        if not CHOICE_HOOKS:
            _PLANS[key] = plan
    return plan


def _with_kernel_masks(entry):
    """Where the call is not ours (dropout, other ndims) torch's math path runs on the DTensors and
    builds its causal mask as a plain tensor from the shapes alone: the same on every rank, so taken
    as Replicate on purpose (a plain attn_mask is every rank's own copy there, as in _parse_sdpa)."""

    def sdpa(*args, **kwargs):
        with implicit_replication():
            return entry(*args, **kwargs)

    sdpa.not_ours = entry.not_ours
    return sdpa


# F.scaled_dot_product_attention is the C binding itself (one object, registered once)
@torch_level(
    F.scaled_dot_product_attention,
    signature=CallSignature(_sdpa_call),
    apply=_Attention.apply,
    around=_with_kernel_masks,
)
def _parse_sdpa(b: dict, args: tuple, kwargs: dict) -> tuple | None:
    """F.scaled_dot_product_attention on DTensors: (q, k, v, mask, is_causal, scale, layouts); None: torch's path."""
    if not _served(b):
        return None
    q, k, v = (_resolved(b[n]) for n in ("query", "key", "value"))
    mask = _additive(b["attn_mask"], q.dtype)
    if isinstance(mask, DTensor):  # a mask gets no gradient (torch's CPU flash kernel gives it none either)
        mask = resolve_partials(mask)
    elif mask is not None:  # a plain mask is every rank's own copy: Replicate
        mask = distribute_tensor(mask.detach(), spec_of(q).mesh, [R] * spec_of(q).mesh.ndim, src_data_rank=None)
    meshes = {spec_of(t).mesh for t in (q, k, v, mask) if t is not None}
    if len(meshes) > 1:
        raise ShardingError(
            "scaled_dot_product_attention: q, k, v (and attn_mask) live on different meshes "
            f"({sorted(map(str, meshes))}); redistribute them onto one mesh first (e.g. build them with the same "
            "DeviceMesh)."
        )
    causal, scale = bool(b["is_causal"]), b["scale"]
    plan = _plan(q, k, v, mask, causal, scale, b)
    return None if plan is None else (q, k, v, mask, causal, scale, plan)
