"""The scripts benchmarks/torch_compat.sh runs under each torch version work here too.

``torch_compat.sh`` itself builds several multi-GB venvs and is run by hand
(docs/testing.md#torch-versions); these keep its pieces from rotting between those runs:
the cross-version checkpoint script (saved and loaded under the installed torch: every
comparison is then exact) and ``gpu_check.sh --dry-run``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def _environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    return {**env, **extra}


def _checkpoint_script(mode: str, directory: Path) -> subprocess.CompletedProcess:
    script = ROOT / "benchmarks" / "checkpoint_across_versions.py"
    return subprocess.run(
        [sys.executable, str(script), mode, str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_environment(),
        check=False,
    )


def test_a_checkpoint_saved_and_loaded_under_one_torch_continues_exactly(tmp_path):
    saved = _checkpoint_script("save", tmp_path)
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert (tmp_path / "step3.ckpt").is_dir() and (tmp_path / "reference.pt").is_file()

    loaded = _checkpoint_script("load", tmp_path)

    assert loaded.returncode == 0, loaded.stdout[-2000:] + loaded.stderr[-3000:]
    assert "load exact: True" in loaded.stdout
    assert "loss rel. difference 0.00e+00, final weights 0.00e+00" in loaded.stdout


def test_gpu_check_dry_run_imports_everything_and_runs_each_step_on_cpu(tmp_path):
    # python3 is this interpreter, as on the lent GPU machine, where it is the one with torch.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=600,
        env=_environment(PATH=path, OUT=str(tmp_path)),
        check=False,
    )

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.splitlines()[1].startswith("python "), summary[:500]  # versions come first
    assert re.search(r"^all \d+ modules import$", summary, re.MULTILINE), summary[:2000]
    assert "2 passed, 1 skipped" in summary
    bench = (tmp_path / "gpu_bench_dry_run.md").read_text()
    assert "| yafsdp |" in bench and "| host CPU ms |" in bench, bench[-1500:]
    assert summary.rstrip().endswith("dry run passed")
