"""torch's dispatcher and tensor-subclass internals, as shardops reads them (it changes none of them).

Each name is bound once, at import (the dispatch hot path uses them as plain module-level names,
no call in between), and each is known for torch 2.13, 2.14 and 2.15; a torch without one fails
the import with TorchInternalMissing naming the hook. torch has no public twin for any of them.

- `dispatch.operators`: the types of aten operators (`torch._ops.OpOverload`, one overload such as
  aten.add.Tensor; `torch._ops.OpOverloadPacket`, aten.add with all its overloads), and
  `all_op_names()` (`torch._C._dispatch_get_all_op_names`: every registered operator, where
  dir(torch.ops.aten) lists only the packets already touched).
- `dispatch.subclass`: what DTensor needs as a torch.Tensor wrapper subclass:
  `make_wrapper_subclass` (`torch.Tensor._make_wrapper_subclass`: a tensor with the global shape
  and no storage of its own), `disabled_torch_function_impl` (`torch._C._disabled_torch_function_impl`:
  run a function with subclass __torch_function__ off, in C), `DisableTorchFunctionSubclass` and
  `DisableTorchDispatch` (`torch._C.DisableTorchFunctionSubclass`, `torch._C._DisableTorchDispatch`:
  contexts that reach torch's own kernel past our overrides), and `set_conj` / `set_neg`
  (`torch._C._set_conj`, `_set_neg`: a wrapper's lazy conjugate/negative bits).
- `dispatch.modes`: `TorchDispatchMode` (`torch.utils._python_dispatch.TorchDispatchMode`), the
  base class of a mode that sees every aten call below autograd (torch.overrides has only the
  torch-function twin).
- `dispatch.c_namespaces`: the private modules torch's C bindings live in (`torch._C._linalg`,
  `_special`, `_fft`, `_nn`), read from a builtin's __module__ to name it as users call it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import Hook, internal

OPERATORS = Hook("dispatch.operators", "recognise aten operators and list every registered one")
SUBCLASS = Hook("dispatch.subclass", "DTensor is a torch.Tensor wrapper subclass")
MODES = Hook("dispatch.modes", "a mode that sees every aten call (explain, training's torch side)")
C_NAMESPACES = Hook("dispatch.c_namespaces", "name torch's builtins as users call them")

if TYPE_CHECKING:  # the checker reads torch's own classes; at run time they come through the hook
    from torch._ops import OpOverload, OpOverloadPacket
else:
    OpOverload = internal(OPERATORS, "torch._ops.OpOverload")
    OpOverloadPacket = internal(OPERATORS, "torch._ops.OpOverloadPacket")
_all_op_names: Callable[[], list[str]] = internal(OPERATORS, "torch._C._dispatch_get_all_op_names")

make_wrapper_subclass: Callable[..., Any] = internal(SUBCLASS, "torch.Tensor._make_wrapper_subclass")
disabled_torch_function_impl: Callable[..., Any] = internal(SUBCLASS, "torch._C._disabled_torch_function_impl")
DisableTorchFunctionSubclass: Callable[[], Any] = internal(SUBCLASS, "torch._C.DisableTorchFunctionSubclass")
DisableTorchDispatch: Callable[[], Any] = internal(SUBCLASS, "torch._C._DisableTorchDispatch")
set_conj: Callable[[Any, bool], None] = internal(SUBCLASS, "torch._C._set_conj")
set_neg: Callable[[Any, bool], None] = internal(SUBCLASS, "torch._C._set_neg")

TorchDispatchMode: type = internal(MODES, "torch.utils._python_dispatch.TorchDispatchMode")

# builtin's __module__ prefix -> the public namespace its functions are called by (None: no public one)
_C_NAMESPACES = {
    "torch._C._linalg": "linalg",
    "torch._C._special": "special",
    "torch._C._fft": "fft",
    "torch._C._nn": None,
}
for _module in _C_NAMESPACES:
    internal(C_NAMESPACES, _module)


def all_op_names() -> list[str]:
    """Every operator registered with torch's dispatcher, as "namespace::name.overload"."""
    return _all_op_names()


def c_namespace(module: str) -> tuple[str, str | None] | None:
    """For a builtin whose __module__ is `module`: (the private module it lives in, its public namespace
    or None), e.g. ("torch._C._linalg", "linalg"), ("torch._C._nn", None); None for any other module."""
    for private, public in _C_NAMESPACES.items():
        if module.startswith(private):
            return private, public
    return None
