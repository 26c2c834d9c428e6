"""How Hugging Face models (and peft's LoRA adapters) initialize, for meta-device builds.

The core materializes a meta-built model one flat group at a time and initializes each
group with torch's convention, ``reset_parameters()`` (``core/plan/materialize.py``).
Hugging Face modules mostly have none: ``PreTrainedModel._init_weights`` initializes them
from the model, and peft resets its adapters after the model's init. This module is that
knowledge, plugged into the core through ``shard_model(..., model_init=hf_model_init)``;
both strategies pass it (``adapters/sharding.py``). It imports neither transformers nor
peft: a model built from them has loaded them already, and nothing else needs them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn

from lightning_yafsdp.core.plan.materialize import ModuleTree

_HF_FLAG = "_is_hf_initialized"


def hf_model_init(root: nn.Module, tree: ModuleTree) -> HuggingFaceInit | None:
    """The Hugging Face family init for ``root``; None when transformers is not loaded
    and ``root`` holds no peft LoRA layer (a plain torch model)."""
    pretrained_class = _loaded_class("transformers.modeling_utils", "PreTrainedModel")
    lora_layer_class = _loaded_class("peft.tuners.lora.layer", "LoraLayer")
    if pretrained_class is None and lora_layer_class is None:
        return None
    return HuggingFaceInit(root, tree, pretrained_class, lora_layer_class)


class HuggingFaceInit:
    """``_init_weights`` of each module's Hugging Face model, restricted to a group.

    One per model (``hf_model_init``); follows ``core.plan.materialize.ModelFamilyInit``.
    """

    def __init__(self, root: nn.Module, tree: ModuleTree, pretrained_class, lora_class) -> None:
        self.root = root
        self.tree = tree
        self._flags_tensors = pretrained_class is not None
        self._hf_owner = _hf_owners(root, pretrained_class) if pretrained_class else {}
        self._lora_layers, self._adapter_modules = _lora_layers(root, tree, lora_class)
        self._module_names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}

    def restricted_to(self, fresh: list[torch.Tensor]) -> AbstractContextManager[None]:
        return _restricted(self.root, fresh, flag=self._flags_tensors)

    def initialize(self, owners: list[nn.Module], *, adapters: bool) -> None:
        """``_init_weights`` on the owners and all their ancestors, in post-order (children
        before parents, as ``PreTrainedModel.initialize_weights`` does); then, with
        ``adapters``, the LoRA layers among them reset their adapters."""
        visit = self.tree.with_ancestors(owners)
        for module in self.tree.post_order:
            hf_model = self._hf_owner.get(id(module))
            # PEFT adds its adapters after the model's own init: they never see _init_weights.
            if (
                id(module) in visit
                and hf_model is not None
                and id(module) not in self._adapter_modules
            ):
                hf_model._init_weights(module)
        if not adapters:
            return
        for layer, configs in self._lora_layers:
            if id(layer) in visit:
                _reset_lora_adapters(layer, configs, self._module_names.get(id(layer), "?"))

    def uninitialized_cause(self, module: nn.Module) -> str | None:
        hf_model = self._hf_owner.get(id(module))
        if hf_model is None:
            return None
        return f"{type(hf_model).__name__}._init_weights does not set it either"


def _loaded_class(module_name: str, class_name: str):
    # Only a model built from the library can need its init, and then it is imported.
    return getattr(sys.modules.get(module_name), class_name, None)


def _hf_owners(root: nn.Module, pretrained_class) -> dict[int, nn.Module]:
    """Each module's nearest Hugging Face PreTrainedModel (itself or an ancestor)."""
    owners: dict[int, nn.Module] = {}

    def visit(module: nn.Module, current: nn.Module | None) -> None:
        if isinstance(module, pretrained_class):
            current = module
        if id(module) in owners:
            return
        if current is not None:
            owners[id(module)] = current
        for child in module.children():
            visit(child, current)

    visit(root, None)
    return owners


def _lora_layers(root: nn.Module, tree: ModuleTree, lora_layer_class) -> tuple[list, set[int]]:
    """PEFT LoRA layers with their adapters' configs, and the ids of the adapter modules."""
    if lora_layer_class is None:
        return [], set()
    layers, adapter_modules = [], set()
    for module in root.modules():
        if not isinstance(module, lora_layer_class):
            continue
        layers.append((module, _nearest_peft_config(module, tree.parents)))
        for name, child in module.named_children():
            if name != "base_layer":
                adapter_modules.update(id(sub) for sub in child.modules())
    return layers, adapter_modules


def _nearest_peft_config(module: nn.Module, parents) -> dict:
    pending, seen = [module], set()
    while pending:
        current = pending.pop()
        config = getattr(current, "peft_config", None)
        if isinstance(config, dict):
            return config
        seen.add(id(current))
        pending += [p for p in parents.get(id(current), ()) if id(p) not in seen]
    return {}


def _reset_lora_adapters(layer: nn.Module, configs: dict, name: str) -> None:
    # As peft's LoraLayer.update_layer does at construction, for the inits that need no data.
    for adapter in [*layer.lora_A.keys(), *layer.lora_embedding_A.keys()]:
        config = configs.get(adapter)
        init = getattr(config, "init_lora_weights", True)
        if isinstance(init, str) and init.lower() != "gaussian":
            raise ValueError(
                f"LoRA adapter {adapter!r} of '{name}' uses init_lora_weights={init!r}, which "
                "computes the adapter from the base weights (or data) when the adapter is "
                "created; on the meta device there are none. Apply the adapter to a model "
                "with real weights (e.g. `with torch.device('cpu'):` around from_pretrained "
                "and get_peft_model in configure_model)."
            )
        layer.reset_lora_parameters(adapter, init)


def _torch_init_guard() -> AbstractContextManager[None]:
    initialization = sys.modules.get("transformers.initialization")
    guard = getattr(initialization, "guard_torch_init_functions", None)
    return guard() if guard is not None else nullcontext()


@contextmanager
def _restricted(root: nn.Module, fresh: list[torch.Tensor], *, flag: bool) -> Iterator[None]:
    with _torch_init_guard():
        if not flag:
            yield
            return
        with _others_flagged_initialized(root, fresh):
            yield


@contextmanager
def _others_flagged_initialized(root: nn.Module, fresh: list[torch.Tensor]) -> Iterator[None]:
    """[Note: group-restricted HF init] Mark every tensor but ``fresh`` as initialized.

    transformers' init functions (and torch's, under ``guard_torch_init_functions``)
    skip tensors whose ``_is_hf_initialized`` is set, so an ancestor's ``_init_weights``
    (T5's root initializes ``shared``; GPT-2's attention rescales ``c_proj``) writes
    only this group's tensors and draws no random numbers for the others.
    """
    fresh_ids = {id(t) for t in fresh}
    previous: dict[int, tuple[torch.Tensor, object]] = {}
    missing = object()
    for tensor in _all_tensors(root):
        if id(tensor) in previous:
            continue
        previous[id(tensor)] = (tensor, getattr(tensor, _HF_FLAG, missing))
        setattr(tensor, _HF_FLAG, id(tensor) not in fresh_ids)
    try:
        yield
    finally:
        for tensor, flag in previous.values():
            if flag is missing:
                delattr(tensor, _HF_FLAG)
            else:
                setattr(tensor, _HF_FLAG, flag)


def _all_tensors(root: nn.Module) -> Iterator[torch.Tensor]:
    for module in root.modules():
        yield from (t for t in _own_tensors(module) if t is not None)
        # Sharded groups' placeholders are plain tensor attributes once rewired.
        yield from (v for v in vars(module).values() if isinstance(v, torch.Tensor))


def _own_tensors(module: nn.Module) -> list[torch.Tensor | None]:
    return [*module._parameters.values(), *module._buffers.values()]
