"""run_gloo: run a function once per process, the processes joined by a gloo process group.

Each rank is a fresh process (spawn start method) that joins a gloo group over
localhost TCP, calls `fn(*args)`, and sends back its result. Any failure (a rank
raising, a rank dying, the whole run running out of time) raises `RankFailure`
in the caller, and no child process is left running. The training demo runs
torch DTensor's side of the comparison this way; the tests use it for the
torch.distributed world.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable

import torch
import torch.multiprocessing as torch_mp


class RankFailure(RuntimeError):
    """A rank of `run_gloo` raised, died, or did not finish in time."""


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
    procs, readers = [], []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child, args=(fn, args, rank, world_size, port, timeout, pg_timeout, setup, threads, writer), name=f"gloo-rank{rank}", daemon=True
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
                status, payload = pickle.loads(reader.recv_bytes())
            except EOFError:
                procs[rank].join(5)
                raise RankFailure(f"run_gloo: rank {rank} exited (code {procs[rank].exitcode}) without a result") from None
            if status == "error":
                raise RankFailure(f"run_gloo: rank {rank} raised:\n{payload}")
            results[rank] = payload
            del waiting[rank]
    for rank, proc in enumerate(procs):
        proc.join(max(1.0, deadline - time.monotonic()))
        if proc.exitcode != 0:
            raise RankFailure(f"run_gloo: rank {rank} returned a result but exited with code {proc.exitcode}")
    return results


def _child(fn: Callable[..., Any], args: tuple, rank: int, world_size: int, port: int, timeout: float, pg_timeout: float, setup: Any, threads: int, conn: Any) -> None:
    import torch.distributed as dist

    # Ranks share a few cores: few intra-op threads each avoid oversubscription.
    torch.set_num_threads(threads)
    message: tuple[str, Any]
    try:
        # Spawned ranks start seconds apart on a busy machine: the meeting gets the run's whole timeout.
        init_timeout = datetime.timedelta(seconds=max(timeout, pg_timeout))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=init_timeout)
        if setup is not None:
            setup(pg_timeout)
        message = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - sent to the parent
        message = ("error", f"[pid {os.getpid()}] " + traceback.format_exc())
    try:
        data = pickle.dumps(message)
    except Exception:  # noqa: BLE001
        data = pickle.dumps(("error", "result not picklable:\n" + traceback.format_exc()))
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
