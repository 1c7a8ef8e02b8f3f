"""The policies `fully_shard` takes, with torch 2.13's names, fields and defaults."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision.

    param_dtype: dtype of the unsharded parameters (forward/backward compute and the
        all_gather); None keeps the parameter's own dtype. The sharded parameters (what the
        optimizer steps) keep their own dtype.
    reduce_dtype: dtype of the gradient reduction; None: param_dtype (if given), else the
        parameter's dtype. Unsynced micro-batches accumulate in it.
    output_dtype: floating-point forward outputs are cast to it (None: left alone).
    cast_forward_inputs: floating-point forward inputs are cast to param_dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """No offloading (the default)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters and gradients live on the CPU (shardops' worlds run on the CPU
    already, so this changes nothing there); pin_memory is accepted for torch's signature."""

    pin_memory: bool = True
