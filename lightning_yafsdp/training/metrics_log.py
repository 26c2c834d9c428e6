"""``logs/metrics.csv``: one row per logged step, kept across resumes.

Lightning's CSVLogger writes one row per ``log_metrics`` call, so a step's train
loss, its tokens/s and the validation after it land on three sparse rows, and a
resume with ``version=""`` deletes the file. :class:`StepMetricsLogger` merges
every call of one step into one row and never deletes a row.

[Note: metrics rows across a resume] A checkpoint taken after ``N`` optimizer
steps (``global_step == N``) holds everything logged at Lightning steps ``< N``
(Lightning logs a step's values under the 0-based index of that step, and the
validation after step ``N`` under ``N - 1``, which still runs before the next
checkpoint's segment starts). A segment that ran past its last checkpoint and
was killed left rows at steps ``>= N`` that the resumed segment logs again. Those
rows are moved, never deleted, to ``metrics.superseded-K.csv`` next to the file.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import io
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lightning_yafsdp.config import ConfigError

METRICS_FILE = "metrics.csv"
STEP = "step"
TENSORBOARD_INSTALL = "pip install 'lightning-yafsdp[tensorboard]'"


def check_logger_available(kind: str) -> None:
    """Fails early when ``trainer.logger=kind`` needs a package that is not installed.

    Args:
        kind: ``trainer.logger``: ``"csv"``, ``"tensorboard"`` or ``"none"``.

    Raises:
        ConfigError: ``tensorboard`` without the ``tensorboard`` (or ``tensorboardX``)
            package; the message names the install command.
    """
    if kind != "tensorboard":
        return
    # Lightning's TensorBoardLogger writes with either package.
    if _importable("tensorboard") or _importable("tensorboardX"):
        return
    raise ConfigError(
        "trainer.logger='tensorboard' needs the tensorboard package, which is not installed: "
        f"{TENSORBOARD_INSTALL} (or set trainer.logger=csv)"
    )


def flat_recipe(config: Any) -> dict[str, Any]:
    """A recipe as ``{"optim.lr": 0.003, ...}``: the hyperparameters TensorBoard shows.

    The LightningModule saves no hyperparameters (its one argument is the recipe, kept
    whole in config.yaml), so Lightning logs none at fit start and TensorBoard's
    HPARAMS tab was empty; ``yafsdp train`` logs this instead.

    Lists become strings (TensorBoard's hparams take scalars and strings only); None
    stays None (Lightning writes it as "None").
    """
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}{key}.", item)
        else:
            flat[prefix[:-1]] = str(value) if isinstance(value, (list, tuple)) else value

    walk("", dataclasses.asdict(config))
    return flat


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class StepMetricsLogger(Logger):
    """A Lightning logger writing ``log_dir/metrics.csv`` with one row per step.

    Rows are merged by step; the columns are the union of every metric logged so
    far (``step`` first, then in order of first appearance). A row is on disk
    (flushed) as soon as it is logged, so a killed run keeps its rows. Only global
    rank 0 writes.

    Args:
        log_dir: The directory of ``metrics.csv`` (``runs/X/logs``).
        resume_step: The ``global_step`` of the checkpoint this run resumes from
            (optimizer steps it holds). Existing rows at steps below it are kept and
            new rows appended; rows at or after it are moved to
            ``metrics.superseded-K.csv`` (see the note above). ``None``: a fresh run;
            an existing file is moved aside whole.
    """

    def __init__(self, log_dir: str | Path, *, resume_step: int | None = None) -> None:
        super().__init__()
        self._log_dir = Path(log_dir)
        self._resume_step = 0 if resume_step is None else resume_step
        self._rows: dict[int, dict[str, Any]] = {}
        self._columns: list[str] = [STEP]
        self._file: io.TextIOWrapper | None = None
        self._last_row_offset = 0
        self._prepared = False
        self.superseded_path: Path | None = None

    # -- Lightning's Logger interface -----------------------------------------------------

    @property
    @override
    def name(self) -> str:
        return "metrics"

    @property
    @override
    def version(self) -> str:
        return ""

    @property
    @override
    def save_dir(self) -> str:
        return str(self._log_dir.parent)

    @property
    @override
    def log_dir(self) -> str:
        return str(self._log_dir)

    @property
    def path(self) -> Path:
        """The CSV file this logger writes."""
        return self._log_dir / METRICS_FILE

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        # The resolved recipe is saved as config.yaml next to logs/; nothing to add.
        self.set_aside_superseded_rows()

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        self.set_aside_superseded_rows()
        values = {key: _scalar(value) for key, value in metrics.items() if key != STEP}
        if step is None:
            step = int(metrics.get(STEP, self._last_step() + 1))
        last = self._last_step()
        new_columns = [key for key in values if key not in self._columns]
        row = self._rows.setdefault(step, {STEP: step})
        row.update(values)
        self._columns.extend(new_columns)
        if new_columns or step < last or self._file is None:
            self._rewrite()
        elif step == last:
            self._rewrite_last_row(row)
        else:
            self._append(row)

    @override
    @rank_zero_only
    def save(self) -> None:
        if self._file is not None:
            self._file.flush()

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- resume -----------------------------------------------------------------------------

    @rank_zero_only
    def set_aside_superseded_rows(self) -> Path | None:
        """Loads the existing file, moving rows the resumed run logs again (once).

        Called by the first write; call it earlier to tell the user before training.

        Returns:
            The ``metrics.superseded-K.csv`` that received the moved rows, or None
            (nothing to move, or not rank 0).
        """
        if self._prepared:
            return self.superseded_path
        self._prepared = True
        if not self.path.exists():
            return None
        columns, rows = read_metrics(self.path)
        kept = {step: row for step, row in rows.items() if step < self._resume_step}
        later = [row for step, row in rows.items() if step >= self._resume_step]
        self._columns = _ordered_columns(columns)
        self._rows = kept
        if later:
            self.superseded_path = _free_sibling(self.path)
            _write_csv_atomically(self.superseded_path, self._columns, later)
        self._rewrite()
        return self.superseded_path

    # -- writing ------------------------------------------------------------------------------

    def _last_step(self) -> int:
        return max(self._rows, default=-1)

    def _rewrite(self) -> None:
        # A new column changes the header: the whole file is written again, atomically.
        if self._file is not None:
            self._file.close()
        ordered = [self._rows[step] for step in sorted(self._rows)]
        _write_csv_atomically(self.path, self._columns, ordered[:-1])
        self._file = self.path.open("a+", newline="")
        self._last_row_offset = self._file.tell()
        if ordered:
            self._write_row(ordered[-1])

    def _rewrite_last_row(self, row: dict[str, Any]) -> None:
        # Another metric of the step already on the last line: that line is written again.
        assert self._file is not None
        self._file.seek(self._last_row_offset)
        self._file.truncate()
        self._write_row(row)

    def _append(self, row: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.seek(0, os.SEEK_END)
        self._last_row_offset = self._file.tell()
        self._write_row(row)

    def _write_row(self, row: dict[str, Any]) -> None:
        assert self._file is not None
        csv.DictWriter(self._file, fieldnames=self._columns).writerow(_formatted(row))
        self._file.flush()


def read_metrics(path: str | Path) -> tuple[list[str], dict[int, dict[str, Any]]]:
    """Reads a metrics CSV (ours, or Lightning's sparse one), merging rows by step.

    Args:
        path: The CSV file.

    Returns:
        The columns in file order and the rows by step; a row maps a column to a
        float and holds only the columns that have a value on that step.
    """
    rows: dict[int, dict[str, Any]] = {}
    with Path(path).open(newline="") as handle:
        reader = csv.DictReader(handle)
        columns = list(reader.fieldnames or [])
        for record in reader:
            if not record.get(STEP):
                continue
            step = int(float(record[STEP]))
            row = rows.setdefault(step, {STEP: step})
            row.update(
                {k: float(v) for k, v in record.items() if k != STEP and v not in ("", None)}
            )
    return columns, rows


def _scalar(value: Any) -> float:
    return float(value.item() if hasattr(value, "item") else value)


def _ordered_columns(columns: list[str]) -> list[str]:
    return [STEP, *(column for column in columns if column != STEP)]


def _free_sibling(path: Path) -> Path:
    # metrics.superseded-1.csv, -2, ...: an earlier set-aside file is never overwritten.
    for index in range(1, 10_000):
        candidate = path.with_name(f"{path.stem}.superseded-{index}{path.suffix}")
        if not candidate.exists():
            return candidate
    raise FileExistsError(f"{path.parent} holds 9999 superseded metrics files; remove some")


def _write_csv_atomically(path: Path, columns: list[str], rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(_formatted(row) for row in rows)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


def _formatted(row: dict[str, Any]) -> dict[str, Any]:
    # Steps (and epochs) read back as floats from an older file: written as integers.
    return {k: int(v) if k in (STEP, "epoch") and math.isfinite(v) else v for k, v in row.items()}
