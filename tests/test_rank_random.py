"""Each rank thread of so.run has its own default random state, as each process has under torchrun.

Checked against torch in this process (the main thread is "a process": same seed, same
ops, bitwise the same values), against 4 gloo processes (one launch for every check:
plain draws, DTensor draws, dropout masks, GPT-2 with dropout over 5 steps), and through
activation checkpointing, repeated (the shared-generator bug was intermittent).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import shardops as so
from shardops import Replicate, Shard

SEED = 1234
x8 = lambda: torch.linspace(0.1, 0.9, 8)  # noqa: E731 - a fresh plain operand per op

# Every random op on plain tensors, by the path that reaches it: a generator argument filled
# in, a sibling overload with a generator, or the default generator lent for the call.
PLAIN_RANDOM_OPS = {
    "rand": lambda: torch.rand(5),
    "rand out=": lambda: torch.rand(5, out=torch.empty(5)),
    "randn": lambda: torch.randn(5, dtype=torch.float64),
    "randint": lambda: torch.randint(10, (6,)),
    "randint low": lambda: torch.randint(3, 10, (6,)),
    "randperm": lambda: torch.randperm(9),
    "rand_like": lambda: torch.rand_like(x8()),
    "randn_like": lambda: torch.randn_like(x8()),
    "randint_like": lambda: torch.randint_like(x8(), 7),
    "uniform_": lambda: x8().uniform_(-1, 1),
    "normal_": lambda: x8().normal_(2.0, 3.0),
    "normal(mean, std)": lambda: torch.normal(x8(), x8()),
    "normal(float, float, size)": lambda: torch.normal(0.0, 1.0, (4,)),
    "bernoulli": lambda: torch.bernoulli(x8()),
    "bernoulli_(p)": lambda: x8().bernoulli_(0.3),
    "random_": lambda: x8().random_(0, 100),
    "exponential_": lambda: x8().exponential_(),
    "geometric_": lambda: x8().geometric_(0.4),
    "log_normal_": lambda: x8().log_normal_(),
    "cauchy_": lambda: x8().cauchy_(),
    "multinomial": lambda: torch.multinomial(x8(), 4),
    "poisson": lambda: torch.poisson(x8() * 5),
    "binomial": lambda: torch.binomial(torch.full((8,), 10.0), x8()),
    "_standard_gamma": lambda: torch._standard_gamma(x8() + 1),
    "_sample_dirichlet": lambda: torch._sample_dirichlet(x8().reshape(2, 4) + 1),
    "F.dropout": lambda: F.dropout(torch.ones(16), 0.5),
    "F.dropout2d": lambda: F.dropout2d(torch.ones(1, 4, 2, 2), 0.5),
    "F.alpha_dropout": lambda: F.alpha_dropout(torch.ones(16), 0.5, True),
    "F.feature_alpha_dropout": lambda: F.feature_alpha_dropout(torch.ones(1, 4, 2, 2), 0.5, True),
    "native_dropout": lambda: torch.native_dropout(torch.ones(16), 0.5, True)[0],
    "F.rrelu": lambda: F.rrelu(x8() - 0.5, training=True),
    "nn.init.trunc_normal_": lambda: torch.nn.init.trunc_normal_(torch.empty(8)),
    "nn.init.kaiming_uniform_": lambda: torch.nn.init.kaiming_uniform_(torch.empty(3, 4)),
    "nn.init.orthogonal_": lambda: torch.nn.init.orthogonal_(torch.empty(3, 3)),
}


def _draw_all(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {name: op() for name, op in PLAIN_RANDOM_OPS.items()}


def test_every_plain_random_op_draws_from_the_rank_state_as_a_process_does():
    torch.manual_seed(99)
    expected_after = torch.rand(3)
    torch.manual_seed(99)
    in_process = {s: _draw_all(s) for s in (SEED, SEED + 1)}  # a process: this main thread
    torch.manual_seed(99)
    results = so.run(lambda: _draw_all(SEED + so.init_device_mesh("cpu", (4,)).get_rank() % 2), 4)
    assert torch.equal(torch.rand(3), expected_after)  # the caller's own state was not touched
    for rank, drawn in enumerate(results):
        for name, value in in_process[SEED + rank % 2].items():
            assert torch.equal(drawn[name], value), (rank, name)
    assert not torch.equal(results[0]["rand"], results[1]["rand"])  # seeds differ: draws differ


def test_an_explicit_generator_is_left_alone():
    def body():
        g = torch.Generator().manual_seed(7)
        return torch.rand(4, generator=g), torch.ones(6).bernoulli_(0.5, generator=g), torch.randperm(5, generator=g)

    g = torch.Generator().manual_seed(7)
    expected = torch.rand(4, generator=g), torch.ones(6).bernoulli_(0.5, generator=g), torch.randperm(5, generator=g)
    for got in so.run(body, 2):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_every_run_starts_each_rank_from_a_fresh_random_seed_as_a_new_process():
    def body():
        return torch.initial_seed(), torch.rand(4)

    first, second = so.run(body, 3), so.run(body, 3)
    seeds = [s for s, _ in first + second]
    assert len(set(seeds)) == 6  # every rank of every run: its own seed, as separate processes have
    for seed, values in first + second:
        assert torch.equal(values, torch.rand(4, generator=torch.Generator().manual_seed(seed)))


def test_state_functions_act_on_the_rank_state():
    def body():
        rank = so.init_device_mesh("cpu", (2,)).get_rank()
        torch.manual_seed(SEED + rank)
        assert torch.initial_seed() == SEED + rank
        state = torch.get_rng_state()
        a = torch.rand(5)
        torch.set_rng_state(state)
        b = torch.rand(5)
        with torch.random.fork_rng():
            torch.rand(100)
        c = torch.rand(5)
        new_seed = torch.seed()
        assert torch.initial_seed() == new_seed
        return a, b, c

    for rank, (a, b, c) in enumerate(so.run(body, 2)):
        g = torch.Generator().manual_seed(SEED + rank)
        assert torch.equal(a, torch.rand(5, generator=g)) and torch.equal(b, a)
        assert torch.equal(c, torch.rand(5, generator=g))  # fork_rng gave the state back


def test_unseeded_dtensor_draws_take_the_first_rank_state():
    """Ranks start from different seeds; a DTensor draw must still fit together (rank 0's wins, as torch)."""

    def body():
        mesh = so.init_device_mesh("cpu", (2, 2))
        x = so.distribute_tensor(torch.zeros(8, 6), mesh, [Replicate(), Shard(1)])
        return x.uniform_().full_tensor(), x.normal_().to_local(), mesh.get_coordinate()

    results = so.run(body, 4)
    for full, _local, (_dp, _) in results:
        assert torch.equal(full, results[0][0])
    assert torch.equal(results[0][1], results[2][1]) and not torch.equal(results[0][0], so.run(body, 4)[0][0])


# ------------------------------------------------------------------ activation checkpointing

ITERATIONS = 30


def _checkpointed_grads(dtensor: bool, use_reentrant: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    mesh = so.init_device_mesh("cpu", (2,))
    pairs = []
    for step in range(ITERATIONS):
        base = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        grads = []
        for use_checkpoint in (False, True):
            torch.manual_seed(SEED + step)
            x = (so.distribute_tensor(base, mesh, [Shard(0)]) if dtensor else base.clone()).requires_grad_()
            block = lambda t: F.dropout(t * 2.0, 0.5) * t  # noqa: E731 - the gradient depends on the mask
            y = checkpoint(block, x, use_reentrant=use_reentrant) if use_checkpoint else block(x)
            y.sum().backward()
            after = torch.rand(4)  # the sequence continues as if nothing was recomputed
            grad = x.grad
            assert grad is not None
            if dtensor:
                grad = _dt(grad).full_tensor()
            grads.append(torch.cat([grad.flatten(), after]))
        pairs.append((grads[0], grads[1]))
    return pairs


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("dtensor", [False, True], ids=["plain", "dtensor"])
def test_checkpointed_dropout_gives_the_gradient_of_the_plain_run(dtensor, use_reentrant):
    for rank_pairs in so.run(_checkpointed_grads, 2, dtensor, use_reentrant):
        for plain, checkpointed in rank_pairs:
            assert torch.equal(plain, checkpointed)
            assert (plain[:-4] == 0).any()  # the mask dropped something: the check can fail


# ------------------------------------------------------------------ the same script as 4 processes


def _spec():
    from shardops.training.config import SIZES, RunSpec

    return RunSpec(
        model="gpt2", cfg=replace(SIZES["tiny"], dropout=0.1), mesh_shape=(2, 2), steps=5, sequence_parallel=False
    )


def _dt(t: torch.Tensor) -> so.DTensor:
    assert isinstance(t, so.DTensor), type(t)  # an op on a DTensor gives one
    return t


def _same_script() -> dict:
    """One rank's draws, masks and GPT-2 training, seeded as a torchrun user seeds."""
    from shardops.training.shardops_side import train_rank

    mesh = so.init_device_mesh("cpu", (2, 2))
    torch.manual_seed(SEED)
    out: dict[str, Any] = {"rand": torch.rand(5), "randn": torch.randn(5), "randint": torch.randint(100, (5,))}
    out["mask"] = F.dropout(torch.ones(32), 0.5)
    x = so.distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0), Shard(1)])
    out["dt uniform_"] = _dt(x.uniform_()).full_tensor()
    out["dt normal_"] = _dt(x.normal_()).full_tensor()
    out["dt mask"] = _dt(F.dropout(x + 1.0, 0.5)).full_tensor()
    torch.manual_seed(SEED)
    trained = train_rank(_spec(), None, True)
    out["losses"] = [r.loss for r in trained["records"]]
    out.update({f"grad {n}": g for n, g in trained["grads"].items()})
    out.update({f"param {n}": p for n, p in trained["params"].items()})
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.vector_norm((a - b).double()) / torch.linalg.vector_norm(b.double()).clamp_min(1e-30)).item()


def test_gpt2_with_dropout_is_reproducible_and_keeps_tensor_parallel_peers_in_step():
    first, second = so.run(_same_script, 4, timeout=600), so.run(_same_script, 4, timeout=600)
    for a, b in zip(first, second):
        assert a.keys() == b.keys()
        for key in a:
            assert (a[key] == b[key]) if key == "losses" else torch.equal(a[key], b[key]), key
    for rank in first:  # replicas agree: one loss, one set of parameters
        assert rank["losses"] == first[0]["losses"]
        assert all(torch.equal(rank[k], first[0][k]) for k in rank if k.startswith("param"))


@pytest.mark.slow  # 4 spawned processes training GPT-2 (about a minute on a loaded 2-core machine)
def test_threads_world_equals_four_gloo_processes():
    from mp import run_gloo

    threads = so.run(_same_script, 4, timeout=600)
    processes = run_gloo(_same_script, 4, timeout=600)
    for rank, (ours, theirs) in enumerate(zip(threads, processes)):
        for key in ("rand", "randn", "randint", "mask", "dt uniform_", "dt normal_", "dt mask"):
            assert torch.equal(ours[key], theirs[key]), (rank, key)
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6)
        for key in ours:
            if key.startswith(("grad", "param")):
                assert _rel(ours[key], theirs[key]) <= 1e-6, (rank, key)
