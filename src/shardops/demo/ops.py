"""`shardops demo --ops`: sharded math ops of a transformer step on a (2,2) mesh, checked against torch.

    shardops demo --ops                # threads world, 4 ranks in this process
    torchrun --nproc-per-node 4 -m shardops.demo --ops   # the same under torch.distributed (gloo)
    shardops demo --ops --device cuda  # tensors on the GPU (under torchrun: nccl, one GPU per rank)

For each op: the input/output layouts, the collectives shardops issued, the bytes this
rank sent and the rounds. Every output and gradient is compared with single-device
torch; the exit code is 1 on any mismatch. The comparison with torch's DTensor (its
default path and its best one, e.g. loss_parallel), measured on the same layouts, is
`shardops bench` (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import shardops as so
from shardops import Replicate, Shard

# Sizes: big enough that the sharded algorithms matter, small enough for 2 cores in seconds.
B, S, H, HEADS, V, K = 4, 32, 256, 8, 4096, 5
IGNORE = -100


@dataclass
class Row:
    op: str
    layouts: str
    counts: dict
    nbytes: int
    rounds: int
    ok: bool
    detail: str = ""


@dataclass
class Step:
    name: str
    run: Callable[[Any], Row]
    notes: list = field(default_factory=list)


def _close(a: torch.Tensor, b: torch.Tensor, rtol=2e-5, atol_scale=2e-6) -> bool:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()  # the check, not the op: host copies are fine
    if a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    atol = atol_scale * max(b.abs().max().item(), 1e-30)
    return bool(torch.allclose(a, b, rtol=rtol, atol=atol))


def _fmt(placements) -> str:
    return "[" + ",".join(map(repr, placements)) + "]"


def _measure(fn):
    with so.CommDebugMode() as comm:
        out = fn()
    return out, comm


def _data(device: str):
    g = torch.Generator().manual_seed(1234)
    data = {
        "x": torch.randn(B, S, H, generator=g),
        "w": 1 + 0.1 * torch.randn(H, generator=g),
        "scores": 4 * torch.randn(B, HEADS, S, S, generator=g),
        "logits": 3 * torch.randn(B * S, V, generator=g),
        "target": torch.randint(0, V, (B * S,), generator=g),
        "gy": torch.randn(B, S, H, generator=g),
        "gp": torch.randn(B, HEADS, S, S, generator=g),
    }
    data["target"][::7] = IGNORE
    return {name: t.to(device) for name, t in data.items()}


def _leaf(full, mesh, placements):
    return so.distribute_tensor(full, mesh, placements, src_data_rank=None).requires_grad_()


def step_rms_norm(mesh, d) -> Row:
    pl = [Shard(1), Shard(2)]  # sequence on "sp", hidden on "tp"
    x = _leaf(d["x"], mesh, pl)
    w = _leaf(d["w"], mesh, [Replicate(), Replicate()])
    gy = so.distribute_tensor(d["gy"], mesh, pl, src_data_rank=None)

    def fwd_bwd():
        y = F.rms_norm(x, (H,), w, eps=1e-6)
        y.backward(gy)
        return y

    y, comm = _measure(fwd_bwd)
    xr, wr = d["x"].clone().requires_grad_(), d["w"].clone().requires_grad_()
    yr = F.rms_norm(xr, (H,), wr, eps=1e-6)
    yr.backward(d["gy"])
    ok = _close(y.full_tensor(), yr) and _close(x.grad.full_tensor(), xr.grad) and _close(w.grad.full_tensor(), wr.grad)
    return Row(
        "rms_norm fwd+bwd",
        f"x{_fmt(pl)} w[R,R] -> y{_fmt(y.placements)}",
        comm.get_comm_counts(),
        comm.get_total_bytes(),
        comm.get_rounds(),
        ok,
    )


def step_softmax(mesh, d) -> Row:
    pl = [Shard(1), Shard(3)]  # heads on "sp", keys on "tp"
    s = _leaf(d["scores"], mesh, pl)
    gp = so.distribute_tensor(d["gp"], mesh, pl, src_data_rank=None)

    def fwd_bwd():
        p = torch.softmax(s, dim=-1)
        p.backward(gp)
        return p

    p, comm = _measure(fwd_bwd)
    sr = d["scores"].clone().requires_grad_()
    pr = torch.softmax(sr, dim=-1)
    pr.backward(d["gp"])
    ok = _close(p.full_tensor(), pr) and _close(s.grad.full_tensor(), sr.grad)
    return Row(
        "attention softmax fwd+bwd",
        f"scores{_fmt(pl)} -> {_fmt(p.placements)}",
        comm.get_comm_counts(),
        comm.get_total_bytes(),
        comm.get_rounds(),
        ok,
    )


def step_cross_entropy(mesh, d) -> Row:
    pl = [Shard(0), Shard(1)]  # tokens on "sp", vocabulary on "tp"
    logits = _leaf(d["logits"], mesh, pl)
    target = so.distribute_tensor(d["target"], mesh, [Shard(0), Replicate()], src_data_rank=None)

    def fwd_bwd():
        loss = F.cross_entropy(logits, target, ignore_index=IGNORE)
        loss.backward()
        return loss.full_tensor()

    loss, comm = _measure(fwd_bwd)
    lr = d["logits"].clone().requires_grad_()
    ref = F.cross_entropy(lr, d["target"], ignore_index=IGNORE)
    ref.backward()
    ok = _close(loss, ref) and _close(logits.grad.full_tensor(), lr.grad)
    return Row(
        "vocab-parallel cross_entropy fwd+bwd",
        f"logits{_fmt(pl)} target[S(0),R] -> grad{_fmt(logits.grad.placements)}",
        comm.get_comm_counts(),
        comm.get_total_bytes(),
        comm.get_rounds(),
        ok,
    )


def step_statistics(mesh, d) -> Row:
    pl = [Shard(1), Shard(2)]
    x = so.distribute_tensor(d["x"], mesh, pl, src_data_rank=None)

    def stats():
        return x.mean(dim=-1).full_tensor(), x.var(dim=-1).full_tensor()

    (mean, var), comm = _measure(stats)
    ok = _close(mean, d["x"].mean(-1)) and _close(var, d["x"].var(-1))
    return Row(
        "activation mean/var over hidden",
        f"x{_fmt(pl)} -> [R,R]",
        comm.get_comm_counts(),
        comm.get_total_bytes(),
        comm.get_rounds(),
        ok,
    )


def step_topk(mesh, d) -> Row:
    pl = [Shard(0), Shard(1)]
    logits = so.distribute_tensor(d["logits"], mesh, pl, src_data_rank=None)

    def sample():
        values, indices = torch.topk(logits, K, dim=-1)
        return values.full_tensor(), indices.full_tensor()

    (values, indices), comm = _measure(sample)
    rv, ri = torch.topk(d["logits"], K, dim=-1)
    ok = _close(values, rv) and torch.equal(indices, ri)
    return Row(
        f"top-{K} sampling over vocabulary",
        f"logits{_fmt(pl)} -> [R,R]",
        comm.get_comm_counts(),
        comm.get_total_bytes(),
        comm.get_rounds(),
        ok,
    )


def step_clip(mesh, d) -> Row:
    g = torch.Generator().manual_seed(99)
    shapes: list[tuple[tuple[int, ...], list[so.Placement]]] = [
        ((H, H), [Shard(0), Shard(1)]),
        ((H,), [Replicate(), Shard(0)]),
        ((V, H), [Shard(1), Shard(0)]),
        ((H, 4 * H), [Replicate(), Shard(1)]),
    ]
    fulls = [torch.randn(s, generator=g).to(d["x"].device) for s, _ in shapes]
    params = []
    for full, (_, pl) in zip(fulls, shapes):
        p = so.distribute_tensor(torch.zeros_like(full), mesh, pl, src_data_rank=None).requires_grad_()
        p.grad = so.distribute_tensor(full, mesh, pl, src_data_rank=None)
        params.append(p)

    def clip():
        return torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)

    total, comm = _measure(clip)
    # NOTE: the reference runs in float64: over a million float32 elements torch's own float32
    # norm is off by ~1e-5 relative, more than the sharded one (per-shard norms, then combined).
    refs = [torch.zeros_like(f, dtype=torch.float64).requires_grad_() for f in fulls]
    for r, f in zip(refs, fulls):
        r.grad = f.double()
    ref_total = torch.nn.utils.clip_grad_norm_(refs, max_norm=1.0)
    total_full = total.full_tensor() if isinstance(total, so.DTensor) else total
    ok = _close(total_full, ref_total, rtol=1e-5) and all(
        isinstance(p.grad, so.DTensor) and r.grad is not None and _close(p.grad.full_tensor(), r.grad, rtol=1e-5)
        for p, r in zip(params, refs)
    )
    return Row(
        "clip_grad_norm_ (4 params, mixed layouts)",
        "grads [S,S]/[R,S]/[S,S]/[R,S] -> clipped in place",
        comm.get_comm_counts(),
        comm.get_total_bytes(),
        comm.get_rounds(),
        ok,
    )


STEPS = [step_rms_norm, step_softmax, step_cross_entropy, step_statistics, step_topk, step_clip]


def rank_main(device: str = "cpu") -> list[Row]:
    mesh = so.init_device_mesh(device, (2, 2), mesh_dim_names=("sp", "tp"))
    d = _data(device)
    rows = []
    for step in STEPS:
        try:
            rows.append(step(mesh, d))
        except Exception as e:  # noqa: BLE001 - reported as a failed row, exit code 1
            rows.append(Row(step.__name__.removeprefix("step_"), "", {}, 0, 0, False, f"{type(e).__name__}: {e}"))
    return rows


def print_table(rows: list[Row], world: str, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"shardops demo — transformer step slice on a (2,2) mesh ({world}), rank 0")
    for col in ("op", "layouts", "collectives", "bytes/rank", "rounds", "check"):
        table.add_column(col, justify="right" if col in ("bytes/rank", "rounds") else "left")
    for r in rows:
        colls = ", ".join(f"{k}×{v}" for k, v in sorted(r.counts.items())) or "none"
        check = "[green]exact[/]" if r.ok else f"[red]MISMATCH[/] {r.detail}"
        table.add_row(r.op, r.layouts, colls, f"{r.nbytes:,}", str(r.rounds), check)
    console = Console(width=max(160, Console().width))
    console.print(table)
    console.print(
        f"total bytes sent by rank 0: {sum(r.nbytes for r in rows):,}; {seconds:.1f} s. "
        "DTensor on the same layouts (default and best path): `shardops bench`, docs/benchmarks.md"
    )


def parse_device(argv: list[str] | None) -> str:
    import argparse

    p = argparse.ArgumentParser(prog="shardops demo --ops")
    p.add_argument("--device", default="cpu", help="where the tensors live: cpu (default) or cuda")
    device = p.parse_args(argv or []).device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"shardops demo --device cuda: no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is "
            "False)"
        )
    return device


def main(argv: list[str] | None = None) -> int:
    device = parse_device(argv)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return _torchrun_main(device)
    start = time.perf_counter()
    rows = so.run(rank_main, 4, device, timeout=120)
    print_table(rows[0], f"threads world, 4 ranks, {device}", time.perf_counter() - start)
    ok = all(r.ok for ranks in rows for r in ranks)
    print("all outputs and gradients match single-device torch" if ok else "MISMATCH: see the table")
    return 0 if ok else 1


def _torchrun_main(device: str) -> int:
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # On CUDA: nccl for the tensors, gloo for shardops' host metadata (shapes, seeds) and the verdict below.
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")
    start = time.perf_counter()
    try:
        rows = rank_main(device)
        ok = torch.tensor([float(all(r.ok for r in rows))])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if dist.get_rank() == 0:
            print_table(
                rows,
                f"torch.distributed {dist.get_backend()}, {dist.get_world_size()} processes, {device}",
                time.perf_counter() - start,
            )
            print("all outputs and gradients match single-device torch" if ok.item() else "MISMATCH: see the table")
        dist.barrier()  # every rank past its last collective before any tears gloo down
        return 0 if ok.item() else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
