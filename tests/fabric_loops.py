"""Fabric training loops shared by the Fabric tests, run on each rank by ``dist_run``.

Each optimizer step sees the same global batch whatever the world size (rank ``r`` of
``W`` takes rows ``r::W`` of ``GLOBAL_ROWS``), so a run saved at one world size and
continued at another must repeat the uninterrupted run's losses to float round-off.
"""

from __future__ import annotations

import lightning as L
import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lightning_yafsdp  # noqa: F401  (registers strategy="yafsdp")
from lightning_yafsdp.checkpoint import full_model_state_dict
from lightning_yafsdp.core import get_engine
from lightning_yafsdp.models.llama import Llama, LlamaConfig

GLOBAL_ROWS = 6  # divisible by world sizes 1, 2 and 3
SEQ_LEN = 12
ACCUMULATION = 2
STEPS = 6
CLIP = 0.5
LR = 1e-3


def micro_batch(
    step: int, micro: int, rank: int, world_size: int, vocab_size: int = 256
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + 10 * step + micro)
    rows = torch.randint(0, vocab_size, (GLOBAL_ROWS, SEQ_LEN), generator=generator)
    return rows[rank::world_size]


def build_llama() -> nn.Module:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_name("tiny"))


def decay_split_adamw(model: nn.Module) -> torch.optim.Optimizer:
    """The nanoGPT / litgpt split: matrices decay, vectors do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens.reshape(-1))


def make_fabric(strategy, precision: str = "32-true") -> L.Fabric:
    fabric = L.Fabric(
        accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, precision=precision
    )
    fabric.launch()
    return fabric


def train_steps(
    fabric: L.Fabric,
    model,
    optimizer,
    steps: range,
    norms: list | None = None,
    *,
    vocab_size: int = 256,
    loss_fn=next_token_loss,
):
    """Steps with accumulation and global-norm clipping; the mean loss of each step.

    ``norms`` (if given) receives the total gradient norm ``clip_gradients`` returned.
    """
    losses = []
    for step in steps:
        total = torch.zeros(())
        for micro in range(ACCUMULATION):
            tokens = fabric.to_device(
                micro_batch(step, micro, fabric.global_rank, fabric.world_size, vocab_size)
            )
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATION - 1):
                loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
                fabric.backward(loss / ACCUMULATION)
            total += loss.detach() / ACCUMULATION
        norm = fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        if norms is not None:
            norms.append(norm.item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(total, reduce_op="mean").item())
    return losses


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on every rank, under yafsdp or ddp."""
    inner = getattr(model, "_forward_module", model)
    inner = getattr(inner, "module", inner)  # DistributedDataParallel
    if "_yafsdp_engine" in inner.__dict__:
        return full_model_state_dict(get_engine(inner), rank0_only=False)
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


class FabricAndTrainerLM(pl.LightningModule):
    """The tiny Llama as a LightningModule, trained by Fabric and by the Trainer alike."""

    def __init__(self) -> None:
        super().__init__()
        self.model = build_llama()
        self.micro_losses: list[float] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = next_token_loss(self(tokens[:, :-1]), tokens[:, 1:])
        self.micro_losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return decay_split_adamw(self)


class StepRows(torch.utils.data.Dataset):
    """This rank's micro-batches of the given steps, in order (one item = one micro-batch)."""

    def __init__(self, steps: range, rank: int, world_size: int) -> None:
        self.items = [(s, m) for s in steps for m in range(ACCUMULATION)]
        self.rank, self.world_size = rank, world_size

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        step, micro = self.items[index]
        return micro_batch(step, micro, self.rank, self.world_size)
