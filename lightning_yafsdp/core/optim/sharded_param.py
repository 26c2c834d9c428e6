"""A sharded parameter: the full logical tensor as the user sees it, this rank's piece inside.

[Note: sharded parameters]
After ``shard_model`` every original trainable parameter is back in its module's
``_parameters`` under its original name, as an ``nn.Parameter`` whose type is
``RangeShardedTensor``: a wrapper subclass (like DTensor, but not one) that reports
the parameter's full shape, the master dtype and the device, and whose storage is
``_local``, this rank's contiguous run ``[start, end)`` of the flattened parameter,
a 1-D view into the flat master shard (possibly 0 elements). Gradients (``p.grad``)
and, for optimizers that run on it directly, optimizer state are RangeShardedTensors of
the same placement.

Why our own type and not a DTensor: our shards are ragged flat ranges of a flat
group, not dim-0 chunks. DTensor has no such placement; labelling the range
``Shard(0)`` would make every DTensor-aware tool (DCP planners, ``full_tensor()``,
state-dict utilities) compute wrong offsets silently. Here whatever is not
implemented raises and names the fix.

What runs on a RangeShardedTensor (``__torch_dispatch__``):

* pointwise ops, ``_foreach_*`` and ``_fused_*`` ops (optimizers), ``zero_``,
  ``fill_``: on the local pieces; all RangeShardedTensor operands must share a placement;
* ``*_like``, ``clone``, ``detach``, ``alias``: local op, same placement;
* ``copy_``: sharded to sharded copies pieces; a full plain tensor of the logical
  shape copied INTO a RangeShardedTensor gives it its own elements (``load_state_dict``);
* ``linalg_vector_norm`` and ``_foreach_norm``: the GLOBAL norm of the full tensor,
  one all_reduce per call over the shard group (collective: every rank must make
  the call; the set of non-None grads is the same on every rank, so ``grad_norm``
  and ``clip_grad_norm_`` qualify);
* whole-tensor ``sum``, ``mean``, ``max``/``amax``, ``min``/``amin``, ``all``, ``any``
  (no ``dim``): the reduction of the full tensor, one all_reduce (collective);
* anything else (matmul, ``view``, casts, reductions over a dim) raises ``NotImplementedError``:
  the tensor holds one rank's elements only; use it inside its unit's forward
  (where the module attribute is the gathered view) or under ``summon_full_params``.

In-place ops write ``_local``, a view of the master, so the master's version
counter moves and the engine refreshes its compute shards before the next forward.

The name says what it is, a tensor sharded by element RANGE: it is neither torch's
legacy ``torch.distributed._shard.ShardedTensor`` nor a DTensor, and torch code that
special-cases either never mistakes it for one.

[Note: element ranges as boxes]
``torch.distributed.checkpoint`` (DCP) saves and reshards a RangeShardedTensor through
the protocol DTensor implements (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``), with DCP's DEFAULT planners. DCP describes a shard as a box
(an offset and a size per dimension) of the tensor's FULL shape, and a run
``[start, end)`` of a flattened row-major tensor is not always one box ("elements 100
to 1300 of a 32 x 64 matrix"). It is, however, the union of at most ``2 * ndim - 1``
boxes: a partial first row, a block of whole rows, a partial last row (recursively
inside the partial rows), each contiguous in memory and so a view of ``_local``. Every
rank writes its run as those boxes: the checkpoint's metadata holds true shapes and
original names, any DCP reader (``dcp_to_torch_save``, an FSDP2 model's plain
``dcp.load``, Lightning's consolidation) rebuilds full tensors, and a reader at another
world size asks for the boxes of ITS runs, which DCP intersects with the stored ones.
The alternative, writing every parameter flattened to 1-D, would make the stored shapes
differ from the model's and break every reader that is not ours.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch._guards
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from lightning_yafsdp.core.comm.collectives import (
    CommStats,
    all_gather_into,
    all_gather_objects,
    all_reduce_,
)

aten = torch.ops.aten

_LOCAL_LIKE = {
    aten.zeros_like.default,
    aten.empty_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
}
_NORMS = {aten.linalg_vector_norm.default, aten._foreach_norm.Scalar}
# Whole-tensor reductions: the local partial, then one all_reduce (collective).
_REDUCTIONS = {
    aten.sum.default: dist.ReduceOp.SUM,
    aten.mean.default: dist.ReduceOp.SUM,
    aten.amax.default: dist.ReduceOp.MAX,
    aten.amin.default: dist.ReduceOp.MIN,
    aten.max.default: dist.ReduceOp.MAX,
    aten.min.default: dist.ReduceOp.MIN,
    aten.all.default: dist.ReduceOp.MIN,
    aten.any.default: dist.ReduceOp.MAX,
}
_ELEMENTWISE_EXTRA = {aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor}


@dataclass(frozen=True)
class ShardPlacement:
    """Which part of which parameter a RangeShardedTensor holds.

    Attributes:
        name: the parameter's fully qualified name (its first alias when tied).
        aliases: every name the parameter is reachable under (``name`` first).
        shape: the full parameter's shape.
        start: first element of the flattened parameter this rank holds.
        end: one past the last (``start == end``: this rank holds none).
    """

    name: str
    aliases: tuple[str, ...]
    shape: torch.Size
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


class RangeShardedTensor(torch.Tensor):
    """A full-shape tensor of which this rank stores elements ``[start, end)`` (see the Note)."""

    _local: torch.Tensor
    _placement: ShardPlacement
    _group: dist.ProcessGroup | None

    @staticmethod
    def __new__(
        cls,
        local: torch.Tensor,
        placement: ShardPlacement,
        group: dist.ProcessGroup | None,
        *,
        requires_grad: bool = False,
    ):
        if local.dim() != 1 or local.numel() != placement.numel:
            raise ValueError(
                f"the local piece of {placement.name!r} must be 1-D with {placement.numel} "
                f"elements, got shape {tuple(local.shape)}"
            )
        tensor = torch.Tensor._make_wrapper_subclass(
            cls,
            placement.shape,
            dtype=local.dtype,
            device=local.device,
            requires_grad=requires_grad,
        )
        tensor._local = local
        tensor._placement = placement
        tensor._group = group
        return tensor

    def __repr__(self) -> str:  # noqa: D105
        p = self._placement
        return (
            f"RangeShardedTensor({p.name!r}, shape={tuple(p.shape)}, elements [{p.start}, {p.end}) "
            f"of {math.prod(p.shape)}, dtype={self.dtype}, device={self.device})"
        )

    def local_tensor(self) -> torch.Tensor:
        """This rank's elements, a plain 1-D tensor (a view: writes reach the shard)."""
        return self._local

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor, gathered from every rank. Collective: call on every rank."""
        return gather_full(self)

    def untyped_storage(self):
        # Writers that read raw memory (safetensors, peft's save_pretrained) would save one
        # rank's piece as if it were the whole tensor: refuse, with the fix.
        raise RuntimeError(_raw_memory_refusal(self))

    def data_ptr(self) -> int:
        raise RuntimeError(_raw_memory_refusal(self))

    def __deepcopy__(self, memo: dict) -> RangeShardedTensor:
        # A copy keeps this rank's piece only (an EMA of a sharded model is shard-sized)
        # and shares the process group: groups are never copied.
        if id(self) in memo:
            return memo[id(self)]
        copy = RangeShardedTensor(self._local.detach().clone(), self._placement, self._group)
        if isinstance(self, nn.Parameter):
            copy = nn.Parameter(copy, requires_grad=self.requires_grad)
        memo[id(self)] = copy
        return copy

    def __reduce_ex__(self, protocol):
        # torch.save writes the local piece and the placement, never the process group
        # or the whole flat storage the piece is a view of.
        return (
            _rebuild,
            (self._local.detach().clone(), self._placement, isinstance(self, nn.Parameter)),
        )

    def __tensor_flatten__(self):
        return ["_local"], (self._placement, self._group)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        placement, group = meta
        return RangeShardedTensor(inner["_local"], placement, group)

    # -- torch.distributed.checkpoint's protocol ([Note: element ranges as boxes]) -------

    def __create_write_items__(self, fqn: str, object: Any) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        # From the local piece: the wrapper refuses raw-memory queries such as is_pinned.
        properties = TensorProperties.create_from_tensor(self._local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape),
            )
            for chunk in self.__create_chunk_list__()
        ]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [
            ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            for offsets, sizes, _ in _boxes(self._placement)
        ]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        # The box at ``index.offset``: a view of ``_local``, so a load writes the shard.
        for offsets, sizes, begin in _boxes(self._placement):
            if torch.Size(offsets) == index.offset:
                return self._local.narrow(0, begin, math.prod(sizes)).view(sizes)
        raise ValueError(
            f"{self._placement.name!r}: this rank holds no box at offset {tuple(index.offset)} "
            f"(it holds elements [{self._placement.start}, {self._placement.end}))"
        )

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LOCAL_LIKE:
            source = args[0]
            return RangeShardedTensor(func(source._local, *args[1:], **kwargs), *_meta(source))
        if func is aten.copy_.default:
            return _copy_into(args[0], args[1], **kwargs)
        if func in _NORMS:
            return _global_norms(func, args, kwargs)
        if func in _REDUCTIONS and not (
            func in (aten.amax.default, aten.amin.default) and args[1:]
        ):
            return _global_reduction(func, args[0], kwargs)
        if not _is_elementwise(func):
            raise NotImplementedError(_refusal(func, args))
        return _run_elementwise(func, args, kwargs)


def is_sharded(value: object) -> bool:
    """True for a RangeShardedTensor (a sharded parameter, its grad or its optimizer state)."""
    return isinstance(value, RangeShardedTensor)


def local_of(value: object) -> object:
    """``value``'s local piece if it is a RangeShardedTensor, else ``value`` itself."""
    return value._local if isinstance(value, RangeShardedTensor) else value


def register_foreach_support() -> None:
    """Let torch's optimizers and clipping use their foreach paths on RangeShardedTensors."""
    from torch.optim import optimizer as optim_module
    from torch.utils import _foreach_utils

    for registry in (
        getattr(optim_module, "_foreach_supported_types", None),
        getattr(_foreach_utils, "_foreach_supported_types", None),
    ):
        if registry is not None and RangeShardedTensor not in registry:
            registry.append(RangeShardedTensor)


@torch.no_grad()
def gather_full(tensor: RangeShardedTensor) -> torch.Tensor:
    """All-gather every rank's piece of ``tensor``: the full tensor on every rank."""
    group, placement = tensor._group, tensor._placement
    if group is None:
        raise RuntimeError(
            f"{placement.name!r}: this RangeShardedTensor was loaded from a file and belongs to no "
            "process group, so the other ranks' elements cannot be gathered"
        )
    world = dist.get_world_size(group)
    counts = all_gather_objects(placement.numel, group=group)
    width = max(counts)
    padded = torch.zeros(width, dtype=tensor.dtype, device=tensor.device)
    padded[: placement.numel].copy_(tensor._local)
    pieces = torch.empty(width * world, dtype=tensor.dtype, device=tensor.device)
    all_gather_into(pieces, padded, group, async_op=False, stats=CommStats())
    # Pieces are consecutive in rank order (the flat layout's shards are).
    full = torch.cat([pieces[r * width : r * width + n] for r, n in enumerate(counts)])
    return full.view(placement.shape)


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes), one entry per dimension


def range_to_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Split elements ``[start, end)`` of a row-major tensor of ``shape`` into boxes.

    Boxes come in element order, so box ``i`` covers the next ``prod(sizes_i)``
    elements of the run ([Note: element ranges as boxes]). ``[]`` for an empty run.
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if not 0 <= start <= end <= total:
        raise ValueError(f"range [{start}, {end}) is outside a tensor of {total} elements")
    if start == end:
        return []
    if not shape:
        return [((), ())]
    inner, rest = math.prod(shape[1:]), shape[1:]
    first_row, last_row = start // inner, (end - 1) // inner

    def in_row(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *off), (1, *size)) for off, size in range_to_boxes(rest, lo, hi)]

    if first_row == last_row:
        return in_row(first_row, start - first_row * inner, end - first_row * inner)
    head = in_row(first_row, start % inner, inner) if start % inner else []
    tail = in_row(last_row, 0, end % inner) if end % inner else []
    full_begin, full_end = first_row + bool(head), last_row + 1 - bool(tail)
    body = []
    if full_end > full_begin:
        body = [((full_begin, *([0] * len(rest))), (full_end - full_begin, *rest))]
    return head + body + tail


@functools.lru_cache(maxsize=4096)
def _boxes_of(shape: tuple[int, ...], start: int, end: int) -> tuple:
    """``(offsets, sizes, first element in the local piece)`` of every box of a run."""
    boxes, begin = [], 0
    for offsets, sizes in range_to_boxes(shape, start, end):
        boxes.append((offsets, sizes, begin))
        begin += math.prod(sizes)
    return tuple(boxes)


def _boxes(placement: ShardPlacement) -> tuple:
    return _boxes_of(tuple(placement.shape), placement.start, placement.end)


# -- dispatch rules -------------------------------------------------------------------------


def _meta(tensor: RangeShardedTensor) -> tuple[ShardPlacement, dist.ProcessGroup | None]:
    return tensor._placement, tensor._group


def _is_elementwise(func) -> bool:
    name = func._schema.name
    return (
        torch.Tag.pointwise in func.tags
        or name.startswith("aten::_foreach_")
        or name.startswith("aten::_fused_")
        or func in _ELEMENTWISE_EXTRA
    )


def _run_elementwise(func, args, kwargs):
    if func._schema.name.startswith("aten::_foreach_"):
        return _run_foreach(func, args, kwargs)
    sharded = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, RangeShardedTensor)]
    placement = sharded[0]._placement
    for value in pytree.tree_leaves((args, kwargs)):
        _check_operand(func, value, placement)
    local_args, local_kwargs = pytree.tree_map(local_of, (args, kwargs))
    out = func(*local_args, **local_kwargs)
    if func._schema.name.startswith("aten::_fused_"):
        return None
    if func._schema.is_mutable:
        return args[0]
    if isinstance(out, torch.Tensor) and out.shape == sharded[0]._local.shape:
        return RangeShardedTensor(out, *_meta(sharded[0]))
    return out


def _check_operand(func, value, placement: ShardPlacement) -> None:
    # A plain operand with more than one element would broadcast against the local piece:
    # wrong elements, or by chance the right shape. Scalars and same-placement pieces only.
    if isinstance(value, RangeShardedTensor):
        if value._placement != placement:
            raise NotImplementedError(
                f"{func} mixes sharded tensors of different parameters "
                f"({placement.name!r} and {value._placement.name!r})"
            )
    elif isinstance(value, torch.Tensor) and value.numel() > 1:
        raise NotImplementedError(
            f"{func} combines the sharded {placement.name!r} with a plain tensor of shape "
            f"{tuple(value.shape)}: only scalars and tensors sharded the same way can be "
            "combined with a sharded tensor outside its unit's forward"
        )


def _run_foreach(func, args, kwargs):
    # Lists are matched position by position: tensor i of every list is one parameter.
    local_args, local_kwargs = pytree.tree_map(local_of, (args, kwargs))
    out = func(*local_args, **local_kwargs)
    if func._schema.name.endswith("_"):
        return None
    models = args[0]
    return [
        RangeShardedTensor(o, *_meta(m)) if isinstance(m, RangeShardedTensor) else o
        for o, m in zip(out, models, strict=True)
    ]


def _copy_into(dst, src, non_blocking: bool = False):
    if not isinstance(dst, RangeShardedTensor):
        raise NotImplementedError(
            f"copying the sharded {src._placement.name!r} into a plain tensor: it holds this "
            "rank's elements only; use .full_tensor() (collective) or summon_full_params()"
        )
    placement = dst._placement
    if isinstance(src, RangeShardedTensor):
        if src._placement.numel != placement.numel or src._placement.start != placement.start:
            raise NotImplementedError(
                f"copying {src._placement.name!r} into {placement.name!r}: different pieces"
            )
        dst._local.copy_(src._local, non_blocking=non_blocking)
        return dst
    if src.numel() == 1 and src.dim() == 0:
        dst._local.copy_(src, non_blocking=non_blocking)
        return dst
    if tuple(src.shape) != tuple(placement.shape):
        raise RuntimeError(
            f"copying a tensor of shape {tuple(src.shape)} into {placement.name!r} of shape "
            f"{tuple(placement.shape)}"
        )
    piece = src.reshape(-1)[placement.start : placement.end]
    dst._local.copy_(piece, non_blocking=non_blocking)
    return dst


def _global_norms(func, args, kwargs):
    """Norms of FULL tensors: local partial sums, ONE all_reduce for the whole call."""
    many = func is aten._foreach_norm.Scalar
    tensors = list(args[0]) if many else [args[0]]
    order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    order = float(order)
    dims = None if many else (args[2] if len(args) > 2 else kwargs.get("dim"))
    if dims not in (None, [], ()):
        raise NotImplementedError(_refusal(func, args))
    dtype = kwargs.get("dtype")
    locals_ = [local_of(t).float() for t in tensors]
    if order == math.inf:
        parts = [x.abs().max() if x.numel() else x.new_zeros(()) for x in locals_]
        op = dist.ReduceOp.MAX
    elif order == 0:
        parts = [(x != 0).sum().float() for x in locals_]
        op = dist.ReduceOp.SUM
    else:
        parts = [x.abs().pow(order).sum() for x in locals_]
        op = dist.ReduceOp.SUM
    partial = torch.stack(parts)
    group = next((t._group for t in tensors if isinstance(t, RangeShardedTensor)), None)
    if group is None:
        raise RuntimeError(
            "the norm of a RangeShardedTensor that belongs to no process group (loaded from a "
            "file) cannot be computed: the other ranks' elements are not reachable"
        )
    all_reduce_(partial, group, op=op)
    total = partial if order in (0.0, math.inf) else partial.pow(1.0 / order)
    total = total.to(dtype or tensors[0].dtype)
    return list(total.unbind()) if many else total[0]


def _global_reduction(func, tensor: RangeShardedTensor, kwargs: dict) -> torch.Tensor:
    """``sum``/``mean``/``max``/``all``... of the FULL tensor: one all_reduce (collective)."""
    local, group = tensor._local, tensor._group
    if group is None:
        raise RuntimeError(
            f"{func} of {tensor._placement.name!r}, a RangeShardedTensor that belongs to no "
            "process group (loaded from a file): the other ranks' elements are not reachable"
        )
    op = _REDUCTIONS[func]
    if func is aten.mean.default:
        partial = local.sum(dtype=kwargs.get("dtype") or local.dtype)
    elif local.numel() or func in (aten.sum.default, aten.all.default, aten.any.default):
        partial = func(local, **kwargs)
    else:  # max/min of no elements: the neutral value of the reduction
        info = torch.finfo(local.dtype) if local.is_floating_point() else torch.iinfo(local.dtype)
        partial = local.new_full((), info.min if op is dist.ReduceOp.MAX else info.max)
    flag = partial.dtype == torch.bool
    partial = partial.to(torch.uint8) if flag else partial.clone()
    all_reduce_(partial, group, op=op)
    if func is aten.mean.default:
        return partial / math.prod(tensor._placement.shape)
    return partial.to(torch.bool) if flag else partial


def _refusal(func, args) -> str:
    names = [
        a._placement.name for a in pytree.tree_leaves(args) if isinstance(a, RangeShardedTensor)
    ]
    what = names[0] if names else "a sharded parameter"
    compiling = _compile_refusal(what)
    if compiling is not None:
        return compiling
    return (
        f"{func} on the sharded parameter {what!r}: outside its unit's forward it holds only "
        "this rank's elements, so only elementwise ops and norms work on it. Use the "
        "parameter inside the forward of the module that owns it, or gather it with "
        "`with trainer.strategy.summon_full_params():` (torch loop: "
        "`engine.summon_full_params()`) or `p.full_tensor()` (both collective)."
    )


def _compile_refusal(name: str) -> str | None:
    """The refusal for a sharded parameter met while torch.compile traces, else None."""
    if torch._guards.TracingContext.try_get() is None and not torch.compiler.is_compiling():
        return None
    return (
        f"torch.compile traced the sharded parameter {name!r} outside its unit's forward: "
        "it holds this rank's elements only, and the engine's hooks that gather it run "
        "outside compiled graphs. Compile each block (`block.compile()` on every unit's "
        "module in configure_model) or the whole model, and keep reads of parameters out "
        "of compiled code that runs outside the units."
    )


def _raw_memory_refusal(tensor: RangeShardedTensor) -> str:
    compiling = _compile_refusal(tensor._placement.name)
    if compiling is not None:
        return compiling
    return (
        f"the memory of the sharded parameter {tensor._placement.name!r} was read directly "
        "(a file writer such as safetensors or peft's save_pretrained, or data_ptr()): it "
        "holds this rank's elements only. Gather the full weights on EVERY rank first: "
        "`with trainer.strategy.summon_full_params(): model.save_pretrained(path, "
        "is_main_process=trainer.is_global_zero)` (torch loop: engine.summon_full_params())."
    )


def _rebuild(local: torch.Tensor, placement: ShardPlacement, is_param: bool):
    tensor = RangeShardedTensor(local, placement, None)
    return nn.Parameter(tensor) if is_param else tensor


register_foreach_support()
