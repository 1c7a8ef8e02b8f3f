"""Random ops (ops/random.py, rng.py): layout-invariant draws, re-seeding, statistics, bytes, memory.

The values are not torch's single-device values (a different generator), so nothing
here compares with torch's draws. What is checked instead:
  - the generator's bits equal a scalar splitmix64 reference, and each rank's global
    indices equal a brute-force slice of arange (uneven, empty and strided shards);
  - one seed gives the identical global tensor under every mesh and layout (1-, 2- and
    4-rank meshes, a 2-D mesh), in strict mode, with 0 bytes, keeping self's layout;
  - torch.manual_seed(s) restarts the sequence (threads world and plain process);
  - distribution tests on 10^5 samples (KS for uniform/normal written here, chi-square
    for bernoulli/randint, moments, dropout fraction), so a broken generator fails;
  - a sharded dropout's largest local temporary stays within 2x the shard.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardops as so
from shardops import Partial, Replicate, Shard, StridedShard, rng
from shardops.placements import dim_positions
from test_memory import LargestLocalTensor  # the one recorder of local temporaries

aten = torch.ops.aten
SHAPE = (10, 6)  # on 4 ranks: dim 0 -> 3,3,3,1 rows; dim 1 -> 2,2,2,0 (an empty shard)
SEED = 1234


# ------------------------------------------------------------------ the generator itself


def test_bits_equal_scalar_splitmix64():
    index = torch.tensor([0, 1, 2, 3, 10**12, 2**62 + 5, 2**63 - 1, -1, -(2**63)], dtype=torch.int64)
    key = 0x0123456789ABCDEF
    got = [b & rng.MASK64 for b in rng.random_bits(index.clone(), key).tolist()]
    want = [rng.splitmix64((i * rng.GOLDEN + key) & rng.MASK64) for i in index.tolist()]
    assert got == want


def _brute_indices(shape, mesh_shape, coord, placements) -> torch.Tensor:
    full = torch.arange(math.prod(shape)).reshape(shape)
    for d in range(len(shape)):
        pos = list(dim_positions(shape[d], d, mesh_shape, coord, placements))
        full = full.index_select(d, torch.tensor(pos, dtype=torch.long))
    return full.reshape(-1)


@pytest.mark.parametrize("shape", [(10,), (10, 6), (3, 5, 7), (0, 4), (4, 1, 3)])
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (3,)])
def test_each_rank_gets_exactly_its_global_indices(shape, mesh_shape):
    kinds = (
        [Replicate(), Partial()]
        + [Shard(d) for d in range(len(shape))]
        + [StridedShard(d, 2) for d in range(len(shape))]
    )
    for placements in itertools.product(kinds, repeat=len(mesh_shape)):
        if sum(p.is_partial() for p in placements) > 1:
            continue
        for coord in itertools.product(*[range(n) for n in mesh_shape]):
            layout = rng.index_layout(shape, mesh_shape, coord, placements)
            chunks = [c for _, c in rng.index_chunks(layout, chunk=7)]  # a small chunk: runs split and grouped
            got = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.int64)
            assert torch.equal(got, _brute_indices(shape, mesh_shape, coord, placements)), (shape, placements, coord)


# ------------------------------------------------------------------ layout invariance


def _replicated_like(x, t: torch.Tensor):
    """A constant tensor beside the DTensor x: a Replicate DTensor on x's mesh (torch's rule for mixed operands)."""
    return so.DTensor.from_local(t, x.device_mesh, [Replicate()] * x.device_mesh.ndim)


def _trunc(x):
    return nn.init.trunc_normal_(x, mean=0.5, std=2.0, a=-1.0, b=3.0)


# name -> fn(x) where x is a zero DTensor of SHAPE; the result's global values are compared
OPS = {
    "uniform_": lambda x: x.uniform_(-2, 3),
    "normal_": lambda x: x.normal_(1.0, 2.0),
    "bernoulli_ float": lambda x: x.bernoulli_(0.3),
    "bernoulli_ tensor p": lambda x: x.bernoulli_(_replicated_like(x, torch.linspace(0, 1, 6))),
    "bernoulli(p)": lambda x: torch.bernoulli(x + 0.25),
    "bernoulli(self, p)": lambda x: torch.bernoulli(x, 0.7),
    "rand_like": lambda x: torch.rand_like(x),
    "randn_like": lambda x: torch.randn_like(x, dtype=torch.float64),
    "randint_like": lambda x: torch.randint_like(x, 10),
    "randint_like low": lambda x: torch.randint_like(x, -3, 4, dtype=torch.int64),
    "random_": lambda x: x.random_(),
    "random_ to": lambda x: x.random_(7),
    "random_ from to": lambda x: x.random_(-5, 5),
    "random_ int64": lambda x: x.to(torch.int64).random_(),
    "exponential_": lambda x: x.exponential_(2.0),
    "geometric_": lambda x: x.geometric_(0.3),
    "log_normal_": lambda x: x.log_normal_(),
    "cauchy_": lambda x: x.cauchy_(),
    "normal(tensor mean)": lambda x: torch.normal(x + 1.0, 0.5),
    "normal(tensor mean, tensor std)": lambda x: torch.normal(x + 1.0, x + 0.5),
    "rand_like(generator)": lambda x: torch.rand_like(x, generator=torch.Generator().manual_seed(9)),
    "aten.uniform (functional)": lambda x: aten.uniform(x, -1.0, 1.0),
    "aten.random.to (functional)": lambda x: aten.random.to(x, 100),
    "aten.bernoulli.Tensor (functional)": lambda x: aten.bernoulli.Tensor(x, x + 0.5),
    "aten.normal_functional": lambda x: aten.normal_functional(x, 2.0, 0.5),
    "native_dropout": lambda x: torch.native_dropout(x + 1.0, 0.4, True)[0],
    "native_dropout mask": lambda x: torch.native_dropout(x + 1.0, 0.4, True)[1],
    "F.dropout": lambda x: F.dropout(x + 1.0, 0.1),
    "nn.Dropout": lambda x: nn.Dropout(0.5)(x + 1.0),
    "init.uniform_": lambda x: nn.init.uniform_(x),
    "init.normal_": lambda x: nn.init.normal_(x, std=0.02),
    "init.xavier_uniform_": lambda x: nn.init.xavier_uniform_(x),
    "init.xavier_normal_": lambda x: nn.init.xavier_normal_(x),
    "init.kaiming_uniform_": lambda x: nn.init.kaiming_uniform_(x, a=math.sqrt(5)),
    "init.kaiming_normal_": lambda x: nn.init.kaiming_normal_(x),
    "init.trunc_normal_": _trunc,
    "init.orthogonal_": lambda x: nn.init.orthogonal_(x),
    "uniform_ on a transposed view": lambda x: x.t().uniform_().t(),
}
LAYOUTS = [
    ((1,), (Replicate(),)),
    ((2,), (Shard(0),)),
    ((2,), (Shard(1),)),
    ((4,), (Shard(0),)),
    ((4,), (Shard(1),)),
    ((4,), (Replicate(),)),
    ((2, 2), (Shard(0), Shard(1))),
    ((2, 2), (Shard(1), Shard(1))),
    ((2, 2), (Replicate(), Shard(0))),
]


def _draw(op, mesh_shape, placements, seed=SEED):
    """Each rank: (global result, placements, local result, bytes moved by the op)."""

    def body():
        mesh = so.init_device_mesh("cpu", mesh_shape)
        x = so.distribute_tensor(torch.zeros(SHAPE), mesh, list(placements))
        torch.manual_seed(seed)
        with so.CommDebugMode() as comm:
            y = op(x)
        return y.full_tensor(), y.placements, y.to_local().clone(), comm.get_total_bytes()

    return so.run(body, math.prod(mesh_shape))


GATHERS_ON_PURPOSE = {"init.orthogonal_"}


@pytest.mark.parametrize("name", list(OPS))
def test_same_seed_same_global_tensor_on_every_layout(name, strict):
    reference = None
    for mesh_shape, placements in LAYOUTS:
        with so.allow_replicate(*(["orthogonal_"] if name in GATHERS_ON_PURPOSE else [])):  # strict mode asks for it
            results = _draw(OPS[name], mesh_shape, placements)
        for rank, (full, out_placements, local, moved) in enumerate(results):
            where = f"{name} on mesh {mesh_shape} {placements}, rank {rank}"
            # orthogonal_ QR-factors the drawn matrix: linalg_qr gathers it (replicate on purpose)
            assert moved == 0 or name in GATHERS_ON_PURPOSE, where
            assert out_placements == placements, where
            if reference is None:
                reference = full
            assert full.dtype == reference.dtype and torch.equal(full, reference), where
            if all(p.is_replicate() for p in placements):
                assert torch.equal(local, reference), f"{where}: a replicated draw differs between ranks"
    assert reference.unique().numel() > 1, f"{name}: constant output, the draw did nothing"


def test_strided_shard_draws_the_same_values(strict):
    ref = _draw(OPS["normal_"], (1,), (Replicate(),))[0][0]
    for rank, (full, placements, _, moved) in enumerate(_draw(OPS["normal_"], (2, 2), (StridedShard(0, 2), Shard(0)))):
        assert moved == 0 and placements == (StridedShard(0, 2), Shard(0))
        assert torch.equal(full, ref), rank


def test_different_seeds_and_successive_draws_differ():
    a = _draw(OPS["uniform_"], (2,), (Shard(0),), seed=1)[0][0]
    b = _draw(OPS["uniform_"], (2,), (Shard(0),), seed=2)[0][0]
    assert not torch.equal(a, b)

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        torch.manual_seed(1)
        x = so.distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(0)])
        return x.uniform_(-2, 3).full_tensor(), x.uniform_(-2, 3).full_tensor()

    first, second = so.run(body, 2)[0]
    assert torch.equal(first, a) and not torch.equal(first, second)


# ------------------------------------------------------------------ pending (Partial) inputs


def test_fill_of_a_pending_tensor_is_replicated_with_no_bytes(strict):
    ref = _draw(OPS["uniform_"], (1,), (Replicate(),))[0][0]

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.DTensor.from_local(torch.full(SHAPE, float(mesh.get_rank())), mesh, [Partial()])
        torch.manual_seed(SEED)
        with so.CommDebugMode() as comm:
            y = OPS["uniform_"](x)
            z = torch.rand_like(x)
            pending = [
                so.DTensor.from_local(torch.full(SHAPE, 1.0 + mesh.get_rank()), mesh, [Partial()]) for _ in range(3)
            ]
            inits = [nn.init.zeros_(pending[0]), nn.init.ones_(pending[1]), nn.init.constant_(pending[2], 0.5)]
        return (
            y is x,
            y.placements,
            z.placements,
            y.to_local().clone(),
            comm.get_total_bytes(),
            [(t.placements, t.full_tensor()) for t in inits],
        )

    for same, yp, zp, local, moved, inits in so.run(body, 4):
        assert same and yp == (Replicate(),) and zp == (Replicate(),) and moved == 0
        assert torch.equal(local, ref)
        for (placements, full), value in zip(inits, (0.0, 1.0, 0.5)):
            assert placements == (Replicate(),) and (full == value).all()


def test_dropout_of_a_pending_sum_stays_pending_with_one_mask(strict):
    x_full = torch.arange(60, dtype=torch.float32).reshape(SHAPE) + 1

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        piece = x_full / 4 + (mesh.get_rank() - 1.5)  # pieces sum to x_full
        x = so.DTensor.from_local(piece, mesh, [Partial()])
        torch.manual_seed(SEED)
        with so.CommDebugMode() as comm:
            out, mask = torch.native_dropout(x, 0.5, True)
        return out.placements, mask.placements, comm.get_total_bytes(), out.full_tensor(), mask.to_local().clone()

    results = so.run(body, 4)
    for out_p, mask_p, moved, out, mask in results:
        assert out_p == (Partial(),) and mask_p == (Replicate(),) and moved == 0
        assert torch.equal(mask, results[0][4])
        torch.testing.assert_close(out, x_full * mask * 2.0)
    assert 0 < results[0][4].sum() < 60


# ------------------------------------------------------------------ seeding


def test_reseeding_restarts_the_sequence_in_rank_threads():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(1)])
        torch.manual_seed(5)
        a = x.normal_().full_tensor()
        b = x.normal_().full_tensor()
        torch.random.manual_seed(5)
        c = x.normal_().full_tensor()
        return a, b, c

    for a, b, c in so.run(body, 2):
        assert torch.equal(a, c) and not torch.equal(a, b)


def test_reseeding_restarts_the_sequence_in_the_process():
    torch.manual_seed(11)
    a = torch.stack([_local_draw() for _ in range(2)])
    torch.manual_seed(11)
    b = torch.stack([_local_draw() for _ in range(2)])
    assert torch.equal(a, b) and not torch.equal(a[0], a[1])
    torch.random.default_generator.manual_seed(11)  # a re-seed the wrapper does not see: followed only for a new seed
    torch.manual_seed(12)
    assert not torch.equal(_local_draw(), a[0])


def _local_draw() -> torch.Tensor:
    """A draw outside shardops.run: the process state (the main thread is no rank thread)."""
    key = rng.next_key()
    out = torch.empty(8)
    return rng.fill(out, (8,), (), (), (), key, lambda bits, j0, j1: rng.uniform_closed_open(bits, torch.float32))


def test_debug_mode_names_ranks_seeded_differently():
    """The first draw takes rank 0's state (as torch DTensor does); a later per-rank re-seed is the user's mistake."""

    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(0)])
        x.uniform_()
        torch.manual_seed(SEED + mesh.get_rank())
        x.uniform_()

    from shardops.dispatch import core

    was = core._state["debug"]
    so.set_debug(True)
    try:
        with pytest.raises(so.ShardingError, match="different random keys.*torch.manual_seed"):
            so.run(body, 2)
    finally:
        so.set_debug(was)


def test_activation_checkpointing_recomputes_the_same_dropout_mask():
    """torch.utils.checkpoint saves and restores torch's RNG state; the draw counter travels with it."""
    from torch.utils.checkpoint import checkpoint

    def body(use_checkpoint):
        mesh = so.init_device_mesh("cpu", (2,))
        torch.manual_seed(SEED)
        x = so.distribute_tensor(
            torch.arange(60, dtype=torch.float32).reshape(SHAPE), mesh, [Shard(0)]
        ).requires_grad_()
        block = lambda t: F.dropout(t * 2.0, 0.5) * t  # noqa: E731 - the gradient depends on the mask
        y = checkpoint(block, x, use_reentrant=False) if use_checkpoint else block(x)
        y.sum().backward()
        after = torch.rand_like(x)  # the sequence continues as if nothing was recomputed
        return y.full_tensor(), x.grad.full_tensor(), after.full_tensor()

    plain, checkpointed = so.run(body, 2, False)[0], so.run(body, 2, True)[0]
    for a, b in zip(plain, checkpointed):
        assert torch.equal(a, b)


def _torchrun_style_draws():
    """Under torch.distributed (a process per rank): the state is per process, seeded as users do."""
    mesh = so.init_device_mesh("cpu", (2,))
    torch.manual_seed(SEED)
    x = so.distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(1)])
    return x.normal_(1.0, 2.0).full_tensor(), F.dropout(x, 0.3).full_tensor()


@pytest.mark.slow  # two spawned processes; the process-state path itself is in the default suite (main thread)
def test_processes_under_gloo_draw_what_rank_threads_draw():
    from mp import run_gloo

    threads = so.run(_torchrun_style_draws, 2)[0]
    for rank_result in run_gloo(_torchrun_style_draws, 2, timeout=180):
        for a, b in zip(rank_result, threads):
            assert torch.equal(a, b)


def test_explicit_generator_keys_the_draw():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(0)])
        g = torch.Generator().manual_seed(3)  # the same seed on every rank
        a = x.uniform_(generator=g).full_tensor()
        b = x.uniform_(generator=g).full_tensor()
        g.manual_seed(3)
        c = x.uniform_(generator=g).full_tensor()
        return a, b, c

    results = so.run(body, 2)
    for a, b, c in results:
        assert torch.equal(a, c) and not torch.equal(a, b) and torch.equal(a, results[0][0])


# ------------------------------------------------------------------ statistics (10^5 samples)

N = 100_000
KS_CRITICAL = 1.95 / math.sqrt(N)  # alpha = 0.001


def _sample(op, dtype=torch.float32) -> torch.Tensor:
    """N values drawn on a 4-rank Shard(0) layout, gathered."""

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(torch.zeros(N, dtype=dtype), mesh, [Shard(0)])
        torch.manual_seed(SEED)
        return op(x).full_tensor()

    return so.run(body, 4)[0]


def ks_statistic(samples: torch.Tensor, cdf) -> float:
    """max |F_n(x) - F(x)| over the sorted samples (both sides of each step)."""
    x, _ = samples.double().sort()
    n = x.numel()
    f = cdf(x)
    above = torch.arange(1, n + 1, dtype=torch.float64) / n - f
    below = f - torch.arange(0, n, dtype=torch.float64) / n
    return max(above.max().item(), below.max().item())


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return (((counts.double() - expected) ** 2) / expected).sum().item()


def _normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uniform_passes_ks_and_moments(dtype):
    u = _sample(lambda x: x.uniform_(), dtype)
    assert u.min() >= 0 and u.max() < 1
    assert ks_statistic(u, lambda x: x) < KS_CRITICAL
    assert abs(u.double().mean() - 0.5) < 0.004 and abs(u.double().var() - 1 / 12) < 0.002
    pairs = torch.stack([u[:-1], u[1:]]).double()  # neighbours (consecutive global indices) uncorrelated
    assert abs(torch.corrcoef(pairs)[0, 1]) < 0.015


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normal_passes_ks_and_moments(dtype):
    z = _sample(lambda x: x.normal_(), dtype)
    assert ks_statistic(z, _normal_cdf) < KS_CRITICAL
    assert abs(z.double().mean()) < 0.015 and abs(z.double().var() - 1) < 0.02


def test_successive_draws_are_independent():
    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(torch.zeros(N), mesh, [Shard(0)])
        torch.manual_seed(SEED)
        return x.normal_().full_tensor(), x.normal_().full_tensor()

    a, b = so.run(body, 4)[0]
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.015


def test_bernoulli_and_dropout_fractions():
    for p in (0.1, 0.5, 0.93):
        ones = _sample(lambda x: x.bernoulli_(p)).sum().item()  # noqa: B023 - called within this iteration
        stat = chi_square(torch.tensor([N - ones, ones]), torch.tensor([N * (1 - p), N * p]))
        assert stat < 10.83, (p, ones)  # chi-square, 1 dof, alpha 0.001
    y = _sample(lambda x: F.dropout(x + 1.0, 0.1))
    kept = (y != 0).double().mean().item()
    assert abs(kept - 0.9) < 0.003 and torch.allclose(y[y != 0], torch.tensor(1 / 0.9))


def test_bernoulli_with_a_probability_per_element():
    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        p = so.distribute_tensor(torch.zeros(N), mesh, [Shard(0)])
        torch.manual_seed(SEED)
        p.uniform_()
        return p.full_tensor(), torch.bernoulli(p).full_tensor()

    p, b = so.run(body, 4)[0]
    assert set(b.unique().tolist()) <= {0.0, 1.0}
    assert abs(b.double().mean() - 0.5) < 0.006
    assert abs((b.double() * p).mean() - 1 / 3) < 0.005  # E[b p] = E[p^2]: b follows its own p
    low, high = b[p < 0.1], b[p > 0.9]
    assert low.mean() < 0.07 and high.mean() > 0.93


def test_randint_chi_square_and_exponential_moments():
    k = _sample(lambda x: torch.randint_like(x, 3, 13)).long()
    assert k.min() == 3 and k.max() == 12
    counts = torch.bincount(k - 3, minlength=10)
    assert chi_square(counts, torch.full((10,), N / 10)) < 27.88  # 9 dof, alpha 0.001
    e = _sample(lambda x: x.exponential_(2.0)).double()
    assert abs(e.mean() - 0.5) < 0.006 and abs(e.var() - 0.25) < 0.01
    assert ks_statistic(e, lambda x: 1 - torch.exp(-2 * x)) < KS_CRITICAL


def test_trunc_normal_distribution():
    t = _sample(lambda x: nn.init.trunc_normal_(x, mean=0.0, std=1.0, a=-2.0, b=2.0)).double()
    assert t.min() >= -2 and t.max() <= 2
    z = _normal_cdf(torch.tensor(2.0, dtype=torch.float64)) - _normal_cdf(torch.tensor(-2.0, dtype=torch.float64))
    assert (
        ks_statistic(t, lambda x: (_normal_cdf(x) - _normal_cdf(torch.tensor(-2.0, dtype=torch.float64))) / z)
        < KS_CRITICAL
    )
    assert abs(t.var() - 0.7737) < 0.01  # variance of N(0,1) truncated to [-2, 2]


# ------------------------------------------------------------------ dropout: strict, 0 bytes, layout, memory


def test_f_dropout_on_shard0_is_strict_local_and_keeps_the_layout(strict):
    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.distribute_tensor(torch.ones(10, 6), mesh, [Shard(0)]).requires_grad_()
        with so.CommDebugMode() as comm:
            y = F.dropout(x, 0.1)
            y.backward(torch.ones_like(y))
        return y.placements, x.grad.placements, comm.get_total_bytes(), y.to_local().clone(), x.grad.to_local().clone()

    for placements, grad_placements, moved, local, grad in so.run(body, 4):
        assert placements == (Shard(0),) and grad_placements == (Shard(0),) and moved == 0
        assert torch.equal(local, grad)  # the gradient goes through the same mask and scale


@pytest.mark.parametrize("placements", [(Shard(0),), (Shard(1),)])
def test_sharded_dropout_temporaries_within_2x_the_shard(placements):
    rows, cols = 1024, 512  # f32 shard of 512 KiB on 4 ranks

    def body():
        mesh = so.init_device_mesh("cpu", (4,))
        x = so.DTensor.from_local(
            torch.ones(rows // 4, cols) if placements[0].dim == 0 else torch.ones(rows, cols // 4),
            mesh,
            list(placements),
        )
        shard = x.to_local().numel() * 4
        recorder = LargestLocalTensor()
        with recorder:
            F.dropout(x, 0.1)
            x.normal_()
        return recorder.largest, shard, recorder.ops_seen

    for (largest, op, _shape), shard, seen in so.run(body, 4):
        assert seen > 10, "the recorder saw no local kernels"
        assert largest <= 2 * shard, f"{op} made {largest} bytes, the shard is {shard}"


# ------------------------------------------------------------------ nn.init on a DTensor parameter


def test_init_functions_on_a_dtensor_parameter(strict):
    fan_in, fan_out = 48, 64

    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        w = nn.Parameter(so.distribute_tensor(torch.zeros(fan_out, fan_in), mesh, [Shard(0), Shard(1)]))
        torch.manual_seed(SEED)
        out = {}
        with so.CommDebugMode() as comm:
            for name, init in [
                ("xavier_uniform_", nn.init.xavier_uniform_),
                ("kaiming_normal_", nn.init.kaiming_normal_),
                ("trunc_normal_", lambda t: nn.init.trunc_normal_(t, std=0.02)),
                ("constant_", lambda t: nn.init.constant_(t, 0.5)),
                ("zeros_", nn.init.zeros_),
                ("ones_", nn.init.ones_),
            ]:
                assert init(w) is w and w.placements == (Shard(0), Shard(1))
                out[name] = w.full_tensor()
        return out, comm.get_total_bytes(), w.requires_grad

    results = so.run(body, 4)
    out, moved, requires_grad = results[0]
    assert all(r[0][k].equal(out[k]) for r in results for k in out)
    bound = math.sqrt(6 / (fan_in + fan_out))
    assert out["xavier_uniform_"].abs().max() <= bound and out["xavier_uniform_"].abs().max() > 0.9 * bound
    assert abs(out["kaiming_normal_"].std() - math.sqrt(2 / fan_in)) < 0.02
    assert out["trunc_normal_"].abs().max() <= 2 and abs(out["trunc_normal_"].std() - 0.02) < 0.003
    assert (out["constant_"] == 0.5).all() and (out["zeros_"] == 0).all() and (out["ones_"] == 1).all()
    assert requires_grad


# ------------------------------------------------------------------ refusals and verify


def test_seeded_ops_without_a_layout_invariant_version_refuse():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(torch.ones(4, 6), mesh, [Replicate()])
        torch.multinomial(x, 2)

    with pytest.raises(so.ShardingError, match="multinomial.*layout-invariant"):
        so.run(body, 2)


def test_sparse_init_refuses_a_dtensor_and_still_works_on_plain_tensors():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        nn.init.sparse_(so.distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]), 0.5)

    with pytest.raises(so.ShardingError, match="sparse_.*randperm"):
        so.run(body, 2)
    w = nn.init.sparse_(torch.empty(6, 4), 0.5)
    assert ((w == 0).sum(0) == 3).all()


def test_a_transposed_view_draws_in_its_own_row_major_order():
    """The index is the row-major position in the tensor the op sees: x.t().uniform_() equals a fresh [6, 10] draw."""

    def body(view):
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(0)])
        torch.manual_seed(SEED)
        if view:
            x.t().uniform_()
            return x.full_tensor().t()
        return so.distribute_tensor(torch.zeros(SHAPE[::-1]), mesh, [Shard(1)]).uniform_().full_tensor()

    assert torch.equal(so.run(body, 2, True)[0], so.run(body, 2, False)[0])


def test_verify_skips_random_ops_with_a_reason():
    from shardops.verify import targets as verify_targets

    targets, skipped = verify_targets.discover()
    names = {t.name for t in targets}
    assert not any(n.startswith(("aten.bernoulli", "aten.rand", "aten.native_dropout.")) for n in names)
    assert skipped.get(verify_targets.RANDOM_SKIP, 0) >= 20


def test_random_benchmark_smoke():
    """The benchmark runs and reports a ratio (timings are never asserted)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks import random_ops, run

    r = random_ops.measure_random(rows_per_rank=64, cols=64, repeats=1)
    assert [row["case"] for row in r["rows"]][0].startswith("shardops F.dropout") and r["dropout_ratio"] > 0
    assert "÷ torch bernoulli_" in random_ops.format_random_table(r)
    assert any("dropout" in t["target"] for t in run.targets({"random": r}))
