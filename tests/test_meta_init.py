"""Meta-device initialization and pretrained weights under Trainer(strategy="yafsdp").

A model built in ``configure_model`` lands on the meta device; ``setup`` materializes it
one group at a time and must initialize it the way the model itself does (Hugging Face
models through their ``_init_weights``), identically on every rank, or refuse with an
error naming what nothing initializes. ``from_pretrained`` in ``configure_model`` starts
from exactly the saved weights; weights loaded under ``trainer.init_module()`` are kept;
``trainer.init_module(empty_init=True)`` builds on meta.

One ``dist_run`` on two CPU ranks fits every scenario (a few steps each) and returns
plain facts: the full weights right after setup, the losses, error messages.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.data import DataLoader

import lightning_yafsdp  # noqa: F401  (registers strategy="yafsdp")
from tests.distributed import dist_run

VOCAB = 128
SEQ = 8
STEPS = 3


def _llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip


def _gpt2_config() -> transformers.GPT2Config:
    return transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
        bos_token_id=0, eos_token_id=0, use_cache=False,
    )  # fmt: skip


def _bert_config() -> transformers.BertConfig:
    return transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip


FAMILIES = {
    "llama": (_llama_config, transformers.LlamaForCausalLM),
    "gpt2": (_gpt2_config, transformers.GPT2LMHeadModel),
    "bert": (_bert_config, transformers.BertForMaskedLM),
}


def _lora_config() -> peft.LoraConfig:
    return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])


def _eager(family: str) -> nn.Module:
    make_config, cls = FAMILIES[family]
    torch.manual_seed(0)
    return cls(make_config())


def _loader() -> DataLoader:
    tokens = torch.randint(
        0, VOCAB, (STEPS * 2 * 2, SEQ), generator=torch.Generator().manual_seed(1)
    )
    return DataLoader(tokens, batch_size=2)


class _TokenModule(pl.LightningModule):
    """Predict each token from the model's logits; records what the tests assert on.

    Args:
        build: ``"configure_model"`` (plain build there: meta), ``"pretrained"``
            (``from_pretrained(path)`` in configure_model), ``"given"`` (``model`` is passed
            in, built by the caller, e.g. under ``trainer.init_module()``).
    """

    def __init__(self, family: str, *, build: str, path: str | None = None, model=None) -> None:
        super().__init__()
        self.family, self.build, self.path = family, build, path
        self.model = model
        self.losses: list[float] = []
        self.initial: dict[str, torch.Tensor] = {}
        self.built_on_meta: bool | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        make_config, cls = FAMILIES[self.family]
        if self.build == "pretrained":
            self.model = cls.from_pretrained(self.path)
        elif self.build == "lora":
            self.model = peft.get_peft_model(cls.from_pretrained(self.path), _lora_config())
        else:
            self.model = cls(make_config())
        self.built_on_meta = all(t.is_meta for t in self.model.state_dict().values())

    def on_fit_start(self) -> None:
        engine = self.trainer.strategy.engine
        state = engine.full_state_dict()
        self.initial = {name.removeprefix("model."): t.clone() for name, t in state.items()}
        for name, buffer in self.model.named_buffers():
            self.initial.setdefault(name, buffer.detach().clone())

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(input_ids=tokens).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _Scale(nn.Module):
    """Nothing initializes its parameter or its non-persistent buffer on the meta device.

    No reset_parameters, not a Hugging Face module: built for real, both are fine.
    """

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))
        self.register_buffer("offsets", torch.arange(width), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain + self.offsets


class _UninitializedModule(pl.LightningModule):
    def configure_model(self) -> None:
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.scale = _Scale(8)

    def training_step(self, batch, batch_idx):
        return self.scale(self.blocks(batch.float())).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer() -> pl.Trainer:
    return pl.Trainer(
        strategy="yafsdp", accelerator="cpu", devices=2, precision="32-true",
        max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip


def _fit(module: pl.LightningModule, trainer: pl.Trainer | None = None) -> dict:
    trainer = trainer or _trainer()
    trainer.fit(module, _loader())
    return {"initial": module.initial, "losses": module.losses, "meta": module.built_on_meta}


def _runs(saved_dir: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    pl.seed_everything(7 + torch.distributed.get_rank())  # ranks seeded differently on purpose
    runs = {f: _fit(_TokenModule(f, build="configure_model")) for f in FAMILIES}
    runs["pretrained"] = _fit(_TokenModule("llama", build="pretrained", path=saved_dir))
    runs["lora"] = _fit(_TokenModule("llama", build="lora", path=saved_dir))

    trainer = _trainer()
    with trainer.init_module():
        model = transformers.LlamaForCausalLM(_llama_config())
        model.load_state_dict(torch.load(f"{saved_dir}/state.pt"))
    runs["init_module"] = _fit(_TokenModule("llama", build="given", model=model), trainer)

    trainer = _trainer()
    with trainer.init_module(empty_init=True):
        model = transformers.LlamaForCausalLM(_llama_config())
    on_meta = all(p.is_meta for p in model.parameters())
    runs["empty_init"] = _fit(_TokenModule("llama", build="given", model=model), trainer)
    runs["empty_init"]["meta"] = on_meta

    runs["world_size_1_vs_2"] = _shard_at_world_sizes_1_and_2()
    runs["core_without_model_init"] = _core_shard_without_model_init()
    try:
        _trainer().fit(_UninitializedModule(), DataLoader(torch.ones(4, 8), batch_size=2))
        runs["uninitialized_error"] = None
    except RuntimeError as error:
        runs["uninitialized_error"] = str(error)
    return runs


def _shard_at_world_sizes_1_and_2() -> dict:
    """Full initial weights of one meta model sharded over both ranks and over rank 0 alone.

    The ranks' generators are seeded differently; rank 0's is in the same state for both.
    Each rank initializes its own shard, so the two-rank weights equal the one-rank ones
    only if every rank initialized every group exactly as rank 0 did.
    """
    from lightning_yafsdp.core import shard_model
    from lightning_yafsdp.hf_init import hf_model_init

    rank = torch.distributed.get_rank()
    rank0_alone = torch.distributed.new_group([0])
    torch.manual_seed(100 + rank)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_llama_config())
    both = shard_model(model, model_init=hf_model_init).full_state_dict()
    if rank != 0:
        return {}
    torch.manual_seed(100)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_llama_config())
    alone = shard_model(
        model, process_group=rank0_alone, model_init=hf_model_init
    ).full_state_dict()
    return {"both": both, "alone": alone}


def _core_shard_without_model_init() -> str | None:
    """The torch-only core on a meta HF model, without the Hugging Face init plugged in."""
    from lightning_yafsdp.core import shard_model

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_llama_config())
    try:
        shard_model(model)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """A tiny Llama saved with save_pretrained (and its state dict, for init_module)."""
    directory = tmp_path_factory.mktemp("saved_llama")
    torch.manual_seed(123)
    model = transformers.LlamaForCausalLM(_llama_config())
    with torch.no_grad():  # unmistakable values: no init scheme produces these
        for param in model.parameters():
            param.add_(torch.rand_like(param))
    model.save_pretrained(directory)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(state, directory / "state.pt")
    return str(directory), state


@pytest.fixture(scope="module")
def runs(saved_llama) -> list[dict]:
    return dist_run(2, _runs, saved_llama[0], timeout_s=240)


def _assert_like_eager(initial: dict[str, torch.Tensor], eager: nn.Module) -> None:
    """Per tensor: constants (norm weights, biases, buffers) exact, random ones by statistics."""
    expected = {**dict(eager.named_buffers()), **eager.state_dict()}
    assert set(expected) <= set(initial), sorted(set(expected) - set(initial))
    for name, want in expected.items():
        got = initial[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        if not want.is_floating_point() or want.numel() < 2 or torch.all(want == want.flatten()[0]):
            assert torch.equal(got, want), f"{name}: must equal the eager build exactly"
            continue
        if "inv_freq" in name:
            assert torch.equal(got, want), f"{name}: a rotary buffer must equal eager's"
            continue
        n = want.numel()
        # Both are draws from the same distribution: their std agree within a few
        # standard errors (std of a std estimate: std / sqrt(2n); of a mean: std / sqrt(n)).
        std = want.std().item()
        assert abs(got.std().item() - std) < 6 * std * math.sqrt(2 / (2 * n)) + 1e-6, name
        assert abs(got.mean().item() - want.mean().item()) < 6 * std * math.sqrt(2 / n), name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_model_built_in_configure_model_is_initialized_like_eager(runs, family):
    _assert_like_eager(runs[0][family]["initial"], _eager(family))
    assert runs[0][family]["meta"], "configure_model builds on the meta device"


def test_meta_initialization_is_identical_on_every_rank(runs):
    both, alone = runs[0]["world_size_1_vs_2"]["both"], runs[0]["world_size_1_vs_2"]["alone"]
    assert both.keys() == alone.keys()
    differ = [k for k in both if not torch.equal(both[k], alone[k])]
    assert not differ, f"rank 1 initialized its shards differently from rank 0: {differ[:3]}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_meta_initialized_model_trains_with_finite_losses(runs, family):
    losses = runs[0][family]["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert abs(losses[0] - math.log(VOCAB)) < 0.5, "an initialized LM starts near ln(vocab)"


def test_from_pretrained_in_configure_model_starts_from_saved_weights(runs, saved_llama):
    _, saved = saved_llama
    for rank in runs:
        run = rank["pretrained"]
        assert run["meta"], "from_pretrained in configure_model must not load every tensor"
        for name, tensor in saved.items():
            assert torch.equal(run["initial"][name], tensor), name
        assert all(math.isfinite(x) for x in run["losses"])


def test_lora_on_from_pretrained_in_configure_model_matches_an_eager_build(runs, saved_llama):
    path, _ = saved_llama
    torch.manual_seed(0)
    eager = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(path), _lora_config())
    run = runs[0]["lora"]
    assert run["meta"], "from_pretrained + get_peft_model in configure_model stays on meta"
    base = {k: v for k, v in eager.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(run["initial"][k], v) for k, v in base.items()), "base not as saved"
    # lora_B exactly zero (the adapter starts as a no-op), lora_A by statistics (kaiming).
    _assert_like_eager(run["initial"], eager)
    assert all(math.isfinite(x) for x in run["losses"])


def test_weights_loaded_under_init_module_are_never_reinitialized(runs, saved_llama):
    _, saved = saved_llama
    for rank in runs:
        for name, tensor in saved.items():
            assert torch.equal(rank["init_module"]["initial"][name], tensor), name


def test_init_module_empty_init_builds_on_meta_and_initializes_like_eager(runs):
    run = runs[0]["empty_init"]
    assert run["meta"], "init_module(empty_init=True) builds on the meta device"
    _assert_like_eager(run["initial"], _eager("llama"))
    rank1 = runs[1]["empty_init"]["initial"]
    assert all(torch.equal(run["initial"][k], rank1[k]) for k in rank1)


def test_tensors_nobody_initializes_stop_sharding_with_their_names(runs):
    for rank in runs:
        message = rank["uninitialized_error"]
        assert message is not None, "sharding must refuse an uninitialized parameter"
        assert "scale.gain" in message and "_Scale has no reset_parameters()" in message
        assert "scale.offsets" in message and "non-persistent buffer" in message
        assert "init_submodule" in message and "param_init_fn=" in message
        assert "blocks" not in message.split("Fix")[0], "initialized tensors are not named"


def test_the_core_alone_refuses_a_meta_hf_model_and_names_the_hf_init(runs):
    # The core knows no model library: without model_init= a Hugging Face norm (no
    # reset_parameters()) stays NaN, and the init guard names the adapter that knows.
    for rank in runs:
        message = rank["core_without_model_init"]
        assert message is not None, "an uninitialized HF norm must stop sharding"
        assert "LlamaRMSNorm has no reset_parameters()" in message
        assert "model_init=lightning_yafsdp.hf_init.hf_model_init" in message
