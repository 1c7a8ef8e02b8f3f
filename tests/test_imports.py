"""No import cycle in src/shardops or benchmarks, module-level or function-level.

The graph is built from the AST of every module: every `import` and `from ... import`
statement anywhere in the file (inside functions too, since a function-level import
only hides a cycle), relative imports resolved. `from pkg import name` points at the
submodule `pkg.name` where one exists, else at `pkg`. Importing `pkg.sub` runs `pkg`'s
`__init__` first, so it is an edge to `pkg` too, unless `pkg` is one of the importer's
own packages (Python imports those first, and a package does not depend on its modules).

A layer order: every module sits in a layer, and imports only from its own layer or lower
ones (the planner's caches, for instance, sit below spec and cost, which use them).

A further check: DTensor's private fields are read only by tensor.py and its seam
(wrapping.py); every other module goes through the seam.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"shardops": ROOT / "src" / "shardops", "benchmarks": ROOT / "benchmarks"}


def _modules() -> dict[str, Path]:
    mods = {}
    for base in SOURCES.values():
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module) if node.level else node.module or ""
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            for t in targets:
                # the deepest known module the dotted name refers to
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
                graph[name].update(_packages_run_first(t, name, mods))
    return graph


def _packages_run_first(target: str, importer: str, mods: dict[str, Path]) -> set[str]:
    """The packages above `target` whose __init__ runs on its import, less the importer's own packages."""
    own = {importer, *_ancestors(importer)}
    return {p for p in _ancestors(target) if p in mods and p not in own}


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "shardops.dispatch.registry" in graph["shardops.ops.softmax"]  # relative, module level
    assert "shardops.world" in graph["shardops.mesh"]  # function level
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    # a function-level import of a submodule runs its package first
    assert "shardops.parallel" in graph["shardops.models"]
    assert "shardops.dispatch" not in graph["shardops.dispatch.core"]  # its own package


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# ------------------------------------------------------------------ layers

# Lowest first. A module's layer is that of its longest listed prefix (a package lists its
# modules). Imports go down or sideways, never up; test_no_import_cycle covers sideways circles.
LAYERS: list[tuple[str, ...]] = [
    ("shardops.errors", "shardops.caches", "shardops.notation", "shardops._torch"),  # torch's internals: the seam
    ("shardops.placements",),
    ("shardops.comm", "shardops.wrapper_meta"),
    ("shardops.world",),
    ("shardops.mesh", "shardops.rng"),
    ("shardops.spec", "shardops.cost"),
    ("shardops.redistribute",),
    ("shardops.planner",),
    ("shardops.dispatch",),
    ("shardops.tensor", "shardops.wrapping"),
    (
        "shardops.ops",
        "shardops.interop",
        "shardops.explain",
        "shardops.checkpoint",
        "shardops.parallel",
        "shardops.fsdp",
    ),
    ("shardops.remesh", "shardops.pipelining"),  # remesh gathers layouts with checkpoint's object exchange
    ("shardops.models", "shardops.models_moe", "shardops.verify", "shardops.autoparallel"),
    ("shardops",),  # the public API (__init__)
    ("shardops.training", "shardops.demo", "shardops.cli"),
]


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[0]):
                best = (len(name), index)
    return best[1] if best else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a higher layer, as 'importer -> imported'."""
    return sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        for t in targets
        if m.startswith("shardops") and t.startswith("shardops") and layer_of(t) > layer_of(m)  # type: ignore[operator]
    )


def test_every_module_has_a_layer():
    missing = sorted(m for m in import_graph() if m.startswith("shardops") and layer_of(m) is None)
    assert not missing, f"put these modules in a layer of LAYERS: {missing}"


def test_the_layer_check_sees_an_upward_import():
    assert upward_imports({"shardops.spec": {"shardops.planner.choice"}}) == [
        "shardops.spec -> shardops.planner.choice"
    ]
    assert upward_imports({"shardops.planner.choice": {"shardops.spec"}}) == []
    assert layer_of("shardops.planner.search") == layer_of("shardops.planner") > layer_of("shardops.caches")


def test_no_module_imports_from_a_higher_layer():
    up = upward_imports(import_graph())
    assert not up, "imports from a higher layer (move the shared part down, or the module up): " + ", ".join(up)


# ------------------------------------------------------------------ the library apart from its tools

# The tools side: the command line, the demos and the training comparison (trainer, launcher,
# reports). The library (everything else under shardops) never imports them.
TOOLS = ("shardops.cli", "shardops.demo", "shardops.training")
# The only library modules that print through rich, when run from the command line (`shardops
# verify`'s progress bar and report): importing them does not import rich (the import is inside
# the printing functions), and the rest of verify runs without it.
RICH_PRINTERS = ("shardops.verify.driver", "shardops.verify.report")


def _is_tool(module: str) -> bool:
    return any(module == t or module.startswith(t + ".") for t in TOOLS)


def _external_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_library_never_imports_its_tools():
    graph = import_graph()
    library = [m for m in graph if m.startswith("shardops") and not _is_tool(m)]
    assert "shardops.models" in library and "shardops.ops.softmax" in library
    leaks = {m: sorted(t for t in graph[m] if _is_tool(t)) for m in library}
    assert not {m: t for m, t in leaks.items() if t}


def test_the_library_does_not_import_rich():
    mods = _modules()
    users = sorted(
        m
        for m, path in mods.items()
        if m.startswith("shardops") and not _is_tool(m) and "rich" in _external_imports(path)
    )
    assert set(users) <= set(RICH_PRINTERS), users


def test_import_shardops_and_a_sharded_step_without_rich():
    """With rich not installed (blocked here), `import shardops`, a sharded op, and
    shardops.models with its plan all work, and rich is never imported."""
    import subprocess
    import sys

    program = """
import sys
sys.modules["rich"] = None  # `import rich` now raises ModuleNotFoundError, as when not installed
import torch, shardops as so
from shardops.models import GPT2, ModelArgs, gpt2_plan, llama_plan, Llama
def body():
    mesh = so.init_device_mesh("cpu", (2,))
    x = so.distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [so.Shard(1)])
    return torch.softmax(x, 1).full_tensor()
got = so.run(body, 2)[0]
assert torch.allclose(got, torch.softmax(torch.arange(12.0).reshape(3, 4), 1))
assert not [m for m in sys.modules if m.startswith("rich.")]
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


PRIVATE_FIELDS = {
    "_local_tensor",
    "_make",
    "_spec",
    "_set_spec",
    "_redistribute_local",
    "_pending_layout",
    "_resolve_pending",
}
SEAM = {"shardops.tensor", "shardops.wrapping"}


def private_field_uses() -> list[str]:
    """Every `x.<private DTensor field>` in the library outside tensor.py and its seam, as `module:line .field`."""
    uses = []
    for name, path in _modules().items():
        if not name.startswith("shardops") or name in SEAM:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in PRIVATE_FIELDS:
                uses.append(f"{name}:{node.lineno} .{node.attr}")
    return uses


def test_the_private_field_scan_sees_reads_writes_and_calls(tmp_path):
    src = "x._local_tensor\ny._spec = 1\nDTensor._make(a, b)\nz.spec_of\n"
    found = [n.attr for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Attribute) and n.attr in PRIVATE_FIELDS]
    assert sorted(found) == ["_local_tensor", "_make", "_spec"]


def test_only_tensor_and_its_seam_touch_dtensor_private_fields():
    uses = private_field_uses()
    assert not uses, "use shardops.wrapping (wrap, local_of, spec_of, local_in, relabel, become) instead: " + ", ".join(
        uses
    )


REGISTRY_TABLES = {
    "RULES",
    "TORCH_FUNCTIONS",
    "DECOMPOSITIONS",
    "ALGORITHMS",
    "REPLICATE_ONLY",
    "REPLICATE_WHEN",
    "OVERWRITES_SELF",
}
MUTATORS = {"add", "update", "setdefault", "pop", "discard", "remove", "clear", "__setitem__"}


def registry_writes(source: str) -> list[int]:
    """Lines of `source` that write one of the registry's tables (item assignment, deletion or a mutating call)."""

    def table(node) -> bool:
        return (isinstance(node, ast.Name) and node.id in REGISTRY_TABLES) or (
            isinstance(node, ast.Attribute) and node.attr in REGISTRY_TABLES
        )

    lines = []
    for node in ast.walk(ast.parse(source)):
        targets = (
            node.targets
            if isinstance(node, (ast.Assign, ast.Delete))
            else [node.target]
            if isinstance(node, ast.AugAssign)
            else []
        )
        if isinstance(node, ast.stmt) and any(isinstance(t, ast.Subscript) and table(t.value) for t in targets):
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
            and table(node.func.value)
        ):
            lines.append(node.lineno)
    return lines


def test_the_registry_write_scan_sees_items_and_calls():
    src = "RULES[op] = r\nregistry.DECOMPOSITIONS[op] = f\nREPLICATE_ONLY.add(op)\nx = RULES[op]\nRULES.get(op)\n"
    assert registry_writes(src) == [1, 2, 3]


def test_ops_register_only_through_the_registry_decorators():
    """One way in: the library writes the registry's tables only inside dispatch/registry.py (the decorators)."""
    writes = [
        f"{name}:{line}"
        for name, path in _modules().items()
        if name.startswith("shardops") and name != "shardops.dispatch.registry"
        for line in registry_writes(path.read_text())
    ]
    assert not writes, (
        "register with @strategy / @torch_level / @decomposition / @replicate_when (dispatch/registry.py): "
        + ", ".join(writes)
    )
