"""A representative subset of the suite, run with the SHARDOPS_DEBUG agreement checks on.

With debug on, every dispatch all-gathers (uncounted) a checksum of the chosen plan and of
each plain-tensor operand, and raises if ranks disagree. CI runs this file; it re-runs:

- the property tests of test_properties.py on a few examples each (derandomized: the same
  examples every run), for the families that have landed;
- the DTensor basics of test_dtensor.py (pointwise autograd, pending partials, views,
  in-place ops, errors), imported below so pytest collects them here again.

The whole suite also runs under SHARDOPS_DEBUG=1 (the checks are uncounted, so figures
asserted from CommDebugMode stay the same).
"""

from __future__ import annotations

import pytest

import shardops as so
import test_properties as props  # tests/ is not a package: pytest puts it on sys.path
from shardops.dispatch import core

# Re-collected here, under the debug fixture below.
from test_dtensor import (  # noqa: F401,E402
    test_inplace_keeps_self_layout,
    test_ops_across_meshes_raise,
    test_partial_sum_stays_pending_where_exact,
    test_pointwise_autograd_mesh2x2,
    test_redistribute_backward_returns_gradient_to_source_layout,
    test_sharded_input_gets_gradient_in_its_own_layout,
    test_view_ops_match_torch,
)

EXAMPLES = 8
pytestmark = props.pytestmark  # torch's warning for var's correction >= n, as in test_properties


# test_properties' per-session record of which sharded algorithms ran; the examples here must not
# count in it (test_every_sharded_algorithm_ran judges test_properties' own examples).
_RECORDS = ("ALGORITHMS_OFFERED", "ALGORITHMS_RAN", "EXAMPLES_BY_OP", "LAST_OFFERED")


@pytest.fixture(autouse=True, scope="module")
def debug_checks():
    before = core._state["debug"]
    saved = {name: type(getattr(props, name))(getattr(props, name)) for name in _RECORDS}
    so.set_debug(True)
    yield
    so.set_debug(before)
    for name, value in saved.items():
        record = getattr(props, name)
        record.clear()
        record.update(value)


def test_debug_checks_are_on():
    assert core._state["debug"]


# the property families on EXAMPLES examples each (the cost model's choices only: none forced)
test_redistribute_debug = props.property_test(
    "test_redistribute_debug", props.redistribute_cases(), EXAMPLES, force=False
)
test_pointwise_debug = props.property_test("test_pointwise_debug", props.pointwise_cases(), EXAMPLES, force=False)
test_views_debug = props.property_test("test_views_debug", props.view_cases(), EXAMPLES, force=False)
test_reductions_debug = props.property_test(
    "test_reductions_debug", props.reduction_cases(), EXAMPLES, skip=props._REDUCTIONS_SKIP, force=False
)
test_softmax_debug = props.property_test(
    "test_softmax_debug", props.softmax_cases(), EXAMPLES, skip=props._SOFTMAX_SKIP, force=False
)
test_cross_entropy_debug = props.property_test(
    "test_cross_entropy_debug", props.loss_cases(), EXAMPLES, skip=props._LOSS_SKIP, force=False
)
test_layer_norm_debug = props.property_test(
    "test_layer_norm_debug", props.normalization_cases(), EXAMPLES, skip=props._NORMALIZE_SKIP, force=False
)
test_moments_debug = props.property_test(
    "test_moments_debug", props.moment_cases(), EXAMPLES, skip=props._MOMENTS_SKIP, force=False
)
