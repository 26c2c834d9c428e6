"""The LightningModule of ``yafsdp train``: next-token cross-entropy on packed sequences.

Reads as the Trainer calls it: ``configure_model`` builds the recipe's model (on
the meta device under YaFSDP: free; the strategy materializes, initializes with
``init_submodule`` and shards it one unit at a time), ``configure_optimizers``
takes the engine's param groups (norm gains without weight decay), and each
``training_step`` applies the curriculum and the divergence guard around the loss.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchmetrics
from torch import nn

from lightning_yafsdp.config import RunConfig
from lightning_yafsdp.core.comm.collectives import all_reduce_
from lightning_yafsdp.training.chunked_loss import chunked_cross_entropy, recipe_chunk_tokens
from lightning_yafsdp.training.curriculum import Curriculum
from lightning_yafsdp.training.guard import DivergenceGuard
from lightning_yafsdp.training.models import build_model, model_init_fn
from lightning_yafsdp.training.schedule import lr_lambda
from lightning_yafsdp.training.stats import log_event_metrics

RUN_HISTORY_KEY = "yafsdp_run"


@dataclasses.dataclass
class RunHistory:
    """What a run did before this process, carried by its checkpoints.

    Attributes:
        tokens: Tokens trained on, all ranks together.
        first_train_loss: The loss of the run's first step (None before any).
        schedule_steps: The LR schedule's length (None in checkpoints written before
            it was recorded); see [Note: the LR schedule across a resume].
    """

    tokens: int = 0
    first_train_loss: float | None = None
    schedule_steps: int | None = None


class CausalLMModule(pl.LightningModule):
    """Train a causal LM from a recipe.

    Args:
        config: The resolved recipe.
        schedule_steps: The LR schedule's length (default: ``schedule.total_steps``,
            else ``trainer.max_steps``); a resume passes the one it keeps.

    Attributes recorded for the final summary (plain Python, rank-local):
        train_losses: ``(step, loss averaged over ranks and the step's micro-batches)``
            for every step trained by this process (a resumed run: since the resume).
        tokens_seen: Tokens this rank trained on in this process (curriculum crops
            included).
        earlier: What the segments before a resume did (``RunHistory``, all zero for a
            fresh run); saved in every checkpoint under ``"yafsdp_run"``.
        guard: The divergence guard (None when off).
        loss_chunk_tokens: Tokens per chunk of the head and the loss ([Note: chunked
            loss], ``model.loss_chunk_size``); None: the whole logits.
    """

    def __init__(self, config: RunConfig, *, schedule_steps: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.schedule_steps = (
            schedule_steps or config.schedule.total_steps or (config.trainer.max_steps)
        )
        self.model: nn.Module | None = None
        self.loss_chunk_tokens = recipe_chunk_tokens(config)
        practices = config.practices
        self.curriculum = (
            Curriculum(
                practices.curriculum,
                seq_len=config.data.seq_len,
                batch_size=config.data.batch_size,
            )
            if practices.curriculum.enabled
            else None
        )
        self.guard = (
            DivergenceGuard(practices.divergence_guard)
            if practices.divergence_guard.enabled
            else None
        )
        self.val_nll = torchmetrics.MeanMetric()
        self.train_losses: list[tuple[int, float]] = []
        self._step_losses: list[float] = []  # this optimizer step's micro-batches so far
        self.tokens_seen = 0
        self.earlier = RunHistory()
        self.last_seq_len = config.data.seq_len

    # -- model --------------------------------------------------------------------------

    def configure_model(self) -> None:
        if self.model is not None:  # runs again for validate/test: keep the sharded model
            return
        self.model = build_model(self.config)

    def init_submodule(self, module: nn.Module) -> None:
        """Initialise one piece of the meta-built model (called by the strategy)."""
        assert self.model is not None
        model_init_fn(self.model)(module)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        out = self.model(tokens)
        return out if isinstance(out, torch.Tensor) else out.logits

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats) of a ``[batch, seq + 1]`` window batch."""
        fp32 = self.config.practices.fp32_loss  # [YaLM] the softmax before the loss in fp32
        if self.loss_chunk_tokens is not None:  # [Note: chunked loss]
            assert self.model is not None
            return chunked_cross_entropy(
                self.model.hidden_states(batch[:, :-1]),
                self.model.output,
                batch[:, 1:],
                chunk_tokens=self.loss_chunk_tokens,
                fp32=fp32,
            )
        logits = self(batch[:, :-1])
        if fp32:
            logits = logits.float()
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    # -- training -----------------------------------------------------------------------

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        step = self.global_step
        guard = self.guard
        if guard is not None:
            if guard.should_skip(step):
                log_event_metrics(self.trainer, {"guard/skipped": 1.0})
                return self._no_update()
        if self.curriculum is not None:
            batch = self.curriculum.crop(batch, step)
        self.last_seq_len = batch.shape[1] - 1
        loss = self.loss(batch)
        mean_loss = self._mean_over_ranks(loss.detach())
        if guard is not None:
            value = float(mean_loss)
            reason = guard.verdict(value, step)
            if reason is not None:
                event = guard.roll_back(
                    self,
                    self.optimizers().optimizer,
                    step=step,
                    reason=reason,
                    loss=value,
                    schedulers=[s.scheduler for s in self.trainer.lr_scheduler_configs],
                    engine=getattr(self.trainer.strategy, "_engine", None),
                )
                log_event_metrics(
                    self.trainer,
                    {
                        "guard/rollback": 1.0,
                        "guard/bad_loss": value,
                        "guard/lr_scale": guard.lr_scale,
                    },
                )
                if self.global_rank == 0:
                    print(
                        f"[divergence guard] step {step}: loss {reason} ({value:.4g}); rolled "
                        f"back to step {event.restored_step}, skipping this batch"
                        + (
                            f" and {guard.config.skip_batches} more"
                            if guard.config.skip_batches
                            else ""
                        )
                        + (f", lr x{event.lr_scale:g}" if event.lr_scale != 1.0 else ""),
                        flush=True,
                    )
                return self._no_update()
            # Healthy loss: these weights (and this optimizer state) are good to return to.
            guard.maybe_snapshot(self, self.optimizers().optimizer, step)
        self.tokens_seen += batch[:, 1:].numel()
        self.log("train_loss", mean_loss, on_step=True, prog_bar=True, logger=False)
        self._step_losses.append(float(mean_loss))
        if (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:
            self._end_of_step(step, batch)
        return loss

    def _end_of_step(self, step: int, batch: torch.Tensor) -> None:
        """Record the optimizer step's loss: the mean over its micro-batches."""
        step_loss = sum(self._step_losses) / len(self._step_losses)
        self._step_losses.clear()
        self.train_losses.append((step, step_loss))
        # Lightning logs its own metrics (tokens/s) on steps with (step + 1) % n == 0: the
        # same steps here put them on one row. Step 0 too: the loss at initialisation.
        if step == 0 or (step + 1) % self.config.trainer.log_every_n_steps == 0:
            # Straight to the loggers: through self.log, Lightning would repeat the last
            # loss on the rows of steps the divergence guard skipped.
            metrics = {"train_loss": step_loss, "lr": self.optimizers().param_groups[0]["lr"]}
            if self.curriculum is not None:
                metrics["curriculum/seq_len"] = float(batch.shape[1] - 1)
                metrics["curriculum/batch_size"] = float(batch.shape[0])
            log_event_metrics(self.trainer, metrics)

    def _no_update(self) -> torch.Tensor:
        # [Note: skipping a step] Lightning refuses ``return None`` from training_step
        # in distributed runs. A zero loss that touches no parameter skips the update
        # just as well: backward reaches no unit (no collectives, on every rank alike),
        # the gradients stay None after zero_grad, and AdamW leaves such parameters
        # alone. The forward that produced the bad loss simply has no backward, which
        # the engine allows (its views are rebuilt by the next forward).
        return torch.zeros((), device=self.trainer.strategy.root_device, requires_grad=True)

    def _mean_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        # One small all_reduce per step: the guard must decide alike on every rank
        # (a rank that skips backward while another runs it would hang the collectives),
        # and the logged loss is then the global one with no extra sync.
        if dist.is_available() and dist.is_initialized() and self.trainer.world_size > 1:
            value = value.clone()
            all_reduce_(value, None)
            value /= self.trainer.world_size
        return value

    # -- validation ---------------------------------------------------------------------

    def on_validation_epoch_start(self) -> None:
        self.val_nll.to(self.trainer.strategy.root_device)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss = self.loss(batch)
        self.val_nll.update(loss, weight=batch[:, 1:].numel())

    def on_validation_epoch_end(self) -> None:
        nll = self.val_nll.compute()  # synced over ranks by torchmetrics
        self.val_nll.reset()
        # Already equal on every rank; sync_dist only silences Lightning's warning.
        self.log("val_loss", nll, prog_bar=True, sync_dist=True)
        self.log("val_ppl", torch.exp(nll), sync_dist=True)

    # -- optimizer ----------------------------------------------------------------------

    def configure_optimizers(self) -> dict[str, Any]:
        optim, schedule = self.config.optim, self.config.schedule
        # The usual split, the same under every strategy (sharded parameters report
        # their full shape): matrices decay, biases and norm weights do not.
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        groups = [
            {"params": decay, "weight_decay": optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lr_lambda(
                warmup_steps=schedule.warmup_steps,
                total_steps=self.schedule_steps,
                decay=schedule.decay,
                min_ratio=schedule.min_lr_ratio,
            ),
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    # -- the run across resumes ---------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[RUN_HISTORY_KEY] = dataclasses.asdict(self.history())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(RUN_HISTORY_KEY)
        if saved:
            self.earlier = RunHistory(**saved)

    def history(self) -> RunHistory:
        """The whole run so far: earlier segments plus this process's training."""
        first = self.earlier.first_train_loss
        if first is None and self.train_losses:
            first = self.train_losses[0][1]
        return RunHistory(
            tokens=self.earlier.tokens + self.tokens_seen * self.trainer.world_size,
            first_train_loss=first,
            schedule_steps=self.schedule_steps,
        )

    def final_train_loss(self, last: int = 10) -> float:
        """Mean of the last ``last`` logged training losses (nan before any)."""
        tail = [loss for _, loss in self.train_losses[-last:]]
        return sum(tail) / len(tail) if tail else math.nan
