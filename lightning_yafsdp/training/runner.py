"""``yafsdp train`` as a function: recipe -> Trainer -> fit -> summary.

[Note: one command, many processes] On a laptop the first process is the
launcher: Lightning's subprocess launcher re-runs the same command line for
ranks 1..N-1. Under SLURM (``srun``) or torchrun every rank runs the command
itself. So everything here runs on every rank, deterministically; what only one
process should do (print, write files) checks :func:`is_rank_zero`, and the run
directory is decided once and handed down through ``YAFSDP_RUN_NAME``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger

from lightning_yafsdp.config import ConfigError, RunConfig, to_yaml
from lightning_yafsdp.data import TokenDataModule
from lightning_yafsdp.estimate import Estimate, estimate
from lightning_yafsdp.training import console
from lightning_yafsdp.training.launch_env import RUN_NAME_ENV, is_rank_zero
from lightning_yafsdp.training.module import CausalLMModule
from lightning_yafsdp.training.preflight import check_inputs
from lightning_yafsdp.training.progress import StepProgressBar
from lightning_yafsdp.training.resume import RESUME_ENV, RunStart, handoff_scope, plan_start
from lightning_yafsdp.training.stats import RunStats, device_peak_flops, peak_memory_bytes
from lightning_yafsdp.training.thermometers import Thermometers


def run_dir_of(config: RunConfig) -> Path:
    """``output_dir/run_name``, the same on every rank (see the note above)."""
    # Rank 0 decides; a name in the environment is what rank 0 handed to the ranks it
    # launched (in rank 0's own process it would be left over from an earlier run).
    name = config.trainer.run_name or (None if is_rank_zero() else os.environ.get(RUN_NAME_ENV))
    if not name:
        job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
        # Under SLURM the job id is stable across requeues: a requeued job resumes here.
        suffix = job if job and job != "none" else time.strftime("%Y%m%d-%H%M%S")
        name = f"{config.recipe}-{suffix}"
    os.environ[RUN_NAME_ENV] = name  # inherited by the ranks the launcher starts
    return Path(config.trainer.output_dir) / name


def world_size_of(config: RunConfig) -> int:
    from lightning_yafsdp.estimate import _world_size

    return _world_size(config)


def build_strategy(config: RunConfig, est: Estimate) -> Any:
    if config.strategy.name == "ddp":
        return "ddp"
    from lightning_yafsdp.strategy import YaFSDPStrategy

    k = est.checkpointed_units
    return YaFSDPStrategy(
        zero_stage=config.strategy.zero_stage,
        reduce_dtype=getattr(torch, config.strategy.reduce_dtype),
        activation_checkpointing=list(range(k)) if k else None,
        sync_module_states=config.strategy.sync_module_states,
        shard_size=config.strategy.shard_size,
        verify_checksums=config.strategy.verify_checksums,
        async_save=config.strategy.async_save,
        vocab_chunks=config.strategy.vocab_chunks,
        blocks_per_unit=config.strategy.blocks_per_unit_value,
        # The engine would otherwise cast each block's floating inputs, the residual
        # stream included, to bf16, undoing fp32_residual at every block boundary.
        cast_forward_inputs=not config.practices.fp32_residual,
    )


def build_trainer(
    config: RunConfig,
    run_dir: Path,
    est: Estimate,
    *,
    train_sequences: int,
    resume_step: int | None = None,
    extra_callbacks: Sequence[Callback] = (),
) -> pl.Trainer:
    """The Trainer of a recipe.

    Args:
        train_sequences: Size of the train split.
        resume_step: The step a resumed run continues from (None: fresh); the metrics
            log keeps the rows up to it.
    """
    tc = config.trainer
    callbacks: list[Any] = [RunStats(), *extra_callbacks]
    if config.practices.thermometers.enabled:
        callbacks.append(Thermometers(config.practices.thermometers.every_n_steps))
    if tc.progress_bar:
        callbacks.append(StepProgressBar(leave=True))
    checkpointing = tc.checkpoint_every_n_steps > 0
    if checkpointing:
        callbacks.append(
            ModelCheckpoint(
                dirpath=run_dir / "checkpoints",
                every_n_train_steps=tc.checkpoint_every_n_steps,
                save_last=True,
                save_top_k=-1,
            )
        )
    return pl.Trainer(
        accelerator=tc.accelerator,
        devices=tc.lightning_devices(),
        num_nodes=tc.num_nodes,
        strategy=build_strategy(config, est),
        precision=tc.precision,
        max_steps=tc.max_steps,
        max_epochs=_epochs(config, est.world_size, train_sequences),
        accumulate_grad_batches=tc.accumulate_grad_batches,
        gradient_clip_val=config.optim.grad_clip or None,
        val_check_interval=min(tc.val_check_interval, tc.max_steps * tc.accumulate_grad_batches),
        check_val_every_n_epoch=None,
        limit_val_batches=tc.limit_val_batches,
        num_sanity_val_steps=0,
        log_every_n_steps=tc.log_every_n_steps,
        logger=_logger(config, run_dir, resume_step=resume_step),
        callbacks=callbacks,
        enable_checkpointing=checkpointing,
        enable_progress_bar=tc.progress_bar,
        enable_model_summary=False,
        default_root_dir=run_dir,
        # The datamodule's samplers are distributed and resumable themselves.
        use_distributed_sampler=False,
    )


def _epochs(config: RunConfig, world_size: int, train_sequences: int) -> int:
    # max_steps decides; the epoch count only makes the progress bar read "Epoch 0/1".
    per_epoch = max(1, train_sequences // (config.data.batch_size * world_size))
    return math.ceil(config.trainer.max_steps * config.trainer.accumulate_grad_batches / per_epoch)


def _logger(config: RunConfig, run_dir: Path, *, resume_step: int | None = None) -> list[Logger]:
    from lightning_yafsdp.training.metrics_log import StepMetricsLogger

    kind = config.trainer.logger
    if kind == "none":
        return []
    # metrics.csv always: the plot and the summary read it, TensorBoard or not.
    loggers: list[Logger] = [StepMetricsLogger(run_dir / "logs", resume_step=resume_step)]
    if kind == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(save_dir=str(run_dir), name="logs", version="tensorboard"))
    return loggers


def train(
    config: RunConfig,
    *,
    start: RunStart | None = None,
    show: bool = True,
    extra_callbacks: Sequence[Callback] = (),
) -> dict[str, Any]:
    """Run a recipe to the end; return the summary facts (every rank gets them).

    Args:
        config: The resolved recipe.
        start: Where the run starts (:func:`plan_start`; ``yafsdp train --resume``
            decides it before any process starts). None: a fresh run, refused if the
            run folder already holds one.
        show: Print the startup panel and the final summary on rank 0.
        extra_callbacks: More Lightning callbacks for the Trainer.
    """
    with handoff_scope():
        return _train(config, start=start, show=show, extra_callbacks=extra_callbacks)


def _train(
    config: RunConfig, *, start: RunStart | None, show: bool, extra_callbacks: Sequence[Callback]
) -> dict[str, Any]:
    notices = check_inputs(config, training=True)  # before any file is written
    run_dir = run_dir_of(config)
    start = start if start is not None else plan_start(run_dir, None)
    # Handed to the ranks the launcher starts (inside handoff_scope: not beyond this run).
    os.environ[RESUME_ENV] = str(start.checkpoint or "")
    rank_zero = is_rank_zero()
    pl.seed_everything(config.trainer.seed, workers=True, verbose=False)
    if config.trainer.accelerator == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # N ranks on one machine: each gets its share of the cores, not all of them.
        processes = max(1, world_size_of(config) // config.trainer.num_nodes)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))
    est = estimate(config)
    data = _prepared_data(config)
    schedule_steps, schedule_warning = schedule_steps_for(config, start)
    if schedule_warning and rank_zero:
        print(schedule_warning, file=sys.stderr, flush=True)  # also in the panel
        notices = [*notices, schedule_warning]
    model = CausalLMModule(config, schedule_steps=schedule_steps)
    _check_vocab(config, data, est)
    trainer = build_trainer(
        config,
        run_dir,
        est,
        train_sequences=len(data.train_dataset),
        resume_step=start.step if start.checkpoint else None,
        extra_callbacks=[
            *extra_callbacks,
            _CommitRunFolder(config, run_dir, start),
            _RecipeHparams(config),
        ],
    )
    if rank_zero and show:
        notices = [*notices, *start.notes]
        paths = {"outputs": str(run_dir)}
        if start.checkpoint is not None:
            paths["resuming"] = str(start.checkpoint)
        console.print_startup(_startup_panel(config, est, data, start, notices), paths)
    _fit(trainer, model, data, start, run_dir)
    # val_check_interval counts training batches (micro-batches), as Lightning does.
    batches = trainer.global_step * config.trainer.accumulate_grad_batches
    interval = min(config.trainer.val_check_interval, batches or 1)
    if config.trainer.limit_val_batches and batches % interval != 0:
        trainer.validate(model, datamodule=data, verbose=False)
    facts = _summary(config, trainer, model, data, run_dir, start)
    if trainer.is_global_zero:
        facts["plot"] = _plot(config, run_dir, baseline=facts.get("unigram_entropy"))
        (run_dir / "summary.json").write_text(json.dumps(facts, indent=2, default=str) + "\n")
        if show:
            console.print_summary(
                _display(facts), _output_paths(facts), [loss for _, loss in model.train_losses]
            )
    return facts


def schedule_steps_for(config: RunConfig, start: RunStart) -> tuple[int, str | None]:
    """[Note: the LR schedule across a resume] applied to this run."""
    from lightning_yafsdp.training.schedule import schedule_steps_of

    schedule = config.schedule
    return schedule_steps_of(
        warmup_steps=schedule.warmup_steps,
        decay=schedule.decay,
        min_ratio=schedule.min_lr_ratio,
        lr=config.optim.lr,
        max_steps=config.trainer.max_steps,
        total_steps=schedule.total_steps,
        resumed_step=start.step if start.checkpoint is not None else None,
        resumed_length=start.schedule_steps,
    )


def _fit(
    trainer: pl.Trainer,
    model: CausalLMModule,
    data: TokenDataModule,
    start: RunStart,
    run_dir: Path,
) -> None:
    with warnings.catch_warnings():
        # Lightning cannot see that our sampler resumes mid-epoch ([Note: resuming the
        # data order]) and would warn that the data order is lost; a resumed run's
        # checkpoint folder is not empty, by design.
        warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended")
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not")
        try:
            trainer.fit(model, datamodule=data, ckpt_path=str(start.checkpoint or "") or None)
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C: Lightning stops the ranks, exit(1)
            if is_rank_zero():
                print(
                    f"yafsdp train: stopped at step {trainer.global_step}; continue from the "
                    f"last checkpoint with: yafsdp train {run_dir}/config.yaml --resume",
                    file=sys.stderr,
                )
            raise


class _CommitRunFolder(Callback):
    """Writes what a run changes in its folder once training starts, after the
    checkpoint was restored: a resume that fails (a checkpoint of another model) leaves
    config.yaml and metrics.csv as they were."""

    def __init__(self, config: RunConfig, run_dir: Path, start: RunStart) -> None:
        self.config, self.run_dir, self.start = config, run_dir, start

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if not trainer.is_global_zero:
            return
        _write_config(self.config, self.run_dir, self.start)
        moved = _set_aside_later_metrics(trainer)
        if moved:
            print(
                f"yafsdp train: metrics logged from step {self.start.step} on by the "
                f"interrupted run were moved to {moved}",
                flush=True,
            )


class _RecipeHparams(Callback):
    """Logs the flattened recipe (``flat_recipe``) as TensorBoard's hyperparameters.

    In ``setup``: Lightning writes the logger's hparams.yaml once, right after the
    setup hooks, and the LightningModule saves no hyperparameters of its own.
    """

    def __init__(self, config: RunConfig) -> None:
        self.config = config

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        from lightning_yafsdp.training.metrics_log import flat_recipe

        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
                logger.log_hyperparams(flat_recipe(self.config))


def _set_aside_later_metrics(trainer: pl.Trainer) -> Path | None:
    """Move the rows a resumed run will log again out of metrics.csv (the logger would
    at its first row; done here to say so); the path of the file they went to."""
    from lightning_yafsdp.training.metrics_log import StepMetricsLogger

    for logger in trainer.loggers:
        if isinstance(logger, StepMetricsLogger):
            return logger.set_aside_superseded_rows()
    return None


def _plot(config: RunConfig, run_dir: Path, *, baseline: float | None) -> str | None:
    """metrics.png of the run (None with ``trainer.logger=none``: no metrics)."""
    from lightning_yafsdp.training.plot import PlotError, write_plot

    if config.trainer.logger == "none":
        return None
    try:
        return str(write_plot(run_dir, baseline=baseline))
    except PlotError as err:  # no step logged: say so, the run itself succeeded
        print(f"yafsdp train: no plot: {err}")
        return None


def _prepared_data(config: RunConfig) -> TokenDataModule:
    data = TokenDataModule(config.data)
    try:
        data.setup("fit")
    except (ValueError, OSError) as err:  # too little text, an unreadable token file
        raise ConfigError(f"data: {err}") from err
    return data


def _write_config(config: RunConfig, run_dir: Path, start: RunStart) -> None:
    """``config.yaml`` with the run's name, so ``yafsdp train runs/X/config.yaml
    --resume`` continues run X; a resume with other settings keeps the old file."""
    text = _config_text(config, run_dir)
    path = run_dir / "config.yaml"
    run_dir.mkdir(parents=True, exist_ok=True)
    if path.is_file() and _settings(path.read_text()) != _settings(text):
        path.replace(_free_name(run_dir / f"config.before-step-{start.step}.yaml"))
    path.write_text(text)


def _config_text(config: RunConfig, run_dir: Path) -> str:
    named = dataclasses.replace(config.trainer, run_name=run_dir.name)
    return to_yaml(dataclasses.replace(config, trainer=named))


def _settings(text: str) -> str:
    # Where the run folder is seen from (output_dir) is not a setting of the run.
    return "\n".join(line for line in text.splitlines() if not line.startswith("  output_dir:"))


def _free_name(path: Path) -> Path:
    candidate, k = path, 1
    while candidate.exists():
        candidate, k = path.with_name(f"{path.stem}-{k}{path.suffix}"), k + 1
    return candidate


def _startup_panel(
    config: RunConfig,
    est: Estimate,
    data: TokenDataModule,
    start: RunStart,
    notices: Sequence[str],
) -> Any:
    return console.startup_panel(
        recipe=config.recipe,
        model_name=_model_name(config),
        est=est,
        world_size=est.world_size,
        precision=config.trainer.precision,
        strategy=config.strategy.name,
        data=_data_facts(config, data),
        start=start.describe(),
        warnings=notices,
    )


def _check_vocab(config: RunConfig, data: TokenDataModule, est: Estimate) -> None:
    from lightning_yafsdp.training.models import build_model, vocab_size_of

    with torch.device("meta"):
        vocab = vocab_size_of(build_model(config))
    if data.vocab_size > vocab:
        raise ConfigError(
            f"the data's vocabulary ({data.vocab_size} tokens, data.tokenizer="
            f"{config.data.tokenizer!r}) exceeds the model's vocab_size={vocab}; set "
            "model.vocab_size or use the model's own tokenizer"
        )


def _model_name(config: RunConfig) -> str:
    if config.model.kind == "hf":
        return f"hf:{config.model.hf_path}"
    return f"llama/{config.model.preset}"


def _data_facts(config: RunConfig, data: TokenDataModule) -> dict[str, Any]:
    return {
        "source": config.data.source,
        "train_tokens": data.train_tokens,
        "val_tokens": data.val_tokens,
        "vocab_size": data.vocab_size,
        "unigram_entropy": data.unigram_entropy,
    }


def _summary(
    config: RunConfig,
    trainer: pl.Trainer,
    model: CausalLMModule,
    data: TokenDataModule,
    run_dir: Path,
    start: RunStart,
) -> dict[str, Any]:
    """The whole run's facts; speed and memory are this process's (since a resume)."""
    stats = next(cb for cb in trainer.callbacks if isinstance(cb, RunStats))
    device = trainer.strategy.root_device
    history = model.history()
    segment_tokens = model.tokens_seen * trainer.world_size
    rate = segment_tokens / stats.train_seconds if stats.train_seconds else math.nan
    peak, peak_kind = peak_memory_bytes(device)
    val = trainer.callback_metrics.get("val_loss")
    facts: dict[str, Any] = {
        "steps": trainer.global_step,
        "resumed_from_step": start.step if start.checkpoint is not None else None,
        "tokens": history.tokens,
        "train_seconds": round(stats.train_seconds, 2),
        "tokens_per_s": round(rate, 1),
        "mfu": None,
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
        "first_train_loss": (
            history.first_train_loss if history.first_train_loss is not None else math.nan
        ),
        "final_train_loss": model.final_train_loss(),
        "final_val_loss": float(val) if val is not None else math.nan,
        "unigram_entropy": data.unigram_entropy,
        "run_dir": str(run_dir),
        "checkpoint": _last_checkpoint(trainer),
        "rollbacks": [vars(r) for r in model.guard.rollbacks] if model.guard else [],
        "skipped_steps": list(model.guard.skipped_steps) if model.guard else [],
    }
    peak_flops = device_peak_flops(device)
    if peak_flops and config.model.kind == "llama" and model.model is not None:
        with torch.device("meta"):
            from lightning_yafsdp.training.models import build_model

            flops = build_model(config).flops_per_token(config.data.seq_len)
        facts["mfu"] = round(rate * flops / (peak_flops * trainer.world_size), 4)
    return facts


def _last_checkpoint(trainer: pl.Trainer) -> str | None:
    callback = trainer.checkpoint_callback
    if callback is None:
        return None
    return getattr(callback, "last_model_path", None) or None


def _display(facts: dict[str, Any]) -> dict[str, str]:
    resumed = facts["resumed_from_step"]
    return {
        "steps": str(facts["steps"]) + (f" (resumed at step {resumed})" if resumed else ""),
        "tokens": console.human_count(facts["tokens"]),
        "tokens/s (training" + (", since the resume)" if resumed else ")"): (
            f"{facts['tokens_per_s']:,.0f}"
        ),
        "MFU": f"{facts['mfu']:.1%}" if facts["mfu"] is not None else "n/a (device peak unknown)",
        f"peak memory ({facts['peak_memory_kind']}, rank 0)": console.human_bytes(
            facts["peak_memory_bytes"]
        ),
        "first train loss": f"{facts['first_train_loss']:.3f}",
        "final train loss (last 10 steps)": f"{facts['final_train_loss']:.3f}",
        "final val loss": f"{facts['final_val_loss']:.3f}",
        "unigram baseline (val)": f"{facts['unigram_entropy']:.3f}",
        "divergence rollbacks": str(len(facts["rollbacks"])),
    }


def _output_paths(facts: dict[str, Any]) -> dict[str, str]:
    return {
        "outputs": str(facts["run_dir"]),
        "plot": facts.get("plot") or "none (trainer.logger=none)",
        "checkpoint": facts["checkpoint"] or "none (trainer.checkpoint_every_n_steps=0)",
    }
