"""Damaged or partial checkpoints are refused with one line naming the bad file.

One 2-rank Lightning run writes a sharded checkpoint directory and a single-file one
(module fixture); each test copies one and damages the copy the way a full disk, a
killed copy or a lost rank's file would: a truncated shard, a truncated ``meta.pt``,
no ``.metadata``, no ``__1_0.distcp``, a truncated single file. ``yafsdp inspect``
names the file (exit 2), ``yafsdp export`` refuses and writes nothing,
``Trainer.fit(ckpt_path=...)`` raises before loading (rank 0 names the file, rank 1
points to rank 0) and ``load_from_checkpoint`` refuses too. No test may change a file
of the damaged checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_yafsdp.checkpoint import DamagedCheckpointError
from lightning_yafsdp.cli.main import main
from lightning_yafsdp.strategy import YaFSDPStrategy
from tests.distributed import dist_run
from tests.lightning_models import CausalLMModule, quiet_trainer, token_loader


def _write_checkpoints(root: str) -> None:
    """One optimizer step, saved as a sharded directory and as one file."""
    trainer = quiet_trainer("yafsdp", root)
    trainer.fit(CausalLMModule(), token_loader(4))
    trainer.save_checkpoint(f"{root}/checkpoints/step-1.ckpt")
    trainer = quiet_trainer(YaFSDPStrategy(state_dict_type="full"), root)
    trainer.fit(CausalLMModule(), token_loader(4))
    trainer.save_checkpoint(f"{root}/checkpoints/full-step-1.ckpt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    dist_run(2, _write_checkpoints, str(root), timeout_s=240)
    return root / "checkpoints"


def _truncate(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as stream:
        stream.truncate(size // 2)


def _truncate_shard(ckpt: Path) -> Path:
    _truncate(ckpt / "__0_0.distcp")
    return ckpt / "__0_0.distcp"


def _truncate_meta(ckpt: Path) -> Path:
    _truncate(ckpt / "meta.pt")
    return ckpt / "meta.pt"


def _delete_metadata(ckpt: Path) -> Path:
    (ckpt / ".metadata").unlink()
    return ckpt / ".metadata"


def _delete_rank_file(ckpt: Path) -> Path:
    (ckpt / "__1_0.distcp").unlink()
    return ckpt / "__1_0.distcp"


def _truncate_single_file(ckpt: Path) -> Path:
    _truncate(ckpt)
    return ckpt


def _without_manifest(damage: Callable[[Path], Path]) -> Callable[[Path], Path]:
    """The same damage to a directory saved before manifests existed (sizes from .metadata)."""

    def damage_old_checkpoint(ckpt: Path) -> Path:
        (ckpt / "yafsdp-manifest.json").unlink()
        return damage(ckpt)

    return damage_old_checkpoint


# kind -> (which saved checkpoint, how it is damaged, words the message must hold)
DAMAGE: dict[str, tuple[str, Callable[[Path], Path], str]] = {
    "truncated shard": ("step-1.ckpt", _truncate_shard, "is truncated: "),
    "truncated meta.pt": ("step-1.ckpt", _truncate_meta, "is truncated: "),
    "missing .metadata": ("step-1.ckpt", _delete_metadata, "is missing"),
    "missing rank file": ("step-1.ckpt", _delete_rank_file, "is missing (rank 1's data"),
    "truncated single file": ("full-step-1.ckpt", _truncate_single_file, "is truncated"),
    "old: truncated shard": ("step-1.ckpt", _without_manifest(_truncate_shard), "is truncated: "),
    "old: truncated meta.pt": (
        "step-1.ckpt",
        _without_manifest(_truncate_meta),
        "is truncated or corrupt",
    ),
    "old: missing rank file": (
        "step-1.ckpt",
        _without_manifest(_delete_rank_file),
        "is missing (rank 1's data; .metadata lists it)",
    ),
}


def _damaged_copy(saved: Path, tmp_path: Path, kind: str) -> tuple[Path, Path]:
    """``(checkpoint, bad file)``: a damaged copy in a checkpoints/ folder with a sibling."""
    name, damage, _ = DAMAGE[kind]
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    copy = shutil.copytree if (saved / name).is_dir() else shutil.copy2
    copy(saved / name, folder / name)
    copy(saved / name, folder / "earlier.ckpt")  # an intact sibling the message suggests
    return folder / name, damage(folder / name)


def _tree_hash(path: Path) -> dict[str, str]:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _assert_one_line_naming(message: str, bad_file: Path, kind: str) -> None:
    assert "\n" not in message.strip()
    assert repr(str(bad_file)) in message, message
    assert DAMAGE[kind][2] in message, message
    assert "earlier.ckpt" in message, message  # what to load instead


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_inspect_names_the_damaged_file_and_exits_2(saved, tmp_path, capsys, kind) -> None:
    checkpoint, bad_file = _damaged_copy(saved, tmp_path, kind)
    before = _tree_hash(checkpoint)

    assert main(["inspect", str(checkpoint)]) == 2

    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("yafsdp inspect: ")
    _assert_one_line_naming(captured.err, bad_file, kind)
    assert _tree_hash(checkpoint) == before


@pytest.mark.parametrize("kind", ["truncated shard", "missing rank file", "truncated single file"])
def test_export_of_a_damaged_checkpoint_writes_nothing(saved, tmp_path, capsys, kind) -> None:
    checkpoint, bad_file = _damaged_copy(saved, tmp_path, kind)
    before = _tree_hash(checkpoint)
    out = tmp_path / "export"

    assert main(["export", str(checkpoint), str(out)]) == 2

    _assert_one_line_naming(capsys.readouterr().err, bad_file, kind)
    assert not out.exists()
    assert _tree_hash(checkpoint) == before


def test_an_intact_checkpoint_is_inspected_as_verified(saved, capsys) -> None:
    for name in ("step-1.ckpt", "full-step-1.ckpt"):
        assert main(["inspect", str(saved / name), "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["verified"] == "sizes and file structure"
        assert info["world_size"] == 2
    assert main(["inspect", str(saved / "step-1.ckpt"), "--json", "--verify"]) == 0
    verified = json.loads(capsys.readouterr().out)["verified"]
    assert verified == "sizes, file structure and CRC-32 checksums"


def test_inspect_verify_finds_a_changed_byte_that_sizes_cannot(saved, tmp_path, capsys) -> None:
    checkpoint = tmp_path / "checkpoints" / "step-1.ckpt"
    shutil.copytree(saved / "step-1.ckpt", checkpoint)
    shard = checkpoint / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, other contents
    shard.write_bytes(bytes(data))
    before = _tree_hash(checkpoint)

    assert main(["inspect", str(checkpoint)]) == 0  # sizes alone cannot tell
    capsys.readouterr()
    assert main(["inspect", str(checkpoint), "--verify"]) == 2

    message = capsys.readouterr().err
    assert "\n" not in message.strip()
    assert repr(str(shard)) in message and "does not match its checksum" in message, message
    assert _tree_hash(checkpoint) == before


def test_load_from_checkpoint_refuses_a_damaged_checkpoint(saved, tmp_path) -> None:
    checkpoint, bad_file = _damaged_copy(saved, tmp_path, "truncated shard")
    before = _tree_hash(checkpoint)

    with pytest.raises(DamagedCheckpointError) as raised:
        CausalLMModule.load_from_checkpoint(checkpoint)

    _assert_one_line_naming(str(raised.value), bad_file, "truncated shard")
    assert _tree_hash(checkpoint) == before


def _fit_from(checkpoints: list[str], **strategy_kwargs) -> list[tuple[str, str, bool]]:
    """Per checkpoint: the error's type and message, and whether the weights changed."""
    outcomes = []
    for checkpoint in checkpoints:
        model = CausalLMModule()
        strategy = YaFSDPStrategy(**strategy_kwargs)
        trainer = quiet_trainer(strategy, str(Path(checkpoint).parent.parent))
        weights = None
        try:
            trainer.fit(model, token_loader(4), ckpt_path=checkpoint)
        except Exception as err:  # noqa: BLE001 - returned to the test to assert on
            weights = trainer.strategy.engine.full_state_dict()  # the model as left
            outcomes.append((type(err).__name__, str(err), _same(weights, CausalLMModule())))
        else:
            outcomes.append(("no error", "", False))
    return outcomes


def _same(weights: dict, fresh: CausalLMModule) -> bool:
    import torch

    reference = fresh.state_dict()
    return all(torch.equal(weights[k], reference[k]) for k in weights)


def test_fit_from_a_damaged_checkpoint_stops_before_loading(saved, tmp_path) -> None:
    damaged = {}
    for kind in ("truncated shard", "truncated single file"):
        folder = tmp_path / kind.replace(" ", "-")
        folder.mkdir()
        damaged[kind] = _damaged_copy(saved, folder, kind)
    before = {kind: _tree_hash(ckpt) for kind, (ckpt, _) in damaged.items()}

    ranks = dist_run(2, _fit_from, [str(c) for c, _ in damaged.values()], timeout_s=240)

    for kind, rank0, rank1 in zip(damaged, ranks[0], ranks[1], strict=True):
        checkpoint, bad_file = damaged[kind]
        assert rank0[0] == "DamagedCheckpointError", rank0
        _assert_one_line_naming(rank0[1], bad_file, kind)
        assert rank1[0] == "DamagedCheckpointError", rank1
        assert rank1[1].startswith("rank 0 reported that checkpoint"), rank1
        assert rank0[2] and rank1[2], "the model's weights were changed"
        assert _tree_hash(checkpoint) == before[kind]


def _flip_a_byte_in_the_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other contents: only a checksum can tell
    path.write_bytes(bytes(data))


def _flipped_copies(saved: Path, tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    """``{kind: (checkpoint, flipped file)}``: rank 1's shard, and a single-file checkpoint."""
    copies = {}
    for kind, name, inside in (
        ("flipped shard", "step-1.ckpt", "__1_0.distcp"),
        ("flipped single file", "full-step-1.ckpt", None),
    ):
        folder = tmp_path / kind.replace(" ", "-") / "checkpoints"
        folder.mkdir(parents=True)
        copy = shutil.copytree if (saved / name).is_dir() else shutil.copy2
        copy(saved / name, folder / name)
        copy(saved / name, folder / "earlier.ckpt")
        bad_file = folder / name / inside if inside else folder / name
        _flip_a_byte_in_the_middle(bad_file)
        copies[kind] = (folder / name, bad_file)
    return copies


def test_fit_from_a_checkpoint_with_a_flipped_byte_stops_before_loading(saved, tmp_path) -> None:
    # Rank 1 compares the checksum of the shard it wrote, __1_0.distcp: rank 0 still
    # names it ([Note: checksums on load]).
    flipped = _flipped_copies(saved, tmp_path)
    before = {kind: _tree_hash(ckpt) for kind, (ckpt, _) in flipped.items()}

    ranks = dist_run(2, _fit_from, [str(c) for c, _ in flipped.values()], timeout_s=240)

    for kind, rank0, rank1 in zip(flipped, ranks[0], ranks[1], strict=True):
        checkpoint, bad_file = flipped[kind]
        assert rank0[0] == "DamagedCheckpointError", rank0
        message = rank0[1]
        assert "\n" not in message.strip()
        assert repr(str(bad_file)) in message, message
        assert "does not match its checksum" in message, message
        assert "verify_checksums=False" in message, message  # the way out, if on purpose
        assert rank1[0] == "DamagedCheckpointError", rank1
        assert rank1[1].startswith("rank 0 reported that checkpoint"), rank1
        assert rank0[2] and rank1[2], "the model's weights were changed"
        assert _tree_hash(checkpoint) == before[kind]


def test_fit_with_verify_checksums_false_resumes_from_a_flipped_byte(saved, tmp_path) -> None:
    flipped = _flipped_copies(saved, tmp_path)

    ranks = dist_run(
        2, _fit_from, [str(c) for c, _ in flipped.values()], verify_checksums=False, timeout_s=240
    )

    assert ranks[0] == ranks[1] == [("no error", "", False)] * 2
