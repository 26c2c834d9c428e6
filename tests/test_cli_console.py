"""The startup panel and the run summary print every path whole, on a line of its own."""

from __future__ import annotations

import io

from rich.console import Console
from rich.panel import Panel

from lightning_yafsdp.training.console import print_startup, print_summary

LONG = "/scratch/project/someone/runs/tiny-cpu-20260101-120000/checkpoints/epoch=0-step=450.ckpt"


def test_summary_paths_are_never_wrapped_on_a_narrow_terminal() -> None:
    out = io.StringIO()
    narrow = Console(file=out, width=40, soft_wrap=False)
    paths = {"outputs": LONG.rsplit("/checkpoints", 1)[0], "checkpoint": LONG}
    print_summary({"steps": "450", "final val loss": "2.410"}, paths, [5.5, 3.0], console=narrow)
    lines = out.getvalue().splitlines()
    assert f"checkpoint  {LONG}" in lines  # the whole path on one line, copyable
    assert f"outputs     {paths['outputs']}" in lines
    assert any(line.startswith("train loss  5.50 ") for line in lines)


def test_startup_paths_are_printed_below_the_panel_unwrapped() -> None:
    out = io.StringIO()
    narrow = Console(file=out, width=40, soft_wrap=False)
    paths = {"outputs": LONG.rsplit("/checkpoints", 1)[0], "resuming": LONG}
    print_startup(Panel("model: tiny", title="yafsdp train: tiny-cpu"), paths, console=narrow)
    lines = out.getvalue().splitlines()
    assert f"resuming  {LONG}" in lines and f"outputs   {paths['outputs']}" in lines
    assert lines.index(f"outputs   {paths['outputs']}") > 0  # below the panel
