"""The tests' gloo launcher: shardops.training.launch.run_gloo with short collective timeouts.

Process groups made after init (torch DeviceMesh dims, shardops' multi-dim groups)
take c10d's default timeout (30 min), not init's: the tests make a stuck rank fail
fast by setting c10d's private default in each child (tests may use torch privates).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from shardops.training.launch import RankFailure
from shardops.training.launch import run_gloo as _run_gloo

__all__ = ["RankFailure", "run_gloo"]


def short_timeouts(pg_timeout: float) -> None:
    import torch.distributed.distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=pg_timeout)
    c10d.default_pg_timeout = timeout
    c10d._set_pg_timeout(timeout)  # the world group met with the run's whole timeout


def run_gloo(
    fn: Callable[..., Any], world_size: int = 4, *args: Any, timeout: float = 120, pg_timeout: float | None = None
) -> list[Any]:
    return _run_gloo(fn, world_size, *args, timeout=timeout, pg_timeout=pg_timeout, setup=short_timeouts)
