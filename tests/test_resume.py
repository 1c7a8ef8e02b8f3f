"""Resuming a training run with dropout on (issue 29's acceptance), and the demo's --save-every /
--resume. Expected values come from runs that were never stopped, made in the test (and, for the
demo, from its single-device reference), never from numbers copied from shardops' output.
"""

from __future__ import annotations

import io

import pytest
import torch

import shardops as so
from checkpoint_harness import train_and_checkpoint  # tests/ is not a package


def test_resume_with_dropout_is_bitwise(tmp_path):
    """GPT-2 with dropout, 6 steps on (2, 2); separately 3 steps and a save, then new worlds load
    onto (2, 2) and train steps 4-6. The plan keeps the tensors dropout reads as DTensors
    (training/config.py): on mesh["tp"], holding each data-parallel rank's batch slice, as under
    torch's data parallelism, so another data-parallel size draws other masks (resuming onto
    another mesh: test_checkpoint.py, dropout off)."""
    path = str(tmp_path / "ckpt")

    def train(steps: range, load: bool, save_after: int | None, mesh_shape=(2, 2), with_rng: bool = True):
        return so.run(
            lambda: train_and_checkpoint(
                path, steps, load, save_after, mesh_shape=mesh_shape, with_rng=with_rng, invariant_dropout=True
            ),
            4,
        )

    whole = train(range(6), False, None)
    saved = train(range(3), False, 2)
    same = train(range(3, 6), True, None)
    without_rng = train(range(3, 6), True, None, with_rng=False)

    expected = whole[0][0]
    assert all(w[0] == expected for w in whole)  # every rank reads the same global loss
    assert saved[0][0] == expected[:3]
    for losses, loaded_step in same:
        assert loaded_step == 3
        assert losses == expected[3:]  # bitwise
    # The masks matter: without the saved random state, steps 4-6 draw other masks.
    assert without_rng[0][0] != expected[3:]


# ---------------------------------------------------------------- the demo's --save-every / --resume

TINY = ["--size", "tiny", "--batch", "4", "--no-torch"]


def _quiet_console():
    from rich.console import Console

    return Console(file=io.StringIO())


def _demo(argv: list[str]) -> list[dict]:
    """The demo's own steps (argument parsing, spec, the shardops side in strict mode) without the torch side."""
    from shardops.demo import training as demo

    args = demo.parse_args(TINY + argv)
    return demo.run_shardops(demo.spec_from(args), _quiet_console(), demo.checkpointing_from(args))[0]


def _losses(result: dict) -> list[float]:
    return [r.loss for r in result["records"]]


def test_demo_save_and_resume_equals_the_run_never_stopped(tmp_path):
    from shardops.demo import training as demo
    from shardops.training import report

    path = str(tmp_path / "demo-ckpt")
    whole = _demo(["--steps", "4"])
    first = _demo(["--steps", "3", "--save-every", "2", "--checkpoint", path])  # saves after step 2 only
    resumed = _demo(["--steps", "4", "--resume", path])
    # Onto another mesh: (dp 2, tp 2) -> (tp 4). Without dropout, since each data-parallel rank
    # draws its masks for its own batch slice (as torch's ranks do): (4,) draws others.
    plain = ["--dropout", "0"]
    plain_whole = _demo(["--steps", "4", *plain])
    _demo(["--steps", "3", "--save-every", "2", "--checkpoint", path + "-plain", *plain])
    other_mesh = _demo(["--steps", "4", "--mesh", "4", "--resume", path + "-plain", *plain])

    for w, f, r in zip(whole, first, resumed):
        assert f["first_step"] == 0 and _losses(f) == _losses(w)[:3]
        assert r["first_step"] == 2
        assert _losses(r) == _losses(w)[2:]  # bitwise: model, optimizer, random state, step counter
        for name, value in w["params"].items():
            assert torch.equal(r["params"][name], value), name
    assert other_mesh[0]["first_step"] == 2
    assert _losses(other_mesh[0]) == pytest.approx(_losses(plain_whole[0])[2:], rel=1e-6, abs=1e-6)
    # What the demo prints: the resumed run against the single-device run that was never stopped.
    spec = demo.spec_from(demo.parse_args(TINY + ["--steps", "4"]))
    assert spec.cfg.dropout > 0
    check = report.check(
        "shardops", "", resumed[0]["records"], resumed[0]["params"], demo.resumed_reference(spec, resumed[0])
    )
    assert check.ok, check


def test_demo_resume_past_the_last_step_and_bad_flags_are_clear_errors(tmp_path, capsys):
    from shardops.demo import training as demo

    path = str(tmp_path / "demo-ckpt")
    _demo(["--steps", "2", "--save-every", "2", "--checkpoint", path])
    assert demo.main(TINY + ["--steps", "2", "--resume", path]) == 2
    assert "nothing left" in capsys.readouterr().out
    for bad in (
        ["--save-every", "2"],
        ["--checkpoint", path],
        ["--save-every", "-1", "--checkpoint", path],
        ["--resume", str(tmp_path / "missing")],
    ):
        with pytest.raises(SystemExit):
            demo.parse_args(bad)


def _demo_rank_in_gloo(tmp: str) -> dict:
    """The demo's torchrun path (train_rank under torch.distributed, strict mode): whole, saved, resumed."""
    from shardops.demo import training as demo
    from shardops.training.shardops_side import train_rank

    path = f"{tmp}/demo-ckpt"

    def run(argv: list[str]) -> list[float]:
        args = demo.parse_args(TINY + argv)
        so.set_strict(True)
        try:
            return _losses(train_rank(demo.spec_from(args), checkpointing=demo.checkpointing_from(args)))
        finally:
            so.set_strict(False)

    return {
        "whole": run(["--steps", "4"]),
        "first": run(["--steps", "2", "--save-every", "2", "--checkpoint", path]),
        "resumed": run(["--steps", "4", "--resume", path]),
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_resume_in_gloo_processes_equals_the_run_never_stopped(tmp_path):
    from shardops.training.launch import run_gloo

    for r in run_gloo(_demo_rank_in_gloo, 4, str(tmp_path), timeout=500):
        assert r["first"] == r["whole"][:2]
        assert r["resumed"] == r["whole"][2:]
