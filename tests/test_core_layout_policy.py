"""Flat layout arithmetic and the unit / norm policy (pure, no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_yafsdp.core import FlatLayout, find_units, is_norm_module
from lightning_yafsdp.core.runtime.layout import PARAM_ALIGN_ELEMENTS
from lightning_yafsdp.models.llama import Llama, LlamaConfig, RMSNorm, TransformerBlock


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_shards_are_equal_contiguous_and_cover_every_parameter(world_size: int) -> None:
    shapes = [torch.Size([5, 3]), torch.Size([7]), torch.Size([2, 2, 2])]
    layout = FlatLayout(["a", "b", "c"], shapes, world_size)
    assert layout.padded_numel % world_size == 0
    assert layout.shard_numel * world_size == layout.padded_numel
    ranges = [layout.shard_range(r) for r in range(world_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    for index, span in enumerate(layout.spans):
        assert span.offset % PARAM_ALIGN_ELEMENTS == 0
        owned = [layout.shard_slice(index, r) for r in range(world_size)]
        pieces = sorted((p.param_start, p.param_end) for p in owned if p is not None)
        assert pieces[0][0] == 0 and pieces[-1][1] == span.numel
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))


def test_padding_ranges_are_the_complement_of_the_parameters() -> None:
    layout = FlatLayout(["a", "b"], [torch.Size([3]), torch.Size([5])], 3)
    covered = [(s.offset, s.end) for s in layout.spans] + layout.padding_ranges()
    covered.sort()
    assert covered[0][0] == 0 and covered[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))


def test_auto_detects_the_repeated_blocks_of_the_reference_llama() -> None:
    model = Llama(LlamaConfig.from_name("tiny", n_layers=3))
    units = find_units(model)
    assert [name for name, _ in units] == ["layers.0", "layers.1", "layers.2"]


def test_auto_detects_hugging_face_decoder_layers() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    assert [name for name, _ in find_units(model)] == ["model.layers.0", "model.layers.1"]
    norm = model.model.norm
    assert type(norm).__name__ == "LlamaRMSNorm" and is_norm_module(norm)


def test_auto_detects_every_block_stack_of_an_encoder_decoder() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_ff=32, d_kv=8, num_heads=2, num_layers=2
    )
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(config)
    assert [name for name, _ in find_units(model)] == [
        "encoder.block.0",
        "encoder.block.1",
        "decoder.block.0",
        "decoder.block.1",
    ]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)


class _SiblingBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 8)
        self.block1, self.block2, self.block3 = _Block(), _Block(), _Block()
        self.head = nn.Linear(8, 2)


class _RootLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)


def test_auto_detects_blocks_without_a_container() -> None:
    assert [name for name, _ in find_units(_SiblingBlocks())] == ["block1", "block2", "block3"]
    assert [name for name, _ in find_units(_RootLinears())] == ["fc1", "fc2"]
    wrapped = nn.Module()  # a LightningModule holding self.model
    wrapped.model = _RootLinears()
    assert [name for name, _ in find_units(wrapped)] == ["model.fc1", "model.fc2"]
    stack = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 2)
    )
    assert [name for name, _ in find_units(stack)] == ["0", "2", "4"]


def test_a_module_listed_twice_in_a_stack_is_one_unit() -> None:
    shared = _Block()
    model = nn.Sequential(nn.ModuleList([shared, shared, _Block()]))
    assert len(find_units(model)) == 2


def test_a_model_without_blocks_is_refused_with_what_to_pass() -> None:
    class Backbone(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.mix = nn.Embedding(64, 32), nn.Linear(32, 32)

    class Shared(nn.Module):  # one layer called several times, as in ALBERT
        def __init__(self) -> None:
            super().__init__()
            self.backbone, self.layer = Backbone(), _Block()

    with pytest.raises(ValueError, match=r"could not auto-detect.*units=\['backbone', 'layer'\]"):
        find_units(Shared())


def test_units_can_be_chosen_by_class_names_or_predicate() -> None:
    model = Llama(LlamaConfig.from_name("tiny", n_layers=2))
    by_class = find_units(model, TransformerBlock)
    by_names = find_units(model, ["layers.1", "output"])
    by_predicate = find_units(model, lambda name, module: name == "tok_embeddings")
    assert [n for n, _ in by_class] == ["layers.0", "layers.1"]
    assert [n for n, _ in by_names] == ["layers.1", "output"]
    assert [n for n, _ in by_predicate] == ["tok_embeddings"]


def test_nested_matches_keep_only_the_outer_module() -> None:
    model = Llama(LlamaConfig.from_name("tiny", n_layers=2))
    units = find_units(model, ["layers.0", "layers.0.attention"])
    assert [n for n, _ in units] == ["layers.0"]


def test_unknown_unit_names_are_reported() -> None:
    model = Llama(LlamaConfig.from_name("tiny", n_layers=2))
    with pytest.raises(ValueError, match=r"\['layers.9'\] are not submodules"):
        find_units(model, ["layers.9"])


def test_norm_detection_defaults_and_override() -> None:
    assert is_norm_module(nn.LayerNorm(4)) and is_norm_module(RMSNorm(4))
    assert not is_norm_module(nn.Linear(4, 4))
    assert not is_norm_module(RMSNorm(4), norm_classes=())  # norm group disabled
    assert is_norm_module(nn.Linear(4, 4), norm_classes=nn.Linear)
