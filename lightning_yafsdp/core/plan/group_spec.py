"""``GroupSpec``: which parameters one flat group will hold, before any tensor moves."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from lightning_yafsdp.core.runtime.flat_group import ParamOwner


@dataclass
class GroupSpec:
    """The parameters of one flat group, as ``shard_model`` plans it.

    Attributes:
        name: the group's name (a module path, ``a+b`` for a root unit of several
            modules, ``<norms>`` or ``<root>``).
        params: one per tied set, in layout order.
        owners: per parameter, every place it is reachable from.
        modules: a unit's modules, hooked around their forwards: one block, or a
            root unit's modules (several when a tied tensor joins them).
        is_block: a unit the policy chose (activation checkpointing applies to
            these), as opposed to a root unit ([Note: root units]).
        frozen_params / frozen_owners: a unit's frozen parameters (requires_grad
            False) and their owners: sharded and gathered with the unit, no grads
            ([Note: frozen shards]).
    """

    name: str
    params: list[nn.Parameter] = field(default_factory=list)
    owners: list[list[ParamOwner]] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)
    is_block: bool = True
    frozen_params: list[nn.Parameter] = field(default_factory=list)
    frozen_owners: list[list[ParamOwner]] = field(default_factory=list)

    def add(self, param: nn.Parameter, owners: list[ParamOwner]) -> None:
        """Add a parameter to the trainable or the frozen list, by its requires_grad."""
        if param.requires_grad:
            self.params.append(param)
            self.owners.append(owners)
        else:
            self.frozen_params.append(param)
            self.frozen_owners.append(owners)

    def numel(self) -> int:
        return sum(p.numel() for p in (*self.params, *self.frozen_params))
