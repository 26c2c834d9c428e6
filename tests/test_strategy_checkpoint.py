"""Lightning checkpoints with strategy="yafsdp": save, ModelCheckpoint, resume, reshard, convert.

Every Trainer here runs on real gloo ranks (tests/distributed.py). Two multi-rank
runs do everything and return plain facts; the tests assert
on them (and on the files they leave) one behaviour each:

- ``_two_rank_runs``: a straight 6-step fit with two ``ModelCheckpoint`` callbacks
  (top-k + ``save_last=True``, and ``save_last="link"``) that records the weights
  after every step and calls ``trainer.save_checkpoint`` after step 3; a 3-step fit
  that does the same with ``state_dict_type="full"``, and one under DDP; a new
  Trainer resuming each of the three to step 6 with ``fit(ckpt_path=...)``.
- ``_one_rank_runs``: the 2-rank checkpoints validated and resumed on 1 rank.

The step-3 saves are taken where ``ModelCheckpoint(every_n_train_steps=...)`` takes
them, in ``on_train_batch_end`` of the epoch's last batch (an epoch is 3 steps here),
and every epoch visits the rows in the same order. Then Lightning resumes exactly
where the straight run went on. (From a save taken after ``fit`` returned or at the
epoch's end, Lightning 2.6.6 restarts the data of the next epoch after one batch;
from a save in the middle of an epoch it replays that epoch's batches; with its
shuffling sampler a resumed epoch draws another permutation. It does all of that
under ``strategy="ddp"`` too, bit for bit.)
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_yafsdp import YaFSDPStrategy
from lightning_yafsdp.checkpoint import (
    CheckpointSaveError,
    consolidate_checkpoint,
    consolidated_state_dict,
    is_sharded_checkpoint,
)
from tests.distributed import dist_run
from tests.lightning_models import CausalLMModule, RankTaggedTokens, fixed_batch

BATCH = 2
STEPS_PER_EPOCH = 3
ROWS = STEPS_PER_EPOCH * BATCH * 2  # one epoch over both ranks
LR = 1e-2
EXACT = 0.0
DDP_PARITY = 1e-5  # relative: yafsdp vs ddp are the same math reduced in another order


class ScheduledLM(CausalLMModule):
    """The shared tiny Llama with a per-step StepLR; ``seed != 0`` starts from other weights."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(lr=LR)
        if seed:
            torch.manual_seed(seed)
            self.model = self._build()

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def _loader(num_rows: int = ROWS) -> DataLoader:
    """Each rank its own rows, in the same order every epoch (needs the process group)."""
    dataset = RankTaggedTokens(num_rows)
    sampler = DistributedSampler(dataset, shuffle=False)
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler)


def _lr_after(steps: int) -> float:
    return LR * 0.5 ** (steps // 2)


class _SaveAfterStep(pl.Callback):
    """``trainer.save_checkpoint(path)`` once ``step`` optimizer steps are done."""

    def __init__(self, path: str, step: int = STEPS_PER_EPOCH) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class _RecordWeights(pl.Callback):
    """Rank 0 keeps the full weights after every optimizer step (a collective gather)."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        full = trainer.strategy.engine.full_state_dict()
        if trainer.is_global_zero:
            self.weights[trainer.global_step] = {k: v.clone() for k, v in full.items()}


def _trainer(strategy, root: str, **overrides) -> pl.Trainer:
    options = dict(
        accelerator="cpu",
        devices=2,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=root,
        use_distributed_sampler=False,  # see _loader
    )
    options.update(overrides)
    return pl.Trainer(strategy=strategy, **options)


def _full_weights(trainer: pl.Trainer) -> dict[str, torch.Tensor] | None:
    full = trainer.strategy.engine.full_state_dict()  # collective
    return {k: v.clone() for k, v in full.items()} if trainer.is_global_zero else None


@torch.no_grad()
def _outputs(model: pl.LightningModule) -> torch.Tensor:
    model.eval()
    return model(fixed_batch()).float()


def _run_facts(model: ScheduledLM, trainer: pl.Trainer, **extra) -> dict:
    """What the tests compare of one fit (``weights`` on rank 0 only)."""
    return {
        "losses": list(model.train_losses),
        "weights": _full_weights(trainer),
        "global_step": trainer.global_step,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        **extra,
    }


# -- the spawned runs ----------------------------------------------------------------------


def _two_rank_runs(root: str) -> dict:
    facts: dict = {}
    top_k = ModelCheckpoint(
        dirpath=f"{root}/top_k",
        every_n_train_steps=2,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last=True,
    )
    linked = ModelCheckpoint(dirpath=f"{root}/linked", every_n_train_steps=2, save_last="link")
    callbacks = [top_k, linked, _RecordWeights(), _SaveAfterStep(f"{root}/step3-sharded.ckpt")]
    model = ScheduledLM()
    trainer = _trainer("yafsdp", root, max_steps=6, enable_checkpointing=True, callbacks=callbacks)
    trainer.fit(model, _loader())
    facts["straight"] = _run_facts(model, trainer, outputs=_outputs(model))
    facts["weights_at"] = callbacks[2].weights
    facts["top_k"] = {
        "best_k": sorted(Path(p).name for p in top_k.best_k_models),
        "last": Path(top_k.last_model_path).name,
    }
    trainer.save_checkpoint(f"{root}/weights-only", weights_only=True)
    try:
        trainer.save_checkpoint(f"{root}/notes")  # a directory that is not a checkpoint
    except CheckpointSaveError as err:
        facts["refused"] = str(err)

    for name, strategy in (
        ("full", YaFSDPStrategy(state_dict_type="full")),
        ("ddp", "ddp"),
    ):
        first = ScheduledLM()
        save = _SaveAfterStep(f"{root}/step3-{name}.ckpt")
        _trainer(strategy, root, max_steps=3, callbacks=[save]).fit(first, _loader())
        facts[f"first-{name}"] = first.train_losses

    for name, strategy in (
        ("sharded", "yafsdp"),
        ("full", YaFSDPStrategy(state_dict_type="full")),
        ("ddp", "yafsdp"),
    ):
        resumed = ScheduledLM(seed=1)  # other weights: the load must overwrite them all
        trainer = _trainer(strategy, root, max_steps=6)
        trainer.fit(resumed, _loader(), ckpt_path=f"{root}/step3-{name}.ckpt")
        facts[f"resumed-{name}"] = _run_facts(resumed, trainer)
    del first, resumed, trainer
    gc.collect()  # no DDP module may outlive the process group (an abort at exit)
    return facts


def _one_rank_runs(root: str) -> dict:
    facts: dict = {}
    model = ScheduledLM(seed=1)
    trainer = _trainer("yafsdp", root, devices=1, limit_val_batches=1)
    trainer.validate(model, _loader(2), ckpt_path=f"{root}/top_k/last.ckpt", verbose=False)
    facts["validated_outputs"] = _outputs(model)
    facts["validated_weights"] = _full_weights(trainer)

    model = ScheduledLM(seed=1)
    finds_last = ModelCheckpoint(dirpath=f"{root}/linked", save_top_k=0)  # for "last"
    trainer = _trainer(
        "yafsdp", root, devices=1, max_steps=8, enable_checkpointing=True, callbacks=[finds_last]
    )
    trainer.fit(model, _loader(), ckpt_path="last")  # linked/last.ckpt, a symlink
    facts["resumed_from"] = Path(trainer.ckpt_path).name
    facts["resumed"] = _run_facts(model, trainer)
    return facts


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lightning-ckpt")


@pytest.fixture(scope="module")
def two_ranks(root) -> dict:
    (root / "notes").mkdir()
    (root / "notes" / "keep.txt").write_text("not a checkpoint")
    return dist_run(2, _two_rank_runs, str(root), timeout_s=240)[0]


@pytest.fixture(scope="module")
def one_rank(root, two_ranks) -> dict:
    return dist_run(1, _one_rank_runs, str(root), timeout_s=180)[0]


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# -- exact resume ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_three_steps_save_and_resume_three_steps_equals_six_straight_steps(two_ranks, kind):
    straight, resumed = two_ranks["straight"], two_ranks[f"resumed-{kind}"]
    first = straight["losses"][:3] if kind == "sharded" else two_ranks["first-full"]
    assert first + resumed["losses"] == straight["losses"]
    assert len(straight["losses"]) == 6
    assert resumed["global_step"] == straight["global_step"] == 6
    assert resumed["lr"] == straight["lr"] == _lr_after(6)  # the scheduler resumed too
    assert _max_difference(resumed["weights"], straight["weights"]) == EXACT


def test_sharded_save_is_a_directory_and_full_save_one_file(root, two_ranks):
    assert is_sharded_checkpoint(root / "step3-sharded.ckpt")
    assert (root / "step3-sharded.ckpt" / "meta.pt").is_file()
    assert (root / "step3-full.ckpt").is_file()
    assert not [p.name for p in root.iterdir() if "yafsdp-" in p.name]  # no temporaries left


def test_saving_over_a_directory_that_is_not_a_checkpoint_is_refused(root, two_ranks):
    assert "is a directory that is not a sharded checkpoint" in two_ranks["refused"]
    assert (root / "notes" / "keep.txt").read_text() == "not a checkpoint"


def test_a_full_checkpoint_loads_with_load_from_checkpoint(root, two_ranks):
    model = ScheduledLM.load_from_checkpoint(root / "step3-full.ckpt", seed=1)
    assert _max_difference(model.state_dict(), two_ranks["weights_at"][3]) == EXACT


# -- ModelCheckpoint -----------------------------------------------------------------------------


def test_model_checkpoint_top_k_keeps_the_best_directories_and_a_last_copy(root, two_ranks):
    # Steps 1-3 are epoch 0, steps 4-6 epoch 1; step 2's checkpoint was rotated out.
    names = ["epoch=1-step=4.ckpt", "epoch=1-step=6.ckpt"]
    assert two_ranks["top_k"] == {"best_k": names, "last": "last.ckpt"}
    assert sorted(p.name for p in (root / "top_k").iterdir()) == [*names, "last.ckpt"]
    for name in [*names, "last.ckpt"]:
        assert is_sharded_checkpoint(root / "top_k" / name), name
    for step, name in ((4, names[0]), (6, names[1]), (6, "last.ckpt")):
        weights = consolidated_state_dict(root / "top_k" / name)
        assert _max_difference(weights, two_ranks["weights_at"][step]) == EXACT, name


def test_save_last_link_is_a_symlink_to_the_latest_checkpoint_directory(root, two_ranks):
    linked = root / "linked"
    assert sorted(p.name for p in linked.iterdir()) == ["epoch=1-step=6.ckpt", "last.ckpt"]
    assert (linked / "last.ckpt").is_symlink()
    assert os.readlink(linked / "last.ckpt") == "epoch=1-step=6.ckpt"
    weights = consolidated_state_dict(linked / "last.ckpt")
    assert _max_difference(weights, two_ranks["straight"]["weights"]) == EXACT


def test_a_weights_only_save_holds_no_optimizer_state(root, two_ranks):
    checkpoint = consolidate_checkpoint(root / "weights-only")
    assert "optimizer_0" not in checkpoint and "lr_schedulers" not in checkpoint
    assert checkpoint["global_step"] == 6
    assert _max_difference(checkpoint["model"], two_ranks["straight"]["weights"]) == EXACT


# -- another world size ----------------------------------------------------------------------------


def test_a_two_rank_checkpoint_validates_on_one_rank_with_identical_outputs(two_ranks, one_rank):
    assert torch.equal(one_rank["validated_outputs"], two_ranks["straight"]["outputs"])
    assert _max_difference(one_rank["validated_weights"], two_ranks["straight"]["weights"]) == 0


def test_a_two_rank_checkpoint_resumes_training_on_one_rank(one_rank):
    resumed = one_rank["resumed"]
    assert one_rank["resumed_from"] == "last.ckpt"
    assert resumed["global_step"] == 8
    assert len(resumed["losses"]) == 2 and all(math.isfinite(x) for x in resumed["losses"])
    assert resumed["lr"] == _lr_after(8)


# -- other strategies and Lightning's tools --------------------------------------------------


def test_a_ddp_checkpoint_resumes_in_yafsdp(two_ranks):
    straight, resumed = two_ranks["straight"], two_ranks["resumed-ddp"]
    assert resumed["global_step"] == 6 and resumed["lr"] == _lr_after(6)
    torch.testing.assert_close(
        torch.tensor(two_ranks["first-ddp"] + resumed["losses"]),
        torch.tensor(straight["losses"]),
        rtol=DDP_PARITY,
        atol=0,
    )
    for name, value in straight["weights"].items():
        scale = value.abs().max()
        assert (resumed["weights"][name] - value).abs().max() <= DDP_PARITY * scale, name


def test_lightning_consolidation_of_a_sharded_checkpoint_loads_into_the_plain_module(
    root, two_ranks, tmp_path
):
    output = tmp_path / "consolidated.ckpt"
    subprocess.run(
        [sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint"]
        + [str(root / "top_k" / "epoch=1-step=4.ckpt"), "--output_file", str(output)],
        check=True,
        capture_output=True,
    )
    expected = two_ranks["weights_at"][4]
    loaded = ScheduledLM.load_from_checkpoint(output, seed=1)
    assert _max_difference(loaded.state_dict(), expected) == EXACT

    checkpoint = torch.load(output, weights_only=False)
    plain = ScheduledLM(seed=1)
    plain.load_state_dict(checkpoint["state_dict"], strict=True)
    assert _max_difference(plain.state_dict(), expected) == EXACT
    assert checkpoint["global_step"] == 4
    assert checkpoint["lr_schedulers"][0]["last_epoch"] == 4
    names = set(checkpoint["optimizer_states"][0]["state"])
    assert names == {n for n, _ in plain.named_parameters()}


# -- arguments (no processes) ------------------------------------------------------------------


def test_state_dict_type_is_validated():
    assert YaFSDPStrategy().state_dict_type == "sharded"
    assert YaFSDPStrategy(state_dict_type="full").state_dict_type == "full"
    with pytest.raises(ValueError, match="'sharded' or 'full'"):
        YaFSDPStrategy(state_dict_type="local")


def test_storage_options_are_refused():
    with pytest.raises(TypeError, match="storage_options"):
        YaFSDPStrategy().save_checkpoint({}, "ckpt", storage_options={"compress": True})
