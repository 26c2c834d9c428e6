"""A real Fabric client: litgpt's GPT in a loop shaped like litgpt's pretrain script.

litgpt builds the model under ``fabric.init_module(empty_init=True)`` when it runs on
several devices, sets its GPT-NeoX initialization by patching each module's
``reset_parameters`` (``litgpt.pretrain.initialize_weights``), then calls
``fabric.setup(model)`` and builds AdamW from ``model.parameters()``; each step
accumulates under ``no_backward_sync``, clips with ``fabric.clip_gradients`` and uses
litgpt's ``chunked_cross_entropy``. Under ``strategy="yafsdp"`` that loop must train
exactly as ``strategy="ddp"`` from the same initial weights, and those weights must be
litgpt's initialization (its per-module standard deviations).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests import fabric_loops as fl
from tests.distributed import dist_run

litgpt = pytest.importorskip("litgpt", reason="litgpt is in the test extra: pip install -e .[test]")

VOCAB = 128
# Measured on 2 CPU ranks: per-step losses within 9.3e-8 relative of ddp's, weights within
# 3.1e-6 of their update; see [Tolerance: Fabric parity] in tests/test_fabric.py.
LOSS_RTOL = 1e-6
UPDATE_RTOL = 5e-5


def _config():
    return litgpt.Config(
        n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=VOCAB,
        padded_vocab_size=VOCAB, bias=False, n_query_groups=2, intermediate_size=64,
        mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", rotary_percentage=1.0,
        parallel_residual=False,
    )  # fmt: skip


def _pretrain_like(strategy: str, initial: dict | None = None) -> dict:
    from litgpt.model import GPT
    from litgpt.pretrain import initialize_weights
    from litgpt.utils import chunked_cross_entropy

    config = _config()
    fabric = fl.make_fabric(strategy)
    with fabric.init_module(empty_init=initial is None):
        model = GPT(config)
    if initial is None:
        initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)
    else:
        model.load_state_dict(initial)
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    optimizer = fabric.setup_optimizers(optimizer)
    start = fl.full_weights(model)
    losses = fl.train_steps(
        fabric, model, optimizer, range(fl.STEPS), vocab_size=VOCAB,
        loss_fn=lambda logits, targets: chunked_cross_entropy(logits, targets),
    )  # fmt: skip
    return {"initial": start, "losses": losses, "weights": fl.full_weights(model)}


def _both() -> dict:
    ours = _pretrain_like("yafsdp")
    # Only the (persistent) weights travel; the rope cache is rebuilt from the config.
    return {"yafsdp": ours, "ddp": _pretrain_like("ddp", initial=ours["initial"])}


@pytest.fixture(scope="module")
def runs() -> dict:
    return dist_run(2, _both, timeout_s=300)[0]


def test_litgpt_pretrain_style_loop_trains_as_under_ddp(runs):
    ours, ddp = runs["yafsdp"], runs["ddp"]
    torch.testing.assert_close(ours["losses"], ddp["losses"], rtol=LOSS_RTOL, atol=0)
    for name, weight in ddp["weights"].items():
        update = (weight - ddp["initial"][name]).norm()
        assert update > 0, f"{name} did not train"
        error = (ours["weights"][name] - weight).norm()
        assert error <= UPDATE_RTOL * update, f"{name}: off by {error / update:.3g} of its update"


def test_the_meta_build_gets_litgpts_own_initialization(runs):
    initial = runs["yafsdp"]["initial"]
    n_embd, n_layer = 32, 2
    expected = {  # litgpt.pretrain.initialize_weights
        "transformer.h.0.attn.proj.weight": 1 / math.sqrt(n_embd) / n_layer,
        "transformer.h.1.mlp.proj.weight": 1 / math.sqrt(n_embd) / n_layer,
        "transformer.h.0.attn.qkv.weight": math.sqrt(2.0 / 5 / n_embd),
        "transformer.wte.weight": math.sqrt(2.0 / 5 / n_embd),
    }
    for name, std in expected.items():
        assert initial[name].std().item() == pytest.approx(std, rel=0.1), name
    assert torch.equal(initial["transformer.h.0.norm_1.weight"], torch.ones(n_embd))
