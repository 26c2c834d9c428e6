"""Sharded checkpoints: a torch.distributed.checkpoint directory plus ``meta.pt``.

Layout (the one Lightning's FSDP strategy writes, so Lightning's consolidation
utility reads it)::

    CHECKPOINT/
      .metadata            DCP: every tensor's full shape and where its boxes are
      __<rank>_0.distcp    DCP: each rank's data
      meta.pt              rank 0: everything that is not weights or optimizer
                           state (Lightning's loops, schedulers, callbacks; the
                           torch API's ``extra``) plus a ``"yafsdp"`` entry

DCP keys: ``model`` -> ``{name: tensor}`` and ``optimizer_<i>`` -> the name-keyed
optimizer state of ``state.py``. Each rank writes its runs as boxes of the full
parameter shapes ([Note: element ranges as boxes]), so a reader at any world
size asks DCP for the boxes of its own runs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from lightning_yafsdp.checkpoint import atomic
from lightning_yafsdp.checkpoint.errors import (
    CheckpointMismatchError,
    NotACheckpointError,
    name_list,
)
from lightning_yafsdp.checkpoint.index import ShardIndex, build_index, replicated_state
from lightning_yafsdp.checkpoint.ranges import FlatRange, RangeLoadPlanner, RangeSavePlanner
from lightning_yafsdp.checkpoint.state import (
    check_names_and_shapes,
    check_param_groups,
    load_optimizer_state,
    sharded_model_state_dict,
    sharded_optimizer_state_dict,
)
from lightning_yafsdp.core import YaFSDPEngine

META_FILENAME = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME
DCP_METADATA_FILENAME = ".metadata"
MODEL_KEY = "model"
FORMAT_KEY = "yafsdp"
FORMAT_VERSION = 1
_OPTIMIZER_KEY = re.compile(r"optimizer_(\d+)$")


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory with a DCP ``.metadata`` file."""
    path = Path(path)
    return path.is_dir() and (path / DCP_METADATA_FILENAME).is_file()


# -- save ---------------------------------------------------------------------------------


def save_sharded(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    extra: Mapping[str, Any] | None = None,
    prefix: str = "",
    model_state: Mapping[str, Any] | None = None,
    optimizer_states: Sequence[Mapping[str, Any]] | None = None,
) -> None:
    """Write a sharded checkpoint of ``engine`` (and ``optimizers``) to the directory ``path``.

    Collective: every rank of the engine's group calls it with the same path.
    Atomic ([Note: atomic commit]): ``path`` appears, or is replaced, only once
    every rank's files are written and synced.

    Args:
        path: the checkpoint directory (created; an existing checkpoint there is
            replaced only after the new one is complete).
        engine: the sharded model's engine.
        optimizers: optimizers over the engine's master parameters.
        extra: picklable objects saved by rank 0 in ``meta.pt`` (step counters,
            schedulers, RNG states...); returned by ``load_sharded``.
        prefix: prepended to every parameter name.
        model_state: a ready ``sharded_model_state_dict`` (the Lightning strategy
            passes its own); computed from ``engine`` when None.
        optimizer_states: ready ``sharded_optimizer_state_dict``s, one per optimizer.

    Raises:
        CheckpointSaveError: on every rank if any rank failed; nothing in memory changed.
    """
    if model_state is None:
        model_state = sharded_model_state_dict(engine, prefix=prefix)
    if optimizer_states is None:
        optimizer_states = [
            sharded_optimizer_state_dict(engine, opt, prefix=prefix) for opt in optimizers
        ]
    state: dict[str, Any] = {MODEL_KEY: dict(model_state)}
    for i, optimizer_state in enumerate(optimizer_states):
        state[optimizer_key(i)] = optimizer_state
    meta = dict(extra or {})
    meta[FORMAT_KEY] = format_info(engine, "sharded", len(optimizer_states), prefix=prefix)
    with atomic.atomic_directory(path, group=engine.group) as tmp:
        dcp.save(
            state,
            storage_writer=FileSystemWriter(tmp, sync_files=True),
            planner=RangeSavePlanner(),
            process_group=engine.group,
        )
        if engine.rank == 0:
            torch.save(meta, tmp / META_FILENAME)
            atomic.fsync_file(tmp / META_FILENAME)


def format_info(engine: YaFSDPEngine, kind: str, num_optimizers: int, *, prefix: str) -> dict:
    """What ``inspect`` and loaders want to know without reading the tensors."""
    index = build_index(engine, prefix=prefix)
    return {
        "format_version": FORMAT_VERSION,
        "state_dict_type": kind,
        "world_size": engine.world_size,
        "num_optimizers": num_optimizers,
        "parameter_count": sum(index.shapes[name].numel() for name in index.aliases),
    }


# -- load ----------------------------------------------------------------------------------


def load_sharded(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    prefix: str = "",
    strict: bool = True,
) -> dict[str, Any]:
    """Load a sharded checkpoint written at any world size into ``engine`` and ``optimizers``.

    Collective. Each rank reads exactly the elements it owns under its own
    layout. Everything is checked against the checkpoint's metadata first:
    when a check fails nothing is modified.

    Args:
        optimizers: loaded when given (their count must match the checkpoint's);
            ``()`` loads the weights only.
        strict: with False, parameters missing from the checkpoint keep their
            values and names only in the checkpoint are ignored.

    Returns:
        The contents of ``meta.pt`` (``extra`` of ``save_sharded``, or the rest of a
        Lightning checkpoint).

    Raises:
        NotACheckpointError: ``path`` is not a sharded checkpoint.
        CheckpointMismatchError: names, shapes, optimizer count or param groups differ.
    """
    path = Path(path)
    _recover(path, engine)
    if not is_sharded_checkpoint(path):
        raise NotACheckpointError(describe_non_checkpoint(path))
    reader = FileSystemReader(path)
    metadata = reader.read_metadata()
    layout = CheckpointLayout.from_metadata(metadata)
    index = build_index(engine, prefix=prefix)
    buffers = replicated_state(engine, prefix=prefix)
    check_names_and_shapes(
        expected={**index.shapes, **{k: v.shape for k, v in buffers.items()}},
        found=layout.model_shapes,
        what=f"checkpoint {path}",
        strict=strict,
    )
    if optimizers and len(optimizers) != layout.num_optimizers:
        raise CheckpointMismatchError(
            f"checkpoint {path} holds the state of {layout.num_optimizers} optimizer(s) but "
            f"{len(optimizers)} were given; configure the same optimizers as when it was saved, "
            "or load the weights only (no optimizers)"
        )
    objects = _read_objects(path, engine, layout.object_fqns(len(optimizers)))
    param_groups = [layout.param_groups(i, objects) for i in range(len(optimizers))]
    for i, optimizer in enumerate(optimizers):
        unknown = set(layout.optimizer_state[i]) - set(index.aliases)
        if unknown:
            raise CheckpointMismatchError(
                f"optimizer {i} in checkpoint {path} has state for parameters the model does "
                f"not have: {name_list(unknown)}"
            )
        check_param_groups(index, optimizer, param_groups[i])

    targets: dict[str, Any] = {}
    for run in index.runs:
        present = [a for a in run.aliases if a in layout.model_shapes]
        if present:
            local = index.masters[run.master].detach()[
                run.master_offset : run.master_offset + run.numel
            ]
            targets[layout.model_fqn[present[0]]] = FlatRange(run.shape, run.start, run.end, local)
    for name, buffer in buffers.items():
        if name in layout.model_fqn:
            targets[layout.model_fqn[name]] = buffer
    states = [_optimizer_targets(index, layout, i, targets) for i in range(len(optimizers))]
    _read_tensors(path, engine, targets)
    engine.mark_weights_changed()
    for i, optimizer in enumerate(optimizers):
        load_optimizer_state(index, optimizer, param_groups=param_groups[i], states=states[i])
    meta_file = path / META_FILENAME
    meta = (
        torch.load(meta_file, map_location="cpu", weights_only=False) if meta_file.is_file() else {}
    )
    return meta


def read_format_info(path: str | os.PathLike) -> dict[str, Any]:
    """The ``"yafsdp"`` entry of a sharded checkpoint's ``meta.pt`` (``{}`` if absent)."""
    meta_file = Path(path) / META_FILENAME
    if not meta_file.is_file():
        return {}
    return torch.load(meta_file, map_location="cpu", weights_only=False).get(FORMAT_KEY, {})


class CheckpointLayout:
    """What a DCP checkpoint holds, by original name, read from its ``.metadata`` alone."""

    def __init__(self) -> None:
        self.model_shapes: dict[str, torch.Size] = {}
        self.model_fqn: dict[str, str] = {}
        self.optimizer_state: dict[int, dict[str, dict[str, str]]] = {}
        self.optimizer_objects: dict[int, dict[tuple, str]] = {}
        self.other_objects: list[str] = []
        self.tensor_md: dict[str, Any] = {}

    @property
    def num_optimizers(self) -> int:
        return len(self.optimizer_objects.keys() | self.optimizer_state.keys())

    @classmethod
    def from_metadata(cls, metadata: Metadata) -> CheckpointLayout:
        layout = cls()
        paths = metadata.planner_data or {}
        for fqn, md in metadata.state_dict_metadata.items():
            path = tuple(paths.get(fqn, (fqn,)))
            is_object = isinstance(md, BytesStorageMetadata)
            if not is_object:
                layout.tensor_md[fqn] = md
            match = _OPTIMIZER_KEY.match(str(path[0]))
            if path[0] == MODEL_KEY and len(path) == 2:
                layout.model_fqn[path[1]] = fqn
                if not is_object:
                    layout.model_shapes[path[1]] = md.size
            elif match and len(path) == 4 and path[1] == "state":
                layout.optimizer_state.setdefault(int(match[1]), {}).setdefault(path[2], {})[
                    path[3]
                ] = fqn
            elif match:
                layout.optimizer_objects.setdefault(int(match[1]), {})[path[1:]] = fqn
            else:
                layout.other_objects.append(fqn)
        return layout

    def object_fqns(self, num_optimizers: int) -> list[str]:
        return [
            fqn
            for i in range(num_optimizers)
            for fqn in self.optimizer_objects.get(i, {}).values()
            if fqn not in self.tensor_md
        ]

    def param_groups(self, optimizer: int, objects: Mapping[str, Any]) -> list[dict]:
        groups: dict[int, dict] = {}
        for path, fqn in self.optimizer_objects.get(optimizer, {}).items():
            if path[0] != "param_groups" or len(path) != 3:
                continue
            value = objects[fqn] if fqn in objects else None
            groups.setdefault(int(path[1]), {})[path[2]] = value
        return [groups[i] for i in sorted(groups)]


def _optimizer_targets(
    index: ShardIndex, layout: CheckpointLayout, optimizer: int, targets: dict[str, Any]
) -> dict[int, dict[str, Any]]:
    """Allocate each master's optimizer state and add DCP read targets for it."""
    saved = layout.optimizer_state.get(optimizer, {})
    states: dict[int, dict[str, Any]] = {}
    for master_id, master in enumerate(index.masters):
        names = [n for n in index.names_by_master[master_id] if n in saved]
        if not names:
            continue
        entry: dict[str, Any] = {}
        for key in dict.fromkeys(k for n in names for k in saved[n]):
            holders = [n for n in names if key in saved[n]]
            md = layout.tensor_md.get(saved[holders[0]][key])
            if md is not None and len(md.size) > 0 and md.size == index.shapes[holders[0]]:
                tensor = torch.zeros_like(master.detach(), memory_format=torch.contiguous_format)
                for run in index.runs:
                    if run.master == master_id and key in saved.get(run.name, {}):
                        local = tensor[run.master_offset : run.master_offset + run.numel]
                        targets[saved[run.name][key]] = FlatRange(
                            run.shape, run.start, run.end, local
                        )
                entry[key] = tensor
            elif md is not None:
                tensor = torch.empty(md.size, dtype=md.properties.dtype)
                targets[saved[holders[0]][key]] = tensor
                entry[key] = tensor
            else:
                raise CheckpointMismatchError(
                    f"optimizer {optimizer} state {key!r} is a pickled object; only tensor "
                    "optimizer state can be loaded from a sharded checkpoint"
                )
        states[master_id] = entry
    return states


def _read_objects(path: Path, engine: YaFSDPEngine, fqns: list[str]) -> dict[str, Any]:
    if not fqns:
        return {}
    planner = RangeLoadPlanner()
    dcp.load(
        dict.fromkeys(fqns),
        storage_reader=FileSystemReader(path),
        planner=planner,
        process_group=engine.group,
    )
    return planner.loaded_objects


def _read_tensors(path: Path, engine: YaFSDPEngine, targets: dict[str, Any]) -> None:
    dcp.load(
        targets,
        storage_reader=FileSystemReader(path),
        planner=RangeLoadPlanner(),
        process_group=engine.group,
    )


def _recover(path: Path, engine: YaFSDPEngine) -> None:
    error = None
    if engine.rank == 0:
        try:
            atomic.recover(path)
        except OSError as exc:
            error = exc
    atomic.agree(error, group=engine.group, doing=f"recovering checkpoint {path}")


def describe_non_checkpoint(path: Path) -> str:
    """Why ``path`` is not a checkpoint, and what to pass instead."""
    if not path.exists():
        siblings = (
            sorted(p.name for p in path.parent.glob("*"))[:10] if path.parent.is_dir() else []
        )
        return (
            f"checkpoint {str(path)!r} does not exist"
            + (f" (the directory holds: {', '.join(siblings)})" if siblings else "")
            + "; pass the path of a checkpoint directory written by save_sharded / "
            "trainer.save_checkpoint, or a checkpoint file"
        )
    if path.is_dir():
        contents = sorted(p.name for p in path.iterdir())[:10]
        return (
            f"{str(path)!r} is a directory but not a sharded checkpoint: it has no "
            f"{DCP_METADATA_FILENAME} file (it holds: {', '.join(contents) or 'nothing'}). A save "
            "that was interrupted leaves a hidden '.<name>.yafsdp-tmp' directory instead; the "
            "last complete checkpoint is the one to load"
        )
    return f"{str(path)!r} is a file, not a sharded checkpoint directory"
