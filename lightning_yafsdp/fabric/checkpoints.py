"""``fabric.save`` / ``fabric.load`` / ``fabric.load_raw``: a Fabric state to and from the
checkpoint format the Trainer writes ([Note: one checkpoint format for Fabric and the
Trainer] in ``checkpoint/fabric_format.py``), through ``save_checkpoint`` and
``load_checkpoint``. Fabric's "stateful" objects are anything with ``state_dict()`` and
``load_state_dict()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_yafsdp.checkpoint import load_checkpoint, save_checkpoint
from lightning_yafsdp.checkpoint.background import BackgroundSaver
from lightning_yafsdp.checkpoint.errors import CheckpointMismatchError
from lightning_yafsdp.checkpoint.fabric_format import RESERVED_KEYS, read_checkpoint_extras
from lightning_yafsdp.checkpoint.full import FABRIC_KEYS
from lightning_yafsdp.checkpoint.optimizer_state import optimizer_entry
from lightning_yafsdp.checkpoint.sharded import FORMAT_KEY
from lightning_yafsdp.checkpoint.state import StateDictType, model_entry
from lightning_yafsdp.core import YaFSDPEngine

Filter = Mapping[str, Callable[[str, Any], bool]]


def save_fabric_checkpoint(
    path: str | os.PathLike,
    state: Mapping[str, Any],
    *,
    state_dict_type: StateDictType,
    filter: Filter | None = None,
    background: BackgroundSaver | None = None,
) -> None:
    """``fabric.save``: write a Fabric state (collective, atomic; ``background``: a sharded
    save is written by that saver)."""
    filter = dict(filter or {})
    module_key, module, engine = sharded_module_in(state, action="save")
    checkpoint: dict[str, Any] = {}
    optimizers: dict[str, Any] = {}
    for key, obj in state.items():
        if key in RESERVED_KEYS:
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
    save_checkpoint(
        path,
        engine,
        extra={**checkpoint, FABRIC_KEYS: names},
        state_dict_type=state_dict_type,
        model_state=_filtered(module_key, model_entry(engine, module, state_dict_type), filter),
        optimizer_states=list(optimizers.values()),
        background=background,
    )


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
    for key in RESERVED_KEYS:
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
