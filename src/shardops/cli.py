"""The `shardops` command: subcommands verify, explain, demo (alias train), bench, autoplan.

Each subcommand is one row of SUBCOMMANDS: (module path, function). Modules are
imported only when their subcommand runs, so `shardops explain` does not pay
for the benchmarks, and a subcommand whose module does not exist yet says so.

    verify, explain   shardops.<module>.add_arguments(parser) + main(args[, extra]) -> exit code
    demo, train, bench, autoplan  module:main(argv) -> exit code (they parse their own arguments)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# name -> (module path, function, one-line help). Parsed here: modules with add_arguments(parser).
# Passed through: the function receives the remaining argv and parses it itself.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "verify": ("shardops.verify", "main", "check every registered op against single-device torch"),
    "explain": ("shardops.explain", "main", "show the candidate strategies of a call, their costs and the choice"),
    "demo": ("shardops.demo", "main", "run the demo"),
    "train": ("shardops.demo", "main", "the demo's training run (--save-every N --checkpoint DIR, --resume DIR)"),
    "bench": ("benchmarks.run", "main", "run the benchmarks against torch.distributed.tensor"),
    "autoplan": (
        "shardops.training.autoplan_cli",
        "main",
        "choose and print a parallelization plan for a built-in model",
    ),
}


class MissingSubcommand(RuntimeError):
    """A subcommand whose module is not there (yet)."""


def load(name: str) -> tuple[object, Callable]:
    module_path, func, _ = SUBCOMMANDS[name]
    try:
        module = _import(module_path)
    except ModuleNotFoundError as e:
        if e.name and (module_path == e.name or module_path.startswith(e.name + ".")):
            if e.name.split(".")[0] == "benchmarks":
                raise MissingSubcommand(
                    f"shardops {name}: the benchmarks live in the repository (benchmarks/ beside src/), not in the "
                    "installed package. Install shardops from a clone (`pip install -e .`, `make bench`) or run "
                    "`python -m benchmarks.run` in the clone."
                ) from None
            raise MissingSubcommand(
                f"shardops {name}: {module_path} is not available (not installed or not written yet)"
            ) from None
        if e.name == "rich":
            raise MissingSubcommand(f"shardops {name} prints with rich: pip install 'shardops[cli]'") from None
        raise
    return module, getattr(module, func)


def _import(module_path: str):
    """Import a subcommand's module. `benchmarks` is not part of the package: found as itself, or
    beside src/ in the clone this package was installed from (an editable install), never from the cwd.
    The clone goes on sys.path (at its end), which spawned processes inherit: the bench's gloo ranks
    import their `benchmarks.*` entry points from any working directory."""
    if module_path.split(".")[0] == "benchmarks" and "benchmarks" not in sys.modules:
        _load_repository_benchmarks()
    return importlib.import_module(module_path)


def _load_repository_benchmarks() -> None:
    try:
        if importlib.util.find_spec("benchmarks") is not None:
            return
    except ValueError:
        return
    clone = Path(__file__).resolve().parents[2]  # <clone>/src/shardops/cli.py -> <clone>
    if not (clone / "benchmarks" / "__init__.py").is_file():
        return
    sys.path.append(str(clone))  # nothing else named benchmarks is importable (find_spec above)
    importlib.invalidate_caches()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardops", description="sharded tensor math on PyTorch")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (module_path, _, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, add_help=name in ("verify", "explain"))
        if name in ("verify", "explain"):
            importlib.import_module(module_path).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS and argv[0] not in ("verify", "explain"):
        return _pass_through(argv[0], argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from .errors import ShardingError

    try:
        _, func = load(args.command)
    except MissingSubcommand as e:
        print(e, file=sys.stderr)
        return 2
    try:
        if args.command == "explain":
            return int(func(args, extra) or 0)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return int(func(args) or 0)
    except ShardingError as e:
        print(f"shardops {args.command}: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name != "rich":
            raise
        print(f"shardops {args.command} prints with rich: pip install 'shardops[cli]'", file=sys.stderr)
        return 2


def _pass_through(name: str, rest: list[str]) -> int:
    try:
        _, func = load(name)
    except MissingSubcommand as e:
        print(e, file=sys.stderr)
        return 2
    takes_argv = bool(inspect.signature(func).parameters)
    try:
        return int((func(rest) if takes_argv else func()) or 0)
    except ModuleNotFoundError as e:
        if e.name != "rich":
            raise
        print(f"shardops {name} prints with rich: pip install 'shardops[cli]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
