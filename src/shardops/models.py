"""Two small language models in plain torch.nn, and torchtitan-style plans for them.

- `Llama`: token embedding, nn.RMSNorm, attention with rotary embeddings (torch.polar
  frequencies, torch.view_as_complex), F.scaled_dot_product_attention(is_causal=True),
  SwiGLU MLP, output projection.
- `GPT2`: learned positional embedding, nn.LayerNorm, GELU MLP with bias, nn.Dropout,
  input and output embeddings tied.

Nothing here knows about shardops: the plans (`llama_plan`, `gpt2_plan`) are written
against the `torch.distributed.tensor.parallel` API and work with `shardops.parallel`
(or torch's own, given torch placements). Weights are drawn from an explicit
generator (`seed`), so every rank of a threads world builds the same model.

The attention code reads batch and sequence sizes from its projections' outputs
(not from its input): between parallel boundaries these are local tensors, and on
a data-parallel mesh the boundary input is a DTensor whose batch is global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT2", "Llama", "ModelArgs", "gpt2_plan", "llama_plan"]


@dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 64
    hidden_dim: int = 48  # MLP width (SwiGLU) / 4 * dim is GPT-2's; kept explicit for tiny models
    max_seq_len: int = 16
    norm_eps: float = 1e-5
    dropout: float = 0.0  # GPT-2 only
    rope_theta: float = 10000.0


def _init(module: nn.Module, seed: int) -> None:
    """Deterministic weights: normal(0, 0.02) for matrices and embeddings, norms at one, biases at zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)


# ------------------------------------------------------------------ LLaMA-style


def precompute_freqs_cis(head_dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(end, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # complex64 [end, head_dim // 2]


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate (batch, seq, heads, head_dim) queries and keys by the positions' complex frequencies."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = _replicated_like(freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1]), xq_)
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def _replicated_like(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A constant table (the same on every rank) next to a distributed tensor `x`: said to be
    replicated on x's mesh, as mixing plain and distributed tensors in one op requires."""
    mesh = getattr(x, "device_mesh", None)
    if mesh is None or hasattr(table, "device_mesh"):
        return table
    replicate: object
    if type(x).__module__.startswith("shardops"):
        from .placements import Replicate

        replicate = Replicate()
    else:
        from torch.distributed.tensor import Replicate as TorchReplicate

        replicate = TorchReplicate()
    return type(x).from_local(table, mesh, [replicate] * mesh.ndim)  # type: ignore[attr-defined]  # x is a DTensor


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, bias: bool = False, rotary: bool = True):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.rotary = rotary
        self.wq = nn.Linear(args.dim, args.dim, bias=bias)
        # no key bias: it shifts all of a query's scores alike, which softmax ignores, so its gradient
        # is zero up to rounding (and AdamW's normalised step would turn that rounding into updates)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=bias)
        self.wo = nn.Linear(args.dim, args.dim, bias=bias)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor | None = None) -> torch.Tensor:
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        bs, seqlen = xq.shape[0], xq.shape[1]
        # -1 heads: all of them on one device, this rank's under tensor parallelism
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        if self.rotary:
            if freqs_cis is None:
                raise ValueError("Attention(rotary=True) needs freqs_cis")
            xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True)
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """Pre-norm attention and feed-forward, each added to the residual stream.

    A variant swaps the feed-forward: `ffn_attr` names the attribute that holds it (its state-dict
    key and plan path: `feed_forward` here, `moe` in shardops.models_moe), `make_ffn` builds it."""

    ffn_attr = "feed_forward"

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        setattr(self, self.ffn_attr, self.make_ffn(args))  # last: weights are drawn in registration order

    def make_ffn(self, args: ModelArgs) -> nn.Module:
        return FeedForward(args)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + getattr(self, self.ffn_attr)(self.ffn_norm(h))


class Llama(nn.Module):
    freqs_cis: torch.Tensor  # a buffer
    """The LLaMA-style model; a variant sets `block` (its layers) and `default_args`."""

    block: type[LlamaBlock] = LlamaBlock
    default_args: type[ModelArgs] = ModelArgs

    def __init__(self, args: ModelArgs | None = None, seed: int = 0):
        super().__init__()
        args = args or self.default_args()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.block(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len, args.rope_theta),
            persistent=False,
        )
        _init(self, seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


# ------------------------------------------------------------------ GPT-2-style


class GPT2MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.c_fc = nn.Linear(args.dim, args.hidden_dim)
        self.c_proj = nn.Linear(args.hidden_dim, args.dim)
        self.dropout = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class GPT2Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = Attention(args, bias=True, rotary=False)
        self.ln_2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = GPT2MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, args: ModelArgs | None = None, seed: int = 0):
        super().__init__()
        args = args or ModelArgs()
        self.args = args
        self.wte = nn.Embedding(args.vocab_size, args.dim)
        self.wpe = nn.Embedding(args.max_seq_len, args.dim)
        self.drop = nn.Dropout(args.dropout)
        self.h = nn.ModuleList([GPT2Block(args) for _ in range(args.n_layers)])
        self.ln_f = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input and output embeddings
        _init(self, seed)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # positions per sample (as idx is laid out), so that they split over the batch like idx
        pos = torch.ones_like(idx).cumsum(1) - 1  # computed from idx: a DTensor where idx is one
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ------------------------------------------------------------------ plans (torchtitan style)


def _styles(api):
    """The parallel API to build a plan with: shardops.parallel by default, or torch's module."""
    if api is None:
        from . import parallel as api
    return api


def _placements(api):
    if api is None or api.__name__.startswith("shardops"):
        from .placements import Replicate, Shard
    else:
        from torch.distributed.tensor import Replicate, Shard
    return Replicate, Shard


def _head(api, seq, loss_parallel: bool):
    """The output projection, column-parallel over the vocabulary: logits Shard(-1) DTensors for
    loss_parallel, else gathered (Replicate, local)."""
    Replicate, Shard = _placements(api)
    return api.ColwiseParallel(
        input_layouts=seq,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )


def _attention(api, path: str, input_layouts: tuple, local_attention: bool) -> dict:
    """Attention at `path`: inputs (the first in layout `input_layouts[0]`) replicated, q/k/v
    column-parallel (heads split), the output projection row-parallel back to the first input's layout."""
    Replicate, _ = _placements(api)
    seq = input_layouts[0]
    desired = tuple(Replicate() if layout is not None else None for layout in input_layouts)
    return {
        path: api.PrepareModuleInput(input_layouts=input_layouts, desired_input_layouts=desired),
        **{f"{path}.{w}": api.ColwiseParallel(use_local_output=local_attention) for w in ("wq", "wk", "wv")},
        f"{path}.wo": api.RowwiseParallel(output_layouts=seq),
    }


def llama_plan(
    *, loss_parallel: bool = True, sequence_parallel: bool = True, local_attention: bool = True, api=None
) -> dict:
    """Tensor-parallel plan for `Llama`: vocabulary-parallel embedding and output, column/row-parallel
    attention and MLP, sequence-parallel norms. `local_attention=False` keeps q/k/v as DTensors,
    so rotary and SDPA run on DTensors (torch cannot run that variant on CPU)."""
    api = _styles(api)
    Replicate, Shard = _placements(api)
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "tok_embeddings": api.RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": _head(api, seq, loss_parallel),
        # the blocks' second input, freqs_cis, is a plain tensor: left as it is
        **_attention(api, "layers.*.attention", (seq, None), local_attention),
        "layers.*.feed_forward": api.PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": api.ColwiseParallel(),
        "layers.*.feed_forward.w2": api.RowwiseParallel(output_layouts=seq),
        "layers.*.feed_forward.w3": api.ColwiseParallel(),
    }
    if sequence_parallel:
        plan.update(
            {
                "norm": api.SequenceParallel(),
                "layers.*.attention_norm": api.SequenceParallel(),
                "layers.*.ffn_norm": api.SequenceParallel(),
            }
        )
    return plan


def gpt2_plan(
    *, loss_parallel: bool = True, sequence_parallel: bool = True, local_attention: bool = True, api=None
) -> dict:
    """Tensor-parallel plan for `GPT2`: both embeddings vocabulary/position-row-parallel (the tied
    table Shard(0), the output projection sharing it), column/row-parallel attention and MLP,
    sequence-parallel layer norms."""
    api = _styles(api)
    Replicate, Shard = _placements(api)
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "wte": api.RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "wpe": api.RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": _head(api, seq, loss_parallel),
        **_attention(api, "h.*.attn", (seq,), local_attention),
        "h.*.mlp": api.PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "h.*.mlp.c_fc": api.ColwiseParallel(),
        "h.*.mlp.c_proj": api.RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        plan.update(
            {"ln_f": api.SequenceParallel(), "h.*.ln_1": api.SequenceParallel(), "h.*.ln_2": api.SequenceParallel()}
        )
    return plan
