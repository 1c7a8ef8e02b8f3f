"""Pricing from metadata takes the kernels the mesh's device takes.

A dry-world DTensor (comm/dry.py) holds a META shard, so torch's device-dispatched choices inside
a composite op see the meta device, not the mesh's. One of them changes the collectives:
`scaled_dot_product_attention` picks its backend by device. On CPU it runs the fused
`_scaled_dot_product_flash_attention_for_cpu` (one op, sharded by its own rules); on meta it
decomposes into bmm/softmax (other ops, other redistributions). nn.MultiheadAttention calls it
from inside its functional form, where no __torch_function__ sees the call, so the dry step of a
model with it moved other bytes than the same step on the threads world.

`install()` registers, for meta tensors under autograd, a kernel of
`aten::scaled_dot_product_attention` that asks torch's own backend choice on CPU stand-ins of the
same sizes, last-dim strides and dtypes (the inputs of that choice; no data) when the query is a
DTensor on a CPU mesh, or a plain (local) meta tensor inside a dry world, whose ranks' tensors live
on CPU meshes; and runs the fused op as torch's CPU path does. The choice changes what autograd keeps
for backward too (the fused op keeps q, k, v, its output and logsumexp; the decomposition its
score matrices), which the memory per rank counts. Any other call (meta tensors outside a dry world,
another mesh device, the math choice) runs torch's own composite kernel unchanged.
"""

from __future__ import annotations

import math
import threading

import torch

from ..comm.dry import DryCommunicator
from ..tensor import DTensor
from ..world import current_comm, in_threads_world

__all__ = ["install"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_FLASH_CHOICE: int = torch.nn.attention.SDPBackend.FLASH_ATTENTION.value
_lock = threading.Lock()
_library: list[torch.library.Library] = []  # kept alive: the registration lasts as long as it


def _cpu_stand_in(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with `t`'s sizes, dtype, last-dim stride and requires_grad, over a storage of one row
    (no data read)."""
    shape = tuple(t.shape)
    last = t.stride(-1) if t.ndim else 1
    row = (shape[-1] - 1) * last + 1 if shape and shape[-1] else 1
    strides = (0,) * (len(shape) - 1) + ((last,) if shape else ())
    return torch.empty(row, dtype=t.dtype, requires_grad=t.requires_grad).as_strided(shape, strides)


def _cpu_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> int:
    q, k, v = (_cpu_stand_in(t) for t in (query, key, value))
    mask = None if attn_mask is None else _cpu_stand_in(attn_mask)
    return int(aten._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa))


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask as SDPA makes it before its kernel: 0 where kept, -inf where masked."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), torch.tensor(-math.inf, dtype=dtype), torch.tensor(0.0, dtype=dtype))


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    args = (query, key, value, attn_mask, dropout_p, is_causal)
    if isinstance(query, DTensor):
        on_cpu_mesh = query.device_mesh.device_type == "cpu"
    else:  # a rank's local tensor in the dry world (its meshes are CPU ones: measure.py's init_device_mesh)
        on_cpu_mesh = in_threads_world() and isinstance(current_comm(), DryCommunicator)
    if on_cpu_mesh and _cpu_choice(*args, scale, enable_gqa) == _FLASH_CHOICE:
        mask = _additive(attn_mask, query.dtype)
        return aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale
        )[0]
    return _SDPA.decompose(*args, scale=scale, enable_gqa=enable_gqa)


def install() -> None:
    """Register the meta kernel once per process (idempotent, thread-safe)."""
    with _lock:
        if not _library:
            library = torch.library.Library("aten", "IMPL")
            library.impl("scaled_dot_product_attention", _sdpa, "AutogradMeta")
            _library.append(library)
