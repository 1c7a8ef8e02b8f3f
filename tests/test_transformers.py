"""transformers models parallelized with their own tensor-parallel plan (from_transformers), against single-device.

Each case builds a tiny model from a config (random init, nothing downloaded), trains it
on one device, then on 4 ranks with `from_transformers` in strict mode: the loss and every
parameter's gradient at each of two AdamW steps, and the loss after them, equal the
single-device run within 1e-4. On (2, 2) the plan runs on mesh["tp"] and `replicate` (torch's
DDP) on mesh["dp"]: each dp rank trains on its own batch slice. `use_local_output=True` is how transformers
applies its plan (local tensors between boundaries); False keeps every boundary a DTensor
(attention, rotary, masks, repeat_kv and the loss on DTensors).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")  # a dev dependency (pyproject's dev extra)

import shardops as so  # noqa: E402
from shardops import Replicate, Shard, StridedShard  # noqa: E402
from shardops.fsdp import replicate  # noqa: E402
from shardops.parallel import from_transformers, loss_parallel  # noqa: E402
from shardops.parallel.loss import target_placements  # noqa: E402

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=4,
)
MODELS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", {}),
    "gemma2": ("Gemma2Config", {}),  # tied embeddings, scaled embedding, soft-capping
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Mixtral with its experts tensor-parallel, named explicitly (MOE_TP_EXPERTS)
    "mixtral_tp_experts": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
# transformers 5.25 took the experts out of its MoE models' tensor-parallel plans (`moe_tp_experts` is
# deprecated there, to go in 5.28): under tensor parallelism alone the experts stay replicated. Up to
# 5.24 Mixtral's own plan held these entries. The tests that mean these kinds name them here, so they
# test the same layouts whichever transformers the dev extra installs.
MOE_TP_EXPERTS = {
    "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "model.layers.*.mlp.experts.down_proj": "rowwise",
    "model.layers.*.mlp.experts": "moe_tp_experts",
}
EXTRA_PLAN = {"mixtral_tp_experts": MOE_TP_EXPERTS}
STEPS = 2
BATCH = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))


def build(name: str) -> torch.nn.Module:
    cls, extra = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**TINY, **extra)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    if name in EXTRA_PLAN:
        # the attribute from_transformers reads; transformers' validating `tp_plan` setter would refuse
        # `moe_tp_experts` once transformers drops it, while shardops keeps reading plans that name it
        model._tp_plan = {**model._tp_plan, **EXTRA_PLAN[name]}
    return model


def next_token_loss(logits, ids):
    logits, target = logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
    if isinstance(logits, so.DTensor):  # this rank's rows of the target, laid out like the logits, said explicitly
        target = so.from_local(target, logits.device_mesh, target_placements(logits.placements, 1))
    with loss_parallel():
        return F.cross_entropy(logits, target)


def train(model, ids, full=lambda t: t):
    """Per step (loss, {name: full gradient}); then the loss after the last step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    record = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = next_token_loss(model(ids).logits, ids)
        loss.backward()
        record.append((full(loss).item(), {n: full(p.grad).detach().clone() for n, p in model.named_parameters()}))
        opt.step()
    with torch.no_grad():
        final = full(next_token_loss(model(ids).logits, ids)).item()
    return record, final


def _full(t):
    return t.full_tensor() if isinstance(t, so.DTensor) else t


def reference(name):
    model = build(name)
    state = copy.deepcopy(model.state_dict())
    return state, train(model, BATCH)


def sharded(name, state, mesh_shape, use_local_output):
    def rank():
        model = build(name)
        model.load_state_dict(state)  # every rank starts from the reference's weights
        if len(mesh_shape) == 1:
            mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("tp",))
            from_transformers(model, mesh, use_local_output=use_local_output)
            ids = BATCH
        else:
            mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
            from_transformers(model, mesh["tp"], use_local_output=use_local_output)
            replicate(model, device_mesh=mesh["dp"])
            ids = BATCH.chunk(mesh_shape[0])[mesh.get_coordinate()[0]]
        return train(model, ids, _full)

    so.set_strict(True)
    try:
        return so.run(rank, 4, timeout=600)
    finally:
        so.set_strict(False)


def check(name, mesh_shape, use_local_output):
    state, reference_run = reference(name)
    compare(reference_run, sharded(name, state, mesh_shape, use_local_output), mesh_shape, use_local_output)


def compare(reference_run, results, mesh_shape, use_local_output):
    """Every rank's (steps, final loss) from `train` against the single-device run's."""
    ref_steps, ref_final = reference_run
    dp = mesh_shape[0] if len(mesh_shape) > 1 else 1
    for step, (ref_loss, ref_grads) in enumerate(ref_steps):
        # on (dp, tp) the loss is this dp rank's batch mean: their mean is the global loss
        losses = [r[0][step][0] for r in results]
        assert sum(losses) / len(losses) == pytest.approx(ref_loss, abs=1e-4), (step, losses, ref_loss)
        if dp == 1:
            assert all(x == pytest.approx(ref_loss, abs=1e-4) for x in losses)
        for r in results:
            grads = r[0][step][1]
            assert grads.keys() == ref_grads.keys()
            for n, g in grads.items():
                assert torch.allclose(g, ref_grads[n], atol=1e-4, rtol=0), (step, n, (g - ref_grads[n]).abs().max())
    finals = [r[1] for r in results]
    assert sum(finals) / len(finals) == pytest.approx(ref_final, abs=1e-4)


# On (dp, tp) the loss is this dp rank's batch mean, which replicate averages over dp as DDP does
# (the gradients of the global-batch loss).
FAST = [
    ("llama", (4,), True),
    ("llama", (4,), False),
    ("qwen3", (4,), True),
    ("gemma2", (4,), False),
    ("mixtral", (4,), True),
    ("mixtral_tp_experts", (4,), False),
    ("llama", (2, 2), False),
    ("qwen2", (2, 2), True),
]
ALL = [(m, s, u) for m in MODELS for s in ((4,), (2, 2)) for u in (True, False)]
_FAST_KEYS = set(FAST)


@pytest.mark.parametrize("name,mesh_shape,use_local_output", FAST, ids=lambda v: str(v))
def test_model_trains_exactly_with_its_own_plan(name, mesh_shape, use_local_output):
    check(name, mesh_shape, use_local_output)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,mesh_shape,use_local_output",
    [c for c in ALL if tuple(getattr(c, "values", c)) not in _FAST_KEYS],
    ids=lambda v: str(v),
)
def test_model_trains_exactly_with_its_own_plan_grid(name, mesh_shape, use_local_output):
    check(name, mesh_shape, use_local_output)


def test_plan_kinds_become_shardops_layouts():
    """Each layout kind lands as transformers means it: colwise Shard(0), rowwise Shard(1), the vocabulary-
    sharded embedding, gather-output head, the packed [gate; up] experts as StridedShard (each half
    column-sharded), the experts' down projection sharded on its input dim."""
    state = build("mixtral_tp_experts").state_dict()

    def rank():
        model = build("mixtral_tp_experts")
        model.load_state_dict(state)
        mesh = so.init_device_mesh("cpu", (4,))
        from_transformers(model, mesh)
        p = dict(model.named_parameters())
        layer = "model.layers.0."
        gate_up = p[layer + "mlp.experts.gate_up_proj"]
        # this rank's rows: its quarter of the gate half, then its quarter of the up half
        full = state[layer + "mlp.experts.gate_up_proj"]
        gate, up = full.chunk(2, dim=1)
        r = mesh.get_rank()
        want = torch.cat([gate.chunk(4, dim=1)[r], up.chunk(4, dim=1)[r]], dim=1)
        return (
            {n: t.placements for n, t in p.items() if isinstance(t, so.DTensor)},
            torch.equal(gate_up.to_local(), want),
            sorted(n for n, t in p.items() if not isinstance(t, so.DTensor)),
        )

    placements, local_ok, plain = so.run(rank, 4)[0]
    layer = "model.layers.0."
    assert placements[layer + "self_attn.q_proj.weight"] == (Shard(0),)
    assert placements[layer + "self_attn.o_proj.weight"] == (Shard(1),)
    assert placements["model.embed_tokens.weight"] == (Shard(0),)
    assert placements["lm_head.weight"] == (Shard(0),)
    assert placements[layer + "mlp.experts.gate_up_proj"] == (StridedShard(1, 2),)
    assert placements[layer + "mlp.experts.down_proj"] == (Shard(2),)
    assert local_ok
    assert plain == sorted(
        [
            layer + "mlp.gate.weight",
            layer + "input_layernorm.weight",
            layer + "post_attention_layernorm.weight",
            "model.norm.weight",
        ]
    )


def test_qwen3_head_norms_gradient_is_summed_over_heads():
    """replicated_with_grad_allreduce: q_norm/k_norm see only this rank's heads; their parameters stay
    replicated and their gradient covers every head (checked exactly by the training test, placed here)."""
    state = build("qwen3").state_dict()

    def rank():
        model = build("qwen3")
        model.load_state_dict(state)
        from_transformers(model, so.init_device_mesh("cpu", (4,)))
        return model.model.layers[0].self_attn.q_norm.weight.placements

    assert so.run(rank, 4)[0] == (Replicate(),)


def test_errors_name_what_to_do():
    model = build("llama")

    def two_d():
        from_transformers(model, so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))

    with pytest.raises(so.ShardingError, match='mesh\\["tp"\\]'):
        so.run(two_d, 4)
    plain = torch.nn.Linear(2, 2)

    def no_plan():
        from_transformers(plain, so.init_device_mesh("cpu", (4,)))

    with pytest.raises(so.ShardingError, match="no tensor-parallel plan"):
        so.run(no_plan, 4)


def test_with_mesh_gives_the_mesh():
    """`with mesh:` (torch's DeviceMesh is a context manager): from_transformers(model, None) uses it."""
    state = build("llama").state_dict()

    def rank():
        model = build("llama")
        model.load_state_dict(state)
        mesh = so.init_device_mesh("cpu", (4,))
        with mesh as entered:
            assert entered is mesh
            from_transformers(model, None)
        return model.lm_head.weight.device_mesh == mesh

    assert all(so.run(rank, 4))
