"""torch.compile: training-step time of the LLaMA- and GPT-2-style models, shardops vs torch DTensor.

    python -m benchmarks.compile [--size tiny|quick|full] [--models llama gpt2] [--steps N] [--systems DTensor shardops]

Both sides run in the same `world_size` gloo processes on 127.0.0.1 (tensor parallel
over all of them), with the same model weights, plan (shardops.models' plans, written
once for both APIs, loss_parallel off so both take the same plain cross-entropy) and
data, taking turns step by step (so both see the same machine load). Per side: eager
step time, compiled step time (backend inductor), and the first compiled step (which
compiles, from empty inductor caches). A step is forward + cross-entropy + backward; a timed step starts after a
barrier and its time is the slowest rank's; the figure is the median over steps.
The compiled and eager losses are compared on every rank (the `same loss` column), and
`torch._dynamo.explain` counts the forward's graphs and graph breaks per side.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

SIZES = {
    "tiny": {"dim": 32, "n_layers": 2, "n_heads": 4, "vocab_size": 64, "hidden_dim": 64, "max_seq_len": 16, "batch": 2},
    "quick": {
        "dim": 128,
        "n_layers": 2,
        "n_heads": 4,
        "vocab_size": 512,
        "hidden_dim": 256,
        "max_seq_len": 64,
        "batch": 4,
    },
    # the size: dim 512, 8 layers, seq 256
    "full": {
        "dim": 512,
        "n_layers": 8,
        "n_heads": 8,
        "vocab_size": 4096,
        "hidden_dim": 1408,
        "max_seq_len": 256,
        "batch": 4,
    },
}
SYSTEMS = ("shardops", "DTensor")


def _interleaved(steps_by_system: dict[str, Any], steps: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each system's step `steps` times, the systems taking turns (order flipped every round),
    each call after a barrier.

    Taking turns in the same processes puts both sides under the same load: on a shared machine
    the load drifts by more than the gap between the systems within the minutes a run takes.
    Returns (seconds per call by system, last loss by system).
    """
    import torch.distributed as dist

    times: dict[str, list[float]] = {name: [] for name in steps_by_system}
    losses: dict[str, float] = {}
    order = list(steps_by_system)
    for i in range(steps):
        for name in order if i % 2 == 0 else order[::-1]:
            dist.barrier()
            start = time.perf_counter()
            losses[name] = steps_by_system[name]()
            times[name].append(time.perf_counter() - start)
    return times, losses


def _build(system: str, model_name: str, args, world: int):
    from shardops.models import GPT2, Llama, gpt2_plan, llama_plan

    Model, make_plan = {"llama": (Llama, llama_plan), "gpt2": (GPT2, gpt2_plan)}[model_name]
    torch.manual_seed(0)  # the same weights on both sides
    model = Model(args)
    if system == "shardops":
        import shardops as so
        from shardops import parallel as api

        mesh = so.init_device_mesh("cpu", (world,))
    else:
        import torch.distributed.tensor.parallel as api
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    api.parallelize_module(model, mesh, make_plan(loss_parallel=False, api=api))
    if model_name == "gpt2" and system == "DTensor":
        model.lm_head.weight = model.wte.weight  # torch's parallelize_module unties it (as torch_side does)
    return model


def _rank(systems: tuple[str, ...], model_name: str, size: dict[str, Any], steps: int) -> dict[str, Any]:
    """Both systems' models in the same gloo processes: eager steps taking turns, then compiled steps taking turns."""
    from torch._inductor.utils import fresh_cache

    from shardops.models import ModelArgs

    args = ModelArgs(**{k: v for k, v in size.items() if k != "batch"})
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (size["batch"], args.max_seq_len), generator=g)
    targets = torch.randint(0, args.vocab_size, (size["batch"], args.max_seq_len), generator=g)
    world = torch.distributed.get_world_size()
    models = {system: _build(system, model_name, args, world) for system in systems}

    def step(model, run) -> float:
        for p in model.parameters():
            p.grad = None
        out = run(tokens)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        loss = F.cross_entropy(out.flatten(0, 1), targets.flatten(0, 1))
        loss.backward()
        return float(loss.detach())

    eager_steps = {name: (lambda m=m: step(m, m)) for name, m in models.items()}
    _interleaved(eager_steps, 1)  # warm-up
    eager, eager_loss = _interleaved(eager_steps, steps)
    explained = {name: torch._dynamo.explain(m)(tokens) for name, m in models.items()}  # forward's graphs and breaks
    torch._dynamo.reset()  # the timed compiles start from nothing
    compiled_models = {name: torch.compile(m, backend="inductor") for name, m in models.items()}
    with fresh_cache():  # inductor's one-time start (imports, toolchain checks) is paid here, by neither side
        torch.compile(lambda x: torch.nn.functional.gelu(x @ x).sum(), backend="inductor")(
            torch.ones(4, 4, requires_grad=True)
        ).backward()
    first = {}
    for name, m in models.items():  # the first compiled step compiles: timed one side at a time
        # from empty caches (on disk and in memory): else the side compiled second reuses the
        # kernels the first side compiled, and earlier runs' kernels on disk serve both
        with fresh_cache():
            torch.distributed.barrier()
            start = time.perf_counter()
            step(m, compiled_models[name])
            first[name] = time.perf_counter() - start
    compiled, compiled_loss = _interleaved(
        {name: (lambda m=m, c=c: step(m, c)) for (name, m), c in zip(models.items(), compiled_models.values())}, steps
    )
    return {
        name: {
            "eager": eager[name],
            "compiled": compiled[name],
            "first_compiled": first[name],
            "graphs": explained[name].graph_count,
            "breaks": explained[name].graph_break_count,
            "same_loss": abs(eager_loss[name] - compiled_loss[name]) <= 1e-4 * max(1.0, abs(eager_loss[name])),
            "loss": compiled_loss[name],
        }
        for name in models
    }


def measure_compile(
    size: str = "quick",
    models: tuple[str, ...] = ("llama", "gpt2"),
    steps: int = 5,
    world_size: int = 4,
    systems: tuple[str, ...] = SYSTEMS,
) -> dict[str, Any]:
    from shardops.training import launch

    rows = []
    for model_name in models:
        try:
            ranks = launch.run_gloo(_rank, world_size, tuple(systems), model_name, SIZES[size], steps, timeout=3600)
        except Exception as e:  # noqa: BLE001 - a failing run is a result to show
            first = (str(e).splitlines() or [""])[
                0
            ]  # a RankFailure's first line: the rank, its exception's type and message
            rows += [
                {"model": model_name, "system": system, "error": f"{type(e).__name__}: {first[:300]}"}
                for system in systems
            ]
            continue
        for system in systems:
            slowest = lambda key: [max(r[system][key][i] for r in ranks) for i in range(steps)]  # noqa: E731, B023 - called within this iteration
            rows.append(
                {
                    "model": model_name,
                    "system": system,
                    "eager_ms": 1e3 * statistics.median(slowest("eager")),
                    "compiled_ms": 1e3 * statistics.median(slowest("compiled")),
                    "first_compiled_s": max(r[system]["first_compiled"] for r in ranks),
                    "same_loss": all(r[system]["same_loss"] for r in ranks),
                    "graphs": max(r[system]["graphs"] for r in ranks),
                    "breaks": max(r[system]["breaks"] for r in ranks),
                    "compiled_steps_ms": [round(1e3 * t, 1) for t in slowest("compiled")],
                }
            )
    return {"size": size, "world_size": world_size, "steps": steps, "rows": rows}


def format_compile_table(result: dict[str, Any]) -> str:
    lines = [
        "| model | system | eager step (ms) | compiled step (ms) | compiled ÷ eager | first compiled step (s) | same "
        "loss | forward graphs, breaks |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['system']} | failed: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {r['system']} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | "
            f"{r['compiled_ms'] / r['eager_ms']:.2f}× | {r['first_compiled_s']:.1f} | "
            f"{'yes' if r['same_loss'] else '**no**'} | {_graphs(r)} |"
        )
    return "\n".join(lines + _side_by_side(result["rows"]))


def _side_by_side(rows: list[dict[str, Any]]) -> list[str]:
    """Per model: shardops' compiled step over torch DTensor's (the issue's target: <= 1)."""
    timed = {(r["model"], r["system"]): r for r in rows if "error" not in r}
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        ours, theirs = timed.get((model, "shardops")), timed.get((model, "DTensor"))
        if ours and theirs:
            line = (
                f"\n{model}: shardops compiled ÷ DTensor compiled = {ours['compiled_ms'] / theirs['compiled_ms']:.3f}×"
            )
            pairs = list(zip(ours.get("compiled_steps_ms", []), theirs.get("compiled_steps_ms", [])))
            if pairs:  # the sides took turns: step i of one ran next to step i of the other
                ratios = sorted(a / b for a, b in pairs)
                line += (
                    f" (step by step: median {statistics.median(ratios):.3f}×, {ratios[0]:.3f}–{ratios[-1]:.3f}×, "
                    f"shardops faster in {sum(r < 1 for r in ratios)} of {len(ratios)})"
                )
            out.append(line)
    return out


def _graphs(row: dict[str, Any]) -> str:
    return f"{row['graphs']}, {row['breaks']}" if "graphs" in row else "n/a"


def compile_caption(result: dict[str, Any]) -> str:
    s = SIZES[result["size"]]
    return (
        f"{result['world_size']} gloo processes, tensor parallel; dim {s['dim']}, {s['n_layers']} layers, "
        f"seq {s['max_seq_len']}, batch {s['batch']}; step = forward + cross-entropy + backward; "
        f"median of {result['steps']} steps (slowest rank); "
        'compiled = torch.compile(model, backend="inductor"); '
        "graphs and breaks: torch._dynamo.explain of the model's forward (slowest rank's count)."
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="quick")
    parser.add_argument("--models", nargs="*", default=["llama", "gpt2"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument(
        "--systems",
        nargs="*",
        choices=SYSTEMS,
        default=list(SYSTEMS),
        help="which sides (they take turns step by step)",
    )
    a = parser.parse_args(argv)
    result = measure_compile(a.size, tuple(a.models), a.steps, a.world_size, tuple(a.systems))
    print(compile_caption(result))
    print(format_compile_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
