"""Bad strategy arguments, each of which must be refused at once with a one-line error.

Shared by ``tests/test_strategy_arguments.py`` and ``benchmarks/bad_arguments.py`` (which
prints the table of where each one is refused and how many lines it prints).

``CONSTRUCTOR``: refused by ``YaFSDPStrategy(**kwargs)`` (the Trainer's and Fabric's).
``WORLD_SIZE``: valid on their own, refused once the run's size is known (by
``Trainer(...)`` / ``Fabric(...)``, before anything is launched), with the Trainer
arguments that make them wrong.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch import nn


def _no_arguments():
    return None


def _two_arguments(a, b):
    return None


# (the keyword arguments, a text to find in the message)
CONSTRUCTOR: list[tuple[dict, str]] = [
    ({"units": "model.layers"}, "units='model.layers'"),
    ({"units": []}, "units=[]"),
    ({"units": [nn.Linear, "model.layers.0"]}, "units="),
    ({"units": 42}, "units=42"),
    ({"units": _no_arguments}, "units="),
    ({"norm_classes": "LayerNorm"}, "norm_classes='LayerNorm'"),
    ({"norm_classes": [nn.LayerNorm, "RMSNorm"]}, "norm_classes='RMSNorm'"),
    ({"norm_classes": torch.float32}, "norm_classes=torch.float32"),
    ({"norm_classes": "torch.nn.NoSuchNorm"}, "does not import"),
    ({"zero_stage": 1}, "zero_stage=1"),
    ({"zero_stage": "3"}, "zero_stage='3'"),
    ({"zero_stage": True}, "zero_stage=True"),
    ({"reduce_dtype": "fp16"}, "reduce_dtype='fp16'"),
    ({"reduce_dtype": torch.float16}, "reduce_dtype=torch.float16"),
    ({"reduce_dtype": torch.int32}, "reduce_dtype=torch.int32"),
    ({"reduce_dtype": 32}, "reduce_dtype=32"),
    ({"activation_checkpointing": "some"}, "activation_checkpointing='some'"),
    ({"activation_checkpointing": [-1]}, "activation_checkpointing=[-1]"),
    ({"activation_checkpointing": True}, "activation_checkpointing=True"),
    ({"activation_checkpointing": [0, "model.layers.1"]}, "activation_checkpointing="),
    ({"param_init_fn": "init"}, "param_init_fn='init'"),
    ({"param_init_fn": nn.Linear}, "param_init_fn="),
    ({"param_init_fn": _two_arguments}, "cannot take 1 positional"),
    ({"sync_module_states": "yes"}, "sync_module_states='yes'"),
    ({"sync_module_states": 1}, "sync_module_states=1"),
    ({"cast_forward_inputs": "no"}, "cast_forward_inputs='no'"),
    ({"cast_forward_inputs": None}, "cast_forward_inputs=None"),
    ({"timeout": "30"}, "timeout='30'"),
    ({"timeout": 0}, "timeout=0"),
    ({"timeout": -5.0}, "timeout=-5.0"),
    ({"timeout": timedelta(0)}, "timeout=datetime.timedelta(0)"),
    ({"process_group_backend": "mpi2"}, "process_group_backend='mpi2'"),
    ({"process_group_backend": 3}, "process_group_backend=3"),
    ({"process_group_backend": "cpu:gloo,tpu:nccl"}, "process_group_backend="),
    ({"state_dict_type": "local"}, "state_dict_type='local'"),
    ({"state_dict_type": None}, "state_dict_type=None"),
    ({"verify_checksums": "no"}, "verify_checksums='no'"),
    ({"verify_checksums": None}, "verify_checksums=None"),
    ({"async_save": "yes"}, "async_save='yes'"),
    ({"shard_size": 0}, "shard_size=0"),
    ({"shard_size": 1.5}, "shard_size=1.5"),
    ({"shard_size": "2"}, "shard_size='2'"),
    ({"shard_size": True}, "shard_size=True"),
    ({"device_mesh": "2x1"}, "device_mesh='2x1'"),
    ({"device_mesh": (2, 2, 2)}, "device_mesh=(2, 2, 2)"),
    ({"device_mesh": (0, 2)}, "device_mesh=(0, 2)"),
    ({"device_mesh": {"replicate": 1, "shard": 2}}, "device_mesh={"),
    ({"shard_size": 2, "device_mesh": (1, 2)}, "not both"),
    ({"accelerator": "cpu"}, "accelerator='cpu'"),
    ({"parallel_devices": "cpu"}, "parallel_devices='cpu'"),
    ({"parallel_devices": []}, "parallel_devices=[]"),
    ({"cluster_environment": "slurm"}, "cluster_environment='slurm'"),
    ({"checkpoint_io": "torch"}, "checkpoint_io='torch'"),
    ({"sharding_strategy": "FULL_SHARD"}, "sharding_strategy: use zero_stage="),
]

if not torch.distributed.is_backend_available("nccl"):  # a CPU-only torch build
    CONSTRUCTOR.append(({"process_group_backend": "nccl"}, "'nccl' is not available"))

# (strategy keyword arguments, Trainer/Fabric keyword arguments, a text to find)
WORLD_SIZE: list[tuple[dict, dict, str]] = [
    ({"shard_size": 3}, {"devices": 2}, "shard_size=3 does not divide the world size 2"),
    ({"shard_size": 4}, {"devices": 2}, "shard_size=4 does not divide the world size 2"),
    ({"shard_size": 3}, {"devices": 2, "num_nodes": 2}, "divisors of 4: [1, 2, 4]"),
    ({"device_mesh": (2, 2)}, {"devices": 2}, "device_mesh=(2, 2) has 4 ranks but the run has 2"),
    ({"device_mesh": [1, 4]}, {"devices": 2}, "device_mesh=(1, 4) has 4 ranks but the run has 2"),
]
if torch.distributed.is_backend_available("nccl"):  # where nccl exists, not for CPU devices
    WORLD_SIZE.append(
        ({"process_group_backend": "nccl"}, {"devices": 2}, "cannot serve cpu devices")
    )


def label(kwargs: dict) -> str:
    """A test id: the arguments as written."""
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())[:60]
