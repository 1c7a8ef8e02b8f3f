"""The device-sensitive checks, on the device `SHARDOPS_TEST_DEVICE` names (default: cuda).

`make test-gpu` runs them on CUDA (`pytest -m gpu`); `SHARDOPS_TEST_DEVICE=cpu pytest -m gpu
tests/test_gpu.py` runs the same checks on CPU. Every result is compared with single-device
torch on the same device, and every sharded result must live on that device:

- the threads world (`so.run`), tensors on the device: sharded algorithms (softmax,
  vocabulary-parallel cross-entropy, layer norm, cumsum, topk, var), redistribute, matmul,
  a tensor-parallel training step with AdamW, dropout, a checkpoint round trip;
- the torch.distributed world: one process per GPU over nccl (CPU tensors, such as the
  metadata shardops exchanges, go over gloo: backend "cpu:gloo,cuda:nccl"); on CPU, gloo.
"""

from __future__ import annotations

import datetime
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
import torch.nn as nn
import torch.nn.functional as F

import shardops as so
import shardops.checkpoint as ckpt
from shardops import Partial, Replicate, Shard
from shardops.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

DEVICE = os.environ.get("SHARDOPS_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def device_present():
    """Fail (not skip): `pytest -m gpu` on a machine without the device must not pass quietly."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.fail(
            "SHARDOPS_TEST_DEVICE=cuda but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); set SHARDOPS_TEST_DEVICE=cpu to run on CPU"
        )


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _check(out: so.DTensor | torch.Tensor, ref: torch.Tensor, **tol) -> None:
    full = out.full_tensor() if isinstance(out, so.DTensor) else out
    assert full.device.type == DEVICE, f"result on {full.device}, expected {DEVICE}"
    if isinstance(out, so.DTensor):
        assert out.to_local().device.type == DEVICE, f"local shard on {out.to_local().device}"
    torch.testing.assert_close(full, ref, **tol)


# ------------------------------------------------------------------ sharded algorithms, threads world


def _dist(t: torch.Tensor, mesh, placements, grad: bool = False) -> so.DTensor:
    d = so.distribute_tensor(t.detach(), mesh, placements)
    return d.requires_grad_() if grad else d


def test_distribute_tensor_places_the_shard_on_the_mesh_device():
    """As in torch: a CPU tensor distributed on a device mesh is moved to the mesh's device."""
    full = torch.arange(24.0).reshape(4, 6)

    def main():
        mesh = so.init_device_mesh(DEVICE, (2,))
        d = so.distribute_tensor(full, mesh, [Shard(1)])
        return d.to_local().device.type, d.full_tensor().cpu()

    for device_type, got in so.run(main, 2):
        assert device_type == DEVICE
        torch.testing.assert_close(got, full)


def test_softmax_and_its_gradient_on_a_sharded_dim():
    x, gy = _rand(6, 10, seed=1), _rand(6, 10, seed=2)
    xr = x.clone().requires_grad_()
    yr = torch.softmax(xr, dim=1)
    yr.backward(gy)

    def main():
        mesh = so.init_device_mesh(DEVICE, (4,))
        dx = _dist(x, mesh, [Shard(1)], grad=True)
        y = torch.softmax(dx, dim=1)
        y.backward(_dist(gy, mesh, [Shard(1)]))
        _check(y, yr.detach())
        _check(dx.grad, xr.grad)

    so.run(main, 4)


def test_cross_entropy_over_a_sharded_vocabulary():
    logits = _rand(12, 20, seed=3)
    target = torch.randint(0, 20, (12,), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    target[::5] = -100  # ignored positions
    lr = logits.clone().requires_grad_()
    ref = F.cross_entropy(lr, target)
    ref.backward()

    def main():
        mesh = so.init_device_mesh(DEVICE, (2, 2), mesh_dim_names=("dp", "tp"))
        dl = _dist(logits, mesh, [Shard(0), Shard(1)], grad=True)
        with loss_parallel():
            loss = F.cross_entropy(dl, target.chunk(2)[mesh.get_coordinate()[0]])
            loss.backward()
        _check(loss, ref.detach())
        _check(dl.grad, lr.grad)

    so.run(main, 4)


def test_layer_norm_over_a_sharded_hidden_dim():
    x, w, b = _rand(3, 5, 16, seed=5), _rand(16, seed=6), _rand(16, seed=7)
    xr = x.clone().requires_grad_()
    yr = F.layer_norm(xr, (16,), w, b)
    yr.sum().backward()

    def main():
        mesh = so.init_device_mesh(DEVICE, (4,))
        dx = _dist(x, mesh, [Shard(2)], grad=True)
        y = F.layer_norm(dx, (16,), _dist(w, mesh, [Replicate()]), _dist(b, mesh, [Replicate()]))
        y.sum().backward()
        _check(y, yr.detach(), atol=1e-5, rtol=1e-5)
        _check(dx.grad, xr.grad, atol=1e-5, rtol=1e-5)

    so.run(main, 4)


def test_cumsum_topk_var_along_a_sharded_dim():
    x = _rand(5, 13, seed=8)

    def main():
        mesh = so.init_device_mesh(DEVICE, (4,))
        dx = _dist(x, mesh, [Shard(1)])
        _check(torch.cumsum(dx, dim=1), torch.cumsum(x, dim=1), atol=1e-5, rtol=1e-5)
        values, indices = torch.topk(dx, 3, dim=1)
        ref_values, ref_indices = torch.topk(x, 3, dim=1)
        _check(values, ref_values)
        _check(indices, ref_indices)
        _check(torch.var(dx, dim=1), torch.var(x, dim=1), atol=1e-5, rtol=1e-5)
        _check(dx.var(), x.var(), atol=1e-5, rtol=1e-5)

    so.run(main, 4)


def test_ops_whose_indices_are_planned_on_the_host():
    """Index tensors built from the layout (re-index routes, GQA heads) and zero-dependent backwards, on the device."""
    x = _rand(6, 12, seed=12)
    z = x.clone()
    z[1, 2] = z[1, 9] = z[4, 5] = 0.0  # cumprod/prod backward with zeros; row 1 has two
    index = torch.tensor([11, 0, 5, 5, 3], device=DEVICE)
    q, k, v = _rand(2, 8, 6, 4, seed=13), _rand(2, 2, 6, 4, seed=14), _rand(2, 2, 6, 4, seed=15)

    def grads(fn, *inputs):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        out.sum().backward() if not isinstance(out, so.DTensor) else out.full_tensor().sum().backward()
        return out, [t.grad for t in leaves]

    def main():
        mesh = so.init_device_mesh(DEVICE, (4,))
        _check(torch.flip(_dist(x, mesh, [Shard(1)]), dims=[1]), torch.flip(x, dims=[1]))
        _check(torch.index_select(_dist(x, mesh, [Shard(1)]), 1, index), torch.index_select(x, 1, index))
        for fn in (lambda t: torch.cumprod(t, dim=1), lambda t: t.prod()):
            ref, (ref_grad,) = grads(fn, z)
            dz = _dist(z, mesh, [Shard(1)], grad=True)
            out = fn(dz)
            out.full_tensor().sum().backward()
            _check(out, ref.detach(), atol=1e-5, rtol=1e-5)
            _check(dz.grad, ref_grad, atol=1e-5, rtol=1e-5)
        # grouped-query attention, q heads sharded, K/V heads whole: each local q head picks its K/V head
        sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        ref, ref_grads = grads(sdpa, q, k, v)
        dq, dk, dv = (
            _dist(q, mesh, [Shard(1)], grad=True),
            _dist(k, mesh, [Replicate()], grad=True),
            _dist(v, mesh, [Replicate()], grad=True),
        )
        out = sdpa(dq, dk, dv)
        out.full_tensor().sum().backward()
        _check(out, ref.detach(), atol=1e-5, rtol=1e-5)
        for got, want in zip((dq.grad, dk.grad, dv.grad), ref_grads):
            _check(got, want, atol=1e-5, rtol=1e-5)

    so.run(main, 4)


def test_redistribute_between_layouts():
    x = _rand(7, 9, seed=9)

    def main():
        mesh = so.init_device_mesh(DEVICE, (2, 2))
        d = _dist(x, mesh, [Shard(0), Shard(1)])
        for placements in (
            [Shard(1), Shard(0)],
            [Replicate(), Shard(1)],
            [Replicate(), Replicate()],
            [Shard(0), Shard(0)],
        ):
            _check(d.redistribute(mesh, placements), x)
        # a pending sum: each rank holds x / 4
        pending = so.DTensor.from_local(x / 4, mesh, [Partial(), Partial()])
        _check(pending.redistribute(mesh, [Shard(0), Replicate()]), x, atol=1e-6, rtol=1e-6)

    so.run(main, 4)


def test_matmul_of_sharded_operands():
    a, b = _rand(8, 12, seed=10), _rand(12, 6, seed=11)

    def main():
        mesh = so.init_device_mesh(DEVICE, (2, 2))
        _check(
            _dist(a, mesh, [Shard(0), Replicate()]) @ _dist(b, mesh, [Replicate(), Shard(1)]),
            a @ b,
            atol=1e-5,
            rtol=1e-5,
        )
        _check(
            _dist(a, mesh, [Replicate(), Shard(1)]) @ _dist(b, mesh, [Replicate(), Shard(0)]),
            a @ b,
            atol=1e-5,
            rtol=1e-5,
        )

    so.run(main, 4)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def test_tensor_parallel_training_steps_with_adamw():
    torch.manual_seed(0)
    init = _MLP().to(DEVICE).state_dict()
    xs = [_rand(4, 8, seed=20 + i) for i in range(3)]

    ref = _MLP().to(DEVICE)
    ref.load_state_dict(init)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for x in xs:
        opt.zero_grad()
        (ref(x) ** 2).mean().backward()
        opt.step()

    def main():
        mesh = so.init_device_mesh(DEVICE, (4,))
        model = _MLP().to(DEVICE)
        model.load_state_dict(init)
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for x in xs:
            opt.zero_grad()
            (model(x) ** 2).mean().backward()
            opt.step()
        for name, p in model.named_parameters():
            # AdamW divides by the gradients' root mean square: a reduction order's last bit can move a step by more
            _check(p.detach(), dict(ref.named_parameters())[name].detach(), atol=1e-4, rtol=1e-4)

    so.run(main, 4)


def test_dropout_draws_the_same_mask_on_every_layout():
    """shardops' own generator: one seed gives one global mask, whatever the layout; dropout scales the kept values."""
    x = _rand(8, 12, seed=30) + 3.0  # no zeros: a zero in the output is a dropped value

    def draw(mesh_shape, placements, device=DEVICE):
        def main():
            mesh = so.init_device_mesh(device, mesh_shape)
            torch.manual_seed(7)
            y = F.dropout(_dist(x.to(device), mesh, placements), p=0.3)
            assert y.to_local().device.type == device
            return y.full_tensor()

        return so.run(main, math.prod(mesh_shape))[0]

    single = draw((1,), [Replicate()])
    kept = single != 0
    assert 0 < kept.sum() < kept.numel()
    torch.testing.assert_close(single[kept], x[kept] / 0.7)
    for mesh_shape, placements in (((2,), [Shard(0)]), ((2, 2), [Shard(1), Shard(0)])):
        torch.testing.assert_close(draw(mesh_shape, placements), single, atol=0, rtol=0)
    # the generator is integer arithmetic: the device draws the CPU's mask, bit for bit
    torch.testing.assert_close(draw((2,), [Shard(1)], "cpu").to(DEVICE) != 0, kept, atol=0, rtol=0)


def test_checkpoint_save_and_load_round_trip(tmp_path):
    w, v = _rand(6, 10, seed=40), _rand(9, seed=41)

    def save():
        mesh = so.init_device_mesh(DEVICE, (2, 2))
        ckpt.save(
            {"w": _dist(w, mesh, [Shard(0), Shard(1)]), "v": _dist(v, mesh, [Replicate(), Shard(0)]), "step": 3},
            str(tmp_path),
        )

    def load():
        mesh = so.init_device_mesh(DEVICE, (4,))
        state = {
            "w": _dist(torch.zeros_like(w), mesh, [Shard(1)]),
            "v": _dist(torch.zeros_like(v), mesh, [Replicate()]),
            "step": 0,
        }
        ckpt.load(state, str(tmp_path))
        _check(state["w"], w)
        _check(state["v"], v)
        assert state["step"] == 3

    so.run(save, 4)
    so.run(load, 4)


# ------------------------------------------------------------------ the torch.distributed world


def _dt(t: object) -> so.DTensor:
    assert isinstance(t, so.DTensor), type(t)  # an op on a DTensor (or its gradient) gives one
    return t


def _dist_world_program(device: str) -> dict[str, torch.Tensor]:
    """Each rank's results (moved to CPU to travel back): softmax, matmul, redistribute, a re-index, backward."""
    world = dist.get_world_size()
    mesh = so.init_device_mesh(device, (world,))
    x, w = _rand_on(device, 6, 2 * world + 1, seed=50), _rand_on(device, 2 * world + 1, 4, seed=51)
    dx = so.distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
    dw = so.distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    y = torch.softmax(dx, dim=1) @ dw  # the matmul's contraction dim is sharded: a pending sum
    y.sum().backward()
    assert dx.to_local().device.type == device and _dt(y).to_local().device.type == device
    return {
        "y": _dt(y).full_tensor().cpu(),
        "x_grad": _dt(dx.grad).full_tensor().cpu(),
        "w_grad": _dt(dw.grad).full_tensor().cpu(),
        "flip": _dt(torch.flip(dx.detach(), dims=[1])).full_tensor().cpu(),
        "cumsum": _dt(torch.cumsum(dx.detach(), dim=1)).redistribute(mesh, [Shard(0)]).full_tensor().cpu(),
    }


def _rand_on(device: str, *shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _dist_rank(rank: int, world: int, port: int, backend: str, device: str, out_dir: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        torch.save(_dist_world_program(device), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.device_count() < 2,
    reason=f"the nccl world needs 2 or more GPUs; this machine has {torch.cuda.device_count()}",
)
def test_torch_distributed_world(tmp_path):
    """nccl, one process per GPU, on CUDA; gloo with 2 processes on CPU."""
    if DEVICE == "cuda":
        world = torch.cuda.device_count()
        backend = "cpu:gloo,cuda:nccl"  # shardops' host metadata (shapes, seeds) travels as CPU tensors
    else:
        world, backend = 2, "gloo"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch_mp.spawn(_dist_rank, args=(world, port, backend, DEVICE, str(tmp_path)), nprocs=world, join=True)

    x, w = _rand_on(DEVICE, 6, 2 * world + 1, seed=50), _rand_on(DEVICE, 2 * world + 1, 4, seed=51)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    yr = torch.softmax(xr, dim=1) @ wr
    yr.sum().backward()
    expected = {
        "y": yr,
        "x_grad": xr.grad,
        "w_grad": wr.grad,
        "flip": torch.flip(x, dims=[1]),
        "cumsum": torch.cumsum(x, dim=1),
    }
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, ref in expected.items():
            torch.testing.assert_close(
                got[name],
                ref.detach().cpu(),
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m: f"rank {rank}, {name}: {m}",  # noqa: B023 - called within this iteration
            )
