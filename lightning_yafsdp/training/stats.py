"""Run statistics for the progress bar and the final summary: tokens/s, time, memory."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

# Dense bf16 peak FLOP/s of known accelerators, for MFU (name substring -> FLOP/s).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
}


def device_peak_flops(device: torch.device) -> float | None:
    """The bf16 peak of ``device`` if known (CUDA only), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Peak memory of this process: CUDA allocated, or the CPU resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "CUDA allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "CPU RSS"


class RunStats(Callback):
    """Times training and shows tokens/s (all ranks) on the progress bar.

    ``train_seconds`` is the wall time of ``fit``'s training loop, data loading
    included and validation excluded: tokens / train_seconds is what a user gets.
    """

    def __init__(self) -> None:
        self.train_seconds = 0.0
        self._fit_start: float | None = None
        self._val_start: float | None = None
        self._val_seconds = 0.0
        self._last_time: float | None = None
        self._last_tokens = 0
        self._rate: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._fit_start = self._last_time = time.perf_counter()
        self._last_tokens = pl_module.tokens_seen

    def on_validation_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if self._val_start is not None and self._fit_start is not None:
            self._val_seconds += time.perf_counter() - self._val_start
        self._val_start = None
        self._last_time = time.perf_counter()  # the rate covers training only

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        now = time.perf_counter()
        if self._last_time is None:
            return
        seconds, self._last_time = now - self._last_time, now
        tokens = (pl_module.tokens_seen - self._last_tokens) * trainer.world_size
        self._last_tokens = pl_module.tokens_seen
        if tokens and seconds > 0:
            rate = tokens / seconds
            self._rate = rate if self._rate is None else 0.9 * self._rate + 0.1 * rate
            pl_module.log("tokens_per_s", self._rate, on_step=True, prog_bar=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if self._fit_start is not None:
            self.train_seconds = time.perf_counter() - self._fit_start - self._val_seconds


def log_event_metrics(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Write metrics of THIS step straight to the loggers (rank 0 writes).

    ``LightningModule.log`` from a hook that runs only on some steps makes Lightning
    repeat the last value on every later step's row; thermometer readings and guard
    events must appear on the steps they happened, and nowhere else.
    """
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
