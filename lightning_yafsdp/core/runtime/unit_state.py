"""A sharded unit's life in one iteration, as one explicit state machine.

[Note: unit state machine]
Every hook of a unit (``unit.py``) asks this machine whether it may act and
tells it what happened; no other flag says where a unit is. Modelled on FSDP2's
per-group ``TrainingState``, with the states a flat-buffer engine needs:

    IDLE ──forward──> FORWARD ──forward_done──> AWAITING_BACKWARD
      │                  │ forward_failed: back to where it came from
      └─no_grad_forward─> NO_GRAD_FORWARD ──no_grad_done / failed──> (where it came from)
    AWAITING_BACKWARD ──pre_backward──> BACKWARD ──call_done──> BACKWARD_PAUSED  (calls left)
                                                 └─call_done──> reduce ──> BACKWARD_DONE
    BACKWARD_PAUSED ──pre_backward──> BACKWARD;  ──reduce (a flush)──> AWAITING_BACKWARD
    any state that computes nothing ──end_iteration──> IDLE
    any state ──abandon──> IDLE  (the last backward raised; seen at the next forward)

- A unit called k times in one forward (a module shared across depth, ALBERT)
  counts k pending backward calls. Its grad buffer stays claimed between the
  calls' backwards (BACKWARD_PAUSED: grads accumulate in the buffer, the weight
  buffer is free), so it is gathered and reduce-scattered once per backward,
  after its LAST call. If another unit needs that grad buffer first (two
  forwards of the model before one backward), the paused unit is flushed:
  its partial sum is reduce-scattered now and the rest later (exact, since the
  master grad adds).
- A no-grad forward (evaluation, a DPO reference pass, a reentrant
  checkpoint's first pass) may run from any state that computes nothing and
  returns to that state: it never changes what a pending backward needs.
- A forward that raises (out of memory, a bad batch) returns the unit to the
  state it came from (``forward_failed``), so the next step runs normally.
- A backward that raises (out of memory) never reaches its end-of-backward
  callback; the next forward sees the engine still in backward outside any
  autograd pass, waits the collectives in flight, drops their results and
  resets every unit (``abandon``).
- A forward whose backward never comes leaves the unit in AWAITING_BACKWARD;
  the next forward adds one call, and the next end of backward resets to IDLE.
- ``pre_backward`` from IDLE or BACKWARD_DONE starts one more backward of the
  unit in this iteration (a second ``backward`` of a retained graph; a torch
  reentrant checkpoint recomputing a shared unit call by call): exact, one
  more reduce.

Invalid transitions raise ``RuntimeError`` naming the unit, its state and the
event: they are engine bugs or unsupported call patterns, never silently
absorbed.
"""

from __future__ import annotations

import enum


class UnitState(enum.Enum):
    IDLE = "idle"  # no forward of this iteration awaits its backward
    FORWARD = "forward"  # inside a grad-enabled forward
    NO_GRAD_FORWARD = "no-grad forward"  # inside a forward under no_grad / inference_mode
    AWAITING_BACKWARD = "awaiting backward"  # forward calls whose backward has not run
    BACKWARD = "backward"  # computing grads: holds its weight and grad buffers
    BACKWARD_PAUSED = "backward paused"  # between two calls' backwards: holds its grad buffer
    BACKWARD_DONE = "backward done"  # all calls' grads reduce-scattered


_AT_REST = frozenset(
    {
        UnitState.IDLE,
        UnitState.AWAITING_BACKWARD,
        UnitState.BACKWARD_PAUSED,
        UnitState.BACKWARD_DONE,
    }
)

# event -> {from state: to state}. ``None`` as the target: decided by the machine
# (the state the unit came from, or by the count of pending calls).
TRANSITIONS: dict[str, dict[UnitState, UnitState | None]] = {
    "forward": {
        UnitState.IDLE: UnitState.FORWARD,
        UnitState.AWAITING_BACKWARD: UnitState.FORWARD,
        UnitState.BACKWARD_DONE: UnitState.FORWARD,
    },
    "forward_done": {UnitState.FORWARD: UnitState.AWAITING_BACKWARD},
    "forward_failed": {UnitState.FORWARD: None},
    "no_grad_forward": {state: UnitState.NO_GRAD_FORWARD for state in _AT_REST},
    "no_grad_done": {UnitState.NO_GRAD_FORWARD: None},
    "pre_backward": {
        UnitState.AWAITING_BACKWARD: UnitState.BACKWARD,
        UnitState.BACKWARD_PAUSED: UnitState.BACKWARD,
        UnitState.IDLE: UnitState.BACKWARD,
        UnitState.BACKWARD_DONE: UnitState.BACKWARD,
    },
    "call_done": {UnitState.BACKWARD: None},  # PAUSED if calls are left, else reduce next
    "reduce": {UnitState.BACKWARD: None, UnitState.BACKWARD_PAUSED: None},
    "end_iteration": {state: UnitState.IDLE for state in _AT_REST},
    # A backward that raised never reaches its end: the next forward resets every unit.
    "abandon": {state: UnitState.IDLE for state in UnitState},
}


class UnitLifecycle:
    """The state of one unit plus the two numbers the states need.

    Attributes:
        state: the current ``UnitState``.
        pending_calls: forward calls of this iteration whose backward has not
            finished (k for a module called k times per forward).
        resume_state: where a running forward returns to when it ends without
            adding a backward (no-grad forward, or a forward that raised).
    """

    def __init__(self, unit_name: str) -> None:
        self.unit_name = unit_name
        self.state = UnitState.IDLE
        self.pending_calls = 0
        self.resume_state = UnitState.IDLE

    @property
    def computing(self) -> bool:
        """True while a forward or backward of the unit runs (its weight buffer is in use)."""
        return self.state in (UnitState.FORWARD, UnitState.NO_GRAD_FORWARD, UnitState.BACKWARD)

    @property
    def holds_grad_buffer(self) -> bool:
        return self.state in (UnitState.BACKWARD, UnitState.BACKWARD_PAUSED)

    @property
    def awaits_backward(self) -> bool:
        return self.state in (UnitState.AWAITING_BACKWARD, UnitState.BACKWARD_PAUSED)

    def fire(self, event: str) -> UnitState:
        """Apply ``event``; returns the new state. Raises if it is invalid in this state."""
        targets = TRANSITIONS[event]
        if self.state not in targets:
            raise RuntimeError(
                f"unit '{self.unit_name}': event '{event}' is invalid in state "
                f"'{self.state.value}' (valid from: {sorted(s.value for s in targets)}). "
                "This call pattern is not supported; please report it with the model code."
            )
        target = targets[self.state]
        if event in ("forward", "no_grad_forward"):
            self.resume_state = self.state
        elif event == "forward_done":
            self.pending_calls += 1
        elif event in ("forward_failed", "no_grad_done"):
            target = self.resume_state
        elif event == "call_done":
            self.pending_calls = max(self.pending_calls - 1, 0)
            target = UnitState.BACKWARD_PAUSED if self.pending_calls else UnitState.BACKWARD
        elif event == "reduce":
            target = UnitState.AWAITING_BACKWARD if self.pending_calls else UnitState.BACKWARD_DONE
        elif event in ("end_iteration", "abandon"):
            self.pending_calls = 0
        self.state = target
        return target
