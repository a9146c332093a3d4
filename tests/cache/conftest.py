import pytest
from torch._dynamo.backends import common

from tests.helpers import count_calls


@pytest.fixture(autouse=True)
def _private_cache_key(tmp_path_factory, monkeypatch):
    """Each test of the cache gets a cache key of its own (under a temporary
    XDG_CONFIG_HOME, which subprocesses inherit), never the user's."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))


@pytest.fixture
def aot_runs(monkeypatch):
    """Counts aot_autograd's runs (``[n]``)."""
    return count_calls(monkeypatch, common, "aot_module_simplified")
