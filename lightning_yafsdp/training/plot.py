"""``runs/X/metrics.png``: the loss, learning rate and tokens/s of a run against step.

Drawn with matplotlib's Agg renderer on a bare ``Figure`` (no pyplot, no display,
no global backend switch), from ``logs/metrics.csv`` (see ``metrics_log``).
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any

from lightning_yafsdp.training.metrics_log import METRICS_FILE, STEP, read_metrics

PLOT_FILE = "metrics.png"
SUMMARY_FILE = "summary.json"
_LOSS_COLUMNS = ("train_loss", "val_loss")
# What --output's extension may be (matplotlib writes each without another package).
FORMATS = ("png", "svg", "pdf", "jpg", "jpeg")


class PlotError(ValueError):
    """No metrics to plot: the message names the file and why."""


def metrics_path_of(run: str | Path) -> Path:
    """The metrics CSV of ``run``: a run directory, or the CSV itself.

    Raises:
        PlotError: Neither ``run/logs/metrics.csv`` nor a CSV file at ``run``.
    """
    run = Path(run)
    if run.is_file():
        return run
    for candidate in (run / "logs" / METRICS_FILE, run / METRICS_FILE):
        if candidate.is_file():
            return candidate
    if not run.exists():
        raise PlotError(
            f"{run} does not exist: give a run directory (runs/NAME) or its metrics.csv"
        )
    raise PlotError(
        f"{run} has no logs/{METRICS_FILE}: not a run directory, or the run used "
        "trainer.logger=none"
    )


def default_plot_path(metrics_path: Path) -> Path:
    """``runs/X/metrics.png`` for ``runs/X/logs/metrics.csv``, else next to the CSV."""
    folder = metrics_path.parent
    run_dir = folder.parent if folder.name == "logs" else folder
    return run_dir / PLOT_FILE


def write_plot(
    run: str | Path, *, output: str | Path | None = None, baseline: float | None = None
) -> Path:
    """Writes the picture of a run's train/validation loss, learning rate and tokens/s.

    Args:
        run: A run directory (``runs/NAME``) or its ``logs/metrics.csv``.
        output: The file to write, in the format its extension names (one of
            :data:`FORMATS`; none: PNG), or a directory for ``metrics.png`` (default:
            the run directory); an existing file there is replaced (atomically).
        baseline: The unigram entropy of the validation tokens (nats/token), drawn as
            the loss a model that ignores context reaches; default: the
            ``unigram_entropy`` of the run's summary.json, if it has one.

    Returns:
        The path written.

    Raises:
        PlotError: No metrics file, no loss logged in it yet, or an extension that
            is not an image format.
    """
    metrics_path = metrics_path_of(run)
    try:
        _, rows = read_metrics(metrics_path)
    except (ValueError, csv.Error, UnicodeDecodeError) as err:
        raise PlotError(f"{metrics_path} is not a metrics CSV ({err})") from None
    series = {column: _series(rows, column) for column in (*_LOSS_COLUMNS, "lr", "tokens_per_s")}
    if not any(series[column][0] for column in _LOSS_COLUMNS):
        raise PlotError(
            f"{metrics_path} has no train_loss or val_loss yet (the run logs them every "
            "trainer.log_every_n_steps steps)"
        )
    target = Path(output) if output is not None else default_plot_path(metrics_path)
    if target.is_dir():
        target = target / PLOT_FILE
    image_format = _format_of(target)
    run_dir = default_plot_path(metrics_path).parent
    if baseline is None:
        baseline = _summary_baseline(run_dir)
    figure = _figure(series, title=run_dir.name, baseline=baseline)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    figure.savefig(partial, format=image_format, dpi=100)
    os.replace(partial, target)
    return target


def _format_of(target: Path) -> str:
    extension = target.suffix.lower().lstrip(".")
    if not extension:
        return "png"
    if extension not in FORMATS:
        raise PlotError(
            f"--output {target}: .{extension} is not an image format this writes; "
            f"use one of {', '.join('.' + f for f in FORMATS)}"
        )
    return extension


def _summary_baseline(run_dir: Path) -> float | None:
    """The unigram baseline ``yafsdp train`` recorded in the run's summary.json."""
    try:
        value = json.loads((run_dir / SUMMARY_FILE).read_text()).get("unigram_entropy")
    except (OSError, ValueError, AttributeError):
        return None  # a run still training has no summary yet
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _series(rows: dict[int, dict[str, Any]], column: str) -> tuple[list[int], list[float]]:
    points = [(step, row[column]) for step, row in sorted(rows.items()) if column in row]
    return [step for step, _ in points], [value for _, value in points]


def _figure(
    series: dict[str, tuple[list[int], list[float]]], *, title: str, baseline: float | None
) -> Any:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 8), layout="constrained")
    loss_axes, lr_axes, speed_axes = figure.subplots(
        3, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1, 1]}
    )
    figure.suptitle(title)
    _draw(loss_axes, series["train_loss"], label="train loss", style="-")
    _draw(loss_axes, series["val_loss"], label="validation loss", style="o-")
    if baseline is not None:
        # The loss of predicting every token from its frequency alone: a model that has
        # learned anything from context ends below it.
        loss_axes.axhline(
            baseline, linestyle="--", color="gray", label=f"unigram baseline ({baseline:.2f})"
        )
    loss_axes.set_ylabel("loss (nats/token)")
    loss_axes.legend()
    _draw(lr_axes, series["lr"], label="learning rate", style="-")
    lr_axes.set_ylabel("learning rate")
    _draw(speed_axes, series["tokens_per_s"], label="tokens/s", style="-")
    speed_axes.set_ylabel("tokens/s (all ranks)")
    speed_axes.set_xlabel(STEP)
    return figure


def _draw(axes: Any, points: tuple[list[int], list[float]], *, label: str, style: str) -> None:
    steps, values = points
    if steps:
        axes.plot(steps, values, style, label=label, markersize=3)
    else:
        axes.text(
            0.5, 0.5, f"no {label} logged", ha="center", va="center", transform=axes.transAxes
        )
    axes.grid(alpha=0.3)
