"""torch.compile on models with shardops DTensor parameters (issue 25).

Compiled against eager shardops on the same module and input: output values and
placements, every parameter's gradient (values and layout), the collectives and
bytes per step (compiled moves nothing extra), and how many graphs dynamo made.
Both worlds: threads (so.run) and 4 gloo processes. Eager shardops is itself
checked against single-device torch in test_parallel.py; here the reference for
the values is also single-device torch, computed in the test.
"""

import copy
import functools
import os
from typing import Any

import pytest
import torch
import torch.nn as nn

import shardops as so
from mp import run_gloo
from shardops import Partial, Replicate, Shard
from shardops.fsdp import replicate
from shardops.fsdp.replicate import replicate_state
from shardops.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

MESHES = [(4,), (2, 2)]
# The default suite keeps one mesh of a repeated case; the other runs with `pytest -m slow` (CI time).
SLOW = pytest.mark.slow
MESHES_DP2XTP2_DEFAULT = [pytest.param((4,), id="tp4", marks=SLOW), pytest.param((2, 2), id="dp2xtp2")]


class _GraphCounter:
    """A dynamo backend that counts the graphs it is given, then runs them as aot_eager would."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs += 1
        return aot_eager(gm, example_inputs)


def _mlp(seed: int = 0, hidden: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 8))


def _parallel_mlp(reference: nn.Module, mesh_shape) -> tuple[nn.Module, so.DeviceMesh]:
    """Column- then row-parallel on the tp dim; on a 2-d mesh also `replicate` (torch's composable
    DDP) over dp, as torchtitan's apply_tp then apply_ddp: gradients all-reduced over dp in
    backward's hooks, activations plain local tensors of the rank's batch."""
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    mesh = so.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    m = copy.deepcopy(reference)
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if len(mesh_shape) == 2:
        replicate(m, device_mesh=mesh["dp"])
    return m, mesh


def _dp_size(mesh: so.DeviceMesh) -> int:
    return mesh["dp"].size() if mesh.ndim == 2 else 1


def _local_batch(x: torch.Tensor, mesh: so.DeviceMesh) -> torch.Tensor:
    """This rank's rows of the global batch `x`: its dp coordinate's chunk (all of it without dp)."""
    return x.chunk(_dp_size(mesh))[mesh.get_local_rank("dp")] if mesh.ndim == 2 else x


def _loss(y: torch.Tensor, dp: int) -> torch.Tensor:
    """The global batch's sum of squares, as each of the `dp` data-parallel ranks' part of it:
    replicate averages the dp ranks' gradients, so the rank's sum times dp gives single-device
    torch's gradients (torchtitan scales its loss for the same reason)."""
    return (y * y).sum() * dp


def _step(m: nn.Module, x: torch.Tensor, mesh: so.DeviceMesh, run=None):
    """Forward of this rank's batch of `x` (through `run`: m or its compiled form), the loss, backward;
    what came out and what the step sent."""
    for p in m.parameters():
        p.grad = None
    with so.CommDebugMode() as comm:
        y = (run or m)(_local_batch(x, mesh))
        loss = _loss(y, _dp_size(mesh))
        loss.backward()
    grads = {n: p.grad for n, p in m.named_parameters()}
    return y, grads, comm.get_comm_counts(), comm.get_total_bytes()


def _full(t):
    return t.full_tensor() if isinstance(t, so.DTensor) else t


def _compare_compiled_with_eager(mesh_shape, backend) -> list[dict]:
    reference = _mlp()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    ref_y = reference(x)
    (ref_y * ref_y).sum().backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    def rank():
        m, mesh = _parallel_mlp(reference, mesh_shape)
        eager_y, eager_grads, eager_counts, eager_bytes = _step(m, x, mesh)
        compiled = torch.compile(m, backend=backend)
        y, grads, counts, nbytes = _step(m, x, mesh, compiled)  # first call: compiles
        y2, grads2, counts2, nbytes2 = _step(m, x, mesh, compiled)  # second: the cached graph
        out = {
            "requires_grad": y.requires_grad,
            "eager": (eager_counts, eager_bytes),
            "compiled": [(counts, nbytes), (counts2, nbytes2)],
        }
        ref_rows = _local_batch(ref_y, mesh)  # the rows of this rank's batch
        out["values"] = [torch.allclose(_full(v), ref_rows, atol=1e-5) for v in (eager_y, y, y2)]
        out["grads"] = {}
        for n, g in grads.items():
            e = eager_grads[n]
            out["grads"][n] = (
                g is not None and grads2[n] is not None,
                g is not None
                and type(g) is type(e)
                and (not isinstance(g, so.DTensor) or g.placements == e.placements),
                g is not None
                and torch.allclose(_full(g), _full(e), atol=1e-5)
                and torch.allclose(_full(grads2[n]), _full(e), atol=1e-5),
                torch.allclose(_full(e), ref_grads[n], atol=1e-5),
            )
        return out

    return so.run(rank, 4)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=["tp4", "dp2xtp2"])
def test_compiled_parallel_mlp_equals_eager_and_torch(mesh_shape):
    torch._dynamo.reset()
    for r, out in enumerate(_compare_compiled_with_eager(mesh_shape, "aot_eager")):
        assert out["requires_grad"], f"rank {r}: the compiled output lost requires_grad"
        assert out["values"] == [True, True, True], f"rank {r}: {out['values']}"
        for name, (present, same_layout, same_values, eager_right) in out["grads"].items():
            assert present, f"rank {r}: {name}.grad is None after a compiled backward"
            assert same_layout, f"rank {r}: {name}.grad has another type or layout than eager's"
            assert same_values, f"rank {r}: the compiled {name}.grad differs from eager's"
            assert eager_right, f"rank {r}: eager {name}.grad differs from single-device torch"
        assert out["compiled"] == [out["eager"], out["eager"]], (
            f"rank {r}: compiled {out['compiled']} vs eager {out['eager']}"
        )


def _train_rank(reference: nn.Module, mesh_shape, backend: str, steps: int = 3, compiled_part: str = "step") -> dict:
    """`steps` training steps of the parallel MLP, eager and compiled (forward, loss, backward,
    clip_grad_norm_, AdamW's foreach step): each step's loss, collectives and (clipped) gradients,
    the final parameters.
    compiled_part: "step" compiles the whole train_step, "accumulating" the whole step with two
    backwards (micro-batches of 4), "update" only clip_grad_norm_ + the optimizer's step after an
    eager backward."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    out: dict = {}
    for mode in ("eager", "compiled"):
        m, mesh = _parallel_mlp(reference, mesh_shape)
        rows, dp = _local_batch(x, mesh), _dp_size(mesh)  # read outside the compiled step
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)

        def update():
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)  # noqa: B023 - called within this iteration
            opt.step()  # noqa: B023 - called within this iteration

        compiled_update = (
            torch.compile(update, backend=backend) if mode == "compiled" and compiled_part == "update" else update
        )

        def train_step():
            opt.zero_grad()  # noqa: B023 - called within this iteration
            total = 0.0
            for batch in rows.chunk(2) if compiled_part == "accumulating" else (rows,):  # noqa: B023
                y = m(batch)  # noqa: B023 - called within this iteration
                loss = _loss(y, dp)  # noqa: B023 - called within this iteration
                loss.backward()
                total = total + loss.detach()
            compiled_update()  # noqa: B023 - called within this iteration
            return total

        run = (
            torch.compile(train_step, backend=backend)
            if mode == "compiled" and compiled_part != "update"
            else train_step
        )
        out[mode], out[mode + "_grads"] = [], []
        for _ in range(steps):
            with so.CommDebugMode() as comm:
                loss = run()
            out[mode].append((float(_full(loss)), comm.get_comm_counts(), comm.get_total_bytes()))
            out[mode + "_grads"].append({n: _full(p.grad).detach() for n, p in m.named_parameters()})
        out[mode + "_params"] = {n: _full(p).detach() for n, p in m.named_parameters()}
    return out


def _single_device_training(reference: nn.Module, steps: int = 3) -> tuple[list[float], dict]:
    m = copy.deepcopy(reference)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        y = m(x)
        loss = (y * y).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in m.named_parameters()}


def _training_differences(out: dict, mesh_shape, same_bytes: bool) -> list[str]:
    """Where a rank's compiled training differs from its eager training, and eager from one device
    (the parameters; the losses too where the rank's loss is the global one: tensor parallel only)."""
    losses = lambda mode: [s[0] for s in out[mode]]  # noqa: E731
    close = lambda a, b: abs(a - b) <= 1e-5 * max(1.0, abs(b))  # noqa: E731
    wrong = (
        [f"losses: compiled {losses('compiled')} vs eager {losses('eager')}"]
        if not all(map(close, losses("compiled"), losses("eager")))
        else []
    )
    wrong += [
        f"{n} after compiled training"
        for n, p in out["eager_params"].items()
        if not torch.allclose(out["compiled_params"][n], p, atol=1e-5)
    ]
    for step, (compiled, eager) in enumerate(zip(out["compiled_grads"], out["eager_grads"])):
        wrong += [
            f"{n}.grad after compiled step {step}"
            for n, g in eager.items()
            if not torch.allclose(compiled[n], g, atol=1e-5)
        ]
    ref_losses, ref_params = _single_device_training(_mlp())
    if len(mesh_shape) == 1 and not all(map(close, losses("eager"), ref_losses)):
        wrong.append(f"losses: eager {losses('eager')} vs one device {ref_losses}")
    wrong += [
        f"{n}: eager vs one device"
        for n, p in ref_params.items()
        if not torch.allclose(out["eager_params"][n], p, atol=1e-5)
    ]
    if same_bytes and [s[1:] for s in out["compiled"]] != [s[1:] for s in out["eager"]]:
        wrong.append(f"collectives: compiled {out['compiled']} vs eager {out['eager']}")
    return wrong


@pytest.mark.parametrize("mesh_shape", MESHES_DP2XTP2_DEFAULT)
def test_compiled_train_step_with_optimizer_equals_eager(mesh_shape):
    """torch.compile(train_step): the optimizer's step (clip_grad_norm_, AdamW) runs compiled on the DTensor
    parameters after backward's graph break, with eager's values and eager's bytes at every step, and
    the parameters of single-device training. On (dp, tp) the model is also `replicate`d over dp: the
    style hooks the compiled step traces compare the tp sub-mesh of each rank thread (a mesh compared
    in compiled code is a constant: mesh.py), and the gradients are averaged in backward's hooks."""
    torch._dynamo.reset()
    reference = _mlp()
    for r, out in enumerate(so.run(lambda: _train_rank(reference, mesh_shape, "aot_eager"), 4)):
        wrong = _training_differences(out, mesh_shape, same_bytes=True)
        assert not wrong, f"rank {r}: {wrong}"


def test_replicate_gradient_accumulation_in_a_compiled_step():
    """Two micro-batches' backwards inside the compiled step (a backward called from compiled code is
    eager code), each ending in replicate's bucket all_reduce (DDP without no_sync sends a reduction per
    backward): eager's values and eager's bytes at every step, single-device torch's parameters."""
    torch._dynamo.reset()
    reference = _mlp()
    for r, out in enumerate(
        so.run(lambda: _train_rank(reference, (2, 2), "aot_eager", compiled_part="accumulating"), 4)
    ):
        wrong = _training_differences(out, (2, 2), same_bytes=True)
        assert not wrong, f"rank {r}: {wrong}"


def test_eager_backward_then_compiled_clip_and_optimizer_step_sends_eager_bytes():
    """Backward in eager, clip_grad_norm_ + AdamW compiled, tp + replicate on (2,2): the compiled update
    reads the gradients replicate averaged at the end of backward. Losses, parameters, gradients and
    bytes are eager's at every step, the first included; the parameters single-device torch's. (A
    gradient pending as a sum or as shards reaching compiled code: the pending tests below.)"""
    torch._dynamo.reset()
    reference = _mlp()
    for r, out in enumerate(so.run(lambda: _train_rank(reference, (2, 2), "aot_eager", compiled_part="update"), 4)):
        wrong = _training_differences(out, (2, 2), same_bytes=True)
        assert not wrong, f"rank {r}: {wrong}"


def _gloo_train_rank(mesh_shape, compiled_part="step", backend="aot_eager"):
    return _train_rank(_mlp(), mesh_shape, backend, compiled_part=compiled_part)


# weight shape -> the layout its gradient comes back pending in, and the layout it is pending to
PENDING_CASES = {
    "shards": ((5, 3), ((Shard(0),), (Replicate(),))),  # the planner slices the weight inside the op
    "sum": ((3,), ((Partial(),), (Replicate(),))),  # a broadcast weight: each rank's rows' summand
}


def _pending_training(mesh, case: str, backend: str | None, steps: int = 3) -> tuple[list, torch.Tensor]:
    """A replicated weight (PENDING_CASES[case]) times a row-sharded (5, 3) input (uneven over 4 ranks,
    one empty): its gradient comes back pending, as shards (a move that changes the local shape) or as
    a sum. clip_grad_norm_ + AdamW, compiled with `backend` or eager: each step's pending layout and
    collectives, and the final weight."""
    torch.manual_seed(0)
    w = so.distribute_tensor(torch.randn(PENDING_CASES[case][0]), mesh, [Replicate()]).requires_grad_()
    opt = torch.optim.AdamW([w], lr=1e-2, foreach=True)

    def update():
        torch.nn.utils.clip_grad_norm_([w], 1.0)
        opt.step()

    run = torch.compile(update, backend=backend) if backend else update
    steps_seen = []
    for step in range(steps):
        opt.zero_grad()
        x = so.distribute_tensor(torch.randn(5, 3, generator=torch.Generator().manual_seed(step)), mesh, [Shard(0)])
        ((w * x) ** 2).sum().backward()
        g = w.grad
        assert isinstance(g, so.DTensor)
        pending = (g.placements, g._pending_layout)
        with so.CommDebugMode() as comm:
            run()
        steps_seen.append((pending, comm.get_comm_counts(), comm.get_total_bytes()))
    return steps_seen, w.full_tensor().detach()


@pytest.mark.parametrize("case", list(PENDING_CASES))
def test_pending_gradient_reaches_compiled_code_with_eager_bytes(case):
    """A gradient pending as shards (Shard(0) -> Replicate, uneven: a move that changes the local shape)
    or as a sum (Partial -> Replicate): compiled code is traced with the resolved gradient and the gather
    or all_reduce runs once as the graph is called (a graph cannot change its input's layout). Eager's
    collectives at every step; the weight is single-device torch's."""
    torch.manual_seed(0)
    w = torch.randn(PENDING_CASES[case][0]).requires_grad_()
    opt = torch.optim.AdamW([w], lr=1e-2, foreach=True)
    for step in range(3):
        opt.zero_grad()
        ((w * torch.randn(5, 3, generator=torch.Generator().manual_seed(step))) ** 2).sum().backward()
        torch.nn.utils.clip_grad_norm_([w], 1.0)
        opt.step()
    torch._dynamo.reset()

    def rank():
        mesh = so.init_device_mesh("cpu", (4,))
        return _pending_training(mesh, case, None), _pending_training(mesh, case, "aot_eager")

    for r, ((eager, eager_w), (compiled, compiled_w)) in enumerate(so.run(rank, 4)):
        assert eager[0][0] == PENDING_CASES[case][1], eager  # the case this test is about
        assert compiled == eager, f"rank {r}: compiled {compiled} vs eager {eager}"
        assert torch.allclose(compiled_w, w.detach(), atol=1e-6) and torch.allclose(eager_w, w.detach(), atol=1e-6)


@pytest.mark.parametrize("compiled_part", [pytest.param("update", marks=SLOW), "accumulating"])
def test_replicate_compiled_update_and_accumulation_under_gloo(compiled_part):
    """The accumulation and the compiled-update tests above in 4 gloo processes (replicate's bucket
    all_reduce is asynchronous there, waited for at the end of backward)."""
    for r, out in enumerate(run_gloo(_gloo_train_rank, 4, (2, 2), compiled_part, timeout=600)):
        wrong = _training_differences(out, (2, 2), same_bytes=True)
        assert not wrong, f"rank {r}: {wrong}"


@pytest.mark.parametrize("mesh_shape", MESHES_DP2XTP2_DEFAULT)
def test_compiled_train_step_with_optimizer_under_gloo(mesh_shape):
    for r, out in enumerate(run_gloo(_gloo_train_rank, 4, mesh_shape, timeout=600)):
        wrong = _training_differences(out, mesh_shape, same_bytes=True)
        assert not wrong, f"rank {r}: {wrong}"


@pytest.mark.slow  # inductor's C++ compiles: 225 s (threads) and 115 s (gloo) on a loaded 2-core machine
@pytest.mark.parametrize("world", ["threads", "gloo"])
def test_compiled_training_with_inductor_equals_eager(world):
    """inductor (C++ kernels on CPU) compiles the tp + replicate training step with two micro-batches'
    backwards (the gloo accumulation case): each step's loss, every gradient, the final parameters and
    the collectives are eager's (the aot_eager tests above run the same training with torch's own
    kernels)."""
    torch._dynamo.reset()
    if world == "threads":
        reference = _mlp()
        outs = so.run(lambda: _train_rank(reference, (2, 2), "inductor", compiled_part="accumulating"), 4)
    else:
        outs = run_gloo(_gloo_train_rank, 4, (2, 2), "accumulating", "inductor", timeout=600)
    for r, out in enumerate(outs):
        wrong = _training_differences(out, (2, 2), same_bytes=True)
        assert not wrong, f"rank {r}: {wrong}"


def test_sharded_parameter_gradient_is_never_silently_none():
    """A plain layer after the sharded ones: backward succeeds either way, so only the grads tell."""
    torch._dynamo.reset()

    def rank():
        mesh = so.init_device_mesh("cpu", (2,))
        m = nn.Sequential(_mlp(), nn.Linear(8, 4))
        parallelize_module(m[0], mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        compiled = torch.compile(m, backend="aot_eager")
        compiled(torch.randn(3, 8)).sum().backward()
        return {n: p.grad is not None for n, p in m.named_parameters()}

    for grads in so.run(rank, 2):
        assert all(grads.values()), grads


def _checks_its_mesh(mesh: so.DeviceMesh):
    """A style hook's shape: its mesh in a closure, compared with the input DTensor's (parallel/_layout.move)."""
    return lambda x: x - 1 if x.device_mesh != mesh else x + 1


def test_compiled_code_compares_each_rank_threads_sub_mesh_as_a_constant():
    """On (2, 2) the tp sub-meshes of ranks {0, 1} and {2, 3} differ, and one code object sees both.
    Comparing a mesh held by the code with an input's used to fail the trace (dynamo made the ints of
    the mesh's identity symbolic after the second mesh, and `!=` of symbolic ints is no constant)."""
    torch._dynamo.reset()

    def rank():
        mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        f = torch.compile(_checks_its_mesh(mesh["tp"]), backend="aot_eager", fullgraph=True)
        on_tp, on_dp = (so.DTensor.from_local(torch.zeros(2), mesh[d], [Replicate()]) for d in ("tp", "dp"))
        return f(on_tp).to_local().tolist(), f(on_dp).to_local().tolist()

    assert so.run(rank, 4) == [([1.0, 1.0], [-1.0, -1.0])] * 4


def _threads_world_graph_counts(world_size: int = 4, user_limit: int | None = None) -> dict:
    """Graphs each rank of a `world_size` threads world compiles over two steps, and dynamo's
    recompile limits in the caller before, in the ranks after compiling, in the caller after.
    `user_limit`: the caller sets dynamo's recompile_limit first, as a torchrun script would."""
    from torch._dynamo import config

    torch._dynamo.reset()
    if user_limit is not None:
        config.recompile_limit = user_limit
    counters = [_GraphCounter() for _ in range(world_size)]
    limits = lambda: [config.recompile_limit, config.accumulated_recompile_limit]  # noqa: E731
    reference = _mlp(hidden=2 * world_size)
    before = limits()

    def rank():
        m, mesh = _parallel_mlp(reference, (world_size,))
        compiled = torch.compile(m, backend=counters[mesh.get_rank()], fullgraph=True)
        compiled(torch.randn(8, 8)).sum().backward()
        compiled(torch.randn(8, 8)).sum().backward()
        return limits()

    in_ranks = so.run(rank, world_size)
    return {"graphs": [c.graphs for c in counters], "limits": [before, in_ranks, limits()]}


def _in_fresh_process(call: str):
    """Evaluate `call` (an expression over this module) in a new Python: dynamo's state is
    process-wide, and what earlier tests of a whole-suite run leave behind (global config,
    other frames) can add a recompile."""
    import json
    import subprocess
    import sys

    program = f"import test_compile, json; print(json.dumps(test_compile.{call}))"
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", program], cwd=here, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_parallel_mlp_compiles_to_one_graph_in_the_threads_world():
    """Each rank traces once (its coordinate is part of the guard), one graph each, none again on the second step."""
    assert _in_fresh_process("_threads_world_graph_counts(4)")["graphs"] == [1, 1, 1, 1]


def test_threads_world_over_eight_ranks_compiles_on_every_rank():
    """The ranks share dynamo's cache, one entry each: with dynamo's default limit of 8 entries a
    frame, ranks 8 and 9 of a 10-rank world silently ran eager (0 graphs). Each rank thread's
    limits are its caller's times the ranks; the caller's own stay as they were."""
    out = _in_fresh_process("_threads_world_graph_counts(10)")
    assert out["graphs"] == [1] * 10, out
    before, in_ranks, after = out["limits"]
    assert in_ranks == [[10 * before[0], 10 * before[1]]] * 10 and after == before, out


def test_rank_threads_see_the_callers_compile_config():
    """torch.compile's config values are per thread; a rank thread starts from its caller's, as a
    torchrun process runs with its script's settings (the rank threads used to see torch's defaults)."""
    out = _in_fresh_process("_threads_world_graph_counts(2, user_limit=3)")
    before, in_ranks, after = out["limits"]
    assert before[0] == 3 and in_ranks == [[6, 2 * before[1]]] * 2 and after == before, out


def _gloo_rank(mesh_shape, backend):
    torch.manual_seed(0)
    reference = _mlp()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    m, mesh = _parallel_mlp(reference, mesh_shape)
    eager_y, eager_grads, eager_counts, eager_bytes = _step(m, x, mesh)
    explained = torch._dynamo.explain(copy.deepcopy(m))(x) if len(mesh_shape) == 1 else None
    graph_ops = _GraphOps()  # aot_eager, noting each graph's ops
    compiled = torch.compile(m, backend=graph_ops if backend == "aot_eager" else backend)
    y, grads, counts, nbytes = _step(m, x, mesh, compiled)
    y2, grads2, counts2, nbytes2 = _step(m, x, mesh, compiled)
    same_grads = all(
        grads[n] is not None
        and grads[n].placements == eager_grads[n].placements
        and torch.allclose(_full(grads[n]), _full(eager_grads[n]), atol=1e-5)
        for n in grads
    )
    return {
        "graphs": None if explained is None else (explained.graph_count, explained.graph_break_count),
        "values": torch.allclose(_full(y), _full(eager_y), atol=1e-5) and y.requires_grad,
        "grads": same_grads,
        "bytes": ((counts, nbytes), (eager_counts, eager_bytes)),
        "bytes_again": (counts2, nbytes2),
        "collectives": [op for op in graph_ops.ops if "c10d" in op or op.startswith("shardops")],
        "buckets": len(state.buckets) if (state := replicate_state(m)) is not None else 0,
    }


@pytest.mark.parametrize("mesh_shape", MESHES_DP2XTP2_DEFAULT)
def test_compiled_parallel_mlp_under_gloo(mesh_shape):
    """Also: under torch.distributed the traced collectives are torch's own (_c10d_functional), each
    with its wait and shardops' byte counter, which makes a compiled step count what eager counts.
    The graphs hold every collective of the step but replicate's: as torch's DDP/replicate (without
    compiled autograd), its bucket all_reduces run in the parameters' gradient hooks, outside the
    compiled graphs, one per bucket, and the step still sends eager's collectives and bytes."""
    for r, out in enumerate(run_gloo(_gloo_rank, 4, mesh_shape, "aot_eager", timeout=600)):
        ops = out["collectives"]
        assert not [op for op in ops if op.startswith("shardops.") and op != "shardops.count.default"], (
            f"rank {r}: {ops}"
        )
        issued = [op for op in ops if op.startswith("_c10d_functional.") and "wait_tensor" not in op]
        waits = [op for op in ops if "wait_tensor" in op]
        counters = [op for op in ops if op == "shardops.count.default"]
        assert issued and len(issued) == len(waits) == len(counters), f"rank {r}: {ops}"
        assert out["buckets"] == (1 if len(mesh_shape) == 2 else 0), f"rank {r}: {out['buckets']} buckets"
        assert sum(out["bytes"][1][0].values()) == len(issued) + out["buckets"], (
            f"rank {r}: eager sends {out['bytes'][1]}, the graphs hold {issued}, {out['buckets']} bucket(s) outside"
        )
        assert out["bytes_again"] == out["bytes"][1], f"rank {r}: second compiled step {out['bytes_again']}"
        if out["graphs"] is not None:
            assert out["graphs"] == (1, 0), f"rank {r}: (graphs, breaks) = {out['graphs']}"
        assert out["values"] and out["grads"], f"rank {r}: {out}"
        compiled, eager = out["bytes"]
        assert compiled == eager, f"rank {r}: compiled step sent {compiled}, eager {eager}"


@pytest.mark.slow
def test_compiled_parallel_mlp_with_inductor():
    torch._dynamo.reset()
    for r, out in enumerate(_compare_compiled_with_eager((4,), "inductor")):
        assert out["requires_grad"] and out["values"] == [True, True, True], f"rank {r}: {out}"
        assert all(all(v) for v in out["grads"].values()), f"rank {r}: {out['grads']}"
        assert out["compiled"] == [out["eager"], out["eager"]], f"rank {r}"


COLUMNS = 15  # uneven over 2 ranks: 8 and 7


# op -> (function of a [4, COLUMNS] tensor, the dim its DTensor is sharded on): ops with a sharded
# algorithm over that dim (collectives inside), forward and backward
def _causal_attention(x):
    q = x.view(1, 1, 4, COLUMNS)
    return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).view(4, COLUMNS)


SHARDED_ALGORITHMS: dict[str, tuple[Any, ...]] = {  # (function, x's sharded dim, makers of other operands)
    "cumsum": (lambda x: torch.cumsum(x, 1), 1),
    "cumprod": (lambda x: torch.cumprod(x, 1), 1),
    "logcumsumexp": (lambda x: torch.logcumsumexp(x, 1), 1),
    "cummax": (lambda x: torch.cummax(x, 1).values, 1),
    "rms_norm": (lambda x: torch.nn.functional.rms_norm(x, (COLUMNS,)), 1),
    "layer_norm": (lambda x: torch.nn.functional.layer_norm(x, (COLUMNS,)), 1),
    "logsumexp": (lambda x: torch.logsumexp(x, 1), 1),
    "var": (lambda x: x.var(1), 1),
    "std_mean": (lambda x: torch.std_mean(x, 1)[0], 1),
    "vector_norm": (lambda x: torch.linalg.vector_norm(x, dim=1), 1),
    "vector_norm_all": (lambda x: torch.linalg.vector_norm(x), 1),
    "topk": (lambda x: torch.topk(x, 3, dim=1).values, 1),
    "sort": (lambda x: torch.sort(x, dim=1).values, 1),
    "max_dim": (lambda x: torch.max(x, 1).values, 1),
    "amax": (lambda x: torch.amax(x, 1), 1),
    "median": (lambda x: torch.median(x, 1).values, 1),
    "softmax": (lambda x: torch.softmax(x, 1), 1),
    "log_softmax": (lambda x: torch.log_softmax(x, 1), 1),
    "sum": (lambda x: x.sum(1), 1),
    "mean": (lambda x: x.mean(), 1),
    # an operand beside x is made Replicate on x's mesh outside the compiled code (a plain tensor of
    # more than one element next to a DTensor raises, as in torch)
    "cross_entropy": (lambda x, target: torch.nn.functional.cross_entropy(x, target), 1, lambda: torch.arange(4) * 3),
    "flip": (lambda x: torch.flip(x, (1,)), 1),
    "roll": (lambda x: torch.roll(x, 3, 1), 1),
    "row_parallel_matmul": (lambda x, w: x @ w, 1, lambda: torch.ones(COLUMNS, 5)),
    "causal_attention": (_causal_attention, 0),
}


def _sharded_algorithm_differences(backend: str = "aot_eager") -> dict[str, list[str]]:
    """Each op compiled whole (fullgraph) against eager shardops and single-device torch: values,
    input gradient, and bytes (the compiled step sends no more than eager)."""
    mesh = so.init_device_mesh("cpu", (2,))
    x0 = torch.randn(4, COLUMNS, generator=torch.Generator().manual_seed(0)) + 0.1
    out = {}
    for name, (f, dim, *operand) in SHARDED_ALGORITHMS.items():
        plain = [make() for make in operand]
        replicated = [so.DTensor.from_local(t, mesh, [so.Replicate()]) for t in plain]
        reference = x0.clone().requires_grad_()
        want = f(reference, *plain)
        (want * want).sum().backward()
        runs: dict[str, Any] = {}
        for mode, run in (("eager", f), ("compiled", torch.compile(f, backend=backend, fullgraph=True))):
            x = so.distribute_tensor(x0, mesh, [so.Shard(dim)]).requires_grad_()
            try:
                with so.CommDebugMode() as comm:
                    y = run(x, *replicated)
                    (y * y).sum().backward()
                runs[mode] = (_full(y).detach(), _full(x.grad), comm.get_total_bytes())
            except Exception as e:  # noqa: BLE001 - the failure is the finding
                runs[mode] = f"{type(e).__name__}: {str(e)[:300]}"
        wrong = [f"{mode}: {r}" for mode, r in runs.items() if isinstance(r, str)]
        if not wrong:
            for mode, (y, grad, _) in runs.items():
                if not (torch.allclose(y, want, atol=1e-5) and torch.allclose(grad, _full(reference.grad), atol=1e-4)):
                    wrong.append(f"{mode}: values or gradient differ from single-device torch")
            if runs["compiled"][2] > runs["eager"][2]:
                wrong.append(f"compiled sends {runs['compiled'][2]} B, eager {runs['eager'][2]} B")
        out[name] = wrong
    return out


@pytest.mark.parametrize("world", ["threads", pytest.param("gloo", marks=SLOW)])
def test_sharded_algorithms_compile_whole_with_eager_values_and_bytes(world):
    """Over uneven shards. Found on the way: in the threads world a rank whose algorithm did not read
    a collective's result (the first shard of a cumsum needs no prefix) had it removed as dead code:
    ranks met in the wrong collectives (an error, or a wrong gradient); a vector_norm's compiled
    backward failed (its gradient was expected as a NormPartial); var, cumprod, flip, roll and
    cross_entropy read tensors at trace time (graph breaks); amax and sum sent more than eager."""
    _assert_sharded_algorithms_compile(world, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("world", ["threads", "gloo"])
def test_sharded_algorithms_compile_whole_with_inductor(world):
    """Inductor schedules each rank's graph itself, and over uneven shards the ranks' graphs differ
    (the first shard of a scan reads no prefix): every rank must still issue the same collectives
    in the same order."""
    _assert_sharded_algorithms_compile(world, "inductor")


def _assert_sharded_algorithms_compile(world: str, backend: str) -> None:
    torch._dynamo.reset()
    run = so.run if world == "threads" else functools.partial(run_gloo, timeout=600)
    for r, ops in enumerate(run(_sharded_algorithm_differences, 2, backend)):
        wrong = {name: w for name, w in ops.items() if w}
        assert not wrong, f"rank {r}: {wrong}"


def test_random_ops_on_dtensors_refuse_to_compile():
    """A compiled dropout would replay one frozen draw counter every step: a clear error instead."""
    torch._dynamo.reset()

    def rank():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.distribute_tensor(torch.ones(4, 8), mesh, [so.Shard(1)])
        f = torch.compile(lambda t: torch.nn.functional.dropout(t, 0.5, training=True) * 2, backend="aot_eager")
        try:
            f(x)
        except Exception as e:  # noqa: BLE001 - dynamo wraps the error in its own type
            return str(e)
        return "compiled"

    for message in so.run(rank, 2):
        assert "draw counter would be frozen" in message, message


def test_in_place_resolution_of_a_partial_input_refuses_to_compile():
    """Eager resolves a pending partial of `self` in place and relabels it; a compiled graph could
    write back the data but not the label: a clear error instead of a DTensor whose data and layout disagree."""
    torch._dynamo.reset()

    def rank():
        mesh = so.init_device_mesh("cpu", (2,))
        x = so.DTensor.from_local(torch.ones(4), mesh, [so.Partial()])
        f = torch.compile(lambda t: t.add_(1), backend="aot_eager")
        try:
            f(x)
        except Exception as e:  # noqa: BLE001 - dynamo wraps the error in its own type
            return str(e)
        return f"compiled: {x.placements} {x.full_tensor()}"

    for message in so.run(rank, 2):
        assert "cannot change an input's layout" in message, message


def test_compile_benchmark_section_renders_its_rows_and_failures():
    from benchmarks import run
    from benchmarks.compile import format_compile_table

    result = {
        "size": "tiny",
        "world_size": 4,
        "steps": 2,
        "rows": [
            {
                "model": "gpt2",
                "system": "shardops",
                "eager_ms": 20.0,
                "compiled_ms": 10.0,
                "first_compiled_s": 3.0,
                "same_loss": True,
                "graphs": 1,
                "breaks": 0,
            },
            {"model": "gpt2", "system": "DTensor", "error": "RuntimeError: boom"},
        ],
    }
    table = format_compile_table(result)
    assert (
        "| gpt2 | shardops | 20.0 | 10.0 | 0.50× | 3.0 | yes | 1, 0 |" in table
        and "failed: RuntimeError: boom" in table
    )
    assert "compile" in run.BENCHMARKS
    assert "### torch.compile" in run.render_report(
        {"compile": result}, "shardops bench --quick", run.machine_info(), {}, None
    )


class _GraphOps:
    """An aot_eager backend that notes the ops of every forward and backward graph it compiles."""

    def __init__(self) -> None:
        self.ops: list[str] = []

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def note(g, _inputs):
            for n in g.graph.nodes:
                if (
                    n.op == "call_function"
                ):  # an effectful op (shardops::count) is wrapped in with_effects(token, op, ...)
                    self.ops.append(str(n.args[1]) if "with_effects" in str(n.target) else str(n.target))
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=note, bw_compiler=note)


def test_a_mesh_sliced_inside_compiled_code_is_built_eagerly():
    """`mesh["dp"]` in a compiled function: the slice breaks the graph and runs eagerly (dynamo used to
    compile DeviceMesh.__init__ as a frame of its own and fail building a guard on the half-built mesh)."""
    torch._dynamo.reset()

    def rank():
        mesh = so.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        f = torch.compile(lambda x: x * mesh["dp"].size() + mesh["tp"].get_local_rank(), backend="aot_eager")
        return f(torch.ones(2)).tolist()

    assert so.run(rank, 4) == [[2.0, 2.0], [3.0, 3.0]] * 2
