"""What the training demo prints: a progress bar, the per-part table beside torch, and each column's check
against its single-device reference with the measured errors beside the tolerance."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import RunSpec
from .loop import PARTS, StepRecord

LOSS_TOL = 1e-4  # relative, per step
PARAM_TOL = 1e-4  # ||p - p_ref|| <= PARAM_TOL * ||p_ref||, per parameter


def console() -> Any:
    from rich.console import Console

    return Console(width=max(132, Console().width))


def header(spec: RunSpec) -> str:
    c = spec.cfg
    n_params = c.vocab_size * c.dim * (2 if spec.model == "llama" else 1) + c.n_layers * (
        4 * c.dim * c.dim + 3 * c.dim * c.hidden_dim
    )
    mesh = "x".join(map(str, spec.mesh_shape))
    return (
        f"[bold]shardops demo[/]: train {spec.model} ({c.n_layers} layers, dim {c.dim}, {c.n_heads} heads, vocab "
        f"{c.vocab_size}, ~{n_params / 1e6:.2f}M params) for {spec.steps} steps on a {mesh} mesh "
        f"({_mesh_words(spec)}), batch {spec.batch_size} x {c.max_seq_len} tokens, AdamW, strict mode, "
        f"dropout {c.dropout:g}{' (this model has none)' if spec.model == 'llama' else ''}, "
        f"attention {'on local shards' if spec.local_attention else 'on DTensors'}"
    )


def _mesh_words(spec: RunSpec) -> str:
    if len(spec.mesh_shape) != 2:
        return "tp"
    dp = "fully_shard" if spec.dp_mode == "shard" else "replicate"
    return f"dp x tp: {dp} over dp, each rank its own batch slice"


@contextlib.contextmanager
def progress(con: Any, steps: int) -> Iterator[Callable[[int, StepRecord], None]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("shardops"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=con, transient=False) as bar:
        task = bar.add_task("train", total=steps, info="")

        def advance(step: int, record: StepRecord) -> None:
            bar.update(task, completed=step + 1, info=f"loss {record.loss:.4f}  step {record.seconds * 1e3:.0f} ms")

        yield advance


@dataclass
class Check:
    """One column of the demo against its single-device reference."""

    name: str  # "shardops", "torch DTensor"
    reference: str  # what the reference is, in words
    ok: bool
    loss_error: float  # worst relative loss difference over the steps
    param_error: float  # worst ||p - p_ref|| / ||p_ref|| over the parameters
    lines: list[str] = field(default_factory=list)

    def line(self) -> str:
        mark = "[green]PASS[/]" if self.ok else "[red]MISMATCH[/]"
        return (
            f"{mark} {self.name} vs single-device training ({self.reference}): worst loss error {self.loss_error:.1e} "
            f"(relative, tolerance {LOSS_TOL:g}), worst final parameter error {self.param_error:.1e} "
            f"(relative norm, tolerance {PARAM_TOL:g})"
        )


def check(
    name: str, reference_words: str, records: Sequence[StepRecord], params: dict[str, torch.Tensor], ref: dict[str, Any]
) -> Check:
    """Every step's loss and the final parameters against single-device training."""
    lines = []
    losses = [r.loss for r in records]
    ref_losses = [r.loss for r in ref["records"]]
    loss_error = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses)), default=float("inf"))
    param_error = 0.0
    for pname, p_ref in ref["params"].items():
        p = params.get(pname)
        if p is None or p.shape != p_ref.shape:
            lines.append(f"parameter {pname} missing from {name}'s model or of another shape")
            param_error = float("inf")
            continue
        err = (
            torch.linalg.vector_norm((p - p_ref).double()) / torch.linalg.vector_norm(p_ref.double()).clamp_min(1e-30)
        ).item()
        param_error = max(param_error, err)
    if len(losses) != len(ref_losses):
        lines.append(f"{name} ran {len(losses)} steps, the reference {len(ref_losses)}")
    ok = loss_error <= LOSS_TOL and param_error <= PARAM_TOL and len(losses) == len(ref_losses)
    return Check(name, reference_words, ok, loss_error, param_error, lines)


def _busiest(results: Sequence[dict[str, Any]]) -> tuple[int, list[StepRecord]]:
    """The rank that sent the most bytes over the run, and its records."""
    totals = [sum(r.nbytes for r in res["records"]) for res in results]
    rank = max(range(len(totals)), key=totals.__getitem__)
    return rank, results[rank]["records"]


def _per_step(records: Sequence[StepRecord], part: str) -> tuple[str, int, float]:
    """Collectives per step (as counted in the last step), bytes per step, mean seconds (steps after the first)."""
    last = records[-1].parts[part]
    colls = ", ".join(f"{k}×{v}" for k, v in sorted(last.counts.items())) or "-"
    timed = records[1:] or records
    return colls, last.nbytes, sum(r.parts[part].seconds for r in timed) / len(timed)


def parts_table(spec: RunSpec, ours: Sequence[dict[str, Any]], theirs: Sequence[dict[str, Any]] | None) -> Any:
    from rich.table import Table

    our_rank, our_records = _busiest(ours)
    title = (
        "one training step, per part: collectives and bytes handed to the transport on the busiest rank "
        f"(shardops rank {our_rank}"
    )
    if theirs:
        their_rank, their_records = _busiest(theirs)
        title += f", torch DTensor rank {their_rank})"
    else:
        title += ")"
    table = Table(title=title)
    table.add_column("part")
    table.add_column("shardops collectives")
    table.add_column("shardops bytes", justify="right")
    if theirs:
        table.add_column("torch DTensor collectives")
        table.add_column("torch bytes", justify="right")
    for part in PARTS:
        colls, nbytes, _ = _per_step(our_records, part)
        row = [part, colls, f"{nbytes:,}"]
        if theirs:
            t_colls, t_bytes, _ = _per_step(their_records, part)
            row += [t_colls, f"{t_bytes:,}"]
        table.add_row(*row)
    row = ["[bold]step total[/]", "", f"[bold]{our_records[-1].nbytes:,}[/]"]
    if theirs:
        row += ["", f"[bold]{their_records[-1].nbytes:,}[/]"]
    table.add_row(*row)
    return table


def summary(
    ours: Sequence[dict[str, Any]],
    theirs,
    checks: Sequence[Check],
    world: str,
    ours_seconds: float,
    theirs_seconds: float | None,
) -> str:
    lines = []
    losses = [r.loss for r in ours[0]["records"]]
    lines.append(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    for c in checks:
        lines.append(c.line())
        lines += c.lines
    _, our_records = _busiest(ours)
    step_ms = 1e3 * sum(r.seconds for r in our_records[1:]) / max(len(our_records) - 1, 1)
    lines.append(f"shardops ({world}): {step_ms:.0f} ms/step, {ours_seconds:.1f} s in all")
    if theirs:
        _, their_records = _busiest(theirs)
        t_ms = 1e3 * sum(r.seconds for r in their_records[1:]) / max(len(their_records) - 1, 1)
        ratio = our_records[-1].nbytes / max(their_records[-1].nbytes, 1)
        lines.append(
            f"torch DTensor ({len(theirs)} gloo processes): {t_ms:.0f} ms/step, {theirs_seconds:.1f} s with start-up; "
            f"bytes per step on the busiest rank (handed to the transport): shardops {our_records[-1].nbytes:,} vs "
            f"torch {their_records[-1].nbytes:,} ({ratio:.2f}x; the runs differ where torch's column leaves out "
            "dropout or attention on DTensors). Step times are not comparable across worlds: see `shardops bench` for "
            "both sides as gloo processes."
        )
    return "\n".join(lines)
