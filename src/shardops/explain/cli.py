"""`shardops explain` on the command line: an expression, a mesh, links, and named tensor specs."""

from __future__ import annotations

from collections.abc import Sequence

from .. import cost
from ..errors import ShardingError
from .call import explain
from .result import DEFAULT_TOP


def add_arguments(parser) -> None:
    parser.add_argument(
        "expression", help='a torch call on named tensors, e.g. "softmax(x, dim=1)" or "F.cross_entropy(x, t)"'
    )
    parser.add_argument("--mesh", required=True, help="mesh shape: 4096, 8x8x16, 2x2")
    parser.add_argument(
        "--links",
        default=None,
        help="link model per mesh dim: nvlink,ib,ib (presets: " + ", ".join(sorted(cost.PRESETS)) + ")",
    )
    parser.add_argument("--top", type=int, default=DEFAULT_TOP, help="candidates shown per step (default 10)")
    parser.add_argument(
        "--tensor", "-t", action="append", default=[], metavar="NAME=SPEC", help="a named tensor (also: --NAME SPEC)"
    )
    parser.add_argument(
        "--json", nargs="?", const="-", default=None, metavar="PATH", help="JSON instead of text (to PATH, or stdout)"
    )


def main(args, extra: Sequence[str] = ()) -> int:
    """`shardops explain` with parsed arguments; `extra` holds the --NAME SPEC pairs."""
    import json

    tensors = dict(_named_tensors(args.tensor, extra))
    result = explain(args.expression, mesh=args.mesh, links=args.links, top=args.top, **tensors)
    if args.json is None:
        print(result)
    elif args.json == "-":
        print(json.dumps(result.to_dict(), indent=1))
    else:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    return 0


def _named_tensors(pairs: Sequence[str], extra: Sequence[str]):
    for p in pairs:
        if "=" not in p:
            raise ShardingError(f"explain: --tensor {p!r} should be NAME=SPEC")
        name, spec = p.split("=", 1)
        yield name.strip(), spec.strip()
    extra = list(extra)
    i = 0
    while i < len(extra):
        flag = extra[i]
        name, eq, spec = flag[2:].partition("=")
        if not flag.startswith("--") or not name.isidentifier():
            raise ShardingError(f"explain: unexpected argument {flag!r}; name tensors as --NAME SPEC")
        if eq:
            yield name, spec
            i += 1
            continue
        if i + 1 >= len(extra):
            raise ShardingError(f"explain: {flag} needs a spec, e.g. {flag} 'f32[8,4096]:R,S(1)'")
        yield flag[2:], extra[i + 1]
        i += 2
