"""The loss forms of torch's data parallelism under shardops' fully_shard and replicate, with SGD (a
gradient off by the data-parallel size shows at once; AdamW would hide it).

Each dp rank feeds its own batch slice and takes a rank-local mean loss, which fully_shard and
replicate average over dp (torch's DDP/FSDP2 convention): the same whether the model's output is
a plain tensor, a DTensor on the tp mesh (`use_local_output=False`: the loss is a DTensor, still
this rank's batch's), or that DTensor's `to_local()`. torchtitan's form, a sum over the rank's
elements divided by the global element count, equals single-device training under fully_shard
with the gradient divide factor 1 (a plain sum over dp), and gives 1/dp of its gradients under
replicate (torch's DDP averages once more). The reference is single-device SGD on the global batch.
"""

import copy

import pytest
import torch
import torch.nn as nn

import shardops as so
from parallel_harness import strict
from shardops import Replicate
from shardops.fsdp import fully_shard, replicate
from shardops.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

STEPS, LR, DP = 3, 0.1, 2


class NormMLP(nn.Module):
    """A norm the plan leaves alone (it computes on local tensors) before two planned linears."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(21)
        self.norm = nn.LayerNorm(16)
        self.w1 = nn.Linear(16, 24)
        self.w2 = nn.Linear(24, 16)

    def forward(self, x):
        return self.w2(torch.tanh(self.w1(self.norm(x))))


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _data():
    g = torch.Generator().manual_seed(22)
    return torch.randn(8, 5, 16, generator=g), torch.randn(8, 5, 16, generator=g)


def _reference(model, x, target, lr: float = LR):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _mse(model(x), target)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _plan(use_local_output: bool) -> dict:
    return {"w1": ColwiseParallel(), "w2": RowwiseParallel(use_local_output=use_local_output)}


# loss form -> (plan or None: data parallel only, how the loss is taken from the model's output)
FORMS = {
    "local": (_plan(True), "mean"),  # a plain output: the rank's batch mean
    "dtensor": (_plan(False), "mean"),  # a DTensor output on mesh["tp"]: the loss a DTensor, the rank's batch mean
    "to_local": (_plan(False), "to_local"),  # the DTensor output's local tensor
    "no_plan": (None, "mean"),  # data parallel over the whole mesh
    "global_sum": (_plan(True), "global_sum"),  # torchtitan's: the rank's sum / the global element count
    "no_plan_global_sum": (None, "global_sum"),
}


def _sharded(model, plan, how, mode, x, target):
    """One rank: (its losses, the final parameters, the dp size)."""
    shape, names = ((DP, 4 // DP), ("dp", "tp")) if plan is not None else ((4,), ("dp",))
    mesh = so.init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = copy.deepcopy(model)
    if plan is not None:
        parallelize_module(model, mesh["tp"], plan)
    dp_mesh = mesh["dp"]
    if mode == "fully_shard":
        fully_shard(model, mesh=dp_mesh)
        if how == "global_sum":
            model.set_gradient_divide_factor(1.0)  # torchtitan's: the loss is already divided globally
    else:
        replicate(model, device_mesh=dp_mesh)
    dp, r = dp_mesh.size(), dp_mesh.get_local_rank()
    rows, local_target = x.chunk(dp)[r], target.chunk(dp)[r]
    if how != "to_local" and plan is not None and not plan["w2"].use_local_output:
        local_target = so.DTensor.from_local(local_target, mesh["tp"], [Replicate()])  # the output's layout
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        out = model(rows)
        assert isinstance(out, so.DTensor) == (plan is not None and not plan["w2"].use_local_output)
        if how == "global_sum":
            loss = ((out - local_target) ** 2).sum() / target.numel()
        else:
            loss = _mse(out.to_local() if how == "to_local" else out, local_target)
        loss.backward()
        losses.append(loss.full_tensor().item() if isinstance(loss, so.DTensor) else loss.item())
        opt.step()
    params = {n: (p.full_tensor() if isinstance(p, so.DTensor) else p).detach() for n, p in model.named_parameters()}
    return losses, params, dp


@pytest.mark.parametrize("mode", ["fully_shard", "replicate"])
@pytest.mark.parametrize("form", list(FORMS))
def test_sgd_training_equals_single_device(form, mode):
    """Losses: the dp ranks' mean (a rank-local mean) or sum (torchtitan's form) is single-device's at
    every step; so are the parameters after 3 SGD steps, except torchtitan's form under replicate,
    whose gradients are 1/dp of single-device's (torch's DDP): its training is single-device SGD at lr/dp."""
    x, target = _data()
    model = NormMLP()
    plan, how = FORMS[form]
    ddp_global = how == "global_sum" and mode == "replicate"
    with strict():
        results = so.run(_sharded, 4, model, plan, how, mode, x, target)
    dp = results[0][2]
    ref_losses, ref_params = _reference(model, x, target, LR / dp if ddp_global else LR)
    per_dp_rank = 4 // dp  # each dp rank's losses appear once per tp rank
    for step in range(STEPS):
        total = sum(losses[step] for losses, _, _ in results) / per_dp_rank
        combined = total if how == "global_sum" else total / dp
        assert combined == pytest.approx(ref_losses[step], abs=1e-5), (step, combined, ref_losses[step])
    for _, params, _ in results:
        for name, ref in ref_params.items():
            torch.testing.assert_close(
                params[name],
                ref,
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m: f"{form}/{mode} {name}: {m}",  # noqa: B023 - called within this iteration
            )
