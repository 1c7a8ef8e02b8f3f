"""run_gloo, the launcher of gloo processes (benchmarks, the demo's torch side, the tests): a rank
that raises or cannot even import its function comes back as a RankFailure naming the cause
(its exception's type, message and the rank's own traceback), never as a bare exit code."""

from __future__ import annotations

import os
import signal
import sys
import types

import pytest

from shardops.errors import ShardingError
from shardops.training.launch import RankFailure, run_gloo


def rank_one_raises() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ShardingError("rank one found a bad layout")
    return dist.get_rank()


def rank_kills_itself() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_raising_rank_carries_its_exception():
    with pytest.raises(RankFailure) as info:
        run_gloo(rank_one_raises, 2, timeout=120)
    e = info.value
    assert e.rank == 1
    assert e.error_type == "shardops.errors.ShardingError"
    assert e.error_message == "rank one found a bad layout"
    assert (
        "in rank_one_raises" in e.rank_traceback
        and 'raise ShardingError("rank one found a bad layout")' in e.rank_traceback
    )
    first, *rest = str(e).splitlines()
    assert first == "run_gloo: rank 1 raised: shardops.errors.ShardingError: rank one found a bad layout"
    assert e.rank_traceback.strip() in str(e)  # the report shows the rank's own traceback


def test_a_rank_that_cannot_import_its_function_names_the_import_error(monkeypatch):
    """The bench's failure: the parent knew a module (put into sys.modules) that a spawned rank cannot import."""
    module = types.ModuleType("known_only_to_the_parent")
    exec("def work():\n    return 1\n", module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(RankFailure) as info:
        run_gloo(module.work, 1, timeout=120)
    e = info.value
    assert e.rank == 0 and e.error_type == "ModuleNotFoundError"
    assert e.error_message == "No module named 'known_only_to_the_parent'"
    assert str(e).startswith("run_gloo: rank 0 raised: ModuleNotFoundError: No module named 'known_only_to_the_parent'")


def test_a_rank_killed_by_a_signal_says_which():
    with pytest.raises(RankFailure, match=r"rank 0 exited \(killed by SIGKILL\) without a result") as info:
        run_gloo(rank_kills_itself, 1, timeout=120)
    assert info.value.rank == 0 and info.value.error_type is None
