"""A save that cannot write (a full disk, a file size limit) fails in one line, losing nothing.

The write really fails at the OS: each rank lowers its ``RLIMIT_FSIZE`` (with ``SIGXFSZ``
ignored, so a write past the limit returns ``EFBIG`` instead of killing the process)
around ``trainer.save_checkpoint`` onto an existing checkpoint of the same name, the
way a disk that fills up during a save fails every write after a point. Every rank
must raise the same one-line ``CheckpointSaveError`` naming the checkpoint, the bytes a
save needs and that the previous checkpoint is intact; that checkpoint must be
byte-identical, no ``.NAME.yafsdp-tmp`` may be left, and once the limit is lifted the
same Trainer saves again ([Note: a failed write is one line]).
"""

from __future__ import annotations

import hashlib
import resource
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest

from lightning_yafsdp.checkpoint import verify_checkpoint
from lightning_yafsdp.strategy import YaFSDPStrategy
from tests.distributed import dist_run
from tests.lightning_models import CausalLMModule, quiet_trainer, token_loader

# Far below a shard (about 200 kB here): the first data write fails.
FILE_SIZE_LIMIT_BYTES = 4096


@contextmanager
def _file_size_limit(nbytes: int):
    """Writes past ``nbytes`` in any file fail with EFBIG (OSError) in this process."""
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)


def _tree_hash(path: Path) -> dict[str, str]:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _save_onto_a_checkpoint_while_writes_fail(root: str, state_dict_type: str) -> dict:
    trainer = quiet_trainer(YaFSDPStrategy(state_dict_type=state_dict_type), root)
    trainer.fit(CausalLMModule(), token_loader(4))
    path = Path(root) / "checkpoints" / "last.ckpt"
    trainer.save_checkpoint(path)
    before = _tree_hash(path)
    error = None
    with _file_size_limit(FILE_SIZE_LIMIT_BYTES):
        try:
            trainer.save_checkpoint(path)
        except Exception as exc:  # noqa: BLE001 - returned to the test to assert on
            error = (type(exc).__name__, str(exc))
    trainer.strategy.barrier()
    facts = {
        "error": error,
        "intact": _tree_hash(path) == before,
        "left in the folder": sorted(p.name for p in path.parent.iterdir()),
    }
    trainer.save_checkpoint(path)  # the limit lifted, the same run saves again
    return facts


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_a_save_that_cannot_write_fails_in_one_line_and_keeps_the_previous_checkpoint(
    tmp_path, state_dict_type
) -> None:
    ranks = dist_run(
        2, _save_onto_a_checkpoint_while_writes_fail, str(tmp_path), state_dict_type,
        timeout_s=240,
    )  # fmt: skip

    path = tmp_path / "checkpoints" / "last.ckpt"
    for facts in ranks:
        kind, message = facts["error"]
        assert kind == "CheckpointSaveError", message
        assert "\n" not in message, message
        assert repr(str(path)) in message, message
        # The OS's reason, or torch.save's short write (its C++ writer drops the errno).
        assert "File too large" in message or "could not write the whole file" in message
        assert "needs at least" in message and "bytes" in message, message
        assert "room for both" in message, message
        assert "previous checkpoint at that path, if any, is intact" in message, message
        assert facts["intact"], "the previous checkpoint changed"
        assert facts["left in the folder"] == ["last.ckpt"], facts["left in the folder"]
    assert ranks[0]["error"] == ranks[1]["error"]
    verify_checkpoint(path, checksums=True)  # and the save after the failure is complete
