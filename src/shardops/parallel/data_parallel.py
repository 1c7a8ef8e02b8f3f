"""Data parallelism over the mesh dims a tensor-parallel plan does not use, with the batch as a
DTensor on the whole mesh.

    model = parallelize_module(model, mesh["tp"], plan)          # optional
    model = data_parallel(model, mesh, mode="replicate")         # or mode="shard"

Torch-style data parallelism is `shardops.fsdp` (`fully_shard`, `replicate`): only parameters
are distributed and activations keep the local batch, so any model code runs (docs/fsdp.md);
the training job, README and docs use it. `data_parallel` is the older convenience kept for
what builds on its whole-mesh layouts (expert parallelism's token dispatch, the autoparallel
planner's candidates, `from_transformers`' docs, pipelining's tests): every boundary tensor
holds the whole batch as its global shape, so every op of the model needs a sharding rule and
code reading a batch size from a tensor sees the global one. New code uses `shardops.fsdp`.

The batch is split over the data-parallel dims (every mesh dim the parameters do
not already live on; all of them without a plan): each rank feeds its own batch
shard, as with torch's DDP/FSDP, and every parallel boundary of the plan lays its
tensors out on the whole mesh (batch sharded over dp, the plan's placement over tp).
Without a plan, the model's plain tensor inputs become DTensors sharded on
`batch_dim` (equal batch shards, as a distributed sampler gives; for uneven ones
pass DTensors with their global shape, e.g. `so.from_local(x, mesh, [Shard(0)],
shape=...)`, which pass through) and the whole model runs on DTensors. The model's DTensor outputs come
out sharded on `batch_dim` over dp (a target then comes as this rank's shard, said
explicitly: `from_local(target, mesh, [Shard(0), ...])`; loss_parallel refuses a plain
one there, as torch does). A loss computed on the DTensor
outputs (mean over the batch) is the global loss, exact on uneven batches, and is not
divided again; a loss computed on plain local tensors (use_local_output=True, or
`out.to_local()`) is the rank's local loss, and its gradients are averaged over the
data-parallel ranks, as torch's DDP and FSDP do (the mesh's `data_parallel_dims` tell
to_local/from_local to convert between the two conventions: tensor.dp_grad_scale).

Collectives per training step for the parameters (the activations move as the plan says):

Parameters of modules the plan leaves alone (they compute on plain local tensors)
are stored like the others and read in forward as plain tensors whose gradient is
Partial(sum) over dp (each rank's covers its own batch shard): the collectives below
apply to them too.

- mode="replicate": parameters replicated over dp. Forward and backward issue none
  for them: a weight's gradient comes back pending (Partial(sum) over dp), and its
  first read (the optimizer step, or clip_grad_norm_) resolves it with one
  all_reduce over dp, once per step however often the optimizer reads it (over dp
  and tp together for a sequence-parallel norm weight). Where compiled code reads
  it (a compiled train step or optimizer step), backward makes that all_reduce as it
  accumulates the gradient, as DDP does: a graph cannot change its input's layout
  (docs/compile.md).
- mode="shard" (FSDP-style): each parameter is stored sharded over dp on a dim the
  plan does not shard, so the optimizer state is sharded too and the step is local.
  Forward: one all_gather over dp per parameter and module use (a compute view,
  _views); backward: one reduce_scatter over dp per parameter and use (the gather's
  backward), the gradient arriving in the storage layout. A parameter whose every
  dim the plan shards (a column-parallel bias) stays replicated over dp (replicate path).
  The gathered weights are kept by autograd until backward (no re-gather).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .._torch import pytree
from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..placements import Partial, Placement, Replicate, Shard, StridedShard
from ..tensor import DTensor, from_local
from ._layout import DATA_PARALLEL_ATTR, DataParallelLayout, as_mesh, distribute_param
from ._views import VIEWS_ATTR, LocalView, set_compute_layout
from .expert import expert_parameters

__all__ = ["data_parallel"]

MODES = ("replicate", "shard")


def data_parallel(
    module: nn.Module, device_mesh: DeviceMesh, mode: str = "replicate", *, batch_dim: int = 0
) -> nn.Module:
    """Make `module` data-parallel over the dims of `device_mesh` its parameters do not use (see module doc)."""
    mesh = as_mesh(device_mesh, "data_parallel")
    if mode not in MODES:
        raise ShardingError(f"data_parallel: mode must be one of {MODES}, got {mode!r}")
    if any(getattr(m, DATA_PARALLEL_ATTR, None) is not None for m in module.modules()):
        raise ShardingError("data_parallel: this module is already data-parallel")
    experts = expert_parameters(module, mesh)  # already laid out on the whole mesh: their ep dims are data dims
    sub_meshes = {p.device_mesh for p in module.parameters() if isinstance(p, DTensor) and id(p) not in experts}
    layout = DataParallelLayout(mesh, _dp_dims(mesh, sub_meshes), batch_dim, mode)
    if mesh.data_parallel_dims not in ((), layout.dp_dims):
        raise ShardingError(
            f"data_parallel: {mesh} already splits the batch over mesh dims {mesh.data_parallel_dims}, this module "
            f"would over {layout.dp_dims}; give both modules the same data-parallel dims (or separate meshes)"
        )
    mesh.data_parallel_dims = layout.dp_dims  # the loss convention on these dims (tensor.dp_grad_scale)
    lifted: dict[int, nn.Parameter] = {}
    lifted_buffers: dict[int, DTensor] = {}
    outside_plan: set[int] = set()  # lifted parameters that were plain: their modules compute on local tensors
    for sub in module.modules():
        sub.__dict__[DATA_PARALLEL_ATTR] = layout
        for name, p in list(sub._parameters.items()):
            if p is None or id(p) in experts:
                continue
            if id(p) not in lifted:
                lifted[id(p)] = nn.Parameter(_lift(p, layout), requires_grad=p.requires_grad)
                if sub_meshes and not isinstance(p, DTensor):
                    outside_plan.add(id(lifted[id(p)]))
            sub._parameters[name] = lifted[id(p)]
        _lift_buffers(sub, layout, lifted_buffers)
        _lift_compute_views(sub, layout, outside_plan, experts)
    if not sub_meshes:
        module.register_forward_pre_hook(_batch_inputs(layout), with_kwargs=True)
    module.register_forward_hook(_batch_outputs(layout))
    return module


def _lift_buffers(sub: nn.Module, layout: DataParallelLayout, lifted: dict[int, DTensor]) -> None:
    """DTensor buffers a style laid out on the tp mesh (distribute_module replicates a module's buffers,
    e.g. Gemma's embedding scale) move to the whole mesh like the parameters, replicated over dp: the
    module's forward mixes them with activations that live on the whole mesh (rank 0 of each dp group
    wins, as for parameters). Plain buffers stay plain; buffers are never sharded over dp."""
    for name, b in list(sub._buffers.items()):
        if not isinstance(b, DTensor) or b.device_mesh == layout.mesh:
            continue
        if id(b) not in lifted:
            with torch.no_grad():
                placements = layout.lift_param(b.device_mesh, b.placements)
                local = layout.mesh.comm.broadcast(
                    b.to_local().detach().contiguous(), 0, layout.mesh.group(layout.dp_dims)
                )
                lifted[id(b)] = from_local(local, layout.mesh, placements, shape=b.shape, stride=b.stride())
        sub._buffers[name] = lifted[id(b)]


def _dp_dims(mesh: DeviceMesh, sub_meshes: set[DeviceMesh]) -> tuple[int, ...]:
    if not sub_meshes:
        return tuple(range(mesh.ndim))
    used: set[str] = set()
    for sub in sub_meshes:
        names = sub.mesh_dim_names or ()
        if sub == mesh or not names or not mesh.mesh_dim_names or any(n not in mesh.mesh_dim_names for n in names):
            raise ShardingError(
                f"data_parallel: the module's parameters live on {sub}; give data_parallel the whole mesh they were "
                "sliced from by name (e.g. parallelize_module(m, mesh['tp'], plan), then data_parallel(m, mesh)), got "
                f"{mesh}"
            )
        used.update(names)
    dims = tuple(d for d, n in enumerate(mesh.mesh_dim_names or ()) if n not in used)
    if not dims:
        raise ShardingError(
            f"data_parallel: every dim of {mesh} is used by the tensor-parallel plan; no dim is left for data"
        )
    return dims


def _lift(p: torch.Tensor, layout: DataParallelLayout) -> DTensor:
    """The parameter on the whole mesh: replicated over dp (rank 0 of each dp group wins),
    then sharded in "shard" mode."""
    mesh = layout.mesh
    with torch.no_grad():
        if isinstance(p, DTensor):
            placements = layout.lift_param(p.device_mesh, p.placements)
            group = mesh.group(layout.dp_dims)
            local = mesh.comm.broadcast(p.to_local().detach().contiguous(), 0, group)
            dt = from_local(local, mesh, placements, shape=p.shape, stride=p.stride())
        else:
            dt = distribute_param(p, mesh, [Replicate()] * mesh.ndim, 0)
        if layout.mode == "shard":
            stored = _storage_layout(dt, layout)
            if stored != dt.placements:
                dt = dt.redistribute(placements=stored)  # replicate -> shard: local slicing, no collective
    return dt


def _storage_layout(dt: DTensor, layout: DataParallelLayout) -> tuple[Placement, ...]:
    """FSDP storage: the dp dims shard the first tensor dim no other mesh dim shards (none free: replicated)."""
    taken = {p.dim for p in dt.placements if isinstance(p, (Shard, StridedShard))}
    free = next((d for d in range(dt.ndim) if d not in taken), None)
    if free is None:
        return dt.placements
    return tuple(Shard(free) if d in layout.dp_dims else p for d, p in enumerate(dt.placements))


def _compute_layout(stored: tuple[Placement, ...], layout: DataParallelLayout) -> tuple[Placement, ...]:
    return tuple(Replicate() if d in layout.dp_dims else p for d, p in enumerate(stored))


def _lift_compute_views(sub: nn.Module, layout: DataParallelLayout, outside_plan: set[int], experts: set[int]) -> None:
    """Views given on the tp mesh move to the whole mesh; a module outside the plan reads its
    parameters as local views; FSDP adds a gather view per dp-sharded parameter."""
    views = sub.__dict__.get(VIEWS_ATTR, {})
    local = LocalView(
        tuple(Partial() if d in layout.dp_dims else Replicate() for d in range(layout.mesh.ndim)),
        only_for_plain_inputs=True,
    )
    for name, p in sub._parameters.items():
        if not isinstance(p, DTensor) or id(p) in experts:
            continue
        old = views.get(name)
        if isinstance(old, LocalView):
            set_compute_layout(sub, name, _lift_local_view(layout, _sub_mesh_of(layout, p), old))
        elif old is None and id(p) in outside_plan:
            set_compute_layout(sub, name, local)  # each dp rank's gradient covers its own batch shard
        elif old is not None:
            set_compute_layout(sub, name, layout.lift_param(_sub_mesh_of(layout, p), old))
        elif layout.mode == "shard":
            compute = _compute_layout(p.placements, layout)
            if compute != p.placements:
                set_compute_layout(sub, name, compute)


def _lift_local_view(layout: DataParallelLayout, sub: DeviceMesh, view: LocalView) -> LocalView:
    """A plan's local view on the whole mesh: the same piece over tp (replicated over dp), its gradient
    declared as the plan said over tp (a per-head norm's Partial stays Partial) and Partial(sum) over
    dp, where each rank's gradient covers its own batch shard."""
    grad = tuple(Partial() if d in layout.dp_dims else q for d, q in enumerate(layout.lift(sub, view.grad_placements)))
    placements = None if view.placements is None else layout.lift_param(sub, view.placements)
    return LocalView(grad, placements)


def _sub_mesh_of(layout: DataParallelLayout, p: DTensor) -> DeviceMesh:
    """The tp sub-mesh a lifted parameter came from (its non-dp dims, by name)."""
    names = [n for d, n in enumerate(layout.mesh.mesh_dim_names or ()) if d not in layout.dp_dims]
    return layout.mesh[names[0]] if len(names) == 1 else layout.mesh[tuple(names)]


def _batch_outputs(layout: DataParallelLayout):
    """The root's DTensor outputs come out batch-sharded over dp (whatever layout the planner left),
    so that a target laid out as this rank's batch shard lines up with them (see loss_parallel)."""

    def place(x):
        if isinstance(x, DTensor) and x.device_mesh == layout.mesh and x.ndim > layout.batch_dim:
            want = tuple(Shard(layout.batch_dim) if d in layout.dp_dims else p for d, p in enumerate(x.placements))
            return x if want == x.placements else x.redistribute(placements=want)
        return x

    def hook(module, args, outputs):
        return pytree.tree_map(place, outputs)

    return hook


def _batch_inputs(layout: DataParallelLayout):
    """Without a plan: the root's plain tensor inputs are this rank's batch shard."""
    placements = [Shard(layout.batch_dim) if d in layout.dp_dims else Replicate() for d in range(layout.mesh.ndim)]

    def wrap(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.ndim > layout.batch_dim:
            return from_local(x, layout.mesh, placements)
        return x

    def hook(module, args, kwargs):
        return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}

    return hook
