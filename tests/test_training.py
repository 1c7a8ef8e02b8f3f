"""Training the LLaMA- and GPT-2-style models with shardops equals single-device training.

Strict mode (no fallback anywhere), AdamW, 3 steps, meshes (4,) (tp) and (2, 2)
(dp x tp): every step's loss, the first step's gradients and the final parameters
against single-device training from the same initial weights, computed here.
"""

from __future__ import annotations

import math

import pytest
import torch

import shardops as so
from shardops.training.config import SIZES, RunSpec
from shardops.training.reference import reference
from shardops.training.shardops_side import train_rank

TOL = 1e-4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.vector_norm((a - b).double()) / torch.linalg.vector_norm(b.double()).clamp_min(1e-30)).item()


def _train(spec: RunSpec) -> list[dict]:
    return so.run(train_rank, math.prod(spec.mesh_shape), spec, None, True, timeout=600)


# a 1-D tp mesh has no data-parallel dim: one dp mode
@pytest.mark.parametrize(
    "mesh, dp_mode",
    [((4,), "replicate"), ((2, 2), "replicate"), ((2, 2), "shard")],
    ids=["tp4", "dp2xtp2-replicate", "dp2xtp2-shard"],
)
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_training_equals_single_device(strict, model, mesh, dp_mode):
    spec = RunSpec(model=model, cfg=SIZES["tiny"], mesh_shape=mesh, steps=3, dp_mode=dp_mode)
    ref = reference(spec)
    results = _train(spec)
    for rank_result in results:
        losses = [r.loss for r in rank_result["records"]]
        ref_losses = [r.loss for r in ref["records"]]
        assert losses == pytest.approx(ref_losses, rel=TOL, abs=TOL)
    ours = results[0]
    assert set(ours["grads"]) == set(ref["grads"])
    for name, g_ref in ref["grads"].items():
        assert _rel(ours["grads"][name], g_ref) <= TOL, name
    for name, p_ref in ref["params"].items():
        assert ours["params"][name].shape == p_ref.shape, name
        assert _rel(ours["params"][name], p_ref) <= TOL, name


@pytest.mark.parametrize("mesh", [(4,), (2, 2)], ids=["tp4", "dp2xtp2"])
def test_gpt2_with_dropout_equals_single_device_with_the_same_masks(strict, mesh):
    """Dropout on DTensors draws the global tensor's mask whatever the tp layout: the reference is
    single-device training whose nn.Dropout layers take shardops' masks of the whole tensor, under
    data parallelism each rank's batch slice's (training/reference.py). Without them the run
    differs: the check can fail."""
    from dataclasses import replace

    spec = RunSpec(
        model="gpt2", cfg=replace(SIZES["tiny"], dropout=0.1), mesh_shape=mesh, steps=3, local_attention=False
    )
    ref = reference(spec)
    results = _train(spec)
    for rank_result in results:
        assert [r.loss for r in rank_result["records"]] == pytest.approx(
            [r.loss for r in ref["records"]], rel=TOL, abs=TOL
        )
    for name, g_ref in ref["grads"].items():
        assert _rel(results[0]["grads"][name], g_ref) <= TOL, name
    for name, p_ref in ref["params"].items():
        assert _rel(results[0]["params"][name], p_ref) <= TOL, name
    # the masks matter: without dropout, or with other masks (under dp, the whole batch's mask of a
    # tp-only run instead of each rank's slice mask), the run is not the same
    others = [reference(replace(spec, cfg=SIZES["tiny"]))]
    if spec.dp > 1:
        others.append(reference(replace(spec, mesh_shape=(4,))))
    for other in others:
        assert max(_rel(other["params"][name], p_ref) for name, p_ref in ref["params"].items()) > 10 * TOL


@pytest.mark.parametrize("dp_mode", ["replicate", "shard"])
def test_step_moves_no_more_bytes_than_torch_dtensor(strict, dp_mode):
    """Busiest rank, one whole step (zero_grad to reading the loss), same model, mesh and plan
    (sequence parallel on mesh["tp"]), data parallelism on mesh["dp"] by each side's own
    replicate / fully_shard; torch's side runs in 4 gloo processes, measured in this test."""
    from shardops.training import torch_side
    from shardops.training.launch import run_gloo

    spec = RunSpec(model="llama", cfg=SIZES["tiny"], mesh_shape=(2, 2), steps=2, dp_mode=dp_mode)
    ours = _train(spec)
    theirs = run_gloo(torch_side.train_rank, 4, spec, timeout=300)
    assert max(res["records"][-1].nbytes for res in ours) <= max(res["records"][-1].nbytes for res in theirs)
    # torch's side trains the same: its losses are the single-device ones too
    ref = [r.loss for r in reference(spec)["records"]]
    assert [r.loss for r in theirs[0]["records"]] == pytest.approx(ref, rel=TOL, abs=TOL)
    # both sides reduce the gradients during backward: nothing is sent by the optimizer step
    for res in (*ours, *theirs):
        assert res["records"][-1].parts["optimizer"].nbytes == 0
