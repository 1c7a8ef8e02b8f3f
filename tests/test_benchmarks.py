"""The benchmarks in tiny configurations, so that none of them can rot.

Every benchmark has a smoke test in the default suite (comm, overhead, end to
end in a one-rank gloo world inside this process, planning, and `run.main`
end to end); the real two-process gloo run is behind `slow`.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# benchmarks/ sits at the repository root, beside src/; make it importable
# however pytest was started.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import end_to_end, overhead, planning, run  # noqa: E402
from benchmarks.cases import MESH_SHAPES, select_cases  # noqa: E402
from benchmarks.dtensor_side import measure_dtensor  # noqa: E402
from benchmarks.shardops_side import fallback_ops, measure_case, measure_shardops  # noqa: E402

import shardops as so  # noqa: E402
from bench_harness import RAISED, raising_case  # noqa: E402


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized()


# --- communication ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def comm_rows():
    names = ["sum", "softmax"]
    return run.compare_comm(measure_shardops(names, MESH_SHAPES), measure_dtensor(names, MESH_SHAPES))


def test_shardops_side_counts_rank0_and_checks_against_torch(comm_rows):
    assert [(r["case"], r["mesh"]) for r in comm_rows] == [(c, m) for c in ("sum", "softmax") for m in MESH_SHAPES]
    for r in comm_rows:
        s = r["shardops"]
        assert s["error"] is None and s["status"] == "ok" and s["correct"] is True, s
        assert s["rounds"] == len(s["calls"]) == sum(s["counts"].values())
        assert s["bytes"] == sum(c["bytes"] for c in s["calls"])
        assert s["lower_bound_bytes"] == r["DTensor"]["lower_bound_bytes"] > 0


def test_sum_over_the_sharded_dim_sends_one_f32_per_row(comm_rows):
    r = next(r for r in comm_rows if r["case"] == "sum" and r["mesh"] == (4,))
    # 8 rows, one f32 partial each: the floor, whichever algorithm the sum family uses.
    assert r["shardops"]["bytes"] == 32 == r["lower_bound_bytes"]
    assert r["ratio"] == 1.0 and r["bytes_target"] == "met"
    assert not r["dtensor_moves_sharded_dim"] and r["gather_target"] == "n/a"


def test_softmax_rows_are_judged_against_dtensor_gathering_the_shard(comm_rows):
    for r in (r for r in comm_rows if r["case"] == "softmax"):
        assert r["dtensor_moves_sharded_dim"]  # DTensor all-gathers the softmax dim
        saving = r["DTensor"]["bytes"] / max(r["shardops"]["bytes"], 1)
        if saving >= run.TARGET_GATHER_SAVING:
            assert r["gather_target"] == "met"
        else:
            assert r["gather_target"].startswith("missed")


def test_comm_table_has_a_row_per_case_and_mesh(comm_rows):
    table = run.format_comm_table(comm_rows)
    assert table.count("\n| softmax |") == 2 and table.count("\n| sum |") == 2
    assert "| sum | (2,2) | [S(0),S(1)] |" in table
    assert "≥ 30× less" in table.splitlines()[0]


def test_a_raising_op_is_an_error_row_not_a_crash():
    row = measure_case(raising_case(), (4,), reference=([], []))
    assert row["status"] == "raises" and row["correct"] is None and row["rounds"] == 0
    assert row["error"] == RAISED


def test_fallback_ops_are_named_once_each():
    def message(text, category=so.FallbackWarning):
        return warnings.WarningMessage(category(text), category, "f.py", 1)

    caught = [
        message("shardops: aten.cumsum.default has no sharded strategy; replicated its inputs ..."),
        message("shardops: aten.cumsum.default has no sharded strategy; replicated its inputs ..."),
        message("something else", UserWarning),
        message("shardops: aten.sort.stable has no sharded strategy; ..."),
    ]
    assert fallback_ops(caught) == ["aten.cumsum.default", "aten.sort.stable"]


def _side(status="ok", nbytes=100, error=None, fallbacks=()):
    return {"status": status, "bytes": nbytes, "error": error, "fallbacks": list(fallbacks)}


@pytest.mark.parametrize(
    "so_bytes, dt_bytes, floor, fallbacks, expected",
    [
        (10, 3000, 10, (), "met"),
        (200, 3000, 10, (), "missed"),
        (200, 3000, 200, (), "missed: the floor allows at most 15.0× less"),
        (3000, 3000, 10, ("aten.histc.default",), "missed: shardops falls back (aten.histc.default)"),
    ],
    ids=["saves-30x", "saves-less", "floor-forbids", "fallback"],
)
def test_gather_target_verdicts(so_bytes, dt_bytes, floor, fallbacks, expected):
    row = {
        "shardops": _side(nbytes=so_bytes, fallbacks=fallbacks),
        "DTensor": _side(nbytes=dt_bytes),
        "lower_bound_bytes": floor,
        "dtensor_moves_sharded_dim": True,
    }
    assert run._judge_gather(row) == expected


def test_byte_target_verdicts():
    assert run._judge_bytes(_side(), _side(), 1.0) == "met"
    assert run._judge_bytes(_side(), _side(), 1.2) == "missed"
    assert run._judge_bytes(_side(error="E"), _side(), None) == "missed: shardops raises"
    assert run._judge_bytes(_side(), _side(error="E"), None) == "n/a: DTensor raises"


# --- dispatch overhead ---------------------------------------------------------------------


def test_overhead_times_both_systems_on_the_fake_group():
    result = overhead.measure_overhead(("add", "softmax_sharded"), iters=20, repeats=2)
    if result["note"] is None:  # shardops ran on the fake process group (else: the fallback world, said so)
        assert result["comm"]["shardops"]["softmax_sharded"]  # 4 ranks: the sharded dim makes it communicate
    for system in overhead.SYSTEMS:
        assert all(v is not None and v > 0 for v in result["us"][system].values()), system
    assert result["comm"]["DTensor"]["add"] == {}
    assert result["comm"]["DTensor"]["softmax_sharded"]  # DTensor redistributes the softmax dim
    rows = {r["op"]: r for r in overhead.overhead_rows(result)}
    assert rows["add"]["target"] == overhead.TARGET_NO_COMM
    assert rows["softmax_sharded"]["target"] == overhead.TARGET_DTENSOR_REDISTRIBUTES
    table = overhead.format_overhead_table(result)
    assert "| add |" in table and "| softmax_sharded |" in table


def test_overhead_falls_back_to_a_one_rank_threads_world_and_says_so(monkeypatch):
    from shardops.world import in_threads_world

    real = overhead._shardops_table

    def fake_group_breaks(mesh_shape):
        if not in_threads_world():
            raise RuntimeError("torch_dist cannot do this")
        return real(mesh_shape)

    monkeypatch.setattr(overhead, "_shardops_table", fake_group_breaks)
    result = overhead.measure_overhead(("add",), iters=20, repeats=1)
    assert "torch_dist cannot do this" in result["note"] and "1-rank threads world" in result["world"]
    assert all(result["us"][s]["add"] > 0 for s in overhead.SYSTEMS)
    assert "Note:" in overhead.format_overhead_table(result)


def test_interleaved_timer_reports_every_system_and_op():
    calls = {"a": 0, "b": 0}

    def bump(name):
        def call():
            calls[name] += 1

        return call

    out = overhead.time_interleaved({"a": {"x": bump("a")}, "b": {"x": bump("b")}}, ["x"], iters=40, repeats=3)
    assert set(out) == {"a", "b"} and all(v["x"] > 0 for v in out.values())
    assert calls["a"] == calls["b"] > 3 * 40 - 1


def test_overhead_runs_standalone(capsys):
    threads = torch.get_num_threads()
    assert overhead.main(["--iters", "20", "--repeats", "1", "--ops", "add"]) == 0
    assert "| add |" in capsys.readouterr().out
    assert torch.get_num_threads() == threads  # main times on one thread and gives the rest back


# --- end to end ----------------------------------------------------------------------------


def test_end_to_end_steps_in_a_one_rank_gloo_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        result = end_to_end.rank_main(end_to_end.SIZES["tiny"])
    finally:
        dist.destroy_process_group()
    assert [r["step"] for r in result["rows"]] == [s.name for s in end_to_end.STEPS]
    for r in result["rows"]:
        assert r["shardops"]["error"] is None and r["shardops"]["correct"], r
        for system in end_to_end.SYSTEMS:
            entry = r[system]
            assert (entry["ms"] is None) == (entry["error"] is not None)
    result["summary"] = end_to_end.summarize(result)
    assert result["summary"]["common_steps"]
    assert "total, steps both run" in end_to_end.format_end_to_end_table(result)


def test_end_to_end_summary_counts_only_common_steps():
    def entry(ms):
        return {"ms": ms, "correct": True, "error": None if ms is not None else "E", "runs_ms": []}

    result = {
        "rows": [
            {"step": "a", "shardops": entry(1.0), "DTensor": entry(4.0)},
            {"step": "b", "shardops": entry(2.0), "DTensor": entry(None)},
        ]
    }
    s = end_to_end.summarize(result)
    assert s["common_steps"] == ["a"] and s["only"]["shardops"] == ["b"]
    assert s["ratio"] == 0.25 and s["met"] is True and s["all_steps_ms"]["shardops"] == 3.0


@pytest.mark.slow
def test_end_to_end_on_two_gloo_processes():
    result = end_to_end.measure_end_to_end("tiny", world_size=2, timeout=300)
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    for r in result["rows"]:
        assert r["shardops"]["error"] is None and r["shardops"]["correct"], r


# --- planning ------------------------------------------------------------------------------


def test_planning_rows_for_each_mesh_and_op():
    from shardops.redistribute import _plan_cached

    rows = planning.measure_planning([(4,), (2, 2)], min_reps=1, max_reps=1, budget_s=0.0)
    ops = list(planning.op_calls(so.DeviceMesh("cpu", torch.arange(4))).keys()) + [
        "redistribute -> R",
        "redistribute -> transposed",
    ]
    assert [(r["mesh"], r["op"]) for r in rows] == [(m, op) for m in ((4,), (2, 2)) for op in ops]
    assert all(r["total_us"] > 0 for r in rows)
    softmax_2d = next(r for r in rows if r["op"] == "softmax(dim=1)" and r["mesh"] == (2, 2))
    assert not softmax_2d["fallback"] and softmax_2d["candidates"] > 1
    assert _plan_cached.cache_info().currsize == 0  # nothing cached is left to skew the next measurement
    g = planning.growth(rows)
    assert set(g["add"]) == {1, 2}
    assert "growth per added mesh dim" in planning.format_growth_table(rows)
    assert "| softmax(dim=1) | (2,2) |" in planning.format_planning_table(rows)


def test_layouts_shard_the_reduced_dim_on_every_mesh_dim_but_the_first():
    assert planning.layout(1) == (so.Shard(1),)
    assert planning.layout(3) == (so.Shard(0), so.Shard(1), so.Shard(1))
    assert planning.transposed(3) == (so.Shard(1), so.Shard(0), so.Shard(0))


# --- the driver ----------------------------------------------------------------------------


def test_run_main_writes_every_output(tmp_path, monkeypatch):
    monkeypatch.setitem(run.QUICK, "planning", {"meshes": [(2,), (2, 2)], "max_reps": 1})
    code = run.main(
        [
            "--quick",
            "--only",
            "comm",
            "planning",
            "--cases",
            "sum",
            "--out",
            str(tmp_path),
            "--docs",
            str(tmp_path / "docs.md"),
        ]
    )
    assert code == 0
    snippet = (tmp_path / "README_SNIPPET.md").read_text()
    assert (tmp_path / "docs.md").read_text().startswith("<!-- generated by `shardops bench`")
    assert "shardops bench --quick" in snippet and "torch " + torch.__version__ in snippet
    assert "### Communication per op" in snippet and "### Planning time" in snippet and "### Targets" in snippet
    data = json.loads((tmp_path / "results.json").read_text())
    assert {"command", "machine", "targets", "results", "seconds"} <= set(data)
    assert [r["case"] for r in data["results"]["comm"]["rows"]] == ["sum", "sum"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp_path / "bytes_per_case.png").exists()
    else:
        assert (tmp_path / "bytes_per_case.png").stat().st_size > 1000


def test_a_crashing_benchmark_is_reported_and_the_rest_still_run(monkeypatch, tmp_path):
    def broken(cfg):
        raise RuntimeError("planner exploded")

    monkeypatch.setattr(run, "_planning", broken)
    code = run.main(
        ["--quick", "--only", "comm", "planning", "--cases", "sum", "--no-plot", "--out", str(tmp_path), "--docs", ""]
    )
    assert code == 1
    report = (tmp_path / "report.md").read_text()
    assert "planner exploded" in report and "| sum | (4,) |" in report


def test_a_failing_gloo_rank_is_named_in_the_report(monkeypatch, tmp_path):
    """A benchmark whose gloo rank raised:
    the targets row and the section name the rank's exception, with its traceback."""
    from shardops.training import launch

    def work():
        raise ModuleNotFoundError("No module named 'benchmarks'", name="benchmarks")

    def broken(cfg):
        try:
            work()
        except ModuleNotFoundError as e:
            raise launch._raised(1, launch._error_report(e)) from None

    monkeypatch.setattr(run, "_planning", broken)
    code = run.main(["--quick", "--only", "planning", "--no-plot", "--out", str(tmp_path), "--docs", ""])
    assert code == 1
    report = (tmp_path / "report.md").read_text()
    want = (
        "shardops.training.launch.RankFailure: run_gloo: rank 1 raised: "
        "ModuleNotFoundError: No module named 'benchmarks'"
    )
    assert f"| planning benchmark runs | **MISSED** | {want} |" in report
    assert "rank 1 (pid" in report and "in work" in report  # the rank's own traceback


def test_a_partial_run_leaves_the_docs_page_alone(monkeypatch, tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("the whole run's page")
    monkeypatch.setattr(run, "DOCS_PATH", docs)
    monkeypatch.setattr(run, "ROOT", tmp_path)
    code = run.main(["--quick", "--only", "comm", "--cases", "sum", "--no-plot", "--out", str(tmp_path / "out")])
    assert code == 0 and docs.read_text() == "the whole run's page"
    assert (tmp_path / "out" / "report.md").exists()


def test_no_matplotlib_means_no_chart_and_a_message(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    rows = [{"case": "sum", "mesh": (4,), "lower_bound_bytes": 32, "shardops": _side(), "DTensor": _side()}]
    message = run.plot_bytes(rows, tmp_path / "chart.png")
    assert message is not None and "matplotlib" in message
    assert not (tmp_path / "chart.png").exists()


def test_case_selection_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown benchmark case"):
        select_cases(["no_such_case"])


def test_ratio_is_taken_against_torchs_best_path():
    """Cross-entropy: DTensor's loss_parallel() moves far less than its default path; shardops is compared with it."""

    def side(nbytes, path="default", error=None):
        return {
            "case": "cross_entropy",
            "mesh": (4,),
            "placements": (("S(1)",),),
            "bytes": nbytes,
            "rounds": 3,
            "counts": {"all_reduce": 3},
            "calls": [{"kind": "all_reduce", "bytes": nbytes}],
            "error": error,
            "status": "ok" if error is None else "raises",
            "lower_bound_bytes": 32,
            "path": path,
        }

    (row,) = run.compare_comm([side(100)], [side(256_000)], [side(96, "loss_parallel")])
    assert (
        row["baseline"] == "loss_parallel"
        and row["ratio"] == pytest.approx(100 / 96)
        and row["bytes_target"] == "missed"
    )
    (row,) = run.compare_comm(
        [side(100)], [side(256_000)], [side(96, "loss_parallel", error="NotImplementedError: 2-D mesh")]
    )
    assert row["baseline"] == "default" and row["ratio"] == pytest.approx(100 / 256_000)
    assert "(loss_parallel)" in run.format_comm_table([row]) or "error" in run.format_comm_table([row])


def test_autoplan_section_plans_the_7b_shape_from_metadata():
    """The planning-time section on a small mesh (the bench runs (8, 8) and (8, 8, 16)): a row per mesh,
    the chosen plan's bytes, no target where the issue sets none."""
    from benchmarks.autoplan import format_autoplan_table, measure_autoplan

    result = measure_autoplan(((2,),))
    (row,) = result["rows"]
    assert row["mesh"] == [2] and row["candidates"] >= row["feasible"] >= 1 and row["bytes"] > 0
    assert row["target_s"] is None and row["met"] is None
    table = format_autoplan_table(result)
    assert "| (2) | 2 |" in table and f"{row['bytes']:,}" in table
