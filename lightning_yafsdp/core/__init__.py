"""The torch-only YaFSDP engine: shard any model, train it with any torch loop.

This package never imports lightning.

Example::

    engine = shard_model(model)                       # after init_process_group
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)   # any param groups
    loss = model(batch).mean(); loss.backward()
    engine.clip_grad_norm_(1.0); optimizer.step(); optimizer.zero_grad()
"""

from lightning_yafsdp.core.comm.collectives import CommStats
from lightning_yafsdp.core.comm.order_guard import CollectiveOrderError
from lightning_yafsdp.core.comm.streams import ScheduleEvent
from lightning_yafsdp.core.optim.optim_step import register_elementwise_optimizer
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor, ShardPlacement
from lightning_yafsdp.core.plan.policy import find_units, is_norm_module
from lightning_yafsdp.core.plan.sharding import ShardingPlan, get_engine, plan_layouts, shard_model
from lightning_yafsdp.core.runtime.engine import ParamShard, YaFSDPEngine
from lightning_yafsdp.core.runtime.layout import FlatLayout
from lightning_yafsdp.core.runtime.tensor_tree import OpaqueValueError

__all__ = [
    "CollectiveOrderError",
    "CommStats",
    "FlatLayout",
    "OpaqueValueError",
    "ParamShard",
    "ScheduleEvent",
    "ShardPlacement",
    "RangeShardedTensor",
    "ShardingPlan",
    "YaFSDPEngine",
    "find_units",
    "get_engine",
    "is_norm_module",
    "plan_layouts",
    "register_elementwise_optimizer",
    "shard_model",
]
