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
