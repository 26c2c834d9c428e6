"""Smoke test of the Lightning benchmark (benchmarks/compare.py): runs end to end.

One measured step of the tiny model per strategy (and of the one-process compute floor),
one round, no memory pass: it checks the plumbing (spawned 2-rank jobs, the 1-process
floor, the timing callback, the JSON report and its ``--from-json`` re-render), not speed.
The overhead arithmetic (step - floor, ratios, goals) is checked on made-up summaries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import compare

ROOT = Path(__file__).parents[1]
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def test_compare_quick_reports_every_strategy_with_ratios_and_goals(tmp_path):
    out = tmp_path / "compare.json"
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "compare.py"),
        "--quick",
        "--steps=1",
        "--warmup=1",
        "--rounds=1",
        "--no-memory-pass",
        "--accelerator=cpu",
        "--estimate",
        f"--json={out}",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())

    ran = ["yafsdp", "ddp", "fsdp2", "floor"]
    assert report["strategies"] == ran
    assert set(report["summaries"]) == set(ran)
    # On CPU, FSDP1 is refused by Lightning; DeepSpeed needs CUDA (and the package).
    assert set(report["skipped"]) == {"fsdp", "deepspeed"}
    assert "skipped: fsdp" in proc.stdout
    for name in ran:
        summary = report["summaries"][name]
        assert len(summary["step_times_s"]) == 1 and summary["median_step_s"] > 0
        assert min(summary["timing_runs_memory"]["peak_rss_mib_per_rank"]) > 0
        for peer in ("ddp", "fsdp2"):
            assert report["ratios"][name][f"step_vs_{peer}"] > 0
            assert report["ratios"][name][f"mem_vs_{peer}"] > 0
    assert report["ratios"]["ddp"]["step_vs_ddp"] == 1.0
    # Same seed, same rows: every strategy starts from the same loss; the floor (one
    # process) trains on rank 0's rows.
    losses = [report["summaries"][name]["first_loss_per_rank"] for name in ran[:3]]
    torch.testing.assert_close(torch.tensor(losses[1:]), torch.tensor(losses[:1]).expand(2, 2))
    floor = report["summaries"]["floor"]
    assert floor["lightning_strategy"] == "SingleDeviceStrategy"
    assert len(floor["timing_runs_memory"]["peak_rss_mib_per_rank"]) == 1
    torch.testing.assert_close(floor["first_loss_per_rank"][0], losses[0][0])
    assert set(report["overheads_s"]) == {"yafsdp", "ddp", "fsdp2"}
    assert "| floor |" in report["overhead_markdown"]
    assert "overhead vs FSDP2" in proc.stdout

    assert [g["key"] for g in report["goals"]] == [
        "step_vs_ddp",
        "step_vs_fsdp2",
        "mem_vs_fsdp2",
        "mem_vs_ddp",
        "overhead_vs_fsdp2",
        "overhead_vs_ddp",
    ]
    overheads = report["overheads_s"]
    for goal in report["goals"]:
        metric, _, peer = goal["key"].partition("_vs_")
        if metric == "overhead" and overheads[peer] <= 0:
            # One measured step on a shared machine: a peer can beat the single-process
            # floor, and then there is no overhead to compare (goal not judged).
            assert goal["met"] is None, goal
        else:
            assert isinstance(goal["met"], bool), goal
    comm = report["summaries"]["yafsdp"]["comm_per_step"]
    assert comm["all_gather"]["calls"] > 0 and comm["reduce_scatter"]["bytes"] > 0
    assert "| yafsdp |" in report["table_markdown"]

    estimate = report["estimate"]  # the estimator may be absent; then it says why
    assert isinstance(estimate, dict)
    if "rows" in estimate:
        terms = {row["term"] for row in estimate["rows"]}
        assert {"master_shards", "weight_buffers", "comm all_gather bytes/step"} <= terms
    else:
        assert estimate["unavailable"]

    rerun = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare.py"), f"--from-json={out}"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert report["overhead_markdown"] in rerun.stdout


def _summary(step: float) -> dict:
    return {"median_step_s": step, "memory_pass": None, "timing_runs_memory": {}}


def test_overhead_ratios_and_goals_use_the_floor():
    summaries = {n: _summary(t) for n, t in [("yafsdp", 1.3), ("ddp", 1.5), ("fsdp2", 2.0)]}
    summaries["floor"] = _summary(1.0)
    for s in summaries.values():
        s["timing_runs_memory"]["peak_rss_mib_per_rank"] = [100.0]
    ratios = compare.compute_ratios(summaries)
    assert compare.overheads(summaries) == pytest.approx({"yafsdp": 0.3, "ddp": 0.5, "fsdp2": 1.0})
    assert ratios["yafsdp"]["overhead_vs_ddp"] == pytest.approx(0.6)
    assert ratios["yafsdp"]["overhead_vs_fsdp2"] == pytest.approx(0.3)
    assert "overhead_vs_ddp" not in ratios["floor"]
    goals = {g["key"]: g for g in compare.goal_results(ratios)}
    assert goals["overhead_vs_fsdp2"]["goal"] == 0.6 and goals["overhead_vs_fsdp2"]["met"]
    assert goals["overhead_vs_ddp"]["goal"] == 1.2 and goals["overhead_vs_ddp"]["met"]
    assert "| yafsdp | 1.300 | +0.300 |" in compare.render_overhead_table(summaries, ratios)

    summaries["ddp"]["median_step_s"] = 0.9  # a peer at or under the floor: no ratio
    goals = {g["key"]: g for g in compare.goal_results(compare.compute_ratios(summaries))}
    assert goals["overhead_vs_ddp"]["met"] is None
    del summaries["floor"]  # no floor (an old --json file): no overheads, goals n/a
    ratios = compare.compute_ratios(summaries)
    assert compare.overheads(summaries) == {}
    assert compare.render_overhead_table(summaries, ratios) is None
    assert {g["key"]: g["met"] for g in compare.goal_results(ratios)}["overhead_vs_fsdp2"] is None


def test_compiled_runs_are_judged_by_the_compiled_goals():
    summaries = {n: _summary(t) for n, t in [("yafsdp", 1.0), ("ddp", 1.0), ("fsdp2", 1.2)]}
    for s in summaries.values():
        s["timing_runs_memory"]["peak_rss_mib_per_rank"] = [100.0]
    ratios = compare.compute_ratios(summaries)
    goals = {g["key"]: g for g in compare.goal_results(ratios, compare.COMPILE_GOALS)}
    assert set(goals) == {"step_vs_ddp", "step_vs_fsdp2"}
    assert goals["step_vs_ddp"]["goal"] == 1.10 and goals["step_vs_ddp"]["met"]
    # 1.0 / 1.2 = 0.83x FSDP2's compiled step: under the 0.90x goal.
    assert goals["step_vs_fsdp2"]["goal"] == 0.90 and goals["step_vs_fsdp2"]["met"]
    table = compare.render_table(summaries, ratios, 1024, compare.COMPILE_GOALS)
    assert "0.83x (met, goal <= 0.90x)" in table


def test_breakdown_splits_the_cpu_time_into_the_main_thread_and_the_other_threads():
    """The busier rank's CPU per step, what of it ran outside the main thread (on CPU:
    gloo's workers) and in the kernel, and its page faults, against the floor's
    (compare.py --breakdown)."""
    from benchmarks import _breakdown as bd
    from benchmarks._measure import markdown_table

    def step(cpu: float, main: float, kernel: float, faults: int, main_faults: int) -> dict:
        return {
            "forward": 0.1, "backward": 0.2, "optimizer": 0.05, bd.CPU: cpu, bd.MAIN_CPU: main,
            bd.KERNEL_CPU: kernel, bd.FAULTS: faults, bd.MAIN_FAULTS: main_faults,
        }  # fmt: skip

    floor = bd.phase_medians([[{"phases": [step(0.30, 0.30, 0.01, 900, 900)]}]])
    # Rank 1 is the busier one: its split is reported, not a mix of the two ranks'.
    yafsdp = bd.phase_medians(
        [
            [
                {"phases": [step(0.40, 0.36, 0.02, 50, 40)]},
                {"phases": [step(0.42, 0.35, 0.03, 7000, 4000)]},
            ]
        ]
    )
    summaries = {"floor": {"phases": floor}, "yafsdp": {"phases": yafsdp}}
    text = bd.render(summaries, "floor", markdown_table)
    assert "of which not the main thread" in text and "page faults: main thread / others" in text
    cells = (
        "100.0 (+0.0) | 200.0 (+0.0) | 50.0 (+0.0) | 420.0 (+120.0) | 70.0 (+70.0) "
        "| 30.0 (+20.0) | 4000 / 3000"
    )
    assert f"| yafsdp | {cells} |" in text


def test_the_breakdown_measures_the_faults_of_a_step():
    """A PhaseClock step that touches 8 MiB of fresh memory in the main thread counts its
    faults there (one per page: 2048 of 4 KiB, or 4 where the kernel gives huge pages); a
    JSON of an older run still renders."""
    from benchmarks import _breakdown as bd
    from benchmarks._measure import markdown_table

    clock = bd.PhaseClock()
    for name in ("start", "before_backward"):
        clock.mark(name)
    fresh = bytearray(8 << 20)  # zero-filled by Python: every page written once
    clock.mark("after_backward")
    clock.close_step(measured=True)
    del fresh
    faults = clock.steps[0][bd.MAIN_FAULTS]
    assert (8 << 20) // (2 << 20) <= faults <= clock.steps[0][bd.FAULTS], clock.steps[0]
    old = {"forward": 0.1, "backward": 0.2, "optimizer": 0.05, bd.CPU: 0.4, bd.MAIN_CPU: 0.3}
    assert "| old | 100.0 | 200.0 | 50.0 | 400.0 | 100.0 | nan | nan / nan |" in bd.render(
        {"old": {"phases": old}}, "floor", markdown_table
    )


@pytest.mark.parametrize("ranks", [2, 3])
def test_gloo_exchanges_checks_the_pairwise_results_and_prints_their_ratios(ranks, tmp_path):
    # benchmarks/gloo_exchanges.py first checks that the pairwise results equal gloo's
    # collectives on its ranks (a rank failing that exits non-zero), then measures.
    rows = _table_rows(
        "gloo_exchanges.py", f"--ranks={ranks}", "--numel=30000", "--calls=2", "--rounds=1",
        cwd=tmp_path,
    )  # fmt: skip
    assert [row.split(" | ")[0].strip("| ") for row in rows] == [
        "gather collective",
        "gather pairwise",
        "reduce all_reduce",
        "reduce reduce_scatter",
        "reduce pairwise",
    ]
    assert "x gather collective" in rows[1] and "x reduce all_reduce" in rows[4]


def test_order_check_prints_every_mode_against_the_tag_exchanges(tmp_path):
    # benchmarks/order_check.py switches one engine between the exchange line, tag
    # exchanges and no check, step by step; the plumbing only (timings are its output).
    rows = _table_rows(
        "order_check.py", "--quick", "--cycles=1", "--batch=1", "--seq=16", cwd=tmp_path
    )
    assert [row.split(" | ")[0].strip("| ") for row in rows] == ["line", "tags", "off"]
    assert rows[1].endswith("| - |") and " / " in rows[0]


def _table_rows(script: str, *flags: str, cwd) -> list[str]:
    """The rows of the table ``benchmarks/<script>`` prints (after its separator line)."""
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *flags]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env=env, cwd=cwd, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if line.startswith("| ")][1:]
