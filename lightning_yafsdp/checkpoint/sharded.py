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
optimizer state of ``optimizer_state.py`` (torch's ``get_optimizer_state_dict``
layout: every param group with its hyperparameters and parameter names), and any
other top-level entry of the checkpoint that holds sharded tensors (listed in
``meta.pt["yafsdp"]["sharded_keys"]``). Sharded values are ``RangeShardedTensor``s,
which speak DCP's own protocol ([Note: element ranges as boxes]), so DCP's DEFAULT
planners write and read them: a reader at any world size asks for the boxes of its
own elements, and an FSDP2 model reads the directory with a plain ``dcp.load``.
Replicas of a hybrid-sharded model hold the same boxes; DCP's plan deduplication
writes each once, from the lowest rank holding it (replica 0).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from lightning_yafsdp.checkpoint import atomic
from lightning_yafsdp.checkpoint.background import BackgroundSaver, stage
from lightning_yafsdp.checkpoint.errors import CheckpointMismatchError, NotACheckpointError
from lightning_yafsdp.checkpoint.index import ShardIndex, build_index
from lightning_yafsdp.checkpoint.manifest import write_manifest
from lightning_yafsdp.checkpoint.optimizer_state import (
    check_state_names,
    load_optimizer_state,
    restored_param_groups,
    sharded_optimizer_state_dict,
)
from lightning_yafsdp.checkpoint.state import check_names_and_shapes, check_writable, module_state
from lightning_yafsdp.checkpoint.trees import (
    has_sharded_leaves,
    lists_from_int_keys,
    set_nested,
    tensor_bytes,
)
from lightning_yafsdp.checkpoint.verify import describe_non_checkpoint, verify_on_rank_zero
from lightning_yafsdp.core import YaFSDPEngine
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor

META_FILENAME = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME
DCP_METADATA_FILENAME = ".metadata"
MODEL_KEY = "model"
# Where Lightning's ModelParallelStrategy (FSDP2) keeps the weights in its DCP directories
# (its FSDPStrategy, like us, uses "model"): read as the model when there is no "model".
MODEL_PARALLEL_MODEL_KEY = "state_dict"
FORMAT_KEY = "yafsdp"
FORMAT_VERSION = 2  # 2: per-parameter optimizer groups (DCP's protocol writes the same files)
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
    background: BackgroundSaver | None = None,
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
            entry holding ``RangeShardedTensor``s (e.g. a ``WeightAveraging``
            callback's ``"current_model_state"``) is written sharded into the DCP files.
        prefix: prepended to every parameter name.
        model_state: the model's state dict (``RangeShardedTensor``s and plain tensors;
            the Lightning strategy passes the module's ``state_dict()``);
            ``engine.root.state_dict()`` when None.
        optimizer_states: ready ``sharded_optimizer_state_dict``s, one per optimizer.
        background: a ``BackgroundSaver``: the state is staged (copied) here and
            written in its thread; this returns before the files are written.

    Raises:
        CheckpointSaveError: on every rank if any rank failed; nothing in memory changed.
            With ``background``: raised by the saver's ``wait()`` instead.
    """
    if background is not None:
        background.wait()  # one save in flight at a time; raises a failed one's error
    if model_state is None:
        model_state = module_state(engine, prefix=prefix)
    if optimizer_states is None:
        optimizer_states = [
            sharded_optimizer_state_dict(engine, opt, prefix=prefix) for opt in optimizers
        ]
    state, meta = _dcp_state_and_meta(engine, model_state, optimizer_states, extra, prefix=prefix)
    bytes_here = tensor_bytes(state, whole=engine.rank == 0)
    path = Path(path)
    # Rank 0 writes meta.pt: pickled now, so a background write holds a copy of it.
    meta_bytes = _serialized(meta) if engine.rank == 0 else b""
    if background is None:
        _write_sharded(path, state, meta_bytes, group=engine.group, bytes_here=bytes_here)
        return
    staged, staged_meta = stage(state), meta_bytes
    background.submit(
        path,
        lambda group: _write_sharded(path, staged, staged_meta, group=group, bytes_here=bytes_here),
    )


def _write_sharded(
    path: Path, state: dict[str, Any], meta: bytes | Exception, *, group, bytes_here: int
) -> None:
    """DCP's files, ``meta.pt`` and the manifest into a temporary directory, then commit."""
    with atomic.atomic_directory(path, group=group, bytes_here=bytes_here) as tmp:
        dcp.save(
            state,
            storage_writer=FileSystemWriter(tmp, sync_files=True),
            # [Note: hybrid sharding] replicas hold the same boxes: the lowest rank, in
            # replica 0, writes each (and rank 0 the whole tensors and objects).
            planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
            process_group=group,
        )
        _write_meta_and_manifest(tmp, meta, group=group)


def _serialized(meta: Mapping[str, Any]) -> bytes | Exception:
    """``meta`` pickled, or why it cannot be (reported by every rank in the write phase)."""
    buffer = io.BytesIO()
    try:
        torch.save(dict(meta), buffer)
    except Exception as exc:  # noqa: BLE001 - see above
        return exc
    return buffer.getvalue()


def _dcp_state_and_meta(
    engine: YaFSDPEngine,
    model_state: Mapping[str, Any],
    optimizer_states: Sequence[Mapping[str, Any]],
    extra: Mapping[str, Any] | None,
    *,
    prefix: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What DCP writes (weights, optimizers, sharded extras) and what ``meta.pt`` holds."""
    state: dict[str, Any] = {MODEL_KEY: dict(model_state)}
    for i, optimizer_state in enumerate(optimizer_states):
        state[optimizer_key(i)] = dict(optimizer_state)
    meta = dict(extra or {})
    sharded_keys = [key for key, value in meta.items() if has_sharded_leaves(value)]
    for key in sharded_keys:
        if key == MODEL_KEY or _OPTIMIZER_KEY.match(str(key)):
            raise CheckpointMismatchError(
                f"the checkpoint entry {key!r} holds sharded tensors and its name is taken by "
                "the weights or an optimizer in the sharded layout; rename it"
            )
        state[key] = meta.pop(key)
    meta[FORMAT_KEY] = format_info(
        engine, "sharded", len(optimizer_states), prefix=prefix, sharded_keys=sharded_keys
    )
    return state, meta


def _write_meta_and_manifest(tmp: Path, meta: bytes | Exception, *, group) -> None:
    """Rank 0 writes ``meta.pt``; then every rank digests its files (collective)."""
    meta_failure = meta if isinstance(meta, Exception) else None
    if dist.get_rank(group) == 0 and meta_failure is None:
        try:
            (tmp / META_FILENAME).write_bytes(meta)
            atomic.fsync_file(tmp / META_FILENAME)
        except Exception as exc:  # noqa: BLE001 - write_manifest raises it on every rank
            meta_failure = exc
    # Collective even when meta.pt failed, so no rank is left waiting in it.
    write_manifest(tmp, rank_zero_files=(META_FILENAME,), group=group, failure=meta_failure)


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

    Collective. One ``dcp.load`` with DCP's default planner: the weights are read in
    place into this rank's shards, the optimizer states into fresh tensors of this
    rank's elements. Every file is verified first ([Note: verify before reading]) and
    names, shapes and the optimizer count are checked against ``.metadata`` first:
    when one of those checks fails nothing is modified. The param groups are pickled
    in the checkpoint, so they are compared after the read, before any optimizer is
    touched.

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
        ``RangeShardedTensor``s where they name a parameter of the model.

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
    _check_before_reading(path, layout, engine, index, model, len(optimizers), strict=strict)
    extra_keys = [k for k in info.get("sharded_keys", []) if k in layout.top_level]
    targets = {layout.model_key: {n: v for n, v in model.items() if n in layout.model_shapes}}
    for key in [optimizer_key(i) for i in range(len(optimizers))] + extra_keys:
        targets[key] = layout.read_targets(key, lambda p, md: _target(index, model, p, md))
    dcp.load(
        targets,
        storage_reader=FileSystemReader(path),
        planner=DefaultLoadPlanner(),
        process_group=engine.group,
    )
    engine.mark_weights_changed()
    for i, optimizer in enumerate(optimizers):
        saved = targets[optimizer_key(i)]
        groups = restored_param_groups(index, optimizer, saved.get("param_groups", []))
        states = {
            name: {k: v._local if isinstance(v, RangeShardedTensor) else v for k, v in e.items()}
            for name, e in saved.get("state", {}).items()
        }
        load_optimizer_state(index, optimizer, param_groups=groups, states=states)
    return {**meta, **{key: targets[key] for key in extra_keys}}


def _target(
    index: ShardIndex, model: Mapping[str, Any], path: tuple, md: Any
) -> RangeShardedTensor | torch.Tensor | None:
    """Where DCP reads the value at ``path`` (under an optimizer or a sharded entry).

    Per-element optimizer state of a sharded parameter, and an entry's tensor named
    and shaped like a sharded parameter (a ``WeightAveraging`` callback's
    ``"current_model_state"``): this rank's elements, laid out as the parameter.
    Scalars and other tensors: whole. A pickled object: None (DCP replaces it).
    """
    if isinstance(md, BytesStorageMetadata):
        return None
    is_state = len(path) == 4 and path[1] == "state"
    entry = index.entry_named(path[2]) if is_state else None
    like = model.get(path[1]) if len(path) == 2 and not is_state else None
    if entry is not None and len(md.size) > 0:
        local = torch.zeros(entry.numel, dtype=md.properties.dtype, device=entry.local.device)
        return RangeShardedTensor(local, entry.param._placement, entry.param._group)
    if isinstance(like, RangeShardedTensor) and torch.Size(md.size) == like.shape:
        return like.detach().clone()
    return torch.empty(md.size, dtype=md.properties.dtype)


def _verified_layout(
    path: Path, engine: YaFSDPEngine, *, verify_checksums: bool
) -> CheckpointLayout:
    """Recover an interrupted commit, verify every file, then read ``.metadata`` (collective)."""
    _recover(path, engine)
    verify_on_rank_zero(path, group=engine.group, checksums=verify_checksums)
    if not is_sharded_checkpoint(path):
        raise NotACheckpointError(describe_non_checkpoint(path))
    return CheckpointLayout(FileSystemReader(path).read_metadata())


def _read_meta(path: Path) -> dict[str, Any]:
    meta_file = path / META_FILENAME
    if not meta_file.is_file():
        return {}
    return torch.load(meta_file, map_location="cpu", weights_only=False)


def _check_before_reading(
    path: Path,
    layout: CheckpointLayout,
    engine: YaFSDPEngine,
    index: ShardIndex,
    model: Mapping[str, Any],
    num_optimizers: int,
    *,
    strict: bool,
) -> None:
    """Everything ``.metadata`` can tell: names, shapes, optimizer count and state names."""
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
    for i in range(num_optimizers):
        states = layout.optimizer_state_shapes(i)
        check_state_names(index, states, what=f"optimizer {i}")
        for name, keys in states.items():
            entry = index.entry_named(name)
            for key, size in keys.items():
                if entry is not None and len(size) > 0 and torch.Size(size) != entry.shape:
                    raise CheckpointMismatchError(
                        f"optimizer {i} state {key!r} of {name!r} has shape {tuple(size)} in "
                        f"the checkpoint, the parameter {tuple(entry.shape)}; only "
                        "per-element and scalar optimizer state can be loaded by name"
                    )


class CheckpointLayout:
    """What a DCP checkpoint holds, by the paths it was saved under (from ``.metadata``)."""

    def __init__(self, metadata: Metadata) -> None:
        planner_paths = metadata.planner_data or {}
        self.paths = {
            fqn: tuple(planner_paths.get(fqn, (fqn,))) for fqn in metadata.state_dict_metadata
        }
        self.storage = dict(metadata.state_dict_metadata)
        self.top_level = {path[0] for path in self.paths.values()}
        self.model_key = MODEL_KEY if MODEL_KEY in self.top_level else MODEL_PARALLEL_MODEL_KEY
        self.model_shapes = {
            path[1]: self.storage[fqn].size
            for fqn, path in self.paths.items()
            if path[0] == self.model_key
            and len(path) == 2
            and not isinstance(self.storage[fqn], BytesStorageMetadata)
        }

    @property
    def num_optimizers(self) -> int:
        return len({key for key in self.top_level if _OPTIMIZER_KEY.match(str(key))})

    def optimizer_state_shapes(self, optimizer: int) -> dict[str, dict[str, tuple]]:
        """``{name: {key: stored shape}}`` of optimizer ``optimizer``'s state (``()``: object)."""
        shapes: dict[str, dict[str, tuple]] = {}
        for fqn, path in self.paths.items():
            if path[0] == optimizer_key(optimizer) and len(path) == 4 and path[1] == "state":
                md = self.storage[fqn]
                size = () if isinstance(md, BytesStorageMetadata) else tuple(md.size)
                shapes.setdefault(path[2], {})[path[3]] = size
        return shapes

    def read_targets(self, key: str, target: Callable[[tuple, Any], Any]) -> Any:
        """The nested dict saved under ``key``, each leaf ``target(path, storage md)``."""
        root: dict = {}
        for fqn, path in self.paths.items():
            if path[0] == key:
                set_nested(root, path, target(path, self.storage[fqn]))
        return lists_from_int_keys(root)[key]


def _recover(path: Path, engine: YaFSDPEngine) -> None:
    error = None
    if engine.rank == 0:
        try:
            atomic.recover(path)
        except OSError as exc:
            error = exc
    atomic.agree(error, group=engine.group, doing=f"recovering checkpoint {path}")
