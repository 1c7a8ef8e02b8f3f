"""Each rank thread's own default generator, handed to the random aten ops it runs.

Under torchrun every process has its own default CPU generator. In `shardops.run`
the ranks are threads of one process and would share torch's, drawing in whatever
order the threads arrive (a checkpointed dropout recomputing another mask, tensor-
parallel peers dropping different elements). So each rank thread gets a fresh
`torch.Generator` (seeded at random, as a new process's default one is) and a dispatch mode on
its own (thread-local) mode stack that passes that generator to every random
aten op on plain CPU tensors whose generator is None:

- ops with a `generator` argument (bernoulli_, uniform_, normal_, random_,
  exponential_, geometric_, log_normal_, cauchy_, multinomial, normal, poisson,
  binomial, _standard_gamma, _sample_dirichlet, rrelu_with_noise, _fused_dropout,
  ...) get it filled in;
- ops whose overload has none but a sibling overload has (rand, randn, randint,
  randperm, rand_like, randn_like, randint_like, their out= forms) run as that sibling;
- the rest (native_dropout) run with torch's default generator holding the rank's
  state for the call, under a lock.

An explicit generator is left alone, except torch's default one: in a rank thread,
`torch.default_generator` reads as the rank's generator, and a reference to torch's own
taken before (random_split's default argument) is handed the rank's generator here, as
a process's script would draw from its own. DTensor and other tensor-subclass operands
are left alone (DTensor draws are counter-based, see rng.py), and so are non-CPU devices.
The torch internals used for this (the thread's dispatch-mode stack, the default
generator's identity) live in shardops._torch.random.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .._torch import random as torch_random
from ..tensor import DTensor
from ..world import RANK_THREAD_CONTEXTS, set_rank_generator

Route = Callable[[torch.Generator, Any, tuple, dict], Any]

# Ops without a generator argument in any overload that still draw from the default generator.
GENERATORLESS_RANDOM = frozenset({"native_dropout"})

_routes: dict[Any, Route | None] = {}
_DTENSOR_ONLY = (DTensor,)
_swap_lock = threading.Lock()


class RankGenerator(torch_random.dispatch_mode_base()):  # type: ignore[misc]
    """Hands `generator` to the random ops of the thread whose mode stack holds this mode."""

    # higher-order operators pass here too (torch's HOPs have no rule for this mode): see _route_for
    supports_higher_order_operators = True

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.generator = generator

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # torch.compile inside a rank thread still compiles (the mode stays off while it traces)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        # Every op of the rank thread passes here. A DTensor op goes straight into DTensor's dispatch
        # (no second trip through the dispatcher; its draws are counter-based); a plain op that is not
        # random costs one dict lookup.
        if types == _DTENSOR_ONLY:
            return DTensor.__torch_dispatch__(func, types, args, kwargs)
        route = _routes.get(func, _routes)
        if route is _routes:
            route = _routes[func] = _route_for(func)
        kwargs = kwargs or {}
        if route is None or not _plain_cpu(args, kwargs):
            return func(*args, **kwargs)
        return route(self.generator, func, args, kwargs)


@contextmanager
def rank_random_state() -> Iterator[torch.Generator]:
    """The calling thread's own default random state while inside: a fresh generator, as a new process has."""
    generator = torch.Generator()
    generator.seed()  # a new process's default generator starts from a non-deterministic seed
    # onto this thread's own stack only (see shardops._torch.random)
    torch_random.push_dispatch_mode(RankGenerator(generator))
    set_rank_generator(generator)
    torch_random.set_thread_default_generator(generator)
    try:
        yield generator
    finally:
        torch_random.set_thread_default_generator(None)
        set_rank_generator(None)
        torch_random.pop_dispatch_mode()


def _plain_cpu(args: tuple, kwargs: dict) -> bool:
    """Only plain CPU tensors (or none: a factory on the CPU) take the rank's CPU generator."""
    seen_tensor = False
    for value in (*args, *kwargs.values()):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__ or t.device.type != "cpu":
                    return False
                seen_tensor = True
    if seen_tensor:
        return True
    device = kwargs.get("device")
    if device is None:
        device = torch.get_default_device()
    return (device.type if isinstance(device, torch.device) else torch.device(device).type) == "cpu"


def _route_for(func: Any) -> Route | None:
    if torch_random.is_higher_order_operator(func):
        return None  # a compiled graph's with_effects(token, shardops::all_gather, ...): its op draws nothing
    names = [a.name for a in func._schema.arguments]
    if "generator" in names:
        return _fill_generator(names.index("generator"))
    sibling = _generator_sibling(func, names)
    if sibling is not None:
        return lambda gen, _func, args, kwargs: sibling(*args, **kwargs, generator=gen)
    if func._schema.name.split("::")[-1] in GENERATORLESS_RANDOM:
        return _with_default_generator_swapped
    return None


def _fill_generator(position: int) -> Route:
    def route(gen: torch.Generator, func: Any, args: tuple, kwargs: dict) -> Any:
        if position < len(args):
            if _is_default(args[position]):
                args = (*args[:position], gen, *args[position + 1 :])
        elif _is_default(kwargs.get("generator")):
            kwargs = {**kwargs, "generator": gen}
        return func(*args, **kwargs)

    return route


def _is_default(generator: torch.Generator | None) -> bool:
    """No generator, or torch's default one by a reference taken before this thread was a rank."""
    return generator is None or torch_random.is_process_default_generator(generator)


def _generator_sibling(func: Any, names: list[str]) -> Any:
    """The overload of the same op taking the same arguments plus a keyword `generator` (rand -> rand.generator)."""
    packet = func.overloadpacket
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        args = candidate._schema.arguments
        theirs = [a.name for a in args]
        if "generator" in theirs and args[theirs.index("generator")].kwarg_only:
            theirs.remove("generator")
            if theirs == names:
                return candidate
    return None


def _with_default_generator_swapped(gen: torch.Generator, func: Any, args: tuple, kwargs: dict) -> Any:
    """An op that only reads torch's default generator: lend it the rank's state for this one call."""
    default = torch_random.process_default_generator()  # torch.default_generator reads as `gen` here
    with _swap_lock:
        saved = default.get_state()
        default.set_state(gen.get_state())
        try:
            return func(*args, **kwargs)
        finally:
            gen.set_state(default.get_state())
            default.set_state(saved)


RANK_THREAD_CONTEXTS.append(rank_random_state)
