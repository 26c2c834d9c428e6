"""LightningModules and data shared by the strategy tests.

Tiny on purpose: a Trainer run on two CPU ranks must take seconds. Every module records
what the tests assert on (per-micro-batch losses, validation losses, metric values) in
plain attributes, so a rank can return them from ``dist_run``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor
from lightning_yafsdp.models.llama import Llama, LlamaConfig, hf_llama_config

SEQ_LEN = 16


def quiet_trainer(strategy, root: str, *, max_steps: int = 1) -> pl.Trainer:
    """A two-rank CPU Trainer that writes nothing on its own (no logger, no checkpoints)."""
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=max_steps,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=root,
    )


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig.from_name("tiny")


class RankTaggedTokens(Dataset):
    """Random token rows (fixed seed); each item also carries its own index.

    The index lets a test see which rows each rank received (the DistributedSampler).
    """

    def __init__(self, num_rows: int, *, vocab_size: int = 256, seed: int = 1234) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (num_rows, SEQ_LEN), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens[index], "index": torch.tensor(index)}


def token_loader(num_rows: int, *, batch_size: int = 2) -> DataLoader:
    return DataLoader(RankTaggedTokens(num_rows), batch_size=batch_size, shuffle=False)


def fixed_batch() -> torch.Tensor:
    """The batch on which trained models are compared."""
    generator = torch.Generator().manual_seed(99)
    return torch.randint(0, 256, (2, SEQ_LEN), generator=generator)


class CausalLMModule(pl.LightningModule):
    """Next-token cross-entropy training of a causal LM.

    Args:
        build: ``"eager"`` builds the model in ``__init__`` (seeded, identical on every
            rank and under every strategy); ``"configure_model"`` builds it in
            ``configure_model`` (the meta-device path under YaFSDPStrategy).
        kind: ``"llama"`` (this package's reference model) or ``"hf"`` (Hugging Face
            ``LlamaForCausalLM`` from the same tiny shape, built offline).
        lr: AdamW learning rate.
    """

    def __init__(self, *, build: str = "eager", kind: str = "llama", lr: float = 1e-2) -> None:
        super().__init__()
        self.kind = kind
        self.lr = lr
        self.model: nn.Module | None = None
        self.configure_model_calls = 0
        self.max_live_numel = 0
        self.train_losses: list[float] = []
        self.val_losses: list[float] = []
        self.seen_indices: list[int] = []
        self.val_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=256)
        if build == "eager":
            torch.manual_seed(0)
            self.model = self._build()

    def _build(self) -> nn.Module:
        config = tiny_llama_config()
        if self.kind == "llama":
            return Llama(config)
        from transformers import LlamaForCausalLM

        hf_config = hf_llama_config(config)
        hf_config._attn_implementation = "eager"
        return LlamaForCausalLM(hf_config)

    def configure_model(self) -> None:
        self.configure_model_calls += 1
        if self.model is not None:
            return
        self.model = self._build()

    def init_submodule(self, module: nn.Module) -> None:
        """Meta-device initialisation, one module at a time (see YaFSDPStrategy).

        Also records the most full-size parameter elements alive at any call, so a test
        can check that no rank ever held the whole model.
        """
        # Full-size (unsharded) parameters only: sharded ones hold this rank's piece.
        live = sum(
            p.numel()
            for p in self.model.parameters()
            if not p.is_meta and not isinstance(p, RangeShardedTensor)
        )
        self.max_live_numel = max(self.max_live_numel, live)
        self.model.init_submodule(module)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.kind == "llama":
            return self.model(tokens)
        return self.model(input_ids=tokens).logits

    def _loss(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self(tokens[:, :-1])
        targets = tokens[:, 1:]
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss, logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch["tokens"])
        self.train_losses.append(loss.item())
        self.seen_indices.extend(batch["index"].tolist())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, logits = self._loss(batch["tokens"])
        self.val_losses.append(loss.item())
        self.val_accuracy(logits.argmax(-1).reshape(-1), batch["tokens"][:, 1:].reshape(-1))
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_acc", self.val_accuracy)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch["tokens"]).float().argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)
