"""Entry point of the ``yafsdp`` command.

Only ``--version`` and ``--help`` exist today. The commands ``train``, ``estimate``,
``export`` and ``inspect`` are added by later issues, each when it works; none is
registered before then.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lightning_yafsdp import __version__

_PLANNED_COMMANDS = ("train", "estimate", "export", "inspect")

_PLANNED_HELP = """\
planned commands (not available in this version):
  train     run a training recipe (recipes/*.yaml)
  estimate  estimate memory and step time for a model and cluster
  export    consolidate a sharded checkpoint into a plain state dict / safetensors
  inspect   show the sharding layout of a model or checkpoint
"""


def build_parser() -> argparse.ArgumentParser:
    """Builds the argument parser of the ``yafsdp`` command."""
    parser = argparse.ArgumentParser(
        prog="yafsdp",
        description=(
            "YaFSDP-style fully sharded data parallelism for PyTorch Lightning. "
            "This version provides no commands yet."
        ),
        epilog=_PLANNED_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``yafsdp`` command.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The process exit code.
    """
    parser = build_parser()
    _, unknown = parser.parse_known_args(argv)
    if unknown and unknown[0] in _PLANNED_COMMANDS:
        parser.error(
            f"'{unknown[0]}' is planned but not available in version {__version__}; "
            "see 'yafsdp --help'"
        )
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    # No command exists yet: with nothing to run, show what the command will offer.
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
