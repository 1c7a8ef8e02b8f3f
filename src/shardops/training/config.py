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
    dp_mode: str = "replicate"  # torch's side only does replicate (gradients all-reduced over dp)
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


MODELS = {"llama": models.Llama, "gpt2": models.GPT2}
PLANS = {"llama": models.llama_plan, "gpt2": models.gpt2_plan}


def build(spec: RunSpec) -> torch.nn.Module:
    """The model with its deterministic initial weights (the same on every side)."""
    return MODELS[spec.model](spec.cfg, seed=0)


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
