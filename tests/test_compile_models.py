"""torch.compile on whole models (shardops' LLaMA and GPT-2 with their tensor-parallel plans): a compiled
training step equals eager's (loss, every gradient's value and layout) and sends eager's collectives, in
the threads world and under gloo. In a file of its own so that the suite's workers share test_compile's
load (pytest -n 2 --dist loadfile).
"""

import pytest
import torch
import torch.nn as nn

import shardops as so
from mp import run_gloo
from parallel_harness import tiny_model
from shardops.parallel import parallelize_module
from test_compile import MESHES, SLOW, _full


def _model_step(model: nn.Module, run, tokens: torch.Tensor, targets: torch.Tensor) -> dict:
    """One training step's loss, every gradient (global value and layout) and the collectives it sent."""
    for p in model.parameters():
        p.grad = None
    with so.CommDebugMode() as comm:
        out = run(tokens)
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten(0, 1))
        loss.backward()
    grads = {
        n: (None if p.grad is None else _full(p.grad), getattr(p.grad, "placements", None))
        for n, p in model.named_parameters()
    }
    return {"loss": _full(loss).detach(), "grads": grads, "log": list(comm.log)}


def _compiled_model_differences(model_name: str, mesh_shape) -> list[str]:
    """Where this rank's compiled training steps (the first compiles, the second reuses) differ from eager's.

    Collectives: eager's, in eager's order and sizes.
    """
    model, vocab = tiny_model(model_name, mesh_shape)
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, vocab, (4, 16), generator=g) for _ in range(2))
    eager = _model_step(model, model, tokens, targets)
    compiled = torch.compile(model, backend="aot_eager")
    wrong = []
    for step in range(2):
        got = _model_step(model, compiled, tokens, targets)
        if not torch.allclose(got["loss"], eager["loss"], atol=1e-5):
            wrong.append(f"step {step}: loss {got['loss']} vs eager {eager['loss']}")
        for name, (grad, layout) in got["grads"].items():
            want, want_layout = eager["grads"][name]
            if grad is None:
                wrong.append(f"step {step}: {name}.grad is None after a compiled backward")
            elif layout != want_layout or not torch.allclose(grad, want, atol=1e-5):
                wrong.append(f"step {step}: {name}.grad {layout} differs from eager's {want_layout}")
        if got["log"] != eager["log"]:
            wrong.append(f"step {step}: collectives {got['log']} vs eager {eager['log']}")
    return wrong


MODEL_CASES = [(name, shape) for name in ("llama", "gpt2") for shape in MESHES]
DEFAULT_MODEL_CASES = {("llama", (2, 2)), ("gpt2", (4,))}  # each model and each mesh once; the rest: -m slow


@pytest.mark.parametrize(
    "model_name, mesh_shape",
    [
        pytest.param(n, s, id=f"{n}-{'x'.join(map(str, s))}", marks=() if (n, s) in DEFAULT_MODEL_CASES else SLOW)
        for n, s in MODEL_CASES
    ],
)
def test_compiled_models_equal_eager_in_the_threads_world(model_name, mesh_shape):
    torch._dynamo.reset()
    for r, wrong in enumerate(so.run(lambda: _compiled_model_differences(model_name, mesh_shape), 4)):
        assert not wrong, f"rank {r}: {wrong}"


def _both_models_differences(mesh_shape):
    return {name: _compiled_model_differences(name, mesh_shape) for name in ("llama", "gpt2")}


def test_compiled_models_equal_eager_under_gloo_on_a_2d_mesh():
    for r, models in enumerate(run_gloo(_both_models_differences, 4, (2, 2), timeout=900)):
        for name, wrong in models.items():
            assert not wrong, f"rank {r}, {name}: {wrong}"


def _model_graphs(model_name: str) -> tuple[int, int, list[str], bool]:
    from shardops.models import GPT2, Llama, ModelArgs, gpt2_plan, llama_plan

    Model, make_plan = {"llama": (Llama, llama_plan), "gpt2": (GPT2, gpt2_plan)}[model_name]
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, hidden_dim=64, max_seq_len=16)
    torch.manual_seed(0)
    model = Model(args)
    parallelize_module(model, so.init_device_mesh("cpu", (2,)), make_plan(loss_parallel=False))
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len), generator=torch.Generator().manual_seed(0))
    explained = torch._dynamo.explain(model)(tokens)
    torch._dynamo.reset()
    targets = torch.randint(0, args.vocab_size, (2, args.max_seq_len), generator=torch.Generator().manual_seed(1))
    logs = []
    for run in (model, torch.compile(model, backend="aot_eager")):  # a training step: forward, loss, backward
        with so.CommDebugMode() as comm:
            out = run(tokens)
            torch.nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten(0, 1)).backward()
        logs.append(comm.log)
    reasons = [str(b.reason)[:300] for b in explained.break_reasons]
    return explained.graph_count, explained.graph_break_count, reasons, logs[0] == logs[1]


def _both_models_graphs():
    return {name: _model_graphs(name) for name in ("llama", "gpt2")}


@pytest.mark.slow  # about 3 minutes; the 2-D gloo case above keeps compiled models under gloo in the default suite
def test_llama_and_gpt2_compile_to_one_graph_and_send_what_eager_sends_under_gloo():
    """The tensor-parallel LLaMA- and GPT-2-style models (their plans, 2 gloo ranks): the forward is one
    graph with no break, and a compiled training step issues eager's collectives, in eager's order and
    sizes (a forward collective's counter once moved into the backward, which then ran it again)."""
    for r, models in enumerate(run_gloo(_both_models_graphs, 2, timeout=900)):
        for name, (graphs, breaks, reasons, same_collectives) in models.items():
            assert (graphs, breaks) == (1, 0), f"rank {r}, {name}: {graphs} graphs, {breaks} breaks: {reasons}"
            assert same_collectives, f"rank {r}, {name}: the compiled step's collectives differ from eager's"
