"""YaLM curriculum: short sequences and small batches first, grown linearly.

The data loader always yields full ``seq_len + 1`` windows and full batches;
the curriculum crops them at the top of ``training_step`` (the first rows, the
first tokens), so the loaders, samplers and the model need no change and every
rank crops alike.
"""

from __future__ import annotations

import torch

from lightning_yafsdp.config import CurriculumConfig


class Curriculum:
    """Sequence length and batch size as a function of the optimizer step.

    Args:
        config: The curriculum section of the recipe.
        seq_len: Full sequence length (``data.seq_len``), reached at ``warmup_steps``.
        batch_size: Full micro-batch size (``data.batch_size``).
    """

    def __init__(self, config: CurriculumConfig, *, seq_len: int, batch_size: int) -> None:
        self.config = config
        self.seq_len = seq_len
        self.batch_size = batch_size

    def _fraction(self, step: int) -> float:
        return min(1.0, step / self.config.warmup_steps)

    def seq_len_at(self, step: int) -> int:
        """Tokens the model reads at ``step`` (a multiple of ``multiple_of``, at least it)."""
        start, full = self.config.start_seq_len, self.seq_len
        length = start + (full - start) * self._fraction(step)
        multiple = self.config.multiple_of
        return int(min(full, max(multiple, int(length) // multiple * multiple)))

    def batch_size_at(self, step: int) -> int:
        """Sequences per micro-batch at ``step``."""
        start = self.config.start_batch_size
        if start is None:
            return self.batch_size
        return int(start + (self.batch_size - start) * self._fraction(step))

    def crop(self, batch: torch.Tensor, step: int) -> torch.Tensor:
        """The part of a ``[batch, seq_len + 1]`` batch that trains at ``step``."""
        return batch[: self.batch_size_at(step), : self.seq_len_at(step) + 1]
