import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _private_compilation_cache(tmp_path_factory):
    """The suite's persistent XLA cache lives in a temporary directory, never in
    ~/.cache (tests of the cache itself point DYNAJAX_CACHE_DIR elsewhere)."""
    old = os.environ.get("DYNAJAX_CACHE_DIR")
    os.environ["DYNAJAX_CACHE_DIR"] = str(tmp_path_factory.mktemp("dynajax-xla-cache"))
    yield
    if old is None:
        os.environ.pop("DYNAJAX_CACHE_DIR", None)
    else:
        os.environ["DYNAJAX_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch, so compiled state never leaks between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
