"""InputCache: the jax.Arrays of inputs that come back unchanged, call after call.

Parameters and buffers reach a compiled graph as the same tensor objects on every call.
Converting a tensor costs ~3 µs inside ``jax.jit`` (a NumPy view becomes a device
buffer on each call); a ready ``jax.Array`` costs ~0.75 µs. So each input position keeps
the zero-copy ``jax.Array`` of the tensor it saw last, and reuses it while that same
tensor object comes back with the same storage pointer and version counter:

    call 1:  weight -> zero_copy_array(weight) -> cached     x -> cached
    call 2:  weight is weight, same version, same data_ptr -> reuse
             x is a new tensor -> position demoted: converted per call from now on,
             until a probe (every 16 calls) sees the same live object come back
             twice (a KV cache that each generate() call makes anew): cached again

A cached array *is* the tensor's memory (``zero_copy_array`` refuses anything else),
so in-place updates between calls (an optimizer step, ``.data.add_``, a NumPy write)
are seen by the next call as eager PyTorch sees them. Versions and pointers guard the
metadata: ``set_``/``resize_``/in-place view ops bump the version, ``p.data = q``
changes the pointer. A changed version with the same pointer, shape and strides (the
usual in-place update) keeps the array. On an accelerator torch writes on its own
stream, after the call that wrote returned: there one of the updated tensors is
imported afresh for that call (``fence``), and the call waits for torch's stream.

Lifetimes: the cache holds a weak reference to each tensor and an array over a
*detached* alias of its storage, so it never keeps a caller's tensor object alive; when
the tensor dies its array is dropped and the position demoted (a new object will come).

Thread safety: the hot path reads one immutable snapshot (the arrays and the positions
converted per call, together); a refresh builds a new one.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Sequence
from itertools import compress
from typing import Any

import torch

_version = operator.attrgetter("_version")
_RIGHT = True  # InputCache._still_right: the snapshot's arrays are right as they are
_data_ptr = torch.Tensor.data_ptr
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PROBE_EVERY = 16  # calls between two looks at the positions converted per call


class _Snapshot:
    __slots__ = ("get", "ids", "versions", "ptrs", "arrays", "refs", "meta", "volatile")

    def __init__(
        self,
        get: Callable[[Sequence[Any]], Sequence[Any]],
        ids: tuple[int, ...],
        versions: tuple[int, ...],
        ptrs: tuple[int, ...],
        arrays: list[Any],
        refs: dict[int, weakref.ref],
        meta: dict[int, tuple[Any, ...]],
        volatile: list[int],
    ) -> None:
        self.get = get
        self.ids = ids
        self.versions = versions
        self.ptrs = ptrs
        self.arrays = arrays  # one slot per input; None where converted per call
        self.refs = refs
        self.meta = meta  # position -> (version, data_ptr, shape, stride)
        # The positions converted per call with these arrays. Kept with them, not read
        # from the cache: a refresh in another thread may change the cache's meanwhile.
        self.volatile = volatile


def _identity(ts: Sequence[Any]) -> Sequence[Any]:
    return ts


def _per_position(
    fn: Callable[[torch.Tensor], Any] | Sequence[Callable[[torch.Tensor], Any]], n: int
) -> list[Callable[[torch.Tensor], Any]]:
    if callable(fn):
        return [fn] * n
    fns = list(fn)
    if len(fns) != n:
        raise ValueError(f"InputCache: {len(fns)} converters for {n} inputs")
    return fns


def _getter(positions: Sequence[int], n: int) -> Callable[[Sequence[Any]], Sequence[Any]]:
    if list(positions) == list(range(n)):
        return _identity
    if len(positions) == 1:
        (i,) = positions
        return lambda ts: (ts[i],)
    return operator.itemgetter(*positions)


class InputCache:
    """Per-position memo of zero-copy ``jax.Array``s for a partition's inputs.

    Args:
        n: number of inputs.
        convert: the per-call converter (tensor -> JAX-consumable value), or one per
            position (a placement gives each input its own sharding).
        make_cached: tensor -> zero-copy ``jax.Array`` or None (not cacheable); or one
            per position (under ``device=``/``mesh=``: the resident copy on the device
            or mesh).
        same_layout_reuse: keep an array across a version bump when pointer, shape and
            strides are unchanged. Right where the arrays are the tensors' memory and
            torch's writes are synchronous (the CPU); False for resident copies on
            another device (``device=``, ``mesh=``), which a write makes stale.
        fence_writes: the arrays are the tensors' memory on an accelerator, where
            torch's writes are queued on its stream: a call after a version bump keeps
            the arrays but imports one of the bumped tensors afresh (``make_cached``, a
            DLPack import, which orders JAX after torch's current stream) and passes
            that array in its slot. An XLA execution waits for every argument's
            definition event, so it then starts after all of torch's writes queued so
            far, however many tensors they touched: one import per such call, where
            every bumped tensor used to be imported and the snapshot rebuilt (~100 µs
            per tensor on an H100; an optimizer step bumps every parameter).
    """

    def __init__(
        self,
        n: int,
        convert: Callable[[torch.Tensor], Any] | Sequence[Callable[[torch.Tensor], Any]],
        make_cached: Callable[[torch.Tensor], Any] | Sequence[Callable[[torch.Tensor], Any]],
        *,
        same_layout_reuse: bool = True,
        fence_writes: bool = False,
    ) -> None:
        self._n = n
        self._convert = _per_position(convert, n)
        self._make_cached = _per_position(make_cached, n)
        self._same_layout_reuse = same_layout_reuse
        self._fence_writes = fence_writes
        self._candidates: list[int] = list(range(n))
        self._snap: _Snapshot | None = None
        self._prev: _Snapshot | None = None  # the last snapshot, also once invalidated
        self._died: set[int] = set()
        self._self_ref = weakref.ref(self)
        self._countdown = _PROBE_EVERY
        self._watched: list[tuple[int, weakref.ref]] | None = None
        self._refused: set[int] = set()  # positions whose tensor had no cached array

    @property
    def cached_positions(self) -> list[int]:
        """Positions whose arrays are currently reused (for tests and reports)."""
        return list(self.resident)

    @property
    def resident(self) -> dict[int, Any]:
        """The arrays currently kept for reuse, by input position (for tests, reports,
        and the placement of state: under ``device=`` they live on that device). After an
        input died (a temporary), the arrays still held for the others."""
        snap = self._snap or self._prev
        if snap is None:
            return {}
        return {i: a for i, a in enumerate(snap.arrays) if a is not None}

    def hit(self, ts: Sequence[torch.Tensor]) -> _Snapshot | None:
        """The current snapshot if every input it caches has its array still right (the
        same object at the same pointer, and the same version, or the same sizes and
        strides where arrays are the tensors' own memory), else None.

        ``snapshot.arrays`` are then exactly the arguments ``arrays(ts)`` would return,
        except at ``snapshot.volatile``, the positions converted per call.
        """
        snap = self._snap
        if snap is not None and self._still_right(snap, ts, fence=False) is _RIGHT:
            return self._sampled(snap, ts)
        return None

    def _still_right(self, snap: _Snapshot, ts: Sequence[torch.Tensor], fence: bool = True) -> Any:
        """Whether ``snap``'s arrays are right for ``ts``: the same objects at the same
        pointers, and the same versions or, where arrays are the tensors' own memory,
        the same sizes and strides. ``_RIGHT``, or ``None`` (not right), or, on an
        accelerator after in-place updates, ``(position, array)``: the arrays are right
        once the one in that slot is replaced by ``array`` for this call (``fence``;
        without it, such a call is not right, and the snapshot is left as it was)."""
        if tuple(map(id, c := snap.get(ts))) != snap.ids or tuple(map(_data_ptr, c)) != snap.ptrs:
            return None
        versions = tuple(map(_version, c))
        if versions == snap.versions:
            return _RIGHT
        if not (self._same_layout_reuse or self._fence_writes):
            return None  # resident copies: a write made them stale
        # In-place updates since the last call (a KV cache written every decode step, an
        # optimizer step): the arrays are the tensors' memory, so they stay right while
        # sizes and strides are unchanged. The snapshot then records the new versions,
        # so the next call with no update takes the first test. Only the inputs whose
        # versions moved are read (C-level selection: a decode step's 8 KV buffers
        # among 50 inputs).
        moved = list(map(operator.ne, versions, snap.versions))
        for t, (_, _, shape, stride) in zip(
            compress(c, moved), compress(snap.meta.values(), moved), strict=True
        ):
            if t.shape != shape or t.stride() != stride:
                return None
        verdict: Any = _RIGHT
        if self._fence_writes:
            # Accelerator: torch's writes may still be queued on its stream.
            if not fence:
                return None
            i = list(snap.meta)[moved.index(True)]
            fresh = self._make_cached[i](ts[i])
            if fresh is None:
                return None
            verdict = (i, fresh)
        snap.versions = versions
        return verdict

    def hit_guarded(self, ts: Sequence[torch.Tensor]) -> _Snapshot | None:
        """``hit`` for inputs whose dtypes, sizes and strides the caller has checked
        (Dynamo's guards, which fix them for every input before a compiled frame runs).
        Where arrays are the tensors' own memory (``same_layout_reuse``), the same data
        pointers suffice: versions are not read (a version bump with the same pointer,
        sizes and strides keeps the array, as in ``hit``), and neither are identities.
        While a snapshot stands, every tensor it caches is alive (a death drops the
        snapshot, ``_on_death``) and its array holds that tensor's storage, so no other
        memory can sit at a cached pointer: a tensor found there with the guarded
        layout (another view of the same storage, ``p.data`` set to one) reads the very
        bytes the array does. Elsewhere (resident copies on another device, and an
        accelerator's arrays, which need a fence after a write) this is ``hit``.
        """
        if not self._same_layout_reuse:
            return self.hit(ts)
        snap = self._snap
        if snap is not None and tuple(map(_data_ptr, snap.get(ts))) == snap.ptrs:
            return self._sampled(snap, ts)
        return None

    def _sampled(self, snap: _Snapshot, ts: Sequence[torch.Tensor]) -> _Snapshot:
        n = self._countdown - 1
        if n:
            self._countdown = n
            return snap
        self._probe(snap, ts)
        return snap

    def _probe(self, snap: _Snapshot, ts: Sequence[torch.Tensor]) -> None:
        """Every ``_PROBE_EVERY`` calls, a look at the positions converted per call (one
        new object demotes a position): their tensors are remembered
        weakly, and at the next call a position whose tensor is the very same live
        object again goes back to the candidates, and the snapshot is rebuilt at the
        call after, with that tensor's array cached. ``generate()`` makes a new KV cache
        per call, which then comes back call after call for the whole generation: 14 of
        a LLaMA decode step's inputs were put into arrays on every step (175 µs a step).
        A temporary made anew each call is a new object or a dead one (its id may be
        reused; the weak reference tells). A position whose tensor could not be cached
        (not zero-copy, made in inference mode) is not probed: it would be refreshed for
        nothing every 17 calls. Probes run on the cached path only: a graph none of
        whose inputs is cached has no snapshot, and converts every input."""
        watched = self._watched
        if watched is None:
            refused = self._refused
            self._watched = [
                (i, weakref.ref(t))
                for i in snap.volatile
                if i not in refused and type(t := ts[i]) in _PLAIN
            ]
            self._countdown = 1
            return
        self._watched = None
        self._countdown = _PROBE_EVERY
        back = [i for i, ref in watched if ref() is ts[i]]
        if back:
            self._candidates = sorted({*self._candidates, *back})
            self._died.difference_update(back)
            self._snap = None  # rebuilt by the next call's ``arrays``

    @property
    def current(self) -> _Snapshot | None:
        """The snapshot in use (None until an input is cached, and after one died)."""
        return self._snap

    def arrays(self, ts: Sequence[torch.Tensor]) -> list[Any]:
        """The JAX arguments for the tensors ``ts``, one per input."""
        snap = self._snap
        right = self._still_right(snap, ts) if snap is not None else None
        if right is not None:
            out = snap.arrays.copy()  # type: ignore[union-attr]
            volatile = snap.volatile  # type: ignore[union-attr]
            if right is not _RIGHT:
                i, out[i] = right
        else:
            out, volatile = self._refresh(ts)
        convert = self._convert
        for i in volatile:
            out[i] = convert[i](ts[i])
        return out

    # -- slow path: some cached input changed ------------------------------------------

    def _refresh(self, ts: Sequence[torch.Tensor]) -> tuple[list[Any], list[int]]:
        prev = self._snap or self._prev
        died, self._died = self._died, set()
        keep: list[int] = []
        arrays: list[Any] = [None] * self._n
        refs: dict[int, weakref.ref] = {}
        meta: dict[int, tuple[Any, ...]] = {}
        for i in self._candidates:
            t = ts[i]
            if type(t) not in _PLAIN:
                continue  # subclasses and non-tensors: converted per call
            old_ref = prev.refs.get(i) if prev is not None else None
            if i in died or (old_ref is not None and old_ref() is not t):
                continue  # a different object than last time: an activation
            arr = self._reuse(prev, i, t) if prev is not None and old_ref is not None else None
            if arr is None:
                arr = self._make_cached[i](t)
            if arr is None:
                self._refused.add(i)  # (not zero-copy, inference mode: never probed)
                continue
            keep.append(i)
            arrays[i] = arr
            refs[i] = old_ref if old_ref is not None else weakref.ref(t, self._on_death(i))
            meta[i] = (t._version, t.data_ptr(), t.shape, t.stride())
        self._candidates = keep
        volatile = [i for i in range(self._n) if arrays[i] is None]
        snap = None
        if keep:
            c = [ts[i] for i in keep]
            snap = _Snapshot(
                _getter(keep, self._n),
                tuple(map(id, c)),
                tuple(map(_version, c)),
                tuple(map(_data_ptr, c)),
                arrays,
                refs,
                meta,
                volatile,
            )
        self._snap = snap
        self._prev = snap
        return arrays.copy(), volatile

    def _reuse(self, prev: _Snapshot, i: int, t: torch.Tensor) -> Any:
        arr = prev.arrays[i]
        if arr is None:
            return None
        version, ptr, shape, stride = prev.meta[i]
        if t.data_ptr() != ptr:
            return None
        if t._version == version:
            return arr
        if self._same_layout_reuse and t.shape == shape and t.stride() == stride:
            return arr
        return None

    def _on_death(self, i: int) -> Callable[[weakref.ref], None]:
        self_ref = self._self_ref

        def drop(_: weakref.ref) -> None:
            cache = self_ref()
            if cache is not None:
                cache._died.add(i)
                cache._snap = None  # ids may be reused from here on
                prev = cache._prev
                if prev is not None:
                    prev.arrays[i] = None  # release the storage now

        return drop
