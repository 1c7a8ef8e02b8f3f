import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _quiet_fallback_warnings():
    import shardops

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", shardops.FallbackWarning)
        yield
