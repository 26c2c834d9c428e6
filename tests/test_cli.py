"""The ``yafsdp`` command: help, config errors before any process starts, the default run."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_yafsdp import __version__
from lightning_yafsdp.cli.main import main
from lightning_yafsdp.config import ConfigError, load_config

REPO = Path(__file__).resolve().parent.parent


def _yafsdp(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "lightning_yafsdp", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- help ---------------------------------------------------------------------------------


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_help_lists_every_command(capsys) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in ("train", "estimate", "prepare", "export", "inspect", "plot"):
        assert command in out
    assert "planned" not in out


@pytest.mark.parametrize("command", ["train", "estimate", "prepare", "export", "inspect", "plot"])
def test_each_command_has_help(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"yafsdp {command}" in capsys.readouterr().out


def test_train_help_lists_every_config_key_with_type_default_and_description(capsys) -> None:
    from lightning_yafsdp.cli.config_help import config_keys

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    keys = list(config_keys())
    assert len(keys) > 60
    for key in keys:
        assert key.description, f"{key.name} has no description in its section's docstring"
        line = next(line for line in out.splitlines() if line.split()[:1] == [key.name])
        assert f"{key.type} = {key.default}" in line and key.description[:30] in line
    # Types, defaults and several names sharing one docstring entry come out right.
    assert "trainer.max_steps" in out and "int = 450  Optimizer steps to run." in out
    assert "model.rope_theta" in out and "float | null = null  override the preset's" in out
    assert "optim.betas" in out and "list[float] = [0.9, 0.95]" in out


def test_inspect_of_a_directory_that_is_not_a_checkpoint_fails_clearly(tmp_path, capsys) -> None:
    assert main(["inspect", str(tmp_path)]) == 2
    assert "yafsdp inspect:" in capsys.readouterr().err


def test_export_of_a_missing_path_fails_clearly(tmp_path, capsys) -> None:
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "yafsdp export:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# -- config errors ----------------------------------------------------------------------------


def test_unknown_key_names_the_closest_valid_key() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'optim.lrr'.*did you mean 'optim.lr'"):
        load_config(None, ["optim.lrr=1e-3"])


def test_unknown_section_names_the_closest_section() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'trainr'.*did you mean 'trainer'"):
        load_config(None, ["trainr.devices=1"])


def test_unknown_key_in_a_recipe_file_names_the_file(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model:\n  n_layer: 2\n")
    with pytest.raises(
        ConfigError, match=r"bad.yaml: unknown key 'model.n_layer'.*'model.n_layers'"
    ):
        load_config(recipe)


def test_wrong_type_names_the_key_and_the_expected_type() -> None:
    with pytest.raises(ConfigError, match=r"wrong type for 'trainer.max_steps' \(expected int\)"):
        load_config(None, ["trainer.max_steps=many"])


def test_value_out_of_range_is_an_error() -> None:
    with pytest.raises(ConfigError, match="trainer.precision='16-mixed'"):
        load_config(None, ["trainer.precision=16-mixed"])


@pytest.mark.parametrize(("given", "meant"), [("bf16", "bf16-mixed"), ("32", "32-true")])
def test_lightnings_precision_aliases_are_accepted_and_written_out(given, meant) -> None:
    assert load_config(None, [f"trainer.precision={given}"]).trainer.precision == meant


def test_our_precision_aliases_are_lightnings() -> None:
    from lightning.fabric.connector import _PRECISION_INPUT_STR_ALIAS_CONVERSION

    from lightning_yafsdp.config import PRECISION_ALIASES

    assert PRECISION_ALIASES == {
        str(k): v for k, v in _PRECISION_INPUT_STR_ALIAS_CONVERSION.items()
    }


def test_a_precision_recipes_do_not_support_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"'16-mixed' is not one of .* aliases '32', 'bf16'"):
        load_config(None, ["trainer.precision=16"])


def test_override_without_equals_is_an_error() -> None:
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(None, ["optim.lr"])


def test_overrides_apply_over_the_recipe() -> None:
    config = load_config("llama-1b", ["optim.lr=3e-4", "trainer.devices=8"])
    assert config.optim.lr == 3e-4 and config.trainer.devices == "8"
    assert config.model.preset == "llama-1b" and config.recipe == "llama-1b"


def test_bad_config_fails_before_any_process_starts(tmp_path: Path) -> None:
    result = _yafsdp("train", "model.dimm=32", cwd=tmp_path)
    assert result.returncode == 2
    assert "unknown key 'model.dimm'" in result.stderr and "'model.dim'" in result.stderr
    assert "Initializing distributed" not in result.stdout + result.stderr
    assert not (tmp_path / "runs").exists()


def test_print_config_shows_the_resolved_config(capsys) -> None:
    assert main(["train", "--print-config", "optim.lr=0.001", "data.seq_len=64"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.001" in out and "seq_len: 64" in out and "recipe: tiny-cpu" in out


@pytest.mark.parametrize(
    "overrides",
    [["data.source=bin", "data.path=missing.bin"], ["strategy.shard_size=3"]],
    ids=["missing-data", "shard-size"],
)
def test_an_input_error_is_the_only_thing_printed(overrides, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", *overrides, "trainer.run_name=x"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, out[:300] + err  # no YAML above it


def test_check_runs_the_input_checks_and_says_how_the_run_would_start(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--check", "data.source=bin", "data.path=missing.bin"]) == 2
    assert "data.path='missing.bin' does not exist" in capsys.readouterr().err
    assert main(["train", "--check", "trainer.run_name=r", "--resume", "auto"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("yafsdp train --check: tiny-cpu in runs/r: fresh run"), out
    assert main(["train", "--check", "trainer.run_name=r", "--resume"]) == 2  # not auto
    assert "no checkpoint to resume" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing written


def test_more_cpu_ranks_than_cores_is_said_on_stderr_even_with_quiet(
    tmp_path, monkeypatch, capsys
) -> None:
    cores = len(os.sched_getaffinity(0))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "x" / "logs").mkdir(parents=True)
    (tmp_path / "runs" / "x" / "logs" / "metrics.csv").write_text("step\n0\n")
    # The run itself is refused (its folder is in use) right after the input checks:
    # no rank is started, whatever the core count.
    args = ["train", f"trainer.devices={cores + 1}", "trainer.run_name=x", "--quiet"]
    assert main(args) == 2
    first, refusal = capsys.readouterr().err.splitlines()
    assert f"{cores + 1} CPU ranks on {cores} usable core(s)" in first
    assert f"trainer.devices={cores} or fewer" in first and "already holds a run" in refusal


def test_estimate_prints_memory_and_traffic(capsys) -> None:
    assert main(["estimate", "--json", "trainer.devices=2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 2 and report["master_shards"] > 0
    assert report["activations_all_checkpointed"] < report["activations_no_checkpointing"]
    # all_reduce: one byte per parameter per backward (which parameters got a grad).
    assert set(report["comm_per_step"]) == {"all_gather", "reduce_scatter", "all_reduce"}


def test_prepare_writes_a_bin_file(tmp_path: Path, capsys) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n" * 10)
    out = tmp_path / "corpus.bin"
    assert main(["prepare", "--source", "text", "--path", str(text), "--output", str(out)]) == 0
    assert out.stat().st_size == 2 * len(text.read_bytes())  # uint16, one token per byte
    assert json.loads(out.with_suffix(".json").read_text())["vocab_size"] == 256


# -- the default run --------------------------------------------------------------------------


@pytest.mark.slow
def test_default_recipe_trains_end_to_end_and_its_loss_falls(tmp_path: Path) -> None:
    """``yafsdp train`` (tiny-cpu, 2 CPU processes, YaFSDP) on a shortened schedule."""
    result = _yafsdp(
        "train",
        "trainer.max_steps=40",
        "trainer.val_check_interval=40",
        "trainer.progress_bar=false",
        "trainer.run_name=e2e",
        cwd=tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "e2e"
    assert "yafsdp train: tiny-cpu" in result.stdout  # the startup panel
    assert "run summary" in result.stdout
    facts = json.loads((run_dir / "summary.json").read_text())
    assert facts["steps"] == 40 and facts["tokens"] == 40 * 16 * 128 * 2
    assert facts["first_train_loss"] > 5.0  # ~ln(256) at initialisation
    assert facts["final_val_loss"] < facts["first_train_loss"] - 1.5
    assert facts["final_val_loss"] < facts["unigram_entropy"]
    assert (run_dir / "config.yaml").read_text() == _resolved(run_dir)
    rows = list(csv.DictReader((run_dir / "logs" / "metrics.csv").open()))
    assert any(row.get("val_ppl") for row in rows) and any(row.get("tokens_per_s") for row in rows)


def _resolved(run_dir: Path) -> str:
    from lightning_yafsdp.config import to_yaml

    config = load_config(
        None,
        [
            "trainer.max_steps=40",
            "trainer.val_check_interval=40",
            "trainer.progress_bar=false",
            "trainer.run_name=e2e",
        ],
    )
    return to_yaml(config)
