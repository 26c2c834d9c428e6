"""``yafsdp export`` and ``yafsdp inspect``: checkpoints on the command line.

Both read a checkpoint in one process on CPU (no process group): ``inspect``
reads only metadata; ``export`` consolidates the full weights, so it needs the
whole model in CPU memory.
"""

from __future__ import annotations

import argparse
import sys

# A LightningModule from `yafsdp train` holds the network as `self.model`.
_TRAINING_MODULE_PREFIX = "model."


def add_checkpoint_commands(commands: argparse._SubParsersAction) -> None:
    """Registers ``export`` and ``inspect`` on the ``yafsdp`` parser's subcommands."""
    export = commands.add_parser(
        "export",
        help="consolidate a checkpoint into plain weights (safetensors or .pt)",
        description="Write the consolidated weights of a sharded (or single-file) "
        "checkpoint under their original names and shapes. With --hf-config the output "
        "directory also gets config.json and loads with transformers' from_pretrained.",
    )
    export.add_argument("checkpoint", help="checkpoint directory (sharded) or file (full)")
    export.add_argument("out_dir", help="output directory (created if needed)")
    export.add_argument("--format", choices=("safetensors", "pt"), default="safetensors")
    export.add_argument(
        "--strip-prefix",
        default=None,
        help=f"remove this prefix from every name (default: '{_TRAINING_MODULE_PREFIX}' when "
        "every weight carries it, as in checkpoints written by 'yafsdp train'; '' keeps all)",
    )
    export.add_argument(
        "--hf-config", default=None, help="local Hugging Face model/config directory to copy"
    )
    export.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="cast floating weights (default: as stored, fp32)",
    )

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
    import torch

    from lightning_yafsdp.checkpoint import CheckpointError, export_checkpoint, inspect_checkpoint

    try:
        prefix = options.strip_prefix
        if prefix is None:
            prefix = _default_prefix(inspect_checkpoint(options.checkpoint))
        hf_config = None
        if options.hf_config:
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(options.hf_config, local_files_only=True)
        path = export_checkpoint(
            options.checkpoint,
            options.out_dir,
            fmt=options.format,
            hf_config=hf_config,
            strip_prefix=prefix,
            dtype=getattr(torch, options.dtype) if options.dtype else None,
        )
    except (CheckpointError, OSError, ValueError) as err:
        print(f"yafsdp export: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def run_inspect(options: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from lightning_yafsdp.checkpoint import CheckpointError, inspect_checkpoint, render_inspection

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


def _default_prefix(info: dict) -> str:
    names = info["tensor_names"]
    if names and all(name.startswith(_TRAINING_MODULE_PREFIX) for name in names):
        return _TRAINING_MODULE_PREFIX
    return ""
