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
