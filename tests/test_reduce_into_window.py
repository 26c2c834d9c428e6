"""Reductions write the gradient window directly ([Note: reduce into the gradient window]).

A fresh window's first write is the reduce_scatter itself, divided in place once final;
a later write (a live window: accumulation) is staged in the grad buffer and added.
Both paths must give the same gradient to the bit, with and without row chunks and
under hybrid sharding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_yafsdp.core import shard_model
from tests.core_probes import batch, tiny_llama
from tests.distributed import dist_run


def _direct_and_staged_grads(options: dict) -> dict:
    """The grads of one backward into a fresh window (direct) and of the same backward
    added into that window zeroed in place (staged), per parameter."""
    model = tiny_llama(**options.pop("model", {}))
    engine = shard_model(model, **options)
    tokens, targets = batch(0)

    def backward() -> dict[str, torch.Tensor]:
        logits = model(tokens)
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
        return {
            name: p.grad._local.clone()
            for name, p in model.named_parameters()
            if p.grad is not None
        }

    direct = backward()
    for param in engine.sharded_parameters():
        if param.grad is not None:
            param.grad.zero_()  # the window stays live: the next backward adds into it
    staged = backward()
    return {
        "equal": {name: torch.equal(direct[name], staged[name]) for name in direct},
        "largest": max(g.abs().max().item() for g in direct.values() if g.numel()),
        "grad_buffers": engine.memory_report()["grad_buffers"],
        "slots": sum(b.tensor.numel() * b.tensor.element_size() for b in engine.grad_buffers),
    }


_CASES = {
    "flat": (2, {}),
    "row_chunks_tied": (2, {"model": {"vocab_size": 3001, "tie_embeddings": True}}),
    "hybrid": (4, {"shard_size": 2}),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_direct_and_staged_reductions_give_the_same_gradient_to_the_bit(case: str) -> None:
    world_size, options = _CASES[case]
    for facts in dist_run(world_size, _direct_and_staged_grads, options):
        assert facts["largest"] > 0
        assert all(facts["equal"].values()), [n for n, ok in facts["equal"].items() if not ok]
        # The grad buffers are the slots alone: no reduced-shard twin beside them.
        assert facts["grad_buffers"] == facts["slots"]
