"""Both strategies' background saves (``async_save=True``): the saver, its waits, its reports.

The saver itself, and why it is built the way it is, is
``lightning_yafsdp.checkpoint.background`` ([Note: background saves]). Here is only
when the strategies use it: a sharded save hands its write to it; the next save, a
load, removing the checkpoint being written, and the end of training wait for it;
every training step asks it, without blocking, whether a write failed, and says so in
one line on rank 0; the failure itself is raised at the next save, load or end of fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_yafsdp.checkpoint.background import BackgroundSaver


class BackgroundSaving:
    """Mixed into both strategies, after ``ShardingState`` (which gives ``_options``)."""

    _options: Any
    _saver: BackgroundSaver | None = None

    def _saver_for_save(self, group: dist.ProcessGroup | None) -> BackgroundSaver | None:
        """The saver when ``async_save`` is on; built at the first save (collective)."""
        if not self._options.async_save:
            return None
        if self._saver is None:
            self._saver = BackgroundSaver(group)
        return self._saver

    def wait_for_checkpoint(self) -> None:
        """Block until a checkpoint being written in the background is committed.

        Needed only where no later save, load or end of fit waits for it, e.g. after a
        last ``fabric.save`` (``fabric.strategy.wait_for_checkpoint()``); a no-op when
        ``async_save`` is off or nothing is in flight.

        Raises:
            CheckpointSaveError: that write failed (the previous checkpoint is intact).
        """
        if self._saver is not None:
            self._saver.wait()

    def _wait_if_writing(self, path: Any) -> None:
        """Wait when ``path`` is the checkpoint being written (before removing it)."""
        if self._saver is not None and self._saver.in_flight_path == Path(path):
            self._saver.wait()

    def _report_failed_save(self) -> None:
        """One line on rank 0 as soon as a background write is known to have failed."""
        line = self._saver.poll() if self._saver is not None else None
        if line is not None:
            rank_zero_warn(line + " (raised at the next save, load or end of fit)")

    def _close_saver(self) -> None:
        """Wait for the write in flight and stop the worker; a failure is said, not raised."""
        saver, self._saver = self._saver, None
        line = saver.close() if saver is not None else None
        if line is not None:
            rank_zero_warn(line)
