"""What a training comparison trains: the model, its size, the mesh, the plan options.

Both sides (shardops and torch DTensor) and the single-device reference build
the model from the same `RunSpec` with the same initial weights.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import models
from ..models import ModelArgs
from .loop import batch

SIZES = {
    "tiny": ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=64, hidden_dim=48, max_seq_len=16),
    "small": ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, hidden_dim=128, max_seq_len=32),
    "medium": ModelArgs(dim=256, n_layers=4, n_heads=8, vocab_size=2048, hidden_dim=512, max_seq_len=64),
}


@dataclass(frozen=True)
class RunSpec:
    """What both sides train: model, size, mesh, plan options, steps."""

    model: str = "llama"
    cfg: ModelArgs = field(default_factory=lambda: SIZES["small"])
    mesh_shape: tuple[int, ...] = (2, 2)
    batch_size: int = 4
    steps: int = 20
    lr: float = 3e-3
    local_attention: bool = True
    sequence_parallel: bool = True
    dp_mode: str = (
        "replicate"  # over mesh["dp"]: "replicate" (composable DDP) or "shard" (fully_shard per block, then the root)
    )
    seed: int = 0  # torch.manual_seed on every rank before training: the dropout masks' stream

    @property
    def world_size(self) -> int:
        n = 1
        for d in self.mesh_shape:
            n *= d
        return n

    def as_torch_runs_it(self) -> RunSpec:
        """What torch DTensor can run of this on CPU, checked against its own single-device run:
        no dropout (torch keeps no layout-invariant random state on CPU meshes:
        torch/distributed/tensor/_random.py has trackers for CUDA-like devices only, so each rank
        draws its shard's mask from its own CPU stream and no single-device run has those masks),
        and local attention (no CPU SDPA strategy for DTensors:
        `aten._scaled_dot_product_flash_attention_for_cpu` has no sharding strategy)."""
        return replace(self, cfg=replace(self.cfg, dropout=0.0), local_attention=True)

    @property
    def dp(self) -> int:
        return self.mesh_shape[0] if len(self.mesh_shape) == 2 else 1

    def local_batch(self, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel rank's rows of the step's global (inputs, targets): its own batch slice."""
        rows = self.batch_size // self.dp
        inputs, targets = batch(self.cfg, self.batch_size, step)
        return inputs[dp_rank * rows : (dp_rank + 1) * rows], targets[dp_rank * rows : (dp_rank + 1) * rows]


MODELS = {"llama": models.Llama, "gpt2": models.GPT2}
PLANS = {"llama": models.llama_plan, "gpt2": models.gpt2_plan}


def build(spec: RunSpec) -> torch.nn.Module:
    """The model with its deterministic initial weights (the same on every side)."""
    return MODELS[spec.model](spec.cfg, seed=0)


def replicate_norms_off_plan(spec: RunSpec, model: torch.nn.Module, tp_mesh: Any, distribute_module: Any) -> None:
    """With dropout and no sequence parallelism the residual stream stays a DTensor (see `plan`),
    but the norms are in no style: their parameters are given the tp mesh, replicated (torch's
    `distribute_module` default), so a norm never mixes a plain weight with a DTensor input.
    (Data parallelism then shards them over dp like any parameter.)"""
    if spec.cfg.dropout == 0 or spec.sequence_parallel:
        return
    for module in model.modules():
        if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
            distribute_module(module, tp_mesh)


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks, in order: one `fully_shard` unit each (torchtitan's units)."""
    stack = model.get_submodule("layers" if isinstance(model, models.Llama) else "h")
    return list(stack.values()) if isinstance(stack, torch.nn.ModuleDict) else list(stack.children())


def apply_data_parallel(spec: RunSpec, model: torch.nn.Module, dp_mesh: Any, fully_shard: Any, replicate: Any) -> None:
    """Data parallelism over `dp_mesh` as torchtitan's apply_fsdp / apply_ddp write it, with either
    side's `fully_shard` and `replicate` (torch's or shardops'): only the parameters are touched."""
    if spec.dp_mode == "shard":
        for block in blocks(model):
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    elif spec.dp_mode == "replicate":
        replicate(model, device_mesh=dp_mesh)
    else:
        raise ValueError(f"dp_mode must be 'replicate' or 'shard', got {spec.dp_mode!r}")


# The modules whose outputs make up the residual stream, which nn.Dropout reads.
RESIDUAL_OUTPUTS = {"llama": (), "gpt2": ("wte", "wpe", "h.*.attn.wo", "h.*.mlp.c_proj")}


def plan(spec: RunSpec, api: Any) -> dict[str, Any]:
    """The torchtitan-style plan of spec.model, written against `api` (torch's or shardops' parallel module).

    With dropout, the residual stream stays DTensors (`use_local_output=False` on the modules
    that write it): dropout then runs on a DTensor and draws the global tensor's mask. On a
    local shard it would draw from each rank's own stream, a mask no single device draws.
    """
    styles = PLANS[spec.model](api=api, local_attention=spec.local_attention, sequence_parallel=spec.sequence_parallel)
    if spec.cfg.dropout > 0:
        for name in RESIDUAL_OUTPUTS[spec.model]:
            styles[name] = copy.copy(styles[name])
            styles[name].use_local_output = False
    return styles
