"""``yafsdp export`` and ``yafsdp inspect``: checkpoints on the command line.

Both read a checkpoint in one process on CPU (no process group): ``inspect``
reads only metadata; ``export`` consolidates the full weights, so it needs the
whole model in CPU memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

# A LightningModule from `yafsdp train` holds the network as `self.model`.
_TRAINING_MODULE_PREFIX = "model."


def add_checkpoint_commands(commands: argparse._SubParsersAction) -> None:
    """Registers ``export`` and ``inspect`` on the ``yafsdp`` parser's subcommands."""
    _add_export_command(commands)
    _add_inspect_command(commands)


def _add_export_command(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export",
        help="consolidate a checkpoint into plain weights or a Hugging Face model directory",
        description="Write the consolidated weights of a sharded (or single-file) "
        "checkpoint under their original names and shapes. With --hf (or --hf-config DIR) "
        "the output directory is a Hugging Face model (model.safetensors + config.json) "
        "that AutoModelForCausalLM.from_pretrained loads: a built-in Llama is renamed to "
        "LlamaForCausalLM's weights, its config taken from the run's config.yaml. "
        "Everything is checked before anything is written; an earlier export in OUT_DIR "
        "is replaced only with --force.",
    )
    export.add_argument("checkpoint", help="checkpoint directory (sharded) or file (full)")
    export.add_argument("out_dir", help="output directory (created when the export succeeds)")
    export.add_argument("--format", choices=("safetensors", "pt"), default="safetensors")
    export.add_argument(
        "--strip-prefix",
        default=None,
        help=f"remove this prefix from every name (default: '{_TRAINING_MODULE_PREFIX}' when "
        "every weight carries it, as in checkpoints written by 'yafsdp train'; '' keeps all)",
    )
    export.add_argument(
        "--hf",
        action="store_true",
        help="write a Hugging Face model directory, config.json made from the run's model "
        "(built-in Llama) or copied from its model.hf_path (model.kind=hf)",
    )
    export.add_argument(
        "--hf-config",
        default=None,
        metavar="DIR",
        help="like --hf, with config.json taken from this local Hugging Face model/config "
        "directory (for a built-in Llama it must describe the trained architecture)",
    )
    export.add_argument(
        "--run-config",
        default=None,
        metavar="FILE",
        help="the run's config.yaml (default: the one in the checkpoint's run directory)",
    )
    export.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="cast floating weights (default: as stored, fp32)",
    )
    export.add_argument(
        "--force",
        action="store_true",
        help="replace an earlier export (model.safetensors, model.pt, config.json) in OUT_DIR",
    )


def _add_inspect_command(commands: argparse._SubParsersAction) -> None:
    inspect = commands.add_parser(
        "inspect",
        help="check a checkpoint is complete; show its step, world size, parameters and size",
        description="Check that no file of a checkpoint is missing or truncated, read its "
        "metadata (no tensors) and print a table. A damaged checkpoint is named in one line "
        "(exit code 2).",
    )
    inspect.add_argument("checkpoint", help="checkpoint directory (sharded) or file (full)")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="also compare every file with the CRC-32 checksum recorded at save (reads "
        "every byte; sharded checkpoints)",
    )


def run_export(options: argparse.Namespace) -> int:
    """``yafsdp export``: one line on stderr and status 2 for anything refused."""
    import torch

    from lightning_yafsdp.checkpoint import CheckpointError, inspect_checkpoint
    from lightning_yafsdp.export import export_checkpoint

    try:
        hf = bool(options.hf or options.hf_config)
        run_config = _run_config_of(options) if hf else None
        prefix = options.strip_prefix
        if prefix is None:
            prefix = _default_prefix(inspect_checkpoint(options.checkpoint))
        path = export_checkpoint(
            options.checkpoint,
            options.out_dir,
            fmt=options.format,
            hf=options.hf,
            hf_config=options.hf_config,
            run_config=options.run_config,
            strip_prefix=prefix,
            dtype=getattr(torch, options.dtype) if options.dtype else None,
            force=options.force,
        )
    except (CheckpointError, OSError, ValueError) as err:
        print(f"yafsdp export: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    if hf:
        from lightning_yafsdp.export.hugging_face import write_tokenizer

        out_dir = path.parent
        print(f"wrote {out_dir / 'config.json'}: from_pretrained({str(out_dir)!r}) loads it")
        print(write_tokenizer(out_dir, run_config))
    return 0


def _run_config_of(options: argparse.Namespace) -> Any:
    """The run's config (None when unknown); a tokenizer directory it names that is
    missing here is refused now, before the export writes anything."""
    from lightning_yafsdp.export.directory import ExportError
    from lightning_yafsdp.export.hugging_face import find_run_config, load_run_config

    path = options.run_config or find_run_config(options.checkpoint)
    config = load_run_config(path) if path else None
    tokenizer = config.data.tokenizer if config is not None else "byte"
    if tokenizer != "byte" and not Path(tokenizer).is_dir():
        raise ExportError(
            f"the run's data.tokenizer={tokenizer!r} is not a local directory here, so the "
            "export would have no tokenizer: run it where that directory is, or copy it there"
        )
    return config


def run_inspect(options: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from lightning_yafsdp.checkpoint import CheckpointError, inspect_checkpoint

    try:
        info = inspect_checkpoint(options.checkpoint, checksums=options.verify)
    except (CheckpointError, OSError) as err:
        print(f"yafsdp inspect: {err}", file=sys.stderr)
        return 2
    if options.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        Console().print(render_inspection(info))
    return 0


def render_inspection(info: dict[str, Any]):
    """A ``rich.table.Table`` of ``inspect_checkpoint``'s result (print it with a Console)."""
    from rich.table import Table

    world, shard = info.get("world_size"), info.get("shard_size")
    writers = f"{world} rank(s)" if world else "-"
    if world and shard and shard < world:  # [Note: hybrid sharding]
        writers += f": {world // shard} replicas x {shard} sharded ranks"
    size, unit = float(info["size_bytes"]), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    table = Table(title=f"checkpoint {info['path']}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for field, value in (
        ("format", info["kind"]),
        ("step", info.get("step")),
        ("epoch", info.get("epoch")),
        ("written by", writers),
        ("parameters", f"{info['parameter_count']:,}"),
        ("tensors (weights)", f"{info['num_tensors']:,}"),
        ("optimizers", info["num_optimizers"]),
        ("size on disk", f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"),
        ("verified", info.get("verified")),
    ):
        table.add_row(field, "-" if value is None else str(value))
    return table


def _default_prefix(info: dict) -> str:
    names = info["tensor_names"]
    if names and all(name.startswith(_TRAINING_MODULE_PREFIX) for name in names):
        return _TRAINING_MODULE_PREFIX
    return ""
