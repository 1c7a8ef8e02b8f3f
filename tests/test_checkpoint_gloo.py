"""Checkpoints between torch DTensor and shardops as 4 gloo processes (one launch, several checks).

Acceptance of issue 24 (plus torch's fully_shard checkpoints, both ways): torch's
tensor-parallel Llama on a (4,) mesh trains a step and saves with torch's own `dcp.save`; a
shardops model on (2,2) (dp x tp) loads it with torch's own `dcp.load` and continues: its
next-step losses equal torch's. And the reverse: shardops
saves (plain `dcp.save` through the subclass hooks, and `shardops.checkpoint.save`), torch
loads and continues with shardops' losses. Also: torch's `dcp_to_torch_save` of a shardops
checkpoint, and `torch.save` / `torch.load` of a shardops state dict per rank; the memory bound
of a resharding load (in the same launch: each process measures its own peak); and resuming
with dropout on, bitwise, in new gloo processes (slow).

The launches are few on purpose (each one spawns 4 processes that import torch): the checks
share them.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from checkpoint_harness import (
    full,
    shardops_model,
    shardops_step,
    torch_model,
    torch_step,
    train_and_checkpoint,
)  # tests/ is not a package
from mp import run_gloo

LR = 1e-2


def _checks(tmp: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import shardops as so

    rank = dist.get_rank()
    out: dict = {}
    # torch -> shardops
    tm = torch_model(seed=0)
    topt = torch.optim.AdamW(tm.parameters(), lr=LR)
    torch_step(tm, topt, 0)
    dcp.save(
        {"model": get_model_state_dict(tm), "optim": get_optimizer_state_dict(tm, topt)},
        checkpoint_id=os.path.join(tmp, "torch"),
    )
    out["torch_losses"] = [torch_step(tm, topt, s) for s in (1, 2)]

    sm, mesh, dp_rank = shardops_model((2, 2), seed=7)
    sopt = torch.optim.AdamW(sm.parameters(), lr=LR)
    state: dict[str, Any] = {"model": get_model_state_dict(sm), "optim": get_optimizer_state_dict(sm, sopt)}
    dcp.load(state, checkpoint_id=os.path.join(tmp, "torch"))
    set_model_state_dict(sm, state["model"])
    set_optimizer_state_dict(sm, sopt, state["optim"])
    out["shardops_after_torch"] = [shardops_step(sm, sopt, s, dp=2, dp_rank=dp_rank) for s in (1, 2)]

    # shardops -> torch: plain dcp.save of shardops state dicts, and shardops.checkpoint.save
    sm, mesh, dp_rank = shardops_model((2, 2), seed=0)
    sopt = torch.optim.AdamW(sm.parameters(), lr=LR)
    shardops_step(sm, sopt, 0, dp=2, dp_rank=dp_rank)
    dcp.save(
        {"model": get_model_state_dict(sm), "optim": get_optimizer_state_dict(sm, sopt)},
        checkpoint_id=os.path.join(tmp, "so_dcp"),
    )
    so.checkpoint.save({"model": sm, "optim": sopt}, os.path.join(tmp, "so_api"))
    saved_params = {n: full(p).clone() for n, p in sm.state_dict().items()}
    out["shardops_losses"] = [shardops_step(sm, sopt, s, dp=2, dp_rank=dp_rank) for s in (1, 2)]
    for name in ("so_dcp", "so_api"):
        tm = torch_model(seed=9)
        topt = torch.optim.AdamW(tm.parameters(), lr=LR)
        state = {"model": get_model_state_dict(tm), "optim": get_optimizer_state_dict(tm, topt)}
        dcp.load(state, checkpoint_id=os.path.join(tmp, name))
        set_model_state_dict(tm, state["model"])
        set_optimizer_state_dict(tm, topt, state["optim"])
        out[f"torch_after_{name}"] = [torch_step(tm, topt, s) for s in (1, 2)]

    if rank == 0:
        dcp_to_torch_save(os.path.join(tmp, "so_api"), os.path.join(tmp, "so_api.pt"))
        whole = torch.load(os.path.join(tmp, "so_api.pt"))
        out["to_torch_save_equal"] = all(torch.equal(whole["model"][n], saved_params[n]) for n in saved_params)
    # torch.save / torch.load of a shardops state dict, per rank
    path = os.path.join(tmp, f"sd_rank{rank}.pt")
    torch.save(sm.state_dict(), path)
    loaded = torch.load(path)
    out["pickle_equal"] = all(
        torch.equal(full(loaded[n]), full(p)) and loaded[n].placements == p.placements
        for n, p in sm.state_dict().items()
    )
    out["fsdp"] = _fully_shard_both_ways(tmp)
    out["across_rank_sets"] = _load_state_dict_across_rank_sets()
    out["memory"] = _resharding_load_memory(os.path.join(tmp, "big"))
    return out


def _load_state_dict_across_rank_sets() -> bool:
    """A TP model on (4,) into one on mesh["tp"] of (2, 2) (rank sets {0,1} and {2,3}): single-device values."""
    import shardops as so
    from shardops.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def model(mesh):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(7, 10), torch.nn.ReLU(), torch.nn.Linear(10, 7))
        if mesh is not None:
            parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return m

    expected = model(None).state_dict()
    src = model(so.init_device_mesh("cpu", (4,)))
    dst = model(so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"])
    with torch.no_grad():
        for p in dst.parameters():
            p.zero_()
    dst.load_state_dict(src.state_dict())
    return all(torch.equal(full(t), expected[n]) for n, t in dst.state_dict().items())


def _fully_shard_both_ways(tmp: str) -> tuple[bool, bool]:
    """torch's fully_shard (FSDP2) checkpoint -> shardops (2, 2) tensor + data parallel, and the reverse."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import shardops as so
    from checkpoint_harness import ARGS
    from shardops.models import Llama

    def fsdp_llama(seed: int):
        model = Llama(ARGS, seed=seed)
        mesh = init_device_mesh("cpu", (4,))
        for layer in model.layers.children():
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    dcp.save(get_model_state_dict(fsdp_llama(4)), checkpoint_id=os.path.join(tmp, "fsdp"))
    sm, _, _ = shardops_model((2, 2), seed=0)
    state: dict[str, Any] = get_model_state_dict(sm)
    dcp.load(state, checkpoint_id=os.path.join(tmp, "fsdp"))
    into_shardops = all(torch.equal(full(state[k]), v) for k, v in Llama(ARGS, seed=4).state_dict().items())
    sm, _, _ = shardops_model((2, 2), seed=6)
    so.checkpoint.save({"model": sm}, os.path.join(tmp, "so_fsdp"))
    state = {"model": get_model_state_dict(fsdp_llama(0))}
    dcp.load(state, checkpoint_id=os.path.join(tmp, "so_fsdp"))
    into_fsdp = all(torch.equal(full(state["model"][k]), v) for k, v in Llama(ARGS, seed=6).state_dict().items())
    return into_shardops, into_fsdp


MiB = 1 << 20
BIG = (4096, 4096)  # float32: 64 MiB


class _LargestNewStorage:
    """The largest tensor storage any aten op allocates on this process while active (views excluded)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {
                    t.untyped_storage().data_ptr()
                    for t in torch.utils._pytree.tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor)
                }
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                        outer.largest = max(outer.largest, t.untyped_storage().nbytes())
                return out

        self.largest = 0
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _resharding_load_memory(path: str) -> dict:
    """A (4,)-sharded 64 MiB tensor, loaded onto (2, 2): what this rank allocates and reads.

    Three measurements: tracemalloc's peak (the Python read buffers), the largest storage an
    aten op allocates (a dispatch mode), and the process's peak resident memory (VmHWM after
    resetting it through /proc/self/clear_refs) above the resident memory before the load.
    """
    import gc
    import tracemalloc

    import shardops as so
    from shardops import Shard
    from shardops.checkpoint.api import checkpoint_dir, load_state_dict

    mesh4 = so.init_device_mesh("cpu", (4,))
    rank = mesh4.get_rank()
    rows = BIG[0] // 4
    src = so.DTensor.from_local(
        torch.randn(rows, BIG[1], generator=torch.Generator().manual_seed(rank)), mesh4, [Shard(0)]
    )
    so.checkpoint.save({"big": src}, path)
    del src
    mesh22 = so.init_device_mesh("cpu", (2, 2))
    shard = (BIG[0] // 2, BIG[1] // 2)
    dst = so.DTensor.from_local(torch.zeros(shard), mesh22, [Shard(0), Shard(1)], shape=BIG)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    before = _proc_status("VmRSS")
    tracemalloc.start()
    with _LargestNewStorage() as largest:
        reader = load_state_dict({"big": dst}, checkpoint_dir(path))
    python_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    rss_growth = _proc_status("VmHWM") - before
    i, j = mesh22.own_coordinate()
    halves = [torch.randn(rows, BIG[1], generator=torch.Generator().manual_seed(2 * i + k)) for k in range(2)]
    expected = torch.cat(halves)[:, j * shard[1] : (j + 1) * shard[1]]
    return {
        "equal": torch.equal(dst.to_local(), expected),
        "shard_bytes": dst.to_local().nbytes,
        "bytes_read": reader.bytes_read,
        "largest_buffer": reader.largest_buffer,
        "python_peak": python_peak,
        "largest_torch_allocation": largest.largest,
        "rss_growth": rss_growth,
    }


@pytest.mark.timeout(900)
def test_torch_and_shardops_checkpoints_load_into_each_other(tmp_path):
    results = run_gloo(_checks, 4, str(tmp_path), timeout=600)
    r0 = results[0]
    for r in results:
        assert r["torch_losses"] == r0["torch_losses"]
    # the next-step losses after loading equal the run that saved (float tolerance: other mesh, other reduction order)
    assert r0["shardops_after_torch"] == pytest.approx(r0["torch_losses"], rel=1e-5, abs=1e-6)
    assert r0["torch_after_so_dcp"] == pytest.approx(r0["shardops_losses"], rel=1e-5, abs=1e-6)
    assert r0["torch_after_so_api"] == pytest.approx(r0["shardops_losses"], rel=1e-5, abs=1e-6)
    assert r0["to_torch_save_equal"]
    assert all(r["pickle_equal"] for r in results)
    assert all(r["fsdp"] == (True, True) for r in results)  # torch fully_shard checkpoints, both ways
    assert all(r["across_rank_sets"] for r in results)
    for r in results:  # peak extra memory per rank <= its shard + a 16 MiB read buffer
        m = r["memory"]
        assert m["equal"]
        assert m["bytes_read"] == m["shard_bytes"] == 16 * MiB  # exactly its own bytes, no whole saved shard
        assert m["largest_buffer"] <= 16 * MiB and m["python_peak"] <= 16 * MiB
        assert m["largest_torch_allocation"] <= m["shard_bytes"]
        assert m["rss_growth"] <= m["shard_bytes"] + 16 * MiB


def _resume_new_processes(tmp: str) -> dict:
    path = os.path.join(tmp, "resume")
    return {
        "same_mesh": train_and_checkpoint(path, range(3, 6), True, None, invariant_dropout=True),
        "without_rng": train_and_checkpoint(path, range(3, 6), True, None, with_rng=False, invariant_dropout=True),
    }


def _resume_first_run(tmp: str) -> list[float]:
    return train_and_checkpoint(os.path.join(tmp, "resume"), range(6), False, 2, invariant_dropout=True)[0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_with_dropout_in_new_gloo_processes_is_bitwise(tmp_path):
    """Issue 29's acceptance in the torch.distributed world (slow: two launches and 12 steps on a
    loaded machine take minutes): GPT-2 with dropout on trains 6 steps on (2, 2), saving after
    step 3; new processes load onto (2, 2) and train steps 4-6. The plan keeps the tensors dropout
    reads as DTensors on mesh["tp"] (training/config.py): each data-parallel rank's masks are those
    of its batch slice, as under torch's data parallelism (so another dp size draws other masks)."""
    whole = run_gloo(_resume_first_run, 4, str(tmp_path), timeout=600)
    resumed = run_gloo(_resume_new_processes, 4, str(tmp_path), timeout=600)
    for r, again in zip(whole, resumed):
        losses, loaded_step = again["same_mesh"]
        assert loaded_step == 3
        assert losses == r[3:]  # bitwise on the same mesh
    assert resumed[0]["without_rng"][0] != whole[0][3:]  # control: the random state matters


def _save_maybe_dying(path: str, step: int, die_rank: int | None) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    import shardops as so
    from shardops import Shard

    mesh = so.init_device_mesh("cpu", (2, 2))
    weights = so.distribute_tensor(torch.full((8, 8), float(step)), mesh, [Shard(0), Shard(1)])
    if die_rank is not None and mesh.get_rank() == die_rank:

        def die(self, plan, planner):
            os._exit(3)  # the process is gone mid-save, without a word to the others

        FileSystemWriter.write_data = die  # type: ignore[method-assign]  # this process dies mid-save on purpose
    so.checkpoint.save({"w": weights, "step": step}, path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_killed_mid_save_leaves_the_last_good_checkpoint(tmp_path):
    import shardops as so
    from mp import RankFailure
    from shardops import Shard

    path = str(tmp_path / "ckpt")
    run_gloo(_save_maybe_dying, 4, path, 1, None, timeout=300)
    with pytest.raises(RankFailure, match="rank 2 exited"):
        run_gloo(_save_maybe_dying, 4, path, 2, 2, timeout=300, pg_timeout=10)

    def load():
        mesh = so.init_device_mesh("cpu", (4,))
        state = {"w": so.distribute_tensor(torch.zeros(8, 8), mesh, [Shard(1)]), "step": 0}
        so.checkpoint.load(state, path)
        return state["step"], state["w"].full_tensor()

    for step, w in so.run(load, 4):
        assert step == 1 and torch.equal(w, torch.full((8, 8), 1.0))
