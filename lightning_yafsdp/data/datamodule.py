"""The LightningDataModule of ``yafsdp train``: tokens -> split -> packed loaders.

Every rank reads and tokenizes the same data (deterministic), so no rank waits for
another. The loaders bring their own distributed samplers (the Trainer runs with
``use_distributed_sampler=False``): each rank sees its own slice of every epoch,
and the training sampler continues a resumed epoch where the checkpoint left it
([Note: resuming the data order] in ``sampler.py``): the datamodule's
``state_dict`` (saved in every checkpoint) records how far the epoch got.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import numpy as np
from torch.utils.data import DataLoader, DistributedSampler

from lightning_yafsdp.config import DataConfig
from lightning_yafsdp.data.packed import PackedSequences, split_tokens, unigram_entropy
from lightning_yafsdp.data.prepare import read_bin
from lightning_yafsdp.data.sampler import ResumableDistributedSampler
from lightning_yafsdp.data.sources import read_documents
from lightning_yafsdp.data.tokenizer import load_tokenizer


def load_tokens(config: DataConfig) -> tuple[np.ndarray, int]:
    """The whole token stream of a data config and its vocabulary size."""
    if config.source == "bin":
        assert config.path is not None
        tokens, meta = read_bin(config.path)
        vocab = int(meta.get("vocab_size") or int(tokens.max()) + 1)
        return tokens, vocab
    docs = read_documents(
        config.source,
        path=config.path,
        max_bytes=config.max_bytes,
        jsonl_field=config.jsonl_field,
        seed=config.seed,
    )
    tokenizer = load_tokenizer(config.tokenizer)
    return tokenizer.encode_documents(docs), tokenizer.vocab_size


class TokenDataModule(pl.LightningDataModule):
    """Packed train/validation sequences of ``config.seq_len + 1`` tokens.

    Attributes (after ``setup``):
        vocab_size: Size of the tokenizer's vocabulary.
        train_tokens / val_tokens: Number of tokens in each split.
        unigram_entropy: Entropy of the validation split's token frequencies (nats),
            the baseline a model must beat.
    """

    def __init__(self, config: DataConfig) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = 0
        self.train_tokens = 0
        self.val_tokens = 0
        self.unigram_entropy = float("nan")
        self._train: PackedSequences | None = None
        self._val: PackedSequences | None = None
        self._resume: dict[str, int] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self._train is not None:
            return
        tokens, self.vocab_size = load_tokens(self.config)
        train, val = split_tokens(tokens, self.config.val_fraction)
        self._train = PackedSequences(train, self.config.seq_len)
        self._val = PackedSequences(val, self.config.seq_len)
        self.train_tokens, self.val_tokens = len(train), len(val)
        self.unigram_entropy = unigram_entropy(val, self.vocab_size)

    @property
    def train_dataset(self) -> PackedSequences:
        assert self._train is not None, "call setup() first"
        return self._train

    def train_dataloader(self) -> DataLoader:
        assert self._train is not None, "call setup() first"
        world_size, rank, seed = self._placement()
        sampler = ResumableDistributedSampler(
            self._train, num_replicas=world_size, rank=rank, seed=seed
        )
        if self._resume is not None:
            sampler.resume_at(
                epoch=self._resume["epoch"], samples_done=self._resume["samples_done"]
            )
        return DataLoader(
            self._train,
            batch_size=self.config.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.config.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        assert self._val is not None, "call setup() first"
        world_size, rank, _ = self._placement()
        return DataLoader(
            self._val,
            batch_size=self.config.batch_size,
            sampler=DistributedSampler(
                self._val, num_replicas=world_size, rank=rank, shuffle=False
            ),
            drop_last=True,
            num_workers=self.config.num_workers,
        )

    def state_dict(self) -> dict[str, Any]:
        """How far the current training epoch got (Lightning saves it in checkpoints)."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != "fit":
            return {}
        # Checkpoints are written after a training batch's hooks ran: ``processed``
        # counts that batch; every rank trained as many batches of its own slice.
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        samples = batches * self.config.batch_size * trainer.world_size
        return {"epoch": trainer.current_epoch, "samples_done": samples}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Called while restoring, before the loaders are built (see train_dataloader).
        self._resume = dict(state_dict) if state_dict else None

    def _placement(self) -> tuple[int, int, int]:
        """(world size, rank, shuffle seed): the Trainer's, or one process outside one."""
        trainer = self.trainer
        if trainer is None:
            return 1, 0, 0
        # The seed Lightning's own distributed sampler would use (seed_everything's).
        return trainer.world_size, trainer.global_rank, int(os.environ.get("PL_GLOBAL_SEED", 0))
