"""Helpers for the module-parallel tests: strict mode once the model ops have strategies, and
a training run (3 AdamW steps) sharded and on one device from the same weights and data."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F

import shardops as so
from shardops import Replicate, Shard
from shardops.dispatch.registry import DECOMPOSITIONS, RULES, TORCH_FUNCTIONS
from shardops.parallel import data_parallel, loss_parallel, parallelize_module

aten = torch.ops.aten

# The ops a model's forward and backward reach besides the math families already in main:
# matrix products, embeddings, attention, rotary (complex views), dropout. Their strategies
# come from other branches; until they land, the model tests run non-strict (values are still
# exact through the replicate fallback) and the optimizer tests run strict on their own.
MODEL_OPS = {
    "linear": (aten.mm.default, aten.addmm.default),
    "embedding": (aten.embedding.default, aten.embedding_dense_backward.default),
    "attention": (aten._scaled_dot_product_flash_attention_for_cpu.default,),
    "rotary": (aten.view_as_complex.default, aten.view_as_real.default),  # freqs (torch.polar) are plain
}


def has_strategies(*families: str) -> bool:
    return all(op in RULES or op in DECOMPOSITIONS or op in TORCH_FUNCTIONS for f in families for op in MODEL_OPS[f])


@contextlib.contextmanager
def strict(enabled: bool = True):
    so.set_strict(enabled)
    try:
        yield
    finally:
        so.set_strict(False)


def tied_gpt2_reference(seed: int):
    """(args, tokens, targets, model): a one-layer GPT-2 (tied embeddings) after one single-device
    backward of its cross-entropy on a batch drawn from `seed`; its wte.weight.grad is the reference."""
    from shardops.models import GPT2, ModelArgs

    args = ModelArgs(n_layers=1)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab_size, (2, 8), generator=g)
    targets = torch.randint(0, args.vocab_size, (2, 8), generator=g)
    model = GPT2(args)
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(0, 1)).backward()
    return args, tokens, targets, model


def relative_error(g: torch.Tensor, ref: torch.Tensor) -> float:
    """||g - ref|| / ||ref||, with a floor for gradients that are zero up to rounding
    (a key bias's gradient is exactly zero in exact arithmetic: softmax ignores a shift)."""
    return float((g - ref).norm() / max(float(ref.norm()), 1e-4))


MAX_NORM = 1.0  # small enough to clip: the total norm over all (sharded) gradients matters
# AdamW's step g / (|g| + eps) turns a gradient element at rounding level (|g| ~ 1e-9, a few per model)
# into an O(lr) update decided by its last bits: with torch's eps=1e-8 any change of summation order
# (sharded matmuls, or another thread count on one device) moves such an element by ~1e-4. eps=1e-6
# keeps those elements' steps small while every real gradient element still steps as AdamW does.
ADAMW_EPS = 1e-6


def reference_training(model: torch.nn.Module, tokens, targets, steps: int = 3, loss_fn=None, lr: float = 1e-2):
    """Single-device losses, first-step gradients and final parameters."""
    loss_fn = loss_fn or (lambda out, tgt: F.cross_entropy(out.flatten(0, 1), tgt.flatten(0, 1)))
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=ADAMW_EPS)
    losses, grads = [], {}
    for step in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if step == 0:
            grads = {n: _grad(p).clone() for n, p in model.named_parameters()}
        losses.append(loss.item())
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def sharded_training(
    make_model: Callable[[], torch.nn.Module],
    plan: dict | None,
    mesh_shape: tuple[int, ...],
    mode: str | None,
    tokens,
    targets,
    steps: int = 3,
    loss_fn=None,
    lr: float = 1e-2,
    foreach: bool | None = None,
):
    """One rank's run (inside so.run): (losses, first-step gradients, final parameters,
    per step: pending gradient mesh dims before the optimizer step, collectives in the step,
    collectives of a second read of every gradient)."""
    loss_fn = loss_fn or (lambda out, tgt: F.cross_entropy(out.flatten(0, 1), tgt.flatten(0, 1)))
    model = make_model()
    if mode is None:  # tensor parallel only, the whole mesh is tp
        mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("tp",))
        parallelize_module(model, mesh, plan)
        tok, tgt = (
            tokens,
            so.from_local(targets, mesh, [Replicate()]),
        )  # the loss meets DTensor logits: a DTensor target
    else:
        names = ("dp", "tp") if len(mesh_shape) == 2 else ("dp",)
        mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        if plan is not None:
            parallelize_module(model, mesh["tp"], plan)
        data_parallel(model, mesh, mode)
        dp = mesh.own_coordinate()[0]
        tok, tgt = tokens.chunk(mesh_shape[0])[dp], targets.chunk(mesh_shape[0])[dp]
        # this dp rank's piece of the target, said explicitly (torch's loss_parallel refuses a plain one there)
        tgt = so.from_local(tgt, mesh, [Shard(0)] + [Replicate()] * (len(mesh_shape) - 1))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=ADAMW_EPS, foreach=foreach)
    losses, grads, pending, step_comms, reread_comms = [], {}, [], [], []
    for step in range(steps):
        opt.zero_grad()
        with loss_parallel():
            loss = loss_fn(model(tok), tgt)
            loss.backward()
        pending.append(
            sum(sum(a != b for a, b in zip(_dt(p.grad).placements, _dt(p).placements)) for p in model.parameters())
        )
        with so.CommDebugMode() as comm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # reads every gradient first
            opt.step()
        step_comms.append(comm.get_total_counts())
        with so.CommDebugMode() as comm:
            for p in model.parameters():
                _grad(p) * 1.0  # a read in the parameter's layout: free once resolved
        reread_comms.append(comm.get_total_counts())
        if step == 0:
            grads = {n: _dt(p.grad).full_tensor() for n, p in model.named_parameters()}
        losses.append(loss.full_tensor().item() if isinstance(loss, so.DTensor) else loss.item())
    params = {n: _dt(p.detach()).full_tensor() for n, p in model.named_parameters()}
    return losses, grads, params, pending, step_comms, reread_comms


def check_training(results, reference, tol: float = 1e-4) -> None:
    ref_losses, ref_grads, ref_params = reference
    for losses, grads, params, pending, step_comms, reread_comms in results:
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= tol, (losses, ref_losses)
        assert set(grads) == set(ref_grads)
        for name in ref_grads:
            assert relative_error(grads[name], ref_grads[name]) <= tol, (
                name,
                relative_error(grads[name], ref_grads[name]),
            )
            assert relative_error(params[name], ref_params[name]) <= tol, (
                name,
                relative_error(params[name], ref_params[name]),
            )
        # each pending gradient is resolved at most once per mesh dim in the step, however often clipping and
        # AdamW read it; clip_grad_norm_'s total norm adds at most one collective per mesh dim
        assert all(c <= p + 2 for c, p in zip(step_comms, pending)), (step_comms, pending)
        assert reread_comms == [0] * len(reread_comms)


def _full(t):
    return t.full_tensor() if isinstance(t, so.DTensor) else t


def _dt(t: object) -> so.DTensor:
    """`t`, which the model's parallel plan made a DTensor (a parameter or its gradient)."""
    assert isinstance(t, so.DTensor), type(t)
    return t


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None, "no gradient"
    return p.grad


def count_step(model, feed, loss_of):
    """Bytes this rank sends in forward + loss + backward + resolving every gradient; the values."""
    with so.CommDebugMode() as fwd:
        loss = loss_of(model(feed))
    with so.CommDebugMode() as bwd:
        loss.backward()
    with so.CommDebugMode() as sync, torch.no_grad():
        for p in model.parameters():
            if isinstance(p.grad, so.DTensor):
                p.grad.to_local()
    sent = fwd.get_total_bytes() + bwd.get_total_bytes() + sync.get_total_bytes()
    with torch.no_grad():
        return sent, _full(loss.detach()), {n: _full(p.grad) for n, p in model.named_parameters()}


def tiny_model(model_name: str, mesh_shape) -> tuple[torch.nn.Module, int]:
    """The LLaMA- or GPT-2-style model on its tensor-parallel plan (on a 2-d mesh data-parallel over
    the other dim), and its vocabulary size."""
    from shardops.models import GPT2, Llama, ModelArgs, gpt2_plan, llama_plan

    Model, make_plan = {"llama": (Llama, llama_plan), "gpt2": (GPT2, gpt2_plan)}[model_name]
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, hidden_dim=64, max_seq_len=16)
    mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("tp",) if len(mesh_shape) == 1 else ("dp", "tp"))
    torch.manual_seed(0)
    model = Model(args)
    parallelize_module(model, mesh["tp"], make_plan(loss_parallel=False))
    if len(mesh_shape) == 2:
        data_parallel(model, mesh)
    return model, args.vocab_size
