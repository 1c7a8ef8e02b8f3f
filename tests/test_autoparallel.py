"""so.autoparallel: the chosen plan's measured bytes per step equal its prediction, it moves no
more than the hand plan of docs/parallel.md, and it gives single-device values in strict mode.
Data parallelism is torch's (`replicate`, `fully_shard`): each rank runs its own batch slice, so
the ranks' mean loss is the single-device loss and every gradient equals the single-device one."""

from __future__ import annotations

import copy
import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F

import shardops as so
from autoparallel_harness import EncoderModel as _EncoderModel
from autoparallel_harness import SmallResNet as _SmallResNet
from autoparallel_harness import auto_step as _auto_step
from autoparallel_harness import check_values as _check_values
from autoparallel_harness import hand_step as _hand_step
from autoparallel_harness import mlp_stack
from autoparallel_harness import reference as _reference
from autoparallel_harness import regression_loss as _regression_loss
from autoparallel_harness import same_pricing_from_metadata as _same_pricing_from_metadata
from autoparallel_harness import token_batch as _tokens
from autoparallel_harness import trains_exactly as _trains_exactly
from parallel_harness import count_step, strict
from shardops.autoparallel import language_model_loss
from shardops.models import GPT2, Llama, ModelArgs, gpt2_plan, llama_plan
from shardops.world import in_threads_world

ARGS = ModelArgs()
HAND = {Llama: llama_plan, GPT2: gpt2_plan}


# each model on each mesh; two of the four behind -m slow (each model and each mesh stays in the default run)
@pytest.mark.parametrize(
    "model_cls, mesh_shape",
    [
        (Llama, (4,)),
        (GPT2, (2, 2)),
        pytest.param(Llama, (2, 2), marks=pytest.mark.slow),
        pytest.param(GPT2, (4,), marks=pytest.mark.slow),
    ],
    ids=["llama-4", "gpt2-2x2", "llama-2x2", "gpt2-4"],
)
def test_autoparallel_measured_equals_predicted_and_no_worse_than_hand(model_cls, mesh_shape):
    make = lambda: model_cls(ARGS, seed=0)  # noqa: E731
    tokens = _tokens(4, 8, ARGS.vocab_size)
    ref_loss, ref_grads = _reference(make(), tokens)
    plan = so.autoparallel(make(), mesh_shape, (tokens,), objective="bytes")
    _same_pricing_from_metadata(plan, make(), mesh_shape, (tokens,))

    auto = _auto_step(plan, make, tokens)
    _check_values(auto, ref_loss, ref_grads)
    measured = max(sent for sent, _, _ in auto)
    assert measured == plan.predicted_bytes  # the issue allows 1%; pricing runs the same step, so exact

    hand = _hand_step(make, HAND[model_cls], mesh_shape, tokens)
    _check_values(hand, ref_loss, ref_grads)
    hand_bytes = max(sent for sent, _, _ in hand)
    assert measured <= hand_bytes, (measured, hand_bytes, str(plan))


def test_autoparallel_pure_data_parallel_beats_hand_plan_on_8_ranks():
    """A tiny model with a large batch on (8,): gradient all-reduces are smaller than the
    activations tensor parallelism moves, so the plan is pure data parallelism."""
    args = ModelArgs(dim=16, n_heads=8, hidden_dim=32, vocab_size=32, n_layers=1, max_seq_len=32)
    make = lambda: Llama(args, seed=0)  # noqa: E731
    tokens = _tokens(16, 32, args.vocab_size)
    ref_loss, ref_grads = _reference(make(), tokens)
    plan = so.autoparallel(make(), (8,), (tokens,), objective="bytes")
    assert plan.candidate.dims == ("dp",) and plan.parallelize_plan == {}
    _same_pricing_from_metadata(plan, make(), (8,), (tokens,), objective="bytes")

    auto = _auto_step(plan, make, tokens)
    _check_values(auto, ref_loss, ref_grads)
    measured = max(sent for sent, _, _ in auto)
    assert measured == plan.predicted_bytes
    hand_bytes = max(sent for sent, _, _ in _hand_step(make, llama_plan, (8,), tokens))
    assert hand_bytes >= 3 * measured, (hand_bytes, measured)  # docs/autoparallel.md states the factor


def test_plan_prints_the_code_and_explains_each_module():
    tokens = _tokens(4, 8, ARGS.vocab_size)
    plan = so.autoparallel(Llama(ARGS, seed=0), (4,), (tokens,))
    text = str(plan)
    assert "parallelize_module(model, mesh, {" in text and "'layers.*.attention.wq': ColwiseParallel()" in text
    assert "gradient sync" in text and f"{plan.predicted_bytes:,}" in text
    explained = plan.explain()
    assert "layers.*.feed_forward.w2" in explained and "runner-up" in explained


def test_uneven_shards_priced_from_metadata_equal_the_threads_world():
    """A vocabulary of 50 over 4 ranks splits 13, 13, 13, 11: the dry world prices the last rank too."""
    args = ModelArgs(vocab_size=50, n_layers=1)
    make = lambda: GPT2(args, seed=0)  # noqa: E731  (tied embedding and head)
    tokens = _tokens(4, 8, args.vocab_size)
    plan = so.autoparallel(make(), (4,), (tokens,))
    dry = _same_pricing_from_metadata(plan, make(), (4,), (tokens,))
    assert dry.predicted_bytes == plan.predicted_bytes > 0


def test_a_meta_model_on_a_4096_rank_mesh_is_planned_from_metadata_alone():
    """No world of ranks, no data: the model is built on the meta device."""
    with torch.device("meta"):
        model = Llama(ModelArgs(dim=64, n_heads=16, hidden_dim=128, vocab_size=128, n_layers=3), seed=0)
    tokens = torch.empty(1024, 16, dtype=torch.long, device="meta")
    plan = so.autoparallel(model, (8, 8, 16), (tokens,), links=("nvlink", "ib", "ib"), objective="bytes")
    assert plan.pricing.startswith("from metadata") and not in_threads_world()
    assert all(s.measurement.feasible for s in plan.considered) and len(plan.considered) > 1
    assert plan.predicted_bytes == min(s.measurement.total_bytes for s in plan.considered)
    with pytest.raises(so.ShardingError, match="pricing='metadata'"):
        so.autoparallel(model, (8, 8, 16), (tokens,), pricing="run")


def test_data_parallelism_on_a_4096_rank_mesh_sends_what_ddp_sends():
    """Priced from metadata on (8, 8, 16): one all_reduce of every gradient, the parameters' bytes."""
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(1024, 16)
    plan = so.autoparallel(net, (8, 8, 16), (x,), loss_fn=lambda out, x: out.square().mean())
    dp = next(s.measurement for s in plan.considered if s.candidate.dims == ("dp", "dp", "dp"))
    assert dp.total_bytes == sum(p.numel() * p.element_size() for p in net.parameters())
    assert plan.predicted_bytes <= dp.total_bytes  # the Linear pair split over tp is a candidate too


@pytest.mark.slow  # three searches (about 30 s)
def test_memory_limit_chooses_fully_shard_and_keeps_units_gathered_only_where_that_fits():
    """Below the memory of every replicate plan (the hand plan's included), the plan is fully_shard per
    block and the root: without resharding after forward while that fits (fewer bytes: no second
    all_gather), with it below; both run exactly and send their prediction."""
    make = lambda: Llama(ARGS, seed=0)  # noqa: E731
    tokens = _tokens(4, 8, ARGS.vocab_size)
    roomy = so.autoparallel(make(), (2, 2), (tokens,), memory_per_rank=10**9)
    memory = {s.candidate: s.measurement.memory_per_rank for s in roomy.considered if s.measurement.feasible}
    replicated = min(m for c, m in memory.items() if c.dp_mode == "replicate")
    kept = min(m for c, m in memory.items() if c.dp_mode == "fully_shard" and not c.reshard_after_forward)
    resharded = min(m for c, m in memory.items() if c.dp_mode == "fully_shard" and c.reshard_after_forward)
    assert resharded < kept < replicated
    ref_loss, ref_grads = _reference(make(), tokens)
    for limit, reshard in ((replicated - 1, False), (kept - 1, True)):
        plan = so.autoparallel(make(), (2, 2), (tokens,), memory_per_rank=limit)
        c = plan.candidate
        assert (c.dp_mode, c.reshard_after_forward) == ("fully_shard", reshard) and plan.predicted_bytes > 0
        assert plan.chosen.measurement.memory_per_rank <= limit
        text = str(plan)
        assert "for block in model.layers.values():" in text or "for block in model.layers:" in text
        assert f"    fully_shard(block, mesh=mesh['dp'], reshard_after_forward={reshard})" in text
        assert f"fully_shard(model, mesh=mesh['dp'], reshard_after_forward={reshard})" in text
        auto = _auto_step(plan, make, tokens)
        _check_values(auto, ref_loss, ref_grads)
        assert max(sent for sent, _, _ in auto) == plan.predicted_bytes
    _same_pricing_from_metadata(plan, make(), (2, 2), (tokens,), memory_per_rank=limit)


def test_fully_shard_memory_is_one_dp_share_plus_the_gathered_units():
    """Pure data parallelism on (4,), every dp candidate: replicate holds parameters, gradients and two AdamW
    states whole (4x the parameters); fully_shard a 1/4 row share of each (FSDP's ceil-sized first shards)
    plus the units gathered at once: the root's and the largest block's when resharding, all of them when not."""
    make = lambda: Llama(ModelArgs(n_layers=2), seed=0)  # noqa: E731
    tokens = _tokens(4, 8, ARGS.vocab_size)
    plan = so.autoparallel(make(), (4,), (tokens,), memory_per_rank=10**9)
    model = make()
    nbytes = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    share = sum(math.ceil(p.shape[0] / 4) * (p.numel() // p.shape[0]) * p.element_size() for p in model.parameters())
    blocks = [nbytes(block.parameters()) for block in model.layers.values()]
    root = nbytes(model.parameters()) - sum(blocks)
    want = {
        ("replicate", True): 4 * nbytes(model.parameters()),
        ("fully_shard", True): 4 * share + root + max(blocks),
        ("fully_shard", False): 4 * share + root + sum(blocks),
    }
    got = {
        (s.candidate.dp_mode, s.candidate.reshard_after_forward): s.measurement.memory_per_rank
        - s.measurement.activation_bytes  # (tested in test_activations_kept_for_backward_are_in_the_memory_limit)
        for s in plan.considered
        if s.candidate.tp_dim is None
    }
    assert got == want


def test_autoplan_cli_prints_the_plan(capsys):
    from shardops.cli import main

    assert main(["autoplan", "--model", "gpt2", "--mesh", "4"]) == 0
    out = capsys.readouterr().out
    assert "parallelize_module(model, mesh, {" in out and "'h.*.mlp.c_fc': ColwiseParallel()" in out


def test_deep_model_priced_from_one_and_two_blocks_matches_the_whole_model():
    """Four blocks priced from 1- and 2-block copies: the applied plan on all four measures the same."""
    args = ModelArgs(n_layers=4)
    make = lambda: GPT2(args, seed=0)  # noqa: E731
    tokens = _tokens(4, 8, args.vocab_size)
    ref_loss, ref_grads = _reference(make(), tokens)
    plan = so.autoparallel(make(), (2, 2), (tokens,))
    auto = _auto_step(plan, make, tokens)
    _check_values(auto, ref_loss, ref_grads)
    assert max(sent for sent, _, _ in auto) == plan.predicted_bytes


def test_a_model_without_blocks_is_planned_with_its_own_loss():
    """No repeated blocks: data parallelism (one all_reduce of every gradient: what DDP sends) and the
    Linear pair split over tp beside it; a given loss_fn is priced, and the chosen plan trains exactly."""
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 16, generator=g)
    loss_fn = _regression_loss(4)
    plan = so.autoparallel(net, (2, 2), (x,), loss_fn=loss_fn, objective="bytes")
    by_dims = {s.candidate.dims: s.measurement for s in plan.considered}
    assert by_dims.keys() == {("dp", "dp"), ("dp", "tp")} and all(m.feasible for m in by_dims.values())
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    assert by_dims["dp", "dp"].total_bytes == weights
    assert plan.predicted_bytes == min(m.total_bytes for m in by_dims.values())
    _trains_exactly(plan, net, x, loss_fn)


def test_a_batch_that_cannot_split_is_a_clear_error():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(so.ShardingError, match="does not split evenly"):
        so.autoparallel(net, (4,), (torch.randn(6, 4),), loss_fn=lambda out, x: out.sum())


def test_autoplan_cli_plans_llama_7b_on_4096_ranks_from_metadata(capsys):
    """The issue's command: a full-size shape on the meta device, priced from metadata, no world, within
    the issue's 60 s of CPU time (this process's, every thread's; about 5 s measured)."""
    import time

    from shardops.cli import main

    cpu = time.process_time()
    assert main(["autoplan", "llama-7b", "--mesh", "8,8,16", "--links", "nvlink,ib,ib"]) == 0
    assert time.process_time() - cpu <= 60.0
    out = capsys.readouterr().out
    assert "autoparallel plan for Llama on mesh (8, 8, 16)" in out and "from metadata" in out
    searched = re.search(r"searched (\d+) candidates \((\d+) feasible\)", out)
    assert searched and int(searched[1]) == int(searched[2]) > 1  # dp, tp on 16 and on 8: every one priced on meta


def test_a_small_cnn_is_planned_and_trains_exactly():
    """Conv2d -> ReLU -> AdaptiveAvgPool2d -> Flatten -> Linear on (2,): the convolution family's rules
    split the batch, so data parallelism works: one all_reduce of every gradient, DDP's bytes."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 4),
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 8, 8, generator=g)
    loss_fn = _regression_loss(4)
    plan = so.autoparallel(net, (2,), (x,), loss_fn=loss_fn)
    assert plan.candidate.dims == ("dp",)
    assert plan.predicted_bytes == sum(p.numel() * p.element_size() for p in net.parameters())
    _same_pricing_from_metadata(plan, net, (2,), (x,), loss_fn=loss_fn)
    _trains_exactly(plan, net, x, loss_fn)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (8,)], ids=["4", "2x2", "8"])
def test_a_resnet_style_cnn_is_planned_and_trains_exactly(mesh_shape):
    """Convolutions, GroupNorm (per sample), max and adaptive average pooling and a residual add all run on
    each rank's batch slice: data parallelism over every mesh dim, whose only traffic is the gradients'
    all_reduce (DDP's bytes), and the step equals single-device torch's."""
    net = _SmallResNet()
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    loss_fn = _regression_loss(4)
    plan = so.autoparallel(net, mesh_shape, (x,), loss_fn=loss_fn)
    assert set(plan.candidate.dims) == {"dp"}
    assert plan.predicted_bytes == sum(p.numel() * p.element_size() for p in net.parameters())
    assert plan.chosen.measurement.bytes_per_part["forward + loss"] == 0
    if mesh_shape == (2, 2):
        _same_pricing_from_metadata(plan, net, mesh_shape, (x,), loss_fn=loss_fn)
    _trains_exactly(plan, net, x, loss_fn)


def _ddp_reference(net, x, loss_fn, ranks: int):
    """torch's DDP step (no SyncBatchNorm) computed here: each rank a copy of the model on its own batch
    slice (its own BatchNorm statistics and running buffers), its own loss, the ranks' gradients averaged."""
    losses, grads, buffers = [], [], []
    for local in x.chunk(ranks):
        model = copy.deepcopy(net)
        loss = loss_fn(model(local), local)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
        buffers.append({n: b.clone() for n, b in model.named_buffers()})
    mean_grads = {n: torch.stack([g[n] for g in grads]).mean(0) for n in grads[0]}
    return losses, mean_grads, buffers


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
def test_a_batchnorm_cnn_follows_torch_data_parallel_semantics_and_says_so(mesh_shape):
    """BatchNorm2d under the data-parallel plan: each rank normalizes by its own batch slice's statistics
    and keeps its own running statistics, as torch's DDP/FSDP without SyncBatchNorm; the gradients are the
    ranks' average. The plan prints that, and its measured bytes are its prediction."""
    net = _SmallResNet(norm=torch.nn.BatchNorm2d)
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    loss_fn = _regression_loss(4)
    plan = so.autoparallel(net, mesh_shape, (x,), loss_fn=loss_fn)
    assert set(plan.candidate.dims) == {"dp"}
    assert "BatchNorm: each rank's batch statistics (torch DDP semantics); use nn.SyncBatchNorm" in str(plan)
    ranks = math.prod(mesh_shape)
    losses, grads, buffers = _ddp_reference(net, x, loss_fn, ranks)
    whole = copy.deepcopy(net)
    loss_fn(whole(x), x).backward()  # the global batch's statistics: not what data parallelism computes
    assert not torch.allclose(whole.stem.weight.grad, grads["stem.weight"], rtol=1e-3, atol=1e-5)

    def main():
        model = plan.apply(copy.deepcopy(net))
        local = plan.local_batch(x)
        with strict():
            sent, loss, got = count_step(model, local, lambda out: loss_fn(out, local))
        index = next(i for i, piece in enumerate(x.chunk(ranks)) if torch.equal(piece, local))
        return sent, loss, got, index, {n: _full_local(b) for n, b in model.named_buffers()}

    results = so.run(main, ranks)
    assert sorted(r[3] for r in results) == list(range(ranks))  # every slice on one rank
    for sent, loss, got, index, bufs in results:
        assert sent == plan.predicted_bytes
        torch.testing.assert_close(loss, losses[index], rtol=1e-4, atol=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)
        for name, b in buffers[index].items():
            torch.testing.assert_close(bufs[name], b, rtol=1e-4, atol=1e-6, msg=name)


def _full_local(t):
    return t.to_local() if isinstance(t, so.DTensor) else t


class _AttentionBlock(torch.nn.Module):
    """A block whose attention is nn.MultiheadAttention: it reads in_proj_weight directly and out_proj's
    weight without calling out_proj, so neither is a Linear group the search splits."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.attn = torch.nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, dim))

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class _AttentionModel(torch.nn.Module):
    def __init__(self, hidden: int, dim: int = 16, vocab: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList([_AttentionBlock(dim, hidden) for _ in range(2)])
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def _matmul_elements(model: torch.nn.Module) -> int:
    """Elements of every weight of >= 2 dims a module multiplies with (embedding tables are looked up)."""
    total = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Embedding):
            for p in module.parameters(recurse=False):
                if p.ndim >= 2:
                    total += (p.to_local() if isinstance(p, so.DTensor) else p).numel()
    return total


@pytest.mark.parametrize("hidden", [32, 128])
def test_parameters_a_module_reads_directly_are_in_the_memory_and_compute_figures(hidden):
    """nn.MultiheadAttention's in_proj_weight (read directly, replicated by every tensor-parallel candidate)
    counts in each rank's matmul share and parameter bytes, as the applied candidates hold them here."""
    from shardops.autoparallel.candidates import COMPUTE_SLACK, compute_share
    from shardops.autoparallel.plan import apply_candidate
    from shardops.autoparallel.structure import find_structure

    make = lambda: _AttentionModel(hidden)  # noqa: E731
    tokens = _tokens(4, 8, 32)
    plan = so.autoparallel(make(), (2,), (tokens,))
    structure = find_structure(make(), (tokens,))
    feasible = [s for s in plan.considered if s.measurement.feasible]
    full = _matmul_elements(make())

    def main():
        held = []
        for s in feasible:
            names = ("tp",) if s.candidate.tp_dim is not None else ("dp",)
            mesh = so.init_device_mesh("cpu", (2,), mesh_dim_names=names)
            model = apply_candidate(make(), mesh, s.candidate, s.entries)
            local_bytes = sum(
                (p.to_local() if isinstance(p, so.DTensor) else p).numel() * p.element_size()
                for p in model.parameters()
            )
            held.append((local_bytes, _matmul_elements(model)))
        return held

    per_rank = so.run(main, 2)
    for i, s in enumerate(feasible):
        local_bytes = max(rank[i][0] for rank in per_rank)
        assert s.measurement.parameter_bytes == local_bytes, s.candidate
        assert s.measurement.memory_per_rank == 4 * local_bytes + s.measurement.activation_bytes
        dp = 2 if s.candidate.tp_dim is None else 1
        share = max(rank[i][1] for rank in per_rank) / dp / (full / 2)
        assert compute_share(structure, s.candidate, (2,)) == pytest.approx(share), s.candidate
        assert share <= COMPUTE_SLACK, s.candidate
    # with a small MLP, splitting it alone leaves each rank the whole attention: over the bound, ruled out
    assert any(s.candidate.tp_dim is not None for s in feasible) == (hidden == 128)
    assert f"parameters per rank: {plan.chosen.measurement.parameter_bytes:,} B" in str(plan)


@pytest.mark.parametrize(
    "make, mesh_shape",
    [(_EncoderModel, (2,)), (lambda: _AttentionModel(128), (2,))],
    ids=["transformer-encoder-2", "mha-block-tp-2"],
)
def test_metadata_pricing_equals_the_threads_world_with_multihead_attention(make, mesh_shape):
    """nn.MultiheadAttention calls scaled_dot_product_attention from inside its functional form,
    where torch picks the kernel by device (CPU: the fused flash op; meta: bmm and softmax). The dry
    step takes the CPU one too, so every candidate (FSDP-style included) prices the same both ways."""
    tokens = _tokens(4, 8, 32)
    plan = so.autoparallel(make(), mesh_shape, (tokens,), memory_per_rank=10**9)
    assert sum(s.measurement.feasible for s in plan.considered) >= 2
    _same_pricing_from_metadata(plan, make(), mesh_shape, (tokens,), memory_per_rank=10**9)
    ref_loss, ref_grads = _reference(make(), tokens)
    auto = _auto_step(plan, make, tokens)
    _check_values(auto, ref_loss, ref_grads)
    assert max(sent for sent, _, _ in auto) == plan.predicted_bytes


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_a_transformer_encoder_gets_tensor_parallel_candidates_from_its_layers_linears(mesh_shape):
    """nn.TransformerEncoderLayer's linear1 -> (activation, dropout) -> linear2, called in that order by its
    forward, is a column/row-parallel pair of every layer (`encoder.layers.*.linear1`). Its self_attn (an
    nn.MultiheadAttention reading its packed in_proj_weight and out_proj.weight directly) stays whole and
    plain on every rank. Every candidate prices the same from metadata; the chosen plan and the cheapest
    fully_shard one train exactly in strict mode and send their prediction."""
    make = lambda: _EncoderModel(ff=128)  # noqa: E731  (a 4x-wider MLP than attention: splitting it alone pays)
    tokens = _tokens(4, 8, 32)
    roomy = 10**9
    plan = so.autoparallel(make(), mesh_shape, (tokens,), memory_per_rank=roomy)
    assert all(s.measurement.feasible for s in plan.considered)
    tp = [s for s in plan.considered if s.candidate.tp_dim is not None]
    assert tp and all(
        {e.key: e.text for e in s.entries}
        == {"encoder.layers.*.linear1": "ColwiseParallel()", "encoder.layers.*.linear2": "RowwiseParallel()"}
        for s in tp
    )
    dp = next(s for s in plan.considered if s.candidate.tp_dim is None and s.candidate.dp_mode == "replicate")
    assert plan.candidate.tp_dim is not None and plan.predicted_bytes < dp.measurement.total_bytes
    _same_pricing_from_metadata(plan, make(), mesh_shape, (tokens,), memory_per_rank=roomy)
    ref_loss, ref_grads = _reference(make(), tokens)
    sharded = [s for s in tp if s.candidate.dp_mode == "fully_shard"]
    for chosen in [plan.chosen, *sharded[:1]]:
        one = dataclasses.replace(plan, chosen=chosen)
        auto = _auto_step(one, make, tokens)
        _check_values(auto, ref_loss, ref_grads)
        assert max(sent for sent, _, _ in auto) == one.predicted_bytes


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)])
def test_an_mlp_stack_gets_tensor_parallel_pairs_from_its_linear_shapes(mesh_shape):
    """nn.Sequential of Linear/ReLU, no names to go by: consecutive Linears whose features chain
    (16 -> 64 -> 16, 16 -> 64 -> 4) are column/row-parallel pairs. With a small batch and wide layers the
    plan splits them, sends fewer bytes than pure data parallelism, and trains exactly."""
    net = mlp_stack()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=g)
    loss_fn = _regression_loss(4)
    roomy = 10**9  # a memory limit that binds nothing: the FSDP-style candidates are searched too
    plan = so.autoparallel(net, mesh_shape, (x,), loss_fn=loss_fn, memory_per_rank=roomy, objective="bytes")
    assert all(s.measurement.feasible for s in plan.considered)  # values checked against single-device torch
    dp = next(s for s in plan.considered if s.candidate.tp_dim is None and s.candidate.dp_mode == "replicate")
    assert dp.measurement.total_bytes == sum(p.numel() * p.element_size() for p in net.parameters())
    assert plan.candidate.tp_dim is not None and plan.predicted_bytes < dp.measurement.total_bytes
    assert plan.parallelize_plan.keys() == {"0", "2", "4", "6"}
    assert "'0': ColwiseParallel()" in str(plan) and "'2': RowwiseParallel()" in str(plan)
    assert "'6': RowwiseParallel()" in str(plan)  # the output: plain, this rank's batch slice
    _same_pricing_from_metadata(plan, net, mesh_shape, (x,), loss_fn=loss_fn, memory_per_rank=roomy, objective="bytes")
    _trains_exactly(plan, net, x, loss_fn)


class _CountedBlock(torch.nn.Module):
    """A residual MLP block that counts its forwards (every copy shares the class counter)."""

    calls = 0

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, dim))

    def forward(self, x):
        type(self).calls += 1
        return x + self.mlp(x)


class _Trunk(torch.nn.Module):
    """Blocks in an nn.Sequential under a name no rule knows ("trunk"), then a head."""

    def __init__(self, depth: int, dim: int = 16, hidden: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Sequential(*[_CountedBlock(dim, hidden) for _ in range(depth)])
        self.out = torch.nn.Linear(dim, 4)

    def forward(self, x):
        return self.out(self.trunk(x))


def test_repeated_blocks_are_found_by_structure_and_planning_work_does_not_grow_with_depth():
    """The stack is recognised by class and parameter shapes (an nn.Sequential named "trunk"), not by a
    name; a ModuleList of blocks with other shapes is no stack. Planning runs the same number of block
    forwards at 4 and at 16 blocks (structure and pricing see 1- and 2-block copies only), and the plan
    for 16 blocks trains exactly."""
    from shardops.autoparallel.structure import find_blocks

    assert find_blocks(_Trunk(3)) == ("trunk", 3)
    mixed = _Trunk(2)
    mixed.trunk = torch.nn.Sequential(_CountedBlock(16, 64), _CountedBlock(16, 32))
    assert find_blocks(mixed) == (None, 0)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    loss_fn = _regression_loss(4)
    calls = {}
    for depth in (4, 16):
        _CountedBlock.calls = 0
        plan = so.autoparallel(_Trunk(depth), (2,), (x,), loss_fn=loss_fn, pricing="metadata")
        calls[depth] = _CountedBlock.calls
        assert plan.blocks == "trunk" and plan.candidate.tp_dim is not None
        assert plan.parallelize_plan.keys() == {"trunk.*.mlp.0", "trunk.*.mlp.2"}
    assert calls[4] == calls[16] > 0
    _trains_exactly(plan, _Trunk(16), x, loss_fn)


def test_fully_shard_with_tensor_parallelism_stays_feasible_after_planning_another_mesh():
    """Planning (2,) first leaves decisions cached whose meshes equal (2, 2)'s tp sub-mesh but were made
    on their own (no root mesh); fully_shard then still composes the tp layout with dp."""
    tokens = _tokens(4, 8, 32)
    so.autoparallel(_EncoderModel(ff=128), (2,), (tokens,), pricing="metadata")
    plan = so.autoparallel(_EncoderModel(ff=128), (2, 2), (tokens,), pricing="metadata", memory_per_rank=10**9)
    with_tp = [s for s in plan.considered if s.candidate.tp_dim is not None and s.candidate.dp_mode == "fully_shard"]
    assert len(with_tp) == 2 and all(s.measurement.feasible for s in with_tp), [s.measurement.error for s in with_tp]


@pytest.mark.parametrize("mesh_shape", [(4,), pytest.param((2, 2), marks=pytest.mark.slow)], ids=["4", "2x2"])
def test_llama_moe_plans_expert_parallelism_where_it_moves_fewer_bytes(mesh_shape):
    """shardops' LlamaMoE: its GroupedExperts (stacked w1/w2/w3, a TopKRouter beside them) are found by
    structure and planned ExpertParallel over the data-parallel ranks; measured = predicted, single-device
    values in strict mode, fewer bytes than the best plan without expert parallelism (applied and measured)."""
    from shardops.models_moe import LlamaMoE, MoEArgs

    args = MoEArgs(n_layers=2)
    make = lambda: LlamaMoE(args, seed=0)  # noqa: E731
    tokens = _tokens(4, 8, args.vocab_size)
    plan = so.autoparallel(make(), mesh_shape, (tokens,))
    assert plan.candidate.expert_parallel and set(plan.expert_plan) == {"layers.*.moe.experts"}, str(plan)
    assert "layers.*.moe.experts: ExpertParallel()\n    runner-up (+" in plan.explain()
    ref_loss, ref_grads = _reference(make(), tokens)
    auto = _auto_step(plan, make, tokens)
    _check_values(auto, ref_loss, ref_grads)
    measured = max(sent for sent, _, _ in auto)
    assert measured == plan.predicted_bytes
    no_ep = [s for s in plan.considered if s.measurement.feasible and not s.candidate.expert_parallel]
    runner_up = min(no_ep, key=lambda s: s.measurement.total_bytes)
    theirs = _auto_step(dataclasses.replace(plan, chosen=runner_up), make, tokens)
    _check_values(theirs, ref_loss, ref_grads)
    assert max(sent for sent, _, _ in theirs) == runner_up.measurement.total_bytes
    assert measured < runner_up.measurement.total_bytes


def _saved_for_backward(plan, make, tokens) -> int:
    """Bytes autograd keeps from each rank's forward + loss for its backward, measured on the applied plan:
    every distinct saved tensor's local bytes, the parameters excepted (counted as parameters); the busiest rank's."""

    def main():
        model = plan.apply(make())
        local = plan.local_batch(tokens)
        seen: set[int] = set()
        total = [0]

        def pack(t):
            if not isinstance(t, torch.nn.Parameter) and id(t) not in seen:
                seen.add(id(t))
                mine = t.to_local() if isinstance(t, so.DTensor) else t
                total[0] += mine.numel() * mine.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = language_model_loss(model(local), local)
        loss.backward()
        return total[0]

    return max(so.run(main, math.prod(plan.mesh_shape)))


def test_activations_kept_for_backward_are_in_the_memory_limit():
    """The memory per rank counts the activations autograd keeps for backward (as measured on the applied plan,
    from both pricings) beside parameters, gradients and AdamW states: a limit that holds the latter but not
    the activations rules the plan out."""
    args = ModelArgs(n_layers=2)
    make = lambda: Llama(args, seed=0)  # noqa: E731
    tokens = _tokens(4, 8, args.vocab_size)
    plan = so.autoparallel(make(), (2,), (tokens,))
    m = plan.chosen.measurement
    assert m.activation_bytes == _saved_for_backward(plan, make, tokens) > 0
    assert m.memory_per_rank == 4 * m.parameter_bytes + m.activation_bytes
    assert f"activations kept for backward per rank: {m.activation_bytes:,} B" in str(plan)
    dry = so.autoparallel(make(), (2,), (tokens,), pricing="metadata")
    assert dry.candidate == plan.candidate and dry.chosen.measurement.activation_bytes == m.activation_bytes
    limit = m.memory_per_rank - 1  # parameters, gradients and AdamW states fit; with the activations, not
    tight = so.autoparallel(make(), (2,), (tokens,), memory_per_rank=limit)
    ruled_out = next(s for s in tight.considered if s.candidate == plan.candidate)
    assert ruled_out.measurement.error is not None and "over memory_per_rank" in ruled_out.measurement.error
    assert tight.candidate != plan.candidate and tight.chosen.measurement.memory_per_rank <= limit


class _GatedBlock(torch.nn.Module):
    """up -> gelu(h) * sigmoid(h) -> down (functional ops, no modules between), or a softmax over the
    features between them, which mixes them: not a pair."""

    def __init__(self, mixes: bool):
        super().__init__()
        self.up, self.down, self.mixes = torch.nn.Linear(16, 128), torch.nn.Linear(128, 16), mixes

    def forward(self, x):
        h = self.up(x)
        h = h.softmax(-1) if self.mixes else F.gelu(h) * torch.sigmoid(h)
        return x + self.down(h)


class _GatedNet(torch.nn.Module):
    def __init__(self, mixes: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([_GatedBlock(mixes) for _ in range(2)])
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_linear_pairs_come_from_the_traced_forward_not_the_call_order():
    """A block's Linears pair where the traced forward carries the first one's output features to the second
    through elementwise ops only (here functional gelu and sigmoid, no modules between): the pair splits
    (fewer bytes than data parallelism), trains exactly and sends its prediction. Called in the same order
    with a softmax over the features between them, they are no pair: data parallelism only."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    loss_fn = _regression_loss(4)
    plan = so.autoparallel(_GatedNet(), (2,), (x,), loss_fn=loss_fn)
    assert plan.parallelize_plan.keys() == {"blocks.*.up", "blocks.*.down"}, str(plan)
    dp = next(s for s in plan.considered if s.candidate.tp_dim is None)
    assert plan.predicted_bytes < dp.measurement.total_bytes
    _trains_exactly(plan, _GatedNet(), x, loss_fn)
    mixed = so.autoparallel(_GatedNet(mixes=True), (2,), (x,), loss_fn=loss_fn)
    assert all(s.candidate.tp_dim is None for s in mixed.considered)


class _Bank(torch.nn.Module):
    """Experts under names no plan knows: stacked [experts, ...] weights, transformers' experts interface."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.inp = torch.nn.Parameter(torch.randn(experts, hidden, dim, generator=g) * 0.3)
        self.out = torch.nn.Parameter(torch.randn(experts, dim, hidden, generator=g) * 0.3)

    def forward(self, x, ids, weights):
        y = torch.zeros_like(x)
        for e in range(self.inp.shape[0]):
            token, slot = torch.where(ids == e)
            h = torch.tanh(x[token] @ self.inp[e].T) @ self.out[e].T
            y = y.index_add(0, token, h * weights[token, slot, None])
        return y


class _Mixer(torch.nn.Module):
    def __init__(self, dim: int, experts: int = 4, routed: bool = True):
        super().__init__()
        self.choose = torch.nn.Linear(dim, experts, bias=False) if routed else torch.nn.Identity()
        self.bank = _Bank(experts, dim, 2 * dim)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        scores = self.choose(flat).softmax(-1) if isinstance(self.choose, torch.nn.Linear) else flat[:, :4].softmax(-1)
        weights, ids = scores.topk(2, dim=-1)
        return x + self.bank(flat, ids, weights / weights.sum(-1, keepdim=True)).reshape(x.shape)


class _MixerNet(torch.nn.Module):
    def __init__(self, routed: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Sequential(_Mixer(8, routed=routed), _Mixer(8, routed=routed))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.trunk(x))


def test_experts_are_recognised_by_structure_not_names():
    """Stacked expert weights called as experts(tokens, ids, weights) beside a [experts, width] router are
    experts whatever their names (`trunk.*.bank`, routed by `choose`): planned ExpertParallel, exact, measured
    = predicted. The same bank without a router module beside it is not taken for experts."""
    from shardops.autoparallel.structure import find_structure

    x = torch.randn(8, 3, 8, generator=torch.Generator().manual_seed(2))
    loss_fn = _regression_loss(4)
    assert [e.name for e in find_structure(_MixerNet(), (x,)).experts] == ["bank"]
    assert find_structure(_MixerNet(routed=False), (x,)).experts == []
    plan = so.autoparallel(_MixerNet(), (2,), (x,), loss_fn=lambda out, x: loss_fn(out[:, 0], x))
    assert plan.candidate.expert_parallel and set(plan.expert_plan) == {"trunk.*.bank"}, str(plan)
    _trains_exactly(plan, _MixerNet(), x, lambda out, x: loss_fn(out[:, 0], x))
