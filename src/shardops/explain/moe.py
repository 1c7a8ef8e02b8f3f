"""Explaining a mixture-of-experts layer: `moe(x, num_experts=..., top_k=...)` in an explain expression.

    shardops explain "moe(x, num_experts=8, top_k=2)" --mesh 4 --x "f32[256,64]:S(0)"
    so.explain("moe(x, num_experts=8, top_k=2)", mesh=(2, 2), x="f32[8,32,64]:S(0),R")

The router (linear, softmax, top-k) is traced and planned like any call. The routing
itself depends on the data, so it is one step priced for *balanced* routing (every
rank's token-slots spread over the experts in proportion to how many each rank holds),
with the layout `shardops.parallel.ExpertParallel` runs: experts `Shard(0)` over the
mesh dim `ep_dim`, tokens sharded over it. Its candidates:

- expert-parallel (what the style does): all_to_all of the token counts per expert,
  all_to_all of the routed tokens (dispatch), all_to_all of the results (combine);
  backward mirrors the two token all_to_alls with the same bytes;
- gather-tokens: every rank gathers all tokens over ep, runs its experts on the ones
  routed to them, and the outputs are reduce-scattered back (the alternative with no
  all_to_all), for comparison.

On a 2-D mesh the other dim is tensor parallelism inside each expert: the outputs'
all_reduce over it is listed too. The runtime's exact bytes for a real routing are
what `so.CommDebugMode` counts (tests/test_expert_parallel.py computes them from the routing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ShardingError
from ..placements import Placement, Replicate, Shard, chunk_size_and_offset, local_shape_and_offset
from ..planner import pricing
from ..spec import TensorSpec
from .result import Option, Step

__all__ = ["RoutingStep", "moe"]


@dataclass(frozen=True)
class RoutingStep:
    """A recorded MoE routing (in place of an aten op in the Recorder's calls)."""

    num_experts: int
    top_k: int
    ep_dim: int

    def __str__(self) -> str:
        return "expert_parallel.routing"

    def plan(self, index: int, tokens_spec: TensorSpec, links) -> Step:
        mesh = tokens_spec.mesh
        ep = self.ep_dim
        tp = None if mesh.ndim == 1 else next(d for d in range(mesh.ndim) if d != ep)
        if mesh.ndim > 2:
            raise ShardingError(f"explain moe(): a mesh (ep,) or (ep, tp), got {mesh.shape}")
        want: list[Placement] = [Replicate()] * mesh.ndim
        want[ep] = Shard(0)
        placements = tuple(want)
        n = mesh.shape[ep]
        local, _ = local_shape_and_offset(tokens_spec.shape, mesh.shape, [0] * mesh.ndim, placements)
        tokens, hidden = local[0], tokens_spec.shape[1]
        row = hidden * tokens_spec.dtype.itemsize
        slots = tokens * self.top_k
        mine = chunk_size_and_offset(self.num_experts, n, 0)[0]
        others = self.num_experts - mine
        count_bytes = others * 8
        token_bytes = math.ceil(slots * others / self.num_experts) * row
        ep_comm: list[tuple[tuple[int, ...], str, float]] = [
            ((ep,), "all_to_all", float(count_bytes)),
            ((ep,), "all_to_all", float(token_bytes)),
            ((ep,), "all_to_all", float(token_bytes)),
        ]
        all_tokens = tokens_spec.shape[0] * row
        gather_comm: list[tuple[tuple[int, ...], str, float]] = [
            ((ep,), "all_gather", float(tokens * row)),
            ((ep,), "reduce_scatter", float(all_tokens)),
        ]
        tp_comm: list[tuple[tuple[int, ...], str, float]] = (
            [] if tp is None else [((tp,), "all_reduce", float(tokens * row))]
        )

        def t(comm):
            return sum(_time(kind, b, mesh.shape[d[0]], links[d[0]]) for d, kind, b in comm)

        out_placements = placements
        options = []
        for number, (label, comm) in enumerate(
            (
                ("expert-parallel (dispatch + combine all_to_all)", ep_comm + tp_comm),
                ("gather-tokens (all_gather, experts, reduce_scatter)", gather_comm + tp_comm),
            ),
            1,
        ):
            seconds = t(comm)
            options.append(
                Option(
                    number,
                    (placements,),
                    (out_placements,),
                    label,
                    (),
                    comm,
                    (tokens_spec.with_placements(placements),),
                    seconds,
                    0.0,
                    seconds,
                    0.0,
                    chosen=number == 1,
                )
            )
        ep_opt, gather_opt = options
        reason = (
            f"#1 {ep_opt.label}: what ExpertParallel runs, {_fmt(ep_opt.bytes)} per rank vs {_fmt(gather_opt.bytes)} "
            f"for #2; balanced routing assumed ({slots} token-slots on rank 0, {mine} of {self.num_experts} experts "
            "local); backward: the two token all_to_alls mirrored, same bytes"
        )
        spec = tokens_spec.with_placements(placements)
        return Step(
            index,
            str(self),
            f"routing(tokens, top_k={self.top_k}, num_experts={self.num_experts})",
            ["tokens"],
            (spec,),
            [spec],
            options,
            len(options),
            ep_opt,
            reason,
        )


def _time(kind: str, nbytes: float, n: int, link) -> float:
    """The cost model's time for what one rank puts in (pricing.collective_time takes the whole size)."""
    whole = {"all_gather": nbytes * n, "all_to_all": nbytes * n / max(n - 1, 1)}.get(kind, nbytes)
    return pricing.collective_time(kind, whole, n, link)


def _fmt(b: int) -> str:
    from .text import fmt_bytes

    return fmt_bytes(b)


def moe(x: torch.Tensor, num_experts: int, top_k: int = 2, ep_dim: int = 0) -> torch.Tensor:
    """The router on `x` (traced), then the routing step; returns the layer's output (x's shape)."""
    from .trace import active_recorder

    rec = active_recorder()
    if rec is None:
        raise ShardingError("moe(...) is an explain expression: use it inside so.explain / shardops explain")
    if (
        not isinstance(num_experts, int)
        or num_experts < 1
        or not isinstance(top_k, int)
        or not 1 <= top_k <= num_experts
    ):
        raise ShardingError(
            f"explain moe(): need 1 <= top_k <= num_experts, got top_k={top_k!r}, num_experts={num_experts!r}"
        )
    tokens = x.reshape(-1, x.shape[-1])
    gate = torch.empty(num_experts, x.shape[-1], dtype=x.dtype, device=x.device)
    probs = torch.softmax(F.linear(tokens, gate).float(), dim=-1)
    torch.topk(probs, top_k, dim=-1)
    rec.calls.append((RoutingStep(num_experts, top_k, ep_dim), (tokens,), {}, tokens))
    return tokens.reshape(x.shape)


def is_routing(func: Any) -> bool:
    return isinstance(func, RoutingStep)
