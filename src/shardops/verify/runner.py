"""Running cases on the ranks of a threads world, as few `shardops.run` calls as possible.

Each case calls the op directly on DTensors, compares `out.full_tensor()` with
torch's result and, where torch differentiates the op, the input gradients of
sum(out * g). A case that raises is recorded as failing and the rest go on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._torch import pytree
from ..errors import CollectiveError
from ..tensor import DTensor
from ..world import current_comm, run
from ..wrapping import wrap
from .cases import Built, replace_tensors
from .compare import tie_aware, worst_of
from .forcing import recording
from .references import call, differentiable

CASE_TIMEOUT = 30.0  # seconds a rank waits in a collective before the case counts as hung


@dataclass
class Outcome:
    error: float = 0.0
    grad_error: float | None = None
    problem: str | None = None
    out_placements: str = ""
    algorithms: frozenset[str] = frozenset()  # labels of the sharded algorithms that ran (any rank)


class _CaseRaised(Exception):
    """A rank raised inside a case; the rank's error is in the shared `errors` dict of run_cases."""


def _run_case(b: Built, rank: int) -> Outcome:
    mesh_leaves = []
    wants_grad = b.grad_case
    for spec, local in zip(b.specs, b.locals[rank]):
        mesh_leaves.append(wrap(local, spec, requires_grad=wants_grad and differentiable(local)))
    leaves = replace_tensors(b.prep.leaves, mesh_leaves)
    with torch.set_grad_enabled(wants_grad):
        out = pytree.tree_leaves(call(b.target.fn, b.prep.tree, leaves))
        full = [o.full_tensor() if isinstance(o, DTensor) else o for o in out]
    placements = " ".join("[" + ",".join(map(repr, o.placements)) + "]" for o in out if isinstance(o, DTensor))
    result = Outcome(out_placements=placements)
    if not b.prep.sample.check_values:  # random or uninitialised values: shapes and dtypes only
        blank = lambda v: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
        result.error, result.problem = worst_of(
            [(blank(f), blank(r)) for f, r in zip(full, b.ref_out)], b.tol, "output"
        )
        return result
    pairs = list(zip(full, b.ref_out)) if len(full) == len(b.ref_out) else [(full, b.ref_out)]
    if b.prep.sample.tie_outputs and len(full) == len(b.ref_out):
        assert b.prep.sample.tie_dim is not None  # a sample with tie outputs names their dim
        pairs = tie_aware(full, b.ref_out, b.ref_inputs, b.prep.sample.tie_dim, b.prep.sample.tie_outputs)
    result.error, result.problem = worst_of(pairs, b.tol, "output")
    if wants_grad:
        result.grad_error, problem = _check_grads(b, full, mesh_leaves)
        result.problem = result.problem or problem
    return result


def _check_grads(b: Built, full: list[Any], leaves: list[DTensor]) -> tuple[float, str | None]:
    terms = [(f * w).sum() for f, w in zip(full, b.prep.grad_out) if w is not None]
    wrt = [x for x in leaves if x.requires_grad]
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in terms):
        return math.inf, "gradient: the sharded output does not require grad, torch's does"
    grads = iter(torch.autograd.grad(sum(terms), wrt, allow_unused=True))
    got = [next(grads) if x.requires_grad else None for x in leaves]
    pairs = []
    assert b.ref_grads is not None  # a case that checks gradients has torch's
    with torch.no_grad():
        for gv, rv, x in zip(got, b.ref_grads, leaves):
            if not x.requires_grad:
                continue
            gv = gv.full_tensor() if isinstance(gv, DTensor) else gv
            rv = torch.zeros(x.shape, dtype=x.dtype) if rv is None else rv
            pairs.append((torch.zeros_like(rv) if gv is None else gv, rv))
    return worst_of(pairs, b.tol, "gradient")


def _rank_loop(todo: Sequence[tuple[int, Built]], results: dict, errors: dict) -> None:
    rank = current_comm().rank
    for index, b in todo:
        try:
            with recording() as ran:
                outcome = _run_case(b, rank)
            outcome.algorithms = frozenset(ran)
            results[(index, rank)] = outcome
        except Exception as e:  # noqa: BLE001 - reported as the case's failure
            errors[rank] = (index, e)
            raise _CaseRaised() from e


def run_cases(built: Sequence[Built], world_size: int) -> list[Outcome]:
    """Run the cases in as few so.run calls as possible; a case that raises is recorded and the rest go on.

    NOTE: collectives span sub-groups, so a rank may run ahead of ranks it shares no group with: when a
    case raises, cases other ranks were aborted in are run again, the failing one is not.
    """
    results: dict[tuple[int, int], Outcome] = {}
    failed: dict[int, Outcome] = {}
    done = lambda i: all((i, r) in results for r in range(world_size))  # noqa: E731
    while True:
        todo = [(i, b) for i, b in enumerate(built) if i not in failed and not done(i)]
        if not todo:
            break
        errors: dict[int, tuple[int, BaseException]] = {}
        try:
            run(_rank_loop, world_size, todo, results, errors, timeout=CASE_TIMEOUT)
        except _CaseRaised:
            index, error = _root_cause(errors)
            failed[index] = Outcome(math.inf, None, f"raised {type(error).__name__}: {_first_line(error)}")
    return [failed.get(i) or _merge([results[(i, r)] for r in range(world_size)]) for i in range(len(built))]


def _root_cause(errors: dict[int, tuple[int, BaseException]]) -> tuple[int, BaseException]:
    """The earliest case that raised on its own (not a rank released because another one failed)."""
    echo = lambda e: isinstance(e, CollectiveError) and "aborted" in str(e)  # noqa: E731
    own = [ie for ie in errors.values() if not echo(ie[1])] or list(errors.values())
    return min(own, key=lambda ie: ie[0])


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _merge(per_rank: list[Outcome]) -> Outcome:
    worst = max(per_rank, key=lambda o: (o.problem is not None, o.error))
    grads = [o.grad_error for o in per_rank if o.grad_error is not None]
    ran = frozenset().union(*(o.algorithms for o in per_rank))
    return Outcome(worst.error, max(grads) if grads else None, worst.problem, per_rank[0].out_placements, ran)
