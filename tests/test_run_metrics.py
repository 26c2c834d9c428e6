"""Seeing a run: metrics.csv (one row per step, kept across resumes), the PNG plot,
TensorBoard, the progress bar in optimizer steps, the oversubscription warning."""

from __future__ import annotations

import contextlib
import csv
import io
import os
import sys
from pathlib import Path

import pytest

from lightning_yafsdp.adapters.hosts import oversubscription_warning
from lightning_yafsdp.cli.main import main
from lightning_yafsdp.config import ConfigError
from lightning_yafsdp.training.metrics_log import StepMetricsLogger, check_logger_available

MAX_STEPS = 8
_TINY_RUN = [
    "trainer.devices=1",
    f"trainer.max_steps={MAX_STEPS}",
    "trainer.accumulate_grad_batches=2",
    "trainer.val_check_interval=4",  # micro-batches: a validation every 2 optimizer steps
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=2",
    "trainer.checkpoint_every_n_steps=0",
    "trainer.logger=tensorboard",
    "trainer.progress_bar=true",
    "trainer.run_name=seen",
    "data.max_bytes=200000",
    "data.batch_size=4",
    "data.seq_len=64",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """One ``yafsdp train`` on one rank; its run directory and what it printed."""
    out_dir = tmp_path_factory.mktemp("runs")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("COLUMNS", "200")  # the rich bar's width off a terminal
        with contextlib.redirect_stdout(printed):
            code = main(["train", "--quiet", *_TINY_RUN, f"trainer.output_dir={out_dir}"])
    assert code == 0, printed.getvalue()[-3000:]
    return {"dir": out_dir / "seen", "stdout": printed.getvalue()}


def _rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open()))


# -- metrics.csv -------------------------------------------------------------------------------


def test_metrics_csv_has_one_row_per_logged_step_with_train_val_lr_and_speed(run: dict) -> None:
    rows = _rows(run["dir"] / "logs" / "metrics.csv")
    # Step 0: the loss at initialisation; then every 2nd step, where validation also ran.
    assert [int(row["step"]) for row in rows] == [0, 1, 3, 5, 7]
    for row in rows[1:]:
        assert all(row[key] for key in ("train_loss", "lr", "tokens_per_s", "val_loss")), row
    assert 4.0 < float(rows[-1]["val_loss"]) < float(rows[0]["train_loss"]) < 6.0


def test_resume_keeps_earlier_rows_and_moves_later_ones_aside(tmp_path: Path) -> None:
    first = StepMetricsLogger(tmp_path)
    for step in range(10):
        first.log_metrics({"train_loss": 5.0 - step / 10}, step=step)
    first.finalize("killed after its checkpoint at global_step 6")

    resumed = StepMetricsLogger(tmp_path, resume_step=6)
    for step in (6, 7):
        resumed.log_metrics({"train_loss": 1.0, "lr": 0.1}, step=step)
    rows = _rows(tmp_path / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert float(rows[5]["train_loss"]) == pytest.approx(4.5) and not rows[5]["lr"]
    assert float(rows[6]["train_loss"]) == 1.0
    assert resumed.superseded_path == tmp_path / "metrics.superseded-1.csv"
    moved = _rows(resumed.superseded_path)
    assert [int(r["step"]) for r in moved] == [6, 7, 8, 9]
    assert float(moved[0]["train_loss"]) == pytest.approx(4.4)


def test_a_fresh_run_over_an_old_file_moves_it_aside_without_overwriting(tmp_path: Path) -> None:
    (tmp_path / "metrics.superseded-1.csv").write_text("step,train_loss\n3,1.0\n")
    (tmp_path / "metrics.csv").write_text("step,train_loss\n0,5.0\n1,4.0\n")
    fresh = StepMetricsLogger(tmp_path)
    fresh.log_metrics({"train_loss": 5.5}, step=0)
    assert [r["train_loss"] for r in _rows(tmp_path / "metrics.csv")] == ["5.5"]
    assert (tmp_path / "metrics.superseded-1.csv").read_text() == "step,train_loss\n3,1.0\n"
    assert [r["step"] for r in _rows(tmp_path / "metrics.superseded-2.csv")] == ["0", "1"]


def test_rows_merge_by_step_and_are_on_disk_before_the_run_ends(tmp_path: Path) -> None:
    logger = StepMetricsLogger(tmp_path)
    logger.log_metrics({"train_loss": 5.0, "lr": 0.1}, step=3)
    logger.log_metrics({"tokens_per_s": 100.0, "epoch": 0}, step=3)
    logger.log_metrics({"train_loss": 4.0}, step=5)
    logger.log_metrics({"val_loss": 4.5}, step=5)  # a new column: the header is rewritten
    # Read without finalize: a killed run keeps these rows.
    assert _rows(tmp_path / "metrics.csv") == [
        {"step": "3", "train_loss": "5.0", "lr": "0.1", "tokens_per_s": "100.0", "epoch": "0",
         "val_loss": ""},
        {"step": "5", "train_loss": "4.0", "lr": "", "tokens_per_s": "", "epoch": "",
         "val_loss": "4.5"},
    ]  # fmt: skip


# -- the plot ----------------------------------------------------------------------------------


def test_plot_writes_a_png_of_the_run_and_prints_its_path(run: dict, capsys) -> None:
    assert main(["plot", str(run["dir"])]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == run["dir"] / "metrics.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_plot_to_a_chosen_path_from_the_csv(run: dict, tmp_path: Path, capsys) -> None:
    target = tmp_path / "pictures" / "loss.png"
    assert main(["plot", str(run["dir"] / "logs" / "metrics.csv"), "--output", str(target)]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    assert target.read_bytes()[:4] == b"\x89PNG"


def test_plot_of_a_missing_run_or_empty_metrics_is_one_clear_line(tmp_path, capsys) -> None:
    assert main(["plot", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err and "run directory" in err
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.csv").write_text("step,train_loss\n")
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no train_loss or val_loss yet" in err
    assert not (tmp_path / "metrics.png").exists()


# -- TensorBoard -------------------------------------------------------------------------------


def test_tensorboard_writes_events_next_to_metrics_csv(run: dict) -> None:
    (events,) = (run["dir"] / "logs" / "tensorboard").glob("events.out.tfevents.*")
    data = events.read_bytes()
    assert b"train_loss" in data and b"val_loss" in data
    assert (run["dir"] / "logs" / "metrics.csv").is_file()


def test_tensorboard_hparams_are_the_flattened_recipe(run: dict) -> None:
    import yaml

    from lightning_yafsdp.config import load_config
    from lightning_yafsdp.training.metrics_log import flat_recipe

    board = run["dir"] / "logs" / "tensorboard"
    hparams = yaml.safe_load((board / "hparams.yaml").read_text())
    recipe = flat_recipe(load_config(run["dir"] / "config.yaml"))
    assert hparams == recipe and hparams["trainer.max_steps"] == MAX_STEPS  # was {}
    (events,) = board.glob("events.out.tfevents.*")
    assert b"optim.lr" in events.read_bytes() and b"strategy.zero_stage" in events.read_bytes()


def test_tensorboard_not_installed_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ConfigError, match=r"pip install 'lightning-yafsdp\[tensorboard\]'"):
        check_logger_available("tensorboard")
    check_logger_available("csv")


# -- the terminal ------------------------------------------------------------------------------


def test_progress_bar_counts_optimizer_steps_to_max_steps(run: dict) -> None:
    # 8 optimizer steps of 2 micro-batches each: the bar ends full at 8/8, with no ETA.
    (bar,) = [line for line in run["stdout"].splitlines() if line.startswith("steps ")]
    assert f" {MAX_STEPS}/{MAX_STEPS} " in bar and "•" not in bar


def test_more_cpu_ranks_than_cores_is_warned() -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    warning = oversubscription_warning(cores + 1, "cpu")
    assert warning and f"{cores + 1} CPU ranks" in warning and "\n" not in warning
    assert f"set devices={cores} or fewer" in warning
    assert oversubscription_warning(cores, "cpu") is None
    assert oversubscription_warning(cores + 1, "cuda") is None
