"""What Lightning's two front doors share: the Trainer strategy and the Fabric strategy.

``lightning_yafsdp.strategy.YaFSDPStrategy`` (Trainer) and
``lightning_yafsdp.fabric.YaFSDPStrategy`` (Fabric) are thin adapters: each translates
its front door's hooks into the same few operations, kept here so that neither holds
engine logic and neither writes them twice:

- ``options.py``: the constructor arguments both take, validated once
  (``ShardingOptions``), with the migration hints for FSDPStrategy arguments.
- ``sharding.py``: turning a module (meta-built or real) into a sharded one, and
  pointing optimizers built before that at the sharded parameters.
- ``distributed.py``: the process group, barrier and broadcast.
- ``mesh.py``: the shard and replicate groups, built once per strategy; ``hosts.py``:
  the warning when a shard group spans more machines than it needs.
- ``saving.py``: ``async_save=True``: when a background save is waited for and reported.

The checkpoint entries both write are ``model_entry`` (``checkpoint/state.py``) and
``optimizer_entry`` (``checkpoint/optimizer_state.py``). Nothing here imports
``lightning.pytorch``, so a Fabric-only program never loads it.
"""
