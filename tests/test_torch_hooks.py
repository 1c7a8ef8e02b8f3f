"""shardops changes torch only through shardops._torch.install(), and loudly when an internal is missing (issue 41).

Each check runs in a fresh interpreter: this test process has long since installed the hooks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

SRC = Path(__file__).resolve().parent.parent / "src"


def _run_python(code: str) -> dict:
    """Run `code` in a fresh interpreter with this tree's shardops; it prints one JSON object last."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


SNAPSHOT = """
import json, types
import torch, torch.random, torch.nn.init, torch._dynamo

MODULES = (torch, torch.random, torch.nn.init, torch._dynamo)

def snapshot():
    return {m.__name__: (type(m), dict(vars(m))) for m in MODULES}  # the values themselves: ids cannot be reused

def changes(before, after):
    found = []
    for m in MODULES:
        (type_before, old), (type_after, new) = before[m.__name__], after[m.__name__]
        if type_after is not type_before:
            found.append(f"type({m.__name__}) is now {type_after.__name__}")
        found += [f"{m.__name__}.{k} replaced" for k in old if k in new and new[k] is not old[k]]
        found += [f"{m.__name__}.{k} removed" for k in old if k not in new]
        # an import of a torch submodule adds it to its package: the only addition allowed
        found += [f"{m.__name__}.{k} added" for k in new if k not in old
                  and not (isinstance(new[k], types.ModuleType) and new[k].__name__ == f"{m.__name__}.{k}")]
        found += [f"{m.__name__}.__dict__[{k!r}] is not what {m.__name__}.{k} reads" for k in ("default_generator",)
                  if k in new and getattr(m, k) is not new[k]]
    return sorted(found)
"""


def test_importing_shardops_changes_nothing_in_torch_and_install_changes_only_its_hooks():
    result = _run_python(
        SNAPSHOT
        + """
before = snapshot()
import shardops as so
imported = snapshot()
so.DeviceMesh("cpu", [0])  # the first mesh (init_device_mesh's, a DTensor's) installs the hooks
meshed = snapshot()
so.run(lambda: None, 2)  # and so.run would: installed once, nothing more changes
print(json.dumps({
    "import": changes(before, imported), "install": changes(before, meshed), "run": changes(meshed, snapshot())
}))
"""
    )
    assert result["import"] == []
    assert result["run"] == []
    # The same comparison sees the hooks once installed (the check can fail): only these, and
    # torch.default_generator still reads as torch's own object outside so.run's rank threads.
    assert result["install"] == sorted(
        [f"torch.{f} replaced" for f in ("manual_seed", "seed", "initial_seed", "get_rng_state", "set_rng_state")]
        + [
            f"torch.random.{f} replaced"
            for f in ("manual_seed", "seed", "initial_seed", "get_rng_state", "set_rng_state")
        ]
        + [
            "torch.nn.init.trunc_normal_ replaced",
            "torch.nn.init.sparse_ replaced",
            "type(torch) is now TorchModuleWithRankDefaultGenerator",
        ]
    )


def test_a_missing_internal_fails_loudly_naming_the_hook_and_changes_nothing():
    result = _run_python(
        SNAPSHOT
        + """
import shardops as so
from shardops._torch import TorchInternalMissing

messages = {}
for owner, name in (
    (torch._C, "_push_on_torch_dispatch_stack"),
    (torch.nn.init, "trunc_normal_"),
    (torch.random, "get_rng_state"),
):
    kept = getattr(owner, name)
    delattr(owner, name)  # a torch release without it
    before = snapshot()
    try:
        so.run(lambda: torch.rand(1), 2)
        messages[name] = "no error"
    except TorchInternalMissing as e:
        messages[name] = str(e)
    messages[name + " changed"] = changes(before, snapshot())
    setattr(owner, name, kept)
so.run(lambda: None, 2)  # with every internal back, install succeeds
messages["installed"] = so._torch.installed()
print(json.dumps(messages))
"""
    )
    for name, hook, owner in (
        ("_push_on_torch_dispatch_stack", "random.dispatch_stack", "torch._C"),
        ("trunc_normal_", "random.nn_init", "torch.nn.init"),
        ("get_rng_state", "random.default_state", "torch.random"),
    ):
        message = result[name]
        assert f"shardops hook {hook!r}" in message, message
        assert f"needs {owner}.{name}" in message and f"torch {torch.__version__} does not have" in message, message
        assert "known for torch 2.13, 2.14, 2.15" in message, message
        assert result[name + " changed"] == [], (name, result[name + " changed"])  # checked before anything changed
    assert result["installed"] is True


def test_a_missing_internal_that_shardops_only_reads_fails_the_import_naming_it():
    # the dispatch hot path binds torch._C._set_neg & co. once at import: a torch without one stops
    # `import shardops` there, with the hook's name, rather than at the first complex DTensor
    result = _run_python(
        """
import json, torch
del torch._C._set_neg  # a torch release without it
try:
    import shardops
    print(json.dumps({"error": None}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""
    )
    assert result["error"] == "TorchInternalMissing", result
    message = result["message"]
    assert "shardops hook 'dispatch.subclass'" in message and "needs torch._C._set_neg" in message, message
    assert f"torch {torch.__version__} does not have" in message and "known for torch 2.13, 2.14, 2.15" in message, (
        message
    )


def test_a_missing_private_placement_fails_the_conversion_naming_it(monkeypatch):
    import torch.distributed.tensor.placement_types as placement_types

    from shardops._torch import TorchInternalMissing, distributed

    monkeypatch.delattr(placement_types, "_StridedShard")
    distributed.strided_shard_class.cache_clear()
    try:
        with pytest.raises(
            TorchInternalMissing, match=r"'distributed.placements'.*placement_types\._StridedShard.*does not have"
        ):
            distributed.strided_shard_class()
    finally:
        distributed.strided_shard_class.cache_clear()  # found again once torch has it back
