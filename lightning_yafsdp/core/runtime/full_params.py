"""Full weights from the shards: gathered whole for inspection, export and write-back.

Outside the step (``summon_full_params``, ``full_state_dict``) a group's full flat tensor
is one all_gather of its master shard (and of its frozen shard) in the shard group;
nothing here touches the step's buffers.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_yafsdp.core.comm.collectives import CommStats, all_gather_into
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor
from lightning_yafsdp.core.runtime.flat_group import FlatParamGroup


class FullGather:
    """Gathers groups' full flat tensors over ``shard_group`` (collective: every rank)."""

    def __init__(self, shard_group, shard_rank: int, device: torch.device, stats: CommStats):
        self.shard_group, self.shard_rank = shard_group, shard_rank
        self.device, self.stats = device, stats

    def trainable(self, group: FlatParamGroup) -> torch.Tensor:
        return self._gather(group.master_shard, group.layout.padded_numel)

    def frozen(self, group: FlatParamGroup) -> torch.Tensor | None:
        if group.frozen_layout is None:
            return None
        return self._gather(group.frozen_shard, group.frozen_layout.padded_numel)

    def _gather(self, shard: torch.Tensor, numel: int) -> torch.Tensor:
        full = torch.empty(numel, dtype=shard.dtype, device=self.device)
        all_gather_into(full, shard, self.shard_group, async_op=False, stats=self.stats)
        return full

    @torch.no_grad()
    def write_back(self, group: FlatParamGroup, flat: torch.Tensor, frozen) -> None:
        """This rank's slices of ``flat`` (and ``frozen``) back into the group's shards."""
        start, end = group.layout.shard_range(self.shard_rank)
        group.master_shard.copy_(flat[start:end])
        if frozen is not None:
            start, end = group.frozen_layout.shard_range(self.shard_rank)
            group.frozen_shard.copy_(frozen[start:end])

    def state_dict(self, root: nn.Module, groups: list[FlatParamGroup]) -> dict[str, torch.Tensor]:
        """Original-name state dict with full master-dtype weights (every rank gets all)."""
        state = {
            name: tensor.detach()
            for name, tensor in root.state_dict(keep_vars=True).items()
            if not isinstance(tensor, RangeShardedTensor)
        }
        for group in groups:
            placed = [(group.layout, self.trainable(group), group.owners)]
            if group.frozen_layout is not None:
                placed.append((group.frozen_layout, self.frozen(group), group.frozen_owners))
            for layout, flat, owners_list in placed:
                for span, owners in zip(layout.spans, owners_list, strict=True):
                    value = flat[span.offset : span.end].view(span.shape)
                    for owner in owners:
                        state[owner.name] = value
        return state
