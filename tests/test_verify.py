"""shardops verify: passes on the registered pointwise and view ops, and catches broken strategies."""

import io
import json
import math

import pytest
import torch
from rich.console import Console

from shardops import Partial, Replicate, Shard, ShardingError
from shardops import verify as V
from shardops.dispatch import registry
from shardops.mesh import DeviceMesh
from shardops.placements import NormPartial
from shardops.planner.rows import row
from shardops.verify import forcing
from shardops.verify import samples as verify_samples
from shardops.verify.cases import build
from shardops.verify.compare import MAX_SPLIT_SCALE, TOLERANCE, split_scale
from shardops.verify.layouts import Case
from shardops.verify.runner import run_cases

aten = torch.ops.aten
TEST_BUDGET = 4  # cases per op and mesh: the small budget for tests
MESHES = ["4", "2x2"]


def quiet_verify(ops, meshes=MESHES, **kw):
    out = io.StringIO()
    report = V.verify(
        ops, meshes, budget=kw.pop("budget", TEST_BUDGET), progress=False, console=Console(file=out, width=200), **kw
    )
    return report, out.getvalue()


# ------------------------------------------------------------------ the registered ops pass

POINTWISE_AND_VIEWS = [
    "aten.neg.default",
    "aten.add.Tensor",
    "aten.mul.Tensor",
    "aten.div.Scalar",
    "aten.exp.default",
    "aten.where.self",
    "aten.maximum.default",
    "aten.clamp.default",
    "aten.eq.Tensor",
    "aten.bitwise_and.Tensor",
    "aten.pow.Tensor_Scalar",
    "aten.view.default",
    "aten.reshape.default",
    "aten.transpose.int",
    "aten.permute.default",
    "aten.expand.default",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.select.int",
    "aten.slice.Tensor",
    "aten.split.Tensor",
    "aten.clone.default",
    "aten._to_copy.default",
    "aten.zeros_like.default",
    "aten.new_zeros.default",
]


@pytest.mark.parametrize("op", POINTWISE_AND_VIEWS)
def test_registered_op_passes(op):
    report, text = quiet_verify([op])
    assert report.ok, text
    row = next(iter(report.rows.values()))
    forced = len(row.algorithms_registered) * len(MESHES)  # one case per sharded algorithm and mesh
    assert row.cases == TEST_BUDGET * len(MESHES) + forced and row.passed == row.cases


def test_gradients_are_checked_for_float_ops():
    report, text = quiet_verify(["aten.mul.Tensor"], budget=8)
    assert report.ok, text
    assert report.rows["aten.mul"].grad_cases > 0


def test_every_registered_op_has_samples():
    """An op family added later is checked without anyone listing it, as long as a sample row matches it."""
    targets, _ = V.discover()
    missing = [t.name for t in targets if t.generator is None]
    assert not missing, f"add rows to verify_samples.SAMPLES for: {missing}"


def test_discovery_skips_out_and_inplace_variants():
    targets, skipped = V.discover()
    names = {t.name for t in targets}
    assert "aten.add.Tensor" in names and "aten.add_.Tensor" not in names and "aten.add.out" not in names
    assert skipped["out= variants"] > 0 and skipped["in-place variants"] > 0


# ------------------------------------------------------------------ broken strategies are caught


def _patched(monkeypatch, op, extra_rows, drop_input=None):
    """The op's rule with rows added (and the rows taking `drop_input` removed, so the added one is chosen)."""
    original = registry.RULES[op]

    def rule(schema):
        kept = [r for r in original(schema) if drop_input is None or drop_input not in r.inputs]
        return kept + extra_rows(schema)

    monkeypatch.setitem(registry.RULES, op, rule)


def test_neg_keeping_pending_max_fails_with_a_reproduction(monkeypatch, capsys):
    # wrong on purpose: -max(a, b) is min(-a, -b), so P(max) must become P(min)
    _patched(
        monkeypatch, aten.neg.default, lambda schema: [row(Partial("max"), Partial("max"))], drop_input=Partial("max")
    )
    code = V.main(_args(op=["aten.neg.default"], mesh=["4"], budget=12))
    text = capsys.readouterr().out
    assert code == 1
    assert "repro: shardops verify --op aten.neg.default --mesh 4 --case" in text
    assert "P(max)" in text


def test_local_reduction_over_sharded_dim_fails(monkeypatch, capsys):
    assert aten.sum.dim_IntList in registry.RULES, "sum is not registered"

    def local_claim(schema):  # wrong on purpose: summing a shard of the reduced dim is not the full sum
        spec = schema.self_spec
        return (
            [row(Replicate(), Shard(d)) for d in schema.dims("dim") if spec.shape[d] > 1]
            if schema.arg("keepdim")
            else []
        )

    monkeypatch.setitem(registry.RULES, aten.sum.dim_IntList, lambda schema: local_claim(schema) + [])
    code = V.main(_args(op=["aten.sum.dim_IntList"], mesh=["4"], budget=12))
    text = capsys.readouterr().out
    assert code == 1
    assert "repro: shardops verify --op aten.sum.dim_IntList --mesh 4 --case" in text


def test_reproduction_line_reruns_the_failing_case(monkeypatch, capsys):
    _patched(monkeypatch, aten.exp.default, lambda schema: [row(Partial("sum"), Partial("sum"))])  # exp is not linear
    report, _ = quiet_verify(["aten.exp.default"], ["4"], budget=12)
    assert not report.ok
    failure = report.failures[0]
    assert failure.repro.endswith(f"--case {failure.case} --budget 12")
    code = V.main(_args(op=["aten.exp.default"], mesh=["4"], budget=12, case=failure.case))
    assert code == 1
    assert f"case {failure.case}" in capsys.readouterr().out


def test_an_op_without_samples_is_reported_not_skipped(monkeypatch):
    monkeypatch.setitem(registry.RULES, aten._cdist_forward.default, lambda schema: [])  # an op with no sample row
    report, text = quiet_verify(["aten._cdist_forward.default"], ["4"])
    assert report.ok
    assert report.rows["aten._cdist_forward"].status == "no samples"
    assert "no samples" in text and "aten._cdist_forward.default" in text


def test_json_report(tmp_path):
    path = tmp_path / "verify.json"
    report, _ = quiet_verify(["aten.neg.default"], ["4"], json_path=str(path))
    data = json.loads(path.read_text())
    assert data["ok"] is True and data["cases"] == report.cases
    assert data["ops"][0]["op"] == "aten.neg" and data["ops"][0]["passed"] == TEST_BUDGET


def test_case_out_of_range_is_a_clear_error():
    with pytest.raises(ShardingError, match="has cases 0..3"):
        quiet_verify(["aten.neg.default"], ["4"], case=99)


def test_parts_split_a_run_into_disjoint_halves(monkeypatch):
    whole, _ = quiet_verify(["aten.neg.default"], ["4"], budget=6)
    halves = [quiet_verify(["aten.neg.default"], ["4"], budget=6, part=f"{k}/2")[0] for k in range(2)]
    assert [h.cases for h in halves] == [(whole.cases + 1) // 2, whole.cases // 2]
    assert all(h.ok for h in halves)
    _patched(monkeypatch, aten.neg.default, lambda schema: [row(Partial("max"), Partial("max"))], Partial("max"))
    failing = {f.case for f in quiet_verify(["aten.neg.default"], ["4"], budget=6)[0].failures}
    parts = [quiet_verify(["aten.neg.default"], ["4"], budget=6, part=f"{k}/2")[0] for k in range(2)]
    assert failing and {f.case for h in parts for f in h.failures} == failing  # same case numbers: --case repros
    with pytest.raises(ShardingError, match="not K/N"):
        quiet_verify(["aten.neg.default"], ["4"], part="2/2")


def _args(op, mesh, budget=None, case=None, full=False):
    import argparse

    return argparse.Namespace(
        op=op,
        mesh=mesh,
        budget=budget,
        seed=0,
        case=case,
        part=None,
        json=None,
        list=False,
        no_progress=True,
        full=full,
    )


# ------------------------------------------------------------------ pending inputs cannot pass by luck

KINDS = [Partial("sum"), Partial("avg"), Partial("max"), Partial("min"), Partial("product"), NormPartial(2)]
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.int64, torch.bool]
# the pending kinds verify gives each dtype (e.g. no P(avg) for integers, only P(max)/P(min) for bools)
USED = [(k, d) for d in DTYPES for k in KINDS if k in V.alphabet(torch.zeros(1, dtype=d))]


@pytest.mark.parametrize("kind, dtype", USED, ids=[f"{k!r}-{str(d).removeprefix('torch.')}" for k, d in USED])
@pytest.mark.parametrize("m", [2, 4, 8])
def test_pending_pieces_resolve_exactly(kind, dtype, m):
    x = verify_samples.make_tensor((5, 3), dtype, torch.Generator().manual_seed(1))
    pieces = verify_samples.split_pending(x, kind, m, torch.Generator().manual_seed(2))
    resolved = verify_samples.resolve_pending(pieces, kind)
    if isinstance(kind, NormPartial):
        torch.testing.assert_close(
            resolved.double(), x.double().abs(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-6, atol=0
        )
    else:
        assert torch.equal(resolved, x)
    if kind in (Partial("max"), Partial("min")):
        stacked = torch.stack(pieces)
        holders = (stacked == x).sum(0)
        assert bool((holders >= 1).all())
        if dtype != torch.bool:  # the others hold strictly smaller (max) / larger (min) values
            assert bool((holders == 1).all())


def test_sum_pieces_differ_from_an_even_split():
    x = verify_samples.make_tensor((4, 4), torch.float64, torch.Generator().manual_seed(0))
    pieces = verify_samples.split_pending(x, Partial("sum"), 4, torch.Generator().manual_seed(0))
    assert all(not torch.allclose(p, x / 4) for p in pieces)
    assert any(bool((p * x < 0).any()) for p in pieces)  # sign changes


def test_sampled_cases_are_deterministic_and_cover_every_kind():
    target = next(t for t in V.discover()[0] if t.name == "aten.exp.default")
    prepared, _ = V.prepare(target, 0)
    a = V.sampled_cases(prepared, (4,), 12, 7)
    b = V.sampled_cases(prepared, (4,), 12, 7)
    assert a == b
    kinds = {c.layouts[0][0] for c in a}
    assert set(V.coverage_slots(prepared)) <= kinds


def test_compare_rules():
    t = torch.tensor([1.0, math.nan, math.inf])
    assert V.compare(t, t.clone(), 0)[1] is None
    assert V.compare(torch.tensor([1.0, 0.0, math.inf]), t, 1)[1] is not None  # NaN moved
    assert V.compare(torch.tensor([1, 2]), torch.tensor([1, 3]), 1.0)[1] is not None  # ints are exact
    assert V.compare(torch.tensor([1.0 + 1e-12]), torch.tensor([1.0], dtype=torch.float64).float(), 1e-5)[1] is None


# --------------------------------------------------------- every sharded algorithm runs, not only the cost model's pick


def test_both_softmax_variants_run_and_are_reported(tmp_path):
    from shardops.ops import softmax

    path = tmp_path / "verify.json"
    report, text = quiet_verify(
        ["aten._softmax.default", "aten._log_softmax.default"], ["4", "2x2"], budget=1, json_path=str(path)
    )
    assert report.ok, text
    ops = {o["op"]: o for o in json.loads(path.read_text())["ops"]}
    for name in ("aten._softmax", "aten._log_softmax"):
        entry = ops[name]
        assert {softmax.LABEL_GATHER, softmax.LABEL_TWO_REDUCES} <= set(entry["algorithms_registered"])
        assert (
            entry["algorithms_run"][softmax.LABEL_GATHER] >= 1
            and entry["algorithms_run"][softmax.LABEL_TWO_REDUCES] >= 1
        )
        assert entry["algorithms_not_run"] == []


def test_a_registered_algorithm_that_never_ran_fails_the_run():
    from shardops.verify.report import OpRow, VerifyReport

    row = OpRow("aten.x", cases=3, passed=3)
    row.algorithms_registered = {"sharded x"}
    report = VerifyReport({"aten.x": row}, [], {}, {})
    assert not report.ok and row.status == "NOT RUN"
    row.algorithms_run["sharded x"] += 1
    assert report.ok and row.status == "ok"


def test_forcing_runs_the_named_algorithm_and_records_it():
    import shardops as so
    from shardops.ops import softmax
    from shardops.verify import forcing

    x = torch.randn(4, 10, dtype=torch.float64)

    def per_rank():
        mesh = so.init_device_mesh("cpu", (4,))
        dx = so.distribute_tensor(x, mesh, [Shard(1)])
        with forcing.recording() as ran, so.CommDebugMode() as comm:
            y = torch.softmax(dx, dim=1)
        return ran, comm.get_comm_counts(), y.full_tensor()

    for label, kind in ((softmax.LABEL_TWO_REDUCES, "all_reduce"), (softmax.LABEL_GATHER, "all_gather")):
        with forcing.forcing(label):
            ran, counts, y = so.run(per_rank, 4)[0]
        assert ran == {label} and counts.get(kind, 0) >= 1
        torch.testing.assert_close(y, torch.softmax(x, 1))


REQUIRED_ALGORITHMS = [  # op -> how many sharded algorithms its samples must offer (verify forces each)
    ("aten._softmax.default", 2),
    ("aten._log_softmax.default", 2),
    ("aten.logsumexp.default", 1),
    ("aten.cumsum.default", 1),
    ("aten.cumprod.default", 1),
    ("aten.logcumsumexp.default", 1),
    ("aten.cummax.default", 1),
    ("aten.cummin.default", 1),
    ("aten.var.correction", 1),
    ("aten.std.correction", 1),
    ("aten.topk.default", 1),
    ("aten.histc.default", 1),
    ("aten.native_layer_norm.default", 1),
    ("aten._fused_rms_norm.default", 2),
    ("aten.nll_loss_forward.default", 1),
    ("aten.nll_loss_backward.default", 1),
]


@pytest.mark.parametrize("name, count", REQUIRED_ALGORITHMS, ids=[n for n, _ in REQUIRED_ALGORITHMS])
def test_samples_reach_the_sharded_algorithms(name, count):
    """The samples must offer each family's sharded algorithms, or verify would have nothing to force."""
    from shardops.verify import driver, references, targets

    target = next(t for t in targets.discover()[0] if t.name == name)
    prepared, _ = references.prepare(target, 0)
    assert len(set().union(*driver.algorithm_labels(target, prepared))) >= count


# ------------------------------------------------------------------ the tolerance of a case with pending inputs


def test_split_scale_is_the_pieces_magnitude_over_the_values():
    x = verify_samples.make_tensor((6, 5), torch.float32, torch.Generator().manual_seed(3))
    pieces = verify_samples.split_pending(x, Partial("sum"), 4, torch.Generator().manual_seed(4))
    expected = float(sum(p.double().abs().sum() for p in pieces) / x.double().abs().sum())
    assert 1.0 < split_scale(x, pieces, Partial("sum")) == pytest.approx(expected)  # signed pieces: larger
    assert split_scale(x, [x / 4] * 4, Partial("sum")) == pytest.approx(1.0)  # an even split rounds as x does
    assert split_scale(x, [x + 1, x - 1], Partial("avg")) > 1.0  # averaged pieces: their mean magnitude
    assert split_scale(x, [x, x - 1], Partial("max")) == 1.0  # one rank holds the value itself
    assert split_scale(x.abs(), [x.abs() * 0.5**0.5] * 2, NormPartial(2)) == 1.0
    assert split_scale(x.long(), [x.long(), -x.long()], Partial("sum")) == 1.0  # integers compare exactly
    assert split_scale(torch.zeros(3), [torch.ones(3), -torch.ones(3)], Partial("sum")) == MAX_SPLIT_SCALE


def test_a_pending_case_tolerance_follows_its_pieces_and_still_catches_a_wrong_rule(monkeypatch):
    # the weight gradient of a conv whose output gradient is P(sum) rounds on each rank's piece; the
    # looser tolerance must still fail a rule that claims that rank-local bias gradient is Replicate
    target = next(t for t in V.discover()[0] if t.name == "aten.convolution_backward.default")
    prepared, _ = V.prepare(target, 0)
    f32 = next(i for i, p in enumerate(prepared) if p.dtype == torch.float32 and p.sample.args[3] is not None)
    mesh = DeviceMesh("cpu", torch.arange(4))
    case = Case(0, f32, ((Partial("sum"),), (Replicate(),), (Replicate(),)))
    pending = build(target, prepared[f32], case, mesh, 0)
    plain = build(target, prepared[f32], Case(0, f32, ((Replicate(),),) * 3), mesh, 0)
    assert plain.tol == TOLERANCE[torch.float32] < pending.tol <= MAX_SPLIT_SCALE * plain.tol
    with forcing.installed():
        assert run_cases([pending], 4)[0].problem is None

    def wrong(schema):  # wrong on purpose: each rank's bias gradient sums only its own piece of grad
        present = [i for i, m in enumerate(schema.arg("output_mask")) if m]
        outs = [[Partial("sum"), Partial("sum"), Replicate()][i] for i in present]
        return [row(outs, [Partial("sum"), Replicate(), Replicate()])]

    _patched(monkeypatch, aten.convolution_backward.default, wrong, drop_input=Partial("sum"))
    with forcing.installed():
        outcome = run_cases([build(target, prepared[f32], case, mesh, 0)], 4)[0]
    assert outcome.problem is not None and outcome.error > 100 * pending.tol, outcome
