"""`replicate`: torch's composable DDP (`torch.distributed._composable.replicate`) on shardops.

Parameters stay what they are (plain tensors, or a tensor-parallel plan's DTensors on the tp
sub-mesh): forward runs on local tensors with the local batch. At `replicate` time every
parameter takes the data mesh's first rank's values (one broadcast of a flat buffer, as DDP's
init sync). During backward each parameter's gradient lands in a bucket (reverse parameter
order, by dtype, a bucket closed once it holds `bucket_cap_mb`); a complete bucket's all_reduce
(one, of the bucket's flat buffer) starts at once and runs while backward goes on (the
torch.distributed world's asynchronous collectives; the threads world completes it on the
spot), ⌈Ψ·itemsize / cap⌉ all_reduces per step when the parameters fill the buckets evenly,
logical bytes Ψ·itemsize. Each gradient is divided by the data-parallel size while it is copied
into the bucket and becomes a view of the bucket at once (DDP's `gradient_as_bucket_view`): one
pass over the gradients in all, nothing copied back, and the gradients autograd made are freed
as their bucket starts. The end of backward starts any bucket a parameter without a gradient
left open (as zeros) and waits for every bucket.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from .._torch.autograd import queue_end_of_backward
from ..comm import traceable
from ..comm.base import CollectiveWork
from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..spec import TensorMeta, TensorSpec
from ..tensor import DTensor
from ..wrapping import local_of, shard_in, spec_of, wrap
from ._presharded import divide_gradient, sharded_over
from .fully_shard import _data_mesh

# DDP keywords that mean nothing for shardops' synchronous CPU collectives; accepted for torch's signature
_ACCEPTED = {
    "device_ids",
    "device_id",
    "output_device",
    "dim",
    "broadcast_buffers",
    "init_sync",
    "process_group",
    "find_unused_parameters",
    "check_reduction",
    "gradient_as_bucket_view",
    "static_graph",
    "delay_all_reduce_named_params",
    "param_to_hook_all_reduce",
    "mixed_precision",
    "skip_all_reduce_unused_params",
}
STATE_ATTR = "_shardops_replicate_state"


class _Bucket:
    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.numels = [_local_numel(p) for p in params]
        self.ready = 0
        self.flat: torch.Tensor | None = None  # the started all_reduce's buffer, the gradients' storage
        self.work: CollectiveWork | None = None  # the bucket's all_reduce, started and not yet waited for


class ReplicateState:
    def __init__(self, params: list[nn.Parameter], mesh: DeviceMesh, bucket_bytes: int) -> None:
        self.mesh = mesh
        self.group = mesh.group(tuple(range(mesh.ndim)))
        self.buckets = _buckets(params, bucket_bytes)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.callback_queued = False
        self.requires_gradient_sync = True  # False: gradients accumulate locally (a pipeline's micro-batches)
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    # Hooks of the autograd engine, also under a backward called from compiled code: dynamo's frame hook
    # must not compile them (a compiled _start failed building guards on the bucket's DTensor gradients).
    @traceable.eager_only
    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.requires_gradient_sync:
            return
        if not self.callback_queued:
            self.callback_queued = True
            queue_end_of_backward(self._finish)
        bucket = self.bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._start(bucket)

    @traceable.eager_only
    def _finish(self) -> None:
        """End of backward: start the buckets a parameter without a gradient left open, then wait
        for every bucket's all_reduce (in the order they started)."""
        self.callback_queued = False
        for bucket in self.buckets:
            if 0 < bucket.ready <= len(bucket.params):
                self._start(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                self._wait(bucket)
            bucket.ready = 0

    def _start(self, bucket: _Bucket) -> None:
        """The bucket's gradients, divided by the group size, in one flat buffer (one pass, as DDP
        divides while it copies into its bucket), all-reduced asynchronously: the backward of the
        earlier layers runs while it travels. Each gradient becomes its view of the buffer now, so
        the one autograd made is freed and nothing is copied back; read it after backward."""
        grads = [_local_grad(p) for p in bucket.params]
        sample = next(g for g in grads if g is not None)  # the bucket's last gradient started it
        flat = torch.empty(sum(bucket.numels), dtype=sample.dtype, device=sample.device)
        for g, out in zip(grads, flat.split(bucket.numels)):
            if g is None:
                out.zero_()  # a parameter without a gradient this step: it still travels (as DDP's)
            else:
                torch.div(g, self.group.size, out=out.view(g.shape))
        bucket.flat = flat
        bucket.work = self.mesh.comm.all_reduce_async(flat, "sum", self.group)
        bucket.ready = len(bucket.params) + 1  # started: the end of backward only waits for it
        for p, g, view in zip(bucket.params, grads, flat.split(bucket.numels)):
            if g is not None:
                _set_grad(p, view)

    def _wait(self, bucket: _Bucket) -> None:
        assert bucket.work is not None and bucket.flat is not None  # started by the bucket's last gradient
        total = bucket.work.wait()
        if total is not bucket.flat:  # a world that returns the sum in a new tensor (threads)
            bucket.flat.copy_(total)
        bucket.work = bucket.flat = None


def _buckets(params: list[nn.Parameter], cap: int) -> list[_Bucket]:
    """DDP's assignment: reverse parameter order (about the order backward makes gradients), per
    dtype, a bucket closed as soon as it holds `cap` bytes."""
    out: list[_Bucket] = []
    open_: dict[torch.dtype, tuple[list, int]] = {}
    for p in reversed(params):
        members, size = open_.get(p.dtype, ([], 0))
        members.append(p)
        size += _local_numel(p) * p.element_size()
        if size >= cap:
            out.append(_Bucket(members))
            members, size = [], 0
        open_[p.dtype] = (members, size)
    out.extend(_Bucket(members) for members, _ in open_.values() if members)
    return out


def _local_numel(p: torch.Tensor) -> int:
    return local_of(p).numel() if isinstance(p, DTensor) else p.numel()


def _local_grad(p: torch.Tensor) -> torch.Tensor | None:
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor):
        return shard_in(g, spec_of(p).placements)
    return g


def _set_grad(p: torch.Tensor, flat: torch.Tensor) -> None:
    """`p`'s gradient becomes `flat` (its slice of a bucket), in p's layout."""
    grad = p.grad
    assert grad is not None  # only parameters that had a gradient get one back
    if isinstance(p, DTensor):
        spec = spec_of(p)
        local = flat.view(local_of(p).shape)
        p.grad = wrap(
            local, TensorSpec(spec.mesh, spec.placements, TensorMeta(spec.shape, spec.meta.stride, grad.dtype))
        )
    else:
        p.grad = flat.view(p.shape)


def replicate(module: nn.Module, ignored_modules: Iterable[nn.Module] | None = None, **kwargs: Any) -> nn.Module:
    """Data-parallel `module` as torch's composable DDP: `device_mesh=` (default: every rank),
    `bucket_cap_mb=25`; the other DDP keywords are accepted. Parameters already sharded over the
    data mesh (expert parallelism's experts) are neither synced nor all-reduced, their gradients
    only averaged (_presharded)."""
    from .fully_shard import unit_of_any

    unknown = set(kwargs) - _ACCEPTED - {"device_mesh", "bucket_cap_mb"}
    if unknown:
        raise ShardingError(
            f"replicate: unknown keyword(s) {sorted(unknown)}; DDP's keywords are "
            f"{sorted(_ACCEPTED | {'device_mesh', 'bucket_cap_mb'})}"
        )
    if unit_of_any(module):
        raise ShardingError(
            "replicate: this module is already managed by fully_shard; use one of fully_shard or replicate"
        )
    if module.__dict__.get(STATE_ATTR) is not None:
        raise ShardingError("replicate: this module is already replicated")
    mesh = _data_mesh(kwargs.get("device_mesh"))
    ignored = {id(p) for m in (ignored_modules or ()) for p in m.parameters()}
    presharded = [p for p in module.parameters() if id(p) not in ignored and sharded_over(p, mesh)]
    for p in presharded:  # expert parallelism's experts: complete gradients, averaged like the others
        divide_gradient(p, lambda: float(mesh.size()))
    ignored |= set(map(id, presharded))
    params = [p for p in module.parameters() if id(p) not in ignored and p.requires_grad]
    if kwargs.get("init_sync", True):
        _sync_params([p for p in module.parameters() if id(p) not in ignored] + list(module.buffers()), mesh)
    cap = int(float(kwargs.get("bucket_cap_mb", 25)) * 1024 * 1024)
    module.__dict__[STATE_ATTR] = ReplicateState(params, mesh, cap)
    return module


def replicate_state(module: nn.Module) -> ReplicateState | None:
    """The state `replicate` gave `module` (None: not replicated)."""
    return module.__dict__.get(STATE_ATTR)


def _sync_params(params: list[torch.Tensor], mesh: DeviceMesh) -> None:
    """Every rank of the data mesh takes its first rank's parameters and buffers: one broadcast per dtype."""
    group = mesh.group(tuple(range(mesh.ndim)))
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(local_of(p) if isinstance(p, DTensor) else p.data)
    with torch.no_grad():
        for locals_ in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in locals_])
            flat = mesh.comm.broadcast(flat, 0, group)
            offset = 0
            for t in locals_:
                t.copy_(flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
