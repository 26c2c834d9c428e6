"""Where a ``yafsdp train`` run starts: fresh, or from a checkpoint (``--resume``).

[Note: resuming a run] A run is its folder, ``output_dir/run_name``: config.yaml,
logs/metrics.csv, checkpoints/. ``--resume`` continues the run from its newest
checkpoint, ``--resume PATH`` from a given one, ``--resume auto`` from the newest
checkpoint if there is one and fresh otherwise (a SLURM requeue before the first
save); without the flag a run folder that already holds checkpoints or metrics is
refused rather than silently continued or overwritten. The decision is made once,
by the process that becomes rank 0 before any rank starts, and handed to the
ranks Lightning's launcher starts through ``YAFSDP_RESUME_FROM`` (as the run name
is through ``YAFSDP_RUN_NAME``): by the time they run, rank 0 may have written
files that would change the answer. Under SLURM or torchrun every rank decides
alone, from the same files; only rank 0 refuses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_yafsdp.config import ConfigError
from lightning_yafsdp.training.launch_env import RUN_NAME_ENV, is_rank_zero

RESUME_ENV = "YAFSDP_RESUME_FROM"
# The value of ``--resume`` given without a path: the run's newest checkpoint.
LATEST = "latest"
# ``--resume auto``: the newest checkpoint if the run has one, else a fresh start.
AUTO = "auto"

_CHECKPOINT_GLOBS = ("checkpoints/*.ckpt", "hpc_ckpt_*.ckpt")
_METRICS = "logs/metrics.csv"


@dataclasses.dataclass(frozen=True)
class RunStart:
    """How a run starts.

    Attributes:
        checkpoint: The checkpoint it continues from; None for a fresh run.
        step: The optimizer step stored in that checkpoint (0 when fresh).
        tokens: Tokens the run had trained on at that step, all ranks together
            (None when the checkpoint does not say, e.g. one not written by
            ``yafsdp train``).
        notes: What the choice passed over (damaged checkpoints), for the panel.
        schedule_steps: The LR schedule length the checkpoint was trained with (None
            when fresh or not recorded).
    """

    checkpoint: Path | None = None
    step: int = 0
    tokens: int | None = None
    notes: tuple[str, ...] = ()
    schedule_steps: int | None = None

    def describe(self) -> str:
        """One line for the startup panel (the checkpoint's path is printed below it)."""
        if self.checkpoint is None:
            return "fresh run (no checkpoint)"
        tokens = f", {self.tokens:,} tokens seen" if self.tokens is not None else ""
        return f"resuming at step {self.step}{tokens}"


@contextlib.contextmanager
def handoff_scope() -> Iterator[None]:
    """Keep the run name and resume decision handed to launched ranks (environment
    variables) from outliving the run in this process: a later run in the same process,
    or processes it spawns for something else, must not inherit them."""
    saved = {name: os.environ.get(name) for name in (RUN_NAME_ENV, RESUME_ENV)}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_home_of(path: Path) -> Path | None:
    """The run folder a checkpoint or config.yaml belongs to (one holding config.yaml).

    ``runs/X/checkpoints/last.ckpt``, ``runs/X/hpc_ckpt_3.ckpt`` and
    ``runs/X/config.yaml`` belong to ``runs/X``; anything else to no run.
    """
    path = Path(path).absolute()
    folder = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return folder if (folder / "config.yaml").is_file() else None


def interpret_resume(
    recipe: str | None, overrides: list[str], resume: str | None
) -> tuple[str | None, list[str], str | None, Path | None]:
    """Read ``yafsdp train [RECIPE] [overrides] --resume [X]`` the way it was meant.

    ``--resume optim.lr=1e-4`` is a bare ``--resume`` and an override; ``--resume
    runs/X`` or ``--resume runs/X/config.yaml`` is run X from its newest checkpoint; a
    ``--resume PATH`` checkpoint without a recipe brings the config.yaml of the run it
    belongs to.

    Returns:
        ``(recipe, overrides, resume, home)``: ``home`` is the run folder the recipe
        belongs to (the run continues there), or None.

    Raises:
        ConfigError: two recipes, or a checkpoint outside any run folder and no recipe
            (which recipe trained it is unknown).
    """
    if resume not in (None, LATEST, AUTO):
        path = Path(resume)
        if "=" in resume and not path.exists():
            return interpret_resume(recipe, [*overrides, resume], LATEST)
        if not path.exists():
            raise ConfigError(f"--resume {resume}: {path} does not exist")
        if path.suffix in (".yaml", ".yml") or (path / "config.yaml").is_file():
            if recipe is not None:
                raise ConfigError(f"two recipes given: {recipe!r} and --resume {resume!r}")
            config_file = path if path.suffix in (".yaml", ".yml") else path / "config.yaml"
            return interpret_resume(str(config_file), overrides, LATEST)
    if recipe is None and resume not in (None, LATEST, AUTO):
        home = run_home_of(Path(resume))
        if home is None:
            raise ConfigError(
                f"--resume {resume}: this checkpoint is in no run folder (no config.yaml "
                "beside its checkpoints/ folder), so its recipe is unknown: give it, as in "
                f"yafsdp train RECIPE --resume {resume}"
            )
        return str(home / "config.yaml"), overrides, resume, home
    is_run_config = recipe is not None and Path(recipe).name == "config.yaml"
    home = run_home_of(Path(recipe)) if is_run_config and Path(recipe).is_file() else None
    return recipe, overrides, resume, home


def plan_start(run_dir: Path, resume: str | None) -> RunStart:
    """Decide how the run in ``run_dir`` starts (see [Note: resuming a run]).

    Args:
        run_dir: The run's folder.
        resume: None (no ``--resume``), :data:`LATEST`, :data:`AUTO`, or a checkpoint
            path.

    Raises:
        ConfigError: ``--resume`` (not ``auto``) finds no checkpoint, the path does not exist or is
            not a checkpoint, or (without ``--resume``) the run folder already holds
            a run.
        DamagedCheckpointError: the checkpoint has a missing or truncated file.
    """
    rank_zero = is_rank_zero()
    handed_down = os.environ.get(RESUME_ENV)
    if handed_down is not None and not rank_zero:
        return _read_start(Path(handed_down)) if handed_down else RunStart()
    if resume is None:
        if rank_zero:
            _refuse_existing_run(run_dir)
        start = RunStart()
    elif resume == AUTO and not _checkpoints_in(run_dir):
        # Metrics a killed first attempt left are moved aside whole by the logger.
        start = RunStart(notes=(f"--resume auto: no checkpoint in {run_dir} yet",))
    else:
        start = _latest_checkpoint(run_dir) if resume in (LATEST, AUTO) else _given(Path(resume))
    return start


def _checkpoints_in(run_dir: Path) -> list[Path]:
    return [p for pattern in _CHECKPOINT_GLOBS for p in run_dir.glob(pattern)]


def _given(path: Path) -> RunStart:
    if not path.exists():
        raise ConfigError(f"--resume {path}: {path} does not exist")
    return _read_start(path)


def previous_outputs(run_dir: Path) -> list[Path]:
    """Checkpoints and metrics a run folder already holds."""
    found = [p for pattern in _CHECKPOINT_GLOBS for p in sorted(run_dir.glob(pattern))]
    metrics = run_dir / _METRICS
    return found + ([metrics] if metrics.is_file() else [])


def _refuse_existing_run(run_dir: Path) -> None:
    found = previous_outputs(run_dir)
    if found:
        shown = ", ".join(str(p.relative_to(run_dir)) for p in found[:3])
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise ConfigError(
            f"run folder {run_dir} already holds a run ({shown}{more}): pass --resume to "
            "continue it, or trainer.run_name=<new name> to start another run next to it"
        )


def _latest_checkpoint(run_dir: Path) -> RunStart:
    """The run's checkpoint written last that is intact (damaged ones are noted)."""
    from lightning_yafsdp.checkpoint import DamagedCheckpointError

    candidates = _checkpoints_in(run_dir)
    if not candidates:
        looked = " and ".join(str(run_dir / pattern) for pattern in _CHECKPOINT_GLOBS)
        raise ConfigError(
            f"--resume: no checkpoint to resume in run folder {run_dir} (looked for "
            f"{looked}); give one with --resume PATH, or use --resume auto (fresh when "
            "there is none), or drop --resume to start a fresh run"
        )
    # Written last, not most trained: after a resume from a middle checkpoint the later
    # checkpoints of the abandoned segment are not the run any more. On equal times
    # (a copied folder), the most trained.
    notes: list[str] = []
    newest_first = sorted(
        candidates, key=lambda p: (p.stat().st_mtime_ns, _step_in_name(p)), reverse=True
    )
    for path in newest_first:
        try:
            start = _read_start(path)
        except (DamagedCheckpointError, ConfigError) as err:
            notes.append(f"skipped {path.name}: {err}")
            continue
        return dataclasses.replace(start, notes=tuple(notes))
    raise ConfigError(
        f"--resume: every checkpoint in {run_dir} is damaged or unreadable; first: {notes[0]}"
    )


def _step_in_name(path: Path) -> int:
    digits = path.name.split("step=")[-1].split(".")[0].split("-")[0]
    return int(digits) if digits.isdigit() else -1


def _read_start(path: Path) -> RunStart:
    """What a checkpoint resumes; a damaged one raises ``DamagedCheckpointError``
    (one line naming the bad file) before anything reads it."""
    from lightning_yafsdp.checkpoint import (
        CheckpointError,
        DamagedCheckpointError,
        inspect_checkpoint,
        verify_checkpoint,
    )

    try:
        verify_checkpoint(path)
        info = inspect_checkpoint(path)
        history = _run_history(path)
    except DamagedCheckpointError:
        raise
    except (CheckpointError, OSError, RuntimeError, EOFError) as err:
        raise ConfigError(f"cannot resume from {path}: {err}") from err
    return RunStart(
        checkpoint=path,
        step=int(info.get("step") or 0),
        tokens=history.get("tokens"),
        schedule_steps=history.get("schedule_steps"),
    )


def _run_history(path: Path) -> dict[str, Any]:
    """The ``"yafsdp_run"`` entry ``yafsdp train`` writes into its checkpoints."""
    import torch

    from lightning_yafsdp.checkpoint.sharded import META_FILENAME
    from lightning_yafsdp.training.module import RUN_HISTORY_KEY

    source = path / META_FILENAME if path.is_dir() else path
    # mmap: a single-file checkpoint is not read whole just to find this entry.
    state = torch.load(source, map_location="cpu", weights_only=False, mmap=path.is_file())
    return dict(state.get(RUN_HISTORY_KEY) or {})
