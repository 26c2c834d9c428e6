"""Wall time of a Lightning fit with background saves, synchronous saves, and no saves.

2 CPU ranks (gloo) through Lightning's own launcher, an 8-layer dim-512 Llama, 12
optimizer steps, ``ModelCheckpoint(every_n_train_steps=3)`` (4 sharded checkpoints,
the last one waited for at the end of the fit). One fit per mode, the same machine::

    python benchmarks/async_save.py --mode none
    python benchmarks/async_save.py --mode sync
    python benchmarks/async_save.py --mode async
    python benchmarks/async_save.py --mode async --devices 1   # a core left to the writer

Each prints one line: ``mode, fit wall time (s), checkpoint size (MiB)``. The figure
that matters is what saves ADD to the fit: (async - none) / (sync - none).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

import lightning_yafsdp  # noqa: F401 - registers "yafsdp"
from lightning_yafsdp import YaFSDPStrategy
from lightning_yafsdp.models.llama import Llama, LlamaConfig

STEPS, EVERY, BATCH, SEQ = 12, 3, 2, 128


class _Tokens(Dataset):
    def __len__(self) -> int:
        return STEPS * BATCH * 2

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randint(0, 256, (SEQ + 1,), generator=torch.Generator().manual_seed(index))


class _LM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = LlamaConfig(dim=512, n_layers=8, n_heads=8, ffn_hidden_dim=1376, max_seq_len=SEQ)
        self.model = Llama(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("none", "sync", "async"), required=True)
    parser.add_argument("--root", default=None, help="where checkpoints go (default: a tmp dir)")
    parser.add_argument(
        "--devices", type=int, default=2, help="CPU ranks (2; 1 leaves a core to the writer)"
    )
    args = parser.parse_args()
    mode = args.mode
    root = Path(args.root or tempfile.mkdtemp(prefix="async-save-"))
    torch.manual_seed(0)
    if args.devices < (os.cpu_count() or 1):
        # One thread per rank (Lightning's own rule for 2 ranks on 2 cores) also for 1 rank,
        # so that a core is left over for the writer; set before Lightning picks its own.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    callbacks = []
    if mode != "none":
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=EVERY, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=YaFSDPStrategy(async_save=mode == "async"),
        max_steps=STEPS,
        callbacks=callbacks,
        enable_checkpointing=mode != "none",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    module = _LM()
    started = time.perf_counter()
    trainer.fit(module, DataLoader(_Tokens(), batch_size=BATCH))
    seconds = time.perf_counter() - started
    if trainer.is_global_zero:
        size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 2**20
        print(f"mode={mode} fit_wall_s={seconds:.2f} checkpoints_mib={size:.0f}", flush=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
