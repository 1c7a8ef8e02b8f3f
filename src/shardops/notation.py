"""How shardops writes dtypes, meshes and torch callables as short text (shared by explain and verify).

dtype_name(torch.float32)        -> "f32"        (DTYPES reads it back, with torch's long names too)
parse_mesh_shape("8x8x16")       -> (8, 8, 16)   (also 4096, "8,8,16", (8, 8, 16))
mesh_name((2, 2))                -> "2x2"
callable_name(torch.cumsum)      -> "torch.cumsum" (Tensor.cumsum, F.rms_norm, torch.linalg.vector_norm)
"""

from __future__ import annotations

from typing import Any

import torch

from ._torch.dispatch import OpOverload, c_namespace
from .errors import ShardingError

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float64: "f64",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.complex64: "c64",
    torch.complex128: "c128",
}
# short names, "b", and torch's own names ("float", "long", "bfloat16", ...)
DTYPES: dict[str, torch.dtype] = {
    **{name: dtype for dtype, name in DTYPE_NAMES.items()},
    "b": torch.bool,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "double": torch.float64,
    "int": torch.int64,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "long": torch.int64,
    "uint8": torch.uint8,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype))


def tensor_text(t: torch.Tensor) -> str:
    """f32[8, 6]: a tensor's dtype and shape."""
    return f"{dtype_name(t.dtype)}{list(t.shape)}"


def parse_mesh_shape(mesh: Any, who: str = "shardops") -> tuple[int, ...]:
    """A mesh shape from 4096, (8, 8, 16), "8x8x16" or "8,8,16"; ShardingError naming `who` otherwise."""
    try:
        if isinstance(mesh, str):
            shape = tuple(int(s) for s in mesh.lower().replace(",", "x").split("x") if s.strip())
        elif isinstance(mesh, int):
            shape = (mesh,)
        else:
            shape = tuple(int(s) for s in mesh)
    except (TypeError, ValueError):
        raise ShardingError(f"{who}: mesh {mesh!r} not understood; use e.g. 4, 2x2, 8x8x16 or (8, 8, 16)") from None
    if not shape or any(s < 1 for s in shape):
        raise ShardingError(f"{who}: mesh {mesh!r} needs positive sizes, like 4, 2x2 or 2x2x2")
    return shape


def mesh_name(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def callable_name(fn: Any) -> str:
    """A readable, stable name for a torch-level callable: torch.cumsum, Tensor.cumsum, F.rms_norm."""
    if isinstance(fn, OpOverload):
        return str(fn)
    name = getattr(fn, "__name__", repr(fn))
    owner = getattr(fn, "__objclass__", None)
    qual = getattr(fn, "__qualname__", name)
    module = getattr(fn, "__module__", None) or ""
    if (owner is not None and "Tensor" in owner.__name__) or qual.startswith("Tensor."):
        return f"Tensor.{name}"
    if module.startswith("torch.nn.functional"):
        return f"F.{name}"
    namespace = c_namespace(module)  # (torch's private C module, its public namespace) for a builtin
    for prefix in (
        "linalg",
        "special",
        "fft",
    ):  # linalg_vector_norm in torch's C linalg module -> torch.linalg.vector_norm
        if (namespace is not None and namespace[1] == prefix) or name.startswith(f"{prefix}_"):
            return f"torch.{prefix}.{name.removeprefix(prefix + '_')}"
    if namespace is not None:  # no public namespace (the C bindings' nn builtins): named where they live
        return f"{namespace[0]}.{name}"
    return f"torch.{name}"
