"""torch.compile's private internals, as shardops uses them (dynamo, AOTAutograd, fake tensors,
effect tokens, functional collectives, pytree constants).

What shardops needs of torch.compile, and why, is in comm/traceable.py and docs/compile.md; this
module only reaches into torch. Every hook names the torch versions it is known for (`KNOWN`)
and checks, when it is installed or first used, that the internal it needs is there; when it is
not, it raises `TorchInternalMissing` naming the hook and the running torch, never falls back.

Nothing here runs at import. `install()` (through shardops._torch.install) registers the effect
of shardops' collectives and the pytree constants at once, and dynamo's marks when torch._dynamo
is imported (by the first torch.compile: importing it costs seconds, so install() leaves that to
torch.compile and watches for it with a finder on sys.meta_path, removed once it has run).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from . import TorchInternalMissing

KNOWN = ("2.13", "2.14", "2.15")  # the torch releases every hook below is known for


def require(hook: str, module: str, *path: str) -> Any:
    """`module.path...` for `hook`, or a TorchInternalMissing naming the hook and this torch."""
    try:
        obj: Any = importlib.import_module(module)
        for name in path:
            obj = getattr(obj, name)
    except (ImportError, AttributeError) as e:
        where = ".".join((module, *path))
        raise TorchInternalMissing(
            f"shardops' torch hook {hook!r} needs {where}, which torch {torch.__version__} does not have ({e}). "
            f"The hook is known for torch {', '.join(KNOWN)}; install one of those."
        ) from e
    return obj


# ------------------------------------------------------------------ what is torch.compile doing on this thread?


_found = functools.lru_cache(maxsize=None)(require)  # for the hot paths (install() checks them first)


def tracing() -> bool:
    """True inside torch.compile's tracing on this thread (dynamo or AOTAutograd)."""
    return _found("tracing", "torch._guards", "TracingContext").try_get() is not None


def compiling() -> bool:
    """True while torch.compile compiles on this thread: tracing, and what dynamo does around it
    (fake copies of the inputs, building guards). False whenever compiled code runs."""
    return _found("compiling", "torch._guards", "CompileContext").try_get() is not None or tracing()


def is_fake(t: torch.Tensor) -> bool:
    """A fake (or functionalized fake) tensor: torch.compile is tracing, not running."""
    return _found("is_fake", "torch._subclasses.fake_tensor", "is_fake")(t)


def _check_hot_paths() -> None:
    require("tracing", "torch._guards", "TracingContext", "try_get")
    require("compiling", "torch._guards", "CompileContext", "try_get")
    require("is_fake", "torch._subclasses.fake_tensor", "is_fake")
    require("real_zeros", "torch._subclasses.fake_tensor", "unset_fake_temporarily")
    require("without_modes", "torch.utils._python_dispatch", "_disable_current_modes")


def real_zeros(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """Zeros of `shape` as a real tensor, even inside a fake-tensor mode."""
    with require("real_zeros", "torch._subclasses.fake_tensor", "unset_fake_temporarily")():
        return torch.zeros(shape, dtype=like.dtype, device=like.device)


def without_modes():
    """A context with torch's dispatch modes (fake, proxy) off: plain tensors again."""
    return require("without_modes", "torch.utils._python_dispatch", "_disable_current_modes")()


# ------------------------------------------------------------------ torch's functional collectives (torch.distributed)


def _functional_op(name: str):
    try:
        return getattr(torch.ops._c10d_functional, name)
    except AttributeError as e:  # the namespace is made on access; a missing op is the error
        raise TorchInternalMissing(
            f"shardops' torch hook 'functional collectives' needs torch.ops._c10d_functional.{name}, which torch "
            f"{torch.__version__} does not have. The hook is known for torch {', '.join(KNOWN)}."
        ) from e


def wait(t: torch.Tensor) -> torch.Tensor:
    return _functional_op("wait_tensor")(t)


def functional_all_reduce(t: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    return wait(_functional_op("all_reduce")(t, op, group_name))


def functional_all_gather(t: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return wait(_functional_op("all_gather_into_tensor")(t, group_size, group_name))


def functional_reduce_scatter(t: torch.Tensor, op: str, group_size: int, group_name: str) -> torch.Tensor:
    return wait(_functional_op("reduce_scatter_tensor")(t, op, group_size, group_name))


def functional_all_to_all(t: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group_name: str) -> torch.Tensor:
    return wait(_functional_op("all_to_all_single")(t, out_sizes, in_sizes, group_name))


# -------------------------------------------------------------- dynamo's compiles (callbacks) and its per-thread config

_watchers: list[tuple[Callable[..., None], Callable[..., None]]] = []


def watch_compiles(on_start: Callable[..., None], on_end: Callable[..., None]) -> None:
    """Call on_start/on_end around each of dynamo's compiles (installed with dynamo's marks)."""
    _watchers.append((on_start, on_end))


def keep_watching() -> None:
    """Register the compile watchers again where torch._dynamo.reset() dropped them (it clears
    every compile callback). Cheap; a no-op before dynamo's hooks are installed."""
    if not _dynamo_hooks_installed[0]:
        return
    handler = require("watch_compiles", "torch._dynamo.callback", "callback_handler")
    for on_start, on_end in _watchers:
        if on_start not in handler.start_callbacks:
            handler.register_start_callback(on_start)
        if on_end not in handler.end_callbacks:
            handler.register_end_callback(on_end)


def scale_recompile_limits(factor: int) -> None:
    """Multiply dynamo's recompile limits in this thread's config context (torch 2.13+: per thread)."""
    config = require("recompile limits", "torch._dynamo", "config")
    for name in ("recompile_limit", "accumulated_recompile_limit"):
        setattr(config, name, getattr(config, name) * factor)


# ------------------------------------------------------------------ what dynamo must and must not trace into

_opaque: list = []  # functions dynamo records as one call (nonstrict_trace); AOTAutograd traces into them
_eager_only: list = []  # functions dynamo never compiles as frames, nor anything they call
_sourceless: list[type] = []  # metadata classes dynamo holds as plain Python constants
_graph_entry: list[tuple[Callable[[Any], bool], Callable[[list], None]]] = []


def trace_opaque(fn):
    """Dynamo records each call of `fn` as one node (torch.compiler.nonstrict_trace's marks)."""
    _opaque.append(fn)
    if _dynamo_hooks_installed[0]:
        _mark_opaque(fn)
    return fn


def eager_only(fn):
    """Dynamo never compiles `fn`, nor any frame it calls, as a frame of its own."""
    _eager_only.append(fn)
    if _dynamo_hooks_installed[0]:
        _skip(fn)
    return fn


def hold_as_constants(classes: Iterable[type]) -> None:
    """Instances of `classes` read in compiled code are plain Python constants for dynamo."""
    _sourceless.extend(classes)


def on_graph_entry(wanted: Callable[[Any], bool], enter: Callable[[list], None]) -> None:
    """Run `enter(inputs)` as each compiled graph is called, before it reads its inputs, for graphs
    with an example input where `wanted(example)` holds; `inputs` are those inputs, in order.

    The graph's inputs are the objects the compiled code passes (subclass tensors still wrapped):
    this runs after dynamo's guards passed and before AOTAutograd unwraps them, outside every
    compile lock, at the same point of every rank's program.
    """
    _graph_entry.append((wanted, enter))


def _mark_opaque(fn) -> None:
    # the ids torch.compiler.nonstrict_trace registers (its wrapper would be a new object)
    for ids in ("_allowed_callable_ids", "_nonstrict_trace_callable_ids"):
        require("trace_opaque", "torch._dynamo.trace_rules", ids).add(id(fn))
    skip_code = require("trace_opaque", "torch._dynamo.eval_frame", "skip_code")
    # Called from eager code after a graph break, the function runs as it is: dynamo never compiles
    # it as a frame of its own (a resume after _make_wrapper_subclass lost requires_grad, issue 25).
    skip_code(fn.__code__)


def _skip(fn) -> None:
    set_strategy = require("eager_only", "torch._dynamo.eval_frame", "set_code_exec_strategy")
    action = require("eager_only", "torch._dynamo.types", "FrameAction")
    strategy = require("eager_only", "torch._dynamo.types", "FrameExecStrategy")
    set_strategy(fn.__code__, strategy(action.SKIP, action.SKIP))


def _hold_as_constant(cls: type) -> None:
    variable = require("hold_as_constants", "torch._dynamo.variables.user_defined", "UserDefinedObjectVariable")
    handlers = require("hold_as_constants", "torch._dynamo.variables.builder", "SourcelessBuilder", "_type_handlers")
    handlers.setdefault(cls, lambda tx, value: variable(value))


def _wrap_graph_calls() -> None:
    """Wrap the callable each backend returns (OutputGraph.call_user_compiler) with the graph-entry hooks."""
    output_graph = require("on_graph_entry", "torch._dynamo.output_graph", "OutputGraph")
    compile_graph = require("on_graph_entry", "torch._dynamo.output_graph", "OutputGraph", "call_user_compiler")
    if getattr(compile_graph, "_shardops_entry", False):
        return

    def call_user_compiler(self, gm, example_inputs):
        compiled = compile_graph(self, gm, example_inputs)
        hooks = [enter for wanted, enter in _graph_entry if any(wanted(x) for x in example_inputs)]
        if not hooks:
            return compiled

        def entered(*args, **kwargs):
            for enter in hooks:
                enter(list(args))
            return compiled(*args, **kwargs)

        return entered

    call_user_compiler._shardops_entry = True  # type: ignore[attr-defined]
    output_graph.call_user_compiler = call_user_compiler


def _install_dynamo_hooks() -> None:
    for fn in _opaque:
        _mark_opaque(fn)
    for fn in _eager_only:
        _skip(fn)
    for cls in _sourceless:
        _hold_as_constant(cls)
    _wrap_graph_calls()
    callback = require("watch_compiles", "torch._dynamo", "callback")
    for on_start, on_end in _watchers:
        callback.on_compile_start(on_start)
        callback.on_compile_end(on_end)
    _dynamo_hooks_installed[0] = True


_dynamo_hooks_installed = [False]


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Installs dynamo's hooks right after torch._dynamo is imported (by the first torch.compile)."""

    def find_spec(self, name, path, target=None):
        if name != "torch._dynamo":
            return None
        _remove_finder()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            _install_dynamo_hooks()

        spec.loader.exec_module = exec_then_install
        return spec


_finder = _AfterDynamoImport()


def _remove_finder() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


# ------------------------------------------------------------------ effects and pytree constants


_ordered_ops: list[str] = []
_pytree_constants: list[type] = []
_pytree_dataclasses: list[type] = []


def keep_in_order(op_names: Iterable[str]) -> None:
    """Make the ops ordered effects (torch's effect tokens): never removed, merged or reordered."""
    _ordered_ops.extend(op_names)


def pytree_constants(constants: Iterable[type], dataclasses: Iterable[type]) -> None:
    """Instances of `constants` are pytree constants; `dataclasses` are pytree nodes of their fields."""
    _pytree_constants.extend(constants)
    _pytree_dataclasses.extend(dataclasses)


def _install_effects() -> None:
    register = require("keep_in_order", "torch.library", "_register_effectful_op")
    ordered = require("keep_in_order", "torch._library.effects", "EffectType").ORDERED
    for name in _ordered_ops:
        register(name, ordered)


def _install_pytree() -> None:
    import torch.utils._pytree as pytree

    for cls in _pytree_constants:
        if not pytree.is_constant_class(cls):
            pytree.register_constant(cls)
    for cls in _pytree_dataclasses:
        if cls not in pytree.SUPPORTED_NODES:
            pytree.register_dataclass(cls)


_installed = [False]
_lock = threading.Lock()


def install() -> None:
    """Install every compile hook (idempotent): effects and pytree constants now, dynamo's marks now
    if torch._dynamo is loaded, else when it is."""
    with _lock:
        if _installed[0]:
            return
        _check_hot_paths()
        _install_effects()
        _install_pytree()
        if "torch._dynamo" in sys.modules:
            _install_dynamo_hooks()
        elif _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        _installed[0] = True
