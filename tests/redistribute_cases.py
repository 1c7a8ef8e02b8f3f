"""Random redistribution cases shared by the threads-world and gloo tests."""

import math
import random

import torch

import shardops as so
from shardops.redistribute import plan, plan_bytes

PARTIALS = [so.Partial(op) for op in ("sum", "avg", "max", "min", "product")]


def random_placement(rng: random.Random, ndim: int, source: bool):
    opts: list[so.Placement] = [so.Replicate()]
    if ndim:
        opts += [so.Shard(d) for d in range(ndim)] * 2 + [so.StridedShard(d, rng.choice([2, 3])) for d in range(ndim)]
    if source:
        opts += PARTIALS + [so.NormPartial(rng.choice([1, 2, 3, math.inf]))]
    else:
        opts += PARTIALS[:4]
    return rng.choice(opts)


def make_source(full: torch.Tensor, mesh, placements, rng_seed: int):
    """A DTensor whose true value is `full`, with Partial/NormPartial values split unevenly between ranks."""
    coord = mesh.get_coordinate()
    replicated = [so.Replicate() if p.is_partial() else p for p in placements]
    dt = so.distribute_tensor(full, mesh, replicated)
    local = dt.to_local().clone()
    gen = torch.Generator().manual_seed(rng_seed)
    for i, p in enumerate(placements):
        n, c = mesh.shape[i], coord[i]
        if n == 1 or not p.is_partial():
            continue
        local = _split_partial(local, p, n, c, gen)
    return so.DTensor.from_local(local, mesh, placements, shape=full.shape)


def bytes_per_case(seed: int, mesh_shape, count: int) -> list[int]:
    log: list[int] = []
    run_cases(seed, mesh_shape, count, log)
    return log


def _split_partial(x, p, n, c, gen):
    # Same random draws on every rank (same generator seed), so parts are consistent.
    if isinstance(p, so.NormPartial):
        q = p.norm_type
        if math.isinf(q):  # the true value on coordinate 0, smaller values elsewhere
            return x.abs() if c == 0 else x.abs() * 0.5
        w = torch.rand((n,) + tuple(x.shape), generator=gen, dtype=x.dtype) + 0.1
        w = w / w.pow(q).sum(0).pow(1 / q)
        return x.abs() * w[c]
    op = p.reduce_op
    if op == "sum":
        w = torch.randn((n,) + tuple(x.shape), generator=gen, dtype=x.dtype)
        w = w - w.mean(0) + 1.0 / n  # parts sum to 1, signs vary
        return x * w[c]
    if op == "avg":
        w = torch.randn((n,) + tuple(x.shape), generator=gen, dtype=x.dtype)
        w = w - w.mean(0) + 1.0
        return x * w[c]
    if op == "product":
        w = torch.rand((n,) + tuple(x.shape), generator=gen, dtype=x.dtype) + 0.5
        w[-1] = 1 / w[:-1].prod(0)
        return (x if c == 0 else torch.ones_like(x)) * w[c]
    gap = torch.rand((n,) + tuple(x.shape), generator=gen, dtype=x.dtype) + 0.1
    owner = torch.randint(0, n, tuple(x.shape), generator=gen)
    delta = torch.where(owner == c, torch.zeros_like(x), gap[c])
    return x - delta if op == "max" else x + delta


def run_cases(seed: int, mesh_shape, count: int, byte_log: list | None = None):
    """Run `count` random triples on this rank; return the failures (empty list when all pass).

    `byte_log`, if given, receives the bytes CommDebugMode counted for each case.
    """
    mesh = so.init_device_mesh("cpu", mesh_shape)
    rng = random.Random(seed)
    failures = []
    for t in range(count):
        ndim = rng.randint(0, 3)
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 7, 8]) for _ in range(ndim))
        full = torch.randn(shape, generator=torch.Generator().manual_seed(seed * 7919 + t), dtype=torch.float64)
        src = tuple(random_placement(rng, ndim, True) for _ in mesh_shape)
        kinds = [p for p in src if p.is_partial()]
        src = tuple(kinds[0] if p.is_partial() else p for p in src)  # mixed pending kinds are refused (as torch)
        dst = tuple(random_placement(rng, ndim, False) for _ in mesh_shape)
        kinds = [p for p in dst if p.is_partial()]
        dst = tuple(kinds[0] if p.is_partial() else p for p in dst)
        if any(isinstance(p, so.NormPartial) for p in src):
            full = full.abs()
        x = make_source(full, mesh, src, seed * 31 + t)
        expected_bytes = plan_bytes(x._spec, plan(x._spec, dst), mesh.own_coordinate())
        with so.CommDebugMode() as comm:
            y = x.redistribute(placements=dst)
        if byte_log is not None:
            byte_log.append(comm.get_total_bytes())
        got = y.full_tensor()
        want = so.distribute_tensor(full, mesh, [so.Replicate() if p.is_partial() else p for p in dst]).to_local()
        mine = y.to_local()
        ok_full = torch.allclose(got, full, rtol=1e-9, atol=1e-9)
        if any(p.is_partial() for p in dst):  # a Partial target: check the local is a valid share via full only
            ok_local = tuple(mine.shape) == tuple(want.shape)
        else:
            ok_local = torch.allclose(mine, want, rtol=1e-9, atol=1e-9)
        if not (ok_full and ok_local and comm.get_total_bytes() == expected_bytes):
            failures.append(
                f"shape={shape} {list(src)}->{list(dst)} full={ok_full} local={ok_local} "
                f"bytes={comm.get_total_bytes()} plan={expected_bytes}"
            )
    return failures
