"""Call patterns real models use: each trains exactly as under DDP, or is refused.

"Refused" means: the fit raised before any optimizer step, from lightning_yafsdp's own
code (a deliberate check, not an incidental failure deep in torch), with a message that
says what was found, why and the fix. Anything else (wrong numbers, a crash mid-run, a
hang) fails.

The patterns: a module shared across depth (ALBERT), a unit skipped in some steps
(LayerDrop) and parameters unused in a step, reentrant activation checkpointing (torch's
and Hugging Face's), a no-grad forward of the same model between forward and backward
(a DPO-style reference pass) with and without checkpointing, units returning a dataclass
or a plain object, an exception inside a unit's forward that the LightningModule catches
and retries, a model with no repeated block container, T5 (two block stacks), and units
called in a different order on different ranks (must fail every rank within seconds).

Every fit uses SGD without momentum or weight decay: DDP leaves the grad of a parameter
unused in a step at None and SGD skips it, while a flat shard always has a grad, so only
a zero grad (not a stale one) gives the same step. AdamW parity for skipped parameters
is a later issue.
"""

from __future__ import annotations

import re
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader
from transformers.models.albert.modeling_albert import AlbertLayer

import lightning_yafsdp  # noqa: F401 - registers strategy="yafsdp"
from lightning_yafsdp import YaFSDPStrategy
from tests.distributed import dist_run
from tests.zoo_models import FAMILIES, VOCAB, ZooRows, dist_run_each, full_weights, ranks_of

STEPS = 4
BATCH = 2
DIM = 32
LR = 0.1
# [Tolerance] same fp32 ops on the same weights; only reduction order differs. Measured
# on these models: bit for bit or a few 1e-7.
RTOL = 2e-6
_WEIGHT_SCALE_FLOOR = 1e-2  # see test_model_zoo: round-off-only tensors compare absolutely


# -- models ---------------------------------------------------------------------------------


class SimulatedOutOfMemory(RuntimeError):
    """What an out-of-memory error looks like to the LightningModule that retries."""


class Mlp(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(dim, 2 * dim)
        self.fc_out = nn.Linear(2 * dim, dim)
        self.fail_next_forward = False  # set by a test: raise once, mid-unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.fc_in(x))
        if self.fail_next_forward:
            self.fail_next_forward = False
            raise SimulatedOutOfMemory("simulated out of memory inside a unit's forward")
        return self.fc_out(hidden)


class Block(nn.Module):
    """A pre-norm residual block; ``gate`` (optional) is used only in the steps that set
    ``use_gate``."""

    def __init__(self, dim: int, *, gate: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim) if gate else None
        self.mlp = Mlp(dim)
        self.use_gate = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.mix(self.norm(x))
        if self.use_gate:
            h = h * torch.sigmoid(self.gate(h))
        return h + self.mlp(h)


@dataclass
class BlockOutput:
    """A unit output the engine cannot see into (not a tensor, tuple or dict)."""

    hidden: torch.Tensor
    scale: float


class Carry:
    """A plain object as a unit output."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


class DataclassBlock(Block):
    def forward(self, x):  # noqa: D102
        return BlockOutput(hidden=super().forward(x), scale=1.0)


class ObjectBlock(Block):
    def forward(self, x):  # noqa: D102
        return Carry(super().forward(x))


class StackLM(nn.Module):
    """Embedding, a ModuleList of blocks, a norm, a head.

    Args:
        block: the block class (its output may be a tensor, a ``BlockOutput`` or a
            ``Carry``).
        depth: number of blocks.
        reentrant_checkpointing: run each block under
            ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``.
        optional_parts: also build the parts some steps leave unused: a gate in every
            block and an extra head.
    """

    def __init__(
        self,
        *,
        block: type = Block,
        depth: int = 4,
        reentrant_checkpointing: bool = False,
        optional_parts: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(block(DIM, gate=optional_parts) for _ in range(depth))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.extra_head = nn.Linear(DIM, VOCAB) if optional_parts else None
        self.reentrant_checkpointing = reentrant_checkpointing
        self.skipped: set[int] = set()  # LayerDrop: block indices skipped this step
        self.use_extra_head = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for index, block in enumerate(self.blocks):
            if index in self.skipped:
                continue
            if self.reentrant_checkpointing:
                x = checkpoint(block, x, use_reentrant=True)
            else:
                x = block(x)
            x = x.hidden if isinstance(x, (BlockOutput, Carry)) else x
        x = self.norm(x)
        logits = self.head(x)
        if self.use_extra_head:
            logits = logits + self.extra_head(x)
        return logits


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x):  # noqa: D102
        return x + torch.tanh(self.proj(self.norm(x)))


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x):  # noqa: D102
        return x + self.down(F.relu(self.up(x)))


class FlatStackLM(nn.Module):
    """No repeated block container: differently named, differently shaped layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.encoder = Encoder()
        self.mixer = Mixer()
        self.refiner = Block(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):  # noqa: D102
        return self.head(self.refiner(self.mixer(self.encoder(self.embed(tokens)))))


def _albert() -> nn.Module:
    config = transformers.AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=16,
        hidden_size=DIM,
        intermediate_size=64,
        num_hidden_layers=4,  # one AlbertLayer, called four times per forward
        num_hidden_groups=1,
        inner_group_num=1,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
    )
    config._attn_implementation = "eager"
    return transformers.AlbertForMaskedLM(config)


# -- the LightningModule -------------------------------------------------------------------


class PatternModule(pl.LightningModule):
    """Trains one pattern's model; what happens in each step is the pattern's business.

    Args:
        pattern: a key of ``_PATTERNS``.
        rank_dependent: for "layerdrop": skip a different block on each rank.
    """

    def __init__(self, pattern: str, *, rank_dependent: bool = False) -> None:
        super().__init__()
        self.pattern = pattern
        self.rank_dependent = rank_dependent
        self.train_losses: list[float] = []
        self.retries = 0
        torch.manual_seed(0)
        self.model = _PATTERNS[pattern].build()

    def training_step(self, batch, batch_idx):
        self._prepare_step(batch_idx)
        if self.pattern == "exception":
            loss = self._loss_with_retry(batch)
        elif self.pattern.startswith("reference_pass"):
            loss = self._reference_pass_loss(batch)
        else:
            loss = self._loss(batch)
        self.train_losses.append(loss.item())
        return loss

    def _prepare_step(self, batch_idx: int) -> None:
        if self.pattern == "layerdrop":
            skipped = {2} if batch_idx in (1, 3) else set()
            if self.rank_dependent and batch_idx == 1:
                skipped = {1 + self.global_rank}  # rank 0 skips block 1, rank 1 block 2
            self.model.skipped = skipped
        elif self.pattern == "unused":
            # The gate of block 1 is used in steps 0 and 2 only; the extra head in step 1
            # only: each is used, then unused, in consecutive steps (a stale grad shows).
            self.model.blocks[1].use_gate = batch_idx in (0, 2)
            self.model.use_extra_head = batch_idx == 1
        elif self.pattern == "exception" and batch_idx == 2:
            self.model.blocks[1].mlp.fail_next_forward = True

    def _loss_with_retry(self, batch) -> torch.Tensor:
        try:
            return self._loss(batch)
        except SimulatedOutOfMemory:
            self.retries += 1  # an OOM handler: free what it can and try again
            return self._loss(batch)

    def _logits(self, batch) -> torch.Tensor:
        if isinstance(self.model, transformers.PreTrainedModel):
            return self.model(input_ids=batch["input_ids"]).logits
        return self.model(batch["input_ids"])

    def _loss(self, batch) -> torch.Tensor:
        if isinstance(self.model, transformers.PreTrainedModel):
            return self.model(**batch).loss
        logits = self.model(batch["input_ids"][:, :-1])
        targets = batch["input_ids"][:, 1:]
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def _reference_pass_loss(self, batch) -> torch.Tensor:
        # DPO-style: the policy forward, then a no-grad forward of the same model (the
        # reference), then one backward through the policy graph only.
        policy = F.log_softmax(self._logits(batch).float(), dim=-1)
        with torch.no_grad():
            reference = F.log_softmax(self._logits(batch).float(), dim=-1)
        task = F.nll_loss(policy[:, :-1].reshape(-1, VOCAB), batch["input_ids"][:, 1:].reshape(-1))
        return task + (policy.exp() * (policy - reference - 0.1)).sum(-1).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


@dataclass(frozen=True)
class Pattern:
    """How to build a pattern's model and which strategies it is compared under."""

    build: callable
    ddp: str = "ddp"
    yafsdp_options: tuple = ()


def _llama_with_hf_checkpointing(reentrant: bool | None) -> nn.Module:
    model = FAMILIES["llama"].build()
    kwargs = None if reentrant is None else {"use_reentrant": reentrant}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


_PATTERNS: dict[str, Pattern] = {
    "albert": Pattern(_albert, yafsdp_options=(("units", AlbertLayer),)),
    "layerdrop": Pattern(StackLM, ddp="ddp_find_unused_parameters_true"),
    "unused": Pattern(lambda: StackLM(optional_parts=True), ddp="ddp_find_unused_parameters_true"),
    "torch_reentrant": Pattern(lambda: StackLM(reentrant_checkpointing=True)),
    "hf_reentrant": Pattern(lambda: _llama_with_hf_checkpointing(True)),
    "reference_pass": Pattern(FAMILIES["llama"].build),
    "reference_pass_checkpointed": Pattern(lambda: _llama_with_hf_checkpointing(None)),
    "dataclass_output": Pattern(lambda: StackLM(block=DataclassBlock)),
    "object_output": Pattern(lambda: StackLM(block=ObjectBlock)),
    "exception": Pattern(StackLM),
    "flat_stack": Pattern(FlatStackLM),
    "flat_stack_named_units": Pattern(
        FlatStackLM,
        yafsdp_options=(("units", ["model.encoder", "model.mixer", "model.refiner"]),),
    ),
}


# -- running them ----------------------------------------------------------------------------


def _trainer(strategy, **overrides) -> pl.Trainer:
    options = dict(
        accelerator="cpu",
        devices=2,
        precision="32-true",
        max_steps=STEPS,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    options.update(overrides)
    return pl.Trainer(strategy=strategy, **options)


def _loader(pattern: str) -> DataLoader:
    inputs = "masked" if pattern == "albert" else "causal"
    return DataLoader(ZooRows(inputs, STEPS * BATCH * 2), batch_size=BATCH, shuffle=False)


def _fit(pattern: str, strategy, *, rank_dependent: bool = False) -> dict:
    """One fit as plain facts; an exception is returned with where it was raised."""
    started = time.monotonic()
    model = PatternModule(pattern, rank_dependent=rank_dependent)
    trainer = None
    try:
        trainer = _trainer(strategy)
        trainer.fit(model, _loader(pattern))
    except Exception as err:  # noqa: BLE001 - the tests judge the error
        return {
            "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc(),
            "raised_in": traceback.extract_tb(err.__traceback__)[-1].filename,
            "steps": trainer.global_step if trainer is not None else 0,
            "losses": model.train_losses,
            "seconds": time.monotonic() - started,
        }
    facts = {"error": None, "losses": model.train_losses, "steps": trainer.global_step}
    facts["final"] = full_weights(trainer, model)
    facts["retries"] = model.retries
    facts["seconds"] = time.monotonic() - started
    if isinstance(trainer.strategy, YaFSDPStrategy):
        facts["units"] = [unit.name for unit in trainer.strategy.engine.blocks()]
    return facts


def _yafsdp(pattern: str) -> YaFSDPStrategy:
    return YaFSDPStrategy(timeout=timedelta(seconds=60), **dict(_PATTERNS[pattern].yafsdp_options))


def _pattern_runs(patterns: list[str]) -> dict:
    runs = {}
    for pattern in patterns:
        if pattern == "t5_units":
            runs[pattern] = _t5_units()
            continue
        runs[pattern] = {
            "ddp": _fit(pattern, _PATTERNS[pattern].ddp),
            "yafsdp": _fit(pattern, _yafsdp(pattern)),
        }
    return runs


_OWN_MODEL_PATTERNS = [
    "layerdrop",
    "unused",
    "torch_reentrant",
    "dataclass_output",
    "object_output",
    "exception",
    "flat_stack",
    "flat_stack_named_units",
]
_HF_PATTERNS = [
    "albert",
    "hf_reentrant",
    "reference_pass",
    "reference_pass_checkpointed",
    "t5_units",
]


@pytest.fixture(scope="module")
def own_model_runs() -> dict:
    return dist_run_each(2, _pattern_runs, _OWN_MODEL_PATTERNS, timeout_s=300, alone_timeout_s=120)


@pytest.fixture(scope="module")
def hf_runs() -> dict:
    return dist_run_each(2, _pattern_runs, _HF_PATTERNS, timeout_s=300, alone_timeout_s=120)


def _t5_units() -> dict:
    from tests.zoo_models import ZooModule, zoo_loader

    model = ZooModule("t5")
    trainer = _trainer("yafsdp", max_steps=1)
    try:
        trainer.fit(model, zoo_loader("t5", 4))
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()}
    return {"error": None, "units": [unit.name for unit in trainer.strategy.engine.blocks()]}


# -- judging ---------------------------------------------------------------------------------


def _weights_error(actual: dict, expected: dict) -> tuple[float, str]:
    assert sorted(actual) == sorted(expected)
    worst, where = 0.0, ""
    for name, reference in expected.items():
        scale = max(reference.abs().max().item(), _WEIGHT_SCALE_FLOOR)
        error = (actual[name] - reference).abs().max().item() / scale
        if error > worst:
            worst, where = error, name
    return worst, where


def _assert_refused_before_training(run: dict) -> None:
    # Before the first optimizer step: no weight was ever updated from wrong numbers.
    assert run["steps"] == 0, (
        f"failed after {run['steps']} optimizer steps, not refused up front:\n{run['traceback']}"
    )
    assert "lightning_yafsdp" in run["raised_in"], (
        f"not a deliberate refusal by lightning_yafsdp (raised in {run['raised_in']}):\n"
        f"{run['traceback']}"
    )
    assert len(run["error"]) > 80, f"too terse to say what, why and the fix: {run['error']}"


def _assert_exact_or_refused(results: dict, pattern: str) -> str:
    """Returns "exact" or "refused" (the same on every rank)."""
    outcomes = set()
    for rank, facts in enumerate(ranks_of(results, pattern)):
        ddp, ours = facts["ddp"], facts["yafsdp"]
        assert ddp["error"] is None, ddp["traceback"]
        if ours["error"] is not None:
            _assert_refused_before_training(ours)
            outcomes.add(f"refused: {ours['error']}")
            continue
        assert len(ours["losses"]) == len(ddp["losses"]) == STEPS, (rank, ours["losses"])
        torch.testing.assert_close(
            torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), rtol=RTOL, atol=0
        )
        error, where = _weights_error(ours["final"], ddp["final"])
        assert error <= RTOL, f"rank {rank}: final {where} off by {error:.3g}"
        outcomes.add("exact")
    assert len(outcomes) == 1, f"ranks disagree: {outcomes}"
    outcome = outcomes.pop()
    print(f"{pattern}: {outcome}")
    return outcome.split(":")[0]


# -- the tests -------------------------------------------------------------------------------


def test_module_shared_across_depth_albert_is_exact_or_refused(hf_runs):
    _assert_exact_or_refused(hf_runs, "albert")


def test_unit_skipped_in_some_steps_same_on_every_rank_is_exact_or_refused(own_model_runs):
    _assert_exact_or_refused(own_model_runs, "layerdrop")


def test_parameters_unused_in_a_step_get_no_stale_grad(own_model_runs):
    _assert_exact_or_refused(own_model_runs, "unused")


def test_torch_reentrant_activation_checkpointing_is_exact_or_refused(own_model_runs):
    _assert_exact_or_refused(own_model_runs, "torch_reentrant")


def test_hugging_face_reentrant_gradient_checkpointing_is_exact_or_refused(hf_runs):
    _assert_exact_or_refused(hf_runs, "hf_reentrant")


def test_no_grad_reference_pass_between_forward_and_backward_is_exact_or_refused(hf_runs):
    _assert_exact_or_refused(hf_runs, "reference_pass")


def test_no_grad_reference_pass_with_gradient_checkpointing_is_exact_or_refused(hf_runs):
    _assert_exact_or_refused(hf_runs, "reference_pass_checkpointed")


def test_unit_returning_a_dataclass_is_exact_or_refused(own_model_runs):
    _assert_exact_or_refused(own_model_runs, "dataclass_output")


def test_unit_returning_a_plain_object_is_exact_or_refused(own_model_runs):
    _assert_exact_or_refused(own_model_runs, "object_output")


def test_exception_inside_a_unit_then_retry_trains_exactly_like_ddp(own_model_runs):
    # Refusing is not an option here: the next step must run normally.
    for facts in ranks_of(own_model_runs, "exception"):
        ours = facts["yafsdp"]
        assert ours["error"] is None, ours["traceback"]
        assert ours["retries"] == facts["ddp"]["retries"] == 1
    _assert_exact_or_refused(own_model_runs, "exception")


def test_model_without_repeated_blocks_is_auto_sharded_or_told_what_to_pass(own_model_runs):
    outcome = _assert_exact_or_refused(own_model_runs, "flat_stack")
    for facts in ranks_of(own_model_runs, "flat_stack"):
        ours = facts["yafsdp"]
        if outcome == "refused":
            # Exactly what to pass: the model's own layers, not the wrapper holding all of
            # them (one unit for the whole model would shard nothing one at a time).
            assert "units=" in ours["error"], ours["error"]
            assert re.search(r"model\.(encoder|mixer|refiner)", ours["error"]), ours["error"]
        else:
            assert len(ours["units"]) >= 2, ours["units"]  # sharded, not one replicated group


def test_model_without_repeated_blocks_given_units_by_name_is_exact(own_model_runs):
    assert _assert_exact_or_refused(own_model_runs, "flat_stack_named_units") == "exact"
    for facts in ranks_of(own_model_runs, "flat_stack_named_units"):
        units = facts["yafsdp"]["units"]
        assert units == ["model.encoder", "model.mixer", "model.refiner"]


def test_t5_encoder_and_decoder_blocks_are_both_units(hf_runs):
    for run in ranks_of(hf_runs, "t5_units"):
        assert run["error"] is None, run["error"]
        encoder = [name for name in run["units"] if ".encoder.block." in name]
        decoder = [name for name in run["units"] if ".decoder.block." in name]
        assert len(encoder) == 2 and len(decoder) == 2, run["units"]


# -- units called differently on different ranks ---------------------------------------------


def _per_rank_layerdrop() -> dict:
    return _fit("layerdrop", _yafsdp("layerdrop"), rank_dependent=True)


def test_units_called_in_a_different_order_on_each_rank_fail_every_rank_within_seconds():
    # Rank 0 skips block 1 and rank 1 skips block 2 in the same step: their collectives
    # no longer pair up (and, the blocks being the same size, could silently swap shards).
    runs = dist_run(2, _per_rank_layerdrop, timeout_s=120)
    for rank, run in enumerate(runs):
        print(f"rank {rank} after {run.get('seconds', 0):.1f} s: {run['error']}")
        assert run["error"] is not None, f"rank {rank} trained on mismatched collectives"
        assert re.search(r"(?i)mismatch|order|differ", run["error"]), run["traceback"]
        assert run["seconds"] < 30, (rank, run["seconds"], run["error"])
