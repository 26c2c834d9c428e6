"""The YaLM-100B "fp32 residual stream under bf16" practice: model, engine, recipe."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_yafsdp.config import ConfigError, load_config
from lightning_yafsdp.models.llama import Llama, LlamaConfig
from tests.distributed import dist_run


def _config(**overrides) -> LlamaConfig:
    return LlamaConfig.from_name("tiny", n_layers=2, **overrides)


def _tokens(config: LlamaConfig) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))


def _record_block_input_dtypes(model: Llama) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    model.layers[1].register_forward_pre_hook(lambda _module, args: seen.append(args[0].dtype))
    return seen


def test_fp32_weights_give_the_same_logits_with_and_without_the_flag() -> None:
    torch.manual_seed(0)
    plain = Llama(_config(embedding_norm=True))
    flagged = Llama(_config(embedding_norm=True, fp32_residual=True))
    flagged.load_state_dict(plain.state_dict())
    tokens = _tokens(plain.config)
    torch.testing.assert_close(flagged(tokens), plain(tokens), rtol=0, atol=1e-6)


def test_bf16_weights_keep_the_stream_between_blocks_in_fp32() -> None:
    torch.manual_seed(0)
    model = Llama(_config(fp32_residual=True)).to(torch.bfloat16)  # bf16-true style
    seen = _record_block_input_dtypes(model)
    logits = model(_tokens(model.config))
    assert seen == [torch.float32]
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()

    plain = Llama(_config()).to(torch.bfloat16)
    seen_plain = _record_block_input_dtypes(plain)
    plain(_tokens(plain.config))
    assert seen_plain == [torch.bfloat16]


def test_bf16_autocast_keeps_the_stream_in_fp32() -> None:
    torch.manual_seed(0)
    model = Llama(_config(fp32_residual=True))
    seen = _record_block_input_dtypes(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(_tokens(model.config))
    assert seen == [torch.float32]
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def _train_sharded_bf16() -> dict:
    from lightning_yafsdp.core import shard_model

    torch.manual_seed(0)
    model = Llama(_config(fp32_residual=True))
    engine = shard_model(model, param_dtype=torch.bfloat16, cast_forward_inputs=False)
    # Registered after sharding so it runs after the engine's own pre-hook (which would
    # cast the input to bf16 with cast_forward_inputs=True): it sees what the block gets.
    seen = _record_block_input_dtypes(model)
    optimizer = torch.optim.AdamW(engine.sharded_parameters(), lr=1e-3)
    tokens = _tokens(model.config)
    losses = []
    for _ in range(2):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    engine.close()
    return {"dtypes": seen, "losses": losses, "logits_dtype": logits.dtype}


def test_engine_keeps_block_inputs_fp32_and_trains() -> None:
    (result,) = dist_run(1, _train_sharded_bf16)
    assert result["dtypes"] == [torch.float32, torch.float32]
    assert result["logits_dtype"] == torch.bfloat16
    assert all(math.isfinite(loss) for loss in result["losses"])


def test_practice_switch_sets_the_model_flag_and_leaves_unit_inputs_uncast() -> None:
    from lightning_yafsdp.estimate import estimate
    from lightning_yafsdp.training.models import build_model
    from lightning_yafsdp.training.runner import build_strategy

    for flag in (False, True):
        config = load_config(None, [f"practices.fp32_residual={str(flag).lower()}"])
        with torch.device("meta"):
            model = build_model(config)
        assert model.config.fp32_residual is flag
        strategy = build_strategy(config, estimate(config, world_size=1))
        assert strategy.options.cast_forward_inputs is (not flag)


def test_practice_switch_is_rejected_for_hugging_face_models() -> None:
    overrides = ["model.kind=hf", "model.hf_path=/nowhere", "practices.fp32_residual=true"]
    with pytest.raises(ConfigError, match="only available for the reference model"):
        load_config(None, overrides)
