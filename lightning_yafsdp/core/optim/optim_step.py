"""Optimizer steps over sharded parameters run on plain tensors.

[Note: optimizer steps on plain tensors]
An optimizer holds the model's sharded parameters (RangeShardedTensors, full logical
shape). Stepping them through ``__torch_dispatch__`` is correct for elementwise
math but pays one Python dispatch per op per parameter (about 1.4 ms per
parameter per step on CPU). For torch's elementwise optimizers the engine
instead swaps, for the duration of ``step()``, every sharded parameter in the
optimizer's param groups for its plain local piece (a 1-D view of the flat
master, so the update lands in the master), with ``.grad`` the plain piece of
its grad, and moves its state entry along. The optimizer's own code then runs
unchanged on plain tensors: single-tensor, foreach and fused paths alike.
Param-group dicts stay the same objects (a scheduler's ``lr`` edits are kept);
only their ``"params"`` lists are replaced and put back.

Outside ``step()``, ``optimizer.state[p]`` is keyed by the sharded parameter and
holds plain tensors of its local piece's size: this rank's elements of the
state, placed like ``p._local``.

Lightning calls ``optimizer.step(closure)``, and the grads exist only once the
closure (training_step + backward) has run; the pre-hook wraps the closure so
that the swap happens right after it, inside ``step()``. A step that raises
leaves a swap behind; it is undone at the next step or forward.

Optimizers whose math depends on the parameter's shape (Adafactor, Shampoo,
Muon, LBFGS) cannot run on pieces; they are left on the dispatch path, where
the first non-elementwise op raises with the fix, instead of silently
computing something else.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from lightning_yafsdp.core.comm.step_timing import timed_hook
from lightning_yafsdp.core.optim.grads import ShardGrads
from lightning_yafsdp.core.optim.optim_runs import (
    Arenas,
    PieceSlot,
    Run,
    adopt_into_arenas,
    finish_run,
    plan_runs,
)
from lightning_yafsdp.core.optim.sharded_param import local_of


class SwapOwner(Protocol):
    """What the swap asks of the engine that owns the sharded parameters.

    A protocol rather than the engine class: optim/ sits below runtime/ in core's layer
    order (docs/design.md, module map), so it names only the three calls it makes.
    """

    def sharded_parameters(self) -> list[torch.nn.Parameter]: ...

    def grads_by_master(self) -> Sequence[tuple[ShardGrads, Any]]: ...

    def mark_weights_changed(self) -> None: ...


# Optimizers whose update of each element depends only on that element's own
# parameter, grad and state (and on scalars): they give the same result on pieces.
ELEMENTWISE_OPTIMIZERS: set[type] = {
    torch.optim.Adadelta,
    torch.optim.Adagrad,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.SGD,
}


def register_elementwise_optimizer(optimizer_class: type) -> None:
    """Declare that ``optimizer_class`` updates every element independently (see the Note)."""
    ELEMENTWISE_OPTIMIZERS.add(optimizer_class)


class OptimizerStepSwap:
    """Swaps an engine's sharded parameters for plain pieces around each optimizer step.

    The global step hooks reference this object weakly, and it references its
    engine weakly: torch keeps global hooks forever, and a strong reference would
    pin every engine (and its process group) ever built.
    """

    def __init__(self, engine: SwapOwner) -> None:
        self._engine = weakref.ref(engine)
        self._param_ids: set[int] | None = None
        self._slot_of: dict[int, PieceSlot] | None = None
        # Per optimizer: the flat per-element state ("arenas") runs step in place.
        self._arenas: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.coalesce = True  # [Note: optimizer runs]; off: every piece on its own
        # id(optimizer) -> (optimizer, [(param group, its original params)]), during step()
        self._active: dict[int, tuple[torch.optim.Optimizer, list]] = {}
        me = weakref.ref(self)

        def before(optimizer, args, kwargs):
            alive = me()
            return None if alive is None else alive._before_step(optimizer, args, kwargs)

        def after(optimizer, args, kwargs) -> None:
            alive = me()
            if alive is not None:
                alive._after_step(optimizer)

        self._handles = [
            register_optimizer_step_pre_hook(before),
            register_optimizer_step_post_hook(after),
        ]

    def close(self) -> None:
        self.restore_all()
        for handle in self._handles:
            handle.remove()

    def restore_all(self) -> None:
        """Undo swaps a step that raised left behind."""
        for optimizer, _ in list(self._active.values()):
            self._swap_out(optimizer)

    # -- hooks ------------------------------------------------------------------------

    def _before_step(self, optimizer, args: tuple, kwargs: dict):
        self.restore_all()
        if not self._holds_ours(optimizer) or type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
            return None
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is None:
            self._swap_in(optimizer)
            return None

        def closure_then_swap():
            loss = closure()
            self._swap_in(optimizer)
            return loss

        return (args[0],), {**kwargs, "closure": closure_then_swap}

    def _after_step(self, optimizer) -> None:
        if id(optimizer) in self._active:
            self._swap_out(optimizer)
        engine = self._engine()
        if engine is not None and self._holds_ours(optimizer):
            engine.mark_weights_changed()

    # -- the swap -----------------------------------------------------------------------

    def _holds_ours(self, optimizer) -> bool:
        ours = self._our_param_ids()
        return any(id(p) in ours for group in optimizer.param_groups for p in group["params"])

    def _our_param_ids(self) -> set[int]:
        if self._param_ids is None:
            engine = self._engine()
            params = engine.sharded_parameters() if engine is not None else []
            self._param_ids = {id(p) for p in params}
        return self._param_ids

    def _slots(self) -> dict[int, PieceSlot]:
        if self._slot_of is None:
            engine = self._engine()
            slots = {}
            for grads, _ in engine.grads_by_master() if engine is not None else ():
                # Order among the pieces this rank holds: pieces of other ranks take no
                # room in this master, so the ones around them are neighbours.
                order = 0
                for param, start, end in grads.params:
                    slots[id(param)] = PieceSlot(grads.master, grads, order, start, end)
                    order += end > start
            self._slot_of = slots
        return self._slot_of

    @timed_hook
    def _swap_in(self, optimizer) -> None:
        ours, slots = self._our_param_ids(), self._slots()
        state = optimizer.state
        saved = []
        for group in optimizer.param_groups:
            params = group["params"]
            items = plan_runs(params, slots, state) if self.coalesce else params
            pieces, singles, runs = [], [], []
            for item in items:
                if isinstance(item, Run):
                    runs.append(item)
                    pieces.append(item.tensor)
                elif id(item) in ours:
                    singles.append(item)
                    pieces.append(_enter_piece(item, state))
                else:
                    pieces.append(item)
            saved.append((group, params, singles, runs))
            group["params"] = pieces
        self._active[id(optimizer)] = (optimizer, saved)

    @timed_hook
    def _swap_out(self, optimizer) -> None:
        _, saved = self._active.pop(id(optimizer))
        state, slots = optimizer.state, self._slots()
        arenas = self._arenas.get(optimizer)
        if arenas is None:
            arenas = self._arenas[optimizer] = Arenas()
        for group, params, singles, runs in saved:
            for run in runs:
                finish_run(run, state, arenas)
            for param in singles:
                piece = param._local
                piece.grad = None  # the grad window must die with the parameters' grads
                if piece in state:
                    entry = state.pop(piece)
                    if self.coalesce:
                        adopt_into_arenas(slots[id(param)], entry, arenas)
                    state[param] = entry
            group["params"] = params
        arenas.seal()


def _enter_piece(param, state) -> torch.Tensor:
    """``param``'s plain piece, with the plain piece of its grad and its state moved to it."""
    piece = param._local
    piece.grad = None if param.grad is None else param.grad._local
    if param in state:
        entry = {k: local_of(v) for k, v in state[param].items()}
        _check_piece_state(param, entry)
        del state[param]
        state[piece] = entry
    return piece


def _check_piece_state(param, entry: dict) -> None:
    # State loaded with optimizer.load_state_dict from an unsharded run (DDP) has the
    # parameter's full shape; stepping it against this rank's piece would fail deep in
    # the optimizer, or broadcast into nonsense.
    numel = param._local.numel()
    for name, value in entry.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() != numel:
            raise RuntimeError(
                f"optimizer state {name!r} of the sharded parameter "
                f"{param._placement.name!r} has shape {tuple(value.shape)}, but this rank "
                f"holds {numel} of its elements: it was loaded with "
                "optimizer.load_state_dict() from an unsharded run (DDP, one device). Load "
                "checkpoints through the strategy (trainer.fit(ckpt_path=...)) or "
                "lightning_yafsdp.checkpoint, which slices every state tensor for this rank."
            )
