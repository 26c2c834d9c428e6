"""The checks that run outside the suite (on a lent GPU) work here too.

``gpu_check.sh --dry-run`` (docs/testing.md#the-gpu-check) keeps the GPU check from
rotting between GPU loans.
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
    assert "| yafsdp |" in (tmp_path / "gpu_bench_dry_run.md").read_text()
    assert summary.rstrip().endswith("dry run passed")
