"""Benchmark cases the benchmark tests share (import after making benchmarks/ importable)."""

from __future__ import annotations

import torch
from benchmarks.cases import Case

RAISED = "NotImplementedError: no strategy for this op"


def raising_case() -> Case:
    """A reduction case whose op raises: each side must record an error row, not crash."""

    def boom(x):
        raise NotImplementedError("no strategy for this op")

    return Case(
        name="boom",
        build=lambda g: (torch.randn(4, 8, generator=g),),
        fn=boom,
        placements={(4,): (("S(1)",),)},
        kind="reduction",
        reduce_dims=(1,),
        floor_row_bytes=4,
    )
