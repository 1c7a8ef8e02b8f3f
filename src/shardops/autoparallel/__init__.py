"""so.autoparallel: choose a model's whole parallelization plan by its predicted step time (or bytes).

    plan = so.autoparallel(model, (2, 2), (tokens,))
    print(plan)                      # the parallelize_module dict + fully_shard/replicate a person would write
    so.run(lambda: train(plan.apply(Llama(args)), plan.local_batch(tokens)), 4)

Search: per mesh dim data or tensor parallelism (torch's: `replicate`, or `fully_shard` per repeated
block and the root, on the dp sub-mesh; each rank its batch slice); on the tensor-parallel dim one style per
kind of module (sequence parallelism, vocabulary parallelism, column/row-parallel or
replicated per Linear group), decided once for a block and reused by every repeated block
(candidates.py). Every candidate is priced by running its step (measure.py): on a threads world
of the mesh's size, where it must also give single-device values, or, from metadata alone, as
one rank of a dry world on META tensors (comm/dry.py: any mesh size, a model built on the meta
device). The shortest predicted step wins (timing.py: the dry step's collectives priced on the link
model, its kernels' FLOPs and bytes on a compute model), then the fewest bytes; with objective="bytes"
the fewest bytes on the busiest rank, then the fewest rounds, then the least memory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cost import resolve_links
from ..errors import ShardingError
from ..explain.trace import warm_up
from ..mesh import DeviceMesh
from ..placements import Replicate
from ..tensor import DTensor, from_local
from .candidates import compute_share, enumerate_candidates, plan_entries
from .measure import (
    expert_routing,
    extrapolate,
    give_routing,
    measure,
    measure_dry,
    on_meta,
    reference_step,
    uses_batch_statistics,
)
from .plan import OBJECTIVES, Plan, Scored, apply_candidate, batch_feed, mesh_names_for, rank_key
from .sequence import reads_sequence_length_from_stream
from .structure import find_structure, truncated
from .timing import Compute, StepProfile, extrapolate_profile, predict, profile_dry, resolve_compute

__all__ = ["Compute", "Plan", "autoparallel", "language_model_loss"]

MAX_RUNNABLE_RANKS = 16  # pricing runs the step on a threads world of this many ranks at most


def language_model_loss(output: torch.Tensor, tokens: torch.Tensor, *rest) -> torch.Tensor:
    """Next-token cross-entropy of a language model called on token ids (transformers' outputs: their `.logits`)."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, DTensor) and not isinstance(tokens, DTensor):  # the global batch, the same on every rank
        tokens = from_local(tokens, logits.device_mesh, [Replicate()] * logits.device_mesh.ndim)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _blocks_text(model: nn.Module, blocks: str | None) -> str:
    """The loop over the repeated blocks as code writes it: model.layers, model.layers.values()."""
    if blocks is None:
        return ""
    dict_ = isinstance(model.get_submodule(blocks), nn.ModuleDict)
    return f"model.{blocks}.values()" if dict_ else f"model.{blocks}"


PRICINGS = ("auto", "run", "metadata")


def _pricing_for(pricing: str, shape: tuple[int, ...], model: nn.Module, example: tuple) -> str:
    if pricing not in PRICINGS:
        raise ShardingError(f"autoparallel: pricing={pricing!r}; use one of {PRICINGS}")
    on_meta_already = any(isinstance(t, torch.Tensor) and t.is_meta for t in example) or any(
        p.is_meta for p in model.parameters()
    )
    runnable = math.prod(shape) <= MAX_RUNNABLE_RANKS and not on_meta_already
    if pricing == "run" and not runnable:
        raise ShardingError(
            f"autoparallel: pricing='run' runs one step on a threads world, which needs real tensors and at most "
            f"{MAX_RUNNABLE_RANKS} ranks (mesh {shape}); use pricing='metadata' (or the default)"
        )
    if pricing == "auto":
        return "run" if runnable else "metadata"
    return pricing


def autoparallel(
    model: nn.Module,
    mesh: DeviceMesh | Sequence[int],
    example_inputs: tuple | torch.Tensor,
    *,
    loss_fn: Callable | None = None,
    links=None,
    memory_per_rank: int | None = None,
    pricing: str = "auto",
    objective: str = "bytes",
    compute: str | Compute | None = None,
    optimizer: str = "adamw",
) -> Plan:
    """The plan with the fewest bytes (or shortest predicted step time) per rank (see module doc). Call it outside
    `so.run`, with the global example batch; apply the plan inside, on every rank.

    `pricing`: "run" runs each candidate's step on a threads world of the mesh's size and checks its
    values against single-device torch; "metadata" runs it as one rank at a time of a dry world on
    META tensors (any mesh size, a model built on the meta device); "auto" (default) runs where it
    can (real tensors, at most 16 ranks) and prices from metadata otherwise.

    `objective`: "time" ranks the feasible candidates by predicted step time per rank
    (forward, backward, gradient resolution and an `optimizer` step: timing.py, under `links` and
    `compute`, a Compute or a preset name; default "gloo-localhost" for gloo-localhost links, "gpu"
    with nvlink/ib links, else "cpu"), then bytes; "bytes" (default, until the time model is validated on an
    idle machine: docs/autoparallel.md) by bytes on the busiest rank, then rounds, then memory."""
    shape = tuple(int(s) for s in (mesh.shape if isinstance(mesh, DeviceMesh) else mesh))
    example = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if objective not in OBJECTIVES:
        raise ShardingError(f"autoparallel: objective={objective!r}; use one of {OBJECTIVES}")
    link_models = resolve_links(links, len(shape))
    compute_model = resolve_compute(compute, link_models)
    how = _pricing_for(pricing, shape, model, example)
    warmup_s = warm_up() if how == "metadata" else 0.0  # torch's first meta kernel imports dynamo: said apart
    t0 = time.perf_counter()
    structure = find_structure(model, example)  # a model with values: its forward routes tokens to experts
    if structure.transformer:  # sequence parallelism only where the model takes its positions from its input
        structure.positions_from_stream = reads_sequence_length_from_stream(model, structure, example)
    routing = _routing(model, structure, example)
    if how == "metadata":
        model, example = _on_meta_routed(model, example, routing)
    loss_fn = loss_fn or language_model_loss
    # repeated blocks cost the same each: price a 1-block and a 2-block copy and extrapolate
    depths = (1, 2) if structure.blocks and structure.n_blocks > 2 else (None,)
    models = [model if k is None or not structure.blocks else truncated(model, structure.blocks, k) for k in depths]
    refs = [reference_step(m, example, loss_fn) for m in models]
    # with BatchNorm, a data-parallel step equals torch's DDP step (each rank's batch statistics), not one device's
    per_rank_statistics = uses_batch_statistics(model) and how == "run"
    dp_refs: dict[int, list] = {1: refs}
    # the step-time profile comes from the dry world always (metadata: what the byte pricing ran)
    metas = [(mod, example) if how == "metadata" else _on_meta_routed(mod, example, routing) for mod in models]
    batch = example[0].shape[0]
    scored: list[Scored] = []
    # fully_shard never moves fewer bytes than replicate (all_gathers and a reduce_scatter per unit
    # against one all_reduce of the gradients); it is searched only when memory is a constraint
    dp_modes = ("replicate",) if memory_per_rank is None else ("replicate", "fully_shard")
    for cand in enumerate_candidates(structure, shape, batch, dp_modes):
        entries = plan_entries(structure, cand)
        names = mesh_names_for(cand)
        apply_fn = lambda mod, msh, c=cand, e=entries: apply_candidate(mod, msh, c, e, structure.blocks)  # noqa: E731
        feed_fn = batch_feed(shape, cand)
        pricer = measure if how == "run" else measure_dry
        dp = math.prod(shape[d] for d in cand.dp_dims) if per_rank_statistics else 1
        if dp not in dp_refs:
            dp_refs[dp] = [reference_step(m, example, loss_fn, dp) for m in models]
        pairs = zip(models, dp_refs[dp])
        runs = [pricer(mod, shape, names, apply_fn, feed_fn, example, loss_fn, ref) for mod, ref in pairs]
        m = runs[0] if len(runs) == 1 else extrapolate(runs[0], runs[1], structure.n_blocks)
        if m.feasible and memory_per_rank is not None and m.memory_per_rank > memory_per_rank:
            m.error = f"needs {m.memory_per_rank:,} B per rank, over memory_per_rank={memory_per_rank:,}"
        profile, time_error = None, None
        if m.feasible and objective == "time":
            try:
                warm = how != "metadata"  # after a threads run: the dry world's own decisions are not cached yet
                profile = _profile(metas, shape, names, apply_fn, feed_fn, loss_fn, optimizer, structure.n_blocks, warm)
            except Exception as e:  # noqa: BLE001  (ran, but not in the dry world: ranked last, said in the plan)
                time_error = f"{type(e).__name__}: {e}"
        step = None if profile is None else predict(profile, link_models, compute_model)
        scored.append(Scored(cand, entries, m, profile, step, time_error))
    if not scored:
        raise ShardingError(
            f"autoparallel: no candidate for {type(model).__name__} on mesh {shape}: the example batch of {batch} does "
            "not split evenly over the data-parallel dims, and the model has no repeated blocks for tensor "
            "parallelism; give a batch divisible by the mesh size"
        )
    feasible = [s for s in scored if s.measurement.feasible]
    if not feasible:
        reasons = "; ".join(f"{s.candidate}: {s.measurement.error}" for s in scored[:4])
        raise ShardingError(
            f"autoparallel: no candidate plan works for {type(model).__name__} on mesh {shape} ({reasons})"
        )
    if objective == "time" and all(s.time is None for s in feasible):
        raise ShardingError(
            f"autoparallel: objective='time' could time none of the {len(feasible)} feasible plans for "
            f"{type(model).__name__} on mesh {shape} in the dry world ({feasible[0].time_error}); "
            "use objective='bytes'"
        )
    best = min(feasible, key=rank_key(objective))
    plan = Plan(
        shape, best, scored, type(model).__name__, compute_share(structure, best.candidate, shape), PRICING_TEXT[how]
    )
    plan.blocks, plan.blocks_text = structure.blocks, _blocks_text(model, structure.blocks)
    if best.candidate.dp_dims and uses_batch_statistics(model):
        plan.notes.append(BATCH_NORM_NOTE)
    if how == "metadata" and structure.experts:
        plan.notes.append(EXPERTS_ON_META_NOTE)
    plan.objective = objective
    plan.models = (link_models, compute_model)
    plan.timings = {"plan_s": time.perf_counter() - t0, "warmup_s": warmup_s}
    return plan


def _routing(model: nn.Module, structure, example: tuple) -> dict[str, torch.Tensor]:
    """The expert ids every experts module's router gives on the example (a model with values, at most two
    blocks run): the dry world routes by them. Empty without experts or values."""
    if not structure.experts or any(p.is_meta for p in model.parameters()):
        return {}
    probe = truncated(model, structure.blocks, 2) if structure.n_blocks > 2 else model
    stack = probe.get_submodule(structure.blocks)
    names = [f"{structure.blocks}.{b}.{e.name}" for b, _ in stack.named_children() for e in structure.experts]
    return expert_routing(probe, names, example)


def _on_meta_routed(model: nn.Module, example: tuple, routing: dict) -> tuple[nn.Module, tuple]:
    meta_model, meta_example = on_meta(model, example)
    return give_routing(meta_model, routing), meta_example


EXPERTS_ON_META_NOTE = (
    "experts priced from metadata: routed by the example's recorded expert ids; their own activations "
    "(and FLOPs) are not in the figures below"
)
BATCH_NORM_NOTE = "BatchNorm: each rank's batch statistics (torch DDP semantics); use nn.SyncBatchNorm for global ones"


def _profile(metas, shape, names, apply_fn, feed_fn, loss_fn, optimizer: str, n_blocks: int, warm: bool) -> StepProfile:
    """The candidate's step profile on META copies; from a 1- and a 2-block copy, extrapolated, as the bytes.
    `warm`: run the dry step once unprofiled first; not needed right after the dry byte pricing ran it
    (the planner's shape inference is cached then), so both pricings give the same profile."""
    profiles = [
        profile_dry(mod, shape, names, apply_fn, feed_fn, ex, loss_fn, optimizer=optimizer, warm=warm)
        for mod, ex in metas
    ]
    return profiles[0] if len(profiles) == 1 else extrapolate_profile(profiles[0], profiles[1], n_blocks)


PRICING_TEXT = {
    "run": "measured: one step on the threads world, counted with so.CommDebugMode",
    "metadata": "from metadata: one step on META tensors in the dry world, counted with so.CommDebugMode",
}
