"""YaFSDPStrategy for Fabric: the engine behind ``Fabric(strategy="yafsdp")``.

The same sharding as the Trainer strategy (``lightning_yafsdp.strategy``), the same
arguments and the same checkpoint format, for loops written by hand with Fabric
(litgpt's pretrain and finetune scripts). The story of a run, in Fabric's calls:

1. ``Fabric(strategy="yafsdp", precision=...)``: the options are checked; the flag
   becomes a :class:`~lightning_yafsdp.fabric.precision.YaFSDPPrecision`.
2. ``fabric.launch()``: processes and ranks as under ``"ddp"``; the process group.
3. ``fabric.init_module(empty_init=True)``: modules are built on the meta device (and
   ``from_pretrained`` lazily), so no rank ever holds the whole model;
   ``empty_init=False`` builds real tensors on the CPU, as FSDPStrategy does.
4. ``fabric.setup(model, optimizer)`` or ``setup_module`` + ``setup_optimizers``: the
   module is sharded in place, unit by unit, and moved to the device; an optimizer
   built before (even from meta parameters) is pointed at the sharded parameters; one
   built after from ``model.parameters()`` (param groups too) needs nothing.
5. ``fabric.backward`` / ``optimizer.step()``: the engine's hooks gather, reduce-scatter
   and refresh. ``fabric.no_backward_sync`` is accepted and changes nothing: every
   backward reduce-scatters into the gradient shards, which accumulate until
   ``zero_grad`` (a sharded model has no whole local gradient to hold back).
   ``fabric.clip_gradients(max_norm=...)`` clips by the global norm over every rank.
6. ``fabric.save`` / ``fabric.load`` / ``fabric.load_raw``: ``fabric/checkpoints.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import TBroadcast, _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.distributed import ReduceOp, _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.wrappers import _FabricModule, _unwrap_compiled
from torch import Tensor, nn
from torch.optim import Optimizer
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
from lightning_yafsdp.adapters.sharding import (
    parameter_names,
    place_module,
    rebind_optimizers,
    refuse_optimizers_with_state,
    shard_module,
)
from lightning_yafsdp.checkpoint.state import StateDictType
from lightning_yafsdp.core import YaFSDPEngine
from lightning_yafsdp.core.plan.meta_build import meta_device
from lightning_yafsdp.fabric.checkpoints import (
    engine_of,
    load_fabric_checkpoint,
    load_raw_into,
    save_fabric_checkpoint,
)
from lightning_yafsdp.fabric.precision import YaFSDPPrecision, to_fabric_precision
from lightning_yafsdp.model_checks import (
    check_no_meta_metric_states,
    check_optimizers_hold_model_params,
)
from lightning_yafsdp.pretrained import lazy_from_pretrained

if TYPE_CHECKING:
    from lightning.fabric.accelerators import Accelerator
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_yafsdp.core.plan.policy import NormSpec, UnitsSpec
    from lightning_yafsdp.core.plan.sharding import CheckpointSpec

_OPTIMIZER_AFTER_SETUP = (
    "Create the optimizer after model = fabric.setup_module(model), from "
    "model.parameters() (or param groups of it), or pass both to fabric.setup(model, "
    "optimizer)."
)


class YaFSDPStrategy(ShardingState, BackgroundSaving, ParallelStrategy, _Sharded):
    """Fully sharded data parallel training in a Fabric loop.

    Takes the arguments of :class:`lightning_yafsdp.strategy.YaFSDPStrategy` (units,
    norm_classes, zero_stage, reduce_dtype, activation_checkpointing, param_init_fn,
    sync_module_states, cast_forward_inputs, timeout, process_group_backend,
    state_dict_type, verify_checksums, async_save, shard_size, device_mesh, vocab_chunks,
    blocks_per_unit),
    documented there. With ``async_save=True`` the next ``fabric.save``/``fabric.load`` and
    ``teardown`` wait for a save in flight; after the last save of a script call
    ``fabric.strategy.wait_for_checkpoint()`` to see a failure raised.
    ``state_dict_type`` decides how ``fabric.save`` writes; ``fabric.load`` reads either
    kind, and checkpoints of the Trainer strategy, comparing checksums first unless
    ``verify_checksums=False``.

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
        precision: Precision | None = None,
        **unknown: Any,
    ) -> None:
        # Every named argument above but the Lightning plumbing (accelerator, devices, ...).
        self._options = ShardingOptions.from_arguments(type(self).__name__, locals(), unknown)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._num_nodes = 1
        self._process_group_backend = self._options.process_group_backend
        self._backward_sync_control = _AccumulatingBackward()
        self._sharded_modules: list[nn.Module] = []

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers ``"yafsdp"``; a second call (re-import, reload) is a no-op."""
        register_once(cls, strategy_registry)

    # -- what Fabric asks before anything runs ------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

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
    def state_dict_type(self) -> StateDictType:
        return self._options.state_dict_type

    @property
    @override
    def precision(self) -> YaFSDPPrecision:
        if self._precision is None:  # used without Fabric's connector, which always sets one
            self._precision = YaFSDPPrecision("32-true")
        return self._precision

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        self._precision = to_fabric_precision(precision)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def _set_world_ranks(self) -> None:
        self._check_against_run()
        assign_world_ranks(self)

    # -- process group, model, optimizers ---------------------------------------------

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._set_world_ranks()
        assert self.cluster_environment is not None
        self._process_group_backend = init_process_group(
            self.cluster_environment,
            self.root_device,
            backend=self._process_group_backend,
            timeout=self._options.timeout,
        )
        self._ensure_mesh()
        self.precision.device_type = self.root_device.type

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        # As FSDPStrategy: meta with empty_init=True (materialized and initialized unit
        # by unit in setup_module), real tensors on the CPU otherwise.
        stack = ExitStack()
        if empty_init:
            stack.enter_context(self.module_sharded_context())
        stack.enter_context(self.precision.module_init_context())
        return stack

    @contextmanager
    @override
    def module_sharded_context(self) -> Generator[None, None, None]:
        # [Note: meta-device configure_model] in lightning_yafsdp/strategy.py.
        with lazy_from_pretrained(), meta_device():
            yield

    @override
    def module_to_device(self, module: nn.Module) -> None:
        # Sharding places the module (a meta-built one cannot be moved before it).
        if "_yafsdp_engine" in module.__dict__:
            module.to(self.root_device)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        check_no_meta_metric_states(module)
        engine = shard_module(
            module, self._options, self.precision, device=self.root_device, mesh=self._mesh
        )
        place_module(module, engine, self.root_device)
        if module not in self._sharded_modules:
            self._sharded_modules.append(module)
        return module

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        refuse_optimizers_with_state(optimizers)
        names_before = parameter_names(module)
        module = self.setup_module(module)
        rebind_optimizers(optimizers, names_before, module)
        return module, [self.setup_optimizer(opt) for opt in optimizers], scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        check_optimizers_hold_model_params(
            self._sharded_modules, [optimizer], fix=_OPTIMIZER_AFTER_SETUP
        )
        return optimizer

    @contextmanager
    def summon_full_params(
        self, module: nn.Module, *, writeback: bool = False
    ) -> Generator[None, None, None]:
        """The full weights in ``module`` for the block (collective; see the Trainer's)."""
        with engine_of(_unwrap(module), action="summon_full_params").summon_full_params(
            writeback=writeback
        ):
            yield

    # -- a training step -------------------------------------------------------------------

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        # torch optimizers trigger the engines' step hook; any other Optimizable might not.
        for module in self._sharded_modules:
            engine_of(module, action="step").mark_weights_changed()
        return output

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        # The global norm over every rank's shards (one all_reduce) of this optimizer's
        # parameters, as torch.nn.utils.clip_grad_norm_ over the unsharded model.
        return self._engine_of(module).clip_grad_norm_(
            float(max_norm),
            float(norm_type),
            params=self.precision.main_params(optimizer),
            error_if_nonfinite=error_if_nonfinite,
        )

    @override
    def clip_gradients_value(
        self, module: nn.Module, optimizer: Optimizer, clip_val: float | int
    ) -> None:
        self._engine_of(module).clip_grad_value_(
            float(clip_val), params=self.precision.main_params(optimizer)
        )

    def _engine_of(self, module: nn.Module) -> YaFSDPEngine:
        return engine_of(_unwrap(module), action="clip_gradients")

    # -- collectives ----------------------------------------------------------------------

    @override
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return broadcast_object(obj, src)

    # -- checkpoints ---------------------------------------------------------------------

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "YaFSDPStrategy writes checkpoints itself and does not use CheckpointIO "
                "storage_options; call fabric.save(path, state) without them"
            )
        # Every rank writes to rank 0's path.
        path = self.broadcast(path)
        save_fabric_checkpoint(
            path,
            state,
            state_dict_type=self.state_dict_type,
            filter=filter,
            background=self._saver_for_save(self.mesh.world_group if self.mesh else None),
        )

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: nn.Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        path = self.broadcast(path)
        self.wait_for_checkpoint()  # it may be the one being written
        if isinstance(state, (nn.Module, Optimizer)):  # fabric.load_raw
            load_raw_into(
                path, state, strict=strict, verify_checksums=self._options.verify_checksums
            )
            return {}
        if not state:
            raise ValueError(
                "fabric.load(path) under strategy='yafsdp' needs the model to load into: "
                "fabric.load(path, {'model': model, 'optimizer': optimizer, ...}). To read a "
                "checkpoint without a model, use lightning_yafsdp.checkpoint."
                "consolidate_checkpoint(path)"
            )
        return load_fabric_checkpoint(
            path, state, strict=strict, verify_checksums=self._options.verify_checksums
        )


    @override
    def teardown(self) -> None:
        self._close_saver()
        super().teardown()


def _unwrap(module: nn.Module) -> nn.Module:
    """The module itself, out of Fabric's wrapper and torch.compile's."""
    module, _ = _unwrap_compiled(module)
    if isinstance(module, _FabricModule):
        module, _ = _unwrap_compiled(module._forward_module)
    return module


class _AccumulatingBackward(_BackwardSyncControl):
    """``fabric.no_backward_sync``: accepted, and nothing to skip.

    Under DDP it holds each rank's whole local gradient back from the all_reduce until
    the last micro-batch. A sharded model holds no whole gradient (that would cost the
    memory sharding saves): each backward reduce-scatters into the gradient shards,
    which accumulate until ``zero_grad``, so the result is the same sum either way.
    """

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        engine_of(_unwrap(module), action="no_backward_sync")  # refuses one never set up
        return nullcontext()
