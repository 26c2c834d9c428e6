"""Learning-rate schedule: linear warm-up, then cosine/linear decay or constant."""

from __future__ import annotations

import math
from collections.abc import Callable


def lr_lambda(
    *, warmup_steps: int, total_steps: int, decay: str, min_ratio: float
) -> Callable[[int], float]:
    """The LR multiplier at each optimizer step, for ``LambdaLR``.

    Warm-up goes from ``1 / (warmup_steps + 1)`` to 1 (never exactly 0, so step 0
    trains); decay reaches ``min_ratio`` at ``total_steps`` and stays there.
    """

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if decay == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if decay == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_ratio + (1.0 - min_ratio) * shape

    return multiplier


def schedule_steps_of(
    *,
    warmup_steps: int,
    decay: str,
    min_ratio: float,
    lr: float,
    max_steps: int,
    total_steps: int | None,
    resumed_step: int | None = None,
    resumed_length: int | None = None,
) -> tuple[int, str | None]:
    """The optimizer steps the schedule spans, and a warning when a resume changes it.

    [Note: the LR schedule across a resume] The LR multiplier is a function of the
    step and the schedule's length; a resume that raises ``trainer.max_steps`` would
    re-stretch the decay and jump the LR back up (e.g. 3.7e-4 -> 1.1e-3 half way
    through a cosine). So a resumed run keeps the length its checkpoint was trained
    with (``"yafsdp_run"`` records it), and trains at the floor past it, unless
    ``schedule.total_steps`` asks for another length; either way a changed length is
    said, with the LR before and after, at the resumed step.

    Args:
        warmup_steps, decay, min_ratio: As in :func:`lr_lambda`.
        lr: The peak LR (``optim.lr``), for the warning's numbers.
        max_steps: ``trainer.max_steps``.
        total_steps: ``schedule.total_steps`` (None: not set).
        resumed_step: The checkpoint's step (None: a fresh run).
        resumed_length: The schedule length the checkpoint was trained with (None:
            fresh, or a checkpoint that does not record it).

    Returns:
        ``(steps, warning)``; ``warning`` is None when nothing changed.
    """
    wanted = total_steps if total_steps is not None else max_steps
    if resumed_step is None or resumed_length is None or wanted == resumed_length:
        return wanted, None

    def lr_at(length: int) -> float:
        return lr * lr_lambda(
            warmup_steps=warmup_steps, total_steps=length, decay=decay, min_ratio=min_ratio
        )(resumed_step)

    kept, stretched = lr_at(resumed_length), lr_at(wanted)
    if total_steps is None:
        return resumed_length, (
            f"warning: trainer.max_steps={max_steps}, but the LR schedule keeps the "
            f"{resumed_length} steps the checkpoint was trained with (LR {kept:.2e} at step "
            f"{resumed_step}, the floor after step {resumed_length}); "
            f"schedule.total_steps={max_steps} re-stretches it (the LR would jump to "
            f"{stretched:.2e})"
        )
    return wanted, (
        f"warning: schedule.total_steps={wanted} re-stretches the LR schedule the "
        f"checkpoint was trained with ({resumed_length} steps): the LR at step "
        f"{resumed_step} goes from {kept:.2e} to {stretched:.2e}"
    )
