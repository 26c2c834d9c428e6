"""Grouped blocks ([Note: grouped blocks]): consecutive small blocks as one unit.

What a user sees: ``strategy="yafsdp"`` on a model of many small blocks gathers and
reduces them in groups (``blocks_per_unit="auto"``), and trains exactly as
``strategy="ddp"`` does (per-step losses and final weights, ``32-true``), built eagerly
and in ``configure_model``, with activation checkpointing, ZeRO-2, accumulation, a block
skipped in some steps, and a Hugging Face model; the plan (and so ``yafsdp estimate``)
picks the same units as the engine; large blocks and units named by ``units=`` stay as
they are.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_yafsdp.core.plan.grouping import auto_blocks_per_unit
from lightning_yafsdp.core.plan.sharding import plan_layouts
from lightning_yafsdp.models.llama import Llama, LlamaConfig
from tests.distributed import dist_run
from tests.parity_fits import fit, loss_error, weights_error

# [Tolerance] 32-true: the same fp32 ops on the same full weights as DDP; only the order
# of the gradient sums differs. Measured here: losses <= 2.4e-7, weights <= 3.6e-7 (SGD).
_PARITY_RTOL = 2e-6


def _small_llama(n_layers: int = 8) -> Llama:
    return Llama(
        LlamaConfig(vocab_size=64, dim=32, n_layers=n_layers, n_heads=4, ffn_hidden_dim=64)
    )


def _loss(model: nn.Module, batch: dict) -> torch.Tensor:
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _rows(count: int) -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    return [{"tokens": torch.randint(0, 64, (9,), generator=gen)} for _ in range(count)]


def _unit_names(model: nn.Module, **options) -> list[str]:
    return [name for name, _ in plan_layouts(model, world_size=2, **options).units]


# -- the plan -------------------------------------------------------------------------------


def test_auto_groups_small_blocks_in_pairs_and_keeps_four_units_of_blocks():
    with torch.device("meta"):
        names = _unit_names(_small_llama(8))
    blocks = [n for n in names if n.startswith("layers")]
    assert blocks == ["layers.0-1", "layers.2-3", "layers.4-5", "layers.6-7"]


def test_auto_keeps_blocks_of_four_million_elements_one_per_unit():
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("llama-1b"))
    blocks = [n for n in _unit_names(model) if n.startswith("layers")]
    assert blocks == [f"layers.{i}" for i in range(16)]
    assert auto_blocks_per_unit([4 * 2**20] * 64) == 1
    assert auto_blocks_per_unit([2**20] * 64) == 4
    assert auto_blocks_per_unit([2**20] * 6) == 1  # 4 units of blocks at least
    # A group never holds more than 4M elements: debug-50m's 3.1M blocks stay single.
    assert auto_blocks_per_unit([3 * 2**20] * 16) == 1
    assert auto_blocks_per_unit([2**20 + 1] * 64) == 3


def test_a_number_groups_that_many_in_near_equal_groups():
    with torch.device("meta"):
        names = _unit_names(_small_llama(8), blocks_per_unit=3)
    assert [n for n in names if n.startswith("layers")] == [
        "layers.0-2",
        "layers.3-5",
        "layers.6-7",
    ]


def test_units_named_by_the_user_stay_as_named_unless_a_number_is_given():
    from lightning_yafsdp.models.llama import TransformerBlock

    with torch.device("meta"):
        model = _small_llama(8)
        named = _unit_names(model, units=TransformerBlock)
        grouped = _unit_names(model, units=TransformerBlock, blocks_per_unit=4)
    assert [n for n in named if n.startswith("layers")] == [f"layers.{i}" for i in range(8)]
    assert [n for n in grouped if n.startswith("layers")] == ["layers.0-3", "layers.4-7"]


@pytest.mark.parametrize("bad", [0, -1, "two", 1.5, True])
def test_a_bad_blocks_per_unit_is_refused_in_one_line(bad):
    from lightning_yafsdp import YaFSDPStrategy

    with pytest.raises((ValueError, TypeError), match="blocks_per_unit") as info:
        YaFSDPStrategy(blocks_per_unit=bad)
    assert "\n" not in str(info.value)


# -- training against DDP ---------------------------------------------------------------------


class _SkipsABlock(nn.Module):
    """Block 5 runs on odd steps only (the same draw on every rank, as a seeded LayerDrop)."""

    def __init__(self) -> None:
        super().__init__()
        self.llama = _small_llama(8)
        self.calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        llama, self.calls = self.llama, self.calls + 1
        h = llama.tok_embeddings(tokens)
        cos, sin = llama.rope(tokens.shape[1], h.dtype)
        for index, layer in enumerate(llama.layers):
            if index != 5 or self.calls % 2:
                h = layer(h, cos, sin)
        return llama.output(llama.norm(h))


def _parity(world_size: int, case: str) -> dict:
    from lightning_yafsdp import YaFSDPStrategy

    options: dict = {}
    build, reference = _small_llama, "ddp"
    if case == "meta":
        return _meta_parity(world_size)
    if case == "uneven-checkpointed":
        options = {"blocks_per_unit": 3, "activation_checkpointing": "all"}
    if case == "zero2":
        options = {"zero_stage": 2}
    if case == "skips-a-block":
        build, reference = _SkipsABlock, "ddp_find_unused_parameters_true"
    rows = _rows(8 * world_size)
    ours = fit(YaFSDPStrategy(**options), build, _loss, rows, world_size=world_size, steps=4)
    theirs = fit(reference, build, _loss, rows, world_size=world_size, steps=4)
    return {"yafsdp": ours, "ddp": theirs}


def _meta_parity(world_size: int) -> dict:
    """Built in ``configure_model`` (meta device under yafsdp); DDP starts from the weights
    the meta build initialized, built eagerly."""
    rows = _rows(8 * world_size)
    ours = fit("yafsdp", _small_llama, _loss, rows, eager=False, world_size=world_size, steps=4)
    assert ours["error"] is None, ours["error"]
    start = {name.removeprefix("model."): w for name, w in ours["initial"].items()}

    def same_start() -> nn.Module:
        model = _small_llama()
        model.load_state_dict(start)
        return model

    theirs = fit("ddp", same_start, _loss, rows, world_size=world_size, steps=4)
    return {"yafsdp": ours, "ddp": theirs}


@pytest.mark.parametrize(
    ("world_size", "case"),
    [(2, "eager"), (3, "meta"), (2, "uneven-checkpointed"), (2, "zero2"), (2, "skips-a-block")],
)
def test_grouped_blocks_train_like_ddp(world_size, case):
    if case == "skips-a-block":
        pytest.importorskip("lightning")  # the reference strategy is Lightning's own
    runs = dist_run(world_size, _parity, world_size, case, timeout_s=300)
    for rank, run in enumerate(runs):
        losses = loss_error(run["yafsdp"], run["ddp"])
        weights, where = weights_error(run["yafsdp"], run["ddp"])
        assert losses <= _PARITY_RTOL, (rank, losses)
        assert weights <= _PARITY_RTOL, f"rank {rank}: {where} off by {weights:.3g}"
    units = runs[0]["yafsdp"]["units"]
    assert any("-" in name for name in units), units  # the blocks were grouped


def _attention_calls_per_block(activation_checkpointing) -> list[int]:
    from lightning_yafsdp.core import shard_model

    torch.manual_seed(0)
    model = _small_llama(4)
    engine = shard_model(
        model, blocks_per_unit=2, activation_checkpointing=activation_checkpointing
    )
    calls = [0] * len(model.layers)
    for index, layer in enumerate(model.layers):
        layer.attention.register_forward_pre_hook(
            lambda *_, index=index: calls.__setitem__(index, calls[index] + 1)
        )
    tokens = torch.randint(0, 64, (2, 9))
    _loss(model, {"tokens": tokens}).backward()
    assert [unit.name for unit in engine.units if unit.is_block] == ["layers.0-1", "layers.2-3"]
    return calls


def test_checkpointing_a_unit_of_grouped_blocks_recomputes_every_block():
    (calls,) = dist_run(1, _attention_calls_per_block, "all", timeout_s=120)
    assert calls == [2, 2, 2, 2]  # forward, then recomputation in backward
    (calls,) = dist_run(1, _attention_calls_per_block, None, timeout_s=120)
    assert calls == [1, 1, 1, 1]


def _hf_llama_checkpointed() -> nn.Module:
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    config = HFConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable()  # HF's own (non-reentrant) checkpointing
    return model


def _hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(input_ids=batch["tokens"], labels=batch["tokens"]).loss


def _hf_parity(world_size: int) -> dict:
    rows = _rows(8 * world_size)
    runs = {}
    for strategy in ("yafsdp", "ddp"):
        runs[strategy] = fit(
            strategy, _hf_llama_checkpointed, _hf_loss, rows, world_size=world_size, steps=3
        )
    return runs


def test_a_hugging_face_model_with_its_own_checkpointing_trains_like_ddp_when_grouped():
    pytest.importorskip("transformers")
    runs = dist_run(2, _hf_parity, 2, timeout_s=300)
    for rank, run in enumerate(runs):
        assert loss_error(run["yafsdp"], run["ddp"]) <= _PARITY_RTOL, rank
        weights, where = weights_error(run["yafsdp"], run["ddp"])
        assert weights <= _PARITY_RTOL, f"rank {rank}: {where} off by {weights:.3g}"
    assert "model.model.layers.0-1" in runs[0]["yafsdp"]["units"], runs[0]["yafsdp"]["units"]


def _checkpointed_by_class() -> list[int]:
    from lightning_yafsdp.core import shard_model
    from lightning_yafsdp.models.llama import TransformerBlock

    torch.manual_seed(0)
    model = _small_llama(4)
    shard_model(model, blocks_per_unit=2, activation_checkpointing=TransformerBlock)
    calls = [0] * len(model.layers)
    for index, layer in enumerate(model.layers):
        layer.attention.register_forward_pre_hook(
            lambda *_, index=index: calls.__setitem__(index, calls[index] + 1)
        )
    _loss(model, {"tokens": torch.randint(0, 64, (2, 9))}).backward()
    return calls


def test_checkpointing_named_by_block_class_selects_units_of_grouped_blocks():
    """FSDPStrategy's form, ``activation_checkpointing=TransformerBlock``: a unit named
    ``layers.0-1`` is no module path, so the class is matched on the unit's blocks."""
    (calls,) = dist_run(1, _checkpointed_by_class, timeout_s=120)
    assert calls == [2, 2, 2, 2]


class _Mix(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class _Gate(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.fc(x))


class _Hybrid(nn.Module):
    """Blocks of two alternating classes (as Jamba's Mamba and attention layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Mix() if i % 2 else _Gate() for i in range(8)])
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def test_blocks_of_alternating_classes_are_grouped_in_module_order():
    with torch.device("meta"):
        names = _unit_names(_Hybrid(), blocks_per_unit=2)
    assert [n for n in names if n.startswith("layers")] == [
        "layers.0-1", "layers.2-3", "layers.4-5", "layers.6-7",
    ]  # fmt: skip


def _checkpointed_members_of_mixed_units() -> list[bool]:
    from lightning_yafsdp.core import shard_model

    model = _Hybrid()
    shard_model(model, blocks_per_unit=2, activation_checkpointing=_Mix)
    return [layer.forward.__name__ == "checkpointed_forward" for layer in model.layers]


def test_checkpointing_by_class_recomputes_the_matching_blocks_of_a_mixed_unit():
    (wrapped,) = dist_run(1, _checkpointed_members_of_mixed_units, timeout_s=120)
    assert wrapped == [False, True] * 4
