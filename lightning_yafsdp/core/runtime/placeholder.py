"""``UngatheredWeight``: a root unit's weight attribute while the unit is not gathered.

[Note: ungathered weights]
A root unit (an embedding, the output head: [Note: root units]) is gathered only
around its module's forward and backward. Its parent's forward often reads the
weight's METADATA before calling it: our Llama casts the final hidden state to
``self.output.weight.dtype``, Hugging Face code reads ``.dtype`` / ``.device`` /
``.shape``. The sharded parameter would answer with the master dtype (fp32 under
bf16-mixed), which is wrong for the forward. So while a forward is under way the
attribute is an ``UngatheredWeight``: a storage-less tensor with the gathered
weight's shape, compute dtype and device, which refuses every operation on its
values with an error that names the weight and the fix (a read of values there
would otherwise compute with whatever unit the shared buffer holds).
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree


class UngatheredWeight(torch.Tensor):
    """Shape, dtype and device of a gathered weight; every op on it raises.

    Args:
        name: the parameter's name.
        unit: the name of the root unit it belongs to.
        shape / dtype / device: what the gathered weight will be.
    """

    @staticmethod
    def __new__(cls, name: str, unit: str, shape, dtype: torch.dtype, device: torch.device):
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device, requires_grad=False
        )
        tensor._name = name
        tensor._unit = unit
        return tensor

    def __repr__(self) -> str:  # noqa: D105
        return f"UngatheredWeight({self._name}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def __deepcopy__(self, memo: dict) -> UngatheredWeight:
        # Metadata only, never written: a deep copy of the model (an EMA) may share it.
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        leaves = pytree.tree_leaves((args, kwargs or {}))
        weight = next(leaf for leaf in leaves if isinstance(leaf, UngatheredWeight))
        raise RuntimeError(
            f"'{weight._name}' was read outside the forward of its module (unit "
            f"'{weight._unit}', gathered only while that module computes), by {func}. Call "
            "the module instead of reading its weight, tie a module to the weight "
            "(e.g. head.weight = embed.weight), or read it inside "
            "engine.summon_full_params() / trainer.strategy.summon_full_params()."
        )
