"""The YaLM practices, each shown acting in a real 2-rank YaFSDP run (or on the model)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_yafsdp.config import CurriculumConfig, load_config
from lightning_yafsdp.models.llama import RMSNorm
from lightning_yafsdp.training import Curriculum
from lightning_yafsdp.training.models import build_model
from tests.distributed import dist_run

_SMALL_RUN = [
    "data.max_bytes=300000",
    "data.seq_len=64",
    "data.batch_size=4",
    "trainer.limit_val_batches=0",
    "trainer.log_every_n_steps=1",
    "trainer.progress_bar=false",
    "schedule.warmup_steps=0",
    "schedule.decay=constant",
]
NAN_STEP = 5


class _BlowUpWeights(pl.Callback):
    """At step NAN_STEP, on every rank, every master shard becomes NaN (a divergence)."""

    def __init__(self) -> None:
        self.done = False
        self.finite_at_end = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == NAN_STEP and not self.done:
            self.done = True
            with torch.no_grad():
                for param in pl_module.parameters():
                    param.fill_(math.nan)
            trainer.strategy.engine.mark_weights_changed()

    def on_train_end(self, trainer, pl_module) -> None:
        self.finite_at_end = all(bool(torch.isfinite(p).all()) for p in pl_module.parameters())


def _metrics(run_dir: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((run_dir / "logs" / "metrics.csv").open()))


def _practice_runs(out_dir: str) -> dict:
    from lightning_yafsdp.training.runner import train

    common = [*_SMALL_RUN, f"trainer.output_dir={out_dir}"]
    curriculum = load_config(
        None,
        [
            *common,
            "trainer.run_name=curriculum",
            "trainer.max_steps=6",
            "practices.curriculum.enabled=true",
            "practices.curriculum.start_seq_len=16",
            "practices.curriculum.start_batch_size=2",
            "practices.curriculum.warmup_steps=4",
            "practices.thermometers.enabled=true",
            "practices.thermometers.every_n_steps=2",
        ],
    )
    curriculum_facts = train(curriculum, show=False)
    blow_up = _BlowUpWeights()
    guard = load_config(
        None,
        [
            *common,
            "trainer.run_name=guard",
            "trainer.max_steps=10",
            "practices.divergence_guard.enabled=true",
            "practices.divergence_guard.snapshot_every_n_steps=2",
            "practices.divergence_guard.skip_batches=1",
            "practices.divergence_guard.lr_cut=0.5",
        ],
    )
    guard_facts = train(guard, show=False, extra_callbacks=[blow_up])
    return {
        "curriculum": curriculum_facts,
        "guard": guard_facts,
        "finite_at_end": blow_up.finite_at_end,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("practices")
    result = dist_run(2, _practice_runs, str(out_dir), timeout_s=240)[0]
    result["dir"] = out_dir
    return result


# -- curriculum ----------------------------------------------------------------------------


def test_curriculum_schedule_grows_linearly_in_multiples() -> None:
    config = CurriculumConfig(enabled=True, start_seq_len=32, warmup_steps=10, multiple_of=16)
    curriculum = Curriculum(config, seq_len=128, batch_size=8)
    assert [curriculum.seq_len_at(s) for s in (0, 5, 10, 50)] == [32, 80, 128, 128]
    assert curriculum.crop(torch.zeros(8, 129), 0).shape == (8, 33)


def test_curriculum_changes_sequence_length_at_the_scheduled_step(runs: dict) -> None:
    rows = [r for r in _metrics(runs["dir"] / "curriculum") if r.get("curriculum/seq_len")]
    seq = {int(r["step"]): float(r["curriculum/seq_len"]) for r in rows}
    batch = {int(r["step"]): float(r["curriculum/batch_size"]) for r in rows}
    # 16 -> 64 over 4 steps, multiples of 8: 16, 28->24, 40, 52->48, then 64.
    assert [seq[s] for s in range(6)] == [16, 24, 40, 48, 64, 64]
    assert [batch[s] for s in range(6)] == [2, 2, 3, 3, 4, 4]
    # Tokens counted as trained: the cropped batches, on both ranks.
    expected = sum(int(seq[s]) * int(batch[s]) for s in range(6)) * 2
    assert runs["curriculum"]["tokens"] == expected


# -- thermometers --------------------------------------------------------------------------


def test_thermometers_log_unit_extremes_and_grad_norm_every_n_steps(runs: dict) -> None:
    rows = _metrics(runs["dir"] / "curriculum")
    measured = {int(r["step"]): r for r in rows if r.get("thermo/grad_norm")}
    assert sorted(measured) == [0, 2, 4]
    row = measured[2]
    for unit in range(4):
        for point in (f"model.layers.{unit}", f"model.layers.{unit}.attention"):
            high, low = float(row[f"thermo/{point}/act_max"]), float(row[f"thermo/{point}/act_min"])
            assert low < 0 < high
    assert float(row["thermo/grad_norm"]) > 0


# -- divergence guard ------------------------------------------------------------------------


def test_guard_rolls_back_on_nan_and_skips_the_batch(runs: dict) -> None:
    facts = runs["guard"]
    (rollback,) = facts["rollbacks"]
    assert rollback["step"] == NAN_STEP and rollback["reason"] == "nan"
    assert rollback["restored_step"] == 4  # the latest snapshot (every 2 healthy steps)
    # The offending batch and skip_batches=1 more trained nothing.
    assert facts["skipped_steps"] == [NAN_STEP, NAN_STEP + 1]
    rows = _metrics(runs["dir"] / "guard")
    losses = {int(r["step"]): float(r["train_loss"]) for r in rows if r.get("train_loss")}
    assert sorted(losses) == [0, 1, 2, 3, 4, 7, 8, 9]
    assert all(math.isfinite(losses[s]) and losses[s] < losses[0] for s in (7, 8, 9))
    events = [r for r in rows if r.get("guard/rollback")]
    assert [int(r["step"]) for r in events] == [NAN_STEP]
    assert runs["finite_at_end"]


def test_guard_cuts_the_learning_rate_after_a_rollback(runs: dict) -> None:
    rows = _metrics(runs["dir"] / "guard")
    lrs = {int(r["step"]): float(r["lr"]) for r in rows if r.get("lr")}
    assert lrs[4] == lrs[0]
    assert lrs[NAN_STEP + 3] == pytest.approx(lrs[0] * 0.5)
    assert runs["guard"]["rollbacks"][0]["lr_scale"] == 0.5


# -- model switches ----------------------------------------------------------------------------


def test_embedding_norm_switch_adds_a_norm_after_the_embedding() -> None:
    with torch.device("meta"):
        plain = build_model(load_config(None))
        normed = build_model(load_config(None, ["practices.embedding_norm=true"]))
    assert plain.embedding_norm is None and isinstance(normed.embedding_norm, RMSNorm)


def test_dropout_is_off_by_default_and_switchable() -> None:
    with torch.device("meta"):
        default = build_model(load_config(None))
        dropped = build_model(load_config(None, ["practices.dropout=0.1"]))
    assert not any(isinstance(m, nn.Dropout) for m in default.modules())
    assert any(isinstance(m, nn.Dropout) for m in dropped.modules())


def test_loss_softmax_runs_in_fp32_under_bf16() -> None:
    from lightning_yafsdp.training.module import CausalLMModule

    module = CausalLMModule(load_config(None, ["practices.fp32_loss=true"]))
    module.model = nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 256)).to(torch.bfloat16)
    seen = {}
    original = torch.nn.functional.cross_entropy

    def spy(logits, target, **kwargs):
        seen["dtype"] = logits.dtype
        return original(logits, target, **kwargs)

    torch.nn.functional.cross_entropy = spy
    try:
        module.loss(torch.randint(0, 256, (2, 9)))
    finally:
        torch.nn.functional.cross_entropy = original
    assert seen["dtype"] == torch.float32
