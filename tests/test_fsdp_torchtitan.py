"""torchtitan's `apply_fsdp` / `apply_ddp`, written as torchtitan writes them with the imports
swapped to shardops, on shardops' LLaMA-style model with its torchtitan-style tensor-parallel plan.

The training loop follows torchtitan: the loss is the sum over this rank's tokens divided by the
global token count, and the FSDP modules' gradient divide factor is 1 (a plain sum over dp), so
`apply_fsdp` gives single-device training's gradients; under `apply_ddp` torch's DDP averages
the gradients once more, giving 1/dp of them (torch's behaviour, kept).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardops as so

# -- the swapped imports: torch.distributed.fsdp / torch.distributed._composable -> shardops.fsdp
from shardops.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard, replicate
from shardops.models import Llama, ModelArgs, llama_plan
from shardops.parallel import parallelize_module


# ---------------------------------------------------------------- torchtitan (parallelize_llama.py)
def apply_fsdp(
    model, dp_mesh, param_dtype, reduce_dtype, pp_enabled, cpu_offload=False, reshard_after_forward_policy="default"
):
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fsdp_config = {"mesh": dp_mesh, "mp_policy": mp_policy}
    if cpu_offload:
        fsdp_config["offload_policy"] = CPUOffloadPolicy()

    for layer_id, transformer_block in model.layers.items():
        if reshard_after_forward_policy == "always":
            reshard_after_forward = True
        elif reshard_after_forward_policy == "never":
            reshard_after_forward = False
        elif reshard_after_forward_policy == "default":
            if pp_enabled:
                # For PP, do not reshard after forward to avoid per-microbatch
                # all-gathers, which can be expensive and non-overlapped
                reshard_after_forward = False
            else:
                # As an optimization, do not reshard after forward for the last
                # transformer block since FSDP would prefetch it immediately
                reshard_after_forward = int(layer_id) < len(model.layers) - 1
        else:
            raise ValueError(f"Invalid reshard_after_forward_policy: {reshard_after_forward_policy}.")
        fully_shard(transformer_block, **fsdp_config, reshard_after_forward=reshard_after_forward)
    fully_shard(model, **fsdp_config, reshard_after_forward=not pp_enabled)


def apply_ddp(model, dp_mesh, enable_compile, enable_compiled_autograd):
    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)


# ---------------------------------------------------------------- end of torchtitan's code


ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, hidden_dim=48, max_seq_len=16)
BATCH, SEQ, STEPS, TOL = 4, 16, 3, 1e-4


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        (
            torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=g),
            torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _step_loss(model, tokens, labels, global_tokens: int) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum") / global_tokens


def _single() -> dict:
    model = Llama(ARGS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    losses, grads = [], None
    for tokens, labels in _batches():
        opt.zero_grad()
        loss = _step_loss(model, tokens, labels, tokens.numel())
        loss.backward()
        losses.append(loss.item())
        grads = grads or {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        opt.step()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _full(t):
    return t.full_tensor() if isinstance(t, so.DTensor) else t


def _rank(mesh_shape: tuple[int, ...], how: str) -> dict:
    so.set_strict(True)
    try:
        names = ("dp", "tp")[: len(mesh_shape)]
        mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        model = Llama(ARGS)
        if "tp" in names:
            parallelize_module(model, mesh["tp"], llama_plan(loss_parallel=False))
        if how == "fsdp":
            apply_fsdp(model, mesh["dp"], torch.float32, torch.float32, pp_enabled=False)
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_gradient_divide_factor(1.0)
        else:
            apply_ddp(model, mesh["dp"], enable_compile=False, enable_compiled_autograd=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
        dp = mesh["dp"]
        n, r = dp.size(), dp.get_local_rank()
        losses, grads = [], None
        for tokens, labels in _batches():
            per = BATCH // n
            opt.zero_grad()
            loss = _step_loss(model, tokens[r * per : (r + 1) * per], labels[r * per : (r + 1) * per], tokens.numel())
            loss.backward()
            losses.append(dp.comm.all_reduce(loss.detach(), "sum", dp.group(0)).item())
            grads = grads or {k: _full(p.grad) for k, p in model.named_parameters()}
            opt.step()
        return {"losses": losses, "grads": grads, "params": {k: _full(p).detach() for k, p in model.named_parameters()}}
    finally:
        so.set_strict(False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.vector_norm((a - b).double()) / torch.linalg.vector_norm(b.double()).clamp_min(1e-30)).item()


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["fsdp4", "dp2xtp2"])
def test_apply_fsdp_trains_as_single_device(mesh_shape):
    ref = _single()
    for ours in so.run(_rank, 4, mesh_shape, "fsdp", timeout=600):
        assert ours["losses"] == pytest.approx(ref["losses"], rel=TOL)
        for name, g in ref["grads"].items():
            assert _rel(ours["grads"][name], g) <= TOL, name
        for name, p in ref["params"].items():
            assert _rel(ours["params"][name], p) <= TOL, name


def test_apply_ddp_averages_once_more_as_torch():
    """DDP's average on top of a loss already divided by the global token count: 1/dp of the gradients."""
    ref = _single()
    for ours in so.run(_rank, 4, (4,), "ddp", timeout=600):
        assert ours["losses"][0] == pytest.approx(ref["losses"][0], rel=TOL)
        for name, g in ref["grads"].items():
            assert _rel(ours["grads"][name] * 4, g) <= TOL, name
