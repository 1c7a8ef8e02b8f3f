"""`torch.default_generator`, named explicitly, is the calling rank's generator inside so.run (issue 42 item 2).

Under torchrun each process has its own default generator; `random_split`'s default argument,
`torch.randperm(n, generator=torch.default_generator)`, the generator's own methods and a
DataLoader shuffling with it all act on that process's state. In so.run the ranks are threads
of one process: each must see its own rank's state, as a process does. Checked against this
main thread (a process: same seed, same calls) and against 2 gloo processes, with a different
seed per rank so that a generator shared between the rank threads cannot give the right values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler, random_split

import shardops as so
from shardops import Shard

SEED = 1234
WORLD = 2


def _dt(t: object) -> so.DTensor:
    """`t`, an op's result on DTensors: a DTensor."""
    assert isinstance(t, so.DTensor), type(t)
    return t


def _draws(rank: int) -> dict:
    """Every use of the default generator by name that a script makes, seeded for `rank`."""
    torch.manual_seed(SEED + rank)
    # (torch takes any sequence as a dataset; its stubs say Dataset)
    parts: list[Any] = random_split(range(8), [4, 4])  # type: ignore[arg-type]
    out: dict = {"random_split": [list(part) for part in parts]}  # its default arg: the generator
    out["randperm"] = torch.randperm(8, generator=torch.default_generator)
    out["rand"] = torch.rand(4, generator=torch.default_generator)
    out["bernoulli_"] = torch.ones(8).bernoulli_(0.5, generator=torch.default_generator)
    out["normal_"] = torch.empty(3).normal_(generator=torch.default_generator)
    out["torch.random.default_generator"] = torch.rand(
        2, generator=torch.random.default_generator
    )  # a reference taken at import
    out["sampler"] = list(RandomSampler(range(10), generator=torch.default_generator))
    out["loader, generator=default"] = [
        b.tolist()
        for b in DataLoader(range(10), batch_size=4, shuffle=True, generator=torch.default_generator)  # type: ignore[arg-type]
    ]

    torch.default_generator.manual_seed(SEED + 10 + rank)  # the generator's own methods
    out["initial_seed"] = (torch.default_generator.initial_seed(), torch.initial_seed())
    out["rand after its manual_seed"] = torch.rand(3)
    out["loader"] = [
        b.tolist()
        for b in DataLoader(range(10), batch_size=4, shuffle=True)  # type: ignore[arg-type]
    ]  # RandomSampler draws its seed
    state = torch.default_generator.get_state()
    first = torch.rand(3)
    torch.default_generator.set_state(state)
    out["set_state round trip"] = (first, torch.rand(3))
    torch.set_rng_state(state)
    out["torch.set_rng_state of its state"] = torch.rand(3)
    out["state"] = torch.default_generator.get_state()
    new_seed = torch.default_generator.seed()
    drawn = torch.rand(2)
    expected = torch.rand(2, generator=torch.Generator().manual_seed(new_seed))
    out["seed() is the seed in use"] = (torch.initial_seed() == new_seed, torch.equal(drawn, expected))
    return out


def _rank_draws(with_dtensor: bool = False) -> dict:
    """One rank's draws (module level: the gloo processes run it too)."""
    mesh = so.init_device_mesh("cpu", (WORLD,))
    out = _draws(mesh.get_rank())
    if with_dtensor:  # a DTensor draw keyed by the default generator given explicitly, by either reference
        torch.manual_seed(SEED + 20 + mesh.get_rank())  # after _draws' seed(): a random seed
        x = so.distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])
        out["DTensor uniform_"] = _dt(x.uniform_(generator=torch.default_generator)).full_tensor()
        out["DTensor normal_, earlier reference"] = _dt(
            x.normal_(generator=torch.random.default_generator)
        ).full_tensor()
    return out


def _assert_same(got: dict, expected: dict, rank: int) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), (rank, key)
        elif isinstance(value, tuple) and isinstance(value[0], torch.Tensor):
            assert all(torch.equal(a, b) for a, b in zip(got[key], value)), (rank, key)
        else:
            assert got[key] == value, (rank, key)


def test_the_default_generator_by_name_acts_on_the_rank_state_as_in_a_process():
    torch.manual_seed(99)
    expected_after = torch.rand(3)
    torch.manual_seed(99)
    in_process = [_draws(rank) for rank in range(WORLD)]  # this main thread is a process
    torch.manual_seed(99)
    default = torch.default_generator
    results = so.run(_rank_draws, WORLD)
    assert torch.default_generator is default is torch._C.default_generator  # outside so.run: torch's own object
    assert torch.equal(torch.rand(3), expected_after)  # the caller's state was not touched by the ranks
    for rank, (got, expected) in enumerate(zip(results, in_process)):
        _assert_same(got, expected, rank)
        assert got["set_state round trip"][0].equal(got["set_state round trip"][1])
        assert got["seed() is the seed in use"] == (True, True)
    assert results[0]["random_split"] != results[1]["random_split"]  # seeds differ: the check can fail


def test_the_same_seed_gives_every_rank_the_same_split():
    """The issue's case: one seed on every rank, as a torchrun script seeds: every rank splits alike."""

    def body():
        torch.manual_seed(0)
        return [[list(p) for p in random_split(range(8), [4, 4])] for _ in range(20)]

    torch.manual_seed(0)
    expected = [[list(p) for p in random_split(range(8), [4, 4])] for _ in range(20)]
    for splits in so.run(body, 4):
        assert splits == expected


def test_threads_world_equals_separate_processes():
    from mp import run_gloo

    threads = so.run(_rank_draws, WORLD, True)
    processes = run_gloo(_rank_draws, WORLD, True, timeout=300)
    for rank, (ours, theirs) in enumerate(zip(threads, processes)):
        _assert_same(ours, theirs, rank)
