"""torch.compile under the engine: per-block and whole-model compile through the Trainer.

Compiled yafsdp must train exactly as compiled DDP (HF Llama, 32-true, two CPU ranks,
``aot_eager``: Dynamo and AOT autograd without inductor's code generation, so the numbers
are eager kernels' and comparable to round-off). The engine's hooks run outside the
compiled graphs ([Note: engine hooks under compile]); the graph-break counts below fail
if a hook (or anything it reaches) is traced into a block's graph again.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from tests.distributed import dist_run
from tests.lightning_models import CausalLMModule, token_loader
from tests.test_strategy import STEPS, TRAIN_ROWS, _trainer
from tests.zoo_models import full_weights

_BACKEND = "aot_eager"


class CompiledLM(CausalLMModule):
    """The HF Llama of the parity tests, compiled per block or as a whole in configure_model."""

    def __init__(self, *, compile_mode: str, build: str) -> None:
        super().__init__(build=build, kind="hf", lr=1e-3)
        self.compile_mode = compile_mode

    # A meta-device build is initialised by the HF model's own scheme (the strategy's
    # default when the LightningModule has no init_submodule).
    init_submodule = property(lambda self: None)

    def configure_model(self) -> None:
        already_built = self.model is not None and self.configure_model_calls > 0
        super().configure_model()
        if already_built:
            return
        if self.compile_mode == "none":
            return
        if self.compile_mode == "block":
            for layer in self.model.model.layers:
                layer.compile(backend=_BACKEND)
        else:
            self.model = torch.compile(self.model, backend=_BACKEND)


def _fit(
    strategy: str, compile_mode: str, build: str = "eager", nested_graph_breaks: bool = False
) -> dict:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = CompiledLM(compile_mode=compile_mode, build=build)
    trainer = _trainer(strategy, accumulate_grad_batches=1, gradient_clip_val=None)
    with torch._dynamo.config.patch(nested_graph_breaks=nested_graph_breaks):
        trainer.fit(model, token_loader(TRAIN_ROWS // 2))
    weights = full_weights(trainer, model)
    return {
        "losses": model.train_losses,
        "weights": {name.replace("_orig_mod.", ""): w for name, w in weights.items()},
        "graph_breaks": sum(counters["graph_break"].values()),
        "recompiles": sum(counters["recompiles"].values()),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "units": len(trainer.strategy.engine.units) if strategy == "yafsdp" else None,
    }


def _runs() -> dict:
    return {
        "ddp-block": _fit("ddp", "block"),
        "yafsdp-block": _fit("yafsdp", "block"),
        "yafsdp-block-meta": _fit("yafsdp", "block", build="configure_model"),
        "yafsdp-eager-meta": _fit("yafsdp", "none", build="configure_model"),
        "ddp-whole": _fit("ddp", "whole"),
        "yafsdp-whole": _fit("yafsdp", "whole"),
        "yafsdp-whole-nested": _fit("yafsdp", "whole", nested_graph_breaks=True),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return dist_run(2, _runs, timeout_s=280)


def _assert_matches(runs: list[dict], ours: str, reference: str) -> None:
    for rank, run in enumerate(runs):
        assert len(run[ours]["losses"]) == STEPS, f"rank {rank}"
        # [Tolerance] 32-true, same kernels: measured bitwise equal (0.0) on this machine,
        # losses and weights; 1e-6 relative leaves room for another CPU's summation order.
        torch.testing.assert_close(
            torch.tensor(run[ours]["losses"]),
            torch.tensor(run[reference]["losses"]),
            rtol=1e-6,
            atol=0,
        )
        error, where = _weights_error(run[ours]["weights"], run[reference]["weights"])
        assert error <= 1e-6, f"rank {rank}: {where} off by {error:.3g} relative"


def _weights_error(actual: dict, expected: dict) -> tuple[float, str]:
    assert sorted(actual) == sorted(expected)
    worst, where = 0.0, ""
    for name, weight in expected.items():
        error = ((actual[name] - weight).norm() / weight.norm().clamp_min(1e-12)).item()
        if error > worst:
            worst, where = error, name
    return worst, where


def test_per_block_compile_matches_compiled_ddp(runs):
    _assert_matches(runs, "yafsdp-block", "ddp-block")


def test_per_block_compile_of_a_configure_model_build_matches_eager_yafsdp(runs):
    # A meta-device build draws its own init (HF's scheme, unit by unit), so its reference
    # is the same build trained without compile.
    _assert_matches(runs, "yafsdp-block-meta", "yafsdp-eager-meta")


def test_whole_model_compile_matches_compiled_ddp(runs):
    _assert_matches(runs, "yafsdp-whole", "ddp-whole")


def test_per_block_compile_has_no_graph_break_and_no_recompile(runs):
    for run in runs:
        for name in ("yafsdp-block", "yafsdp-block-meta"):
            assert run[name]["graph_breaks"] == 0, (name, run[name])
            assert run[name]["recompiles"] == 0, (name, run[name])
            # As many graphs as under DDP (4 here): hooks add none.
            assert run[name]["unique_graphs"] == run["ddp-block"]["unique_graphs"], run[name]


def test_whole_model_compile_breaks_only_at_engine_hooks(runs):
    for run in runs:
        whole = run["yafsdp-whole"]
        assert whole["recompiles"] == 0, whole
        # At most one break per unit boundary: measured 6 on this HF Llama's 6 units (4
        # blocks, the embedding and the head as root units). Dynamo's default bubbles a
        # break inside a nested module call up to the outermost frame, which breaks at
        # its call site and is traced again from there, so one hook can count more than
        # once (the count is not one per unit: see the nested test below).
        assert 0 < whole["graph_breaks"] <= whole["units"] == 6, whole


def test_whole_model_compile_breaks_at_most_once_per_unit_with_nested_graph_breaks(runs):
    # torch._dynamo.config.nested_graph_breaks=True resumes tracing in the frame that
    # broke: each engine hook met inside the compiled model breaks once. Measured 4 on
    # this HF Llama's 6 units. Training is unchanged.
    for run in runs:
        nested = run["yafsdp-whole-nested"]
        assert nested["recompiles"] == 0, nested
        assert 0 < nested["graph_breaks"] <= 4, nested
    _assert_matches(runs, "yafsdp-whole-nested", "ddp-whole")


def _compiled_read_outside_units() -> str:
    import transformers

    from lightning_yafsdp.core.plan.sharding import shard_model
    from tests.lightning_models import hf_llama_config, tiny_llama_config

    model = transformers.LlamaForCausalLM(hf_llama_config(tiny_llama_config()))
    shard_model(model)
    weight = model.lm_head.weight
    try:
        torch.compile(lambda: weight * 2 + 1, backend=_BACKEND)()
    except Exception as error:  # Dynamo wraps the engine's RuntimeError
        return str(error)
    return "no error"


def test_a_sharded_parameter_traced_outside_its_unit_is_refused_naming_compile():
    message = dist_run(1, _compiled_read_outside_units, timeout_s=120)[0]
    assert "torch.compile traced the sharded parameter 'lm_head.weight'" in message, message
    assert "block.compile()" in message and "safetensors" not in message, message
