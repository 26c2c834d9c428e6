"""A save that died between its two renames leaves the previous checkpoint recoverable.

[Note: atomic commit] in lightning_yafsdp/checkpoint/atomic.py: replacing a sharded
checkpoint renames the old directory to ``.<name>.yafsdp-old`` and then the finished
``.<name>.yafsdp-tmp`` to ``<name>``. A crash between the two leaves no ``<name>`` at
all. Here the crash is simulated by leaving exactly that on-disk state (the renames are
plain ``os.replace`` calls, so a killed process leaves nothing else), then the next
load, and the next save that fails, must both find the previous checkpoint.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_yafsdp.checkpoint import CheckpointSaveError, load_checkpoint, save_checkpoint
from lightning_yafsdp.checkpoint.atomic import old_path_for, tmp_path_for
from tests import checkpoint_scenarios as sc
from tests.distributed import dist_run

EXACT = 0.0


def _crash_between_renames(path: Path, newer: Path) -> None:
    """On-disk state of a save of ``newer`` over ``path`` killed between its renames."""
    if dist.get_rank() == 0:
        os.replace(path, old_path_for(path))
        shutil.rmtree(tmp_path_for(path), ignore_errors=True)
        shutil.copytree(newer, tmp_path_for(path))
    dist.barrier()


def _fresh_load(path: Path) -> dict:
    _, engine, optimizer = sc.build_sharded(seed=1)
    load_checkpoint(path, engine, optimizers=[optimizer])
    return sc.full_weights(engine)


def _recovery_facts(root: str) -> dict:
    root = Path(root)
    model, engine, optimizer = sc.build_sharded()
    sc.train_steps(model, optimizer, range(2))
    for name in ("load", "save"):  # one previous checkpoint per scenario
        save_checkpoint(root / name / "ckpt", engine, optimizers=[optimizer])
    previous = sc.full_weights(engine)
    sc.train_steps(model, optimizer, range(2, 4))
    save_checkpoint(root / "newer", engine, optimizers=[optimizer])  # what the dying save wrote
    facts: dict = {}

    path = root / "load" / "ckpt"
    _crash_between_renames(path, root / "newer")
    facts["load"] = _attempt(lambda: sc.max_difference(_fresh_load(path), previous))
    dist.barrier()
    facts["after_load"] = sorted(p.name for p in path.parent.iterdir() if p != tmp_path_for(path))

    path = root / "save" / "ckpt"
    _crash_between_renames(path, root / "newer")
    try:  # the next save fails while writing (rank 0 cannot pickle its extra state)
        save_checkpoint(path, engine, optimizers=[optimizer], extra={"hook": lambda: None})
        facts["failed_save"] = None
    except CheckpointSaveError as exc:
        facts["failed_save"] = str(exc)
    facts["load_after_failed_save"] = _attempt(
        lambda: sc.max_difference(_fresh_load(path), previous)
    )
    return facts


def _attempt(measure) -> float | str:
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - the test shows what went wrong
        return f"{type(exc).__name__}: {exc}"


@pytest.fixture(scope="module")
def recovery(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("recover")
    return dist_run(2, _recovery_facts, str(root), timeout_s=180)[0]


def test_loading_after_a_crash_between_the_renames_restores_the_previous_checkpoint(recovery):
    assert recovery["load"] == EXACT
    # Back under its own name; the dead save's -tmp sibling waits for the next save.
    assert recovery["after_load"] == ["ckpt"]


def test_a_save_failing_after_such_a_crash_keeps_the_previous_checkpoint(recovery):
    assert "PicklingError" in recovery["failed_save"] or "pickle" in recovery["failed_save"]
    assert recovery["load_after_failed_save"] == EXACT
