"""Fine-tune a local Hugging Face model with the CLI, resume it, inspect and export it.

The whole user path of the finetune-hf recipe on CPU: a tiny LlamaForCausalLM saved
with weights to a local directory (no hub), 2 processes, checkpoints every 3 steps, a
second `yafsdp train` in the same run directory resuming from `last.ckpt`, then
`yafsdp inspect` and `yafsdp export --hf-config` loading back with `from_pretrained`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_cli import REPO, _yafsdp

transformers = pytest.importorskip("transformers")

TRAIN = [
    "train",
    str(REPO / "recipes" / "finetune-hf.yaml"),
    "model.hf_path=base",
    "data.path=sft.jsonl",
    "data.tokenizer=byte",
    "data.seq_len=32",
    "data.batch_size=4",
    "data.val_fraction=0.1",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.precision=32-true",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=2",
    "trainer.checkpoint_every_n_steps=3",
    "trainer.progress_bar=false",
    "trainer.run_name=ft",
    "schedule.warmup_steps=1",
    "optim.lr=1e-3",
    "strategy.activation_checkpointing=all",
]


def _make_base_model_and_data(root: Path) -> None:
    from lightning_yafsdp.models.llama import LlamaConfig, hf_llama_config

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_llama_config(LlamaConfig.from_name("tiny"))).save_pretrained(
        root / "base"
    )
    with (root / "sft.jsonl").open("w") as f:
        for i in range(400):
            f.write(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n"}) + "\n")


def test_finetune_resume_inspect_and_export_a_local_hf_model(tmp_path: Path) -> None:
    _make_base_model_and_data(tmp_path)
    first = _yafsdp(*TRAIN, "trainer.max_steps=6", cwd=tmp_path, timeout=240)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    checkpoints = tmp_path / "runs" / "ft" / "checkpoints"
    assert (checkpoints / "last.ckpt").exists()

    second = _yafsdp(*TRAIN, "trainer.max_steps=9", "--resume", cwd=tmp_path, timeout=240)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "Restored all states from the checkpoint" in second.stdout + second.stderr
    summary = json.loads((tmp_path / "runs" / "ft" / "summary.json").read_text())
    assert summary["steps"] == 9

    inspected = _yafsdp("inspect", str(checkpoints / "last.ckpt"), "--json", cwd=tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    info = json.loads(inspected.stdout)
    assert info["step"] == 9 and info["world_size"] == 2 and info["kind"] == "sharded"

    exported = _yafsdp(
        "export", str(checkpoints / "last.ckpt"), "out", "--hf-config", "base", cwd=tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    tuned_state, base_state = tuned.state_dict(), base.state_dict()
    assert tuned_state.keys() == base_state.keys()
    assert any(not torch.equal(tuned_state[k], base_state[k]) for k in base_state)
    tokens = torch.arange(16).view(1, 16)
    assert torch.isfinite(tuned(tokens).logits).all()
