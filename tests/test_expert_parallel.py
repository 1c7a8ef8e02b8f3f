"""Expert parallelism (shardops.parallel.ExpertParallel) against single-device torch.

Routing is made deliberately uneven (the router favours one expert; 5 experts over 4
ranks, so one rank holds none), and the bytes of every all_to_all are computed here
from that routing: per MoE layer, forward = one small count exchange + dispatch +
combine, backward = the two token all_to_alls mirrored, nothing else over ep.
"""

import pytest
import torch
import torch.nn.functional as F

import shardops as so
from mp import run_gloo
from shardops import Partial, Replicate, Shard
from shardops.fsdp import fully_shard, replicate
from shardops.models import _init
from shardops.models_moe import GroupedExperts, LlamaMoE, MoE, MoEArgs, llama_moe_plan, llama_moe_tp_plan
from shardops.parallel import ExpertParallel, loss_parallel, parallelize_module
from shardops.placements import chunk_size_and_offset

ARGS = MoEArgs(dim=8, n_heads=2, num_experts=5, top_k=2, moe_hidden_dim=6, vocab_size=16, max_seq_len=8)
X = (
    torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(1)) + 1.5
)  # a mean along (1, ..., 1): the router's bias below bites
MESHES = [(4,), (2, 2)]
TOL = 1e-4


def _moe(seed=0):
    m = MoE(ARGS)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        m.router.weight[0] += 3.0  # expert 0 wins for most tokens, expert 4 for none: uneven routing
        m.router.weight[4] -= 3.0
    return m


def _reference(x):
    m = _moe()
    xr = x.clone().requires_grad_()
    loss = (m(xr) ** 2).sum()
    loss.backward()
    return loss.detach(), xr.grad, {n: p.grad for n, p in m.named_parameters()}


def _expected_a2a_bytes(x, ep, me):
    """This ep rank's all_to_all bytes (counts, dispatch, combine), from the routing of every rank's tokens."""
    m = _moe()
    with torch.no_grad():
        ids = [m.router(xs.reshape(-1, ARGS.dim))[1] for xs in x.chunk(ep)]
    return _routing_a2a_bytes(ids, me)


def _routing_a2a_bytes(ids, me):
    """ep rank `me`'s all_to_all bytes for one MoE layer, given every ep rank's expert ids [tokens, k]:
    forward [counts, dispatch, combine], backward [dispatch, combine] (the combine's mirror first)."""
    ep = len(ids)
    slices = [chunk_size_and_offset(ARGS.num_experts, ep, j) for j in range(ep)]
    counts = [torch.bincount(i.reshape(-1), minlength=ARGS.num_experts) for i in ids]
    sent = [int(counts[me][s : s + n].sum()) for n, s in slices]  # token-slots to each rank
    got = [int(counts[i][slices[me][1] : slices[me][1] + slices[me][0]].sum()) for i in range(ep)]
    row = ARGS.dim * 4
    count_bytes = sum(n for j, (n, _) in enumerate(slices) if j != me) * 8
    dispatch = sum(n for j, n in enumerate(sent) if j != me) * row
    combine = sum(n for j, n in enumerate(got) if j != me) * row
    return [count_bytes, dispatch, combine], [dispatch, combine]


def _a2a(log):
    return [b for kind, b in log if kind == "all_to_all"]


def _moe_layer(shape, x):
    mesh = so.init_device_mesh("cpu", shape)
    m = _moe()
    parallelize_module(m.experts, mesh, ExpertParallel())
    so.distribute_module(m.router, mesh)
    xd = so.distribute_tensor(x, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1)).requires_grad_()
    with so.CommDebugMode() as fwd:
        loss = (m(xd) ** 2).sum()
    with so.CommDebugMode() as bwd:
        loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
    return loss.full_tensor().detach(), xd.grad.full_tensor(), grads, fwd.log, bwd.log, mesh.get_coordinate()[0]


@pytest.mark.parametrize("shape", MESHES, ids=["ep4", "ep2xtp2"])
def test_moe_layer_exact_with_two_token_all_to_alls_each_way(shape, strict):
    loss_ref, xg_ref, g_ref = _reference(X)
    for loss, xg, grads, fwd, bwd, ep_rank in so.run(_moe_layer, 4, shape, X):
        assert torch.allclose(loss, loss_ref, rtol=1e-5, atol=TOL)
        assert torch.allclose(xg, xg_ref, atol=TOL)
        for name, g in g_ref.items():
            assert torch.allclose(grads[name], g, atol=TOL), name
        want_fwd, want_bwd = _expected_a2a_bytes(X, shape[0], ep_rank)
        assert _a2a(fwd) == want_fwd  # counts (int64), dispatch, combine
        assert _a2a(bwd) == want_bwd  # the token all_to_alls mirrored; no count exchange
        # over ep nothing else moves; over tp (2-D mesh) only the expert outputs' and input gradients' sums
        assert {k for k, _ in fwd} <= {"all_to_all", "all_reduce", "all_gather"}
        assert {k for k, _ in bwd} <= {"all_to_all", "all_reduce"}


def test_uneven_routing_really_is_uneven():
    """The routing the tests use sends most tokens to expert 0, and rank 3 of 4 holds no expert."""
    m = _moe()
    with torch.no_grad():
        ids = m.router(X.reshape(-1, ARGS.dim))[1]
    counts = torch.bincount(ids.reshape(-1), minlength=ARGS.num_experts)
    assert int(counts[0]) == X.shape[0] * X.shape[1] and int(counts[4]) == 0
    assert chunk_size_and_offset(ARGS.num_experts, 4, 3)[0] == 0


def _local_mode(shape, x):
    """Plain tensors in and out (as transformers applies a plan): each ep rank its batch shard."""
    mesh = so.init_device_mesh("cpu", shape)
    m = _moe()
    parallelize_module(m.experts, mesh, ExpertParallel())
    mine = x.chunk(shape[0])[mesh.get_coordinate()[0]].clone().requires_grad_()
    loss = (m(mine) ** 2).sum()
    loss.backward()
    return (
        loss.detach(),
        mine.grad,
        {n: p.grad.full_tensor() if isinstance(p.grad, so.DTensor) else p.grad for n, p in m.named_parameters()},
    )


@pytest.mark.parametrize("shape", MESHES, ids=["ep4", "ep2xtp2"])
def test_moe_layer_local_tensors(shape, strict):
    loss_ref, xg_ref, g_ref = _reference(X)
    out = so.run(_local_mode, 4, shape, X)
    ep = shape[0]
    total = sum(out[r][0] for r in range(0, 4, 4 // ep))
    assert torch.allclose(total, loss_ref, atol=TOL)
    xg = torch.cat([out[r][1] for r in range(0, 4, 4 // ep)])
    assert torch.allclose(xg, xg_ref, atol=TOL)
    for name in ("experts.w1", "experts.w2", "experts.w3"):
        assert torch.allclose(out[0][2][name], g_ref[name], atol=TOL), name
    # the router is a plain module here: each rank's gradient covers its own tokens
    router = sum(out[r][2]["router.weight"] for r in range(0, 4, 4 // ep))
    assert torch.allclose(router, g_ref["router.weight"], atol=TOL)


def _partial_output(x):
    mesh = so.init_device_mesh("cpu", (2, 2))
    m = _moe()
    parallelize_module(m.experts, mesh, ExpertParallel(output_layouts=Partial()))
    so.distribute_module(m.router, mesh)
    xd = so.distribute_tensor(x.reshape(-1, ARGS.dim), mesh, [Shard(0), Replicate()])
    w, ids = m.router(xd)
    out = m.experts(xd, ids, w)
    return out.placements, out.full_tensor()


def test_partial_output_over_tp(strict):
    m = _moe()
    with torch.no_grad():
        t = X.reshape(-1, ARGS.dim)
        want = m.experts(t, *reversed(m.router(t)))
    for placements, full in so.run(_partial_output, 4, X):
        assert placements == (Shard(0), Partial())
        assert torch.allclose(full, want, atol=TOL)


# ------------------------------------------------------------------ the LLaMA-style MoE model


def _lm_batch():
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, ARGS.vocab_size, (4, 6), generator=g), torch.randint(
        0, ARGS.vocab_size, (4, 6), generator=g
    )


def _model():
    model = LlamaMoE(ARGS, seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.layers.values():
            for p in layer.moe.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            layer.moe.router.weight[1] += 0.8
    return model


def _lm_routing(model, tokens):
    """Every MoE layer's expert ids [tokens, k] for the whole batch on one device, in layer order."""
    ids = []
    hooks = [
        layer.moe.router.register_forward_hook(lambda m, a, out: ids.append(out[1])) for layer in model.layers.values()
    ]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    return ids


def _lm_expected_a2a_bytes(ids_per_layer, ep, me):
    """ep rank `me`'s all_to_all bytes in one training step: each ep rank routes its batch shard's tokens;
    forward runs the layers in order, backward in reverse."""
    fwd, bwd = [], []
    for ids in ids_per_layer:
        f, b = _routing_a2a_bytes(list(ids.chunk(ep)), me)
        fwd, bwd = fwd + f, b + bwd
    return fwd, bwd


def test_llama_moe_routing_is_uneven():
    """The LLaMA fixture routes unevenly (uneven all_to_all splits): expert counts differ 3x in the first
    MoE layer, every ep rank sends different numbers of token-slots, and on (4,) rank 3 holds no expert."""
    tokens, _ = _lm_batch()
    ids = _lm_routing(_model(), tokens)
    counts = torch.bincount(ids[0].reshape(-1), minlength=ARGS.num_experts)
    assert int(counts.max()) >= 3 * int(counts.min())
    for layer in ids:
        per_rank = [torch.bincount(c.reshape(-1), minlength=ARGS.num_experts) for c in layer.chunk(4)]
        assert len({tuple(c.tolist()) for c in per_rank}) == 4
    assert chunk_size_and_offset(ARGS.num_experts, 4, 3)[0] == 0


# ------------------------------------------------------------------ transformers' MoE blocks


def _hf_block(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        block = MixtralSparseMoeBlock(
            transformers.MixtralConfig(hidden_size=8, intermediate_size=6, num_local_experts=5, num_experts_per_tok=2)
        )
    else:
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        config = transformers.Qwen2MoeConfig(
            hidden_size=8,
            moe_intermediate_size=6,
            shared_expert_intermediate_size=4,
            num_experts=5,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        )
        block = Qwen2MoeSparseMoeBlock(config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        block.gate.weight[0] += 1.0
    return block


def _hf_step(kind, shape, x):
    mesh = so.init_device_mesh("cpu", shape)
    block = _hf_block(kind)
    parallelize_module(block.experts, mesh, ExpertParallel())  # gate_up_proj packed: StridedShard(1, 2) over tp
    so.distribute_module(block, mesh)  # the router (and Qwen's shared expert) replicated
    xd = so.distribute_tensor(x, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1)).requires_grad_()
    with so.CommDebugMode() as comm:
        loss = (block(xd) ** 2).sum()
        loss.backward()
    return (
        loss.full_tensor().detach(),
        xd.grad.full_tensor(),
        {n: p.grad.full_tensor() for n, p in block.named_parameters()},
        comm.get_comm_counts(),
    )


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("shape", MESHES + [(1, 4)], ids=["ep4", "ep2xtp2", "tp4"])
def test_transformers_moe_block(kind, shape, strict):
    """(1, 4): no expert parallelism, every expert tensor-parallel (transformers' "moe_tp_experts" with
    "packed_colwise" gate_up_proj): no all_to_all at all."""
    block = _hf_block(kind)
    xr = X.clone().requires_grad_()
    loss_ref = (block(xr) ** 2).sum()
    loss_ref.backward()
    for loss, xg, grads, counts in so.run(_hf_step, 4, kind, shape, X):
        assert torch.allclose(loss, loss_ref.detach(), rtol=1e-5, atol=TOL)
        assert torch.allclose(xg, xr.grad, atol=TOL)
        for name, p in block.named_parameters():
            assert torch.allclose(grads[name], p.grad, atol=TOL), name
        # forward: counts, dispatch, combine; backward: the two mirrored
        assert counts.get("all_to_all", 0) == (3 + 2 if shape[0] > 1 else 0)


# ------------------------------------------------------------------ errors


def _bad(case):
    mesh = so.init_device_mesh("cpu", (4,))
    m = _moe()
    if case == "3d-mesh":
        parallelize_module(m.experts, so.init_device_mesh("cpu", (1, 2, 2)), ExpertParallel())
    if case == "no-own-parameters":
        parallelize_module(m, mesh, ExpertParallel())
    if case == "not-stacked":
        parallelize_module(torch.nn.Linear(ARGS.dim, 3), mesh, ExpertParallel())
    parallelize_module(m.experts, mesh, ExpertParallel())
    x = torch.randn(3, ARGS.dim)
    if case == "bad-ids":
        m.experts(x, torch.full((3, 2), ARGS.num_experts), torch.ones(3, 2))
    if case == "bad-shape":
        m.experts(x, torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))


@pytest.mark.parametrize("case", ["3d-mesh", "no-own-parameters", "not-stacked", "bad-ids", "bad-shape"])
def test_bad_input_raises_sharding_error(case):
    with pytest.raises(so.ShardingError):
        so.run(_bad, 4, case)


def test_tp_layout_missing_names_the_parameter():
    class Odd(GroupedExperts):
        def __init__(self):
            super().__init__(ARGS)
            self.extra = torch.nn.Parameter(torch.zeros(ARGS.num_experts, 2))

    def body():
        parallelize_module(Odd(), so.init_device_mesh("cpu", (2, 2)), ExpertParallel())

    with pytest.raises(so.ShardingError, match="extra"):
        so.run(body, 4)


# ------------------------------------------------------------------ torch.distributed (gloo)


def _gloo_layer(shape):

    loss, xg, grads, fwd, bwd, ep_rank = _moe_layer(shape, X)
    return loss, xg, grads, _a2a(fwd), _a2a(bwd), ep_rank


@pytest.mark.slow  # 4 gloo processes: about a minute on 2 cores
def test_moe_layer_gloo_uneven_all_to_all():
    """The same layer in 4 gloo processes: torch.distributed's all_to_all_single with uneven splits."""
    loss_ref, xg_ref, g_ref = _reference(X)
    for loss, xg, grads, fwd, bwd, ep_rank in run_gloo(_gloo_layer, 4, (2, 2)):
        assert torch.allclose(loss, loss_ref, atol=TOL) and torch.allclose(xg, xg_ref, atol=TOL)
        for name, g in g_ref.items():
            assert torch.allclose(grads[name], g, atol=TOL), name
        assert (fwd, bwd) == _expected_a2a_bytes(X, 2, ep_rank)


@pytest.mark.slow  # 4 gloo processes, both layouts: about 1.5 minutes on 2 cores
def test_benchmark_moe_quick_expert_parallel_moves_fewer_bytes():
    from benchmarks.moe import measure_moe, table

    rows = {r["layout"]: r for r in measure_moe(quick=True)}
    assert all(r["exact"] for r in rows.values())
    assert rows["expert-parallel"]["counts"] == {"all_to_all": 5}
    assert rows["expert-parallel"]["bytes"] < rows["tensor-parallel"]["bytes"]
    assert "| expert-parallel |" in table(list(rows.values()))


# ------------------------------------------------------------------ explain


def _balanced_routing_bytes():
    """The runtime's all_to_all bytes on rank 0 for a routing that spreads every rank's slots evenly."""
    args = MoEArgs(dim=16, num_experts=8, top_k=2, moe_hidden_dim=4)
    mesh = so.init_device_mesh("cpu", (4,))
    experts = GroupedExperts(args)
    _init(experts, 0)
    parallelize_module(experts, mesh, ExpertParallel())
    tokens = 32  # 8 per rank, 16 token-slots: each expert twice
    ids = torch.stack([torch.arange(tokens) * 2 % 8, (torch.arange(tokens) * 2 + 1) % 8], 1)
    x = so.distribute_tensor(torch.randn(tokens, args.dim), mesh, [Shard(0)])
    with so.CommDebugMode() as comm:
        experts(
            x,
            so.distribute_tensor(ids, mesh, [Shard(0)]),
            so.distribute_tensor(torch.ones(tokens, 2), mesh, [Shard(0)]),
        )
    return _a2a(comm.log)


def test_explain_moe_layer_shows_the_routing_collectives_and_their_bytes():
    e = so.explain("moe(x, num_experts=8, top_k=2)", mesh=4, x="f32[32,16]:S(0)")
    routing = next(s for s in e.steps if s.op == "expert_parallel.routing")
    comm = routing.chosen.comm
    assert [k for _, k, _ in comm] == ["all_to_all"] * 3
    # balanced routing: rank 0's 16 token-slots, 12 of them to the 6 experts other ranks hold, 64 B rows
    assert [int(b) for _, _, b in comm] == [6 * 8, 12 * 64, 12 * 64]
    assert [int(b) for _, _, b in comm] == so.run(_balanced_routing_bytes, 4)[0]  # what the runtime moves
    assert "all_to_all" in str(e) and "expert-parallel" in str(e)
    two_d = so.explain("moe(x, num_experts=8, top_k=2)", mesh=(2, 2), x="f32[4,8,16]:S(0),R")
    routing = next(s for s in two_d.steps if s.op == "expert_parallel.routing")
    assert [(d, k) for d, k, _ in routing.chosen.comm] == [((0,), "all_to_all")] * 3 + [((1,), "all_reduce")]


def test_explain_moe_from_the_command_line(capsys):
    from shardops.cli import main

    assert main(["explain", "moe(x, num_experts=4, top_k=1)", "--mesh", "4", "--x", "f32[64,8]:S(0)"]) == 0
    out = capsys.readouterr().out
    assert "routing(tokens, top_k=1, num_experts=4)" in out and "all_to_all" in out


# ------------------------------------------------------------------ with torch-style data parallelism (shardops.fsdp)

FSDP_STEPS = 3


def _fsdp_parallelize(model, shape, mode):
    """torchtitan's order: TP on mesh["tp"] (on (2, 2)), the experts EP over the data mesh (TP inside over tp),
    then fully_shard per block + root, or replicate, on the data mesh: the experts, already sharded there,
    are left alone by it (their gradients are complete on their ranks, only divided as the others are)."""
    names = ("dp", "tp")[: len(shape)]
    mesh = so.init_device_mesh("cpu", shape, mesh_dim_names=names)
    if len(shape) == 2:
        parallelize_module(model, mesh["tp"], llama_moe_tp_plan())
    parallelize_module(model, mesh, llama_moe_plan())
    dp_mesh = mesh["dp"] if len(shape) == 2 else mesh
    if mode == "shard":
        for layer in model.layers.values():
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    else:
        replicate(model, device_mesh=dp_mesh)
    return mesh, dp_mesh


def _full(t):
    return t.full_tensor() if isinstance(t, so.DTensor) else t


def _fsdp_train(shape, mode, strict_mode=False):
    """Each rank feeds its own batch slice (plain tensors) and takes its local mean loss, as under torch's DDP/FSDP."""
    so.set_strict(strict_mode)
    model = _model()
    mesh, dp_mesh = _fsdp_parallelize(model, shape, mode)
    dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    tokens, target = (t.chunk(dp)[dp_rank] for t in _lm_batch())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    steps = []
    for _ in range(FSDP_STEPS):
        opt.zero_grad()
        with loss_parallel(), so.CommDebugMode() as fwd:
            loss = F.cross_entropy(model(tokens).flatten(0, 1), target.flatten(0, 1))
        with loss_parallel(), so.CommDebugMode() as bwd:
            loss.backward()
        grads = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters()}
        steps.append((_full(loss).detach(), grads, fwd.log, bwd.log))
        opt.step()
    params = {n: _full(p).detach() for n, p in model.named_parameters()}
    return steps, params, dp_rank


def _fsdp_reference():
    model = _model()
    tokens, target = _lm_batch()
    routing = _lm_routing(model, tokens)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    steps = []
    for _ in range(FSDP_STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(model(tokens).flatten(0, 1), target.flatten(0, 1))
        loss.backward()
        steps.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return steps, {n: p.detach() for n, p in model.named_parameters()}, routing


def _dense_bytes():
    """Bytes of the parameters that are not experts' (what data parallelism reduces on a 1-D mesh)."""
    return sum(p.numel() * 4 for n, p in _model().named_parameters() if ".experts." not in n)


def _check_fsdp_training(results, shape, mode):
    steps_ref, params_ref, routing = _fsdp_reference()
    dp = shape[0]
    for step, (loss_ref, grads_ref) in enumerate(steps_ref):
        # a local mean loss per data-parallel rank: their mean is the global batch's loss
        losses = {r[2]: r[0][step][0] for r in results}
        assert len(losses) == dp
        assert torch.allclose(sum(losses.values()) / dp, loss_ref, atol=TOL), step
        for steps, _, _ in results:
            for name, g in grads_ref.items():
                assert torch.allclose(steps[step][1][name], g, atol=TOL), (step, name)
    for _, params, _ in results:
        for name, p in params_ref.items():
            assert torch.allclose(params[name], p, atol=TOL), name
    for steps, _, dp_rank in results:
        _, _, fwd, bwd = steps[0]
        # per MoE layer: forward counts + dispatch + combine, backward the two token all_to_alls mirrored,
        # with exactly the bytes the single-device routing of each ep rank's batch slice implies
        assert (_a2a(fwd), _a2a(bwd)) == _lm_expected_a2a_bytes(routing, dp, dp_rank)
        if len(shape) == 1:  # the data-parallel reduction moves the dense parameters' gradients, never an expert's
            kind = "reduce_scatter" if mode == "shard" else "all_reduce"
            assert sum(b for k, b in bwd if k == kind) == _dense_bytes()
            assert {k for k, _ in fwd + bwd} <= {"all_to_all", "all_gather", kind}


@pytest.mark.parametrize("mode", ["shard", "replicate"])
@pytest.mark.parametrize("shape", MESHES, ids=["ep4", "ep2xtp2"])
def test_llama_moe_expert_parallel_with_fully_shard_and_replicate(shape, mode, strict):
    """Tokens are each rank's local batch slice (plain tensors); ExpertParallel routes them over the data
    mesh; fully_shard (per block + root) or replicate on the data mesh leaves the experts as EP laid them
    out. 3 AdamW steps equal single-device training: losses, every gradient, the parameters."""
    _check_fsdp_training(so.run(_fsdp_train, 4, shape, mode, True), shape, mode)


@pytest.mark.slow  # 4 gloo processes: about a minute on 2 cores
@pytest.mark.parametrize("shape", MESHES, ids=["ep4", "ep2xtp2"])
def test_llama_moe_expert_parallel_with_fully_shard_gloo(shape):
    _check_fsdp_training(run_gloo(_fsdp_train, 4, shape, "shard", True, timeout=300), shape, "shard")


def _recognised():
    from shardops.fsdp._presharded import sharded_over

    mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    experts = GroupedExperts(ARGS)
    parallelize_module(experts, mesh, ExpertParallel())
    flat = so.init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    one_d = GroupedExperts(ARGS)
    parallelize_module(one_d, flat, ExpertParallel())
    tp_only = so.distribute_tensor(torch.zeros(4, 2), mesh["tp"], [Shard(0)])
    return (
        sharded_over(experts.w1, mesh["dp"]),  # Shard(0) over dp of the (dp, tp) mesh
        sharded_over(one_d.w1, so.init_device_mesh("cpu", (4,))),  # the same ranks, unnamed (a default mesh)
        sharded_over(tp_only, mesh["dp"]),
        sharded_over(torch.zeros(4), flat),
    )


def test_parameters_sharded_over_the_data_mesh_are_recognised():
    """What fully_shard/replicate leave alone: DTensors sharded on every dim of their data mesh."""
    for found in so.run(_recognised, 4):
        assert found == (True, True, False, False)
