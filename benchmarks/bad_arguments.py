"""Where is each bad ``YaFSDPStrategy(...)`` argument refused, and how many lines does it print?

For every bad value in ``tests/strategy_arguments.py``, on the Trainer's strategy:

1. ``YaFSDPStrategy(**kwargs)`` in this process: refused there -> "constructor";
2. else ``Trainer(strategy=..., accelerator="cpu", devices=2)`` (the run's size is known
   there, nothing launched yet): refused -> "Trainer(...)";
3. else a real 2-rank fit of a tiny model through Lightning's launcher: refused ->
   "after launch" (with the seconds it took and the lines it printed), or "trained"
   (never refused).

The Fabric strategy is tried at step 1 too (same options class). Prints a markdown table.

    python benchmarks/bad_arguments.py                 # ~5 s if everything is refused early
    python benchmarks/bad_arguments.py --json table.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.strategy_arguments import CONSTRUCTOR, WORLD_SIZE, label  # noqa: E402

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")

_LAUNCHED = r"""
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_yafsdp import YaFSDPStrategy
from tests.strategy_arguments import CONSTRUCTOR, WORLD_SIZE


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(8, 8) for _ in range(2)))

    def training_step(self, batch, batch_idx):
        return self.layers(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    table, index = sys.argv[1], int(sys.argv[2])
    kwargs, run = (CONSTRUCTOR[index][0], {}) if table == "c" else WORLD_SIZE[index][:2]
    trainer = pl.Trainer(
        strategy=YaFSDPStrategy(**kwargs), accelerator="cpu", **{"devices": 2, **run},
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=2))
    print("TRAINED", flush=True)
"""


def _refusal(action) -> str | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            action()
    except Exception as error:  # noqa: BLE001 - the table reports any refusal
        return f"{type(error).__name__}: {error}"
    return None


def _launch(table: str, index: int, script: Path, *, timeout_s: float = 120.0) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    env["PYTHONPATH"] = str(REPO)
    began = time.monotonic()
    with subprocess.Popen(
        [sys.executable, str(script), table, str(index)], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env, cwd=script.parent, start_new_session=True,
    ) as proc:  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # rank 1 too
            output, _ = proc.communicate()
            return dict(
                where=f"hangs after launch (killed after {timeout_s:g} s)",
                lines=len(output.splitlines()),
                message="(no error: the ranks wait for each other)",
            )
    trained = "TRAINED" in output and proc.returncode == 0
    return dict(
        where="trained (never refused)" if trained else "after launch",
        seconds=round(time.monotonic() - began, 1),
        lines=len(output.splitlines()),
        message=output.strip().splitlines()[-1] if output.strip() else "",
    )


def measure(kwargs: dict, run: dict, *, table: str, index: int, script: Path) -> dict:
    import lightning.pytorch as pl

    from lightning_yafsdp import YaFSDPStrategy
    from lightning_yafsdp.fabric import YaFSDPStrategy as FabricYaFSDPStrategy

    row = dict(argument=label({**kwargs, **run}))
    fabric = _refusal(lambda: FabricYaFSDPStrategy(**kwargs))
    row["fabric"] = "constructor" if fabric else "accepted"
    message = _refusal(lambda: YaFSDPStrategy(**kwargs))
    if message:
        return dict(row, where="constructor", lines=len(message.splitlines()), message=message)
    trainer_kwargs = {"devices": 2, **run}
    message = _refusal(
        lambda: pl.Trainer(strategy=YaFSDPStrategy(**kwargs), accelerator="cpu", **trainer_kwargs)
    )
    if message:
        return dict(row, where="Trainer(...)", lines=len(message.splitlines()), message=message)
    return dict(row, **_launch(table, index, script))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    script = Path(tempfile.mkdtemp(prefix="bad_arguments_")) / "fit.py"
    script.write_text(_LAUNCHED)
    rows = [
        measure(kwargs, {}, table="c", index=i, script=script)
        for i, (kwargs, _) in enumerate(CONSTRUCTOR)
    ]
    rows += [
        measure(kwargs, run, table="w", index=i, script=script)
        for i, (kwargs, run, _) in enumerate(WORLD_SIZE)
    ]
    print("| # | argument (and run) | refused by (Trainer) | Fabric ctor | lines | message |")
    print("|---|---|---|---|---|---|")
    for number, row in enumerate(rows, 1):
        where = row["where"] + (f", {row['seconds']} s" if "seconds" in row else "")
        message = row["message"].replace("|", "\\|")[:150]
        print(
            f"| {number} | `{row['argument']}` | {where} | {row['fabric']} | {row['lines']} | "
            f"{message} |"
        )
    late = [r for r in rows if r["where"] not in ("constructor", "Trainer(...)")]
    multi = [r for r in rows if r["lines"] != 1]
    print(
        f"\n{len(rows)} bad values: {len(rows) - len(late)} refused before launch, "
        f"{len(late)} later or never; {len(multi)} printed more than one line"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if late or multi else 0


if __name__ == "__main__":
    sys.exit(main())
