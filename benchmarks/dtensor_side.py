"""What PyTorch's own DTensor does on the benchmark cases.

Two measurements, both on CPU in one process:

- `measure_dtensor`: each case of `benchmarks.cases` on a 4-rank world made of
  threads (torch's threaded test process group, real data movement between
  the threads). A `TorchDispatchMode` on every rank records the c10d
  collectives that actually run (on CPU, DTensor sometimes replaces an
  all_to_all by an all_gather and a local slice; what runs is what is
  counted), the bytes put into them and the number of rounds; rank 0's
  figures are reported. The result (values and gradients) is checked against
  single-device torch on the full inputs.
- `dtensor_dispatch_overhead` / `floor_overhead` / `plain_overhead`: the
  per-op Python cost of DTensor on torch's `fake` process group (no data
  movement), of a do-nothing `__torch_dispatch__` wrapper subclass (the floor
  any Python tensor wrapper pays) and of plain eager torch.

Run `python -m benchmarks.dtensor_side` for markdown tables.

torch private APIs (the threaded and fake process groups, the sharding
propagator's lock) are used here on purpose: this is benchmark code.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.cases import MESH_SHAPES, Case, materialize, parse_placements, select_cases
from shardops.training.torch_side import collective_kind as _kind_of

WORLD_SIZE = 4

# --- counting the collectives that run ---------------------------------------

_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d"})
# Ops of those namespaces that move no data of their own.
_NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd", "check_for_nan", "barrier", "monitored_barrier_"})
# Schema argument names that hold what a collective sends, across the
# functional (`input`, `inputs`) and the c10d in-place (`input_tensors`, ...) ops.
_SEND_ARG_NAMES = ("input", "inputs", "input_tensor", "input_tensors", "input_list")
# In-place c10d ops that send their `tensors` argument itself.
_SENDS_TENSORS_ARG = ("allreduce", "broadcast", "reduce_", "send", "isend")


def collective_kind(op_name: str) -> str | None:
    """'all_gather' for `_c10d_functional.all_gather_into_tensor`, etc.; None for a non-collective."""
    return None if op_name in _NOT_COLLECTIVES else _kind_of(op_name)


def _tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def _sent_bytes(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> int:
    """Bytes of the tensors a collective call puts in (its inputs, not its outputs).

    all_gather: the local shard (padding included, if DTensor padded it);
    all_reduce / reduce_scatter / all_to_all: the whole input; broadcast: the
    tensor, on every rank (not only the source; DTensor issues none in the
    measured regions).
    """
    schema_args = func._schema.arguments
    named = {a.name: v for a, v in zip(schema_args, args)}
    named.update(kwargs)
    sent = [named[n] for n in _SEND_ARG_NAMES if n in named]
    if not sent:
        op_name = func._schema.name.split("::")[-1]
        if any(p in op_name for p in _SENDS_TENSORS_ARG):
            sent = [named.get("tensors", named.get("tensor"))]
    return _tensor_bytes(sent)


@dataclass(frozen=True)
class CollectiveCall:
    """One collective call seen on this rank."""

    op: str  # e.g. "_c10d_functional.all_gather_into_tensor"
    kind: str  # "all_gather", "all_reduce", ...
    bytes: int  # bytes of the tensors it was given to send
    backward: bool  # issued while autograd ran a backward node
    alltoall_fallback: bool  # an all_gather DTensor issued in place of an all_to_all (CPU)


def _inside_function(name: str, max_depth: int = 40) -> bool:
    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


class CollectiveCounter(TorchDispatchMode):
    """Records, on this thread's rank, every c10d collective call that runs.

    Each call counts as one round (a coalesced call moves several tensors in
    one round). Tensor subclasses are let through first (`NotImplemented`) so
    that DTensor desugars into the local ops and collectives that are then
    seen here; FakeTensors (DTensor's shape propagation) are not.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CollectiveCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(not _is_plain_tensor_type(t) for t in types):
            return NotImplemented
        if func.namespace in _COLLECTIVE_NAMESPACES:
            op_name = func._schema.name.split("::")[-1]
            kind = collective_kind(op_name)
            if kind is not None:
                self.calls.append(
                    CollectiveCall(
                        op=f"{func.namespace}.{op_name}",
                        kind=kind,
                        bytes=_sent_bytes(func, args, kwargs),
                        backward=torch._C._current_autograd_node() is not None,
                        # torch's CPU path of a Shard(i) -> Shard(j) move; the name is
                        # torch.distributed.tensor._collective_utils.shard_dim_alltoall.
                        alltoall_fallback=kind == "all_gather" and _inside_function("shard_dim_alltoall"),
                    )
                )
        return func(*args, **kwargs)

    @property
    def counts(self) -> dict[str, int]:
        return dict(collections.Counter(c.kind for c in self.calls))

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.calls)

    @property
    def rounds(self) -> int:
        return len(self.calls)


def _is_plain_tensor_type(t: type) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return t is torch.Tensor or issubclass(t, FakeTensor)


# --- a world of threads --------------------------------------------------------


@contextmanager
def _threaded_world() -> Iterator[None]:
    """Install torch's threaded process group for the duration of the block."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    if dist.is_initialized():
        raise RuntimeError("a torch process group is already initialised in this thread; destroy it first")
    # DTensor's shape propagation enters a FakeTensorMode; rank threads must
    # take turns there (torch's own threaded DTensor tests do the same).
    old_lock = ShardingPropagator._fake_mode_lock
    ShardingPropagator._fake_mode_lock = threading.Lock()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        yield
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        ShardingPropagator._fake_mode_lock = old_lock


def run_threaded(fn: Callable[[int], Any], world_size: int = WORLD_SIZE, timeout: float = 300.0) -> list[Any]:
    """Run `fn(rank)` on `world_size` threads joined by a threaded process group.

    Returns each rank's result. An exception on any rank (or a rank still
    running after `timeout` seconds) wakes the ranks waiting in a collective
    and is raised here.
    """
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []

    with _threaded_world():
        store = dist.HashStore()

        def worker(rank: int) -> None:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - reported in the caller
                errors.append((rank, e))
                ProcessLocalGroup.exception_handle(e)
            finally:
                dist.destroy_process_group()

        threads = [threading.Thread(target=worker, args=(r,), name=f"rank{r}", daemon=True) for r in range(world_size)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            ProcessLocalGroup.exception_handle(TimeoutError())
            for t in threads:
                t.join(5.0)
            raise TimeoutError(f"ranks {alive} still running after {timeout} s")
    real = [(r, e) for r, e in errors if not isinstance(e, SystemExit)]
    if real:
        rank, err = min(real, key=lambda re_: re_[0])
        raise RuntimeError(f"rank {rank} failed: {type(err).__name__}: {err}") from err
    if errors:
        raise RuntimeError(f"ranks exited early: {errors}")
    return results


# --- measuring one case ---------------------------------------------------------


def _reference(case: Case) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Single-device torch on the full inputs: output leaves and input gradients."""
    inputs = list(case.inputs())
    for i in case.grad_inputs:
        inputs[i].requires_grad_(True)
    with torch.enable_grad():
        out = case.fn(*inputs)
    outs = [t.detach() for t in pytree.tree_leaves(out)]
    grads = [None if inputs[i].grad is None else inputs[i].grad.detach() for i in case.grad_inputs]
    return outs, grads


def _short_error(e: BaseException) -> str:
    """The error's type and first line; for DTensor's wrapped propagation errors, the cause's."""
    root = e.__cause__ or e
    lines = [ln.strip() for ln in str(root).splitlines() if ln.strip()]
    return f"{type(root).__name__}: {lines[0] if lines else ''}"[:300]


def best_path(name: str | None):
    """The context a case's `dtensor_best` path runs in (a null context for DTensor's default path)."""
    if name is None:
        return contextlib.nullcontext()
    if name == "loss_parallel":
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    raise ValueError(f"unknown DTensor path {name!r}")


def _measure_on_rank(case: Case, mesh: Any, reference: tuple[list, list], path: str | None = None) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh_shape = tuple(mesh.shape)
    dts = []
    for i, (t, spec) in enumerate(zip(case.inputs(), case.placement_specs(mesh_shape))):
        dt = distribute_tensor(t, mesh, parse_placements(spec, Shard, Replicate))
        if i in case.grad_inputs:
            dt = dt.detach().requires_grad_(True)
        dts.append(dt)

    counter = CollectiveCounter()
    error: str | None = None
    correct: bool | None = None
    try:
        with torch.enable_grad(), counter:
            out = case.fn(*dts)
    except Exception as e:  # noqa: BLE001 - a raising op is a result here
        error = _short_error(e)
    if error is None:
        ref_outs, ref_grads = reference
        outs = [materialize(t) for t in pytree.tree_leaves(out)]
        grads = [None if dts[i].grad is None else materialize(dts[i].grad) for i in case.grad_inputs]
        correct = len(outs) == len(ref_outs) and all(
            case.close(None if a is None else a.detach(), b) for a, b in zip(outs + grads, ref_outs + ref_grads)
        )
    return {
        "case": case.name,
        "mesh": mesh_shape,
        "path": path or "default",
        "placements": case.placement_specs(mesh_shape),
        "counts": counter.counts,
        "bytes": counter.bytes,
        "rounds": counter.rounds,
        "backward_rounds": sum(c.backward for c in counter.calls),
        "alltoall_fallbacks": sum(c.alltoall_fallback for c in counter.calls),
        "calls": [asdict(c) for c in counter.calls],
        "lower_bound_bytes": case.lower_bound_bytes(mesh_shape),
        "correct": correct,
        "error": error,
    }


def measure_dtensor(
    case_names: Sequence[str] | None = None, mesh_shapes: Sequence[Sequence[int]] = MESH_SHAPES, best: bool = False
) -> list[dict[str, Any]]:
    """Run each case with torch.distributed.tensor on a 4-thread world.

    best=True: only the cases with a `dtensor_best` path (e.g. loss_parallel), run on that path.

    Returns one dict per (case, mesh), in case order, with keys:

    - case, mesh, path ("default" or the best path's name), placements (the input PlacementSpecs);
    - counts: rank 0's collective calls by kind, e.g. {"all_gather": 2};
    - bytes: what rank 0 put into those calls (their input tensors);
    - rounds: rank 0's collective calls (each one a sequential step);
    - backward_rounds: how many of them ran inside backward;
    - alltoall_fallbacks: all_gathers that DTensor issued in place of an
      all_to_all (its CPU path), included in counts["all_gather"];
    - calls: rank 0's calls, one dict each (see `CollectiveCall`);
    - lower_bound_bytes: the case's rough floor per round;
    - correct: True when every rank's values and gradients match
      single-device torch, False when not, None when the op raised;
    - error: None, or the error text of the first rank that raised;
    - status: "ok", "wrong" or "raises".
    """
    from torch.distributed.tensor import init_device_mesh

    cases = [c for c in select_cases(case_names) if c.dtensor_best or not best]
    if not cases:
        return []
    mesh_shapes = [tuple(s) for s in mesh_shapes]
    for s in mesh_shapes:
        if len(s) == 0 or torch.Size(s).numel() != WORLD_SIZE:
            raise ValueError(f"mesh shape {s} does not cover the {WORLD_SIZE}-rank world")
    references = {c.name: _reference(c) for c in cases}

    def per_rank(rank: int, group: Sequence[Case]) -> list[dict[str, Any]]:
        meshes = [init_device_mesh("cpu", s) for s in mesh_shapes]
        return [
            _measure_on_rank(c, m, references[c.name], c.dtensor_best if best else None) for c in group for m in meshes
        ]

    # NOTE: a best path such as loss_parallel() swaps DTensor's op handlers process-wide, so it is
    # entered once here, around the rank threads, never inside them.
    per_rank_rows = [[] for _ in range(WORLD_SIZE)]
    paths = dict.fromkeys(c.dtensor_best if best else None for c in cases)
    for path in paths:
        group = [c for c in cases if (c.dtensor_best if best else None) == path]
        with best_path(path):
            for rank, part in enumerate(run_threaded(lambda rank, group=group: per_rank(rank, group))):
                per_rank_rows[rank] += part
    rows = per_rank_rows[0]
    for i, row in enumerate(rows):
        others = [r[i] for r in per_rank_rows]
        row["error"] = next((o["error"] for o in others if o["error"] is not None), None)
        row["correct"] = None if row["error"] is not None else all(o["correct"] for o in others)
        row["status"] = "raises" if row["error"] is not None else ("ok" if row["correct"] else "wrong")
    return rows


# --- per-op dispatch overhead ------------------------------------------------------

DEFAULT_OVERHEAD_OPS = ("add", "mul_scalar", "sum_dim", "clone", "detach", "softmax_sharded")


def _op_table(x: torch.Tensor, y: torch.Tensor, xs: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """The timed calls; `xs` is sharded along dim 1 where the tensor type has a layout."""
    return {
        "add": lambda: x + y,
        "mul_scalar": lambda: x * 2.0,
        "sum_dim": lambda: x.sum(1),
        "clone": lambda: x.clone(),
        "detach": lambda: x.detach(),
        "softmax_sharded": lambda: torch.softmax(xs, 1),
    }


_BATCH = 20  # calls per timed batch: amortises perf_counter, short enough to dodge stalls


def _time_ops(table: dict[str, Callable[[], Any]], ops: Sequence[str], iters: int, repeats: int) -> dict[str, float]:
    """Microseconds per call: each repeat times `iters` calls in batches of
    `_BATCH` and keeps the median batch; the figure is the median repeat.

    Medians, not means: on a shared machine a few calls stall for
    milliseconds (seen on softmax_sharded: median 60 µs, mean up to 1.4 ms).
    """
    unknown = [o for o in ops if o not in table]
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}; known: {sorted(table)}")
    batches = max(1, iters // _BATCH)
    out = {}
    for name in ops:
        call = table[name]
        for _ in range(max(10, iters // 10)):  # warm the caches (sharding propagation, allocator)
            call()
        per_repeat = []
        for _ in range(repeats):
            batch_times = []
            for _ in range(batches):
                start = time.perf_counter()
                for _ in range(_BATCH):
                    call()
                batch_times.append((time.perf_counter() - start) / _BATCH * 1e6)
            per_repeat.append(statistics.median(batch_times))
        out[name] = statistics.median(per_repeat)
    return out


_TINY_SHAPE = (8, 8)


def _tiny_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(*_TINY_SHAPE, generator=g), torch.randn(*_TINY_SHAPE, generator=g)


def dtensor_dispatch_overhead(
    ops: Sequence[str] = DEFAULT_OVERHEAD_OPS, iters: int = 2000, repeats: int = 5
) -> dict[str, float]:
    """Microseconds per op of torch DTensor, rank 0 of 4 on the `fake` process group.

    Tiny f32[8, 8] inputs sharded Shard(0) (Shard(1) for softmax_sharded, so
    that DTensor plans and issues its all-gather, which the fake group
    completes without moving data), warm caches; see `_time_ops` for the
    statistic. Runs in the calling thread with its own process group.
    """
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a torch process group is already initialised; destroy it first")
    dist.init_process_group("fake", rank=0, world_size=WORLD_SIZE, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        a, b = _tiny_inputs()
        x = distribute_tensor(a, mesh, [Shard(0)])
        y = distribute_tensor(b, mesh, [Shard(0)])
        xs = distribute_tensor(a, mesh, [Shard(1)])
        return _time_ops(_op_table(x, y, xs), ops, iters, repeats)
    finally:
        dist.destroy_process_group()


class PassthroughTensor(torch.Tensor):
    """A do-nothing wrapper: unwraps the arguments, runs the op, rewraps the outputs."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> PassthroughTensor:
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            device=elem.device,
            requires_grad=elem.requires_grad,
        )
        r.elem = elem
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # aten arguments nest at most one level (Tensor[]), so a one-level
        # unwrap is complete; pytree would add microseconds and raise the floor.
        args = [_unwrap(a) for a in args]
        kwargs = {k: _unwrap(v) for k, v in kwargs.items()} if kwargs else {}
        out = func(*args, **kwargs)
        if type(out) is torch.Tensor:
            return cls(out)
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __repr__(self) -> str:
        return f"PassthroughTensor({self.elem!r})"


def _unwrap(a: Any) -> Any:
    if isinstance(a, PassthroughTensor):
        return a.elem
    if isinstance(a, (list, tuple)):
        return type(a)(e.elem if isinstance(e, PassthroughTensor) else e for e in a)
    return a


def floor_overhead(ops: Sequence[str] = DEFAULT_OVERHEAD_OPS, iters: int = 2000, repeats: int = 5) -> dict[str, float]:
    """Microseconds per op of `PassthroughTensor`: the floor any Python wrapper pays."""
    a, b = _tiny_inputs()
    x, y = PassthroughTensor(a), PassthroughTensor(b)
    return _time_ops(_op_table(x, y, x), ops, iters, repeats)


def plain_overhead(ops: Sequence[str] = DEFAULT_OVERHEAD_OPS, iters: int = 2000, repeats: int = 5) -> dict[str, float]:
    """Microseconds per op of plain eager torch on the same tiny inputs (the kernel itself)."""
    a, b = _tiny_inputs()
    return _time_ops(_op_table(a, b, a), ops, iters, repeats)


# --- report -------------------------------------------------------------------------


def _fmt_mesh(shape: Sequence[int]) -> str:
    return "(" + ",".join(str(s) for s in shape) + (",)" if len(shape) == 1 else ")")


def _fmt_placements(specs: Sequence[Sequence[str]]) -> str:
    return " ".join("[" + ",".join(s) + "]" for s in specs)


def format_measure_table(rows: Sequence[dict[str, Any]]) -> str:
    head = "| case | mesh | placements | status | bytes | floor | rounds (bwd) | collectives | error |"
    lines = [head, "|---|---|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        counts = ", ".join(f"{k}×{v}" for k, v in sorted(r["counts"].items())) or "none"
        if r["alltoall_fallbacks"]:
            counts += f" ({r['alltoall_fallbacks']} all_gather for all_to_all)"
        err = (r["error"] or "").replace("|", "\\|")
        lines.append(
            f"| {r['case']} | {_fmt_mesh(r['mesh'])} | {_fmt_placements(r['placements'])} | {r['status']} "
            f"| {r['bytes']} | {r['lower_bound_bytes']} | {r['rounds']} ({r['backward_rounds']}) | {counts} | {err} |"
        )
    return "\n".join(lines)


def format_overhead_table(columns: dict[str, dict[str, float]]) -> str:
    names = list(columns)
    ops = list(next(iter(columns.values())))
    lines = ["| op | " + " | ".join(f"{n} (µs)" for n in names) + " |", "|---|" + "---:|" * len(names)]
    for op in ops:
        lines.append(f"| {op} | " + " | ".join(f"{columns[n][op]:.1f}" for n in names) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    import json
    import logging

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--iters", type=int, default=2000, help="calls per timing repeat")
    parser.add_argument("--no-overhead", action="store_true", help="skip the dispatch-overhead timing")
    parser.add_argument("--json", metavar="PATH", help="also write the measured rows as JSON")
    args = parser.parse_args(argv)

    # DTensor warns, once per rank, about its CPU all_to_all fallback and its
    # sequential all_reduces on 2-D meshes; both show in the table instead.
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    rows = measure_dtensor(args.cases or None)
    print(f"## torch {torch.__version__} DTensor: collectives of rank 0 of {WORLD_SIZE} (threaded process group)\n")
    print(format_measure_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if not args.no_overhead:
        columns = {
            "DTensor (fake PG)": dtensor_dispatch_overhead(iters=args.iters),
            "passthrough wrapper": floor_overhead(iters=args.iters),
            "plain torch": plain_overhead(iters=args.iters),
        }
        print(f"\n## Per-op time, f32[8, 8], median of 5 repeats of {args.iters} calls (median batch of {_BATCH})\n")
        print(format_overhead_table(columns))


if __name__ == "__main__":
    main()
