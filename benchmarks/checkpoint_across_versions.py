"""A checkpoint saved under one torch version, loaded and continued under another.

    python benchmarks/checkpoint_across_versions.py save DIR   # under torch A
    python benchmarks/checkpoint_across_versions.py load DIR   # under torch B (or A)

``save``: 2 gloo ranks, ``Trainer(strategy="yafsdp")`` in 32-true on the tests' tiny
Llama, 6 straight steps; a sharded checkpoint is written after step 3 (``DIR/step3.ckpt``)
and ``DIR/reference.pt`` keeps the per-step losses and the full weights after steps 3
and 6, with the torch version that made them.

``load`` (exits 1 on any mismatch, naming it):
  1. ``trainer.validate(ckpt_path=...)`` on 1 rank: the loaded weights equal the saved
     step-3 weights bit for bit (a load is a copy; no version may change a value);
  2. ``fit(ckpt_path=...)`` on 2 ranks to step 6: the losses of steps 4-6 and the final
     weights equal the straight run's, exactly under the same torch, and to
     ``CROSS_VERSION_RTOL`` under another (the CPU kernels of two torch builds may round
     differently; measured differences are in docs/testing.md#torch-versions).

``benchmarks/torch_compat.sh`` runs ``save`` under one version and ``load`` under each
other; ``tests/test_benchmarks.py`` runs both under the installed torch.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/ holds the model, the data and the rank harness

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

import lightning_yafsdp  # noqa: E402, F401  (registers strategy="yafsdp")
from tests.distributed import dist_run  # noqa: E402
from tests.lightning_models import CausalLMModule, RankTaggedTokens  # noqa: E402

SAVE_STEP, FINAL_STEP = 3, 6
BATCH = 2
# Relative, on losses and on weights (against the largest weight of the tensor). Measured
# between the 2.13 CPU wheel and the 2.11/2.14 CUDA builds on a CPU: 0.0 (docs/testing.md);
# the margin is for builds whose CPU kernels round differently, and a perturbation of the
# resumed weights by 1e-4 moves the losses by 2e-5, above it.
CROSS_VERSION_RTOL = 1e-5


def _loader() -> DataLoader:
    dataset = RankTaggedTokens(SAVE_STEP * BATCH * 2)  # one 3-step epoch over 2 ranks
    return DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=False))


def _trainer(root: str, *, devices: int = 2, **overrides) -> pl.Trainer:
    options = dict(
        accelerator="cpu",
        devices=devices,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        default_root_dir=root,
    )
    return pl.Trainer(strategy="yafsdp", **{**options, **overrides})


class _SaveAndRecord(pl.Callback):
    """Saves after ``SAVE_STEP`` (where ModelCheckpoint would) and keeps rank 0's weights."""

    def __init__(self, path: str) -> None:
        self.path, self.weights = path, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        full = trainer.strategy.engine.full_state_dict()  # a collective: every rank calls it
        if trainer.is_global_zero:
            self.weights[trainer.global_step] = {k: v.clone() for k, v in full.items()}
        if self.path and trainer.global_step == SAVE_STEP:
            trainer.save_checkpoint(self.path)


def _save_run(directory: str) -> dict:
    model, record = CausalLMModule(), _SaveAndRecord(f"{directory}/step3.ckpt")
    trainer = _trainer(directory, max_steps=FINAL_STEP, callbacks=[record])
    trainer.fit(model, _loader())
    return {"losses": list(model.train_losses), "weights": record.weights}


def _continue_run(directory: str) -> dict:
    torch.manual_seed(1)
    model, record = CausalLMModule(), _SaveAndRecord("")  # other weights until the load
    trainer = _trainer(directory, max_steps=FINAL_STEP, callbacks=[record])
    trainer.fit(model, _loader(), ckpt_path=f"{directory}/step3.ckpt")
    facts = {"losses": list(model.train_losses), "weights": record.weights}
    del model, trainer
    gc.collect()
    return facts


def _loaded_weights(directory: str) -> dict:
    torch.manual_seed(1)
    model = CausalLMModule()
    trainer = _trainer(directory, devices=1, limit_val_batches=1)
    trainer.validate(model, _loader(), ckpt_path=f"{directory}/step3.ckpt", verbose=False)
    return {k: v.clone() for k, v in trainer.strategy.engine.full_state_dict().items()}


def _relative_difference(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        raise SystemExit(f"parameter names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in a)


def save(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    facts = dist_run(2, _save_run, str(directory), timeout_s=240)[0]
    facts["torch"] = str(torch.__version__)
    torch.save(facts, directory / "reference.pt")
    print(f"saved {directory}/step3.ckpt under torch {torch.__version__}")


def _continuation_errors(continued: dict, reference: dict) -> tuple[float, float]:
    """Largest relative differences of the steps after the save: losses, final weights."""
    expected = torch.tensor(reference["losses"][SAVE_STEP:])
    losses = torch.tensor(continued["losses"])
    loss_error = ((losses - expected).abs() / expected).max().item()
    final = FINAL_STEP
    return loss_error, _relative_difference(
        continued["weights"][final], reference["weights"][final]
    )


def load(directory: Path) -> list[str]:
    """The mismatches between this torch's load and continuation and the saved run."""
    reference = torch.load(directory / "reference.pt", weights_only=True)
    same_torch = reference["torch"] == str(torch.__version__)
    tolerance = 0.0 if same_torch else CROSS_VERSION_RTOL
    problems = []
    loaded = dist_run(1, _loaded_weights, str(directory), timeout_s=180)[0]
    if (load_error := _relative_difference(loaded, reference["weights"][SAVE_STEP])) != 0.0:
        problems.append(
            f"loaded step-{SAVE_STEP} weights differ from the saved by {load_error:.2e}"
        )
    continued = dist_run(2, _continue_run, str(directory), timeout_s=240)[0]
    if len(continued["losses"]) != FINAL_STEP - SAVE_STEP:
        return [*problems, f"the resumed fit ran {len(continued['losses'])} steps"]
    loss_error, weight_error = _continuation_errors(continued, reference)
    print(
        f"saved under torch {reference['torch']}, loaded under {torch.__version__}: load exact: "
        f"{not problems}; steps {SAVE_STEP + 1}-{FINAL_STEP} loss rel. difference "
        f"{loss_error:.2e}, final weights {weight_error:.2e} (allowed {tolerance:.0e})"
    )
    if loss_error > tolerance:
        problems.append(f"continued losses differ by {loss_error:.2e} > {tolerance:.0e}")
    if weight_error > tolerance:
        problems.append(f"final weights differ by {weight_error:.2e} > {tolerance:.0e}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("save", "load"))
    parser.add_argument("directory", type=Path)
    args = parser.parse_args()
    if args.mode == "save":
        save(args.directory)
        return
    problems = load(args.directory)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    raise SystemExit(1 if problems else 0)


if __name__ == "__main__":
    main()
