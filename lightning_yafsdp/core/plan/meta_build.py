"""What a meta-device build keeps of its constructor: constants, small draws, weight norms.

[Note: constructor values in meta builds]
A model built under ``torch.device("meta")`` has shapes but no values; the engine then
initializes every tensor by the model's own init scheme (``reset_parameters()``, the
family's ``_init_weights``). Some values come from no init scheme, only from the
constructor itself, and three kinds are common enough to keep:

1. **Constants from Python data**: ``nn.Parameter(torch.tensor(config.logit_scale_init))``
   (CLIP). Under ``meta_device()`` a tensor made from Python data (``torch.tensor``,
   ``torch.as_tensor``) stays on the meta device (the constructor's arithmetic with other
   meta tensors works as before) and its value is computed on the CPU beside it; the
   materializer gives the real tensor that value instead of an init (it is never an init
   draw, and the same on every rank).
2. **Small tensors the constructor made real anyway**: the legacy ``torch.Tensor(n)``
   ignores the device context (wav2vec2's ``masked_spec_embed``, ``.uniform_()`` in
   ``__init__``). ``meta_device()`` remembers the small real tensors made inside it, and
   those are accepted in a meta build; rank 0's value is broadcast so that
   every rank starts from the same draw. Any other real tensor beside meta ones is still
   refused (a half-loaded model, a module built in ``__init__``).
3. **Weight-norm parametrizations** (``nn.utils.parametrizations.weight_norm``, wav2vec2's
   positional convolution): the parameters are the originals ``g`` and ``v``; the module's
   ``reset_parameters()`` writes a *computed* weight, which changes neither, so they would
   stay uninitialized. ``init_parametrized_weights`` initializes a plain weight of the
   same shape by the module's own ``reset_parameters()`` and assigns it, which
   parametrize turns into originals through the parametrization's ``right_inverse``
   (``g = ||w||``, ``v = w``): exactly what the constructor did to its eager weight.
Anything else the constructor computes stays refused by the init guard, with the fix.

The registries of kinds 1 and 2 are read only while ``shard_model`` plans, checks,
broadcasts and materializes (``constructor_values``, ``value_from_constructor``). They
hold weak references to the storages they describe (``StorageWeakRef``, keyed by the
storage's identity, which ``nn.Parameter(t)`` shares): a registry entry never keeps a
tensor alive, and an entry whose storage is gone (the module was sharded, or the
constructor's temporary was dropped) is stale. Every ``shard_model`` and every
``meta_device()`` prunes stale entries first (``prune_constructor_values``), so beyond
the values of modules not sharded yet (two models built in one context may share a
constant: sharding one keeps the other's) the process keeps at most the small CPU
values of the last sharded module's constants, until the next build or sharding. A weak
reference also pins its storage's identity, so a key is never reused while its entry
exists.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode

# A real tensor of at most this many elements made inside ``meta_device()`` is a
# constructor value; larger ones are not kept (a constructor's value is a constant or a
# small draw, and a large one would cost its memory on every rank until setup).
CONSTRUCTOR_VALUE_MAX_NUMEL = 1 << 16
_FROM_DATA = (torch.tensor, torch.as_tensor)
# The storages of the small real tensors made under meta_device() (kind 2), and of the
# meta tensors made from Python data with their CPU values (kind 1); keyed by the
# storage's identity, weakly held (see the note).
_made_under_meta: dict[int, StorageWeakRef] = {}
_values_of_meta: dict[int, tuple[StorageWeakRef, torch.Tensor]] = {}


class _ConstructorData(TorchFunctionMode):
    """Remembers what a meta build's constructor computed (kinds 1 and 2 of the note).

    Tensors made from Python data stay on the meta device, so the constructor's own
    arithmetic with other meta tensors works as before; their values are computed on the
    CPU beside them. Small real tensors made here (the legacy ``torch.Tensor(n)``) are
    remembered as they are.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not isinstance(result, torch.Tensor) or result.numel() > CONSTRUCTOR_VALUE_MAX_NUMEL:
            return result
        storage = result.untyped_storage()
        if result.device.type != "meta":
            if result.numel():
                _made_under_meta[storage._cdata] = StorageWeakRef(storage)
        elif func in _FROM_DATA and kwargs.get("device") is None:
            value = func(*args, **{**kwargs, "device": "cpu"})
            _values_of_meta[storage._cdata] = (StorageWeakRef(storage), value)
        return result


@contextmanager
def meta_device() -> Iterator[None]:
    """``torch.device("meta")`` that keeps constructor values (see the note)."""
    prune_constructor_values()
    with torch.device("meta"), _ConstructorData():
        yield


def value_from_constructor(meta: torch.Tensor) -> torch.Tensor | None:
    """The value a meta tensor was made with from Python data (kind 1), or None."""
    known = _values_of_meta.get(meta.untyped_storage()._cdata)
    return None if known is None else known[1]


def constructor_values(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The real parameters of a meta build that its constructor made (kind 2).

    Empty unless the module also holds meta parameters. Real parameters made elsewhere
    (built in ``__init__``, loaded with ``assign=True``) are not constructor values.
    """
    params = list(module.named_parameters())
    if not any(p.is_meta for _, p in params):
        return []
    return [
        (name, p)
        for name, p in params
        if not p.is_meta and p.numel() and p.untyped_storage()._cdata in _made_under_meta
    ]


def prune_constructor_values() -> None:
    """Drop the entries whose storage is gone (a sharded module's, a dropped temporary's)."""
    for key in [k for k, ref in _made_under_meta.items() if ref.expired()]:
        del _made_under_meta[key]
    for key in [k for k, (ref, _) in _values_of_meta.items() if ref.expired()]:
        del _values_of_meta[key]


def init_parametrized_weights(module: nn.Module) -> bool:
    """Initialize the originals of ``module``'s parametrized tensors by its own
    ``reset_parameters()`` (kind 3 of the note); False if it has none or no reset."""
    if not parametrize.is_parametrized(module) or not callable(
        getattr(module, "reset_parameters", None)
    ):
        return False
    # A shallow twin of the module's own class (parametrize subclassed it and refuses
    # copy.copy): the same attributes and parameters, a plain tensor for each weight.
    plain = object.__new__(type(module).__bases__[0])
    plain.__dict__ = dict(module.__dict__)
    plain._modules = {k: v for k, v in module._modules.items() if k != "parametrizations"}
    plain._parameters = dict(module._parameters)
    names = list(module.parametrizations.keys())
    for name in names:
        computed = getattr(module, name)
        plain._parameters[name] = nn.Parameter(torch.empty_like(computed))
    plain.reset_parameters()
    with torch.no_grad():
        for name in names:
            setattr(module, name, plain._parameters[name].detach())
    return True
