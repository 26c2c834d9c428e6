"""Background saves: staged on the main thread, written in a thread on a gloo group of their own.

[Note: background saves]
A save returns once its DCP state dict is staged (copied to CPU, ``stage``) and
``meta.pt`` pickled; one worker thread then runs the synchronous save's write and atomic
commit, one save at a time, on a gloo group of its own (two threads' collectives on one
group would interleave). Not ``dcp.async_save``: its stager reads raw storage
(``data_ptr``), which a ``RangeShardedTensor`` refuses, and its future completes before
the manifest and commit. Not Lightning's ``AsyncCheckpointIO``: it runs a per-rank save,
and ours is collective. A failed write is never lost: ``poll()`` gives its line once at
the next step; ``wait()`` (next save, a load, end of training) raises it on every rank.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from lightning_yafsdp.checkpoint.atomic import error_line
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor


def stage(tree: Any) -> Any:
    """A CPU copy of a checkpoint tree that later changes to the model cannot reach.

    ``RangeShardedTensor``s keep their placement and lose their process group: nothing
    collective runs on a staged copy.
    """

    def copied(value: Any) -> Any:
        if isinstance(value, RangeShardedTensor):
            local = value._local.detach().to("cpu", copy=True)
            return RangeShardedTensor(local, value._placement, None)
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", copy=True)
        return copy.deepcopy(value)

    return pytree.tree_map(copied, tree)


class BackgroundSaver:
    """Runs one checkpoint write at a time in a worker thread (see the Note).

    Args:
        group: the ranks that save together. A gloo group over the same ranks is created
            here: collective, every rank constructs its saver at the same point.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.group = dist.new_group(ranks=ranks, backend="gloo")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="yafsdp-save")
        self._in_flight: Future | None = None
        self._path: Path | None = None
        self._failure: BaseException | None = None
        self._announced = False

    @property
    def in_flight_path(self) -> Path | None:
        """Where the save in flight commits (None when no save is in flight)."""
        return self._path if self._in_flight is not None else None

    def submit(self, path: Path, write: Callable[[dist.ProcessGroup], None]) -> None:
        """Run ``write(group)`` in the worker once the previous save is done."""
        self.wait()
        self._path = Path(path)
        self._in_flight = self._executor.submit(write, self.group)

    def poll(self) -> str | None:
        """The one line of a failed write, once, as soon as it is known; never blocks."""
        if self._in_flight is not None and self._in_flight.done():
            self._collect()
        if self._failure is None or self._announced:
            return None
        self._announced = True
        return _one_line(self._failure)

    def wait(self) -> None:
        """Block until the save in flight is committed; raise a failed write's error once
        (``CheckpointSaveError``; the previous checkpoint at its path is intact)."""
        if self._in_flight is not None:
            self._collect()
        if self._failure is not None:
            failure, self._failure, self._announced = self._failure, None, False
            raise failure

    def close(self) -> str | None:
        """Wait for the save in flight and stop the worker; the failure's line, if any."""
        try:
            self.wait()
        except BaseException as failure:  # noqa: BLE001 - reported, not raised, at teardown
            return _one_line(failure)
        finally:
            self._executor.shutdown(wait=True)
        return None

    def _collect(self) -> None:
        future, self._in_flight = self._in_flight, None
        try:
            future.result()
        except BaseException as failure:  # noqa: BLE001 - kept until wait() raises it
            self._failure = failure


def _one_line(failure: BaseException) -> str:
    return f"a background checkpoint save failed: {error_line(failure)}"
