"""Helpers for the module-parallel tests: strict mode once the model ops have strategies, and
a training run (3 AdamW steps) sharded and on one device from the same weights and data."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F

import shardops as so
from shardops import Partial, Replicate
from shardops.dispatch.registry import DECOMPOSITIONS, RULES, TORCH_FUNCTIONS
from shardops.fsdp import fully_shard, replicate
from shardops.parallel import loss_parallel, parallelize_module

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


def apply_dp(model: torch.nn.Module, dp_mesh, mode: str) -> torch.nn.Module:
    """torchtitan's apply_ddp / apply_fsdp: `replicate` on the data mesh, or `fully_shard` per
    repeated block (a ModuleDict/ModuleList child's children) and then the root."""
    if mode == "replicate":
        return replicate(model, device_mesh=dp_mesh)
    for container in model.children():
        if isinstance(container, (torch.nn.ModuleDict, torch.nn.ModuleList)):
            for block in container.children():
                fully_shard(block, mesh=dp_mesh)
    return fully_shard(model, mesh=dp_mesh)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_ over gradients that may live on several meshes (FSDP + TP: the
    plan's parameters on (dp, tp), those outside it on dp), grouped by mesh as torchtitan's own
    clipping does: each group's norm read in full, the groups' norms combined, every gradient scaled."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, so.DTensor) else None, []).append(p.grad)
    norms = [_full(torch.nn.utils.get_total_norm(grads)) for grads in groups.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)


def global_loss(loss: torch.Tensor, mesh, dp: int) -> float:
    """The whole batch's loss from this rank's local mean (even batch slices): averaged over dp, in one read
    over the whole mesh with the loss's own tp layout (outside the counted blocks)."""
    if isinstance(loss, so.DTensor):
        tp, local = list(loss.placements), loss.to_local()
    else:
        tp, local = [Replicate()] * (mesh.ndim - 1), loss
    return so.from_local(local.detach() / dp, mesh, [Partial("sum"), *tp]).full_tensor().item()


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
    else:  # torch-style data parallelism on mesh["dp"]: each rank its own batch slice, plain tensors
        names = ("dp", "tp") if len(mesh_shape) == 2 else ("dp",)
        mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        if plan is not None:
            parallelize_module(model, mesh["tp"], plan)
        apply_dp(model, mesh["dp"], mode)
        dp = mesh.own_coordinate()[0]
        tok, tgt = tokens.chunk(mesh_shape[0])[dp], targets.chunk(mesh_shape[0])[dp]
        if plan is not None:  # the loss meets DTensor outputs on mesh["tp"]: this dp rank's target, replicated over tp
            tgt = so.from_local(tgt, mesh["tp"], [Replicate()])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=ADAMW_EPS, foreach=foreach)
    losses, grads, pending, step_comms, reread_comms = [], {}, [], [], []
    for step in range(steps):
        opt.zero_grad()
        with loss_parallel():
            loss = loss_fn(model(tok), tgt)
            loss.backward()
        pending.append(sum(_pending_dims(p) for p in model.parameters()))
        with so.CommDebugMode() as clip:
            clip_grad_norm(list(model.parameters()), MAX_NORM)  # reads every gradient first
        with so.CommDebugMode() as comm:
            opt.step()
        # tensor parallel only: pending gradients are resolved by the step's first reads (clip's included);
        # under fully_shard/replicate backward left every gradient final, and the optimizer step sends nothing
        step_comms.append(comm.get_total_counts() + (clip.get_total_counts() if mode is None else 0))
        with so.CommDebugMode() as comm:
            for p in model.parameters():
                _grad(p) * 1.0  # a read in the parameter's layout: free once resolved
        reread_comms.append(comm.get_total_counts())
        if step == 0:
            grads = {n: _full(_grad(p)) for n, p in model.named_parameters()}
        if mode is None:
            losses.append(loss.full_tensor().item() if isinstance(loss, so.DTensor) else loss.item())
        else:
            losses.append(global_loss(loss, mesh, mesh_shape[0]))
    params = {n: _full(p.detach()) for n, p in model.named_parameters()}
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


def _pending_dims(p: torch.Tensor) -> int:
    """Mesh dims on which the gradient is laid out otherwise than its parameter (a pending reduction)."""
    g = _grad(p)
    if not isinstance(p, so.DTensor):
        assert not isinstance(g, so.DTensor), "a plain parameter with a DTensor gradient"
        return 0
    assert isinstance(g, so.DTensor), type(g)
    return sum(a != b for a, b in zip(g.placements, p.placements))


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
    """The LLaMA- or GPT-2-style model on its tensor-parallel plan (on a 2-d mesh `replicate` over
    the other dim, each rank then feeding its own batch slice), and its vocabulary size."""
    from shardops.models import GPT2, Llama, ModelArgs, gpt2_plan, llama_plan

    Model, make_plan = {"llama": (Llama, llama_plan), "gpt2": (GPT2, gpt2_plan)}[model_name]
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, hidden_dim=64, max_seq_len=16)
    mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("tp",) if len(mesh_shape) == 1 else ("dp", "tp"))
    torch.manual_seed(0)
    model = Model(args)
    parallelize_module(model, mesh["tp"], make_plan(loss_parallel=False))
    if len(mesh_shape) == 2:
        replicate(model, device_mesh=mesh["dp"])
    return model, args.vocab_size
