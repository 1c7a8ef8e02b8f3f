"""shardops.parallel in the threads world: plans, styles, ties, loss_parallel, with fully_shard/replicate,
optimizers on DTensor parameters, and small models trained against single-device torch.

The styles against torch's own parallelize_module (same module, same inputs, 4 gloo
processes) are in test_parallel_torch.py.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardops as so
from parallel_harness import (
    apply_dp,
    check_training,
    has_strategies,
    reference_training,
    sharded_training,
    strict,
    tied_gpt2_reference,
)
from shardops import Replicate, Shard
from shardops.experimental import implicit_replication
from shardops.models import GPT2, Llama, ModelArgs, gpt2_plan, llama_plan
from shardops.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

MESHES = [((4,), None), ((2, 2), "replicate"), ((2, 2), "shard")]
MESH_IDS = ["tp4", "dp2xtp2-replicate", "dp2xtp2-shard"]
LM_MESHES = MESHES + [((4,), "shard")]  # the last: data parallel only, no plan
LM_MESH_IDS = MESH_IDS + ["dp4-shard"]


def _tp_mesh():
    return so.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))


# ------------------------------------------------------------------ plans


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(8, 12)
        self.w2 = nn.Linear(12, 8)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class Stack(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n)})
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x)


def test_plan_keys_with_wildcards_and_dotted_paths():
    ref = Stack()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))

    def main():
        m = copy.deepcopy(ref)
        plan = {
            "layers.*.w1": ColwiseParallel(),
            "layers.[02].w2": RowwiseParallel(),
            "layers.1.w2": RowwiseParallel(use_local_output=False),
            "nothing.*": ColwiseParallel(),
        }
        parallelize_module(m, _tp_mesh(), plan)
        placements = {n: p.placements if isinstance(p, so.DTensor) else None for n, p in m.named_parameters()}
        out = m(x)
        return placements, out.full_tensor() if isinstance(out, so.DTensor) else out

    with pytest.warns(
        UserWarning, match="'nothing.*' could not be resolved"
    ):  # (warnings from rank threads: checked here)
        placements, out = so.run(main, 4)[0]
    for i in range(3):
        assert placements[f"layers.{i}.w1.weight"] == (Shard(0),) and placements[f"layers.{i}.w1.bias"] == (Shard(0),)
    assert placements["layers.0.w2.weight"] == placements["layers.2.w2.weight"] == (Shard(1),)
    assert placements["layers.0.w2.bias"] == (Replicate(),)
    assert placements["layers.1.w2.weight"] == (Shard(1),)
    assert placements["head.weight"] is None  # not in the plan: a plain parameter fed a DTensor
    torch.testing.assert_close(out, ref(x))


def test_styles_take_torch_placements_and_reject_other_modules():
    from torch.distributed.tensor import Shard as TorchShard

    style = RowwiseParallel(output_layouts=TorchShard(1))
    assert style.output_layouts == (Shard(1),)

    def main():
        with pytest.raises(so.ShardingError, match="nn.Linear and nn.Embedding"):
            parallelize_module(nn.LayerNorm(4), _tp_mesh(), ColwiseParallel())
        return True

    assert all(so.run(main, 4))


@pytest.mark.parametrize("src_data_rank", [0, 1, None])
def test_src_data_rank_is_the_rank_within_the_tp_mesh(src_data_rank):
    """As torch: parameters come from group rank src_data_rank of the mesh given (a sub-mesh here)."""

    def main():
        mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        lin = nn.Linear(4, 4)
        with torch.no_grad():
            lin.weight.fill_(float(mesh.get_rank()))
            lin.bias.fill_(float(mesh.get_rank()))
        parallelize_module(lin, mesh["tp"], ColwiseParallel(), src_data_rank=src_data_rank)
        return mesh["tp"].mesh.tolist(), mesh.get_rank(), lin.weight.to_local().unique().tolist()

    for tp_ranks, rank, values in so.run(main, 4):
        expected = rank if src_data_rank is None else tp_ranks[src_data_rank]
        assert values == [float(expected)]


# ------------------------------------------------------------------ ties


@pytest.mark.parametrize("layouts", ["same", "different"])
def test_tied_embeddings_stay_tied(layouts):
    """torch's parallelize_module unties them silently; here the gradient equals single-device."""
    args, tokens, targets, ref = tied_gpt2_reference(3)
    if layouts == "same":  # table Shard(0) for both (vocabulary parallel)
        plan = {
            "wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
    else:  # embedding sharded on its hidden dim (Shard(1)), output projection on the vocabulary (Shard(0))
        plan = {
            "wte": ColwiseParallel(output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }

    def main():
        m = GPT2(args)
        parallelize_module(m, _tp_mesh(), plan)
        tied = m.wte.weight is m.lm_head.weight
        with loss_parallel():
            F.cross_entropy(m(tokens).flatten(0, 1), targets.flatten(0, 1)).backward()
        return tied, m.wte.weight.placements, m.wte.weight.grad.full_tensor()

    for tied, placements, grad in so.run(main, 4):
        assert tied
        assert placements == ((Shard(0),) if layouts == "same" else (Shard(1),))
        torch.testing.assert_close(grad, ref.wte.weight.grad, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------ Prepare* styles


class Recorder(nn.Module):
    """Records what reaches its forward, returns (x + y) * z and z."""

    def forward(self, x, y=None, *, z):
        self.seen = {"x": x, "y": y, "z": z}
        if isinstance(z, so.DTensor):  # y, left plain, is every rank's same copy: said explicitly (torch's rule)
            y = so.from_local(y, z.device_mesh, [Replicate()])
        return x + y * z, z


@pytest.mark.parametrize("use_local", [False, True])
def test_prepare_module_input_positional_and_keyword(use_local):
    x, y, z = (torch.randn(8, 3, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3))

    def main():
        mesh = _tp_mesh()
        rank = mesh.get_local_rank()
        m = Recorder()
        parallelize_module(
            m,
            mesh,
            PrepareModuleInput(
                input_layouts=(Shard(0), None),
                desired_input_layouts=(Replicate(), None),
                input_kwarg_layouts={"z": Shard(0)},
                desired_input_kwarg_layouts={"z": Replicate()},
                use_local_output=use_local,
            ),
        )
        out, _ = m(x.chunk(4)[rank], y, z=z.chunk(4)[rank])
        seen = m.seen
        kinds = {k: type(v).__name__ for k, v in seen.items()}
        placements = {k: getattr(v, "placements", None) for k, v in seen.items()}
        full = out.full_tensor() if isinstance(out, so.DTensor) else out
        return kinds, placements, full

    for kinds, placements, out in so.run(main, 4):
        expected = "Tensor" if use_local else "DTensor"
        assert kinds == {"x": expected, "y": "Tensor", "z": expected}  # None layout: y untouched
        if not use_local:
            assert placements["x"] == placements["z"] == (Replicate(),)
        torch.testing.assert_close(out, x + y * z)


def test_prepare_module_output_and_input_output():
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(4))

    class Double(nn.Module):
        def forward(self, a):
            return a * 2, a.sum()

    def main():
        mesh = _tp_mesh()
        rank = mesh.get_local_rank()
        only_out = Double()
        parallelize_module(
            only_out,
            mesh,
            PrepareModuleOutput(output_layouts=(Replicate(), None), desired_output_layouts=(Shard(0), None)),
        )
        a, s = only_out(x)
        both = Double()
        parallelize_module(
            both,
            mesh,
            PrepareModuleInputOutput(
                input_layouts=Shard(0),
                desired_input_layouts=Replicate(),
                output_layouts=(Replicate(), Replicate()),
                desired_output_layouts=(Shard(0), Replicate()),
                use_local_output=False,
            ),
        )
        b, t = both(x.chunk(4)[rank])
        return type(a).__name__, a, s, b.placements, b.full_tensor(), t.full_tensor(), rank

    for a_kind, a, s, b_placements, b, t, rank in so.run(main, 4):
        assert a_kind == "Tensor"  # use_local_output=True by default
        torch.testing.assert_close(a, (x * 2).chunk(4)[rank])
        torch.testing.assert_close(s, x.sum())  # None: untouched
        assert b_placements == (Shard(0),)
        torch.testing.assert_close(b, x * 2)
        torch.testing.assert_close(t, x.sum())


def test_distribute_module_partition_and_hooks():
    lin = nn.Linear(6, 4)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(5))

    def main():
        mesh = _tp_mesh()
        m = copy.deepcopy(lin)

        def partition(name, module, mesh):
            if isinstance(module, nn.Linear):
                module.register_parameter(
                    "weight", nn.Parameter(so.distribute_tensor(module.weight.detach(), mesh, [Shard(0)]))
                )

        so.distribute_module(
            m,
            mesh,
            partition,
            input_fn=lambda mod, inputs, mesh: so.DTensor.from_local(inputs[0], mesh, [Replicate()]),
            output_fn=lambda mod, out, mesh: out.full_tensor(),
        )
        with pytest.raises(so.ShardingError, match="only be called once"):
            so.distribute_module(m, mesh)
        return m.weight.placements, m.bias.placements, m(x)

    for wp, bp, out in so.run(main, 4):
        assert wp == (Shard(0),) and bp == (Replicate(),)  # the rest replicated
        torch.testing.assert_close(out, lin(x))


# ------------------------------------------------------------------ loss_parallel


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_loss_parallel_forward_backward(mesh_shape):
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 6, 10, generator=g, requires_grad=True)
    target = torch.randint(0, 10, (4, 6), generator=g)
    ref = F.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1))
    (ref_grad,) = torch.autograd.grad(ref, logits)

    def main():
        if len(mesh_shape) == 1:
            mesh = so.init_device_mesh("cpu", mesh_shape)
            dl = so.distribute_tensor(logits.detach(), mesh, [Shard(2)]).requires_grad_()
            tgt = target  # replicated: a plain target, as torch takes it
        else:
            mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
            dl = so.distribute_tensor(logits.detach(), mesh, [Shard(0), Shard(2)]).requires_grad_()
            # this rank's batch shard, said explicitly (torch's loss_parallel refuses a plain one here)
            tgt = so.from_local(target.chunk(2)[mesh.get_coordinate()[0]], mesh, [Shard(0), Replicate()])
        with loss_parallel():
            loss = F.cross_entropy(dl.flatten(0, 1), tgt.flatten(0, 1))
            loss.backward()
        return loss.full_tensor(), dl.grad.full_tensor(), dl.grad.placements == dl.placements

    for loss, grad, same_layout in so.run(main, 4):
        torch.testing.assert_close(loss, ref.detach())
        torch.testing.assert_close(grad, ref_grad)
        assert same_layout  # the logits' gradient stays vocabulary-sharded


# ------------------------------------------------------------------ optimizers and pending gradients


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=False),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=0.05, fused=True),
    "adamw-amsgrad-foreach": lambda ps: torch.optim.AdamW(ps, lr=0.05, amsgrad=True, foreach=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False),
    "sgd-momentum-foreach": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
}
PARAM_LAYOUTS = [[Replicate(), Replicate()], [Replicate(), Shard(1)], [Shard(0), Shard(1)], [Shard(1), Replicate()]]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_steps_strict_on_dtensor_parameters(name):
    """3 steps with clip_grad_norm_ over all parameters; the gradients reach the step pending
    (Partial(sum) or sharded where the parameter is replicated); no fallback (strict)."""
    g = torch.Generator().manual_seed(7)
    inits = [torch.randn(6, 5, generator=g) for _ in PARAM_LAYOUTS]
    xs = [torch.randn(3, 6, 5, generator=g) for _ in range(3)]

    def loss_of(params, x):
        return sum(((p * x).sum(0) ** 2).sum() * (k + 1) for k, p in enumerate(params))

    ref_params = [nn.Parameter(t.clone()) for t in inits]
    opt = OPTIMIZERS[name](ref_params)
    for x in xs:
        opt.zero_grad()
        loss_of(ref_params, x).backward()
        torch.nn.utils.clip_grad_norm_(ref_params, 10.0)
        opt.step()

    def main():
        mesh = so.init_device_mesh("cpu", (2, 2))
        params = [nn.Parameter(so.distribute_tensor(t, mesh, pl)) for t, pl in zip(inits, PARAM_LAYOUTS)]
        opt = OPTIMIZERS[name](params)
        with strict():
            for x in xs:
                opt.zero_grad()
                dx = so.distribute_tensor(x, mesh, [Shard(0), Replicate()])  # batch sharded: weight gradients pend
                loss_of(params, dx).full_tensor().backward()
                torch.nn.utils.clip_grad_norm_(params, 10.0)
                opt.step()
        return [p.detach().full_tensor() for p in params], [p.placements for p in params]

    for params, placements in so.run(main, 4):
        assert placements == [tuple(pl) for pl in PARAM_LAYOUTS]
        for p, r in zip(params, ref_params):
            torch.testing.assert_close(p, r.detach(), atol=1e-5, rtol=1e-5)


def test_sequence_parallel_norm_gradients_resolve_once():
    """torch's AdamW (for-loop) all-reduces a SequenceParallel norm weight's Partial gradient on
    each of its reads; here the first read resolves it, once per step."""
    norm = nn.LayerNorm(6)
    x = torch.randn(2, 8, 6, generator=torch.Generator().manual_seed(8))

    def main():
        mesh = _tp_mesh()
        m = copy.deepcopy(norm)
        parallelize_module(m, mesh, SequenceParallel())
        opt = torch.optim.AdamW(m.parameters(), lr=0.1, foreach=False)
        counts = []
        with strict():
            for _ in range(2):
                opt.zero_grad()
                out = m(x.chunk(4, dim=1)[mesh.get_local_rank()])
                (out.full_tensor() ** 2).sum().backward()
                pending = [p.grad.placements for p in m.parameters()]
                with so.CommDebugMode() as comm:
                    opt.step()
                counts.append((pending, comm.get_comm_counts()))
        return counts

    for counts in so.run(main, 4):
        for pending, comm in counts:
            assert pending == [(so.Partial(),), (so.Partial(),)]
            assert comm == {"all_reduce": 2}  # weight and bias, once each (torch: 3 each, one per read)


# ------------------------------------------------------------------ training


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.norm = nn.LayerNorm(16)
        self.w1 = nn.Linear(16, 24)
        self.w2 = nn.Linear(24, 16)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(self.norm(x))))


MLP_PLAN = {
    "": PrepareModuleInput(
        input_layouts=Replicate(), desired_input_layouts=Shard(1)
    ),  # the root: sequence-shard the input
    "norm": SequenceParallel(),
    "w1": ColwiseParallel(input_layouts=Shard(1)),
    "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
}


def _mse(out, target):
    return ((out - target) ** 2).mean()


@pytest.mark.parametrize(
    "mesh_shape,mode", MESHES + [((4,), "replicate"), ((4,), "shard")], ids=MESH_IDS + ["dp4-replicate", "dp4-shard"]
)
def test_mlp_trains_like_single_device(mesh_shape, mode):
    g = torch.Generator().manual_seed(12)
    x, target = torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 16, generator=g)
    model = MLP()
    plan = None if (mode is not None and len(mesh_shape) == 1) else MLP_PLAN
    ref = reference_training(model, x, target, loss_fn=_mse)
    with strict(has_strategies("linear")):
        results = so.run(sharded_training, 4, lambda: copy.deepcopy(model), plan, mesh_shape, mode, x, target, 3, _mse)
    check_training(results, ref)


def _lm_data(args, batch=4, seq=8, seed=13):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, args.vocab_size, (batch, seq), generator=g), torch.randint(
        0, args.vocab_size, (batch, seq), generator=g
    )


LM = {"llama": (Llama, llama_plan), "gpt2": (GPT2, gpt2_plan)}


def _op_families(name: str, plan: dict | None, local_attention: bool) -> tuple[str, ...]:
    """The op families a run reaches on DTensors: attention (and LLaMA's rotary) run on local
    tensors between the plan's boundaries, on DTensors without a plan or with local_attention=False."""
    if plan is not None and local_attention:
        return ("linear", "embedding")
    return ("linear", "embedding", "attention") + (("rotary",) if name == "llama" else ())


def check_lm_training(name, mesh_shape, mode, **plan_kwargs):
    """Train `name` sharded and on one device; assert (check_training) losses, first gradients, final parameters."""
    Model, make_plan = LM[name]
    args = ModelArgs()
    tokens, targets = _lm_data(args)
    ref = reference_training(Model(args), tokens, targets)
    plan = None if (mode is not None and len(mesh_shape) == 1) else make_plan(**plan_kwargs)
    with strict(has_strategies(*_op_families(name, plan, plan_kwargs.get("local_attention", True)))):
        results = so.run(sharded_training, 4, lambda: Model(args), plan, mesh_shape, mode, tokens, targets)
    check_training(results, ref)


@pytest.mark.parametrize("mesh_shape,mode", LM_MESHES, ids=LM_MESH_IDS)
@pytest.mark.parametrize("name", list(LM))
def test_language_model_trains_like_single_device(name, mesh_shape, mode):
    """Sequence-parallel norms, column/row-parallel attention and MLP (local tensors in between),
    vocabulary-parallel embedding and loss; GPT-2's tied embeddings stay one parameter."""
    check_lm_training(name, mesh_shape, mode)


@pytest.mark.parametrize("mesh_shape,mode", [MESHES[0], MESHES[2]], ids=[MESH_IDS[0], MESH_IDS[2]])
@pytest.mark.parametrize("name", list(LM))
def test_language_model_with_attention_on_dtensors(name, mesh_shape, mode):
    """q/k/v stay DTensors (use_local_output=False): rotary and SDPA run on DTensors."""
    check_lm_training(name, mesh_shape, mode, local_attention=False)


@pytest.mark.parametrize("mode", ["replicate", "shard"])
@pytest.mark.parametrize("name", list(LM))
def test_language_model_with_norms_outside_the_plan(name, mode):
    """No sequence parallelism: the norms are left out of the plan and compute on local tensors;
    on a (dp, tp) mesh their parameters are still synchronised over dp."""
    check_lm_training(name, (2, 2), mode, sequence_parallel=False)


@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_tied_embeddings_with_two_layouts_under_fully_shard_and_replicate(mode):
    """Embedding hidden-sharded, output projection vocabulary-sharded: one parameter read through
    a view, and the rest of the model outside the plan, on a (dp, tp) mesh."""
    args = ModelArgs(n_layers=1)
    tokens, targets = _lm_data(args)
    plan = {
        "wte": ColwiseParallel(output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    ref = reference_training(GPT2(args), tokens, targets)
    results = so.run(sharded_training, 4, lambda: GPT2(args), plan, (2, 2), mode, tokens, targets)
    check_training(results, ref)


class _ScaledEmbedding(nn.Embedding):
    """Gemma's embedding: its output times a constant buffer (which the style replicates on mesh["tp"])."""

    def __init__(self):
        super().__init__(16, 8)
        self.register_buffer("scale", torch.tensor(8**0.5), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.scale


@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_a_styles_buffers_under_fully_shard_and_replicate(mode):
    """A buffer the style replicated on mesh["tp"] stays there under fully_shard/replicate on mesh["dp"]:
    activations live on the tp mesh, so the module's forward mixes them with it as under TP alone."""
    torch.manual_seed(0)
    model = _ScaledEmbedding()
    ids = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(2))
    ref = model(ids).pow(2).mean()
    (ref_grad,) = torch.autograd.grad(ref, model.weight)

    def main():
        mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        m = copy.deepcopy(model)
        parallelize_module(m, mesh["tp"], RowwiseParallel(input_layouts=Replicate()))
        apply_dp(m, mesh["dp"], mode)
        local = m(ids.chunk(2)[mesh.get_coordinate()[0]]).pow(2).mean()  # this dp rank's batch mean
        local.backward()
        return m.scale.device_mesh == mesh["tp"], local.item(), m.weight.grad.full_tensor()

    results = so.run(main, 4)
    assert sum(r[1] for r in results) / 4 == pytest.approx(ref.item(), abs=1e-6)
    for on_tp_mesh, _, grad in results:
        assert on_tp_mesh
        torch.testing.assert_close(grad, ref_grad)


# ------------------------------------------------------------------ tied, scaled embeddings (issue 21)


class ScaledTiedLM(nn.Module):
    """Gemma-2's shape in small: the input embedding scaled by sqrt(dim), a residual that mixes the
    embedding's plain output with a DTensor, and the output projection tied to the embedding."""

    def __init__(self, vocab=16, dim=8):
        super().__init__()
        torch.manual_seed(31)
        self.embed = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        h = h * torch.tensor(h.shape[-1] ** 0.5, dtype=h.dtype)
        return self.lm_head(torch.tanh(h + self.mid(h)))


@pytest.mark.parametrize("embed_style", ["rowwise", "colwise", "outside_plan"])
def test_tied_scaled_embedding_gradient(embed_style):
    """The tied weight's gradient is one plain-backed DTensor (never a DTensor wrapping a DTensor:
    the plain embedding output met a DTensor in the residual) equal to single-device torch."""
    g = torch.Generator().manual_seed(32)
    ids, targets = torch.randint(0, 16, (2, 5), generator=g), torch.randint(0, 16, (2, 5), generator=g)
    ref = ScaledTiedLM()
    F.cross_entropy(ref(ids).flatten(0, 1), targets.flatten()).backward()

    def main():
        mesh = _tp_mesh()
        model = ScaledTiedLM()
        plan = {
            "mid": ColwiseParallel(use_local_output=False),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        if embed_style == "rowwise":
            plan["embed"] = RowwiseParallel(input_layouts=Replicate())
        elif embed_style == "colwise":
            plan["embed"] = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(model, mesh, plan)
        # the model mixes the embedding's plain (replicated) output, and outside the plan the plain ids,
        # with DTensors: torch's opt-in for that
        with loss_parallel(), implicit_replication():
            F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
        grad = model.embed.weight.grad
        assert model.embed.weight is model.lm_head.weight
        assert type(grad._local_tensor) is torch.Tensor
        return grad.full_tensor(), model.mid.weight.grad.full_tensor()

    for tied, mid in so.run(main, 4):
        torch.testing.assert_close(tied, ref.embed.weight.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mid, ref.mid.weight.grad, atol=1e-5, rtol=1e-5)
