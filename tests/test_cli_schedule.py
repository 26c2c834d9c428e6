"""A resume that raises ``trainer.max_steps`` keeps the LR schedule it was trained with.

[Note: the LR schedule across a resume]: the length comes from the checkpoint, the
LR stays at the floor past it, a warning says what a re-stretch would do, and
``schedule.total_steps`` re-stretches on purpose (with the LR jump said).
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lightning_yafsdp.training.schedule import schedule_steps_of
from tests.test_cli import _yafsdp

LR, WARMUP, FLOOR = 1e-3, 1, 0.1
SHORT = [
    f"optim.lr={LR}",
    f"schedule.warmup_steps={WARMUP}",
    f"schedule.min_lr_ratio={FLOOR}",
    "trainer.devices=1",
    "trainer.checkpoint_every_n_steps=4",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "trainer.progress_bar=false",
    "data.max_bytes=300000",
    "trainer.run_name=r",
]


def _schedule(**kwargs):
    return schedule_steps_of(warmup_steps=30, decay="cosine", min_ratio=0.1, lr=3e-3, **kwargs)


def test_a_fresh_run_spans_max_steps_or_total_steps_without_a_word() -> None:
    assert _schedule(max_steps=450, total_steps=None) == (450, None)
    assert _schedule(max_steps=450, total_steps=300) == (300, None)


def test_a_resume_with_more_max_steps_keeps_the_checkpoints_length_and_says_so() -> None:
    steps, warning = _schedule(
        max_steps=900, total_steps=None, resumed_step=240, resumed_length=450
    )
    assert steps == 450
    # Half way down the 450-step cosine: 1.65e-3; re-stretched over 900 steps: 2.63e-3.
    assert "keeps the 450 steps" in warning and "1.65e-03" in warning
    assert "schedule.total_steps=900" in warning and "2.63e-03" in warning


def test_total_steps_re_stretches_a_resumed_schedule_and_says_how_far_the_lr_jumps() -> None:
    steps, warning = _schedule(max_steps=900, total_steps=900, resumed_step=240, resumed_length=450)
    assert steps == 900
    assert "re-stretches" in warning and "from 1.65e-03 to 2.63e-03" in warning


@pytest.mark.slow
def test_extending_a_finished_run_trains_on_at_the_floor_lr(tmp_path: Path) -> None:
    first = _yafsdp("train", *SHORT, "trainer.max_steps=4", cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    more = _yafsdp(
        "train", "runs/r/config.yaml", "--resume", "trainer.max_steps=8", cwd=tmp_path, timeout=300
    )
    assert more.returncode == 0, more.stderr[-3000:]
    assert "the LR schedule keeps the 4 steps the checkpoint was trained with" in more.stderr
    rows = csv.DictReader((tmp_path / "runs" / "r" / "logs" / "metrics.csv").open())
    lrs = {int(row["step"]): float(row["lr"]) for row in rows if row.get("lr")}
    assert sorted(lrs) == list(range(8))
    assert lrs[3] > LR * FLOOR  # still decaying in the first segment
    for step in range(4, 8):  # the old schedule's floor, not a re-stretched cosine
        assert lrs[step] == pytest.approx(LR * FLOOR, rel=1e-6), (step, lrs)
