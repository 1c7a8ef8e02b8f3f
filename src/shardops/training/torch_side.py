"""torch DTensor's side of the training comparison: the same model and plan under
`torch.distributed.tensor.parallel`, run in gloo processes (`launch.run_gloo`).

Data parallelism as on shardops' side, with torch's own APIs: the plan on mesh["tp"], then
`torch.distributed.fsdp.fully_shard` (per block, then the root) or
`torch.distributed._composable.replicate` on mesh["dp"]; gradients reduce during backward, each
rank trains on its own batch slice and records the dp-averaged loss. Collectives are counted by
torch's own `CommDebugMode`; the bytes each one puts in are read from the c10d calls that
actually run (a dispatch mode on this process).
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import torch
import torch.nn.functional as F

from .._torch import pytree
from .._torch.dispatch import TorchDispatchMode
from .config import RunSpec, apply_data_parallel, build, plan
from .loop import Steps

# Ordered: the first pattern found in a c10d op's name gives the kind (benchmarks read it too).
COLLECTIVE_KINDS = (
    ("reduce_scatter", "reduce_scatter"),
    ("all_reduce", "all_reduce"),
    ("allreduce", "all_reduce"),
    ("all_gather", "all_gather"),
    ("allgather", "all_gather"),
    ("all_to_all", "all_to_all"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
    ("scatter", "scatter"),
    ("gather", "gather"),
    ("reduce_", "reduce"),
    ("batch_p2p", "p2p"),
    ("send", "p2p"),
    ("recv", "p2p"),
)
_SENT_ARGS = ("input", "inputs", "input_tensor", "input_tensors", "input_list", "tensors", "tensor")


def collective_kind(name: str) -> str | None:
    """'all_gather' for `_c10d_functional.all_gather_into_tensor`, etc.; None for a non-collective."""
    return next((kind for pattern, kind in COLLECTIVE_KINDS if pattern in name), None)


class _ByteCounter(TorchDispatchMode):
    """Bytes this process puts into each c10d collective that runs (its input tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is not torch.Tensor and issubclass(t, torch.Tensor) and t.__name__ == "DTensor" for t in types):
            return NotImplemented  # let DTensor desugar first: its collectives then come through here
        if func.namespace in ("_c10d_functional", "c10d_functional", "c10d", "_c10d_functional_autograd"):
            kind = collective_kind(func._schema.name.split("::")[-1])
            if kind is not None:
                named = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
                sent = next((named[n] for n in _SENT_ARGS if n in named), None)
                nbytes = sum(
                    t.numel() * t.element_size() for t in pytree.tree_leaves(sent) if isinstance(t, torch.Tensor)
                )
                self.sent.append((kind, nbytes))
        return func(*args, **kwargs)


class TorchMeter:
    """torch's CommDebugMode (the counts) with the bytes of the same calls."""

    def __enter__(self) -> TorchMeter:
        from torch.distributed.tensor.debug import CommDebugMode

        self._comm = CommDebugMode()
        self._bytes = _ByteCounter()
        self._comm.__enter__()
        self._bytes.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bytes.__exit__(*exc)
        self._comm.__exit__(*exc)

    def counts(self) -> dict[str, int]:
        # CommDebugMode keys are torch op overloads; name them as shardops does
        out: collections.Counter = collections.Counter()
        for op, n in self._comm.get_comm_counts().items():
            kind = collective_kind(str(op))
            if kind is not None:
                out[kind] += n
        return dict(out)

    def bytes(self) -> int:
        return sum(n for _, n in self._bytes.sent)


def _retie(model: torch.nn.Module, name: str) -> None:
    """torch's parallelize_module unties GPT-2's shared embedding: a torch user has to tie it again."""
    if name == "gpt2":
        model.get_submodule("lm_head").weight = model.get_submodule("wte").weight


def train_rank(spec: RunSpec) -> dict[str, Any]:
    """One gloo rank of torch DTensor training (call through launch.run_gloo)."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.tensor.parallel as tp_api
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from .._torch.distributed import torch_fsdp_replicate

    fsdp_replicate = torch_fsdp_replicate()

    # CommDebugMode's module tracker hooks every module; torch warns when the input needs no grad
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    # the models return a view (flatten happens outside, nothing writes into it in place)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    # reading the final (StridedShard, Shard) parameters whole takes two all_gathers: torch logs it, once per rank
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)

    torch.manual_seed(spec.seed)
    names = ("dp", "tp") if len(spec.mesh_shape) == 2 else ("tp",)
    mesh = init_device_mesh("cpu", spec.mesh_shape, mesh_dim_names=names)
    model = build(spec)
    parallelize_module(model, mesh["tp"] if spec.dp > 1 else mesh, plan(spec, tp_api))
    _retie(model, spec.model)
    if spec.dp > 1:
        # composable DDP (`torch.distributed._composable.replicate`) does not average tensor-parallel
        # DTensor parameters (torchtitan refuses DDP with TP; measured here: wrong from the second
        # step): torch's replicate for TP is the fully_shard-based one (gradients all-reduced per unit)
        def replicate(module: torch.nn.Module, device_mesh: Any) -> Any:
            return fsdp_replicate(module, mesh=device_mesh)

        apply_data_parallel(spec, model, mesh["dp"], fully_shard, replicate)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    dp_group = mesh["dp"].get_group() if spec.dp > 1 else None
    dp_rank = mesh["dp"].get_local_rank() if spec.dp > 1 else 0
    run = Steps(TorchMeter)
    for step in range(spec.steps):
        run.start()
        inputs, targets = spec.local_batch(step, dp_rank)
        with run.timed("zero_grad"):
            opt.zero_grad()
        with run.timed("forward"), loss_parallel():
            logits = model(inputs)
        with run.timed("loss"), loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
        with run.timed("backward"), loss_parallel():
            loss.backward()
        with run.timed("optimizer"):
            opt.step()
        with run.timed("loss_read"):
            value = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().clone()
            if dp_group is not None:
                dist.all_reduce(value, group=dp_group)
                value /= spec.dp
            run.finish(value.item())
        run.done()
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    return {"records": run.records, "params": params if dist.get_rank() == 0 else None}


def train(spec: RunSpec, timeout: float = 600) -> list[dict[str, Any]]:
    """torch DTensor training on prod(mesh_shape) gloo processes; each rank's records
    (rank 0 also its final parameters)."""
    from .launch import run_gloo

    return run_gloo(train_rank, spec.world_size, spec, timeout=timeout)
