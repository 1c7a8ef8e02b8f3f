"""`shardops verify`: a differential checker of every registered op against single-device torch.

One job per module, in the order a run uses them:

    targets.py   which ops: every registered op, discovered from the registry at run time
    samples.py   which arguments each op gets (the SAMPLES table: add a row for a new op)
    references.py samples torch accepts, with torch's outputs and gradients (the reference)
    layouts.py   which input placements: swept (--full) or a seeded sample
    forcing.py   running each sharded algorithm (not only the cost model's pick), recording what ran
    cases.py     one case's local pieces on every rank (pending inputs split exactly)
    runner.py    running cases on the ranks of a threads world
    compare.py   sharded result vs torch: tolerance for floats (scaled by pending pieces), exact otherwise
    report.py    per-op rows, failures with a repro command, JSON, the table
    driver.py    the run: plan cases per op and mesh, run, report
    cli.py       `shardops verify` arguments and exit code

The default run fails if any case mismatches or if a sharded algorithm an op's
rows offer (`algorithms_registered` in the JSON report) ran in no case.
"""

from .cli import add_arguments, main
from .compare import compare
from .driver import MESHES, parse_mesh, verify
from .layouts import DEFAULT_BUDGET, alphabet, coverage_slots, sampled_cases
from .references import prepare
from .report import VerifyReport
from .targets import Target, discover, select

__all__ = [
    "DEFAULT_BUDGET",
    "MESHES",
    "Target",
    "VerifyReport",
    "add_arguments",
    "alphabet",
    "compare",
    "coverage_slots",
    "discover",
    "main",
    "parse_mesh",
    "prepare",
    "sampled_cases",
    "select",
    "verify",
]
