import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _private_compilation_cache(tmp_path_factory):
    """The suite's persistent XLA cache and its signing key live in temporary
    directories, never in ~/.cache or ~/.config (tests of the cache itself point
    DYNAJAX_CACHE_DIR elsewhere)."""
    saved = {k: os.environ.get(k) for k in ("DYNAJAX_CACHE_DIR", "XDG_CONFIG_HOME")}
    os.environ["DYNAJAX_CACHE_DIR"] = str(tmp_path_factory.mktemp("dynajax-xla-cache"))
    # The cache's signing key (XDG_CONFIG_HOME/dynajax/cache.key) too.
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("dynajax-config"))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch, so compiled state never leaks between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
