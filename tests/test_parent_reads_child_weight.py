"""A module may read a child's weight before calling the child, as under DDP.

Hugging Face's ``CLIPTextEmbeddings.forward`` reads ``position_embedding.weight.shape``
before it calls ``position_embedding``; Lightning calls ``training_step``, never the root
module's forward. The embedding lives in the resident root group, so its weights must be
exposed as soon as any ancestor of their owner runs, not only when the owner does.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_yafsdp  # noqa: F401 - registers strategy="yafsdp"
from tests.distributed import dist_run

transformers = pytest.importorskip("transformers")

STEPS = 3
VOCAB = 64
SEQ = 8
ROUND_OFF = 1e-6  # measured 0.0 on two ranks


class _TextEncoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.CLIPTextConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=SEQ,
            attn_implementation="eager",
        )
        self.model = transformers.CLIPTextModel(config)
        self.head = torch.nn.Linear(32, 2)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        pooled = self.model(input_ids=tokens).pooler_output
        loss = F.cross_entropy(self.head(pooled), labels)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(strategy: str) -> dict:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (STEPS * 2 * 2, SEQ), generator=generator)
    labels = torch.randint(0, 2, (STEPS * 2 * 2,), generator=generator)
    model = _TextEncoder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(tokens, labels), batch_size=2))
    weights = (
        trainer.strategy.engine.full_state_dict() if strategy == "yafsdp" else model.state_dict()
    )
    return {"losses": model.losses, "weights": {k: v.clone() for k, v in weights.items()}}


def _runs() -> dict:
    return {strategy: _fit(strategy) for strategy in ("ddp", "yafsdp")}


def test_clip_text_model_reading_its_position_embedding_shape_trains_like_ddp():
    for facts in dist_run(2, _runs, timeout_s=180):
        ddp, ours = facts["ddp"], facts["yafsdp"]
        assert len(ours["losses"]) == STEPS
        torch.testing.assert_close(ours["losses"], ddp["losses"], rtol=ROUND_OFF, atol=0)
        for key, expected in ddp["weights"].items():
            scale = expected.abs().max().clamp_min(1e-3)
            error = (ours["weights"][key].float() - expected.float()).abs().max() / scale
            assert error <= ROUND_OFF, (key, error.item())


class _PenaltyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h).pow(2).mean()


def _penalty_after_forward() -> str:
    from lightning_yafsdp.core import shard_model

    torch.manual_seed(0)
    model = _PenaltyNet()
    shard_model(model, units=nn.Sequential)
    loss = model(torch.randn(4, 16))
    try:  # layers.0's buffer holds layers.2 by now: its views would read layers.2's weights
        penalty = sum(layer[0].weight.pow(2).sum() for layer in model.layers)
    except RuntimeError as error:
        return str(error)
    (loss + penalty).backward()
    return "no error"


def test_a_block_weight_read_after_its_buffer_was_taken_refuses_instead_of_reading_another():
    """A penalty computed in the training step after the forward read whatever unit held
    the block's slot by then, silently (found by a review); now it names the weight."""
    (message,) = dist_run(2, _penalty_after_forward, timeout_s=120)[:1]
    assert "'layers.0.0.weight' was read outside the forward of its module" in message
