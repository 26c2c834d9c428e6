"""Tiny Hugging Face models of many families, wrapped as LightningModules for the zoo tests.

Every family is built from a tiny config (hidden 32, 2 layers, vocab 128, no dropout,
eager attention), never from the hub. ``ZooModule`` trains any of them with the HF loss
(``model(**batch).loss``) and records what the tests compare: per-micro-batch losses.

Two ways to build, as users do:

- ``build="eager"``: in ``__init__`` with a fixed seed (real tensors, identical on every
  rank and under every strategy), the path that must match DDP to float round-off;
- ``build="configure_model"``: plainly inside ``configure_model`` (the meta device under
  ``strategy="yafsdp"``), the path whose initial weights must follow the model's own init.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_yafsdp  # noqa: F401 - registers strategy="yafsdp"

VOCAB = 128
SEQ_LEN = 16
IMAGE_SIZE = 16
NUM_LABELS = 4

# Shape shared by every decoder config below.
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attention_dropout=0.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


@dataclass(frozen=True)
class Family:
    """One model family: how to build it and what a batch of its inputs looks like.

    Attributes:
        name: the family's short name (test ids).
        build: returns the HF model, built from its tiny config on the current device.
        inputs: ``"causal"`` (input_ids, labels = input_ids), ``"masked"`` (same, for an
            encoder's MLM head), ``"seq2seq"`` (input_ids and different labels) or
            ``"image"`` (pixel_values and class labels).
    """

    name: str
    build: Callable[[], nn.Module]
    inputs: str


def _eager(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    config._attn_implementation = "eager"
    return config


def _llama() -> nn.Module:
    return transformers.LlamaForCausalLM(_eager(transformers.LlamaConfig(**_DECODER)))


def _mistral() -> nn.Module:
    config = transformers.MistralConfig(**_DECODER, sliding_window=8)
    return transformers.MistralForCausalLM(_eager(config))


def _gemma2() -> nn.Module:
    config = transformers.Gemma2Config(
        **_DECODER, head_dim=8, query_pre_attn_scalar=8, sliding_window=8
    )
    return transformers.Gemma2ForCausalLM(_eager(config))


def _phi3() -> nn.Module:
    config = transformers.Phi3Config(**_DECODER, resid_pdrop=0.0, embd_pdrop=0.0)
    return transformers.Phi3ForCausalLM(_eager(config))


def _gpt_neox() -> nn.Module:
    shape = {k: v for k, v in _DECODER.items() if k != "num_key_value_heads"}
    config = transformers.GPTNeoXConfig(**shape, hidden_dropout=0.0, rotary_pct=0.5)
    return transformers.GPTNeoXForCausalLM(_eager(config))


def _mixtral() -> nn.Module:
    # Four experts, two per token: over 32 tokens every expert is used in every step
    # (an expert no rank uses would leave DDP's grad None; see test_call_patterns).
    config = transformers.MixtralConfig(
        **_DECODER, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0
    )
    return transformers.MixtralForCausalLM(_eager(config))


def _t5() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        pad_token_id=0,
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(_eager(config))


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(_eager(config))


def _vit() -> nn.Module:
    config = transformers.ViTConfig(
        image_size=IMAGE_SIZE,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=NUM_LABELS,
    )
    return transformers.ViTForImageClassification(_eager(config))


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("llama", _llama, "causal"),
        Family("mistral", _mistral, "causal"),
        Family("gemma2", _gemma2, "causal"),
        Family("phi3", _phi3, "causal"),
        Family("gpt_neox", _gpt_neox, "causal"),
        Family("mixtral", _mixtral, "causal"),
        Family("t5", _t5, "seq2seq"),
        Family("bert", _bert, "masked"),
        Family("vit", _vit, "image"),
    )
}


class ZooRows(Dataset):
    """Random inputs of one family's kind (fixed seed), identical in every process."""

    def __init__(self, inputs: str, num_rows: int, *, seed: int = 1234) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = inputs
        if inputs == "image":
            shape = (num_rows, 3, IMAGE_SIZE, IMAGE_SIZE)
            self.pixel_values = torch.randn(shape, generator=generator)
            self.labels = torch.randint(0, NUM_LABELS, (num_rows,), generator=generator)
        else:
            # Token 0 is the pad token: keep it out so no position is masked anywhere.
            self.tokens = torch.randint(3, VOCAB, (num_rows, SEQ_LEN), generator=generator)
            self.targets = torch.randint(3, VOCAB, (num_rows, SEQ_LEN // 2), generator=generator)

    def __len__(self) -> int:
        return len(self.labels) if self.inputs == "image" else len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.inputs == "image":
            return {"pixel_values": self.pixel_values[index], "labels": self.labels[index]}
        if self.inputs == "seq2seq":
            return {"input_ids": self.tokens[index], "labels": self.targets[index]}
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def zoo_loader(family: str, num_rows: int, *, batch_size: int = 2) -> DataLoader:
    rows = ZooRows(FAMILIES[family].inputs, num_rows)
    return DataLoader(rows, batch_size=batch_size, shuffle=False)


class ZooModule(pl.LightningModule):
    """Trains one zoo family with its own HF loss; records every micro-batch's loss.

    Args:
        family: a key of ``FAMILIES``.
        build: ``"eager"`` (in ``__init__``, seeded) or ``"configure_model"``.
        lr: learning rate of SGD (momentum 0.9, weight decay 0.01 on every parameter).
            SGD, not AdamW, so that a final-weight comparison measures the gradients:
            Adam divides by sqrt(v) and turns round-off in an exactly-zero gradient
            (e.g. an attention key bias, which softmax ignores) into lr-sized steps.
        seed: the seed of the eager build.
    """

    def __init__(
        self, family: str, *, build: str = "eager", lr: float = 0.1, seed: int = 0
    ) -> None:
        super().__init__()
        self.family = FAMILIES[family]
        self.lr = lr
        self.model: nn.Module | None = None
        self.train_losses: list[float] = []
        if build == "eager":
            torch.manual_seed(seed)
            self.model = self.family.build()
        elif build != "configure_model":
            raise ValueError(f"build must be 'eager' or 'configure_model', got {build!r}")

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.family.build()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.train_losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=0.01)


class InitialWeights(pl.Callback):
    """Keeps the full weights and every buffer as they are when training starts.

    Reads them through the public API: the strategy's engine under yafsdp, the module
    itself otherwise.
    """

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weights = full_weights(trainer, pl_module)
        self.buffers = {k: v.detach().clone() for k, v in pl_module.named_buffers()}


def full_weights(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
    """The module's full state dict, gathered under yafsdp; plain CPU copies."""
    engine = getattr(trainer.strategy, "engine", None) if _is_yafsdp(trainer) else None
    state = engine.full_state_dict() if engine is not None else pl_module.state_dict()
    return {name: tensor.detach().cpu().clone() for name, tensor in state.items()}


def _is_yafsdp(trainer: pl.Trainer) -> bool:
    return type(trainer.strategy).__name__ == "YaFSDPStrategy"


# -- many fits in one spawn, without one crash hiding the others --------------------------


def dist_run_each(
    world_size: int, fn: Callable, keys: list[str], *args, timeout_s: float, alone_timeout_s: float
) -> dict[str, list[dict] | str]:
    """Runs ``fn(keys, *args)`` (which returns ``{key: facts}`` on each rank) in one call.

    All keys share one ``dist_run``: one set of ranks and one gloo group. A rank that dies
    (an abort, a hang) would take every key's result with it: then each key runs again in
    a call of its own, so that only the key that kills its ranks loses its facts.

    Returns:
        ``{key: [facts of rank 0, facts of rank 1, ...]}``, or ``{key: "what killed it"}``.
    """
    from tests.distributed import DistributedTimeoutError, RankFailedError, dist_run

    try:
        per_rank = dist_run(world_size, fn, keys, *args, timeout_s=timeout_s)
        return {key: [facts[key] for facts in per_rank] for key in keys}
    except (RankFailedError, DistributedTimeoutError):
        pass
    results: dict[str, list[dict] | str] = {}
    for key in keys:
        try:
            per_rank = dist_run(world_size, fn, [key], *args, timeout_s=alone_timeout_s)
            results[key] = [facts[key] for facts in per_rank]
        except (RankFailedError, DistributedTimeoutError) as err:
            results[key] = f"{type(err).__name__}: {err}"
    return results


def ranks_of(results: dict[str, list[dict] | str], key: str) -> list[dict]:
    """The per-rank facts of ``key``; fails the test if its ranks died."""
    facts = results[key]
    assert not isinstance(facts, str), f"{key}: its ranks died:\n{facts}"
    return facts
