"""torch.compile: training-step time of the LLaMA- and GPT-2-style models, shardops vs torch DTensor.

    python -m benchmarks.compile [--size tiny|quick|full] [--models llama gpt2] [--steps N] [--systems DTensor shardops]

Each side runs as `world_size` gloo processes on 127.0.0.1 (tensor parallel over all
of them), the same model, plan (shardops.models' plans, written once for both APIs,
loss_parallel off so both sides take the same plain cross-entropy) and data. Per side:
eager step time, compiled step time (backend inductor), and the first compiled step
(which compiles). A step is forward + cross-entropy + backward; a timed step starts
after a barrier and its time is the slowest rank's; the figure is the median over steps.
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
    "quick": {"dim": 128, "n_layers": 2, "n_heads": 4, "vocab_size": 512, "hidden_dim": 256, "max_seq_len": 64, "batch": 4},
    # the size: dim 512, 8 layers, seq 256
    "full": {"dim": 512, "n_layers": 8, "n_heads": 8, "vocab_size": 4096, "hidden_dim": 1408, "max_seq_len": 256, "batch": 4},
}
SYSTEMS = ("shardops", "DTensor")


def _timed(fn, steps: int) -> tuple[float, list[float], float]:
    """(first call's seconds, later calls' seconds, last loss); every call starts after a barrier."""
    import torch.distributed as dist

    times, loss = [], 0.0
    for _ in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        loss = fn()
        times.append(time.perf_counter() - start)
    return times[0], times[1:], loss


def _rank(system: str, model_name: str, size: dict[str, Any], steps: int) -> dict[str, Any]:
    from shardops.models import GPT2, Llama, ModelArgs, gpt2_plan, llama_plan

    Model, make_plan = {"llama": (Llama, llama_plan), "gpt2": (GPT2, gpt2_plan)}[model_name]
    args = ModelArgs(**{k: v for k, v in size.items() if k != "batch"})
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (size["batch"], args.max_seq_len), generator=g)
    targets = torch.randint(0, args.vocab_size, (size["batch"], args.max_seq_len), generator=g)
    world = torch.distributed.get_world_size()
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

    def step(run) -> float:
        for p in model.parameters():
            p.grad = None
        out = run(tokens)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        loss = F.cross_entropy(out.flatten(0, 1), targets.flatten(0, 1))
        loss.backward()
        return float(loss.detach())

    eager_first, eager, eager_loss = _timed(lambda: step(model), steps)
    explained = torch._dynamo.explain(model)(tokens)  # graphs and breaks of the forward (dynamo only, no inductor)
    torch._dynamo.reset()  # the timed compile starts from nothing
    compiled_model = torch.compile(model, backend="inductor")
    compile_first, compiled, compiled_loss = _timed(lambda: step(compiled_model), steps)
    return {
        "eager": eager, "compiled": compiled, "first_compiled": compile_first,
        "graphs": explained.graph_count, "breaks": explained.graph_break_count,
        "same_loss": abs(eager_loss - compiled_loss) <= 1e-4 * max(1.0, abs(eager_loss)),
    }


def measure_compile(
    size: str = "quick", models: tuple[str, ...] = ("llama", "gpt2"), steps: int = 5, world_size: int = 4,
    systems: tuple[str, ...] = SYSTEMS,
) -> dict[str, Any]:
    from shardops.training import launch

    rows = []
    for model_name in models:
        for system in systems:  # the order may be swapped between runs: the machine's load drifts within one
            try:
                ranks = launch.run_gloo(_rank, world_size, system, model_name, SIZES[size], steps, timeout=3600)
            except Exception as e:  # noqa: BLE001 - one side failing is a result to show
                rows.append({"model": model_name, "system": system, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            slowest = lambda key: [max(r[key][i] for r in ranks) for i in range(steps)]  # noqa: E731
            rows.append({
                "model": model_name, "system": system,
                "eager_ms": 1e3 * statistics.median(slowest("eager")),
                "compiled_ms": 1e3 * statistics.median(slowest("compiled")),
                "first_compiled_s": max(r["first_compiled"] for r in ranks),
                "same_loss": all(r["same_loss"] for r in ranks),
                "graphs": max(r["graphs"] for r in ranks), "breaks": max(r["breaks"] for r in ranks),
            })
    return {"size": size, "world_size": world_size, "steps": steps, "rows": rows}


def format_compile_table(result: dict[str, Any]) -> str:
    lines = [
        "| model | system | eager step (ms) | compiled step (ms) | compiled ÷ eager | first compiled step (s) | same loss | forward graphs, breaks |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['system']} | failed: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {r['system']} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | "
            f"{r['compiled_ms'] / r['eager_ms']:.2f}× | {r['first_compiled_s']:.1f} | {'yes' if r['same_loss'] else '**no**'} | {_graphs(r)} |"
        )
    return "\n".join(lines + _side_by_side(result["rows"]))


def _side_by_side(rows: list[dict[str, Any]]) -> list[str]:
    """Per model: shardops' compiled step over torch DTensor's (the issue's target: <= 1)."""
    timed = {(r["model"], r["system"]): r for r in rows if "error" not in r}
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        ours, theirs = timed.get((model, "shardops")), timed.get((model, "DTensor"))
        if ours and theirs:
            out.append(f"\n{model}: shardops compiled ÷ DTensor compiled = {ours['compiled_ms'] / theirs['compiled_ms']:.2f}×")
    return out


def _graphs(row: dict[str, Any]) -> str:
    return f"{row['graphs']}, {row['breaks']}" if "graphs" in row else "n/a"


def compile_caption(result: dict[str, Any]) -> str:
    s = SIZES[result["size"]]
    return (
        f"{result['world_size']} gloo processes, tensor parallel; dim {s['dim']}, {s['n_layers']} layers, seq {s['max_seq_len']}, "
        f"batch {s['batch']}; step = forward + cross-entropy + backward; median of {result['steps']} steps (slowest rank); "
        "compiled = torch.compile(model, backend=\"inductor\"); "
        "graphs and breaks: torch._dynamo.explain of the model's forward (slowest rank's count)."
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="quick")
    parser.add_argument("--models", nargs="*", default=["llama", "gpt2"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--systems", nargs="*", choices=SYSTEMS, default=list(SYSTEMS), help="which sides, in this order (alternate it between runs)")
    a = parser.parse_args(argv)
    result = measure_compile(a.size, tuple(a.models), a.steps, a.world_size, tuple(a.systems))
    print(compile_caption(result))
    print(format_compile_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
