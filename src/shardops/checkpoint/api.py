"""`shardops.checkpoint.save(state, path)` / `load(state, path)`: torch's DCP format, both worlds.

`state` maps names to tensors (DTensors or plain), nested state dicts, plain Python
values, or objects with `state_dict()` / `load_state_dict()` (modules, optimizers,
`RandomState`, a trainer's own object: DCP's `Stateful` idea).

The steps are DCP's own (torch's planner and file writer, the same files torch's
`dcp.load` and `dcp_to_torch_save` read); the coordination between ranks (gather the
local plans, hand out the global plan, gather the write results) runs over shardops'
communicator (`exchange`), so it works inside `so.run` as under torchrun.

Saving is atomic: the ranks write into a fresh sibling directory, and only after every
rank has written and the metadata is on disk does rank 0 swap it into `path`; a rank
dying mid-save leaves the previous checkpoint at `path` untouched. Each file's block
checksums go into a side file torch's readers ignore (`blocksums`). Loading reads only
the byte ranges each rank needs (`reader.RangedFileSystemReader`), checks every byte it
reads against those checksums, and fails on any mismatch or any element left unloaded
(`planner.CheckedLoadPlanner`).
"""

from __future__ import annotations

import glob
import os
import shutil
import threading
import uuid
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

from ..errors import ShardingError
from ..world import current_comm
from . import blocksums
from .blocksums import FileSums, sum_file, write_sums
from .chunks import coordinated_save
from .exchange import agree, agree_local, broadcast_object
from .planner import CheckedLoadPlanner
from .reader import DEFAULT_BUFFER_BYTES, RangedFileSystemReader

_SAVING = ".saving-"
_REPLACED = ".replaced-"
# torch's DCP planners flip a module global while planning (`_version._derived_version`, when the
# checkpoint holds keys the state dict does not: each rank's RandomState entry): rank threads of
# one process plan one at a time. No collective runs under it (pending tensors resolve first).
_PLANNING = threading.Lock()


# ------------------------------------------------------------------ state <-> state dicts


def _is_stateful(obj: Any) -> bool:
    return (
        callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
        and not isinstance(obj, torch.Tensor)
    )


def _owner(opt: torch.optim.Optimizer, state: Mapping[str, Any]) -> torch.nn.Module | None:
    """The module in `state` that holds every parameter of `opt` (its keys then follow torch's FQN convention)."""
    wanted = {id(p) for g in opt.param_groups for p in g["params"]}
    for obj in state.values():
        if isinstance(obj, torch.nn.Module) and wanted <= {id(p) for p in obj.parameters()}:
            return obj
    return None


def _save_view(state: Mapping[str, Any]) -> dict[str, Any]:
    """What gets saved for each name: torch's get_model_state_dict / get_optimizer_state_dict conventions
    (FQN keys) for modules and their optimizers, `state_dict()` for other stateful objects."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if not isinstance(state, Mapping):
        raise ShardingError(
            "checkpoint.save: state must map names to tensors, state dicts or objects with state_dict(); got "
            f"{type(state).__name__}"
        )
    out: dict[str, Any] = {}
    for name, obj in state.items():
        owner = _owner(obj, state) if isinstance(obj, torch.optim.Optimizer) else None
        if owner is not None:
            out[name] = get_optimizer_state_dict(owner, obj)
        elif isinstance(obj, torch.nn.Module):
            out[name] = get_model_state_dict(obj)
        else:
            out[name] = obj.state_dict() if _is_stateful(obj) else obj
    return out


def _load_view(state: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(state, Mapping):
        raise ShardingError(
            "checkpoint.load: state must map names to tensors, state dicts or objects with load_state_dict(); got "
            f"{type(state).__name__}"
        )
    for obj in state.values():
        if isinstance(obj, torch.optim.Optimizer):
            init_optimizer_state(obj)  # an optimizer that never stepped gets state to load into
    return _save_view(state)


def _restore(state: MutableMapping[str, Any], targets: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    for name, obj in state.items():
        owner = _owner(obj, state) if isinstance(obj, torch.optim.Optimizer) else None
        if owner is not None:
            set_optimizer_state_dict(owner, obj, targets[name])
        elif isinstance(obj, torch.nn.Module):
            set_model_state_dict(obj, targets[name])
        elif _is_stateful(obj):
            obj.load_state_dict(targets[name])
        elif not isinstance(obj, torch.Tensor) and targets[name] is not obj:
            state[name] = targets[name]  # a plain top-level value (an int, a string) comes back here


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create the state of an optimizer that has not stepped, so that there is something to load into.

    As torch's `set_optimizer_state_dict` does: one step with zero gradients and learning
    rate 0 (parameters unchanged), then the gradients are dropped again.
    """
    if opt.state:
        return
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        raise ShardingError(
            "checkpoint.load: the optimizer has no state yet but its parameters hold gradients; call "
            "zero_grad(set_to_none=True) first"
        )
    saved_lrs = [g["lr"] for g in opt.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        for g in opt.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, saved_lrs):
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)


# ------------------------------------------------------------------ paths: atomic replace


def _commit(staging: str, path: str) -> str | None:
    """Swap the finished `staging` directory into `path` (rank 0, after every rank has written);
    returns where the previous checkpoint went (removed once the swap is durable)."""
    replaced = None
    if os.path.exists(path):
        replaced = f"{path}{_REPLACED}{uuid.uuid4().hex[:8]}"
        os.rename(path, replaced)
    os.rename(staging, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    return replaced


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _directory(path: str | os.PathLike) -> str:
    """`path` without a trailing separator: the staging and set-aside names are its siblings."""
    path = os.path.normpath(os.fspath(path))
    if os.path.basename(path) in ("", ".", ".."):
        path = os.path.abspath(path)  # "." or "..": siblings need a real name
    return path


def checkpoint_dir(path: str | os.PathLike) -> str:
    """The directory to read for `path`: itself, or the previous checkpoint a crash mid-commit left aside."""
    path = _directory(path)
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    aside = sorted(glob.glob(glob.escape(path) + _REPLACED + "*"), key=os.path.getmtime)
    for candidate in reversed(aside):
        if os.path.exists(os.path.join(candidate, ".metadata")):
            return candidate
    if os.path.isdir(path):
        raise ShardingError(
            f"checkpoint.load: {path} holds no finished checkpoint (no .metadata); a save into it never completed"
        )
    raise ShardingError(f"checkpoint.load: no checkpoint at {path}")


# ------------------------------------------------------------------ the DCP steps, coordinated by shardops


def _resolve_pending_tensors(obj: Any) -> None:
    """Resolve every pending (Partial) DTensor in a state dict first: a collective, on every rank."""
    from .chunks import resolve_pending

    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "_spec"):
            resolve_pending(obj, "checkpoint")
    elif isinstance(obj, Mapping):
        for value in obj.values():
            _resolve_pending_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _resolve_pending_tensors(value)


def save_state_dict(state_dict: dict[str, Any], directory: str) -> None:
    """DCP's save steps for `state_dict` into `directory`, every rank of the current world taking part."""
    rank = current_comm().rank
    coordinator = rank == 0
    writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True, overwrite=True)
    planner = DefaultSavePlanner()

    def local_plan():
        _resolve_pending_tensors(state_dict)
        with _PLANNING, coordinated_save():
            writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
            planner.set_up_planner(state_dict, writer.storage_meta(), coordinator)
            return writer.prepare_local_plan(planner.create_local_plan())

    local_plans = agree("checkpoint save (local plan)", local_plan)

    def global_plan():
        if not coordinator:
            return None
        plans, metadata = planner.create_global_plan(local_plans)
        return writer.prepare_global_plan(plans), metadata

    plans, metadata = agree("checkpoint save (global plan)", global_plan)[0]  # every rank has the coordinator's
    block = blocksums.BLOCK_BYTES
    written = agree("checkpoint save (writing)", lambda: _write_and_sum(writer, planner, plans[rank], directory, block))
    results = [r for r, _ in written]
    sums = {name: s for _, per_rank in written for name, s in per_rank.items()}
    agree_local(
        "checkpoint save (metadata)",
        lambda: _finish(writer, metadata, results, sums, directory, block) if coordinator else None,
    )


def _write_and_sum(
    writer: FileSystemWriter, planner: DefaultSavePlanner, plan: Any, directory: str, block: int
) -> tuple[list[Any], dict[str, FileSums]]:
    """This rank's write results and the block sums of the files it wrote."""
    results = writer.write_data(planner.finish_plan(plan), planner).wait()
    files = sorted({r.storage_data.relative_path for r in results})
    return results, {name: sum_file(os.path.join(directory, name), block) for name in files}


def _finish(
    writer: FileSystemWriter, metadata: Any, results: list[Any], sums: dict[str, FileSums], directory: str, block: int
) -> None:
    """The coordinator's last step: torch's .metadata, then the block sums of every file (itself included)."""
    writer.finish(metadata, results)
    sums = {**sums, ".metadata": sum_file(os.path.join(directory, ".metadata"), block)}
    write_sums(directory, sums, block)


def load_state_dict(
    state_dict: dict[str, Any], directory: str, buffer_bytes: int = DEFAULT_BUFFER_BYTES, verify: bool | str = True
) -> RangedFileSystemReader:
    """DCP's load steps into `state_dict` (in place), every rank of the current world taking part."""
    rank = current_comm().rank
    coordinator = rank == 0
    reader = RangedFileSystemReader(directory, buffer_bytes=buffer_bytes, verify=verify)
    planner = CheckedLoadPlanner()

    def local_plan():
        _resolve_pending_tensors(state_dict)
        metadata = reader.read_metadata()
        with _PLANNING:
            reader.set_up_storage_reader(metadata, coordinator, rank=rank, use_collectives=True)
            planner.set_up_planner(state_dict, metadata, coordinator)
            return reader.prepare_local_plan(planner.create_local_plan())

    local_plans = agree("checkpoint load (local plan)", local_plan)
    plans = broadcast_object(
        agree_local(
            "checkpoint load (global plan)",
            lambda: reader.prepare_global_plan(planner.create_global_plan(local_plans)) if coordinator else None,
        )
    )
    agree_local("checkpoint load (reading)", lambda: reader.read_data(planner.finish_plan(plans[rank]), planner).wait())
    return reader


# ------------------------------------------------------------------ public entry points


def save(state: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Save `state` to the directory `path` in torch's DCP format, atomically (see module doc)."""
    path = _directory(path)
    state_dict = _save_view(state)
    staging = broadcast_object(f"{path}{_SAVING}{uuid.uuid4().hex[:12]}" if current_comm().rank == 0 else None)
    try:
        save_state_dict(state_dict, staging)
        replaced = agree_local(
            "checkpoint save (commit)", lambda: _commit(staging, path) if current_comm().rank == 0 else None
        )
    except BaseException:
        if current_comm().rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)  # the other ranks are already on their way


def load(
    state: MutableMapping[str, Any],
    path: str | os.PathLike,
    *,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    verify: bool | str = True,
) -> None:
    """Load the checkpoint at `path` into `state` in place: tensors are filled, stateful objects get
    `load_state_dict`, plain values are replaced in `state` (and inside nested dicts).

    `buffer_bytes` bounds each rank's read buffer; `verify` picks the checksum checks (see
    `reader`): by default every byte read is checked against the checkpoint's block checksums
    (or, for a checkpoint saved without them, each saved box read from against its archive's)."""
    directory = checkpoint_dir(path)
    targets = _load_view(state)
    load_state_dict(targets, directory, buffer_bytes, verify)
    _restore(state, targets)
