"""Reading what a user types: tensor specs "f32[8,4096]:R,S(1)", placements, meshes and link models."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch

from .. import cost
from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..notation import DTYPES, dtype_name, parse_mesh_shape
from ..placements import NormPartial, Partial, Placement, Replicate, Shard, StridedShard, normalize_placements
from ..spec import TensorMeta, TensorSpec, contiguous_stride

R = Replicate()
SPEC_RE = re.compile(r"^\s*(?P<dtype>[A-Za-z0-9_]+)\s*\[(?P<shape>[0-9,\s]*)\]\s*(?::\s*(?P<placements>.*))?$")
_PLACEMENT_RE = re.compile(
    r"_S\(\s*-?\d+\s*,\s*\d+\s*\)|S\(\s*-?\d+\s*\)|NormP\(\s*[-+a-z0-9.]+\s*\)|P\(\s*[a-z]*\s*\)|P|R"
)
SPEC_HELP = (
    'a spec is DTYPE[SHAPE]:PLACEMENTS, e.g. "f32[8,4096]:R,S(1)" '
    "(placements R, S(d), P(sum|avg|max|min|product), NormP(p), _S(d,k); one per mesh dim)"
)


def parse_placement(text: str) -> Placement:
    t = text.replace(" ", "")
    if t == "R":
        return R
    if t == "P":
        return Partial("sum")
    inner = t[t.index("(") + 1 : -1] if "(" in t else ""
    if t.startswith("_S("):
        d, k = inner.split(",")
        return StridedShard(int(d), int(k))
    if t.startswith("S("):
        return Shard(int(inner))
    if t.startswith("NormP("):
        return NormPartial(float(inner))
    if t.startswith("P("):
        return Partial(inner or "sum")
    raise ShardingError(f"explain: placement {text!r} not understood; {SPEC_HELP}")


def parse_placements(text: str) -> tuple[Placement, ...]:
    compact = text.replace(" ", "")
    tokens = _PLACEMENT_RE.findall(compact)
    if ",".join(tokens) != compact:
        raise ShardingError(f"explain: placements {text!r} not understood; {SPEC_HELP}")
    return tuple(parse_placement(t) for t in tokens)


def parse_spec(text: str | TensorSpec, mesh: DeviceMesh, what: str = "tensor") -> TensorSpec:
    """A TensorSpec from "f32[8,4096]:R,S(1)" (no placements: Replicate everywhere)."""
    if isinstance(text, TensorSpec):
        if text.mesh.shape != mesh.shape:
            raise ShardingError(
                f"explain: {what} lives on a mesh of shape {text.mesh.shape}, the others on {mesh.shape}"
            )
        return text
    m = SPEC_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ShardingError(f"explain: {what} = {text!r} is not a tensor spec; {SPEC_HELP}")
    dtype = DTYPES.get(m["dtype"].lower())
    if dtype is None:
        raise ShardingError(
            f"explain: {what}: unknown dtype {m['dtype']!r}; use one of f16, bf16, f32, f64, i32, i64, bool, ..."
        )
    shape = tuple(int(s) for s in m["shape"].split(",") if s.strip())
    raw = m["placements"]
    placements = parse_placements(raw) if raw and raw.strip() else (R,) * mesh.ndim
    placements = normalize_placements(placements, len(shape), mesh.ndim, f"explain: {what} = {text!r}")
    return TensorSpec(mesh, placements, TensorMeta(shape, contiguous_stride(shape), dtype))


def spec_text(spec: TensorSpec) -> str:
    return f"{dtype_name(spec.dtype)}[{','.join(map(str, spec.shape))}]:{','.join(map(repr, spec.placements))}"


def parse_mesh(mesh: Any) -> DeviceMesh:
    """A planning-only mesh from 4096, (8, 8, 16), "8x8x16" or a DeviceMesh (no world needed)."""
    if isinstance(mesh, DeviceMesh):
        return mesh
    if mesh is None:
        raise ShardingError("explain: give the mesh, e.g. mesh=(2, 2) or --mesh 8x8x16")
    shape = parse_mesh_shape(mesh, "explain")
    return DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(shape))


def parse_links(links: Any, mesh_ndim: int) -> tuple[cost.Link, ...]:
    """Per-mesh-dim links: None (the runtime's current model), "nvlink,ib,ib", a preset, a Link, or a list."""
    if isinstance(links, str) and "," in links:
        links = [s.strip() for s in links.split(",")]
    return cost.resolve_links(links, mesh_ndim)


def link_names(links: Sequence[cost.Link]) -> list[str]:
    by_value = {v: k for k, v in reversed(list(cost.PRESETS.items()))}
    return [by_value.get(link, repr(link)) for link in links]
