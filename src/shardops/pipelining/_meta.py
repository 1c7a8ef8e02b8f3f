"""The first step's checks: the pipeline's layout agrees on every rank, and the shapes crossing each
stage boundary are inferred (or checked against `input_args`/`output_args`).

Every failure is raised on every rank of the pipeline at once, with the same message: the layout
is checked from one all_gather of each rank's description; the shapes travel down the pipeline
stage by stage (a stage that fails passes its error on instead of shapes, so no stage waits for
ever), and a last all_gather tells every rank what failed where.

Messages are JSON in fixed-size uint8 buffers, so a receiver always knows what to allocate.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..comm.base import Communicator, Group, P2POp
from ..errors import ShardingError
from .stage import PipelineStage, TensorMeta

META_BYTES = 4096
_DTYPES = {
    str(d): d
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


def encode(obj: Any) -> torch.Tensor:
    raw = json.dumps(obj).encode()
    if len(raw) > META_BYTES:  # only an error message can be this long
        raw = json.dumps({**obj, "error": obj.get("error", "")[: META_BYTES // 2] + "..."}).encode()[:META_BYTES]
    buf = torch.zeros(META_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def decode(buf: torch.Tensor) -> Any:
    raw = bytes(buf.tolist())
    return json.loads(raw.rstrip(b"\x00").decode())


def gather(comm: Communicator, group: Group, obj: Any) -> list[Any]:
    return [decode(b) for b in comm.all_gather(encode(obj), group)]


def metas_to_json(metas: Sequence[TensorMeta]) -> list:
    return [[list(m.shape), str(m.dtype), m.requires_grad, m.placements, m.global_shape] for m in metas]


def metas_from_json(items: list) -> tuple[TensorMeta, ...]:
    return tuple(
        TensorMeta(
            tuple(shape), _DTYPES[dtype], rg, None if pl is None else tuple(pl), None if gs is None else tuple(gs)
        )
        for shape, dtype, rg, pl, gs in items
    )


def describe(metas: Sequence[TensorMeta]) -> str:
    return "(" + ", ".join(m.describe() for m in metas) + ")"


# ------------------------------------------------------------------ the layout


def check_layout(
    comm: Communicator, stages: Sequence[PipelineStage], schedule: str, n_microbatches: int, place: Callable[[int], int]
) -> None:
    """Every rank of the group agrees on the stage count, the micro-batch count and the schedule, and
    holds the stages the schedule's placement gives it (stage s on group member `place(s)`)."""
    group = stages[0].group
    mine = {
        "rank": comm.rank,
        "schedule": schedule,
        "n_microbatches": n_microbatches,
        "num_stages": [s.num_stages for s in stages],
        "stages": [s.stage_index for s in stages],
    }
    everyone = gather(comm, group, mine)
    problem = _layout_problem(everyone, group, place)
    if problem:
        raise ShardingError(f"{schedule}: the pipeline over ranks {list(group.ranks)} is inconsistent: {problem}")


def _layout_problem(everyone: list[dict], group: Group, place: Callable[[int], int]) -> str | None:
    def per_rank(key: str) -> str:
        return ", ".join(f"rank {d['rank']}: {d[key]}" for d in everyone)

    if len({json.dumps(d["num_stages"]) for d in everyone}) > 1 or any(len(set(d["num_stages"])) > 1 for d in everyone):
        return (
            f"mismatched stage counts (num_stages by rank: {per_rank('num_stages')}); "
            "give every PipelineStage the same num_stages"
        )
    if len({d["schedule"] for d in everyone}) > 1:
        return f"different schedules ({per_rank('schedule')}); build the same schedule class on every rank"
    if len({d["n_microbatches"] for d in everyone}) > 1:
        return f"different n_microbatches ({per_rank('n_microbatches')})"
    num_stages = everyone[0]["num_stages"][0]
    per = {len(d["stages"]) for d in everyone}
    if len(per) > 1 or num_stages != group.size * per.pop():
        return (
            f"{num_stages} stages do not spread evenly over {group.size} ranks (stages by rank: {per_rank('stages')}); "
            f"num_stages must be the group size times the stages each rank holds"
        )
    for d in everyone:
        wrong = [s for s in d["stages"] if group.ranks[place(s)] != d["rank"]]
        if wrong:
            where = ", ".join(f"stage {s} on rank {group.ranks[place(s)]}" for s in wrong)
            return (
                f"rank {d['rank']} holds stage(s) {wrong}, which this schedule places elsewhere "
                f"({where}; stages by rank: {per_rank('stages')})"
            )
    return None


# ------------------------------------------------------------------ the shapes


def infer_shapes(
    comm: Communicator,
    stages: Sequence[PipelineStage],
    first_args: Sequence[torch.Tensor] | None,
    input_errors: Sequence[str],
    tag: Callable[[int], int],
) -> None:
    """Set each stage's input_metas/output_metas, passing shapes from stage 0 to the last; raise on every rank on
    failure. `input_errors`: what this rank found wrong with step()'s inputs or target (reported with the rest)."""
    group = stages[0].group
    local: dict[int, dict] = {}  # messages between two stages of this rank
    errors: list[str] = list(input_errors)
    first_error = "step()'s inputs cannot be split" if input_errors and first_args is None else None
    works = []
    for stage in sorted(stages, key=lambda s: s.stage_index):
        s = stage.stage_index
        if stage.is_first:
            msg = (
                {"error": first_error}
                if first_error
                else {"metas": metas_to_json([TensorMeta.of(a) for a in first_args or ()])}
            )
        elif (s - 1) in local:
            msg = local.pop(s - 1)
        else:
            buf = torch.empty(META_BYTES, dtype=torch.uint8)
            for w in comm.batch_isend_irecv([P2POp("irecv", buf, stage.stage_to_rank(s - 1), group, tag(s))]):
                w.wait()
            msg = decode(buf)
        out, error = _stage_shapes(stage, msg, first_args)
        if error and not msg.get("error"):
            errors.append(error)
        if stage.is_last:
            continue
        nxt = {"error": error} if error else {"metas": metas_to_json(out)}
        if stage.stage_to_rank(s + 1) == comm.rank:
            local[s] = nxt
        else:
            works += comm.batch_isend_irecv(
                [P2POp("isend", encode(nxt), stage.stage_to_rank(s + 1), group, tag(s + 1))]
            )
    for w in works:
        w.wait()
    reported = [e for d in gather(comm, group, {"errors": errors}) for e in d["errors"]]
    if reported:
        raise ShardingError("pipeline shape check failed (raised on every rank): " + " | ".join(reported))


def _stage_shapes(
    stage: PipelineStage, msg: dict, first_args: Sequence[torch.Tensor] | None
) -> tuple[tuple[TensorMeta, ...], str | None]:
    """(output metas, error) of one stage, given what the previous stage sent."""
    if msg.get("error"):
        return (), msg["error"]
    s = stage.stage_index
    inputs = metas_from_json(msg["metas"])
    declared = stage.declared_inputs
    if declared is not None and [(m.shape, m.dtype, m.placements) for m in declared] != [
        (m.shape, m.dtype, m.placements) for m in inputs
    ]:
        return (), (
            f"stage {s - 1}'s output {describe(inputs)} differs from stage {s}'s input_args {describe(declared)}; "
            f"make the stages' shapes agree (or drop input_args to infer them)"
        )
    stage.input_metas = inputs
    if stage.declared_outputs is not None:
        stage.output_metas = stage.declared_outputs
        return stage.output_metas, None
    try:
        args = (
            tuple(first_args or ())
            if stage.is_first
            else tuple(
                m.wrap(torch.zeros(m.shape, dtype=m.dtype, device=stage.device), stage.mesh if m.placements else None)
                for m in inputs
            )
        )
        with torch.no_grad():
            out = stage.submod(*args)
    except Exception as e:  # noqa: BLE001 - reported on every rank, as a ShardingError
        where = "micro-batch 0" if stage.is_first else f"stage {s - 1}'s output {describe(inputs)}"
        return (), f"stage {s} (rank {stage.rank}) cannot take {where}: {type(e).__name__}: {e}"
    outs = out if isinstance(out, tuple) else (out,)
    stage.output_metas = tuple(TensorMeta.of(o) for o in outs)
    return stage.output_metas, None
