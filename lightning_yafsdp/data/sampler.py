"""The training sampler of ``yafsdp train``: every rank's slice of a shuffled epoch,
resumable in the middle of an epoch.

[Note: resuming the data order] Lightning restores the loops' counters from a
checkpoint (it knows ``k`` batches of the epoch were trained) but a plain
DataLoader starts its epoch again from the first batch, so a resumed run would
train on batches it has already seen and never on the rest of the epoch. This
sampler draws the same permutation as ``torch.utils.data.DistributedSampler``
(seeded by ``seed + epoch``, so a fresh run's order is what Lightning's injected
sampler gives) and, when told that ``k`` batches of ``epoch`` are done, starts
that epoch at batch ``k``. Its length stays the whole epoch's, which is what
Lightning's loop expects: it counts the ``k`` restored batches plus the rest.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` (shuffled, ``drop_last``) that can start an epoch part-way.

    Args:
        dataset: The dataset to sample (only its length is read).
        num_replicas: Ranks sharing the epoch.
        rank: This rank.
        seed: Base seed of the shuffle (epoch ``e`` uses ``seed + e``).
    """

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self._resume_epoch: int | None = None
        self._samples_done = 0

    def resume_at(self, *, epoch: int, samples_done: int) -> None:
        """Start ``epoch`` after its first ``samples_done`` samples, counted over all ranks
        (so a run resumed at another world size skips what the whole job trained)."""
        self._resume_epoch, self._samples_done = epoch, samples_done

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator).tolist()[: self.total_size]
        if self.epoch == self._resume_epoch:
            # The rest of the epoch's global order, dealt round-robin as before: with the
            # world size unchanged this is exactly this rank's remaining slice.
            rest = order[self._samples_done :]
            per_rank = len(rest) // self.num_replicas
            return iter(rest[self.rank :: self.num_replicas][:per_rank])
        return iter(order[self.rank : self.total_size : self.num_replicas])
