"""Each strategy argument checked, and spelled the way the rest of the code expects it.

[Note: arguments checked in the constructor]
A bad argument found after the processes launched costs a user the launch (seconds
to minutes on a cluster) and a page of traceback from every rank; one that is never
found trains the wrong thing. So ``ShardingOptions`` (``options.py``) passes every
argument through one checker here when either strategy is constructed: it returns
the value in its canonical form (``"bf16"`` -> ``torch.bfloat16``, 30 -> a
``timedelta``) or raises a one-line ``TypeError`` / ``ValueError`` that names the
argument, repeats what it got and says what it accepts. What needs the world size
(a shard size that divides it, a mesh that covers it) is checked by
``check_world_size`` as soon as Lightning knows the devices and nodes
(``set_world_ranks``, called while the Trainer or Fabric object is built), before
any process is launched and before any collective.

YAML and LightningCLI write dtypes and durations as strings and numbers, so those
spellings are accepted too (``reduce_dtype: bfloat16``, ``timeout: 600``).
"""

from __future__ import annotations

import importlib
import inspect
import operator
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

# Spellings of each reduce dtype a YAML file or a command line may use.
_REDUCE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "32": torch.float32,
    "torch.float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
}
_REDUCE_DTYPES_ACCEPTED = (
    "torch.float32 (or 'float32', 'fp32') or torch.bfloat16 (or 'bfloat16', 'bf16')"
)
_BACKENDS = tuple(b for b in dist.Backend.backend_list if b not in ("undefined", "fake"))


def refuse(name: str, value: Any, accepts: str, *, error: type[Exception] = ValueError) -> NoReturn:
    """The one-line error every checker raises: the argument, what it got, what it accepts."""
    raise error(f"{name}={_shown(value)} is not accepted: {name}= takes {accepts}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_list(value: Any) -> bool:
    """A list, a tuple or another sequence (omegaconf's ListConfig), not a string."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _is_module_class(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, nn.Module)


# -- the sharding arguments ------------------------------------------------------------------


def check_units(name: str, value: Any) -> Any:
    accepts = (
        "None (auto-detect the repeated blocks), an nn.Module subclass, a non-empty list of "
        "subclasses or of module names (e.g. ['model.layers.0']), or a predicate "
        "(name, module) -> bool"
    )
    if value is None or _is_module_class(value):
        return value
    if _is_list(value):
        if value and (
            all(_is_module_class(u) for u in value) or all(isinstance(u, str) for u in value)
        ):
            return value if isinstance(value, (list, tuple)) else list(value)
        refuse(name, value, accepts)
    if callable(value) and not isinstance(value, type):
        return _callable_taking(name, value, 2, accepts)
    refuse(name, value, accepts, error=TypeError)


def check_norm_classes(name: str, value: Any) -> Any:
    accepts = (
        "None (LayerNorm/RMSNorm/GroupNorm and *RMSNorm/*LayerNorm classes), an nn.Module "
        "subclass or its import path ('torch.nn.LayerNorm'), a list of them, or () for no "
        "norm group"
    )
    if value is None:
        return None
    items = value if _is_list(value) else (value,)
    classes = tuple(_module_class(name, item, accepts) for item in items)
    return classes if _is_list(value) else classes[0]


def _module_class(name: str, value: Any, accepts: str) -> type:
    if _is_module_class(value):
        return value
    if isinstance(value, str) and "." in value:
        module_path, _, attribute = value.rpartition(".")
        try:
            found = getattr(importlib.import_module(module_path), attribute)
        except (ImportError, AttributeError):
            refuse(name, value, accepts + f"; '{value}' does not import")
        if _is_module_class(found):
            return found
    refuse(name, value, accepts, error=TypeError)


def check_zero_stage(name: str, value: Any) -> int:
    if _is_int(value) and value in (2, 3):
        return value
    refuse(name, value, "3 (weights re-gathered in backward) or 2 (kept from forward)")


def check_reduce_dtype(name: str, value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in (torch.float32, torch.bfloat16):
        return value
    if isinstance(value, str) and value.strip().lower() in _REDUCE_DTYPES:
        return _REDUCE_DTYPES[value.strip().lower()]
    refuse(name, value, _REDUCE_DTYPES_ACCEPTED)


def check_activation_checkpointing(name: str, value: Any) -> Any:
    accepts = (
        "None, 'all', a list of block indices (non-negative integers), a block class or a "
        "list of classes, or a predicate (index, name) -> bool"
    )
    if value is None or value == "all" or _is_module_class(value):
        return value
    if _is_list(value):
        if all(_is_int(i) and i >= 0 for i in value) or (
            value and all(_is_module_class(c) for c in value)
        ):
            return value if isinstance(value, (list, tuple)) else list(value)
        refuse(name, value, accepts)
    if callable(value) and not isinstance(value, type):
        return _callable_taking(name, value, 2, accepts)
    refuse(name, value, accepts, error=TypeError if not isinstance(value, str) else ValueError)


def check_param_init_fn(name: str, value: Any) -> Any:
    accepts = (
        "None (the LightningModule's init_submodule(module), else the model's own "
        "reset_parameters / _init_weights) or a callable (module) -> None"
    )
    if value is None:
        return None
    if callable(value) and not isinstance(value, type):
        return _callable_taking(name, value, 1, accepts)
    refuse(name, value, accepts, error=TypeError)


def _callable_taking(name: str, fn: Callable, count: int, accepts: str) -> Callable:
    """``fn`` if it can be called with ``count`` positional arguments (when that is knowable)."""
    try:
        inspect.signature(fn).bind(*range(count))
    except TypeError:
        refuse(name, fn, accepts + f"; this callable cannot take {count} positional argument(s)")
    except ValueError:
        pass  # builtins without a signature: taken on trust
    return fn


def check_optional_bool(name: str, value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    refuse(
        name, value, "True, False or None (decide from how the model was built)", error=TypeError
    )


def check_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    refuse(name, value, "True or False", error=TypeError)


def check_blocks_per_unit(name: str, value: Any) -> int | str:
    if isinstance(value, str) and value == "auto":
        return value
    if not isinstance(value, bool) and hasattr(value, "__index__") and operator.index(value) >= 1:
        return operator.index(value)  # a numpy integer too
    refuse(name, value, "'auto' or a whole number of blocks >= 1 (1: one block per unit)")


def check_timeout(name: str, value: Any) -> timedelta | None:
    accepts = (
        "a datetime.timedelta or a number of seconds greater than 0, or None (torch's default)"
    )
    if value is None:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        refuse(name, value, accepts, error=TypeError)
    if not seconds > 0:  # also refuses NaN
        refuse(name, value, accepts)
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


def check_process_group_backend(name: str, value: Any) -> str | None:
    accepts = (
        f"None (gloo on CPU, nccl on CUDA), one of {', '.join(map(repr, _BACKENDS))}, or "
        "per device ('cpu:gloo,cuda:nccl'), available in this torch build"
    )
    if value is None:
        return None
    if not isinstance(value, str):
        refuse(name, value, accepts, error=TypeError)
    spelled = value.strip().lower()
    for part in spelled.split(","):
        device, _, backend = part.strip().rpartition(":")
        if backend not in _BACKENDS or (device and device not in ("cpu", "cuda", "xpu")):
            refuse(name, value, accepts)
        if not dist.is_backend_available(backend):
            refuse(name, value, accepts + f"; '{backend}' is not available here")
    return spelled


def check_state_dict_type(name: str, value: Any) -> str:
    if value in ("sharded", "full"):
        return value
    refuse(name, value, "'sharded' or 'full' (a DCP directory every rank writes, or one file)")


def check_shard_size(name: str, value: Any) -> int | None:
    if value is None or (_is_int(value) and value >= 1):
        return value
    refuse(
        name,
        value,
        "None (one node's ranks, or every rank) or a positive integer that "
        "divides devices x num_nodes",
    )


def check_device_mesh(name: str, value: Any) -> Any:
    accepts = (
        "None, (replicas, shard_size) as two positive integers (YAML: [2, 4]), or a DeviceMesh "
        "(1-D, or 2-D with mesh_dim_names=('replicate', 'shard'))"
    )
    if value is None:
        return None
    if _is_list(value):
        if len(value) == 2 and all(_is_int(n) and n >= 1 for n in value):
            return tuple(value)
        refuse(name, value, accepts)
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(value, DeviceMesh):
        refuse(name, value, accepts, error=TypeError if not isinstance(value, str) else ValueError)
    names = tuple(value.mesh_dim_names or ())
    if value.ndim == 1 or (value.ndim == 2 and names == ("replicate", "shard")):
        return value
    refuse(name, value, accepts + f"; this one has {value.ndim} dimension(s) named {names}")


SHARDING_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "units": check_units,
    "norm_classes": check_norm_classes,
    "zero_stage": check_zero_stage,
    "reduce_dtype": check_reduce_dtype,
    "activation_checkpointing": check_activation_checkpointing,
    "param_init_fn": check_param_init_fn,
    "sync_module_states": check_optional_bool,
    "cast_forward_inputs": check_bool,
    "vocab_chunks": check_bool,
    "blocks_per_unit": check_blocks_per_unit,
    "timeout": check_timeout,
    "process_group_backend": check_process_group_backend,
    "state_dict_type": check_state_dict_type,
    "verify_checksums": check_bool,
    "async_save": check_bool,
    "shard_size": check_shard_size,
    "device_mesh": check_device_mesh,
}


# -- Lightning's plumbing (the connector usually fills these in) ------------------------------


def check_plumbing(arguments: dict[str, Any]) -> None:
    """Type checks of the arguments both strategies hand to Lightning's base class.

    The precision plugin is checked by the strategies' precision setters
    (``dtype_policy.adopt_flag_plugin``), which the base class calls.
    """
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment

    _check_instance("cluster_environment", arguments["cluster_environment"], ClusterEnvironment)
    _check_instance("checkpoint_io", arguments["checkpoint_io"], CheckpointIO)
    _check_accelerator(arguments["accelerator"])
    devices = arguments["parallel_devices"]
    if devices is not None and not (
        isinstance(devices, Sequence)
        and not isinstance(devices, str)
        and devices
        and all(isinstance(d, torch.device) for d in devices)
    ):
        refuse(
            "parallel_devices",
            devices,
            "None (from Trainer/Fabric devices=) or a non-empty list of torch.device",
            error=TypeError,
        )


def _check_instance(name: str, value: Any, kind: type) -> None:
    if value is not None and not isinstance(value, kind):
        refuse(name, value, f"None or a {kind.__name__} instance", error=TypeError)


def _check_accelerator(value: Any) -> None:
    from lightning.fabric.accelerators import Accelerator as FabricAccelerator

    kinds: tuple[type, ...] = (FabricAccelerator,)
    # The Trainer's accelerators are their own class; where lightning.pytorch is not
    # loaded (a Fabric program, which must not load it) none can exist.
    trainer_accelerators = sys.modules.get("lightning.pytorch.accelerators")
    if trainer_accelerators is not None:
        kinds += (trainer_accelerators.Accelerator,)
    if value is not None and not isinstance(value, kinds):
        refuse(
            "accelerator",
            value,
            "None (Trainer/Fabric accelerator= sets it) or an Accelerator instance",
            error=TypeError,
        )


# -- what needs the world size -----------------------------------------------------------------


def check_against_run(options: Any, *, world_size: int, device_type: str) -> None:
    """What the constructor could not know: the world size (``devices x num_nodes``) and
    the device type, against ``shard_size``, ``device_mesh`` and the backend. No collective.
    """
    mesh = options.device_mesh
    if isinstance(mesh, tuple):
        replicas, shard_size = mesh
        if replicas * shard_size != world_size:
            raise ValueError(
                f"device_mesh={mesh} has {replicas * shard_size} ranks but the run has "
                f"{world_size} (devices x num_nodes): give (replicas, shard_size) with "
                f"replicas x shard_size = {world_size}"
            )
    elif mesh is not None and mesh.size() != world_size:
        raise ValueError(
            f"device_mesh covers {mesh.size()} ranks but the run has {world_size} (devices x "
            "num_nodes): build the mesh over every rank"
        )
    if options.shard_size is not None:
        from lightning_yafsdp.core.comm.mesh import check_shard_size as divides_world

        divides_world(options.shard_size, world_size)
    backend = options.process_group_backend
    if backend is not None and "," not in backend:
        serves = dist.Backend.default_device_backend_map
        wanted = backend.rpartition(":")[2]
        if device_type in serves and wanted in ("nccl", "xccl") and serves[device_type] != wanted:
            raise ValueError(
                f"process_group_backend={backend!r} cannot serve {device_type} devices: use "
                f"{serves[device_type]!r} (or None to choose from the device), or "
                "accelerator='gpu'"
            )
