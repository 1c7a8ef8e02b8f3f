"""shardops.pipelining: a LLaMA-style model split by depth equals single-device training of the whole batch.

8 layers, global batch of 8 sequences in 4 micro-batches, pp=4 (2 layers per stage): every step's loss
and every gradient against the whole model trained on one device in this test (AdamW, eps=1e-4: its
first step is about lr*sign(g), which turns rounding in near-zero gradients into whole parameter
moves). Bytes are asserted exactly, the bubble is read from the executed action order, and the
layout/shape errors are raised on every rank.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardops as so
from mp import RankFailure, run_gloo
from shardops.comm.base import P2POp
from shardops.models import Llama, ModelArgs
from shardops.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)
from shardops.world import current_comm

ARGS = ModelArgs(dim=32, n_layers=8, n_heads=4, vocab_size=64, hidden_dim=48, max_seq_len=16)
BATCH, SEQ, M, STEPS, LR, EPS = 8, 8, 4, 3, 1e-2, 1e-4
TOL = 1e-5
ACT_BYTES = (BATCH // M) * SEQ * ARGS.dim * 4  # one micro-batch's activations, float32


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.vector_norm((a - b).double()) / torch.linalg.vector_norm(b.double()).clamp_min(1e-30)).item()


def _grad(p: torch.Tensor) -> torch.Tensor:
    """p's gradient, which the step just made (a missing one fails the test here)."""
    assert p.grad is not None, "no gradient"
    return p.grad


def _full(t: torch.Tensor | None) -> torch.Tensor:
    """The whole tensor of a parameter or its gradient (plain under replicate: already whole)."""
    assert t is not None, "no gradient"
    return t.full_tensor() if isinstance(t, so.DTensor) else t


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=g),
            torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


class LlamaStage(nn.Module):
    """The layers of one stage, torchtitan-style: the whole model's FQNs for what it keeps, None for the rest."""

    freqs_cis: torch.Tensor  # a buffer

    def __init__(self, model: Llama, layer_ids: list[str], first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({k: model.layers[k] for k in layer_ids})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("freqs_cis", model.freqs_cis, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        freqs = self.freqs_cis[:SEQ]  # not h.shape[1]: under sequence parallelism h is this rank's sequence shard
        for layer in self.layers.values():
            h = layer(h, freqs)
        return self.output(self.norm(h)) if self.norm is not None and self.output is not None else h


def _stage_module(stage: int, num_stages: int, seed: int = 0) -> LlamaStage:
    per = ARGS.n_layers // num_stages
    ids = [str(i) for i in range(stage * per, (stage + 1) * per)]
    return LlamaStage(Llama(ARGS, seed=seed), ids, stage == 0, stage == num_stages - 1)


def _reference() -> dict:
    model = Llama(ARGS, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, grads = [], []
    for tokens, target in _batches():
        opt.zero_grad()
        loss = _loss(model(tokens), target)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: _grad(p).clone() for n, p in model.named_parameters()})
        opt.step()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _pipeline_rank(schedule_name: str, stages_per_rank: int = 1) -> dict:
    """One rank's side of pipelined training; what it saw, for the test to compare."""
    comm = current_comm()
    p = comm.world_size
    mesh = so.init_device_mesh("cpu", (p,), mesh_dim_names=("pp",))
    group = mesh.get_group("pp")
    num_stages = p * stages_per_rank
    indices = [comm.rank + k * p for k in range(stages_per_rank)]
    if schedule_name == "ZBVZeroBubble":  # the V: stages r and 2p-1-r
        indices = [comm.rank, 2 * p - 1 - comm.rank]
    modules = [_stage_module(s, num_stages) for s in indices]
    stages = [PipelineStage(m, s, num_stages, "cpu", group=group) for m, s in zip(modules, indices)]
    cls: Callable[..., Any] = get_schedule_class(schedule_name)  # each class takes its own stage arguments
    schedule = cls(stages if stages_per_rank > 1 else stages[0], M, loss_fn=_loss)
    params = [q for m in modules for q in m.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS)
    out: dict[str, Any] = {"losses": [], "grads": [], "counts": [], "bytes": [], "log": [], "actions": [], "peak": {}}
    for tokens, target in _batches():
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        with so.CommDebugMode() as cm:
            schedule.step(
                *((tokens,) if 0 in indices else ()),
                target=target if num_stages - 1 in indices else None,
                losses=losses,
            )
        out["losses"].append([x.item() for x in losses])
        out["grads"].append({n: _grad(q).clone() for m in modules for n, q in m.named_parameters()})
        out["counts"].append(cm.get_comm_counts())
        out["bytes"].append(cm.get_total_bytes())
        out["log"].append(list(cm.log))
        out["actions"].append([str(a) for a in schedule.executed_actions])
        opt.step()
    out["peak"] = {s.stage_index: s.peak_in_flight for s in stages}
    out["explained"] = schedule.explain()
    out["params"] = {n: q.detach().clone() for m in modules for n, q in m.named_parameters()}
    return out


def _check_explained(results: list[dict]) -> None:
    """schedule.explain(), from metadata only, says what a steady step ran and sent: the executed order,
    CommDebugMode's p2p counts and bytes."""
    for rank, r in enumerate(results):
        explained = r["explained"]
        assert list(explained.program) == r["actions"][1]
        assert {k: n for k, n in explained.get_comm_counts().items() if n} == r["counts"][1], rank
        assert explained.get_total_bytes() == r["bytes"][1]
        assert f"total: {r['counts'][1].get('send', 0)} sends ({r['bytes'][1]:,} B)" in str(explained)


def _check_equals_reference(results: list[dict], ref: dict, tol: float = TOL, losses: bool = True) -> None:
    """Every step's loss (the mean of the last stage's micro-batch losses) and gradients, the final parameters."""
    last = max(range(len(results)), key=lambda r: len(results[r]["losses"][0]))
    for step in range(STEPS):
        mb_losses = results[last]["losses"][step]
        assert len(mb_losses) == M
        if losses:
            assert sum(mb_losses) / M == pytest.approx(ref["losses"][step], rel=tol)
        seen = {}
        for r in results:
            seen.update(r["grads"][step])
        assert set(seen) == set(ref["grads"][step])
        for name, g in ref["grads"][step].items():
            assert _rel(seen[name], g) <= tol, (step, name)
    params = {n: t for r in results for n, t in r["params"].items()}
    for name, t in ref["params"].items():
        assert _rel(params[name], t) <= tol, name


COST = {
    "F": 1,
    "B": 2,
    "I": 1,
    "W": 1,
}  # a backward is about two forwards; its halves one each (the zero-bubble paper's)


def _slots(
    actions_by_rank: list[list[str]], layers_per_stage: int = 1, cost: dict[str, int] | None = None
) -> tuple[int, list[int]]:
    """Replay the executed orders, each action after what it depends on, and return (makespan, idle time
    per rank). An action takes one slot, or with `cost`, cost[kind] x layers_per_stage units of one layer's
    forward (so schedules of different stage sizes compare). Independent of timing.

    F depends on the previous stage's F; B or I on the next stage's B or I; W on its own I (same rank, earlier)."""
    import re

    def parse(action: str) -> tuple[int, str, int]:
        m = re.fullmatch(r"(\d+)([FBIW])(\d+)", action)
        assert m is not None, action
        return int(m[1]), m[2], int(m[3])

    parsed = [[parse(a) for a in acts] for acts in actions_by_rank]
    last_stage = max(s for acts in parsed for s, _, _ in acts)
    done: dict[tuple, int] = {}
    pos, clock, busy = [0] * len(parsed), [0] * len(parsed), [0] * len(parsed)

    def dependency(s: int, kind: str, mb: int) -> tuple | None:
        if kind == "F":
            return (s - 1, "F", mb) if s > 0 else None
        if kind == "W":
            return (s, "I", mb)
        return (
            next(((s + 1, k, mb) for k in "BI" if (s + 1, k, mb) in done), (s + 1, "?", mb)) if s < last_stage else None
        )

    while any(pos[r] < len(parsed[r]) for r in range(len(parsed))):
        progressed = False
        for r, acts in enumerate(parsed):
            if pos[r] == len(acts):
                continue
            s, kind, mb = acts[pos[r]]
            dep = dependency(s, kind, mb)
            if dep is not None and dep not in done:
                continue
            length = 1 if cost is None else cost[kind] * layers_per_stage
            done[(s, kind, mb)] = clock[r] = max(clock[r], done[dep] if dep else 0) + length
            busy[r] += length
            pos[r] += 1
            progressed = True
        assert progressed, "the executed orders deadlock"
    makespan = max(clock)
    return makespan, [makespan - b for b in busy]


@pytest.fixture(scope="module")
def reference() -> dict:
    return _reference()


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_pp4_equals_single_device_training(reference, schedule):
    results = so.run(_pipeline_rank, 4, schedule)
    _check_equals_reference(results, reference)
    _check_explained(results)
    p = 4
    for rank, r in enumerate(results):
        # steady steps: only the boundary transfers, exactly m activations forward and m gradients back per boundary
        sends = (M if rank < p - 1 else 0) + (M if rank > 0 else 0)
        for step in (1, 2):
            assert r["counts"][step] == {"send": sends, "recv": sends}, (rank, r["counts"][step])
            assert r["bytes"][step] == sends * ACT_BYTES
        # the first step adds the shape exchange: one 4 KiB message per boundary and two 4 KiB all_gathers
        assert r["bytes"][0] == r["bytes"][1] + (4096 if rank < p - 1 else 0) + 2 * 4096
    total = sum(r["bytes"][1] for r in results)
    assert total == (p - 1) * 2 * M * ACT_BYTES
    makespan, idle = _slots([r["actions"][1] for r in results])
    assert makespan == 2 * (M + p - 1)
    assert idle == [2 * (p - 1)] * p  # (p-1) forward and (p-1) backward slots per rank
    peaks = {s: n for r in results for s, n in r["peak"].items()}
    if schedule == "GPipe":
        assert peaks == {s: M for s in range(p)}
    else:
        assert peaks == {s: min(M, p - s) for s in range(p)}
        assert results[2]["actions"][1] == ["2F0", "2F1", "2B0", "2F2", "2B1", "2F3", "2B2", "2B3"]
        assert results[3]["actions"][1] == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3"]


def test_looped_bfs_two_stages_per_rank(reference):
    results = so.run(_pipeline_rank, 2, "LoopedBFS", 2)
    _check_equals_reference(results, reference)
    _check_explained(results)
    # 4 stages on 2 ranks: every boundary crosses ranks; each carries m activations and m gradients
    assert sum(r["bytes"][1] for r in results) == 3 * 2 * M * ACT_BYTES


def test_interleaved_1f1b_two_stages_per_rank(reference):
    p, v = 4, 2
    results = so.run(_pipeline_rank, p, "Interleaved1F1B", v)
    _check_equals_reference(results, reference)
    _check_explained(results)
    # 8 stages of one layer each: 7 boundaries, all across ranks, m activations and m gradients each (x v per rank pair)
    assert sum(r["bytes"][1] for r in results) == (p * v - 1) * 2 * M * ACT_BYTES
    # the bubble, in slots of one stage (1/v of a rank's layers): 2(p-1) per rank, where 1F1B on the same
    # layers (test_pp4_...: 2(p-1) slots of v layers each) idles 2(p-1)v of these slots: 1/v of it
    makespan, idle = _slots([r["actions"][1] for r in results])
    assert makespan == 2 * M * v + 2 * (p - 1)
    assert idle == [2 * (p - 1)] * p
    peaks = {s: n for r in results for s, n in r["peak"].items()}
    assert max(peaks.values()) <= M


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble"])
def test_zero_bubble_two_stages_per_rank(reference, schedule):
    """pp=2, 4 stages of 2 layers: equal to single-device training, every backward split into I then W,
    and fewer idle layer-units per rank than 1F1B on the same layers (2 stages of 4)."""
    p, v = 2, 2
    results = so.run(_pipeline_rank, p, schedule, v)
    _check_equals_reference(results, reference)
    _check_explained(results)
    for r in results:
        acts = r["actions"][1]
        assert not [a for a in acts if "B" in a]
        for a in acts:  # each micro-batch's W after its I, on the same rank
            if "W" in a:
                assert acts.index(a.replace("W", "I")) < acts.index(a), acts
        assert sorted(acts) == sorted(
            f"{s}{k}{mb}" for s in range(4) for k in "FIW" for mb in range(M) if f"{s}F{mb}" in acts
        )
    stages_by_rank = [sorted({int(a[0]) for a in r["actions"][1]}) for r in results]
    if schedule == "ZBVZeroBubble":
        assert stages_by_rank == [[0, 3], [1, 2]]
        # the turn of the V (stages 1 and 2) is one rank's hand-off: two of the three boundaries cross ranks
        assert sum(r["bytes"][1] for r in results) == 2 * 2 * M * ACT_BYTES
    else:
        assert stages_by_rank == [[0, 2], [1, 3]]
        assert sum(r["bytes"][1] for r in results) == 3 * 2 * M * ACT_BYTES
    one_f_one_b = so.run(_pipeline_rank, p, "1F1B")
    _, idle_1f1b = _slots([r["actions"][1] for r in one_f_one_b], ARGS.n_layers // p, COST)
    assert (
        idle_1f1b == [(p - 1) * (COST["F"] + COST["B"]) * ARGS.n_layers // p] * p
    )  # 1F1B's bubble: (p-1)(F+B) per rank
    _, idle = _slots([r["actions"][1] for r in results], ARGS.n_layers // (p * v), COST)
    assert all(z < b for z, b in zip(idle, idle_1f1b)), (idle, idle_1f1b)
    # 1 slot per rank, the least there is: rank 1 waits for stage 0's first forward, then never again
    assert idle == [ARGS.n_layers // (p * v)] * p
    peaks = {s: n for r in results for s, n in r["peak"].items()}
    assert all(peaks[r] <= p for r in range(p)), peaks  # live micro-batches in each rank's first stage: 1F1B's bound


def _zbv_tp_rank() -> dict:
    """ZBV on (pp=2, tp=2): each rank's two stages (r and 3-r) tensor-parallel on mesh["tp"] (sequence
    parallel). (The zero-bubble schedules refuse fully_shard and replicate stages: test_schedule_arguments.)"""
    from shardops.parallel import parallelize_module

    mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    r = mesh.get_local_rank("pp")
    indices = [r, 3 - r]
    modules = [_stage_module(s, 4) for s in indices]
    for m in modules:
        parallelize_module(m, mesh["tp"], _tp_plan(m))
    stages = [PipelineStage(m, s, 4, "cpu", group=mesh["pp"].get_group()) for m, s in zip(modules, indices)]
    schedule = ScheduleZBVZeroBubble(stages, M, loss_fn=_loss)
    opt = torch.optim.AdamW([q for m in modules for q in m.parameters()], lr=LR, eps=EPS)
    out: dict = {"losses": [], "grads": []}
    for tokens, target in _batches():
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        schedule.step(*((tokens,) if r == 0 else ()), target=target if r == 0 else None, losses=losses)
        out["losses"].append([(x.full_tensor() if hasattr(x, "full_tensor") else x).item() for x in losses])
        out["grads"].append({n: _full(q.grad).clone() for m in modules for n, q in m.named_parameters()})
        opt.step()
    out["params"] = {n: _full(q).detach().clone() for m in modules for n, q in m.named_parameters()}
    return out


def test_zbv_with_tp_stages_equals_single_device_training(strict, reference):
    results = so.run(_zbv_tp_rank, 4)
    # V shape: the last stage (3) is pp rank 0's second stage, so ranks 0 and 1 (pp 0, tp 0/1) hold the losses
    assert [len(r["losses"][0]) for r in results] == [M, M, 0, 0]
    _check_equals_reference(results, reference, tol=3e-5)  # see test_pp2_tp2_...


def _gloo_rank(schedule: str) -> dict:
    out = _pipeline_rank(schedule)
    # one launch covers the rest of the gloo checks too (a launch costs most of this test's time)
    return {
        **{k: out[k] for k in ("losses", "grads", "params", "bytes", "counts")},
        "errors": [_error_rank(case) for case, _ in ERROR_CASES],
        "p2p": _p2p_rank(),
        "pp_tp": _pp_tp_rank(),  # the pp groups {0, 2} and {1, 3}: torch sub-groups of the mesh
        "zbv": {
            k: v for k, v in _pipeline_rank("ZBVZeroBubble", 2).items() if k in ("losses", "grads", "params", "actions")
        },
    }


def test_gloo_equals_single_device_training(reference):
    """4 gloo processes: pp=4 1F1B, every error case of test_errors_raise_on_every_rank, the p2p primitives
    and (pp=2, tp=2)."""
    results = run_gloo(_gloo_rank, 4, "1F1B", timeout=300)
    _check_equals_reference(results, reference)
    assert sum(r["bytes"][1] for r in results) == 3 * 2 * M * ACT_BYTES
    threads = so.run(_pipeline_rank, 4, "1F1B")
    assert [r["counts"] for r in results] == [r["counts"] for r in threads]
    assert [r["bytes"] for r in results] == [r["bytes"] for r in threads]
    # each error case: the same ShardingError on every process, none left waiting
    for k, (_case, words) in enumerate(ERROR_CASES):
        _check_error_messages([r["errors"][k] for r in results], words)
    _check_p2p([r["p2p"] for r in results])
    _check_equals_reference([r["pp_tp"] for r in results], reference, tol=3e-5)
    # pp=4 ZBV, 8 stages of one layer: the same order as in the threads world
    _check_equals_reference([r["zbv"] for r in results], reference)
    assert [r["zbv"]["actions"] for r in results] == [
        r["actions"] for r in so.run(_pipeline_rank, 4, "ZBVZeroBubble", 2)
    ]
    # its bubble against 1F1B's on the same layers, in one layer's forward: 3 (rank 3 waits 3 forwards to start,
    # the least there is) against (p-1)(F+B) = 18
    _, idle_zbv = _slots([r["zbv"]["actions"][1] for r in results], 1, COST)
    _, idle_1f1b = _slots([r["actions"][1] for r in threads], 2, COST)
    assert idle_zbv == [3] * 4 and idle_1f1b == [18] * 4
    assert all(r["pp_tp"]["sends"][1] == [ACT_BYTES // 2] * M for r in results)


# ------------------------------------------------------------------ errors, on every rank


def _error_rank(case: str) -> str:
    comm = current_comm()
    p, rank = comm.world_size, comm.rank
    num_stages = p + 1 if case == "stage_count" and rank == p - 1 else p
    module: nn.Module = _stage_module(min(rank, num_stages - 1), p)
    input_args = None
    if case == "declared_shape" and rank == 2:
        input_args = torch.zeros(BATCH // M, SEQ, ARGS.dim + 1)
    if case == "module_shape" and rank == 2:
        module = nn.Linear(ARGS.dim + 3, ARGS.dim)
    stage = PipelineStage(module, rank, num_stages, "cpu", input_args=input_args)
    try:
        if (
            case == "interleaved_microbatches"
        ):  # fewer than its rounds of p need: raised where it is built, by every rank
            ScheduleInterleaved1F1B([stage], p - 1, loss_fn=_loss)
        schedule = Schedule1F1B(stage, M, loss_fn=_loss)
    except so.ShardingError as e:
        return f"{type(e).__name__}: {e}"
    tokens, target = _batches()[0]
    if case == "batch":
        tokens, target = tokens[:6], target[:6]
    try:
        schedule.step(*((tokens,) if rank == 0 else ()), target=target if rank == p - 1 else None)
    except so.ShardingError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


ERROR_CASES = [
    ("batch", "do not split into n_microbatches=4"),
    ("interleaved_microbatches", "n_microbatches=3 is not a multiple of the pipeline's 4 ranks"),
    ("stage_count", "mismatched stage counts"),
    ("declared_shape", "stage 1's output (float32[2, 8, 32]) differs from stage 2's input_args (float32[2, 8, 33])"),
    ("module_shape", "stage 2 (rank 2) cannot take stage 1's output (float32[2, 8, 32])"),
]


def _check_error_messages(messages: list[str], words: str) -> None:
    assert len(messages) == 4
    for m in messages:
        assert m.startswith("ShardingError") and words in m, m


@pytest.mark.parametrize("case, words", ERROR_CASES, ids=[c for c, _ in ERROR_CASES])
def test_errors_raise_on_every_rank(case, words):
    # a short timeout: a rank left waiting would fail the run with a CollectiveError, not return a message
    _check_error_messages(so.run(_error_rank, 4, case, timeout=30), words)


def test_later_step_batch_not_divisible_raises_on_the_first_stage():
    def body():
        rank = current_comm().rank
        stage = PipelineStage(_stage_module(rank, 2), rank, 2, "cpu")
        schedule = ScheduleGPipe(stage, M, loss_fn=_loss)
        tokens, target = _batches()[0]
        schedule.step(*((tokens,) if rank == 0 else ()), target=target if rank == 1 else None)
        schedule.step(*((tokens[:6],) if rank == 0 else ()), target=target[:6] if rank == 1 else None)

    with pytest.raises(so.ShardingError, match="do not split into n_microbatches=4"):
        so.run(body, 2, timeout=10)


def test_later_step_with_another_batch_shape_raises_on_the_first_stage():
    """The first step sized every transfer: a later batch of another shape raises before anything is sent."""

    def body():
        rank = current_comm().rank
        stage = PipelineStage(_stage_module(rank, 2), rank, 2, "cpu")
        schedule = ScheduleGPipe(stage, M, loss_fn=_loss)
        tokens, target = _batches()[0]
        schedule.step(*((tokens,) if rank == 0 else ()), target=target if rank == 1 else None)
        twice = torch.cat([tokens, tokens]), torch.cat([target, target])
        schedule.step(*((twice[0],) if rank == 0 else ()), target=twice[1] if rank == 1 else None)

    with pytest.raises(
        so.ShardingError, match=r"micro-batch \(int64\[4, 8\]\) differs from the first step's \(int64\[2, 8\]\)"
    ):
        so.run(body, 2, timeout=10)


class _FailsWhenArmed(nn.Module):
    """A stage module that raises in the forward of micro-batch `fail_at` of any step once armed."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.fail_at: int | None = None
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # (the first step's shape check runs under no_grad)
            self.calls += 1
            if self.fail_at is not None and self.calls == self.fail_at + 1:
                raise RuntimeError("injected failure")
        return self.inner(x)


def _failure_rank(schedule_name: str, out_dir: str) -> None:
    """A good first step, then stage 1 raises in the forward of micro-batch 2: writes what this rank raised and how
    long after the step started to `out_dir`/rank, and leaves the process at once once every rank has written.

    (A rank whose peers failed keeps receives that will never complete; gloo cannot cancel them, so the process's
    own teardown would wait on them or abort: the test reads files rather than run_gloo's results.)"""
    comm = current_comm()
    p, rank = comm.world_size, comm.rank
    module = _FailsWhenArmed(_stage_module(rank, p))
    cls: Any = get_schedule_class(schedule_name)  # a single-stage schedule
    schedule = cls(PipelineStage(module, rank, p, "cpu"), M, loss_fn=_loss)
    tokens, target = _batches()[0]
    inputs = (tokens,) if rank == 0 else ()
    kwargs: dict[str, Any] = {"target": target} if rank == p - 1 else {}
    schedule.step(*inputs, **kwargs)
    module.calls = 0
    module.fail_at = 2 if rank == 1 else None
    start = time.monotonic()
    try:
        schedule.step(*inputs, **kwargs)
        outcome = "no error"
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = f"{type(e).__name__}: {e} {' '.join(getattr(e, '__notes__', []))}"
    seconds = time.monotonic() - start
    out = Path(out_dir)
    (out / f"{rank}.tmp").write_text(f"{seconds}\n{outcome}")
    (out / f"{rank}.tmp").rename(out / str(rank))
    deadline = time.monotonic() + 60
    while len(list(out.glob("[0-9]"))) < p and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_gloo_failure_after_the_first_step_raises_on_every_rank_at_once(schedule, tmp_path):
    """Stage 1 raises in a later step: every rank raises within seconds, not after the process groups' 120 s
    timeout; the failing rank's error names its action, the others' name it and their own."""
    pg_timeout = 120
    with pytest.raises(RankFailure, match="without a result"):  # the ranks leave by os._exit, results in files
        run_gloo(_failure_rank, 4, schedule, str(tmp_path), timeout=3 * pg_timeout, pg_timeout=pg_timeout)
    deadline = time.monotonic() + 30  # the parent stops at the first rank's exit; the others are writing
    while len(list(tmp_path.glob("[0-9]"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    where = "stage 1's forward of micro-batch 2 (1F2) on rank 1: RuntimeError: injected failure"
    for rank in range(4):
        seconds, message = (tmp_path / str(rank)).read_text().split("\n", 1)
        assert float(seconds) < 15, (rank, seconds, message)
        if rank == 1:
            assert message.startswith("RuntimeError: injected failure") and "raised in stage 1's forward" in message
        else:
            assert message.startswith("CollectiveError") and where in message, message
            assert f"on rank {rank}, receiving from rank" in message, message


def test_schedule_arguments():
    with pytest.raises(so.ShardingError, match="unknown schedule"):
        get_schedule_class("Nope")
    assert get_schedule_class("1f1b") is Schedule1F1B and get_schedule_class("ScheduleGPipe") is ScheduleGPipe
    assert get_schedule_class("LoopedBFS") is ScheduleLoopedBFS
    assert get_schedule_class("interleaved1f1b") is ScheduleInterleaved1F1B
    assert get_schedule_class("ZBVZeroBubble") is ScheduleZBVZeroBubble
    assert get_schedule_class("ScheduleInterleavedZeroBubble") is ScheduleInterleavedZeroBubble

    def body():
        with pytest.raises(so.ShardingError, match="stage_index 5 is not in"):
            PipelineStage(nn.Linear(2, 2), 5, 2, "cpu")
        stage = PipelineStage(nn.Linear(2, 2), current_comm().rank, 2, "cpu")
        with pytest.raises(so.ShardingError, match="n_microbatches must be a positive int"):
            ScheduleGPipe(stage, 0)
        # fewer micro-batches than the interleaved schedule's rounds need
        with pytest.raises(so.ShardingError, match="n_microbatches=3 is not a multiple of the pipeline's 2 ranks"):
            ScheduleInterleaved1F1B([stage], 3)
        with pytest.raises(so.ShardingError, match="takes exactly 2 stages per rank"):
            ScheduleZBVZeroBubble([stage], 4)
        with pytest.raises(so.ShardingError, match="n_microbatches=5 is not a multiple of its 2 rounds"):
            ScheduleInterleavedZeroBubble([stage], 5)  # torch's rule: rounds of max(1, m // p)
        from shardops.fsdp import fully_shard, replicate

        dp_mesh = so.init_device_mesh("cpu", (2,))
        sharded = PipelineStage(fully_shard(nn.Linear(2, 2), mesh=dp_mesh), current_comm().rank, 2, "cpu")
        with pytest.raises(so.ShardingError, match="has fully_shard units; .* does not compose with data paral"):
            ScheduleInterleavedZeroBubble([sharded], 2)
        # replicate all-reduces at the end of I's backward, before W made the weights' gradients: refused
        replicated = PipelineStage(replicate(nn.Linear(2, 2), device_mesh=dp_mesh), current_comm().rank, 2, "cpu")
        with pytest.raises(so.ShardingError, match="has replicate; .* does not compose with data parallelism"):
            ScheduleInterleavedZeroBubble([replicated], 2)

    so.run(body, 2)


# ------------------------------------------------------------------ point to point


def _p2p_rank() -> tuple:
    comm = current_comm()
    rank, peer = comm.rank, comm.rank ^ 1
    mine = torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * rank
    got = torch.empty(2, 3, dtype=torch.float64)
    with so.CommDebugMode() as cm:
        # both ranks send and receive in one batch: no deadlock
        for w in comm.batch_isend_irecv([P2POp("isend", mine, peer), P2POp("irecv", got, peer)]):
            w.wait()
        if rank % 2 == 0:
            comm.send(torch.tensor([True, False]), peer)
        else:
            flags = comm.recv((2,), peer, dtype=torch.bool)
            assert flags.tolist() == [True, False]
    return got, cm.get_comm_counts(), cm.get_total_bytes(), cm.get_rounds()


def _check_p2p(results: list[tuple]) -> None:
    for rank, (got, counts, nbytes, rounds) in enumerate(results):
        sender = rank % 2 == 0
        assert torch.equal(got, torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * (rank ^ 1))
        assert counts == ({"send": 2, "recv": 1} if sender else {"send": 1, "recv": 2})
        assert nbytes == 6 * 8 + (2 if sender else 0)  # the sender counts the bytes
        assert rounds == 2


def test_p2p_batch_send_recv_counts():
    _check_p2p(so.run(_p2p_rank, 4))  # under gloo: test_gloo_equals_single_device_training


def test_threads_recv_without_a_sender_raises_after_the_timeout():
    import time

    def body():
        comm = current_comm()
        if comm.rank == 1:
            comm.recv((2,), 0)
        else:
            time.sleep(2.0)  # alive, but never sends

    start = time.monotonic()
    with pytest.raises(so.CollectiveError, match="did not send it within the timeout"):
        so.run(body, 2, timeout=0.5)
    assert time.monotonic() - start < 10


def test_p2p_argument_errors():
    def body():
        comm = current_comm()
        with pytest.raises(so.ShardingError, match="to or from itself"):
            comm.send(torch.zeros(1), comm.rank)
        with pytest.raises(so.ShardingError, match="not a rank of the group"):
            comm.send(torch.zeros(1), 7)
        mesh = so.init_device_mesh("cpu", (2,))
        d = so.distribute_tensor(torch.zeros(4), mesh, [so.Shard(0)])
        with pytest.raises(so.ShardingError, match="to_local"):
            comm.send(d, 1 - comm.rank)

    so.run(body, 2)


def test_get_group_is_the_ranks_along_the_dim():
    def body():
        mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        with pytest.raises(so.ShardingError, match="pass mesh_dim"):
            mesh.get_group()
        return mesh.get_group("pp").ranks, mesh.get_group(1).ranks, mesh["pp"].get_group().ranks

    assert so.run(body, 4) == [
        ((0, 2), (0, 1), (0, 2)),
        ((1, 3), (0, 1), (1, 3)),
        ((0, 2), (2, 3), (0, 2)),
        ((1, 3), (2, 3), (1, 3)),
    ]


# ------------------------------------------------------------------ with tensor parallelism


def _pp_tp_rank() -> dict:
    """(pp=2, tp=2): each stage tensor-parallel on mesh["tp"] (sequence parallel: the residual stream is
    each tp rank's sequence shard), the stages joined over mesh["pp"]."""
    from shardops.models import llama_plan
    from shardops.parallel import parallelize_module

    mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    s = mesh.get_local_rank("pp")
    module = _stage_module(s, 2)
    plan = {
        k: v
        for k, v in llama_plan(loss_parallel=False).items()
        if k.startswith("layers") or getattr(module, k, None) is not None
    }
    parallelize_module(module, mesh["tp"], plan)
    stage = PipelineStage(module, s, 2, "cpu", group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, M, loss_fn=_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
    out: dict[str, Any] = {"losses": [], "grads": [], "sends": []}
    for tokens, target in _batches():
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        with so.CommDebugMode() as cm:
            schedule.step(*((tokens,) if s == 0 else ()), target=target if s == 1 else None, losses=losses)
        out["losses"].append([x.item() for x in losses])
        out["grads"].append(
            {
                n: (_full(q.grad) if hasattr(q.grad, "full_tensor") else _grad(q)).clone()
                for n, q in module.named_parameters()
            }
        )
        out["sends"].append([b for kind, b in cm.log if kind == "send"])
        opt.step()
    out["params"] = {
        n: (q.full_tensor() if hasattr(q, "full_tensor") else q).detach().clone() for n, q in module.named_parameters()
    }
    return out


def test_pp2_tp2_equals_single_device_training(strict, reference):
    results = so.run(_pp_tp_rank, 4)
    # tensor parallelism sums the matmuls' partial products in another order: after two AdamW steps the
    # smallest gradients (~1e-5) differ by ~1.1e-5 relative (measured); 1e-5 holds without tp
    _check_equals_reference(results, reference, tol=3e-5)
    # each tp rank sends its sequence shard of the activations (nothing gathered): half a micro-batch's bytes
    for r in results:
        assert r["sends"][1] == [ACT_BYTES // 2] * M
    assert sum(sum(r["sends"][1]) for r in results) == 2 * M * ACT_BYTES


def _two_linears() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))


def _dtensor_boundary_rank() -> dict:
    """Stage 0's output stays a DTensor (Shard(-1), use_local_output=False): its local shard and layout cross."""
    from shardops.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    s = mesh.get_local_rank("pp")
    layer = _two_linears()[s]
    style = ColwiseParallel(use_local_output=False) if s == 0 else RowwiseParallel(input_layouts=so.Shard(-1))
    parallelize_module(layer, mesh["tp"], style)
    stage = PipelineStage(layer, s, 2, "cpu", group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, M, loss_fn=F.mse_loss)
    x, y = (
        torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(2)),
        torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(3)),
    )
    schedule.step(*((x,) if s == 0 else ()), target=y if s == 1 else None)  # the first step also checks the shapes
    layer.zero_grad()
    with so.CommDebugMode() as cm:
        losses: list[torch.Tensor] = []
        schedule.step(*((x,) if s == 0 else ()), target=y if s == 1 else None, losses=losses)
    grads = {f"{s}.{n}": _full(q.grad) for n, q in layer.named_parameters()}
    return {
        "grads": grads,
        "sends": [b for kind, b in cm.log if kind == "send"],
        "losses": [x.item() for x in losses],
        "explained": schedule.explain(),
    }


def test_dtensor_crosses_a_boundary_as_its_local_shard(strict):
    model = _two_linears()
    x, y = (
        torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(2)),
        torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(3)),
    )
    loss = sum(F.mse_loss(model(xm), ym) for xm, ym in zip(x.chunk(M), y.chunk(M))) / M
    loss.backward()
    results = so.run(_dtensor_boundary_rank, 4)
    grads = {n: g for r in results for n, g in r["grads"].items()}
    for n, q in model.named_parameters():
        assert _rel(grads[n], q.grad) <= TOL, n
    assert sum(results[2]["losses"]) / M == pytest.approx(loss.item(), rel=TOL)
    local_act = (BATCH // M) * (32 // 2) * 4  # each tp rank's half of the 32 features
    assert [r["sends"] for r in results] == [[local_act] * M] * 2 + [[local_act] * M] * 2
    for r in results:  # explain prices the local shard that crosses, not the DTensor's global shape
        assert r["explained"].get_total_bytes() == sum(r["sends"])
        assert "S1; local [2, 16]" in str(r["explained"])


def _explain_before_a_step_rank(declare: bool) -> str:
    s = current_comm().rank
    layer = _two_linears()[s]
    example = {"input_args": torch.randn(BATCH // M, 16)} if s == 0 else {"input_args": torch.randn(BATCH // M, 32)}
    if s == 0:
        example["output_args"] = torch.randn(BATCH // M, 32)
    stage = PipelineStage(layer, s, 2, "cpu", **(example if declare else {}))
    schedule = Schedule1F1B(stage, M, loss_fn=F.mse_loss)
    try:
        return str(schedule.explain())
    except so.ShardingError as e:
        return f"error: {e}"


def test_explain_before_the_first_step_needs_declared_shapes():
    """Before a step, explain knows the boundary shapes only from input_args/output_args: without them it says so."""
    assert all("run one step first" in text for text in so.run(_explain_before_a_step_rank, 2, False))
    first, last = so.run(_explain_before_a_step_rank, 2, True)
    one = (BATCH // M) * 32 * 4  # a micro-batch's boundary tensor, float32
    assert "program: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3" in first  # 1F1B on stage 0 of 2: one warm-up forward
    assert f"send activations to rank 1: {M} x (float32[2, 32]) = {M * one:,} B" in first
    assert f"recv gradients from rank 1: {M} x (float32[2, 32])" in first
    assert f"total: {M} sends ({M * one:,} B), {M} receives" in last


def test_forward_only_returns_the_last_stages_outputs():
    model = _two_linears()
    x = torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(4))

    def body():
        s = current_comm().rank
        stage = PipelineStage(_two_linears()[s], s, 2, "cpu")
        schedule = Schedule1F1B(stage, M)  # no loss_fn: forwards only
        out = schedule.step(*((x,) if s == 0 else ()))
        return out, [str(a) for a in schedule.executed_actions], len(stage._outputs)

    (first, first_actions, _), (last, last_actions, kept) = so.run(body, 2)
    assert first is None and torch.allclose(last, model(x).detach(), rtol=TOL, atol=1e-7)
    assert first_actions == [f"0F{i}" for i in range(M)] and last_actions == [f"1F{i}" for i in range(M)]
    assert kept == 0  # nothing held for a backward that will not come


def test_p2p_in_the_dry_world_is_counted_and_moves_nothing():
    from shardops.comm.dry import DryCommunicator
    from shardops.world import run_dry

    def body():
        comm = current_comm()
        with so.CommDebugMode() as cm:
            comm.send(torch.empty(4, device="meta"), 3)
            got = comm.recv(torch.empty(2, 3, device="meta"), 3)
        with pytest.raises(so.ShardingError, match="meta tensors only"):
            comm.send(torch.zeros(1), 3)
        return cm.get_comm_counts(), cm.get_total_bytes(), got.shape

    comm = DryCommunicator(1, 8)
    assert run_dry(body, comm) == ({"send": 1, "recv": 1}, 16, (2, 3))
    assert not comm.symmetric


# ------------------------------------------------------------------ with data parallelism


def _train_stage(
    module: nn.Module, schedule: Any, s: int, d: int, rows: int, loss_value: Callable[[torch.Tensor], float]
) -> dict:
    """3 AdamW steps of stage `s` of a pp=2 pipeline fed dp rank `d`'s rows: each step's micro-batch losses,
    gradients (whole), sends, reduce_scatters and all_reduces, and the final parameters (whole)."""
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
    out: dict = {"losses": [], "grads": [], "sends": [], "reduce_scatters": [], "all_reduces": []}
    for tokens, target in _batches():
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        with so.CommDebugMode() as cm:
            schedule.step(
                *((tokens[d * rows : (d + 1) * rows],) if s == 0 else ()),
                target=target[d * rows : (d + 1) * rows] if s == 1 else None,
                losses=losses,
            )
        out["losses"].append([loss_value(x) for x in losses])
        out["grads"].append({n: _full(q.grad).clone() for n, q in module.named_parameters()})
        out["sends"].append([b for kind, b in cm.log if kind == "send"])
        out["reduce_scatters"].append(cm.get_comm_counts().get("reduce_scatter", 0))
        out["all_reduces"].append(cm.get_comm_counts().get("all_reduce", 0))
        opt.step()
    out["params"] = {n: _full(q).detach().clone() for n, q in module.named_parameters()}
    return out


def _pp_dp_rank() -> dict:
    """(pp=2, dp=2): each stage `replicate`d over mesh["dp"]; activations are plain local tensors with
    this rank's rows, as under torch's DDP."""
    from shardops.fsdp import replicate

    mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    s, d = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    module = _stage_module(s, 2)
    replicate(module, device_mesh=mesh["dp"])
    stage = PipelineStage(module, s, 2, "cpu", group=mesh["pp"].get_group())
    return _train_stage(module, Schedule1F1B(stage, M, loss_fn=_loss), s, d, BATCH // 2, lambda x: x.item())


def _check_mean_local_loss(results: list[dict], ref: dict) -> None:
    """The last stage's ranks each saw their own rows: the global loss is the mean of their local losses."""
    last = [r for r in results if r["losses"][0]]
    for step in range(STEPS):
        mean = sum(sum(r["losses"][step]) / M for r in last) / len(last)
        assert mean == pytest.approx(ref["losses"][step], rel=TOL)


def test_pp2_dp2_equals_single_device_training(strict, reference):
    results = so.run(_pp_dp_rank, 4)
    _check_mean_local_loss(results, reference)
    _check_equals_reference(results, reference, losses=False)
    # each dp rank sends its own rows of each micro-batch (half of it): nothing gathered across dp
    for r in results:
        assert r["sends"][1] == [ACT_BYTES // 2] * M
        # the micro-batches' gradients accumulate unreduced: one bucket all_reduce per step, not one per micro-batch
        assert r["all_reduces"] == [1] * STEPS


def _pp_dp_tp_rank() -> dict:
    """(pp=2, dp=2, tp=2): each stage tensor-parallel on mesh["tp"], then `replicate` on mesh["dp"]."""
    from shardops.fsdp import replicate
    from shardops.models import llama_plan
    from shardops.parallel import parallelize_module

    mesh = so.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    s, d = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    module = _stage_module(s, 2)
    plan = {
        k: v
        for k, v in llama_plan(loss_parallel=False).items()
        if k.startswith("layers") or getattr(module, k, None) is not None
    }
    parallelize_module(module, mesh["tp"], plan)
    replicate(module, device_mesh=mesh["dp"])
    stage = PipelineStage(module, s, 2, "cpu", group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, M, loss_fn=_loss)  # plain (gathered) logits: each dp rank's own loss, as under DDP
    return _train_stage(module, schedule, s, d, BATCH // 2, lambda x: x.item())


def test_pp2_dp2_tp2_equals_single_device_training(strict, reference):
    results = so.run(_pp_dp_tp_rank, 8)
    # the last stage's two dp ranks (ranks 4 and 6: tp rank 0) report their own rows' losses: their mean is the batch's
    for step in range(STEPS):
        per_dp = [sum(results[r]["losses"][step]) / M for r in (4, 6)]
        assert sum(per_dp) / 2 == pytest.approx(reference["losses"][step], rel=TOL)
    for r in results:
        assert r["sends"][1] == [ACT_BYTES // 4] * M  # this rank's rows (dp) of its sequence shard (tp)
    _check_equals_reference(results, reference, tol=3e-5, losses=False)  # tp's summation order: see test_pp2_tp2_...


def _pp_fsdp_rank(schedule_name: str) -> dict:
    """(pp=2, dp=2): each stage's layers and the stage itself under fully_shard on mesh["dp"];
    activations are plain local tensors with this rank's rows, as under torch's FSDP2."""
    from shardops.fsdp import fully_shard

    mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    s, d = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    module = _stage_module(s, 2)
    for layer in module.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(module, mesh=mesh["dp"])
    stage = PipelineStage(module, s, 2, "cpu", group=mesh["pp"].get_group())
    cls: Callable[..., Any] = get_schedule_class(schedule_name)  # each class takes its own stage arguments
    out = _train_stage(module, cls(stage, M, loss_fn=_loss), s, d, BATCH // 2, lambda x: x.item())
    out["units"] = len(module.layers) + 1  # every layer, and the stage's own (embedding or norm + output)
    return out


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_pp2_with_fully_shard_stages_equals_single_device_training(strict, reference, schedule):
    results = so.run(_pp_fsdp_rank, 4, schedule)
    for r in results:  # the micro-batches' gradients accumulate unreduced: one reduce_scatter per unit and step
        assert r["reduce_scatters"] == [r["units"]] * STEPS
    # the last stage's ranks each saw their own rows: the global loss is the mean of their local losses
    last = [r for r in results if r["losses"][0]]
    for step in range(STEPS):
        mean = sum(sum(r["losses"][step]) / M for r in last) / len(last)
        assert mean == pytest.approx(reference["losses"][step], rel=TOL)
    _check_equals_reference(results, reference, losses=False)


# ------------------------------------------------------------------ checkpoints across pp degrees


def _tp_plan(module: nn.Module) -> dict:
    from shardops.models import llama_plan

    return {
        k: v
        for k, v in llama_plan(loss_parallel=False).items()
        if k.startswith("layers") or getattr(module, k, None) is not None
    }


def _whole(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
        for n, t in module.state_dict().items()
    }


def _pp2_tp2_save_rank(path: str) -> dict[str, torch.Tensor]:
    """One training step of (pp=2, tp=2), then each stage saves its module: the whole model's FQNs, tp shards."""
    from shardops.checkpoint import save
    from shardops.parallel import parallelize_module

    mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    s = mesh.get_local_rank("pp")
    module = _stage_module(s, 2)
    parallelize_module(module, mesh["tp"], _tp_plan(module))
    schedule = Schedule1F1B(PipelineStage(module, s, 2, "cpu", group=mesh["pp"].get_group()), M, loss_fn=_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
    tokens, target = _batches()[0]
    schedule.step(*((tokens,) if s == 0 else ()), target=target if s == 1 else None)
    opt.step()
    save({"model": module}, path)
    return _whole(module)


def _pp2_tp2_load_rank(path: str) -> dict[str, torch.Tensor]:
    from shardops.checkpoint import load
    from shardops.parallel import parallelize_module

    mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    module = _stage_module(mesh.get_local_rank("pp"), 2, seed=7)  # other values: the load must replace them
    parallelize_module(module, mesh["tp"], _tp_plan(module))
    load({"model": module}, path)
    return _whole(module)


def _tp4_load_rank(path: str) -> dict[str, torch.Tensor]:
    from shardops.checkpoint import load
    from shardops.parallel import parallelize_module

    model = Llama(ARGS, seed=7)
    parallelize_module(model, so.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)), _tp_plan(model))
    load({"model": model}, path)
    return _whole(model)


def _single_device_rank(path: str, save_path: str | None = None) -> dict[str, torch.Tensor]:
    """A whole unparallelized model loads the checkpoint; with `save_path`, it changes its values and saves them."""
    from shardops.checkpoint import load, save

    model = Llama(ARGS, seed=7)
    load({"model": model}, path)
    loaded = _whole(model)
    if save_path is not None:
        with torch.no_grad():
            for q in model.parameters():
                q.mul_(0.5).add_(0.25)
        save({"model": model}, save_path)
    return loaded


def test_checkpoint_across_pp_degrees(tmp_path):
    """Saved by (pp=2, tp=2) stages, loaded by (pp=1, tp=4) and by one device, and a single-device save
    loaded back by (pp=2, tp=2): the stages keep the whole model's names, so every load is exact."""
    saved_parts = so.run(_pp2_tp2_save_rank, 4, str(tmp_path / "pp2_tp2"))
    saved = {n: t for part in saved_parts for n, t in part.items()}
    assert set(saved) == set(Llama(ARGS, seed=0).state_dict())  # the stages' FQNs cover the whole model, once
    assert not all(torch.equal(t, Llama(ARGS, seed=7).state_dict()[n]) for n, t in saved.items())
    for loaded in so.run(_tp4_load_rank, 4, str(tmp_path / "pp2_tp2")):
        assert loaded.keys() == saved.keys() and all(torch.equal(loaded[n], saved[n]) for n in saved)
    [single] = so.run(_single_device_rank, 1, str(tmp_path / "pp2_tp2"), str(tmp_path / "single"))
    assert all(torch.equal(single[n], saved[n]) for n in saved)
    back = so.run(_pp2_tp2_load_rank, 4, str(tmp_path / "single"))
    changed = {n: t * 0.5 + 0.25 for n, t in saved.items()}
    for part in back:
        for n, t in part.items():
            assert torch.equal(t, changed[n]), n
    assert set().union(*back) == set(changed)


# ------------------------------------------------------------------ the benchmark beside torch's pipelining


@pytest.mark.slow
def test_benchmark_sends_what_torch_sends_and_computes_the_same_losses():
    """benchmarks/pipelining.py at a tiny size: both sides' p2p bytes equal (2 x m activations per boundary
    crossing ranks, per step) and their losses agree."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.pipelining import SIZES, measure_pipelining

    size = SIZES["tiny"]
    rows = measure_pipelining(size, schedules=["1F1B", "ZBVZeroBubble"])
    act = (size["batch"] // size["microbatches"]) * size["seq"] * size["dim"] * 4
    crossing = {"1F1B": 3, "ZBVZeroBubble": 6}  # ZBV: 8 stages, the V's turn (3 -> 4) stays on rank 3
    for r in rows:
        assert r["losses agree"], r
        assert r["torch bytes"] == r["shardops bytes"] == [crossing[r["schedule"]] * 2 * size["microbatches"] * act], r


# ------------------------------------------------------------------ the split backward


@pytest.mark.parametrize("tied", [False, True])
def test_split_backward_equals_autograd(tied):
    """I then W give torch.autograd's gradients for a LLaMA block, and for a weight used twice (W falls back
    to a whole backward there: from each use it would also run the other's share)."""
    from shardops.pipelining._split_backward import backward_input, backward_weight

    model = Llama(ARGS, seed=0)
    block, linear = model.layers["0"], nn.Linear(ARGS.dim, ARGS.dim)
    params = list(linear.parameters()) if tied else list(block.parameters())

    def run(x: torch.Tensor) -> torch.Tensor:
        return linear(torch.relu(linear(x))) if tied else block(x, model.freqs_cis[:SEQ])

    x = torch.randn(2, SEQ, ARGS.dim, generator=torch.Generator().manual_seed(5), requires_grad=True)
    out = run(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    expected = torch.autograd.grad(out, [x, *params], g)
    found, work = backward_input([run(x)], [g], [x], params)
    assert all(q.grad is None for q in params)  # I computes no weight gradient
    assert torch.allclose(found[0], expected[0], rtol=1e-6, atol=1e-7)
    backward_weight(work)
    for q, e in zip(params, expected[1:]):
        assert torch.allclose(q.grad, e, rtol=1e-6, atol=1e-7)
    assert len(work.starts) == (1 if tied else 9)  # the block: each of its 9 weights from its own branch
