import gc
import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _private_cache_and_config_homes(tmp_path_factory):
    """The suite runs every option at its default: the persistent XLA cache is on, in
    the default place under XDG_CACHE_HOME, and its signing key under XDG_CONFIG_HOME.
    Both homes are temporary directories of the session, never the user's ~/.cache or
    ~/.config (tests of the cache itself point DYNAJAX_CACHE_DIR elsewhere). A
    ``DYNAJAX_*`` variable of the shell that runs the suite is set aside for it."""
    names = [
        "XDG_CACHE_HOME",
        "XDG_CONFIG_HOME",
        *(k for k in os.environ if k.startswith("DYNAJAX_")),
    ]
    saved = {k: os.environ.pop(k, None) for k in names}
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache-home"))
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("config-home"))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch, so compiled state never leaks between tests;
    a module a test's ``train_step`` released is collected with the test (a model and
    its step form a cycle), so its global hook does not outlive the test."""
    from dynajax.training import view

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    if view._CALL_HOOK:
        gc.collect()
