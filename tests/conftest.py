import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))
# FallbackWarning is an error in the whole suite (pyproject.toml: filterwarnings); a test that
# expects a fallback says so with pytest.warns(so.FallbackWarning).

import pytest


@pytest.fixture
def strict():
    """Strict mode for the test (an op with no sharded strategy raises), reset afterwards."""
    import shardops as so

    so.set_strict(True)
    try:
        yield
    finally:
        so.set_strict(False)


@pytest.hookimpl(trylast=True)  # after -k/-m have deselected theirs
def pytest_collection_modifyitems(config, items):
    """test_properties' test_every_sharded_algorithm_ran checks what the session's forced property
    examples ran: it stays selected only with some family test that forces algorithms and is not
    skipped at collection (alone it would have nothing to check). Its module marks both kinds."""

    def marked(item, attr):
        return getattr(getattr(item, "function", None), attr, False)

    def skipped(item):
        return any(m.args and m.args[0] is True for m in item.iter_markers("skipif"))

    if any(marked(i, "forces_algorithms") and not skipped(i) for i in items):
        return
    dropped = [i for i in items if marked(i, "checks_forced_examples")]
    if dropped:
        items[:] = [i for i in items if i not in dropped]
        config.hook.pytest_deselected(items=dropped)
