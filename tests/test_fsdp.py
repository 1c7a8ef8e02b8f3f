"""shardops.fsdp: fully_shard (FSDP2) and replicate (composable DDP) against single-device torch.

The models are tiny and run in the threads world (one gloo test at the end). Every reference
is single-device training computed here from the same initial weights on the global batch;
each data-parallel rank trains on its slice of that batch with a rank-local mean loss.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardops as so
from shardops import DTensor, Shard, StridedShard
from shardops.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, replicate
from shardops.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

TOL = 1e-5
DIM, HIDDEN, OUT, BATCH, STEPS = 8, 20, 3, 8, 3  # HIDDEN=20 over 4 ranks: uneven dim-0 shards in w1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.relu(self.w1(self.norm(x))))


class Model(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(5, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.out = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _model(seed: int = 0) -> Model:
    torch.manual_seed(seed)
    return Model()


def _data(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, OUT, generator=g)) for _ in range(steps)]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def _reference(steps: int = STEPS, lr: float = 1e-2) -> dict:
    """Single-device AdamW on the global batch: every step's loss, the first step's gradients, the final parameters."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-5)
    losses, grads = [], None
    for x, y in _data(steps):
        opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        losses.append(loss.item())
        if grads is None:
            grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        opt.step()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _full(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None, "no gradient"
    return t.full_tensor() if isinstance(t, DTensor) else t


def _whole(t: Any) -> torch.Tensor:
    """A DTensor's full tensor: torch's or shardops' (the side-by-side runs use both)."""
    return t.full_tensor()


def _batch_slice(mesh: so.DeviceMesh, dp_dim: str | None, x: torch.Tensor) -> torch.Tensor:
    n, r = (mesh[dp_dim].size(), mesh[dp_dim].get_local_rank()) if dp_dim else (mesh.size(), mesh.get_rank())
    per = x.shape[0] // n
    return x[r * per : (r + 1) * per]


def _train(model: nn.Module, mesh: so.DeviceMesh, dp_dim: str | None, steps: int = STEPS, lr: float = 1e-2) -> dict:
    """Each rank's run: losses averaged over dp (the global batch's loss), first gradients, final parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-5)
    dp_size = (mesh[dp_dim] if dp_dim else mesh).size()
    losses, grads = [], None
    for x, y in _data(steps):
        opt.zero_grad()
        loss = _loss(model, _batch_slice(mesh, dp_dim, x), _batch_slice(mesh, dp_dim, y))
        loss.backward()
        losses.append(loss.detach())
        if grads is None:
            grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
    group = mesh.group((mesh.mesh_dim_names or ()).index(dp_dim) if dp_dim else tuple(range(mesh.ndim)))
    local_losses = mesh.comm.all_gather(torch.stack(losses), group)
    return {
        "losses": (sum(local_losses, torch.zeros(())) / dp_size).tolist(),
        "grads": grads,
        "params": {n: _full(p).detach() for n, p in model.named_parameters()},
    }


def _check(ours: dict, ref: dict) -> None:
    assert ours["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL)
    assert set(ours["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        torch.testing.assert_close(ours["grads"][name], g, rtol=TOL, atol=TOL, msg=name)
    for name, p in ref["params"].items():
        torch.testing.assert_close(ours["params"][name], p, rtol=TOL, atol=TOL, msg=name)


def _shard_blocks(model: Model, **kwargs) -> Model:
    for block in model.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def _tp_plan(model: Model, tp_mesh: so.DeviceMesh) -> None:
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})


# ------------------------------------------------------------------ equal to single-device training


def _fsdp_rank(reshard_after_forward):
    mesh = so.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = _shard_blocks(_model(), mesh=mesh, reshard_after_forward=reshard_after_forward)
    assert isinstance(model, FSDPModule) and type(model).__name__ == "FSDPModel"
    return _train(model, mesh, "dp")


@pytest.mark.parametrize("reshard_after_forward", [None, True, False])
def test_fully_shard_trains_as_single_device(strict, reshard_after_forward):
    ref = _reference()
    for ours in so.run(_fsdp_rank, 4, reshard_after_forward):
        _check(ours, ref)


def _fsdp_tp_rank():
    mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model()
    _tp_plan(model, mesh["tp"])
    model = _shard_blocks(model, mesh=mesh["dp"])
    w1 = model.blocks[0].w1.weight
    # stored on the (dp, tp) mesh: FSDP's dim-0 chunks of the tp shard (strided), tp's Shard(0)
    layout = (
        w1.device_mesh.mesh_dim_names,
        w1.placements,
        model.blocks[0].w2.weight.placements,
        model.blocks[0].norm.weight.placements,
    )
    return _train(model, mesh, "dp"), layout


def test_fully_shard_with_tensor_parallel_trains_as_single_device(strict):
    ref = _reference()
    for ours, layout in so.run(_fsdp_tp_rank, 4):
        _check(ours, ref)
        assert layout == (("dp", "tp"), (StridedShard(0, 2), Shard(0)), (Shard(0), Shard(1)), (Shard(0),))


def _hsdp_rank():
    mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _shard_blocks(_model(), mesh=mesh)
    x, y = (_batch_slice(mesh, None, t) for t in _data(1)[0])
    with so.CommDebugMode() as comm:
        _loss(model, x, y).backward()
    model.zero_grad()
    return comm.get_comm_counts(), model.blocks[0].w1.weight.placements, _train(model, mesh, None)


def test_hsdp_trains_as_single_device(strict):
    """HSDP: sharded over the mesh's last dim, replicated over its first; per unit one gather over
    the shard dim, one reduce_scatter over it and one all_reduce over the replicate dim."""
    ref = _reference()
    for counts, placements, ours in so.run(_hsdp_rank, 4):
        assert placements == (so.Replicate(), Shard(0))
        assert counts == {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 3}
        _check(ours, ref)


# ------------------------------------------------------------------ collectives per step, exact


def _unit_params(model: Model) -> dict[str, list[torch.Tensor]]:
    """The units' original parameters (before sharding), by unit: each block, then the root's own."""
    units: dict[str, list[torch.Tensor]] = {f"blocks.{i}": list(b.parameters()) for i, b in enumerate(model.blocks)}
    units["root"] = [*model.inp.parameters(), *model.out.parameters()]
    return units


def _gather_bytes(params: list[torch.Tensor], d: int, member: int, itemsize: int = 4) -> int:
    """This member's own dim-0 chunks (torch.chunk's cut: trailing members may get none), unpadded."""
    chunks = [torch.chunk(torch.empty(p.shape), d) for p in params]
    return sum(c[member].numel() if member < len(c) else 0 for c in chunks) * itemsize


def _padded_bytes(params: list[torch.Tensor], d: int, itemsize: int = 4) -> int:
    """FSDP2's padded per-rank shard: ceil(dim0 / d) rows of every parameter."""
    return sum(math.ceil(p.shape[0] / d) * (p.numel() // p.shape[0]) for p in params) * itemsize


def _counting_rank(reshard_after_forward, param_dtype):
    mesh = so.init_device_mesh("cpu", (4,))
    model = _model()
    units = _unit_params(model)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    model = _shard_blocks(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = (_batch_slice(mesh, None, t) for t in _data(1)[0])
    with so.CommDebugMode() as fwd:
        loss = _loss(model, x, y)
    with so.CommDebugMode() as bwd:
        loss.backward()
    with so.CommDebugMode() as step:
        opt.step()
    return (
        mesh.get_rank(),
        units,
        (fwd.log, fwd.get_wire_bytes()),
        (bwd.log, bwd.get_wire_bytes()),
        step.get_total_counts(),
    )


@pytest.mark.parametrize("reshard_after_forward", [None, True, False])
def test_collectives_per_step_exact(strict, reshard_after_forward):
    """Per unit: one all_gather in forward, one in backward when it resharded (the root keeps its
    parameters by default), one reduce_scatter during backward; bytes from the units' sizes."""
    for rank, units, (fwd, fwd_wire), (bwd, bwd_wire), step_counts in so.run(
        _counting_rank, 4, reshard_after_forward, None
    ):
        d = 4
        order = ["root", "blocks.0", "blocks.1"]  # forward order of the units' gathers
        assert fwd == [("all_gather", _gather_bytes(units[u], d, rank)) for u in order]
        assert fwd_wire == sum(_padded_bytes(units[u], d) for u in order)
        regather = {
            "root": reshard_after_forward is True,
            "blocks.0": reshard_after_forward is not False,
            "blocks.1": reshard_after_forward is not False,
        }
        expected = []
        for u in ["blocks.1", "blocks.0"]:  # backward: gather (if resharded), then its reduce_scatter, unit by unit
            if regather[u]:
                expected.append(("all_gather", _gather_bytes(units[u], d, rank)))
            expected.append(("reduce_scatter", sum(p.numel() for p in units[u]) * 4))
        # the root's inputs are data: its reduce_scatter runs at the end of backward, before backward() returns
        # (its backward gather, if any, comes first, when its outputs' gradient arrives)
        root = [("reduce_scatter", sum(p.numel() for p in units["root"]) * 4)]
        if regather["root"]:
            expected.insert(0, ("all_gather", _gather_bytes(units["root"], d, rank)))
        assert bwd == expected + root
        padded_rs = sum(d * _padded_bytes(units[u], d) for u in order)
        assert bwd_wire == padded_rs + sum(_padded_bytes(units[u], d) for u in order if regather[u])
        assert step_counts == 0  # nothing left for the optimizer step


def _prefetch_rank():
    """Explicit prefetching (torchtitan's forward and backward chains): whether the next block's
    gather is started and not yet waited for while the current block computes, the step's
    collectives, and training."""
    from shardops.fsdp._state import unit_of

    mesh = so.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = _shard_blocks(_model(), mesh=mesh)
    b0, b1 = model.blocks
    model.set_modules_to_forward_prefetch([b0])
    b0.set_modules_to_forward_prefetch([b1])
    b1.set_modules_to_backward_prefetch([b0])
    in_flight = []

    def record(unit):
        return lambda *_: in_flight.append(unit.gathering is not None and not unit.gathering.is_completed())

    b0.norm.register_forward_hook(record(unit_of(b1)))  # b0 computes while b1's gather travels
    b1.w2.register_full_backward_hook(record(unit_of(b0)))  # b1's backward computes while b0's travels
    x, y = (_batch_slice(mesh, "dp", t) for t in _data(1)[0])
    with so.CommDebugMode() as comm:
        _loss(model, x, y).backward()
    model.zero_grad(set_to_none=True)
    return in_flight[:2], sorted(comm.log), _train(model, mesh, "dp")


def test_explicit_prefetch_trains_the_same_with_the_same_collectives(strict):
    ref = _reference()
    plain = {r: sorted(f + b) for r, _, (f, _), (b, _), _ in so.run(_counting_rank, 4, None, None)}
    for rank, (in_flight, log, ours) in enumerate(so.run(_prefetch_rank, 4)):
        assert in_flight == [False, False]  # the threads world completes a gather when it starts
        assert log == plain[rank]
        _check(ours, ref)


def test_mixed_precision_gathers_half_the_bytes(strict):
    full = {r: (f, b) for r, _, f, b, _ in so.run(_counting_rank, 4, None, None)}
    half = {r: (f, b) for r, _, f, b, _ in so.run(_counting_rank, 4, None, torch.bfloat16)}
    for rank in range(4):
        (f32_fwd, _), (f32_bwd, _) = full[rank]
        (bf16_fwd, _), (bf16_bwd, _) = half[rank]
        assert [(k, n // 2) for k, n in f32_fwd] == bf16_fwd
        # gathers halve, reductions stay float32 (reduce_dtype)
        assert [(k, n // 2 if k == "all_gather" else n) for k, n in f32_bwd] == bf16_bwd


def _mp_rank():
    mesh = so.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _shard_blocks(_model(), mesh=mesh, mp_policy=mp)
    out = _train(model, mesh, "dp")
    return out, model.blocks[0].w1.weight.dtype, model.blocks[0].w1.weight.grad.dtype


def test_mixed_precision_trains_close_to_float32(strict):
    ref = _reference()
    for ours, param_dtype, grad_dtype in so.run(_mp_rank, 4):
        assert param_dtype == grad_dtype == torch.float32  # the sharded parameters keep their dtype
        assert ours["losses"] == pytest.approx(ref["losses"], rel=2e-2, abs=2e-2)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(ours["grads"][name], g, rtol=5e-2, atol=2e-2, msg=name)


# ------------------------------------------------------------------ gradient accumulation without sync


def _accumulation_rank(k):
    mesh = so.init_device_mesh("cpu", (4,))
    model = _shard_blocks(_model(), mesh=mesh)
    x, y = (_batch_slice(mesh, None, t) for t in _data(1)[0])
    micro = x.shape[0] // k
    sent = []
    for i in range(k):
        last = i == k - 1
        model.set_requires_gradient_sync(last)
        with so.CommDebugMode() as comm:
            loss = _loss(model, x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]) / k
            loss.backward()
        sent.append(comm.get_comm_counts().get("reduce_scatter", 0))
        if not last:
            assert all(p.grad is None for p in model.parameters())  # nothing reduced yet
    return sent, {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def test_unsynced_micro_batches_accumulate_to_the_big_batch_gradient(strict):
    ref = _reference(steps=1)["grads"]
    for sent, grads in so.run(_accumulation_rank, 4, 2):
        assert sent == [0, 3]  # no reduction for the unsynced micro-batch; one per unit for the synced one
        for name, g in ref.items():
            torch.testing.assert_close(grads[name], g, rtol=TOL, atol=TOL, msg=name)


def _forwards_then_backwards_rank(reshard_after_forward, k):
    """k micro-batches: every forward first, then every backward (a pipeline stage's GPipe order)."""
    mesh = so.init_device_mesh("cpu", (4,))
    model = _shard_blocks(_model(), mesh=mesh, reshard_after_forward=reshard_after_forward)
    x, y = (_batch_slice(mesh, None, t) for t in _data(1)[0])
    micro = x.shape[0] // k
    losses = [_loss(model, x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]) / k for i in range(k)]
    for loss in losses:
        loss.backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_several_forwards_before_their_backwards_reduce_every_gradient(strict, reshard_after_forward):
    ref = _reference(steps=1)["grads"]
    for grads in so.run(_forwards_then_backwards_rank, 4, reshard_after_forward, 2):
        for name, g in ref.items():
            torch.testing.assert_close(grads[name], g, rtol=TOL, atol=TOL, msg=name)


# ------------------------------------------------------------------ replicate (composable DDP)


def _replicate_rank(bucket_cap_mb):
    mesh = so.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = replicate(
        _model(seed=mesh.get_rank()), device_mesh=mesh, bucket_cap_mb=bucket_cap_mb
    )  # rank 0's weights win
    x, y = (_batch_slice(mesh, "dp", t) for t in _data(1)[0])
    with so.CommDebugMode() as bwd:
        _loss(model, x, y).backward()
    return bwd.log, _train(model, mesh, "dp")


@pytest.mark.parametrize("cap", ["25MB", "half", "1B"])
def test_replicate_trains_as_single_device_with_bucketed_all_reduces(strict, cap):
    """⌈Ψ·4 B / cap⌉ all_reduces during backward (a 1-byte cap: one per parameter), Ψ·4 bytes."""
    params = list(_model().parameters())
    psi_bytes = sum(p.numel() for p in params) * 4
    cap_mb, buckets = {"25MB": (25, 1), "half": (psi_bytes / 2 / 2**20, 2), "1B": (1 / 2**20, len(params))}[cap]
    ref = _reference()
    for log, ours in so.run(_replicate_rank, 4, cap_mb):
        assert [k for k, _ in log] == ["all_reduce"] * buckets
        assert sum(n for _, n in log) == psi_bytes
        _check(ours, ref)


def _replicate_overlap_rank():
    """One bucket per parameter: how many buckets' all_reduces are started and not yet waited for
    when the first layer's gradient is computed (backward goes on while they travel)."""
    from shardops.fsdp.replicate import STATE_ATTR

    mesh = so.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = replicate(_model(seed=mesh.get_rank()), device_mesh=mesh, bucket_cap_mb=1 / 2**20)
    buckets = model.__dict__[STATE_ATTR].buckets
    in_flight = []
    model.inp.weight.register_hook(
        lambda g: in_flight.append(sum(b.work is not None and not b.work.is_completed() for b in buckets))
    )
    x, y = (_batch_slice(mesh, "dp", t) for t in _data(1)[0])
    with so.CommDebugMode() as bwd:
        _loss(model, x, y).backward()
    return in_flight[0], bwd.log, _train(model, mesh, "dp")


def test_replicate_syncs_parameters_from_the_first_rank(strict):
    def rank():
        mesh = so.init_device_mesh("cpu", (4,))
        model = replicate(_model(seed=mesh.get_rank()), device_mesh=mesh)
        return {n: p.detach() for n, p in model.named_parameters()}

    first, *others = so.run(rank, 4)
    expected = dict(_model(seed=0).named_parameters())
    for params in [first, *others]:
        for name, p in params.items():
            torch.testing.assert_close(p, expected[name].detach())


# -------------------------------------------------------- models whose ops have no DTensor rule: activations stay local


class Attention(nn.Module):
    """nn.MultiheadAttention reads self.out_proj.weight directly, not through the child's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, DIM))
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(x, x, x, need_weights=False)[0]
        return self.head(h + self.mlp(h)).mean(1)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(DIM, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x)).mean(1)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, stride=2)
        self.head = nn.Linear(4 * 3 * 3, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.conv1(x)), 1)
        return self.head(F.relu(self.conv2(h)).flatten(1))


MODELS = {"attention": (Attention, (6, DIM)), "encoder": (Encoder, (6, DIM)), "cnn": (CNN, (2, 7, 7))}


def _inputs(kind: str, steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(BATCH, *MODELS[kind][1], generator=g), torch.randn(BATCH, OUT, generator=g)) for _ in range(steps)
    ]


def _single(kind: str) -> dict:
    torch.manual_seed(0)
    model = MODELS[kind][0]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    for x, y in _inputs(kind):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _local_activations_rank(kind: str, how: str, mesh_shape: tuple[int, ...]):
    names = ("dp", "tp")[: len(mesh_shape)]
    mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = MODELS[kind][0]()
    if len(mesh_shape) == 2:  # the MLP tensor-parallel, the attention outside the plan
        parallelize_module(model.get_submodule("mlp"), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if how == "fully_shard":
        fully_shard(model, mesh=mesh["dp"])
    else:
        replicate(model, device_mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    kinds = set()
    for x, y in _inputs(kind):
        opt.zero_grad()
        with so.CommDebugMode() as comm:
            F.mse_loss(model(_batch_slice(mesh, "dp", x)), _batch_slice(mesh, "dp", y)).backward()
        kinds |= {k for k, _ in comm.log}
        opt.step()
    return kinds, {n: _full(p).detach() for n, p in model.named_parameters()}


# replicate is torch's composable DDP: pure data parallelism, so (2, 2) only under fully_shard
@pytest.mark.parametrize(
    "kind, mesh_shape, how",
    [(k, (4,), h) for k in MODELS for h in ("fully_shard", "replicate")] + [("attention", (2, 2), "fully_shard")],
)
def test_activations_stay_local(strict, kind, mesh_shape, how):
    """Only the parameters' collectives run (0 activation bytes: no op of the model meets a
    DTensor, so conv and attention need no DTensor rule); training equals single-device."""
    ref = _single(kind)
    allowed = {"all_gather", "reduce_scatter"} if how == "fully_shard" else {"all_reduce"}
    if len(mesh_shape) == 2:
        allowed |= {"all_reduce"}  # the row-parallel layer's own tp all_reduce
    for kinds, params in so.run(_local_activations_rank, 4, kind, how, mesh_shape):
        assert kinds <= allowed
        for name, p in ref.items():
            torch.testing.assert_close(params[name], p, rtol=TOL, atol=TOL, msg=name)


# ------------------------------------------------------------------ torch.distributed (gloo) world


def _side_by_side(torch_side: bool, param_dtype, steps: int = 5) -> dict:
    """This process's run of the same model and batches under torch's fully_shard or shardops':
    every step's global loss and gradients, the final parameters, the forward's all_gather bytes."""
    Policy: Any  # torch's or shardops' (likewise below)
    shard: Any
    mesh: Any
    if torch_side:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy as Policy
        from torch.distributed.fsdp import fully_shard as shard

        mesh = init_device_mesh("cpu", (4,))
        rank, comm = mesh.get_rank(), None
    else:
        Policy, shard = MixedPrecisionPolicy, fully_shard
        mesh = so.init_device_mesh("cpu", (4,))
        rank = mesh.get_rank()
    model = _model()
    mp = Policy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        shard(block, mesh=mesh, mp_policy=mp)
    shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    losses, grads, gathered = [], [], 0
    for x, y in _data(steps):
        opt.zero_grad()
        per = BATCH // 4
        with so.CommDebugMode() as comm:
            loss = _loss(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        gathered = sum(n for k, n in comm.log if k == "all_gather")
        loss.backward()
        total = loss.detach().float().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / 4)
        grads.append({n: _whole(p.grad) for n, p in model.named_parameters()})
        opt.step()
    return {
        "losses": losses,
        "grads": grads,
        "params": {n: _whole(p).detach() for n, p in model.named_parameters()},
        "gathered": gathered,
    }


def _gloo_rank():
    so.set_strict(True)
    replicated = _replicate_overlap_rank()
    prefetched = _prefetch_rank()
    pure = _fsdp_rank(None)
    _, _, fwd, bwd, _ = _counting_rank(None, None)
    dp_tp, layout = _fsdp_tp_rank()
    runs = {
        (side, str(dtype)): _side_by_side(side == "torch", dtype)
        for side in ("torch", "shardops")
        for dtype in (None, torch.bfloat16)
    }
    return pure, fwd, bwd, dp_tp, layout, runs, replicated, prefetched


def test_fully_shard_and_replicate_in_gloo_processes_and_beside_torch_fully_shard():
    """The same programs in 4 gloo processes: training equals single-device, the collective log
    (logical and wire bytes) equals the threads world's; replicate's bucket all_reduces and
    fully_shard's explicit prefetches travel while computation goes on; beside torch's own fully_shard on the same
    model and batches, 5 AdamW steps: float32 equal within 1e-5 (losses, every step's gradients,
    parameters), bf16 parameters with float32 reduction within 1e-3 (losses) and 2e-2
    (gradients), gathering half of float32's bytes."""
    from mp import run_gloo

    ref = _reference()
    params = list(_model().parameters())
    threads = {r: (f, b) for r, _, f, b, _ in so.run(_counting_rank, 4, None, None)}
    for in_flight, log, _ in so.run(_replicate_overlap_rank, 4):
        assert in_flight == 0  # the threads world completes each all_reduce when it starts
        assert [k for k, _ in log] == ["all_reduce"] * len(params) and sum(n for _, n in log) == sum(
            p.numel() for p in params
        ) * 4
    for rank, (pure, fwd, bwd, dp_tp, layout, runs, replicated, prefetched) in enumerate(
        run_gloo(_gloo_rank, 4, timeout=600)
    ):
        in_flight, prefetch_log, prefetch_run = prefetched
        assert in_flight == [True, True]  # explicit prefetches travel while the current block computes
        assert prefetch_log == sorted(fwd[0] + bwd[0])  # the same collectives, started earlier
        _check(prefetch_run, ref)
        in_flight, replicate_log, replicate_run = replicated
        # replicate: every bucket but the first layer's two still travelling while its backward runs
        assert in_flight >= len(params) - 2
        assert replicate_log == log  # one all_reduce per bucket, Ψ·4 bytes in all, as in the threads world
        _check(replicate_run, ref)
        _check(pure, ref)
        _check(dp_tp, ref)
        assert (fwd, bwd) == threads[rank]
        assert layout[1] == (StridedShard(0, 2), Shard(0))
        for dtype, tol in (("None", (1e-5, 1e-5)), ("torch.bfloat16", (1e-3, 2e-2))):
            theirs, ours = runs[("torch", dtype)], runs[("shardops", dtype)]
            assert ours["losses"] == pytest.approx(theirs["losses"], rel=tol[0], abs=tol[0])
            for step, (g_ours, g_theirs) in enumerate(zip(ours["grads"], theirs["grads"])):
                for name, g in g_theirs.items():
                    torch.testing.assert_close(g_ours[name], g, rtol=tol[1], atol=tol[1], msg=f"step {step} {name}")
            if dtype == "None":
                for name, p in theirs["params"].items():
                    torch.testing.assert_close(ours["params"][name], p, rtol=1e-5, atol=1e-5, msg=name)
        assert runs[("shardops", "torch.bfloat16")]["gathered"] * 2 == runs[("shardops", "None")]["gathered"]


# ------------------------------------------------------------------ state dicts


def _state_dict_rank(path: str):
    mesh = so.init_device_mesh("cpu", (4,))
    model = _shard_blocks(_model(), mesh=mesh)
    sd = model.state_dict()
    layouts = {k: (type(v).__name__, v.placements) for k, v in sd.items()}
    _train(model, mesh, None, steps=1)
    so.checkpoint.save({"model": model}, path)
    trained = {k: v.full_tensor() for k, v in model.state_dict().items()}
    fresh = _shard_blocks(_model(seed=5), mesh=mesh)
    so.checkpoint.load({"model": fresh}, path)
    loaded = {k: v.full_tensor() for k, v in fresh.state_dict().items()}
    return layouts, trained, loaded


def test_state_dict_is_sharded_under_the_original_names(tmp_path):
    names = set(_model().state_dict())
    for layouts, trained, loaded in so.run(_state_dict_rank, 4, str(tmp_path / "ckpt")):
        assert set(layouts) == names
        assert set(layouts.values()) == {("DTensor", (Shard(0),))}
        for k in names:
            torch.testing.assert_close(loaded[k], trained[k], rtol=0, atol=0)


def _sharded_model(torch_side: bool, seed: int, tp: bool):
    """The test model under torch's fully_shard or shardops', with its AdamW: pure FSDP on (4,), or
    (dp=2, tp=2) with the blocks' MLPs tensor-parallel (torch's StridedShard layout on both sides)."""
    init_device_mesh: Any  # torch's or shardops' (likewise below)
    shard: Any
    Col: Any
    Row: Any
    parallelize: Any
    if torch_side:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel as Col,
        )
        from torch.distributed.tensor.parallel import (
            RowwiseParallel as Row,
        )
        from torch.distributed.tensor.parallel import (
            parallelize_module as parallelize,
        )
    else:
        init_device_mesh, shard, Col, Row, parallelize = (
            so.init_device_mesh,
            fully_shard,
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
    mesh = init_device_mesh("cpu", (2, 2) if tp else (4,), mesh_dim_names=("dp", "tp") if tp else ("dp",))
    model = _model(seed)
    if tp:
        for block in model.blocks:
            parallelize(block, mesh["tp"], {"w1": Col(), "w2": Row()})
    for block in model.blocks:
        shard(block, mesh=mesh["dp"])
    shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, tp: bool) -> None:
    dp, rank = (2, torch.distributed.get_rank() // 2) if tp else (4, torch.distributed.get_rank())
    per = BATCH // dp
    opt.zero_grad()
    _loss(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
    opt.step()


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Full parameters and full AdamW state by parameter name (either side's DTensors)."""

    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    params = {n: whole(p) for n, p in model.named_parameters()}
    state = {n: {k: whole(v) for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    return {"params": params, "optim": state}


def _save(model: nn.Module, opt: torch.optim.Optimizer, how: str, path: str) -> None:
    if how == "shardops":
        so.checkpoint.save({"model": model, "optim": opt}, path)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)


def _load(model: nn.Module, opt: torch.optim.Optimizer, how: str, path: str) -> None:
    if how == "shardops":
        so.checkpoint.load({"model": model, "optim": opt}, path)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state: dict[str, Any] = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


# (saved by, saved with, loaded by, loaded with, tensor parallel): torch's DCP both ways, and
# shardops.checkpoint's files (DCP's format) read by torch and torch's read by shardops.checkpoint
INTEROP = [
    ("torch", "dcp", "shardops", "dcp", False),
    ("torch", "dcp", "shardops", "shardops", False),
    ("shardops", "dcp", "torch", "dcp", False),
    ("shardops", "shardops", "torch", "dcp", False),
    ("torch", "dcp", "shardops", "shardops", True),
    ("shardops", "shardops", "torch", "dcp", True),
]


def _interop_rank(root: str):
    """Each case: the saver trains a step and saves model and AdamW state; a fresh model of the
    other side (other initial weights) loads it; both then train two more steps."""
    data = _data(3)
    out = []
    for i, (saver, saved_with, loader, loaded_with, tp) in enumerate(INTEROP):
        path = f"{root}/{i}"
        src, src_opt = _sharded_model(saver == "torch", 0, tp)
        _step(src, src_opt, *data[0], tp)
        _save(src, src_opt, saved_with, path)
        saved = _snapshot(src, src_opt)
        dst, dst_opt = _sharded_model(loader == "torch", 5, tp)
        _load(dst, dst_opt, loaded_with, path)
        loaded = _snapshot(dst, dst_opt)
        kinds = {type(p).__module__.split(".")[0] for p in dst.parameters()}
        layout = [type(p).__name__.lstrip("_") for p in dst.blocks[0].w1.weight.placements]
        for x, y in data[1:]:
            _step(src, src_opt, x, y, tp)
            _step(dst, dst_opt, x, y, tp)
        out.append((saved, loaded, kinds, layout, _snapshot(src, src_opt)["params"], _snapshot(dst, dst_opt)["params"]))
    return out


def test_checkpoints_interoperate_with_torch_fully_shard(tmp_path):
    """torch fully_shard -> shardops fully_shard and back, 4 gloo processes, model and AdamW state:
    through torch's DCP (get/set_model_state_dict, get/set_optimizer_state_dict) and through
    shardops.checkpoint. The loaded parameters and optimizer state equal the saver's exactly, and
    two more steps on each side stay equal (1e-5)."""
    from mp import run_gloo

    names = set(dict(_model().named_parameters()))
    for rank_cases in run_gloo(_interop_rank, 4, str(tmp_path), timeout=600):
        for (saver, saved_with, loader, loaded_with, tp), (saved, loaded, kinds, layout, src_after, dst_after) in zip(
            INTEROP, rank_cases
        ):
            case = f"{saver} {saved_with} -> {loader} {loaded_with}" + (" (dp=2, tp=2)" if tp else "")
            assert kinds == {"shardops" if loader == "shardops" else "torch"}, case
            assert layout == (["StridedShard", "Shard"] if tp else ["Shard"]), case
            assert set(saved["params"]) == set(loaded["params"]) == names, case
            for name, p in saved["params"].items():
                torch.testing.assert_close(loaded["params"][name], p, rtol=0, atol=0, msg=f"{case}: {name}")
                assert set(loaded["optim"][name]) == set(saved["optim"][name]) == {"step", "exp_avg", "exp_avg_sq"}, (
                    case
                )
                for key, v in saved["optim"][name].items():
                    torch.testing.assert_close(
                        loaded["optim"][name][key], v, rtol=0, atol=0, msg=f"{case}: {name} {key}"
                    )
            for name, p in src_after.items():
                torch.testing.assert_close(
                    dst_after[name], p, rtol=TOL, atol=TOL, msg=f"{case}: {name} after two more steps"
                )


# ------------------------------------------------------------------ memory (gloo processes)

MEM_WIDTH, MEM_LAYERS = 256, 6


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(MEM_WIDTH, MEM_WIDTH), nn.ReLU(), nn.Linear(MEM_WIDTH, MEM_WIDTH))
            for _ in range(MEM_LAYERS)
        )
        self.head = nn.Linear(MEM_WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _peak_tracked_bytes(prof) -> int:
    """The peak of live tensor storage allocated inside the profiled block (the CPU allocator's events)."""
    live = peak = 0
    for _, n in sorted((e.start_ns(), e.nbytes()) for e in prof.kineto_results.events() if e.name() == "[memory]"):
        live += n
        peak = max(peak, live)
    return peak


def _memory_rank(torch_side: bool) -> int:
    """Peak memory a forward + backward allocates beyond the resident sharded parameters and
    optimizer state (every unit resharding after forward). The least of 10 steps: the CPU
    profiler records the allocator's events of this thread only, and a collective's buffers
    are now and then freed on gloo's thread (when its work object goes), which then reads as
    held to the end, on either side."""
    shard: Any  # torch's or shardops'
    mesh: Any
    from torch.autograd.profiler import profile

    if torch_side:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as shard

        mesh = init_device_mesh("cpu", (4,))
    else:
        shard, mesh = fully_shard, so.init_device_mesh("cpu", (4,))
    model = _Residual()
    for layer in model.layers:
        shard(layer, mesh=mesh, reshard_after_forward=True)
    shard(model, mesh=mesh, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, peaks = torch.randn(2, MEM_WIDTH), []
    for step in range(12):  # 10 measured: a loaded machine makes gloo's thread free buffers more often
        opt.zero_grad(set_to_none=True)
        with profile(profile_memory=True, enabled=step >= 2) as prof:
            F.mse_loss(model(x), torch.zeros(2, 4)).backward()
        if step >= 2:
            peaks.append(_peak_tracked_bytes(prof))
        opt.step()
    return min(peaks)


def _memory_both() -> tuple[int, int]:
    return _memory_rank(True), _memory_rank(False)


def test_peak_memory_per_rank_within_fsdp_bound_and_torch(capsys):
    """Sharded gradients (Ψ/d) plus one gathered unit and its reduction's buffers;
    never more than torch's fully_shard."""
    from mp import run_gloo

    model = _Residual()
    psi = sum(p.numel() for p in model.parameters()) * 4
    unit = sum(p.numel() for p in model.layers[0].parameters()) * 4
    for theirs, ours in run_gloo(_memory_both, 4, timeout=600):
        with capsys.disabled():
            print(
                f"\npeak tracked bytes per rank: shardops {ours}, torch fully_shard {theirs} (Ψ/d {psi // 4}, unit "
                f"{unit})"
            )
        assert ours <= theirs
        assert ours <= psi // 4 + 4 * unit


# ------------------------------------------------------------------ defaults and user errors


def _defaults_and_errors_rank():
    mesh = so.init_device_mesh("cpu", (4,))
    default = _shard_blocks(_model())  # mesh=None: every rank
    errors = {}

    def expect(name, fn):
        try:
            fn()
        except so.ShardingError as e:
            errors[name] = str(e)

    expect("twice", lambda: fully_shard(default.blocks[0], mesh=mesh))
    expect("replicate a fully_shard model", lambda: replicate(default))
    expect("reshard to a smaller world", lambda: fully_shard(_model(), mesh=mesh, reshard_after_forward=2))
    mixed = _model()
    mixed.out.double()
    expect("mixed dtypes", lambda: fully_shard(mixed, mesh=mesh))
    expect("unknown keyword", lambda: replicate(_model(), bucket_cap=3))
    tied = _model()
    tied.blocks[1].w1.weight = tied.blocks[0].w1.weight
    fully_shard(tied.blocks[0], mesh=mesh)
    expect("shared between units", lambda: fully_shard(tied.blocks[1], mesh=mesh))
    layout = (default.blocks[0].w1.weight.device_mesh.shape, default.blocks[0].w1.weight.placements)
    return layout, errors, _train(default, mesh, None, steps=1)


def test_defaults_and_user_errors(strict):
    ref = _reference(steps=1)
    for layout, errors, ours in so.run(_defaults_and_errors_rank, 4):
        assert layout == ((4,), (Shard(0),))
        _check(ours, ref)
        assert set(errors) == {
            "twice",
            "replicate a fully_shard model",
            "reshard to a smaller world",
            "mixed dtypes",
            "unknown keyword",
            "shared between units",
        }
        assert "already fully sharded" in errors["twice"]
        assert "reshard_after_forward=2" in errors["reshard to a smaller world"]
        assert "torch.float64" in errors["mixed dtypes"] and "param_dtype" in errors["mixed dtypes"]
        assert "bucket_cap" in errors["unknown keyword"]
        assert "tied weights" in errors["shared between units"]


def _grouped_rank():
    mesh = so.init_device_mesh("cpu", (4,))
    model = _model()
    units = _unit_params(model)
    fully_shard(list(model.blocks), mesh=mesh)  # one unit over both blocks
    fully_shard(model, mesh=mesh)
    x, y = (_batch_slice(mesh, None, t) for t in _data(1)[0])
    with so.CommDebugMode() as comm:
        _loss(model, x, y).backward()
    model.zero_grad()
    blocks = units["blocks.0"] + units["blocks.1"]
    return comm.log, mesh.get_rank(), blocks, units["root"], _train(model, mesh, None)


def test_a_unit_over_several_modules(strict):
    """fully_shard([block0, block1]): one gather in forward, one in backward,
    one reduce_scatter of both blocks' gradients."""
    ref = _reference()
    for log, rank, blocks, root, ours in so.run(_grouped_rank, 4):
        assert log == [
            ("all_gather", _gather_bytes(root, 4, rank)),
            ("all_gather", _gather_bytes(blocks, 4, rank)),
            ("all_gather", _gather_bytes(blocks, 4, rank)),
            ("reduce_scatter", sum(p.numel() for p in blocks) * 4),
            ("reduce_scatter", sum(p.numel() for p in root) * 4),
        ]
        _check(ours, ref)


def _unshard_reshard_rank():
    mesh = so.init_device_mesh("cpu", (4,))
    model = _shard_blocks(_model(), mesh=mesh)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    model.unshard()
    # (cloned: reshard frees the unsharded storage, as torch's does)
    root_gathered = {
        n: (type(p), p.detach().clone()) for n, p in model.named_parameters() if not n.startswith("blocks")
    }
    block_kinds = {type(p).__name__ for n, p in model.named_parameters() if n.startswith("blocks")}
    model.reshard()
    kinds_after = {type(p).__name__ for p in model.parameters()}
    seq = fully_shard(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), mesh=mesh)
    return full, root_gathered, block_kinds, kinds_after, type(seq[0:1]).__name__


def test_unshard_and_reshard():
    full_model = dict(_model().named_parameters())
    for full, root_gathered, block_kinds, kinds_after, sliced in so.run(_unshard_reshard_rank, 4):
        for name, (kind, p) in root_gathered.items():  # the root's own parameters, gathered as plain tensors
            assert kind is nn.Parameter
            torch.testing.assert_close(p, full_model[name].detach(), rtol=0, atol=0)
        assert block_kinds == {"DTensor"}  # other units untouched
        assert kinds_after == {"DTensor"}
        assert sliced == "Sequential"  # an FSDP container constructing itself makes the plain class, as torch
        for name, p in full.items():
            torch.testing.assert_close(p, full_model[name].detach(), rtol=0, atol=0)


# ---------------------------------------------- torch.compile per block (torchtitan's order: compile, then fully_shard)


def _compiled_rank(compiled: bool):
    mesh = so.init_device_mesh("cpu", (4,))
    model = _model()
    if compiled:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, fullgraph=True)  # type: ignore[assignment]  # a module's compile is a module
    model = _shard_blocks(model, mesh=mesh)
    logs = []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    for x, y in _data(2):
        opt.zero_grad()
        with so.CommDebugMode() as comm:
            _loss(model, _batch_slice(mesh, None, x), _batch_slice(mesh, None, y)).backward()
        logs.append(comm.log)
        opt.step()
    params = {n.replace("._orig_mod", ""): _full(p).detach() for n, p in model.named_parameters()}
    return logs, params


def test_compiled_blocks_send_eagers_bytes_and_train_the_same(strict):
    torch._dynamo.reset()  # this test's compiles start from no earlier test's cache entries or recompile counts
    ref = _reference(steps=2)["params"]
    # Four rank threads compile their own blocks' one code object: 4 x 2 entries, dynamo's whole default
    # limit. shardops scales the limit per rank thread when a DTensor reaches dynamo; under fully_shard the
    # blocks see plain tensors only, so this test scales it itself (the rank threads copy this context).
    limits = {"recompile_limit": 8 * 4, "accumulated_recompile_limit": 256 * 4}
    with torch._dynamo.config.patch(**limits):
        compiled = so.run(_compiled_rank, 4, True, timeout=600)
    for (eager_logs, _), (compiled_logs, params) in zip(so.run(_compiled_rank, 4, False), compiled):
        assert compiled_logs == eager_logs
        for name, p in ref.items():
            torch.testing.assert_close(params[name], p, rtol=TOL, atol=TOL, msg=name)


# ------------------------------------------------------------------ the benchmark beside torch's data parallelism


def test_benchmark_sends_what_torch_sends():
    """benchmarks/fsdp.py at a tiny size, the sides interleaved in the same 2 gloo processes: per step and rank,
    shardops fully_shard's wire bytes equal torch fully_shard's padded all_gather + reduce_scatter inputs,
    and replicate's all_reduce bytes equal DDP's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.fsdp import SIZES, measure_fsdp, table

    measured = measure_fsdp(SIZES["tiny"], world=2)
    sides = measured["sides"]
    assert sides["shardops fully_shard"]["bytes"] == sides["torch fully_shard"]["bytes"] > 0
    assert sides["shardops fully_shard + prefetch"]["bytes"] == sides["torch fully_shard"]["bytes"]
    assert sides["shardops replicate"]["bytes"] == sides["torch DDP"]["bytes"] == 4 * measured["params"]
    assert all(len(r["s"]) == SIZES["tiny"]["steps"] and r["peak"] > 0 for r in sides.values())
    assert "shardops replicate / torch DDP" in table(measured)
