"""What every side of a training comparison shares: the batches, the step records, `timed(part)`,
and the single-device reference loop.

A training loop here is a plain loop (see `train_reference`, and the sharded sides in
shardops_side.py and torch_side.py):

    for step in range(steps):
        steps.start()                                  # a fresh StepRecord
        with steps.timed("zero_grad"): opt.zero_grad()
        with steps.timed("forward"):   logits = model(inputs)
        with steps.timed("loss"):      loss = F.cross_entropy(...)
        with steps.timed("backward"):  loss.backward()
        with steps.timed("optimizer"): opt.step()
        with steps.timed("loss_read"): steps.finish(loss.item())

`timed(part)` times the block and reads, through the side's meter (a context manager), the
collectives and bytes this rank issued in it. Data parallelism (fully_shard / replicate, on
either side) reduces the gradients inside `backward`: no part of its own.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ..models import ModelArgs

PARTS = ("zero_grad", "forward", "loss", "backward", "optimizer", "loss_read")


class Meter(Protocol):
    def counts(self) -> dict[str, int]: ...

    def bytes(self) -> int:
        """The bytes compared across systems: what this rank handed the transport."""
        ...


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

    def __enter__(self) -> NoComm:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def counts(self) -> dict[str, int]:
        return {}

    def bytes(self) -> int:
        return 0


class Steps:
    """The records of a run: `start()` a step, `timed(part)` its parts, `finish(loss)` it."""

    def __init__(
        self,
        meter: Callable[[], contextlib.AbstractContextManager[Meter]] = NoComm,
        on_step: Callable[[int, StepRecord], None] | None = None,
    ):
        self.meter = meter
        self.on_step = on_step
        self.records: list[StepRecord] = []

    def start(self) -> None:
        self.records.append(StepRecord(loss=float("nan"), parts={p: PartRecord(0.0, {}, 0) for p in PARTS}))

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        with self.meter() as meter:
            start = time.perf_counter()
            yield
            seconds = time.perf_counter() - start
        self.records[-1].parts[part] = PartRecord(seconds, dict(meter.counts()), int(meter.bytes()))

    def finish(self, loss: float) -> None:
        self.records[-1].loss = float(loss)

    def done(self) -> None:
        """Call after the step's last part: reports the step."""
        if self.on_step is not None:
            self.on_step(len(self.records) - 1, self.records[-1])


def batch(cfg: ModelArgs, batch_size: int, step: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """The global (inputs, targets) of a step, the same on every rank: next-token prediction on
    arithmetic sequences mod the vocabulary (random start, stride 1-3), so the loss can fall."""
    gen = torch.Generator().manual_seed(seed + step)
    start = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
    tokens = (start + stride * torch.arange(cfg.max_seq_len + 1)) % cfg.vocab_size
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train_reference(model: torch.nn.Module, cfg: ModelArgs, batch_size: int, steps: int, lr: float) -> dict[str, Any]:
    """Single-device training, the ground truth of the sharded sides: its records, final
    parameters and first step's gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    run = Steps()
    first_grads: dict[str, torch.Tensor] = {}
    for step in range(steps):
        run.start()
        inputs, targets = batch(cfg, batch_size, step)
        with run.timed("zero_grad"):
            opt.zero_grad()
        with run.timed("forward"):
            logits = model(inputs)
        with run.timed("loss"):
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
        with run.timed("backward"):
            loss.backward()
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        with run.timed("optimizer"):
            opt.step()
        with run.timed("loss_read"):
            run.finish(loss.item())
        run.done()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"records": run.records, "params": params, "grads": first_grads}


__all__ = ["PARTS", "PartRecord", "StepRecord", "Steps", "NoComm", "batch", "train_reference"]
