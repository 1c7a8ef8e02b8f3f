"""How explain writes bytes, times and placement tuples."""

from __future__ import annotations

from collections.abc import Sequence

from ..placements import Placement


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def placements_text(placements: Sequence[Placement]) -> str:
    return ",".join(map(repr, placements))
