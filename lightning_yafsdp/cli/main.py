"""Entry point of the ``yafsdp`` command (also ``python -m lightning_yafsdp``).

Commands: ``train``, ``estimate``, ``prepare``, ``export``, ``inspect``, ``plot``.

Every command validates its recipe and overrides before anything heavy runs (no
process is started for a bad config); errors print one message and exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lightning_yafsdp import __version__
from lightning_yafsdp.cli.checkpoints import add_checkpoint_commands, run_export, run_inspect
from lightning_yafsdp.cli.plot import add_plot_command, run_plot

if TYPE_CHECKING:
    from lightning_yafsdp.config import RunConfig

# The value of a bare ``train --resume`` (lightning_yafsdp.training.resume.LATEST; not
# imported from there, so that ``yafsdp --help`` stays free of torch).
LATEST = "latest"

_EPILOG = """\
examples:
  yafsdp train                                  tiny Llama on CPU, 2 processes, ~2.5 minutes
  yafsdp train recipes/llama-1b.yaml trainer.devices=8 optim.lr=3e-4
  yafsdp estimate llama3-8b trainer.devices=8
  yafsdp prepare --source text --path corpus/ --output data/corpus.bin
  yafsdp inspect runs/tiny-cpu-<time>/checkpoints/last.ckpt
  yafsdp export runs/tiny-cpu-<time>/checkpoints/last.ckpt exported/ --format safetensors
  yafsdp plot runs/tiny-cpu-<time>
"""

_OVERRIDES_HELP = (
    "dotlist overrides merged over the recipe, e.g. optim.lr=3e-4 trainer.devices=8 "
    "(unknown keys and wrong types are errors)"
)


def build_parser() -> argparse.ArgumentParser:
    """Builds the argument parser of the ``yafsdp`` command."""
    parser = argparse.ArgumentParser(
        prog="yafsdp",
        description="YaFSDP-style fully sharded data parallelism for PyTorch Lightning: "
        "train decoder language models from YAML recipes.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_train_command(commands)
    _add_estimate_command(commands)
    _add_prepare_command(commands)
    add_checkpoint_commands(commands)
    add_plot_command(commands)
    return parser


def _add_train_command(commands) -> None:
    from lightning_yafsdp.cli.config_help import render_config_keys

    train = commands.add_parser(
        "train",
        help="run a training recipe",
        description=textwrap.fill(
            "Train with a recipe (default: the embedded tiny-cpu recipe: a tiny Llama on "
            "the Python standard library's sources, byte-level, 2 CPU processes, about two "
            "and a half minutes on 2 cores). The resolved config is saved as "
            "config.yaml in the run folder (trainer.output_dir/run_name; --print-config "
            "prints it), next to logs/metrics.csv, metrics.png, checkpoints/ and "
            "summary.json. A stopped run continues with: yafsdp train "
            "runs/NAME/config.yaml --resume",
            width=88,
        ),
        epilog=render_config_keys(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _recipe_arguments(train)
    train.add_argument(
        "--config", default=None, metavar="RECIPE", help="the recipe (same as the positional)"
    )
    train.add_argument(
        "--resume",
        nargs="?",
        const=LATEST,
        default=None,
        metavar="PATH",
        help="continue the run from its newest checkpoint, or from the checkpoint PATH "
        "(without a recipe, the config.yaml of the run PATH belongs to is used); an error "
        "if there is nothing to resume. --resume auto: the newest checkpoint if the run "
        "has one, a fresh start otherwise (what a SLURM requeue wants)",
    )
    train.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    train.add_argument(
        "--check",
        action="store_true",
        help="check the recipe and what it points at (model dir, data, tokenizer, devices, "
        "output dir, the checkpoint --resume would take), print how the run would start, "
        "and exit: no process starts, nothing is written",
    )
    train.add_argument("--quiet", action="store_true", help="no startup panel or summary")


def _add_estimate_command(commands) -> None:
    est = commands.add_parser(
        "estimate",
        help="estimate memory per rank and communication per step",
        description="Memory per rank (master/grad/optimizer shards, compute shards, "
        "buffers, activations with and without checkpointing) and collective bytes per "
        "optimizer step for a recipe, from the layouts the engine builds. Nothing is "
        "allocated: the model is built on the meta device.",
    )
    _recipe_arguments(est)
    est.add_argument(
        "--world-size", type=int, default=None, help="ranks (default: devices x num_nodes)"
    )
    est.add_argument(
        "--device-memory",
        default=None,
        metavar="SIZE",
        help="a device's memory, e.g. 80GB or 141GB (10^9 bytes) or 80GiB (2^30): adds "
        "a fits / does-not-fit line (exit status 1 when it does not fit)",
    )
    est.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_prepare_command(commands) -> None:
    prep = commands.add_parser(
        "prepare",
        help="tokenize text into a .bin token file",
        description="Tokenize text once into a flat uint16/uint32 .bin file (plus a .json "
        "sidecar with dtype and vocab size) for data.source=bin.",
    )
    prep.add_argument("--source", choices=("stdlib", "text", "jsonl"), default="stdlib")
    prep.add_argument("--path", default=None, help="file, directory or glob (text/jsonl)")
    prep.add_argument("--output", required=True, help="the .bin file to write")
    prep.add_argument("--tokenizer", default="byte", help="'byte' or a local HF tokenizer dir")
    prep.add_argument("--jsonl-field", default="text", help="JSON key holding the text")
    prep.add_argument("--max-bytes", type=int, default=1 << 40, help="cap on text read (bytes)")


def _recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "args",
        nargs="*",
        metavar="[RECIPE] [KEY=VALUE ...]",
        help="a recipe (YAML path, or a name in ./recipes such as llama-1b; default: the "
        "embedded tiny-cpu recipe), then " + _OVERRIDES_HELP,
    )


def _split_recipe(args: Sequence[str]) -> tuple[str | None, list[str]]:
    if args and "=" not in args[0]:
        return args[0], list(args[1:])
    return None, list(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``yafsdp`` command.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The process exit code.
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # parse_known_args: overrides may also follow options (`train RECIPE --quiet a=1`).
    options, unknown = parser.parse_known_args(argv)
    late_overrides = [u for u in unknown if "=" in u and not u.startswith("-")]
    rest = [u for u in unknown if u not in late_overrides]
    if rest or (late_overrides and options.command not in ("train", "estimate")):
        parser.error(f"unrecognized arguments: {' '.join(rest or late_overrides)}")
    if late_overrides:
        options.args = [*options.args, *late_overrides]
    if options.command is None:
        parser.print_help()
        return 0
    from lightning_yafsdp.config import ConfigError

    try:
        if options.command == "train":
            return _train(options)
        if options.command == "estimate":
            return _estimate(options)
        if options.command == "export":
            return run_export(options)
        if options.command == "inspect":
            return run_inspect(options)
        if options.command == "plot":
            return run_plot(options)
        return _prepare(options)
    except ConfigError as err:
        print(f"yafsdp {options.command}: config error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # imported only now: `yafsdp --help` stays free of torch
        from lightning_yafsdp.checkpoint.errors import CheckpointError

        if not isinstance(err, CheckpointError):
            raise
        print(f"yafsdp {options.command}: {err}", file=sys.stderr)  # e.g. a damaged resume
        return 2


def _train(options: argparse.Namespace) -> int:
    from lightning_yafsdp.training.resume import handoff_scope

    with handoff_scope():
        return _train_in_scope(options)


def _train_in_scope(options: argparse.Namespace) -> int:
    from lightning_yafsdp.config import ConfigError, to_yaml

    config, resume = _train_config(options)  # fails here, before any process starts
    # Lightning's own deprecation chatter (not actionable by the user of a recipe).
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated")
    from lightning_yafsdp.training.resume import plan_start
    from lightning_yafsdp.training.runner import is_rank_zero, run_dir_of, train

    if options.print_config:
        print(to_yaml(config), end="")
        return 0
    from lightning_yafsdp.training.preflight import check_inputs

    notices = check_inputs(config, training=True)  # one line, before anything is printed
    if is_rank_zero():
        for notice in notices:  # e.g. more CPU ranks than cores: said with --quiet too
            print(f"yafsdp train: {notice}", file=sys.stderr, flush=True)
    from lightning_yafsdp.adapters.hosts import OversubscribedWarning

    # Said above in the recipe's terms (trainer.devices); the strategy would repeat it.
    warnings.filterwarnings("ignore", category=OversubscribedWarning)
    run_dir = run_dir_of(config)
    config.trainer.run_name = run_dir.name  # decided once: printed, saved, resumable
    start = plan_start(run_dir, resume)
    if start.checkpoint is not None and start.step >= config.trainer.max_steps:
        raise ConfigError(
            f"{start.checkpoint} is at step {start.step}, and trainer.max_steps="
            f"{config.trainer.max_steps}: nothing to train; raise trainer.max_steps to continue"
        )
    if options.check:
        from lightning_yafsdp.training.runner import schedule_steps_for

        if is_rank_zero():
            schedule_warning = schedule_steps_for(config, start)[1]
            for line in [*start.notes, *filter(None, [schedule_warning])]:
                print(line, file=sys.stderr)
            print(f"yafsdp train --check: {config.recipe} in {run_dir}: {start.describe()}")
            if start.checkpoint is not None:
                print(f"resuming  {start.checkpoint}")
        return 0
    # The resolved config is not printed here (it would bury the run's first lines):
    # --print-config shows it, and the run folder keeps it as config.yaml.
    facts = train(config, start=start, show=not options.quiet)
    return 0 if facts["steps"] > 0 else 1


def _train_config(options: argparse.Namespace) -> tuple[RunConfig, str | None]:
    """The recipe of ``yafsdp train`` and its ``--resume`` value (``interpret_resume``).

    A recipe that is a run's config.yaml makes that run folder the run's, wherever it
    is now, unless the command line names another (``trainer.run_name`` /
    ``trainer.output_dir``).
    """
    from lightning_yafsdp.config import ConfigError, load_config
    from lightning_yafsdp.training.resume import AUTO, LATEST, interpret_resume
    from lightning_yafsdp.training.runner import is_rank_zero

    recipe, overrides = _split_recipe(options.args)
    if options.config is not None:
        if recipe is not None:
            raise ConfigError(f"two recipes given: {recipe!r} and --config {options.config!r}")
        recipe = options.config
    recipe, overrides, resume, home = interpret_resume(recipe, overrides, options.resume)
    config = load_config(recipe, overrides)
    renamed = any(o.startswith(("trainer.run_name=", "trainer.output_dir=")) for o in overrides)
    if home is not None and not renamed:
        config.trainer.output_dir, config.trainer.run_name = str(home.parent), home.name
    named = config.trainer.run_name or os.environ.get("SLURM_JOB_ID")
    if resume in (LATEST, AUTO) and not named and is_rank_zero():
        raise ConfigError(
            "--resume continues a named run: give its config (yafsdp train "
            "runs/NAME/config.yaml --resume), trainer.run_name=NAME, or a checkpoint "
            "(--resume runs/NAME/checkpoints/last.ckpt)"
        )
    return config, resume


def _estimate(options: argparse.Namespace) -> int:
    import json

    from lightning_yafsdp.config import ConfigError, load_config
    from lightning_yafsdp.estimate import estimate, fit_verdict, parse_memory_size
    from lightning_yafsdp.training.console import estimate_table, print_rich
    from lightning_yafsdp.training.preflight import check_inputs

    device_bytes = None
    if options.device_memory is not None:
        try:
            device_bytes = parse_memory_size(options.device_memory)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    recipe, overrides = _split_recipe(options.args)
    config = load_config(recipe, overrides)
    check_inputs(config, training=False)  # a missing local model dir: one line, not the hub
    est = estimate(config, world_size=options.world_size)
    fits, verdict = (
        fit_verdict(est, device_bytes, given=options.device_memory)
        if device_bytes is not None
        else (True, None)
    )
    if options.json:
        payload = {
            "world_size": est.world_size,
            "shard_size": est.shard_size,
            "precision": est.precision,
            "zero_stage": est.zero_stage,
            "num_parameters": est.num_parameters,
            **est.engine_report(),
            "optimizer_states": est.optimizer_states,
            "activations_no_checkpointing": est.activations(0),
            "activations_all_checkpointed": est.activations(est.num_blocks),
            "checkpointed_units": est.checkpointed_units,
            "total": est.total,
            "comm_per_step": est.comm_per_step,
            "notes": est.notes,
        }
        if device_bytes is not None:
            payload.update(device_memory=device_bytes, fits=fits, verdict=verdict)
        print(json.dumps(payload, indent=2))
        return 0 if fits else 1
    hybrid = f" (shard groups of {est.shard_size})" if est.is_hybrid else ""
    title = (
        f"{config.recipe}: {est.num_parameters:,} parameters, {est.world_size} rank(s)"
        f"{hybrid}, {est.precision}, ZeRO-{est.zero_stage}, {len(est.units)} units"
    )
    print_rich(estimate_table(est, title=title))
    for note in est.notes:
        print(f"note: {note}")
    if verdict is not None:
        print(verdict)
    return 0 if fits else 1


def _prepare(options: argparse.Namespace) -> int:
    from lightning_yafsdp.data.prepare import prepare_bin

    if options.source != "stdlib" and not options.path:
        print(f"yafsdp prepare: --source {options.source} needs --path", file=sys.stderr)
        return 2
    meta = prepare_bin(
        options.output,
        source=options.source,
        path=options.path,
        tokenizer=options.tokenizer,
        max_bytes=options.max_bytes,
        jsonl_field=options.jsonl_field,
    )
    print(
        f"wrote {meta['num_tokens']:,} tokens ({meta['dtype']}, vocab {meta['vocab_size']}) "
        f"to {options.output}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
