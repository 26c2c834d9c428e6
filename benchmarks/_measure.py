"""Measurement and reporting pieces shared by the CPU benchmarks.

``engine_cpu.py`` (torch-level engine) and ``compare.py`` (Lightning strategies) both
run every (strategy, round) as a fresh multi-rank job and report the same things the
same way; this module holds what they share:

* peak RSS: the kernel's high-water mark (``VmHWM``, what ``ru_maxrss`` reports) and
  its reset, the current RSS, and the per-rank summary of the three phases a rank
  records (import, build, train);
* the environment of the memory pass (glibc malloc settings under which RSS follows
  live tensor bytes) and a context manager that applies it to spawned ranks;
* step times: the slower rank's time per step, and its median;
* report formatting: markdown tables, ratios printed next to their goals, per-step
  collective counts and bytes, and the JSON dump.

Only the standard library is imported here (the ranks import torch themselves).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------- RSS


def current_rss_kib() -> int:
    """Resident set size of this process now (KiB)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024


def hwm_kib() -> int:
    """Peak RSS since start or the last :func:`reset_hwm` (VmHWM; what ru_maxrss reports)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def reset_hwm() -> bool:
    """Reset the kernel's peak-RSS counter to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# glibc settings of the memory pass: every allocation over 256 KiB is its own mmap and
# is unmapped on free, so RSS follows live tensor bytes instead of the heap's history.
LIVE_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "262144", "MALLOC_TRIM_THRESHOLD_": "262144"}


def live_malloc_note() -> str:
    """The memory pass's malloc settings as ``K=V K=V`` (for report footnotes)."""
    return " ".join(f"{k}={v}" for k, v in LIVE_MALLOC_ENV.items())


@contextlib.contextmanager
def environment(env: dict[str, str] | None) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the block (spawned ranks inherit it; glibc reads
    the malloc variables at process start-up), then restore the previous values."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def memory_summary(jobs: list[list[dict]], world_size: int) -> dict:
    """Per-rank peaks in MiB, max over jobs.

    Each rank result holds ``import_rss_kib`` (RSS after imports and the process group),
    ``build_peak_kib`` / ``train_peak_kib`` (the kernel's peak counter read at the end of
    building and of training, reset in between), ``train_start_rss_kib`` and
    ``peak_rss_kib`` (the whole-process peak, what ru_maxrss would report).
    """

    def per_rank(fn: Callable[[dict], float]) -> list[float]:
        return [max(fn(job[r]) for job in jobs) / 1024 for r in range(world_size)]

    return {
        "peak_rss_mib_per_rank": per_rank(lambda r: r["peak_rss_kib"]),
        "growth_over_import_mib_per_rank": per_rank(
            lambda r: max(r["build_peak_kib"], r["train_peak_kib"]) - r["import_rss_kib"]
        ),
        "train_peak_rss_mib_per_rank": per_rank(lambda r: r["train_peak_kib"]),
        "train_growth_mib_per_rank": per_rank(
            lambda r: r["train_peak_kib"] - r["train_start_rss_kib"]
        ),
        "import_rss_mib_per_rank": per_rank(lambda r: r["import_rss_kib"]),
    }


# --------------------------------------------------------------------------- step times


def slower_rank_times(results: Sequence[dict], key: str = "step_times_s") -> list[float]:
    """Per measured step, the slower rank's time (one job's rank results)."""
    return [max(ts) for ts in zip(*(r[key] for r in results))]


def median_step(results: Sequence[dict], key: str = "step_times_s") -> float:
    """Median over a job's measured steps of the slower rank's time."""
    return statistics.median(slower_rank_times(results, key))


def rotations(names: Sequence[str], rounds: int) -> Iterator[tuple[int, list[str]]]:
    """``(round, order)`` with the order rotated by one each round (interleaving)."""
    names = list(names)
    for rnd in range(rounds):
        k = rnd % len(names) if names else 0
        yield rnd, names[k:] + names[:k]


def comm_per_step(snapshot: dict | None, steps: int) -> dict | None:
    """A ``CommStats.snapshot()`` over ``steps`` steps -> per-step calls and bytes by kind."""
    if snapshot is None:
        return None
    return {
        kind: {
            "calls": snapshot["calls"][kind] / steps,
            "bytes": snapshot["bytes"][kind] / steps,
        }
        for kind in sorted(snapshot["calls"])
    }


# --------------------------------------------------------------------------- formatting


def fmt_comm(comm: dict | None) -> str:
    """``all_gather 32x / 361.1 MiB; reduce_scatter 18x / 193.1 MiB`` (per step)."""
    if not comm:
        return "-"
    parts = [f"{kind} {c['calls']:g}x / {c['bytes'] / 2**20:.1f} MiB" for kind, c in comm.items()]
    return "; ".join(parts)


def ratio(value: float | None, goal: float | None) -> str:
    """``0.79x`` or, with a goal (an upper bound), ``0.79x (met, goal <= 1.10x)``."""
    if value is None:
        return "-"
    if goal is None:
        return f"{value:.2f}x"
    return f"{value:.2f}x ({'met' if value <= goal else 'MISSED'}, goal <= {goal:.2f}x)"


def goal_met(value: float | None, goal: float) -> bool | None:
    return None if value is None else value <= goal


def pair(values: Iterable[float]) -> str:
    """Per-rank values as ``1157 / 1155``."""
    return " / ".join(f"{v:.0f}" for v in values)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str) -> str:
    """A markdown table; ``align`` has one letter per column: ``l`` (``---``) or ``r``."""
    marks = {"l": "---", "r": "---:"}
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(marks[a] for a in align) + "|",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def platform_line() -> str:
    """``torch X, Python Y, N CPUs (arch)``; imports torch."""
    import torch

    return (
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})"
    )


def platform_info() -> dict[str, Any]:
    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def write_json(path: str | os.PathLike, payload: dict) -> None:
    """Write ``payload`` as indented JSON and say so."""
    Path(path).write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")
