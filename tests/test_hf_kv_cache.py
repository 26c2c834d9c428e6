"""Hugging Face causal LMs under ``activation_checkpointing``: no KV cache while training.

Every HF causal LM config defaults to ``use_cache=True``: each block appends its keys and
values to a cache. A checkpointed block runs its forward again in backward and appends
them a second time, so the recomputed attention sees twice the keys (a shape error under
a padding mask). The strategies set ``config.use_cache=False`` with a warning, as Hugging
Face's own activation checkpointing does while training
([Note: no KV cache under activation checkpointing], ``adapters/sharding.py``).

Through ``Trainer(strategy=YaFSDPStrategy(activation_checkpointing="all"))`` at 2 ranks
against ``strategy="ddp"`` on the same model with HF's own
``activation_checkpointing_enable()`` (``gradient_checkpointing_enable()`` before
transformers 5), ``32-true``, per-step losses and final weights (``tests/parity_fits.py``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.distributed import dist_run
from tests.parity_fits import fit, loss_error, weights_error

# [Tolerance] 32-true under yafsdp runs DDP's fp32 ops on the same full weights; only the
# order of the gradient sums differs. Measured here: losses 0.0, weights <= 2.6e-7 (OPT).
_PARITY_RTOL = 2e-6
_VOCAB = 64
_FAMILIES = ("gpt2", "llama", "qwen2", "mistral", "gpt_neox", "opt")


def _config(family: str):
    import transformers

    small = dict(vocab_size=_VOCAB, num_hidden_layers=2, hidden_size=32, num_attention_heads=2)
    if family == "gpt2":
        return transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=_VOCAB, n_positions=16,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    if family in ("llama", "qwen2", "mistral", "gpt_neox"):
        config_class = transformers.AutoConfig.for_model(family).__class__
        return config_class(
            **small, num_key_value_heads=2, intermediate_size=64, max_position_embeddings=16
        )
    return transformers.OPTConfig(
        **small, ffn_dim=64, max_position_embeddings=16, word_embed_proj_dim=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=1,
    )  # fmt: skip


class _Build:
    """A picklable factory: the family's tiny causal LM, HF checkpointing on or off."""

    def __init__(self, family: str, *, hf_checkpointing: bool) -> None:
        self.family, self.hf_checkpointing = family, hf_checkpointing

    def __call__(self):
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(_config(self.family))
        assert model.config.use_cache  # the default this file is about
        if self.hf_checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
        return model


def _loss(model, batch: dict) -> torch.Tensor:
    return model(input_ids=batch["ids"], attention_mask=batch["mask"], labels=batch["ids"]).loss


def _rows(count: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    # Left padding of 0-2 tokens: a padding mask, under which a doubled cache cannot run.
    return [
        {
            "ids": torch.randint(2, _VOCAB, (8,), generator=gen),
            "mask": torch.tensor([0] * (i % 3) + [1] * (8 - i % 3)),
        }
        for i in range(count)
    ]


def _runs(families: tuple[str, ...]) -> dict:
    import lightning_yafsdp

    runs = {}
    for family in families:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = fit(
                lightning_yafsdp.YaFSDPStrategy(activation_checkpointing="all"),
                _Build(family, hf_checkpointing=False), _loss, _rows(8), world_size=2, steps=3,
            )  # fmt: skip
        if ours["error"] is not None:  # a rank may be left in a collective: stop here
            runs[family] = {"yafsdp": ours, "ddp": None, "warned": []}
            break
        ddp = fit(
            "ddp", _Build(family, hf_checkpointing=True), _loss, _rows(8), world_size=2, steps=3
        )
        warned = [str(w.message) for w in caught if "use_cache" in str(w.message)]
        runs[family] = {"yafsdp": ours, "ddp": ddp, "warned": warned}
    return runs


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    pytest.importorskip("transformers")
    return dist_run(2, _runs, _FAMILIES, timeout_s=180)


@pytest.mark.slow
@pytest.mark.parametrize("family", _FAMILIES)
def test_a_cached_causal_lm_trains_under_activation_checkpointing_like_ddp(runs, family):
    for rank, run in enumerate(runs):
        facts = run.get(family)
        assert facts is not None, f"rank {rank}: not run, an earlier family failed"
        assert facts["yafsdp"]["error"] is None, facts["yafsdp"]["error"]
        losses = loss_error(facts["yafsdp"], facts["ddp"])
        weights, where = weights_error(facts["yafsdp"], facts["ddp"])
        assert losses <= _PARITY_RTOL, (rank, losses, facts["yafsdp"]["losses"])
        assert weights <= _PARITY_RTOL, f"rank {rank}: {where} off by {weights:.3g}"


@pytest.mark.slow
def test_turning_the_cache_off_is_said_once_on_rank_zero(runs):
    warned = runs[0]["gpt2"]["warned"]
    assert len(warned) == 1, warned
    assert "GPT2LMHeadModel" in warned[0] and "config.use_cache is now False" in warned[0]
    assert "\n" not in warned[0]
    assert runs[1]["gpt2"]["warned"] == []


def _warnings_of_train_without_kv_cache(model) -> list[str]:
    from lightning_yafsdp.adapters.sharding import train_without_kv_cache

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_without_kv_cache(model)
    return [str(w.message) for w in caught if "use_cache" in str(w.message)]


def test_models_without_a_cache_setting_are_left_alone():
    """ViT's config has no ``use_cache``: nothing to turn off, no warning, no error."""
    import transformers

    config = transformers.ViTConfig(
        image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32,
    )  # fmt: skip
    model = transformers.ViTModel(config)
    assert _warnings_of_train_without_kv_cache(model) == []
    assert not hasattr(model.config, "use_cache")


def test_an_encoder_decoder_gets_one_warning_naming_the_model():
    """T5's encoder and decoder hold copies of the config: both caches go, one warning."""
    import transformers

    config = transformers.T5Config(
        vocab_size=_VOCAB, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8
    )
    model = transformers.T5ForConditionalGeneration(config)
    found = _warnings_of_train_without_kv_cache(model)
    assert len(found) == 1, found
    assert not any(
        getattr(m.config, "use_cache", False)
        for m in model.modules()
        if isinstance(m, transformers.PreTrainedModel)
    )
