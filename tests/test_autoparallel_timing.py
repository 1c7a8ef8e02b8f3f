"""so.autoparallel's step-time objective (autoparallel/timing.py): the predictor's arithmetic against
figures computed here from the model's shapes and the link's alpha/beta, and a ranking by time that
differs from the ranking by bytes where the link's latency dominates."""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
import torch

import shardops as so
from shardops.autoparallel import language_model_loss, timing
from shardops.autoparallel.candidates import Candidate, plan_entries
from shardops.autoparallel.measure import on_meta
from shardops.autoparallel.plan import apply_candidate, batch_feed, mesh_names_for
from shardops.autoparallel.structure import find_structure
from shardops.cost import Link
from shardops.models import Llama, ModelArgs

IN, HIDDEN, OUT = 16, 64, 8
FLOPS_ONLY = timing.Compute(flop_rate=1e9, bandwidth=math.inf, kernel_overhead=0.0, dispatch_overhead=0.0)
COMM_ONLY = timing.Compute(flop_rate=math.inf, bandwidth=math.inf, kernel_overhead=0.0, dispatch_overhead=0.0)
DISPATCH_ONLY = timing.Compute(flop_rate=math.inf, bandwidth=math.inf, kernel_overhead=0.0, dispatch_overhead=1e-2)


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))


def _loss(out, x):
    return (out**2).mean()  # no target: nothing to lay out beside a DTensor output


def _profile(net, x, cand: Candidate, mesh_shape) -> timing.StepProfile:
    model, example = on_meta(net, (x,))
    entries = plan_entries(find_structure(model, example), cand)
    return timing.profile_dry(
        model,
        mesh_shape,
        mesh_names_for(cand),
        lambda m, mesh: apply_candidate(m, mesh, cand, entries),
        batch_feed(mesh_shape, cand),
        example,
        _loss,
    )


def test_data_parallel_step_time_is_the_flops_and_the_gradient_all_reduces_by_hand():
    """Data parallelism on (2,): each rank's Linears on half the batch (forward 2*b*k*n FLOPs per Linear;
    backward the weight gradients of both and the first input gradient of the second only, the model's
    input needing none), and replicate's one bucket (every gradient, well under 25 MB) all-reduced on a ring:
    2(n-1) alpha + 2(n-1)/n bytes / beta."""
    batch, n = 8, 2
    x = torch.randn(batch, IN)
    prof = _profile(_mlp(), x, Candidate(("dp",)), (n,))
    b = batch // n
    forward = 2 * b * IN * HIDDEN + 2 * b * HIDDEN * OUT
    backward = 2 * b * IN * HIDDEN + 2 * (2 * b * HIDDEN * OUT)
    assert prof.parts["forward + loss"].flops == forward
    assert prof.parts["backward"].flops == backward

    link = Link(latency=3e-4, bandwidth=2e8)
    got = timing.predict(prof, (link,), FLOPS_ONLY)
    grads = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT  # float32 elements of the gradients, one bucket
    all_reduces = 2 * (n - 1) * link.latency + 2 * (n - 1) / n * 4 * grads / link.bandwidth
    assert sum(got.comm.values()) == pytest.approx(all_reduces, rel=1e-12)
    assert sum(got.compute.values()) == pytest.approx((forward + backward) / 1e9, rel=1e-12)
    assert got.total == pytest.approx(all_reduces + (forward + backward) / 1e9, rel=1e-12)


def test_each_compute_term_is_its_count_over_its_rate():
    """The roofline terms add: streamed bytes over the bandwidth, a fixed cost per kernel and per DTensor op."""
    x = torch.randn(8, IN)
    prof = _profile(_mlp(), x, Candidate(("tp",), pairs_tp=(True,)), (2,))
    compute = timing.Compute(flop_rate=2e9, bandwidth=5e9, kernel_overhead=3e-6, dispatch_overhead=7e-5)
    got = timing.predict(prof, (Link(1e-4, 1e9),), compute)
    for name, part in prof.parts.items():
        want = part.flops / 2e9 + part.streamed_bytes / 5e9 + part.kernels * 3e-6 + part.dtensor_ops * 7e-5
        assert got.compute[name] == pytest.approx(want, rel=1e-12)
        assert part.kernels > 0 or name == "gradient sync"
    # the optimizer step runs on each rank's shard of every parameter: the kernels of AdamW's step (its second:
    # the first allocates the states) on plain tensors of the local shapes, counted here
    shapes = [(HIDDEN // 2, IN), (HIDDEN // 2,), (OUT, HIDDEN // 2), (OUT,)]
    local = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = torch.optim.AdamW(local, lr=1e-3, foreach=False)
    for p in local:
        p.grad = torch.ones_like(p)
    opt.step()
    with timing.KernelCounter() as counter:
        opt.step()
    assert prof.parts["optimizer step"].kernels == counter.part.kernels
    elements = sum(p.numel() for p in local)
    assert prof.parts["optimizer step"].streamed_bytes == counter.part.streamed_bytes > 4 * 4 * elements
    # each update op on a DTensor parameter is one call through shardops' dispatch, the same ops per parameter
    # (the step counter and its read are plain kernels)
    calls = prof.parts["optimizer step"].dtensor_ops
    assert 0 < calls < counter.part.kernels and calls % len(shapes) == 0


def test_time_and_bytes_rank_differently_when_dispatch_costs_dominate():
    """A small batch on (2,): the column/row pair all-reduces the output activation (batch x OUT floats),
    data parallelism its gradients (about 9 KB, one bucket): fewest bytes is the pair. But the pair runs its
    Linears on DTensors (shardops' dispatch per op) where data parallelism runs plain local tensors: under a
    per-DTensor-call cost that dominates, data parallelism is the faster plan."""
    batch = 8
    x = torch.randn(batch, IN)
    net = _mlp()
    weights = sum(p.numel() * 4 for p in net.parameters())
    assert batch * OUT * 4 < weights  # the activation all_reduce is the smaller

    by_bytes = so.autoparallel(net, (2,), (x,), loss_fn=_loss, objective="bytes", pricing="metadata")
    assert by_bytes.chosen.time is None and by_bytes.predicted_time is None  # bytes prices no time
    free_link = Link(latency=0.0, bandwidth=1e15)
    by_time = so.autoparallel(
        net, (2,), (x,), loss_fn=_loss, links=free_link, compute=DISPATCH_ONLY, objective="time", pricing="metadata"
    )
    assert by_bytes.candidate.dims == ("tp",) and by_time.candidate.dims == ("dp",)
    assert by_time.predicted_bytes > by_bytes.predicted_bytes
    # each plan's time is its DTensor calls times the per-call cost (links and kernels cost ~nothing)
    for s in by_time.considered:
        calls = sum(part.dtensor_ops for part in s.profile.parts.values())
        assert s.time.total == pytest.approx(calls * DISPATCH_ONLY.dispatch_overhead, rel=1e-6, abs=1e-9)
    # under a link where bytes dominate and compute is free, time agrees with bytes
    thin = Link(latency=0.0, bandwidth=1e6)
    agrees = so.autoparallel(
        net, (2,), (x,), loss_fn=_loss, links=thin, compute=COMM_ONLY, objective="time", pricing="metadata"
    )
    assert agrees.candidate.dims == ("tp",)


def test_explain_names_the_runner_up_with_the_time_and_bytes_between_them():
    x = torch.randn(8, IN)
    link = Link(latency=0.0, bandwidth=1e15)
    plan = so.autoparallel(
        _mlp(), (2,), (x,), loss_fn=_loss, links=link, compute=DISPATCH_ONLY, objective="time", pricing="metadata"
    )
    other = next(s for s in plan.considered if s is not plan.chosen)
    dt_ms = (other.time.total - plan.chosen.time.total) * 1e3
    db = other.measurement.total_bytes - plan.chosen.measurement.total_bytes
    text = plan.explain()
    assert dt_ms > 0 and db < 0  # the runner-up sends fewer bytes but takes longer
    assert f"mesh dim 0 'dp': dp; runner-up tp ({dt_ms:+.3f} ms, {db:+,} B)" in text
    assert "predicted step time" in str(plan)


def test_a_deep_model_profile_is_extrapolated_from_one_and_two_blocks():
    """Every block adds the same collectives, FLOPs and kernels: the 1- and 2-block copies' line gives the
    4-block model's profile exactly (what so.autoparallel prices a deep model by)."""
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))

    def profile(layers: int) -> timing.StepProfile:
        args = ModelArgs(dim=16, n_heads=4, hidden_dim=32, vocab_size=32, n_layers=layers, max_seq_len=16)
        model, example = on_meta(Llama(args, seed=0), (tokens,))
        structure = find_structure(model, example)
        cand = Candidate(("tp",), True, True, (True, True), embeddings_parallel=True)
        entries = plan_entries(structure, cand)
        return timing.profile_dry(
            model,
            (2,),
            mesh_names_for(cand),
            lambda m, mesh: apply_candidate(m, mesh, cand, entries, structure.blocks),
            batch_feed((2,), cand),
            example,
            language_model_loss,
        )

    line = timing.extrapolate_profile(profile(1), profile(2), 4)
    whole = profile(4)
    assert line.activation_bytes == whole.activation_bytes
    for name, part in line.parts.items():
        want = whole.parts[name]
        assert (part.flops, part.kernels, part.dtensor_ops) == (want.flops, want.kernels, want.dtensor_ops), name
        assert part.streamed_bytes == pytest.approx(want.streamed_bytes), name
        assert part.collectives == want.collectives, name
    assert whole.parts["forward + loss"].rounds > 0


def test_an_unknown_objective_or_compute_preset_is_a_clear_error():
    x = torch.randn(8, IN)
    with pytest.raises(so.ShardingError, match="objective"):
        so.autoparallel(_mlp(), (2,), (x,), loss_fn=_loss, objective="speed")
    with pytest.raises(so.ShardingError, match="compute preset"):
        so.autoparallel(_mlp(), (2,), (x,), loss_fn=_loss, compute="abacus")


def test_convolutions_are_priced_at_their_own_rate():
    """A conv's FLOPs (2 * batch * out * in * kh * kw * H * W, forward) go to the convolution rate."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4)
    )
    x = torch.randn(4, 3, 6, 6)
    prof = _profile(net, x, Candidate(("dp",)), (2,))
    b = 4 // 2
    conv = 2 * b * 8 * 3 * 9 * 6 * 6
    forward = prof.parts["forward + loss"]
    assert forward.conv_flops == conv and forward.flops == 2 * b * 8 * 6 * 6 * 4
    rates = timing.Compute(1e9, math.inf, 0.0, 0.0, conv_rate=1e8)
    assert timing.compute_time(forward, rates) == pytest.approx(conv / 1e8 + forward.flops / 1e9, rel=1e-12)


def test_a_candidate_the_dry_world_cannot_time_is_said_and_none_timed_raises(monkeypatch):
    """Under objective='time' a candidate whose dry profile fails is ranked last and named in the plan;
    if no feasible candidate can be timed, the planner raises instead of silently ranking by bytes."""
    ap = sys.modules["shardops.autoparallel"]  # the package (its name is also the function's)
    real = ap._profile
    x = torch.randn(8, IN)

    def only_tp(metas, shape, names, *args, **kwargs):
        if names == ("dp",):
            raise RuntimeError("no kernel for this in the dry world")
        return real(metas, shape, names, *args, **kwargs)

    monkeypatch.setattr(ap, "_profile", only_tp)
    plan = so.autoparallel(_mlp(), (2,), (x,), loss_fn=_loss, objective="time", pricing="metadata")
    assert plan.candidate.dims == ("tp",)
    assert "could not be timed and were ranked last" in str(plan) and "no kernel for this" in str(plan)

    def never(*args, **kwargs):
        raise RuntimeError("no kernel for this in the dry world")

    monkeypatch.setattr(ap, "_profile", never)
    with pytest.raises(so.ShardingError, match="could time none of the 2 feasible plans"):
        so.autoparallel(_mlp(), (2,), (x,), loss_fn=_loss, objective="time", pricing="metadata")


def test_each_collective_call_waits_for_the_last_peer():
    """sync_wait is charged once per collective call, in the part that makes it, on top of the ring model."""
    x = torch.randn(8, IN)
    prof = _profile(_mlp(), x, Candidate(("tp",), pairs_tp=(True,)), (2,))
    link = Link(1e-4, 1e9)
    plain = timing.predict(prof, (link,), COMM_ONLY)
    waiting = timing.predict(prof, (link,), dataclasses.replace(COMM_ONLY, sync_wait=3e-3))
    calls = {name: part.rounds for name, part in prof.parts.items()}
    assert calls["forward + loss"] == 1  # the pair's output all_reduce (the input needs no gradient: none backward)
    for name in prof.parts:
        assert waiting.comm[name] == pytest.approx(plain.comm[name] + calls[name] * 3e-3, rel=1e-12)
        assert waiting.compute[name] == plain.compute[name]


def test_cpu_attention_kernels_are_counted_as_flops():
    """scaled_dot_product_attention's CPU kernel (which torch's FLOP counter does not know) is priced by its
    two matmuls, Q K^T and P V: 4 * batch * heads * seq^2 * head_dim forward."""
    b, h, s, d = 2, 4, 16, 8
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    with timing.KernelCounter() as counter:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert counter.part.flops == 4 * b * h * s * s * d
    with timing.KernelCounter() as counter:
        out.sum().backward()
    # recomputing the scores, then the gradients of both matmuls' two operands: 5 matmuls of that size
    assert counter.part.flops == 10 * b * h * s * s * d


def test_the_fit_recovers_the_per_call_costs_a_step_was_made_of():
    """fit_timing's least squares: steps whose times are made here from their profiles under chosen rates
    (the bursts' slowed 1.5x), per-kernel, per-DTensor-call and per-collective costs give those back (and
    none negative)."""
    from shardops.training import fit_timing

    x = torch.randn(8, IN)
    cands = [Candidate(("dp",)), Candidate(("tp",), pairs_tp=(True,))]
    nets = [_mlp(), torch.nn.Sequential(*[m for _ in range(3) for m in (torch.nn.Linear(IN, IN), torch.nn.Tanh())])]
    profiles = [_profile(net, x, c, (2,)) for net in nets for c in cands]
    rates = timing.Compute(flop_rate=2e9, bandwidth=5e9, kernel_overhead=0.0, dispatch_overhead=0.0)
    link = Link(1e-4, 1e9)
    slow = dataclasses.replace(rates, flop_rate=2e9 / 1.5, bandwidth=5e9 / 1.5)
    truth = dataclasses.replace(slow, kernel_overhead=7e-6, dispatch_overhead=2e-4, sync_wait=5e-3)
    measured = [timing.predict(p, (link,), truth).total for p in profiles]
    fitted = fit_timing._fitted_overheads(rates, link, profiles, measured)
    assert fitted.flop_rate == pytest.approx(2e9 / 1.5, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(5e9 / 1.5, rel=1e-6)
    assert fitted.kernel_overhead == pytest.approx(7e-6, rel=1e-6)
    assert fitted.dispatch_overhead == pytest.approx(2e-4, rel=1e-6)
    assert fitted.sync_wait == pytest.approx(5e-3, rel=1e-6)
    # a cost the steps do not show comes back 0, not negative; kernels faster than the bursts' are not believed
    no_wait = [timing.predict(p, (link,), dataclasses.replace(truth, sync_wait=0.0)).total for p in profiles]
    assert fit_timing._fitted_overheads(rates, link, profiles, no_wait).sync_wait == pytest.approx(0.0, abs=1e-9)
    fast = dataclasses.replace(truth, flop_rate=4e9, bandwidth=1e10)
    at_rates = fit_timing._fitted_overheads(
        rates, link, profiles, [timing.predict(p, (link,), fast).total for p in profiles]
    )
    assert (at_rates.flop_rate, at_rates.bandwidth) == (2e9, 5e9)
