"""The sbatch templates in recipes/slurm, run by bash in a simulated SLURM job.

``srun`` and ``sbatch`` are stub scripts on PATH: ``sbatch`` records what it was asked
to submit; ``srun`` records its options and runs the command locally, as the one task
of a one-task job (Lightning's SLURMEnvironment reads the same SLURM_* variables).
The command-line tests use a ``yafsdp`` stub that only records; the requeue test runs
the real ``yafsdp train`` (one CPU rank, a few steps): a fresh start, a requeue that
finds a checkpoint, and a requeue before the first checkpoint.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = REPO / "recipes" / "slurm"
# What each template is given on its command line (llama2-70b.sbatch names its recipe).
ARGS = {
    "train.sbatch": ["recipes/llama3-8b.yaml", "optim.lr=1e-4"],
    "llama2-70b.sbatch": ["optim.lr=1e-4"],
}

_SRUN = """#!/bin/bash
# srun stub: record the options, run the command locally.
echo "srun $*" >> "$STUB_LOG"
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""
_SBATCH = """#!/bin/bash
echo "sbatch $*" >> "$STUB_LOG"
"""
_RECORDING_YAFSDP = """#!/bin/bash
echo "yafsdp $*" >> "$STUB_LOG"
"""
_REAL_YAFSDP = f"""#!/bin/bash
exec {shlex.quote(sys.executable)} -m lightning_yafsdp "$@"
"""


def _stubs(folder: Path, *, real_yafsdp: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    scripts = {"srun": _SRUN, "sbatch": _SBATCH}
    scripts["yafsdp"] = _REAL_YAFSDP if real_yafsdp else _RECORDING_YAFSDP
    for name, text in scripts.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def _slurm_job(job_id: str, *, restarts: int | None, cpus: int = 1, tasks: int = 1) -> dict:
    """The variables SLURM sets in a one-node job's batch step."""
    job = {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NAME": "yafsdp",
        "SLURM_NTASKS": str(tasks),
        "SLURM_NTASKS_PER_NODE": str(tasks),
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_CPUS_PER_TASK": str(cpus),
        "SLURM_NODELIST": "localhost",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }
    if restarts is not None:
        job["SLURM_RESTART_COUNT"] = str(restarts)
    return job


def _run_template(
    template: str, args: list[str], *, cwd: Path, stubs: Path, job: dict, timeout: float = 60
) -> tuple[subprocess.CompletedProcess, list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK"))}
    env.pop("LOCAL_RANK", None)
    env.pop("WORLD_SIZE", None)
    log = cwd / f"stub-{len(list(cwd.glob('stub-*.log')))}.log"
    env.update(job, PATH=f"{stubs}:{env['PATH']}", STUB_LOG=str(log), PYTHONPATH=str(REPO))
    result = subprocess.run(
        ["bash", str(TEMPLATES / template), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return result, calls


# -- the command lines, with a recording yafsdp ------------------------------------------------


@pytest.mark.parametrize("template", ["train.sbatch", "llama2-70b.sbatch"])
def test_outside_a_job_the_template_creates_its_log_folder_and_submits_itself(
    template, tmp_path
) -> None:
    stubs = _stubs(tmp_path / "bin", real_yafsdp=False)
    result, calls = _run_template(template, ARGS[template], cwd=tmp_path, stubs=stubs, job={})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "logs").is_dir()  # SLURM opens logs/%x-%j.out before the script runs
    assert calls == [" ".join(["sbatch", str(TEMPLATES / template), *ARGS[template]])]


@pytest.mark.parametrize("template", ["train.sbatch", "llama2-70b.sbatch"])
@pytest.mark.parametrize("restarts", [None, 0, 2])
def test_the_job_checks_inputs_then_sruns_with_its_cpus_and_resume_auto_on_a_requeue(
    template, restarts, tmp_path
) -> None:
    stubs = _stubs(tmp_path / "bin", real_yafsdp=False)
    job = _slurm_job("77", restarts=restarts, cpus=12, tasks=8)
    result, calls = _run_template(template, ARGS[template], cwd=tmp_path, stubs=stubs, job=job)
    assert result.returncode == 0, result.stderr
    check, srun, launched = calls
    resume = " --resume auto" if restarts else ""
    assert check.startswith("yafsdp train recipes/") and check.endswith(f"{resume} --check")
    # The sbatch line's overrides come last (they win over the template's own).
    assert "trainer.devices=8 trainer.num_nodes=1" in check
    assert check.removesuffix(f"{resume} --check").endswith(" optim.lr=1e-4")
    assert srun.startswith("srun --kill-on-bad-exit=1 --cpus-per-task=12 yafsdp train ")
    # The job runs exactly what it checked.
    assert launched == check.removesuffix(" --check") == srun.split(" ", 3)[3]


# -- the real thing: fresh start, requeue with a checkpoint, requeue before one ---------------

_SHORT = [
    "trainer.accelerator=cpu",
    "trainer.max_steps=4",
    "trainer.checkpoint_every_n_steps=2",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "trainer.progress_bar=false",
    "data.max_bytes=300000",
]


@pytest.mark.slow
def test_a_requeued_job_resumes_if_it_has_a_checkpoint_and_starts_afresh_if_not(
    tmp_path,
) -> None:
    stubs = _stubs(tmp_path / "bin", real_yafsdp=True)
    job_id = str(20000 + os.getpid() % 9000)  # Lightning's port comes from the job id
    run_dir = tmp_path / "runs" / f"tiny-cpu-{job_id}"

    def submit(restarts: int | None) -> tuple[subprocess.CompletedProcess, dict]:
        job = _slurm_job(job_id, restarts=restarts)
        result, _ = _run_template(
            "train.sbatch", ["tiny-cpu", *_SHORT], cwd=tmp_path, stubs=stubs, job=job, timeout=300
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        return result, json.loads((run_dir / "summary.json").read_text())

    fresh, summary = submit(None)
    assert "fresh run" in fresh.stdout and summary["steps"] == 4
    assert summary["resumed_from_step"] is None

    # Preempted after the checkpoint at step 2: only that one is on disk.
    checkpoints = sorted(run_dir.glob("checkpoints/*.ckpt"))
    kept = next(p for p in checkpoints if "step=2" in p.name)
    for path in checkpoints:
        if path != kept:
            _remove(path)
    resumed, summary = submit(1)
    assert "resuming at step 2" in resumed.stdout  # the pre-check and the startup panel
    resuming = [line for line in resumed.stdout.splitlines() if line.startswith("resuming ")]
    assert resuming and all(line.endswith(kept.name) for line in resuming)
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 4

    # A node died before the first checkpoint: the folder holds metrics, no checkpoint.
    for path in run_dir.glob("checkpoints/*.ckpt"):
        _remove(path)
    afresh, summary = submit(2)
    assert "no checkpoint in" in afresh.stdout + afresh.stderr
    assert summary["resumed_from_step"] is None and summary["steps"] == 4
    assert sorted(run_dir.glob("logs/metrics.superseded-*.csv"))  # old rows moved aside


def _remove(checkpoint: Path) -> None:
    # Sharded checkpoints are folders; a consolidated one is a file.
    shutil.rmtree(checkpoint) if checkpoint.is_dir() else checkpoint.unlink()
