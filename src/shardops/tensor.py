"""DTensor: a torch.Tensor wrapper whose data is this rank's shard of a global tensor."""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import caches
from ._torch import pytree
from ._torch.dispatch import DisableTorchFunctionSubclass, disabled_torch_function_impl, make_wrapper_subclass
from .comm import traceable
from .dispatch import core
from .dispatch.debug import check_agreement
from .dispatch.mixed import check_plain_operand
from .dispatch.registry import COPYING_VIEW_ALGORITHMS, DECOMPOSITIONS, OVERWRITES_SELF, TORCH_FUNCTIONS
from .dispatch.schema import static_key
from .errors import ShardingError
from .mesh import DeviceMesh
from .placements import (
    NormPartial,
    Partial,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    local_shape_and_offset,
    normalize_placements,
    shard_positions,
    without_partials,
)
from .redistribute import execute, plan
from .spec import TensorMeta, TensorSpec, contiguous_stride
from .wrapper_meta import mirror_lazy_bits

# runs func with subclass __torch_function__ disabled (in C: cheaper than the context manager)
_torch_function_default = disabled_torch_function_impl
_NO_SUBCLASS_TORCH_FUNCTION = DisableTorchFunctionSubclass
# False whenever Python runs it; True while dynamo traces it (per trace, so rank threads never see another's)
_dynamo_tracing = torch.compiler.is_dynamo_compiling
_SCALARS = {int, float, bool, type(None)}
_NO_KWARGS: dict = {}


class DTensor(torch.Tensor):
    _local_tensor: torch.Tensor
    _spec: TensorSpec
    _grad_hook: bool
    _pending_layout: tuple[Placement, ...] | None
    _compile_meta: CompileMeta | None
    _copied_view: CopiedView | None
    _pending_aliases: list[weakref.ref[DTensor]] | None
    __slots__ = (
        "_local_tensor",
        "_spec",
        "_grad_hook",
        "_pending_layout",
        "_compile_meta",
        "_copied_view",
        "_pending_aliases",
    )

    @staticmethod
    def _make(local: torch.Tensor, spec: TensorSpec, requires_grad: bool = False) -> DTensor:
        if isinstance(local, DTensor):  # one level of wrapping, by construction: a local tensor is plain
            raise ShardingError(
                f"internal error: a DTensor {spec!r} would wrap another DTensor {local._spec!r} as its local tensor; "
                "please report this with the call that made it"
            )
        r = make_wrapper_subclass(
            DTensor,
            spec.meta.shape,
            strides=spec.meta.stride,
            dtype=spec.meta.dtype,
            device=local.device,
            layout=local.layout,
            requires_grad=requires_grad,
        )
        r._local_tensor = local
        r._spec = spec
        r._pending_layout = None
        r._compile_meta = None
        r._copied_view = None  # set where a view op had to copy (see _note_view)
        r._pending_aliases = None  # the DTensors sharing a pending tensor's data (see _note_view)
        if local.is_conj() or local.is_neg():  # lazy bits: the wrapper must carry them too (see wrapper_meta)
            mirror_lazy_bits(r, local)
        return r

    def __new__(cls, *a, **k):  # pragma: no cover - construction goes through the API functions
        raise ShardingError("construct a DTensor with distribute_tensor(...) or DTensor.from_local(...)")

    def requires_grad_(self, requires_grad: bool = True) -> DTensor:
        super().requires_grad_(requires_grad)
        if requires_grad and self.is_leaf:
            _keep_grad_layout(self)
        return self

    def _resolve_pending(self) -> None:
        """Move a leaf's gradient to the leaf's layout, once, on its first read (see _keep_grad_layout)."""
        target, self._pending_layout = self._pending_layout, None
        if target is not None and target != self._spec.placements:
            # a fresh local tensor, not copy_: a Partial->Shard or Shard->Replicate move changes the local shape
            self._local_tensor = execute(self._local_tensor, self._spec, plan(self._spec, target))
            self._set_spec(self._spec.with_placements(target))

    @property
    def _key(self) -> int:
        """The spec's cache id (what the dispatch cache keys on for this operand)."""
        return self._spec.key

    def _set_spec(self, spec: TensorSpec) -> None:
        self._spec = spec

    def __repr__(self) -> str:  # type: ignore[override]  # torch's takes a keyword only its printing passes
        return f"DTensor(local={self._local_tensor!r}, spec={self._spec!r})"

    # -- dispatch
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _dynamo_tracing():  # only while dynamo reads this code: ops go into the graph; dispatch runs in AOTAutograd
            with _NO_SUBCLASS_TORCH_FUNCTION():
                return func(*args, **(kwargs or {}))
        impl = TORCH_FUNCTIONS.get(func)
        if impl is not None:
            return impl(*args, **(kwargs or {}))
        return _torch_function_default(func, types, args, kwargs or {})  # on into __torch_dispatch__

    # -- public API
    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        return _to_local(self, grad_placements)

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
    ) -> DTensor:
        return _redistribute(self, device_mesh, placements)

    def _redistribute_checked(self, device_mesh: DeviceMesh | None, placements: Sequence[Placement] | None) -> DTensor:
        if device_mesh is not None and device_mesh != self._spec.mesh:
            raise ShardingError(
                f"redistribute: moving between meshes is not supported ({self._spec.mesh} -> {device_mesh})"
            )
        if placements is None:
            raise ShardingError("redistribute: give the target placements")
        target = normalize_placements(placements, self.ndim, self._spec.mesh.ndim, "redistribute")
        return _Redistribute.apply(self, target)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        replicated = self.redistribute(placements=[Replicate()] * self._spec.mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)

    def _redistribute_local(self, placements: Sequence[Placement]) -> torch.Tensor:
        """This rank's shard in `placements` (no autograd)."""
        if self._pending_layout is not None:
            self._resolve_pending()
        if tuple(placements) == self._spec.placements:
            return self._local_tensor
        return execute(self._local_tensor, self._spec, plan(self._spec, placements))

    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        run_check: bool = False,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
    ) -> DTensor:
        dt = from_local(local_tensor, device_mesh, placements, shape=shape, stride=stride)
        if run_check:
            check_same_everywhere(dt, "from_local(run_check=True)")
        return dt

    # -- torch.compile: a traceable wrapper subclass (comm/traceable.py says how collectives trace)
    def __tensor_flatten__(self):
        """The local tensor is the traced inner tensor; the spec is a trace-time constant that dynamo guards on.

        Called for every DTensor input of a compiled graph on every call (dynamo's guard, then
        AOTAutograd's unwrapping): the metadata is kept while spec and requires_grad stay, so a
        parameter pays for its coordinate once and the guard compares one object with itself.
        """
        traceable.scale_limits_in_rank_thread()
        meta = self._compile_meta
        pending = self._pending_layout
        if meta is not None and meta.resolves and meta.spec is self._spec:
            return ["_resolved_local"], meta  # the traced copy of a pending gradient, named as the real one
        if (
            meta is None
            or meta.source is not self._spec
            or meta.requires_grad != self.requires_grad
            or meta.resolves != (pending is not None)
        ):
            spec = self._spec if pending is None else self._spec.with_placements(pending)
            meta = CompileMeta(
                spec, self.requires_grad, tuple(self._spec.mesh.get_coordinate() or ()), pending is not None, self._spec
            )
            self._compile_meta = meta
        return (["_resolved_local"] if meta.resolves else ["_local_tensor"]), meta

    @property
    def _resolved_local(self) -> torch.Tensor:
        """A pending gradient's local tensor in its leaf's layout: what a compiled graph takes.

        A graph cannot change its input's layout, so it is traced with the layout the gradient
        will have, and the pending sum is reduced as the graph is called, before it reads its
        inputs: `_enter_graph` (the seam's graph-entry hook) resolves the graph's pending
        inputs then, once each, as eager's first read does. What reads this attribute never
        communicates: dynamo's fake copy and guard building (inside its compile lock, which a
        threads world's other ranks wait for) and its guards (as a compiled region is entered)
        keep only metadata. While the gradient is still pending they get the local tensor, or
        zeros of the resolved local shape where resolving changes it (a gradient pending as
        shards); AOTAutograd's unwrapping, after `_enter_graph`, gets the resolved tensor.
        """
        if self._pending_layout is None:
            return self._local_tensor
        local, shape = self._local_tensor, self._spec.with_placements(self._pending_layout).local_shape()
        return local if tuple(local.shape) == shape else traceable.metadata_only(shape, local)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta: CompileMeta, outer_size, outer_stride) -> DTensor:
        spec = meta.spec
        if tuple(outer_size) != spec.shape or tuple(outer_stride) != spec.meta.stride:
            if not all(type(s) is int for s in (*outer_size, *outer_stride)):
                raise ShardingError(
                    f"torch.compile: shardops DTensors need static shapes (got {tuple(outer_size)} for {spec!r}); "
                    "compile with dynamic=False"
                )
            spec = TensorSpec(
                spec.mesh, spec.placements, TensorMeta(tuple(outer_size), tuple(outer_stride), spec.dtype)
            )
        if not meta.resolves:
            return DTensor._make(inner_tensors["_local_tensor"], spec, meta.requires_grad)
        out = DTensor._make(inner_tensors["_resolved_local"], spec, meta.requires_grad)
        out._compile_meta = meta  # flattens as the real one did (dynamo pairs the real and fake inner names)
        return out

    def __coerce_tangent_metadata__(self) -> DTensor:
        """The layout a compiled backward expects the gradient of this forward output in.

        A gradient of a pending value (Partial, NormPartial) is Replicate on those dims, as in eager;
        without this AOTAutograd guesses the output's own layout, and a Replicate gradient cannot be
        moved to a NormPartial (a compiled vector_norm's backward failed). Metadata only: the
        local tensor has the same shape in either layout, so nothing moves.
        """
        target = without_partials(self._spec.placements)
        if target == self._spec.placements:
            return self
        return DTensor._make(self._local_tensor, self._spec.with_placements(target), self.requires_grad)

    def __coerce_same_metadata_as_tangent__(self, expected: CompileMeta, expected_type=None) -> DTensor | None:
        """A compiled backward guessed the incoming gradient's layout (the forward output's); move it there."""
        if expected_type is not None and expected_type is not DTensor:
            return None
        target = expected.spec.placements
        if target == self._spec.placements:
            return self
        return DTensor._make(self._redistribute_local(target), self._spec.with_placements(target))


def _resolves_pending(example: Any) -> bool:
    """A compiled graph's example input traced as a pending gradient (see _resolved_local)."""
    return isinstance(example, DTensor) and example._compile_meta is not None and example._compile_meta.resolves


@traceable.eager_only
def _enter_graph(inputs: list) -> None:
    """As a compiled graph that takes pending gradients is called: resolve them, in the graph's
    input order, once each, as eager's first read does.

    The same point of every rank's program (the graph call, after dynamo's guards and outside its
    compile lock) and the same collectives in the same order on every rank: the graph, and so its
    inputs' order, is traced from the same program. Run eagerly (dynamo's frame hook stays off).
    """
    for x in inputs:
        if isinstance(x, DTensor) and x._pending_layout is not None:
            x._resolve_pending()


# shardops.remesh moves a copy's data between two meshes over the seam (so it imports this
# module); it installs itself here when shardops is imported.
CROSS_MESH_COPY: list[Callable[[Any, Any], Any]] = []


class CompileMeta:
    """What torch.compile keeps of a DTensor besides its local tensor: the spec (mesh, placements,
    global shape) and this rank's mesh coordinate. Dynamo guards on equality, so a graph traced on
    one layout, or on one rank of a threads world (offsets and uneven sizes are baked in), is never
    reused for another. Immutable: dynamo's deepcopy of guard metadata returns it as is.

    A leaf's pending gradient is described in the layout it will have (`resolves`, guarded too:
    its inner tensor is read through DTensor._resolved_local, which reduces the pending sum as
    the graph is called). `source` is the spec it was made from, not guarded."""

    __slots__ = ("spec", "requires_grad", "coordinate", "resolves", "source")

    def __init__(
        self,
        spec: TensorSpec,
        requires_grad: bool,
        coordinate: tuple[int, ...],
        resolves: bool = False,
        source: TensorSpec | None = None,
    ) -> None:
        self.spec, self.requires_grad, self.coordinate = spec, requires_grad, coordinate
        self.resolves, self.source = resolves, source if source is not None else spec

    def _parts(self) -> tuple:
        # coordinate first: in a threads world a rank's guard walks the other ranks' entries, and
        # the comparison stops at the first part that differs
        return (self.coordinate, self.requires_grad, self.spec, self.resolves)

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, CompileMeta) and self._parts() == other._parts())

    def __hash__(self) -> int:
        return hash(self._parts())

    def __deepcopy__(self, memo) -> CompileMeta:
        return self

    def __repr__(self) -> str:
        return (
            f"CompileMeta({self.spec!r}, requires_grad={self.requires_grad}, coordinate={self.coordinate}, "
            f"resolves={self.resolves})"
        )


# ------------------------------------------------------------------ dispatch: unwrap, decide and run, wrap


def dispatch(func, args: tuple, kwargs: dict | None) -> Any:
    """An aten op on DTensor operands: the local tensors and specs go to dispatch/core, the results come back wrapped.

    A cache hit builds one flat key (the overload, each operand's spec id, each static argument
    with its type), looks it up, unwraps, runs the kernel and wraps: no pytree, no spec objects,
    no signature binding. Static lists (dims, sizes) stay in place; only calls with keyword
    arguments or tensor lists are flattened first.
    """
    if args and type(args[0]) is DTensor and args[0]._copied_view is not None:
        _refuse_write_to_copy(func, args[0])  # before any relabelling: a refused write changes nothing
    if func in OVERWRITES_SELF:
        _relabel_overwritten_self(func, args[0] if args else (kwargs or _NO_KWARGS).get("self"))
    key: list[Any] = [func]
    tensor_pos: list[int] = []
    if not kwargs and _operand_key(func, args, key, tensor_pos):
        flat, tree = list(args), None
    else:
        flat, tree = core.flatten_args(args, kwargs or _NO_KWARGS)
        key, tensor_pos = [func, "leaves", core.tree_key(tree)], []
        _operand_key(func, flat, key, tensor_pos, tree)
    key.append(caches.EPOCH[0])  # a new link model or strict mode decides anew
    cache_key = tuple(key)
    decision = core._CACHE.get(cache_key)
    if decision is None:
        if func is _COPY and _across_meshes(args):
            return CROSS_MESH_COPY[0](args[0], args[1])  # load_state_dict from a model on another mesh or plan
        kwargs = kwargs or _NO_KWARGS
        decomposition = DECOMPOSITIONS.get(func)  # never cached: these always come this way
        if decomposition is not None:
            return decomposition(*args, **kwargs)
        names = core.out_arg_names(func)
        if names and all(n in kwargs for n in names):
            return _dispatch_out_variant(func, args, kwargs, names)
        leaves, leaves_tree = core.flatten_args(args, kwargs)  # what decide reads: every list flattened
        positions = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)]
        for i, spec in zip(positions, _operand_specs(leaves, positions, func)):
            leaves[i] = spec
        decision = core.decide_for_dispatch(cache_key, func, leaves, leaves_tree, positions)
    if core._state["debug"]:
        check_agreement(decision, [(k, flat[i]) for k, i in enumerate(tensor_pos) if not isinstance(flat[i], DTensor)])
    self_ = flat[tensor_pos[0]] if decision.inplace else None
    viewed = flat[tensor_pos[0]] if tensor_pos and _VIEW_OPS[func] else None
    for i in tensor_pos:
        a = flat[i]
        if isinstance(a, DTensor):
            flat[i] = a._local_tensor
    if decision.moves:
        if self_ is not None and decision.moves[0] == 0 and (other := _pending_alias_of(self_)) is not None:
            raise _aliased_resolve_error(func, self_, other)
        core.move_inputs(decision, flat, tensor_pos)
    if self_ is not None:  # decision.inplace
        if decision.moves and decision.moves[0] == 0:  # self's pending partial was resolved in place
            if type(self_._local_tensor) is not torch.Tensor and traceable.is_traced_tensor(self_._local_tensor):
                # a compiled graph writes back an input's data, never its layout: the caller's DTensor would keep P()
                raise ShardingError(
                    f"torch.compile: {func} resolves the pending partial of its DTensor input in place "
                    f"({self_._spec!r}); a compiled graph cannot change an input's layout. Redistribute it (e.g. to "
                    "Replicate) before the compiled region."
                )
            self_._set_spec(decision.in_specs[0].with_placements(decision.plans[0].dst))
        core.compute(decision, flat, tree)
        return self_
    if tree is None and decision.algorithm is None:
        out = func(*flat)  # the common case: core.compute without its argument rebuilding
    else:
        out = core.compute(decision, flat, tree)
    if type(out) is torch.Tensor and decision.out_specs is not None:
        result = DTensor._make(out, decision.out_specs[0])
    else:
        out_leaves, out_tree = pytree.tree_flatten(out)
        specs = iter(core.output_specs(decision, out_leaves))
        wrapped = [DTensor._make(t, next(specs)) if isinstance(t, torch.Tensor) else t for t in out_leaves]
        result = pytree.tree_unflatten(wrapped, out_tree)
    if isinstance(viewed, DTensor):
        _note_view(func, decision, viewed, result)
    return result


_COPY = torch.ops.aten.copy_.default


# ------------------------------------------------------------------ writes through views that are copies


class _ViewOps(dict):
    """op -> True where torch promises its output aliases self (slice, select, view, t, ...):
    filled on first sight from the schema, so the hot path is one dict lookup."""

    def __missing__(self, func) -> bool:
        returns = getattr(getattr(func, "_schema", None), "returns", ())
        alias = returns[0].alias_info if returns else None
        self[func] = found = alias is not None and not alias.is_write and func not in _AUTOGRAD_PLUMBING
        return found


_VIEW_OPS = _ViewOps()
# detach/alias are autograd's own plumbing (AccumulateGrad stores a detached gradient): their
# outputs are not marked, or a gradient whose detach the planner moved could never be written
_AUTOGRAD_PLUMBING = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}
# in-place ops that change only a tensor's metadata: on a copy they lose no write
_METADATA_ONLY = {
    getattr(torch.ops.aten, n).default for n in ("t_", "transpose_", "squeeze_", "unsqueeze_", "detach_", "as_strided_")
}


class CopiedView:
    """Why a DTensor that torch calls a view is new data: the view op and the layouts it moved."""

    __slots__ = ("op", "src", "out")

    def __init__(self, op, src: TensorSpec, out: TensorSpec):
        self.op, self.src, self.out = op, src, out


def _note_view(func, decision, viewed: DTensor, result: Any) -> None:
    """After a view op: mark outputs that do not alias its input (self moved first, or the op's
    sharded algorithm built new data, as slice/select along a sharded dim do; a view of such a copy
    is one too), decided from the plan, never from storage, so every rank marks alike. Outputs that
    alias a pending (Partial) input join its alias group (see _pending_alias_of)."""
    outputs = (
        [result] if isinstance(result, DTensor) else [t for t in pytree.tree_leaves(result) if isinstance(t, DTensor)]
    )
    mark = viewed._copied_view
    if mark is None and ((decision.moves and decision.moves[0] == 0) or decision.algorithm in COPYING_VIEW_ALGORITHMS):
        mark = CopiedView(func, viewed._spec, outputs[0]._spec) if outputs else None
    if mark is not None:
        for t in outputs:
            t._copied_view = mark
    elif any(p.is_partial() for p in viewed._spec.placements):
        group = viewed._pending_aliases
        if group is None:
            group = viewed._pending_aliases = [weakref.ref(viewed)]
        group[:] = [r for r in group if r() is not None]
        for t in outputs:
            group.append(weakref.ref(t))
            t._pending_aliases = group


def _refuse_write_to_copy(func, self_: DTensor) -> None:
    """An in-place write to a view op's output that is a copy would never reach the viewed tensor."""
    if func in _METADATA_ONLY or not core._writes_self(func):
        return
    mark = self_._copied_view
    if mark is None:  # the caller checked: only a copy's writes come here
        return
    raise ShardingError(
        f"{func}: writes in place to the output of {mark.op}, which is a copy, not a view: {mark.op} on {mark.src!r} "
        f"moved data to give {mark.out!r}, so the write would never reach the tensor it was taken from. Write to the "
        "whole tensor instead (torch.where, masked_fill_ or index_put_ with a mask or index over its rows), or "
        "redistribute that tensor first so the view is local (e.g. Replicate, or Shard of a dim the view keeps "
        "whole); if a separate copy is what you want, say so with .clone() before writing."
    )


def _pending_alias_of(self_: DTensor) -> DTensor | None:
    """A live DTensor other than self that shares self's data and is still pending: resolving or
    relabelling self in place would leave that one with its partial label over resolved values."""
    group = self_._pending_aliases
    if group is None:
        return None
    for r in group:
        other = r()
        if other is not None and other is not self_ and any(p.is_partial() for p in other._spec.placements):
            return other
    return None


def refuse_pending_alias(func, self_: DTensor) -> None:
    """Raise where resolving or relabelling the pending `self_` in place would leave an alias wrong."""
    other = _pending_alias_of(self_)
    if other is not None:
        raise _aliased_resolve_error(func, self_, other)


def _aliased_resolve_error(func, self_: DTensor, other: DTensor) -> ShardingError:
    return ShardingError(
        f"{func}: would resolve or overwrite the pending sum of {self_._spec!r} in place, but it shares its data with "
        f"a view or base still in use ({other._spec!r}), which would keep its pending label over the new values. "
        "Resolve it first, before taking views: x = x.redistribute(placements=[Replicate()] * mesh.ndim) "
        "(or the Shard placements you need), then view and write."
    )


def _across_meshes(args: tuple) -> bool:
    return (
        len(args) >= 2
        and isinstance(args[0], DTensor)
        and isinstance(args[1], DTensor)
        and args[0]._spec.mesh != args[1]._spec.mesh
    )


def _relabel_overwritten_self(func, self_: Any) -> None:
    """An op that overwrites every value of self (a fill, a draw) never reads it: a pending self
    becomes Replicate without resolving (0 bytes; CPU F.dropout's empty_like(x).bernoulli_() on a
    Partial x would otherwise all-reduce memory it is about to overwrite)."""
    if isinstance(self_, DTensor) and any(p.is_partial() for p in self_._spec.placements):
        refuse_pending_alias(func, self_)
        self_._pending_layout = None  # a leaf's pending gradient overwritten: nothing left to resolve
        self_._set_spec(self_._spec.with_placements(without_partials(self_._spec.placements)))


def _operand_key(func, items: Sequence[Any], key: list, tensor_pos: list[int], tree: Any = None) -> bool:
    """Append each item's cache key and note the tensor operands' positions; False where a list
    holds tensors (a Tensor[] argument: the call must be flattened first). A leaf's pending
    gradient read here for the first time is moved to the leaf's layout first (a write keeps it)."""
    for i, a in enumerate(items):
        t = type(a)
        if t is DTensor:
            if a._pending_layout is not None and not (i == 0 and core._writes_self(func)):
                a._resolve_pending()
            key.append(a._spec.key)
            tensor_pos.append(i)
        elif t in _SCALARS:
            key.append(t)  # 1, 1.0 and True decide differently
            key.append(core.float_key(func, tree, i, a) if t is float else a)  # a float: only what decisions read of it
        elif t is list or t is tuple:
            for v in a:
                if type(v) not in _SCALARS:
                    if isinstance(v, torch.Tensor):
                        return False
                    key.append(static_key(a, func))  # anything else: its hashable stand-in
                    break
            else:
                key.append(t)
                key.append(tuple(a))  # int[] dims and sizes: static
        elif isinstance(a, DTensor):
            if a._pending_layout is not None and not (i == 0 and core._writes_self(func)):
                a._resolve_pending()
            key.append(a._spec.key)
            tensor_pos.append(i)
        elif isinstance(a, torch.Tensor):
            check_plain_operand(func, a)  # torch's rule: only one-element tensors are implicitly Replicate
            key.append(core.plain_key(a))
            tensor_pos.append(i)
        else:
            key.append(static_key(a, func))
    return True


def _operand_specs(flat: Sequence[Any], tensor_pos: Sequence[int], func) -> list[TensorSpec]:
    """Each tensor operand's spec; a plain tensor (one element, or inside implicit_replication:
    _operand_key checked it) is taken as Replicate on the DTensors' mesh."""
    mesh: DeviceMesh | None = None
    for i in tensor_pos:
        if isinstance(flat[i], DTensor):
            m = flat[i]._spec.mesh
            if mesh is None:
                mesh = m
            elif m != mesh:
                raise ShardingError(
                    f"Sharding propagation failed for {func}: operands live on different meshes ({mesh} and {m}); "
                    "redistribute them onto one mesh first (e.g. build both with the same DeviceMesh)."
                )
    specs = []
    for i in tensor_pos:
        a = flat[i]
        if isinstance(a, DTensor):
            specs.append(a._spec)
        else:
            if mesh is None:
                raise ShardingError(f"internal error: {func} reached DTensor dispatch without a DTensor operand")
            meta = TensorMeta(tuple(a.shape), tuple(a.stride()), a.dtype)
            specs.append(TensorSpec(mesh, (Replicate(),) * mesh.ndim, meta))
    return specs


def _dispatch_out_variant(func, args: tuple, kwargs: dict, names: tuple[str, ...]) -> Any:
    """out= overloads: run the functional op, then move each result into its out tensor."""
    outs = [kwargs[n] for n in names]
    rest = {k: v for k, v in kwargs.items() if k not in names}
    packet = getattr(torch.ops.aten, func._schema.name.split("::")[-1])
    result = packet(*args, **rest)
    results = result if isinstance(result, (tuple, list)) else (result,)
    for res, out in zip(results, outs):  # every check before the first write: a refused call changes nothing
        if not isinstance(out, DTensor):
            raise ShardingError(f"{func}: out= must be a DTensor when the inputs are DTensors")
        if not torch.can_cast(res.dtype, out.dtype):
            raise ShardingError(
                f"{func}: result type {res.dtype} can't be cast to the desired output type {out.dtype} of out= (as "
                "torch refuses it)"
            )
    for res, out in zip(results, outs):
        if not isinstance(res, DTensor):
            res = DTensor._make(
                res,
                TensorSpec(
                    out._spec.mesh,
                    (Replicate(),) * out._spec.mesh.ndim,
                    TensorMeta(tuple(res.shape), tuple(res.stride()), res.dtype),
                ),
            )
        moved = (
            res._redistribute_local(out._spec.placements)
            if res._spec.placements != out._spec.placements
            else res._local_tensor
        )
        out._local_tensor.resize_(moved.shape).copy_(moved)
        out._set_spec(
            TensorSpec(
                out._spec.mesh,
                out._spec.placements,
                TensorMeta(res._spec.shape, res._spec.meta.stride, out._spec.dtype),
            )
        )
    return outs[0] if len(outs) == 1 else tuple(outs)


# ------------------------------------------------------------------ entry points dynamo records as one call


@traceable.trace_opaque
def _to_local(dt: DTensor, grad_placements: Sequence[Placement] | None) -> torch.Tensor:
    if dt._pending_layout is not None:
        dt._resolve_pending()
    if not torch.is_grad_enabled():
        return dt._local_tensor
    return _ToLocal.apply(dt, grad_placements)


@traceable.trace_opaque
def _redistribute(dt: DTensor, device_mesh: DeviceMesh | None, placements: Sequence[Placement] | None) -> DTensor:
    return dt._redistribute_checked(device_mesh, placements)


# ------------------------------------------------------------------ autograd functions


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt: DTensor, grad_placements):
        ctx.spec = dt._spec
        ctx.grad_placements = grad_placements
        return dt._local_tensor.view_as(dt._local_tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.spec
        placements = tuple(ctx.grad_placements) if ctx.grad_placements is not None else spec.placements
        gspec = TensorSpec(spec.mesh, placements, TensorMeta(spec.shape, spec.meta.stride, grad.dtype))
        if isinstance(grad, DTensor):
            return _local_grad_from_dtensor(grad, gspec), None
        return DTensor._make(grad.contiguous() if not grad.is_contiguous() else grad, gspec), None


def _derived_once(source: torch.Tensor, key: Any, derive: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """`derive()`, kept on `source` under `key` while neither changes in place; (value, whether it was kept).

    Kept with a strong reference, living as long as the source (a weak one was dead by the second ask).
    """
    kept = getattr(source, "_shardops_derived", None)
    hit = kept.get(key) if kept is not None else None
    if hit is not None and hit[0] == source._version and hit[2] == hit[1]._version:
        return hit[1], True
    value = derive()
    if kept is None:
        kept = source._shardops_derived = {}  # type: ignore[attr-defined]  # torch.Tensor takes new attributes
    kept[key] = (source._version, value, value._version)
    return value, False


def _local_grad_from_dtensor(grad: DTensor, gspec: TensorSpec) -> DTensor:
    """to_local's gradient when the plain local tensor met DTensors downstream.

    A plain operand mixed with DTensors is taken as Replicate, so its gradient comes back as a
    DTensor whose global value is the gradient of this rank's local tensor. Where the local
    tensor is the whole tensor (no Shard), that DTensor is the gradient as it is, pending layout
    and all; otherwise its replicated value is this rank's piece in `gspec`.
    """
    if (
        grad._spec.mesh == gspec.mesh
        and not any(p.is_shard() for p in gspec.placements)
        and tuple(grad.shape) == tuple(gspec.shape)
    ):
        return grad
    local = grad._redistribute_local((Replicate(),) * grad._spec.mesh.ndim)
    return DTensor._make(local.contiguous(), gspec)


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: TensorSpec):
        ctx.spec = spec
        return DTensor._make(local.view_as(local), spec)

    @staticmethod
    def backward(ctx, grad: DTensor):
        spec = ctx.spec
        if not isinstance(grad, DTensor):
            return grad, None
        # The gradient goes back to the source layout; a Partial source gets a Replicate gradient.
        return _gradient_in_layout(grad, without_partials(spec.placements)), None


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt: DTensor, target: tuple[Placement, ...]):
        ctx.src = dt._spec
        local = dt._redistribute_local(target)
        if local is dt._local_tensor:
            local = local.view_as(local)
        return DTensor._make(local, dt._spec.with_placements(target))

    @staticmethod
    def backward(ctx, grad: DTensor):
        src = ctx.src
        target = without_partials(src.placements)
        if not isinstance(grad, DTensor):
            return grad, None
        local = _gradient_in_layout(grad, target)
        return DTensor._make(local, TensorSpec(src.mesh, target, grad._spec.meta)), None


def _gradient_in_layout(grad: DTensor, target: tuple[Placement, ...]) -> torch.Tensor:
    """`grad`'s local tensor moved to `target`, sent once however many backwards ask for it.

    Autograd hands one gradient to every branch of a sum: GPT-2's token and position embeddings
    are both reduce-scattered to the sequence-sharded residual, so both backwards all-gather the
    same gradient (torch's DTensor sends it twice in eager). A later request for the same move of
    the unchanged gradient gets a copy of the first (a local copy, never an alias that one
    consumer's in-place accumulation could change under the other).
    """
    if grad._pending_layout is not None or tuple(target) == grad._spec.placements:
        return grad._redistribute_local(target)
    moved, kept = _derived_once(
        grad._local_tensor, (grad._spec.key, tuple(target)), lambda: grad._redistribute_local(target)
    )
    return moved.clone() if kept else moved


def _keep_grad_layout(leaf: DTensor) -> None:
    """A leaf's gradient comes back in the leaf's layout, each mesh dim paying at most once per step.

    Dispatch may compute a backward in another layout (the planner moved an input
    inside an op, below autograd). On mesh dims the leaf shards, the gradient is
    moved back when it is accumulated. Elsewhere (weights replicated over tp or dp)
    the gradient keeps the cheapest layout backward left it in (Partial(sum) or
    sharded, as torch does) and is marked pending: its first read by any op
    (an optimizer's lerp_, addcmul_, clip_grad_norm_'s norm, full_tensor) moves it
    to the leaf's layout in place, so later reads pay nothing. torch re-reduces a
    Partial gradient on every read. In-place writes to the pending gradient
    (gradient accumulation, zero_) keep it pending.

    Compiled code reads it as well: a graph is traced with the leaf's layout, and its
    pending inputs are resolved as the graph is called (_enter_graph), each once, as
    eager's first read does.
    """
    if getattr(leaf, "_grad_hook", False):
        return
    leaf.register_post_accumulate_grad_hook(_on_grad_accumulated)
    leaf._grad_hook = True


@traceable.eager_only  # runs in the autograd engine, also under a backward called from compiled code
def _on_grad_accumulated(t: DTensor) -> None:
    g = t.grad
    if not isinstance(g, DTensor) or g._spec.mesh != t._spec.mesh:
        return
    wanted = without_partials(t._spec.placements)
    # sharded mesh dims come back as the leaf has them; elsewhere the cheapest layout stays
    target = tuple(p if p.is_shard() else q for p, q in zip(t._spec.placements, g._spec.placements))
    if g._spec.placements != target:
        g = t.grad = DTensor._make(g._redistribute_local(target), g._spec.with_placements(target))
    g._pending_layout = wanted if g._spec.placements != wanted else None


# ------------------------------------------------------------------ construction


def _global_meta(shape: Sequence[int], dtype: torch.dtype, stride: Sequence[int] | None = None) -> TensorMeta:
    shape = tuple(int(s) for s in shape)
    return TensorMeta(shape, tuple(stride) if stride is not None else contiguous_stride(shape), dtype)


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Lay `tensor` out over `device_mesh`; rank `src_data_rank`'s data wins (None: each rank slices its own)."""
    if isinstance(tensor, DTensor):
        raise ShardingError("distribute_tensor: input is already a DTensor; use dt.redistribute(...)")
    mesh, placements = _mesh_and_placements(device_mesh, placements, tensor.ndim, "distribute_tensor")
    data = (
        tensor.detach() if tensor.device.type == mesh.device_type or tensor.is_meta else tensor.detach().to(mesh.device)
    )  # as torch: onto the mesh's device
    if src_data_rank is not None and mesh.size() > 1:
        comm = mesh.comm
        group = mesh.group(tuple(range(mesh.ndim)))
        # As in torch, src_data_rank is the rank within the group along each mesh dim (0 by default, on a
        # sub-mesh too): the data of the rank at coordinate (src_data_rank, ..., src_data_rank) wins.
        if not isinstance(src_data_rank, int) or not all(0 <= src_data_rank < n for n in mesh.shape):
            raise ShardingError(
                f"distribute_tensor: src_data_rank={src_data_rank} is not a group rank on every dim of {mesh} (shape "
                f"{tuple(mesh.shape)}); use 0 <= src_data_rank < {min(mesh.shape)}, or None to keep each rank's own "
                "data."
            )
        src_rank = int(mesh.mesh[(src_data_rank,) * mesh.ndim])
        data = comm.broadcast(data.contiguous(), group.ranks.index(src_rank), group)
    spec = TensorSpec(mesh, tuple(Replicate() for _ in placements), _global_meta(tensor.shape, tensor.dtype))
    local = execute_local_layout(data, spec, placements)
    out = DTensor._make(local.contiguous(), spec.with_placements(placements), requires_grad=tensor.requires_grad)
    if tensor.requires_grad:
        _keep_grad_layout(out)
    return out


def execute_local_layout(data: torch.Tensor, replicated: TensorSpec, placements: Sequence[Placement]) -> torch.Tensor:
    """Slice a replicated tensor into this rank's shard of `placements` (no communication)."""
    coord = replicated.mesh.get_coordinate() or []  # [] off the mesh: an unsharded layout needs none
    x = data
    for i, p in enumerate(placements):
        if isinstance(p, (Shard, StridedShard)):
            pos = shard_positions(p, x.shape[p.dim], replicated.mesh.shape[i], coord[i])
            x = (
                x.narrow(p.dim, pos.start, len(pos))
                if isinstance(pos, range)
                else x.index_select(p.dim, torch.tensor(pos, dtype=torch.long, device=x.device))
            )
        elif isinstance(p, Partial):
            x = p.split(x, coord[i])
    return x.clone(memory_format=torch.contiguous_format)  # never alias the caller's tensor


@traceable.trace_opaque
def from_local(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    shape: Sequence[int] | None = None,
    stride: Sequence[int] | None = None,
) -> DTensor:
    """Wrap this rank's shard. Without `shape`, shards are assumed even (global = local x count)."""
    if isinstance(local_tensor, DTensor):
        raise ShardingError("from_local: input is already a DTensor")
    mesh, placements = _mesh_and_placements(device_mesh, placements, local_tensor.ndim, "from_local")
    if shape is None:
        gshape = list(local_tensor.shape)
        for n, p in zip(mesh.shape, placements):
            if isinstance(p, (Shard, StridedShard)):
                gshape[p.dim] *= n
    else:
        gshape = list(shape)
        if len(gshape) != local_tensor.ndim:
            raise ShardingError(
                f"from_local: shape {tuple(shape)} has {len(gshape)} dims but the local tensor has {local_tensor.ndim}"
            )
    expected = local_shape_and_offset(gshape, mesh.shape, mesh.own_coordinate(), placements)[0]
    if tuple(expected) != tuple(local_tensor.shape):
        raise ShardingError(
            f"from_local: this rank (coordinate {mesh.get_coordinate()}) holds a local tensor of shape "
            f"{tuple(local_tensor.shape)}, but global shape {tuple(gshape)} with placements {list(placements)} gives "
            f"it {tuple(expected)}; pass the right global shape= (uneven shards need it)."
        )
    spec = TensorSpec(mesh, placements, _global_meta(gshape, local_tensor.dtype, stride))
    return _FromLocal.apply(local_tensor, spec)


def _mesh_and_placements(
    mesh: DeviceMesh | None, placements, ndim: int, what: str
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh (this rank must be on it) and the checked placements (default: Replicate) of a new DTensor."""
    mesh = mesh if mesh is not None else _default_mesh()
    _check_member(mesh, what)
    return mesh, normalize_placements(
        placements if placements is not None else [Replicate()] * mesh.ndim, ndim, mesh.ndim, what
    )


def _check_member(mesh: DeviceMesh, what: str) -> None:
    if mesh.get_coordinate() is None:
        raise ShardingError(
            f"{what}: rank {mesh.get_rank()} is not part of {mesh}; only its ranks may hold its tensors "
            "(make the DTensor on the ranks of the mesh, or use a mesh that contains this rank)."
        )


def check_same_everywhere(dt: DTensor, what: str) -> None:
    """from_local(run_check=True): every rank agrees on the global shape and dtype (one small all_gather).

    Ranks that disagree would otherwise issue mismatched collectives: in the threads world an
    error at the first one, under gloo padding read as data or a process aborted by gloo.
    """
    spec = dt._spec
    group = spec.mesh.group(tuple(range(spec.mesh.ndim)))
    mine = torch.tensor(
        [len(spec.shape), *spec.shape, zlib.crc32(str(spec.dtype).encode())], dtype=torch.int64
    )  # crc32: hash() differs between processes
    sizes = spec.mesh.comm.all_gather(torch.tensor([mine.numel()]), group)
    if len({int(s) for s in sizes}) > 1:
        raise ShardingError(
            f"{what}: ranks disagree on the tensor's number of dims ({[int(s) for s in sizes]}); pass shape= on every "
            "rank"
        )
    for rank, theirs in zip(group.ranks, spec.mesh.comm.all_gather(mine, group)):
        if not torch.equal(theirs, mine):
            raise ShardingError(
                f"{what}: rank {rank} sees another global shape or dtype than rank {spec.mesh.get_rank()} "
                f"({spec.dtype}{list(spec.shape)}); uneven shards need the same shape= on every rank"
            )


def _default_mesh() -> DeviceMesh:
    raise ShardingError("give a device_mesh (so.init_device_mesh(...))")


# dynamo traces neither a DTensor's construction nor distribute_tensor: it records each call (or breaks
# the graph before it), never resumes inside one (a resume there lost requires_grad)
traceable.trace_opaque(DTensor._make)
traceable.trace_opaque(distribute_tensor)
traceable.eager_only(dispatch)
# The autograd engine calls __torch_dispatch__ from eager code, also under a backward run after a graph
# break. Compiled as a frame (torch 2.14 traces it whole), a gradient accumulation into a pending gradient
# became a graph that took the gradient as an input and so resolved it at entry (issue 41).
traceable.eager_only(DTensor.__torch_dispatch__.__func__)  # type: ignore[attr-defined]  # a classmethod's function
# Dynamo inlines __torch_function__ where it traces user code; never compile it as a frame of its own
# (entered from eager code under dynamo's frame hook, e.g. an optimizer step after a graph break, the
# frame would be traced with _dynamo_tracing() true and call itself at run time without end).
traceable.eager_only(DTensor.__torch_function__.__func__)  # type: ignore[attr-defined]  # a classmethod's function
traceable.eager_only(DTensor.__tensor_unflatten__)  # AOTAutograd's run-time wrappers call it from eager code
# A mesh made or sliced inside compiled code (`mesh["dp"]`) is built eagerly after a graph break: dynamo
# compiling DeviceMesh.__init__ as a frame of its own guarded on the half-built mesh (its repr failed).
traceable.eager_only(DeviceMesh.__init__)
traceable.eager_only(DeviceMesh.__getitem__)
traceable.on_graph_entry(_resolves_pending, _enter_graph)
traceable.setup(
    DeviceMesh, (Shard, StridedShard, Replicate, Partial, NormPartial), (TensorSpec, TensorMeta)
)  # torch.compile support: meshes and placements as constants; dynamo's marks when it loads
