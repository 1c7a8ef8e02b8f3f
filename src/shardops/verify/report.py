"""The verify report: one row per op, the failures with a command that reproduces each, JSON and a table.

Per op the report also lists the sharded algorithms its rows can run
(`algorithms_registered`, by the names their rows register) and how many of the
op's own cases ran each (`algorithms_run`: only the op's own algorithms, never
those of the ops it reaches); a registered algorithm that none of the op's own
cases ran fails the run.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Failure:
    target: str
    mesh: str
    case: int
    layouts: str
    sample: str
    problem: str
    out_placements: str
    repro: str

    def __str__(self) -> str:
        out = f" -> {self.out_placements}" if self.out_placements else ""
        return (
            f"FAIL {self.target} mesh {self.mesh} case {self.case}: {self.layouts}{out}\n"
            f"     {self.problem}\n     repro: {self.repro}"
        )


@dataclass
class OpRow:
    group: str
    overloads: list[str] = field(default_factory=list)
    cases: int = 0
    passed: int = 0
    failed: int = 0
    grad_cases: int = 0
    worst: float = 0.0
    no_samples: list[str] = field(default_factory=list)  # "overload: reason"
    seconds: float = 0.0
    algorithms_registered: set[str] = field(default_factory=set)  # labels of the sharded algorithms its rows can run
    algorithms_run: Counter = field(default_factory=Counter)  # label -> the op's own cases that ran it
    check_coverage: bool = True  # False for a --case run: one case cannot run every algorithm

    @property
    def algorithms_not_run(self) -> list[str]:
        """Registered algorithms that ran in no case of the run (a failure)."""
        if not self.check_coverage:
            return []
        return sorted(a for a in self.algorithms_registered if not self.algorithms_run[a])

    @property
    def status(self) -> str:
        if self.failed:
            return "FAIL"
        if self.algorithms_not_run:
            return "NOT RUN"  # a registered sharded algorithm ran in no case
        if self.cases == 0:
            return "no samples"
        return "ok" if not self.no_samples else "partial"  # some overloads have no samples (listed below the table)


@dataclass
class VerifyReport:
    rows: dict[str, OpRow]
    failures: list[Failure]
    skipped: dict[str, int]
    settings: dict[str, Any]
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures and not any(r.algorithms_not_run for r in self.rows.values())

    @property
    def cases(self) -> int:
        return sum(r.cases for r in self.rows.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "settings": self.settings,
            "elapsed_s": round(self.elapsed, 2),
            "cases": self.cases,
            "skipped": self.skipped,
            "ops": [
                {
                    "op": r.group,
                    "overloads": r.overloads,
                    "cases": r.cases,
                    "passed": r.passed,
                    "failed": r.failed,
                    "grad_cases": r.grad_cases,
                    "worst_error": r.worst if math.isfinite(r.worst) else "inf",
                    "no_samples": r.no_samples,
                    "status": r.status,
                    "seconds": round(r.seconds, 3),
                    "algorithms_registered": sorted(r.algorithms_registered),
                    "algorithms_run": dict(sorted(r.algorithms_run.items())),
                    "algorithms_not_run": r.algorithms_not_run,
                }
                for r in self.rows.values()
            ],
            "failures": [f.__dict__ for f in self.failures],
        }


def repro_line(target: str, mesh: str, case: int, settings: dict[str, Any]) -> str:
    extra = ""
    if settings.get("full"):
        extra += " --full"
    elif settings.get("budget") is not None:
        extra += f" --budget {settings['budget']}"
    if settings.get("seed"):
        extra += f" --seed {settings['seed']}"
    return f"shardops verify --op {target} --mesh {mesh} --case {case}{extra}"


def print_report(report: VerifyReport, console) -> None:
    from rich.table import Table

    table = Table(title="shardops verify", show_lines=False, box=None, pad_edge=False, padding=(0, 1, 0, 0))
    table.add_column("op", no_wrap=True, min_width=30)
    for col in ("ovl", "cases", "pass", "fail", "grads", "algos run", "worst err"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for r in report.rows.values():
        worst = "-" if r.cases == 0 else ("mismatch" if not math.isfinite(r.worst) else f"{r.worst:.1e}")
        style = "red" if r.failed or r.algorithms_not_run else ("yellow" if r.no_samples else None)
        table.add_row(
            r.group,
            str(len(r.overloads)),
            str(r.cases),
            str(r.passed),
            str(r.failed),
            str(r.grad_cases),
            _algorithms_cell(r),
            worst,
            r.status,
            style=style,
        )
    console.print(table)
    for r in report.rows.values():
        for note in r.no_samples:
            console.print(f"[yellow]no samples[/yellow] {note}", highlight=False)
        if r.algorithms_not_run:
            console.print(
                f"[red]not run[/red] {r.group}: registered sharded algorithm(s) no case ran: {r.algorithms_not_run}",
                highlight=False,
            )
    for f in report.failures:
        console.print(str(f), highlight=False, markup=False)
    skipped = ", ".join(f"{n} {k}" for k, n in report.skipped.items())
    unrun = sum(len(r.algorithms_not_run) for r in report.rows.values())
    verdict = (
        "[green]all passed[/green]"
        if report.ok
        else f"[red]{len(report.failures)} failing case(s), {unrun} algorithm(s) not run[/red]"
    )
    ran = sum(len(r.algorithms_registered) - len(r.algorithms_not_run) for r in report.rows.values())
    if all(r.check_coverage for r in report.rows.values()):
        console.print(f"sharded algorithms: {ran} registered (op, label) pairs ran, {unrun} did not", highlight=False)
    else:
        console.print("sharded algorithms: not checked (a --case run)", highlight=False)
    console.print(
        f"{report.cases} cases over {len(report.rows)} ops in {report.elapsed:.1f} s: {verdict}"
        + (f" (not run: {skipped}; their functional forms are checked)" if skipped else "")
    )


def _algorithms_cell(r: OpRow) -> str:
    """registered algorithms that ran / registered ("-": the op's rows run none)."""
    if not r.algorithms_registered:
        return "-"
    return f"{len(r.algorithms_registered) - len(r.algorithms_not_run)}/{len(r.algorithms_registered)}"
