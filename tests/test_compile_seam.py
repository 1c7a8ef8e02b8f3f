"""shardops' compile hooks into torch's internals live in one seam (shardops/_torch/compile.py),
are installed by one explicit call, and fail loudly on a torch that lacks what they need.

- `import shardops` alone changes nothing of torch's compile machinery (a fresh process compares
  torch._dynamo's attributes, sys.meta_path and the registries the hooks write, before and after),
  and `shardops._torch.install()` then does install every hook (so the comparison can fail).
- An internal taken away: install raises TorchInternalMissing naming the hook and the torch version.
- Every private torch reference in src/ lives in src/shardops/_torch/. A reference is code: an
  import or an attribute chain naming a dotted name from `torch` with a component that starts with
  one underscore (`torch._dynamo`, `torch._C`, `torch.utils._pytree`, `torch.ops._c10d_functional`,
  `torch.Tensor._make_wrapper_subclass`), or a string in code that names one ("torch._inductor"
  for importlib, "torch._C._nn" compared with a __module__, a pickle record's module). Comments
  and docstrings are prose about torch, not a use of it, and are not scanned.
- No caller inspection anywhere in src/ (`sys._getframe`, `f_code`, `co_filename`).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardops._torch import compile as seam

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "shardops"

_PROBE = """
import sys
import torch, torch._dynamo, torch.utils._pytree as pytree
from torch._dynamo import trace_rules
from torch._dynamo.variables.builder import SourcelessBuilder
from torch._higher_order_ops.effects import _get_effect

def snapshot(so=None):
    shot = {
        "torch._dynamo": {k: id(v) for k, v in vars(torch._dynamo).items()},
        "torch._dynamo.config": {
            k: getattr(torch._dynamo.config, k) for k in ("recompile_limit", "accumulated_recompile_limit")
        },
        "OutputGraph": {k: id(v) for k, v in vars(torch._dynamo.output_graph.OutputGraph).items()},
        "sys.meta_path": [id(f) for f in sys.meta_path],
        "type handlers": len(SourcelessBuilder._type_handlers),
        "pytree nodes": len(pytree.SUPPORTED_NODES),
    }
    if so is not None:
        from shardops.mesh import DeviceMesh
        from shardops.tensor import from_local
        shot["effect"] = str(_get_effect(torch.ops.shardops.count.default))
        shot["from_local opaque"] = id(from_local) in trace_rules._allowed_callable_ids
        shot["mesh constant"] = pytree.is_constant_class(DeviceMesh)
        shot["mesh sourceless"] = DeviceMesh in SourcelessBuilder._type_handlers
    return shot

before = snapshot()
import shardops as so
after_import = snapshot(so)
changed = sorted(k for k in before if before[k] != after_import[k])
so._torch.install()
after_install = snapshot(so)
installed = sorted(k for k in after_install if after_import.get(k) != after_install[k])
hooks = ("effect", "from_local opaque", "mesh constant", "mesh sourceless")
print(repr((changed, *(after_import[k] for k in hooks), installed)))
"""


def test_import_shardops_leaves_torch_compile_untouched_and_install_installs():
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    changed, effect, opaque, constant, sourceless, installed = eval(done.stdout.strip().splitlines()[-1])
    assert changed == [], f"import shardops changed {changed}"
    assert (effect, opaque, constant, sourceless) == ("None", False, False, False)
    # the probe sees the hooks once installed (a comparison that could not fail would prove nothing)
    for hooked in (
        "OutputGraph",
        "effect",
        "from_local opaque",
        "mesh constant",
        "mesh sourceless",
        "pytree nodes",
        "type handlers",
    ):
        assert hooked in installed, (hooked, installed)


_LAZY_PROBE = """
import sys, torch
paths = list(sys.meta_path)
import shardops as so
assert sys.meta_path == paths and "torch._dynamo" not in sys.modules, (
    "import shardops imported dynamo or added a finder"
)
so._torch.install()
assert len(sys.meta_path) == len(paths) + 1, "install() waits for torch._dynamo's import with a finder"
import torch._dynamo
from torch._dynamo import trace_rules
from shardops.tensor import from_local
assert sys.meta_path == paths, "the finder leaves once dynamo is imported"
assert id(from_local) in trace_rules._allowed_callable_ids, "dynamo's marks are made as it is imported"
print("ok")
"""


def test_install_before_dynamo_is_imported_marks_it_as_it_loads():
    done = subprocess.run([sys.executable, "-c", _LAZY_PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_missing_effect_internal_fails_loudly_naming_the_hook(monkeypatch):
    monkeypatch.setattr(seam, "_installed", [False])  # as in a process where nothing installed it yet
    monkeypatch.delattr(torch.library, "_register_effectful_op")
    with pytest.raises(
        seam.TorchInternalMissing,
        match=rf"'keep_in_order'.*torch\.library\._register_effectful_op.*torch {re.escape(torch.__version__)}",
    ):
        seam.install()


def test_a_missing_dynamo_internal_fails_loudly_naming_the_hook(monkeypatch):
    import torch._dynamo.output_graph as output_graph

    monkeypatch.delattr(output_graph.OutputGraph, "call_user_compiler")
    with pytest.raises(
        seam.TorchInternalMissing, match=rf"'on_graph_entry'.*call_user_compiler.*torch {re.escape(torch.__version__)}"
    ):
        seam._wrap_graph_calls()


def test_require_names_the_hook_the_internal_and_the_known_versions():
    with pytest.raises(seam.TorchInternalMissing) as e:
        seam.require("a hook", "torch._dynamo", "no_such_internal")
    message = str(e.value)
    assert "'a hook'" in message and "torch._dynamo.no_such_internal" in message and torch.__version__ in message
    assert all(v in message for v in seam.KNOWN)


# ------------------------------------------------------------------ where private torch references live


def _is_private(parts: list[str]) -> bool:
    return parts[0] == "torch" and any(
        p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts[1:]
    )


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


_DOTTED_TORCH_NAME = re.compile(r"\btorch(?:\.\w+)+")  # in a string: torch._C._nn, torch.utils._pytree.tree_map


def _body(node: ast.AST) -> list:
    body = getattr(node, "body", None)
    return body if isinstance(body, list) else []


def _prose(tree: ast.AST) -> set[int]:
    """The string statements of every body (docstrings, bare strings): prose about torch, not code."""
    return {
        id(st.value)
        for n in ast.walk(tree)
        for st in _body(n)
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant) and isinstance(st.value.value, str)
    }


def private_torch_references(source: str) -> list[str]:
    """Every private torch name `source` uses: in imports, as attribute chains from `torch`, and in
    strings that are not docstrings (an f-string's literal parts too); comments are never parsed."""
    tree = ast.parse(source)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # count a chain once, at its end
    prose = _prose(tree)
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = (
                [node.module]
                if _is_private(node.module.split("."))
                else [f"{node.module}.{a.name}" for a in node.names]
            )
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            names = [".".join(d) for d in [_dotted(node)] if d]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            names = _DOTTED_TORCH_NAME.findall(node.value)
        found += [n for n in names if _is_private(n.split("."))]
    return found


_SCANNED = '''"""A module docstring naming torch._dynamo is prose."""
import torch._dynamo
from torch._guards import TracingContext
import torch.utils._pytree as pytree
x = torch._C.DisableTorchFunctionSubclass
y = torch.ops._c10d_functional.wait_tensor
z = torch.Tensor._make_wrapper_subclass
ok = torch.nn.functional.relu
also_ok = torch.__version__
m = importlib.import_module("torch._inductor")  # a comment on torch._C is prose too


def f(p):
    """torch._C in a function's docstring is prose."""
    return f"torch._C._{p}", "torch.nn is public"
'''


def test_the_private_reference_scan_sees_imports_attribute_chains_and_strings_not_prose():
    assert sorted(private_torch_references(_SCANNED)) == sorted(
        [
            "torch._dynamo",
            "torch._guards",
            "torch.utils._pytree",
            "torch._C.DisableTorchFunctionSubclass",
            "torch.ops._c10d_functional.wait_tensor",
            "torch.Tensor._make_wrapper_subclass",
            "torch._inductor",
            "torch._C._",
        ]
    )


def test_every_private_torch_reference_lives_in_the_seam():
    outside = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if not rel.startswith("_torch/"):
            found = private_torch_references(path.read_text())
            if found:
                outside[rel] = found
    assert not outside, f"private torch references outside shardops/_torch/ (give each a name in the seam): {outside}"
    seam = [p for p in (SRC / "_torch").glob("*.py") if private_torch_references(p.read_text())]
    assert len(seam) >= 3, "the scan finds the seam's own references (a scan that sees nothing would pass anyway)"


def test_no_caller_inspection():
    pattern = re.compile(r"_getframe|f_code|co_filename")
    hits = [
        f"{p.relative_to(SRC)}:{i}"
        for p in SRC.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits
