"""`yafsdp inspect` and `yafsdp export` on a checkpoint written by 2 real ranks."""

from __future__ import annotations

import json

import torch

from lightning_yafsdp.cli.main import main
from tests import checkpoint_scenarios as scenario
from tests.distributed import dist_run


def _train_and_save(path: str) -> dict[str, torch.Tensor]:
    from lightning_yafsdp.checkpoint import save_checkpoint

    model, engine, optimizer = scenario.build_sharded()
    scenario.train_steps(model, optimizer, range(2))
    save_checkpoint(path, engine, optimizers=[optimizer], extra={"step": 2})
    return scenario.full_weights(engine)


def test_inspect_and_export_a_sharded_checkpoint(tmp_path, capsys) -> None:
    checkpoint = tmp_path / "ckpt"
    trained = dist_run(2, _train_and_save, str(checkpoint))[0]

    assert main(["inspect", str(checkpoint), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "sharded" and info["world_size"] == 2 and info["step"] == 2
    assert info["num_optimizers"] == 1

    out = tmp_path / "export"
    assert main(["export", str(checkpoint), str(out), "--strip-prefix", ""]) == 0
    from safetensors.torch import load_file

    exported = load_file(str(out / "model.safetensors"))
    fresh = scenario.build_llama(seed=1)
    fresh.load_state_dict(exported, strict=True)  # original names and shapes
    for name, tensor in fresh.state_dict().items():
        if name in trained:
            torch.testing.assert_close(tensor, trained[name], rtol=0, atol=0)
