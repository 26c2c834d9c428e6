"""Run a function on several CPU ranks, each in its own process, joined by gloo.

``dist_run(world_size, fn, *args, **kwargs)`` is how tests exercise real collectives
without a GPU::

    from tests.distributed import dist_run

    def _all_reduce_rank(scale):          # module level, so that it pickles
        t = torch.tensor([float(dist.get_rank())]) * scale
        dist.all_reduce(t)
        return t

    def test_all_reduce_sums_over_ranks():
        assert [t.item() for t in dist_run(2, _all_reduce_rank, 2.0)] == [2.0, 2.0]

See docs/testing.md for the full contract. In short:

- Each rank is a fresh process forked by a ``forkserver`` that imported torch, Lightning,
  transformers and this package once ([Note: preloaded ranks]; spawned where CUDA is
  available); it takes the test
  process's environment (set before ``fn`` runs, after ``fn``'s module was imported),
  working directory and ``sys.path``. Before ``fn`` runs, the default process group
  is initialised (gloo, a FileStore in a fresh temporary directory, so back-to-back calls
  never collide on ports), the env variables RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
  and MASTER_PORT are set, and torch uses ``cpu_count // world_size`` threads.
- The return values come back as a list indexed by rank. They travel pickled by value:
  return plain CPU tensors (``t.detach().cpu()``), not CUDA tensors, not views into
  buffers you expect to share.
- A rank that raises or dies makes ``dist_run`` raise :class:`RankFailedError` with the
  rank and its traceback; the other ranks are killed at once instead of waiting for a
  collective to time out. Ranks still running after ``timeout_s`` seconds (counted from
  the call, process start-up included) are killed and :class:`DistributedTimeoutError`
  names them.
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["DistributedTimeoutError", "RankFailedError", "dist_run"]

# [Note: preloaded ranks] A spawned rank spends ~6 s of CPU importing torch and Lightning
# before the test's first line, and the suite starts well over a hundred ranks on two
# cores. A fork server imports them once; each rank is then a fork of a process that has
# imported but never computed (no thread pool started), which is what makes the fork
# safe. Where CUDA is available the ranks are spawned as before: a CUDA driver touched
# by an import in the server would not survive the fork.
# - multiprocessing hands each rank the test process's sys.path and working directory;
#   its os.environ at the call travels in _RankConfig. What a process reads only at its
#   start (glibc's MALLOC_* variables) comes from the fork server's start, so a test sets
#   such things from inside fn (mallopt), not through the environment.
# - A forked rank ends with os._exit (atexit handlers and C++ static destructors do not
#   run): crashes at interpreter exit are for tests/test_clean_exit.py, which launches
#   real scripts, to catch.
# - The server is started, and its imports waited for, before a call's timeout starts.
# - All forked ranks share one string-hash seed (spawned or launched ranks do not), so a
#   collective order that followed set iteration order would go unnoticed here; the
#   engine keeps its string sets to membership tests.
_PRELOADED = ("torch", "torch.distributed", "lightning.pytorch", "transformers", "lightning_yafsdp")

# How much longer than dist_run's deadline a rank's collectives wait, in seconds: a
# forked rank starts within a second, so a collective timeout equal to the deadline would
# race dist_run's own report of the hang.
_COLLECTIVE_TIMEOUT_MARGIN_S = 30.0
# How long a rank that was told to stop (SIGTERM) gets before SIGKILL, in seconds.
_TERMINATE_GRACE_S = 2.0
# How long a rank that already sent its result gets to exit on its own, in seconds.
_EXIT_GRACE_S = 10.0
# After a rank failed, how long the others get to report theirs, in seconds.
_FAILURE_GRACE_S = 5.0
# What a rank's error says when it failed only because a peer's process went away (gloo).
_ECHO_PHRASES = ("connection closed by peer", "connection reset by peer", "broken pipe")


class RankFailedError(RuntimeError):
    """A rank raised an exception, or its process died before reporting a result."""


class DistributedTimeoutError(TimeoutError):
    """Some ranks had not finished when ``timeout_s`` ran out; they were killed."""


def dist_run(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks and returns their results.

    Args:
        world_size: Number of ranks (processes), at least 1.
        fn: A module-level function (it is pickled by reference into each process).
        *args: Positional arguments for ``fn``; pickled, identical on every rank.
        timeout_s: Wall-clock budget in seconds for the whole run, process start-up
            included. Default 120. The process group's collective timeout is
            ``_COLLECTIVE_TIMEOUT_MARGIN_S`` longer, so that a hung collective is reported
            by ``dist_run`` as a timeout rather than by the rank as a failure.
        **kwargs: Keyword arguments for ``fn``; pickled, identical on every rank.

    Returns:
        The return value of ``fn`` on each rank, index = rank. Values must be picklable;
        tensors should be plain CPU tensors.

    Raises:
        RankFailedError: A rank raised, could not pickle its result, or its process died
            (the message names the rank and holds its traceback or exit code).
        DistributedTimeoutError: Ranks were still running after ``timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    ctx = _rank_context()
    deadline = time.monotonic() + timeout_s
    store_dir = tempfile.mkdtemp(prefix="dist_run_")
    ranks: list[_Rank] = []
    try:
        config = _RankConfig(
            world_size=world_size,
            init_method="file://" + os.path.join(store_dir, "filestore"),
            master_port=_free_port(),
            timeout_s=timeout_s,
            environ=dict(os.environ),
        )
        ranks = _start_ranks(ctx, config, fn, args, kwargs)
        return _collect_results(ranks, deadline=deadline, timeout_s=timeout_s)
    finally:
        _stop_all(ranks)
        shutil.rmtree(store_dir, ignore_errors=True)


@dataclass(frozen=True)
class _RankConfig:
    world_size: int
    init_method: str
    master_port: int
    timeout_s: float
    # The test process's environment at the call: a forked rank would otherwise keep the
    # fork server's, from its start ([Note: preloaded ranks]).
    environ: dict[str, str]


@dataclass
class _Rank:
    rank: int
    process: multiprocessing.process.BaseProcess
    reader: multiprocessing.connection.Connection


def _rank_context() -> multiprocessing.context.BaseContext:
    """Where ranks come from ([Note: preloaded ranks]): a ready fork server, or spawn."""
    if not _forking_is_safe():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOADED))
    # The server forks a child only once it has imported everything, so a child that
    # does nothing waits out the imports here, outside the call's deadline: at the first
    # call, and again if the server died and multiprocessing starts a new one (~0.1 s
    # otherwise).
    warm_up = ctx.Process(target=_do_nothing, name="dist_run-fork-server-warm-up")
    warm_up.start()
    warm_up.join()
    if warm_up.exitcode != 0:
        raise RuntimeError(
            f"dist_run: the fork server's first child exited with code "
            f"{_describe_exit(warm_up.exitcode)}; one of {_PRELOADED} may fail to import"
        )
    return ctx


@functools.cache
def _forking_is_safe() -> bool:
    import torch

    return not torch.cuda.is_available()


def _start_ranks(
    ctx: multiprocessing.context.BaseContext,
    config: _RankConfig,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
) -> list[_Rank]:
    ranks: list[_Rank] = []
    try:
        for rank in range(config.world_size):
            # One pipe per rank, no queue: a pipe has no feeder thread, so "the process
            # is dead and its pipe holds nothing" reliably means it never reported.
            reader, writer = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=_rank_main,
                args=(rank, config, fn, args, kwargs, writer),
                name=f"dist_run-rank{rank}",
            )
            ranks.append(_Rank(rank=rank, process=process, reader=reader))
            try:
                process.start()
            except (pickle.PicklingError, AttributeError, TypeError) as err:
                raise TypeError(
                    f"dist_run could not send {fn!r} or its arguments to a new process "
                    f"({err}); fn must be a module-level function and its arguments "
                    "picklable (no lambdas, local functions or open handles)"
                ) from err
            finally:
                # The child holds its own copy; closing ours makes the pipe report EOF
                # once the child exits.
                writer.close()
    except BaseException:
        _stop_all(ranks)
        raise
    return ranks


def _collect_results(ranks: list[_Rank], *, deadline: float, timeout_s: float) -> list[Any]:
    """Reads each rank's report as it arrives, so that large results never block a child."""
    results: dict[int, Any] = {}
    pending = {r.rank: r for r in ranks}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            hung = sorted(pending)
            raise DistributedTimeoutError(
                f"dist_run: rank(s) {hung} of {len(ranks)} did not finish within "
                f"{timeout_s:g} s and were killed (a hang in a collective, a deadlock, or "
                "a test that needs a larger timeout_s)"
            )
        waitables = [r.reader for r in pending.values()]
        waitables += [r.process.sentinel for r in pending.values()]
        multiprocessing.connection.wait(waitables, timeout=min(remaining, 1.0))
        failures: list[_Failure] = []
        for rank in sorted(pending):
            report = _poll_rank(pending[rank])
            if report is None:
                continue
            del pending[rank]
            if isinstance(report, _Failure):
                failures.append(report)
            else:
                results[rank] = report.value
        if failures:
            failures += _failures_within(pending, grace_s=_FAILURE_GRACE_S)
            raise RankFailedError(_failure_message(failures, len(ranks)))
    _await_clean_exits(ranks)
    return [results[r] for r in range(len(ranks))]


@dataclass(frozen=True)
class _Success:
    value: Any


@dataclass(frozen=True)
class _Failure:
    rank: int
    detail: str
    time: float  # time.time() when the rank failed, to tell the cause from its echoes


def _poll_rank(state: _Rank) -> _Success | _Failure | None:
    """Returns the rank's report, or None while it still runs."""
    if state.reader.poll():
        try:
            # recv_bytes blocks until the whole message is in; the child is writing it.
            return pickle.loads(state.reader.recv_bytes())
        except EOFError:
            pass  # the pipe closed with nothing in it: the process died, see below
        except Exception:
            detail = "its result could not be read:\n" + traceback.format_exc()
            return _Failure(rank=state.rank, detail=detail, time=time.time())
    if state.process.is_alive():
        return None
    state.process.join()
    detail = (
        f"its process exited with code {_describe_exit(state.process.exitcode)} "
        "without reporting a result or an exception (a crash, os._exit or a signal)"
    )
    return _Failure(rank=state.rank, detail=detail, time=time.time())


def _failures_within(pending: dict[int, _Rank], *, grace_s: float) -> list[_Failure]:
    """The failures of the ``pending`` ranks that arrive within ``grace_s`` of the first.

    A failure and its cause reach the harness in either order: a peer's "connection
    closed" comes straight through its pipe, while the death of the rank that caused it
    is seen through the fork server, which reports it late on a loaded machine. So the
    other ranks get a moment to report before the message is written; a rank still
    running then (hung in a collective) is left to ``_stop_all``.
    """
    failures: list[_Failure] = []
    deadline = time.monotonic() + grace_s
    while pending and (remaining := deadline - time.monotonic()) > 0:
        waitables = [r.reader for r in pending.values()]
        waitables += [r.process.sentinel for r in pending.values()]
        multiprocessing.connection.wait(waitables, timeout=remaining)
        for rank in sorted(pending):
            report = _poll_rank(pending[rank])
            if report is None:
                continue
            del pending[rank]
            if isinstance(report, _Failure):
                failures.append(report)
    return failures


def _is_echo(failure: _Failure) -> bool:
    """A failure inside a collective because a peer went away: a consequence, not a cause."""
    detail = failure.detail.lower()
    return any(phrase in detail for phrase in _ECHO_PHRASES)


def _failure_message(failures: list[_Failure], world_size: int) -> str:
    # When one rank fails, its peers often fail next inside a collective ("connection
    # closed by peer"): those are reported after the others, each group earliest first,
    # so the cause comes first whichever rank the harness heard from first.
    first, *echoes = sorted(failures, key=lambda f: (_is_echo(f), f.time))
    lines = [f"dist_run: rank {first.rank} of {world_size} failed: {first.detail}"]
    for echo in echoes:
        lines.append(f"rank {echo.rank} failed afterwards (often a consequence): {echo.detail}")
    return "\n".join(lines)


def _await_clean_exits(ranks: list[_Rank]) -> None:
    """Every rank reported; a rank that then exits abnormally is still a failure."""
    for state in ranks:
        state.process.join(_EXIT_GRACE_S)
        code = state.process.exitcode
        if code is None:
            continue  # left to _stop_all; its result is already in
        if code != 0:
            raise RankFailedError(
                f"dist_run: rank {state.rank} of {len(ranks)} returned a result but then "
                f"exited with code {_describe_exit(code)}"
            )


def _stop_all(ranks: list[_Rank]) -> None:
    """Terminates, then kills, every live rank; reaps all of them; closes all pipes."""
    started = [s for s in ranks if s.process.pid is not None]
    for state in started:
        if state.process.is_alive():
            state.process.terminate()
    stop_by = time.monotonic() + _TERMINATE_GRACE_S
    for state in started:
        state.process.join(max(0.0, stop_by - time.monotonic()))
    for state in started:
        if state.process.is_alive():
            state.process.kill()
            state.process.join()
    for state in ranks:
        state.reader.close()
        if state.process.pid is None or state.process.exitcode is not None:
            state.process.close()


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- in the child process -------------------------------------------------------------


def _do_nothing() -> None:
    """The fork server's warm-up child (``_rank_context``)."""


def _rank_main(
    rank: int,
    config: _RankConfig,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    writer: multiprocessing.connection.Connection,
) -> None:
    _die_with_parent()
    try:
        result = _run_fn(rank, config, fn, args, kwargs)
        message = pickle.dumps(_Success(result), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:  # SystemExit and KeyboardInterrupt are failures here too
        failure = _Failure(rank=rank, detail="\n" + traceback.format_exc(), time=time.time())
        message = pickle.dumps(failure)
    writer.send_bytes(message)
    writer.close()
    sys.stdout.flush()
    sys.stderr.flush()


def _run_fn(
    rank: int, config: _RankConfig, fn: Callable[..., Any], args: tuple, kwargs: dict
) -> Any:
    _adopt_test_environment(config)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(config.world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(config.master_port),
    )
    import torch
    import torch.distributed as dist

    # Ranks share the machine's cores; oversubscription makes CPU tests crawl.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.world_size))
    dist.init_process_group(
        "gloo",
        init_method=config.init_method,
        rank=rank,
        world_size=config.world_size,
        timeout=timedelta(seconds=config.timeout_s + _COLLECTIVE_TIMEOUT_MARGIN_S),
    )
    result = fn(*args, **kwargs)
    _orderly_shutdown()
    return result


def _adopt_test_environment(config: _RankConfig) -> None:
    os.environ.clear()
    os.environ.update(config.environ)


def _orderly_shutdown() -> None:
    """Destroy the gloo group and free it before the process exits.

    A gloo context still alive when the interpreter exits can abort the rank (SIGABRT,
    "terminate called without an active exception") after its result was sent.
    Reference cycles left by fn (engines, Trainers) may hold the group: collect them,
    destroy, collect again. No collective and no wait on the other ranks here: after a
    failed collective the group may be unusable, and a rank that lingers would delay
    the others' "connection closed" error.
    """
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():  # fn may have destroyed it itself
        dist.destroy_process_group()
    gc.collect()


def _die_with_parent() -> None:
    """The rank ends if the test process dies, so that no orphan hangs on.

    A spawned rank's parent is the test process: Linux's parent-death signal does it. A
    forked rank's parent is the fork server, which outlives the test process while any
    rank runs; there a daemon thread waits on the test process's end of the pipe that
    multiprocessing keeps open for as long as the test process lives.
    """
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        try:
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    test_process = multiprocessing.parent_process()
    if test_process is not None:
        threading.Thread(target=_exit_when_ended, args=(test_process,), daemon=True).start()


def _exit_when_ended(test_process: multiprocessing.process.BaseProcess) -> None:
    multiprocessing.connection.wait([test_process.sentinel])
    os._exit(1)
