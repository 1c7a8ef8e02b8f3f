"""The autograd engine's private internals, as shardops uses them.

`queue_end_of_backward`: `torch.autograd.Variable._execution_engine.queue_callback` runs a
function once the running backward pass has finished (known for torch 2.13, 2.14, 2.15). FSDP2
and DDP use it so that every gradient reduction has been issued before `backward()` returns;
shardops.fsdp does the same. A torch without it raises TorchInternalMissing naming the hook.

`in_backward()`: `torch._C._current_graph_task_id` (-1 outside a backward pass; known for torch
2.13, 2.14, 2.15), read to tell autograd's own constant tensors (the zeros and ones a derivative
formula makes from a saved shape) from a user's plain operands; bound at import.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import Hook, internal, require

END_OF_BACKWARD = Hook("autograd.end_of_backward", "run the data-parallel reductions' finish when a backward ends")
GRAPH_TASK = Hook("autograd.graph_task", "tell autograd's constant tensors from a user's plain operands")

_current_graph_task_id: Callable[[], int] = internal(GRAPH_TASK, "torch._C._current_graph_task_id")


def in_backward() -> bool:
    """True while this thread runs a backward pass (autograd's engine is executing a graph task)."""
    return _current_graph_task_id() != -1


def install() -> None:
    """Check the internal now, so a torch without it fails at install, not inside a backward."""
    engine = require(END_OF_BACKWARD, torch.autograd.Variable, "_execution_engine", "torch.autograd.Variable")
    require(END_OF_BACKWARD, engine, "queue_callback", "torch.autograd.Variable._execution_engine")


def queue_end_of_backward(fn: Callable[[], None]) -> None:
    """Run `fn` when the backward pass that is running now ends (call from inside a backward hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)
