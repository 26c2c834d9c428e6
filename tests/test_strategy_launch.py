"""The strategy under external launchers: torchrun, and SLURM's environment (as srun sets it).

Lightning's own launcher is covered in test_strategy.py. Here the processes are
created outside Lightning and the strategy must take ranks and world size from the
cluster environment Lightning detects (TorchElasticEnvironment, SLURMEnvironment).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.test_strategy import _LAUNCHED_SCRIPT, _RANK_VARIABLES

REPO = Path(__file__).parents[1]


def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _RANK_VARIABLES and not k.startswith("SLURM")
    }
    env["PYTHONPATH"] = str(REPO)
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _assert_two_ranks_trained(outputs: str) -> None:
    for rank in (0, 1):
        assert f"rank={rank} world=2 backend=gloo steps=2" in outputs, outputs


def test_torchrun_launch_trains_on_two_ranks(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_LAUNCHED_SCRIPT)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(script),
    ]
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=240,
        env=_clean_env(),
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_two_ranks_trained(proc.stdout)


def test_slurm_environment_as_srun_sets_it_trains_on_two_ranks(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_LAUNCHED_SCRIPT)
    job_id = str(_free_port())  # Lightning derives the rendezvous port from the job id
    procs = []
    for rank in (0, 1):
        env = _clean_env()
        env.update(
            SLURM_NTASKS="2",
            SLURM_NTASKS_PER_NODE="2",
            SLURM_NNODES="1",
            SLURM_NODEID="0",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_NODELIST="127.0.0.1",
            SLURM_JOB_ID=job_id,
            SLURM_JOB_NAME="yafsdp-test",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=tmp_path,
            )
        )
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        outputs.append(out)
    _assert_two_ranks_trained("".join(outputs))
