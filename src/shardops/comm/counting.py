"""What a collective call counts: CommDebugMode's per-rank counters, and which dtypes the transports
reduce natively (the wire figure of a reduce_scatter depends on it).

Below the communicators and the traced collectives (comm/traceable.py), which both record here:
a compiled step is counted by the same function as an eager one.
"""

from __future__ import annotations

import threading
from collections import Counter

import torch

_modes = threading.local()


def _active_modes() -> list[CommDebugMode]:
    stack = getattr(_modes, "stack", None)
    if stack is None:
        stack = _modes.stack = []
    return stack


def record(kind: str, num_bytes: int, wire_bytes: int | None = None) -> None:
    """One collective call: its logical bytes and its wire bytes (default: the same)."""
    wire = num_bytes if wire_bytes is None else wire_bytes
    for mode in _active_modes():
        mode.counts[kind] += 1
        mode.bytes += num_bytes
        mode.wire_bytes += wire
        mode.rounds += 1
        mode.log.append((kind, num_bytes))
        mode.wire_log.append((kind, wire))


def record_p2p(ops: list[tuple[str, int]]) -> None:
    """Point-to-point ops issued together (one `send`/`recv` or one batch): each op is counted
    under its kind ("send" with the bytes this rank sends, "recv" with 0: the sender counts the
    bytes), and the whole batch is one round. torch's CommDebugMode does not count c10d's p2p ops
    at all; shardops counts them so that a pipeline's traffic is visible beside its collectives."""
    for mode in _active_modes():
        for kind, num_bytes in ops:
            mode.counts[kind] += 1
            mode.bytes += num_bytes
            mode.wire_bytes += num_bytes
            mode.log.append((kind, num_bytes))
            mode.wire_log.append((kind, num_bytes))
        mode.rounds += 1 if ops else 0


class CommDebugMode:
    """Counts, on this rank, the collectives issued inside the block."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.bytes = 0
        self.wire_bytes = 0
        self.rounds = 0
        self.log: list[tuple[str, int]] = []  # (kind, logical bytes) per call
        self.wire_log: list[tuple[str, int]] = []  # (kind, wire bytes) per call

    def __enter__(self) -> CommDebugMode:
        # as torch's CommDebugMode: every entry counts from zero
        self.counts = Counter()
        self.bytes = 0
        self.wire_bytes = 0
        self.rounds = 0
        self.log = []
        self.wire_log = []
        _active_modes().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active_modes().remove(self)

    def get_total_counts(self) -> int:
        return sum(self.counts.values())

    def get_comm_counts(self) -> dict[str, int]:
        return dict(self.counts)

    def get_total_bytes(self) -> int:
        """Logical bytes: padding excluded, the same figure in every world."""
        return self.bytes

    def get_wire_bytes(self) -> int:
        """Bytes handed to the transport: uneven all_gather/reduce_scatter padded to the largest member."""
        return self.wire_bytes

    def get_rounds(self) -> int:
        return self.rounds


# dtypes that gloo and nccl both reduce natively (gloo rejects int16: "Invalid scalar type"); the
# torch.distributed world gathers the others and reduces locally. Here because the wire figure
# of a reduce_scatter depends on it in every world.
_NATIVE_REDUCE_DTYPES = frozenset(
    {torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64}
)


def natively_reducible(dtype: torch.dtype, op: str) -> bool:
    if dtype == torch.bool or dtype in _NATIVE_REDUCE_DTYPES:
        return True
    return dtype.is_complex and op in ("sum", "avg") and dtype in (torch.complex64, torch.complex128)
