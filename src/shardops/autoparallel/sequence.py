"""Whether a model can take the sequence-parallel candidates (candidates.py) at all.

Under sequence parallelism the embeddings' output is this rank's sequence shard, a plain tensor: the
model's own code between the styled modules sees it as the whole sequence. A model that derives
positions or masks from that stream's length (transformers' Llama: `inputs_embeds.shape[1]` gives its
rotary positions and causal mask) then computes them for the shard, which fails when the gathered
attention meets them, or, with one token per rank, broadcasts silently into wrong values that only a
value check sees (the threads world's; the dry world has no values). Such models get no
sequence-parallel candidate. A model that takes its positions from the tokens (shardops' Llama: its
rotary table cut to `tokens.shape[1]`) meets a shorter stream with a shape error, and keeps them.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .._torch import pytree
from .structure import ModelStructure, truncated

__all__ = ["reads_sequence_length_from_stream"]

SHORTER = (2, 3)  # the probes' stream lengths: not 1 (would broadcast), shorter than the example's


def reads_sequence_length_from_stream(model: nn.Module, structure: ModelStructure, example: tuple) -> bool:
    """Whether the first block gets, beside the stream, a tensor sized by the stream's length: run with every
    embedding's output cut on dim 1 (sequence parallelism's Shard(1)) to each SHORTER length, such a tensor
    changes shape with it (transformers' rotary cos/sin and causal mask). Positions that ride in the stream
    (GPT-2's position embedding, cut alike) and a model that fails on a shorter stream (its positions
    come from the tokens) do not count."""
    tokens = example[0] if example else None
    if not structure.blocks or not structure.embeddings or not isinstance(tokens, torch.Tensor) or tokens.ndim < 2:
        return False
    if tokens.shape[1] <= max(SHORTER):
        return False  # no shorter streams to tell the two apart with
    blocks = structure.blocks
    probe = truncated(model, blocks, 2) if structure.n_blocks > 2 else model
    beside = [_beside_the_stream(probe, blocks, structure.embeddings, example, n) for n in SHORTER]
    return beside[0] is not None and beside[1] is not None and beside[0] != beside[1]


def _beside_the_stream(
    probe: nn.Module, blocks: str, embeddings: list[str], example: tuple, n: int
) -> list[tuple[int, ...]] | None:
    """The shapes of the tensors the first block is called with, the embeddings' outputs cut to `n`
    positions, but the stream's ([batch, n, ...]); None if the forward fails so."""
    batch = example[0].shape[0]
    shapes: list[tuple[int, ...]] = []

    def cut(module, inputs, out):
        return out[:, :n]

    def record(module, args, kwargs):
        tensors = [t for t in pytree.tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        shapes.extend(s for t in tensors if (s := tuple(t.shape))[:2] != (batch, n))

    first = next(iter(probe.get_submodule(blocks).children()))
    hooks = [probe.get_submodule(name).register_forward_hook(cut) for name in embeddings]
    hooks.append(first.register_forward_pre_hook(record, with_kwargs=True))
    try:
        with torch.no_grad():
            probe(*example)
    except Exception:  # noqa: BLE001  (any error: the model's code does not follow the stream's length)
        return None
    finally:
        for hook in hooks:
            hook.remove()
    return shapes
