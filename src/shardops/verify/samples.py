"""Sample inputs for `shardops verify`: which arguments each registered op gets.

One table, `SAMPLES`, maps op-name patterns to sample generators; the first
match wins. A pattern is a regular expression matched against the op's packet
name (`sum`) or, when it contains a dot, against `packet.overload`
(`max.other`). A pointwise-tagged op (`torch.Tag.pointwise`) with no entry gets
the schema-driven pointwise generator. An op matched by nothing is reported by
verify as "no samples" -- never skipped silently.

A generator is called as `gen(op, dtype, g, k)` for sample number k and
returns a `Sample` (full single-device tensors as leaves) or None. Most entries
are a `Profile`: the schema-driven synthesiser reads the op's aten schema and
fills each argument from `ARG_RULES` (by argument name) or by type, so one
profile serves every overload of an op family (sum.default, sum.dim_IntList,
...). Float tensors hold values on a dyadic grid (see `grid`), so that verify
can split them exactly into Partial pieces.

To give a new op samples: add a row to `SAMPLES` (a Profile with the right
shapes, or a small generator function for ops whose arguments must agree with
each other, like view sizes).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._torch.dispatch import OpOverload, OpOverloadPacket
from ..comm.base import reduce_stack
from ..placements import NormPartial, Placement, as_partial

aten = torch.ops.aten

DEFAULT = object()  # an option meaning "leave this argument at its default"


@dataclass
class Sample:
    """One call: full tensors as leaves of args/kwargs."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    label: str = ""
    check_values: bool = True  # False: random or uninitialised outputs (rand_like, empty_like)
    tie_dim: int | None = None  # sort/topk & co: index outputs are checked by the values they pick along this dim
    tie_outputs: tuple[int, ...] = ()  # which outputs are such indices


@dataclass
class Ctx:
    """What the synthesiser knows while filling one sample's arguments."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    g: torch.Generator
    k: int
    tensors: int = 0

    @property
    def positive(self) -> bool:
        return self.k % 2 == 1

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def main(self, shape=None) -> torch.Tensor:
        return make_tensor(shape if shape is not None else self.shape, self.dtype, self.g, self.positive)

    def partner(self, shape=None, positive=None) -> torch.Tensor:
        """A second operand: non-zero integers (no division/shift surprises), floats of either sign."""
        shape = shape if shape is not None else self.shape
        if not self.dtype.is_floating_point and self.dtype not in (torch.bool, torch.complex64, torch.complex128):
            return torch.randint(1, 5, shape, generator=self.g).to(self.dtype)
        return make_tensor(shape, self.dtype, self.g, self.positive if positive is None else positive)


# ------------------------------------------------------------------ tensors on a grid


def grid(dtype: torch.dtype) -> float:
    """Spacing of float sample values: coarse enough that sums of a few Partial pieces are exact in `dtype`."""
    return 0.25 if dtype in (torch.bfloat16, torch.float16) else 2.0**-10


def value_bound(dtype: torch.dtype) -> float:
    return 4.0 if dtype in (torch.bfloat16, torch.float16) else 8.0


def quantize(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    step = grid(dtype)
    return (torch.round(t.double() / step) * step + 0.0).to(dtype)  # + 0.0: no -0.0 in samples


def make_tensor(shape, dtype: torch.dtype, g: torch.Generator, positive: bool = False) -> torch.Tensor:
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        real = torch.float32 if dtype == torch.complex64 else torch.float64
        return torch.complex(make_tensor(shape, real, g, positive), make_tensor(shape, real, g, positive))
    if not dtype.is_floating_point:
        low = 1 if positive else -6
        return torch.randint(low, 7, shape, generator=g).to(dtype)
    bound = value_bound(dtype)
    if positive:
        raw = torch.rand(shape, generator=g, dtype=torch.float64) * (bound / 2) + grid(dtype)
    else:
        raw = (torch.randn(shape, generator=g, dtype=torch.float64) * bound / 4).clamp(-bound, bound)
    return quantize(raw, dtype)


def class_targets(n_rows: int, n_classes: int, g: torch.Generator, ignore_index: int | None = None) -> torch.Tensor:
    t = torch.randint(0, n_classes, (n_rows,), generator=g)
    if ignore_index is not None and 0 <= ignore_index < n_classes and n_rows > 1:
        t[0] = ignore_index
    return t


def distinct_indices(shape, dim: int, size: int, g: torch.Generator) -> torch.Tensor:
    """int64 indices in [0, size) along `dim`, no repeats along it (scatter stays deterministic)."""
    shape = list(shape)
    full = list(shape)
    full[dim] = size
    perm = torch.rand(full, generator=g).argsort(dim)
    return perm.narrow(dim, 0, shape[dim])


# ------------------------------------------------------------------ pieces of pending (Partial) inputs
#
#   P(sum)      rank k holds x*w_k + noise_k (dyadic weights of both signs, noise summing to 0)
#   P(avg)      rank k holds x + noise_k (noise summing to 0)
#   P(max/min)  per element one rank holds x, the others strictly smaller/larger values
#   P(product)  per element one rank holds x / (product of the others), the others hold +-2^e
#   NormP(2)    rank k holds |x| * sqrt(w_k), w_k > 0 summing to 1
#
# On the sample grid these splits are exact in every dtype (NormP up to one rounding).


def _grid_noise(shape, dtype, g, scale: float) -> torch.Tensor:
    return quantize(torch.randn(shape, generator=g, dtype=torch.float64) * scale, dtype).double()


def split_pending(x: torch.Tensor, p: Placement, m: int, g: torch.Generator) -> list[torch.Tensor]:
    """m pieces whose `p`-reduction is x (exactly, for values on the sample grid)."""
    if isinstance(p, NormPartial):
        w = torch.rand((m,) + tuple(x.shape), generator=g, dtype=torch.float64) + 0.1
        w = w / w.sum(0)
        return [(x.double().abs() * w[k].sqrt()).to(x.dtype) for k in range(m)]
    kind = as_partial(p).reduce_op
    if kind in ("max", "min"):
        return _split_extreme(x, kind, m, g)
    if kind == "product":
        return _split_product(x, m, g)
    if kind == "avg":
        noise = [_grid_noise(x.shape, x.dtype, g, 0.5) for _ in range(m - 1)]
        noise.append(-sum(noise, torch.zeros((), dtype=torch.float64)))
        return [(x.double() + n).to(x.dtype) for n in noise]
    return _split_sum(x, m, g)


def _split_sum(x: torch.Tensor, m: int, g: torch.Generator) -> list[torch.Tensor]:
    exact = not x.is_floating_point()
    weights = [2, -1, 1, -2, 0, 3, -3] if exact else [0.5, -0.25, 0.75, -0.5, 0.25, 1.0, -0.125]
    pieces = []
    for k in range(m - 1):
        if exact:
            noise = torch.randint(-3, 4, x.shape, generator=g)
            pieces.append(x * weights[k % len(weights)] + noise.to(x.dtype))
        else:
            pieces.append(
                quantize(x.double() * weights[k % len(weights)] + _grid_noise(x.shape, x.dtype, g, 0.5), x.dtype)
            )
    if exact:
        pieces.append(x - sum(pieces) if pieces else x.clone())
    else:  # exact too: every value sits on the sample grid
        pieces.append((x.double() - sum(p.double() for p in pieces)).to(x.dtype))
    return pieces


def _split_extreme(x: torch.Tensor, kind: str, m: int, g: torch.Generator) -> list[torch.Tensor]:
    owner = torch.randint(0, m, x.shape, generator=g)
    sign = -1 if kind == "max" else 1
    pieces = []
    for k in range(m):
        if x.dtype == torch.bool:
            other = torch.full_like(x, kind == "min")
        elif x.is_floating_point():
            delta = quantize(torch.rand(x.shape, generator=g, dtype=torch.float64) * 1.5 + 0.25, x.dtype).double()
            other = (x.double() + sign * delta).to(x.dtype)
        else:
            other = x + sign * torch.randint(1, 4, x.shape, generator=g).to(x.dtype)
        pieces.append(torch.where(owner == k, x, other))
    return pieces


def _split_product(x: torch.Tensor, m: int, g: torch.Generator) -> list[torch.Tensor]:
    choices = torch.tensor([0.5, -0.5, 2.0, -2.0, -1.0, 4.0] if x.is_floating_point() else [1, -1], dtype=torch.float64)
    factors = choices[torch.randint(0, len(choices), (m,) + tuple(x.shape), generator=g)]
    owner = torch.randint(0, m, x.shape, generator=g)
    factors.scatter_(0, owner.unsqueeze(0), 1.0)
    mine = x.double() / factors.prod(0)  # exact: the factors are signed powers of two
    return [torch.where(owner == k, mine, factors[k]).to(x.dtype) for k in range(m)]


def resolve_pending(pieces: Sequence[torch.Tensor], p: Placement) -> torch.Tensor:
    """The value the pieces stand for, computed as the runtime's all_reduce computes it."""
    if isinstance(p, NormPartial):
        return reduce_stack([q * q for q in pieces], "sum").sqrt()
    return reduce_stack(list(pieces), as_partial(p).reduce_op)


# ------------------------------------------------------------------ argument rules (by name)


def _opt(options: Sequence[Any]) -> Callable[[Ctx, Any], Any]:
    return lambda ctx, arg: options[ctx.k % len(options)]


def _dims(ctx: Ctx, arg) -> Any:
    nd = ctx.ndim
    if str(arg.type).startswith(("List", "Optional[List")):
        opts: list[list[int] | None] = [[nd - 1], [0], sorted({0, nd - 1})]
        if str(arg.type).startswith("Optional"):
            opts.append(None)
        return opts[ctx.k % len(opts)]
    return [nd - 1, 0, min(1, nd - 1)][ctx.k % 3] if nd else 0


def _scalar(ctx: Ctx, arg) -> Any:
    if ctx.dtype == torch.bool:
        return True
    if not ctx.dtype.is_floating_point and not ctx.dtype.is_complex:
        return 2
    return [0.75, -1.5, 2.0][ctx.k % 3]


def _normalized_shape(ctx: Ctx, arg) -> list[int]:
    return list(ctx.shape[-2:]) if ctx.k % 2 and ctx.ndim > 2 else [ctx.shape[-1]]


def _norm_param(ctx: Ctx, arg) -> torch.Tensor | None:
    """weight/bias of layer_norm-like ops: the normalized shape."""
    return ctx.partner(tuple(_normalized_shape(ctx, arg)))


def _class_target(ctx: Ctx) -> torch.Tensor:
    """Class indices for nll/cross-entropy (one row target is the ignored class when ignore_index=1)."""
    return class_targets(ctx.shape[0], ctx.shape[1], ctx.g, ignore_index=1 if ctx.k % 2 else None)


def _class_weight(ctx: Ctx) -> torch.Tensor | None:
    return ctx.partner((ctx.shape[1],), positive=True) if ctx.k % 3 != 2 else None


def _rounding_mode(ctx: Ctx, arg) -> Any:
    return ["trunc", "floor", None][ctx.k % 3]


ARG_RULES: dict[str, Callable[[Ctx, Any], Any]] = {
    "dim": _dims,
    "keepdim": _opt([False, True]),
    "correction": _opt([1, 0, 2]),
    "unbiased": _opt([True, False]),
    "ord": _opt([2, 1, math.inf, 0, -math.inf, 3]),
    "k": _opt([2, 1, 3]),
    "largest": _opt([True, False]),
    "descending": _opt([False, True]),
    "sorted": _opt([True]),
    "stable": _opt([True, False]),
    "half_to_float": _opt([False]),
    "input_dtype": lambda ctx, arg: ctx.dtype,
    "dtype": lambda ctx, arg: ctx.dtype if ctx.dtype.is_floating_point else torch.float64,  # only when required
    "bins": _opt([5, 3]),
    "reduction": _opt([1, 0, 2]),
    "ignore_index": _opt([-100, 1]),
    "label_smoothing": _opt([0.0, 0.1]),
    "eps": _opt([1e-5]),
    "normalized_shape": _normalized_shape,
    "total_weight": lambda ctx, arg: torch.tensor(3.0, dtype=ctx.dtype),
    "generator": lambda ctx, arg: None,
    "n": _opt([2, 1]),
    "p": _opt([1]),
    "decimals": _opt([1, 2]),
    "rounding_mode": _rounding_mode,
    "scale": _opt([2.0]),
    "split_size": _opt([2, 3]),
    "chunks": _opt([3, 2]),
    "index": _opt([1, -1]),
    "start": _opt([1, 0]),
    "end": _opt([5, 2]),
    "step": _opt([2, 1]),
    "length": _opt([2, 1]),
    "dim0": _opt([0, 0]),
    "dim1": _opt([-1, 1]),
    "diagonal": _opt([0, 1, -1]),
    "offset": _opt([0, 1, -1]),
    "UPLO": _opt(["L", "U"]),
    "mode": _opt(["reduced"]),
    "full_matrices": _opt([False]),
    "compute_uv": _opt([True]),
    "compute_v": _opt([True]),
    "some": _opt([True]),
    "output_mask": lambda ctx, arg: [True, True, True],
    "scalars": lambda ctx, arg: [0.5, 2.0] if ctx.dtype.is_floating_point else [2, 3],
    "min": _opt([-1, 0, -2]),
    "max": _opt([2, 3, 1]),
    "fill_value": _scalar,
    "value": _scalar,
    "other": _scalar,  # only reached for Scalar-typed `other` (tensors are handled by type first)
    "size": lambda ctx, arg: [3, 4],
}


# ------------------------------------------------------------------ the schema-driven synthesiser


@dataclass(frozen=True)
class Profile:
    """How to fill an op's arguments: main tensor shapes, which defaulted args to set, partner shapes."""

    shapes: tuple[tuple[int, ...], ...] = ((8, 6), (5, 3), (2, 4, 5))
    vary: frozenset = frozenset()  # defaulted arguments to fill anyway (by name)
    broadcast: bool = False  # other tensor operands take broadcastable shapes
    optional_tensors: bool = False  # fill Optional[Tensor] arguments that default to None
    tensor_rules: tuple = ()  # (arg name, fn(ctx) -> tensor or None) overrides for tensor arguments
    norm_params: bool = False  # weight/bias have the normalized shape (layer_norm & co)
    check_values: bool = True
    tie_dim: bool = False  # indices output checked by gathering along the op's dim

    def __call__(self, op, dtype: torch.dtype, g: torch.Generator, k: int) -> Sample | None:
        return synthesise(op, self, Ctx(self.shapes[k % len(self.shapes)], dtype, g, k))


def _is_tensor_type(t: str) -> bool:
    return t in ("Tensor", "Optional[Tensor]")


def _partner_shape(ctx: Ctx, profile: Profile) -> tuple[int, ...]:
    if not profile.broadcast or ctx.tensors == 0:
        return ctx.shape
    variants = [ctx.shape, ctx.shape[1:], ctx.shape[:-1] + (1,)]
    return variants[(ctx.k + ctx.tensors) % len(variants)]


def _tensor_arg(ctx: Ctx, arg, profile: Profile) -> torch.Tensor:
    rules = dict(profile.tensor_rules)
    if arg.name in rules:
        t = rules[arg.name](ctx)
    elif arg.name in ("condition", "mask"):
        t = torch.rand(_partner_shape(ctx, profile), generator=ctx.g) > 0.5
    elif arg.name == "total_weight":
        t = ARG_RULES["total_weight"](ctx, arg)
    elif arg.name in ("weight", "bias") and profile.norm_params:
        t = _norm_param(ctx, arg)
    elif ctx.tensors == 0:
        t = ctx.main()
    else:
        t = ctx.partner(_partner_shape(ctx, profile))
    ctx.tensors += 1
    return t


def _value(arg, ctx: Ctx, profile: Profile) -> Any:
    t = str(arg.type)
    if _is_tensor_type(t):
        if (
            t.startswith("Optional")
            and arg.has_default_value()
            and not profile.optional_tensors
            and arg.name not in profile.vary
        ):
            return None
        return _tensor_arg(ctx, arg, profile)
    if t == "List[Tensor]" or t == "List[Optional[Tensor]]":
        # foreach lists: two tensors, of different shapes in odd samples (same shapes for cat/stack)
        second = ctx.shape[1:] if ctx.k % 2 and arg.name != "tensors" and ctx.ndim > 1 else ctx.shape
        return [ctx.main(ctx.shape), ctx.main(second)]
    rule = ARG_RULES.get(arg.name)
    if rule is not None:
        return rule(ctx, arg)
    if t in ("number", "Optional[number]"):
        return _scalar(ctx, arg)
    if t == "int":
        return 1
    if t == "float":
        return 0.5
    if t == "bool":
        return False
    if t.startswith("Optional"):
        return None
    raise _NoSample(f"no rule for argument {arg.name}: {t}")


class _NoSample(Exception):
    pass


def synthesise(op, profile: Profile, ctx: Ctx) -> Sample | None:
    """Fill every required argument (and the `vary` ones) of an aten overload."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    skipped: list[Any] = []  # defaults of positional args left out, filled in if a later one is set
    try:
        for arg in op._schema.arguments:
            fill = not arg.has_default_value() or arg.name in profile.vary
            fill = fill or (profile.optional_tensors and str(arg.type) == "Optional[Tensor]")
            value = _value(arg, ctx, profile) if fill else DEFAULT
            if value is DEFAULT:
                if not arg.kwarg_only:
                    skipped.append(arg.default_value)
                continue
            if arg.kwarg_only:
                kwargs[arg.name] = value
            else:
                args.extend(skipped)
                skipped.clear()
                args.append(value)
    except _NoSample:
        return None
    tie: int | None = None
    outputs: tuple[int, ...] = ()
    if profile.tie_dim:
        bound = dict(zip([a.name for a in op._schema.arguments], args)) | kwargs
        tie = bound.get("dim", -1) if isinstance(bound.get("dim", -1), int) else -1
        names = [r.name for r in op._schema.returns]
        outputs = tuple(i for i, n in enumerate(names) if n == "indices") or (
            (0,) if packet_name(op) == "argsort" else ()
        )
    return Sample(tuple(args), kwargs, check_values=profile.check_values, tie_dim=tie, tie_outputs=outputs)


# ------------------------------------------------------------------ generators for ops whose args must agree


def _pairs(pairs):
    """A generator over fixed (input shape, extra positional args) pairs."""

    def gen(op, dtype, g, k):
        shape, extra = pairs[k % len(pairs)]
        ctx = Ctx(shape, dtype, g, k)
        return Sample((ctx.main(),) + tuple(extra))

    return gen


VIEW_PAIRS = [
    ((8, 6), ([48],)),
    ((2, 4, 5), ([8, 5],)),
    ((2, 4, 5), ([2, 20],)),
    ((5, 3), ([-1],)),
    ((8, 6), ([4, 2, 6],)),
]
EXPAND_PAIRS = [((6, 1), ([6, 4],)), ((5,), ([3, 5],)), ((1, 3), ([2, 4, 3],))]
PERMUTE_PAIRS = [((2, 4, 5), ([2, 0, 1],)), ((8, 6), ([1, 0],)), ((2, 4, 5), ([1, 2, 0],))]
SPLIT_SIZES_PAIRS = [((8, 6), ([3, 3], 1)), ((5, 3), ([1, 4], 0)), ((2, 4, 5), ([2, 0, 3], -1))]
NEW_SIZE_PAIRS = [((8, 6), ([3, 4],)), ((5, 3), ([7],))]
SCALAR_SHAPES = ((1,), ())


def _to_copy(op, dtype, g, k):
    ctx = Ctx(((8, 6), (5, 3))[k % 2], dtype, g, k)
    target = [torch.float64, torch.float32, torch.int64][k % 3]
    return Sample((ctx.main(),), {"dtype": target})


def _new_factory(op, dtype, g, k):
    shape, (size,) = NEW_SIZE_PAIRS[k % len(NEW_SIZE_PAIRS)]
    ctx = Ctx(shape, dtype, g, k)
    fill = (_scalar(ctx, None),) if packet_name(op) == "new_full" else ()
    return Sample((ctx.main(), size) + fill, check_values=packet_name(op) != "new_empty")


def _view_as_real(op, dtype, g, k):
    if dtype not in (torch.float32, torch.float64):
        return None
    cdtype = torch.complex64 if dtype == torch.float32 else torch.complex128
    return Sample((make_tensor(((8, 6), (5, 3))[k % 2], cdtype, g),))


def _layer_norm_backward(op, dtype, g, k):
    """native_layer_norm_backward needs mean/rstd that match its input: take them from the forward."""
    shape = ((8, 6), (2, 4, 5))[k % 2]
    ctx = Ctx(shape, dtype, g, k)
    x, grad = ctx.main(), ctx.partner()
    norm = list(shape[-1:])
    w, b = ctx.partner(tuple(norm)), ctx.partner(tuple(norm))
    _, mean, rstd = torch.native_layer_norm(x, norm, w, b, 1e-5)
    return Sample((grad, x, norm, mean, rstd, w, b, [True, True, True]))


def _nll_loss2d(op, dtype, g, k):
    """nll_loss2d: input (N, C, H, W), target (N, H, W)."""
    shape = ((2, 4, 3, 5), (3, 2, 4, 2))[k % 2]
    ctx = Ctx(shape, dtype, g, k)
    target = torch.randint(0, shape[1], (shape[0],) + shape[2:], generator=g)
    ignore = [-100, 1][k % 2]
    if ignore == 1:
        target.view(-1)[0] = 1
    return Sample((ctx.main(), target, _class_weight(ctx), [1, 0, 2][k % 3], ignore))


def _nll_loss_backward(forward):
    """nll_loss(2d)_backward's grad_output and total_weight must match a forward: take them from it."""

    def gen(op, dtype, g, k):
        fwd = (CLASS_LOSS if forward is aten.nll_loss_forward.default else _nll_loss2d)(forward, dtype, g, k)
        if fwd is None or not dtype.is_floating_point:
            return None
        out, total_weight = forward(*fwd.args)
        x, target, weight, reduction, ignore_index = fwd.args
        return Sample((make_tensor(out.shape, dtype, g), x, target, weight, reduction, ignore_index, total_weight))

    return gen


def _fused_rms_norm_backward(op, dtype, g, k):
    """_fused_rms_norm_backward needs the forward's rstd."""
    shape = ((8, 6), (2, 4, 5))[k % 2]
    ctx = Ctx(shape, dtype, g, k)
    x, grad = ctx.main(), ctx.partner()
    norm = _normalized_shape(ctx, None)
    w = ctx.partner(tuple(norm))
    _, rstd = aten._fused_rms_norm.default(x, norm, w, 1e-5)
    return Sample((grad, x, norm, rstd, w, [True, True]))


def _diagonal_backward(op, dtype, g, k):
    """diagonal_backward(grad, input_sizes, offset, dim1, dim2): grad has the diagonal's shape."""
    sizes, offset, d1, d2 = [([5, 5], 0, 0, 1), ([2, 4, 4], 1, 1, 2), ([6, 4], -1, 0, 1)][k % 3]
    diag = torch.empty(sizes).diagonal(offset, d1, d2)
    return Sample((make_tensor(diag.shape, dtype, g), sizes, offset, d1, d2))


def _gather_like(op, dtype, g, k):
    """gather/scatter/index_select: int64 indices that stay in range and never repeat along dim."""
    shape = ((8, 6), (5, 3))[k % 2]
    dim = k % 2
    ctx = Ctx(shape, dtype, g, k)
    x = ctx.main()
    name = op._schema.name.split("::")[-1]
    if name == "index_select":
        return Sample((x, dim, torch.randperm(shape[dim], generator=g)[:2]))
    idx_shape = list(shape)
    idx_shape[dim] = min(2, shape[dim])
    index = distinct_indices(idx_shape, dim, shape[dim], g)
    if name in ("gather", "take_along_dim"):
        return Sample((x, dim, index) if name == "gather" else (x, index, dim))
    overload = op._overloadname
    if "value" in overload:
        return Sample((x, dim, index, 1.5 if dtype.is_floating_point else 2))
    return Sample((x, dim, index, ctx.partner(tuple(idx_shape))))


def _symmetric(profile: Profile):
    """eigh & co need symmetric input."""

    def gen(op, dtype, g, k):
        s = profile(op, dtype, g, k)
        if s is None or not s.args or not isinstance(s.args[0], torch.Tensor) or not s.args[0].is_floating_point():
            return s
        a = s.args[0]
        return Sample((a + a.mT,) + s.args[1:], s.kwargs)

    return gen


def _histc(op, dtype, g, k):
    """histc with bounds (local histograms) and without (min == max: the data's range, one round first)."""
    ctx = Ctx(((8, 6), (5, 3), (2, 4, 5))[k % 3], dtype, g, k)
    lo, hi = ((0.0, 0.0), (-1.0, 2.0), (0.0, 0.0))[k % 3]
    return Sample((ctx.main(), (5, 3, 4)[k % 3], lo, hi))


def _aten_tensor_list(op, dtype, g, k):
    """aten.cat(tensors, dim) / aten.stack(tensors, dim)."""
    return _tensor_list_call(op if packet_name(op) != "stack" else _named("stack"), dtype, g, k)


def _named(name: str):
    return type("Named", (), {"__name__": name})()


def _solve_triangular(op, dtype, g, k):
    """linalg_solve_triangular(A, B, *, upper): a well-conditioned triangular A."""
    n = (5, 4)[k % 2]
    a = make_tensor((n, n), dtype, g) * 0.1 + torch.eye(n, dtype=dtype) * 4 if dtype.is_floating_point else None
    if a is None:
        return None
    upper = bool(k % 2)
    a = a.triu() if upper else a.tril()
    return Sample((a, make_tensor((n, 3), dtype, g)), {"upper": upper})


def _matmul(op, dtype, g, k):
    """mm/bmm/addmm/matmul-like: shapes chosen by argument name."""
    m, kk, n, b = (6, 5, 4, 2) if k % 2 == 0 else (5, 3, 2, 3)
    shapes = {
        "self": (m, kk),
        "mat1": (m, kk),
        "mat2": (kk, n),
        "mat": (m, kk),
        "vec": (kk,),
        "other": (kk, n),
        "input": (m, kk),
        "weight": (n, kk),
        "bias": (n,),
        "tensor": (kk,),
    }
    name = op._schema.name.split("::")[-1]
    if name in ("bmm", "baddbmm"):
        shapes |= {"self": (b, m, kk), "mat2": (b, kk, n), "batch1": (b, m, kk), "batch2": (b, kk, n)}
    if name in ("addmm", "addmv", "baddbmm"):
        shapes["self"] = (m,) if name == "addmv" else (n,)
    if name == "dot":
        shapes["self"] = (kk,)
    ctx = Ctx((m, kk), dtype, g, k)
    args = []
    for arg in op._schema.arguments:
        if arg.has_default_value() or arg.kwarg_only:
            continue
        if arg.name not in shapes:
            return None
        args.append(ctx.main(shapes[arg.name]))
    return Sample(tuple(args))


# ------------------------------------------------------------------ the table

REDUCTION = Profile(
    vary=frozenset({"dim", "keepdim", "correction", "unbiased", "ord", "descending", "largest", "stable"})
)
SORTING = Profile(vary=frozenset({"dim", "keepdim", "descending", "largest", "stable"}), tie_dim=True)
SCAN = Profile(vary=frozenset({"dim"}))
SOFTMAX = Profile()
BACKWARD = Profile()  # grad_output, output, dim, ... all the same shape
CLASS_LOSS = Profile(
    shapes=((8, 6), (5, 3)),
    vary=frozenset({"reduction", "ignore_index", "label_smoothing", "weight"}),
    tensor_rules=(("target", _class_target), ("weight", _class_weight)),
)
VALUE_LOSS = Profile(shapes=((8, 6), (5, 3)), vary=frozenset({"reduction"}))
NORMALIZATION = Profile(shapes=((8, 6), (2, 4, 5)), norm_params=True, optional_tensors=True)
SQUEEZE = Profile(shapes=((6, 1, 5), (1, 4), (5, 1)), vary=frozenset({"dim"}))
VIEWLIKE = Profile(
    vary=frozenset({"dim", "start", "end", "step"})
)  # select/slice/narrow/split/unbind/chunk/unsqueeze/transpose
LINALG = Profile(shapes=((5, 5), (2, 4, 4), (6, 4)))
LIKE = Profile(shapes=((8, 6), (5, 3)))
FILL_WITH_TENSOR = Profile(
    shapes=((8, 6), (5, 3)), tensor_rules=(("value", lambda ctx: ctx.partner(())),)
)  # x[...] = 1.5
RANDOM_LIKE = Profile(shapes=((8, 6), (5, 3)), check_values=False)
HISTOGRAM = Profile(shapes=((8, 6), (5, 3)), vary=frozenset({"bins", "min", "max"}))
FOREACH = Profile(shapes=((5, 5), (2, 4)))
POINTWISE = Profile(broadcast=True, optional_tensors=True, vary=frozenset({"min", "max"}))
MASKED = Profile(broadcast=True, tensor_rules=(("value", lambda ctx: ctx.partner(())),))
SCALAR_OUT = Profile(shapes=SCALAR_SHAPES)

SAMPLES: list[tuple[str, Callable[..., Sample | None]]] = [
    # pointwise ops registered without the pointwise tag
    (r"where|masked_fill", MASKED),
    # views and shape ops
    (r"view|_unsafe_view|reshape", _pairs(VIEW_PAIRS)),
    (r"expand", _pairs(EXPAND_PAIRS)),
    (r"permute", _pairs(PERMUTE_PAIRS)),
    (r"split_with_sizes", _pairs(SPLIT_SIZES_PAIRS)),
    (r"squeeze", SQUEEZE),
    (r"unsqueeze|select|slice|narrow|split|unbind|chunk|transpose|t|flip|roll", VIEWLIKE),
    (r"new_(zeros|ones|empty|full)", _new_factory),
    (r"fill\.Tensor", FILL_WITH_TENSOR),
    (r"(zeros|ones|full)_like|clone|detach|alias|contiguous|fill|positive", LIKE),
    (r"(empty|rand|randn)_like|native_dropout", RANDOM_LIKE),
    (r"_to_copy", _to_copy),
    (r"view_as_real", _view_as_real),
    (r"_local_scalar_dense", SCALAR_OUT),
    # reductions, scans, moments, norms
    (
        r"sum|nansum|mean|nanmean|prod|amax|amin|aminmax|argmax|argmin|any|all|count_nonzero|logsumexp|special_logsumexp",
        REDUCTION,
    ),
    (r"(max|min)\.(default|dim|unary_out)", REDUCTION),
    (r"var|std|var_mean|std_mean", REDUCTION),
    (r"norm|linalg_vector_norm|_foreach_norm|frobenius_norm|dist", REDUCTION),
    (r"cumsum|cumprod|logcumsumexp|cummax|cummin|_cummax_helper|_cummin_helper", SCAN),
    # softmax and its backwards
    (r"_softmax|_log_softmax|_safe_softmax|softmax|log_softmax", SOFTMAX),
    (r"_softmax_backward_data|_log_softmax_backward_data", BACKWARD),
    # losses
    (r"nll_loss_backward", _nll_loss_backward(aten.nll_loss_forward.default)),
    (r"nll_loss2d_backward", _nll_loss_backward(aten.nll_loss2d_forward.default)),
    (r"nll_loss2d_forward", _nll_loss2d),
    (r"nll_loss|nll_loss_forward|nll_loss_nd|cross_entropy_loss", CLASS_LOSS),
    (r"mse_loss|l1_loss|smooth_l1_loss|huber_loss|binary_cross_entropy|kl_div", VALUE_LOSS),
    # normalisation
    (r"native_layer_norm_backward", _layer_norm_backward),
    (r"_fused_rms_norm_backward", _fused_rms_norm_backward),
    (r"native_layer_norm|layer_norm|rms_norm|_fused_rms_norm", NORMALIZATION),
    # sorting and selection
    (r"sort|argsort|msort|topk|kthvalue|median|nanmedian|mode", SORTING),
    # gather/scatter (backwards of max.dim/topk)
    (r"gather|scatter|scatter_add|scatter_reduce|index_select|take_along_dim", _gather_like),
    # histograms
    (r"histc", _histc),
    (r"bincount", HISTOGRAM),
    # linalg (replicate fallback in the design)
    (r"_linalg_eigh|linalg_eigh|linalg_eigvalsh|eigh", _symmetric(LINALG)),
    (r"diagonal_backward", _diagonal_backward),
    (r"linalg_solve_triangular", _solve_triangular),
    (
        r"svd|_linalg_svd|linalg_svd|linalg_qr|qr|diag|diagonal|diagonal_copy|diag_embed|tril|triu|linalg_\w+|_linalg_\w+",
        LINALG,
    ),
    (r"mm|bmm|addmm|addmv|baddbmm|matmul|mv|dot|linear", _matmul),
    (r"_foreach_\w+", FOREACH),
    (r"stack|cat|concat|concatenate|hstack|vstack", _aten_tensor_list),
]


def packet_name(op) -> str:
    return op._schema.name.split("::")[-1]


def generator_for(op) -> Callable[..., Sample | None] | None:
    """The sample generator for an aten overload: first table match, else pointwise by tag, else None."""
    packet = packet_name(op)
    qualified = f"{packet}.{op._overloadname}"
    for pattern, gen in SAMPLES:
        if re.fullmatch(pattern, qualified if "\\." in pattern else packet):
            return gen
    if torch.Tag.pointwise in op.tags:
        return POINTWISE
    return None


# ------------------------------------------------------------------ torch-level callables (registry.TORCH_FUNCTIONS)


def _cross_entropy(fn, dtype, g, k):
    ctx = Ctx(((8, 6), (5, 3))[k % 2], dtype, g, k)
    ignore = [-100, 1][k % 2]
    return Sample(
        (ctx.main(), class_targets(ctx.shape[0], ctx.shape[1], g, ignore)),
        {"ignore_index": ignore, "reduction": ["mean", "sum", "none"][k % 3]},
    )


def _layer_norm(fn, dtype, g, k):
    ctx = Ctx(((8, 6), (2, 4, 5))[k % 2], dtype, g, k)
    norm = _normalized_shape(ctx, None)
    w = ctx.partner(tuple(norm))
    if fn.__name__ == "rms_norm":
        return Sample((ctx.main(), norm, w), {"eps": 1e-5})
    return Sample((ctx.main(), norm, w, ctx.partner(tuple(norm))), {"eps": 1e-5})


def _dim_call(fn, dtype, g, k):
    ctx = Ctx(((8, 6), (5, 3), (2, 4, 5))[k % 3], dtype, g, k)
    return Sample((ctx.main(),), {"dim": [ctx.ndim - 1, 0, 1][k % 3]})


def _tensor_list_call(fn, dtype, g, k):
    """cat/stack & co: a list of tensors that agree except along dim."""
    shape, dim = [((8, 6), 0), ((5, 3), 1), ((2, 4, 5), -1)][k % 3]
    ctx = Ctx(shape, dtype, g, k)
    if getattr(fn, "__name__", "") in ("stack", "hstack", "vstack", "dstack"):
        return Sample(([ctx.main(), ctx.main()],), {} if getattr(fn, "__name__", "") != "stack" else {"dim": dim})
    other = list(shape)
    other[dim] = 2
    return Sample(([ctx.main(), ctx.main(tuple(other))], dim))


TORCH_SAMPLES: dict[str, Callable[..., Sample | None]] = {
    "cat": _tensor_list_call,
    "concat": _tensor_list_call,
    "concatenate": _tensor_list_call,
    "stack": _tensor_list_call,
    "hstack": _tensor_list_call,
    "vstack": _tensor_list_call,
    "cross_entropy": _cross_entropy,
    "nll_loss": _cross_entropy,
    "layer_norm": _layer_norm,
    "rms_norm": _layer_norm,
    "softmax": _dim_call,
    "log_softmax": _dim_call,
    "cumsum": _dim_call,
    "cumprod": _dim_call,
    "logcumsumexp": _dim_call,
    "cummax": _dim_call,
    "cummin": _dim_call,
}


# ------------------------------------------------------------------ references torch has no CPU kernel for


def _rms_norm_backward_reference(grad, x, normalized_shape, rstd, weight, output_mask):
    """d_input, d_weight of y = x * rstd * weight, in the op's dtype (computed in float64)."""
    dims = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    g, xd, r = grad.double(), x.double(), rstd.double()
    gw = g * weight.double() if weight is not None else g
    d_in = r * (gw - xd * r * r * (gw * xd).mean(dims, keepdim=True))
    d_w = (g * xd * r).sum(tuple(range(x.ndim - len(normalized_shape)))) if weight is not None else None
    return d_in.to(x.dtype), (d_w.to(weight.dtype) if d_w is not None else None)


REFERENCES: dict[str, Callable[..., Any]] = {
    "_fused_rms_norm_backward.default": _rms_norm_backward_reference,
}


def reference_for(op) -> Callable[..., Any] | None:
    """A single-device reference for ops torch cannot run on CPU (None: call the op itself)."""
    return REFERENCES.get(f"{packet_name(op)}.{op._overloadname}") if isinstance(op, OpOverload) else None


def torch_generator(fn) -> Callable[..., Sample | None] | None:
    """Samples for a torch-level callable: its own table entry, else those of the aten op of that name."""
    name = getattr(fn, "__name__", "")
    if name in TORCH_SAMPLES:
        return TORCH_SAMPLES[name]
    packet = getattr(aten, name, None)
    if not isinstance(packet, OpOverloadPacket):
        return None
    overloads = [getattr(packet, o) for o in packet.overloads()]
    gens = [(op, generator_for(op)) for op in overloads if generator_for(op) is not None and not _is_out(op)]
    if not gens:
        return None

    def gen(fn_, dtype, g, k):
        op, inner = gens[k % len(gens)]
        return inner(op, dtype, g, k // len(gens))

    return gen


def _is_out(op) -> bool:
    return any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


# ------------------------------------------------------------------ attention (ops/attention.py)


def _attention_call(op, dtype, g, k):
    """q, k, v [B, H, L, D] for the CPU flash op, its backward, and F.scaled_dot_product_attention:
    plain, causal, an additive mask (with causal too), GQA, lengths that split unevenly."""
    b, h, lq, lk, d = ((2, 4, 6, 6, 4), (3, 2, 5, 7, 3))[k % 2]
    kv_heads = h // 2 if k % 3 == 2 else h
    ctx = Ctx((b, h, lq, d), dtype, g, k)
    q, key, value = ctx.main(), ctx.partner((b, kv_heads, lk, d)), ctx.partner((b, kv_heads, lk, d))
    kwargs = {"is_causal": k % 2 == 0, "attn_mask": ctx.partner((lq, lk)) if k % 3 == 1 else None}
    names = {a.name for a in op._schema.arguments}
    if kv_heads != h and "enable_gqa" in names:
        kwargs["enable_gqa"] = True
    if packet_name(op).endswith("_backward"):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, key, value, 0.0, kwargs["is_causal"], attn_mask=kwargs["attn_mask"]
        )
        return Sample((ctx.partner(out.shape), q, key, value, out, lse, 0.0, kwargs.pop("is_causal")), kwargs)
    return Sample((q, key, value), kwargs)


SAMPLES.insert(
    0, (r"_scaled_dot_product_flash_attention_for_cpu(_backward)?|scaled_dot_product_attention", _attention_call)
)


# ------------------------------------------------------------------ matrix products, embeddings, their views
#
# Views between products: merge a (possibly uneven) sequence dim with the batch, split
# heads out of a hidden dim, and back; the exact layouts include StridedShard.
MATRIX_VIEW_PAIRS = [
    ((3, 4, 5), ([12, 5],)),
    ((12, 5), ([3, 4, 5],)),
    ((2, 3, 8), ([2, 3, 2, 4],)),
    ((2, 3, 2, 4), ([6, 8],)),
]


def _embedding(op, dtype, g, k):
    if not dtype.is_floating_point:
        return None
    vocab, hidden, ids_shape = ((10, 6, (3, 5)), (7, 4, (6,)))[k % 2]
    weight = make_tensor((vocab, hidden), dtype, g)
    ids = torch.randint(0, vocab, ids_shape, generator=g)
    return Sample((weight, ids), {"padding_idx": [-1, 2][k % 2]})


def _embedding_dense_backward(op, dtype, g, k):
    if not dtype.is_floating_point:
        return None
    vocab, hidden, ids_shape = ((10, 6, (3, 5)), (7, 4, (6,)))[k % 2]
    ids = torch.randint(0, vocab, ids_shape, generator=g)
    grad = make_tensor(ids_shape + (hidden,), dtype, g)
    return Sample((grad, ids, vocab, [-1, 2][k % 2], bool(k % 3 == 2)))


def _new_empty_strided(op, dtype, g, k):
    shape = ((8, 6), (5, 3))[k % 2]
    size, stride = ((list(shape), [1, shape[0]]), ([4, 3], [3, 1]))[k % 2]
    return Sample((make_tensor(shape, dtype, g), size, stride), check_values=False)


SAMPLES[:0] = [
    (r"view|_unsafe_view|reshape", _pairs(VIEW_PAIRS + MATRIX_VIEW_PAIRS)),
    (r"embedding", _embedding),
    (r"embedding_dense_backward", _embedding_dense_backward),
    (r"new_empty_strided", _new_empty_strided),
]


# ------------------------------------------------------------------ indexing, padding, complex views


def _index_family(op, dtype, g, k):
    """slice/select backwards, constant_pad_nd, repeat, index.Tensor, index_put, index_add."""
    shape = ((8, 6), (5, 3))[k % 2]
    dim = k % 2
    ctx = Ctx(shape, dtype, g, k)
    x = ctx.main()
    name, n = packet_name(op), shape[dim]
    idx = torch.randperm(n, generator=g)[: min(3, n)]
    if name == "slice_backward":
        start, end, step = [(1, n, 2), (0, 2, 1), (-3, None, 1)][k % 3]
        return Sample(
            (
                x[(slice(None),) * dim + (slice(start, end, step),)].clone(),
                list(shape),
                dim,
                start,
                end if end is not None else 2**62,
                step,
            )
        )
    if name == "select_backward":
        return Sample((x.select(dim, -1).clone(), list(shape), dim, -1))
    if name == "constant_pad_nd":
        return Sample(
            (x, [[1, 2], [0, 1, 2, 0], [-1, 1]][k % 3], [0.0, 1.5, 0.0][k % 3] if dtype.is_floating_point else 0)
        )
    if name == "repeat":
        return Sample((x, [[1, 2], [2, 1], [2, 1, 1]][k % 3]))
    if name == "index":
        return Sample((x, [None, idx] if dim else [idx]))
    if name in ("index_put", "_index_put_impl"):
        values = ctx.partner((len(idx),) + tuple(shape[1:]))
        return Sample((x, [torch.randperm(shape[0], generator=g)[: len(idx)]], values, bool(k % 2)))
    if name == "index_add":
        source = ctx.partner(tuple(len(idx) if d == dim else s for d, s in enumerate(shape)))
        return Sample((x, dim, idx, source))
    return None


def _complex_input(op, dtype, g, k):
    """_conj, _neg_view, resolve_*, view_as_complex: complex (or real pairs) inputs of the sample's precision."""
    if dtype not in (torch.float32, torch.float64):
        return None
    shape = ((8, 6), (5, 3))[k % 2]
    if packet_name(op) == "view_as_complex":
        return Sample((make_tensor(shape + (2,), dtype, g),))
    cdtype = torch.complex64 if dtype == torch.float32 else torch.complex128
    z = make_tensor(shape, cdtype, g)
    return Sample((z.conj() if packet_name(op) == "resolve_conj" else z,))


def _reorder(op, dtype, g, k):
    """flip(dims) / roll(shifts, dims), and scatter_reduce (which needs a reduce)."""
    ctx = Ctx(((8, 6), (5, 3))[k % 2], dtype, g, k)
    name = packet_name(op)
    if name == "flip":
        return Sample((ctx.main(), [[1], [0], [0, 1]][k % 3]))
    if name == "roll":
        shifts, dims = [([2], [1]), ([-3], [0]), ([1, 2], [0, 1])][k % 3]
        return Sample((ctx.main(), shifts, dims))
    s = _gather_like(op, dtype, g, k)
    if name == "scatter":  # scatter.reduce / scatter.value_reduce
        return Sample(s.args, {"reduce": ["add", "multiply"][k % 2]})
    return Sample(s.args + (["sum", "amax", "amin", "prod"][k % 4],), {"include_self": bool(k % 2)})


def _prims_elementwise() -> str:
    from ..ops.pointwise import _PRIMS_ELEMENTWISE

    return "|".join(_PRIMS_ELEMENTWISE + ["view_of"])


_PRIMS_SAMPLED = _prims_elementwise()
SAMPLES[:0] = [
    (r"flip|roll|scatter_reduce", _reorder),
    (r"scatter\.(reduce|value_reduce)", _reorder),
]  # before VIEWLIKE / _gather_like, which have no dims/reduce
SAMPLES += [
    (r"slice_backward|select_backward|constant_pad_nd|repeat|index|index_put|_index_put_impl|index_add", _index_family),
    (r"_conj|conj|_neg_view|resolve_conj|resolve_neg|view_as_complex|real|imag", _complex_input),
    (r"polar|complex|" + _PRIMS_SAMPLED, POINTWISE),
]


# ------------------------------------------------------------------ the convolutional family
#
# ops/convolution.py, pooling.py, group_norm.py, batch_norm.py. Float samples only (these
# kernels take no integers); each float dtype gets its own cases (k + an offset per dtype),
# so the sampled run covers more of them. Backwards take their saved tensors (indices,
# statistics) from the forward. Batch and channel sizes leave empty shards on 4 and 8 ranks.

_CNN_OFFSET = {torch.float64: 0, torch.float32: 3, torch.bfloat16: 1}

# x, weight, bias?, stride, padding, dilation, transposed, output_padding, groups
CONV_CASES = [
    ((3, 4, 6, 5), (6, 4, 3, 3), True, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
    ((5, 6, 7), (3, 6, 2), False, [2], [0], [2], False, [0], 1),
    ((2, 8, 4, 4), (8, 2, 3, 3), True, [1, 1], [1, 1], [1, 1], False, [0, 0], 4),
    ((3, 4, 5, 4), (4, 3, 3, 3), True, [2, 2], [1, 0], [1, 1], True, [1, 0], 1),
    ((3, 4, 5, 6), (5, 4, 1, 1), True, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
    ((2, 8, 3, 4), (8, 2, 2, 2), False, [1, 1], [0, 0], [1, 1], True, [0, 0], 4),
    ((2, 3, 3, 4, 3), (4, 3, 2, 1, 2), True, [1, 1, 1], [0, 1, 0], [1, 1, 1], False, [0, 0, 0], 1),
]


# bfloat16: short sums only. A pending (P(sum)) gradient is rounded to bfloat16 on each rank
# before the ranks' pieces are added; with the sample's signed split weights the pieces
# can be several times the result, so long sums miss the tolerance by construction.
CONV_CASES_BF16 = [
    ((3, 2, 2, 2), (3, 2, 1, 1), True, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
    ((2, 4, 1, 3), (4, 1, 1, 2), True, [1, 1], [0, 0], [1, 1], False, [0, 0], 4),
    ((3, 2, 2, 1), (2, 3, 1, 1), False, [1, 1], [0, 0], [1, 1], True, [0, 0], 1),
]


def _cnn_case(dtype, k: int) -> int | None:
    return None if dtype not in _CNN_OFFSET else k + _CNN_OFFSET[dtype]


def _convolution(op, dtype, g, k):
    """convolution: plain, strided + dilated 1-d, grouped, transposed, 1x1, grouped transposed, 3-d;
    convolution_backward: the same, with a gradient of the output's shape."""
    case = _cnn_case(dtype, k)
    if case is None:
        return None
    cases = CONV_CASES_BF16 if dtype == torch.bfloat16 else CONV_CASES
    x_shape, w_shape, has_bias, stride, padding, dilation, transposed, output_padding, groups = cases[case % len(cases)]
    c_out = w_shape[1] * groups if transposed else w_shape[0]
    x, w = make_tensor(x_shape, dtype, g), make_tensor(w_shape, dtype, g)
    bias = make_tensor((c_out,), dtype, g) if has_bias else None
    statics = (stride, padding, dilation, transposed, output_padding, groups)
    if packet_name(op) == "convolution":
        return Sample((x, w, bias) + statics)
    out = aten.convolution.default(x, w, bias, *statics)
    mask = [True, True, has_bias]
    return Sample((make_tensor(out.shape, dtype, g), x, w, [c_out] if has_bias else None) + statics + (mask,))


def _pool_input(dtype, g, k: int, spatial: int) -> torch.Tensor:
    by_spatial: dict[int, list[tuple[int, ...]]] = {
        1: [(3, 5, 7), (2, 3, 6)],
        2: [(3, 5, 7, 6), (2, 3, 5, 5), (5, 2, 4, 6)],
        3: [(2, 3, 4, 5, 4), (3, 2, 3, 4, 4)],
    }
    shapes = by_spatial[spatial]
    return make_tensor(shapes[k % len(shapes)], dtype, g)


def _max_pool(op, dtype, g, k):
    """max_pool{2,3}d_with_indices (+ backward): windows with stride, padding, dilation, ceil_mode."""
    case = _cnn_case(dtype, k)
    if case is None:
        return None
    spatial = 3 if "3d" in packet_name(op) else 2
    x = _pool_input(dtype, g, case, spatial)
    kernel, stride, padding, dilation, ceil = [
        ([3] * spatial, [2] * spatial, [1] * spatial, [1] * spatial, False),
        ([2] * spatial, [1] * spatial, [0] * spatial, [2] * spatial, True),
    ][case % 2]
    args = (kernel, stride, padding, dilation, ceil)
    forward = aten.max_pool3d_with_indices.default if spatial == 3 else aten.max_pool2d_with_indices.default
    if not packet_name(op).endswith("_backward"):
        return Sample((x,) + args, tie_dim=None)
    out, indices = forward(x, *args)
    return Sample((make_tensor(out.shape, dtype, g), x) + args + (indices,))


def _avg_pool(op, dtype, g, k):
    """avg_pool{2,3}d (+ backward): padding with and without count_include_pad, ceil_mode, a divisor."""
    case = _cnn_case(dtype, k)
    if case is None:
        return None
    spatial = 3 if "3d" in packet_name(op) else 2
    x = _pool_input(dtype, g, case, spatial)
    kernel, stride, padding, ceil, include, divisor = [
        ([3] * spatial, [2] * spatial, [1] * spatial, False, False, None),
        ([2] * spatial, [1] * spatial, [0] * spatial, True, True, None),
        ([2] * spatial, [2] * spatial, [1] * spatial, False, True, 3),
    ][case % 3]
    args = (kernel, stride, padding, ceil, include, divisor)
    if not packet_name(op).endswith("_backward"):
        return Sample((x,) + args)
    out = (aten.avg_pool3d.default if spatial == 3 else aten.avg_pool2d.default)(x, *args)
    return Sample((make_tensor(out.shape, dtype, g), x) + args)


def _adaptive_pool(op, dtype, g, k):
    """_adaptive_avg_pool{2,3}d, adaptive_max_pool{2,3}d (+ backward):
    output sizes that do and do not divide the input."""
    case = _cnn_case(dtype, k)
    if case is None:
        return None
    name = packet_name(op)
    spatial = 3 if "3d" in name else 2
    x = _pool_input(dtype, g, case, spatial)
    size = [[3, 2, 2], [2, 4, 1]][case % 2][:spatial]
    is_max = "max" in name
    forward = getattr(aten, ("adaptive_max_pool" if is_max else "_adaptive_avg_pool") + f"{spatial}d").default
    if not name.endswith("_backward"):
        return Sample((x, size))
    out = forward(x, size)
    if is_max:
        out, indices = out
        return Sample((make_tensor(out.shape, dtype, g), x, indices))
    return Sample((make_tensor(out.shape, dtype, g), x))


def _upsample(op, dtype, g, k):
    """upsample_* (+ backward) by output size: growing and shrinking, align_corners both ways."""
    case = _cnn_case(dtype, k)
    if case is None:
        return None
    name = packet_name(op).removesuffix("_backward")
    spatial = int(re.search(r"(\d)d", name).group(1))
    x = _pool_input(dtype, g, case, spatial)
    size = [[9, 4, 5], [3, 8, 2]][case % 2][:spatial]
    align = () if "align_corners" not in [a.name for a in op._schema.arguments] else (bool(case % 2),)
    if not packet_name(op).endswith("_backward"):
        return Sample((x, size) + align)
    out = getattr(aten, name).default(x, size, *align)
    return Sample((make_tensor(out.shape, dtype, g), size, list(x.shape)) + align)


GROUP_NORM_CASES = [((3, 6, 4, 2), 3, True), ((4, 8, 5), 4, True), ((5, 4, 3, 3), 2, False), ((2, 8, 2, 3), 8, True)]


def _group_norm(op, dtype, g, k):
    """native_group_norm (+ backward): affine or not, groups of 1 to 3 channels."""
    case = _cnn_case(dtype, k)
    if case is None:
        return None
    shape, groups, affine = GROUP_NORM_CASES[case % len(GROUP_NORM_CASES)]
    x = make_tensor(shape, dtype, g)
    w, b = (make_tensor((shape[1],), dtype, g), make_tensor((shape[1],), dtype, g)) if affine else (None, None)
    sizes = (shape[0], shape[1], math.prod(shape[2:]), groups)
    if packet_name(op) == "native_group_norm":
        return Sample((x, w, b) + sizes + (1e-5,))
    out, mean, rstd = aten.native_group_norm.default(x, w, b, *sizes, 1e-5)
    return Sample((make_tensor(shape, dtype, g), x, mean, rstd, w) + sizes + ([True, affine, affine],))


BATCH_NORM_SHAPES = [(5, 4, 3), (3, 6, 2, 2), (6, 3), (2, 5, 3, 2)]


def _batch_norm(op, dtype, g, k):
    """Every batch-norm form: training with and without running statistics, eval; the backward
    with the forward's saved statistics (training) or the running ones (eval)."""
    case = _cnn_case(dtype, k)
    if case is None:
        return None
    shape = BATCH_NORM_SHAPES[case % len(BATCH_NORM_SHAPES)]
    c = shape[1]
    # a large mean (the merged statistics keep their digits); not in bfloat16, whose pending pieces
    # of values near 16 are not exact on the sample grid
    x = make_tensor(shape, dtype, g) + (16 if case % 2 and dtype != torch.bfloat16 else 0)
    affine = case % 3 != 2
    w, b = (make_tensor((c,), dtype, g), make_tensor((c,), dtype, g)) if affine else (None, None)
    rm, rv = make_tensor((c,), dtype, g), make_tensor((c,), dtype, g, positive=True)
    name = f"{packet_name(op)}.{op._overloadname}"
    training = case % 4 != 3
    if name == "_native_batch_norm_legit.no_stats":
        return Sample((x, w, b, True, 0.1, 1e-5))  # eval without statistics: torch's CPU kernel crashes
    if name == "_native_batch_norm_legit_no_training.default":
        return Sample((x, w, b, rm, rv, 0.1, 1e-5))
    if name == "native_batch_norm_backward.default":
        _, mean, invstd = aten.native_batch_norm.default(x, w, b, rm.clone(), rv.clone(), training, 0.1, 1e-5)
        return Sample(
            (make_tensor(shape, dtype, g), x, w, rm, rv, mean, invstd, training, 1e-5, [True, affine, affine])
        )
    if name == "native_batch_norm.default" and case % 5 == 4 and training:
        return Sample((x, w, b, None, None, True, 0.1, 1e-5))
    return Sample((x, w, b, rm, rv, training, 0.2, 1e-5))


SAMPLES += [
    (r"convolution|convolution_backward", _convolution),
    (r"max_pool[23]d_with_indices(_backward)?", _max_pool),
    (r"avg_pool[23]d(_backward)?", _avg_pool),
    (r"_adaptive_avg_pool[23]d(_backward)?|adaptive_max_pool[23]d(_backward)?", _adaptive_pool),
    (r"(_?upsample_\w+)", _upsample),
    (r"native_group_norm(_backward)?", _group_norm),
    (r"native_batch_norm|_native_batch_norm_legit\w*|native_batch_norm_backward", _batch_norm),
]
