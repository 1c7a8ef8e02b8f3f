"""A small mixture-of-experts variant of the LLaMA-style model, in plain torch.nn, and its plan.

`LlamaMoE` is `shardops.models.Llama` with every block's SwiGLU MLP replaced by a
mixture of `num_experts` SwiGLU experts, `top_k` of them per token:

- `TopKRouter`: a linear gate, softmax over the experts (float32), top-k, the k
  weights renormalised to sum to one (Mixtral's router);
- `GroupedExperts`: the experts' weights stacked over the experts (`w1`, `w3`:
  [E, hidden, dim], `w2`: [E, dim, hidden]) with transformers 5.x's experts interface,
  `forward(hidden [T, D], top_k_index [T, k], top_k_weights [T, k]) -> [T, D]`, so
  that `shardops.parallel.ExpertParallel` applies to it as to Mixtral's experts.

Nothing here knows about shardops; `llama_moe_plan` lays the experts out with
`ExpertParallel` (mesh (ep,) or (ep, tp)); torch-style data parallelism over the ep
mesh (`fully_shard` per block and the root, or `replicate`) then leaves the experts
as they are, and each rank feeds its own batch slice, routing its own tokens. With
tensor parallelism for the other layers too (mesh ("dp", "tp"), experts EP over dp,
TP inside over tp):

    parallelize_module(model, mesh["tp"], llama_moe_tp_plan())
    parallelize_module(model, mesh, llama_moe_plan())
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .models import Llama, LlamaBlock, ModelArgs

__all__ = ["GroupedExperts", "LlamaMoE", "MoE", "MoEArgs", "TopKRouter", "llama_moe_plan", "llama_moe_tp_plan"]


@dataclass
class MoEArgs(ModelArgs):
    num_experts: int = 4
    top_k: int = 2
    moe_hidden_dim: int = 24  # each expert's SwiGLU width


class TopKRouter(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        self.top_k = args.top_k
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights [T, k], expert ids [T, k]) for tokens x [T, D]."""
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        return top / top.sum(dim=-1, keepdim=True), ids


class GroupedExperts(nn.Module):
    """SwiGLU experts, weights stacked over the experts (transformers' experts interface)."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.num_experts = args.num_experts
        self.w1 = nn.Parameter(torch.empty(args.num_experts, args.moe_hidden_dim, args.dim))
        self.w2 = nn.Parameter(torch.empty(args.num_experts, args.dim, args.moe_hidden_dim))
        self.w3 = nn.Parameter(torch.empty(args.num_experts, args.moe_hidden_dim, args.dim))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            x = hidden_states[token]
            h = F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e])
            y = F.linear(h, self.w2[e]) * top_k_weights[token, slot, None]
            out = out.index_add(0, token, y.to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        self.router = TopKRouter(args)
        self.experts = GroupedExperts(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, ids = self.router(tokens)
        return self.experts(tokens, ids, weights).reshape(shape)


class LlamaMoEBlock(LlamaBlock):
    """A LLaMA block whose feed-forward is a mixture of experts, held as `moe`."""

    ffn_attr = "moe"

    def make_ffn(self, args: MoEArgs) -> nn.Module:  # type: ignore[override]  # built from MoEArgs only
        return MoE(args)


class LlamaMoE(Llama):
    block = LlamaMoEBlock
    default_args = MoEArgs


def llama_moe_plan(**expert_parallel) -> dict:
    """Expert-parallel plan for `LlamaMoE`, applied on a mesh (ep,) or (ep, tp):
    `parallelize_module(model, mesh, llama_moe_plan())`, then `fully_shard` / `replicate` on the
    ep (= data) mesh, which leave the experts as they are. Keyword arguments go to
    `ExpertParallel` (e.g. `output_layouts=Partial()`)."""
    from .parallel import ExpertParallel

    return {"layers.*.moe.experts": ExpertParallel(**expert_parallel)}


def llama_moe_tp_plan(*, loss_parallel: bool = True, sequence_parallel: bool = True) -> dict:
    """Tensor-parallel plan for everything of `LlamaMoE` but the experts (`llama_plan`'s attention,
    embeddings, output and norms). Each MoE block gets its tokens as local tensors replicated over tp
    (the router runs locally, as a torch user's would) and gives back its sequence shard."""
    from .models import llama_plan
    from .parallel import PrepareModuleInputOutput
    from .placements import Replicate, Shard

    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        k: v
        for k, v in llama_plan(loss_parallel=loss_parallel, sequence_parallel=sequence_parallel).items()
        if ".feed_forward" not in k
    }
    plan["layers.*.moe"] = PrepareModuleInputOutput(
        input_layouts=(seq,),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(seq,),
        use_local_output=True,
    )
    return plan
