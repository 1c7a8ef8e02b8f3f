"""Each parallel style against torch's own parallelize_module, on the same module and inputs.

4 gloo processes on 127.0.0.1; in each, one case runs twice, through
torch.distributed.tensor.parallel and through shardops.parallel with the same plan
(torch's placements given to both: a plan ports by changing its import), and the
two are compared there: output values, whether the output is a local tensor or a
DTensor and its placements, parameter placements, gradients and their placements.
Where shardops differs on purpose, the test says so:
- a vocabulary-sharded embedding's gradient stays Shard(0) (torch: Replicate);
- a SequenceParallel norm's Partial gradient is all-reduced once by AdamW's step
  (torch: once per read, 3 per parameter with foreach=False).
"""

import copy

import pytest
import torch
import torch.nn as nn

import shardops as so
from mp import run_gloo
from parallel_harness import has_strategies, strict, tied_gpt2_reference


class Double(nn.Module):
    def forward(self, a):
        return a * 2


def _cases():
    from torch.distributed.tensor import Replicate, Shard

    g = torch.Generator().manual_seed(0)
    x8, x12 = torch.randn(5, 8, generator=g), torch.randn(5, 12, generator=g)
    seq = torch.randn(2, 8, 8, generator=g)
    batch = torch.randn(4, 6, 8, generator=g)
    ids = torch.randint(0, 16, (2, 8), generator=g)
    full = lambda t: lambda rank: t  # noqa: E731 - replicated input
    chunk = lambda t, d: lambda rank: t.chunk(4, dim=d)[rank]  # noqa: E731 - this rank's shard
    return {
        "colwise-linear": (lambda: nn.Linear(8, 12), lambda api: api.ColwiseParallel(), full(x8)),
        "colwise-linear-replicate-dtensor-out": (
            lambda: nn.Linear(8, 12),
            lambda api: api.ColwiseParallel(output_layouts=Replicate(), use_local_output=False),
            full(x8),
        ),
        "rowwise-linear": (lambda: nn.Linear(12, 8), lambda api: api.RowwiseParallel(), chunk(x12, -1)),
        "rowwise-linear-seq-out": (
            lambda: nn.Linear(8, 8),
            lambda api: api.RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            chunk(seq, -1),
        ),
        "colwise-embedding": (lambda: nn.Embedding(16, 8), lambda api: api.ColwiseParallel(), full(ids)),
        "rowwise-embedding": (
            lambda: nn.Embedding(16, 8),
            lambda api: api.RowwiseParallel(input_layouts=Replicate()),
            full(ids),
        ),
        "rowwise-embedding-seq-out": (
            lambda: nn.Embedding(16, 8),
            lambda api: api.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            full(ids),
        ),
        "sequence-parallel-layernorm": (lambda: nn.LayerNorm(8), lambda api: api.SequenceParallel(), chunk(seq, 1)),
        "sequence-parallel-rmsnorm": (
            lambda: nn.RMSNorm(8),
            lambda api: api.SequenceParallel(use_local_output=True),
            chunk(seq, 1),
        ),
        "prepare-input-output": (
            lambda: Double(),
            lambda api: api.PrepareModuleInputOutput(
                input_layouts=Shard(0),
                desired_input_layouts=Replicate(),
                output_layouts=Replicate(),
                desired_output_layouts=Shard(1),
            ),
            chunk(batch, 0),
        ),
    }


def _run_side(api, mesh, module, style, x, is_ours):
    from shardops.interop import _our_placement

    conv = (lambda ps: tuple(ps)) if is_ours else (lambda ps: tuple(_our_placement(p) for p in ps))
    api.parallelize_module(module, mesh, style)
    if x.is_floating_point():
        x = x.detach().clone().requires_grad_()
    out = module(x)
    is_dtensor = hasattr(out, "placements")
    value = out.to_local() if is_dtensor else out
    loss = (out.full_tensor() ** 2).sum() if is_dtensor else (out**2).sum()
    loss.backward()
    params = {n: conv(p.placements) for n, p in module.named_parameters()}
    grad_placements = {n: conv(p.grad.placements) for n, p in module.named_parameters()}
    grads = {n: p.grad.full_tensor() for n, p in module.named_parameters()}
    return {
        "kind": "DTensor" if is_dtensor else "Tensor",
        "out_placements": conv(out.placements) if is_dtensor else None,
        "value": value.detach(),
        "input_grad": x.grad,
        "params": params,
        "grad_placements": grad_placements,
        "grads": grads,
    }


def _optimizer_all_reduces(api, mesh, module, style, x, is_ours):
    """all_reduces issued by one AdamW (for-loop) step after a backward."""
    api.parallelize_module(module, mesh, style)
    out = module(x)
    ((out.full_tensor() if hasattr(out, "placements") else out) ** 2).sum().backward()
    opt = torch.optim.AdamW(module.parameters(), lr=0.1, foreach=False)
    if is_ours:
        with so.CommDebugMode() as comm:
            opt.step()
        return comm.get_comm_counts().get("all_reduce", 0)
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        opt.step()
    return sum(n for op, n in comm.get_comm_counts().items() if "all_reduce" in str(op))


def program():
    import torch.distributed.tensor.parallel as torch_parallel
    from torch.distributed.device_mesh import init_device_mesh

    import shardops.parallel as our_parallel

    torch_mesh = init_device_mesh("cpu", (4,))
    mesh = so.init_device_mesh("cpu", (4,))
    rank = mesh.get_rank()
    results = {}
    for name, (make, style, inputs) in _cases().items():
        torch.manual_seed(0)
        module = make()
        x = inputs(rank)
        theirs = _run_side(torch_parallel, torch_mesh, copy.deepcopy(module), style(torch_parallel), x, False)
        with strict(has_strategies("linear", "embedding")):  # no fallback on our side
            ours = _run_side(our_parallel, mesh, copy.deepcopy(module), style(our_parallel), x, True)
        results[name] = {
            "value": torch.allclose(ours["value"], theirs["value"], atol=1e-6),
            "kind": (ours["kind"], theirs["kind"]),
            "out_placements": (ours["out_placements"], theirs["out_placements"]),
            "params": (ours["params"], theirs["params"]),
            "grads": {n: torch.allclose(ours["grads"][n], theirs["grads"][n], atol=1e-5) for n in theirs["grads"]},
            "input_grad": theirs["input_grad"] is None
            or torch.allclose(ours["input_grad"], theirs["input_grad"], atol=1e-5),
            "grad_placements": (ours["grad_placements"], theirs["grad_placements"]),
        }
        if name.startswith("sequence-parallel"):
            results[name]["optimizer_all_reduces"] = (
                _optimizer_all_reduces(our_parallel, mesh, copy.deepcopy(module), style(our_parallel), x, True),
                _optimizer_all_reduces(
                    torch_parallel, torch_mesh, copy.deepcopy(module), style(torch_parallel), x, False
                ),
            )
    results["tied-gpt2"] = _tied_gpt2(torch_parallel, torch_mesh, our_parallel, mesh)
    return results


def _tied_gpt2(torch_parallel, torch_mesh, our_parallel, mesh):
    """GPT-2's tied embedding gradient after one backward, against single device, for each API."""
    import torch.nn.functional as F

    from shardops.models import GPT2, gpt2_plan

    args, tokens, targets, ref = tied_gpt2_reference(9)
    out = {}
    for name, api, m in (("torch", torch_parallel, torch_mesh), ("ours", our_parallel, mesh)):
        model = GPT2(args)
        api.parallelize_module(model, m, gpt2_plan(api=api))
        with api.loss_parallel():
            F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(0, 1)).backward()
        grad = model.wte.weight.grad.full_tensor()
        out[name] = (
            model.wte.weight is model.lm_head.weight,
            float((grad - ref.wte.weight.grad).norm() / ref.wte.weight.grad.norm()),
        )
    return out


@pytest.fixture(scope="module")
def results():
    return run_gloo(program, 4, timeout=240)


CASES = list(_cases())


@pytest.mark.parametrize("case", CASES)
def test_style_matches_torch(results, case):
    for rank_results in results:
        r = rank_results[case]
        assert r["value"], "output values differ from torch's"
        assert r["kind"][0] == r["kind"][1], r["kind"]  # local tensor or DTensor, as torch
        assert r["out_placements"][0] == r["out_placements"][1]
        assert r["params"][0] == r["params"][1]
        assert all(r["grads"].values()), r["grads"]
        assert r["input_grad"], "the gradient of the module's local input differs from torch's"
        ours, theirs = r["grad_placements"]
        for name in theirs:
            if case.startswith("rowwise-embedding"):
                # better than torch: the vocabulary-sharded table's gradient stays sharded, no full table per rank
                assert theirs[name] == (so.Replicate(),) and ours[name] == (so.Shard(0),)
            else:
                assert ours[name] == theirs[name], (name, ours[name], theirs[name])


def test_tied_embeddings_stay_tied_where_torch_unties_them(results):
    for rank_results in results:
        r = rank_results["tied-gpt2"]
        assert r["ours"][0] and r["ours"][1] < 1e-5, r["ours"]
        assert not r["torch"][0] and r["torch"][1] > 0.1, r["torch"]  # torch: two parameters, the gradient off


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("sequence-parallel")])
def test_sequence_parallel_norm_gradients_reduce_once_where_torch_reduces_per_read(results, case):
    n_params = {"sequence-parallel-layernorm": 2, "sequence-parallel-rmsnorm": 1}[case]
    for rank_results in results:
        ours, theirs = rank_results[case]["optimizer_all_reduces"]
        assert ours == n_params
        assert theirs == 3 * n_params  # torch: lerp_, mul_/addcmul_, ... each re-reduce the Partial gradient
