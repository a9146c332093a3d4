"""The extension that holds the FFI handler: built once per version, cached, registered.

``available()`` answers whether PyTorch's kernels can run inside XLA programs in this
process. Its first call builds ``torch_op.cc`` with ``torch.utils.cpp_extension``
(about 12 s on a 2-core AMD EPYC or Intel Xeon; nothing where a build for the same
torch, jax, Python and source is in the cache directory), loads it and registers its
handler with JAX under ``TARGET``. Where that cannot happen (no C++ compiler, a failed
build) it logs one line saying so and answers False: the callers keep their other paths
(an eager op between partitions, a host callback). ``DYNAJAX_TORCH_KERNELS=0`` turns
the kernels off (read at each compile).

The build directory is ``$DYNAJAX_KERNEL_DIR``, else ``$XDG_CACHE_HOME/dynajax/kernels``
(``~/.cache/dynajax/kernels``), one subdirectory per torch/jax/Python/source version;
``cpp_extension`` locks it while building, so processes started together build once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import shutil
import sys
import threading

import jax
import torch

log = logging.getLogger("dynajax.ffi")

TARGET = "dynajax_torch_op"
ENV = "DYNAJAX_TORCH_KERNELS"
DIR_ENV = "DYNAJAX_KERNEL_DIR"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_op.cc")

_lock = threading.Lock()
_state: dict[str, object] = {}


def build_directory() -> str:
    """Where this version's extension is built (one directory per torch, jax, Python
    and source of the handler)."""
    base = os.environ.get(DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "dynajax",
        "kernels",
    )
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    python = f"py{sys.version_info[0]}{sys.version_info[1]}"
    tag = f"torch{torch.__version__}-jax{jax.__version__}-{python}"
    return os.path.join(base, f"{tag}-{digest}".replace("+", "_"))


def enabled() -> bool:
    """Whether the environment allows the extension (``DYNAJAX_TORCH_KERNELS``, on by
    default; ``0``, ``off``, ``false`` turn it off)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def compiler() -> str | None:
    """The C++ compiler ``cpp_extension`` would use (``$CXX``, else ``c++``), if found."""
    return shutil.which(os.environ.get("CXX", "c++"))


def available() -> bool:
    """Whether PyTorch's kernels can run inside XLA programs now: the environment
    allows it (read at each call) and the handler is registered with JAX (built and
    loaded on the first call; False, with one logged line, where it cannot be)."""
    if not enabled():
        return False
    if "ok" in _state:
        return bool(_state["ok"])
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
    return bool(_state["ok"])


def unavailable_reason() -> str:
    """Why ``available()`` is False ('' where it is True or not asked yet)."""
    if not enabled():
        return f"{ENV}={os.environ.get(ENV)}"
    return str(_state.get("why", ""))


def _refuse(why: str) -> bool:
    _state["why"] = why
    log.warning(
        "dynajax: PyTorch's kernels cannot run inside XLA programs (%s); ops without a "
        "JAX rule run in eager PyTorch between partitions, or through host callbacks",
        why,
    )
    return False


def _load() -> bool:
    if compiler() is None:
        return _refuse(f"no C++ compiler: {os.environ.get('CXX', 'c++')} is not on PATH")
    directory = build_directory()
    try:
        os.makedirs(directory, exist_ok=True)
        path = _build(directory)
        library = ctypes.CDLL(path)
        jax.ffi.register_ffi_target(
            TARGET, jax.ffi.pycapsule(library.DynajaxTorchOp), platform="cpu"
        )
    except Exception as e:  # noqa: BLE001 - a failed build falls back, with its reason
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return _refuse(f"building {SOURCE} in {directory} failed: {first}")
    _state["path"] = path
    return True


def _build(directory: str) -> str:
    """Builds (or finds built) the extension in ``directory``; its path."""
    from torch.utils import cpp_extension

    name = "dynajax_torch_op"
    built = os.path.join(directory, f"{name}.so")
    if not os.path.exists(built):
        log.warning(
            "dynajax: building the extension that runs PyTorch's kernels inside XLA "
            "(once per torch and jax version, about 15 s) in %s",
            directory,
        )
    # Built from the directory's own copy of the source: cpp_extension rebuilds where
    # a source's path changes, which two installs of one version sharing the cache
    # directory (two checkouts, two environments) would otherwise do at every switch.
    source = os.path.join(directory, os.path.basename(SOURCE))
    with open(SOURCE, "rb") as f:
        text = f.read()
    if not os.path.exists(source) or pathlib.Path(source).read_bytes() != text:
        staged = f"{source}.{os.getpid()}"
        with open(staged, "wb") as f:
            f.write(text)
        os.replace(staged, source)  # (atomic: a concurrent build reads a whole file)
    path = cpp_extension.load(
        name,
        [source],
        extra_include_paths=[jax.ffi.include_dir()],
        extra_cflags=["-O2"],
        build_directory=directory,
        is_python_module=False,
        verbose=False,
    )
    return str(path)
