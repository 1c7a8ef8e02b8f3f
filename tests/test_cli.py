"""The `shardops` command: verify, explain, and the hooks for demo and bench."""

import json
import os
import sys
import types

import pytest

from shardops import cli


def test_no_subcommand_prints_help(capsys):
    assert cli.main([]) == 2
    assert "verify" in capsys.readouterr().out


def test_verify_subcommand(capsys):
    code = cli.main(["verify", "--op", "aten.neg.default", "--mesh", "4", "--budget", "3", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "aten.neg" in out and "all passed" in out


def test_verify_list(capsys):
    assert cli.main(["verify", "--list", "--op", "aten.neg"]) == 0
    assert "aten.neg.default" in capsys.readouterr().out


def test_verify_unknown_op_is_a_clear_error(capsys):
    assert cli.main(["verify", "--op", "aten.no_such_op", "--no-progress"]) == 2
    assert "no registered op matches" in capsys.readouterr().err


def test_explain_subcommand(capsys):
    code = cli.main(
        ["explain", "softmax(x, dim=1)", "--mesh", "8x8x16", "--links", "nvlink,ib,ib", "--x", "f32[8,4096]:R,R,S(1)"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "aten._softmax.default" in out and "chosen: #1" in out and "1024 ranks" in out


def test_explain_json_and_tensor_flag(capsys):
    code = cli.main(["explain", "x + y", "--mesh", "2x2", "-t", "x=f32[8,6]:S(0),R", "--y=f32[8,6]:R,S(1)", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["inputs"] == {"x": "f32[8,6]:S(0),R", "y": "f32[8,6]:R,S(1)"}
    assert data["steps"][0]["op"] == "aten.add.Tensor"


def test_explain_bad_spec_is_a_clear_error(capsys):
    assert cli.main(["explain", "x + 1", "--mesh", "4", "--x", "f32[8]:R,R"]) == 2
    assert "2 placements" in capsys.readouterr().err


def test_missing_demo_module_says_so(monkeypatch, capsys):
    monkeypatch.setitem(cli.SUBCOMMANDS, "demo", ("shardops._no_such_demo", "main", "run the demo"))
    assert cli.main(["demo"]) == 2
    assert "shardops._no_such_demo is not available" in capsys.readouterr().err


def test_bench_hook_passes_its_arguments(monkeypatch):
    calls = []
    module = types.ModuleType("fake_bench")
    module.main = lambda argv: calls.append(argv) or 0
    monkeypatch.setitem(sys.modules, "fake_bench", module)
    monkeypatch.setitem(cli.SUBCOMMANDS, "bench", ("fake_bench", "main", "benchmarks"))
    assert cli.main(["bench", "--quick", "softmax"]) == 0
    assert calls == [["--quick", "softmax"]]


@pytest.mark.parametrize("name, module", [("demo", "shardops.demo"), ("bench", "benchmarks.run")])
def test_default_hooks(name, module):
    assert cli.SUBCOMMANDS[name][:2] == (module, "main")


def test_bench_runs_from_any_directory_of_an_editable_install(tmp_path):
    """`shardops bench` finds benchmarks/ beside src/ of the clone it was installed from, not in the cwd."""
    import subprocess

    script = os.path.join(os.path.dirname(sys.executable), "shardops")
    if not os.path.exists(script):
        script = None
    cmd = (
        [script, "bench", "--help"]
        if script
        else [sys.executable, "-c", "import sys; from shardops.cli import main; sys.exit(main())", "bench", "--help"]
    )
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "usage: shardops bench" in done.stdout


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SHARDOPS = "import sys; from shardops.cli import main; sys.exit(main())"  # what the installed `shardops` script runs


def _this_checkouts_env() -> dict[str, str]:
    """The environment of a `shardops` command run elsewhere, with this checkout's package
    (as an editable install has it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(_REPO, "src"), *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_bench_gloo_ranks_import_the_benchmarks_from_any_directory(tmp_path):
    """The installed command loads benchmarks/ from the clone; a spawned gloo rank must import its
    `benchmarks.*` entry point too (it died on `No module named 'benchmarks'`, issue 42 item 11)."""
    import subprocess

    script = (
        "from shardops import cli\n"
        "cli.load('bench')\n"
        "from benchmarks import end_to_end\n"
        "from shardops.training.launch import run_gloo\n"
        "result = run_gloo(end_to_end.rank_main, 1, end_to_end.SIZES['tiny'], timeout=300)[0]\n"
        "print(sorted({row['shardops']['correct'] for row in result['rows']}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=_this_checkouts_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[True]"


@pytest.mark.slow
def test_the_installed_bench_commands_gloo_rows_run(tmp_path):
    """`shardops bench --tiny --only end_to_end` (2 gloo processes) from a directory outside the clone:
    every shardops row runs and equals single-device torch (about a minute on 2 busy cores)."""
    import subprocess

    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-c",
        _SHARDOPS,
        "bench",
        "--tiny",
        "--only",
        "end_to_end",
        "--no-plot",
        "--docs",
        "",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=_this_checkouts_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((out / "results.json").read_text())["results"]["end_to_end"]
    assert "error" not in result and result["world_size"] == 2 and result["backend"] == "gloo"
    for row in result["rows"]:
        assert row["shardops"]["error"] is None and row["shardops"]["correct"], row


def test_bench_without_the_repository_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "benchmarks", None)  # not importable, as from an installed wheel
    monkeypatch.delitem(sys.modules, "benchmarks.run", raising=False)
    assert cli.main(["bench"]) == 2
    assert "the benchmarks live in the repository" in capsys.readouterr().err
