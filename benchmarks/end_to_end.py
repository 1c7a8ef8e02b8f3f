"""End to end: wall time of the demo's transformer-step slice, shardops vs torch DTensor, on gloo.

    python -m benchmarks.end_to_end [--size quick|full|tiny] [--repeats N]

The steps are those of `shardops demo --ops` (shardops/demo/ops.py: rms_norm,
attention softmax and vocabulary-parallel cross-entropy, each forward + backward;
mean/var over the hidden dim; top-k over the vocabulary; clip_grad_norm_), on a 1-D mesh of
`world_size` gloo processes on 127.0.0.1, at a larger size than the demo's.
Every step's sharded operand is sharded on the dim the op reduces over (the
hidden dim, the key dim, the vocabulary), as in the demo's "tp" mesh dim.

Both systems run in the same processes on the same inputs (built on every rank
from one seeded generator). Each repeat runs every step with both systems,
alternating which goes first; a timed run starts after a barrier and its time
is the slowest rank's. Reported: the median over repeats per step, and the
sum of those medians over the steps that both systems run (a step that raises
on one system is timed on the other only, and the report names it). The first
run of each (system, step) is compared with single-device torch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from shardops.training import launch

TARGET_RATIO = 0.5  # shardops / DTensor wall time: at most half
IGNORE = -100
SYSTEMS = ("shardops", "DTensor")


@dataclass(frozen=True)
class Size:
    batch: int
    seq: int
    hidden: int
    heads: int
    vocab: int
    topk: int = 5
    repeats: int = 5
    warmup: int = 1

    def describe(self) -> str:
        return (
            f"x f32[{self.batch},{self.seq},{self.hidden}], scores "
            f"f32[{self.batch},{self.heads},{self.seq},{self.seq}], logits f32[{self.batch * self.seq},{self.vocab}]"
        )


SIZES = {
    "tiny": Size(2, 8, 32, 2, 64, topk=3, repeats=2, warmup=0),
    # quick: 4-16x the demo's tensors (big enough that moving whole shards shows), few repeats.
    "quick": Size(4, 128, 1024, 8, 16384, repeats=7),
    "full": Size(8, 128, 2048, 16, 32000, repeats=9),
}


# --- the two systems ------------------------------------------------------------------


@dataclass
class System:
    """What a step needs from a library: its mesh and how to lay a tensor out."""

    name: str
    mesh: Any
    shard: Callable[[int], Any]
    replicate: Callable[[], Any]
    distribute: Callable[[torch.Tensor, Sequence[Any]], Any]


def make_systems(world_size: int) -> list[System]:
    import torch.distributed.tensor as tdt

    import shardops as so

    so_mesh = so.init_device_mesh("cpu", (world_size,))
    t_mesh = tdt.init_device_mesh("cpu", (world_size,))
    return [
        System(
            "shardops",
            so_mesh,
            so.Shard,
            so.Replicate,
            lambda t, pl: so.distribute_tensor(t, so_mesh, pl, src_data_rank=None),
        ),
        System(
            "DTensor",
            t_mesh,
            tdt.Shard,
            tdt.Replicate,
            lambda t, pl: tdt.distribute_tensor(t, t_mesh, pl, src_data_rank=None),
        ),
    ]


# --- the steps ---------------------------------------------------------------------------


def make_data(size: Size) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    b, s, h, v = size.batch, size.seq, size.hidden, size.vocab
    data = {
        "x": torch.randn(b, s, h, generator=g),
        "w": 1 + 0.1 * torch.randn(h, generator=g),
        "gy": torch.randn(b, s, h, generator=g),
        "scores": 4 * torch.randn(b, size.heads, s, s, generator=g),
        "gp": torch.randn(b, size.heads, s, s, generator=g),
        "logits": 3 * torch.randn(b * s, v, generator=g),
        "target": torch.randint(0, v, (b * s,), generator=g),
        "g_wq": torch.randn(h, h, generator=g),
        "g_norm": torch.randn(h, generator=g),
        "g_emb": torch.randn(v, 128, generator=g),  # an embedding-sized grad, narrow enough to check quickly
    }
    data["target"][::7] = IGNORE
    return data


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _close(a: Any, b: torch.Tensor, rtol: float = 1e-3, atol_scale: float = 1e-5) -> bool:
    """`a` (f32, sharded or not) against a float64 reference `b`.

    The reference is float64 because single-device f32 is itself off by more
    than 1e-4 on these sizes (torch's f32 vector_norm of 16M elements: 6e-4),
    and the tolerance is loose for the same reason: this is a sanity check of a
    timing benchmark; exactness is the comm benchmark's and the tests' job.
    """
    a = _full(a).detach()
    if a.shape != b.shape:
        return False
    if not b.is_floating_point():
        return torch.equal(a, b)
    a, b = a.double(), b.detach().double()
    atol = atol_scale * max(b.abs().max().item(), 1e-30) if b.numel() else 0.0
    return bool(torch.allclose(a, b, rtol=rtol, atol=atol))


class Step:
    """One timed piece of the step.

    `prepare()` (untimed) lays the inputs out and returns the state; `run(state)`
    is what is timed; `results(state, out)` are the tensors to check, in the
    order of `reference()`, the float64 single-device answer (computed once per
    step and shared by both systems through `refs`).
    """

    name = ""

    def __init__(
        self, sys: System, d: dict[str, torch.Tensor], size: Size, refs: dict[str, tuple] | None = None
    ) -> None:
        self.sys, self.d, self.size = sys, d, size
        self.refs = refs if refs is not None else {}

    def ref(self, key: str, grad: bool = False) -> torch.Tensor:
        """A float64 copy of an input for the reference computation."""
        t = self.d[key]
        t = t.double() if t.is_floating_point() else t.clone()
        return t.requires_grad_() if grad else t

    def leaf(self, key: str, placements: Sequence[Any]) -> Any:
        return self.sys.distribute(self.d[key], placements).requires_grad_(True)

    def check(self, state: Any, out: Any) -> bool:
        if self.name not in self.refs:
            self.refs[self.name] = tuple(t.detach() for t in self.reference())
        expected = self.refs[self.name]
        actual = self.results(state, out)
        return len(actual) == len(expected) and all(_close(a, b) for a, b in zip(actual, expected))

    def prepare(self) -> Any:
        raise NotImplementedError

    def run(self, state: Any) -> Any:
        raise NotImplementedError

    def reference(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def results(self, state: Any, out: Any) -> tuple[Any, ...]:
        raise NotImplementedError


class RmsNorm(Step):
    name = "rms_norm fwd+bwd (hidden sharded)"

    def prepare(self):
        s = self.sys
        x, w = self.leaf("x", [s.shard(2)]), self.leaf("w", [s.replicate()])
        return x, w, s.distribute(self.d["gy"], [s.shard(2)])

    def run(self, state):
        x, w, gy = state
        x.grad = w.grad = None
        y = F.rms_norm(x, (self.size.hidden,), w, eps=1e-6)
        y.backward(gy)
        return y

    def reference(self):
        xr, wr = self.ref("x", grad=True), self.ref("w", grad=True)
        yr = F.rms_norm(xr, (self.size.hidden,), wr, eps=1e-6)
        yr.backward(self.ref("gy"))
        return yr, xr.grad, wr.grad

    def results(self, state, y):
        return y, state[0].grad, state[1].grad


class Softmax(Step):
    name = "attention softmax fwd+bwd (keys sharded)"

    def prepare(self):
        s = self.sys
        return self.leaf("scores", [s.shard(3)]), s.distribute(self.d["gp"], [s.shard(3)])

    def run(self, state):
        scores, gp = state
        scores.grad = None
        p = torch.softmax(scores, dim=-1)
        p.backward(gp)
        return p

    def reference(self):
        sr = self.ref("scores", grad=True)
        pr = torch.softmax(sr, dim=-1)
        pr.backward(self.ref("gp"))
        return pr, sr.grad

    def results(self, state, p):
        return p, state[0].grad


class CrossEntropy(Step):
    name = "cross_entropy fwd+bwd (vocab sharded)"

    def prepare(self):
        s = self.sys
        return self.leaf("logits", [s.shard(1)]), s.distribute(self.d["target"], [s.replicate()])

    def run(self, state):
        logits, target = state
        logits.grad = None
        loss = F.cross_entropy(logits, target, ignore_index=IGNORE)
        loss.backward()
        return _full(loss)

    def reference(self):
        lr = self.ref("logits", grad=True)
        loss = F.cross_entropy(lr, self.ref("target"), ignore_index=IGNORE)
        loss.backward()
        return loss, lr.grad

    def results(self, state, loss):
        return loss, state[0].grad


class MeanVar(Step):
    name = "mean/var over hidden (hidden sharded)"

    def prepare(self):
        return self.sys.distribute(self.d["x"], [self.sys.shard(2)])

    def run(self, x):
        return _full(x.mean(dim=-1)), _full(x.var(dim=-1))

    def reference(self):
        x = self.ref("x")
        return x.mean(-1), x.var(-1)

    def results(self, x, out):
        return out


class TopK(Step):
    name = "top-k over vocabulary (vocab sharded)"

    def prepare(self):
        return self.sys.distribute(self.d["logits"], [self.sys.shard(1)])

    def run(self, logits):
        values, indices = torch.topk(logits, self.size.topk, dim=-1)
        return _full(values), _full(indices)

    def reference(self):
        # f32: top-k must pick the very same entries (ties are measure-zero for randn).
        values, indices = torch.topk(self.d["logits"], self.size.topk, dim=-1)
        return values.double(), indices

    def results(self, logits, out):
        return out


class ClipGradNorm(Step):
    name = "clip_grad_norm_ (3 sharded grads)"
    _GRADS = (("g_wq", 0), ("g_norm", 0), ("g_emb", 0))  # (data key, sharded dim): row/vocab parallel

    def prepare(self):
        s = self.sys
        params, grads = [], []
        for key, dim in self._GRADS:
            p = s.distribute(torch.zeros_like(self.d[key]), [s.shard(dim)]).requires_grad_(True)
            params.append(p)
            grads.append(s.distribute(self.d[key], [s.shard(dim)]))
        return params, grads

    def run(self, state):
        params, grads = state
        for p, g in zip(params, grads):
            p.grad = g.detach().clone()  # clipping scales in place: every run starts from the same grads
        return torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)

    def reference(self):
        refs = [torch.zeros_like(self.ref(k)).requires_grad_() for k, _ in self._GRADS]
        for r, (k, _) in zip(refs, self._GRADS):
            r.grad = self.ref(k)
        total = torch.nn.utils.clip_grad_norm_(refs, max_norm=1.0)
        return (total, *(r.grad for r in refs))

    def results(self, state, total):
        return (total, *(p.grad for p in state[0]))


STEPS: tuple[type[Step], ...] = (RmsNorm, Softmax, CrossEntropy, MeanVar, TopK, ClipGradNorm)


def _short(e: BaseException) -> str:
    root = e.__cause__ or e
    lines = [ln.strip() for ln in str(root).splitlines() if ln.strip()]
    return f"{type(root).__name__}: {lines[0] if lines else ''}"[:300]


# --- one rank -------------------------------------------------------------------------------


def rank_main(size: Size) -> dict[str, Any]:
    """Run inside an initialised torch.distributed world; every rank returns the same summary."""
    import logging
    import warnings

    import torch.distributed as dist

    import shardops as so

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    warnings.simplefilter("ignore", so.FallbackWarning)
    world_size = dist.get_world_size()
    phase_start = time.perf_counter()
    phases: dict[str, float] = {}
    systems = make_systems(world_size)
    data = make_data(size)
    refs: dict[str, tuple] = {}  # one float64 reference per step, for both systems
    steps = {(sys.name, cls.name): cls(sys, data, size, refs) for cls in STEPS for sys in systems}
    states: dict[tuple[str, str], Any] = {}
    errors: dict[tuple[str, str], str] = {}
    correct: dict[tuple[str, str], bool] = {}
    # First run of each: raises? correct? Only what runs on every rank is timed.
    for key, step in steps.items():
        try:
            states[key] = step.prepare()
            correct[key] = bool(step.check(states[key], step.run(states[key])))
        except Exception as e:  # noqa: BLE001 - a raising op is a result here
            errors[key] = _short(e)
    phases["setup and first runs, checked"] = time.perf_counter() - phase_start
    keys = list(steps)
    ok = torch.tensor([0.0 if k in errors else 1.0 for k in keys])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    runnable = [k for k, v in zip(keys, ok.tolist()) if v == 1.0]
    for k in keys:
        if k not in runnable and k not in errors:
            errors[k] = "raised on another rank"
    times = torch.zeros(len(runnable), size.repeats, dtype=torch.float64)
    for r in range(size.warmup + size.repeats):
        for cls in STEPS:
            order = systems if r % 2 == 0 else systems[::-1]
            for sys in order:
                key = (sys.name, cls.name)
                if key not in runnable:
                    continue
                dist.barrier()
                start = time.perf_counter()
                steps[key].run(states[key])
                elapsed = time.perf_counter() - start
                if r >= size.warmup:
                    times[runnable.index(key), r - size.warmup] = elapsed
    phases["timed runs"] = time.perf_counter() - phase_start - phases["setup and first runs, checked"]
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    ok_all = torch.tensor([1.0 if correct.get(k, False) else 0.0 for k in keys])
    dist.all_reduce(ok_all, op=dist.ReduceOp.MIN)
    rows = []
    for cls in STEPS:
        row: dict[str, Any] = {"step": cls.name}
        for sys in systems:
            key = (sys.name, cls.name)
            if key in runnable:
                row[sys.name] = {
                    "ms": statistics.median(times[runnable.index(key)].tolist()) * 1e3,
                    "runs_ms": [t * 1e3 for t in times[runnable.index(key)].tolist()],
                    "correct": bool(ok_all[keys.index(key)].item()),
                    "error": None,
                }
            else:
                row[sys.name] = {"ms": None, "runs_ms": [], "correct": None, "error": errors[key]}
        rows.append(row)
    return {
        "rows": rows,
        "world_size": world_size,
        "backend": dist.get_backend(),
        "size": asdict(size),
        "phase_seconds": phases,
    }


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Totals over the steps both systems ran, the ratio, and whether the target is met."""
    both = [r for r in result["rows"] if all(r[s]["ms"] is not None for s in SYSTEMS)]
    only = {s: [r["step"] for r in result["rows"] if r[s]["ms"] is not None and r not in both] for s in SYSTEMS}
    totals = {s: sum(r[s]["ms"] for r in both) for s in SYSTEMS}
    ratio = totals["shardops"] / totals["DTensor"] if both and totals["DTensor"] > 0 else None
    return {
        "common_steps": [r["step"] for r in both],
        "only": only,
        "total_ms": totals,
        "ratio": ratio,
        "target": TARGET_RATIO,
        "met": None if ratio is None else ratio <= TARGET_RATIO,
        "all_steps_ms": {s: sum(r[s]["ms"] for r in result["rows"] if r[s]["ms"] is not None) for s in SYSTEMS},
    }


# --- spawning the ranks -------------------------------------------------------------------------


def run_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    """`fn(*args)` once per process of a `world_size`-rank gloo world on 127.0.0.1 (the package's launcher)."""
    threads = max(1, (os.cpu_count() or 1) // world_size)
    return launch.run_gloo(fn, world_size, *args, timeout=timeout, threads=threads)


def measure_end_to_end(size: Size | str = "quick", world_size: int = 2, timeout: float = 600.0) -> dict[str, Any]:
    """Spawn `world_size` gloo ranks, time the steps, return rank 0's summary plus `summary` and `seconds`."""
    size = SIZES[size] if isinstance(size, str) else size
    start = time.perf_counter()
    result = run_gloo(rank_main, world_size, size, timeout=timeout)[0]
    result["seconds"] = time.perf_counter() - start
    result["summary"] = summarize(result)
    return result


# --- report ---------------------------------------------------------------------------------------


def _cell(entry: dict[str, Any]) -> str:
    if entry["ms"] is None:
        return "raises"
    return f"{entry['ms']:.1f}" + ("" if entry["correct"] else " (WRONG)")


def format_end_to_end_table(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = ["| step | shardops (ms) | DTensor (ms) | ratio | note |", "|---|---:|---:|---:|---|"]
    for r in result["rows"]:
        a, b = r["shardops"], r["DTensor"]
        ratio = f"{a['ms'] / b['ms']:.2f}×" if a["ms"] and b["ms"] else "—"
        notes = [f"{n} raises: {r[n]['error']}" for n in SYSTEMS if r[n]["error"]]
        notes = [n.replace("|", "\\|") for n in notes]
        lines.append(f"| {r['step']} | {_cell(a)} | {_cell(b)} | {ratio} | {'; '.join(notes)} |")
    ratio = "—" if s["ratio"] is None else f"{s['ratio']:.2f}×"
    met = "n/a" if s["met"] is None else ("met" if s["met"] else "**MISSED**")
    lines.append(
        f"| **total, steps both run ({len(s['common_steps'])})** | **{s['total_ms']['shardops']:.1f}** "
        f"| **{s['total_ms']['DTensor']:.1f}** | **{ratio}** | target ≤ {s['target']:g}×: {met} |"
    )
    lines.append(
        f"| total, every step each system runs | {s['all_steps_ms']['shardops']:.1f} | "
        f"{s['all_steps_ms']['DTensor']:.1f} | | |"
    )
    return "\n".join(lines)


def end_to_end_caption(result: dict[str, Any]) -> str:
    size = Size(**result["size"])
    return (
        f"{result['backend']}, {result['world_size']} processes on 127.0.0.1, 1-D mesh; {size.describe()}; "
        f"median of {size.repeats} runs (after {size.warmup} warm-up), slowest rank"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="quick")
    parser.add_argument("--repeats", type=int, help="timed runs per step (default: the size's)")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    size = SIZES[args.size] if args.repeats is None else replace(SIZES[args.size], repeats=args.repeats)
    result = measure_end_to_end(size, args.world_size)
    print(f"## End to end ({end_to_end_caption(result)})\n")
    print(format_end_to_end_table(result))
    print(f"\n{result['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
