import pytest


@pytest.fixture(autouse=True)
def _private_cache_key(tmp_path_factory, monkeypatch):
    """Each test of the cache gets a cache key of its own (under a temporary
    XDG_CONFIG_HOME, which subprocesses inherit), never the user's."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))
