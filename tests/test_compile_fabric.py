"""torch.compile under the engine through Fabric: HF Llama and GPT-2, precisions, checkpointing.

The Fabric loop of ``tests/fabric_loops.py`` (accumulation under ``no_backward_sync``,
global-norm clipping, AdamW) trains a tiny HF model compiled per block (``block.compile()``
before ``fabric.setup_module``) or as a whole (``torch.compile(model)`` before setup:
Fabric unwraps it, lets the strategy shard the inner model and compiles the result again).
Compiled ``strategy="yafsdp"`` must train as compiled ``strategy="ddp"`` on the same seed
and data: per-step losses, clipping norms and final weights. Backend ``aot_eager`` (see
tests/test_compile.py).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from lightning_yafsdp.fabric import YaFSDPStrategy
from tests import fabric_loops as fl
from tests.distributed import dist_run

_BACKEND = "aot_eager"
_VOCAB = 256
_STEPS = 3


class LogitsOf(nn.Module):
    """An HF causal LM as ``tokens -> logits``, the shape the Fabric loop trains."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens).logits


def _hf_llama() -> nn.Module:
    from tests.lightning_models import hf_llama_config, tiny_llama_config

    config = hf_llama_config(tiny_llama_config())
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config)


def _hf_gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=_VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config)


_FAMILIES = {
    "llama": (_hf_llama, lambda m: m.model.layers),
    "gpt2": (_hf_gpt2, lambda m: m.transformer.h),
}


def _build(
    family: str, compile_mode: str, hf_checkpointing: bool, backend: str = _BACKEND
) -> nn.Module:
    build, blocks_of = _FAMILIES[family]
    torch.manual_seed(0)
    hf_model = build()
    # Training needs no KV cache, and a recomputed forward (activation checkpointing)
    # would append to it twice.
    hf_model.config.use_cache = False
    if hf_checkpointing:
        hf_model.gradient_checkpointing_enable({"use_reentrant": False})
    if compile_mode == "block":
        for block in blocks_of(hf_model):
            block.compile(backend=backend)
    model = LogitsOf(hf_model)
    if compile_mode == "whole":
        model = torch.compile(model, backend=backend)
    return model


def _fit(
    strategy: str,
    family: str,
    compile_mode: str,
    *,
    precision: str = "32-true",
    ours_checkpointing: bool = False,
    hf_checkpointing: bool = False,
    backend: str = _BACKEND,
) -> dict:
    torch._dynamo.reset()
    if strategy == "yafsdp" and ours_checkpointing:
        strategy = YaFSDPStrategy(activation_checkpointing="all")
    fabric = fl.make_fabric(strategy, precision)
    model = fabric.setup_module(_build(family, compile_mode, hf_checkpointing, backend))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=fl.LR))
    start = _full_weights(model)
    norms: list[float] = []
    losses = fl.train_steps(fabric, model, optimizer, range(_STEPS), norms, vocab_size=_VOCAB)
    return {
        "losses": losses,
        "norms": norms,
        "initial": start,
        "weights": _full_weights(model),
    }


def _full_weights(model) -> dict:
    """Full weights under their uncompiled names; Fabric's compile wrapper looked through."""
    inner = model._forward_module
    weights = fl.full_weights(getattr(inner, "_orig_mod", inner))
    return {name.replace("_orig_mod.", ""): w for name, w in weights.items()}


_RUNS = {  # name: the arguments of _fit
    **{
        f"{strategy}-{family}-{mode}": dict(strategy=strategy, family=family, compile_mode=mode)
        for family in ("llama", "gpt2")
        for mode in ("block", "whole")
        for strategy in ("ddp", "yafsdp")
    },
    "yafsdp-llama-eager": dict(strategy="yafsdp", family="llama", compile_mode="none"),
    **{
        f"{strategy}-bf16-{mode}": dict(
            strategy=strategy, family="llama", compile_mode=mode, precision="bf16-mixed"
        )
        for strategy, mode in (("ddp", "block"), ("yafsdp", "block"), ("yafsdp", "none"))
    },
    **{
        f"yafsdp-ours-ac-{mode}": dict(
            strategy="yafsdp", family="llama", compile_mode=mode, ours_checkpointing=True
        )
        for mode in ("block", "whole")
    },
    **{
        f"{strategy}-hf-ac-{mode}": dict(
            strategy=strategy, family="llama", compile_mode=mode, hf_checkpointing=True
        )
        for strategy, mode in (("ddp", "block"), ("yafsdp", "block"), ("yafsdp", "whole"))
    },
}


def _runs() -> dict:
    return {name: _fit(**options) for name, options in _RUNS.items()}


@pytest.fixture(scope="module")
def runs() -> dict:
    return dist_run(2, _runs, timeout_s=400)[0]


# [Tolerance: compiled Fabric parity] 32-true, measured on 2 CPU ranks: compiled yafsdp
# equals eager yafsdp bitwise (losses, norms, weights), and compiled DDP equals eager DDP
# bitwise, so compiled yafsdp vs compiled DDP differs exactly as eager yafsdp vs eager DDP
# does: losses 0.0, clipping norms 1.1e-7 relative (the global norm sums shard norms in
# another order), weights 3.5e-5 of their update on GPT-2 (an attention bias whose update
# is tiny; 5.1e-6 on Llama). The bounds are tests/test_fabric.py's.
LOSS_RTOL = 1e-6
UPDATE_RTOL = 5e-5
# Compiled against eager yafsdp: measured 0.0; room for another CPU's summation order.
EXACT_RTOL = 1e-6
# [Tolerance: bf16 under compile] Measured, Llama, per-block compile: DDP's own bf16 noise
# (DDP bf16-mixed vs DDP 32-true) is 4.7e-5 relative on the losses and 1.6e-3 on the
# clipping norms; yafsdp bf16-mixed vs DDP bf16-mixed is 5.6e-5 and 5.3e-4 (the engine
# computes with bf16 weights, DDP autocasts): within that noise, bounded near it.
BF16_LOSS_RTOL = 1e-4
BF16_NORM_RTOL = 2e-3


def _assert_same_training(run: dict, reference: dict, update_rtol: float = UPDATE_RTOL) -> None:
    torch.testing.assert_close(run["losses"], reference["losses"], rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(run["norms"], reference["norms"], rtol=LOSS_RTOL, atol=0)
    assert run["weights"].keys() == reference["weights"].keys()
    for name, weight in reference["weights"].items():
        # Relative to how far training moved the tensor (tests/test_fabric.py's metric).
        update = (weight - reference["initial"][name]).norm()
        error = (run["weights"][name] - weight).norm()
        assert error <= update_rtol * update, f"{name}: off by {error / update:.3g} of its update"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", ["block", "whole"])
def test_compiled_fabric_training_matches_compiled_ddp(runs, family, mode):
    _assert_same_training(runs[f"yafsdp-{family}-{mode}"], runs[f"ddp-{family}-{mode}"])
    assert runs[f"ddp-{family}-{mode}"]["losses"][-1] != runs[f"ddp-{family}-{mode}"]["losses"][0]


@pytest.mark.parametrize("mode", ["block", "whole"])
def test_compiled_fabric_training_matches_eager_yafsdp(runs, mode):
    _assert_same_training(runs[f"yafsdp-llama-{mode}"], runs["yafsdp-llama-eager"], EXACT_RTOL)


def test_bf16_mixed_under_compile_is_within_ddps_own_bf16_noise(runs):
    ours, ddp = runs["yafsdp-bf16-block"], runs["ddp-bf16-block"]
    torch.testing.assert_close(ours["losses"], ddp["losses"], rtol=BF16_LOSS_RTOL, atol=0)
    torch.testing.assert_close(ours["norms"], ddp["norms"], rtol=BF16_NORM_RTOL, atol=0)
    assert ours["losses"] != runs["yafsdp-llama-block"]["losses"]  # it ran in bf16
    # And compile changes nothing in bf16 either: eager yafsdp bf16-mixed, to round-off.
    _assert_same_training(ours, runs["yafsdp-bf16-none"], EXACT_RTOL)


@pytest.mark.parametrize("mode", ["block", "whole"])
def test_the_strategys_activation_checkpointing_under_compile_matches_compiled_ddp(runs, mode):
    # Recomputation is exact in 32-true, so DDP compiled without checkpointing is the
    # reference (measured: yafsdp with and without checkpointing are bitwise equal).
    _assert_same_training(runs[f"yafsdp-ours-ac-{mode}"], runs["ddp-llama-block"])


@pytest.mark.parametrize("mode", ["block", "whole"])
def test_hf_gradient_checkpointing_under_compile_matches_compiled_ddp_with_it(runs, mode):
    _assert_same_training(runs[f"yafsdp-hf-ac-{mode}"], runs["ddp-hf-ac-block"])


# -- inductor ----------------------------------------------------------------------------


def _inductor_runs() -> dict:
    return {
        strategy: _fit(strategy, "llama", "block", backend="inductor")
        for strategy in ("ddp", "yafsdp")
    }


def test_per_block_inductor_compile_matches_inductor_compiled_ddp(tmp_path, monkeypatch):
    # Inductor generates and builds C++ kernels with the machine's g++ (its cache in tmp).
    # Its kernels are not eager's, but each is the same under both strategies: measured
    # 8.6e-6 of the update (clipping norm order, as eager), losses equal.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    runs = dist_run(2, _inductor_runs, timeout_s=400)[0]
    _assert_same_training(runs["yafsdp"], runs["ddp"])
