"""The main job: `shardops demo` (training) and `shardops demo --ops` (math ops), in the threads
world and under a torchrun-style gloo launch."""

import os
import socket
import subprocess
import sys

import pytest
import torch

import shardops as so
from shardops import demo

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


TINY = ["--size", "tiny", "--steps", "3"]


def test_training_demo_threads_world_checks_both_columns_and_exits_zero(capsys):
    """The default demo: GPT-2 with dropout and attention on DTensors; both columns checked."""
    assert demo.main(TINY) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "dropout 0.1" in out and "attention on DTensors" in out and "step total" in out
    assert "PASS shardops vs single-device training (dropout 0.1 with shardops' masks" in out
    assert "PASS torch DTensor vs single-device training (no dropout" in out
    assert out.count("tolerance 0.0001") == 4  # the measured errors beside the tolerance, both columns
    assert "threads world, 4 ranks in one process" in out and "exact" not in out


def test_training_demo_fails_on_a_mismatch(capsys, monkeypatch):
    """The check can fail: a reference with torch's own dropout masks is not what shardops ran."""
    from shardops.demo import training
    from shardops.training.config import build
    from shardops.training.loop import train_reference

    def reference_with_torch_masks(spec):
        return train_reference(build(spec), spec.cfg, spec.batch_size, spec.steps, spec.lr)

    monkeypatch.setattr(training, "reference", reference_with_torch_masks)
    assert demo.main(TINY + ["--no-torch"]) == 1
    assert "MISMATCH shardops" in " ".join(capsys.readouterr().out.split())


def test_ops_demo_threads_world_verifies_and_exits_zero(capsys):
    assert demo.main(["--ops"]) == 0
    out = capsys.readouterr().out
    assert "all outputs and gradients match single-device torch" in out
    assert "vocab-parallel cross_entropy" in out and "clip_grad_norm_" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list[str]) -> list[str]:
    port, world = _free_port(), 4
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "shardops.demo", *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * world, outs
    return outs


def test_training_demo_under_torchrun_style_gloo_launch():
    outs = _torchrun(TINY)
    out = " ".join(outs[0].split())
    assert "PASS shardops vs single-device training (dropout 0.1 with shardops' masks" in out
    assert "torch.distributed gloo, 4 processes" in out and "threads world" not in out


@pytest.mark.slow  # the training demo's torchrun-style launch above keeps the gloo path in the default suite
def test_ops_demo_under_torchrun_style_gloo_launch():
    outs = _torchrun(["--ops"])
    assert "torch.distributed gloo, 4 processes" in outs[0]
    assert "all outputs and gradients match single-device torch" in outs[0]


def test_distribute_tensor_never_aliases_the_callers_tensor():
    def body():
        mesh = so.init_device_mesh("cpu", (2,))
        full = torch.arange(8.0)
        x = so.distribute_tensor(full, mesh, [so.Shard(0)], src_data_rank=None)
        x.mul_(0)
        return full.tolist()

    assert so.run(body, 2) == [list(map(float, range(8)))] * 2
