"""The LightningCLI example of docs/user-guide.md, run as written (2 CPU ranks, gloo).

``--trainer.strategy=lightning_yafsdp.YaFSDPStrategy`` on the command line, a YAML
``class_path`` with ``init_args``, and why the bare names need ``import
lightning_yafsdp`` ([Note: the class path as a strategy name] in ``_registration.py``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "user-guide.md"


def _block(first_line: str) -> str:
    """The fenced block of the user guide that starts with ``first_line``."""
    match = re.search(rf"```\w+\n({re.escape(first_line)}\n.*?)```", GUIDE.read_text(), re.S)
    assert match, f"docs/user-guide.md has no block starting with {first_line!r}"
    return match.group(1)


def _run(script: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    (cwd / "train_cli.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "train_cli.py", "fit", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _checkpoint(cwd: Path) -> Path:
    (path,) = (cwd / "lightning_logs" / "version_0" / "checkpoints").glob("*.ckpt")
    return path


@pytest.mark.slow
def test_the_class_path_flag_trains_with_yafsdp_on_two_ranks(tmp_path) -> None:
    args = [
        "--trainer.strategy=lightning_yafsdp.YaFSDPStrategy",
        "--trainer.devices=2",
        "--trainer.accelerator=cpu",
        "--trainer.max_steps=2",
    ]
    result = _run(_block("# train_cli.py"), args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max_steps=2` reached" in result.stderr
    # A sharded checkpoint directory, one file per rank: written by YaFSDPStrategy.
    checkpoint = _checkpoint(tmp_path)
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.slow
def test_a_yaml_class_path_passes_its_init_args(tmp_path) -> None:
    (tmp_path / "yafsdp.yaml").write_text(_block("# yafsdp.yaml"))
    # One rank is enough to see init_args arrive (state_dict_type: full -> one file).
    args = ["--config", "yafsdp.yaml", "--trainer.devices=1"]
    result = _run(_block("# train_cli.py"), args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _checkpoint(tmp_path).is_file()
    saved = (tmp_path / "lightning_logs" / "version_0" / "config.yaml").read_text()
    assert "class_path: lightning_yafsdp.YaFSDPStrategy" in saved and "zero_stage: 2" in saved


_TRY_NAMES = """
from lightning.pytorch import Trainer
for name in ("yafsdp", "lightning_yafsdp.YaFSDPStrategy"):
    try:
        print(name, type(Trainer(strategy=name, accelerator="cpu").strategy).__name__)
    except ValueError as err:
        print(name, "refused" if "invalid strategy name" in str(err) else err)
"""


def test_the_names_are_known_only_once_lightning_yafsdp_is_imported() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    printed = {}
    for first in ("", "import lightning_yafsdp\n"):
        result = subprocess.run(
            [sys.executable, "-c", first + _TRY_NAMES],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        printed[bool(first)] = result.stdout.split()
    assert printed[False] == ["yafsdp", "refused", "lightning_yafsdp.YaFSDPStrategy", "refused"]
    assert printed[True] == [
        "yafsdp",
        "YaFSDPStrategy",
        "lightning_yafsdp.YaFSDPStrategy",
        "YaFSDPStrategy",
    ]
