"""transformers mixture-of-experts models with expert parallelism: from_transformers(..., expert_parallel=True),
and ExpertParallel under torch-style data parallelism (fully_shard / replicate).

The experts follow the model's own expert-parallel plan (`ep_dispatch_experts`, `grouped_gemm`)
on the tensor-parallel ranks, the rest of the model its tensor-parallel plan. Against
single-device in strict mode, with the harness of test_transformers (two AdamW steps: the loss
and every parameter's gradient within 1e-4), and the collectives of one step counted: per MoE
layer, forward 3 all_to_alls (counts, dispatch, combine), backward 2 (dispatch and combine mirrored).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import shardops as so  # noqa: E402
from shardops import Shard  # noqa: E402
from shardops.fsdp import fully_shard, replicate  # noqa: E402
from shardops.parallel import ExpertParallel, from_transformers, parallelize_module  # noqa: E402
from test_transformers import BATCH, TINY, _full, compare, next_token_loss, train  # noqa: E402

MOE_LAYERS = 2
MODELS = {
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # 6 experts over 4 ranks: 2, 2, 1, 1 (uneven); a shared expert beside them (replicated)
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24,
        },
    ),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 16}),
}
FAST = [("mixtral", True), ("qwen2_moe", False)]


def build(name: str) -> torch.nn.Module:
    cls, extra = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**{**TINY, "num_hidden_layers": MOE_LAYERS}, **extra)
    config._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config).float()


def _all_to_alls(model):
    """The all_to_alls of one forward and one backward."""
    with so.CommDebugMode() as fwd:
        loss = next_token_loss(model(BATCH).logits, BATCH)
    with so.CommDebugMode() as bwd:
        loss.backward()
    model.zero_grad()
    return fwd.get_comm_counts().get("all_to_all", 0), bwd.get_comm_counts().get("all_to_all", 0)


def _rank(name, state, use_local_output):
    mesh = so.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    # the same model tensor-parallel only: the all_to_alls the rest of the model makes (with DTensor
    # boundaries, one in the loss's backward), which expert parallelism adds to
    dense = from_transformers(build(name), mesh, use_local_output=use_local_output)
    baseline = _all_to_alls(dense)
    model = build(name)
    model.load_state_dict(state)
    from_transformers(model, mesh, use_local_output=use_local_output, expert_parallel=True)
    experts = model.model.layers[0].mlp.experts
    placements = {n: p.placements for n, p in experts.named_parameters()}
    counts = _all_to_alls(model)
    return train(model, BATCH, _full), placements, counts, baseline


@pytest.mark.parametrize("name,use_local_output", FAST, ids=str)
def test_moe_model_trains_exactly_expert_parallel(name, use_local_output, strict):
    check(name, use_local_output)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,use_local_output", [(m, u) for m in MODELS for u in (True, False) if (m, u) not in FAST], ids=str
)
def test_moe_model_trains_exactly_expert_parallel_grid(name, use_local_output, strict):
    check(name, use_local_output)


def check(name, use_local_output):
    torch.manual_seed(0)
    model = build(name)
    state = copy.deepcopy(model.state_dict())
    reference_run = train(model, BATCH)
    out = so.run(_rank, 4, name, state, use_local_output, timeout=600)
    compare(reference_run, [r[0] for r in out], (4,), use_local_output)
    for _, placements, (fwd, bwd), (fwd_dense, bwd_dense) in out:
        assert set(placements.values()) == {(Shard(0),)}  # experts split over the ranks, not tensor-parallel
        assert fwd - fwd_dense == 3 * MOE_LAYERS  # counts, dispatch, combine
        assert bwd - bwd_dense == 2 * MOE_LAYERS  # dispatch and combine mirrored
        if use_local_output:  # local tensors between the plan's boundaries: only the experts exchange tokens
            assert fwd_dense == bwd_dense == 0


def test_expert_parallel_errors_name_what_to_do():
    llama = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY))
    mixtral = build("mixtral")

    def no_ep_plan():
        from_transformers(llama, so.init_device_mesh("cpu", (4,)), expert_parallel=True)

    with pytest.raises(so.ShardingError, match="no expert-parallel plan"):
        so.run(no_ep_plan, 4)

    def two_d():
        from_transformers(mixtral, so.init_device_mesh("cpu", (2, 2)), expert_parallel=True)

    with pytest.raises(so.ShardingError, match="ExpertParallel"):
        so.run(two_d, 4)


def _ep_on_tp_rank(state):
    model = build("mixtral")
    model.load_state_dict(state)
    mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    from_transformers(model, mesh["tp"], expert_parallel=True)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    ids = BATCH.chunk(2)[mesh.get_local_rank("dp")]
    experts = model.model.layers[0].mlp.experts
    weight = next(p for p in experts.parameters())
    return (*train(model, ids, _full), tuple(weight.placements), weight.to_local().shape[0], experts.num_experts)


def test_experts_over_tp_with_fully_shard_over_dp(strict):
    """(dp, tp): experts expert-parallel over mesh["tp"] only (transformers' plan on the tp ranks), the
    model under fully_shard on mesh["dp"]: the experts, Shard(0) over tp, are sharded over dp too and their
    gradients reduce-scattered there like any tensor-parallel parameter's. Equal to one device."""
    torch.manual_seed(0)
    model = build("mixtral")
    state = copy.deepcopy(model.state_dict())
    reference_run = train(model, BATCH)
    results = so.run(_ep_on_tp_rank, 4, state, timeout=600)
    compare(reference_run, results, (2, 2), True)  # losses, every gradient and the final loss vs one device
    for *_, placements, local_experts, num_experts in results:
        # stored sharded over dp (fully_shard) and over tp (the experts): a quarter of the experts per rank
        assert placements[0].is_shard() and placements[1] == so.Shard(0), placements
        assert local_experts == num_experts // 4
    # each dp rank trained its own batch slice: their first losses differ (and average to the global one)
    assert results[0][0][0][0] != results[2][0][0][0]


# ------------------------------------------------------------------ with torch-style data parallelism (shardops.fsdp)


def _fsdp_rank(name, state, mesh_shape, mode):
    """Mixtral's experts ExpertParallel over the data mesh (TP inside on (2, 2), the rest of the model
    under its own TP plan on mesh["tp"]), then fully_shard per layer + root or replicate on the data mesh;
    each rank trains on its own batch slice with its local mean loss."""
    model = build(name)
    model.load_state_dict(state)
    names = ("dp", "tp")[: len(mesh_shape)]
    mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    layers = list(model.model.layers)
    for layer in layers:
        parallelize_module(layer.mlp.experts, mesh, ExpertParallel())
    dp_mesh = mesh
    if len(mesh_shape) == 2:
        from_transformers(model, mesh["tp"])  # the experts, already distributed, are left as they are
        dp_mesh = mesh["dp"]
    if mode == "shard":
        for layer in layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    else:
        replicate(model, device_mesh=dp_mesh)
    ids = BATCH.chunk(dp_mesh.size())[dp_mesh.get_local_rank()]
    with so.CommDebugMode() as comm:
        next_token_loss(model(ids).logits, ids).backward()
    model.zero_grad()
    return train(model, ids, _full), comm.get_comm_counts().get("all_to_all", 0)


@pytest.mark.parametrize("mode", ["shard", "replicate"])
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["ep4", "ep2xtp2"])
def test_mixtral_expert_parallel_with_fully_shard_and_replicate(mesh_shape, mode, strict):
    """Two AdamW steps equal single-device training of the whole batch (the mean of the data-parallel
    ranks' local losses, every gradient); per MoE layer 3 all_to_alls forward and 2 backward, nothing else
    over the data mesh for the experts."""
    torch.manual_seed(0)
    model = build("mixtral")
    state = copy.deepcopy(model.state_dict())
    reference_run = train(model, BATCH)
    out = so.run(_fsdp_rank, 4, "mixtral", state, mesh_shape, mode, timeout=600)
    compare(reference_run, [r[0] for r in out], (mesh_shape[0], 1), True)  # (dp, 1): a local loss per dp rank
    for _, all_to_alls in out:
        assert all_to_alls == 5 * MOE_LAYERS
