"""Background checkpoint saves (``YaFSDPStrategy(async_save=True)``) on real gloo ranks.

- A 12-step fit with ``ModelCheckpoint`` every 3 steps, saving in the background: the
  step-6 write is held until step 7 has changed the weights in place (so the staged
  copy is what is written), the directory does not exist yet when step 7 starts, and
  resuming from it runs steps 7-12 exactly as the uninterrupted run.
- A rank killed (SIGKILL) while a background write is paused before its commit leaves
  the previous checkpoint at that path intact and resumable.
- A background write that fails is said in one line at the next step and raised at the
  end of the fit.
- Fabric: a ``fabric.save`` written in the background while training goes on resumes
  exactly.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_yafsdp import YaFSDPStrategy
from lightning_yafsdp.checkpoint import CheckpointSaveError, atomic, sharded
from lightning_yafsdp.checkpoint.verify import MANIFEST_FILENAME
from tests import checkpoint_scenarios as sc
from tests.distributed import RankFailedError, dist_run
from tests.test_strategy_checkpoint import ScheduledLM, _full_weights, _loader, _trainer

EXACT = 0.0
STEPS = 12


class _HoldWriteUntilStep7(pl.Callback):
    """Holds the step-6 background write (in its thread) until step 7's optimizer step.

    So the write starts after training changed the parameters and optimizer state in
    place: only a staged copy still holds step 6. At step 7's start it records whether
    the step-6 directory existed: it must not, since its write is waiting.
    """

    def __init__(self, path: Path) -> None:
        self.path, self.released = path, threading.Event()
        self.committed_at_step_7: bool | None = None
        self._write = sharded._write_sharded

    def write(self, path: Path, *args, **kwargs) -> None:
        if Path(path) == self.path:
            assert self.released.wait(timeout=120), "step 7 never ended"
        self._write(path, *args, **kwargs)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 6:
            self.committed_at_step_7 = self.path.exists()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 7:
            self.released.set()


def _async_fit_and_resume(root: str) -> dict:
    checkpoints = Path(root, "ckpts")
    held = _HoldWriteUntilStep7(checkpoints / "step=6.ckpt")
    sharded._write_sharded = held.write
    every_3 = ModelCheckpoint(
        dirpath=checkpoints, filename="{step}", every_n_train_steps=3, save_top_k=-1
    )
    model = ScheduledLM()
    strategy = YaFSDPStrategy(async_save=True)
    trainer = _trainer(
        strategy, root, max_steps=STEPS, enable_checkpointing=True, callbacks=[every_3, held]
    )
    trainer.fit(model, _loader())
    sharded._write_sharded = held._write
    straight = {"losses": list(model.train_losses), "weights": _full_weights(trainer)}

    resumed = ScheduledLM(seed=1)  # other weights: the load must overwrite them all
    trainer = _trainer(YaFSDPStrategy(async_save=True), root, max_steps=STEPS)
    trainer.fit(resumed, _loader(), ckpt_path=str(checkpoints / "step=6.ckpt"))
    return {
        "straight": straight,
        "resumed": {"losses": list(resumed.train_losses), "weights": _full_weights(trainer)},
        "committed_at_step_7": held.committed_at_step_7,
        "saved": sorted(p.name for p in checkpoints.iterdir()),
        "manifests": [(checkpoints / n / MANIFEST_FILENAME).is_file() for n in ("step=6.ckpt",)],
    }


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("async")
    return dist_run(2, _async_fit_and_resume, str(root), timeout_s=300)[0]


def test_a_background_save_returns_before_its_commit(async_runs):
    assert async_runs["committed_at_step_7"] is False
    assert async_runs["saved"] == [f"step={s}.ckpt" for s in (12, 3, 6, 9)]
    assert all(async_runs["manifests"])


def test_the_step_6_background_checkpoint_resumes_to_step_12_exactly(async_runs):
    straight, resumed = async_runs["straight"], async_runs["resumed"]
    assert resumed["losses"] == straight["losses"][6:]
    weights = resumed["weights"]
    assert weights.keys() == straight["weights"].keys()
    for name, tensor in straight["weights"].items():
        assert (weights[name] - tensor).abs().max().item() == EXACT, name


# -- kill -9 during a background write -------------------------------------------------------


class _SaveAtSteps3And6(pl.Callback):
    """``trainer.save_checkpoint(path)`` at steps 3 and 6; the step-6 write pauses forever."""

    def __init__(self, path: str, pid_dir: str, reference: str) -> None:
        self.path, self.pid_dir, self.reference = path, pid_dir, reference

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 3:
            weights = _full_weights(trainer)
            if trainer.is_global_zero:
                torch.save(weights, self.reference)
            trainer.save_checkpoint(self.path)
        if trainer.global_step == 6:
            trainer.strategy.wait_for_checkpoint()  # step 3 is committed
            sc.install_pause(self.pid_dir)  # the next write stops before its commit
            trainer.save_checkpoint(self.path)


def _fit_until_killed(path: str, pid_dir: str, reference: str) -> None:
    save = _SaveAtSteps3And6(path, pid_dir, reference)
    trainer = _trainer(YaFSDPStrategy(async_save=True), str(Path(path).parent), max_steps=STEPS)
    trainer.callbacks.append(save)
    trainer.fit(ScheduledLM(), _loader())


def _weights_loaded_from(path: str) -> dict | None:
    trainer = _trainer(YaFSDPStrategy(async_save=True), str(Path(path).parent))
    module = ScheduledLM(seed=1)
    trainer.validate(module, _loader(2), ckpt_path=path, verbose=False)
    return _full_weights(trainer)


def _kill_when_paused(pid_dir: Path, deadline: float) -> None:
    while time.monotonic() < deadline:
        if (pid_dir / "paused").exists():
            os.kill(int((pid_dir / "paused").read_text()), signal.SIGKILL)
            return
        time.sleep(0.05)


def test_a_kill_during_a_background_write_leaves_the_previous_checkpoint_resumable(tmp_path):
    path, pid_dir, reference = tmp_path / "last.ckpt", tmp_path / "pids", tmp_path / "ref.pt"
    pid_dir.mkdir()
    killer = threading.Thread(target=_kill_when_paused, args=(pid_dir, time.monotonic() + 120))
    killer.start()
    with pytest.raises(RankFailedError, match="SIGKILL"):
        dist_run(2, _fit_until_killed, str(path), str(pid_dir), str(reference), timeout_s=240)
    killer.join()
    assert (tmp_path / f".last.ckpt{atomic.TMP_SUFFIX}").is_dir()  # the dead write's files

    weights = dist_run(2, _weights_loaded_from, str(path), timeout_s=240)[0]

    expected = torch.load(reference)
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], v) for k, v in expected.items())


# -- a failed background write ---------------------------------------------------------------


class _SaveOnceAt(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 2:
            trainer.save_checkpoint(self.path)


def _fit_with_a_failing_background_save(root: str) -> dict:
    Path(root, "a-file").write_text("a file, not a directory")
    trainer = _trainer(YaFSDPStrategy(async_save=True), root, max_steps=6)
    trainer.callbacks.append(_SaveOnceAt(f"{root}/a-file/ckpt"))
    model = ScheduledLM()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, _loader())
            error = None
        except CheckpointSaveError as exc:
            error = str(exc)
    said = [str(w.message) for w in caught if "background checkpoint save failed" in str(w.message)]
    return {"error": error, "said": said, "steps": trainer.global_step}


def test_a_failed_background_write_is_said_at_the_next_step_and_raised_at_the_end(tmp_path):
    facts = dist_run(2, _fit_with_a_failing_background_save, str(tmp_path), timeout_s=240)
    for rank, result in enumerate(facts):
        assert result["steps"] == 6  # training went on
        assert result["error"] is not None and "a-file" in result["error"]
        assert "\n" not in result["error"]
        assert "previous checkpoint" in result["error"]
        if rank == 0:
            assert len(result["said"]) == 1 and "a-file" in result["said"][0]
            assert "\n" not in result["said"][0]


def test_async_save_with_full_checkpoints_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="state_dict_type='sharded'"):
        YaFSDPStrategy(async_save=True, state_dict_type="full")


# -- Fabric ----------------------------------------------------------------------------------


def _fabric_async_save_and_resume(root: str) -> dict:
    from lightning_yafsdp.fabric import YaFSDPStrategy as FabricStrategy
    from tests import fabric_loops as fl

    fabric = fl.make_fabric(FabricStrategy(async_save=True))
    model = fabric.setup_module(fl.build_llama())
    optimizer = fabric.setup_optimizers(fl.decay_split_adamw(model))
    losses = fl.train_steps(fabric, model, optimizer, range(3))
    fabric.save(f"{root}/step-3", {"model": model, "optimizer": optimizer, "step": 3})
    losses += fl.train_steps(fabric, model, optimizer, range(3, fl.STEPS))  # while it writes
    fabric.strategy.wait_for_checkpoint()

    fabric = fl.make_fabric(FabricStrategy(async_save=True))
    model = fabric.setup_module(fl.build_llama())
    optimizer = fabric.setup_optimizers(fl.decay_split_adamw(model))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(f"{root}/step-3", state)
    resumed = fl.train_steps(fabric, model, optimizer, range(state["step"], fl.STEPS))
    fabric.strategy.teardown()
    return {"losses": losses, "resumed": resumed}


def test_a_fabric_background_save_resumes_exactly(tmp_path):
    for facts in dist_run(2, _fabric_async_save_and_resume, str(tmp_path), timeout_s=240):
        assert facts["resumed"] == facts["losses"][3:]


def test_the_recipe_key_strategy_async_save_reaches_the_strategy():
    from lightning_yafsdp.config import load_config
    from lightning_yafsdp.estimate import estimate
    from lightning_yafsdp.training.runner import build_strategy

    for flag in (False, True):
        config = load_config(None, [f"strategy.async_save={str(flag).lower()}"])
        strategy = build_strategy(config, estimate(config, world_size=1))
        assert strategy.options.async_save is flag
