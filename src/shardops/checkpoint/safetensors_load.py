"""Load `safetensors` files (what transformers saves) into a parallelized model, each rank reading
only its own slices.

safetensors files can be sliced without reading the rest (`safe_open(...).get_slice(name)[...]`
reads the requested region of the memory-mapped file), so a model larger than one rank's
memory loads: every rank asks, per tensor, for the boxes of its own shard (`chunks`) and
copies them into its local tensor. Plain (replicated) tensors are read whole.

Accepts one file, several, or a directory holding them (with transformers'
`model.safetensors.index.json` or not). `key_map` renames this model's keys to the
file's (e.g. a prefix). Shapes must match (a mismatch names the key and both shapes);
dtypes are cast as `load_state_dict` casts.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ShardingError
from ..tensor import DTensor
from ..wrapping import local_of
from .chunks import boxes_of, resolve_pending


@dataclass
class SafetensorsLoad:
    """What `load_safetensors` did on this rank."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # keys of the model the files do not hold
    unexpected: list[str] = field(default_factory=list)  # keys of the files the model does not hold
    bytes_read: int = 0  # bytes of the slices this rank read


def _files(source: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    if isinstance(source, (str, os.PathLike)):
        source = os.fspath(source)
        if os.path.isdir(source):
            index = os.path.join(source, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    names = sorted(set(json.load(f)["weight_map"].values()))
                return [os.path.join(source, n) for n in names]
            found = sorted(glob.glob(os.path.join(source, "*.safetensors")))
            if not found:
                raise ShardingError(f"load_safetensors: no .safetensors file in {source}")
            return found
        return [source]
    return [os.fspath(s) for s in source]


def load_safetensors(
    target: torch.nn.Module | Mapping[str, torch.Tensor],
    source: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    strict: bool = True,
    key_map: Callable[[str], str] | None = None,
) -> SafetensorsLoad:
    """Fill `target` (a module, or a state dict of tensors/DTensors, in place) from safetensors files."""
    from safetensors import safe_open

    state = target.state_dict() if isinstance(target, torch.nn.Module) else target
    report = SafetensorsLoad()
    with ExitStack() as stack:
        where: dict[str, Any] = {}
        for path in _files(source):
            f = stack.enter_context(safe_open(path, framework="pt"))
            for key in f.keys():
                where[key] = f
        wanted = {}
        for name, dst in state.items():
            key = key_map(name) if key_map is not None else name
            if key not in where:
                report.missing.append(name)
                continue
            wanted[key] = name
            report.bytes_read += _load_one(where[key], key, name, dst)
            report.loaded.append(name)
        report.unexpected = sorted(k for k in where if k not in wanted)
    if strict and (report.missing or report.unexpected):
        raise ShardingError(
            f"load_safetensors: missing keys {report.missing[:10]}{'...' if len(report.missing) > 10 else ''}, "
            f"unexpected keys {report.unexpected[:10]}{'...' if len(report.unexpected) > 10 else ''}; "
            "pass key_map= to rename, or strict=False to load what matches"
        )
    return report


def _load_one(f: Any, key: str, name: str, dst: torch.Tensor) -> int:
    sl = f.get_slice(key)
    shape = tuple(sl.get_shape())
    if shape != tuple(dst.shape):
        raise ShardingError(
            f"load_safetensors: {name!r} is {list(shape)} in the file ({key!r}) but {list(dst.shape)} in the model"
        )
    with torch.no_grad():
        if not isinstance(dst, DTensor):
            piece = f.get_tensor(key)
            dst.copy_(piece)
            return piece.nbytes
        resolve_pending(dst, f"load_safetensors of {name!r}")
        local = local_of(dst)
        total = 0
        for box in boxes_of(dst):
            piece = (
                sl[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))] if box.offsets else f.get_tensor(key)
            )
            box.narrow(local).copy_(piece)
            total += piece.nbytes
        return total
