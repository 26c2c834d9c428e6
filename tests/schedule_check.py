"""Checks the four ordering conditions of YaFSDP on a recorded schedule.

The log is the engine's program order of issues, waits and compute
boundaries (``engine.recording()``); on CUDA it is the order in which work and
event waits are enqueued, which is what the conditions constrain.
"""

from __future__ import annotations

from lightning_yafsdp.core import ScheduleEvent


def four_condition_violations(
    log: list[ScheduleEvent], slots: dict[str, tuple[int, int]], *, cuda: bool = False
) -> list[str]:
    """Return a message per violation (empty: the schedule is correct).

    Args:
        log: recorded events.
        slots: unit name -> (weight buffer index, grad buffer index).
        cuda: the log of a CUDA run, where a replicate all_reduce is ordered after its
            reduce_scatter by an event on its stream rather than by a host wait.
    """
    violations: list[str] = []
    last_gather: dict[int, str] = {}  # weight buffer -> unit of the last gather issued into it
    gather_waited: dict[int, bool] = {}  # weight buffer -> was that gather waited
    computing: dict[int, str] = {}  # weight buffer -> unit computing with it now
    unwaited_reduce: dict[int, str] = {}  # grad buffer -> unit whose reduce is not waited yet
    # Hybrid sharding: grad buffer -> unit whose replicate all_reduce is not waited yet,
    # and the units whose reduce_scatter was waited (the all_reduce reads its result).
    unwaited_all_reduce: dict[int, str] = {}
    scattered: set[str] = set()
    in_backward: set[str] = set()
    backward_done: set[str] = set()
    for i, event in enumerate(log):
        unit, where = event.unit, f"event {i} ({event.op} {event.unit})"
        if unit not in slots:
            continue  # resident groups: gathered/reduced synchronously
        weight_slot, grad_slot = slots[unit]
        if event.op == "gather_issue":
            holder = computing.get(weight_slot)
            if holder is not None and holder != unit:
                violations.append(f"condition 2: {where} while '{holder}' computes in it")
            last_gather[weight_slot], gather_waited[weight_slot] = unit, False
        elif event.op == "gather_wait":
            if last_gather.get(weight_slot) == unit:
                gather_waited[weight_slot] = True
        elif event.op in ("forward_start", "backward_start"):
            if last_gather.get(weight_slot) != unit or not gather_waited.get(weight_slot):
                violations.append(f"condition 1: {where} before its weights were gathered")
            computing[weight_slot] = unit
            if event.op == "backward_start":
                violations += _condition_3(unwaited_reduce.get(grad_slot), where)
                in_backward.add(unit)
                backward_done.discard(unit)
        elif event.op in ("forward_end", "backward_end"):
            computing.pop(weight_slot, None)
            if event.op == "backward_end":
                in_backward.discard(unit)
                backward_done.add(unit)
        elif event.op == "backward_start_weightless":
            # [Note: weightless backward] an embedding's backward reads no weights:
            # condition 1 does not apply, condition 3 does.
            violations += _condition_3(unwaited_reduce.get(grad_slot), where)
            in_backward.add(unit)
            backward_done.discard(unit)
        elif event.op == "backward_end_weightless":
            in_backward.discard(unit)
            backward_done.add(unit)
        elif event.op == "reduce_scatter_issue":
            if unit in in_backward or unit not in backward_done:
                violations.append(f"condition 4: {where} before its backward finished")
            pending = unwaited_all_reduce.get(grad_slot)
            if pending is not None:
                violations.append(
                    f"condition 3: {where} before the all_reduce of '{pending}' finished"
                )
            unwaited_reduce[grad_slot] = unit
            scattered.discard(unit)
        elif event.op == "reduce_scatter_wait":
            if unwaited_reduce.get(grad_slot) == unit:
                del unwaited_reduce[grad_slot]
            scattered.add(unit)
        elif event.op == "all_reduce_issue":
            if not cuda and unit not in scattered:
                violations.append(f"condition 3: {where} before its reduce_scatter finished")
            unwaited_all_reduce[grad_slot] = unit
        elif event.op == "all_reduce_wait":
            if unwaited_all_reduce.get(grad_slot) == unit:
                del unwaited_all_reduce[grad_slot]
    return violations


def _condition_3(pending: str | None, where: str) -> list[str]:
    """A backward may start only after its grad buffer's previous reduce_scatter finished."""
    if pending is None:
        return []
    return [f"condition 3: {where} before the reduce_scatter of '{pending}' finished"]
