"""The torch.distributed world: shardops collectives on torch process groups.

Works with any backend that implements the c10d collectives used here (gloo on
CPU, nccl on GPU, `fake` for dry runs). Two facts shape the code:

- Uneven sizes. c10d's single-tensor collectives need equal sizes per rank, so
  all_gather and reduce_scatter pad every member's flattened tensor to the
  largest member's numel on the wire and cut the padding off afterwards. All
  members know every size (the callers pass them), so no round is spent on
  sizes. all_to_all uses `all_to_all_single` with per-member split sizes
  instead: each rank only knows the sizes it sends and receives, not the
  global maximum a padded exchange would need.
- gloo's reduce_scatter is an all_reduce of the whole buffer. On gloo a
  reduce_scatter is therefore one all_to_all and a local reduction
  (`_exchange_rows`): half the bytes, one step instead of a ring.
- Group order. A shardops `Group` lists its ranks in mesh order; a torch
  process group numbers its members in its own order (sorted global ranks for
  groups made by `new_group`). Every result is put back in mesh order.

Data movement (all_gather, all_to_all, broadcast) ships raw bytes, so every
dtype travels, whatever the backend supports. Reductions ship a dtype the
backend can reduce: bool as uint8 (max = any, min = all), and `avg` as a sum
divided afterwards, the way `base.reduce_stack` does (floor division for
integers). A dtype/op pair the backends cannot reduce (int16, complex product,
...) is exchanged as bytes and reduced locally with `reduce_stack` (all_reduce:
an all_gather; reduce_scatter: an all_to_all): still one call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CollectiveError
from .base import (
    CollectiveWork,
    Communicator,
    Group,
    P2POp,
    P2PWork,
    free_storages,
    reduce_stack,
)
from .base import (
    natively_reducible as _natively_reducible,
)
from .wire import pack_padded

_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG, and none has a floor-dividing integer AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
# bool reduced as uint8 0/1: the bool sum of reduce_stack is a logical or.
_BOOL_OPS = {"sum": "max", "avg": "max", "max": "max", "min": "min", "product": "min"}

# c10d renamed the single-tensor collectives in torch 2.13; the old names warn there.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _TorchGroup:
    """A resolved group: the process group and, per shardops group index, the member's torch group rank."""

    __slots__ = ("pg", "ranks", "pg_index", "identity", "_backends")

    def __init__(self, pg: Any, ranks: tuple[int, ...], pg_index: tuple[int, ...]) -> None:
        self.pg = pg
        self.ranks = ranks
        self.pg_index = pg_index
        self.identity = pg_index == tuple(range(len(pg_index)))
        self._backends: dict[str, str] = {}

    def backend_for(self, device: torch.device) -> str:
        """The backend that carries this group's collectives on `device`'s type ("gloo", "nccl", ...)."""
        name = self._backends.get(device.type)
        if name is None:
            full = str(dist.get_backend(self.pg))  # "gloo", or per device type: "cpu:gloo,cuda:nccl"
            by_device = dict(part.split(":", 1) for part in full.split(",") if ":" in part)
            name = self._backends[device.type] = by_device.get(device.type, full).lower()
        return name

    def exchanges_reduce_scatter(self, device: torch.device) -> bool:
        """gloo's reduce_scatter is an all_reduce of the whole buffer: there it is an exchange
        (_exchange_rows)."""
        return self.backend_for(device) == "gloo"

    def to_pg_order(self, items: Sequence[Any]) -> list[Any]:
        """`items` in shardops group order -> the same items in torch group-rank order."""
        if self.identity:
            return list(items)
        out: list[Any] = [None] * len(items)
        for i, item in enumerate(items):
            out[self.pg_index[i]] = item
        return out

    def from_pg_order(self, items: Sequence[Any]) -> list[Any]:
        """`items` in torch group-rank order -> shardops group order."""
        return list(items) if self.identity else [items[j] for j in self.pg_index]


class TorchDistCommunicator(Communicator):
    """Collectives of the current torch.distributed default process group's world."""

    def __init__(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise CollectiveError("TorchDistCommunicator needs an initialised torch.distributed process group")
        self._bind()

    def _bind(self) -> None:
        self._world_pg = dist.group.WORLD
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        self._groups: dict[tuple, _TorchGroup] = {}
        self._by_members: dict[tuple[int, ...], Any] = {}  # sorted ranks -> a process group over them

    def _check_world(self) -> None:
        # A destroyed and re-initialised default group invalidates every cached subgroup.
        if dist.group.WORLD is not self._world_pg:
            self._bind()

    @property
    def rank(self) -> int:  # type: ignore[override]
        self._check_world()
        return self._rank

    @property
    def world_size(self) -> int:  # type: ignore[override]
        self._check_world()
        return self._world_size

    # ------------------------------------------------------------ groups

    def process_group(self, group: Group) -> Any:
        """The torch ProcessGroup behind a shardops group (for interop and tests)."""
        return self._resolve(group).pg

    def _resolve(self, group: Group) -> _TorchGroup:
        self._check_world()
        cache_key = (group.ranks, group.key)
        resolved = self._groups.get(cache_key)
        if resolved is None:
            pg = self._find_process_group(group)
            members = dist.get_process_group_ranks(pg)
            if sorted(members) != sorted(group.ranks):
                raise CollectiveError(
                    f"the torch process group for ranks {list(group.ranks)} has members {members}; "
                    "the shardops mesh and its torch DeviceMesh disagree"
                )
            self._by_members.setdefault(tuple(sorted(members)), pg)
            resolved = _TorchGroup(pg, group.ranks, tuple(members.index(r) for r in group.ranks))
            self._groups[cache_key] = resolved
        return resolved

    def adopt_process_group(self, pg: Any) -> Group:
        """The shardops Group of a torch process group's members (in its rank order), resolved to that group."""
        members = tuple(dist.get_process_group_ranks(pg))
        self._check_world()
        self._by_members.setdefault(tuple(sorted(members)), pg)
        return Group(members)

    def functional_group(self, group: Group, kind: str = "all_reduce") -> tuple[str, tuple[int, ...]] | None:
        resolved = self._resolve(group)
        return resolved.pg.group_name, resolved.pg_index

    def _find_process_group(self, group: Group) -> Any:
        if group.key:
            mesh, dims = group.key
            # Only a torch DeviceMesh that already exists: making one here would be a
            # collective of the whole world, inside a collective of one group.
            torch_mesh = getattr(mesh, "_torch_mesh", None)
            # Size-1 dims add no members: a group over one real dim is torch's own mesh-dim group.
            real_dims = [d for d in dims if mesh.shape[d] > 1]
            if torch_mesh is not None and len(real_dims) == 1:
                return torch_mesh.get_group(real_dims[0])
        members = tuple(sorted(group.ranks))
        if len(members) == self._world_size:
            return dist.group.WORLD
        pg = self._by_members.get(members)
        if pg is None:
            pg = self._new_group(members)
            self._by_members[members] = pg
        return pg

    @staticmethod
    def _new_group(members: tuple[int, ...]) -> Any:
        """A process group over `members` (several mesh dims, or a mesh without a torch DeviceMesh).

        NOTE: created with `use_local_synchronization=True`, so only the members
        take part: exactly the ranks about to run the collective that asked for
        it. A plain `new_group` (or torch's `DeviceMesh._flatten`) needs every
        rank of the world to call it in the same order, which a first use
        inside one group's collective cannot promise.
        """
        try:
            return dist.new_group(
                list(members), use_local_synchronization=True, group_desc="shardops_" + "_".join(map(str, members))
            )
        except (RuntimeError, dist.DistError) as e:  # a member gone or late: c10d's store times out
            raise CollectiveError(
                f"making the process group over ranks {list(members)} (first use of this group) failed in "
                f"torch.distributed: {e}. A member is gone, or did not reach this collective within the timeout."
            ) from e

    def exchanges_reduce_scatter(self, group: Group, device: torch.device) -> bool:
        return self._resolve(group).exchanges_reduce_scatter(device)

    # ------------------------------------------------------------ collectives

    def _all_reduce(self, t: torch.Tensor, op: str, group: Group) -> torch.Tensor:
        g = self._resolve(group)
        if not _natively_reducible(t.dtype, op):
            return reduce_stack(self._gather_bytes_equal(t, g), op)
        wire, finish = _to_wire(t, op, group.size)
        _c10d("all_reduce", g, dist.all_reduce, wire, op=_wire_op(t.dtype, op))
        return finish(wire)

    def _all_reduce_async(self, t: torch.Tensor, op: str, group: Group) -> CollectiveWork:
        """c10d's all_reduce with async_op=True: the backend's threads run it (gloo: its worker
        threads), this rank's thread goes on computing until `wait()`."""
        g = self._resolve(group)
        if not _natively_reducible(t.dtype, op):
            return super()._all_reduce_async(t, op, group)
        # the caller handed `t` over: reduced in place where it travels as it is (no private copy)
        wire, finish = (t, lambda w: w) if _travels_as_is(t, op) else _to_wire(t, op, group.size)
        wait = _c10d_start("all_reduce", g, dist.all_reduce, wire, op=_wire_op(t.dtype, op))
        return CollectiveWork(lambda: (wait(), finish(wire))[1])

    def _all_gather(self, t: torch.Tensor, group: Group, shapes: Sequence[tuple]) -> list[torch.Tensor]:
        return self._all_gather_async(t, group, shapes).wait()

    def _all_gather_async(self, t: torch.Tensor, group: Group, shapes: Sequence[tuple]) -> CollectiveWork:
        """The work's buffers: the input handed over and the gathered rows' (release() frees both)."""
        g = self._resolve(group)
        numels = [math.prod(s) for s in shapes]
        rows, wire = self._start_all_gather_padded(_bytes_of(t), g, [n * t.element_size() for n in numels])
        return CollectiveWork(
            lambda: [_from_bytes(row, t.dtype, s) for row, s in zip(rows(), shapes)], buffers=[t, *wire]
        )

    def _reduce_scatter_async(self, chunks: Sequence[torch.Tensor], op: str, group: Group) -> CollectiveWork:
        """Started on the backend's threads; waited, it frees the wire buffers and the chunks (handed
        over): the result is a new tensor."""
        return CollectiveWork(self._start_reduce_scatter(chunks, op, group, handed_over=True))

    def _start_reduce_scatter(
        self, chunks: Sequence[torch.Tensor], op: str, group: Group, handed_over: bool
    ) -> Callable[[], torch.Tensor]:
        """The reduce_scatter started: the exchange (`_exchange_rows`: gloo, and what a backend cannot
        reduce) or the native collective; returns the wait, which returns this member's reduced chunk.
        `handed_over`: the wait frees the chunks and the wire buffers (the caller reads neither again)."""
        g = self._resolve(group)
        mine = chunks[group.index(self.rank)]
        dtype = _common_dtype(chunks, "reduce_scatter")
        packed = pack_padded(chunks, g.pg_index)
        if g.exchanges_reduce_scatter(mine.device) or not _natively_reducible(dtype, op):
            send = _bytes_of(packed)
            recv = torch.empty_like(send)
            done = _c10d_start("reduce_scatter", g, dist.all_to_all_single, recv, send)

            def exchanged() -> torch.Tensor:
                done()
                out = _reduce_rows(_exchange_rows(recv, len(chunks), mine, g), op)
                if handed_over:
                    free_storages([*chunks, packed, recv])
                return out

            return exchanged
        wire, finish = _to_wire(packed, op, group.size)
        out = wire.new_empty((wire.shape[0] // group.size, *wire.shape[1:]))  # complex travels as (width, 2) reals
        done = _c10d_start("reduce_scatter", g, _reduce_scatter_single, out, wire, op=_wire_op(dtype, op))

        def reduced() -> torch.Tensor:
            done()
            if handed_over:
                free_storages([*chunks, packed, wire])
            return finish(out)[: mine.numel()].reshape(mine.shape)

        return reduced

    def _reduce_scatter(self, chunks: Sequence[torch.Tensor], op: str, group: Group) -> torch.Tensor:
        return self._start_reduce_scatter(chunks, op, group, handed_over=False)()

    def _all_to_all(
        self, chunks: Sequence[torch.Tensor], group: Group, recv_shapes: Sequence[tuple]
    ) -> list[torch.Tensor]:
        g = self._resolve(group)
        dtype = _common_dtype(chunks, "all_to_all")
        size = chunks[0].element_size()
        send = g.to_pg_order([_bytes_of(c) for c in chunks])
        recv_sizes = [math.prod(s) * size for s in recv_shapes]
        out_splits = g.to_pg_order(recv_sizes)
        out = torch.empty(sum(out_splits), dtype=torch.uint8, device=chunks[0].device)
        _c10d("all_to_all", g, dist.all_to_all_single, out, torch.cat(send), out_splits, [s.numel() for s in send])
        pieces = g.from_pg_order(list(torch.split(out, out_splits)))
        return [_from_bytes(p, dtype, s) for p, s in zip(pieces, recv_shapes)]

    def _broadcast(self, t: torch.Tensor, src_index: int, group: Group) -> torch.Tensor:
        g = self._resolve(group)
        out = t.clone()
        # `src` is a global rank; c10d maps it into the group.
        _c10d("broadcast", g, dist.broadcast, _bytes_of(out), src=group.ranks[src_index])
        return out

    def _barrier(self, group: Group) -> None:
        _c10d("barrier", self._resolve(group), dist.barrier)

    def _batch_isend_irecv(self, ops: list[P2POp]) -> list[P2PWork]:
        """c10d's batch_isend_irecv on the groups' process groups; peers are global ranks, as c10d takes them.
        Tensors travel as raw bytes, so every dtype does."""
        torch_ops, groups = [], []
        for p2p in ops:
            g = self._resolve(p2p.group if p2p.group is not None else self.world_group())
            groups.append(g)
            buf = _bytes_of(p2p.tensor.contiguous() if p2p.kind == "send" else p2p.tensor)
            torch_ops.append(
                dist.P2POp(dist.isend if p2p.kind == "send" else dist.irecv, buf, p2p.peer, group=g.pg, tag=p2p.tag)
            )
        try:
            started = dist.batch_isend_irecv(torch_ops)
        except RuntimeError as e:
            raise _collective_error("batch_isend_irecv", groups[0], e) from e
        keep = [op.tensor for op in torch_ops]  # the send buffers live until the works are waited for

        def wait_all() -> None:
            try:
                for work in started:
                    work.wait()
            except RuntimeError as e:
                raise _collective_error("batch_isend_irecv", groups[0], e) from e
            keep.clear()

        batch = P2PWork(wait_all)
        return [batch for _ in ops]

    # ------------------------------------------------------------ helpers

    def _all_gather_padded(self, payload: torch.Tensor, g: _TorchGroup, sizes: Sequence[int]) -> list[torch.Tensor]:
        """All members' 1-d uint8 payloads (member i's has sizes[i] bytes), in shardops order."""
        return self._start_all_gather_padded(payload, g, sizes)[0]()

    def _start_all_gather_padded(
        self, payload: torch.Tensor, g: _TorchGroup, sizes: Sequence[int]
    ) -> tuple[Callable[[], list[torch.Tensor]], list[torch.Tensor]]:
        """`_all_gather_padded` started asynchronously: returns the wait, which returns the rows, and the
        wire buffers (the padded payload, the output the rows are views of)."""
        width = max(sizes)
        if payload.numel() < width:
            padded = torch.zeros(width, dtype=torch.uint8, device=payload.device)
            padded[: payload.numel()] = payload
            payload = padded
        # gloo takes only the concatenated output form, not the stacked one
        out = torch.empty(len(sizes) * width, dtype=torch.uint8, device=payload.device)
        wait = _c10d_start("all_gather", g, _all_gather_single, out, payload)

        def rows() -> list[torch.Tensor]:
            wait()
            got = g.from_pg_order(list(out.view(len(sizes), width).unbind(0)))
            return [row[:n] for row, n in zip(got, sizes)]

        return rows, [payload, out]

    def _gather_bytes_equal(self, t: torch.Tensor, g: _TorchGroup) -> list[torch.Tensor]:
        """Every member's tensor of t's shape and dtype, in shardops order."""
        rows = self._all_gather_padded(_bytes_of(t), g, [t.numel() * t.element_size()] * len(g.pg_index))
        return [_from_bytes(r, t.dtype, tuple(t.shape)) for r in rows]


def _exchange_rows(recv: torch.Tensor, n: int, mine: torch.Tensor, g: _TorchGroup) -> list[torch.Tensor]:
    """A reduce_scatter as one all_to_all of raw bytes and a local reduction, in group order: the
    received rows (`recv`, n members' padded chunks), each as this member's chunk, in shardops order.

    Used on gloo, whose reduce_scatter is an all_reduce of the whole buffer (each rank
    then keeps its chunk; ProcessGroupGloo::reduce_scatter_tensor_coalesced): that moves
    twice the bytes a reduce_scatter needs, in twice the ring steps. The exchange moves
    each chunk once, straight to its member, in one step (measured on 4 gloo processes:
    about half the time at 32 KiB to 4 MiB). It carries every dtype and op (the reduction
    is `reduce_stack`, as in the threads world, which it matches bit for bit), so the
    other backends use it for what they cannot reduce (int16, complex product, ...).
    Chunks are padded to the largest, as the native reduce_scatter's wire is.
    """
    rows = g.from_pg_order(list(recv.view(n, recv.numel() // n).unbind(0)))
    size = mine.numel() * mine.element_size()
    return [_from_bytes(row[:size], mine.dtype, mine.shape) for row in rows]


def _reduce_rows(rows: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """`reduce_stack` of what an exchange received; a sum accumulates in place into one new tensor
    (the same additions in the same order: bit for bit reduce_stack's), not a new tensor per row."""
    if op != "sum" or rows[0].dtype == torch.bool:
        return reduce_stack(rows, op)
    out = rows[0].clone()
    for row in rows[1:]:
        out.add_(row)
    return out


def _c10d(kind: str, g: _TorchGroup, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    if args and isinstance(args[0], torch.Tensor):
        _check_backend_carries(kind, g, args[0].device)
    try:
        collective(*args, group=g.pg, **kwargs)
    except RuntimeError as e:  # c10d's DistError family: timeouts, dead peers, backend refusals
        raise _collective_error(kind, g, e) from e


def _c10d_start(
    kind: str, g: _TorchGroup, collective: Callable[..., Any], *args: Any, **kwargs: Any
) -> Callable[[], None]:
    """`_c10d` with async_op=True: started on the backend's threads; returns the wait."""
    if args and isinstance(args[0], torch.Tensor):
        _check_backend_carries(kind, g, args[0].device)
    try:
        work = collective(*args, group=g.pg, async_op=True, **kwargs)
    except RuntimeError as e:
        raise _collective_error(kind, g, e) from e

    def wait() -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise _collective_error(kind, g, e) from e

    return wait


def _check_backend_carries(kind: str, g: _TorchGroup, device: torch.device) -> None:
    """nccl carries CUDA tensors only, and shardops exchanges some host metadata as CPU tensors
    (shapes in from_local's check, random keys, checkpoint plans): an nccl-only group cannot serve those."""
    if device.type == "cpu" and g.backend_for(device) == "nccl":
        raise CollectiveError(
            f"{kind} of a CPU tensor over ranks {list(g.ranks)}: the process group's only backend is nccl, which "
            "carries CUDA tensors only, and shardops exchanges some metadata as CPU tensors. Initialise the group "
            "with dist.init_process_group('cpu:gloo,cuda:nccl') (torch's choice when no backend is named on a CUDA "
            "machine)."
        )


def _collective_error(kind: str, g: _TorchGroup, e: BaseException) -> CollectiveError:
    # The same error type as the threads world, so callers catch one thing in both.
    return CollectiveError(f"{kind} over ranks {list(g.ranks)} failed in torch.distributed: {e}")


def _wire_op(dtype: torch.dtype, op: str) -> Any:
    return _TORCH_OPS[_BOOL_OPS[op] if dtype == torch.bool else op]


def _to_wire(t: torch.Tensor, op: str, n: int) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """A private copy of `t` the backend can reduce in place, and how to turn the reduced copy into the result."""
    if t.dtype == torch.bool:
        wire = t.to(torch.uint8)

        def finish(w: torch.Tensor) -> torch.Tensor:
            out = w.to(torch.bool)
            return out // n if op == "avg" else out  # as reduce_stack does it

        return wire, finish
    if t.is_complex():
        # c10d reduces complex tensors only as (real, imag) pairs; sum and avg are the ops that allows.
        wire = torch.view_as_real(t.clone())
        return wire, lambda w: torch.view_as_complex(w) / n if op == "avg" else torch.view_as_complex(w)
    wire = t.clone()
    if op != "avg":
        return wire, lambda w: w
    return wire, lambda w: w / n if w.is_floating_point() else w // n


def _travels_as_is(t: torch.Tensor, op: str) -> bool:
    """Whether the backend reduces `t` itself (no uint8/real view, no division afterwards)."""
    return op != "avg" and t.dtype != torch.bool and not t.is_complex()


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (shares its storage)."""
    return t.reshape(-1).view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    if b.numel() == 0:  # an empty slice's storage offset need not be aligned for `view(dtype)`
        return torch.empty(shape, dtype=dtype, device=b.device)
    return b.view(dtype).reshape(shape)


def _common_dtype(chunks: Sequence[torch.Tensor], what: str) -> torch.dtype:
    dtypes = {c.dtype for c in chunks}
    if len(dtypes) != 1:
        raise CollectiveError(f"{what}: chunks of different dtypes {sorted(map(str, dtypes))}; send one dtype")
    return chunks[0].dtype
