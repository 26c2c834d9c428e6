"""Where each millisecond of a step goes, for ``compare.py --breakdown``.

Two views, both per measured step (medians over steps for the phases, means for the
engine's sums):

* phases, for every strategy the same way (Lightning callbacks on every rank, the
  slower rank's step): forward (``on_train_batch_start`` -> ``on_before_backward``),
  backward (-> ``on_after_backward``) and optimizer (-> ``on_train_batch_end``: clipping,
  the step, zero_grad). Each phase minus the floor's says where a strategy's overhead is:
  DDP's all_reduce shows in backward, ZeRO-3's gathers in forward and backward. Beside
  them the step's CPU time, whole process and not the main thread: on CPU the second is
  gloo's threads moving the collectives' bytes (its workers for DDP's all_reduce; mostly
  its transport thread for the engine's pairwise exchanges, whose sends may also write
  from the main thread: [Note: pairwise exchanges on gloo]), the cost no schedule can
  hide when every core computes (2 ranks on 2 cores). Two more columns say what of that
  CPU the kernel spent (socket copies, page faults) and how many minor page faults a
  step took, in the main thread and in the others: glibc returns a freed block at the
  top of its heap to the kernel once enough is free there, and memory allocated anew
  each step (the logits, a gradient window) then faults in again, 4 KiB at a time,
  depending on where the step's allocations landed (docs/performance.md, "Step overhead:
  what the kernel and the faults cost").
* yafsdp's own time ([Note: step breakdown], ``core/comm/step_timing.py``): time in the
  engine's hooks, split into our Python (with the grad copies the hooks make), issuing
  collectives, and exposed waits per kind (the communication the schedule did not
  hide), plus how many waits found their collective already complete (hidden behind
  compute; always 0 on CPU, where gloo reports a send or receive complete only once
  it is waited).
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any

PHASES = ("forward", "backward", "optimizer")
# CPU seconds of the whole rank process (every thread: gloo's workers too) per step: the
# work a step costs, which other load on the machine does not inflate as it does wall time.
CPU = "cpu"
# CPU seconds of the main thread alone (forward, backward, our hooks, the optimizer): the
# rest of CPU is the other threads', on CPU mostly gloo's workers copying the collectives'
# bytes, so CPU - MAIN_CPU is what the communication itself costs.
MAIN_CPU = "main_cpu"
OTHER_CPU = "other_cpu"  # CPU - MAIN_CPU, derived when rendering
# Kernel-mode CPU seconds of the whole process: the sockets' copies and the page faults.
KERNEL_CPU = "kernel_cpu"
# Minor page faults per step: of the whole process, and of the main thread alone.
FAULTS = "faults"
MAIN_FAULTS = "main_faults"
# Linux only (getrusage of the calling thread); elsewhere the main thread's faults are nan.
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)


class PhaseClock:
    """Per-step phase times of one rank (seconds), fed by a Lightning callback."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self._marks[name] = time.perf_counter()
        if name == "start":
            self._cpu_start = time.process_time()
            self._main_cpu_start = time.thread_time()
            self._usage_start = _usage()

    def close_step(self, measured: bool) -> None:
        t = self._marks
        if measured and {"start", "before_backward", "after_backward"} <= t.keys():
            end = time.perf_counter()
            self.steps.append(
                {
                    "forward": t["before_backward"] - t["start"],
                    "backward": t["after_backward"] - t["before_backward"],
                    "optimizer": end - t["after_backward"],
                    CPU: time.process_time() - self._cpu_start,
                    MAIN_CPU: time.thread_time() - self._main_cpu_start,
                    **{k: v - self._usage_start[k] for k, v in _usage().items()},
                }
            )
        self._marks = {}


def _usage() -> dict[str, float]:
    """The kernel CPU and minor page faults so far (process), and the thread's faults."""
    process = resource.getrusage(resource.RUSAGE_SELF)
    thread = resource.getrusage(_RUSAGE_THREAD) if _RUSAGE_THREAD is not None else None
    return {
        KERNEL_CPU: process.ru_stime,
        FAULTS: float(process.ru_minflt),
        MAIN_FAULTS: float(thread.ru_minflt) if thread is not None else float("nan"),
    }


def start_engine_timing() -> Any:
    """Measure the engine's hooks from now on; returns the ``StepTiming``."""
    from lightning_yafsdp.core.comm.step_timing import StepTiming, activate

    timing = StepTiming()
    activate(timing)
    return timing


def stop_engine_timing(timing, steps: int) -> dict | None:
    """The engine's sums divided per step; measuring stops."""
    if timing is None:
        return None
    from lightning_yafsdp.core.comm.step_timing import activate

    activate(None)
    snap = timing.snapshot()
    per_step = {k: snap[k] / steps for k in ("hook_s", "python_s")}
    for key in ("issue_s", "wait_s"):
        per_step[key] = {kind: s / steps for kind, s in snap[key].items()}
    per_step["waited"] = {kind: n / steps for kind, n in snap["waited"].items()}
    per_step["hidden"] = {kind: n / steps for kind, n in snap["hidden"].items()}
    return per_step


def phase_medians(jobs: list[list[dict]]) -> dict[str, float] | None:
    """Median over steps of each phase, of the slower rank per step (s)."""
    counters = (CPU, MAIN_CPU, KERNEL_CPU, FAULTS, MAIN_FAULTS)
    per_step: dict[str, list[float]] = {p: [] for p in (*PHASES, *counters)}
    for job in jobs:
        ranks = [r.get("phases") or [] for r in job]
        for steps in zip(*ranks):
            slower = max(steps, key=lambda s: sum(s[p] for p in PHASES))
            for p in PHASES:
                per_step[p].append(slower[p])
            busier = max(steps, key=lambda s: s[CPU])
            for counter in counters:
                per_step[counter].append(busier.get(counter, float("nan")))
    if not per_step["forward"]:
        return None
    return {p: statistics.median(v) for p, v in per_step.items()}


def engine_means(jobs: list[list[dict]]) -> dict | None:
    """Rank 0's engine timing, averaged over jobs."""
    found = [job[0]["engine_timing"] for job in jobs if job[0].get("engine_timing")]
    if not found:
        return None
    out: dict[str, Any] = {k: statistics.mean(f[k] for f in found) for k in ("hook_s", "python_s")}
    for key in ("issue_s", "wait_s", "waited", "hidden"):
        kinds = sorted({kind for f in found for kind in f[key]})
        out[key] = {kind: statistics.mean(f[key].get(kind, 0.0) for f in found) for kind in kinds}
    return out


def render(summaries: dict[str, dict], floor: str, markdown_table) -> str | None:
    """The phase table (ms, with each phase's excess over the floor) and yafsdp's own
    time; None when no job recorded phases."""
    rows, base = [], summaries.get(floor, {}).get("phases")
    base = _with_other(base) if base else None
    for name, s in summaries.items():
        if not s.get("phases"):
            continue
        row, phases = [name], _with_other(s["phases"])
        for p in (*PHASES, CPU, OTHER_CPU, KERNEL_CPU):
            cell = f"{1e3 * phases[p]:.1f}"
            if base and name != floor:
                cell += f" ({1e3 * (phases[p] - base[p]):+.1f})"
            row.append(cell)
        row.append(f"{phases[MAIN_FAULTS]:.0f} / {phases[FAULTS] - phases[MAIN_FAULTS]:.0f}")
        rows.append(row)
    if not rows:
        return None
    header = [
        "strategy",
        *(f"{p} ms (vs floor)" for p in PHASES),
        "CPU ms/rank (vs floor)",
        "of which not the main thread (vs floor)",
        "of which in the kernel (vs floor)",
        "page faults: main thread / others",
    ]
    lines = [markdown_table(header, rows, "lrrrrrrr")]
    for name, s in summaries.items():
        if s.get("engine_timing"):
            lines.append(_engine_lines(name, s["engine_timing"]))
    return "\n".join(lines)


def _with_other(phases: dict[str, float]) -> dict[str, float]:
    nan = float("nan")
    return {
        **{k: nan for k in (KERNEL_CPU, FAULTS, MAIN_FAULTS)},  # a JSON from before them
        **phases,
        OTHER_CPU: phases[CPU] - phases.get(MAIN_CPU, nan),
    }


def _engine_lines(name: str, t: dict) -> str:
    kinds = sorted(set(t["issue_s"]) | set(t["wait_s"]))
    parts = [
        f"{name}: in the engine's hooks {1e3 * t['hook_s']:.1f} ms/step = "
        f"Python and grad copies {1e3 * t['python_s']:.1f} "
        f"+ issuing {1e3 * sum(t['issue_s'].values()):.1f} "
        f"+ exposed waits {1e3 * sum(t['wait_s'].values()):.1f}"
    ]
    for kind in kinds:
        waited, hidden = t["waited"].get(kind, 0), t["hidden"].get(kind, 0)
        parts.append(
            f"  {kind:14s} issue {1e3 * t['issue_s'].get(kind, 0):6.1f} ms  exposed wait "
            f"{1e3 * t['wait_s'].get(kind, 0):6.1f} ms  waits/step {waited:5.1f}, "
            f"already complete {hidden:5.1f}"
        )
    return "\n".join(parts)
