"""Abstract evaluations of rules, remembered across graphs and processes.

Deciding a verdict runs the op's rule under ``jax.eval_shape`` (``support._evaluate``);
on a ResNet-18 training step that is 0.24 s of the 0.56 s dynajax spends on its two
graphs, and every process used to repeat it, for every graph. An evaluation's result
(None, or the refusal's reason and detail) depends only on the rule and its key: the
op, the abstract arguments and the expected outputs (``support.CapabilityChecker``). So:

* within a process, each key is evaluated once for all graphs (the forward and backward
  of a training step, graph breaks, recompiles), as long as the op's rule is the same
  object (a user rule registered meanwhile is evaluated afresh);
* across processes, results of built-in rules are kept in the persistent cache beside
  the executables (one entry of kind ``verdicts``, authenticated, checked against the
  versions of jax, torch and dynajax's sources like every entry), keyed by the text of
  the key. Keys holding an object known only by identity, and rules whose code is not
  dynajax's own (users' rules, or any rule installed by other code), are not kept.

The entry is read once per process and rewritten when a graph added evaluations (merged
with what other processes added meanwhile; the newest ``_MAX_KEPT`` are kept).
"""

from __future__ import annotations

import functools
import logging
import pickle
import threading
from collections.abc import Callable
from typing import Any

from dynajax.capability.verdict import Reason
from dynajax.lowering.registry import Rule
from dynajax.store import BlobStore

log = logging.getLogger("dynajax.capability")

Result = tuple[Reason, str] | None

_MAX_KEPT = 20_000  # evaluations kept in the persistent entry
_MAX_MEMORY = 100_000  # evaluations kept in the process (then it starts over)

_LOCK = threading.Lock()
_MEMORY: dict[Any, tuple[Rule, Result]] = {}
_STORES: dict[str, _Store] = {}
_MISSING = object()


class Evaluations:
    """The evaluations one ``CapabilityChecker`` consults; ``cache`` (None: the process
    only) is where they persist."""

    def __init__(self, cache: BlobStore | None = None) -> None:
        self._store = _store_for(cache)
        self._new: dict[str, tuple[str, str] | None] = {}

    def get(self, key: Any, rule: Rule, evaluate: Callable[[], Result]) -> Result:
        """The result of ``evaluate()`` for ``key`` under ``rule``, remembered."""
        known = _MEMORY.get(key)
        if known is not None and known[0] is rule:
            return known[1]
        text = _text(key) if self._store is not None and _covered(rule) else None
        found: Any = _MISSING
        if text is not None and self._store is not None:
            found = self._store.get(text)
        if found is not _MISSING:
            result = None if found is None else (Reason[found[0]], found[1])
        else:
            result = evaluate()
            if text is not None:
                self._new[text] = None if result is None else (result[0].name, result[1])
        if len(_MEMORY) >= _MAX_MEMORY:
            _MEMORY.clear()
        _MEMORY[key] = (rule, result)
        return result

    def save(self) -> None:
        """Stores the evaluations made since the last save (if persistent)."""
        if self._new and self._store is not None:
            self._store.add(self._new)
        self._new = {}


def _covered(rule: Rule) -> bool:
    """Whether the rule's code is dynajax's own, which the entry's versions cover (its
    sources' digest); a user's rule, or one installed by other code, is not."""
    if rule.user:
        return False
    for fn in (rule.fn, rule.check):
        while isinstance(fn, functools.partial):
            fn = fn.func
        if fn is not None and not (getattr(fn, "__module__", None) or "").startswith("dynajax."):
            return False
    return True


def _text(key: Any) -> str | None:
    """The key as stable text, or None when part of it is known only by identity."""
    text = repr(key)
    return None if "('id', " in text or " at 0x" in text else text


class _Store:
    """The persistent entry of one cache directory, read once and merged on save."""

    def __init__(self, cache: BlobStore) -> None:
        self.cache = cache
        self.key = cache.value_key("verdicts", "abstract evaluations of built-in rules")
        self._known: dict[str, tuple[str, str] | None] | None = None

    def _read(self) -> dict[str, tuple[str, str] | None]:
        payload, why = self.cache.load_value("verdicts", self.key)
        if payload is None:
            log.debug("no stored abstract evaluations (%s)", why)
            return {}
        try:
            known = pickle.loads(payload)
        except Exception:  # noqa: BLE001 - an authentic entry we cannot read: start over
            return {}
        return known if isinstance(known, dict) else {}

    def get(self, text: str) -> Any:
        if self._known is None:
            with _LOCK:
                if self._known is None:
                    self._known = self._read()
        return self._known.get(text, _MISSING)

    def add(self, new: dict[str, tuple[str, str] | None]) -> None:
        with _LOCK:
            merged = self._read()  # what other processes stored meanwhile
            merged.update(self._known or {})
            merged.update(new)
            if len(merged) > _MAX_KEPT:
                merged = dict(list(merged.items())[-_MAX_KEPT:])
            self._known = merged
            self.cache.store_value(
                "verdicts", self.key, pickle.dumps(merged), "the stored abstract evaluations"
            )


def _store_for(cache: BlobStore | None) -> _Store | None:
    if cache is None or cache.directory is None:
        return None
    name = str(cache.directory)
    with _LOCK:
        store = _STORES.get(name)
        if store is None or store.cache.key_file != cache.key_file:
            store = _STORES[name] = _Store(cache)
        return store
