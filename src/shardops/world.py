"""Which world of ranks the calling code is in, and `run` (the threads world).

Inside `run`, each rank thread carries its communicator in a thread-local. Outside
it, an initialised torch.distributed default process group is the world. A thread
of `run` always sees the threads world, even when a process group exists. Each rank
thread also has its own default random state, as each process has under torchrun
(interop/rank_random.py hands it to random ops, rng.py to torch.manual_seed & co.).
"""

from __future__ import annotations

import contextvars
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch

from . import _torch
from .comm import traceable
from .comm.base import Communicator
from .comm.threads import DEFAULT_TIMEOUT, ThreadsWorld
from .errors import CollectiveError, ShardingError

_local = threading.local()
_torch_comm: Communicator | None = None
# Context managers every rank thread of `run` runs inside, registered by modules this one cannot
# import (they import it): interop/rank_random.py gives each rank thread its own random state.
RANK_THREAD_CONTEXTS: list[Callable[[], AbstractContextManager[Any]]] = []


def current_comm() -> Communicator:
    comm = getattr(_local, "comm", None)
    if comm is not None:
        return comm
    return _torch_dist_comm()


def in_threads_world() -> bool:
    return getattr(_local, "comm", None) is not None


def rank_generator() -> torch.Generator | None:
    """This rank thread's default CPU generator inside `run`; None elsewhere (torch's own default is the process's)."""
    return getattr(_local, "generator", None)


def set_rank_generator(generator: torch.Generator | None) -> None:
    _local.generator = generator


def _torch_dist_comm() -> Communicator:
    global _torch_comm
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ShardingError(
            "no world of ranks: call inside shardops.run(fn, world_size) (threads in this process), "
            "or under torchrun / after torch.distributed.init_process_group."
        )
    if _torch_comm is None or _torch_comm.world_size != dist.get_world_size():
        from .comm.torch_dist import TorchDistCommunicator

        _torch_comm = TorchDistCommunicator()
    return _torch_comm


def run(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any
) -> list[Any]:
    """Run `fn(*args, **kwargs)` once per rank, one thread per rank; return each rank's result.

    An exception on any rank is raised here (the first one, by rank), and every
    rank waiting in a shardops collective is released with an error at once. After
    a failure, a rank busy outside shardops is waited for at most `timeout` seconds
    more; then it is left behind (a daemon thread that raises at its next collective).
    Each rank thread starts with the caller's grad mode and a copy of its context variables.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ShardingError(f"run: world_size must be a positive int, got {world_size!r}")
    _torch.install()  # torch's random state per rank thread (shardops._torch)
    world = ThreadsWorld(world_size, timeout)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size
    grad_enabled = torch.is_grad_enabled()

    def body(rank: int) -> None:
        _local.comm = world.communicator(rank)
        traceable.enter_rank_thread(world_size)
        try:
            with torch.set_grad_enabled(grad_enabled), ExitStack() as contexts:
                for context in RANK_THREAD_CONTEXTS:
                    contexts.enter_context(context())
                results[rank] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = e
            world.fail(f"rank {rank} raised {type(e).__name__}: {e}")
        finally:
            _local.comm = None
            world.rank_done(rank)

    # Each rank thread runs in a copy of the caller's context, as a process runs its script's
    # settings: torch.compile's config (dynamo, inductor: per-thread context variables) and any
    # other context variable the caller set are the rank's too.
    contexts = [contextvars.copy_context() for _ in range(world_size)]
    threads = [
        threading.Thread(target=contexts[r].run, args=(body, r), name=f"shardops-rank{r}", daemon=True)
        for r in range(world_size)
    ]
    try:
        for t in threads:
            t.start()
        stuck = world.wait_for_ranks()
    except BaseException as e:  # e.g. KeyboardInterrupt: release every rank waiting in a collective
        world.fail(f"the caller of shardops.run stopped waiting ({type(e).__name__})")
        raise
    for r, t in enumerate(threads):
        if r not in stuck:
            t.join()  # already past its last line: returns at once
    primary = [e for e in errors if e is not None and not isinstance(e, CollectiveError)]
    failed = primary or [e for e in errors if e is not None]
    left_behind = (
        f"shardops.run: rank(s) {stuck} were still running {timeout:g}s after the failure and were left behind; "
        "they raise at their next collective."
    )
    if failed:
        if stuck and sys.version_info >= (3, 11):  # Python 3.10 has no exception notes
            failed[0].add_note(left_behind)
        raise failed[0]
    if stuck:
        raise CollectiveError(f"{world.failure}. {left_behind}")
    return results


def run_dry(fn: Callable[..., Any], comm: Communicator, *args: Any, **kwargs: Any) -> Any:
    """Run `fn(*args, **kwargs)` as the one rank of `comm`, a dry world's communicator (comm/dry.py):
    its collectives are counted and move nothing, so its tensors must be meta. One thread, no
    other ranks: a world of thousands of ranks costs what one rank's metadata costs."""
    _torch.install()
    out: dict[str, Any] = {}
    grad_enabled = torch.is_grad_enabled()

    def body() -> None:
        _local.comm = comm
        try:
            with torch.set_grad_enabled(grad_enabled), ExitStack() as contexts:
                for context in RANK_THREAD_CONTEXTS:
                    contexts.enter_context(context())
                out["result"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            out["error"] = e
        finally:
            _local.comm = None

    thread = threading.Thread(target=body, name=f"shardops-dry-rank{comm.rank}", daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]
