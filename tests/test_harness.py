"""The multi-rank harness (tests/distributed.py) behaves as its contract says."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed import DistributedTimeoutError, RankFailedError, dist_run

# --- functions run on the ranks (module level, so that they pickle) --------------------


def _rank_and_env(tag):
    return {
        "tag": tag,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")},
        "master_port": int(os.environ["MASTER_PORT"]),
        "threads": torch.get_num_threads(),
    }


def _all_reduce_rank_plus_one():
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return t


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom from the second rank")
    # Rank 0 waits in a collective that rank 1 never joins; dist_run must not wait for
    # the collective timeout to end it.
    dist.barrier()
    return "unreachable"


def _hang_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.barrier()


def _exit_3_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _large_result(numel):
    return {f"w{i}": torch.full((numel,), float(dist.get_rank())) for i in range(4)}


def _ready():
    return None


def _note_pid_and_sleep(directory):
    Path(directory, f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def _kwargs_echo(a, *, b):
    return (a, b)


def _test_process_state(name):
    return {"value": os.environ.get(name), "cwd": os.getcwd()}


# --- tests ------------------------------------------------------------------------------


@pytest.fixture
def ranks_start_at_once():
    """The fork server up and done importing, so that a timed call measures only itself."""
    dist_run(1, _ready)


def test_results_come_back_indexed_by_rank_with_env_and_group_set():
    results = dist_run(2, _rank_and_env, "x")

    assert [r["rank"] for r in results] == [0, 1]
    for rank, r in enumerate(results):
        assert r["tag"] == "x"
        assert r["world_size"] == 2
        assert r["backend"] == "gloo"
        assert r["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
        }
        assert r["threads"] == max(1, os.cpu_count() // 2)
    assert results[0]["master_port"] == results[1]["master_port"] > 0


def test_ranks_see_the_environment_and_directory_of_the_call_not_the_fork_servers(
    monkeypatch, tmp_path
):
    # The first call may start the fork server with the variable set; the second must
    # still not see it once the test process dropped it.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DIST_RUN_PROBE", "set at the call")
    seen = dist_run(2, _test_process_state, "DIST_RUN_PROBE")
    assert seen == [{"value": "set at the call", "cwd": str(tmp_path)}] * 2
    monkeypatch.delenv("DIST_RUN_PROBE")
    assert [r["value"] for r in dist_run(2, _test_process_state, "DIST_RUN_PROBE")] == [None] * 2


def test_world_size_one_runs_fn_with_args_and_kwargs():
    assert dist_run(1, _kwargs_echo, 1, b="two") == [(1, "two")]


def test_all_reduce_sums_across_two_ranks():
    results = dist_run(2, _all_reduce_rank_plus_one)

    assert [t.item() for t in results] == [3.0, 3.0]


def test_large_results_do_not_deadlock():
    numel = 1 << 20  # 4 tensors x 4 MiB per rank, far beyond a pipe's buffer
    results = dist_run(2, _large_result, numel, timeout_s=60)

    for rank, tensors in enumerate(results):
        assert sorted(tensors) == ["w0", "w1", "w2", "w3"]
        assert all(t.shape == (numel,) and bool((t == rank).all()) for t in tensors.values())


def test_exception_on_one_rank_raises_with_rank_and_traceback_and_stops_the_others(
    ranks_start_at_once,
):
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        dist_run(2, _raise_on_rank_1, timeout_s=60)
    elapsed = time.monotonic() - start

    message = str(info.value)
    assert "rank 1" in message
    assert "ValueError: boom from the second rank" in message
    assert "Traceback" in message and "_raise_on_rank_1" in message
    assert elapsed < 30, f"rank 0 was left waiting in its barrier ({elapsed:.1f} s)"


def test_hanging_rank_is_killed_and_named_at_the_timeout(ranks_start_at_once):
    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError) as info:
        dist_run(2, _hang_on_rank_1, timeout_s=6)
    elapsed = time.monotonic() - start

    # Rank 0 waits in the barrier for rank 1, so it hangs too; rank 1 must be named.
    assert "rank(s) [0, 1] of 2" in str(info.value) or "rank(s) [1] of 2" in str(info.value)
    assert 6 <= elapsed < 6 + 8


_CALLER = """
import sys
sys.path.insert(0, {root!r})
from tests.distributed import dist_run
from tests.test_harness import _note_pid_and_sleep

if __name__ == "__main__":
    dist_run(2, _note_pid_and_sleep, {pids!r}, timeout_s=600)
"""


def _has_ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # dead, unreaped
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_end_when_the_test_process_is_killed(tmp_path):
    # A rank forked by the fork server is not the test process's child: without its
    # watch on the test process it would sleep on after a CI timeout kills pytest.
    script = tmp_path / "caller.py"
    script.write_text(_CALLER.format(root=str(Path(__file__).parents[1]), pids=str(tmp_path)))
    caller = subprocess.Popen([sys.executable, str(script)])
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(pid_files := sorted(tmp_path.glob("rank*.pid"))) < 2:
            assert caller.poll() is None and time.monotonic() < deadline, "ranks never started"
            time.sleep(0.2)
        pids = [int(f.read_text()) for f in pid_files]
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 10
        while not all(_has_ended(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [_has_ended(pid) for pid in pids] == [True, True]
    finally:
        caller.kill()
        for pid in pids:
            if not _has_ended(pid):
                os.kill(pid, signal.SIGKILL)


def test_rank_that_exits_without_reporting_is_reported_with_its_exit_code():
    with pytest.raises(RankFailedError) as info:
        dist_run(2, _exit_3_on_rank_1, timeout_s=60)

    _assert_rank_1_is_the_cause(str(info.value))


def _close_the_group_then_exit_3_on_rank_1():
    # Rank 0's barrier fails ("connection closed") well before rank 1's process ends, so
    # the harness hears from rank 0 first.
    if dist.get_rank() == 1:
        dist.destroy_process_group()
        time.sleep(1.0)
        os._exit(3)
    dist.barrier()


def test_the_rank_that_died_is_reported_first_even_when_its_peer_is_heard_from_first():
    with pytest.raises(RankFailedError) as info:
        dist_run(2, _close_the_group_then_exit_3_on_rank_1, timeout_s=60)

    message = str(info.value)
    _assert_rank_1_is_the_cause(message)
    assert "rank 0 failed afterwards (often a consequence)" in message


def _assert_rank_1_is_the_cause(message: str) -> None:
    cause = message.splitlines()[0]
    assert cause.startswith("dist_run: rank 1 of 2 failed"), message
    assert "exited with code 3" in cause, message


def test_fn_that_cannot_be_pickled_is_refused_with_advice():
    with pytest.raises(TypeError, match="module-level function"):
        dist_run(1, lambda: None)
