"""Rich console output of ``yafsdp train``: the startup panel and the final summary."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from lightning_yafsdp.estimate import Estimate

_SPARKS = "▁▂▃▄▅▆▇█"


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def sparkline(values: Sequence[float], width: int = 48) -> str:
    """A one-line chart of ``values`` (binned to ``width`` characters, mean per bin)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ""
    bins = min(width, len(finite))
    means = []
    for i in range(bins):
        chunk = finite[i * len(finite) // bins : (i + 1) * len(finite) // bins]
        means.append(sum(chunk) / len(chunk))
    low, high = min(means), max(means)
    span = (high - low) or 1.0
    return "".join(_SPARKS[min(7, int((v - low) / span * 7.999))] for v in means)


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB")


def common_unit(values: Sequence[float]) -> tuple[str, int]:
    """The binary unit (at most GiB) of the largest value: one unit for a whole column,
    so rows compare at a glance (no 1017.5 GiB next to 1.0 TiB)."""
    largest = max((abs(v) for v in values), default=0)
    power = 0
    while power < len(_BINARY_UNITS) - 1 and largest >= 1024 ** (power + 1):
        power += 1
    return _BINARY_UNITS[power], 1024**power


def in_unit(value: float, unit: tuple[str, int]) -> str:
    """``value`` bytes in ``unit`` (``common_unit``), one decimal; tiny non-zero values
    say so instead of printing 0.0."""
    name, scale = unit
    if value == 0:
        return "0"
    if name == "B":
        return f"{value:,.0f} B"
    if 0 < value < 0.05 * scale:
        return f"< 0.1 {name}"
    return f"{value / scale:,.1f} {name}"


def estimate_table(est: Estimate, *, title: str = "memory per rank") -> Table:
    """Memory per rank by role and collective sizes per step, from ``yafsdp estimate``."""
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("what")
    table.add_column("size", justify="right")
    table.add_row("[bold]memory per rank[/bold]", "")
    rows = [
        ("master shards", est.master_shards),
        ("gradient shards", est.grad_shards),
        ("optimizer states (AdamW)", est.optimizer_states),
        ("compute shards (norms)", est.compute_shards),
        ("gather staging (cast on gather)", est.gather_staging),
        ("frozen shards", est.frozen_shards),
        ("unit weight buffers", est.weight_buffers),
        ("unit grad buffers", est.grad_buffers),
        ("resident groups (root, norms)", est.resident_buffers),
        ("activations, no checkpointing", est.activations(0)),
        ("activations, all blocks checkpointed", est.activations(est.num_blocks)),
        (
            f"activations, {est.checkpointed_units} unit(s) of blocks checkpointed (recipe)",
            est.activations(est.checkpointed_units),
        ),
    ]
    memory_unit = common_unit([est.total, *(value for _, value in rows)])
    for name, value in rows:
        table.add_row(name, in_unit(value, memory_unit))
    table.add_section()
    table.add_row("[bold]total (recipe)[/bold]", in_unit(est.total, memory_unit))
    comm = est.comm_per_step
    traffic = [
        ("all_gather: gathered size", comm["all_gather"]),
        ("reduce_scatter: unreduced size", comm["reduce_scatter"]),
    ]
    if "replicate_all_reduce" in comm:
        traffic.append(("replicate all_reduce: size", comm["replicate_all_reduce"]))
    table.add_section()
    # Sizes of the tensors each rank's collectives gather / reduce (what CommStats
    # counts), not link traffic: a ring moves (K-1)/K of them in and out per rank.
    steps = f"per optimizer step ({est.micro_batches} micro-batch(es)), each rank"
    table.add_row(f"[bold]collectives {steps}: tensor sizes[/bold]", "")
    traffic_unit = common_unit([value for _, value in traffic])
    for name, value in traffic:
        table.add_row(name, in_unit(value, traffic_unit))
    return table


def startup_panel(
    *,
    recipe: str,
    model_name: str,
    est: Estimate,
    world_size: int,
    precision: str,
    strategy: str,
    data: dict[str, Any],
    start: str = "fresh run",
    warnings: Sequence[str] = (),
) -> Panel:
    """What is about to run: model, sharding, memory per rank, data, how it starts.

    Paths are not in it: :func:`print_startup` prints them below it, whole.
    """
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold cyan")
    facts.add_column()
    largest = max(est.units, key=lambda g: g.padded_numel)
    shards = est.master_shards + est.grad_shards + est.compute_shards + est.frozen_shards
    buffers = est.weight_buffers + est.grad_buffers + est.resident_buffers + est.gather_staging
    facts.add_row("model", f"{model_name}: {human_count(est.num_parameters)} parameters")
    facts.add_row(
        "units",
        f"{_blocks_text(est)} + {len(est.units) - est.num_blocks} root units, sharded "
        f"(largest {human_count(largest.numel)} elements) + "
        f"{', '.join(g.name for g in est.residents)} resident",
    )
    hybrid = (
        f" (hybrid: {world_size // est.shard_size} replicas x {est.shard_size} sharded ranks)"
        if est.is_hybrid
        else ""
    )
    facts.add_row(
        "world", f"{world_size} rank(s){hybrid}, strategy {strategy}, ZeRO-{est.zero_stage}"
    )
    facts.add_row("precision", precision)
    facts.add_row(
        "per rank",
        f"shards {human_bytes(shards)}"
        f" + optimizer {human_bytes(est.optimizer_states)}"
        f" + buffers {human_bytes(buffers)}"
        f" + activations {human_bytes(est.activations(est.checkpointed_units))}"
        f" = {human_bytes(est.total)} (estimate)",
    )
    facts.add_row(
        "data",
        f"{data['source']}: {human_count(data['train_tokens'])} train / "
        f"{human_count(data['val_tokens'])} val tokens, vocab {data['vocab_size']}, "
        f"unigram baseline {data['unigram_entropy']:.3f} nats",
    )
    facts.add_row("start", start)
    for warning in warnings:
        facts.add_row("warning", f"[yellow]{warning}[/yellow]")
    return Panel(facts, title=f"yafsdp train: {recipe}", border_style="cyan")


def summary_table(facts: dict[str, Any]) -> Table:
    """The final summary's facts: steps, tokens, speed, memory, losses."""
    table = Table(title="run summary", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, value in facts.items():
        table.add_row(key, value if isinstance(value, str) else f"{value}")
    return table


def print_summary(
    facts: dict[str, Any],
    paths: dict[str, str],
    losses: Sequence[float],
    *,
    console: Console | None = None,
) -> None:
    """The final summary: the facts' table, then each output path on a line of its own
    (:func:`print_paths`), then a sparkline of the train loss."""
    console = console or Console(soft_wrap=False)
    console.print(summary_table(facts))
    print_paths(paths, console=console)
    line = sparkline(losses)
    if line:
        console.print(f"train loss  {losses[0]:.2f} {line} {losses[-1]:.2f}")


def print_startup(panel: Panel, paths: dict[str, str], *, console: Console | None = None) -> None:
    """The startup panel, then its paths (outputs, the checkpoint resumed) unwrapped."""
    console = console or Console(soft_wrap=False)
    console.print(panel)
    print_paths(paths, console=console)


def print_paths(paths: dict[str, str], *, console: Console) -> None:
    """Each path on a line of its own, never wrapped: a panel or table cell folds a long
    path mid-name, and a path cut in two cannot be copied."""
    width = max((len(key) for key in paths), default=0)
    for key, path in paths.items():
        console.print(f"{key:<{width}}  {path}", soft_wrap=True, highlight=False, markup=False)


def print_rich(renderable: Any) -> None:
    Console(soft_wrap=False).print(renderable)


def _blocks_text(est) -> str:
    """``16 blocks``, or ``16 blocks in 8 units`` when blocks are grouped."""
    blocks = est.num_grouped_blocks
    if blocks == est.num_blocks:
        return f"{blocks} blocks"
    return f"{blocks} blocks in {est.num_blocks} units"
