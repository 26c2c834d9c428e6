"""Every torch-version difference the engine depends on, in one place.

Each shim names the torch version it is for; ``tests/test_torch_compat.py`` checks
that each one resolves to a callable that does the job on the installed torch.
This module imports only torch, so ``core/`` can use it without lightning.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

# torch 2.13 recommends the ``*_single`` names; 2.11 only has ``*_into_tensor``.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# torch 2.13 renamed the private ``_is_leaf`` to ``tree_is_leaf``; 2.11 has only the old name.
tree_is_leaf = getattr(pytree, "tree_is_leaf", None) or pytree._is_leaf


def outside_compile(hook):
    """``hook``, kept out of any graph ``torch.compile`` builds around it.

    [Note: engine hooks under compile] The engine's hooks gather shards, wait on work
    handles, swap module attributes and fire the unit's state machine: Python side effects
    and collectives Dynamo cannot trace (and RangeShardedTensor refuses to expose its storage
    to a tracer). They run eagerly, as FSDP2's did before its hooks became traceable;
    the block's own forward and backward, between them, are what compile optimises.
    With per-block compile (``block.compile()``) the hooks run outside the compiled frame
    and a block's graph has no break; with whole-model compile each unit boundary breaks
    the graph once. ``torch.compiler.disable`` exists in every torch this package supports.
    """
    return torch.compiler.disable(hook, recursive=True)
