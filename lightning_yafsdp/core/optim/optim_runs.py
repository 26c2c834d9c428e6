"""Adjacent pieces of one master stepped as one tensor ("runs"), on CPU.

[Note: optimizer runs]
torch's single-tensor optimizer path (the CPU default) costs tens of microseconds of
Python per parameter, and per-parameter temporaries; one flat tensor per master costs
full-size temporaries that stream from memory. Both lose to runs: consecutive pieces of
one master, in one param group, that all have a grad and the same optimizer-state step,
stepped as ONE plain view ``master[a:b]`` (its grad ``window[a:b]``), capped at
``RUN_NUMEL_CAP`` elements so temporaries stay in cache. Alignment padding between the
pieces is stepped too, harmlessly: its weight and grad are always zero, and Adam/SGD
keep zero at zero (weight decay multiplies it).

Per-element state lives in "arenas", one flat tensor of the master's size per state key;
each parameter's state entries are views of its range of the arena, so a run's state is
``arena[a:b]`` with no copy. Fresh state (a first step, or state loaded by
``load_state_dict``) is adopted into the arena once, after the step (into an
uninitialised arena, each fresh piece freed as it is copied, then the gaps zeroed:
``Arenas``, so the first step does not hold the state twice). Each parameter keeps
its own scalar state (``step``, NAdam's ``mu_product``, ASGD's ``eta``): a run needs the
members to agree on all of it and steps a copy holding the common values, which is
written back to each member afterwards, so a parameter skipped by one step (no grad)
keeps its own count, exactly as the per-parameter optimizer would.

Only CPU masters are coalesced: on GPUs the foreach and fused kernels already take the
whole list in a few launches, and comparing step values would synchronize the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_yafsdp.core.optim.sharded_param import local_of

RUN_NUMEL_CAP = 1 << 20


@dataclass(frozen=True)
class PieceSlot:
    """Where one sharded parameter's piece lies in its master.

    Attributes:
        master: the flat master shard tensor.
        grads: its ``ShardGrads`` (the window the grads are views of).
        order: index among the master's non-empty pieces on this rank (consecutive
            pieces merge: only alignment padding lies between them).
        start: first element in the master; ``end``: one past the last.
    """

    master: torch.Tensor
    grads: object
    order: int
    start: int
    end: int


@dataclass
class Run:
    """Members stepped as one plain tensor; ``tensor`` is what the optimizer sees."""

    members: list[nn.Parameter]
    slots: list[PieceSlot]
    tensor: torch.Tensor
    fresh: bool
    entered: dict | None = None  # the state handed to the optimizer (arena slices)


def plan_runs(params: list, slot_of: dict[int, PieceSlot], state) -> list:
    """The param group's params, with mergeable neighbours replaced by ``Run``s.

    Anything that cannot merge (not ours, no grad, no elements, state not in an arena)
    is returned as the parameter itself, to be stepped as its own piece.
    """
    out: list = []
    pending: list[tuple[nn.Parameter, PieceSlot, tuple]] = []
    empties: dict[tuple, list[tuple[nn.Parameter, PieceSlot]]] = {}
    windows: dict[int, torch.Tensor | None] = {}  # per master, looked up once
    for param in sorted(params, key=lambda p: _sort_key(p, slot_of)):
        slot = slot_of.get(id(param))
        if slot is not None and slot.end == slot.start:
            # This rank holds none of it: no data to step, only its step count. All such
            # pieces with the same count step together as one 0-element tensor.
            key = _empty_key(param, state)
            if key is not None:
                empties.setdefault(key, []).append((param, slot))
                continue
        key = _merge_key(param, slot, state, windows) if slot is not None else None
        if key is None:
            _flush(pending, out, state)
            out.append(param)
            continue
        if pending and not _continues(pending, slot, key):
            _flush(pending, out, state)
        pending.append((param, slot, key))
    _flush(pending, out, state)
    for key, members in empties.items():
        pending = [(param, slot, key) for param, slot in members]
        _flush(pending, out, state)
    return out


def _empty_key(param, state) -> tuple | None:
    if param.grad is None:
        return None
    entry = state.get(param)
    if not entry:
        return ("empty", "fresh")
    scalars = _scalar_values(entry)
    return None if scalars is None else ("empty", scalars)


def _scalar_values(entry: dict) -> tuple | None:
    """The values of every 0-dim state tensor (``step``, NAdam's ``mu_product``, ASGD's
    ``eta``/``mu``): members of one run must agree on all of them. None: not on CPU.
    """
    values = []
    for name, value in entry.items():
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            if value.device.type != "cpu":
                return None
            values.append((name, value.item()))
    return tuple(values) if values else None


def _sort_key(param, slot_of) -> tuple:
    slot = slot_of.get(id(param))
    return (0, id(slot.master), slot.order) if slot is not None else (1, 0, 0)


def _merge_key(param, slot: PieceSlot, state, windows: dict) -> tuple | None:
    """``("fresh", ...)`` or ``("arena", step, arenas, ...)`` if the piece can join a run.

    None: step it on its own (no grad, no elements, a GPU master, a grad that is not a
    view of the window, state not in an arena yet). Pointer arithmetic only: this runs
    for every parameter at every step.
    """
    grad = param.grad
    if grad is None or slot.end == slot.start or slot.master.device.type != "cpu":
        return None
    if id(slot.grads) not in windows:
        windows[id(slot.grads)] = slot.grads.window()
    window = windows[id(slot.grads)]
    offset = slot.start * slot.master.element_size()
    if window is None or grad._local.data_ptr() != window.data_ptr() + offset:
        return None
    entry = state.get(param)
    if not entry:
        return ("fresh", id(window))
    scalars = _scalar_values(entry)
    if scalars is None:
        return None
    arenas = []
    for value in entry.values():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        base = value._base
        if base is None or base.numel() != slot.master.numel():
            return None  # not (yet) in an arena
        if value.data_ptr() != base.data_ptr() + slot.start * base.element_size():
            return None
        arenas.append(id(base))
    return ("arena", scalars, tuple(arenas), id(window))


def _continues(pending, slot: PieceSlot, key: tuple) -> bool:
    _, last, last_key = pending[-1]
    first = pending[0][1]
    return (
        last.master is slot.master
        and slot.order == last.order + 1
        and key == last_key
        and slot.end - first.start <= RUN_NUMEL_CAP
    )


def _flush(pending: list, out: list, state) -> None:
    if len(pending) == 1:
        out.append(pending[0][0])
    elif pending:
        members = [p for p, _, _ in pending]
        slots = [s for _, s, _ in pending]
        out.append(_make_run(members, slots, pending[0][2], state))
    pending.clear()


def _make_run(members, slots, key, state) -> Run:
    empty = key[0] == "empty"
    a, b = (0, 0) if empty else (slots[0].start, slots[-1].end)
    tensor = slots[0].master[a:b]
    window = members[0].grad._local._base  # the window: every member's grad is a view of it
    tensor.grad = window[a:b]
    fresh = key[0] == "fresh" or key == ("empty", "fresh")
    run = Run(members=members, slots=slots, tensor=tensor, fresh=fresh)
    if not fresh:
        run_state = {}
        for name, value in state[members[0]].items():
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                # Every member keeps its own scalar state: the run steps a copy of the
                # common value, written back to each member afterwards.
                run_state[name] = value.clone()
            elif isinstance(value, torch.Tensor):
                run_state[name] = local_of(value) if empty else value._base[a:b]
            else:
                run_state[name] = value
        state[tensor] = run_state
        run.entered = dict(run_state)
    return run


@torch.no_grad()
def finish_run(run: Run, state, arenas: Arenas) -> None:
    """After the step: members' state back as arena views, their steps advanced."""
    run.tensor.grad = None
    run_state = state.pop(run.tensor, None)
    if not run_state:
        return  # the optimizer made no state (e.g. SGD without momentum)
    master = run.slots[0].master
    a = run.tensor.storage_offset() - master.storage_offset()
    moved = []  # per-element entries the members must be re-pointed to
    for name, value in run_state.items():
        if name != "step" and isinstance(value, torch.Tensor) and value.dim() > 0:
            if run.entered is not None and value is run.entered.get(name):
                continue  # stepped in place in the arena: the members' views are current
            arena = arenas.get_or_make(master, name, value)
            if value.data_ptr() != arena[a:].data_ptr():
                arena[a : a + value.numel()].copy_(value)
                arenas.wrote(arena, a, a + value.numel())
            moved.append((name, arena))
    for member, slot in zip(run.members, run.slots, strict=True):
        entry = state[member]
        for name, value in run_state.items():
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                own = entry.get(name)
                if isinstance(own, torch.Tensor) and own is not value and own.dim() == 0:
                    own.copy_(value)
                else:
                    entry[name] = value.clone()
            elif not isinstance(value, torch.Tensor):
                entry[name] = value
        for name, arena in moved:
            entry[name] = arena[slot.start : slot.end]


@torch.no_grad()
def adopt_into_arenas(slot: PieceSlot, entry: dict, arenas: Arenas) -> None:
    """One piece's own per-element state copied into the arenas (once), so it can merge."""
    if slot.master.device.type != "cpu" or slot.end == slot.start:
        return
    for name, value in list(entry.items()):
        if name == "step" or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        if value.numel() != slot.end - slot.start:
            continue
        arena = arenas.get_or_make(slot.master, name, value)
        if value.data_ptr() != arena[slot.start :].data_ptr():
            arena[slot.start : slot.end].copy_(value)
            arenas.wrote(arena, slot.start, slot.end)
            entry[name] = arena[slot.start : slot.end]


class Arenas(dict):
    """One optimizer's arenas: ``(id(master), state key)`` -> the flat state tensor.

    A new arena is made uninitialised and filled by the copies of the step that made it;
    ``seal`` then zeroes what no copy wrote (padding between pieces, pieces without state
    yet). Zero-filling it up front instead would touch all of it while every piece's
    fresh state still exists: the first step would hold the optimizer state twice (the
    whole AdamW state, 244 MiB per rank on a 64M-parameter model at 2 ranks); copied
    run by run, each fresh piece is freed as its range is written.
    """

    def __init__(self) -> None:
        super().__init__()
        self._unsealed: dict[int, tuple[torch.Tensor, list[tuple[int, int]]]] = {}

    def get_or_make(self, master: torch.Tensor, name: str, like: torch.Tensor) -> torch.Tensor:
        """The flat state tensor of ``master`` for state key ``name`` (made on first use)."""
        key = (id(master), name)
        arena = self.get(key)
        if arena is None or arena.dtype != like.dtype:
            arena = like.new_empty(master.numel())
            self[key] = arena
            self._unsealed[id(arena)] = (arena, [])
        return arena

    def wrote(self, arena: torch.Tensor, start: int, end: int) -> None:
        unsealed = self._unsealed.get(id(arena))
        if unsealed is not None:
            unsealed[1].append((start, end))

    @torch.no_grad()
    def seal(self) -> None:
        """Zero every range of the arenas made since the last seal that no copy wrote."""
        for arena, written in self._unsealed.values():
            cursor = 0
            for start, end in sorted(written):
                if start > cursor:
                    arena[cursor:start].zero_()
                cursor = max(cursor, end)
            arena[cursor:].zero_()
        self._unsealed.clear()
