"""Every torch-version difference the engine depends on, in one place.

Each shim names the torch version it is for; ``tests/test_torch_compat.py`` checks
that each one resolves to a callable that does the job on the installed torch.
This module imports only torch, so ``core/`` can use it without lightning.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.utils._pytree as pytree

# torch 2.13 recommends the ``*_single`` names; 2.11 only has ``*_into_tensor``.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# torch 2.13 renamed the private ``_is_leaf`` to ``tree_is_leaf``; 2.11 has only the old name.
tree_is_leaf = getattr(pytree, "tree_is_leaf", None) or pytree._is_leaf
