"""Hooks into torch's random-number subsystem, so that each rank thread of so.run has its own state.

Under torchrun each process has its own default generator. In so.run the ranks are threads of
one process, so shardops gives each rank thread its own generator (interop/rank_random.py) and
puts these hooks into torch (each known for torch 2.13, 2.14, 2.15):

- `random.default_state`: torch.manual_seed, seed, initial_seed, get_rng_state and set_rng_state
  (as torch.X and torch.random.X) become the wrappers rng.py registers: they act on the rank
  thread's generator inside so.run and keep the layout-invariant DTensor draw counter in step.
- `random.nn_init`: nn.init.trunc_normal_ and sparse_ become ops/random.py's (torch's have no
  __torch_function__ entry through which a DTensor could take them over).
- `random.default_generator`: `torch.default_generator` read in a rank thread is that rank's
  generator (torch's module object gets a class with that one property; every other thread reads
  torch's own object, unchanged); and `is_process_default_generator` recognises torch's default
  generator when it reaches an op by a reference taken earlier (random_split's default argument),
  by its C++ generator (`Generator._cdata`), since the dispatcher hands Python a new wrapper.
- `random.dispatch_stack`: a dispatch mode pushed onto the calling thread's own (C++, thread-local)
  mode stack, `torch._C._push_on_torch_dispatch_stack` / `_pop_torch_dispatch_stack`: a mode's
  __enter__ also flips process-wide Python flags, which rank threads entering and leaving in any
  order would leave set. With it, `torch.utils._python_dispatch.TorchDispatchMode` and
  `torch._ops.HigherOrderOperator`.

Modules register their replacements at import (shardops' own tables only); install() applies them.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any

import torch

from . import Hook, require

DEFAULT_STATE = Hook("random.default_state", "torch.manual_seed & co. act on the calling rank thread's generator")
NN_INIT = Hook("random.nn_init", "nn.init.trunc_normal_ and sparse_ accept DTensors")
DEFAULT_GENERATOR = Hook("random.default_generator", "torch.default_generator is the calling rank thread's generator")
DISPATCH_STACK = Hook("random.dispatch_stack", "a dispatch mode on the calling thread's own mode stack")

DEFAULT_STATE_FUNCTIONS = ("manual_seed", "seed", "initial_seed", "get_rng_state", "set_rng_state")
Wrap = Callable[[Callable], Callable]  # torch's function -> its replacement

_default_state_wrappers: dict[str, Wrap] = {}
_init_replacements: dict[str, Wrap] = {}


class _ThreadDefault(threading.local):
    generator: torch.Generator | None = None  # a class default: reading it in other threads raises nothing


_thread = _ThreadDefault()
_default_cdata: int | None = None


# ------------------------------------------------------------------ registration (at import; changes nothing in torch)


def wrap_default_state_function(name: str, wrap: Wrap) -> None:
    """At install: torch.<name> and torch.random.<name> become wrap(torch's <name>)."""
    if name not in DEFAULT_STATE_FUNCTIONS:
        raise ValueError(f"{name!r} is not one of torch's default-state functions {DEFAULT_STATE_FUNCTIONS}")
    _default_state_wrappers[name] = wrap


def replace_init_function(name: str, wrap: Wrap) -> None:
    """At install: torch.nn.init.<name> becomes wrap(torch's <name>)."""
    _init_replacements[name] = wrap


# ------------------------------------------------------------------ the calling thread's default generator


def set_thread_default_generator(generator: torch.Generator | None) -> None:
    """What `torch.default_generator` reads as in the calling thread (None: torch's own)."""
    _thread.generator = generator


def process_default_generator() -> torch.Generator:
    """torch's own default CPU generator, whichever thread asks."""
    return torch._C.default_generator


def is_process_default_generator(generator: Any) -> bool:
    """Whether `generator` is torch's default CPU generator (possibly a new Python wrapper of it)."""
    if _default_cdata is None:
        _resolve_default_cdata()
    return isinstance(generator, torch.Generator) and generator._cdata == _default_cdata  # type: ignore[attr-defined]  # not in torch's stubs


def _resolve_default_cdata() -> None:
    global _default_cdata
    default = require(DEFAULT_GENERATOR, torch._C, "default_generator", "torch._C")
    _default_cdata = require(DEFAULT_GENERATOR, default, "_cdata", "torch.Generator")


def _rank_default_generator(module: types.ModuleType) -> torch.Generator:
    generator = _thread.generator
    return generator if generator is not None else module.__dict__["default_generator"]


def _set_default_generator(module: types.ModuleType, value: torch.Generator) -> None:
    module.__dict__["default_generator"] = value


def _check_default_generator() -> None:
    _resolve_default_cdata()
    require(DEFAULT_GENERATOR, torch, "default_generator", "torch")


def _install_default_generator() -> None:
    module_class = type(torch)
    if getattr(module_class, "_shardops_rank_default_generator", False):
        return
    # A property on the module's class wins over the module's __dict__ entry (a data descriptor),
    # so vars(torch) keeps torch's object and only the attribute read depends on the thread.
    torch.__class__ = type(
        "TorchModuleWithRankDefaultGenerator",
        (module_class,),
        {
            "default_generator": property(_rank_default_generator, _set_default_generator),
            "_shardops_rank_default_generator": True,
        },
    )


# ------------------------------------------------------------------ the dispatch-mode stack


def dispatch_mode_base() -> type:
    """torch's base class of dispatch modes."""
    import torch.utils._python_dispatch as python_dispatch

    return require(DISPATCH_STACK, python_dispatch, "TorchDispatchMode", "torch.utils._python_dispatch")


def push_dispatch_mode(mode: Any) -> None:
    """Onto the calling thread's mode stack only, without the mode's process-wide __enter__ flags."""
    require(DISPATCH_STACK, torch._C, "_push_on_torch_dispatch_stack", "torch._C")(mode)


def pop_dispatch_mode() -> None:
    require(DISPATCH_STACK, torch._C, "_pop_torch_dispatch_stack", "torch._C")(None)


def is_higher_order_operator(func: Any) -> bool:
    import torch._ops as ops

    return isinstance(func, require(DISPATCH_STACK, ops, "HigherOrderOperator", "torch._ops"))


def _check_dispatch_stack() -> None:
    dispatch_mode_base()
    for name in ("_push_on_torch_dispatch_stack", "_pop_torch_dispatch_stack"):
        require(DISPATCH_STACK, torch._C, name, "torch._C")
    import torch._ops as ops

    require(DISPATCH_STACK, ops, "HigherOrderOperator", "torch._ops")


# ------------------------------------------------------------------ install


def _replace(hook: Hook, modules: tuple[types.ModuleType, ...], name: str, wrap: Wrap) -> None:
    """modules[i].name = wrap(modules[0].name), once (a replacement is marked)."""
    original = require(hook, modules[0], name, modules[0].__name__)
    if getattr(original, "_shardops_wrapped", False):
        return  # installed already
    replacement = wrap(original)
    replacement.__wrapped__ = original  # type: ignore[attr-defined]
    replacement._shardops_wrapped = True  # type: ignore[attr-defined]
    for module in modules:
        setattr(module, name, replacement)


def _check_replacements() -> None:
    for name in _default_state_wrappers:
        require(DEFAULT_STATE, torch.random, name, "torch.random")
    for name in _init_replacements:
        require(NN_INIT, torch.nn.init, name, "torch.nn.init")


def install() -> None:
    """Every hook above; each checks for what it needs before any changes torch. Idempotent."""
    _check_dispatch_stack()
    _check_replacements()
    _check_default_generator()
    for name, wrap in _default_state_wrappers.items():
        _replace(DEFAULT_STATE, (torch.random, torch), name, wrap)
    for name, wrap in _init_replacements.items():
        _replace(NN_INIT, (torch.nn.init,), name, wrap)
    _install_default_generator()
