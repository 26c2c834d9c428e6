"""Rank functions for tests/test_checkpoint.py (module level: dist_run pickles them by name).

One tiny reference Llama, one AdamW, one deterministic data stream: step ``i``
uses global batch ``i`` (12 sequences, divisible by world sizes 1-4), each rank
its own contiguous slice, so a run is the same optimisation at every world size.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_yafsdp.checkpoint import atomic
from lightning_yafsdp.core import shard_model
from lightning_yafsdp.models.llama import Llama, LlamaConfig

VOCAB = 64
GLOBAL_BATCH = 12
SEQ = 8
CONFIG = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, ffn_hidden_dim=48, max_seq_len=16)


def build_llama(seed: int = 0, **overrides) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig(**{**CONFIG, **overrides}))


def build_sharded(seed: int = 0, *, single_group: bool = False, shard_size=None, **overrides):
    model = build_llama(seed, **overrides)
    engine = shard_model(model, shard_size=shard_size)
    params = model.parameters() if single_group else engine.param_groups(weight_decay=0.1)
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return model, engine, optimizer


def batch(step: int) -> torch.Tensor:
    return torch.randint(
        0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step)
    )


def train_steps(model, optimizer, steps) -> None:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    per_rank = GLOBAL_BATCH // world
    for step in steps:
        tokens = batch(step)[rank * per_rank : (rank + 1) * per_rank]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def probe_tokens() -> torch.Tensor:
    return torch.arange(2 * SEQ).remainder(VOCAB).view(2, SEQ)


@torch.no_grad()
def outputs(model) -> torch.Tensor:
    return model(probe_tokens()).detach().clone()


def full_weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.full_state_dict().items()}


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# -- kill -9 mid-save ----------------------------------------------------------------------


def pause_forever(pid_dir: str, tmp: Path) -> None:
    """``atomic.before_commit`` hook: rank 0 announces its pid and waits to be killed."""
    if dist.get_rank() == 0:
        Path(pid_dir, "paused.tmp").write_text(str(os.getpid()))
        os.replace(Path(pid_dir, "paused.tmp"), Path(pid_dir, "paused"))
    while True:
        time.sleep(0.1)


def install_pause(pid_dir: str) -> None:
    import functools

    atomic.before_commit = functools.partial(pause_forever, pid_dir)
