"""Weights loaded onto a meta build: ``trainer.init_module(empty_init=True)`` + ``assign=True``.

Lightning's documented way to load a checkpoint without initializing: build under
``trainer.init_module(empty_init=True)`` (the meta device under yafsdp, uninitialized real
memory under DDP), then ``model.load_state_dict(state, assign=True)``. Every parameter is
then real, but non-persistent buffers (Llama's rotary ``inv_freq``, BERT's ``position_ids``
and ``token_type_ids``) are in no state dict and stay on the meta device. They must be
re-derived as the model derives them, without touching a loaded weight, and training must
equal DDP's ([Note: meta buffers beside loaded parameters] in core/plan/materialize.py). What
cannot be re-derived, and a half-loaded model, are refused before the first step.

One ``dist_run`` on two CPU ranks does every fit and returns plain facts.
"""

from __future__ import annotations

import traceback

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.data import DataLoader

import lightning_yafsdp  # noqa: F401  (registers strategy="yafsdp")
from tests.distributed import dist_run
from tests.zoo_models import FAMILIES, VOCAB, InitialWeights, full_weights

LOADED_FAMILIES = ("llama", "bert")  # rotary inv_freq; position_ids and token_type_ids
STEPS = 3
SEQ = 8


class _EncoderLM(nn.Module):
    """A BERT encoder with a plain token head (BertForMaskedLM's head ties a bias to the
    decoder's, a tie ``assign=True`` breaks, leaving a parameter nothing uses)."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(input_ids=tokens).last_hidden_state)


def _bert_encoder() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return _EncoderLM(transformers.BertModel(config, add_pooling_layer=False))


BUILDS = {"llama": FAMILIES["llama"].build, "bert": _bert_encoder}


class _LoadedModule(pl.LightningModule):
    """Next-token loss of one family's model, built in ``__init__`` (seeded)."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.family = family
        torch.manual_seed(5)
        self.model = BUILDS[family]()
        self.losses: list[float] = []

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.family == "llama":
            loss = self.model(input_ids=tokens, labels=tokens).loss
        else:  # a BERT encoder and its token head
            logits = self.model(tokens)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens.reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def _trainer(strategy: str, callbacks=()) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, precision="32-true",
        max_steps=STEPS, callbacks=list(callbacks), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip


def _tokens() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    return DataLoader(
        torch.randint(2, VOCAB, (STEPS * 2 * 2, SEQ), generator=generator), batch_size=2
    )


def _saved_state(family: str) -> dict[str, torch.Tensor]:
    """An eager build's state dict, moved off any init scheme's values."""
    torch.manual_seed(0)
    model = BUILDS[family]()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.rand_like(param) * 0.1)
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _loaded_fit(family: str, strategy: str) -> dict:
    state = _saved_state(family)
    initial = InitialWeights()
    trainer = _trainer(strategy, [initial])
    with trainer.init_module(empty_init=True):
        module = _LoadedModule(family)
    # assign=True hands these very tensors to the model: compare against copies.
    saved = {"model." + name: tensor.clone() for name, tensor in state.items()}
    module.model.load_state_dict(state, assign=True)
    on_meta = sorted(name for name, b in module.model.named_buffers() if b.is_meta)
    trainer.fit(module, _tokens())
    return {
        "state": saved,
        "meta_buffers_after_load": on_meta,
        "initial": initial.weights,
        "buffers": initial.buffers,
        "losses": module.losses,
        "final": full_weights(trainer, module),
    }


class _Offsets(nn.Module):
    """A non-persistent buffer nothing but ``__init__`` computes (no reset_parameters)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))
        self.register_buffer("offsets", torch.arange(width), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain + self.offsets


class _OffsetsModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.scale = _Offsets(8)

    def training_step(self, batch, batch_idx):
        return self.scale(self.blocks(batch)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _refusal(load) -> str | None:
    """The error of fitting an _OffsetsModule built on meta and loaded by ``load``."""
    trainer = _trainer("yafsdp")
    with trainer.init_module(empty_init=True):
        module = _OffsetsModule()
    torch.manual_seed(0)
    load(module, _OffsetsModule().state_dict())
    try:
        trainer.fit(module, DataLoader(torch.ones(8, 8), batch_size=2))
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _load_all(module: nn.Module, state: dict) -> None:
    module.load_state_dict(state, assign=True)


def _load_blocks_only(module: nn.Module, state: dict) -> None:
    blocks = {name: tensor for name, tensor in state.items() if name.startswith("blocks.")}
    module.load_state_dict(blocks, assign=True, strict=False)


def _runs() -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    runs = {}
    for family in LOADED_FAMILIES:
        for strategy in ("ddp", "yafsdp"):
            try:
                runs[(family, strategy)] = _loaded_fit(family, strategy)
            except Exception:  # noqa: BLE001 - reported by the test of this run
                runs[(family, strategy)] = {"error": traceback.format_exc()}
    runs["underivable_buffer"] = _refusal(_load_all)
    runs["half_loaded"] = _refusal(_load_blocks_only)
    return runs


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return dist_run(2, _runs, timeout_s=240)


def _succeeded(run: dict) -> dict:
    assert "error" not in run, run["error"]
    return run


def _max_relative_error(actual: dict, expected: dict) -> float:
    assert sorted(actual) == sorted(expected)
    worst = 0.0
    for name, reference in expected.items():
        if not reference.is_floating_point():
            assert torch.equal(actual[name], reference), name
            continue
        scale = max(reference.abs().max().item(), 1e-3)
        worst = max(worst, (actual[name] - reference).abs().max().item() / scale)
    return worst


@pytest.mark.parametrize("family", LOADED_FAMILIES)
def test_loaded_weights_start_training_exactly_as_saved(runs, family):
    for rank_runs in runs:
        run = _succeeded(rank_runs[(family, "yafsdp")])
        assert run["meta_buffers_after_load"], "the scenario must leave meta buffers"
        assert run["initial"].keys() == run["state"].keys()
        for name, saved in run["state"].items():
            assert torch.equal(run["initial"][name], saved), f"{name} changed before step 1"


@pytest.mark.parametrize("family", LOADED_FAMILIES)
def test_meta_buffers_are_re_derived_as_the_eager_build_computes_them(runs, family):
    for rank_runs in runs:
        ours = _succeeded(rank_runs[(family, "yafsdp")])
        ddp = _succeeded(rank_runs[(family, "ddp")])
        for name in ours["meta_buffers_after_load"]:
            got, want = ours["buffers"]["model." + name], ddp["buffers"]["model." + name]
            assert torch.equal(got, want), name


@pytest.mark.parametrize("family", LOADED_FAMILIES)
def test_trains_like_ddp_in_losses_and_final_weights(runs, family):
    for rank_runs in runs:
        ours = _succeeded(rank_runs[(family, "yafsdp")])
        ddp = _succeeded(rank_runs[(family, "ddp")])
        assert len(ours["losses"]) == len(ddp["losses"]) == STEPS
        torch.testing.assert_close(ours["losses"], ddp["losses"], rtol=1e-6, atol=0)
        assert _max_relative_error(ours["final"], ddp["final"]) < 1e-6


def test_a_buffer_nothing_re_derives_is_refused_naming_it_and_the_fix(runs):
    for rank_runs in runs:
        error = rank_runs["underivable_buffer"]
        assert error is not None, "trained with a buffer holding no value"
        assert "scale.offsets" in error and "_Offsets" in error, error
        assert "non-persistent buffer" in error, error
        assert "register_buffer" in error and "empty_init=True" in error, error


def test_a_half_loaded_model_keeps_the_mixed_parameters_error(runs):
    for rank_runs in runs:
        error = rank_runs["half_loaded"]
        assert error is not None and error.startswith("ValueError"), error
        assert "mixes parameters built on the meta device" in error, error
        assert "scale.gain" in error and "blocks.0.weight" in error, error
        assert "load all of them" in error, error
