"""One `fully_shard` call's parameter group (a unit): ONE all_gather to unshard it, ONE
reduce_scatter (plus an all_reduce over the replicate dim under HSDP) for its gradients.

Collectives, per unit and step (d = shard dim size, Ψ_u = the unit's parameter count):

    all_gather       before forward; again before backward if it resharded after forward.
                     A flat buffer of this rank's shards; logical bytes: the rank's own
                     (unpadded) shards; on the wire every member sends the largest member's
                     total (member 0's: torch.chunk gives the first ranks the larger pieces),
                     which is FSDP2's padded flat buffer.
    reduce_scatter   in the unit's post-backward: member r's chunk is the concatenation of
                     every gradient's rows for r, in reduce_dtype; logical bytes Ψ_u·itemsize
                     (the whole unpadded input), wire d × the largest chunk. The sum is
                     divided by the data-parallel size (or set_gradient_divide_factor's factor).

A prefetch (set_modules_to_forward_prefetch / _backward_prefetch) starts a unit's all_gather
early; in the torch.distributed world it travels while other units compute (the threads world
completes it when it starts). The reduce_scatter's wire buffer is packed once, straight from
the gradients (`_pack`), and handed to the communicator, which frees it once sent.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..comm.base import CollectiveWork
from ..errors import ShardingError
from ._param import DataMesh, FSDPParam
from .api import MixedPrecisionPolicy


class FSDPUnit:
    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        params: list[FSDPParam],
        data: DataMesh,
        mp: MixedPrecisionPolicy,
        reshard_after_forward: bool | None,
    ) -> None:
        self.modules = modules
        self.params = params
        self.data = data
        self.mp = mp
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ShardingError(
                f"fully_shard: one unit's parameters have several dtypes {sorted(map(str, dtypes))}; FSDP gathers a "
                "unit in one flat buffer: give them one dtype, or MixedPrecisionPolicy(param_dtype=...), or shard "
                "them in separate units"
            )
        self.param_dtype = dtypes.pop() if dtypes else None
        self.reduce_dtype = mp.reduce_dtype or self.param_dtype
        self.reshard_after_forward = reshard_after_forward  # None until the root is known
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.divide_factor: float | None = None
        self.is_last_backward = True
        self.forward_prefetch: list = []
        self.backward_prefetch: list = []
        self.is_unsharded = False
        self.gathering: CollectiveWork | None = None  # a started all_gather (prefetch) not yet written out
        self.pending_backward = False
        self.forwards_in_pass = 0
        self.inputs_pending = 0  # post-backward functions of this forward whose backward has not run yet
        # the RootState of the model this unit runs in (set at the root's first forward); Any: _state.py imports this
        self.root: Any = None

    # -- parameters
    def start_unshard(self) -> None:
        """Start the unit's one all_gather (asynchronous in the torch.distributed world: a prefetch
        travels while other units compute); `unshard` finishes it."""
        if self.is_unsharded or self.gathering is not None or not self.params:
            return
        for p in self.params:
            p.refresh_sharded()
        flat = torch.cat([p.gather_input() for p in self.params])
        sizes = [sum(p.member_numels[r] for p in self.params) for r in range(self.data.shard_size)]
        self.gathering = self.data.mesh.comm.all_gather_async(flat, self.data.shard_group, [(n,) for n in sizes])

    def unshard(self) -> None:
        if self.is_unsharded or not self.params:
            self.is_unsharded = True
            return
        self.start_unshard()
        assert self.gathering is not None  # start_unshard started it
        pieces = self.gathering.wait()
        buffers = [p.alloc() for p in self.params]
        for member, piece in enumerate(pieces):
            offset = 0
            for p, buffer in zip(self.params, buffers):
                n = p.member_numels[member]
                p.write_member(buffer, member, piece[offset : offset + n])
                offset += n
        del pieces
        self.gathering.release()  # the wire's memory goes now, not whenever the backend's thread lets go
        self.gathering = None
        for p in self.params:
            p.swap_in(unsharded=True)
        self.is_unsharded = True

    def reshard(self) -> None:
        if self.gathering is not None:  # a prefetch nothing used: completed (every member sent), dropped
            self.gathering.release()
            self.gathering = None
        if not self.is_unsharded:
            return
        for p in self.params:
            p.swap_in(unsharded=False)
            p.free()
        self.is_unsharded = False

    # -- gradients
    def holds_unsharded_grads(self) -> bool:
        """A backward left gradients on the unsharded parameters that no post-backward reduced yet."""
        return any(p.unsharded is not None and p.unsharded.grad is not None for p in self.params)

    def take_gradients(self) -> list[tuple[FSDPParam, torch.Tensor]]:
        """The unsharded gradients to reduce, taken off the unsharded parameters (reduce_dtype).
        Unsynced: they are kept (accumulated) instead, and nothing is returned."""
        dtype = self.reduce_dtype
        if dtype is None:  # no parameters (a unit's dtypes are its parameters')
            return []
        if not self.requires_gradient_sync:
            for p in self.params:
                p.accumulate(dtype)
            return []
        return [(p, g) for p in self.params if (g := p.take_unsharded_grad(dtype)) is not None]

    def reduce_gradients(self, grads: list[tuple[FSDPParam, torch.Tensor]]) -> None:
        """One reduce_scatter of `grads` (emptied as soon as they are packed: their memory goes
        before the collective's), then the sharded parameters' .grad. Waited at once: left in
        flight while the next unit's backward computes, its buffers would raise the peak above
        torch fully_shard's."""
        if not grads:
            return
        chunks = self._pack(grads)
        params = [p for p, _ in grads]
        grads.clear()
        work = self.data.mesh.comm.reduce_scatter_async(chunks, "sum", self.data.shard_group)
        del chunks  # handed over: the communicator frees the wire once sent
        self._set_reduced(params, work.wait())

    def _pack(self, grads: list[tuple[FSDPParam, torch.Tensor]]) -> list[torch.Tensor]:
        """Member r's chunk (every gradient's rows for r, concatenated) written straight into row
        pg(r) of one (d, largest chunk) buffer: the reduce_scatter's wire as it is (comm/wire.py),
        no second copy. Row order is the process group's (the identity where it is unknown)."""
        d = self.data.shard_size
        lengths = [sum(p.member_numels[r] for p, _ in grads) for r in range(d)]
        order = self._wire_order()
        width = max(lengths)
        buffer = grads[0][1].new_empty((d, width))
        chunks = []
        for r in range(d):
            row = buffer[order[r], : lengths[r]]
            offset = 0
            for p, g in grads:
                piece = p.grad_chunk(g, r)
                row[offset : offset + piece.numel()].copy_(piece)
                offset += piece.numel()
            chunks.append(row)
        return chunks

    def _wire_order(self) -> tuple[int, ...]:
        comm, group = self.data.mesh.comm, self.data.shard_group
        named = comm.functional_group(group, "reduce_scatter")  # (process group, its rank of each member)
        return tuple(named[1]) if named else tuple(range(group.size))

    def _set_reduced(self, params: list[FSDPParam], out: torch.Tensor) -> None:
        """Under HSDP one all_reduce over the replicate dim; divided; the sharded parameters' .grad."""
        if self.data.replicate_group is not None:
            out = self.data.mesh.comm.all_reduce(out, "sum", self.data.replicate_group)
        factor = self.divide_factor if self.divide_factor is not None else float(self.data.size)
        if factor != 1:
            out.div_(factor)  # the collective's own fresh result
        me = self.data.shard_rank
        offset = 0
        for p in params:
            n = p.member_numels[me]
            p.set_sharded_grad(out[offset : offset + n])
            offset += n
