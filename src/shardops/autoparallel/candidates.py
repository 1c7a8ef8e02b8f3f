"""The plans the search chooses among, as a person would write them.

A candidate fixes, per mesh dim, data parallelism or tensor parallelism (at most one
tensor-parallel dim), and on the tensor-parallel dim one choice per *kind* of module,
taken by every repeated block alike (the plan keys carry the wildcard `blocks.*`):

- `sequence_parallel`: the residual stream between blocks is sequence-sharded (norms under
  SequenceParallel) or replicated;
- `embeddings_parallel`: embeddings row-parallel (vocabulary-sharded tables) or replicated
  (every rank looks up its own tokens: no collective, the whole table's memory);
- `vocab_parallel`: the output head column-parallel with vocabulary-sharded logits, or replicated;
- one flag per Linear group of a block (attention, MLP): column/row-parallel as a pair,
  or replicated (every rank computes the group on the whole activation);
- `expert_parallel` (a block with mixture-of-experts layers, structure.Experts, and a data-parallel
  dim): the experts `ExpertParallel` over the data mesh, torchtitan's way (each rank holds its share
  of the experts and routes its own tokens to them by all_to_all; on a (dp, tp) mesh each expert is
  tensor-parallel over tp too), left alone by fully_shard/replicate; else every rank keeps every expert.

The data-parallel dims are torch's data parallelism over the dp sub-mesh (plan.py applies it):
`replicate` (DDP), or `fully_shard` per repeated block and the root (torchtitan's apply_fsdp)
with `reshard_after_forward` True or False. Only parameters are distributed; each rank runs the
model on its own batch slice.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from ..parallel import (
    ColwiseParallel,
    ExpertParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from ..placements import Replicate, Shard
from .conv_pairs import conv_pair_entries, conv_pair_flags, conv_work_saved
from .structure import ModelStructure

__all__ = ["Candidate", "PlanEntry", "enumerate_candidates", "plan_entries"]


@dataclass(frozen=True)
class Candidate:
    dims: tuple[str, ...]  # per mesh dim: "dp" or "tp"
    sequence_parallel: bool = False
    vocab_parallel: bool = False  # the output head column-parallel with vocabulary-sharded logits
    groups_tp: tuple[bool, ...] = ()
    dp_mode: str = "replicate"  # "replicate" (DDP) or "fully_shard" (parameters, gradients, optimizer state 1/dp)
    embeddings_parallel: bool = False  # the embedding tables row-parallel (vocabulary-sharded)
    pairs_tp: tuple[bool, ...] = ()  # a model without blocks: per Linear pair, column/row-parallel or replicated
    reshard_after_forward: bool = True  # fully_shard's: free each unit's gathered parameters after its forward
    expert_parallel: bool = False  # the experts ExpertParallel over the data-parallel ranks (and tp inside)
    conv_pairs_tp: tuple[bool, ...] = ()  # per convolution pair (conv_pairs.py): split by channels or replicated

    @property
    def tp_dim(self) -> int | None:
        return self.dims.index("tp") if "tp" in self.dims else None

    @property
    def dp_dims(self) -> tuple[int, ...]:
        return tuple(d for d, kind in enumerate(self.dims) if kind == "dp")


@dataclass(frozen=True)
class PlanEntry:
    key: str  # parallelize_module plan key, wildcards folded
    text: str  # the style as a person writes it
    make: Callable[[], object]  # a fresh style object (styles keep per-application state)
    mesh: str = "tp"  # applied on the tp sub-mesh, or "data": the data mesh (with tp: the whole (dp, tp) mesh)


# A candidate may leave a rank at most this multiple of its even share of the model's matmul work
# (replicating a small output head is fine; replicating a block's attention is not parallelism).
# Without it, "every rank computes everything" would win on bytes: it moves nothing.
COMPUTE_SLACK = 1.25


def compute_share(structure: ModelStructure, c: Candidate, mesh_shape: tuple[int, ...]) -> float:
    """The busiest rank's matmul work (weight elements x tokens) over an even split of the whole model's."""
    world = 1
    for size in mesh_shape:
        world *= size
    dp = world // (mesh_shape[c.tp_dim] if c.tp_dim is not None else 1)
    tp = world // dp
    experts = sum(e.weights for e in structure.experts)
    per_block = sum(g.weights for g in structure.groups) + structure.block_other_weights + experts
    total = structure.n_blocks * per_block + structure.head_weights + structure.other_weights
    if total == 0:
        return 1.0
    # what no style splits (block_other_weights, other_weights) every tensor-parallel rank computes whole;
    # expert parallelism over (dp, tp) splits each expert over tp too
    mine = structure.n_blocks * (
        structure.block_other_weights
        + experts / (tp if c.expert_parallel else 1)
        + sum(
            g.weights / (tp if on else 1)
            for g, on in zip(structure.groups, c.groups_tp or (False,) * len(structure.groups))
        )
    )
    mine += structure.head_weights / (tp if c.vocab_parallel else 1) + structure.other_weights
    mine -= sum(w * (1 - 1 / tp) for w, on in zip(structure.pair_weights, c.pairs_tp) if on)
    mine -= conv_work_saved(structure.conv_pairs, c.conv_pairs_tp, tp)
    return (mine / dp) / (total / world)


DP_MODES = ("replicate", "fully_shard")
DataParallel = tuple[str, bool]  # (dp_mode, reshard_after_forward)


def _dp_choices(dp_modes: tuple[str, ...]) -> list[DataParallel]:
    """fully_shard twice: resharding after forward (less memory, one more all_gather per unit) or not."""
    out: list[DataParallel] = []
    for mode in dp_modes:
        if mode not in DP_MODES:
            raise ValueError(f"dp mode {mode!r}; use one of {DP_MODES}")
        out.extend([(mode, True), (mode, False)] if mode == "fully_shard" else [(mode, True)])
    return out


def enumerate_candidates(
    structure: ModelStructure, mesh_shape: tuple[int, ...], batch: int, dp_modes: tuple[str, ...] = ("replicate",)
) -> list[Candidate]:
    """Every candidate for this mesh: per dim dp or tp (dp only where the batch splits evenly), with and
    without expert parallelism (mixture-of-experts blocks, a dp dim), that keeps each rank's matmul work
    within COMPUTE_SLACK of an even share."""
    choices = _dp_choices(dp_modes)
    out: list[Candidate] = []
    # the last dim first: ties then go to (dp, tp), the usual order (tp on the innermost, fastest links)
    tp_choices = (
        list(reversed(range(len(mesh_shape))))
        if structure.transformer or structure.pairs or structure.conv_pairs
        else []
    )
    sizes_seen: set[int] = set()
    for tp in [None, *tp_choices]:
        if tp is not None:
            if mesh_shape[tp] in sizes_seen:
                continue  # tensor parallelism on another dim of the same size moves the same bytes
            sizes_seen.add(mesh_shape[tp])
        dims = tuple("tp" if d == tp else "dp" for d in range(len(mesh_shape)))
        dp_ranks = 1
        for d, kind in enumerate(dims):
            if kind == "dp":
                dp_ranks *= mesh_shape[d]
        if batch % dp_ranks:
            continue
        modes = choices if "dp" in dims else [("replicate", True)]
        if tp is None:
            out.extend(Candidate(dims, dp_mode=mode, reshard_after_forward=raf) for mode, raf in modes)
            continue
        if not structure.transformer:
            out.extend(
                _pair_candidates(structure, dims, modes) + _conv_pair_candidates(structure, dims, modes, mesh_shape[tp])
            )
            continue
        sp_choices = (False,) if structure.positions_from_stream else (True, False)  # sequence.py
        for sp, vocab, emb in itertools.product(sp_choices, (True, False), (True, False)):
            for groups in itertools.product((True, False), repeat=len(structure.groups)):
                out.extend(
                    Candidate(dims, sp, vocab, groups, mode, emb, reshard_after_forward=raf) for mode, raf in modes
                )
    out = [v for c in out for v in _with_expert_parallel(structure, c)]
    return [c for c in out if compute_share(structure, c, mesh_shape) <= COMPUTE_SLACK]


def _with_expert_parallel(structure: ModelStructure, c: Candidate) -> list[Candidate]:
    """`c`, and `c` with its experts ExpertParallel over the data mesh (where there are experts and a dp dim)."""
    if not structure.experts or not c.dp_dims:
        return [c]
    return [c, dataclasses.replace(c, expert_parallel=True)]


MAX_PAIRS_SEARCHED = 3  # every on/off combination of this many pairs; beyond, all of them on only


def _pair_candidates(structure: ModelStructure, dims: tuple[str, ...], modes: list[DataParallel]) -> list[Candidate]:
    """Linear pairs split or not (at least one split). Their outputs are plain tensors of this rank's
    batch slice (RowwiseParallel's default), as the unsplit model's: a loss over them is the rank's own."""
    n = len(structure.pairs)
    choices = itertools.product((True, False), repeat=n) if n <= MAX_PAIRS_SEARCHED else [(True,) * n]
    return [
        Candidate(dims, dp_mode=mode, pairs_tp=flags, reshard_after_forward=raf)
        for flags in choices
        if any(flags)
        for mode, raf in modes
    ]


# ---- convolution pairs split by channels (conv_pairs.py, parallel/conv_style.py)


def _conv_pair_candidates(
    structure: ModelStructure, dims: tuple[str, ...], modes: list[DataParallel], tp_size: int
) -> list[Candidate]:
    """Convolution pairs split by channels or not (at least one split; only pairs tp_size ranks can split)."""
    return [
        Candidate(dims, dp_mode=mode, conv_pairs_tp=flags, reshard_after_forward=raf)
        for flags in conv_pair_flags(structure.conv_pairs, tp_size)
        for mode, raf in modes
    ]


# ----


def _pair_entries(col: str, row: str) -> list[PlanEntry]:
    return [PlanEntry(col, "ColwiseParallel()", ColwiseParallel), PlanEntry(row, "RowwiseParallel()", RowwiseParallel)]


@dataclass(frozen=True)
class _GroupInput:
    kwargs: dict  # PrepareModuleInput's layout arguments
    text: str  # the same, as a person writes them


def _group_input(group, seq, s: str) -> _GroupInput:
    """The group's residual-stream input from `seq` to Replicate(): by position, or by keyword
    when the block calls the group with keywords only (transformers' `self_attn(hidden_states=...)`)."""
    if group.n_inputs == 0 and group.input_kwarg is not None:
        k = group.input_kwarg
        return _GroupInput(
            {"input_kwarg_layouts": {k: seq}, "desired_input_kwarg_layouts": {k: Replicate()}},
            f"input_kwarg_layouts={{{k!r}: {s}}}, desired_input_kwarg_layouts={{{k!r}: Replicate()}}",
        )
    rest = (None,) * (max(group.n_inputs, 1) - 1)
    ins_t = "(" + ", ".join([s, *["None"] * len(rest)]) + ("," if not rest else "") + ")"
    want_t = "(" + ", ".join(["Replicate()", *["None"] * len(rest)]) + ("," if not rest else "") + ")"
    return _GroupInput(
        {"input_layouts": (seq, *rest), "desired_input_layouts": (Replicate(), *rest)},
        f"input_layouts={ins_t}, desired_input_layouts={want_t}",
    )


def _place(p) -> str:
    return "Shard(1)" if p == Shard(1) else "Replicate()" if p == Replicate() else repr(p)


def plan_entries(structure: ModelStructure, c: Candidate) -> list[PlanEntry]:
    """The parallelize_module plans of a candidate: the tensor-parallel one (on the tp sub-mesh), then the
    experts' (on the data mesh); empty for pure data parallelism."""
    return [*_tp_entries(structure, c), *_expert_entries(structure, c)]


def _expert_entries(structure: ModelStructure, c: Candidate) -> list[PlanEntry]:
    """ExpertParallel over the data mesh (the data dim of the mesh the plan is applied on: the flattened
    dp dim leads; one dp dim keeps its place beside tp), each expert tensor-parallel over tp if any."""
    if not c.expert_parallel:
        return []
    ep = c.dp_dims[0] if len(c.dp_dims) == 1 else 0
    text = "ExpertParallel()" if ep == 0 else f"ExpertParallel(ep_dim={ep})"
    return [
        PlanEntry(f"{structure.blocks}.*.{e.name}", text, lambda: ExpertParallel(ep_dim=ep), mesh="data")
        for e in structure.experts
    ]


def _tp_entries(structure: ModelStructure, c: Candidate) -> list[PlanEntry]:
    if c.tp_dim is None:
        return []
    if c.conv_pairs_tp:  # channel-sharded activations inside each split pair; plain everywhere else
        return [PlanEntry(*entry) for entry in conv_pair_entries(structure.conv_pairs, c.conv_pairs_tp)]
    if c.pairs_tp:  # a feature-sharded activation between each pair; replicated (plain) everywhere else
        return [entry for pair, on in zip(structure.pairs, c.pairs_tp) if on for entry in _pair_entries(*pair)]
    seq = Shard(1) if c.sequence_parallel else Replicate()
    s = _place(seq)
    entries: list[PlanEntry] = []

    def add(key, text, make):
        entries.append(PlanEntry(key, text, make))

    for emb in structure.embeddings:
        if c.embeddings_parallel:
            add(
                emb,
                f"RowwiseParallel(input_layouts=Replicate(), output_layouts={s})",
                lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            )
        elif c.sequence_parallel:  # whole table on every rank; the output keeps this rank's sequence shard
            add(
                emb,
                "PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))",
                lambda: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
            )
    if c.vocab_parallel:
        add(
            structure.head,
            f"ColwiseParallel(input_layouts={s}, output_layouts=Shard(-1), use_local_output=False)",
            lambda: ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
        )
    else:
        add(
            structure.head,
            f"PrepareModuleInputOutput(input_layouts={s}, desired_input_layouts=Replicate(), use_local_input=True, "
            "output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=False)",
            lambda: PrepareModuleInputOutput(
                input_layouts=seq,
                desired_input_layouts=Replicate(),
                use_local_input=True,
                output_layouts=Replicate(),
                desired_output_layouts=Replicate(),
                use_local_output=False,
            ),
        )
    if c.sequence_parallel:
        for norm in structure.final_norms:
            add(norm, "SequenceParallel()", SequenceParallel)
    block = f"{structure.blocks}.*"
    for norm in structure.block_norms if c.sequence_parallel else ():
        add(f"{block}.{norm}", "SequenceParallel()", SequenceParallel)
    for moe in dict.fromkeys(e.moe for e in structure.experts) if c.sequence_parallel else ():
        # the router and the experts take the rank's whole tokens, replicated over tp, as plain tensors
        add(
            f"{block}.{moe}",
            "PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), "
            "use_local_input=True, output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),))",
            lambda: PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
            ),
        )
    for group, tp in zip(structure.groups, c.groups_tp):
        key = f"{block}.{group.name}"
        prep = _group_input(group, seq, s)
        if tp:
            # a group called with keywords only (transformers' attention) keeps its plain input when the stream
            # is replicated: each column-parallel Linear takes it as Replicate, as transformers' own plan does
            # (a DTensor there would meet the plain attention mask the model builds beside it)
            if c.sequence_parallel or group.input_kwarg is None or group.n_inputs:
                add(key, f"PrepareModuleInput({prep.text})", lambda prep=prep: PrepareModuleInput(**prep.kwargs))
            for lin in group.colwise:
                add(f"{key}.{lin}", "ColwiseParallel()", ColwiseParallel)
            add(
                f"{key}.{group.rowwise}",
                f"RowwiseParallel(output_layouts={s})",
                lambda: RowwiseParallel(output_layouts=seq),
            )
        elif c.sequence_parallel:  # the whole group on every rank, on the gathered sequence; its output re-sliced
            add(
                key,
                f"PrepareModuleInputOutput({prep.text}, use_local_input=True, "
                "output_layouts=Replicate(), desired_output_layouts=Shard(1))",
                lambda prep=prep: PrepareModuleInputOutput(
                    **prep.kwargs, use_local_input=True, output_layouts=Replicate(), desired_output_layouts=Shard(1)
                ),
            )
    return entries
