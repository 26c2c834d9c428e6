"""Peak RSS per rank of a Lightning fit whose model is built in ``configure_model``.

``benchmarks/compare.py`` builds its model eagerly in ``__init__``; a recipe (and most
users of a sharded strategy) builds it in ``configure_model``, on the meta device under
yafsdp, materialized and sharded one unit at a time. This measures that path: the wide
model of docs/performance.md (4-layer Llama, dim 1024, vocab 8192, 64.0M params), batch
4 per rank, seq 128, ``32-true``, AdamW, 2 ranks x 1 thread on the CPU, under Lightning's
own launcher, with the memory-pass malloc settings (every allocation over 256 KiB its
own mapping, so RSS follows live tensor bytes). Each rank prints its ``VmHWM``.

Examples::

    python benchmarks/meta_build_rss.py                 # yafsdp
    python benchmarks/meta_build_rss.py --strategy ddp
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._measure import LIVE_MALLOC_ENV, hwm_kib  # noqa: E402

SHAPE = dict(
    vocab_size=8192, dim=1024, n_layers=4, n_heads=16, n_kv_heads=8, ffn_hidden_dim=2816,
    max_seq_len=256,
)  # fmt: skip


def _fit(strategy: str, steps: int) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_yafsdp  # noqa: F401 - registers "yafsdp"
    from lightning_yafsdp.models.llama import Llama, LlamaConfig

    class WideLlama(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = Llama(LlamaConfig.from_name("debug-50m", **SHAPE))

        def init_submodule(self, module) -> None:  # the strategy's meta-device init
            self.model.init_submodule(module)

        def training_step(self, batch, batch_idx):
            (tokens,) = batch
            logits = self.model(tokens[:, :-1])
            return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.1)

    torch.set_num_threads(1)
    tokens = torch.randint(0, SHAPE["vocab_size"], (8 * steps, 129))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=steps, precision="32-true",
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(WideLlama(), DataLoader(TensorDataset(tokens), batch_size=4))
    print(f"{strategy} rank {trainer.global_rank}: peak RSS {hwm_kib() // 1024} MiB", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--strategy", default="yafsdp", help="yafsdp (default) or ddp")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_process:
        _fit(args.strategy, args.steps)
        return 0
    # The malloc settings must be in the environment before the interpreter starts.
    env = dict(os.environ, **LIVE_MALLOC_ENV, PYTHONPATH=str(REPO))
    command = [sys.executable, __file__, "--rank-process", "--strategy", args.strategy]
    return subprocess.run([*command, "--steps", str(args.steps)], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
