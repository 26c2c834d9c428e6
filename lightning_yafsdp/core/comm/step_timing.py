"""Where a step's host time goes inside the engine: hooks, issuing and waiting collectives.

[Note: step breakdown]
A benchmark asks "which milliseconds of a step are ours?". Off by default: every hook
entry point reads one module global and calls through (``timed_hook``). On
(``step_timing.activate(StepTiming())``, as ``benchmarks/compare.py --breakdown`` does),
a ``StepTiming`` adds up, per step:

- ``hook_s``: wall time inside the engine's entry points (unit and resident hooks, the
  end-of-backward callback, the optimizer-step swap, clipping), outermost call only, so
  nested hooks are not counted twice. Everything below happens inside it.
- ``issue_s[kind]``: time spent issuing collectives of each kind (our Python, the order
  guard's tag exchange and the backend's enqueue).
- ``wait_s[kind]``: time blocked waiting for a collective: the communication the
  schedule did NOT hide (exposed). ``order_tag`` is the guard's tag exchanges,
  ``blocking`` the synchronous collectives (norms, the used-parameter flags). On CPU a
  reduction's wait includes summing the parts received from the other ranks
  ([Note: pairwise exchanges on gloo]).
- ``hidden[kind]`` / ``waited[kind]``: how many waits found their collective already
  complete (fully hidden behind compute) out of how many waits. gloo reports a send's
  or a receive's completion only once it is waited, so on CPU ``hidden`` is 0: there
  the exposed wait time is what tells.

The Python of our hooks is ``hook_s - sum(issue_s) - sum(wait_s)``, with the copies
they make (each parameter's grad into the grad buffer: 200 MiB per step on debug-50m, as
DDP copies grads into its buckets); compute and the framework's own time are the rest of
the step. One timer serves the process (two
engines in one process share it): it is a measuring tool for benchmarks, not state.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class StepTiming:
    """Running sums of the engine's host time (seconds) since the last ``reset``."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.hook_s = 0.0
        self.issue_s: Counter = Counter()
        self.wait_s: Counter = Counter()
        self.waited: Counter = Counter()
        self.hidden: Counter = Counter()
        self._depth = 0

    def add_issue(self, kind: str, seconds: float) -> None:
        self.issue_s[kind] += seconds

    def add_wait(self, kind: str, seconds: float, *, was_complete: bool) -> None:
        self.wait_s[kind] += seconds
        self.waited[kind] += 1
        self.hidden[kind] += int(was_complete)

    def snapshot(self) -> dict[str, Any]:
        """Plain numbers (seconds, counts), JSON-ready."""
        issue, wait = sum(self.issue_s.values()), sum(self.wait_s.values())
        return {
            "hook_s": self.hook_s,
            "python_s": self.hook_s - issue - wait,
            "issue_s": dict(self.issue_s),
            "wait_s": dict(self.wait_s),
            "waited": dict(self.waited),
            "hidden": dict(self.hidden),
        }


_active: StepTiming | None = None


def activate(timing: StepTiming | None) -> None:
    """Measure into ``timing`` from now on (None: stop measuring)."""
    global _active
    _active = timing


def active() -> StepTiming | None:
    """The timing being measured into, or None (the usual case)."""
    return _active


def timed_hook(fn: F) -> F:
    """Count the time inside ``fn`` as the engine's (outermost entry point only)."""

    @wraps(fn)
    def entry_point(*args: Any, **kwargs: Any) -> Any:
        timing = _active
        if timing is None or timing._depth:
            return fn(*args, **kwargs)
        timing._depth = 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timing.hook_s += time.perf_counter() - start
            timing._depth = 0

    return entry_point  # type: ignore[return-value]
