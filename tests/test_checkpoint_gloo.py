"""Checkpoints between torch DTensor and shardops as 4 gloo processes (one launch, several checks).

Acceptance of issue 24: torch's tensor-parallel Llama on a (4,) mesh trains a step and saves
with torch's own `dcp.save`; a shardops model on (2,2) (dp x tp) loads it with torch's own
`dcp.load` and continues: its next-step losses equal torch's. And the reverse: shardops
saves (plain `dcp.save` through the subclass hooks, and `shardops.checkpoint.save`), torch
loads and continues with shardops' losses. Also: torch's `dcp_to_torch_save` of a shardops
checkpoint, and `torch.save` / `torch.load` of a shardops state dict per rank.
"""
from __future__ import annotations

import os

import pytest
import torch

try:
    from .checkpoint_harness import full, shardops_model, shardops_step, torch_model, torch_step
    from .mp import run_gloo
except ImportError:  # tests/ is not a package
    from checkpoint_harness import full, shardops_model, shardops_step, torch_model, torch_step
    from mp import run_gloo

LR = 1e-2


def _checks(tmp: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict

    import shardops as so

    rank = dist.get_rank()
    out: dict = {}
    # torch -> shardops
    tm = torch_model(seed=0)
    topt = torch.optim.AdamW(tm.parameters(), lr=LR)
    torch_step(tm, topt, 0)
    dcp.save({"model": get_model_state_dict(tm), "optim": get_optimizer_state_dict(tm, topt)}, checkpoint_id=os.path.join(tmp, "torch"))
    out["torch_losses"] = [torch_step(tm, topt, s) for s in (1, 2)]

    sm, mesh, dp_rank = shardops_model((2, 2), seed=7)
    sopt = torch.optim.AdamW(sm.parameters(), lr=LR)
    state = {"model": get_model_state_dict(sm), "optim": get_optimizer_state_dict(sm, sopt)}
    dcp.load(state, checkpoint_id=os.path.join(tmp, "torch"))
    set_model_state_dict(sm, state["model"])
    set_optimizer_state_dict(sm, sopt, state["optim"])
    out["shardops_after_torch"] = [shardops_step(sm, sopt, s, dp=2, dp_rank=dp_rank) for s in (1, 2)]

    # shardops -> torch: plain dcp.save of shardops state dicts, and shardops.checkpoint.save
    sm, mesh, dp_rank = shardops_model((2, 2), seed=0)
    sopt = torch.optim.AdamW(sm.parameters(), lr=LR)
    shardops_step(sm, sopt, 0, dp=2, dp_rank=dp_rank)
    dcp.save({"model": get_model_state_dict(sm), "optim": get_optimizer_state_dict(sm, sopt)}, checkpoint_id=os.path.join(tmp, "so_dcp"))
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
    out["pickle_equal"] = all(torch.equal(full(loaded[n]), full(p)) and loaded[n].placements == p.placements for n, p in sm.state_dict().items())
    return out


@pytest.mark.timeout(600)
def test_torch_and_shardops_checkpoints_load_into_each_other(tmp_path):
    results = run_gloo(_checks, 4, str(tmp_path), timeout=500)
    r0 = results[0]
    for r in results:
        assert r["torch_losses"] == r0["torch_losses"]
    # the next-step losses after loading equal the run that saved (float tolerance: other mesh, other reduction order)
    assert r0["shardops_after_torch"] == pytest.approx(r0["torch_losses"], rel=1e-5, abs=1e-6)
    assert r0["torch_after_so_dcp"] == pytest.approx(r0["shardops_losses"], rel=1e-5, abs=1e-6)
    assert r0["torch_after_so_api"] == pytest.approx(r0["shardops_losses"], rel=1e-5, abs=1e-6)
    assert r0["to_torch_save_equal"]
    assert all(r["pickle_equal"] for r in results)
