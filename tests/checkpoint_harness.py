"""Shared by the checkpoint tests: a small Llama/GPT-2 trained by shardops (any mesh) or by
torch DTensor's own tensor parallelism (gloo processes), one optimizer step at a time."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import shardops as so
from parallel_harness import global_loss
from shardops.fsdp import fully_shard, replicate
from shardops.models import GPT2, Llama, ModelArgs, gpt2_plan, llama_plan

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, hidden_dim=48, max_seq_len=16)
BATCH = 4


def batch(step: int, args: ModelArgs = ARGS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, args.vocab_size, (BATCH, args.max_seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def shardops_model(
    mesh_shape: tuple[int, ...],
    seed: int = 0,
    kind: str = "llama",
    dp_mode: str = "replicate",
    args: ModelArgs = ARGS,
    invariant_dropout: bool = False,
) -> tuple[Any, Any, int]:
    """(model, mesh, dp rank): tensor parallel over 'tp', data parallel over 'dp' on a 2-d mesh
    (`replicate`, or `fully_shard` per block and the root: each rank then feeds its batch slice).

    `invariant_dropout`: the demo's plan (training/config.py), which keeps the tensors dropout reads
    as DTensors, so the masks are those of the global tensor on any mesh; otherwise the plain plan,
    where dropout reads local shards (each rank's mask depends on its shard's shape)."""
    names = ("dp", "tp") if len(mesh_shape) == 2 else ("tp",)
    mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = (Llama if kind == "llama" else GPT2)(args, seed=seed)
    if invariant_dropout:
        from shardops.training.config import RunSpec
        from shardops.training.config import plan as demo_plan

        plan = demo_plan(RunSpec(model=kind, cfg=args), so.parallel)
    else:
        plan = (llama_plan if kind == "llama" else gpt2_plan)()
    so.parallel.parallelize_module(model, mesh["tp"] if len(mesh_shape) == 2 else mesh, plan)
    if len(mesh_shape) == 2:  # torch-style data parallelism on mesh["dp"] (torchtitan's apply_ddp / apply_fsdp)
        if dp_mode == "replicate":
            replicate(model, device_mesh=mesh["dp"])
        else:
            blocks = model.get_submodule("layers" if kind == "llama" else "h")
            for layer in blocks.children():
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
    return model, mesh, (mesh.own_coordinate()[0] if len(mesh_shape) == 2 else 0)


def shardops_step(model: Any, opt: Any, step: int, dp: int = 1, dp_rank: int = 0) -> float:
    """One training step on the global batch; returns the loss before the update."""
    inputs, targets = batch(step)
    rows = BATCH // dp
    inputs, targets = inputs[dp_rank * rows : (dp_rank + 1) * rows], targets[dp_rank * rows : (dp_rank + 1) * rows]
    with so.parallel.loss_parallel():
        logits = model(inputs)
        if isinstance(logits, so.DTensor):  # this rank's target beside logits on mesh["tp"], said explicitly
            targets = so.from_local(targets, logits.device_mesh, [so.Replicate()] * logits.device_mesh.ndim)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if dp > 1:  # this dp rank's batch mean: the whole batch's loss is their average (even slices)
        return global_loss(loss, logits.device_mesh.root_mesh, dp)
    value = loss.full_tensor() if isinstance(loss, so.DTensor) else loss
    return value.item()


def torch_model(seed: int = 0, kind: str = "llama", args: ModelArgs = ARGS) -> Any:
    """torch's own tensor parallelism of the same model on a (world,) torch DeviceMesh (gloo processes)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import parallel as tp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = (Llama if kind == "llama" else GPT2)(args, seed=seed)
    tp.parallelize_module(model, mesh, (llama_plan if kind == "llama" else gpt2_plan)(api=tp))
    return model


def torch_step(model: Any, opt: Any, step: int) -> float:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    inputs, targets = batch(step)
    with loss_parallel():
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(0, 1))
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()


def full(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, so.DTensor):
        return t.full_tensor()
    if hasattr(t, "full_tensor"):
        return t.full_tensor()
    return t


DROPOUT_ARGS = ModelArgs(**{**ARGS.__dict__, "dropout": 0.1})


def train_and_checkpoint(
    path: str,
    steps: range,
    load: bool,
    save_after: int | None,
    mesh_shape=(2, 2),
    with_rng: bool = True,
    args: ModelArgs = DROPOUT_ARGS,
    invariant_dropout: bool = False,
):
    """GPT-2 (dropout per `args`) on one rank of any world; returns (losses,
    the step the extra dict held after loading)."""
    model, mesh, dp_rank = shardops_model(
        mesh_shape, seed=0, kind="gpt2", args=args, invariant_dropout=invariant_dropout
    )
    dp = mesh.shape[0] if len(mesh_shape) == 2 else 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(5)
    extra = {"step": 0}
    state = {"model": model, "optim": opt, "extra": extra}
    if with_rng:
        state["rng"] = so.checkpoint.RandomState()
    if load:
        so.checkpoint.load(state, path)
    loaded_step = extra["step"]
    losses = []
    for s in steps:
        losses.append(shardops_step(model, opt, s, dp=dp, dp_rank=dp_rank))
        extra["step"] = s + 1
        if save_after == s:
            so.checkpoint.save(state, path)
    return losses, loaded_step
