"""What the training demo prints: a progress bar, the per-part table beside torch, the check."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

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
    n_params = c.vocab_size * c.dim * (2 if spec.model == "llama" else 1) + c.n_layers * (4 * c.dim * c.dim + 3 * c.dim * c.hidden_dim)
    mesh = "x".join(map(str, spec.mesh_shape))
    return (
        f"[bold]shardops demo[/]: train {spec.model} ({c.n_layers} layers, dim {c.dim}, {c.n_heads} heads, vocab {c.vocab_size}, "
        f"~{n_params / 1e6:.2f}M params) for {spec.steps} steps on a {mesh} mesh "
        f"({'dp x tp' if len(spec.mesh_shape) == 2 else 'tp'}), batch {spec.batch_size} x {c.max_seq_len} tokens, AdamW, strict mode"
    )


@contextlib.contextmanager
def progress(con: Any, steps: int) -> Iterator[Callable[[int, StepRecord], None]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("shardops"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    with Progress(*columns, console=con, transient=False) as bar:
        task = bar.add_task("train", total=steps, info="")

        def advance(step: int, record: StepRecord) -> None:
            bar.update(task, advance=1, info=f"loss {record.loss:.4f}  step {record.seconds * 1e3:.0f} ms")

        yield advance


@dataclass
class Check:
    ok: bool
    loss_error: float  # worst relative loss difference over the steps
    param_error: float  # worst ||p - p_ref|| / ||p_ref|| over the parameters
    lines: list[str] = field(default_factory=list)


def check(spec: RunSpec, ours: Sequence[dict[str, Any]], ref: dict[str, Any]) -> Check:
    """Every step's loss and the final parameters against single-device training."""
    lines = []
    losses = [r.loss for r in ours[0]["records"]]
    ref_losses = [r.loss for r in ref["records"]]
    loss_error = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    param_error = 0.0
    for name, p_ref in ref["params"].items():
        p = ours[0]["params"].get(name)
        if p is None:
            lines.append(f"parameter {name} missing from shardops' model")
            param_error = float("inf")
            continue
        err = (torch.linalg.vector_norm((p - p_ref).double()) / torch.linalg.vector_norm(p_ref.double()).clamp_min(1e-30)).item()
        param_error = max(param_error, err)
    ok = loss_error <= LOSS_TOL and param_error <= PARAM_TOL and len(losses) == len(ref_losses)
    return Check(ok, loss_error, param_error, lines)


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
    title = f"one training step, per part: collectives and bytes on the busiest rank (shardops rank {our_rank}"
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


def summary(spec: RunSpec, ours, theirs, result: Check, ours_seconds: float, theirs_seconds: float | None) -> str:
    lines = []
    losses = [r.loss for r in ours[0]["records"]]
    lines.append(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    mark = "[green]exact[/]" if result.ok else "[red]MISMATCH[/]"
    lines.append(
        f"{mark}: every loss within {result.loss_error:.1e} (relative) and every final parameter within "
        f"{result.param_error:.1e} (relative norm) of single-device training from the same weights "
        f"(tolerance {LOSS_TOL:g})"
    )
    lines += result.lines
    _, our_records = _busiest(ours)
    step_ms = 1e3 * sum(r.seconds for r in our_records[1:]) / max(len(our_records) - 1, 1)
    lines.append(f"shardops (threads world, 4 ranks under one interpreter): {step_ms:.0f} ms/step, {ours_seconds:.1f} s in all")
    if theirs:
        _, their_records = _busiest(theirs)
        t_ms = 1e3 * sum(r.seconds for r in their_records[1:]) / max(len(their_records) - 1, 1)
        ratio = our_records[-1].nbytes / max(their_records[-1].nbytes, 1)
        lines.append(
            f"torch DTensor (4 gloo processes): {t_ms:.0f} ms/step, {theirs_seconds:.1f} s with start-up; "
            f"bytes per step on the busiest rank: shardops {our_records[-1].nbytes:,} vs torch {their_records[-1].nbytes:,} "
            f"({ratio:.2f}x). Step times are not comparable across worlds: see `shardops bench` for both sides as gloo processes."
        )
    return "\n".join(lines)
