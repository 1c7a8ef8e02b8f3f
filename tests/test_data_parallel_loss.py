"""data_parallel gives the gradient of the global-batch loss in both loss forms (SGD, so a
gradient scaled by the data-parallel size shows at once; AdamW would hide it):

- a rank-local mean loss (plain tensors: use_local_output=True, or `out.to_local()`) is
  averaged over the data-parallel ranks, as torch's DDP and FSDP do;
- a DTensor loss is already the global loss and is not divided again, also when the user
  assembles it from the ranks' local sums as a Partial DTensor (`from_local(..., [Partial()])`).
"""

import copy

import pytest
import torch
import torch.nn as nn

import shardops as so
from parallel_harness import strict
from shardops import Partial, Replicate, Shard
from shardops.parallel import ColwiseParallel, RowwiseParallel, data_parallel, parallelize_module

STEPS, LR = 3, 0.1


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


def _reference(model, x, target):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _mse(model(x), target)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


# loss form -> (plan or None: data parallel only, how the loss is taken from the model's output)
FORMS = {
    # use_local_output=True: the output is this rank's batch shard, the loss a rank-local mean
    "local": ({"w1": ColwiseParallel(), "w2": RowwiseParallel()}, "plain"),
    # use_local_output=False: the output is a DTensor, the loss the global mean
    "dtensor": ({"w1": ColwiseParallel(), "w2": RowwiseParallel(use_local_output=False)}, "dtensor"),
    # the output is a DTensor but the user takes its local shard: a rank-local mean again
    "to_local": ({"w1": ColwiseParallel(), "w2": RowwiseParallel(use_local_output=False)}, "to_local"),
    # no plan (every mesh dim is data parallel): the same three ways in
    "no_plan_dtensor": (None, "dtensor"),
    "no_plan_to_local": (None, "to_local"),
    # the user sums this rank's squared errors and assembles the global mean as a Partial DTensor
    # over the batch's dims: a DTensor loss (the summands are distinct over dp, like batch shards)
    "partial_sum": ({"w1": ColwiseParallel(), "w2": RowwiseParallel(use_local_output=False)}, "partial_sum"),
    "no_plan_partial_sum": (None, "partial_sum"),
}


def _sharded(model, plan, how, mode, x, target):
    mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = copy.deepcopy(model)
    if plan is not None:
        parallelize_module(model, mesh["tp"], plan)
    data_parallel(model, mesh, mode)
    if plan is not None:  # the batch is split over dp only
        placements, shard = [Shard(0), Replicate()], x.chunk(2)[mesh.get_coordinate()[0]]
        local_target = target.chunk(2)[mesh.get_coordinate()[0]]
    else:  # over both mesh dims
        placements, shard = [Shard(0), Shard(0)], x.chunk(4)[mesh.get_rank()]
        local_target = target.chunk(4)[mesh.get_rank()]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        out = model(shard)
        if how == "dtensor":
            loss = _mse(out, so.from_local(local_target, mesh, placements))
            losses.append(loss.full_tensor().item())
        elif how == "partial_sum":
            local_sum = ((out.to_local() - local_target) ** 2).sum() / target.numel()
            loss = so.from_local(local_sum, mesh, [Partial() if p.is_shard() else Replicate() for p in placements])
            losses.append(loss.full_tensor().item())
        else:
            assert isinstance(out, so.DTensor) == (how == "to_local")
            loss = _mse(out.to_local() if how == "to_local" else out, local_target)
            losses.append(loss.item())
        loss.backward()
        opt.step()
    return losses, {n: p.detach().full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["replicate", "shard"])
@pytest.mark.parametrize("form", list(FORMS))
def test_sgd_training_equals_single_device(form, mode):
    x, target = _data()
    model = NormMLP()
    ref_losses, ref_params = _reference(model, x, target)
    plan, how = FORMS[form]
    with strict():
        results = so.run(_sharded, 4, model, plan, how, mode, x, target)
    for losses, params in results:
        if how in ("dtensor", "partial_sum"):  # the global loss; a rank-local loss is this rank's batch shard's
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5, (losses, ref_losses)
        for name, ref in ref_params.items():
            torch.testing.assert_close(
                params[name],
                ref,
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m: f"{form}/{mode} {name}: {m}",  # noqa: B023 - called within this iteration
            )


def test_local_loss_mean_over_ranks_is_the_global_loss():
    """The rank-local losses averaged over dp are the single-device loss (equal batch shards)."""
    x, target = _data()
    model = NormMLP()
    ref_losses, _ = _reference(model, x, target)
    plan, how = FORMS["local"]
    results = so.run(_sharded, 4, model, plan, how, "replicate", x, target)
    for step in range(STEPS):
        mean = sum(r[0][step] for r in results) / 4  # each dp shard's loss twice (two tp ranks)
        assert abs(mean - ref_losses[step]) <= 1e-5
