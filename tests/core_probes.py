"""Rank functions that probe the engine's behaviour (schedule, allocations, traffic, errors)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_yafsdp.core import shard_model
from lightning_yafsdp.models.llama import Llama, LlamaConfig

N_LAYERS = 4


def tiny_llama(**overrides) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_name("tiny", n_layers=N_LAYERS, **overrides))


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    return (
        torch.randint(0, 256, (2, 16), generator=generator),
        torch.randint(0, 256, (2, 16), generator=generator),
    )


def train_step(model, optimizer, seed: int = 0) -> None:
    tokens, targets = batch(seed)
    F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def recorded_step(model, **shard_options) -> tuple:
    """``(engine, schedule log)`` of one training step after a warm-up step."""
    engine = shard_model(model, **shard_options)
    optimizer = torch.optim.AdamW(engine.sharded_parameters(), lr=1e-3)
    train_step(model, optimizer)
    with engine.recording() as log:
        train_step(model, optimizer, seed=1)
    return engine, list(log)


def record_schedule(
    activation_checkpointing=None, zero_stage: int = 3, shard_size: int | None = None,
    blocks_per_unit="auto",
) -> dict:  # fmt: skip
    """One recorded training step after a warm-up step."""
    engine, log = recorded_step(
        tiny_llama(),
        zero_stage=zero_stage,
        activation_checkpointing=activation_checkpointing,
        shard_size=shard_size,
        blocks_per_unit=blocks_per_unit,
    )
    slots = {u.name: (u.weight_buffer.index, u.grad_buffer.index) for u in engine.units}
    return {"log": log, "slots": slots, "unit_names": [u.name for u in engine.units]}


class _WithRootRemainder(nn.Module):
    """A tiny Llama with a root-level bias: two resident groups (norms and the root)."""

    def __init__(self) -> None:
        super().__init__()
        self.llama = tiny_llama()
        self.bias = nn.Parameter(torch.zeros(256))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.llama(tokens) + self.bias


def record_resident_schedule() -> dict:
    """One recorded step (after a warm-up) of a model with two resident groups."""
    engine, log = recorded_step(_WithRootRemainder())
    return {"log": log, "residents": [g.name for g in engine.residents]}


class _LargeAllocations(TorchDispatchMode):
    """Records every op output that owns a fresh storage of at least ``min_numel`` elements."""

    def __init__(self, min_numel: int) -> None:
        super().__init__()
        self.min_numel = min_numel
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [
            a
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        ]
        known = {t.untyped_storage().data_ptr() for t in inputs}
        for tensor in torch.utils._pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            if tensor.untyped_storage().data_ptr() in known:
                continue  # a view or an in-place result
            if tensor.untyped_storage().nbytes() >= self.min_numel * tensor.element_size():
                self.found.append((str(func), tuple(tensor.shape)))
        return out


def traffic_memory_and_allocations(zero_stage: int = 3) -> dict:
    model = tiny_llama()
    engine = shard_model(model, zero_stage=zero_stage)
    optimizer = torch.optim.AdamW(engine.sharded_parameters(), lr=1e-3)
    train_step(model, optimizer)
    engine.comm_stats.reset()
    train_step(model, optimizer, seed=1)
    traffic = engine.comm_stats.snapshot()
    # Steady state: forward + backward must allocate nothing block-sized. (A root unit
    # can be one weight, whose grad autograd makes whole before Narrow copies it in.)
    smallest_unit = min(u.layout.numel for u in engine.blocks())
    tokens, targets = batch(2)
    with _LargeAllocations(smallest_unit) as probe:
        F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten()).backward()
    optimizer.zero_grad()
    return {
        "traffic": traffic,
        "memory": engine.memory_report(),
        "unit_padded": [u.layout.padded_numel for u in engine.units],
        "unit_shards": [u.layout.shard_numel for u in engine.units],
        "residents": [
            (g.name, g.layout.padded_numel, g.layout.shard_numel) for g in engine.residents
        ],
        "smallest_unit": smallest_unit,
        "large_allocations": probe.found,
        "master_shapes": [tuple(m.shape) for m in (engine.flat_shard, engine.norm_shard)],
        "param_names": [n for n, _ in model.named_parameters()],
        "unsharded_param_names": [n for n, _ in tiny_llama().named_parameters()],
    }


def summon_and_shards() -> dict:
    """Full weights inside summon_full_params equal the gathered state; writeback works."""
    model = tiny_llama()
    reference = tiny_llama().state_dict()
    engine = shard_model(model)
    with engine.summon_full_params():
        inside = model.layers[1].attention.wq.weight.clone()
    with engine.summon_full_params(writeback=True), torch.no_grad():
        model.norm.weight.fill_(2.0)
    after = engine.full_state_dict()["norm.weight"]
    outside = model.layers[1].attention.wq.weight
    outside_forward = (type(outside).__name__, tuple(outside.shape), outside._local.numel())
    tokens, _ = batch()
    logits = model(tokens)  # the written-back weights are used by the next forward
    shards = {s.name: (s.start, s.end, s.tensor.numel()) for s in engine.named_parameter_shards()}
    return {
        "inside_equal": torch.equal(inside, reference["layers.1.attention.wq.weight"]),
        "after_writeback": after.clone(),
        "outside_forward": outside_forward,
        "logits_finite": bool(torch.isfinite(logits).all()),
        "shards": shards,
        "shapes": {k: tuple(v.shape) for k, v in reference.items()},
    }


class _PeerCallingBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.peer = None  # set to another block, not registered as a submodule

    def forward(self, x):
        x = self.proj(x)
        return self.peer(x) if self.peer is not None else x


class _PeerModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_PeerCallingBlock(8) for _ in range(3))
        object.__setattr__(self.layers[0], "peer", self.layers[2])

    def forward(self, x):
        return self.layers[1](self.layers[0](x))


class _TiedAcrossUnits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 8)
        self.head.weight = self.layers[1].weight

    def forward(self, x):
        return self.head(self.layers[1](self.layers[0](x)))


def error_messages() -> dict[str, str]:
    """Each bad input's error message (world size 1 suffices: all raise before collectives)."""
    messages = {}

    def capture(key, fn):
        try:
            fn()
        except (ValueError, RuntimeError, TypeError) as error:
            messages[key] = f"{type(error).__name__}: {error}"
        else:
            messages[key] = "no error"

    peer_model = _PeerModel()
    shard_model(peer_model)
    capture("nested", lambda: peer_model(torch.randn(2, 8)))
    capture("tied_across_units", lambda: shard_model(_TiedAcrossUnits()))
    shared = tiny_llama()
    shared.layers[1].attention.wq = shared.layers[0].attention.wq
    capture("module_shared_by_units", lambda: shard_model(shared))

    frozen = tiny_llama()
    frozen.requires_grad_(False)
    capture("no_trainable", lambda: shard_model(frozen))

    mixed = tiny_llama()
    mixed.layers[0].attention.wq.weight = nn.Parameter(torch.empty(64, 64, device="meta"))
    capture("mixed_devices", lambda: shard_model(mixed))
    capture("no_blocks", lambda: shard_model(nn.Linear(4, 4)))
    capture("bad_units_class", lambda: shard_model(tiny_llama(), units=nn.GRU))
    capture("bad_zero_stage", lambda: shard_model(tiny_llama(), zero_stage=1))
    return messages


def hf_gradient_checkpointing() -> dict:
    """HF's own gradient checkpointing (it re-runs ``layer.forward`` without hooks): same grads."""
    import transformers

    from tests.core_scenarios import SCENARIOS, build_model

    results = {}
    for checkpointing in (False, True):
        model = build_model(SCENARIOS["hf_llama"])
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        model.train()
        engine = shard_model(model)
        tokens, targets = batch()
        with engine.recording() as log:
            logits = model(tokens).logits
            F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
        results[checkpointing] = {
            "grads": [p.grad._local.clone() for p in engine.sharded_parameters()],
            "log": list(log),
            "slots": {u.name: (u.weight_buffer.index, u.grad_buffer.index) for u in engine.units},
        }
        assert isinstance(model, transformers.PreTrainedModel)
    return results
