"""Planner hooks the tests steer the planner with (through shardops.planner.choice.choosing)."""

from __future__ import annotations

from shardops.planner.choice import choosing


def _stay_put(ranked):
    return sorted((c for c in ranked if c.redistribute_time == 0), key=lambda c: c.changes) or ranked


def inputs_stay_put():
    """Plan as if moving an input never paid: among the candidates that move no input over
    the network (free local slices allowed), those that change the fewest input layouts, then
    the cheapest. The sharded algorithms then run wherever they apply to the layout given,
    however small the test tensors (on tiny tensors the cost model may rightly prefer
    gathering them, or slicing an input further to shrink a pending output)."""
    return choosing(_stay_put)
