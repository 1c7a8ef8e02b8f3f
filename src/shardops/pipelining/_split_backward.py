"""The zero-bubble schedules' backward in two halves: I, the gradients of a stage's inputs (the
previous stage waits for them), then W, the gradients of its weights (nobody waits for them).

I runs autograd from the stage's outputs to its inputs only. On the way it passes the nodes where
a weight's branch leaves the inputs' path (a matmul's node: its weight half is skipped there,
autograd computes only what the inputs need); a hook keeps the gradient arriving at each of those
nodes. W restarts autograd at those nodes with those gradients and computes only the weights'
branches (one autograd call per branch, whose inputs are only that branch's weights, so autograd does
not follow the inputs' path below it), through AccumulateGrad so gradient hooks fire as in a whole
backward. Together the two halves do one backward's work.

A stage whose inputs need no gradient (the first) does its whole backward in W; so does a stage with
a weight reached from two branches (tied), after an I that computes only the inputs' gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class WeightWork:
    """What W runs: per start (a gradient edge, or a tensor), the gradient arriving there and the
    weights to compute from it."""

    starts: list[tuple[Any, Any, list[torch.Tensor]]] = field(default_factory=list)


def backward_input(
    roots: Sequence[torch.Tensor],
    root_grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """I: the gradients of `inputs` (None where unused), and what W needs to finish the weights'."""
    wanted = [x for x in inputs if x.requires_grad]
    whole = WeightWork([(r, g, list(params)) for r, g in zip(roots, root_grads)])
    root_nodes = [r.grad_fn for r in roots if r.grad_fn is not None]
    if not wanted or not root_nodes:
        return [None] * len(inputs), whole
    param_of = {get_gradient_edge(p).node: p for p in params}
    on_input_path = _reaching(root_nodes, {get_gradient_edge(x).node for x in wanted})
    branches = {}  # node on the inputs' path -> the weights its other children reach
    for node in on_input_path:
        below = _params_below([c for c, _ in node.next_functions if c is not None and c not in on_input_path], param_of)
        if below:
            branches[node] = below
    outside = [
        (r, g, _params_below([r.grad_fn], param_of))
        for r, g in zip(roots, root_grads)
        if r.grad_fn is not None and r.grad_fn not in on_input_path
    ]
    claimed = [id(p) for ps in [*branches.values(), *(ps for _, _, ps in outside)] for p in ps]
    if len(claimed) != len(set(claimed)):
        # a weight reached from two places (a tied weight): W from each would also run the other's
        # share through the inputs' path; one whole backward in W instead (I then only computes the inputs')
        found = torch.autograd.grad(roots, wanted, root_grads, retain_graph=True, allow_unused=True)
        return _by_input(inputs, wanted, found), whole
    arriving: dict[Any, tuple] = {}
    handles = [node.register_prehook(lambda grads, node=node: arriving.__setitem__(node, grads)) for node in branches]
    try:
        found = torch.autograd.grad(roots, wanted, root_grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    work = WeightWork([(r, g, ps) for r, g, ps in outside if ps])
    for node, weights in branches.items():
        grads = arriving.get(node, ())
        edges = [(GradientEdge(node, k), g) for k, g in enumerate(grads) if g is not None]
        if edges:
            work.starts.append(([e for e, _ in edges], [g for _, g in edges], weights))
    return _by_input(inputs, wanted, found), work


def backward_weight(work: WeightWork) -> None:
    """W: the weights' gradients, accumulated into their .grad. One autograd call per branch, its
    inputs only that branch's weights, so autograd does not follow the inputs' path below it."""
    for start, grad, weights in work.starts:
        torch.autograd.backward(start, grad, inputs=weights)


def _by_input(
    inputs: Sequence[torch.Tensor], wanted: list[torch.Tensor], found: Sequence[Any]
) -> list[torch.Tensor | None]:
    by_id = dict(zip(map(id, wanted), found))
    return [by_id.get(id(x)) for x in inputs]


def _params_below(nodes: Sequence[Any], param_of: dict[Any, torch.Tensor]) -> list[torch.Tensor]:
    """The weights whose AccumulateGrad is reached from `nodes`."""
    seen, found, stack = set(), [], list(nodes)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in param_of:
            found.append(param_of[node])
        stack.extend(c for c, _ in node.next_functions if c is not None)
    return found


def _reaching(starts: Sequence[Any], targets: set[Any]) -> set[Any]:
    """The autograd nodes below `starts` from which a node of `targets` can be reached (targets included)."""
    reaches: dict[Any, bool] = {}
    stack = [(node, False) for node in starts]
    while stack:
        node, children_done = stack.pop()
        if node in reaches:
            continue
        children = [child for child, _ in node.next_functions if child is not None]
        if children_done:
            reaches[node] = node in targets or any(reaches[c] for c in children)
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in reaches)
    return {node for node, yes in reaches.items() if yes}
