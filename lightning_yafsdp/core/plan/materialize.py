"""Materialize a meta-device model one flat group at a time, initialize it, and prove it.

A model built under ``torch.device("meta")`` has shapes but no values. ``shard_model``
turns it into real tensors one group at a time (a unit, the root remainder, the norm
group, then whatever is left), so no rank ever holds the whole unsharded model. For each
group, in this order:

1. **Allocate** every meta parameter and buffer the group owns on the target device
   (ties kept: a tensor shared by two modules becomes one real tensor).
2. **Load** the tensors a pretrained source provides (see ``TENSOR_SOURCE_ATTR``): they
   take exactly the saved values and are never initialized.
3. **Poison** the others: NaN for floating tensors, a sentinel for integer/bool ones.
4. **Initialize** them the way the model initializes itself, under a seed that is the
   same on every rank ([Note: init seed]): a user ``init_fn`` if given; otherwise
   ``reset_parameters()`` of each module that owns a fresh tensor, then the model
   family's own init, when a ``ModelFamilyInit`` is plugged in (``model_init=``): the
   core knows only torch's convention; Hugging Face's ``_init_weights`` and peft's LoRA
   reset live in ``lightning_yafsdp/hf_init.py``, which the strategies plug in ([Note:
   group-restricted HF init] there). The family's ``restricted_to`` context wraps every
   initialization of a group, the user's ``init_fn`` too.
5. **Check**: a floating tensor still holding a NaN, or an integer/bool tensor never
   written and still equal to the sentinel, was not initialized by anything; sharding
   stops with an error naming it and saying how to fix it ([Note: init guard]).

A model whose parameters are all real but whose non-persistent buffers are still meta (a
meta build loaded with ``load_state_dict(..., assign=True)``) goes through
``materialize_meta_buffers`` instead: steps 1, 3, 4 and 5 for those buffers only, and
nothing already real may change ([Note: meta buffers beside loaded parameters]).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed import ProcessGroup

from lightning_yafsdp.core.comm.collectives import CommStats, broadcast_
from lightning_yafsdp.core.plan.meta_build import init_parametrized_weights, value_from_constructor

# A module may carry, under this attribute of its ``__dict__``, a source of saved values
# for the meta tensors of the model (e.g. a safetensors checkpoint; see
# lightning_yafsdp.pretrained.SafetensorsSource): ``locate(meta_tensor)`` -> a handle or
# None, ``read(handle)`` -> the saved tensor, ``not_read()`` -> the names of what it
# holds that was never read, ``close()``.
TENSOR_SOURCE_ATTR = "_yafsdp_tensor_source"
_MAX_NAMED = 8
_META_FIX = (
    "Fix one of: define reset_parameters() on the module so that it sets them; "
    "define init_submodule(module) on the LightningModule or pass param_init_fn= "
    "(YaFSDPStrategy / shard_model); or build the model with real tensors (in "
    "__init__, or in configure_model under `with torch.device('cpu'):`) or load "
    "them (from_pretrained, load_state_dict)."
)
_META_BUFFER_FIX = (
    "Every parameter is real (loaded, e.g. load_state_dict(..., assign=True) after "
    "trainer.init_module(empty_init=True)) but these buffers are still on the meta device, "
    "and the engine re-initializes nothing beside loaded weights. Fix one of: give them "
    "their values after loading (a non-persistent buffer is in no state dict: e.g. "
    "`module.register_buffer(name, value, persistent=False)`, computed as the module's "
    "__init__ does); define reset_parameters() on a parameter-free module that owns them; "
    "or build the model with real tensors (trainer.init_module() without empty_init=True)."
)


@dataclass(frozen=True)
class ModuleTree:
    """A model's modules in post-order (children first) and each module's parents.

    A module reachable along two paths (shared across depth) appears once in
    ``post_order`` and lists every parent.
    """

    post_order: list[nn.Module]
    parents: dict[int, list[nn.Module]]

    @classmethod
    def of(cls, root: nn.Module) -> ModuleTree:
        return cls(*_post_order_and_parents(root))

    def with_ancestors(self, modules: list[nn.Module]) -> set[int]:
        """Ids of ``modules`` and of every ancestor of one."""
        visit = {id(m) for m in modules}
        stack = list(modules)
        while stack:
            for parent in self.parents.get(id(stack.pop()), ()):
                if id(parent) not in visit:
                    visit.add(id(parent))
                    stack.append(parent)
        return visit


class ModelFamilyInit(Protocol):
    """How a model family initializes its modules beyond torch's ``reset_parameters()``.

    The core is torch-only: a family whose modules are initialized by their model (Hugging
    Face's ``_init_weights``, peft's adapters) plugs this in through ``shard_model(...,
    model_init=factory)``; ``factory(root, tree)`` returns one for the model, or None.
    """

    def restricted_to(self, fresh: list[torch.Tensor]) -> AbstractContextManager[None]:
        """Context in which the family's init writes ``fresh`` and nothing else."""
        ...

    def initialize(self, owners: list[nn.Module], *, adapters: bool) -> None:
        """Run the family's init for ``owners`` (after their ``reset_parameters()``);
        ``adapters=False``: leave adapter layers alone (only buffers are fresh)."""
        ...

    def uninitialized_cause(self, module: nn.Module) -> str | None:
        """Why the family's init did not set a tensor of ``module`` (for the init guard)."""
        ...


ModelInitFactory = Callable[[nn.Module, ModuleTree], "ModelFamilyInit | None"]


class _TorchOnly:
    """No model family: ``reset_parameters()`` (or the user's ``init_fn``) only."""

    def restricted_to(self, fresh: list[torch.Tensor]) -> AbstractContextManager[None]:
        return nullcontext()

    def initialize(self, owners: list[nn.Module], *, adapters: bool) -> None:
        return None

    def uninitialized_cause(self, module: nn.Module) -> str | None:
        return None


def draw_init_seed(group: ProcessGroup, device: torch.device, *, stats: CommStats) -> int:
    """One seed for meta-device initialization, equal on every rank of ``group``.

    [Note: init seed] Every rank draws from its own default generator (so every rank
    consumes the same amount of randomness and ``seed_everything`` makes runs
    reproducible) and then takes rank 0's draw: ranks that were not seeded alike still
    initialize identically. Group ``i`` is initialized under ``seed + i``, so the
    weights depend neither on the rank nor on the world size.
    """
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(device)
    broadcast_(seed, group, src_rank=0, stats=stats)
    return int(seed.item())


class Materializer:
    """Materializes, loads or initializes, and checks a meta-device model group by group.

    Args:
        root: the whole model being sharded (still holding its meta tensors).
        device: where the real tensors go.
        init_fn: the user's init function, called on each unit module and on each
            other module that owns a fresh tensor; ``None``: the model's own scheme
            (``reset_parameters``, then the family's init from ``model_init``).
        seed: the base seed (``draw_init_seed``).
        model_init: the model family's init (``ModelInitFactory``; None: torch only).
    """

    def __init__(
        self,
        root: nn.Module,
        *,
        device: torch.device,
        init_fn: Callable[[nn.Module], None] | None,
        seed: int,
        model_init: ModelInitFactory | None = None,
    ) -> None:
        self.root = root
        self.device = device
        self.init_fn = init_fn
        self.seed = seed
        self._groups_done = 0
        # A unit's modules: one block, or consecutive blocks ([Note: grouped blocks]).
        self._unit_modules_of: dict[str, list[nn.Module]] = {}
        self._real_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._constructed: dict[int, torch.Tensor] = {}  # id(real tensor) -> its value
        self._module_names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
        self._tree = ModuleTree.of(root)
        family = model_init(root, self._tree) if model_init is not None else None
        self._family: ModelFamilyInit = family if family is not None else _TorchOnly()
        self._sources = _tensor_sources(root)
        # By (module, attribute), which outlives the tensor objects: sharding re-registers
        # frozen parameters as buffers (new tensors) under the same module and name.
        self._saved = _saved_locations(root, self._sources)

    # -- what shard_model calls -------------------------------------------------------

    def assign_unit_modules(self, unit_specs, unit_modules) -> None:
        for spec, (_, modules) in zip(unit_specs, unit_modules, strict=True):
            self._unit_modules_of[spec.name] = list(modules)

    def materialize(self, spec) -> None:
        """Give one flat group real, initialized tensors (``spec.params`` is updated)."""
        unit_modules = self._unit_modules_of.get(spec.name, [])
        every_owner = [*spec.owners, *spec.frozen_owners]
        owner_modules = _unique([owner.module for owners in every_owner for owner in owners])
        fresh = []
        for unit_module in unit_modules:
            fresh += self._allocate(list(unit_module.modules()))
        fresh += self._allocate(owner_modules)
        targets = list(unit_modules)
        targets += [m for m in owner_modules if not any(_inside(m, u) for u in unit_modules)]
        self._initialize(fresh, targets)
        # Allocation replaced the Parameter objects: the group holds the new ones.
        spec.params = [owners[0].module._parameters[owners[0].attr] for owners in spec.owners]
        spec.frozen_params = [
            owners[0].module._parameters[owners[0].attr] for owners in spec.frozen_owners
        ]

    def release(self, spec) -> None:
        # The group now lives in the master shard (and the frozen store): drop its
        # full-size tensors at once.
        for param in (*spec.params, *spec.frozen_params):
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def materialize_rest(self, root: nn.Module) -> None:
        """Materialize what no group owns: buffers, frozen parameters (one more group)."""
        modules = [
            sub
            for sub in root.modules()
            if any(t is not None and t.is_meta for t in _own_tensors(sub))
        ]
        fresh = self._allocate(modules)
        self._initialize(fresh, modules)
        for module, source in self._sources:
            # Every tensor is loaded: let the checkpoint files go.
            module.__dict__.pop(TENSOR_SOURCE_ATTR, None)
            source.close()
            lost = source.not_read()
            if lost:
                raise RuntimeError(
                    f"{len(lost)} tensors of the pretrained checkpoint were never loaded "
                    f"(e.g. {lost[:3]}): the model built by from_pretrained in configure_model "
                    "was changed afterwards so that these tensors were replaced (e.g. "
                    "resize_token_embeddings, a re-created layer). Load it with real tensors "
                    "instead: `with torch.device('cpu'): model = ...from_pretrained(...)` in "
                    "configure_model, or build it in __init__."
                )

    def materialize_meta_buffers(self) -> None:
        """Re-derive the meta buffers of a model whose parameters are all real.

        [Note: meta buffers beside loaded parameters] ``trainer.init_module(empty_init=True)``
        builds on meta; ``load_state_dict(sd, assign=True)`` then makes every parameter and
        persistent buffer real, but a non-persistent buffer (HF rotary ``inv_freq``, CLIP's
        ``position_ids``) is in no state dict and stays meta. Each is computed as the model
        computes it: the model family's init restricted to these buffers (for Hugging Face
        models ``_init_weights``, [Note: group-restricted HF init] in ``hf_init.py``; adapter
        layers left alone), and ``reset_parameters()`` only of an owner that
        holds no parameter (on any other it would overwrite loaded weights). The init guard
        checks every buffer got a value, and a real tensor whose version counter moved (it
        was written) stops with an error: loaded values are never changed.
        """
        modules = [
            sub
            for sub in self.root.modules()
            if any(b is not None and b.is_meta for b in sub._buffers.values())
        ]
        if not modules:
            return
        real_before = _real_tensor_versions(self.root)
        fresh = self._take_constructed(self._allocate(modules))
        versions = [_poison(t) for _, _, t in fresh]
        tensors = [t for _, _, t in fresh]
        owners = _unique([m for m, _, _ in fresh])
        with torch.no_grad(), _seeded(self.device, self.seed):
            with self._family.restricted_to(tensors):
                self._reset_parameters_of([m for m in owners if next(m.parameters(), None) is None])
                self._family.initialize(owners, adapters=False)
        _check_unchanged(real_before)
        self._check(fresh, versions, fix=_META_BUFFER_FIX)

    # -- steps ------------------------------------------------------------------------

    def _allocate(self, modules: list[nn.Module]) -> list[tuple[nn.Module, str, torch.Tensor]]:
        fresh = []
        for module in _unique(modules):
            for table in (module._parameters, module._buffers):
                for attr, tensor in table.items():
                    if tensor is None or not tensor.is_meta:
                        continue
                    real, is_new = self._real_tensor(tensor)
                    table[attr] = real
                    if is_new:
                        fresh.append((module, attr, real))
        return fresh

    def _real_tensor(self, meta: torch.Tensor) -> tuple[torch.Tensor, bool]:
        known = self._real_of.get(id(meta))
        if known is not None:
            return known[1], False
        data = torch.empty_like(meta, device=self.device)
        real = type(meta)(data, meta.requires_grad) if isinstance(meta, nn.Parameter) else data
        self._real_of[id(meta)] = (meta, real)  # the meta tensor is kept so its id stays unique
        value = value_from_constructor(meta)
        if value is not None:
            self._constructed[id(real)] = value
        return real, True

    def _take_constructed(self, fresh):
        """Give tensors the constructor made from Python data that value ([Note: constructor
        values in meta builds]); the rest, still to initialize."""
        rest = []
        for module, attr, tensor in fresh:
            value = self._constructed.pop(id(tensor), None)
            if value is None:
                rest.append((module, attr, tensor))
                continue
            with torch.no_grad():
                tensor.copy_(value)
        return rest

    def _initialize(self, fresh, targets: list[nn.Module]) -> None:
        unloaded = [(m, a, t) for m, a, t in fresh if not self._load(m, a, t)]
        to_init = self._take_constructed(unloaded)
        if not to_init:
            self._groups_done += 1
            return
        versions = [_poison(t) for _, _, t in to_init]
        tensors = [t for _, _, t in to_init]
        owners = _unique([m for m, _, _ in to_init])
        with torch.no_grad(), _seeded(self.device, self.seed + self._groups_done):
            with self._family.restricted_to(tensors):
                if self.init_fn is None:
                    self._default_init(owners)
                else:
                    # Only where something needs it: loaded tensors are never re-initialized.
                    for module in targets:
                        if any(_inside(owner, module) for owner in owners):
                            self.init_fn(module)
        self._groups_done += 1
        self._check(to_init, versions)

    def _load(self, module: nn.Module, attr: str, tensor: torch.Tensor) -> bool:
        saved = self._saved.get((id(module), attr))
        if saved is None:
            return False
        source, where = saved
        _copy_saved(tensor, source.read(where), self._slot_name(module, attr))
        return True

    def _slot_name(self, module: nn.Module, attr: str) -> str:
        module_name = self._module_names.get(id(module), "")
        return f"{module_name}.{attr}" if module_name else attr

    def _default_init(self, owners: list[nn.Module]) -> None:
        self._reset_parameters_of(owners)
        self._family.initialize(owners, adapters=True)

    def _reset_parameters_of(self, owners: list[nn.Module]) -> None:
        owner_ids = {id(m) for m in owners}
        for module in self._tree.post_order:
            lists = module._modules.get("parametrizations")
            if lists is not None and any(id(p) in owner_ids for p in lists.values()):
                # [Note: constructor values in meta builds] (meta_build.py), kind 3.
                if init_parametrized_weights(module):
                    continue
            if id(module) in owner_ids:
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()

    def _check(self, initialized, versions: list[int], *, fix: str = _META_FIX) -> None:
        untouched = [
            item
            for item, version in zip(initialized, versions, strict=True)
            if _still_poisoned(item[2], version) and not _buffer_replaced(*item)
        ]
        if untouched:
            raise RuntimeError(self._uninitialized_message(untouched, fix=fix))

    def _uninitialized_message(self, untouched, *, fix: str) -> str:
        lines = [f"  {self._describe(module, attr, t)}" for module, attr, t in untouched]
        if len(lines) > _MAX_NAMED:
            lines = [*lines[:_MAX_NAMED], f"  ... and {len(lines) - _MAX_NAMED} more"]
        return (
            "meta-device initialization left these tensors uninitialized (they still hold "
            "the NaN/sentinel the engine filled them with; training would read garbage):\n"
            + "\n".join(lines)
            + "\n"
            + fix
        )

    def _describe(self, module: nn.Module, attr: str, tensor: torch.Tensor) -> str:
        cls = type(module).__name__
        kind = "parameter" if attr in module._parameters else "buffer"
        if self.init_fn is not None:
            init_name = getattr(self.init_fn, "__qualname__", repr(self.init_fn))
            cause = f"the init function {init_name} does not set it"
        elif callable(getattr(module, "reset_parameters", None)):
            cause = f"{cls}.reset_parameters() does not set it"
        else:
            cause = f"{cls} has no reset_parameters()"
        family_cause = self._family.uninitialized_cause(module) if self.init_fn is None else None
        if family_cause:
            cause += f" and {family_cause}"
        elif isinstance(self._family, _TorchOnly) and _from_a_model_family(module):
            cause += (
                f" ({type(module).__module__} initializes through its model: pass "
                "model_init=lightning_yafsdp.hf_init.hf_model_init to shard_model, as the "
                "strategies do)"
            )
        if kind == "buffer" and attr in module._non_persistent_buffers_set:
            cause += (
                "; it is a non-persistent buffer, computed in __init__ (which ran on the meta "
                "device) and saved in no checkpoint, so nothing re-derives it"
            )
        return (
            f"{self._slot_name(module, attr)} ({kind} of module "
            f"'{self._module_names.get(id(module)) or '<root>'}' ({cls}), shape "
            f"{tuple(tensor.shape)}, {tensor.dtype}): {cause}"
        )


# -- helpers -------------------------------------------------------------------------------


def _post_order_and_parents(root: nn.Module):
    order: list[nn.Module] = []
    parents: dict[int, list[nn.Module]] = {}
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        seen.add(id(module))
        for child in module.children():
            parents.setdefault(id(child), [])
            if all(p is not module for p in parents[id(child)]):
                parents[id(child)].append(module)
            if id(child) not in seen:
                visit(child)
        order.append(module)

    visit(root)
    return order, parents


def _tensor_sources(root: nn.Module) -> list[tuple[nn.Module, object]]:
    sources = []
    for module in root.modules():
        source = module.__dict__.get(TENSOR_SOURCE_ATTR)
        if source is not None:
            sources.append((module, source))
    return sources


def _saved_locations(root: nn.Module, sources) -> dict[tuple[int, str], tuple[object, object]]:
    saved = {}
    if not sources:
        return saved
    for module in root.modules():
        for table in (module._parameters, module._buffers):
            for attr, tensor in table.items():
                for _, source in sources:
                    where = source.locate(tensor) if tensor is not None else None
                    if where is not None:
                        saved[(id(module), attr)] = (source, where)
                        break
    return saved


def _copy_saved(tensor: torch.Tensor, saved: torch.Tensor, name: str) -> None:
    if tuple(saved.shape) != tuple(tensor.shape):
        raise ValueError(
            f"the pretrained checkpoint holds {name} with shape {tuple(saved.shape)} but the "
            f"model built from its config has {tuple(tensor.shape)}; the checkpoint does not "
            "belong to this model class/config"
        )
    with torch.no_grad():
        tensor.copy_(saved)


def _real_tensor_versions(root: nn.Module) -> list[tuple[str, torch.Tensor, int]]:
    named = [*root.named_parameters(), *root.named_buffers()]
    return [(name, t, t._version) for name, t in named if not t.is_meta]


def _check_unchanged(real_before: list[tuple[str, torch.Tensor, int]]) -> None:
    written = [name for name, tensor, version in real_before if tensor._version != version]
    if written:
        raise RuntimeError(
            f"re-deriving the meta-device buffers wrote {len(written)} tensors that were "
            f"already real (e.g. {written[:3]}), i.e. loaded weights; the model's init code "
            "writes them without honouring `_is_hf_initialized`. Build the model with real "
            "tensors (trainer.init_module() without empty_init=True), or give the meta "
            "buffers their values yourself after load_state_dict."
        )


def _own_tensors(module: nn.Module) -> list[torch.Tensor | None]:
    return [*module._parameters.values(), *module._buffers.values()]


def _unique(modules: list[nn.Module]) -> list[nn.Module]:
    seen: set[int] = set()
    return [m for m in modules if not (id(m) in seen or seen.add(id(m)))]


def _inside(module: nn.Module, container: nn.Module) -> bool:
    return any(sub is module for sub in container.modules())


# [Note: init guard] Floating tensors are filled with NaN and must hold none afterwards.
# Integer and bool tensors cannot hold NaN: they are filled with a sentinel, and fail only
# if they still equal it everywhere AND their version counter did not move (so a buffer
# legitimately written with those values still passes).
def _sentinel(dtype: torch.dtype):
    if dtype == torch.bool:
        return True
    info = torch.iinfo(dtype)
    return info.min if info.min < 0 else info.max


def _poison(tensor: torch.Tensor) -> int:
    with torch.no_grad():
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.fill_(float("nan"))
        else:
            tensor.fill_(_sentinel(tensor.dtype))
    return tensor._version


def _buffer_replaced(module: nn.Module, attr: str, allocated: torch.Tensor) -> bool:
    """The init code assigned a new real tensor to the buffer instead of writing into it.

    litgpt's ``GPT.reset_parameters`` does ``self.cos, self.sin = self.rope_cache(...)``:
    the buffer is set, just not in place. (A parameter must be written in place: the
    group has already taken the allocated one.)
    """
    now = module._buffers.get(attr) if attr in module._buffers else None
    return now is not None and now is not allocated and not now.is_meta


def _still_poisoned(tensor: torch.Tensor, version: int) -> bool:
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).any())
    if tensor._version != version:
        return False
    return bool((tensor == _sentinel(tensor.dtype)).all())


@contextmanager
def _seeded(device: torch.device, seed: int) -> Iterator[None]:
    # Forked: the caller's RNG state is the same after sharding as before it.
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device.index or 0] if cuda else []):
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


def _from_a_model_family(module: nn.Module) -> bool:
    # Read from the class's module name only: the core imports no model library.
    return type(module).__module__.split(".")[0] in ("transformers", "peft")
