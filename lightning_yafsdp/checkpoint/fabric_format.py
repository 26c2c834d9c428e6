"""Fabric's ``fabric.save(path, state)`` / ``fabric.load(path, state)`` in the one format.

[Note: one checkpoint format for Fabric and the Trainer]
A Fabric state is a dict the user names, ``{"model": model, "optimizer": opt, "step": 3}``.
A sharded save is laid out as the Trainer's (``api.py``): the sharded
module's weights as the model entry, the optimizers' states in the order they appear,
every other entry in ``meta.pt``. A full file keeps Fabric's own layout, each entry under
the user's key (``torch.load(f)["model"]``, as Fabric's other strategies and litgpt's
scripts read it). Both record in ``FABRIC_KEYS`` which entry was the module and which
were the optimizers. So each front door reads what the other wrote, and ``yafsdp
inspect`` / ``export`` read both:

- Fabric loading a Trainer checkpoint: the module gets the weights, the optimizers the
  saved optimizer states in the order they are given in ``state``; the Trainer's own
  entries (``global_step``, ``loops``, ``callbacks``...) are returned, or put into
  ``state`` where it asks for them by name.
- Fabric loading a Fabric checkpoint: optimizers are matched by their names; a full file
  of Fabric's ``"ddp"`` / FSDP strategies by the keys given in ``state``.
- The Trainer loading a Fabric checkpoint: see ``as_trainer_checkpoint``.

Nothing here imports lightning: Fabric's "stateful" objects are anything with
``state_dict()`` and ``load_state_dict()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_yafsdp.checkpoint.api import load_checkpoint
from lightning_yafsdp.checkpoint.background import BackgroundSaver
from lightning_yafsdp.checkpoint.errors import CheckpointMismatchError
from lightning_yafsdp.checkpoint.full import (
    FABRIC_KEYS,
    OPTIMIZER_STATES_KEY,
    STATE_DICT_KEY,
    read_file,
    save_full,
    split_full_checkpoint,
)
from lightning_yafsdp.checkpoint.optimizer_state import optimizer_entry
from lightning_yafsdp.checkpoint.sharded import FORMAT_KEY, read_meta, save_sharded
from lightning_yafsdp.checkpoint.state import StateDictType, model_entry
from lightning_yafsdp.core import YaFSDPEngine

_RESERVED = (STATE_DICT_KEY, OPTIMIZER_STATES_KEY, FABRIC_KEYS, FORMAT_KEY)

Filter = Mapping[str, Callable[[str, Any], bool]]


def save_fabric_checkpoint(
    path: str | os.PathLike,
    state: Mapping[str, Any],
    *,
    state_dict_type: StateDictType,
    filter: Filter | None = None,
    background: BackgroundSaver | None = None,
) -> None:
    """Write a Fabric state (collective, atomic); ``filter`` as in ``fabric.save``.

    ``background``: a sharded save is written by that saver ([Note: background saves]).
    """
    filter = dict(filter or {})
    module_key, module, engine = sharded_module_in(state, action="save")
    checkpoint: dict[str, Any] = {}
    optimizers: dict[str, Any] = {}
    for key, obj in state.items():
        if key in _RESERVED:
            raise ValueError(
                f"fabric.save: the state key {key!r} is taken by the checkpoint format; rename it"
            )
        if isinstance(obj, torch.optim.Optimizer):
            if key in filter:
                raise ValueError(
                    f"fabric.save(filter={{{key!r}: ...}}) filters an optimizer; a part of an "
                    "optimizer's state cannot be loaded back. Filter the model's entries only"
                )
            optimizers[key] = optimizer_entry(engine, obj, state_dict_type)
        elif key != module_key:
            value = obj.state_dict() if _is_stateful(obj) else obj
            checkpoint[key] = _filtered(key, value, filter)
    names = {"module": module_key, "optimizers": list(optimizers), "entries": list(checkpoint)}
    model_state = _filtered(module_key, model_entry(engine, module, state_dict_type), filter)
    states = dict(model_state=model_state, optimizer_states=list(optimizers.values()))
    if state_dict_type == "full":
        save_full(path, engine, extra=checkpoint, fabric_keys=names, **states)
    else:
        extra = {**checkpoint, FABRIC_KEYS: names}
        save_sharded(path, engine, extra=extra, background=background, **states)


def load_fabric_checkpoint(
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    strict: bool = True,
    verify_checksums: bool = True,
) -> dict[str, Any]:
    """Restore ``state`` in place from a Fabric or Trainer checkpoint; return what is left.

    Collective. Checked before anything is loaded: the optimizers given match the saved
    ones, and (with ``strict``) every other entry of ``state`` is in the checkpoint.
    """
    module_key, _, engine = sharded_module_in(state, action="load")
    given = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    # What a Fabric file of another strategy holds under the keys of this state.
    expected = {"module": module_key, "optimizers": list(given)}
    extras = read_checkpoint_extras(path, expected)
    saved = (extras or {}).get(FABRIC_KEYS, {})
    optimizers = _optimizers_to_load(given, saved.get("optimizers"), path, strict=strict)
    requested = [key for key in state if key != module_key and key not in given]
    if strict and extras is not None:
        available = {*extras, *extras.get(FORMAT_KEY, {}).get("sharded_keys", ())}
        missing = [key for key in requested if key not in available]
        if missing:
            raise KeyError(
                f"The requested state contains a key {missing[0]!r} that does not exist in "
                f"the loaded checkpoint {str(path)!r}. To disable strict loading, set "
                "`strict=False`."
            )
    rest = load_checkpoint(
        path,
        engine,
        optimizers=list(optimizers.values()),
        strict=strict,
        expected={"module": module_key, "optimizers": list(optimizers)},
        verify_checksums=verify_checksums,
    )
    for key in _RESERVED:
        rest.pop(key, None)
    for key in requested:
        if key in rest:
            _restore_entry(state, key, rest.pop(key), strict=strict)
    return rest


def load_raw_into(
    path: str | os.PathLike, obj: Any, *, strict: bool = True, verify_checksums: bool = True
) -> None:
    """``fabric.load_raw``: a full state dict file (or our checkpoint's weights) into ``obj``."""
    if isinstance(obj, torch.optim.Optimizer):
        raise TypeError(
            "fabric.load_raw(path, optimizer) is not supported by YaFSDPStrategy: a raw "
            "optimizer state is keyed by position over the whole model. Save and load it "
            "with its model: fabric.load(path, {'model': model, 'optimizer': optimizer})"
        )
    engine = engine_of(obj, action="load_raw")
    load_checkpoint(path, engine, strict=strict, verify_checksums=verify_checksums)


def check_trainer_can_resume(extras: Mapping[str, Any] | None, *, num_schedulers: int) -> None:
    """Before loading: a Fabric checkpoint records no LR schedulers for a Trainer that has some.

    Which Fabric entry is which scheduler is unknown, and restoring none would silently
    restart their schedules.
    """
    if extras is None or FABRIC_KEYS not in extras or not num_schedulers:
        return
    raise CheckpointMismatchError(
        "this checkpoint was written by Fabric, which records no Trainer LR schedulers, "
        f"but the LightningModule configures {num_schedulers}; restore them yourself in "
        f"on_load_checkpoint from the Fabric entries {fabric_entries(extras)}, or resume "
        "without schedulers"
    )


def as_trainer_checkpoint(checkpoint: Any, *, lightning_version: str) -> Any:
    """A checkpoint written by ``fabric.save`` as the Trainer and ``load_from_checkpoint``
    read one (any other checkpoint unchanged).

    A Fabric loop records no Lightning version, Trainer loops or scheduler list: the
    loop counters start at 0, the user's own entries stay in the dict for
    ``LightningModule.on_load_checkpoint``, and a full file's weights, under the user's
    key, are also its ``"state_dict"``.
    """
    if not isinstance(checkpoint, dict) or FABRIC_KEYS not in checkpoint:
        return checkpoint
    checkpoint = dict(checkpoint)
    checkpoint.setdefault("pytorch-lightning_version", lightning_version)
    checkpoint.setdefault("lr_schedulers", [])
    module_key = checkpoint[FABRIC_KEYS].get("module")
    if STATE_DICT_KEY not in checkpoint and module_key in checkpoint:
        checkpoint[STATE_DICT_KEY] = checkpoint[module_key]
    return checkpoint


def fabric_entries(checkpoint: Mapping[str, Any]) -> list[str]:
    """The user's own entries of a checkpoint written by Fabric (step counters, ...)."""
    return list(checkpoint.get(FABRIC_KEYS, {}).get("entries", []))


# -- helpers ---------------------------------------------------------------------------------


def engine_of(obj: Any, *, action: str) -> YaFSDPEngine:
    """The engine of a module set up under ``strategy='yafsdp'``."""
    engine = obj.__dict__.get("_yafsdp_engine") if isinstance(obj, nn.Module) else None
    if engine is None:
        raise ValueError(
            f"fabric.{action} needs a model set up by fabric.setup(...) or "
            f"fabric.setup_module(...) under strategy='yafsdp'; got {type(obj).__name__}"
        )
    return engine


def sharded_module_in(state: Mapping[str, Any], *, action: str):
    """``(key, module, engine)`` of the one sharded module in a Fabric state."""
    found = [
        (key, obj, obj.__dict__["_yafsdp_engine"])
        for key, obj in state.items()
        if isinstance(obj, nn.Module) and "_yafsdp_engine" in obj.__dict__
    ]
    if not found:
        raise ValueError(
            f"fabric.{action} found no model set up by Fabric in the state (keys "
            f"{sorted(state)}); put it in, e.g. fabric.{action}(path, {{'model': model, ...}}), "
            "after model = fabric.setup(model)"
        )
    if len(found) > 1:
        raise ValueError(
            f"fabric.{action} found {len(found)} sharded models in the state "
            f"({[key for key, _, _ in found]}); a checkpoint holds one: {action} each with its "
            "own path"
        )
    return found[0]


def _optimizers_to_load(
    given: dict[str, torch.optim.Optimizer],
    saved_names: list[str] | None,
    path: Any,
    *,
    strict: bool,
) -> dict[str, torch.optim.Optimizer]:
    """The optimizers to load, in the order their states were saved."""
    if saved_names is None or not given:  # not written by fabric.save: by position
        return given
    if sorted(given) == sorted(saved_names):
        return {name: given[name] for name in saved_names}
    if not strict and not set(given) & set(saved_names):
        return {}  # none of them was saved: the weights only, as strict=False allows
    raise CheckpointMismatchError(
        f"checkpoint {str(path)!r} holds the optimizers {saved_names} but the state gives "
        f"{sorted(given)}; give all of them under the same names, or none (weights only)"
    )


def read_checkpoint_extras(
    path: str | os.PathLike, expected: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """The entries of a checkpoint beside its weights and optimizer states, read cheaply.

    For checks before a load starts; ``None`` if it cannot be read (the load itself then
    reports the damaged or missing checkpoint).
    """
    path = Path(path)
    try:
        if path.is_dir():
            return read_meta(path)
        return split_full_checkpoint(read_file(path), expected)[2]
    except Exception:  # noqa: BLE001 - see above
        return None


def _restore_entry(state: dict[str, Any], key: str, value: Any, *, strict: bool) -> None:
    obj = state[key]
    if isinstance(obj, nn.Module):
        obj.load_state_dict(value, strict=strict)
    elif _is_stateful(obj):
        obj.load_state_dict(value)
    else:
        state[key] = value


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _filtered(key: str, value: Any, filter: Filter) -> Any:
    # As fabric.save's filter: keeps the items of a dict entry for which filter[key] holds.
    if key not in filter or not isinstance(value, Mapping):
        return value
    return {k: v for k, v in value.items() if filter[key](k, v)}
