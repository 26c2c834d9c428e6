"""Prototype: a sharded parameter = wrapper subclass with full logical shape, local 1-D piece."""
import torch
from torch.utils import _pytree as pytree

aten = torch.ops.aten

class ShardSpec:
    __slots__ = ("shape", "start", "end", "name")
    def __init__(self, shape, start, end, name=""):
        self.shape, self.start, self.end, self.name = torch.Size(shape), start, end, name
    def __repr__(self):
        return f"ShardSpec({tuple(self.shape)}, [{self.start},{self.end}))"

_LIKE = {aten.zeros_like.default, aten.empty_like.default, aten.ones_like.default,
         aten.clone.default, aten.detach.default, aten.alias.default}

class ShardedTensor(torch.Tensor):
    _local: torch.Tensor
    _spec: ShardSpec

    @staticmethod
    def __new__(cls, local, spec, requires_grad=False):
        t = torch.Tensor._make_wrapper_subclass(
            cls, spec.shape, dtype=local.dtype, device=local.device,
            requires_grad=requires_grad)
        t._local, t._spec = local, spec
        return t

    def __repr__(self):
        return f"ShardedTensor({self._spec}, local={self._local})"

    def __tensor_flatten__(self):
        return ["_local"], self._spec
    @staticmethod
    def __tensor_unflatten__(inner, spec, outer_size, outer_stride):
        return ShardedTensor(inner["_local"], spec)

    # pickling / deepcopy: keep the local piece only (a clone: never the whole flat storage)
    def __reduce_ex__(self, proto):
        return (_rebuild, (self._local.detach().clone(), self._spec, self.requires_grad, self.__class__ is not ShardedTensor))

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = None
        def unwrap(x):
            nonlocal spec
            if isinstance(x, ShardedTensor):
                if spec is None: spec = x._spec
                return x._local
            return x
        if func in _LIKE:
            (src,) = args[:1]
            local = func(src._local, *args[1:], **kwargs)
            return ShardedTensor(local, src._spec)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(src, ShardedTensor):
                dst._local.copy_(src._local, **kwargs)
            else:  # a full tensor of the logical shape: take our elements
                dst._local.copy_(src.reshape(-1)[dst._spec.start:dst._spec.end])
            return dst
        if func in (aten.linalg_vector_norm.default, aten._foreach_norm.Scalar):
            return _global_norms(func, args, kwargs)
        name = func._schema.name
        pointwise = torch.Tag.pointwise in func.tags or name.startswith("aten::_foreach_") \
            or name.startswith("aten::_fused_") or func in (aten.zero_.default, aten.fill_.Scalar)
        if not pointwise:
            raise NotImplementedError(
                f"{func} on a sharded parameter: it holds only this rank's elements; "
                "use it inside its unit's forward or under engine.summon_full_params()")
        largs, lkwargs = pytree.tree_map(unwrap, (args, kwargs))
        out = func(*largs, **lkwargs)
        if name.startswith("aten::_foreach_") and name.endswith("_"):
            return None
        if name.endswith("_") and not name.startswith("aten::_fused_"):
            return args[0]
        if name.startswith("aten::_fused_"):
            return None
        # rewrap: lists (foreach) per element spec, single tensors with the arg spec
        if isinstance(out, (list, tuple)):
            firsts = args[0]
            return [ShardedTensor(o, a._spec) if isinstance(a, ShardedTensor) else o for o, a in zip(out, firsts)]
        if isinstance(out, torch.Tensor) and out.dim() == 1 and spec is not None and out.numel() == spec.end - spec.start:
            return ShardedTensor(out, spec)
        return out

def _rebuild(local, spec, requires_grad, is_param):
    t = ShardedTensor(local, spec)
    return torch.nn.Parameter(t, requires_grad) if is_param else t

# foreach support for optimizers
from torch.optim.optimizer import _foreach_supported_types as _a
from torch.utils._foreach_utils import _foreach_supported_types as _b
for l in (_a, _b):
    if ShardedTensor not in l: l.append(ShardedTensor)


import math
import torch.distributed as dist
def _global_norms(func, args, kwargs):
    """Norm of the FULL tensor: local partial, one all_reduce for the whole call (collective)."""
    many = func is aten._foreach_norm.Scalar
    tensors = list(args[0]) if many else [args[0]]
    ord_ = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    locs = [t._local.float() if isinstance(t, ShardedTensor) else t.float() for t in tensors]
    if ord_ == math.inf:
        part = torch.stack([l.abs().max() if l.numel() else torch.zeros(()) for l in locs])
        op = dist.ReduceOp.MAX
    elif ord_ == 0:
        part = torch.stack([(l != 0).sum().float() for l in locs]); op = dist.ReduceOp.SUM
    else:
        part = torch.stack([l.abs().pow(ord_).sum() for l in locs]); op = dist.ReduceOp.SUM
    if dist.is_initialized():
        dist.all_reduce(part, op=op)
    out = part if ord_ in (math.inf, 0) else part.pow(1.0 / ord_)
    out = out.to(tensors[0].dtype)
    return list(out.unbind()) if many else out[0]
