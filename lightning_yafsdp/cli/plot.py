"""``yafsdp plot RUN``: write a run's loss / lr / tokens/s picture and print its path."""

from __future__ import annotations

import argparse
import sys


def add_plot_command(commands: argparse._SubParsersAction) -> None:
    """Adds ``plot`` to the ``yafsdp`` subcommands.

    Args:
        commands: The subparsers of the ``yafsdp`` parser.
    """
    plot = commands.add_parser(
        "plot",
        help="draw a run's loss, learning rate and tokens/s (PNG, SVG, PDF)",
        description="Draw the train and validation loss (with the unigram baseline of a "
        "finished run's summary.json), the learning rate and tokens/s against step from "
        "a run's logs/metrics.csv (default: metrics.png in the run directory; `yafsdp "
        "train` writes it at the end of a run) and print its path. Works while the run "
        "is still training.",
    )
    plot.add_argument("run", metavar="RUN", help="a run directory (runs/NAME) or its metrics.csv")
    plot.add_argument(
        "--output",
        default=None,
        metavar="PATH",
        help="the file to write, in the format of its extension (.png, .svg, .pdf, .jpg; "
        "default: RUN/metrics.png)",
    )


def run_plot(options: argparse.Namespace) -> int:
    """Runs ``yafsdp plot``: 0 when the PNG is written, 2 (one line) when it cannot be."""
    from lightning_yafsdp.training.plot import PlotError, write_plot

    try:
        path = write_plot(options.run, output=options.output)
    except PlotError as err:
        print(f"yafsdp plot: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # an --output that cannot be written
        print(f"yafsdp plot: cannot write {options.output or 'the plot'}: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0
