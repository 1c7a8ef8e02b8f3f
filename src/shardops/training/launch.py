"""run_gloo: run a function once per process, the processes joined by a gloo process group.

Each rank is a fresh process (spawn start method) that joins a gloo group over
localhost TCP, calls `fn(*args)`, and sends back its result. Any failure (a rank
raising, a rank dying, the whole run running out of time) raises `RankFailure`
in the caller, and no child process is left running. A rank's exception, even one
raised while the rank imports `fn` (`fn` and its arguments are unpickled inside the
rank's error handling), comes back whole: its type, message and the rank's traceback.
The training demo runs torch DTensor's side of the comparison this way; the tests
use it for the torch.distributed world.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.multiprocessing as torch_mp


class RankFailure(RuntimeError):
    """A rank of `run_gloo` raised, died, or did not finish in time.

    Where the rank raised: `rank`, `error_type` (the exception's qualified class name),
    `error_message` (its str) and `rank_traceback` (formatted in the rank); the message
    starts with `run_gloo: rank R raised: Type: message` and ends with the rank's traceback.
    """

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        error_type: str | None = None,
        error_message: str | None = None,
        rank_traceback: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type
        self.error_message = error_message
        self.rank_traceback = rank_traceback


def run_gloo(
    fn: Callable[..., Any],
    world_size: int = 4,
    *args: Any,
    timeout: float = 120,
    pg_timeout: float | None = None,
    setup: Callable[[float], None] | None = None,
    threads: int = 1,
) -> list[Any]:
    """`fn(*args)` on `world_size` gloo ranks; each rank's return value, by rank.

    `fn` must be a module-level function and its args and results picklable.
    `timeout` bounds the whole run (start-up included) and the ranks' meeting
    in `init_process_group`; `pg_timeout` (default: `timeout`) is how long a
    collective waits for a missing peer, in every process group.
    """
    ctx = torch_mp.get_context("spawn")
    port = _free_port()
    pg_timeout = timeout if pg_timeout is None else pg_timeout
    # Pickled here, unpickled inside the rank's error handling: a rank that cannot import fn's module
    # reports that ImportError instead of dying in the spawn bootstrap with nothing to say.
    # By value: one blob for every rank (multiprocessing's shared-memory handles are good for one reader).
    work = pickle.dumps((fn, args, setup))
    procs, readers = [], []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child,
                args=(work, rank, world_size, port, timeout, pg_timeout, threads, writer),
                name=f"gloo-rank{rank}",
                daemon=True,
            )
            proc.start()
            writer.close()  # the child holds the only write end: EOF on the reader means it is gone
            procs.append(proc)
            readers.append(reader)
        return _collect(procs, readers, time.monotonic() + timeout, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(10)
        for reader in readers:
            reader.close()


def _collect(procs: list, readers: list, deadline: float, timeout: float) -> list[Any]:
    results: list[Any] = [None] * len(procs)
    waiting = dict(enumerate(readers))
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RankFailure(f"run_gloo: rank(s) {sorted(waiting)} did not finish within {timeout:g}s")
        for reader in wait(list(waiting.values()), timeout=left):
            rank = readers.index(reader)
            try:
                status, payload = pickle.loads(reader.recv_bytes())  # type: ignore[union-attr]  # wait() returns our Connections
            except EOFError:
                procs[rank].join(5)
                raise RankFailure(
                    f"run_gloo: rank {rank} exited ({_exit_words(procs[rank].exitcode)}) without a result", rank=rank
                ) from None
            if status == "error":
                raise _raised(rank, payload)
            results[rank] = payload
            del waiting[rank]
    for rank, proc in enumerate(procs):
        proc.join(max(1.0, deadline - time.monotonic()))
        if proc.exitcode != 0:
            raise RankFailure(f"run_gloo: rank {rank} returned a result but exited with code {proc.exitcode}")
    return results


def _exit_words(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"code {code}"


def _raised(rank: int, error: dict[str, Any]) -> RankFailure:
    """The parent's RankFailure for a rank's exception, as `_error_report` sent it."""
    return RankFailure(
        f"run_gloo: rank {rank} raised: {error['type']}: {error['message']}\n\n"
        f"rank {rank} (pid {error['pid']}) traceback:\n{error['traceback']}",
        rank=rank,
        error_type=error["type"],
        error_message=error["message"],
        rank_traceback=error["traceback"],
    )


def _error_report(e: BaseException, context: str = "") -> dict[str, Any]:
    """What a rank sends for an exception: plain strings, which always unpickle in the parent."""
    kind = type(e)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return {"type": name, "message": context + str(e), "traceback": traceback.format_exc(), "pid": os.getpid()}


def _child(
    work: bytes, rank: int, world_size: int, port: int, timeout: float, pg_timeout: float, threads: int, conn: Any
) -> None:
    import torch.distributed as dist

    # Ranks share a few cores: few intra-op threads each avoid oversubscription.
    torch.set_num_threads(threads)
    message: tuple[str, Any]
    try:
        fn, args, setup = pickle.loads(work)
        # Spawned ranks start seconds apart on a busy machine: the meeting gets the run's whole timeout.
        init_timeout = datetime.timedelta(seconds=max(timeout, pg_timeout))
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=init_timeout
        )
        if setup is not None:
            setup(pg_timeout)
        message = ("ok", fn(*args))
    except BaseException as e:  # noqa: BLE001 - sent to the parent
        message = ("error", _error_report(e))
    try:
        data = pickle.dumps(message)
    except Exception as e:  # noqa: BLE001
        data = pickle.dumps(("error", _error_report(e, "the rank's result is not picklable: ")))
    conn.send_bytes(data)
    conn.close()
    if dist.is_initialized():
        if message[0] == "ok":
            # No rank tears down its connections while a peer may still be reading from
            # them. The result is already sent: a failing barrier changes nothing.
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001
                pass
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
