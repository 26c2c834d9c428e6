"""Specification of the reference Llama decoder in lightning_yafsdp.models.llama."""

from __future__ import annotations

import pytest
import torch

from lightning_yafsdp.models.llama import (
    LLAMA_CONFIGS,
    Llama,
    LlamaConfig,
    hf_llama_config,
    llama_ffn_hidden_dim,
    llama_to_hf_state_dict,
)

BATCH, SEQ = 2, 16


def tiny_config(**overrides) -> LlamaConfig:
    return LlamaConfig.from_name("tiny", **overrides)


def random_tokens(config: LlamaConfig, *, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)


def build_on_meta_and_init(config: LlamaConfig, *, seed: int) -> Llama:
    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_forward_returns_logits_per_position_in_weight_dtype():
    config = tiny_config()
    logits = Llama(config)(random_tokens(config))
    assert logits.shape == (BATCH, SEQ, config.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_bf16_model_returns_bf16_logits():
    config = tiny_config()
    logits = Llama(config).to(torch.bfloat16)(random_tokens(config))
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(logits.float()).all()


def test_changing_a_future_token_leaves_earlier_logits_unchanged():
    config = tiny_config()
    model = Llama(config).eval()
    tokens = random_tokens(config)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % config.vocab_size
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_grouped_query_attention_shapes_run(n_kv_heads):
    config = tiny_config(n_kv_heads=n_kv_heads)
    model = Llama(config)
    assert model.layers[0].attention.wk.weight.shape == (n_kv_heads * config.head_dim, 64)
    assert model(random_tokens(config)).shape == (BATCH, SEQ, config.vocab_size)


def test_embedding_norm_and_dropout_options_run_and_train():
    config = tiny_config(embedding_norm=True, dropout=0.1)
    model = Llama(config).train()
    model(random_tokens(config)).sum().backward()
    assert model.embedding_norm is not None
    assert all(p.grad is not None for p in model.parameters())


def test_tied_embeddings_share_one_parameter():
    model = Llama(tiny_config(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    untied = Llama(tiny_config())
    assert model.num_parameters() == untied.num_parameters() - untied.output.weight.numel()


def test_meta_build_then_init_weights_is_finite_deterministic_and_keeps_tie():
    config = tiny_config(tie_embeddings=True)
    first = build_on_meta_and_init(config, seed=7)
    second = build_on_meta_and_init(config, seed=7)
    assert first.output.weight is first.tok_embeddings.weight
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    logits = first(random_tokens(config))
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, second(random_tokens(config)), rtol=0, atol=0)


def test_init_weights_scales_residual_projections_and_sets_norms_to_one():
    config = tiny_config(n_layers=8, dim=256, n_heads=4, ffn_hidden_dim=512)
    model = build_on_meta_and_init(config, seed=0)
    block = model.layers[0]
    assert block.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attention.wo.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert block.feed_forward.w2.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.equal(block.ffn_norm.weight, torch.ones(config.dim))


def test_to_empty_then_load_state_dict_reproduces_the_model():
    config = tiny_config(tie_embeddings=True)
    reference = Llama(config).eval()
    with torch.device("meta"):
        restored = Llama(config)
    restored.to_empty(device="cpu")
    restored.load_state_dict(reference.state_dict())
    tokens = random_tokens(config)
    torch.testing.assert_close(restored.eval()(tokens), reference(tokens), rtol=0, atol=0)


def test_modules_hold_no_tensor_aliases_outside_parameters_and_buffers():
    model = Llama(tiny_config(tie_embeddings=True))
    for module_name, module in model.named_modules():
        for attribute, value in vars(module).items():
            assert not isinstance(value, torch.Tensor), f"{module_name}.{attribute}"


def test_each_block_runs_as_a_module_once_per_forward():
    config = tiny_config()
    model = Llama(config)
    calls = []
    for index, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda module, args, index=index: calls.append(index))
    model(random_tokens(config))
    assert calls == list(range(config.n_layers))


def test_sequence_longer_than_max_seq_len_is_rejected():
    config = tiny_config(max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        Llama(config)(random_tokens(config))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dim": 66, "n_heads": 4}, "not divisible by n_heads"),
        ({"n_heads": 4, "n_kv_heads": 3}, "not divisible by n_kv_heads"),
        ({"dim": 36, "n_heads": 12, "n_kv_heads": 12}, "odd"),
        ({"n_layers": 0}, "n_layers must be a positive int"),
        ({"dropout": 1.0}, "dropout"),
        ({"rope_theta": 0.0}, "rope_theta"),
    ],
)
def test_invalid_config_is_rejected_with_a_reason(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="llama3-8b"):
        LlamaConfig.from_name("gpt-5")
    with pytest.raises(ValueError, match="unknown LlamaConfig field"):
        LlamaConfig.from_name("tiny", width=3)


def test_n_kv_heads_defaults_to_n_heads():
    assert LlamaConfig(dim=64, n_heads=8).n_kv_heads == 8


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # The counts Hugging Face reports for the published checkpoints.
        ("llama-1b", 1_235_814_400),
        ("llama3-8b", 8_030_261_248),
        ("llama2-7b", 6_738_415_616),
        ("llama2-70b", 68_976_648_192),
        ("llama3-70b", 70_553_706_496),
    ],
)
def test_published_presets_have_published_parameter_counts(name, expected):
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name(name))
    assert model.num_parameters() == expected


def test_small_presets_have_their_advertised_sizes():
    with torch.device("meta"):
        tiny = Llama(LlamaConfig.from_name("tiny"))
        debug = Llama(LlamaConfig.from_name("debug-50m"))
    assert 100_000 < tiny.num_parameters() < 1_000_000
    assert debug.num_parameters() == pytest.approx(50e6, rel=0.05)
    assert set(LLAMA_CONFIGS) >= {
        "tiny",
        "debug-50m",
        "llama-1b",
        "llama3-8b",
        "llama2-7b",
        "llama2-70b",
        "llama3-70b",
    }


def test_ffn_rounding_rule_reproduces_published_widths():
    assert llama_ffn_hidden_dim(4096) == 11008
    assert llama_ffn_hidden_dim(4096, multiple_of=1024, ffn_dim_multiplier=1.3) == 14336
    assert llama_ffn_hidden_dim(8192, multiple_of=4096, ffn_dim_multiplier=1.3) == 28672


def test_flops_per_token_follows_the_palm_formula_and_ignores_tying():
    config = tiny_config()
    model = Llama(config)
    matmul_params = model.num_parameters() - config.vocab_size * config.dim
    attention_flops = 12 * config.n_layers * config.dim * 32
    assert model.flops_per_token(32) == 6 * matmul_params + attention_flops
    tied = Llama(tiny_config(tie_embeddings=True))
    assert tied.flops_per_token(32) == model.flops_per_token(32)


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_logits_match_hugging_face_llama(tie_embeddings):
    transformers = pytest.importorskip("transformers")
    config = tiny_config(tie_embeddings=tie_embeddings)
    torch.manual_seed(0)
    ours = Llama(config).eval()
    # Weights far from the 0.02 init, so any mismatch shows up as a large error.
    with torch.no_grad():
        for name, parameter in ours.named_parameters():
            parameter.normal_(mean=1.0 if "norm" in name else 0.0, std=0.2)
    # Default attention implementation (SDPA on CPU), float32 like ours.
    hf_model = transformers.LlamaForCausalLM(hf_llama_config(config)).float().eval()
    hf_model.load_state_dict(llama_to_hf_state_dict(ours.state_dict(), config), strict=True)
    tokens = random_tokens(config)
    with torch.no_grad():
        expected = hf_model(input_ids=tokens).logits
        actual = ours(tokens)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_hugging_face_mapping_rejects_embedding_norm():
    config = tiny_config(embedding_norm=True)
    with pytest.raises(ValueError, match="embedding_norm"):
        llama_to_hf_state_dict(Llama(config).state_dict(), config)
