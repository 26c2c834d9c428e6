"""`yafsdp export` of a `yafsdp train` checkpoint: Hugging Face round trip, overwrite, modes.

One tiny built-in Llama run (1 process, 3 steps, tied embeddings and non-default rope
theta and norm eps, so a config that drops any of them shows in the logits) is shared by
every test. Exports run through `main([...])` in-process, except the one that needs an
interpreter without safetensors, which runs the installed command
(`python -m lightning_yafsdp export`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_yafsdp.cli.main import main
from tests.test_cli import REPO, _yafsdp

transformers = pytest.importorskip("transformers")

RUN = "tied"
TRAIN = [
    "train",
    "model.n_layers=2",
    "model.tie_embeddings=true",
    "model.rope_theta=500000",
    "model.norm_eps=1e-6",
    "data.max_bytes=200000",
    "data.batch_size=4",
    "trainer.devices=1",
    "trainer.max_steps=3",
    "trainer.checkpoint_every_n_steps=3",
    "trainer.limit_val_batches=0",
    "trainer.logger=none",
    "trainer.progress_bar=false",
    f"trainer.run_name={RUN}",
    "--quiet",
]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A directory holding runs/tied, trained by `yafsdp train`."""
    root = tmp_path_factory.mktemp("export")
    trained = _yafsdp(*TRAIN, cwd=root, timeout=300)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def checkpoint(root) -> Path:
    return root / "runs" / RUN / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def hf_dir(root, checkpoint) -> Path:
    """`yafsdp export CHECKPOINT hf --hf`."""
    assert main(["export", str(checkpoint), str(root / "hf"), "--hf"]) == 0
    return root / "hf"


def _our_model(root: Path, checkpoint: Path, tmp_path: Path) -> torch.nn.Module:
    """The trained network as our own Llama, from a plain export of the checkpoint."""
    from safetensors.torch import load_file

    from lightning_yafsdp.config import load_config
    from lightning_yafsdp.models.llama import Llama
    from lightning_yafsdp.training.models import llama_config

    assert main(["export", str(checkpoint), str(tmp_path / "plain")]) == 0
    model = Llama(llama_config(load_config(root / "runs" / RUN / "config.yaml")))
    model.load_state_dict(load_file(tmp_path / "plain" / "model.safetensors"), strict=True)
    return model.eval()


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- Hugging Face round trip ------------------------------------------------------------------


def test_hf_export_of_the_builtin_llama_is_the_same_model_under_from_pretrained(
    root, checkpoint, hf_dir, tmp_path
) -> None:
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    ours = _our_model(root, checkpoint, tmp_path)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = ours(tokens), hf_model.eval()(tokens).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)  # measured: 0


def test_hf_export_holds_the_byte_tokenizer_the_run_trained_with(hf_dir) -> None:
    from lightning_yafsdp.data.tokenizer import ByteTokenizer

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    text = "def f(x):\n    return 'héllo ✓ 日本'  \n\n\tx"
    ids = tokenizer.encode(text)
    assert ids == ByteTokenizer().encode_documents([text]).tolist()  # id = UTF-8 byte
    assert tokenizer.decode(ids) == text and len(tokenizer) == 256


def test_a_checkpoint_without_its_run_config_gets_no_tokenizer_and_is_told_why(
    tmp_path,
) -> None:
    from lightning_yafsdp.export.hugging_face import write_tokenizer

    line = write_tokenizer(tmp_path, None)
    assert line.startswith("no tokenizer written") and "--run-config" in line
    assert list(tmp_path.iterdir()) == []


def test_a_given_hf_config_is_written_when_it_describes_the_trained_model(
    checkpoint, hf_dir, tmp_path
) -> None:
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    config.bos_token_id = 0  # a field that does not change the logits: the user's to set
    config.save_pretrained(tmp_path / "mine")
    out = tmp_path / "out"
    assert main(["export", str(checkpoint), str(out), "--hf-config", str(tmp_path / "mine")]) == 0
    assert transformers.AutoConfig.from_pretrained(out).bos_token_id == 0


def test_a_given_hf_config_of_another_architecture_is_refused(
    checkpoint, hf_dir, tmp_path, capsys
) -> None:
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    config.rms_norm_eps = 1e-5  # the run trained with 1e-6: same shapes, other logits
    config.save_pretrained(tmp_path / "wrong")
    out = tmp_path / "new" / "out"
    assert main(["export", str(checkpoint), str(out), "--hf-config", str(tmp_path / "wrong")]) == 2
    assert "rms_norm_eps=1e-05 (the model has 1e-06)" in _one_line_error(capsys)
    assert not (tmp_path / "new").exists()


def test_embedding_norm_is_refused_before_anything_is_written(root, tmp_path, capsys) -> None:
    run = tmp_path / "runs" / "norm"
    shutil.copytree(root / "runs" / RUN, run)
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("embedding_norm: false", "embedding_norm: true"))
    out = tmp_path / "out"
    assert main(["export", str(run / "checkpoints" / "last.ckpt"), str(out), "--hf"]) == 2
    assert "practices.embedding_norm=true" in _one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # no out, no staging


# -- the output directory ---------------------------------------------------------------------


def test_an_earlier_export_is_replaced_only_with_force(checkpoint, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["export", str(checkpoint), str(out), "--format", "pt"]) == 0
    before = _digest(out / "model.pt")
    capsys.readouterr()

    assert main(["export", str(checkpoint), str(out)]) == 2
    err = _one_line_error(capsys)
    assert str(out / "model.pt") in err and "--force" in err
    assert sorted(p.name for p in out.iterdir()) == ["model.pt"]
    assert _digest(out / "model.pt") == before

    assert main(["export", str(checkpoint), str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # replaced whole


def test_exported_and_checkpoint_files_get_normal_modes(checkpoint, hf_dir) -> None:
    umask = os.umask(0o022)
    os.umask(umask)
    files = [hf_dir / "model.safetensors", hf_dir / "config.json", *checkpoint.iterdir()]
    modes = {str(f): oct(f.stat().st_mode & 0o777) for f in files}
    assert modes == {str(f): oct(0o666 & ~umask) for f in files}
    assert oct(hf_dir.stat().st_mode & 0o777) == oct(0o777 & ~umask)


def test_without_safetensors_the_export_says_so_in_one_line_and_writes_nothing(
    checkpoint, tmp_path
) -> None:
    # The installed command, in an interpreter where `import safetensors` fails.
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['safetensors'] = None\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_yafsdp", "export", str(checkpoint), str(out)],
        env={**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{REPO}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "yafsdp export: --format safetensors needs the safetensors package: "
        "pip install safetensors, or use --format pt"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker"]
