"""How often does a rank abort at exit after a successful fit? Launch many small runs and count.

Each run is a real ``python script.py`` launched the way a user launches it:
``Trainer(strategy="yafsdp", accelerator="cpu", devices=2)`` with Lightning's own
subprocess launcher (rank 1 is re-run by Lightning from the same command line), a tiny
model and a few steps. The models are the ones an abort at exit was reported on: Hugging
Face GPT-BigCode, a model holding an ``nn.ParameterList``, an eagerly built Hugging Face
Llama, and a fit that resumes from a checkpoint written by ``strategy="ddp"`` (written once,
by a DDP launch, before the yafsdp runs). ``--strategy ddp`` runs the same models under DDP.

Lightning's launcher never reports rank 1's exit status, so the rank script forks itself
first (before torch is imported) and the parent only records how the rank ended in
``rank<N>.exit`` (as ``tests/test_clean_exit.py`` does). A run "aborts" when a rank exits
with 134 / SIGABRT or prints ``terminate called``.

Examples::

    python benchmarks/exit_stress.py --runs 40            # ~40 launches, 10-20 min on 2 cores
    python benchmarks/exit_stress.py --runs 8 --models bigcode llama
    python benchmarks/exit_stress.py --runs 20 --strategy ddp
    python benchmarks/exit_stress.py --runs 40 --json exit_stress.json
    python benchmarks/exit_stress.py --runs 20 --engine-collectives   # torch only, ~1 min

``--engine-collectives`` launches the torch-only script of
``tests/test_clean_exit.py`` instead (2 ranks that exit right after the engine's
collectives), where an abort is far more likely ([Note: gloo work outlives its wait]).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = ("bigcode", "paramlist", "llama", "ddp_checkpoint")
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")

RANK_SCRIPT = r'''
import os
import sys

# -- exit-status wrapper: the parent waits for the rank and records how it ended ------
if os.environ.get("EXIT_STATUS_DIR"):
    child = os.fork()  # the child goes on below as the rank
    if child:
        _, status = os.waitpid(child, 0)
        code = os.waitstatus_to_exitcode(status)
        rank = os.environ.get("LOCAL_RANK", "0")
        path = os.path.join(os.environ["EXIT_STATUS_DIR"], f"rank{rank}.exit")
        with open(path + ".tmp", "w") as f:
            f.write(str(code))
        os.replace(path + ".tmp", path)
        os._exit(code if code >= 0 else 128 - code)

import lightning.pytorch as pl
import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_yafsdp  # noqa: F401 - registers "yafsdp"

VOCAB = 128


def bigcode():
    config = transformers.GPTBigCodeConfig(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, use_cache=False
    )
    return transformers.GPTBigCodeForCausalLM(config)


def llama():
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
    )
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config)


class ParameterListBlock(nn.Module):
    """A block whose weights live in an nn.ParameterList (no Linear inside)."""

    def __init__(self):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(32, 32) / 6) for _ in range(2))

    def forward(self, hidden):
        for weight in self.weights:
            hidden = hidden + torch.tanh(hidden @ weight)
        return hidden


class ParameterListLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.blocks = nn.ModuleList(ParameterListBlock() for _ in range(2))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids, labels):
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        logits = self.head(hidden)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


class LanguageModel(pl.LightningModule):
    def __init__(self, build):
        super().__init__()
        torch.manual_seed(0)
        self.model = build()  # eager: real tensors in __init__

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    model_name, strategy, checkpoint = sys.argv[1], sys.argv[2], sys.argv[3]
    build = {"bigcode": bigcode, "paramlist": ParameterListLM, "llama": llama,
             "ddp_checkpoint": llama}[model_name]
    tokens = torch.randint(0, VOCAB, (16, 16), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens), batch_size=2)
    writes_checkpoint = model_name == "ddp_checkpoint" and strategy == "ddp"
    resumes = model_name == "ddp_checkpoint" and not writes_checkpoint
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=4 if resumes else 2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(LanguageModel(build), loader, ckpt_path=checkpoint if resumes else None)
    if writes_checkpoint:
        trainer.save_checkpoint(checkpoint)
    print(f"rank {trainer.global_rank} fitted {model_name}", flush=True)
'''


def launch(script: Path, model: str, strategy: str, checkpoint: Path, *, timeout_s: float):
    """One launch; returns ``(rank exit codes, fitted ranks, stderr)``."""
    with tempfile.TemporaryDirectory(prefix="exit_stress_") as statuses:
        env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
        env.update(PYTHONPATH=str(REPO), EXIT_STATUS_DIR=statuses)
        try:
            proc = subprocess.run(
                [sys.executable, str(script), model, strategy, str(checkpoint)],
                capture_output=True,
                text=True,
                env=env,
                cwd=script.parent,
                timeout=timeout_s,
                start_new_session=True,
            )
            stdout, stderr = proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as err:
            stdout, stderr = _text(err.stdout), _text(err.stderr) + "\n[exit_stress: timed out]"
        codes = _await_exit_codes(Path(statuses), expected=2, wait_s=30.0)
    fitted = sum(f"rank {r} fitted {model}" in stdout for r in (0, 1))
    return codes, fitted, stderr


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def _await_exit_codes(statuses: Path, *, expected: int, wait_s: float) -> dict[str, int]:
    # Rank 0 does not wait for rank 1: its status may land after the launcher returned.
    deadline = time.monotonic() + wait_s
    while len(list(statuses.glob("*.exit"))) < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return {p.stem: int(p.read_text()) for p in sorted(statuses.glob("*.exit"))}


def classify(codes: dict[str, int], fitted: int, stderr: str) -> str:
    if "terminate called" in stderr or any(c in (134, -6) for c in codes.values()):
        return "abort"
    if fitted < 2 or sorted(codes.values()) != [0, 0]:
        return "failed"
    return "clean"


def engine_collectives(runs: int) -> int:
    """Launch the torch-only exit test's script ``runs`` times; count ranks that aborted."""
    sys.path.insert(0, str(REPO))
    from tests.test_clean_exit import _EXIT_RIGHT_AFTER_COLLECTIVES, _launch_pair

    script = Path(tempfile.mkdtemp(prefix="exit_stress_")) / "collectives_then_exit.py"
    script.write_text(_EXIT_RIGHT_AFTER_COLLECTIVES)
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    env["PYTHONPATH"] = str(REPO)
    codes = [code for _ in range(runs) for code, _ in _launch_pair(script, env)]
    aborted = sum(code in (134, -6) for code in codes)
    print(
        f"engine collectives: {runs} launches, {aborted} of {len(codes)} ranks aborted at exit, "
        f"{sum(code not in (0, 134, -6) for code in codes)} failed otherwise"
    )
    return 1 if any(codes) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=40, help="launches in all (default 40)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--strategy", default="yafsdp", help="yafsdp (default) or ddp")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--json", type=Path, help="write every launch's outcome here")
    parser.add_argument(
        "--engine-collectives",
        action="store_true",
        help="launch 2 torch-only ranks that exit right after the engine's collectives",
    )
    parser.add_argument(
        "--keep-cores",
        type=Path,
        metavar="DIR",
        help="move the core file of an aborted run here (run under `ulimit -c unlimited`; "
        "then `gdb python DIR/core.N -batch -ex 'thread apply all bt'`)",
    )
    args = parser.parse_args(argv)
    if args.engine_collectives:
        return engine_collectives(args.runs)

    work = Path(tempfile.mkdtemp(prefix="exit_stress_"))
    script = work / "fit_and_exit.py"
    script.write_text(RANK_SCRIPT)
    checkpoint = work / "ddp.ckpt"
    if "ddp_checkpoint" in args.models:
        codes, fitted, stderr = launch(
            script, "ddp_checkpoint", "ddp", checkpoint, timeout_s=args.timeout
        )
        if not checkpoint.exists():
            print(f"the DDP launch wrote no checkpoint ({codes}):\n{stderr[-3000:]}")
            return 2
    outcomes, started = [], time.monotonic()
    for index in range(args.runs):
        model = args.models[index % len(args.models)]
        began = time.monotonic()
        codes, fitted, stderr = launch(
            script, model, args.strategy, checkpoint, timeout_s=args.timeout
        )
        outcome = classify(codes, fitted, stderr)
        outcomes.append(
            dict(
                run=index,
                model=model,
                outcome=outcome,
                codes=codes,
                seconds=round(time.monotonic() - began, 1),
                stderr_tail=stderr[-1500:] if outcome != "clean" else "",
            )
        )
        print(
            f"run {index:3d} {model:15s} {outcome:6s} {codes} {outcomes[-1]['seconds']} s",
            flush=True,
        )
        if outcome == "failed":
            print(stderr[-2000:], flush=True)
        core = script.parent / "core"
        if args.keep_cores and core.exists():
            args.keep_cores.mkdir(parents=True, exist_ok=True)
            core.rename(args.keep_cores / f"core.{index}")
    counts = Counter(o["outcome"] for o in outcomes)
    per_model = {m: Counter(o["outcome"] for o in outcomes if o["model"] == m) for m in args.models}
    print(
        f"\n{args.strategy}: {args.runs} launches in {time.monotonic() - started:.0f} s: "
        f"{counts['clean']} clean, {counts['abort']} aborted at exit, "
        f"{counts['failed']} failed otherwise"
    )
    for model, count in per_model.items():
        print(f"  {model:15s} {dict(count)}")
    if args.json:
        args.json.write_text(json.dumps(dict(strategy=args.strategy, outcomes=outcomes), indent=1))
    return 1 if counts["abort"] or counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
