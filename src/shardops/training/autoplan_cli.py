"""`shardops autoplan`: the automatic plan for a built-in model on a mesh, printed.

    shardops autoplan llama-7b --mesh 8,8,16 --links nvlink,ib,ib      (priced from metadata)
    shardops autoplan llama --mesh 2,2 [--batch 4 --seq 8] [--explain]  (a tiny model, priced by running)

Named models: the tiny `llama` and `gpt2` (ModelArgs defaults, or --dim/--layers/...), and
full-size shapes built on the meta device (no memory, no data): `llama-7b` (LLaMA-7B: dim 4096,
32 layers, 32 heads, SwiGLU 11008, vocabulary 32000) and `gpt2-124m` (GPT-2 small). A meta
model or a mesh of more than 16 ranks is priced from metadata (one dry rank, see docs/autoparallel.md).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

import torch

from ..errors import ShardingError
from ..models import GPT2, Llama, ModelArgs

TINY = {"llama": Llama, "gpt2": GPT2}
# full-size shapes, built on the meta device; the default sequence is the model's context
FULL = {
    "llama-7b": (
        Llama,
        ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, hidden_dim=11008, max_seq_len=2048),
    ),
    "gpt2-124m": (
        GPT2,
        ModelArgs(dim=768, n_layers=12, n_heads=12, vocab_size=50257, hidden_dim=3072, max_seq_len=1024),
    ),
}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def build(name: str, args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor]:
    """The named model and its global example batch (on meta for the full-size shapes)."""
    if name in FULL:
        cls, margs = FULL[name]
        with torch.device("meta"):
            model = cls(margs)
        batch = args.batch or math.prod(args.mesh)  # one sequence per rank
        tokens = torch.empty(batch, args.seq or margs.max_seq_len, dtype=torch.long, device="meta")
        return model, tokens
    margs = ModelArgs(
        dim=args.dim,
        n_heads=args.heads,
        n_layers=args.layers,
        vocab_size=args.vocab,
        hidden_dim=args.hidden,
        max_seq_len=max(args.seq or 8, ModelArgs.max_seq_len),
    )
    tokens = torch.randint(0, args.vocab, (args.batch or 4, args.seq or 8), generator=torch.Generator().manual_seed(0))
    return TINY[name](margs), tokens


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardops autoplan", description=__doc__.splitlines()[0])
    names = sorted([*TINY, *FULL])
    parser.add_argument("name", nargs="?", choices=names, help="the model (or --model)")
    parser.add_argument("--model", choices=names, default=None)
    parser.add_argument("--mesh", type=_ints, default=(2, 2), help="mesh shape, e.g. 4 or 2,2 or 8,8,16")
    parser.add_argument(
        "--links", default=None, help="link preset per mesh dim, comma-separated (threads, gloo, nvlink, ib)"
    )
    parser.add_argument(
        "--batch", type=int, default=None, help="global batch (default: 4; one sequence per rank for full-size models)"
    )
    parser.add_argument(
        "--seq", type=int, default=None, help="sequence length (default: 8; the context for full-size models)"
    )
    parser.add_argument("--dim", type=int, default=ModelArgs.dim)
    parser.add_argument("--heads", type=int, default=ModelArgs.n_heads)
    parser.add_argument("--layers", type=int, default=ModelArgs.n_layers)
    parser.add_argument("--vocab", type=int, default=ModelArgs.vocab_size)
    parser.add_argument("--hidden", type=int, default=ModelArgs.hidden_dim)
    parser.add_argument("--pricing", choices=("auto", "run", "metadata"), default="auto")
    parser.add_argument(
        "--memory-per-rank", type=int, default=None, help="bytes per rank for parameters, gradients and AdamW states"
    )
    parser.add_argument("--explain", action="store_true", help="also print each module's runner-up and cost difference")
    parser.add_argument("--objective", choices=("time", "bytes"), default="bytes")
    parser.add_argument("--compute", default=None, help="compute preset (gloo-localhost, cpu, gpu)")
    parser.add_argument(
        "--fit",
        nargs="?",
        const="",
        default=None,
        metavar="JSON",
        help="measure the gloo-localhost link and compute presets on 4 gloo processes here, print them "
        "(and write them to JSON, read at import when SHARDOPS_TIMING_PRESET names it); no plan",
    )
    args = parser.parse_args(list(argv or []))
    from ..autoparallel import autoparallel

    if args.fit is not None:
        from .fit_timing import fit

        link, compute = fit(save=args.fit or None)
        print(f"gloo-localhost: {link!r} (alpha {link.latency:.3g} s, beta {link.bandwidth:.3g} B/s), {compute!r}")
        return 0

    name = args.name or args.model or "llama"
    model, tokens = build(name, args)
    links = tuple(args.links.split(",")) if args.links else None
    try:
        plan = autoparallel(
            model,
            args.mesh,
            (tokens,),
            links=links,
            pricing=args.pricing,
            memory_per_rank=args.memory_per_rank,
            objective=args.objective,
            compute=args.compute,
        )
    except ShardingError as e:
        print(f"shardops autoplan: {e}", file=sys.stderr)
        return 2
    print(plan)
    if args.explain:
        print()
        print(plan.explain())
    return 0
