"""`PipelineStage`: one stage of a model split by depth, and its forward/backward per micro-batch.

A stage keeps, per micro-batch in flight, the inputs it received (leaves that require grad,
so their .grad is what goes back to the previous stage) and the outputs it computed; the
backward of that micro-batch frees them. The schedule (schedules.py) decides the order and
moves tensors between stages; the stage only computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..comm.base import Group
from ..errors import ShardingError
from ..world import current_comm, in_threads_world
from . import _split_backward


@dataclass(frozen=True)
class TensorMeta:
    """What a tensor crossing a stage boundary looks like: enough to allocate its receive buffer.

    A DTensor crosses as its local shard (`shape`) and its layout (`placements`, `global_shape`):
    the receiving stage rebuilds it on its own mesh, nothing is gathered.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False
    placements: tuple[str, ...] | None = None  # "R", "S<dim>", "P<op>"; None: a plain tensor
    global_shape: tuple[int, ...] | None = None

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        requires_grad = bool(t.requires_grad or t.is_floating_point())
        d: Any = t  # a DTensor (shardops' or torch's) where it has placements
        if hasattr(d, "placements"):
            local = d.to_local()
            return TensorMeta(
                tuple(local.shape), t.dtype, requires_grad, tuple(_encode(p) for p in d.placements), tuple(t.shape)
            )
        return TensorMeta(tuple(t.shape), t.dtype, requires_grad)

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def wrap(self, local: torch.Tensor, mesh: Any) -> torch.Tensor:
        """The tensor this meta describes, from its local part (a DTensor on `mesh` where it is one)."""
        if self.placements is None:
            return local
        from ..tensor import from_local

        return from_local(local, mesh, [_decode(p) for p in self.placements], shape=self.global_shape)

    def describe(self) -> str:
        shape = list(self.shape if self.global_shape is None else self.global_shape)
        layout = "" if self.placements is None else f" ({', '.join(self.placements)}; local {list(self.shape)})"
        return f"{str(self.dtype).replace('torch.', '')}{shape}{layout}"


def _encode(placement: Any) -> str:
    from ..placements import Partial, Replicate, Shard

    if type(placement) is Shard:
        return f"S{placement.dim}"
    if type(placement) is Replicate:
        return "R"
    if type(placement) is Partial:
        return f"P{placement.reduce_op}"
    raise ShardingError(
        f"PipelineStage: a DTensor with placement {placement!r} cannot cross a stage boundary yet; redistribute it to "
        "Shard, Replicate or Partial"
    )


def _decode(code: str) -> Any:
    from ..placements import Partial, Replicate, Shard

    if code == "R":
        return Replicate()
    return Shard(int(code[1:])) if code[0] == "S" else Partial(code[1:])


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What travels: a DTensor's local shard, a plain tensor itself."""
    d: Any = t  # a DTensor (shardops' or torch's) where it has placements
    return d.to_local() if hasattr(d, "placements") else t


def as_tuple(value: Any, what: str) -> tuple[torch.Tensor, ...]:
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    for v in values:
        if not isinstance(v, torch.Tensor) or hasattr(v, "placements"):
            raise ShardingError(
                f"PipelineStage: {what} must be plain tensors (or a tuple of them), got {type(v).__name__}"
            )
    return values


def resolve_group(group: Any) -> Group:
    """The shardops Group of `group`: a shardops Group (the threads world's `mesh.get_group()`), a torch
    ProcessGroup (torch.distributed's), or None for every rank of the world."""
    comm = current_comm()
    if group is None:
        return comm.world_group()
    if isinstance(group, Group):
        return group
    if in_threads_world():
        raise ShardingError(
            f"PipelineStage: group {group!r} is not a shardops group; in so.run pass mesh['pp'].get_group()"
        )
    return comm.adopt_process_group(group)  # type: ignore[attr-defined]


class PipelineStage:
    """torch.distributed.pipelining.PipelineStage: `submodule` is stage `stage_index` of `num_stages`.

    `input_args`/`output_args` (example tensors of one micro-batch) are optional: without them
    the first `step` infers the shapes crossing each boundary, and with them it checks them.
    `group`: the ranks of this pipeline (`mesh["pp"].get_group()`), default the whole world.
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str,
        input_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        output_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        group: Any = None,
    ) -> None:
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ShardingError(f"PipelineStage: num_stages must be a positive int, got {num_stages!r}")
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ShardingError(f"PipelineStage: stage_index {stage_index!r} is not in [0, {num_stages})")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = resolve_group(group)
        self.rank = current_comm().rank
        if self.rank not in self.group.ranks:
            raise ShardingError(f"PipelineStage: rank {self.rank} is not in its group {list(self.group.ranks)}")
        self.group_rank = self.group.index(self.rank)
        self.group_size = self.group.size
        self.declared_inputs = (
            None if input_args is None else tuple(TensorMeta.of(t) for t in as_tuple(input_args, "input_args"))
        )
        self.declared_outputs = (
            None if output_args is None else tuple(TensorMeta.of(t) for t in as_tuple(output_args, "output_args"))
        )
        # set by the schedule's first step (the metadata exchange)
        self.input_metas: tuple[TensorMeta, ...] | None = None
        self.output_metas: tuple[TensorMeta, ...] | None = None
        self.stage_to_rank: Callable[[int], int] = lambda s: self.group.ranks[s % self.group_size]
        self._inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._weight_work: dict[int, _split_backward.WeightWork] = {}  # split backwards' W still to run
        self.peak_in_flight = 0  # the most micro-batches whose activations this stage held at once
        self.backwards_left = 0  # this step's micro-batch backwards still to run (set by the schedule)

    @property
    def mesh(self) -> Any:
        """The mesh DTensors arriving here are rebuilt on: the one the stage's own DTensor parameters live on."""
        for t in (*self.submod.parameters(), *self.submod.buffers()):
            if hasattr(t, "device_mesh"):
                return t.device_mesh
        raise ShardingError(
            f"stage {self.stage_index} receives DTensors but has no DTensor parameters to take their mesh from; "
            "parallelize the stage's module, or send plain tensors (use_local_output=True)"
        )

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index} of {self.num_stages}, rank {self.rank})"

    # -- one micro-batch
    def forward_one_chunk(
        self, mb: int, args: Sequence[torch.Tensor], target: torch.Tensor | None, loss_fn: Callable | None
    ) -> tuple[torch.Tensor, ...]:
        """Run the stage on micro-batch `mb`; on the last stage with a loss_fn, also its loss."""
        if self.is_first:
            inputs = tuple(args)
        else:  # leaves: their .grad after the backward is what the previous stage needs
            inputs = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in args)
        out = self.submod(*inputs)
        outputs = out if isinstance(out, tuple) else (out,)
        self._inputs[mb] = inputs
        self._outputs[mb] = outputs
        self.peak_in_flight = max(self.peak_in_flight, len(self._outputs) + len(self._weight_work))
        if self.is_last and loss_fn is not None and torch.is_grad_enabled():
            if target is None:
                raise ShardingError("Pipeline schedule: the last stage has a loss_fn but step() got no target")
            self._losses[mb] = loss_fn(out, target)
        return outputs

    def backward_one_chunk(self, mb: int, output_grads: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        """Backward of micro-batch `mb`; returns the gradients of its inputs (for the previous stage)."""
        inputs, outputs = self._inputs.pop(mb), self._outputs.pop(mb)
        self.backwards_left -= 1
        _sync_gradients_on_last_backward(self.submod, self.backwards_left <= 0)
        roots, grads = self._backward_roots(mb, outputs, output_grads)
        if roots:
            torch.autograd.backward(roots, grads)
        if self.is_first:
            return ()
        return tuple(_input_grad(x) for x in inputs)

    def backward_input_one_chunk(
        self, mb: int, output_grads: Sequence[torch.Tensor] | None
    ) -> tuple[torch.Tensor, ...]:
        """The first half of a split backward (zero-bubble schedules' I): only the gradients of micro-batch `mb`'s
        inputs, for the previous stage; what the weights still need is kept for `backward_weight_one_chunk`."""
        inputs, outputs = self._inputs.pop(mb), self._outputs.pop(mb)
        roots, grads = self._backward_roots(mb, outputs, output_grads)
        params = [q for q in self.submod.parameters() if q.requires_grad]
        found, self._weight_work[mb] = _split_backward.backward_input(
            roots, grads, () if self.is_first else inputs, params
        )
        if self.is_first:
            return ()
        for x, g in zip(inputs, found):
            x.grad = g
        return tuple(_input_grad(x) for x in inputs)

    def backward_weight_one_chunk(self, mb: int) -> None:
        """The second half (W): micro-batch `mb`'s gradients of the stage's parameters, accumulated into .grad."""
        work = self._weight_work.pop(mb)
        self.backwards_left -= 1
        _sync_gradients_on_last_backward(self.submod, self.backwards_left <= 0)
        _split_backward.backward_weight(work)

    def _backward_roots(
        self, mb: int, outputs: tuple[torch.Tensor, ...], output_grads: Sequence[torch.Tensor] | None
    ) -> tuple[tuple, tuple]:
        """What a backward of micro-batch `mb` starts from: the loss on the last stage, else the outputs
        that need grad with their incoming gradients."""
        if self.is_last:
            if mb not in self._losses:
                raise ShardingError("Pipeline schedule: a backward on the last stage needs a loss_fn and a target")
            return (self._losses[mb],), (None,)
        pairs = [(o, g) for o, g in zip(outputs, output_grads or ()) if o.requires_grad and g is not None]
        return tuple(o for o, _ in pairs), tuple(g for _, g in pairs)

    def take_losses(self) -> list[torch.Tensor]:
        losses = [self._losses[mb].detach() for mb in sorted(self._losses)]
        self._losses.clear()
        return losses

    def clear_runtime_states(self) -> None:
        self._inputs.clear()
        self._outputs.clear()
        self._losses.clear()
        self._weight_work.clear()

    def scale_grads(self, factor: int) -> None:
        """Divide every gradient by `factor` (the micro-batch count: the step's loss is their mean)."""
        with torch.no_grad():
            for p in self.submod.parameters():
                if p.grad is not None:
                    p.grad.div_(factor)


def _sync_gradients_on_last_backward(module: nn.Module, last: bool) -> None:
    """A data-parallel stage (fully_shard or replicate) accumulates its micro-batches' gradients unreduced
    and reduces them once, in the step's last backward (as torch's stage does), not once per micro-batch."""
    from ..fsdp import (
        FSDPModule,
    )  # below pipelining; imported here so a stage without data parallelism needs none of it
    from ..fsdp.replicate import replicate_state

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_requires_gradient_sync(last, recurse=False)
        state = replicate_state(sub)
        if state is not None:
            state.requires_gradient_sync = last


def _input_grad(x: torch.Tensor) -> torch.Tensor:
    """The gradient going back for input `x`, in x's own layout (what the sending stage's output meta says)."""
    if x.grad is None:
        return torch.zeros_like(x)
    d: Any = x  # a DTensor (shardops' or torch's) where it has placements
    if hasattr(d, "placements") and tuple(d.grad.placements) != tuple(d.placements):
        return d.grad.redistribute(d.device_mesh, d.placements)
    return x.grad
