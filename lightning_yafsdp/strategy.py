"""YaFSDPStrategy: YaFSDP sharding behind Lightning's Trainer.

``Trainer(strategy="yafsdp")`` behaves like ``strategy="ddp"`` (same launcher, cluster
environments, samplers, logging and gradient semantics) except that the parameters,
gradients and optimizer state are sharded across the ranks by
:func:`lightning_yafsdp.core.shard_model`. The story of a run, in the order the
Trainer calls the hooks below:

1. ``__init__``: the sharding options; ``precision=`` arrives through the
   ``precision_plugin`` setter and becomes a :class:`YaFSDPPrecision`.
2. ``_configure_launcher`` / ``set_world_ranks``: processes and ranks, as DDP does.
3. ``setup_environment``: the process group (gloo on CPU, nccl on CUDA).
4. ``configure_model`` runs inside ``model_sharded_context``: on the meta device, so
   modules built there cost no memory (``from_pretrained`` too: its weights are read
   group by group in ``setup``). ``trainer.init_module()`` builds real tensors unless
   ``empty_init=True``, as with FSDPStrategy.
5. ``setup``: with ``sync_batchnorm=True`` BatchNorm layers become SyncBatchNorm; the
   LightningModule is sharded in place (meta modules are materialized, initialized and
   sharded one unit at a time) and the rest of it (metrics, buffers) moved to the
   root device, as DDP moves the model; then the optimizers are built, so
   ``configure_optimizers`` sees the original parameters, sharded, under their names.
6. Training: the engine's hooks gather and reduce; the precision plugin clips through
   the engine; Lightning's own accumulation and ``zero_grad`` need nothing extra.
7. Checkpoints: ``trainer.save_checkpoint``, ``ModelCheckpoint`` and ``fit(ckpt_path=...)``
   go through :mod:`lightning_yafsdp.checkpoint` (sharded DCP directories by default,
   or one full file); the weights and optimizer states are loaded right after ``setup``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel
from typing_extensions import override

from lightning_yafsdp._registration import STRATEGY_NAME
from lightning_yafsdp.adapters.distributed import (
    assign_world_ranks,
    barrier,
    broadcast_object,
    init_process_group,
    register_once,
)
from lightning_yafsdp.adapters.mesh import ShardingState
from lightning_yafsdp.adapters.options import ShardingOptions
from lightning_yafsdp.adapters.saving import BackgroundSaving
from lightning_yafsdp.adapters.sharding import place_module, shard_module
from lightning_yafsdp.checkpoint import load_checkpoint, save_checkpoint
from lightning_yafsdp.checkpoint.fabric_format import (
    FABRIC_KEYS,
    as_trainer_checkpoint,
    check_trainer_can_resume,
    fabric_entries,
    read_checkpoint_extras,
)
from lightning_yafsdp.checkpoint.optimizer_state import optimizer_entry
from lightning_yafsdp.checkpoint.state import StateDictType, model_entry
from lightning_yafsdp.core import YaFSDPEngine
from lightning_yafsdp.core.plan.meta_build import meta_device
from lightning_yafsdp.core.plan.policy import NormSpec, UnitsSpec
from lightning_yafsdp.model_checks import (
    check_no_meta_metric_states,
    check_optimizers_hold_model_params,
    check_sync_batchnorm_device,
)
from lightning_yafsdp.precision import YaFSDPPrecision, to_trainer_precision
from lightning_yafsdp.pretrained import lazy_from_pretrained

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.pytorch.accelerators import Accelerator
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_yafsdp.core.plan.sharding import CheckpointSpec


class YaFSDPStrategy(ShardingState, BackgroundSaving, ParallelStrategy):
    """Fully sharded data parallel training with YaFSDP's flat, pre-allocated buffers.

    Args:
        units: Which submodules are sharded units (gathered and freed one at a time).
            ``None`` (default) auto-detects the repeated blocks, e.g. ``model.layers[*]``;
            otherwise a block class, a list of classes, a list of module names, or a
            predicate ``(name, module) -> bool``. Everything else (embeddings, head) is
            one more group, gathered once per step.
        norm_classes: Modules whose parameters form the resident norm group (kept
            gathered during the step, no weight decay with :meth:`param_groups`).
            ``None`` (default): LayerNorm/RMSNorm/GroupNorm and classes whose name ends
            in ``RMSNorm``/``LayerNorm``; ``()`` disables the norm group.
        zero_stage: 3 (default: weights re-gathered in backward) or 2 (each unit keeps
            its gathered weights from forward to backward: more memory, a third less
            communication).
        reduce_dtype: dtype of gradient buffers and of the reduce-scatter. Default fp32.
        activation_checkpointing: ``None`` (default), ``"all"``, a list of unit indices,
            a predicate ``(index, name) -> bool``, or (as in FSDPStrategy) a block class
            or list of classes: those units recompute their forward in backward.
        param_init_fn: Initializes a module materialized from the meta device, called
            once per unit and per other module owning parameters or buffers, just
            before it is sharded. Default: the LightningModule's ``init_submodule(module)``
            method if it has one, else the model's own scheme: ``reset_parameters()``
            and, inside a Hugging Face model, its ``_init_weights``. Anything left
            uninitialized stops ``setup`` with an error naming it.
        sync_module_states: Broadcast rank 0's weights and buffers before sharding, so
            that every rank starts from the same model, as DDP does. ``None`` (default):
            for models built with real tensors (in ``__init__``, under
            ``init_module()``); a meta-built model is initialized identically on every
            rank without it.
        cast_forward_inputs: Cast floating inputs of units to the compute dtype.
            Default True.
        timeout: Collective timeout of the process group: if a rank dies, the others
            raise after at most this long instead of hanging. Default 30 minutes.
        process_group_backend: ``"gloo"`` / ``"nccl"``; default from the device.
        state_dict_type: How ``trainer.save_checkpoint`` and ``ModelCheckpoint`` write.
            ``"sharded"`` (default): a directory at the checkpoint path (a
            ``torch.distributed.checkpoint`` layout under the original parameter names
            plus ``meta.pt``) to which every rank writes its own elements; loadable at
            any world size, by Lightning's ``consolidate_checkpoint`` utility and by
            ``LightningModule.load_from_checkpoint`` (consolidated in memory).
            ``"full"``: one ``torch.save`` file written by rank 0, gathered one unit at
            a time, that ``LightningModule.load_from_checkpoint`` reads directly. Both
            kinds, and single-file checkpoints of other strategies (DDP), load with
            ``fit(ckpt_path=...)`` whatever this is set to. Saves are atomic. The
            strategy writes and reads checkpoints itself: ``checkpoint_io`` plugins and
            ``storage_options`` are not used.
        verify_checksums: Before a checkpoint is loaded (``fit(ckpt_path=...)``), compare
            every file with the CRC-32 recorded when it was saved, so a changed byte stops
            the load naming the file instead of resuming on damaged weights. The ranks
            share the reading; it costs about as much as reading the checkpoint once
            more (see docs/user-guide.md). Default True; False checks sizes only.
        async_save: Write sharded checkpoints in the background: a save copies this
            rank's shards and the training state to CPU memory and returns, and a
            thread writes and commits them (atomically, checksummed) while training
            goes on ([Note: background saves]). The next save, a load and the end of
            fit wait for it; a failed write is said in one line at the next step and
            raised at the next save or the end of fit. Costs one copy of this rank's
            shards in CPU memory while a save is in flight. Default False; needs
            ``state_dict_type="sharded"``.
        shard_size: Hybrid sharding (HSDP): parameters, grads and optimizer state are
            sharded over groups of this many consecutive ranks and replicated across
            the groups; gathers and reduce-scatters stay inside a group and each
            reduced grad shard is all-reduced across the groups once per backward.
            ``None`` (default): one node's ranks when ``num_nodes > 1``, else every
            rank (flat). Must divide ``devices x num_nodes``; the world size is flat
            sharding. Memory per rank grows as the group shrinks: ``yafsdp estimate``.
        device_mesh: Instead of ``shard_size``: ``(replicas, shard_size)`` as
            FSDPStrategy takes it, or a 2-D ``DeviceMesh`` with
            ``mesh_dim_names=("replicate", "shard")`` (or a 1-D one: flat).
        vocab_chunks: Run a token embedding or output head larger than a block (every
            128k-256k vocabulary) in row chunks of at most one block each, so the two
            buffer slots are block-sized: ZeRO-3 and ZeRO-2, flat and hybrid sharding,
            plain ``nn.Embedding`` / ``nn.Linear`` and scaled embedding subclasses, tied
            or not, frozen or not (a LoRA-wrapped one stays whole: ``yafsdp estimate``
            names what does). Default True; False keeps them whole
            units, each gathered at once (docs/design.md, Row chunks).
        blocks_per_unit: Consecutive blocks gathered and reduce-scattered as one unit,
            so small blocks pay one collective's fixed cost together (docs/design.md,
            Grouped blocks). ``"auto"`` (default): as many auto-detected blocks as fit in
            4M elements are one unit, keeping at least 4 units of blocks; blocks of more
            than 2M elements (a Llama of dim 512 and up) stay one per unit, and units named with
            ``units=`` stay as named. A number groups that many blocks (auto-detected or
            named); 1 keeps one block per unit. Buffer slots are sized to a unit.

    Raises:
        TypeError: for an argument this strategy does not take (with the replacement
            when it is an FSDPStrategy / ModelParallelStrategy argument).
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        *,
        units: UnitsSpec = None,
        norm_classes: NormSpec = None,
        zero_stage: int = 3,
        reduce_dtype: torch.dtype = torch.float32,
        activation_checkpointing: CheckpointSpec = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        sync_module_states: bool | None = None,
        cast_forward_inputs: bool = True,
        timeout: timedelta | None = default_pg_timeout,
        process_group_backend: str | None = None,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        verify_checksums: bool = True,
        async_save: bool = False,
        shard_size: int | None = None,
        device_mesh: DeviceMesh | tuple[int, int] | None = None,
        vocab_chunks: bool = True,
        blocks_per_unit: int | str = "auto",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **unknown: Any,
    ) -> None:
        # Every named argument above but the Lightning plumbing (accelerator, devices, ...).
        self._options = ShardingOptions.from_arguments(type(self).__name__, locals(), unknown)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.num_nodes = 1
        self._process_group_backend = self._options.process_group_backend
        self._engine: YaFSDPEngine | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers ``"yafsdp"``; a second call (re-import, reload) is a no-op."""
        register_once(cls, strategy_registry)

    # -- what the Trainer asks before anything runs ---------------------------------

    @property
    def engine(self) -> YaFSDPEngine:
        """The engine of the sharded LightningModule (after ``setup``)."""
        if self._engine is None:
            raise RuntimeError("the model is not sharded yet: the engine exists after setup()")
        return self._engine

    @contextmanager
    def summon_full_params(self, *, writeback: bool = False) -> Generator[None, None, None]:
        """The full weights in the LightningModule for the duration of the block.

        Inside it, ``state_dict()``, ``named_parameters()`` and ``module.weight`` are the
        whole, unsharded master-dtype parameters (plain ``nn.Parameter``s), for export or
        inspection outside forward, e.g. a peft adapter::

            with trainer.strategy.summon_full_params():
                model.save_pretrained(path, is_main_process=trainer.is_global_zero)

        Collective: every rank must enter it, and every rank holds the whole model while
        inside. On exit the sharded parameters come back (the same objects, so the
        optimizers stay valid).

        Args:
            writeback: copy changes made to the full parameters back into this rank's
                shards on exit. Default False (changes are dropped).
        """
        with self.engine.summon_full_params(writeback=writeback):
            yield

    @property
    def is_distributed(self) -> bool:
        # Lightning treats a custom ParallelStrategy as distributed only if it says so:
        # that turns on the DistributedSampler and sync_dist.
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def precision_plugin(self) -> YaFSDPPrecision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else YaFSDPPrecision("32-true")

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = to_trainer_precision(plugin)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def set_world_ranks(self) -> None:
        self._check_against_run()
        assign_world_ranks(self)

    # -- process group, model, optimizers ---------------------------------------------

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        self._process_group_backend = init_process_group(
            self.cluster_environment,
            self.root_device,
            backend=self._process_group_backend,
            timeout=self._options.timeout,
        )
        self._ensure_mesh()

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # As FSDPStrategy: trainer.init_module() builds real tensors (weights loaded there
        # are kept) unless empty_init=True puts them on the meta device, where setup()
        # materializes and initializes them group by group ([Note: meta-device
        # configure_model] for configure_model, which model_sharded_context covers).
        device = meta_device() if empty_init else nullcontext()
        with device, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # [Note: meta-device configure_model] Lightning enters this (inside
        # tensor_init_context) only around configure_model: modules built there land on
        # the meta device and cost nothing; setup() materializes, initializes (the model's
        # own scheme, core/plan/materialize.py) and shards them one unit at a time, so no rank
        # ever holds the whole model. from_pretrained builds on meta too and is loaded
        # from its checkpoint one group at a time (lightning_yafsdp/pretrained.py).
        # `with torch.device("cpu"):` inside configure_model builds real tensors instead.
        with lazy_from_pretrained(), meta_device():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        check_no_meta_metric_states(self.lightning_module)
        self._apply_layer_sync()
        if trainer.state.fn == TrainerFn.FITTING:
            check_sync_batchnorm_device(self.lightning_module, self.root_device)
        self._engine = shard_module(
            self.lightning_module,
            self._options,
            self.precision_plugin,
            device=self.root_device,
            mesh=self._mesh,
        )
        self.model_to_device()
        self.precision_plugin.connect_engine(self._engine)
        if trainer.state.fn == TrainerFn.FITTING:
            _rebuild_weight_averages(trainer, self.lightning_module, self.root_device)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _apply_layer_sync(self) -> None:
        # [Note: sync_batchnorm] Trainer(sync_batchnorm=True) hands the strategy a LayerSync
        # (BatchNorm -> SyncBatchNorm). As DDPStrategy and FSDPStrategy do, it is applied
        # before the model is wrapped, here sharded: afterwards the modules own no
        # parameters and cannot be swapped. So it is applied at the first setup of any
        # stage (an eval-mode SyncBatchNorm does not synchronize: validate/test behave as
        # BatchNorm) and not reverted in teardown, which keeps the sharded model for later
        # stages; the state dict keys are the same either way.
        module = self.lightning_module
        if self._layer_sync is None or module.__dict__.get("_yafsdp_engine") is not None:
            return
        if self._layer_sync.apply(module) is not module:
            raise RuntimeError("sync_batchnorm replaced the LightningModule itself")

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # fit -> validate -> fit again: optimizers from an earlier stage hold stale state.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        check_optimizers_hold_model_params(self.lightning_module, self.optimizers)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        place_module(self.model, self.engine, self.root_device)

    # -- collectives ----------------------------------------------------------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return broadcast_object(obj, src)

    @override
    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- checkpoints --------------------------------------------------------------------
    # trainer.save_checkpoint builds Lightning's dict on every rank from the two state
    # hooks below (RangeShardedTensors, or full tensors on rank 0), and save_checkpoint
    # hands it to lightning_yafsdp.checkpoint, which writes a DCP directory + meta.pt (or
    # one file) atomically. Loading happens after setup (restore_checkpoint_after_setup):
    # load_checkpoint copies weights and optimizer states straight into the shards and
    # returns the rest (loops, schedulers, callbacks) for Lightning to restore; Lightning's
    # own model/optimizer restore steps are no-ops here.

    @property
    def state_dict_type(self) -> StateDictType:
        return self._options.state_dict_type

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Collective: Lightning calls it on every rank. "full" leaves {} on ranks != 0.
        return model_entry(self.engine, self.lightning_module, self.state_dict_type)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer_entry(self.engine, optimizer, self.state_dict_type)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "YaFSDPStrategy writes checkpoints itself and does not use CheckpointIO "
                "storage_options; call trainer.save_checkpoint(path) without them"
            )
        # As Lightning's FSDPStrategy: the weights and optimizer states come out of
        # Lightning's dict (they are what is sharded); the rest is saved beside them.
        rest = dict(checkpoint)
        save_checkpoint(
            self.broadcast(filepath),  # every rank must write to rank 0's path
            self.engine,
            extra=rest,
            model_state=rest.pop("state_dict"),
            optimizer_states=rest.pop("optimizer_states", []),
            state_dict_type=self.state_dict_type,
            background=self._saver_for_save(self.engine.group),
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        # Only a fit restores optimizer states; validate/test/predict after a fit keep
        # the fit's optimizers around, which must not be touched (or counted).
        trainer = self.lightning_module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        path = self.broadcast(checkpoint_path)
        self.wait_for_checkpoint()  # it may be the one being written
        # [Note: one checkpoint format for Fabric and the Trainer]: refused before loading.
        extras = read_checkpoint_extras(path)
        schedulers = len(trainer.lr_scheduler_configs) if fitting else 0
        check_trainer_can_resume(extras, num_schedulers=schedulers)
        checkpoint = load_checkpoint(
            path,
            self.engine,
            optimizers=self.optimizers if fitting else (),
            strict=self.lightning_module.strict_loading,
            verify_checksums=self._options.verify_checksums,
        )
        # Hooks and callbacks that read it (WeightAveraging.on_load_checkpoint) get the
        # module's state_dict() after loading: sharded views.
        checkpoint["state_dict"] = self.engine.root.state_dict()
        if FABRIC_KEYS not in checkpoint:
            return checkpoint
        rank_zero_warn(
            f"{checkpoint_path} was written by Fabric: the weights and optimizer states are "
            "restored; the Trainer's step and epoch counters start at 0 (a Fabric loop keeps "
            f"its own, here in the entries {fabric_entries(checkpoint)}, which "
            "on_load_checkpoint receives)"
        )
        return as_trainer_checkpoint(checkpoint, lightning_version=lightning.__version__)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        # Already loaded into the shards by load_checkpoint.
        pass

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # Already loaded by load_checkpoint.
        pass

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        # ModelCheckpoint's top-k and last-checkpoint rotation: sharded checkpoints are
        # directories; a "last" link is removed as a link, never through it.
        self._wait_if_writing(filepath)
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._report_failed_save()  # [Note: background saves]: said at the next step
        super().on_train_batch_start(batch, batch_idx)

    # -- the end ---------------------------------------------------------------------------

    @override
    def on_train_end(self) -> None:
        self.wait_for_checkpoint()  # a failed background save is raised here at the latest
        super().on_train_end()

    @override
    def teardown(self) -> None:
        # Unlike the base class, leave the model where it is: moving a sharded module
        # would detach its master shards from the engine's views. The engine stays, so
        # trainer.validate()/test() after fit() reuse the sharded model.
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self._close_saver()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


# -- helpers ------------------------------------------------------------------------------


def _rebuild_weight_averages(
    trainer: pl.Trainer, module: pl.LightningModule, device: torch.device
) -> None:
    # [Note: WeightAveraging after sharding] Lightning's WeightAveraging (EMA, SWA-like)
    # builds its AveragedModel in its own setup(), which runs before the strategy's: a
    # deep copy of the unsharded model, whose full tensors cannot be averaged with the
    # sharded parameters. Rebuilt here from the sharded module, the copy holds this rank's
    # pieces only (RangeShardedTensor.__deepcopy__), so the average costs a shard, not a model,
    # and its updates and swaps are elementwise. Uses the callback's private attributes
    # of Lightning 2.6 (pinned; tests/test_param_views_callbacks.py checks they exist).
    for callback in trainer.callbacks:
        if not isinstance(callback, WeightAveraging) or callback._average_model is None:
            continue
        wanted = torch.device(callback._device) if callback._device is not None else device
        if wanted.type != device.type:
            raise ValueError(
                f"WeightAveraging(device={callback._device!r}) keeps the averaged model on "
                f"{wanted}, but YaFSDPStrategy trains on {device}: the average of a sharded "
                "model is sharded like it and stays on the training device. Pass device=None."
            )
        callback._average_model = AveragedModel(
            module, device=device, use_buffers=callback._use_buffers, **callback._kwargs
        )


# Loading this module registers the strategy (see lightning_yafsdp/_registration.py).
YaFSDPStrategy.register_strategies(_StrategyRegistry)
