"""from_transformers: a transformers model's own tensor-parallel plan, applied with shardops styles.

    model = AutoModelForCausalLM.from_config(config)
    from_transformers(model, mesh)                 # mesh: the tensor-parallel mesh, 1-d
    loss = model(ids, labels=ids).loss             # runs sharded, exact

transformers (5.x) ships a plan on each model (`model._tp_plan`: the base model's
plan with its prefix, the head's entries, `embedding_rowwise` for the input
embedding). Its keys are dotted paths with `*` for the layer number; a key names
a module (the kind says how the module's forward is parallelized) or a parameter
(the kind only says how that parameter is laid out). Each kind maps to a shardops
style (docs/parallel.md has the table):

  colwise                       ColwiseParallel (output Shard(-1))
  colwise_rep, colwise_gather_output
                                ColwiseParallel(output_layouts=Replicate())
  rowwise                       RowwiseParallel (input Shard(-1), output Replicate)
  rowwise_split_input, rowwise_rep
                                RowwiseParallel(input_layouts=Replicate())
  embedding_rowwise             RowwiseParallel(input_layouts=Replicate()) on the embedding (vocabulary-parallel)
  embedding_colwise             ColwiseParallel(output_layouts=Replicate()) on the embedding
  sequence_parallel             SequenceParallel
  replicated_with_grad_allreduce
                                replicated parameters whose gradient is summed over the mesh (per-head norms)
  packed_colwise                fused [gate; up] weight: StridedShard(out dim, 2), each half column-sharded
  packed_rowwise                fused weight packed along its last dim: StridedShard(-1, 2)
  moe_tp_experts                experts computing on their local shards; input gradient and output summed
  moe_identity_expert           input divided by the mesh size (cancels the experts' sum)
  all_reduce                    a module's partial output summed over the mesh
  mla_kv_a_proj                 the rope part of the projection's output: gradient summed over the mesh
  local_params                  the module computes on its parameters' local shards
  replicate                     nothing (the parameter stays a plain, replicated tensor)

`expert_parallel=True` adds the model's expert-parallel plan (`model._ep_plan`, from the
config's `base_model_ep_plan`), as transformers' `DistributedConfig(ep_size=tp_size)` does
on the same ranks: its entries take the place of the tensor-parallel entries for the
experts module and its parameters.

  ep_dispatch_experts           ExpertParallel over the mesh: the replicated tokens sliced (free),
                                dispatched and combined by all_to_all, the output gathered back
  grouped_gemm                  nothing of its own (ExpertParallel lays the experts out Shard(0))

`use_local_output=True` is how transformers applies its plan: tensors between
boundaries are plain local tensors. `use_local_output=False` keeps every boundary
a DTensor, so attention, rotary embeddings, masks and the loss run on DTensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from ..dispatch.mixed import implicit_replication
from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..placements import Partial, Placement, Replicate, Shard, StridedShard
from ..tensor import DTensor, from_local
from ._layout import as_mesh, distribute_param, move, to_dtensor
from ._views import LocalView, set_compute_layout
from .api import parallelize_module
from .distribute import distribute_module
from .expert import ExpertParallel
from .style import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel, _distribute_params

__all__ = ["from_transformers", "style_for"]

PACKED_SPLIT = 2  # transformers packs [gate; up]: two halves


def from_transformers(
    model: nn.Module, mesh: Any, *, use_local_output: bool = True, expert_parallel: bool = False
) -> nn.Module:
    """Apply `model._tp_plan` (transformers' own tensor-parallel plan) on the 1-d `mesh`, in place; return the model.

    For data parallelism on top, pass `mesh["tp"]` here and call `fully_shard` / `replicate` on
    `mesh["dp"]` after (shardops.fsdp).
    `expert_parallel=True`: the experts follow the model's expert-parallel plan instead (`model._ep_plan`),
    each rank holding its share of every MoE layer's experts, tokens routed to them by all_to_all.
    """
    mesh = as_mesh(mesh, "from_transformers")
    if mesh.ndim != 1 and expert_parallel:
        raise ShardingError(
            f"from_transformers: expert_parallel=True runs the experts over the given 1-d mesh, got {mesh}; "
            "for experts over (dp, tp) apply shardops.parallel.ExpertParallel() to each MoE block's experts "
            "on the 2-d mesh (docs/parallel.md, Expert parallelism)"
        )
    if mesh.ndim != 1:
        raise ShardingError(
            f'from_transformers: transformers\' plans are for a 1-d tensor-parallel mesh, got {mesh}; pass mesh["tp"] '
            "and add data parallelism with shardops.fsdp.fully_shard / replicate on mesh['dp']"
        )
    tp_plan = getattr(model, "_tp_plan", None) or getattr(model, "tp_plan", None)
    if not tp_plan:
        raise ShardingError(
            f"from_transformers: {type(model).__name__} has no tensor-parallel plan (model._tp_plan is empty); "
            "write a plan of shardops.parallel styles and call parallelize_module"
        )
    plan = dict(tp_plan)
    if expert_parallel:
        plan = _with_expert_plan(model, plan)
    parallelize_module(model, mesh, _shardops_plan(model, plan, use_local_output))
    _replicate_the_rest(model, mesh, as_dtensors=not use_local_output)
    if not use_local_output:
        _rotary_tables_replicated(model, mesh)
        _model_made_tensors_replicated(model)
    return model


def _rotary_tables_replicated(model: nn.Module, mesh: DeviceMesh) -> None:
    """The rotary embedding's (cos, sin), computed from positions alone, come out as Replicate DTensors
    (explicitly, so that the backward of q * cos meets a DTensor too)."""

    def replicated(module: nn.Module, args: Any, out: Any) -> Any:
        def wrap(t: Any) -> Any:
            return (
                from_local(t, mesh, [Replicate()] * mesh.ndim)
                if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
                else t
            )

        return tuple(wrap(t) for t in out) if isinstance(out, tuple) else wrap(out)

    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            module.register_forward_hook(replicated)


def _model_made_tensors_replicated(model: nn.Module) -> None:
    """With DTensor boundaries, transformers' forward builds tensors from shapes and positions alone (the
    rotary cos/sin, causal masks, a cache's empty placeholders): the same on every rank, and they meet
    DTensors. The model's forward runs inside implicit_replication() so that they are taken as Replicate,
    on purpose (a plain tensor meeting a DTensor raises elsewhere); its inputs go through the plan's
    boundaries as usual."""
    stack: list = []

    def enter(module: nn.Module, args: Any) -> None:
        context = implicit_replication()
        context.__enter__()
        stack.append(context)

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        stack.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


EXPERT_DISPATCH = "ep_dispatch_experts"
EXPERT_PARAM = "grouped_gemm"


def _with_expert_plan(model: nn.Module, tp_plan: dict[str, str]) -> dict[str, str]:
    """The tensor-parallel plan with the expert-parallel plan's entries in place of the experts' own.

    transformers: expert-parallel rules take precedence over tensor-parallel rules for the same
    modules. An `ep_dispatch_experts` module's tensor-parallel entries (its own and its parameters',
    `moe_tp_experts`, `packed_colwise`, ...) go; its `grouped_gemm` parameter entries add nothing,
    since ExpertParallel lays out every parameter of the experts module itself."""
    ep_plan = getattr(model, "_ep_plan", None) or getattr(model, "ep_plan", None)
    if not ep_plan:
        raise ShardingError(
            f"from_transformers: expert_parallel=True, but {type(model).__name__} has no expert-parallel plan "
            "(model._ep_plan is empty: not a mixture-of-experts model?); call it without expert_parallel"
        )
    dispatch = [key for key, kind in ep_plan.items() if kind == EXPERT_DISPATCH]
    for key, kind in ep_plan.items():
        if kind == EXPERT_DISPATCH:
            continue
        if kind != EXPERT_PARAM or key.rpartition(".")[0] not in dispatch:
            raise ShardingError(
                f"from_transformers: expert-parallel plan entry {key!r}: {kind!r} is not one shardops knows; known: "
                f"{EXPERT_DISPATCH!r} on an experts module, {EXPERT_PARAM!r} on that module's parameters"
            )
    plan = {
        key: kind for key, kind in tp_plan.items() if not any(key == d or key.startswith(d + ".") for d in dispatch)
    }
    plan.update({key: EXPERT_DISPATCH for key in dispatch})
    return plan


def _replicate_the_rest(model: nn.Module, mesh: DeviceMesh, *, as_dtensors: bool) -> None:
    """The parameters the plan leaves alone (norms, the router) get rank 0's values on every rank, as
    the plan's own parameters do (a randomly initialised router would otherwise differ per rank).
    With DTensor boundaries every module computes on DTensors, so they become Replicate DTensors
    too: their gradients are DTensors like the activations' (a plain parameter read next to
    DTensors would get a DTensor gradient)."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or isinstance(p, DTensor):
                continue
            if id(p) not in done:
                with torch.no_grad():
                    dt = distribute_param(p, mesh, [Replicate()], 0)
                    if not as_dtensors:
                        p.copy_(dt.to_local())
                done[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad) if as_dtensors else p
            module._parameters[name] = done[id(p)]


def _shardops_plan(model: nn.Module, tp_plan: dict[str, str], use_local_output: bool) -> dict[str, ParallelStyle]:
    """{concrete module path: style}: module entries by kind, parameter entries grouped on their owner."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    module_kind: dict[str, str] = {}
    param_kinds: dict[str, dict[str, str]] = {}
    for key, kind in tp_plan.items():
        pattern = _key_regex(key)
        hit_params = [n for n in params if pattern.fullmatch(n)]
        hit_modules = [n for n in modules if n and pattern.fullmatch(n)]
        if not hit_params and not hit_modules:
            continue  # a plan entry for a layer this config does not build (parallelize_module would warn)
        for name in hit_params:
            owner, _, pname = name.rpartition(".")
            param_kinds.setdefault(owner, {})[pname] = kind
        for name in hit_modules:
            module_kind[name] = kind
    plan: dict[str, ParallelStyle] = {}
    for path in sorted(set(module_kind) | set(param_kinds), key=lambda p: list(modules).index(p)):
        plan[path] = style_for(module_kind.get(path), param_kinds.get(path, {}), modules[path], use_local_output)
    return plan


def _key_regex(key: str) -> re.Pattern:
    """A plan key as a regex over dotted names: `*` stands for one path token (the layer number)."""
    return re.compile(
        r"\.".join("[^.]+" if tok == "*" else re.escape(tok).replace(r"\*", "[^.]*") for tok in key.split("."))
    )


def style_for(
    kind: str | None, param_kinds: dict[str, str], module: nn.Module, use_local_output: bool
) -> ParallelStyle:
    """The shardops style for one module: its own kind (None: only parameter entries) and its parameters' kinds."""
    u = use_local_output
    layouts = {name: _param_placement(k, module, name) for name, k in param_kinds.items()}
    if kind is None:
        return ParamLayouts(layouts)
    builders: dict[str, Callable[[], ParallelStyle]] = {
        "colwise": lambda: ColwiseParallel(use_local_output=u),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate(), use_local_output=u),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate(), use_local_output=u),
        "rowwise": lambda: RowwiseParallel(use_local_output=u),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate(), use_local_output=u),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate(), use_local_output=u),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), use_local_output=u),
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate(), use_local_output=u),
        "sequence_parallel": lambda: SequenceParallel(use_local_output=u),
        "replicated_with_grad_allreduce": lambda: ReplicatedWithGradSum(use_local_output=u),
        "packed_colwise": lambda: PackedColwiseParallel(use_local_output=u),
        "moe_tp_experts": lambda: LocalShardCompute(layouts, sum_output=True, use_local_output=u),
        "local_params": lambda: LocalShardCompute(layouts, sum_output=False, use_local_output=u),
        "moe_identity_expert": lambda: ScaleInput(),
        "all_reduce": lambda: SumOutput(use_local_output=u),
        "mla_kv_a_proj": lambda: RopeGradSum(),
        "replicate": lambda: ParamLayouts({}),
        EXPERT_DISPATCH: lambda: ExpertDispatch(use_local_output=u),
    }
    if kind not in builders:
        raise ShardingError(
            f"from_transformers: {type(module).__name__} has plan kind {kind!r}, which shardops does not know; "
            f"known kinds: {sorted(builders)}"
        )
    style = builders[kind]()
    if layouts and not isinstance(style, LocalShardCompute):
        return _Both(ParamLayouts(layouts), style)
    return style


def _param_placement(kind: str, module: nn.Module, name: str) -> Placement | None:
    """What a parameter-level plan entry means for that one parameter (transformers' shard_param)."""
    ndim = getattr(module, name).ndim
    if kind == "colwise":
        return Shard(max(ndim - 2, 0))
    if kind == "rowwise":
        return Replicate() if name == "bias" or ndim == 1 else Shard(ndim - 1)
    if kind == "packed_colwise":  # [gate; up] along the output dim: each half column-sharded
        return StridedShard(max(ndim - 2, 0), PACKED_SPLIT)
    if kind == "packed_rowwise":
        return Replicate() if ndim == 1 else StridedShard(ndim - 1, PACKED_SPLIT)
    if kind in ("embedding_rowwise", "embedding_colwise"):
        return Shard(0 if kind == "embedding_rowwise" else 1)
    if kind in ("replicate", "replicated_with_grad_allreduce", "local_params"):
        return None  # stays as it is
    raise ShardingError(
        f"from_transformers: parameter {type(module).__name__}.{name} has plan kind {kind!r}, which shardops does not "
        "know for a parameter"
    )


# --- styles for the kinds torch's parallel API has no name for ----------------------------


class ParamLayouts(ParallelStyle):
    """Lay out the module's own parameters as given (None: leave that one alone); the forward is untouched."""

    def __init__(self, layouts: dict[str, Placement | None]):
        self.layouts = {k: v for k, v in layouts.items() if v is not None}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.layouts:
            _distribute_params(module, device_mesh, self.layouts, self.src_data_rank)
        return module

    def __repr__(self) -> str:
        return f"ParamLayouts({self.layouts})"


class _Both(ParallelStyle):
    def __init__(self, first: ParallelStyle, second: ParallelStyle):
        self.first, self.second = first, second

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in (self.first, self.second):
            style.src_data_rank = self.src_data_rank
            style._apply(module, device_mesh)
        return module


class ReplicatedWithGradSum(ParallelStyle):
    """Replicated parameters of a module that sees only this rank's heads (Qwen3's q_norm/k_norm).

    Local outputs: the module computes on plain tensors and reads its parameter as a plain
    tensor whose gradient is Partial(sum) over the mesh (each rank's covers its heads), summed
    on the gradient's first read. DTensor boundaries: a Replicate DTensor parameter, whose
    gradient autograd gets right by itself.
    """

    def __init__(self, *, use_local_output: bool = True):
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute_params(module, device_mesh, {"*": Replicate()}, self.src_data_rank)
        if self.use_local_output:
            for name, p in module.named_parameters(recurse=False):
                assert isinstance(p, DTensor)  # _distribute_params made each one
                set_compute_layout(module, name, LocalView((Partial(),) * p.device_mesh.ndim))
        return module


def _local_with_summed_grad(module: nn.Module, x: Any, mesh: DeviceMesh) -> Any:
    """A replicated input as a plain tensor whose gradient is summed over the mesh (each rank's is partial)."""
    if not isinstance(x, torch.Tensor):
        return x
    if not (x.is_floating_point() or x.is_complex()):
        return x.to_local() if isinstance(x, DTensor) else x
    dt = move(module, to_dtensor(module, x, mesh, (Replicate(),)), mesh, (Replicate(),))
    return dt.to_local(grad_placements=(Partial(),))


class LocalShardCompute(ParallelStyle):
    """The module's forward runs on its parameters' local shards (transformers' moe_tp_experts, local_params).

    moe_tp_experts: every rank runs its shard of every expert (packed gate/up halves and the
    down projection's input dim are sharded alike), so its output is Partial(sum): the tensor
    inputs come in replicated with their gradient summed, the output leaves summed
    (Replicate; a DTensor with use_local_output=False).
    """

    def __init__(self, layouts: dict[str, Placement | None], *, sum_output: bool, use_local_output: bool = True):
        self.layouts = {k: v for k, v in layouts.items() if v is not None}
        self.sum_output = sum_output
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.layouts:
            _distribute_params(module, device_mesh, self.layouts, self.src_data_rank)
        # The forward reads each parameter's local shard as a plain tensor (a compute view, autograd-tracked:
        # the gradient lands in the DTensor), whose gradient is this rank's whole share of that shard's.
        for name, p in module.named_parameters(recurse=False):
            if isinstance(p, DTensor):
                set_compute_layout(module, name, LocalView(p.placements, p.placements))
            else:  # left alone by the plan (replicated later by from_transformers): read whole
                set_compute_layout(module, name, LocalView((Replicate(),) * device_mesh.ndim))
        module.register_forward_pre_hook(partial(self._enter, device_mesh), with_kwargs=True)
        if self.sum_output:
            module.register_forward_hook(partial(self._leave, device_mesh), always_call=True)
        return module

    def _enter(self, mesh, module, args, kwargs):
        if self.sum_output:
            args = tuple(_local_with_summed_grad(module, a, mesh) for a in args)
            kwargs = {k: _local_with_summed_grad(module, v, mesh) for k, v in kwargs.items()}
        else:
            args = tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)
            kwargs = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in kwargs.items()}
        return args, kwargs

    def _leave(self, mesh, module, args, output):
        if not isinstance(output, torch.Tensor):
            return output
        return _sum_over_mesh(module, output, mesh, self.use_local_output)


def _sum_over_mesh(module: nn.Module, out: torch.Tensor, mesh: DeviceMesh, use_local_output: bool) -> torch.Tensor:
    dt = out if isinstance(out, DTensor) else from_local(out, mesh, (Partial(),))
    dt = move(module, dt, mesh, (Replicate(),))
    return dt.to_local() if use_local_output else dt


class SumOutput(ParallelStyle):
    """transformers' all_reduce: the module's output is partial on every rank; sum it over the mesh."""

    def __init__(self, *, use_local_output: bool = True):
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def leave(mod, args, out):
            return None if out is None else _sum_over_mesh(mod, out, device_mesh, self.use_local_output)

        module.register_forward_hook(leave)
        return module


class ScaleInput(ParallelStyle):
    """transformers' moe_identity_expert: an identity expert's input divided by the mesh size, so that the
    experts' sum over the mesh counts it once."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(lambda mod, args: (args[0] / device_mesh.size(), *args[1:]))
        return module


class RopeGradSum(ParallelStyle):
    """transformers' mla_kv_a_proj: the output's last `config.qk_rope_head_dim` features bypass the
    column-parallel projection that follows, so their gradient is partial: summed over the mesh."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def leave(mod, args, out):
            rope = getattr(getattr(mod, "config", None), "qk_rope_head_dim", None)
            if rope is None:
                raise ShardingError(
                    f"from_transformers: mla_kv_a_proj on {type(mod).__name__} needs module.config.qk_rope_head_dim"
                )
            local = out.to_local() if isinstance(out, DTensor) else out
            kv, rot = local.split([local.shape[-1] - rope, rope], dim=-1)
            return torch.cat([kv, _local_with_summed_grad(mod, rot, device_mesh)], dim=-1)

        module.register_forward_hook(leave)
        return module


class ExpertDispatch(ParallelStyle):
    """transformers' ep_dispatch_experts on the tensor-parallel ranks: ExpertParallel over the whole mesh.

    Between the plan's boundaries the tokens are replicated over the mesh (plain tensors, or
    Replicate DTensors). Each rank takes its slice of them (free), routes it to the experts' ranks
    and back (ExpertParallel: counts, dispatch, combine, three all_to_alls), and the output is
    gathered back to the layout the tokens came in (one all_gather; its backward is a free slice,
    the slice's backward an all_gather of the row gradients), a plain tensor if they came plain.
    """

    def __init__(self, *, use_local_output: bool = True):
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style = ExpertParallel(use_local_output=False)
        style.src_data_rank = self.src_data_rank
        style._apply(module, device_mesh)
        module.forward = _ReplicatedTokensRouted(
            module.forward, device_mesh
        )  # an instance attribute, as ExpertParallel's
        return module


class _ReplicatedTokensRouted:
    def __init__(self, routed: Callable, mesh: DeviceMesh):
        self.routed = routed
        self.mesh = mesh

    def __call__(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        plain = not isinstance(hidden_states, DTensor)
        if plain:  # the same tokens on every rank: Replicate, whose gradient comes back whole on each rank
            replicate = (Replicate(),) * self.mesh.ndim
            hidden_states, top_k_index, top_k_weights = (
                t if isinstance(t, DTensor) else from_local(t, self.mesh, replicate)
                for t in (hidden_states, top_k_index, top_k_weights)
            )
        out = self.routed(hidden_states, top_k_index, top_k_weights)
        if out.placements != hidden_states.placements:
            out = out.redistribute(placements=hidden_states.placements)
        return out.to_local() if plain else out


class PackedColwiseParallel(ColwiseParallel):
    """A linear layer whose weight packs [gate; up] along its output features: each half column-sharded
    (StridedShard(0, 2)), so the local output holds this rank's gate slice then its up slice. The output
    stays in the layout the matmul gives (StridedShard on the last dim), a local tensor when use_local_output."""

    def __init__(self, *, use_local_output: bool = True):
        super().__init__(use_local_output=use_local_output)

    def _layouts_for(self, module):
        return {"*": StridedShard(0, PACKED_SPLIT)}, (Replicate(),)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ShardingError(
                f"from_transformers: a packed_colwise module entry needs nn.Linear, not {type(module).__name__}"
            )
        params, desired = self._layouts_for(module)
        src, local = self.src_data_rank, self.use_local_output
        return distribute_module(
            module,
            device_mesh,
            lambda name, m, mesh: _distribute_params(m, mesh, params, src) if m is module else None,
            partial(self._prepare_input_fn, self.input_layouts, desired),
            lambda mod, out, mesh: out.to_local() if local and isinstance(out, DTensor) else out,
        )
