"""Sharded checkpoints: a torch.distributed.checkpoint directory plus ``meta.pt``.

Layout (the one Lightning's FSDP strategy writes, so Lightning's consolidation
utility reads it)::

    CHECKPOINT/
      .metadata            DCP: every tensor's full shape and where its boxes are
      __<rank>_0.distcp    DCP: each rank's data
      meta.pt              rank 0: everything that is not weights or optimizer
                           state (Lightning's loops, schedulers, callbacks; the
                           torch API's ``extra``) plus a ``"yafsdp"`` entry
      yafsdp-manifest.json rank 0: every file's size and CRC-32 ([Note: checkpoint
                           manifest]); readers ignore it, ``verify.py`` checks it

DCP keys: ``model`` -> ``{name: tensor}``, ``optimizer_<i>`` -> the name-keyed
optimizer state of ``optimizer_state.py`` (every param group with its
hyperparameters and parameter names), and any other top-level entry of the
checkpoint that holds sharded tensors (listed in ``meta.pt["yafsdp"]["sharded_keys"]``).
Each rank writes its elements of every parameter as boxes of the full shapes
([Note: element ranges as boxes]), so a reader at any world size asks DCP for
the boxes of its own elements. ``format_version`` 2; version-1 directories
(one optimizer group per master shard) still load ([Note: version-1 optimizer
groups]).
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
from lightning_yafsdp.checkpoint.errors import CheckpointMismatchError, NotACheckpointError
from lightning_yafsdp.checkpoint.index import ShardIndex, build_index
from lightning_yafsdp.checkpoint.manifest import write_manifest
from lightning_yafsdp.checkpoint.optimizer_state import (
    check_state_names,
    load_optimizer_state,
    restored_param_groups,
    sharded_optimizer_state_dict,
)
from lightning_yafsdp.checkpoint.ranges import FlatRange, RangeLoadPlanner, RangeSavePlanner
from lightning_yafsdp.checkpoint.state import check_names_and_shapes, check_writable, module_state
from lightning_yafsdp.checkpoint.trees import (
    as_flat_range,
    has_sharded_leaves,
    lists_from_int_keys,
    set_nested,
    tensor_bytes,
    to_flat_ranges,
)
from lightning_yafsdp.checkpoint.verify import verify_on_rank_zero
from lightning_yafsdp.core import YaFSDPEngine
from lightning_yafsdp.core.optim.sharded_param import ShardedTensor

META_FILENAME = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME
DCP_METADATA_FILENAME = ".metadata"
MODEL_KEY = "model"
# Where Lightning's ModelParallelStrategy (FSDP2) keeps the weights in its DCP directories
# (its FSDPStrategy, like us, uses "model"): read as the model when there is no "model".
MODEL_PARALLEL_MODEL_KEY = "state_dict"
FORMAT_KEY = "yafsdp"
FORMAT_VERSION = 2  # 2: per-parameter optimizer groups with their real hyperparameters
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
        optimizers: optimizers over the model's (sharded) parameters.
        extra: picklable objects saved by rank 0 in ``meta.pt`` (step counters,
            schedulers, RNG states...); returned by ``load_sharded``. A top-level
            entry holding sharded tensors (``ShardedTensor`` / ``FlatRange``, e.g. a
            ``WeightAveraging`` callback's ``"current_model_state"``) is written
            sharded into the DCP files instead.
        prefix: prepended to every parameter name.
        model_state: the model's state dict as ``ShardedTensor``s / ``FlatRange``s
            and plain tensors (the Lightning strategy passes the module's
            ``state_dict()``); ``engine.root.state_dict()`` when None.
        optimizer_states: ready ``sharded_optimizer_state_dict``s, one per optimizer.

    Raises:
        CheckpointSaveError: on every rank if any rank failed; nothing in memory changed.
    """
    if model_state is None:
        model_state = module_state(engine, prefix=prefix)
    if optimizer_states is None:
        optimizer_states = [
            sharded_optimizer_state_dict(engine, opt, prefix=prefix) for opt in optimizers
        ]
    state, meta = _dcp_state_and_meta(engine, model_state, optimizer_states, extra, prefix=prefix)
    # [Note: hybrid sharding] every replica holds the same shards: only the first
    # writes them, so each element is written once; DCP writes a whole tensor once.
    writes_ranges = engine.mesh.replicate_rank == 0
    bytes_here = tensor_bytes(state, sharded=writes_ranges, whole=engine.rank == 0)
    with atomic.atomic_directory(path, group=engine.group, bytes_here=bytes_here) as tmp:
        dcp.save(
            state,
            storage_writer=FileSystemWriter(tmp, sync_files=True),
            planner=RangeSavePlanner(write_ranges=writes_ranges),
            process_group=engine.group,
        )
        _write_meta_and_manifest(tmp, meta, engine)


def _dcp_state_and_meta(
    engine: YaFSDPEngine,
    model_state: Mapping[str, Any],
    optimizer_states: Sequence[Mapping[str, Any]],
    extra: Mapping[str, Any] | None,
    *,
    prefix: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What DCP writes (weights, optimizers, sharded extras) and what ``meta.pt`` holds."""
    state: dict[str, Any] = {MODEL_KEY: to_flat_ranges(dict(model_state))}
    for i, optimizer_state in enumerate(optimizer_states):
        state[optimizer_key(i)] = to_flat_ranges(optimizer_state)
    meta = dict(extra or {})
    sharded_keys = [key for key, value in meta.items() if has_sharded_leaves(value)]
    for key in sharded_keys:
        if key == MODEL_KEY or _OPTIMIZER_KEY.match(str(key)):
            raise CheckpointMismatchError(
                f"the checkpoint entry {key!r} holds sharded tensors and its name is taken by "
                "the weights or an optimizer in the sharded layout; rename it"
            )
        state[key] = to_flat_ranges(meta.pop(key))
    meta[FORMAT_KEY] = format_info(
        engine, "sharded", len(optimizer_states), prefix=prefix, sharded_keys=sharded_keys
    )
    return state, meta


def _write_meta_and_manifest(tmp: Path, meta: dict[str, Any], engine: YaFSDPEngine) -> None:
    """Rank 0 writes ``meta.pt``; then every rank digests its files (collective)."""
    meta_failure = None
    if engine.rank == 0:
        try:
            torch.save(meta, tmp / META_FILENAME)
            atomic.fsync_file(tmp / META_FILENAME)
        except Exception as exc:  # noqa: BLE001 - write_manifest raises it on every rank
            meta_failure = exc
    # Collective even when meta.pt failed, so no rank is left waiting in it.
    write_manifest(tmp, rank_zero_files=(META_FILENAME,), group=engine.group, failure=meta_failure)


def format_info(
    engine: YaFSDPEngine,
    kind: str,
    num_optimizers: int,
    *,
    prefix: str,
    sharded_keys: Sequence[str] = (),
) -> dict:
    """What ``inspect`` and loaders want to know without reading the tensors."""
    return {
        "format_version": FORMAT_VERSION,
        "state_dict_type": kind,
        "world_size": engine.world_size,
        "shard_size": engine.shard_size,
        "num_optimizers": num_optimizers,
        "parameter_count": build_index(engine, prefix=prefix).parameter_count,
        "sharded_keys": list(sharded_keys),
    }


# -- load ----------------------------------------------------------------------------------


def load_sharded(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    prefix: str = "",
    strict: bool = True,
    verify_checksums: bool = True,
) -> dict[str, Any]:
    """Load a sharded checkpoint written at any world size into ``engine`` and ``optimizers``.

    Collective. Each rank reads exactly the elements it owns under its own
    layout. Every file is verified first ([Note: verify before reading]) and
    everything is checked against the checkpoint's metadata: when a check fails
    nothing is modified.

    Args:
        optimizers: loaded when given (their count must match the checkpoint's);
            ``()`` loads the weights only.
        strict: with False, parameters missing from the checkpoint keep their
            values and names only in the checkpoint are ignored.
        verify_checksums: compare every file with the CRC-32 recorded at save before
            reading it, the work shared over the ranks ([Note: checksums on load]).
            Default True; False checks sizes and structure only.

    Returns:
        The contents of ``meta.pt`` (``extra`` of ``save_sharded``, or the rest of a
        Lightning checkpoint), with sharded entries (``"sharded_keys"``) read back as
        ``ShardedTensor``s where they name a parameter of the model.

    Raises:
        NotACheckpointError: ``path`` is not a sharded checkpoint.
        DamagedCheckpointError: a file is missing, truncated or (``verify_checksums``)
            changed since the save (rank 0 names it).
        CheckpointMismatchError: names, shapes, optimizer count or param groups differ.
    """
    path = Path(path)
    layout = _verified_layout(path, engine, verify_checksums=verify_checksums)
    meta = _read_meta(path)
    info = meta.get(FORMAT_KEY, {})
    index = build_index(engine, prefix=prefix)
    model = module_state(engine, prefix=prefix)
    _check_model_and_optimizer_count(path, layout, engine, model, len(optimizers), strict=strict)
    extra_keys = [k for k in info.get("sharded_keys", []) if k in layout.extras]
    objects = _read_objects(path, engine, layout.object_fqns(len(optimizers), extra_keys))
    groups = [
        _checked_param_groups(index, layout, i, optimizer, objects, info)
        for i, optimizer in enumerate(optimizers)
    ]
    targets = _model_targets(layout, model)
    states = [_optimizer_targets(index, layout, i, targets, objects) for i in range(len(groups))]
    extras = {key: _extra_targets(layout, key, model, targets, objects) for key in extra_keys}
    _read_tensors(path, engine, targets)
    engine.mark_weights_changed()
    for optimizer, param_groups, state in zip(optimizers, groups, states, strict=True):
        load_optimizer_state(index, optimizer, param_groups=param_groups, states=state)
    return {**meta, **{key: _rebuild(values) for key, values in extras.items()}}


def _verified_layout(
    path: Path, engine: YaFSDPEngine, *, verify_checksums: bool
) -> CheckpointLayout:
    """Recover an interrupted commit, verify every file, then read ``.metadata`` (collective)."""
    _recover(path, engine)
    verify_on_rank_zero(path, group=engine.group, checksums=verify_checksums)
    if not is_sharded_checkpoint(path):
        raise NotACheckpointError(describe_non_checkpoint(path))
    return CheckpointLayout.from_metadata(FileSystemReader(path).read_metadata())


def _model_targets(layout: CheckpointLayout, model: Mapping[str, Any]) -> dict[str, Any]:
    """DCP read targets of the weights: this rank's elements of each, by the stored name."""
    return {
        layout.model_fqn[name]: as_flat_range(value) if isinstance(value, ShardedTensor) else value
        for name, value in model.items()
        if name in layout.model_shapes
    }


def _read_meta(path: Path) -> dict[str, Any]:
    meta_file = path / META_FILENAME
    if not meta_file.is_file():
        return {}
    return torch.load(meta_file, map_location="cpu", weights_only=False)


def _checked_param_groups(
    index: ShardIndex,
    layout: CheckpointLayout,
    i: int,
    optimizer: torch.optim.Optimizer,
    objects: Mapping[str, Any],
    info: Mapping[str, Any],
) -> list[dict]:
    """Optimizer ``i``'s saved param groups, checked against ``optimizer`` (nothing loaded)."""
    check_state_names(index, layout.optimizer_state.get(i, {}), what=f"optimizer {i}")
    return restored_param_groups(
        index,
        optimizer,
        layout.param_groups(i, objects),
        format_version=info.get("format_version", FORMAT_VERSION),
    )


def _check_model_and_optimizer_count(
    path: Path,
    layout: CheckpointLayout,
    engine: YaFSDPEngine,
    model: Mapping[str, Any],
    num_optimizers: int,
    *,
    strict: bool,
) -> None:
    check_names_and_shapes(
        expected={k: torch.Size(v.shape) for k, v in model.items()},
        found=layout.model_shapes,
        what=f"checkpoint {path}",
        strict=strict,
    )
    check_writable(engine, model)
    if num_optimizers and num_optimizers != layout.num_optimizers:
        raise CheckpointMismatchError(
            f"checkpoint {path} holds the state of {layout.num_optimizers} optimizer(s) but "
            f"{num_optimizers} were given; configure the same optimizers as when it was saved, "
            "or load the weights only (no optimizers)"
        )


class CheckpointLayout:
    """What a DCP checkpoint holds, by original name, read from its ``.metadata`` alone."""

    def __init__(self) -> None:
        self.model_shapes: dict[str, torch.Size] = {}
        self.model_fqn: dict[str, str] = {}
        self.optimizer_state: dict[int, dict[str, dict[str, str]]] = {}
        self.optimizer_objects: dict[int, dict[tuple, str]] = {}
        self.extras: dict[str, dict[tuple, str]] = {}  # top-level key -> {path: fqn}
        self.tensor_md: dict[str, Any] = {}

    @property
    def num_optimizers(self) -> int:
        return len(self.optimizer_objects.keys() | self.optimizer_state.keys())

    @classmethod
    def from_metadata(cls, metadata: Metadata) -> CheckpointLayout:
        layout = cls()
        planner_paths = metadata.planner_data or {}
        paths = {fqn: tuple(planner_paths.get(fqn, (fqn,))) for fqn in metadata.state_dict_metadata}
        top_level = {path[0] for path in paths.values()}
        model_key = MODEL_KEY if MODEL_KEY in top_level else MODEL_PARALLEL_MODEL_KEY
        for fqn, md in metadata.state_dict_metadata.items():
            path = paths[fqn]
            is_object = isinstance(md, BytesStorageMetadata)
            if not is_object:
                layout.tensor_md[fqn] = md
            match = _OPTIMIZER_KEY.match(str(path[0]))
            if path[0] == model_key and len(path) == 2:
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
                layout.extras.setdefault(str(path[0]), {})[path] = fqn
        return layout

    def object_fqns(self, num_optimizers: int, extra_keys: Sequence[str] = ()) -> list[str]:
        """Every pickled entry of the first ``num_optimizers`` optimizers and of ``extra_keys``."""
        fqns = [
            fqn
            for i in range(num_optimizers)
            for fqn in [
                *self.optimizer_objects.get(i, {}).values(),
                *(f for keys in self.optimizer_state.get(i, {}).values() for f in keys.values()),
            ]
        ]
        fqns += [fqn for key in extra_keys for fqn in self.extras[key].values()]
        return [fqn for fqn in fqns if fqn not in self.tensor_md]

    def param_groups(self, optimizer: int, objects: Mapping[str, Any]) -> list[dict]:
        groups: dict[int, dict] = {}
        for path, fqn in self.optimizer_objects.get(optimizer, {}).items():
            if path[0] != "param_groups" or len(path) != 3:
                continue
            value = objects[fqn] if fqn in objects else None
            groups.setdefault(int(path[1]), {})[path[2]] = value
        return [groups[i] for i in sorted(groups)]


def _optimizer_targets(
    index: ShardIndex,
    layout: CheckpointLayout,
    optimizer: int,
    targets: dict[str, Any],
    objects: Mapping[str, Any],
) -> dict[str, dict[str, Any]]:
    """Allocate each parameter's optimizer state (its own elements) and add DCP read targets."""
    states: dict[str, dict[str, Any]] = {}
    for name, keys in layout.optimizer_state.get(optimizer, {}).items():
        entry = index.entry_named(name)
        states[name] = {}
        for key, fqn in keys.items():
            md = layout.tensor_md.get(fqn)
            if md is None:
                states[name][key] = objects[fqn]  # a pickled value (a Python number...)
            elif entry is not None and len(md.size) > 0:
                if torch.Size(md.size) != entry.shape:
                    raise CheckpointMismatchError(
                        f"optimizer {optimizer} state {key!r} of {name!r} has shape "
                        f"{tuple(md.size)} in the checkpoint, the parameter {tuple(entry.shape)}; "
                        "only per-element and scalar optimizer state can be loaded by name"
                    )
                local = torch.zeros(
                    entry.numel, dtype=md.properties.dtype, device=entry.local.device
                )
                targets[fqn] = FlatRange(entry.shape, entry.start, entry.end, local)
                states[name][key] = local
            else:  # a scalar, or the state of a replicated (frozen) parameter: whole
                targets[fqn] = states[name][key] = torch.empty(md.size, dtype=md.properties.dtype)
    return states


def _extra_targets(
    layout: CheckpointLayout,
    key: str,
    model: Mapping[str, Any],
    targets: dict[str, Any],
    objects: Mapping[str, Any],
) -> dict[tuple, Any]:
    """Read targets of a sharded top-level entry: ``{path: value}`` once loaded.

    ``{key: {name: tensor}}`` entries whose name is a sharded parameter of the model
    with the same shape (a ``WeightAveraging`` callback's ``"current_model_state"``)
    come back as ``ShardedTensor``s laid out like that parameter; other tensors whole.
    """
    values: dict[tuple, Any] = {}
    for path, fqn in layout.extras[key].items():
        md = layout.tensor_md.get(fqn)
        like = model.get(path[1]) if len(path) == 2 else None
        if md is None:
            values[path] = objects[fqn]
        elif isinstance(like, ShardedTensor) and torch.Size(md.size) == like.shape:
            sharded = like.detach().clone()
            targets[fqn] = as_flat_range(sharded)
            values[path] = sharded
        else:
            targets[fqn] = values[path] = torch.empty(md.size, dtype=md.properties.dtype)
    return values


def _rebuild(values: Mapping[tuple, Any]) -> Any:
    """One top-level entry from its ``{path: value}`` leaves (paths start with the key)."""
    if len(values) == 1 and len(next(iter(values))) == 1:
        return next(iter(values.values()))
    root: dict = {}
    for path, value in values.items():
        set_nested(root, path[1:], value)
    return lists_from_int_keys(root)


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
