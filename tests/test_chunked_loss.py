"""The recipes' loss over chunks of tokens equals the whole-logits loss ([Note: chunked loss]).

On the model alone (one process): the loss and every gradient against the unchunked
cross-entropy, fp32 and bf16 logits. Through the Trainer (2 ranks, ``32-true``, the
recipe's own ``CausalLMModule`` built in ``configure_model``): ``strategy="yafsdp"``
against ``strategy="ddp"`` with the chunked loss, per-step losses and final weights,
with the head a whole unit (vocab 256) and in row chunks (vocab 1531, larger than a
block: [Note: row chunks]); and DDP chunked against DDP unchunked.
"""

from __future__ import annotations

import contextlib

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_yafsdp.config import ConfigError, load_config
from lightning_yafsdp.models.llama import Llama, LlamaConfig
from lightning_yafsdp.training.chunked_loss import chunk_tokens_for, chunked_cross_entropy
from tests.distributed import dist_run
from tests.zoo_models import full_weights

SEQ, STEPS = 32, 3
# Measured (2 ranks, 3 AdamW steps): losses <= 1.3e-7 relative for every pair; weights, as
# a fraction of their update, always the token embedding's (the rows that see few tokens:
# AdamW scales their tiny grads' round-off up): chunked vs whole 1.2e-5 / 3.9e-5 (yafsdp,
# vocab 256 / 1531), 1.6e-4 / 5.2e-5 (DDP); yafsdp vs DDP 1.4e-4 / 4.7e-4 chunked,
# 5.6e-8 / 4.3e-4 whole.
_LOSS_RTOL = 5e-7
_UPDATE_RTOL = {"chunked/whole": 3e-4, "yafsdp/ddp": 1e-3}


def _model(vocab: int = 1531) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_name("tiny", vocab_size=vocab, max_seq_len=SEQ))


def _whole_and_chunked(model: Llama, tokens: torch.Tensor, *, chunk: int, fp32: bool):
    results = []
    for chunked in (False, True):
        model.zero_grad()
        hidden = model.hidden_states(tokens[:, :-1])
        if chunked:
            loss = chunked_cross_entropy(
                hidden, model.output, tokens[:, 1:], chunk_tokens=chunk, fp32=fp32
            )
        else:
            logits = model.output(hidden)
            logits = logits.float() if fp32 else logits
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((loss.detach(), grads))
    return results


@pytest.mark.parametrize("chunk", [7, 16, 64, 1000])  # uneven, even, one chunk, > tokens
def test_chunked_loss_and_grads_equal_the_whole_logits_loss(chunk: int) -> None:
    model = _model()
    tokens = torch.randint(0, 1531, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    (whole, whole_grads), (chunked, chunked_grads) = _whole_and_chunked(
        model, tokens, chunk=chunk, fp32=True
    )
    # Measured: loss 0 to 6.5e-8 relative, grads <= 1.1e-6 of their largest element.
    torch.testing.assert_close(chunked, whole, rtol=5e-7, atol=0)
    for name, grad in whole_grads.items():
        scale = grad.abs().max().item()
        error = (chunked_grads[name] - grad).abs().max().item()
        assert error <= 3e-6 * scale, f"{name}: {error:.3g} of {scale:.3g}"


def test_chunked_loss_in_bf16_casts_each_chunk_to_fp32_like_the_whole_loss() -> None:
    model = _model().to(torch.bfloat16)
    tokens = torch.randint(0, 1531, (2, SEQ + 1), generator=torch.Generator().manual_seed(2))
    (whole, _), (chunked, _) = _whole_and_chunked(model, tokens, chunk=10, fp32=True)
    assert chunked.dtype == whole.dtype == torch.float32
    torch.testing.assert_close(chunked, whole, rtol=5e-7, atol=0)  # measured 1.3e-7


def test_without_grad_the_chunks_run_plainly_and_give_the_same_loss() -> None:
    model = _model()
    tokens = torch.randint(0, 1531, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = model.hidden_states(tokens[:, :-1])
        chunked = chunked_cross_entropy(
            hidden, model.output, tokens[:, 1:], chunk_tokens=9, fp32=True
        )
        whole = F.cross_entropy(model.output(hidden).flatten(0, 1), tokens[:, 1:].flatten())
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)


def test_auto_chunks_large_vocabularies_only_in_about_two_gib_of_logits() -> None:
    assert chunk_tokens_for("auto", vocab_size=128256) == 4096  # Llama 3: 2.1 GB per chunk
    assert chunk_tokens_for("auto", vocab_size=256000) == 2048  # Gemma
    assert chunk_tokens_for("auto", vocab_size=32000) is None  # Llama 2: whole
    assert chunk_tokens_for("none", vocab_size=128256) is None
    assert chunk_tokens_for("0", vocab_size=128256) is None
    assert chunk_tokens_for("512", vocab_size=256) == 512


def test_loss_chunk_size_off_or_false_means_whole_logits() -> None:
    for word in ("off", "false", "none", "0"):
        config = load_config(None, [f"model.loss_chunk_size={word}"])
        assert chunk_tokens_for(config.model.loss_chunk_size, vocab_size=128256) is None


def test_bad_loss_chunk_settings_are_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="'auto', 'none' or a number of tokens"):
        load_config(None, ["model.loss_chunk_size=half"])
    with pytest.raises(ConfigError, match="needs model.kind='llama'"):
        load_config(None, ["model.kind=hf", "model.hf_path=/nowhere", "model.loss_chunk_size=64"])


# -- through the Trainer and the recipe's module ------------------------------------------


class _SameStart(pl.Callback):
    """The same initial weights under every strategy (the meta-device init of yafsdp draws
    them in another order than DDP's eager build), recorded for the update errors."""

    def on_train_start(self, trainer, pl_module) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        full = engine.summon_full_params(writeback=True) if engine else contextlib.nullcontext()
        generator = torch.Generator().manual_seed(0)
        with full, torch.no_grad():
            for _, param in sorted(pl_module.named_parameters()):
                noise = torch.randn(param.shape, generator=generator) * 0.05
                param.copy_(noise + 1.0 if param.ndim == 1 else noise)  # norm gains near 1
        self.weights = full_weights(trainer, pl_module)


def _recipe_fit(strategy: str, vocab: int, chunk: str, root: str) -> dict:
    from lightning_yafsdp.training.module import CausalLMModule

    config = load_config(
        None,
        [
            f"model.vocab_size={vocab}",
            f"model.max_seq_len={SEQ}",
            f"data.seq_len={SEQ}",
            f"model.loss_chunk_size={chunk}",
            "schedule.warmup_steps=0",
            "schedule.decay=constant",
            "optim.lr=0.01",
            f"trainer.max_steps={STEPS}",
        ],
    )
    module = CausalLMModule(config)
    torch.manual_seed(0)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, precision="32-true",
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        default_root_dir=root, gradient_clip_val=1.0, callbacks=[initial := _SameStart()],
    )  # fmt: skip
    tokens = torch.randint(
        0, vocab, (4 * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(5)
    )
    trainer.fit(module, DataLoader(tokens, batch_size=2, shuffle=False))
    facts = {"losses": [loss for _, loss in module.train_losses]}
    facts["weights"] = full_weights(trainer, module)
    facts["initial"] = initial.weights
    facts["chunk_tokens"] = module.loss_chunk_tokens
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None:
        facts["units"] = [unit.name for unit in engine.units]
    return facts


def _recipe_runs(vocab: int, root: str) -> dict:
    return {
        "ddp_whole": _recipe_fit("ddp", vocab, "off", f"{root}/ddp_whole"),  # YAML: false
        "ddp": _recipe_fit("ddp", vocab, "24", f"{root}/ddp"),
        "yafsdp": _recipe_fit("yafsdp", vocab, "24", f"{root}/yafsdp"),
        "yafsdp_whole": _recipe_fit("yafsdp", vocab, "none", f"{root}/yafsdp_whole"),
    }


def _update_error(ours: dict, reference: dict, initial: dict) -> tuple[float, str]:
    worst = (0.0, "")
    for name, weight in reference.items():
        update = (weight - initial[name]).norm().item()
        if update:
            worst = max(worst, ((ours[name] - weight).norm().item() / update, name))
    return worst


@pytest.mark.parametrize("vocab", [256, 1531])  # the head a whole unit; in row chunks
def test_recipe_module_chunked_loss_under_yafsdp_matches_ddp(vocab: int, tmp_path) -> None:
    for rank, run in enumerate(dist_run(2, _recipe_runs, vocab, str(tmp_path), timeout_s=300)):
        ours, ddp, whole = run["yafsdp"], run["ddp"], run["ddp_whole"]
        assert ours["chunk_tokens"] == 24 and whole["chunk_tokens"] is None
        row_chunked = any(name.startswith("model.output[") for name in ours["units"])
        assert row_chunked == (vocab == 1531)
        for name, weight in ddp["initial"].items():
            assert torch.equal(ours["initial"][name], weight), name
        pairs = [("yafsdp/ddp", ours, ddp), ("chunked/whole", ddp, whole)]
        pairs.append(("chunked/whole", ours, run["yafsdp_whole"]))
        for pair, run_a, run_b in pairs:
            torch.testing.assert_close(
                torch.tensor(run_a["losses"]), torch.tensor(run_b["losses"]),
                rtol=_LOSS_RTOL, atol=0,
            )  # fmt: skip
            error, where = _update_error(run_a["weights"], run_b["weights"], ddp["initial"])
            assert error < _UPDATE_RTOL[pair], f"rank {rank}, {pair}: {where} off by {error:.3g}"


def test_the_estimate_counts_one_chunk_of_logits() -> None:
    from lightning_yafsdp.estimate import estimate

    def activations_root(chunk: str) -> int:
        config = load_config(
            None,
            ["model.preset=llama3-8b", "trainer.precision=bf16-mixed", "data.seq_len=8192",
             "data.batch_size=1", f"model.loss_chunk_size={chunk}"],
        )  # fmt: skip
        return estimate(config, world_size=8).activations_root

    # bf16 logits and their fp32 copy: 6 bytes per token and vocabulary entry.
    saved = activations_root("none") - activations_root("auto")
    assert saved == (8192 - 4096) * 128256 * 6  # 3.2 GB of Llama-3-8B's 6.3 GB at 8k tokens
    assert activations_root("1024") < activations_root("auto")


# -- what the chunks cost in collectives ----------------------------------------------------


def _collectives_per_step(vocab: int, chunk: int | None) -> dict:
    from lightning_yafsdp.core import shard_model

    model = _model(vocab)
    engine = shard_model(model)
    tokens = torch.randint(0, vocab, (2, SEQ + 1), generator=torch.Generator().manual_seed(4))
    for _ in range(2):  # the second step is measured
        engine.comm_stats.reset()
        hidden = model.hidden_states(tokens[:, :-1])
        if chunk is None:
            logits = model.output(hidden).float()
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        else:
            loss = chunked_cross_entropy(
                hidden, model.output, tokens[:, 1:], chunk_tokens=chunk, fp32=True
            )
        loss.backward()
        model.zero_grad()
    return engine.comm_stats.snapshot()


def _chunk_costs() -> dict:
    return {
        vocab: {chunk: _collectives_per_step(vocab, chunk) for chunk in (None, 64, 16)}
        for vocab in (256, 1531, 4096)
    }


def test_what_chunks_cost_a_head_unit_and_a_head_in_row_chunks() -> None:
    """64 tokens per rank in 1 or 4 chunks; quoted in docs/performance.md.

    In ``k`` chunks the head's grad is reduced ``k`` times, not once. Its gathers: as
    before for a whole unit (its buffer holds it across the consecutive calls); for row
    chunks ``k - 1`` heads more when they fit the two slots (vocab 1531: 2 chunks), and
    ``3k - 3`` heads more when they rotate through them (vocab 4096: 11 chunks; +1 head
    even in one chunk: the recomputation re-gathers the two chunks ZeRO-3 would keep;
    9.1: padding).
    """
    costs = dist_run(2, _chunk_costs)[0]
    extra_heads = {}
    for vocab, runs in costs.items():
        head = vocab * 64 * 4  # fp32 (32-true) weights and grads, bytes
        extra_heads[vocab] = [
            tuple(  # rounded: gathers move padded rows
                round((runs[chunk]["bytes"][kind] - runs[None]["bytes"][kind]) / head, 1)
                for kind in ("all_gather", "reduce_scatter")
            )
            for chunk in (64, 16)
        ]
    assert extra_heads[256] == [(0.0, 0.0), (0.0, 3.0)], extra_heads
    assert extra_heads[1531] == [(0.0, 0.0), (3.0, 3.0)], extra_heads
    assert extra_heads[4096] == [(1.0, 0.0), (9.1, 3.0)], extra_heads
