"""`so.explain` / `shardops explain`: what an op costs on a layout, planned from metadata only.

    so.explain("softmax(x, dim=1)", mesh=(8, 8, 16), links="nvlink,ib,ib", x="f32[8,4096]:R,R,S(1)")
    so.explain(torch.softmax, x_spec, dim=1)

The call is traced once on META tensors of the global shapes (a TorchDispatchMode
records the aten ops torch dispatches to, after its own decompositions); each
recorded op is then planned in order with `dispatch.core.plan_op` exactly as
the runtime would plan it, and the chosen output layouts flow into the next op.
No data is allocated beyond metadata, no collective runs, and no world of ranks
is needed, so any mesh size can be asked about.

For every step the answer lists the candidates the runtime considers (cheapest
first, as the runtime ranks them): input redistributions, the op's internal
collectives, bytes one rank puts into collectives, rounds and estimated time
under the link model, and which one is chosen and why. Ops that replicate
(no rule, or registry.REPLICATE_ONLY) and callables intercepted at the torch
function level (registry.TORCH_FUNCTIONS) are named as such.

One job per module:

    specs.py     reading specs "f32[8,4096]:R,S(1)", placements, meshes, link models
    trace.py     tracing the call on meta tensors
    planning.py  planning each traced op with the runtime's own planner
    result.py    Option / Step / Explanation (numbers, JSON)
    render.py    the text form
    call.py      explain(): the entry that ties them together
    cli.py       `shardops explain`
"""

from .call import explain
from .cli import add_arguments, main
from .result import DEFAULT_TOP, Explanation, Option, Step
from .specs import parse_links, parse_mesh, parse_placement, parse_placements, parse_spec, spec_text

__all__ = [
    "DEFAULT_TOP",
    "Explanation",
    "Option",
    "Step",
    "add_arguments",
    "explain",
    "main",
    "parse_links",
    "parse_mesh",
    "parse_placement",
    "parse_placements",
    "parse_spec",
    "spec_text",
]
