"""Expert parallelism for mixture-of-experts layers: experts sharded over a mesh dim, tokens routed to them.

    parallelize_module(moe_block.experts, mesh, ExpertParallel())          # mesh (ep,) or (ep, tp)

The style applies to an *experts module* in transformers' 5.x layout (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE and `shardops.models_moe.GroupedExperts`): every
parameter is stacked over the experts, `[num_experts, ...]`, and

    forward(hidden_states [T, D], top_k_index [T, k], top_k_weights [T, k]) -> [T, D]

returns, for every token, the sum over its k chosen experts of weight x expert(token).
The router (a linear layer, softmax and top-k) runs before it, on DTensors or local
tensors, and needs nothing from this style.

Layout. The experts' parameters are `Shard(0)` over the expert-parallel mesh dim
(uneven when the experts do not divide evenly, as torch.chunk splits them). On a
2-D mesh (ep, tp) each expert is tensor-parallel over tp too: the up/gate
projections column-sharded (a packed `gate_up_proj` as `StridedShard(1, 2)`, so
each rank holds its slice of the gate half and of the up half), the down projection
row-sharded; its output is then `Partial(sum)` over tp until `output_layouts` says.

Tokens are sharded over ep (each rank routes its own tokens: a batch or sequence
shard; a Replicate input is sliced for free). Per forward:

    1. all_to_all of the token counts per expert (num_experts int64 per rank, tiny), so that
       every rank knows how many tokens it will receive from each other rank;
    2. all_to_all of the routed tokens (dispatch), uneven split sizes, no padding;
    3. the local experts run on the tokens they received (the module's own forward,
       called on its local expert slices: k = 1, weight 1);
    4. all_to_all of the results back to the tokens' ranks (combine);
    5. the weighted sum over each token's k experts, locally.

Backward mirrors it: the combine's gradient goes back by one all_to_all with the
split sizes swapped, the dispatch's likewise (the counts are known from forward:
no count exchange). Bytes per rank, forward and backward alike: the routed
token-slots it sends to other ranks x hidden size x element size, each way.

With data parallelism (torchtitan's way): the ep mesh is the data mesh, each rank's tokens
are its own batch slice as plain tensors, and `shardops.fsdp.fully_shard` / `replicate` on
the data mesh leave the experts (already sharded there, their gradients complete) as they
are, dividing their gradients as they divide the others (fsdp/_presharded.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..placements import Partial, Placement, Replicate, Shard, StridedShard, chunk_size_and_offset
from ..tensor import DTensor, from_local
from ._layout import as_placement, distribute_param
from .style import ParallelStyle

__all__ = ["DRY_ROUTING_ATTR", "ExpertParallel"]

# In the dry world (META tensors, comm/dry.py: pricing from metadata) the router's expert ids have no
# values; the pricer gives the experts module the global batch's ids [tokens, k] under this attribute
# (a CPU tensor, rows in batch order), and each ep rank's rows are its chunk of them.
DRY_ROUTING_ATTR = "_shardops_dry_routing"

# Tensor-parallel layout, inside each expert, of the parameter names transformers and shardops use.
DEFAULT_TP_LAYOUTS: dict[str, Placement] = {
    "gate_up_proj": StridedShard(1, 2),  # packed [gate; up] on dim 1: each half column-sharded
    "gate_proj": Shard(1),
    "up_proj": Shard(1),
    "w1": Shard(1),
    "w3": Shard(1),
    "down_proj": Shard(2),
    "w2": Shard(2),
}


class ExpertParallel(ParallelStyle):
    """Experts `Shard(0)` over mesh dim `ep_dim`; on a 2-D mesh, tensor-parallel over the other dim.

    - `tp_layouts`: each parameter's placement on the tp dim (defaults: `DEFAULT_TP_LAYOUTS`).
    - `output_layouts`: the output's placement on the tp dim: `Replicate()` (default, one
      all_reduce over tp) or `Partial()` (left pending for a later reduce to absorb).
    - `use_local_output`: return a plain tensor; default (None): as the hidden states came in.
    """

    def __init__(
        self,
        *,
        ep_dim: int | str = 0,
        tp_layouts: dict[str, Placement] | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool | None = None,
    ):
        super().__init__()
        self.ep_dim = ep_dim
        self.tp_layouts = {**DEFAULT_TP_LAYOUTS, **{k: as_placement(v) for k, v in (tp_layouts or {}).items()}}
        self.output_layouts = as_placement(output_layouts) or Replicate()
        if not isinstance(self.output_layouts, (Replicate, Partial)):
            raise ShardingError(
                "ExpertParallel: output_layouts is the output's placement over tp, Replicate() or Partial(); got "
                f"{self.output_layouts}"
            )
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim not in (1, 2):
            raise ShardingError(
                f"ExpertParallel: give a mesh (ep,) or (ep, tp); got {device_mesh.ndim} dims ({device_mesh})"
            )
        ep = device_mesh._dim_index(self.ep_dim)
        tp = None if device_mesh.ndim == 1 else 1 - ep
        params = list(module.named_parameters(recurse=False))
        if not params:
            raise ShardingError(
                f"ExpertParallel: {type(module).__name__} has no parameters of its own; apply it to the experts module"
            )
        num_experts = params[0][1].shape[0]
        for name, p in params:
            if isinstance(p, DTensor):
                raise ShardingError(
                    f"ExpertParallel: {type(module).__name__}.{name} is already distributed ({p.placements})"
                )
            if p.ndim < 2 or p.shape[0] != num_experts:
                raise ShardingError(
                    f"ExpertParallel: {type(module).__name__}.{name} has shape {tuple(p.shape)}; every parameter of an "
                    f"experts module is stacked over its {num_experts} experts on dim 0"
                )
            placements: list[Placement] = [Replicate()] * device_mesh.ndim
            placements[ep] = Shard(0)
            if tp is not None:
                if name not in self.tp_layouts:
                    raise ShardingError(
                        f"ExpertParallel: no tensor-parallel layout for {type(module).__name__}.{name} on mesh "
                        f"{device_mesh}; pass tp_layouts={{'{name}': Shard(d)}} (the dims known: "
                        f"{sorted(self.tp_layouts)})"
                    )
                placements[tp] = self.tp_layouts[name]
            with torch.no_grad():
                dt = distribute_param(p, device_mesh, placements, self.src_data_rank)
            module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
        layer = _ExpertLayer(
            module, type(module).forward, device_mesh, ep, tp, num_experts, self.output_layouts, self.use_local_output
        )
        module.forward = layer  # an instance attribute: nn.Module.__call__ finds it before the class's forward
        return module

    def __repr__(self) -> str:
        return (
            f"ExpertParallel(ep_dim={self.ep_dim!r}, output_layouts={self.output_layouts}, "
            f"use_local_output={self.use_local_output})"
        )


class _ExpertLayer:
    """The expert-parallel forward of one experts module (see the module doc)."""

    def __init__(self, module, local_forward, mesh, ep, tp, num_experts, output_layout, use_local_output):
        self.module = module
        self.local_forward = local_forward
        self.mesh = mesh
        self.ep = ep
        self.tp = tp
        self.num_experts = num_experts
        self.output_layout = output_layout
        self.use_local_output = use_local_output

    def __call__(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        name = type(self.module).__name__
        distributed = isinstance(hidden_states, DTensor)
        if distributed:
            hidden_dt, index, weights = self._token_layout(name, hidden_states, top_k_index, top_k_weights)
            x = hidden_dt.to_local(grad_placements=self._partial_over_tp(hidden_dt.placements))
            idx = index.to_local() if isinstance(index, DTensor) else index
            w = (
                weights.to_local(grad_placements=self._partial_over_tp(weights.placements))
                if isinstance(weights, DTensor)
                else weights
            )
        else:
            x, idx, w = hidden_states, top_k_index, top_k_weights
            if isinstance(idx, DTensor) or isinstance(w, DTensor):
                raise ShardingError(
                    f"{name}: hidden_states is a plain tensor but the routing is a DTensor; pass all three alike"
                )
            if self.tp is not None:  # each tp rank's input gradient is its share: sum them
                x, w = _SumGradOver.apply(x, self.mesh, self.tp), _SumGradOver.apply(w, self.mesh, self.tp)
        out = self._routed_dry(x, idx, w) if x.is_meta else self._routed(x, idx, w)
        if distributed:
            return self._wrap_output(out, hidden_dt)
        if self.tp is not None:
            out = _SumOver.apply(out, self.mesh, self.tp)
        return out

    # -- layouts

    def _token_layout(self, name, hidden, index, weights):
        """Hidden states: tokens sharded (or sliced) over ep, Replicate over tp; the routing laid out alike."""
        if hidden.device_mesh != self.mesh:
            raise ShardingError(
                f"{name}: hidden_states live on {hidden.device_mesh}, but the experts were parallelized on "
                f"{self.mesh}; route tokens on the mesh the experts live on"
            )
        if hidden.ndim != 2:
            raise ShardingError(f"{name}: expected hidden_states [tokens, hidden], got shape {tuple(hidden.shape)}")
        want = list(hidden.placements)
        ep_p = want[self.ep]
        want[self.ep] = ep_p if ep_p.is_shard(0) else Shard(0)  # any token sharding: each rank routes its own rows
        if self.tp is not None:
            want[self.tp] = Replicate()
        want_t = tuple(want)
        if hidden.placements != want_t:
            hidden = hidden.redistribute(placements=want_t)
        index = (
            index.redistribute(placements=want_t)
            if isinstance(index, DTensor) and index.placements != want_t
            else index
        )
        weights = (
            weights.redistribute(placements=want_t)
            if isinstance(weights, DTensor) and weights.placements != want_t
            else weights
        )
        return hidden, index, weights

    def _partial_over_tp(self, placements: Sequence[Placement]) -> tuple[Placement, ...]:
        out = list(placements)
        if self.tp is not None:
            out[self.tp] = Partial()
        return tuple(out)

    def _wrap_output(self, out: torch.Tensor, hidden: DTensor) -> Any:
        dt = from_local(
            out, self.mesh, self._partial_over_tp(hidden.placements), shape=hidden.shape, stride=hidden.stride()
        )
        if self.tp is not None and self.output_layout != Partial():
            final = list(hidden.placements)
            final[self.tp] = self.output_layout
            dt = dt.redistribute(placements=tuple(final))
        use_local = self.use_local_output if self.use_local_output is not None else False
        return dt.to_local() if use_local else dt

    # -- routing

    def _expert_slices(self) -> list[tuple[int, int]]:
        """(size, first expert) of every ep rank's experts, in ep group order."""
        n = self.mesh.size(self.ep)
        return [chunk_size_and_offset(self.num_experts, n, j) for j in range(n)]

    def _routed(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        _check_routing(type(self.module).__name__, x, idx, w, self.num_experts)
        mesh, group = self.mesh, self.mesh.group(self.ep)
        slices = self._expert_slices()
        me = group.index(mesh.get_rank())
        tokens, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # token-slots grouped by expert, hence by destination rank
        counts = torch.bincount(flat, minlength=self.num_experts)
        # stays: all_to_all's split sizes are host ints (one read each way per routing, as in torch's EP)
        send_splits = [int(counts[start : start + size].sum()) for size, start in slices]
        received_counts = mesh.comm.all_to_all(
            [counts[start : start + size].contiguous() for size, start in slices],
            group,
            [(slices[me][0],)] * group.size,
        )
        per_source = (
            torch.stack(received_counts) if received_counts else counts.new_zeros((0, slices[me][0]))
        )  # [ep, local experts]
        recv_splits = [int(c.sum()) for c in received_counts]

        routed = x.index_select(0, order // k)
        arrived = _AllToAll.apply(routed, send_splits, recv_splits, mesh, self.ep)
        by_expert = _source_major_to_expert_major(per_source, sum(recv_splits))
        y = self._local_experts(arrived.index_select(0, by_expert), per_source.sum(0), w.dtype)
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
        returned = _AllToAll.apply(y.index_select(0, back), recv_splits, send_splits, mesh, self.ep)
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.numel(), device=order.device)
        per_slot = returned.index_select(0, unsort).view(tokens, k, -1)
        return (per_slot * w.unsqueeze(-1)).sum(1).to(x.dtype)

    def _routed_dry(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`_routed`'s collectives on META tensors: the split sizes from the ids the pricer recorded
        (DRY_ROUTING_ATTR), every ep rank's from its chunk of them; the local experts as shapes only."""
        routing = self.module.__dict__.get(DRY_ROUTING_ATTR)
        name = type(self.module).__name__
        if routing is None:
            raise ShardingError(
                f"{name}: expert-parallel routing on META tensors needs the router's expert ids; price "
                "from a model with values (so.autoparallel records them on one single-device forward)"
            )
        mesh, group = self.mesh, self.mesh.group(self.ep)
        slices, me = self._expert_slices(), group.index(mesh.get_rank())
        per_rank = routing.chunk(group.size)  # each ep rank's tokens: its slice of the global batch
        if per_rank[me].shape != idx.shape:
            raise ShardingError(
                f"{name}: this ep rank routes {tuple(idx.shape)} expert ids, but its chunk of the recorded "
                f"routing is {tuple(per_rank[me].shape)}"
            )
        counts = [torch.bincount(ids.reshape(-1), minlength=self.num_experts) for ids in per_rank]
        send_splits = [int(counts[me][start : start + size].sum()) for size, start in slices]
        mine = slices[me]
        recv_splits = [int(c[mine[1] : mine[1] + mine[0]].sum()) for c in counts]
        stand_ins = [torch.empty(size, dtype=torch.int64, device="meta") for size, _ in slices]
        mesh.comm.all_to_all(stand_ins, group, [(mine[0],)] * group.size)  # the count exchange
        tokens, k = idx.shape
        routed = x.index_select(0, torch.empty(tokens * k, dtype=torch.int64, device="meta"))
        arrived = _AllToAll.apply(routed, send_splits, recv_splits, mesh, self.ep)
        anchor = sum(p.to_local().reshape(-1)[:0].sum() for p in self.module.parameters(recurse=False))
        y = arrived + anchor  # the local experts' output has the rows and width they received
        returned = _AllToAll.apply(y, recv_splits, send_splits, mesh, self.ep)
        return (returned.view(tokens, k, -1) * w.unsqueeze(-1)).sum(1).to(x.dtype)

    def _local_experts(
        self, x: torch.Tensor, tokens_per_expert: torch.Tensor, weight_dtype: torch.dtype
    ) -> torch.Tensor:
        """The module's own forward on its local experts (k = 1, weight 1): rows grouped by local expert."""
        module = self.module
        views = {name: p.to_local() for name, p in module.named_parameters(recurse=False)}
        local_ids = torch.repeat_interleave(
            torch.arange(tokens_per_expert.numel(), device=x.device), tokens_per_expert
        ).unsqueeze(1)
        saved = {name: module.__dict__[name] for name in ("num_experts",) if isinstance(module.__dict__.get(name), int)}
        try:
            module.__dict__.update(views)
            if saved:
                module.__dict__["num_experts"] = tokens_per_expert.numel()
            if tokens_per_expert.numel() == 0:  # this rank holds no expert (uneven split), so no token: forwards
                y = x.new_zeros((0, x.shape[-1]))  # sized by num_experts (transformers' grouped_mm's histc) refuse 0
            else:
                y = self.local_forward(
                    module, x, local_ids, torch.ones(local_ids.shape, dtype=weight_dtype, device=x.device)
                )
        finally:
            for name in views:
                module.__dict__.pop(name, None)
            module.__dict__.update(saved)
        # Every rank's graph must reach the dispatch and its local experts whatever the routing: a rank whose
        # experts received no token still sends its (empty) part of the dispatch's backward all_to_all, and
        # gets a zero gradient for them (never a None gradient on some ranks only).
        anchor = sum(v.reshape(-1)[:0].sum() for v in views.values()) + x.reshape(-1)[:0].sum()
        return y + anchor


def _source_major_to_expert_major(per_source: torch.Tensor, rows: int) -> torch.Tensor:
    """Rows arrive grouped by source rank, then by local expert; the permutation that groups them by expert
    (source order kept within an expert: a stable sort). `rows`, known on the host, spares a read of the sizes."""
    n_src, n_exp = per_source.shape
    expert_of_block = torch.arange(n_exp, device=per_source.device).repeat(n_src)
    expert_of_row = torch.repeat_interleave(expert_of_block, per_source.reshape(-1), output_size=rows)
    return torch.argsort(expert_of_row, stable=True)


def _check_routing(name: str, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, num_experts: int) -> None:
    if idx.ndim != 2 or idx.shape[0] != x.shape[0] or tuple(w.shape) != tuple(idx.shape):
        raise ShardingError(
            f"{name}: expected top_k_index and top_k_weights of shape [tokens, k] for hidden_states {tuple(x.shape)}; "
            f"got {tuple(idx.shape)} and {tuple(w.shape)}"
        )
    if idx.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ShardingError(f"{name}: top_k_index must hold integer expert ids, got {idx.dtype}")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_experts):
        raise ShardingError(
            f"{name}: top_k_index holds expert ids outside [0, {num_experts}) ({int(idx.min())}..{int(idx.max())})"
        )


# ------------------------------------------------------------------ autograd


class _AllToAll(torch.autograd.Function):
    """Rows split by `send_splits` go to the ep ranks in order; returns the rows received, by source rank.
    Backward: the same with the splits swapped."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, send_splits: list[int], recv_splits: list[int], mesh: DeviceMesh, dim: int
    ) -> torch.Tensor:
        ctx.splits = (send_splits, recv_splits)
        ctx.mesh, ctx.dim = mesh, dim
        return _all_to_all_rows(x, send_splits, recv_splits, mesh, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_splits, recv_splits = ctx.splits
        return _all_to_all_rows(grad, recv_splits, send_splits, ctx.mesh, ctx.dim), None, None, None, None


def _all_to_all_rows(
    x: torch.Tensor, send_splits: list[int], recv_splits: list[int], mesh: DeviceMesh, dim: int
) -> torch.Tensor:
    rest = tuple(x.shape[1:])
    chunks = list(torch.split(x.contiguous(), send_splits))
    received = mesh.comm.all_to_all(chunks, mesh.group(dim), [(n, *rest) for n in recv_splits])
    return torch.cat(received) if received else x.new_zeros((0, *rest))


class _SumOver(torch.autograd.Function):
    """Forward: all_reduce(sum) over a mesh dim (partial expert outputs over tp); backward: identity."""

    @staticmethod
    def forward(ctx, x, mesh, dim):
        summed = mesh.comm.all_reduce(x, "sum", mesh.group(dim))
        return summed if summed is not x else x.clone()  # a group of one returns its input: never alias it

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _SumGradOver(torch.autograd.Function):
    """Forward: identity; backward: all_reduce(sum) over a mesh dim (each tp rank's share of an input's gradient)."""

    @staticmethod
    def forward(ctx, x, mesh, dim):
        ctx.mesh, ctx.dim = mesh, dim
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.mesh.comm.all_reduce(grad.contiguous(), "sum", ctx.mesh.group(ctx.dim)), None, None
