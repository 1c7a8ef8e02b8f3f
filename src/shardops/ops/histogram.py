"""histc: a histogram of every element, whatever dims are sharded.

Rows for one mesh dim, for every dim d:

    S(d) -> P(sum)                  bounds given (min != max): local histc; counts add up
    S(d) -> P(sum) + all_gather     no bounds (min == max): first gather each shard's
                                    (min, max), 2 values a rank, one round; then local histc
                                    over the global range -> counts add up

torch's binning is reproduced exactly because every rank calls torch.histc with the very
range torch would have computed on the whole tensor (the data's min and max as doubles, and
its widening of an empty range by +-1). An empty shard contributes (+inf, -inf): it loses
both comparisons, and its histogram is zeros.
"""

from __future__ import annotations

import math

import torch

from ..dispatch.registry import strategy
from ..dispatch.schema import OpSchema
from ..placements import Partial
from ..planner.rows import Row, row
from .common import all_gather_stacked
from .reductions import shard_options

aten = torch.ops.aten
LABEL_HISTC_RANGE = "gather shard ranges, local histc -> pending"


@strategy(aten.histc.default, algorithms=[LABEL_HISTC_RANGE])
def _histc_rule(schema: OpSchema) -> list[Row]:
    spec = schema.self_spec
    bounded = float(schema.arg("min", 0)) != float(schema.arg("max", 0))
    algorithm = None if bounded else histc_global_range
    comm = () if bounded else (("all_gather", 2 * spec.itemsize),)
    label = "local histc -> pending" if bounded else LABEL_HISTC_RANGE
    return [
        row(Partial("sum"), p, algorithm=algorithm, comm=comm, label=label)
        for d in range(spec.ndim)
        for p in shard_options(spec, d)
    ]


def histc_global_range(ctx, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """min == max: torch takes the data's range; every shard learns the global one in one round."""
    spec = ctx.in_specs[0]
    bins = ctx.schema.arg("bins", 100)
    if spec.numel == 0:
        return ctx.func(x, bins, 0, 0)  # torch skips the data range of an empty tensor
    group = [i for i, p in enumerate(spec.placements) if p.is_shard()]
    lo, hi = _local_range(x)
    ranges = all_gather_stacked(torch.stack([lo, hi]), spec, group)
    lo, hi = ranges[:, 0].amin(), ranges[:, 1].amax()  # NaN propagates: torch.histc raises on it, as torch does
    return ctx.func(
        x, bins, lo.item(), hi.item()
    )  # stays: histc takes its range as Python numbers (torch reads it to the host too)


def _local_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.numel() == 0:
        return torch.tensor(math.inf, dtype=x.dtype, device=x.device), torch.tensor(
            -math.inf, dtype=x.dtype, device=x.device
        )
    return torch.aminmax(x)
