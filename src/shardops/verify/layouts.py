"""Input layouts: which placements each operand gets on each mesh dim, swept or sampled.

alphabet(t)          every placement one mesh dim may give an operand: R, S(d), the pending kinds
sampled_cases(...)   the default run: a seeded sample that covers every placement kind of the
                     main operand over the three meshes
all_cases(...)       --full: every combination
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..notation import tensor_text
from ..placements import NormPartial, Partial, Placement, Replicate, Shard, StridedShard
from .references import Prepared

R = Replicate()
PARTIAL_KINDS = (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"), Partial("product"), NormPartial(2))
# Cases per op and mesh (by mesh ndim) in the default run. The coverage sweep (sampled_cases) starts at a
# different placement kind on each mesh, so over the three meshes every kind of the main operand is forced
# at least once. Sized so that the whole registry, plus one case per sharded algorithm and mesh
# (driver.forced_cases), stays well under the 5 minutes CI allows on 2 cores.
DEFAULT_BUDGET = {1: 4, 2: 4, 3: 2}


def alphabet(t: torch.Tensor) -> list[Placement]:
    """Every placement one mesh dim may give this operand."""
    shards: list[Placement] = [Shard(d) for d in range(t.ndim)]
    kinds: list[Placement]
    if t.dtype == torch.bool:
        kinds = [Partial("max"), Partial("min")]
    elif t.is_complex():
        kinds = [Partial("sum")]
    elif not t.is_floating_point():
        kinds = [Partial("sum"), Partial("max"), Partial("min"), Partial("product")]
    else:
        kinds = list(PARTIAL_KINDS)
    return [R] + shards + kinds


def main_operand(tensors: Sequence[torch.Tensor]) -> int:
    """The operand the layout sweep is about: the most dims, then float over int/bool, then the first."""
    return max(range(len(tensors)), key=lambda i: (tensors[i].ndim, tensors[i].is_floating_point(), -i))


def _aligned(p: Placement, main: torch.Tensor, t: torch.Tensor) -> Placement:
    """The placement of operand t that matches `p` on the main operand (same tensor dim, same pending kind)."""
    if t is main:
        return p
    if isinstance(p, (Shard, StridedShard)):
        size = main.shape[p.dim]
        for d in (p.dim - (main.ndim - t.ndim), p.dim):
            if 0 <= d < t.ndim and t.shape[d] == size:
                return Shard(d)
        return R
    if p.is_partial() and t.is_floating_point() == main.is_floating_point() and p in alphabet(t):
        return p
    return R


def aligned_column(p: Placement, tensors: Sequence[torch.Tensor]) -> tuple[Placement, ...]:
    """One mesh dim's placements: `p` on the main operand, the others aligned to it."""
    main = tensors[main_operand(tensors)]
    return tuple(_aligned(p, main, t) for t in tensors)


def coverage_slots(prepared: Sequence[Prepared]) -> list[Placement]:
    """Every placement kind the main operands can take: pending kinds first (the bug-prone ones), shards, Replicate."""
    found: set[Placement] = set()
    for prep in prepared:
        found.update(alphabet(prep.tensors[main_operand(prep.tensors)]))
    shards = sorted((p for p in found if isinstance(p, (Shard, StridedShard))), key=lambda p: p.dim)
    return [p for p in PARTIAL_KINDS if p in found] + shards + [R]


def pending_kinds_ok(layouts: Sequence[Sequence[Placement]], tensors: Sequence[torch.Tensor]) -> bool:
    """At most one pending kind per operand: mixed kinds have no order-free meaning. No NormP in half
    precision, whose resolved norm is not exact on the sample grid. (NormP on several mesh dims is
    resolved one canonical way, whatever the plan: redistribute._joint_norm_resolution.)"""
    for pl, t in zip(layouts, tensors):
        if len({p for p in pl if p.is_partial()}) > 1:
            return False
        if t.dtype in (torch.bfloat16, torch.float16) and any(isinstance(p, NormPartial) for p in pl):
            return False  # a half-precision sqrt(sum of squares) is not exact on the sample grid
    return True


def _transpose(columns: Sequence[Sequence[Placement]]) -> tuple[tuple[Placement, ...], ...]:
    """Per-mesh-dim columns -> per-operand placement tuples."""
    return tuple(zip(*columns))


@dataclass(frozen=True)
class Case:
    index: int
    prepared: int  # index into the target's prepared samples
    layouts: tuple[tuple[Placement, ...], ...]  # per tensor operand, one placement per mesh dim
    force: str | None = None  # the sharded algorithm (row label) this case runs instead of the cost model's pick


def all_cases(prepared: Sequence[Prepared], mesh_shape: tuple[int, ...]) -> Iterator[Case]:
    """--full: every layout combination of every prepared sample."""
    i = 0
    for si, prep in enumerate(prepared):
        columns = list(itertools.product(*[alphabet(t) for t in prep.tensors]))
        for combo in itertools.product(columns, repeat=len(mesh_shape)):
            layouts = _transpose(combo)
            if pending_kinds_ok(layouts, prep.tensors):
                yield Case(i, si, layouts)
                i += 1


def sampled_cases(prepared: Sequence[Prepared], mesh_shape: tuple[int, ...], budget: int, seed: int) -> list[Case]:
    """A seeded sample. Case j < len(slots) puts placement kind j on the main operand of one mesh dim (the
    others aligned to it), so every kind is covered; the other mesh dims, and later cases, draw aligned or
    independent random columns."""
    rng = random.Random(seed)
    ndim = len(mesh_shape)
    order = list(range(len(prepared)))
    rng.shuffle(order)
    slots = coverage_slots(prepared)
    start = sum(DEFAULT_BUDGET.get(d, 0) for d in range(1, ndim))  # each mesh sweeps on where the smaller ones stopped
    slots = slots[start % len(slots) :] + slots[: start % len(slots)]
    cases: list[Case] = []
    seen: set = set()
    rejected = 0
    while len(cases) < budget and rejected < budget * 20:
        j = len(cases)
        slot = slots[j] if j < len(slots) else None
        fits = [
            si
            for si in order
            if slot is None or slot in alphabet(prepared[si].tensors[main_operand(prepared[si].tensors)])
        ]
        si = fits[(j + rejected) % len(fits)]
        tensors = prepared[si].tensors
        columns = [_random_column(tensors, rng) for _ in range(ndim)]
        if slot is not None:
            columns[j % ndim] = aligned_column(slot, tensors)
        layouts = _transpose(columns)
        if not pending_kinds_ok(layouts, tensors) or (si, layouts) in seen:
            rejected += 1
            continue
        seen.add((si, layouts))
        cases.append(Case(len(cases), si, layouts))
    return cases


def _random_column(tensors: Sequence[torch.Tensor], rng: random.Random) -> tuple[Placement, ...]:
    """Mostly an aligned column of a random kind (where rules keep data in place), sometimes independent picks."""
    if rng.random() < 0.6:
        main = tensors[main_operand(tensors)]
        return aligned_column(rng.choice(alphabet(main)), tensors)
    return tuple(rng.choice(alphabet(t)) for t in tensors)


def describe_layouts(prep: Prepared, layouts) -> str:
    return " ".join(f"{tensor_text(t)}:{','.join(map(repr, pl))}" for t, pl in zip(prep.tensors, layouts))
