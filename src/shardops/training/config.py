"""What a training comparison trains: the model, its size, the mesh, the plan options.

Both sides (shardops and torch DTensor) and the single-device reference build
the model from the same `RunSpec` with the same initial weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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

    @property
    def dp(self) -> int:
        return self.mesh_shape[0] if len(self.mesh_shape) == 2 else 1


MODELS = {"llama": models.Llama, "gpt2": models.GPT2}
PLANS = {"llama": models.llama_plan, "gpt2": models.gpt2_plan}


def build(spec: "RunSpec") -> torch.nn.Module:
    """The model with its deterministic initial weights (the same on every side)."""
    return MODELS[spec.model](spec.cfg, seed=0)


def plan(spec: "RunSpec", api: Any) -> dict[str, Any]:
    """The torchtitan-style plan of spec.model, written against `api` (torch's or shardops' parallel module)."""
    return PLANS[spec.model](api=api, local_attention=spec.local_attention, sequence_parallel=spec.sequence_parallel)


