"""Checkpoints: exact resume, resharding, atomic saves, clear load errors, export.

Real gloo ranks (tests/distributed.py); the model, optimizer and data of every
run come from tests/checkpoint_scenarios.py.
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_yafsdp.checkpoint import (
    CheckpointMismatchError,
    CheckpointSaveError,
    NotACheckpointError,
    consolidate_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from lightning_yafsdp.cli.checkpoints import render_inspection
from lightning_yafsdp.core.optim.sharded_param import range_to_boxes
from lightning_yafsdp.export import export_checkpoint
from tests import checkpoint_scenarios as sc
from tests.distributed import RankFailedError, dist_run

EXACT = 0.0
ACROSS_WORLD_SIZES = 1e-5  # reductions in another order: float round-off only


def test_an_element_range_splits_into_boxes_that_cover_exactly_that_range():
    rng = random.Random(0)
    for _ in range(500):
        shape = [rng.randint(1, 5) for _ in range(rng.randint(0, 4))]
        total = math.prod(shape)
        start = rng.randint(0, total)
        end = rng.randint(start, total)
        full = torch.arange(total).view(shape)
        covered = []
        for offsets, sizes in range_to_boxes(shape, start, end):
            region = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
            covered += region.reshape(-1).tolist()
        assert covered == list(range(start, end))
        assert len(range_to_boxes(shape, start, end)) <= max(1, 2 * len(shape) - 1)


# -- exact round trip and resume -------------------------------------------------------------


def _resume_exactly(root: str) -> dict:
    model, engine, optimizer = sc.build_sharded()
    sc.train_steps(model, optimizer, range(3))
    saved = sc.full_weights(engine)
    save_checkpoint(f"{root}/sharded", engine, optimizers=[optimizer], extra={"step": 3})
    save_checkpoint(f"{root}/full.pt", engine, optimizers=[optimizer], state_dict_type="full")
    sc.train_steps(model, optimizer, range(3, 6))
    straight = sc.full_weights(engine)
    result = {}
    for name in ("sharded", "full.pt"):
        model, engine, optimizer = sc.build_sharded(seed=1)  # different init: load must overwrite
        extra = load_checkpoint(f"{root}/{name}", engine, optimizers=[optimizer])
        loaded = sc.full_weights(engine)
        sc.train_steps(model, optimizer, range(3, 6))
        result[name] = {
            "round_trip": sc.max_difference(loaded, saved),
            "resumed": sc.max_difference(sc.full_weights(engine), straight),
            "step": extra.get("step"),
        }
    return result


def test_three_steps_save_resume_three_steps_equals_six_straight_steps(tmp_path):
    result = dist_run(2, _resume_exactly, str(tmp_path))[0]
    assert result["sharded"] == {"round_trip": EXACT, "resumed": EXACT, "step": 3}
    assert result["full.pt"] == {"round_trip": EXACT, "resumed": EXACT, "step": None}


# -- resharding ------------------------------------------------------------------------------------


def _save_at_step_3(path: str) -> dict:
    model, engine, optimizer = sc.build_sharded()
    sc.train_steps(model, optimizer, range(3))
    save_checkpoint(path, engine, optimizers=[optimizer], extra={"global_step": 3, "epoch": 0})
    result = {"outputs": sc.outputs(model), "weights": sc.full_weights(engine)}
    sc.train_steps(model, optimizer, range(3, 6))
    result["continued"] = sc.full_weights(engine)
    return result


def _load_and_continue(path: str) -> dict:
    model, engine, optimizer = sc.build_sharded(seed=1)
    load_checkpoint(path, engine, optimizers=[optimizer])
    result = {"outputs": sc.outputs(model), "weights": sc.full_weights(engine)}
    sc.train_steps(model, optimizer, range(3, 6))
    result["continued"] = sc.full_weights(engine)
    return result


@pytest.fixture(scope="module")
def checkpoint_at_2(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "step-3"
    return path, dist_run(2, _save_at_step_3, str(path))[0]


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_checkpoint_of_2_ranks_loads_at_another_world_size_and_training_continues(
    checkpoint_at_2, world_size
):
    path, written = checkpoint_at_2
    loaded = dist_run(world_size, _load_and_continue, str(path))[0]
    assert torch.equal(loaded["outputs"], written["outputs"])
    assert sc.max_difference(loaded["weights"], written["weights"]) == EXACT
    assert sc.max_difference(loaded["continued"], written["continued"]) < ACROSS_WORLD_SIZES


def test_lightning_consolidation_utility_yields_full_shapes_that_load_strictly(
    checkpoint_at_2, tmp_path
):
    path, written = checkpoint_at_2
    output = tmp_path / "consolidated.ckpt"
    subprocess.run(
        [sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(path)]
        + ["--output_file", str(output)],
        check=True,
        capture_output=True,
    )
    checkpoint = torch.load(output, weights_only=False)
    model = sc.build_llama(seed=1)
    model.load_state_dict(checkpoint["state_dict"], strict=True)
    assert torch.equal(sc.outputs(model), written["outputs"])
    assert checkpoint["global_step"] == 3
    names = set(checkpoint["optimizer_states"][0]["state"])
    assert names == {n for n, _ in model.named_parameters()}
    # our own consolidation reads the same directory without Lightning
    ours = consolidate_checkpoint(path)
    assert ours["model"].keys() == checkpoint["state_dict"].keys()
    assert all(torch.equal(ours["model"][k], checkpoint["state_dict"][k]) for k in ours["model"])


def test_inspect_reports_step_world_size_parameter_count_and_size(checkpoint_at_2):
    path, _ = checkpoint_at_2
    info = inspect_checkpoint(path)
    model = sc.build_llama()
    assert info["kind"] == "sharded"
    assert info["step"] == 3 and info["epoch"] == 0
    assert info["world_size"] == 2
    assert info["parameter_count"] == sum(p.numel() for p in model.parameters())
    assert info["num_optimizers"] == 1
    assert info["size_bytes"] == sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    from rich.console import Console

    console = Console(record=True, width=100)
    console.print(render_inspection(info))
    assert "2 rank(s)" in console.export_text()


# -- atomic saves ---------------------------------------------------------------------------------


def _save_then_die_mid_save(path: str, pid_dir: str, reference: str) -> None:
    model, engine, optimizer = sc.build_sharded()
    sc.train_steps(model, optimizer, range(3))
    save_checkpoint(path, engine, optimizers=[optimizer])
    sc.train_steps(model, optimizer, range(3, 6))
    if dist.get_rank() == 0:
        torch.save(sc.full_weights(engine), reference)
    else:
        sc.full_weights(engine)
    sc.install_pause(pid_dir)  # the next save stops before its commit
    save_checkpoint(path, engine, optimizers=[optimizer])


def _resume_after_crash(path: str) -> dict:
    model, engine, optimizer = sc.build_sharded(seed=1)
    load_checkpoint(path, engine, optimizers=[optimizer])
    sc.train_steps(model, optimizer, range(3, 6))
    weights = sc.full_weights(engine)
    save_checkpoint(path, engine, optimizers=[optimizer])  # cleans the dead save's leftovers
    return weights


def _kill_when_paused(pid_dir: Path, deadline: float) -> None:
    while time.monotonic() < deadline:
        if (pid_dir / "paused").exists():
            os.kill(int((pid_dir / "paused").read_text()), signal.SIGKILL)
            return
        time.sleep(0.05)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_resumable_exactly(tmp_path):
    path, pid_dir, reference = tmp_path / "ckpt", tmp_path / "pids", tmp_path / "ref.pt"
    pid_dir.mkdir()
    killer = threading.Thread(target=_kill_when_paused, args=(pid_dir, time.monotonic() + 60))
    killer.start()
    with pytest.raises(RankFailedError, match="SIGKILL"):
        dist_run(2, _save_then_die_mid_save, str(path), str(pid_dir), str(reference))
    killer.join()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt")]
    assert leftovers == [".ckpt.yafsdp-tmp"]  # the dead save's partial files
    weights = dist_run(2, _resume_after_crash, str(path))[0]
    assert sc.max_difference(weights, torch.load(reference)) == EXACT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "pids", "ref.pt"]


def _save_to(path: str) -> dict:
    model, engine, optimizer = sc.build_sharded()
    sc.train_steps(model, optimizer, range(2))
    before = sc.full_weights(engine)
    errors = {}
    for kind in ("sharded", "full"):
        try:
            save_checkpoint(path, engine, optimizers=[optimizer], state_dict_type=kind)
        except CheckpointSaveError as exc:
            errors[kind] = str(exc)
    unchanged = sc.max_difference(sc.full_weights(engine), before)
    sc.train_steps(model, optimizer, range(2, 3))  # training goes on
    return {"errors": errors, "unchanged": unchanged}


def test_saving_to_an_unwritable_path_raises_a_clear_error_on_every_rank(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    results = dist_run(2, _save_to, str(blocker / "ckpt"))
    for result in results:
        assert result["unchanged"] == EXACT
        assert set(result["errors"]) == {"sharded", "full"}
        for message in result["errors"].values():
            assert "rank 0:" in message and "a-file" in message
            assert "previous checkpoint" in message


# -- load errors ----------------------------------------------------------------------


def _load_errors(root: str) -> dict:
    model, engine, optimizer = sc.build_sharded()
    save_checkpoint(f"{root}/ok", engine, optimizers=[optimizer])
    Path(f"{root}/empty").mkdir()
    errors = {}

    def attempt(label, path, **build):
        model, engine, optimizer = sc.build_sharded(seed=1, **build)
        before = sc.full_weights(engine)
        try:
            load_checkpoint(path, engine, optimizers=[optimizer])
        except (NotACheckpointError, CheckpointMismatchError) as exc:
            errors[label] = (type(exc).__name__, str(exc))
        assert sc.max_difference(sc.full_weights(engine), before) == EXACT, label

    attempt("missing path", f"{root}/nope")
    attempt("not a checkpoint", f"{root}/empty")
    attempt("more layers", f"{root}/ok", n_layers=3)
    attempt("other vocab", f"{root}/ok", vocab_size=96)
    model, engine, optimizer = sc.build_sharded(seed=1)
    before = sc.full_weights(engine)
    try:
        second = torch.optim.SGD(engine.sharded_parameters(), lr=0.1)
        load_checkpoint(f"{root}/ok", engine, optimizers=[optimizer, second])
    except CheckpointMismatchError as exc:
        errors["two optimizers"] = (type(exc).__name__, str(exc))
    assert sc.max_difference(sc.full_weights(engine), before) == EXACT
    return errors


def test_load_errors_say_what_is_wrong_and_leave_the_model_untouched(tmp_path):
    errors = dist_run(1, _load_errors, str(tmp_path))[0]
    assert errors["missing path"][0] == "NotACheckpointError"
    assert "does not exist" in errors["missing path"][1]
    assert errors["not a checkpoint"][0] == "NotACheckpointError"
    assert "no .metadata" in errors["not a checkpoint"][1]
    kind, message = errors["more layers"]
    assert kind == "CheckpointMismatchError"
    assert "missing from the checkpoint: 'layers.2.attention.wk.weight'" in message
    kind, message = errors["other vocab"]
    assert "shape mismatch: 'output.weight': checkpoint (64, 32), model (96, 32)" in message
    assert "1 optimizer(s) but 2 were given" in errors["two optimizers"][1]


# -- cross-strategy: plain full state dicts in, exports out ----------------------------


def _resume_from_unsharded(path: str) -> dict:
    model, engine, optimizer = sc.build_sharded(seed=1, single_group=True)
    load_checkpoint(path, engine, optimizers=[optimizer])
    sc.train_steps(model, optimizer, range(3, 6))
    return sc.full_weights(engine)


def test_a_ddp_style_checkpoint_resumes_in_a_sharded_run(tmp_path):
    model = sc.build_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sc.train_steps(model, optimizer, range(3))
    checkpoint = {
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "global_step": 3,
    }
    torch.save(checkpoint, tmp_path / "ddp.ckpt")
    sc.train_steps(model, optimizer, range(3, 6))
    weights = dist_run(2, _resume_from_unsharded, str(tmp_path / "ddp.ckpt"))[0]
    assert sc.max_difference(weights, dict(model.state_dict())) < ACROSS_WORLD_SIZES


def _hf_save(path: str) -> torch.Tensor:
    model = _tiny_hf_llama()
    from lightning_yafsdp.core import shard_model

    engine = shard_model(model)
    optimizer = torch.optim.AdamW(engine.param_groups(), lr=1e-2)
    tokens = sc.probe_tokens()
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    save_checkpoint(path, engine, optimizers=[optimizer])
    with torch.no_grad():
        return model(tokens).logits


def _tiny_hf_llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=sc.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config)


def test_an_export_of_an_hf_llama_loads_with_from_pretrained(tmp_path):
    import transformers

    logits = dist_run(2, _hf_save, str(tmp_path / "ckpt"))[0]
    config = _tiny_hf_llama().config
    weights = export_checkpoint(tmp_path / "ckpt", tmp_path / "export", hf_config=config)
    assert weights.name == "model.safetensors"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    with torch.no_grad():
        assert torch.allclose(loaded(sc.probe_tokens()).logits, logits, atol=1e-6)
    pt = export_checkpoint(tmp_path / "ckpt", tmp_path / "export-pt", fmt="pt")
    plain = _tiny_hf_llama()
    plain.load_state_dict(torch.load(pt), strict=True)
    with torch.no_grad():
        assert torch.allclose(plain(sc.probe_tokens()).logits, logits, atol=1e-6)
