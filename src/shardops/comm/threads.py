"""The threads world: every rank is a thread of this process.

A collective is a rendezvous: each member deposits a private copy of its input in
the slot (group, sequence number), waits until all members have, checks that they
all called the same collective, and computes its own result from the deposits.

NOTE: one Condition guards the whole world. Worlds are small (<= a few dozen
ranks in one process), so contention is not worth finer locks; and one lock makes
failure propagation simple: `fail()` wakes every waiter, and each raises.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import CollectiveError
from . import traceable
from .base import Communicator, Group, P2POp, P2PWork, reduce_stack

DEFAULT_TIMEOUT = 60.0


class ThreadsWorld:
    def __init__(self, world_size: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._slots: dict[tuple, dict[str, Any]] = {}
        self._seq: dict[tuple, int] = {}
        self.failure: str | None = None
        self.failed_at: float | None = None  # time.monotonic() of the first failure
        self.finished: set[int] = set()  # ranks whose function has returned or raised
        self._mailboxes: dict[tuple, deque] = {}  # (group ranks, src, dst, tag) -> tensors sent, oldest first

    def communicator(self, rank: int) -> ThreadsCommunicator:
        return ThreadsCommunicator(self, rank)

    def fail(self, reason: str) -> None:
        """Make every rank waiting now, or arriving later, raise `reason`."""
        with self._cond:
            self._set_failure(reason)
            self._cond.notify_all()

    def _set_failure(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            self.failed_at = time.monotonic()

    def rank_done(self, rank: int) -> None:
        """`rank` left its function: a collective still waiting for it can stop waiting."""
        with self._cond:
            self.finished.add(rank)
            self._cond.notify_all()

    def wait_for_ranks(self) -> list[int]:
        """Wait until every rank has finished, or `timeout` after a failure; return the ranks still running.

        A rank still running then is outside any collective (those were released by the
        failure): it raises at its next collective, but nothing can stop its own code.
        """
        with self._cond:
            while len(self.finished) < self.world_size:
                if self.failed_at is None:
                    self._cond.wait()
                    continue
                left = self.failed_at + self.timeout - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return [r for r in range(self.world_size) if r not in self.finished]

    def exchange(self, rank: int, group: Group, signature: tuple, payload: Any) -> dict[int, Any]:
        """Deposit `payload`, wait for every member, return every member's payload."""
        with self._cond:
            self._raise_if_failed(signature, group)
            seq_key = (rank, group.ranks)
            seq = self._seq.get(seq_key, 0)
            self._seq[seq_key] = seq + 1
            slot = self._slots.setdefault((group.ranks, seq), {"entries": {}, "read": 0})
            slot["entries"][rank] = (signature, payload)
            self._cond.notify_all()
            deadline = time.monotonic() + self.timeout
            while len(slot["entries"]) < group.size:
                self._raise_if_failed(signature, group)
                missing = [r for r in group.ranks if r not in slot["entries"]]
                gone = [r for r in missing if r in self.finished]
                left = deadline - time.monotonic()
                if left <= 0 and not gone and _later_deadline_for_compiles(deadline, self.timeout) > deadline:
                    # the missing ranks may be queued behind dynamo's compile lock (traceable.py)
                    deadline = _later_deadline_for_compiles(deadline, self.timeout)
                    continue
                if gone or left <= 0:
                    reason = f"{signature[0]} over ranks {list(group.ranks)}: " + (
                        # a rank that has returned will never arrive: waiting for the timeout is pointless
                        f"rank(s) {gone} returned from their function without joining this collective, so they did not "
                        f"arrive within the timeout of {self.timeout:g}s (rank {rank} stopped waiting at once)"
                        if gone
                        else f"rank(s) {missing} did not arrive within the timeout of {self.timeout:g}s "
                        f"(rank {rank} gave up)"
                    )
                    self._set_failure(reason)
                    self._cond.notify_all()
                    raise CollectiveError(reason)
                self._cond.wait(left)
            slot["read"] += 1
            if slot["read"] == group.size:
                del self._slots[(group.ranks, seq)]
            entries = slot["entries"]
        _check_agreement(rank, group, entries)
        return {r: p for r, (_, p) in entries.items()}

    def post(self, group: Group, src: int, dst: int, t: torch.Tensor, tag: int = 0) -> None:
        """Point to point: leave a private copy of `t` for `dst` (sends never wait: they are buffered)."""
        with self._cond:
            self._raise_if_failed(("send",), group)
            self._mailboxes.setdefault((group.ranks, src, dst, tag), deque()).append(t.detach().clone())
            self._cond.notify_all()

    def take(self, group: Group, src: int, dst: int, into: torch.Tensor, tag: int = 0) -> None:
        """Point to point: wait for the oldest tensor `src` sent to `dst` over `group`, copy it into `into`.

        Raises after the world's timeout, at once when `src` has returned without sending, and when
        any rank failed: a recv never hangs.
        """
        key = (group.ranks, src, dst, tag)
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while not self._mailboxes.get(key):
                self._raise_if_failed(("recv",), group)
                left = deadline - time.monotonic()
                if src in self.finished or left <= 0:
                    why = (
                        "returned from its function without sending it"
                        if src in self.finished
                        else f"did not send it within the timeout of {self.timeout:g}s"
                    )
                    reason = f"recv on rank {dst} from rank {src} (group {list(group.ranks)}): rank {src} {why}"
                    self._set_failure(reason)
                    self._cond.notify_all()
                    raise CollectiveError(reason)
                self._cond.wait(left)
            got = self._mailboxes[key].popleft()
        if got.dtype != into.dtype or got.shape != into.shape:
            raise CollectiveError(
                f"recv on rank {dst} from rank {src}: rank {src} sent {got.dtype} of shape {tuple(got.shape)}, "
                f"rank {dst} expected {into.dtype} of shape {tuple(into.shape)}; send and recv must agree"
            )
        into.copy_(got)

    def _raise_if_failed(self, signature: tuple, group: Group) -> None:
        if self.failure is not None:
            raise CollectiveError(f"{signature[0]} over ranks {list(group.ranks)} aborted: {self.failure}")


def _later_deadline_for_compiles(deadline: float, timeout: float) -> float:
    """While torch.compile compiles in this process, a collective's timeout counts from the last compile's end."""
    if traceable.compiles_in_progress():
        return time.monotonic() + min(timeout, 1.0)
    return max(deadline, traceable.compile_quiet_since() + timeout)


def _check_agreement(rank: int, group: Group, entries: dict[int, tuple]) -> None:
    sigs = {r: s for r, (s, _) in entries.items()}
    if len(set(sigs.values())) > 1:
        described = "; ".join(f"rank {r}: {_describe(s)}" for r, s in sorted(sigs.items()))
        raise CollectiveError(
            f"mismatched collectives over ranks {list(group.ranks)} (seen on rank {rank}): {described}. "
            "Every rank of a group must issue the same collectives in the same order."
        )


def _describe(sig: tuple) -> str:
    kind, *rest = sig
    return f"{kind}({', '.join(str(x) for x in rest)})"


class ThreadsCommunicator(Communicator):
    def __init__(self, world: ThreadsWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.world_size

    def _all_reduce(self, t: torch.Tensor, op: str, group: Group) -> torch.Tensor:
        got = self.world.exchange(self.rank, group, ("all_reduce", op, t.dtype, tuple(t.shape)), t.clone())
        return reduce_stack([got[r] for r in group.ranks], op)

    def _all_gather(self, t: torch.Tensor, group: Group, shapes: Sequence[tuple]) -> list[torch.Tensor]:
        got = self.world.exchange(self.rank, group, ("all_gather", t.dtype, tuple(shapes)), t.clone())
        return [got[r] if r == self.rank else got[r].clone() for r in group.ranks]

    def _reduce_scatter(self, chunks: Sequence[torch.Tensor], op: str, group: Group) -> torch.Tensor:
        sig = ("reduce_scatter", op, chunks[0].dtype, tuple(tuple(c.shape) for c in chunks))
        got = self.world.exchange(self.rank, group, sig, [c.clone() for c in chunks])
        me = group.index(self.rank)
        return reduce_stack([got[r][me] for r in group.ranks], op)

    def _all_to_all(
        self, chunks: Sequence[torch.Tensor], group: Group, recv_shapes: Sequence[tuple]
    ) -> list[torch.Tensor]:
        got = self.world.exchange(self.rank, group, ("all_to_all", chunks[0].dtype), [c.clone() for c in chunks])
        me = group.index(self.rank)
        out = [got[r][me] for r in group.ranks]
        for r, o, s in zip(group.ranks, out, recv_shapes):
            if tuple(o.shape) != tuple(s):
                raise CollectiveError(
                    f"all_to_all over ranks {list(group.ranks)}: rank {r} sent shape {tuple(o.shape)} to rank "
                    f"{self.rank}, which expected {tuple(s)}"
                )
        return out

    def _broadcast(self, t: torch.Tensor, src_index: int, group: Group) -> torch.Tensor:
        src = group.ranks[src_index]
        got = self.world.exchange(
            self.rank, group, ("broadcast", src_index, t.dtype, tuple(t.shape)), t.clone() if self.rank == src else None
        )
        return got[src] if self.rank == src else got[src].clone()

    def _barrier(self, group: Group) -> None:
        self.world.exchange(self.rank, group, ("barrier",), None)

    def _batch_isend_irecv(self, ops: list[P2POp]) -> list[P2PWork]:
        works = []
        for p2p in ops:
            group = p2p.group if p2p.group is not None else self.world_group()
            if p2p.kind == "send":
                self.world.post(group, self.rank, p2p.peer, p2p.tensor, p2p.tag)
                works.append(P2PWork())
            else:
                works.append(
                    P2PWork(functools.partial(self.world.take, group, p2p.peer, self.rank, p2p.tensor, p2p.tag))
                )
        return works
