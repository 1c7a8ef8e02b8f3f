"""Random ops: every layout draws the same global tensor (counter-based, see rng.py).

Each rank computes only the elements its shard holds, keyed by their global index,
so no rank draws more than its shard and no collective runs (0 bytes). Rows for
one mesh dim (every row, Replicate included, runs the counter-based draw: torch's
generator is shared by the rank threads and would make replicas diverge):

    in-place fills (uniform_, normal_, bernoulli_, random_, exponential_ ...):
        S(d) -> S(d), _S(d,k) -> _S(d,k), R -> R (self keeps its layout)
    like-factories and bernoulli.p (self lends only its shape):
        the same, plus P(op) -> R (a fresh draw is the whole value)
    bernoulli_.Tensor / bernoulli (p is a tensor): p follows self's shards
    native_dropout(x):   (out, mask): S(d) -> (S(d), S(d)); R -> (R, R);
                         P(sum|avg) -> (P, R): a mask the same on every rank
                         passes through a pending sum

An in-place fill replaces every value, so a pending (Partial) self needs no
resolution: the entries below relabel it Replicate before the draw (0 bytes).
nn.init.trunc_normal_ (a rejection loop reading .item() every round in torch)
gets a one-pass inverse-CDF draw on DTensors. orthogonal_ works as torch's (its
normal_ draw is replicated and layout-invariant, its QR runs replicated); sparse_
is refused on DTensors (its torch.randperm has no layout-invariant version).
Other seeded ops (multinomial, poisson, ...) refuse rather than let each rank draw
its own values.

What reaches dispatch (traced on torch 2.13 CPU): F.dropout / nn.Dropout ->
empty_like, bernoulli_.float(1 - p), div_, mul (native_dropout only on other
paths); F.dropout2d -> new_empty (a Replicate mask per channel) and the same;
nn.init.uniform_ / xavier_uniform_ / kaiming_uniform_ -> uniform_; normal_ /
xavier_normal_ / kaiming_normal_ -> normal_; constant_ / ones_ -> fill_;
zeros_ -> zero_; torch.rand_like -> rand_like; torch.bernoulli(p) -> bernoulli.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from .. import rng
from .._torch import random as torch_random
from ..dispatch import core
from ..dispatch.registry import call_default, overwrites_self, strategy, torch_level
from ..dispatch.schema import CallSignature, OpSchema
from ..errors import ShardingError
from ..placements import Partial, Replicate, Shard, StridedShard, without_partials
from ..planner.rows import Row, row
from ..wrapping import local_of, relabel, spec_of
from .pointwise import _shard_rows

aten = torch.ops.aten
R = Replicate()
LINEAR_PARTIALS = (Partial("sum"), Partial("avg"))


# ------------------------------------------------------------------ drawing


def _draw(ctx, out: torch.Tensor, transform, out_index: int = 0) -> torch.Tensor:
    """Fill `out` (this rank's piece of output `out_index`) with the next draw."""
    spec = ctx.out_specs[out_index]
    mesh = spec.mesh
    generator = ctx.schema.arg("generator")
    if generator is None:
        rng.sync_with_first_rank(mesh)
    key = rng.next_key(generator)
    if core._state["debug"]:
        _check_same_key(ctx, key)
    return rng.fill(out, spec.shape, mesh.shape, mesh.get_coordinate(), spec.placements, key, transform)


def _check_same_key(ctx, key: int) -> None:
    """SHARDOPS_DEBUG=1: every rank draws with the same key (same seed and draw count), uncounted like debug.py."""
    mesh = ctx.out_specs[0].mesh
    group = mesh.group(tuple(range(mesh.ndim)))
    if group.size == 1:
        return
    mine = torch.tensor([rng._signed(key)], dtype=torch.int64)
    for rank, theirs in zip(group.ranks, mesh.comm._all_gather(mine, group, [(1,)] * group.size)):
        if not torch.equal(theirs, mine):
            raise ShardingError(
                f"{ctx.schema.name}: rank {mesh.get_rank()} and rank {rank} draw with different random keys, so their "
                "values would not fit together. Call torch.manual_seed(s) with the same s on every rank (a per-rank "
                "seed, e.g. seed + rank, is for plain-tensor draws only), and issue the same random ops on every rank."
            )


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _uniform(low: float, high: float, dtype: torch.dtype):
    def transform(bits, j0, j1):
        return rng.uniform_closed_open(bits, dtype).mul_(high - low).add_(low)

    return transform


def _normal(mean: float, std: float, dtype: torch.dtype):
    """Box-Muller on two 32-bit uniforms per element (one 64-bit draw)."""
    work = _work_dtype(dtype)

    def transform(bits, j0, j1):
        u1, u2 = rng.two_uniforms(bits, work)
        return u1.log_().mul_(-2.0).sqrt_().mul_(u2.mul_(2 * math.pi).cos_()).mul_(std).add_(mean)

    return transform


def _keep_below(p: float):
    """True with probability p: the top 32 bits below round(p * 2^32) (exact to 2^-33)."""
    threshold = round(min(max(p, 0.0), 1.0) * 2.0**32)

    def transform(bits, j0, j1):
        return rng.high_bits(bits, 32) < threshold

    return transform


def _below_tensor(p_flat: torch.Tensor):
    """True where a 53-bit uniform is below p (p: this rank's probabilities, flat)."""

    def transform(bits, j0, j1):
        return rng.uniform_closed_open(bits, torch.float64) < p_flat[j0:j1]

    return transform


def _integers(low: int, span: int):
    """Integers in [low, low + span): 63 random bits modulo span (bias below span / 2^63)."""

    def transform(bits, j0, j1):
        bits.bitwise_and_((1 << 63) - 1)
        if span < 1 << 63:
            bits.remainder_(span)
        return bits.add_(low)

    return transform


def _open_uniform(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(0, 1) exclusive at both ends: (k + 1/2) / 2^n."""
    n = 53 if dtype == torch.float64 else 24
    return rng.high_bits(bits, n).to(_work_dtype(dtype)).add_(0.5).mul_(2.0**-n)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return (t if t.is_contiguous() else t.contiguous()).view(-1)


# ------------------------------------------------------------------ rules


def _layouts_of(schema: OpSchema) -> list:
    """Shard(d) for every dim, and the StridedShards self already has."""
    spec = schema.self_spec
    strided = sorted({p for p in spec.placements if isinstance(p, StridedShard)}, key=repr)
    return [Shard(d) for d in range(spec.ndim)] + strided


def fill_rule(algorithm: Callable, n_out: int = 1, pending_out: bool = False) -> Callable[[OpSchema], list[Row]]:
    """Self's values are not read: every layout draws in place; a pending self gives Replicate if `pending_out`."""

    def rule(schema: OpSchema) -> list[Row]:
        rows = [row([p] * n_out, p, algorithm) for p in _layouts_of(schema)]
        rows.append(row([R] * n_out, R, algorithm))  # explicit: the implicit replicate row would use torch's generator
        if pending_out:
            partials = {p for p in schema.self_spec.placements if p.is_partial()}
            rows += [row([R] * n_out, p, algorithm) for p in sorted(partials, key=repr)]
        return rows

    return rule


def probability_rule(algorithm: Callable) -> Callable[[OpSchema], list[Row]]:
    """bernoulli_.Tensor(self, p): p (broadcast to self) follows self's shards; a pending p is resolved."""

    def rule(schema: OpSchema) -> list[Row]:
        self_spec, p_spec = schema.tensor_specs
        lead = self_spec.ndim - p_spec.ndim
        rows = []
        for layout in _layouts_of(schema):
            k = layout.dim - lead
            aligned = k >= 0 and p_spec.shape[k] == self_spec.shape[layout.dim]
            p_layout = (
                (StridedShard(k, layout.split_factor) if isinstance(layout, StridedShard) else Shard(k))
                if aligned
                else R
            )
            rows.append(row(layout, [layout, p_layout], algorithm))
        return rows + [row(R, [R, R], algorithm)]

    return rule


def _functional(fill_in_place: Callable) -> Callable:
    """uniform(self), random(self) ...: the in-place draw on a fresh tensor of self's shape."""

    def algorithm(ctx, self, *args, **kwargs):
        return fill_in_place(
            ctx, torch.empty(self.shape, dtype=ctx.out_specs[0].dtype, device=self.device), *args, **kwargs
        )

    return algorithm


def fills(*ops: Any, functional: Sequence[Any] = (), pending_out: bool = False) -> Callable[[Callable], Callable]:
    """Decorator over a draw algorithm (ctx, self, ...): `ops` run it on every layout (fill_rule).

    In-place ops (pending_out False) overwrite every value of self: a pending self is relabelled,
    never resolved (registry.overwrites_self; CPU F.dropout on a Partial x reaches bernoulli_ on
    empty_like(x), a Partial tensor of uninitialised memory). `functional`: the out-of-place twins (functionalised
    graphs use them), the same draw into a fresh tensor.
    """

    def register_fill(algorithm: Callable) -> Callable:
        strategy(*ops)(fill_rule(algorithm, pending_out=pending_out))
        if not pending_out:
            overwrites_self(*ops)
        if functional:
            strategy(*functional)(fill_rule(_functional(algorithm), pending_out=True))
        return algorithm

    return register_fill


# ------------------------------------------------------------------ algorithms (ctx, local args...)


@fills(aten.uniform_.default, functional=[aten.uniform.default])
def _uniform_(ctx, self, *args, **kwargs):
    return _draw(ctx, self, _uniform(ctx.schema.arg("from", 0.0), ctx.schema.arg("to", 1.0), self.dtype))


@fills(aten.normal_.default, functional=[aten.normal_functional.default])
def _normal_(ctx, self, *args, **kwargs):
    return _draw(ctx, self, _normal(ctx.schema.arg("mean", 0.0), ctx.schema.arg("std", 1.0), self.dtype))


@fills(aten.exponential_.default, functional=[aten.exponential.default])
def _exponential_(ctx, self, *args, **kwargs):
    lambd = ctx.schema.arg("lambd", 1.0)
    return _draw(ctx, self, lambda bits, j0, j1: rng.uniform_open_closed(bits, self.dtype).log_().div_(-lambd))


@fills(aten.geometric_.default, functional=[aten.geometric.default])
def _geometric_(ctx, self, *args, **kwargs):
    log_q = math.log1p(-ctx.schema.arg("p"))
    return _draw(ctx, self, lambda bits, j0, j1: _open_uniform(bits, self.dtype).log_().div_(log_q).ceil_())


@fills(aten.log_normal_.default, functional=[aten.log_normal.default])
def _log_normal_(ctx, self, *args, **kwargs):
    normal = _normal(ctx.schema.arg("mean", 1.0), ctx.schema.arg("std", 2.0), self.dtype)
    return _draw(ctx, self, lambda bits, j0, j1: normal(bits, j0, j1).exp_())


@fills(aten.cauchy_.default, functional=[aten.cauchy.default])
def _cauchy_(ctx, self, *args, **kwargs):
    median, sigma = ctx.schema.arg("median", 0.0), ctx.schema.arg("sigma", 1.0)
    return _draw(
        ctx,
        self,
        lambda bits, j0, j1: _open_uniform(bits, self.dtype).sub_(0.5).mul_(math.pi).tan_().mul_(sigma).add_(median),
    )


@fills(aten.bernoulli_.float)
def _bernoulli_float_(ctx, self, *args, **kwargs):
    return _draw(ctx, self, _keep_below(ctx.schema.arg("p", 0.5)))


def _bernoulli_tensor_(ctx, self, p, *args, **kwargs):
    return _draw(ctx, self, _below_tensor(_flat(p.expand_as(self))))  # compared per chunk, in float64


strategy(aten.bernoulli_.Tensor)(probability_rule(_bernoulli_tensor_))
strategy(aten.bernoulli.Tensor)(probability_rule(_functional(_bernoulli_tensor_)))
overwrites_self(aten.bernoulli_.Tensor)


def _bernoulli(ctx, p, *args, **kwargs):
    return _bernoulli_tensor_(ctx, torch.empty_like(p, memory_format=torch.contiguous_format), p)


@strategy(aten.bernoulli.default)
def _probabilities_rule(schema: OpSchema) -> list[Row]:
    """bernoulli(p): the output has p's shape and layout."""
    return [row(p, p, _bernoulli) for p in _layouts_of(schema)] + [row(R, R, _bernoulli)]


@fills(aten.bernoulli.p, pending_out=True)
def _bernoulli_p(ctx, self, *args, **kwargs):
    return _draw(ctx, torch.empty_like(self, memory_format=torch.contiguous_format), _keep_below(ctx.schema.arg("p")))


def _random_range(op, dtype: torch.dtype, schema: OpSchema) -> tuple[int, int]:
    """(low, span) of random_ / randint_like, as torch defines them."""
    if dtype.is_floating_point:
        top = 2 ** (1 - round(math.log2(torch.finfo(dtype).eps)))  # every integer up to 2^digits is exact
    elif dtype == torch.bool:
        top = 1
    else:
        top = torch.iinfo(dtype).max
    if op._overloadname == "default" and op._schema.name in ("aten::random_", "aten::random"):
        return 0, top + 1
    low = schema.arg("from", schema.arg("low", 0)) or 0
    high = schema.arg("to", schema.arg("high"))
    return low, (top + 1 - low) if high is None else high - low


@fills(
    aten.random_.default,
    aten.random_.to,
    getattr(aten.random_, "from"),
    functional=[aten.random.default, aten.random.to, getattr(aten.random, "from")],
)
def _random_(ctx, self, *args, **kwargs):
    return _draw(ctx, self, _integers(*_random_range(ctx.func, self.dtype, ctx.schema)))


@fills(aten.rand_like.default, aten.rand_like.generator, pending_out=True)
def _rand_like(ctx, self, *args, **kwargs):
    out = _empty_out(ctx, self)
    return _draw(ctx, out, _uniform(0.0, 1.0, out.dtype))


@fills(aten.randn_like.default, aten.randn_like.generator, pending_out=True)
def _randn_like(ctx, self, *args, **kwargs):
    out = _empty_out(ctx, self)
    return _draw(ctx, out, _normal(0.0, 1.0, out.dtype))


@fills(
    aten.randint_like.default,
    aten.randint_like.low_dtype,
    aten.randint_like.generator,
    aten.randint_like.low_generator_dtype,
    pending_out=True,
)
def _randint_like(ctx, self, *args, **kwargs):
    out = _empty_out(ctx, self)
    return _draw(ctx, out, _integers(*_random_range(ctx.func, out.dtype, ctx.schema)))


def _normal_tensors(ctx, *args, **kwargs):
    """normal(mean, std) with a tensor mean and/or std: mean + std * z, z drawn on the output's layout."""
    tensors = [a for a in args + tuple(kwargs.values()) if isinstance(a, torch.Tensor)]
    out = torch.empty(ctx.out_specs[0].local_shape(), dtype=ctx.out_specs[0].dtype, device=tensors[0].device)
    _draw(ctx, out, _normal(0.0, 1.0, out.dtype))
    mean, std = ctx.schema.arg("mean"), ctx.schema.arg("std", 1.0)
    local = iter(tensors)
    mean = next(local) if not isinstance(mean, (int, float)) else mean
    std = next(local) if not isinstance(std, (int, float)) else std
    return out.mul_(std).add_(mean)


@strategy(aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor)
def _normal_tensors_rule(schema: OpSchema) -> list[Row]:
    """normal(mean, std) with tensor operands: pointwise rows (operands follow the output's shards)."""
    rows = [row(r.outputs, r.inputs, _normal_tensors) for r in _shard_rows(schema)]
    return rows + [row(R, [R] * len(schema.tensor_specs), _normal_tensors)]


def _empty_out(ctx, self: torch.Tensor) -> torch.Tensor:
    return torch.empty(self.shape, dtype=ctx.out_specs[0].dtype, device=self.device)


def _native_dropout(ctx, x, *args, **kwargs):
    p, train = ctx.schema.arg("p"), ctx.schema.arg("train")
    mask = torch.empty(x.shape, dtype=torch.bool, device=x.device)
    if train is False:  # torch: the input and an all-true mask, no draw
        return x.clone(), mask.fill_(True)
    _draw(ctx, mask, _keep_below(1.0 - p), out_index=1)
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return x * mask * scale, mask


@strategy(aten.native_dropout.default)
def _dropout_rule(schema: OpSchema) -> list[Row]:
    rows = fill_rule(_native_dropout, n_out=2)(schema)
    return rows + [row([p, R], p, _native_dropout) for p in LINEAR_PARTIALS]


@strategy(
    aten.multinomial.default,
    aten.poisson.default,
    aten.binomial.default,
    aten._standard_gamma.default,
    aten._sample_dirichlet.default,
    aten.rrelu_with_noise.default,
    aten.rrelu_with_noise_.default,
    aten.rrelu_with_noise_functional.default,
    aten.randint_like.Tensor,
    aten.randint_like.Tensor_generator,
)
def _refuse_rule(schema: OpSchema) -> list[Row]:
    raise ShardingError(
        f"{schema.name} on {list(schema.tensor_specs)}: this random op has no layout-invariant version in shardops, "
        "and running torch's would draw different values on each rank (the ranks share or diverge from torch's "
        "generator). Call it on dt.full_tensor() (every rank the same seed and generator state) and distribute the "
        "result."
    )


# ------------------------------------------------------------------ torch-level entries


def _relabel_pending(t) -> None:
    """A fill replaces every value: a pending self becomes Replicate without resolving (0 bytes)."""
    from ..tensor import DTensor, refuse_pending_alias

    if isinstance(t, DTensor) and any(p.is_partial() for p in t.placements):
        refuse_pending_alias("a fill", t)  # a view or base still pending would keep P over the filled values
        relabel(t, spec_of(t).with_placements(without_partials(t.placements)))


def _fill_call(tensor, *args, **kwargs): ...  # noqa: E704  (every fill: the tensor first)


def _relabel_then_fill(func: Callable, b: dict, args: tuple, kwargs: dict) -> tuple:
    _relabel_pending(b["tensor"])
    return func, args, kwargs


def _trunc_normal_over(original: Callable) -> Callable:
    def trunc_normal_(tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0, generator=None):
        """nn.init.trunc_normal_: on a DTensor one inverse-CDF pass (0 bytes); otherwise torch's."""
        from ..tensor import DTensor

        if not isinstance(tensor, DTensor):
            return original(tensor, mean, std, a, b, generator=generator)
        return _dtensor_trunc_normal_(tensor, mean, std, a, b, generator)

    return trunc_normal_


def _dtensor_trunc_normal_(tensor, mean: float, std: float, a: float, b: float, generator) -> Any:
    if mean < a - 2 * std or mean > b + 2 * std:
        warnings.warn(
            "mean is more than 2 std from [a, b] in nn.init.trunc_normal_. The distribution of values may be "
            "incorrect.",
            stacklevel=3,
        )
    _relabel_pending(tensor)
    cdf = lambda x: (1.0 + math.erf((x - mean) / (std * math.sqrt(2.0)))) / 2.0  # noqa: E731
    lo, hi = cdf(a), cdf(b)

    def transform(bits, j0, j1):
        u = rng.uniform_closed_open(bits, torch.float64).mul_(hi - lo).add_(lo)
        return u.mul_(2).sub_(1).erfinv_().mul_(std * math.sqrt(2.0)).add_(mean).clamp_(a, b)

    spec = spec_of(tensor)
    if generator is None:
        rng.sync_with_first_rank(spec.mesh)
    with torch.no_grad():
        rng.fill(
            local_of(tensor),
            spec.shape,
            spec.mesh.shape,
            spec.mesh.own_coordinate(),
            spec.placements,
            rng.next_key(generator),
            transform,
        )
    return tensor


def _sparse_over(original: Callable) -> Callable:
    def sparse_(tensor, sparsity, std=0.01, generator=None):
        """nn.init.sparse_: refused on a DTensor (torch.randperm from torch's generator would differ per rank)."""
        from ..tensor import DTensor

        if isinstance(tensor, DTensor):
            raise ShardingError(
                f"nn.init.sparse_ on a DTensor {spec_of(tensor)!r}: it picks its zeros with torch.randperm, which "
                "draws from torch's generator and has no layout-invariant version; initialise a plain tensor on every "
                "rank (same seed) and distribute_tensor it."
            )
        return original(tensor, sparsity, std, generator=generator)

    return sparse_


# torch-level entries (verify skips them with the random aten ops: their values are not torch's)
RANDOM_ENTRIES: set[Callable[..., Any]] = {
    getattr(torch.Tensor, m)
    for m in ("uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_", "log_normal_", "cauchy_")
}
RANDOM_ENTRIES |= {
    torch.nn.init.uniform_,
    torch.nn.init.normal_,
    torch.nn.init.kaiming_uniform_,
    torch.nn.init.constant_,
}  # these enter __torch_function__ themselves
# nn.init.zeros_/ones_/constant_ reach zero_/fill_: they overwrite too, so a pending self needs no resolution
overwrites_self(aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default)
for _entry in RANDOM_ENTRIES | {
    torch.Tensor.zero_,
    torch.Tensor.fill_,
}:  # each parse knows its callable: apply re-calls it
    torch_level(_entry, signature=CallSignature(_fill_call, aliases={"self": "tensor"}), apply=call_default)(
        partial(_relabel_then_fill, _entry)  # type: ignore[arg-type]  # torch's stubs type these methods as `function`
    )
# torch's have no __torch_function__ entry to hook: shardops._torch.install() replaces them
torch_random.replace_init_function("trunc_normal_", _trunc_normal_over)
torch_random.replace_init_function("sparse_", _sparse_over)
