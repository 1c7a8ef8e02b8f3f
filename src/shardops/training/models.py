"""Two small transformer language models in plain torch.nn, and their tensor-parallel plans.

- `Llama`: token embedding, RMSNorm, attention with rotary embeddings (complex
  frequencies from `torch.polar`, applied through `torch.view_as_complex`),
  causal `F.scaled_dot_product_attention`, SwiGLU MLP, output projection.
- `GPT2`: token + learned positional embeddings, LayerNorm, GELU MLP with bias,
  dropout, output projection tied to the token embedding.

Nothing here knows about sharding: the plans are dicts of parallel styles built
from a namespace `P` (either `shardops.parallel` or
`torch.distributed.tensor.parallel`) and placement classes `L` (either
`shardops` or `torch.distributed.tensor`), so one plan runs on both systems.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 512
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_hidden: int = 128
    seq: int = 32
    dropout: float = 0.0
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


SIZES = {
    "tiny": ModelConfig(vocab=128, dim=32, n_layers=1, n_heads=4, ffn_hidden=64, seq=16),
    "small": ModelConfig(),
    "medium": ModelConfig(vocab=2048, dim=256, n_layers=4, n_heads=8, ffn_hidden=512, seq=64),
}


# ------------------------------------------------------------------ LLaMA-style


def rotary_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """complex64 [seq, head_dim/2]: e^{i·pos·θ_k} with θ_k = theta^(-2k/head_dim)."""
    half = cfg.head_dim // 2
    theta = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, dtype=torch.float32) * 2 / cfg.head_dim))
    angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), theta)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of x [b, s, heads, head_dim] by the complex frequencies [s, head_dim/2]."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(pairs * freqs.view(1, x.shape[1], 1, -1)).flatten(3)
    return rotated.type_as(x)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        # -1 heads: under tensor parallelism with local outputs each rank holds n_heads / tp of them
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rotary(q, freqs), apply_rotary(k, freqs)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.attention = LlamaAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.feed_forward = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.register_buffer("freqs", rotary_frequencies(cfg), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        freqs = self.freqs[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, freqs)
        return self.output(self.norm(h))


# ------------------------------------------------------------------ GPT-2-style


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dropout(self.proj(out.transpose(1, 2).reshape(b, s, -1)))


class GeluMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.ffn_hidden)
        self.proj = nn.Linear(cfg.ffn_hidden, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.mlp = GeluMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.ln_1(x))
        return h + self.mlp(self.ln_2(h))


class GPT2(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = nn.Embedding(cfg.seq, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input and output embeddings

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.drop(self.wte(tokens) + self.wpe(positions))
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))


MODELS = {"llama": Llama, "gpt2": GPT2}


def build(name: str, cfg: ModelConfig, seed: int = 0) -> nn.Module:
    """The model with deterministic initial weights (scaled like GPT-2: small std, residual projections shrunk)."""
    gen = torch.Generator().manual_seed(seed)
    model = MODELS[name](cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:
                continue  # norms keep ones / zeros
            std = 0.02 / math.sqrt(2 * cfg.n_layers) if pname.endswith(("wo.weight", "w2.weight", "proj.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.zero_()
    return model


# ------------------------------------------------------------------ tensor-parallel plans (torchtitan-style)


def llama_plan(P: Any, L: Any, *, local_attention: bool = True, sequence_parallel: bool = True) -> dict[str, Any]:
    """Sequence-parallel norms, column/row-parallel attention and MLP, vocabulary-parallel loss.

    `local_attention=False` keeps q/k/v as DTensors (rotary and SDPA run on DTensors).
    """
    seq = L.Shard(1) if sequence_parallel else L.Replicate()
    norm = P.SequenceParallel() if sequence_parallel else None
    plan: dict[str, Any] = {
        "tok_embeddings": P.RowwiseParallel(input_layouts=L.Replicate(), output_layouts=seq),
        "output": P.ColwiseParallel(input_layouts=seq, output_layouts=L.Shard(-1), use_local_output=False),
        "layers.*.attention": P.PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(L.Replicate(), None)),
        "layers.*.attention.wq": P.ColwiseParallel(use_local_output=local_attention),
        "layers.*.attention.wk": P.ColwiseParallel(use_local_output=local_attention),
        "layers.*.attention.wv": P.ColwiseParallel(use_local_output=local_attention),
        "layers.*.attention.wo": P.RowwiseParallel(output_layouts=seq),
        "layers.*.feed_forward": P.PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(L.Replicate(),)),
        "layers.*.feed_forward.w1": P.ColwiseParallel(),
        "layers.*.feed_forward.w2": P.RowwiseParallel(output_layouts=seq),
        "layers.*.feed_forward.w3": P.ColwiseParallel(),
    }
    if norm is not None:
        plan.update({"norm": P.SequenceParallel(), "layers.*.attention_norm": P.SequenceParallel(), "layers.*.ffn_norm": P.SequenceParallel()})
    return plan


def gpt2_plan(P: Any, L: Any, *, local_attention: bool = True, sequence_parallel: bool = True) -> dict[str, Any]:
    seq = L.Shard(1) if sequence_parallel else L.Replicate()
    plan: dict[str, Any] = {
        "wte": P.RowwiseParallel(input_layouts=L.Replicate(), output_layouts=seq),
        "wpe": P.RowwiseParallel(input_layouts=L.Replicate(), output_layouts=L.Shard(0) if sequence_parallel else L.Replicate()),
        "lm_head": P.ColwiseParallel(input_layouts=seq, output_layouts=L.Shard(-1), use_local_output=False),
        "blocks.*.attn": P.PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(L.Replicate(),)),
        "blocks.*.attn.q": P.ColwiseParallel(use_local_output=local_attention),
        "blocks.*.attn.k": P.ColwiseParallel(use_local_output=local_attention),
        "blocks.*.attn.v": P.ColwiseParallel(use_local_output=local_attention),
        "blocks.*.attn.proj": P.RowwiseParallel(output_layouts=seq),
        "blocks.*.mlp": P.PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(L.Replicate(),)),
        "blocks.*.mlp.fc": P.ColwiseParallel(),
        "blocks.*.mlp.proj": P.RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        plan.update({"ln_f": P.SequenceParallel(), "blocks.*.ln_1": P.SequenceParallel(), "blocks.*.ln_2": P.SequenceParallel()})
    return plan


PLANS = {"llama": llama_plan, "gpt2": gpt2_plan}


def torch_namespaces() -> tuple[Any, Any]:
    import torch.distributed.tensor as L
    import torch.distributed.tensor.parallel as P

    return P, L


def shardops_namespaces() -> tuple[Any, Any]:
    import shardops as L
    from shardops import parallel as P

    return P, L
