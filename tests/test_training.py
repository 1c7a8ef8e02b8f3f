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
    """Dropout on DTensors draws the global tensor's mask whatever the layout: the reference is
    single-device training whose nn.Dropout layers take shardops' masks of the whole tensor
    (training/reference.py). Without them (torch's CPU masks) the losses differ: the check can fail."""
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
    # the masks matter: without dropout (or with other masks) the first loss is not the same
    plain = reference(replace(spec, cfg=SIZES["tiny"]))
    assert abs(plain["records"][0].loss - ref["records"][0].loss) > 10 * TOL * abs(ref["records"][0].loss)


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["tp+sp", "tp"])
def test_step_moves_no_more_bytes_than_torch_dtensor(strict, sequence_parallel):
    """Busiest rank, one whole step (zero_grad to reading the loss), same model, mesh and plan;
    torch DTensor's side runs in 4 gloo processes, measured in this test. With sequence-parallel
    norms torch re-reduces their pending gradients at every optimizer read: shardops moves fewer."""
    from shardops.training import torch_side
    from shardops.training.launch import run_gloo

    spec = RunSpec(model="llama", cfg=SIZES["tiny"], mesh_shape=(2, 2), steps=2, sequence_parallel=sequence_parallel)
    ours = max(res["records"][-1].nbytes for res in _train(spec))
    theirs = max(res["records"][-1].nbytes for res in run_gloo(torch_side.train_rank, 4, spec, timeout=300))
    assert ours <= theirs
    if sequence_parallel:
        assert ours < theirs
