"""What a launched rank learns from its environment: its rank, and the run it joins.

Lightning's launcher (or SLURM, torchrun) starts the ranks as new processes: the process
that reads the recipe names the run and decides the resume, and hands both down in
environment variables. Both the runner and the resume planner read them, so they live
here, below both.
"""

from __future__ import annotations

import os

# The run folder's name, chosen by rank 0 and inherited by the ranks it launches.
RUN_NAME_ENV = "YAFSDP_RUN_NAME"


def is_rank_zero() -> bool:
    """True in the process that is (or will be) global rank 0."""
    for var in ("RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var]) == 0
    return int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0
