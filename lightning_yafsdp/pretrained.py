"""``from_pretrained`` inside ``configure_model``: built on meta, loaded one group at a time.

transformers refuses ``from_pretrained`` under a meta-device context (it wants to load
weights), which is where the strategy runs ``configure_model``. Inside that context,
:func:`lazy_from_pretrained` makes ``PreTrainedModel.from_pretrained`` build the model
from its config on the meta device (free) and attach a :class:`SafetensorsSource` that
names, for each parameter and persistent buffer, the checkpoint file and key holding
it. ``shard_model`` then materializes the model one flat group at a time and copies
each group's tensors straight from the file (``core/plan/materialize.py``), so a rank never
holds more than one unsharded group: the same peak as a freshly initialized meta model.
Tensors the checkpoint lacks (a new head) are initialized by the model's own
``_init_weights``, as ``from_pretrained`` would.

What cannot be served this way (a hub id that is not a local directory, ``.bin``
checkpoints, quantization, device maps, renamed legacy keys, extra model arguments) is
loaded the ordinary way, with real tensors, under ``torch.device("cpu")``: correct,
but every rank then holds the whole model until ``setup`` shards it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_yafsdp.core.plan.materialize import TENSOR_SOURCE_ATTR

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_ADAPTER_FILE = "adapter_config.json"  # a PEFT adapter: transformers loads it on top
# from_pretrained arguments the lazy path honours: the model's own, and hub arguments
# that mean nothing for a local directory. Any other one takes the ordinary path.
_LAZY_KWARGS = frozenset(
    {"config", "dtype", "torch_dtype", "attn_implementation", "use_safetensors",
     "low_cpu_mem_usage", "trust_remote_code", "code_revision", "revision", "cache_dir",
     "force_download", "proxies", "token", "local_files_only", "_from_auto", "_commit_hash"}
)  # fmt: skip
# Arguments the lazy path accepts only when empty (AutoModel passes them along).
_EMPTY_KWARGS = frozenset({"adapter_kwargs", "subfolder"})


class SafetensorsSource:
    """Saved tensors of a meta-built model, read one tensor at a time from safetensors files.

    Tensors are found by identity, not by name, so the model may be wrapped or its
    modules renamed after ``from_pretrained`` (a PEFT wrapper keeps the same tensors).

    Args:
        entries: ``(meta tensor, file path, key in that file)`` per tensor of the model.
    """

    def __init__(self, entries: list[tuple[torch.Tensor, str, str]]) -> None:
        # The meta tensors are kept alive, so that their ids stay theirs.
        self._entries = {id(tensor): (tensor, path, key) for tensor, path, key in entries}
        self._read: set[str] = set()
        self._files: dict[str, Any] = {}

    def locate(self, tensor: torch.Tensor) -> tuple[str, str] | None:
        """``(file, key)`` holding ``tensor``'s saved value, or None if it has none."""
        entry = self._entries.get(id(tensor))
        return None if entry is None else entry[1:]

    def read(self, where: tuple[str, str]) -> torch.Tensor:
        """The saved tensor at ``where`` (from :meth:`locate`), as a CPU tensor."""
        path, key = where
        handle = self._files.get(path)
        if handle is None:
            from safetensors import safe_open

            handle = self._files[path] = safe_open(path, framework="pt", device="cpu")
        self._read.add(key)
        return handle.get_tensor(key)

    def not_read(self) -> list[str]:
        """Checkpoint keys whose tensor was never read (the model lost that tensor)."""
        return sorted({key for _, _, key in self._entries.values()} - self._read)

    def close(self) -> None:
        self._files.clear()


@contextmanager
def lazy_from_pretrained() -> Iterator[None]:
    """Within this context, ``from_pretrained`` returns a meta model that loads lazily.

    A no-op when transformers is not installed. Entered before the meta-device context:
    transformers loads ``modeling_utils`` lazily, on first use of a model class, which
    ``configure_model`` itself may be (``from transformers import ...`` inside it), so it
    is imported here, on the real device, if it is not yet.
    """
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None:
        if importlib.util.find_spec("transformers") is None:
            yield
            return
        modeling_utils = importlib.import_module("transformers.modeling_utils")
    pretrained_class = modeling_utils.PreTrainedModel
    original = pretrained_class.__dict__["from_pretrained"]

    def from_pretrained(cls, path, *model_args, **kwargs):
        model = _lazy_load(cls, path, model_args, kwargs)
        if model is not None:
            return model
        # Real tensors for what the lazy path cannot serve (see the module docstring).
        with torch.device("cpu"):
            return original.__func__(cls, path, *model_args, **kwargs)

    pretrained_class.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        pretrained_class.from_pretrained = original


def _lazy_load(cls, path, model_args, kwargs) -> nn.Module | None:
    if model_args or kwargs.get("use_safetensors") is False:
        return None
    for name, value in kwargs.items():
        if name not in _LAZY_KWARGS and not (name in _EMPTY_KWARGS and _is_empty(value)):
            return None
    directory = Path(path) if isinstance(path, (str, os.PathLike)) else None
    if directory is None or not directory.is_dir() or (directory / _ADAPTER_FILE).exists():
        return None
    files = _checkpoint_files(directory)
    if files is None:
        return None
    config = kwargs.get("config")
    if config is None:
        config = cls.config_class.from_pretrained(directory)
    elif not hasattr(config, "to_dict"):
        return None
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype in (None, "auto"):
        dtype = config.dtype or _saved_float_dtype(files)
    build_kwargs = {"dtype": dtype}
    if "attn_implementation" in kwargs:
        build_kwargs["attn_implementation"] = kwargs["attn_implementation"]
    with torch.device("meta"):
        model = cls._from_config(config, **build_kwargs)
    entries = _match_keys(model, files)
    if entries is None:
        return None
    model.__dict__[TENSOR_SOURCE_ATTR] = SafetensorsSource(entries)
    _load_generation_config(model, directory)
    return model.eval()  # as from_pretrained returns it


def _is_empty(value: Any) -> bool:
    if isinstance(value, dict):
        return all(v is None for v in value.values())
    return not value


def _checkpoint_files(directory: Path) -> dict[str, list[str]] | None:
    """``{file path: [keys]}`` of the directory's safetensors checkpoint, or None."""
    from safetensors import safe_open

    if (directory / _INDEX_FILE).is_file():
        weight_map = json.loads((directory / _INDEX_FILE).read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    elif (directory / _SINGLE_FILE).is_file():
        names = [_SINGLE_FILE]
    else:
        return None
    files = {}
    for name in names:
        with safe_open(str(directory / name), framework="pt", device="cpu") as handle:
            files[str(directory / name)] = list(handle.keys())
    return files


def _saved_float_dtype(files: dict[str, list[str]]) -> torch.dtype | None:
    from safetensors import safe_open

    for path, keys in files.items():
        with safe_open(path, framework="pt", device="cpu") as handle:
            for key in keys:
                dtype = handle.get_slice(key).get_dtype()
                if dtype in ("F32", "F16", "BF16", "F64"):
                    return {"F32": torch.float32, "F16": torch.float16,
                            "BF16": torch.bfloat16, "F64": torch.float64}[dtype]  # fmt: skip
    return None


def _match_keys(model: nn.Module, files: dict[str, list[str]]) -> list | None:
    """``(tensor, file, key)`` for each model tensor the checkpoint holds.

    Exact names, or names that differ by the model's ``base_model_prefix`` (a base
    checkpoint loaded into a model with a head); a tied tensor under any of its names.
    None if the checkpoint holds keys nothing matches (legacy names transformers would
    rename): the ordinary path then.
    """
    where = {key: path for path, keys in files.items() for key in keys}
    prefix = getattr(model, "base_model_prefix", "") or ""
    names_of: dict[int, tuple[torch.Tensor, list[str]]] = {}
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.state_dict(keep_vars=True).items(),
    ]
    for name, tensor in named:
        names_of.setdefault(id(tensor), (tensor, []))[1].append(name)
    entries, used = [], set()
    for tensor, names in names_of.values():
        candidates = [f"{p}{n}" for n in names for p in ("", f"{prefix}.")]
        candidates += [n[len(prefix) + 1 :] for n in names if prefix and n.startswith(f"{prefix}.")]
        found = [c for c in candidates if c in where]
        if found:
            entries.append((tensor, where[found[0]], found[0]))
            used.update(found)
    return None if set(where) - used else entries


def _load_generation_config(model: nn.Module, directory: Path) -> None:
    if not (directory / "generation_config.json").is_file() or not model.can_generate():
        return
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_pretrained(directory)
