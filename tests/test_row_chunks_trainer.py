"""Row chunks through the Trainer: a Hugging Face Llama whose vocabulary is 7 blocks.

``Trainer(strategy="yafsdp")`` against ``strategy="ddp"`` with the same seed, in
``32-true``, the model built eagerly and in ``configure_model`` (meta device), at world
sizes 1, 2 and 3: per-step losses and final weights to round-off; a run resumed from a
sharded checkpoint matches DDP resumed from its own ([Note: row chunks]). The same for
a tied embedding and head (Llama with ``tie_word_embeddings``, and Gemma 2, whose
embedding is a scaled subclass: [Note: tied row chunks], [Note: chunkable modules]),
ZeRO-2, hybrid sharding (2 replicas x 2 sharded ranks), and LoRA (peft) on a frozen
base, whose frozen embedding and head run in chunks of frozen rows.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_yafsdp import YaFSDPStrategy
from tests.distributed import dist_run
from tests.zoo_models import full_weights

VOCAB = 1531  # prime: chunk rows and shard boundaries never line up
STEPS, SEQ = 4, 12
# Measured (eager, 2 and 3 ranks): losses <= 1.4e-7 relative, weights <= 2.3e-5 of their
# update (tests/test_strategy.py's _update_error); with a chunk's reduce not divided by
# the world size: losses 5e-4, weights 0.03-0.07.
_LOSS_RTOL = 1e-5
_UPDATE_RTOL = 1e-4
# A tied weight in chunks at 4 ranks (flat or 2 x 2): 1.39e-4 / 1.45e-4 of the update
# (down_proj.weight) where whole units give 1.6e-6: the chunked matmuls round differently
# (AdamW's first steps turn that into sign flips of near-zero grads); in float64 the two
# runs are bitwise equal (tests/test_row_chunks.py).
_TIED_4_RANKS_UPDATE_RTOL = 3e-4


_SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def _hf_llama(family: str = "llama"):
    import transformers

    if family == "gemma2":  # tied, and its embedding is Gemma2TextScaledWordEmbedding
        config = transformers.Gemma2Config(
            **_SHAPE, head_dim=8, query_pre_attn_scalar=8, sliding_window=8
        )
        model_class = transformers.Gemma2ForCausalLM
    else:
        config = transformers.LlamaConfig(**_SHAPE, tie_word_embeddings=family == "llama-tied")
        model_class = transformers.LlamaForCausalLM
    config._attn_implementation = "eager"
    model = model_class(config)
    if family == "llama-lora":  # a frozen base: its embedding and head run in frozen chunks
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    return model


class ChunkedLM(pl.LightningModule):
    """``build="eager"``: built in ``__init__``; else the path of saved weights, loaded by
    ``from_pretrained`` in ``configure_model`` (the meta-device path under yafsdp; DDP
    loads the same weights)."""

    def __init__(self, build: str, family: str = "llama") -> None:
        super().__init__()
        self.model = None
        self.build = build
        self.losses: list[float] = []
        if build == "eager":
            torch.manual_seed(0)
            self.model = _hf_llama(family)

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(self.build)

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader(world_size: int) -> DataLoader:
    """Two steps per epoch: the resumed run restarts at an epoch boundary (Lightning does
    not fast-forward a plain DataLoader mid-epoch)."""
    tokens = torch.randint(
        0, VOCAB, (2 * 2 * world_size, SEQ), generator=torch.Generator().manual_seed(3)
    )
    return DataLoader(tokens, batch_size=2, shuffle=False)


def _trainer(strategy, world_size: int, root, **options) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu", devices=world_size, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=str(root),
        gradient_clip_val=1.0,
    )  # fmt: skip
    defaults.update(options)
    return pl.Trainer(strategy=strategy, **defaults)


def _fit(strategy, build: str, world_size: int, root, family: str = "llama") -> dict:
    module = ChunkedLM(build, family)
    trainer = _trainer(strategy, world_size, root)
    trainer.fit(module, _loader(world_size))
    facts = {"losses": module.losses, "weights": full_weights(trainer, module)}
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None:
        facts["units"] = [unit.name for unit in engine.units]
        facts["slots"] = [buffer.tensor.numel() for buffer in engine.weight_buffers]
    return facts


def _parity_runs(build: str, world_size: int, root: str, family: str, options: dict) -> dict:
    torch.manual_seed(0)
    initial = {f"model.{k}": v.clone() for k, v in _hf_llama(family).state_dict().items()}
    return {
        "ddp": _fit("ddp", build, world_size, root, family),
        "yafsdp": _fit(YaFSDPStrategy(**options), build, world_size, root, family),
        "initial": initial,
    }


def _update_error(ours: dict, reference: dict, initial: dict) -> tuple[float, str]:
    worst = (0.0, "")
    for name, weight in reference.items():
        update = (weight - initial[name]).norm().item()
        if update:
            worst = max(worst, ((ours[name] - weight).norm().item() / update, name))
    return worst


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory) -> dict[str, str]:
    paths = {}
    for family in ("llama", "llama-tied"):
        paths[family] = str(tmp_path_factory.mktemp(f"chunked-{family}"))
        torch.manual_seed(0)
        _hf_llama(family).save_pretrained(paths[family])
    return paths


@pytest.fixture(scope="module")
def saved_llama(saved_models) -> str:
    return saved_models["llama"]


_PARITY = [
    ("llama", "eager", 1, {}),
    ("llama", "configure_model", 2, {}),
    ("llama", "eager", 2, {}),
    ("llama", "configure_model", 3, {}),
    # [Note: tied row chunks] one weight; the embedding's chunks first, the head's last.
    ("llama-tied", "configure_model", 2, {}),
    ("llama-tied", "eager", 3, {}),
    ("gemma2", "eager", 2, {}),  # tied, a scaled embedding subclass
    ("llama", "eager", 2, {"zero_stage": 2}),
    ("llama", "configure_model", 3, {"zero_stage": 2}),
    ("llama-tied", "eager", 2, {"zero_stage": 2}),
    # Hybrid sharding: chunks over each shard group, owned parts all-reduced across.
    ("llama", "eager", 4, {"shard_size": 2}),
    ("llama-tied", "configure_model", 4, {"shard_size": 2}),
    # LoRA on a frozen base: the frozen embedding and head run in chunks of frozen rows.
    ("llama-lora", "eager", 2, {}),
    ("llama-lora", "eager", 3, {"zero_stage": 2}),
]


@pytest.mark.parametrize(
    ("family", "build", "world_size", "options"),
    _PARITY,
    ids=["-".join(map(str, (f, b, w, *o.items()))) for f, b, w, o in _PARITY],
)
def test_chunked_hf_llama_matches_ddp(family, build, world_size, options, tmp_path, saved_models):
    build = saved_models[family] if build == "configure_model" else build
    runs = dist_run(
        world_size, _parity_runs, build, world_size, str(tmp_path), family, options,
        timeout_s=400,
    )  # fmt: skip
    for rank, run in enumerate(runs):
        ours, ddp = run["yafsdp"], run["ddp"]
        assert "model.embed_tokens[" in ours["units"][0], ours["units"]
        assert ".lm_head[" in ours["units"][-1], ours["units"]
        assert sum(".lm_head[" in name for name in ours["units"]) >= 5
        assert max(ours["slots"]) < VOCAB * 32 / 4  # block-sized, not vocabulary-sized
        torch.testing.assert_close(
            torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), rtol=_LOSS_RTOL, atol=0
        )
        error, where = _update_error(ours["weights"], ddp["weights"], run["initial"])
        tied_4 = family == "llama-tied" and world_size == 4
        rtol = _TIED_4_RANKS_UPDATE_RTOL if tied_4 else _UPDATE_RTOL
        assert error < rtol, f"rank {rank}: {where} off by {error:.3g} of its update"


def _resumed(strategy, root: str, saved: str) -> dict:
    """Two steps, a sharded checkpoint, then two more steps resumed from it."""
    first = ChunkedLM(saved)
    saver = ModelCheckpoint(dirpath=f"{root}/ckpt", save_last=True)
    trainer = _trainer(
        strategy(), 2, root, max_steps=2, enable_checkpointing=True, callbacks=[saver]
    )
    trainer.fit(first, _loader(2))
    second = ChunkedLM(saved)
    trainer = _trainer(strategy(), 2, root)
    trainer.fit(second, _loader(2), ckpt_path=f"{root}/ckpt/last.ckpt")
    return {"losses": first.losses + second.losses, "weights": full_weights(trainer, second)}


def _resume_runs(root: str, saved: str) -> dict:
    return {
        "ddp": _resumed(lambda: "ddp", f"{root}/ddp", saved),
        "yafsdp": _resumed(YaFSDPStrategy, f"{root}/yafsdp", saved),
        "initial": _saved_state(saved),
    }


def _saved_state(saved: str) -> dict:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(saved)
    return {f"model.{k}": v.clone() for k, v in model.state_dict().items()}


def test_a_chunked_run_resumed_from_a_sharded_checkpoint_matches_ddp_resumed(tmp_path, saved_llama):
    for run in dist_run(2, _resume_runs, str(tmp_path), saved_llama, timeout_s=300):
        ours, ddp = run["yafsdp"], run["ddp"]
        torch.testing.assert_close(
            torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), rtol=_LOSS_RTOL, atol=0
        )
        error, where = _update_error(ours["weights"], ddp["weights"], run["initial"])
        assert error < _UPDATE_RTOL, f"{where} off by {error:.3g} of its update"


class CompiledChunkedLM(ChunkedLM):
    """Compiled in ``configure_model``, per block or as a whole (``aot_eager``: eager
    kernels, so compiled yafsdp and compiled DDP agree to round-off)."""

    def __init__(self, build: str, compile_mode: str) -> None:
        super().__init__(build)
        self.compile_mode, self.compiled = compile_mode, False

    def configure_model(self) -> None:
        super().configure_model()
        if self.compiled:
            return
        self.compiled = True
        if self.compile_mode == "block":
            for layer in self.model.model.layers:
                layer.compile(backend="aot_eager")
        else:
            self.model = torch.compile(self.model, backend="aot_eager")


def _compiled_runs(compile_mode: str, root: str) -> dict:
    runs = {}
    for name in ("ddp", "yafsdp"):
        torch._dynamo.reset()
        module = CompiledChunkedLM("eager", compile_mode)
        trainer = _trainer(name, 2, f"{root}/{name}")
        trainer.fit(module, _loader(2))
        runs[name] = {"losses": module.losses, "weights": full_weights(trainer, module)}
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            runs[name]["units"] = [unit.name for unit in engine.units]
    torch.manual_seed(0)
    runs["initial"] = {f"model.{k}": v for k, v in _hf_llama().state_dict().items()}
    return runs


@pytest.mark.parametrize("compile_mode", ["block", "whole"])
def test_compiled_chunked_hf_llama_matches_compiled_ddp(compile_mode, tmp_path):
    for run in dist_run(2, _compiled_runs, compile_mode, str(tmp_path), timeout_s=400):
        ours, ddp = run["yafsdp"], run["ddp"]
        assert sum("lm_head[" in name for name in ours["units"]) >= 5
        torch.testing.assert_close(
            torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), rtol=_LOSS_RTOL, atol=0
        )
        weights = {k.replace("_orig_mod.", ""): v for k, v in ours["weights"].items()}
        expected = {k.replace("_orig_mod.", ""): v for k, v in ddp["weights"].items()}
        error, where = _update_error(weights, expected, run["initial"])
        assert error < _UPDATE_RTOL, f"{where} off by {error:.3g} of its update"
