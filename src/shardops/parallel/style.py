"""Parallel styles: how one module's parameters are laid out and how its inputs and outputs move.

Names, keyword arguments and defaults are those of torch.distributed.tensor.parallel
(torch 2.13), so a plan written for torch ports by changing its import. Placements
may be ours or torch's (converted). Differences, each on purpose:

- an input that is already a DTensor is moved to the layout the module needs from
  the layout it really has (torch trusts the declared `input_layouts`);
- `SequenceParallel` broadcasts the parameters from `src_data_rank` (torch assumes
  every rank initialised them alike);
- a module a style does not support raises `ShardingError` (torch: NotImplementedError).

Boundaries lay tensors out on the mesh the plan was given (_layout); data parallelism on
`mesh["dp"]` (shardops.fsdp) leaves them there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from ..errors import LayoutMismatchError, ShardingError
from ..mesh import DeviceMesh
from ..placements import Placement, Replicate, Shard
from ..tensor import DTensor
from ._layout import as_layouts, as_placement, distribute_param, move, to_dtensor
from .distribute import distribute_module

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
]


class ParallelStyle(ABC):
    """What `parallelize_module` applies to one module."""

    src_data_rank: int | None = 0

    @abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module: ...


def _distribute_params(
    module: nn.Module, mesh: DeviceMesh, placements_of: dict[str, Placement], src_data_rank: int | None
) -> None:
    """Replace the module's own parameters by DTensor parameters laid out as given."""
    for name, param in list(module.named_parameters(recurse=False)):
        placement = placements_of.get(name, placements_of.get("*"))
        if placement is None or isinstance(param, DTensor):
            continue
        with torch.no_grad():
            dt = distribute_param(param, mesh, [placement], src_data_rank)
        module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def _first_input(module: nn.Module, inputs: tuple) -> Any:
    if not inputs:
        raise ShardingError(f"{type(module).__name__}: a parallel style needs the module's first positional input")
    return inputs[0]


def _prepare_output(output_layouts, use_local_output: bool, mod, outputs, mesh):
    if not isinstance(outputs, DTensor):
        raise ShardingError(
            f"{type(mod).__name__}: expected a DTensor output at a parallel boundary, got {type(outputs).__name__}"
        )
    outputs = move(mod, outputs, mesh, output_layouts)
    return outputs.to_local() if use_local_output else outputs


class _OneInOneOutStyle(ParallelStyle):
    """A style with one input and one output layout, each defaulting to the subclass's (torch's keywords)."""

    _default_input: Placement  # each subclass's
    _default_output: Placement

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ):
        super().__init__()
        self.input_layouts = (as_placement(input_layouts) or self._default_input,)
        self.output_layouts = (as_placement(output_layouts) or self._default_output,)
        self.use_local_output = use_local_output


class _LinearEmbeddingStyle(_OneInOneOutStyle):
    """Shared by Colwise/Rowwise: one input, one output, nn.Linear and nn.Embedding only."""

    def __init__(self, **layouts: Any) -> None:
        super().__init__(**layouts)
        self.desired_input_layouts: tuple[Placement, ...] = (
            Replicate(),
        )  # Rowwise on nn.Linear: Shard(-1), set in _apply

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = to_dtensor(mod, _first_input(mod, inputs), device_mesh, input_layouts)
        return move(mod, x, device_mesh, desired_input_layouts)

    def _layouts_for(self, module: nn.Module) -> tuple[dict[str, Placement], tuple[Placement, ...]]:
        """(parameter placements, input layout the module computes on)."""
        raise NotImplementedError

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise ShardingError(
                f"{type(self).__name__} supports nn.Linear and nn.Embedding, not {type(module).__name__}; "
                "use PrepareModuleInput/Output or distribute_module for other modules"
            )
        params, desired = self._layouts_for(module)
        self.desired_input_layouts = desired
        src = self.src_data_rank
        return distribute_module(
            module,
            device_mesh,
            lambda name, m, mesh: _distribute_params(m, mesh, params, src) if m is module else None,
            partial(self._prepare_input_fn, self.input_layouts, desired),
            partial(_prepare_output, self.output_layouts, self.use_local_output),
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
            f"use_local_output={self.use_local_output})"
        )


class ColwiseParallel(_LinearEmbeddingStyle):
    """nn.Linear: weight and bias Shard(0) (output features); nn.Embedding: table Shard(1) (embedding dim).

    Input: `input_layouts` (default Replicate), moved to Replicate. Output: `output_layouts`
    (default Shard(-1)), a local tensor when `use_local_output` (default True).
    """

    _default_input = Replicate()
    _default_output = Shard(-1)

    def _layouts_for(self, module):
        if isinstance(module, nn.Linear):
            return {"*": Shard(0)}, (Replicate(),)
        return {"*": Shard(1)}, (Replicate(),)


class RowwiseParallel(_LinearEmbeddingStyle):
    """nn.Linear: weight Shard(1) (input features), bias Replicate; nn.Embedding: table Shard(0) (vocabulary).

    Input: `input_layouts` (default Shard(-1)), moved to Shard(-1) (Linear) or Replicate
    (Embedding). Output: `output_layouts` (default Replicate), local when `use_local_output`.
    The vocabulary-sharded table's gradient stays Shard(0) (torch's comes back Replicate).
    """

    _default_input = Shard(-1)
    _default_output = Replicate()

    def _layouts_for(self, module):
        if isinstance(module, nn.Linear):
            return {"weight": Shard(1), "bias": Replicate()}, (Shard(-1),)
        return {"*": Shard(0)}, (Replicate(),)


class SequenceParallel(ParallelStyle):
    """Replicated parameters, input and output sharded on `sequence_dim` (norms, dropout).

    The parameters' gradients come back pending (Partial(sum) over the sequence shards)
    and are reduced once, on their first read (torch re-reduces on every read).
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        super().__init__()
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        x = _first_input(mod, inputs)
        if isinstance(x, DTensor):
            return move(mod, x, device_mesh, sequence_sharding)
        if isinstance(x, torch.Tensor):
            return to_dtensor(mod, x, device_mesh, sequence_sharding)
        raise ShardingError(f"expecting input of {mod} to be a torch.Tensor or DTensor, but got {x!r}")

    @staticmethod
    def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
        return outputs.to_local() if use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        src = self.src_data_rank
        return distribute_module(
            module,
            device_mesh,
            lambda name, m, mesh: _distribute_params(m, mesh, {"*": Replicate()}, src),
            partial(self._prepare_input_fn, self.sequence_sharding),
            partial(self._prepare_output_fn, self.use_local_output),
        )

    def __repr__(self) -> str:
        return (
            f"SequenceParallel(sequence_dim={self.sequence_sharding[0].dim}, use_local_output={self.use_local_output})"
        )


def _check_pairs(layouts, desired, what: str, names: str) -> None:
    """Layouts and desired layouts pair up one to one (torch asserts it: an AssertionError there and here)."""
    if layouts is not None:
        if desired is None:
            raise LayoutMismatchError(
                f"desired module inputs should not be None! {what}: desired layouts must be given with the layouts"
            )
        if len(layouts) != len(desired):
            raise LayoutMismatchError(
                f"{names} should have same length! {what}: layouts {layouts} and desired layouts {desired} differ in "
                "length"
            )


class PrepareModuleInput(ParallelStyle):
    """Turn a module's inputs (positional by position, keyword by name) into DTensors and move them.

    `None` in `input_layouts` leaves that input alone. `use_local_output` hands the module
    local tensors instead of DTensors (default False).
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
    ):
        self.input_layouts = as_layouts(input_layouts)
        self.desired_input_layouts = as_layouts(desired_input_layouts)
        self.use_local_output = use_local_output
        _check_pairs(
            self.input_layouts,
            self.desired_input_layouts,
            "PrepareModuleInput",
            "input_layouts and desired_input_layouts",
        )
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = {k: as_placement(v) for k, v in (input_kwarg_layouts or {}).items()}
        self.desired_input_kwarg_layouts = {k: as_placement(v) for k, v in (desired_input_kwarg_layouts or {}).items()}
        if self.with_kwargs and len(self.input_kwarg_layouts) != len(self.desired_input_kwarg_layouts):
            raise LayoutMismatchError(
                "input_kwarg_layouts and desired_input_kwarg_layouts should have same length! (PrepareModuleInput)"
            )

    def _prepare_input_arg(self, mod, x, mesh, layout, desired):
        if layout is None:
            return x
        if not isinstance(x, torch.Tensor):
            raise ShardingError(f"PrepareModuleInput: expected a tensor for layout {layout}, got {type(x).__name__}")
        dt = to_dtensor(mod, x, mesh, (layout,))
        if desired is not None:
            dt = move(mod, dt, mesh, (desired,))
        return dt.to_local() if self.use_local_output else dt

    def _prepare_input_fn(self, mod, inputs, mesh):
        if self.input_layouts is None:
            return inputs
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        if len(inputs) != len(self.input_layouts):
            raise ShardingError(
                f"module inputs and input_layouts should have same length! PrepareModuleInput: the module got "
                f"{len(inputs)} positional inputs but input_layouts has {len(self.input_layouts)}"
            )
        return tuple(
            self._prepare_input_arg(mod, x, mesh, lay, want)
            for x, lay, want in zip(inputs, self.input_layouts, self.desired_input_layouts)
        )

    def _prepare_input_kwarg_fn(self, mod, inputs, kwargs, mesh):
        args = self._prepare_input_fn(mod, inputs, mesh)
        kw = {
            k: self._prepare_input_arg(
                mod, v, mesh, self.input_kwarg_layouts.get(k), self.desired_input_kwarg_layouts.get(k)
            )
            for k, v in kwargs.items()
        }
        return args, kw

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.with_kwargs:
            module.register_forward_pre_hook(
                lambda m, a, k: self._prepare_input_kwarg_fn(m, a, k, device_mesh), with_kwargs=True
            )
        else:
            module.register_forward_pre_hook(lambda m, a: self._prepare_input_fn(m, a, device_mesh))
        return module

    def __repr__(self) -> str:
        return (
            f"PrepareModuleInput(input_layouts={self.input_layouts}, "
            f"desired_input_layouts={self.desired_input_layouts}, input_kwarg_layouts={self.input_kwarg_layouts}, "
            f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, use_local_output={self.use_local_output})"
        )


class PrepareModuleOutput(ParallelStyle):
    """Turn a module's outputs into DTensors (`output_layouts`, None: leave alone)
    and move them to `desired_output_layouts`."""

    def __init__(
        self,
        *,
        output_layouts: Placement | tuple[Placement | None, ...],
        desired_output_layouts: Placement | tuple[Placement, ...],
        use_local_output: bool = True,
    ):
        self.output_layouts = as_layouts(output_layouts)
        self.desired_output_layouts = as_layouts(desired_output_layouts)
        self.use_local_output = use_local_output
        _check_pairs(
            self.output_layouts,
            self.desired_output_layouts,
            "PrepareModuleOutput",
            "output_layouts and desired_output_layouts",
        )

    def _prepare_out_fn(self, mod, outputs, mesh):
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        if len(outs) != len(self.output_layouts):
            raise ShardingError(
                f"PrepareModuleOutput: the module returned {len(outs)} outputs but output_layouts has "
                f"{len(self.output_layouts)}"
            )
        prepared = []
        for out, layout, desired in zip(outs, self.output_layouts, self.desired_output_layouts):
            if layout is None:
                prepared.append(out)
                continue
            dt = move(mod, to_dtensor(mod, out, mesh, (layout,)), mesh, (desired,))
            prepared.append(dt.to_local() if self.use_local_output else dt)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda m, a, out: self._prepare_out_fn(m, out, device_mesh))
        return module

    def __repr__(self) -> str:
        return (
            f"PrepareModuleOutput(output_layouts={self.output_layouts}, "
            f"desired_output_layouts={self.desired_output_layouts}, use_local_output={self.use_local_output})"
        )


class PrepareModuleInputOutput(ParallelStyle):
    """PrepareModuleInput and PrepareModuleOutput on one module
    (`use_local_input` is the input side's use_local_output)."""

    def __init__(
        self,
        *,
        input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_input: bool = False,
        output_layouts: Placement | tuple[Placement | None, ...],
        desired_output_layouts: Placement | tuple[Placement, ...],
        use_local_output: bool = True,
    ):
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts,
            desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        return f"PrepareModuleInputOutput({self.prepare_module_input!r}, {self.prepare_module_output!r})"
