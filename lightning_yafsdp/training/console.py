"""Rich console output of ``yafsdp train``: the startup panel and the final summary."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
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


def estimate_table(est: Estimate, *, title: str = "memory per rank") -> Table:
    """Memory per rank by role and traffic per step, from ``yafsdp estimate``."""
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("what")
    table.add_column("bytes", justify="right")
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
            f"activations, {est.checkpointed_units} block(s) checkpointed (recipe)",
            est.activations(est.checkpointed_units),
        ),
        ("total (recipe)", est.total),
    ]
    for name, value in rows:
        table.add_row(name, human_bytes(value))
    comm = est.comm_per_step
    table.add_row("all_gather per optimizer step", human_bytes(comm["all_gather"]))
    table.add_row("reduce_scatter per optimizer step", human_bytes(comm["reduce_scatter"]))
    if "replicate_all_reduce" in comm:
        table.add_row(
            "replicate all_reduce per optimizer step", human_bytes(comm["replicate_all_reduce"])
        )
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
    run_dir: str,
    start: str = "fresh run",
    warnings: Sequence[str] = (),
) -> Panel:
    """What is about to run: model, sharding, memory per rank, data, outputs."""
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold cyan")
    facts.add_column()
    largest = max(est.units, key=lambda g: g.padded_numel)
    shards = est.master_shards + est.grad_shards + est.compute_shards + est.frozen_shards
    buffers = est.weight_buffers + est.grad_buffers + est.resident_buffers + est.gather_staging
    facts.add_row("model", f"{model_name}: {human_count(est.num_parameters)} parameters")
    facts.add_row(
        "units",
        f"{est.num_blocks} blocks + {len(est.units) - est.num_blocks} root units, sharded "
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
    facts.add_row("outputs", run_dir)
    facts.add_row("start", start)
    for warning in warnings:
        facts.add_row("warning", f"[yellow]{warning}[/yellow]")
    return Panel(facts, title=f"yafsdp train: {recipe}", border_style="cyan")


def summary_table(facts: dict[str, Any], losses: Sequence[float]) -> Group:
    """The final summary: steps, tokens, speed, memory, losses and a loss sparkline."""
    table = Table(title="run summary", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right", overflow="fold")  # paths whole, over several lines
    for key, value in facts.items():
        table.add_row(key, value if isinstance(value, str) else f"{value}")
    line = sparkline(losses)
    if not line:
        return Group(table)
    return Group(table, f"train loss  {losses[0]:.2f} {line} {losses[-1]:.2f}")


def print_rich(renderable: Any) -> None:
    Console(soft_wrap=False).print(renderable)
