"""Pipeline schedules: each rank's ordered program of forward (F) and backward (B) actions, and
the executor that runs it.

A program is a list of `_Action(stage, kind, microbatch)`. The executor runs it in order:
an F receives its stage's inputs from the previous stage (an irecv posted while the action
before it computed, waited for now; or a hand-off when that stage is on this rank), computes,
and sends its outputs on without waiting (isend); a B does the same with gradients, backwards.
Sends never block, so every program whose actions come after what they depend on runs without
deadlock in both worlds. A failure on one rank makes every rank raise at once (_abort.py). The executed order is
kept per rank (`executed_actions`), so a test reads the bubble from it, not from timing.

Placement (torch's): stage s lives on group member s % group size, except on ScheduleZBVZeroBubble's
V (stages r and 2p-1-r on member r); each schedule's `_place` says, and the first step checks it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from ..comm.base import P2POp, P2PWork
from ..errors import ShardingError
from ..world import current_comm
from . import _abort, _meta, _zero_bubble
from . import explain as _explain
from .explain import RECV, SEND
from .stage import PipelineStage, TensorMeta, local_part

FORWARD, BACKWARD = "F", "B"
BACKWARD_INPUT, BACKWARD_WEIGHT = (
    "I",
    "W",
)  # a backward split in two (zero-bubble schedules): inputs' gradients, then weights'


@dataclass(frozen=True)
class _Action:
    stage: int
    kind: str  # "F", "B", or a split backward's "I" and "W"
    microbatch: int

    def __str__(self) -> str:  # torch's notation: "0F1" is stage 0's forward of micro-batch 1
        return f"{self.stage}{self.kind}{self.microbatch}"

    __repr__ = __str__


# ------------------------------------------------------------------ base


class _PipelineSchedule:
    """What every schedule shares: splitting the batch, the first step's checks, running the program."""

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable | None,
        scale_grads: bool,
        **specs: Any,
    ) -> None:
        given = [k for k, v in specs.items() if v is not None]
        if given:
            raise ShardingError(
                f"{type(self).__name__}: {given} are not supported yet; micro-batches split every tensor argument on "
                "dim 0"
            )
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ShardingError(f"{type(self).__name__}: n_microbatches must be a positive int, got {n_microbatches!r}")
        if not stages:
            raise ShardingError(f"{type(self).__name__}: no stages")
        if len({s.group.ranks for s in stages}) > 1:
            raise ShardingError(f"{type(self).__name__}: this rank's stages are in different groups")
        self._stages = {s.stage_index: s for s in stages}
        if len(self._stages) != len(stages):
            raise ShardingError(f"{type(self).__name__}: stage indices {[s.stage_index for s in stages]} repeat")
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self.scale_grads = scale_grads
        self._group = stages[0].group
        self._num_stages = stages[0].num_stages
        ranks = self._group.ranks
        for stage in stages:  # where every stage lives, for the transfers
            stage.stage_to_rank = lambda s: ranks[self._place(s)]
        self._checked = False
        self._sends: list[P2PWork] = []
        self._local: dict[tuple, tuple[torch.Tensor, ...]] = {}  # hand-offs between two stages of this rank
        self._posted: dict[tuple, tuple] = {}  # receives started ahead of their action: (buffers, works, source)
        self._guard: _abort.StepGuard | None = None
        self.executed_actions: list[_Action] = []  # this rank's actions of the last step, in the order run

    @property
    def n_microbatches(self) -> int:
        return self._n_microbatches

    @property
    def stages(self) -> list[PipelineStage]:
        return [self._stages[s] for s in sorted(self._stages)]

    def _program(self, stages: list[PipelineStage], has_backward: bool) -> list[_Action]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _place(self, stage_index: int) -> int:
        """The group member stage `stage_index` lives on: torch's looped placement, s % group size."""
        return stage_index % self._group.size

    # -- step
    def step(self, *args: Any, target: torch.Tensor | None = None, losses: list | None = None, **kwargs: Any) -> Any:
        """One training step over the whole batch: `args` on the first stage, `target` and `losses` on the last.
        Returns the last stage's outputs (micro-batches concatenated) there, None elsewhere."""
        if kwargs:
            raise ShardingError(
                f"{type(self).__name__}.step: keyword inputs {sorted(kwargs)} are not supported yet; pass them "
                "positionally"
            )
        name = type(self).__name__
        first, last = self._stages.get(0), self._stages.get(self._num_stages - 1)
        mb_args, split_error = self._split(args, "inputs") if first is not None else (None, None)
        mb_targets, target_error = (
            self._split((target,), "target") if last is not None and target is not None else (None, None)
        )
        comm = current_comm()
        if not self._checked:
            _meta.check_layout(comm, self.stages, name, self._n_microbatches, self._place)
            errors = [e for e in (split_error, target_error) if e]
            _meta.infer_shapes(
                comm, self.stages, mb_args[0] if mb_args else None, errors, lambda s: self._tag(s, 0, "meta", 0)
            )
            self._checked = True
        self._guard = _abort.StepGuard(self._group, name)  # from here on a failure on one rank raises on all
        if split_error or target_error:
            self._abandon(ShardingError(split_error or target_error), "the inputs' split")
        elif first is not None and mb_args is not None:  # (with a first stage, the inputs split)
            try:
                self._check_same_shapes(first, mb_args[0])
            except ShardingError as e:
                self._abandon(e, "the inputs' shapes")
        has_backward = self._loss_fn is not None and torch.is_grad_enabled()
        for stage in self.stages:
            stage.clear_runtime_states()
            stage.peak_in_flight = 0
            stage.backwards_left = self._n_microbatches if has_backward else 0
        self.executed_actions = []
        outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._run_program(self._program(self.stages, has_backward), mb_args, mb_targets, outputs)
        if not has_backward:  # forward only: nothing will read the activations kept for a backward
            for stage in self.stages:
                stage.clear_runtime_states()
        if has_backward and self.scale_grads:
            for stage in self.stages:
                stage.scale_grads(self._n_microbatches)
        if last is None:
            return None
        if losses is not None:
            losses.extend(last.take_losses())
        return _merge(outputs, self._n_microbatches)

    def explain(self, backward: bool = True) -> _explain.PipelineExplanation:
        """This rank's program and point-to-point traffic for one step, from metadata (nothing runs).

        Needs the shapes crossing the boundaries: run one step first, or give the stages `input_args`
        and `output_args`. `backward=False` explains a forward-only step (as under torch.no_grad())."""
        program = self._program(self.stages, backward and self._loss_fn is not None)
        return _explain.PipelineExplanation(
            type(self).__name__,
            current_comm().rank,
            self._num_stages,
            self._n_microbatches,
            tuple(self._group.ranks[self._place(s)] for s in range(self._num_stages)),
            tuple(str(a) for a in program),
            tuple(t for action in program for t in self._transfers_of(action)),
        )

    def _transfers_of(self, a: _Action) -> list[_explain.Transfer]:
        """What action `a` receives and sends across ranks, as `_run` does it (W moves nothing)."""
        if a.kind == BACKWARD_WEIGHT:
            return []
        stage = self._stages[a.stage]
        forward = a.kind == FORWARD
        what = "activations" if forward else "gradients"
        source, dest = (a.stage - 1, a.stage + 1) if forward else (a.stage + 1, a.stage - 1)
        found = []
        if 0 <= source < self._num_stages:  # the previous stage's outputs (forward), the next's gradients (backward)
            metas = self._metas(stage, "input" if forward else "output")
            found.append((RECV, source, metas))
        if 0 <= dest < self._num_stages:
            metas = self._metas(stage, "output" if forward else "input")
            found.append((SEND, dest, metas))
        me = current_comm().rank
        return [
            _explain.Transfer(str(a), direction, peer, what, metas)
            for direction, other, metas in found
            if (peer := self._group.ranks[self._place(other)]) != me
        ]

    def _metas(self, stage: PipelineStage, side: str) -> tuple[TensorMeta, ...]:
        metas = (
            stage.input_metas or stage.declared_inputs
            if side == "input"
            else stage.output_metas or stage.declared_outputs
        )
        if metas is None:
            raise ShardingError(
                f"{type(self).__name__}.explain: stage {stage.stage_index}'s {side} shapes are not known yet; run one "
                "step first (it infers them) or give the PipelineStage input_args and output_args"
            )
        return metas

    def _check_same_shapes(self, first: PipelineStage, args: tuple) -> None:
        """A later step's micro-batches must look like the first step's: every stage's buffers were sized then."""
        now = tuple(TensorMeta.of(a) for a in args if isinstance(a, torch.Tensor))
        then = first.input_metas or ()
        if [(m.shape, m.dtype) for m in now] != [(m.shape, m.dtype) for m in then]:
            raise ShardingError(
                f"{type(self).__name__}.step: this step's micro-batch {_meta.describe(now)} differs from the first "
                f"step's {_meta.describe(then)}, which sized every stage's transfers; keep the batch shape fixed (or "
                "build a new schedule)"
            )

    def _split(self, values: Sequence[Any], what: str) -> tuple[list[tuple], str | None]:
        """Each micro-batch's values (tensors split on dim 0), or the reason they cannot be split."""
        m = self._n_microbatches
        for v in values:
            if isinstance(v, torch.Tensor) and (v.ndim == 0 or v.shape[0] % m):
                size = "a 0-d tensor" if v.ndim == 0 else f"batch size {v.shape[0]}"
                return [], (
                    f"{type(self).__name__}.step: the {what} of shape {tuple(v.shape)} ({size}) do not split into "
                    f"n_microbatches={m} equal micro-batches on dim 0; use a batch size divisible by {m}"
                )
        columns = [v.chunk(m) if isinstance(v, torch.Tensor) else [v] * m for v in values]
        return [tuple(c[i] for c in columns) for i in range(m)], None

    def _abandon(self, error: Exception, where: str) -> NoReturn:
        """Raise `error` here and, through the step's flag, a CollectiveError on every other rank of the pipeline."""
        assert self._guard is not None  # set at the start of every step
        self._guard.fail(f"{where} on rank {current_comm().rank}: {type(error).__name__}: {error}")  # first one kept
        add_note = getattr(error, "add_note", None)  # Python >= 3.11
        if add_note is not None:
            add_note(f"pipeline: raised in {where}; every rank of the pipeline raises")
        raise error

    def _run_program(
        self, program: list[_Action], mb_args: list[tuple] | None, mb_targets: list[tuple] | None, outputs: dict
    ) -> None:
        """Run this rank's actions in order, each one's receive posted while the action before it computes.

        A failure makes every rank of the pipeline raise at once (`_abandon`); the failing rank does not wait
        for its own pending sends, which nobody will receive."""
        failed = True
        try:
            for k, action in enumerate(program):
                if k + 1 < len(program):  # gloo moves a message once its receive is posted: post it early
                    self._post_receive(program[k + 1])
                try:
                    self._run(action, mb_args, mb_targets, outputs)
                except Exception as e:
                    self._abandon(e, _describe(action))
                self.executed_actions.append(action)
            failed = False
        finally:
            sends, self._sends, self._posted = self._sends, [], {}
            if not failed:
                for work in sends:
                    work.wait()

    # -- one action
    def _run(self, a: _Action, mb_args: list[tuple] | None, mb_targets: list[tuple] | None, outputs: dict) -> None:
        stage = self._stages[a.stage]
        if a.kind == FORWARD:
            if stage.is_first:
                assert mb_args is not None  # step() split the inputs for the first stage
                args = mb_args[a.microbatch]
            else:
                args = self._receive(stage, a, "act", stage.input_metas)
            target = mb_targets[a.microbatch][0] if stage.is_last and mb_targets else None
            out = stage.forward_one_chunk(a.microbatch, args, target, self._loss_fn)
            if stage.is_last:
                outputs[a.microbatch] = tuple(o.detach() for o in out)
            else:
                self._deliver(stage, a.stage + 1, a.microbatch, "act", tuple(o.detach() for o in out))
        elif a.kind == BACKWARD_WEIGHT:  # nothing crosses: the weights' half of a split backward
            stage.backward_weight_one_chunk(a.microbatch)
        else:
            grads = None if stage.is_last else self._receive(stage, a, "grad", stage.output_metas)
            backward = stage.backward_one_chunk if a.kind == BACKWARD else stage.backward_input_one_chunk
            input_grads = backward(a.microbatch, grads)
            if not stage.is_first:
                self._deliver(stage, a.stage - 1, a.microbatch, "grad", input_grads)

    def _deliver(
        self, stage: PipelineStage, to_stage: int, mb: int, kind: str, tensors: tuple[torch.Tensor, ...]
    ) -> None:
        dst = stage.stage_to_rank(to_stage)
        if dst == stage.rank:
            self._local[(to_stage, mb, kind)] = tensors
            return
        comm = current_comm()
        ops = [
            P2POp("isend", local_part(t).contiguous(), dst, self._group, self._tag(to_stage, mb, kind, i))
            for i, t in enumerate(tensors)
        ]
        self._sends += comm.batch_isend_irecv(ops)

    def _post_receive(self, a: _Action) -> None:
        """Start the receive action `a` needs from another rank, if any and not started yet."""
        if a.kind == BACKWARD_WEIGHT:
            return
        stage = self._stages[a.stage]
        if a.kind == FORWARD:
            from_stage, kind, metas = a.stage - 1, "act", stage.input_metas
        else:
            from_stage, kind, metas = a.stage + 1, "grad", stage.output_metas
        key = (a.stage, a.microbatch, kind)
        if not 0 <= from_stage < self._num_stages or key in self._posted:
            return
        src = stage.stage_to_rank(from_stage)
        if src == stage.rank:
            return
        bufs = tuple(m.empty(stage.device) for m in metas or ())
        ops = [
            P2POp("irecv", b, src, self._group, self._tag(a.stage, a.microbatch, kind, i)) for i, b in enumerate(bufs)
        ]
        self._posted[key] = (bufs, current_comm().batch_isend_irecv(ops), src)

    def _receive(self, stage: PipelineStage, a: _Action, kind: str, metas: Any) -> tuple[torch.Tensor, ...]:
        key = (stage.stage_index, a.microbatch, kind)
        if key in self._local:  # handed over by this rank's other stage
            return self._local.pop(key)
        self._post_receive(a)
        bufs, works, src = self._posted.pop(key)
        assert self._guard is not None  # set at the start of every step
        for work in works:
            self._guard.wait(work, f"{_describe(a)} on rank {stage.rank}, receiving from rank {src},")
        if any(
            m.placements is not None for m in metas
        ):  # DTensors: rebuilt from their local shards on this stage's mesh
            return tuple(m.wrap(b, stage.mesh if m.placements else None) for m, b in zip(metas, bufs))
        return bufs

    def _tag(self, to_stage: int, mb: int, kind: str, index: int) -> int:
        """A distinct tag per (receiving stage, micro-batch, kind, tensor): messages between two ranks never mix."""
        kinds = ("meta", "act", "grad")
        return ((mb * self._num_stages + to_stage) * len(kinds) + kinds.index(kind)) * 16 + index


def _describe(a: _Action) -> str:
    what = {
        FORWARD: "forward",
        BACKWARD: "backward",
        BACKWARD_INPUT: "input-gradient backward",
        BACKWARD_WEIGHT: "weight-gradient backward",
    }[a.kind]
    return f"stage {a.stage}'s {what} of micro-batch {a.microbatch} ({a})"


def _merge(outputs: dict[int, tuple[torch.Tensor, ...]], m: int) -> Any:
    if len(outputs) != m:
        return None
    parts = [outputs[i] for i in range(m)]
    merged = tuple(torch.cat(col) if col[0].ndim else torch.stack(col) for col in zip(*parts))
    return merged[0] if len(merged) == 1 else merged


class PipelineScheduleSingle(_PipelineSchedule):
    """A schedule of one stage per rank (torch's base class of the same name)."""

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn: Callable | None = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
    ) -> None:
        if not isinstance(stage, PipelineStage):
            raise ShardingError(
                f"{type(self).__name__}: takes one PipelineStage, got {type(stage).__name__}; multi-stage schedules "
                "take a list"
            )
        super().__init__(
            [stage],
            n_microbatches,
            loss_fn,
            scale_grads,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
        )
        self._stage = stage


class PipelineScheduleMulti(_PipelineSchedule):
    """A schedule of several stages per rank (torch's base class of the same name)."""

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable | None = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
    ) -> None:
        if isinstance(stages, PipelineStage):
            stages = [stages]
        super().__init__(
            list(stages),
            n_microbatches,
            loss_fn,
            scale_grads,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
        )


# ------------------------------------------------------------------ the schedules


class ScheduleGPipe(PipelineScheduleSingle):
    """Every micro-batch's forward, then every backward: m micro-batches in flight."""

    def _program(self, stages: list[PipelineStage], has_backward: bool) -> list[_Action]:
        s, m = stages[0].stage_index, self._n_microbatches
        forwards = [_Action(s, FORWARD, i) for i in range(m)]
        return forwards + ([_Action(s, BACKWARD, i) for i in range(m)] if has_backward else [])


class Schedule1F1B(PipelineScheduleSingle):
    """Warm-up forwards, then one forward and one backward in turn, then the remaining backwards:
    stage s holds at most num_stages - s micro-batches in flight."""

    def _program(self, stages: list[PipelineStage], has_backward: bool) -> list[_Action]:
        stage, m = stages[0], self._n_microbatches
        s = stage.stage_index
        if not has_backward:
            return [_Action(s, FORWARD, i) for i in range(m)]
        warmup = min(m, stage.num_stages - 1 - s)
        program = [_Action(s, FORWARD, i) for i in range(warmup)]
        for i in range(m - warmup):
            program += [_Action(s, FORWARD, warmup + i), _Action(s, BACKWARD, i)]
        return program + [_Action(s, BACKWARD, i) for i in range(m - warmup, m)]


class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Several stages per rank (stage s on member s % size): each local stage's forwards for every
    micro-batch, breadth first, then the backwards in reverse stage order."""

    def _program(self, stages: list[PipelineStage], has_backward: bool) -> list[_Action]:
        m = self._n_microbatches
        program = [_Action(st.stage_index, FORWARD, i) for st in stages for i in range(m)]
        if has_backward:
            program += [_Action(st.stage_index, BACKWARD, i) for st in reversed(stages) for i in range(m)]
        return program


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """Megatron-LM's interleaved 1F1B: v stages per rank (stage s on member s % p), micro-batches in rounds
    of p, each rank's forwards cycling through its stages round by round. The bubble is about 1/v of
    1F1B's. Needs n_microbatches to be a multiple of the group size p."""

    def __init__(
        self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None, **kwargs: Any
    ) -> None:
        super().__init__(stages, n_microbatches, loss_fn, **kwargs)
        p = self._group.size
        if n_microbatches % p:
            raise ShardingError(
                f"ScheduleInterleaved1F1B: n_microbatches={n_microbatches} is not a multiple of the pipeline's {p} "
                f"ranks; the schedule runs micro-batches in rounds of {p} (use "
                f"{max(p, n_microbatches - n_microbatches % p)} or {n_microbatches + p - n_microbatches % p})"
            )

    def _program(self, stages: list[PipelineStage], has_backward: bool) -> list[_Action]:
        p, v, m = self._group.size, len(stages), self._n_microbatches
        rank = stages[0].group_rank
        total = m * v

        def nth(k: int, kind: str) -> _Action:
            local = (k // p) % v  # which of this rank's stages: cycles every p actions
            microbatch = (k // (p * v)) * p + k % p
            return _Action(stages[local if kind == FORWARD else v - 1 - local].stage_index, kind, microbatch)

        if not has_backward:
            return [nth(k, FORWARD) for k in range(total)]
        warmup = min(total, 2 * (p - rank - 1) + (v - 1) * p)
        program = [nth(k, FORWARD) for k in range(warmup)]
        for i in range(total - warmup):
            program += [nth(warmup + i, FORWARD), nth(i, BACKWARD)]
        return program + [nth(i, BACKWARD) for i in range(total - warmup, total)]


class _ZeroBubble(PipelineScheduleMulti):
    """The zero-bubble schedules (Qi et al. 2024, arXiv:2401.10241): each backward split into I (the
    gradients of the stage's inputs, which the previous stage waits for) and W (its weights', which
    nobody waits for), W's run where a rank would otherwise idle. Each rank's order comes from one
    greedy simulation of the whole pipeline (_zero_bubble.py); at most p micro-batches are live in a
    rank's first stage, the activation bound of 1F1B. Forward-only steps run the forwards in that order.

    The split itself is _split_backward.py: I stops autograd at the stage's inputs, W restarts it where
    the weights' branches leave the inputs' path."""

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable | None = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
    ) -> None:
        name = type(self).__name__
        if not backward_requires_autograd:
            raise ShardingError(
                f"{name}: backward_requires_autograd=False (a custom backward) is not supported; the split backward "
                "uses autograd"
            )
        del defer_pp_recv  # receives always wait right before the action that needs them
        super().__init__(
            stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec, scale_grads
        )
        self._check_stages_per_rank(len(self.stages))
        _check_no_data_parallel(self.stages, name)

    def _check_stages_per_rank(self, v: int) -> None:
        pass

    def _program(self, stages: list[PipelineStage], has_backward: bool) -> list[_Action]:
        p = self._group.size
        steps = _zero_bubble.greedy_programs(p, self._num_stages, self._n_microbatches, self._place, max_in_flight=p)[
            stages[0].group_rank
        ]
        kinds = {"F": FORWARD, "I": BACKWARD_INPUT, "W": BACKWARD_WEIGHT}
        return [_Action(s, kinds[k], mb) for s, k, mb in steps if has_backward or k == "F"]


def _check_no_data_parallel(stages: list[PipelineStage], schedule: str) -> None:
    """fully_shard reshards a unit when the gradient reaches its inputs, which a split backward's I does
    before its W has read the unsharded weights; replicate all-reduces its buckets at the end of a backward
    pass, which I ends before W has made the weights' gradients: both refused rather than wrong."""
    from ..fsdp import (
        FSDPModule,
    )  # below pipelining; imported here so a stage without data parallelism needs none of it
    from ..fsdp.replicate import replicate_state

    for stage in stages:
        modules = list(stage.submod.modules())
        kind = (
            "fully_shard units"
            if any(isinstance(m, FSDPModule) for m in modules)
            else "replicate"
            if any(replicate_state(m) is not None for m in modules)
            else None
        )
        if kind is not None:
            raise ShardingError(
                f"{schedule}: stage {stage.stage_index}'s module has {kind}; the split backward (I, then W) "
                f"does not compose with data parallelism yet; use Schedule1F1B, ScheduleInterleaved1F1B or "
                "ScheduleGPipe with it"
            )


class ScheduleInterleavedZeroBubble(_ZeroBubble):
    """Zero bubble with v stages per rank, looped (stage s on member s % p), torch's ZB1P. Like torch, needs
    n_microbatches to be a multiple of its rounds, max(1, n_microbatches // p)."""

    def _check_stages_per_rank(self, v: int) -> None:
        m, p = self._n_microbatches, self._group.size
        rounds = max(1, m // p)
        if m % rounds:
            raise ShardingError(
                f"ScheduleInterleavedZeroBubble: n_microbatches={m} is not a multiple of its {rounds} rounds "
                f"(n_microbatches // {p} ranks); use {rounds * (m // rounds)} or {rounds * (m // rounds + 1)}"
            )


class ScheduleZBVZeroBubble(_ZeroBubble):
    """Zero bubble on a V: exactly 2 stages per rank, stages r and 2p-1-r on member r, so the first and
    last stages share rank 0 and the turn of the V (stages p-1 and p) crosses no link."""

    def _check_stages_per_rank(self, v: int) -> None:
        if v != 2:
            raise ShardingError(
                f"ScheduleZBVZeroBubble: takes exactly 2 stages per rank (r and 2p-1-r), got {v} (stages "
                f"{[s.stage_index for s in self.stages]})"
            )

    def _place(self, stage_index: int) -> int:
        p = self._group.size
        return stage_index if stage_index < p else 2 * p - 1 - stage_index


_SCHEDULES: dict[str, type[_PipelineSchedule]] = {
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "LoopedBFS": ScheduleLoopedBFS,
}


def get_schedule_class(schedule_name: str) -> type[_PipelineSchedule]:
    """The schedule class of a name, case-insensitive ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS",
    "InterleavedZeroBubble", "ZBVZeroBubble", or the class's own name)."""
    if not isinstance(schedule_name, str):
        raise ShardingError(f"get_schedule_class: takes a name, got {schedule_name!r}")
    wanted = schedule_name.lower()
    for name, cls in _SCHEDULES.items():
        if wanted in (name.lower(), cls.__name__.lower()):
            return cls
    raise ShardingError(f"get_schedule_class: unknown schedule {schedule_name!r}; shardops has {sorted(_SCHEDULES)}")
