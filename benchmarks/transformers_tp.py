"""transformers models under their own tensor-parallel plan: shardops (`from_transformers`) beside torch
DTensor (transformers' own `apply_tensor_parallelism`), bytes per training step on the busiest rank.

    python -m benchmarks.transformers_tp [--models llama,mixtral]

4 gloo processes; in each, the same tiny model (same weights) is trained for a few steps twice: by
transformers on torch's DTensor (counted by torch's CommDebugMode and the c10d calls that run) and by
shardops in strict mode with local outputs, as transformers applies the plan (counted by
so.CommDebugMode). Forward, loss, backward and the AdamW step are all inside the count.
Figures in docs/parallel.md (no test asserts them: each run starts 4 processes).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

MODELS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "mixtral")
STEPS = 2


def _build(name: str):
    import torch
    import transformers

    cls, extra = {
        "llama": ("LlamaConfig", {}),
        "qwen2": ("Qwen2Config", {}),
        "qwen3": ("Qwen3Config", {}),
        "mistral": ("MistralConfig", {}),
        "gemma2": ("Gemma2Config", {}),
        "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    }[name]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=4,
        **extra,
    )
    config._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config).float()


def _steps(model, ids, meter) -> tuple[list[int], list[float]]:
    import torch
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    nbytes, losses = [], []
    for _ in range(STEPS):
        with meter() as m:
            opt.zero_grad()
            logits = model(ids).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
        nbytes.append(m.bytes())
        losses.append(loss.item())
    return nbytes, losses


class _OurMeter:
    def __enter__(self):
        import shardops as so

        self._comm = so.CommDebugMode()
        self._comm.__enter__()
        return self

    def __exit__(self, *exc):
        self._comm.__exit__(*exc)

    def bytes(self) -> int:
        return self._comm.get_total_bytes()


def _concrete_plan(model) -> dict[str, str]:
    """The plan with `*` expanded to the model's own names (transformers expands it before applying)."""
    from shardops.parallel.transformers import _key_regex

    names = [n for n, _ in model.named_modules() if n] + [n for n, _ in model.named_parameters()]
    return {n: kind for key, kind in model._tp_plan.items() for n in names if _key_regex(key).fullmatch(n)}


def _apply_as_transformers(model, mesh) -> None:
    """transformers' own TP on torch DTensor: each plan entry's style shards the parameters (what its
    loader does per parameter) and, for a module entry, installs its forward."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    modules, params = dict(model.named_modules()), dict(model.named_parameters())
    for name, kind in _concrete_plan(model).items():
        style = ALL_PARALLEL_STYLES[kind]
        if name in params:
            owner, _, pname = name.rpartition(".")
            style.shard_param(modules[owner], pname, mesh)
            continue
        module = modules[name]
        for pname, _ in list(module.named_parameters(recurse=False)):
            if f"{name}.{pname}" not in _concrete_plan(model):
                style.shard_param(module, pname, mesh)
        style.install_forward(module, mesh)


def gloo_rank(names: list[str]) -> dict[str, Any]:
    """One process of 4: per model, (torch's bytes per step, shardops' bytes per step, both losses)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import shardops as so
    from shardops.parallel import from_transformers
    from shardops.training.torch_side import TorchMeter

    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    out = {}
    for name in names:
        base = _build(name)
        theirs = copy.deepcopy(base)
        _apply_as_transformers(theirs, torch_mesh("cpu", (4,)))
        torch_bytes, torch_losses = _steps(theirs, ids, TorchMeter)
        ours = copy.deepcopy(base)
        from_transformers(ours, so.init_device_mesh("cpu", (4,)))
        so.set_strict(True)
        try:
            our_bytes, our_losses = _steps(ours, ids, _OurMeter)
        finally:
            so.set_strict(False)
        out[name] = {
            "torch": torch_bytes,
            "shardops": our_bytes,
            "torch_losses": torch_losses,
            "shardops_losses": our_losses,
        }
    return out


def measure(names: list[str], timeout: float = 600) -> dict[str, dict[str, Any]]:
    """{model: {"torch": busiest rank's bytes per step, "shardops": the same, losses}} from 4 gloo processes."""
    from shardops.training.launch import run_gloo

    ranks = run_gloo(gloo_rank, 4, names, timeout=timeout)
    out = {}
    for name in names:
        per_rank = [r[name] for r in ranks]
        out[name] = {
            "torch": max(max(r["torch"]) for r in per_rank),
            "shardops": max(max(r["shardops"]) for r in per_rank),
            "torch_losses": per_rank[0]["torch_losses"],
            "shardops_losses": per_rank[0]["shardops_losses"],
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args(argv)
    rows = measure(args.models.split(","))
    print("| model | shardops B/step | torch DTensor B/step |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['shardops']:,} | {r['torch']:,} |")


if __name__ == "__main__":
    main()
