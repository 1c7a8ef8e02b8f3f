"""`schedule.explain()`: one rank's program and the point-to-point traffic of one step, from metadata.

Nothing runs and nothing is sent: the program is the schedule's own (the order `step` executes) and
each transfer follows from the shapes crossing the stage boundaries (inferred by the first step, or
declared with the stages' `input_args`/`output_args`). The counts are CommDebugMode's for a steady step
(one "send" and one "recv" per tensor; the sender counts the bytes of the local part it sends), so a
test or a user can hold the measured traffic against this. Collectives that the stages' own plans send
(tensor or data parallelism inside a stage) are not in it: `so.explain` prices those per op.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from .stage import TensorMeta

SEND, RECV = "send", "recv"


def meta_bytes(meta: TensorMeta) -> int:
    """The bytes of the local part that crosses (a DTensor's shard, not its global shape)."""
    return math.prod(meta.shape) * meta.dtype.itemsize


@dataclass(frozen=True)
class Transfer:
    """What one action of the program sends or receives: `what` is "activations" or "gradients"."""

    action: str  # torch's notation: "1F0" is stage 1's forward of micro-batch 0
    direction: str  # SEND or RECV
    peer: int  # the other side's global rank
    what: str
    tensors: tuple[TensorMeta, ...]

    @property
    def nbytes(self) -> int:
        return sum(meta_bytes(m) for m in self.tensors)


@dataclass(frozen=True)
class PipelineExplanation:
    """One rank's view of a step: its stages, the order it runs their actions in, and what crosses ranks."""

    schedule: str
    rank: int
    num_stages: int
    n_microbatches: int
    stage_ranks: tuple[int, ...]  # the global rank each stage lives on
    program: tuple[str, ...]
    transfers: tuple[Transfer, ...]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == self.rank)

    def get_comm_counts(self) -> dict[str, int]:
        """As CommDebugMode counts a steady step of this rank: one per tensor sent or received."""
        counts: Counter[str] = Counter()
        for t in self.transfers:
            counts[t.direction] += len(t.tensors)
        return dict(counts)

    def get_total_bytes(self) -> int:
        """The bytes this rank sends in a step (CommDebugMode's figure: receives count at their sender)."""
        return sum(t.nbytes for t in self.transfers if t.direction == SEND)

    def __str__(self) -> str:
        head = (
            f"{self.schedule}: {self.num_stages} stages, {self.n_microbatches} micro-batches; "
            f"rank {self.rank} runs stage{'s' if len(self.stages) != 1 else ''} {', '.join(map(str, self.stages))}"
        )
        lines = [head, "program: " + " ".join(self.program), "point to point per step:"]
        lines += [f"  {row}" for row in _summary(self.transfers)] or ["  nothing (every neighbour is on this rank)"]
        counts = self.get_comm_counts()
        lines.append(
            f"total: {counts.get(SEND, 0)} sends ({self.get_total_bytes():,} B), {counts.get(RECV, 0)} receives"
        )
        return "\n".join(lines)


def _summary(transfers: Sequence[Transfer]) -> list[str]:
    """One line per (direction, peer, kind, shapes): how many, and their bytes."""
    groups: dict[tuple, list[Transfer]] = {}
    for t in transfers:
        groups.setdefault((t.direction, t.peer, t.what, t.tensors), []).append(t)
    rows = []
    for (direction, peer, what, tensors), items in groups.items():
        shapes = ", ".join(m.describe() for m in tensors)
        toward = "to" if direction == SEND else "from"
        rows.append(
            f"{direction} {what} {toward} rank {peer}: {len(items)} x ({shapes}) = {sum(t.nbytes for t in items):,} B"
            f"  [{items[0].action}..{items[-1].action}]"
        )
    return rows
