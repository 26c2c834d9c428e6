"""``yafsdp train --resume``: a stopped run continues exactly, its metrics are kept.

One uninterrupted run of the default recipe (2 CPU ranks, shortened), then the same
run resumed from its middle checkpoint through ``yafsdp train runs/X/config.yaml
--resume PATH``: the resumed steps must repeat the uninterrupted losses (same data
order, same weights, same optimizer state), the rows logged up to the checkpoint
must survive, the rows after it must be kept aside, and the summary must cover the
whole run. Cheap refusals (nothing to resume, a run folder already in use) run
in-process.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from lightning_yafsdp.cli.main import main
from lightning_yafsdp.config import ConfigError
from lightning_yafsdp.training.resume import LATEST, plan_start
from tests.test_cli import _yafsdp

STEPS, MIDDLE = 12, 6
RUN = [
    f"trainer.max_steps={STEPS}",
    f"trainer.checkpoint_every_n_steps={MIDDLE}",
    f"trainer.val_check_interval={MIDDLE}",
    "trainer.log_every_n_steps=1",
    "trainer.progress_bar=false",
]


def _rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open()))


def _losses(rows: list[dict[str, str]]) -> dict[int, float]:
    return {int(r["step"]): float(r["train_loss"]) for r in rows if r.get("train_loss")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    cwd = tmp_path_factory.mktemp("resume")
    first = _yafsdp("train", *RUN, "trainer.run_name=r", cwd=cwd, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    run_dir = cwd / "runs" / "r"
    before = {
        "rows": _rows(run_dir / "logs" / "metrics.csv"),
        "summary": json.loads((run_dir / "summary.json").read_text()),
    }
    middle = next(run_dir.glob(f"checkpoints/*step={MIDDLE}.ckpt"))
    resumed = _yafsdp(
        "train",
        "runs/r/config.yaml",
        "--resume",
        str(middle.relative_to(cwd)),
        cwd=cwd,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    return {"cwd": cwd, "run_dir": run_dir, "before": before, "resumed": resumed}


def test_the_resumed_steps_repeat_the_uninterrupted_losses(runs) -> None:
    before = _losses(runs["before"]["rows"])
    after = _losses(_rows(runs["run_dir"] / "logs" / "metrics.csv"))
    assert sorted(after) == list(range(STEPS)) == sorted(before)
    for step in range(MIDDLE, STEPS):
        # Same batches, weights and AdamW state: equal to float round-off (measured: equal).
        assert after[step] == pytest.approx(before[step], rel=1e-6, abs=0), step


def test_metrics_up_to_the_checkpoint_are_kept_and_later_rows_set_aside(runs) -> None:
    logs = runs["run_dir"] / "logs"
    kept = [r for r in _rows(logs / "metrics.csv") if int(r["step"]) < MIDDLE]
    assert kept == [r for r in runs["before"]["rows"] if int(r["step"]) < MIDDLE]
    aside = sorted(logs.glob("metrics.superseded*.csv"))
    assert len(aside) == 1, sorted(p.name for p in logs.iterdir())
    assert _losses(_rows(aside[0])) == {
        step: loss for step, loss in _losses(runs["before"]["rows"]).items() if step >= MIDDLE
    }


def test_the_summary_covers_the_whole_run(runs) -> None:
    summary = json.loads((runs["run_dir"] / "summary.json").read_text())
    first = runs["before"]["summary"]
    assert summary["steps"] == STEPS and summary["resumed_from_step"] == MIDDLE
    assert summary["tokens"] == first["tokens"] == STEPS * 16 * 128 * 2
    assert summary["first_train_loss"] == first["first_train_loss"]
    assert first["resumed_from_step"] is None


def test_the_startup_panel_says_what_is_resumed(runs) -> None:
    stdout = runs["resumed"].stdout
    out = " ".join(stdout.replace("│", " ").split())  # the panel wraps lines
    assert f"resuming at step {MIDDLE}, {MIDDLE * 16 * 128 * 2:,} tokens seen" in out
    (resuming,) = [line for line in stdout.splitlines() if line.startswith("resuming ")]
    assert resuming.endswith(f"step={MIDDLE}.ckpt") and " at step" not in resuming  # whole
    assert f"{STEPS} (resumed at step {MIDDLE})" in out
    assert "dataloader is not resumable" not in runs["resumed"].stderr


def test_config_yaml_names_its_run(runs) -> None:
    assert "run_name: r\n" in (runs["run_dir"] / "config.yaml").read_text()


def test_a_bare_resume_picks_the_newest_checkpoint(runs) -> None:
    # Two checkpoints hold step 12: the interrupted segment's last.ckpt and the resumed
    # segment's (Lightning names it last-v1.ckpt beside it); the one written last wins.
    start = plan_start(runs["run_dir"], LATEST)
    assert start.checkpoint == runs["run_dir"] / "checkpoints" / "last-v1.ckpt"
    assert start.step == STEPS and start.tokens == STEPS * 16 * 128 * 2


def test_a_run_folder_in_use_is_refused_without_resume(runs, capsys) -> None:
    metrics = (runs["run_dir"] / "logs" / "metrics.csv").read_bytes()
    args = ["train", str(runs["run_dir"] / "config.yaml"), "trainer.devices=1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err and len(err.splitlines()) == 1
    assert (runs["run_dir"] / "logs" / "metrics.csv").read_bytes() == metrics


# -- refusals before anything runs ----------------------------------------------------------


def test_resume_with_nothing_to_resume_is_an_error(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", "trainer.run_name=new", "trainer.devices=1"]) == 2
    assert "no checkpoint to resume in run folder" in capsys.readouterr().err
    assert main(["train", "--resume", "trainer.devices=1"]) == 2
    assert "--resume continues a named run" in capsys.readouterr().err
    assert main(["train", "--resume", "missing.ckpt"]) == 2
    assert "missing.ckpt does not exist" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_config_is_an_alias_of_the_positional_recipe(capsys) -> None:
    assert main(["train", "--config", "llama-1b", "--print-config"]) == 0
    assert "recipe: llama-1b" in capsys.readouterr().out
    assert main(["train", "tiny-cpu", "--config", "llama-1b"]) == 2
    assert "two recipes given" in capsys.readouterr().err


def test_resuming_from_something_that_is_not_a_checkpoint_is_refused(tmp_path) -> None:
    (tmp_path / "not-a-checkpoint").mkdir()
    with pytest.raises(ConfigError, match="cannot resume from"):
        plan_start(tmp_path / "run", str(tmp_path / "not-a-checkpoint"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.devices=0", "trainer.devices=0: give the number of processes per node"),
        ("trainer.devices=-1", "trainer.devices=-1 means every GPU, and this run is on CPU"),
        ("trainer.accelerator=gpu", "torch sees no CUDA GPU"),
        ("data.source=bin data.path=missing.bin", "data.path='missing.bin' does not exist"),
        ("data.source=text data.path=nowhere/*.txt", "matches no file or directory"),
        ("data.tokenizer=no-such-dir", "neither 'byte' nor a local tokenizer directory"),
        ("model.kind=hf model.hf_path=no-such-model", "'no-such-model' does not exist"),
    ],
)
def test_missing_inputs_fail_in_one_line_before_anything_is_written(
    override, message, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", *override.split(), "trainer.run_name=x"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()


def test_estimate_of_a_missing_local_model_does_not_reach_for_the_hub(tmp_path, capsys) -> None:
    assert main(["estimate", "model.kind=hf", f"model.hf_path={tmp_path / 'gone'}"]) == 2
    assert "does not exist: it must be a local Hugging Face model" in capsys.readouterr().err


def test_resume_from_a_damaged_checkpoint_names_the_file_and_changes_nothing(
    runs, tmp_path, monkeypatch, capsys
) -> None:
    import shutil

    damaged = tmp_path / "step.ckpt"
    shutil.copytree(next(runs["run_dir"].glob(f"checkpoints/*step={MIDDLE}.ckpt")), damaged)
    shard = damaged / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = {p: p.read_bytes() for p in damaged.iterdir()}
    monkeypatch.chdir(tmp_path)
    assert main(["train", "tiny-cpu", "--resume", str(damaged), "trainer.run_name=d"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "__1_0.distcp" in err and "truncated" in err
    assert {p: p.read_bytes() for p in damaged.iterdir()} == before
    assert not (tmp_path / "runs").exists()


def _snapshot(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_finished_run_is_not_resumed_and_not_touched(runs, capsys) -> None:
    before = _snapshot(runs["run_dir"])
    # `--resume RUN_FOLDER` is the run from its newest checkpoint, here at max_steps.
    assert main(["train", "--resume", str(runs["run_dir"])]) == 2
    err = capsys.readouterr().err
    assert f"at step {STEPS}, and trainer.max_steps={STEPS}: nothing to train" in err
    assert _snapshot(runs["run_dir"]) == before


def test_a_checkpoint_outside_any_run_needs_its_recipe(runs, tmp_path, capsys) -> None:
    import shutil

    loose = tmp_path / "loose.ckpt"
    shutil.copytree(runs["run_dir"] / "checkpoints" / "last.ckpt", loose)
    assert main(["train", "--resume", str(loose)]) == 2
    assert "is in no run folder" in capsys.readouterr().err


def test_a_copied_run_folder_continues_in_the_copy(runs, tmp_path, capsys) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(runs["run_dir"], copy)
    assert main(["train", str(copy / "config.yaml"), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert f"output_dir: {tmp_path}\n" in out and "run_name: copy\n" in out


def test_a_bare_resume_skips_a_damaged_newest_checkpoint(runs, tmp_path) -> None:
    import shutil

    copy = tmp_path / "r"
    shutil.copytree(runs["run_dir"], copy)
    newest = copy / "checkpoints" / "last-v1.ckpt"
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    start = plan_start(copy, LATEST)
    assert start.checkpoint != newest and start.step == STEPS  # the other step-12 state
    assert any("skipped last-v1.ckpt" in note and "truncated" in note for note in start.notes)


def test_a_failed_resume_leaves_the_run_folder_as_it_was(runs, tmp_path) -> None:
    import shutil

    copy = tmp_path / "runs" / "f"
    shutil.copytree(runs["run_dir"], copy)
    before = _snapshot(copy)
    middle = next(copy.glob(f"checkpoints/*step={MIDDLE}.ckpt"))
    failed = _yafsdp(
        "train",
        "runs/f/config.yaml",
        "--resume",
        str(middle.relative_to(tmp_path)),
        "model.dim=32",
        "trainer.devices=1",
        cwd=tmp_path,
        timeout=240,
    )
    assert failed.returncode != 0
    assert "model.layers.0.attention" in failed.stderr or "shape" in failed.stderr
    assert _snapshot(copy) == before
