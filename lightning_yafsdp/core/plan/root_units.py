"""Which parameters outside the blocks become units of their own (embeddings, heads).

[Note: root units]
Parameters outside every block (the "root remainder": token embeddings, the
output head, position embeddings, poolers) used to form one resident group:
gathered once per optimizer step and kept, with a full-size grad buffer, for
the whole step. At Llama-3-70B (vocab 128k) that is ~12.7 GB per GPU whatever
the world size. Now the large ones are units like the blocks: gathered before
their module's forward into the shared weight buffers, released after it,
re-gathered for their backward, reduce-scattered right after it.

A *root block* is the topmost module on a parameter's path that contains no block and
has a forward of its own (a ``ModuleList`` is never called: its parent calls its
children, so the root block is the child on the path): for ``model.embed_tokens.weight``
it is ``model.embed_tokens`` (``model`` contains the layers); for ``lm_head.weight``,
``lm_head``. Hooks on it see every read of its parameters that happens inside its own
forward, a parent reading a child's weight included (CLIP's text embeddings). A tensor
tied across root blocks (a GPT-2 / T5 style tied embedding and head) joins them into one
unit with several modules, called several times per forward, whose grads add up in its
grad buffer between calls (the state machine's multi-call path).

What stays resident: parameters owned by the root or by a module that contains
blocks (ViT's ``cls_token`` on the root; nothing hooks a read of those before
the blocks run), and root blocks smaller than ``1/8`` of the largest block:
they cost little resident (their full weights and grads are < 1/8 of one
buffer), and keeping them there keeps models that read a small embedding's
weight outside its forward (DeBERTa's relative positions, read by the encoder)
working. A root unit's parameters read outside its modules' forwards are
sharded tensors there, which refuse to compute (an error naming
``summon_full_params``) rather than compute with another unit's weights.
"""

from __future__ import annotations

from torch import nn

from lightning_yafsdp.core.plan.group_spec import GroupSpec
from lightning_yafsdp.core.plan.policy import has_own_forward

# A root block smaller than this fraction of the largest block stays resident.
ROOT_UNIT_MIN_FRACTION = 1 / 8


def split_root(
    root: nn.Module, unit_modules: list[tuple[str, nn.Module]], root_spec: GroupSpec
) -> tuple[list[GroupSpec], GroupSpec]:
    """Split the root remainder into root units and what stays resident.

    Returns the root units (each with its ``modules``, ``is_block=False``, and its
    frozen parameters) and a spec of the trainable parameters that stay in the
    resident root group, both in the order of ``root_spec``.
    """
    by_name = dict(root.named_modules(remove_duplicate=False))
    holds_block = _modules_holding_blocks(by_name, unit_modules)
    entries = [
        *zip(root_spec.params, root_spec.owners, strict=True),
        *zip(root_spec.frozen_params, root_spec.frozen_owners, strict=True),
    ]
    components = _TiedComponents()
    homes: list[list[nn.Module] | None] = []
    for _, owners in entries:
        blocks = [_root_block(owner.name, by_name, holds_block) for owner in owners]
        if any(block is None for block in blocks):
            homes.append(None)
            continue
        components.join(blocks)
        homes.append(blocks)

    order = {id(m): i for i, (_, m) in enumerate(root.named_modules())}
    names = {id(m): n for n, m in reversed(list(root.named_modules(remove_duplicate=False)))}
    units: dict[int, GroupSpec] = {}
    for (param, owners), blocks in zip(entries, homes, strict=True):
        if blocks is None:
            continue
        key = components.find(id(blocks[0]))
        if key not in units:
            modules = sorted(components.members(key), key=lambda m: order[id(m)])
            name = "+".join(names[id(m)] for m in modules)
            units[key] = GroupSpec(name, modules=modules, is_block=False)
        units[key].add(param, owners)

    largest_block = max((_numel(m) for _, m in unit_modules), default=0)
    kept = [u for u in units.values() if u.numel() >= largest_block * ROOT_UNIT_MIN_FRACTION]
    in_units = {id(p) for spec in kept for p in spec.params}
    resident = GroupSpec(root_spec.name)
    for param, owners in zip(root_spec.params, root_spec.owners, strict=True):
        if id(param) not in in_units:
            resident.add(param, owners)
    # Frozen root parameters outside the kept units stay plain, replicated parameters.
    return kept, resident


def _modules_holding_blocks(by_name: dict[str, nn.Module], unit_modules) -> set[int]:
    """Ids of the root, every block and every ancestor of a block."""
    holding = {id(by_name[""])}
    for unit_name, _ in unit_modules:
        parts = unit_name.split(".")
        for i in range(len(parts)):
            holding.add(id(by_name[".".join(parts[: i + 1])]))
    return holding


def _root_block(param_name: str, by_name, holds_block: set[int]) -> nn.Module | None:
    """The topmost module on the path of ``param_name`` that contains no block and is
    called: a container without a forward (``nn.ModuleList``) is passed over for the
    child on the path, since its parent calls that child directly."""
    parts = param_name.split(".")[:-1]
    for i in range(len(parts)):
        module = by_name[".".join(parts[: i + 1])]
        if id(module) not in holds_block and has_own_forward(module):
            return module
    return None  # owned by the root, by an ancestor of the blocks, or by a container


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class _TiedComponents:
    """Union-find over root blocks: blocks sharing a tied tensor form one unit."""

    def __init__(self) -> None:
        self._parent: dict[int, int] = {}
        self._module: dict[int, nn.Module] = {}

    def join(self, modules: list[nn.Module]) -> None:
        for module in modules:
            self._module.setdefault(id(module), module)
            self._parent.setdefault(id(module), id(module))
        first = self.find(id(modules[0]))
        for module in modules[1:]:
            self._parent[self.find(id(module))] = first

    def find(self, key: int) -> int:
        while self._parent[key] != key:
            self._parent[key] = self._parent[self._parent[key]]
            key = self._parent[key]
        return key

    def members(self, root_key: int) -> list[nn.Module]:
        return [m for key, m in self._module.items() if self.find(key) == root_key]
