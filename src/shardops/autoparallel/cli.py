"""`shardops autoplan`: the automatic plan for a built-in model on a mesh, printed.

    shardops autoplan --model llama --mesh 2,2 [--links nvlink,ib] [--batch 4 --seq 8] [--explain]
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

import torch

from ..errors import ShardingError
from ..models import GPT2, Llama, ModelArgs

MODELS = {"llama": Llama, "gpt2": GPT2}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardops autoplan", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama")
    parser.add_argument("--mesh", type=_ints, default=(2, 2), help="mesh shape, e.g. 4 or 2,2")
    parser.add_argument("--links", default=None, help="link preset per mesh dim, comma-separated (threads, gloo, nvlink, ib)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--dim", type=int, default=ModelArgs.dim)
    parser.add_argument("--heads", type=int, default=ModelArgs.n_heads)
    parser.add_argument("--layers", type=int, default=ModelArgs.n_layers)
    parser.add_argument("--vocab", type=int, default=ModelArgs.vocab_size)
    parser.add_argument("--hidden", type=int, default=ModelArgs.hidden_dim)
    parser.add_argument("--explain", action="store_true", help="also print each module's runner-up and cost difference")
    args = parser.parse_args(list(argv or []))
    from . import autoparallel

    margs = ModelArgs(dim=args.dim, n_heads=args.heads, n_layers=args.layers, vocab_size=args.vocab,
                      hidden_dim=args.hidden, max_seq_len=max(args.seq, ModelArgs.max_seq_len))
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    links = tuple(args.links.split(",")) if args.links else None
    try:
        plan = autoparallel(MODELS[args.model](margs), args.mesh, (tokens,), links=links)
    except ShardingError as e:
        print(f"shardops autoplan: {e}", file=sys.stderr)
        return 2
    print(plan)
    if args.explain:
        print()
        print(plan.explain())
    return 0
