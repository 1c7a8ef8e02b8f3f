"""One training step cut into parts, each timed and its collectives counted.

    zero_grad -> forward -> loss -> backward -> grad_sync -> optimizer -> loss_read

Every side of the comparison (single device, shardops, torch DTensor) supplies
the same parts as functions; `run_steps` times each part and reads, through a
`measure()` context manager, the collectives and bytes this rank issued in it.
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from ..models import ModelArgs

PARTS = ("zero_grad", "forward", "loss", "backward", "grad_sync", "optimizer", "loss_read")


class Meter(Protocol):
    def counts(self) -> dict[str, int]: ...

    def bytes(self) -> int: ...


@dataclass
class PartRecord:
    seconds: float
    counts: dict[str, int]
    nbytes: int


@dataclass
class StepRecord:
    loss: float
    parts: dict[str, PartRecord] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.parts.values())

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts.values())


class NoComm:
    """The single-device meter: nothing is ever sent."""

    def __enter__(self) -> "NoComm":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def counts(self) -> dict[str, int]:
        return {}

    def bytes(self) -> int:
        return 0


def batch(cfg: ModelArgs, batch_size: int, step: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """The global (inputs, targets) of a step, the same on every rank: next-token prediction on
    arithmetic sequences mod the vocabulary (random start, stride 1-3), so the loss can fall."""
    gen = torch.Generator().manual_seed(seed + step)
    start = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
    tokens = (start + stride * torch.arange(cfg.max_seq_len + 1)) % cfg.vocab_size
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def run_steps(
    parts: dict[str, Callable[[dict], Any]],
    steps: int,
    measure: Callable[[], AbstractContextManager[Meter]] = NoComm,
    on_step: Callable[[int, StepRecord], None] | None = None,
) -> list[StepRecord]:
    """Run `steps` steps; each part gets a dict it shares with the step's other parts (the batch, logits, loss...)."""
    records = []
    for step in range(steps):
        state: dict[str, Any] = {"step": step}
        record = StepRecord(loss=float("nan"))
        for name in PARTS:
            fn = parts.get(name)
            if fn is None:
                record.parts[name] = PartRecord(0.0, {}, 0)
                continue
            with measure() as meter:
                start = time.perf_counter()
                fn(state)
                seconds = time.perf_counter() - start
            record.parts[name] = PartRecord(seconds, dict(meter.counts()), int(meter.bytes()))
        record.loss = float(state["loss_value"])
        records.append(record)
        if on_step is not None:
            on_step(step, record)
    return records


Part = Callable[[dict], Any]


def step_parts(opt: torch.optim.Optimizer, forward: Part, loss: Part, backward: Part, loss_read: Part, grad_sync: Part | None = None) -> dict[str, Part]:
    """The parts of a step, by name; zero_grad and the optimizer step are `opt`'s."""
    parts = {"zero_grad": lambda s: opt.zero_grad(), "forward": forward, "loss": loss, "backward": backward,
             "optimizer": lambda s: opt.step(), "loss_read": loss_read}
    if grad_sync is not None:
        parts["grad_sync"] = grad_sync
    return parts


def reference_parts(
    model: torch.nn.Module, cfg: ModelArgs, batch_size: int, lr: float, first_grads: dict[str, torch.Tensor] | None = None
) -> dict[str, Callable[[dict], Any]]:
    """Single-device training: the ground truth the sharded sides are checked against.

    `first_grads`, a dict, receives the first step's gradients.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def backward(s: dict) -> None:
        s["loss"].backward()
        if first_grads is not None and s["step"] == 0:
            first_grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    def forward(s: dict) -> None:
        s["inputs"], s["targets"] = batch(cfg, batch_size, s["step"])
        s["logits"] = model(s["inputs"])

    def loss(s: dict) -> None:
        s["loss"] = torch.nn.functional.cross_entropy(s["logits"].flatten(0, 1), s["targets"].flatten(0, 1))

    def loss_read(s: dict) -> None:
        s["loss_value"] = s["loss"].item()

    return step_parts(opt, forward, loss, backward, loss_read)


__all__ = ["PARTS", "PartRecord", "StepRecord", "NoComm", "batch", "run_steps", "reference_parts", "step_parts"]
