"""What the terminal shows while training: a progress bar in optimizer steps.

Lightning's RichProgressBar counts the micro-batches of one epoch: a 450-step run
whose epoch holds 927 batches ends at "450/927" (49%) with an ETA still running,
and with gradient accumulation it counts every micro-batch. :class:`StepProgressBar`
counts optimizer steps (``trainer.global_step``) up to ``trainer.max_steps``, in one
bar for the whole run, resumed runs starting where their checkpoint stopped.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar
from rich.progress import ProgressColumn, Task
from rich.text import Text
from typing_extensions import override

_DESCRIPTION = "steps"


class StepProgressBar(RichProgressBar):
    """A rich progress bar whose training bar counts optimizer steps to ``max_steps``.

    Without a ``max_steps`` (``-1``) it is Lightning's bar. Validation keeps its own
    bar. The time column shows "elapsed • remaining" while training and only the
    elapsed time once the bar is full (no stale estimate at the end).
    """

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not _counts_steps(trainer):
            super().on_train_epoch_start(trainer, pl_module)
            return
        # One bar for every epoch: Lightning's would reset (or restart) per epoch.
        if self.is_disabled or self.progress is None or self.train_progress_bar_id is not None:
            return
        self._initialize_train_progress_bar_id()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if not _counts_steps(trainer):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, idx)
            return
        if self.is_disabled:
            return
        if self.train_progress_bar_id is None:  # resumed mid-epoch
            self._initialize_train_progress_bar_id()
        # global_step already counts this batch's optimizer step, if it made one.
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    @override
    def _initialize_train_progress_bar_id(self) -> None:
        if not _counts_steps(self.trainer):
            super()._initialize_train_progress_bar_id()
            return
        assert self.progress is not None
        self.train_progress_bar_id = self._add_task(self.trainer.max_steps, _DESCRIPTION)
        self._update(self.train_progress_bar_id, self.trainer.global_step)

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        # The loggers' version ("tensorboard" -> "oard"): a run has its name, not versions.
        metrics.pop("v_num", None)
        return metrics

    @override
    def configure_columns(self, trainer: pl.Trainer) -> list:
        columns = super().configure_columns(trainer)
        time_column = next(c for c in columns if type(c).__name__ == "CustomTimeColumn")
        columns[columns.index(time_column)] = _ElapsedThenDoneColumn(style=self.theme.time)
        return columns


class _ElapsedThenDoneColumn(ProgressColumn):
    """``elapsed • remaining`` while running, ``elapsed`` alone once finished."""

    max_refresh = 0.5  # as Lightning's: no jitter

    def __init__(self, style: Any) -> None:
        self.style = style
        super().__init__()

    def render(self, task: Task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        shown = "-:--:--" if elapsed is None else str(timedelta(seconds=int(elapsed)))
        if not task.finished:
            remaining = task.time_remaining
            shown += " • " + (
                "-:--:--" if remaining is None else str(timedelta(seconds=int(remaining)))
            )
        return Text(shown, style=self.style)


def _counts_steps(trainer: pl.Trainer) -> bool:
    return trainer.max_steps is not None and trainer.max_steps > 0
