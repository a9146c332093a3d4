"""Checkpoints of a ``TrainStep``'s state (``TrainState``) with orbax-checkpoint, and
that state as torch's.

    step.save("ckpt")               # ckpt/<step count>/, written by orbax
    step.restore("ckpt")            # the latest one (or at=N)
    step.state_dict()               # the model's state dict, trained values, torch tensors
    step.save_safetensors("m.safetensors")

A checkpoint holds the parameters (the optimizer's and the frozen ones, which an op
may write: an embedding's ``max_norm``), buffers, the optimizer's state (keyed by parameter
name), PyTorch's RNG state (dropout's seeds are drawn from it) as arrays, and as JSON
the step count, each param group's hyperparameters and every array's name, shape and
dtype. An array with no elements (a parameter of shape ``(0, n)``, its moments) has
nothing to write and orbax refuses it, so it lives in the JSON layout only and is made
again, empty, at restore. orbax's ``CheckpointManager`` writes each checkpoint into a
temporary directory and renames it when complete, so a process killed during a save
leaves the previous checkpoint as it was. ``restore`` reads the JSON first and refuses
a checkpoint of another model (names, shapes or dtypes that differ) before anything
changes.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import torch

from dynajax.errors import TrainStepError
from dynajax.runtime.conversion import cpu_device
from dynajax.sharding.placement import gather_to_torch
from dynajax.training.state import TrainState


def _orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # an optional dependency
        raise TrainStepError(
            "step.save/restore use orbax-checkpoint: pip install orbax-checkpoint "
            "(or dynajax[checkpoint])."
        ) from e
    return ocp


def _manager(directory: str | os.PathLike[str]) -> Any:
    ocp = _orbax()
    return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)))


def _layout(arrays: dict[str, Any]) -> dict[str, list[Any]]:
    return {name: [list(a.shape), str(a.dtype)] for name, a in arrays.items()}


def _trees(step: TrainState) -> tuple[dict[str, Any], dict[str, Any]]:
    """The arrays (an orbax tree) and the JSON metadata of ``step``'s state."""
    names = step.param_names
    optimizer: dict[str, dict[str, Any]] = {}
    for (i, key), a in step.state.items():
        optimizer.setdefault(names[i], {})[key] = a
    params = dict(zip(names, step.params, strict=True))
    frozen = dict(zip(step.frozen_names, step.frozen, strict=True))
    buffers = dict(zip(step.buffer_names, step.buffers, strict=True))
    arrays = {
        "params": params,
        "frozen": frozen,
        "buffers": buffers,
        "optimizer": optimizer,
        "rng": torch.get_rng_state().numpy(),
    }
    meta = {
        "steps": step.steps,
        "params": _layout(params),
        "frozen": _layout(frozen),
        "buffers": _layout(buffers),
        "optimizer": {n: _layout(s) for n, s in optimizer.items()},
        "optimizer_class": type(step.optimizer).__name__,
        "param_groups": [
            {k: v for k, v in g.items() if k != "params" and _is_json(v)}
            for g in step.optimizer.param_groups
        ],
    }
    return arrays, meta


def _stored(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` without its arrays of no elements (orbax writes none; their shape and
    dtype are in the JSON layout)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out[key] = _stored(value)
        elif getattr(value, "size", 1) != 0:
            out[key] = value
    return out


def _is_json(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return all(_is_json(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def save(step: TrainState, directory: str | os.PathLike[str]) -> int:
    """Writes ``step``'s state as checkpoint number ``step.steps`` under ``directory``;
    returns that number."""
    ocp = _orbax()
    arrays, meta = _trees(step)
    manager = _manager(directory)
    manager.save(
        step.steps,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(_stored(arrays)), meta=ocp.args.JsonSave(meta)
        ),
        force=True,
    )
    manager.wait_until_finished()
    manager.close()
    return step.steps


def restore(step: TrainState, directory: str | os.PathLike[str], at: int | None = None) -> int:
    """Loads checkpoint ``at`` (the latest by default) from ``directory`` into ``step``;
    returns its number. Raises ``TrainStepError``, with ``step`` unchanged, for a
    missing checkpoint or one of another model or optimizer."""
    ocp = _orbax()
    manager = _manager(directory)
    try:
        number = manager.latest_step() if at is None else at
        if number is None or number not in manager.all_steps():
            raise TrainStepError(
                f"no checkpoint {'at all' if at is None else at} in {directory} "
                f"(it has {sorted(manager.all_steps())})."
            )
        saved = manager.restore(number, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        arrays, meta = _trees(step)
        _check_same_model(saved.meta, meta, directory)
        # Each array laid out as this step lays it out (on its own device or mesh,
        # whatever the saving run's was); the optimizer's state as saved (a step that
        # has not run yet has none).
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_sharding(a)), arrays
        )
        if "frozen" not in saved.meta:
            del target["frozen"]
        position = {n: i for i, n in enumerate(step.param_names)}
        target["optimizer"] = {
            name: {
                key: jax.ShapeDtypeStruct(
                    tuple(shape),
                    jax.numpy.dtype(dtype),
                    sharding=step.layout.state((position[name], key), shape),
                )
                for key, (shape, dtype) in keys.items()
            }
            for name, keys in saved.meta["optimizer"].items()
        }
        loaded = manager.restore(
            number, args=ocp.args.Composite(state=ocp.args.StandardRestore(_stored(target)))
        ).state
    finally:
        manager.close()

    def value(part: str, name: str, key: str | None = None) -> Any:
        where = loaded[part] if key is None else loaded[part].get(name, {})
        t = target[part][name] if key is None else target[part][name][key]
        found = where.get(name if key is None else key)
        return jax.numpy.zeros(t.shape, t.dtype, device=t.sharding) if found is None else found

    step.params = [value("params", n) for n in step.param_names]
    if "frozen" in saved.meta:  # (a checkpoint written before frozen ones were kept)
        step.frozen = [value("frozen", n) for n in step.frozen_names]
    step.buffers = [value("buffers", n) for n in step.buffer_names]
    step.state = {
        (position[name], key): value("optimizer", name, key)
        for name, keys in target["optimizer"].items()
        for key in keys
    }
    for group, hyper in zip(step.optimizer.param_groups, saved.meta["param_groups"], strict=True):
        group.update(
            {k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in hyper.items()}
        )
    torch.set_rng_state(torch.from_numpy(np.asarray(loaded["rng"]).copy()))
    step.steps = saved.meta["steps"]
    return number


def _sharding(a: Any) -> Any:
    """Where a restored array goes: where ``a`` is (the host's CPU for NumPy arrays)."""
    if isinstance(a, jax.Array):
        return a.sharding
    return jax.sharding.SingleDeviceSharding(cpu_device())


def _check_same_model(saved: dict[str, Any], ours: dict[str, Any], directory: Any) -> None:
    problems = []
    if saved["optimizer_class"] != ours["optimizer_class"]:
        problems.append(
            f"optimizer: {saved['optimizer_class']} saved, {ours['optimizer_class']} here"
        )
    for part in ("params", "frozen", "buffers"):
        if part not in saved:
            continue
        for name in sorted(set(saved[part]) | set(ours[part])):
            a, b = saved[part].get(name), ours[part].get(name)
            if a != b:
                problems.append(f"{part} '{name}': {a or 'absent'} saved, {b or 'absent'} here")
    if len(saved["param_groups"]) != len(ours["param_groups"]):
        problems.append(
            f"{len(saved['param_groups'])} param groups saved, {len(ours['param_groups'])} here"
        )
    if problems:
        shown = "\n".join(f"  - {p}" for p in problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise TrainStepError(
            f"the checkpoint in {directory} is of another model or optimizer; nothing was "
            f"loaded:\n{shown}{more}"
        )
    unknown = sorted(set(saved["optimizer"]) - set(ours["params"]))
    if unknown:
        raise TrainStepError(
            f"the checkpoint in {directory} holds optimizer state of parameters this "
            f"optimizer does not have ({unknown[:3]}); nothing was loaded."
        )


def state_dict(step: TrainState) -> dict[str, torch.Tensor]:
    """The model's state dict with the trained values, as torch tensors (copies; the
    module's hooks must be quiet: the module's own tensors are only read for names)."""
    values = dict(zip(step.param_names, step.params, strict=True))
    values.update(zip(step.frozen_names, step.frozen, strict=True))
    values.update(zip(step.buffer_names, step.buffers, strict=True))
    out = {}
    for name, tensor in step.model.state_dict(keep_vars=True).items():
        a = values.get(name)
        out[name] = tensor.detach().clone() if a is None else gather_to_torch(a).clone()
    return out


def save_safetensors(step: TrainState, path: str | os.PathLike[str]) -> None:
    """``state_dict(step)`` written as a safetensors file; a tied weight is stored
    once, under its first name (as ``save_pretrained`` does)."""
    from safetensors.torch import save_file

    tensors = state_dict(step)
    first: dict[int, str] = {}
    for name, t in step.model.state_dict(keep_vars=True).items():
        first.setdefault(id(t), name)
    save_file({n: tensors[n].contiguous() for n in first.values()}, os.fspath(path))
