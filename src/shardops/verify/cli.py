"""`shardops verify` on the command line: its arguments and exit code (1 on any mismatch)."""

from __future__ import annotations

from .driver import MESHES, verify
from .targets import discover, select


def add_arguments(parser) -> None:
    parser.add_argument(
        "--op", action="append", help="op name, exact or substring (aten.sum.dim_IntList, softmax); repeatable"
    )
    parser.add_argument(
        "--mesh", action="append", choices=sorted(MESHES), help="mesh shape (default: all of 4, 2x2, 2x2x2); repeatable"
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="every layout combination of every sample and dtype (slow: narrow with --op)",
    )
    parser.add_argument(
        "--budget",
        type=int,
        default=None,
        help=(
            "cases per op and mesh in the sampled run "
            "(default: 4 / 4 / 2 by mesh dims; plus one case per sharded algorithm)"
        ),
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled run")
    parser.add_argument(
        "--case",
        type=int,
        default=None,
        help="run only this case (with one --op and one --mesh): the reproduction of a failure",
    )
    parser.add_argument(
        "--part",
        metavar="K/N",
        default=None,
        help="run only part K of N (cases whose index is K mod N; K from 0): split a long --full run over machines",
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON")
    parser.add_argument("--list", action="store_true", help="list the ops verify would check, then exit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args) -> int:
    """`shardops verify` with parsed arguments; exit code 1 on any mismatch."""
    if args.list:
        targets, _ = discover()
        for t in select(targets, args.op):
            print(f"{t.name:<60} {t.kind:<15} {'samples' if t.generator else 'NO SAMPLES'}")
        return 0
    report = verify(
        args.op,
        args.mesh,
        full=args.full,
        budget=args.budget,
        seed=args.seed,
        case=args.case,
        part=args.part,
        json_path=args.json,
        progress=not args.no_progress,
    )
    return 0 if report.ok else 1
