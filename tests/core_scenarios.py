"""Training scenarios run twice: sharded on N ranks, and as a single-process reference.

Both sides build the same model from the same seed and consume the same global
batches; a sharded rank trains on its contiguous slice of each global batch.
Module-level functions so that ``dist_run`` can pickle them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_yafsdp.core import shard_model
from lightning_yafsdp.models.llama import Llama, LlamaConfig

GLOBAL_BATCH = 12  # divisible by world sizes 1, 2, 3 and 4
SEQ_LEN = 16
VOCAB = 256


@dataclass(frozen=True)
class Scenario:
    """One training run; every field has the plain-torch meaning."""

    model: str = "llama"  # "llama", "llama_tied", "hf_llama", "llama_unused"
    optimizer: str = "adamw"  # "adamw" (foreach), "adamw_fused", "sgd"
    steps: int = 5
    accumulation: int = 1
    clip_norm: float | None = None
    zero_stage: int = 3
    checkpoint_units: tuple[int, ...] | None = None
    param_dtype: torch.dtype = torch.float32
    frozen_prefix: str | None = None  # requires_grad=False for params whose name starts so
    eval_between_steps: bool = False
    shard_size: int | None = None  # hybrid sharding: groups of this many ranks, replicated


SCENARIOS: dict[str, Scenario] = {
    "adamw": Scenario(),
    "fused_adamw": Scenario(optimizer="adamw_fused"),
    "sgd_momentum": Scenario(optimizer="sgd"),
    "accumulation_2": Scenario(accumulation=2),
    "clipping": Scenario(clip_norm=0.05),
    "checkpoint_alternate_units": Scenario(checkpoint_units=(0, 2)),
    "zero2": Scenario(zero_stage=2),
    "tied_embeddings": Scenario(model="llama_tied"),
    "frozen_embeddings": Scenario(frozen_prefix="tok_embeddings"),
    # A frozen weight inside a block makes that unit smaller than the others.
    "frozen_in_unit": Scenario(frozen_prefix="layers.0.attention.wq"),
    "unused_parameter": Scenario(model="llama_unused"),
    "eval_between_steps": Scenario(eval_between_steps=True),
    "hf_llama": Scenario(model="hf_llama"),
    "hf_llama_accum_clip_ckpt": Scenario(
        model="hf_llama", accumulation=2, clip_norm=0.05, checkpoint_units=(1,)
    ),
    # SGD: linear in the grads, so the bf16 error stays at bf16 precision
    # (Adam's sign-like first steps turn bf16 noise on tiny grads into +-lr).
    "bf16_compute": Scenario(param_dtype=torch.bfloat16, optimizer="sgd"),
    # Hybrid sharding: shard groups of 2 ranks, replicated across the others.
    "hsdp_accum_clip": Scenario(shard_size=2, accumulation=2, clip_norm=0.05),
    "hsdp_zero2_checkpoint_unused": Scenario(
        shard_size=2, model="llama_unused", zero_stage=2, checkpoint_units=(1,)
    ),
    "hsdp_tied_frozen": Scenario(
        shard_size=2, model="llama_tied", frozen_prefix="layers.0.attention.wq"
    ),
    "hsdp_hf_llama_accum_clip_ckpt": Scenario(
        model="hf_llama", shard_size=2, accumulation=2, clip_norm=0.05, checkpoint_units=(1,)
    ),
    "hsdp_bf16_compute": Scenario(shard_size=2, param_dtype=torch.bfloat16, optimizer="sgd"),
}


class _UnusedWeightBlock(nn.Module):
    """A Llama block with one parameter that never takes part in forward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.unused = nn.Parameter(torch.randn(8, 8))

    def forward(self, x, cos, sin):
        return self.block(x, cos, sin)


def build_model(scenario: Scenario) -> nn.Module:
    torch.manual_seed(1234)
    if scenario.model == "hf_llama":
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attn_implementation="sdpa",
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = LlamaConfig.from_name(
            "tiny", n_layers=4, tie_embeddings=scenario.model == "llama_tied"
        )
        model = Llama(config)
        if scenario.model == "llama_unused":
            model.layers = nn.ModuleList(_UnusedWeightBlock(b) for b in model.layers)
    if scenario.frozen_prefix:
        for name, param in model.named_parameters():
            if name.startswith(scenario.frozen_prefix):
                param.requires_grad_(False)
    return model


def global_batches(scenario: Scenario) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(99)
    shape = (GLOBAL_BATCH, SEQ_LEN)
    return [
        (
            torch.randint(0, VOCAB, shape, generator=generator),
            torch.randint(0, VOCAB, shape, generator=generator),
        )
        for _ in range(scenario.steps)
    ]


def make_optimizer(scenario: Scenario, params) -> torch.optim.Optimizer:
    if scenario.optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    fused = scenario.optimizer == "adamw_fused"
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, foreach=not fused, fused=fused)


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def train(model, optimizer, scenario, batches, *, clip, ranks, world_size) -> list[float]:
    """The plain torch loop both sides run; returns the global loss of every step.

    A sharded rank passes ``ranks=[its rank]``. The single-process reference
    passes ``ranks=range(world_size)`` and accumulates the ranks' slices in
    turn: the same data in the same per-rank pieces, so the two runs differ
    only by the order in which the pieces' grads are summed. (A reference that
    takes the whole global batch in one piece differs from BOTH by the
    round-off of another summation order: 1.1e-5 relative on some weights
    after 5 AdamW steps, measured single-process with a batch split in two.)
    """
    per_rank = GLOBAL_BATCH // world_size
    micro = per_rank // scenario.accumulation
    losses = []
    for tokens, targets in batches:
        step_loss = torch.zeros(())
        for rank in ranks:
            for i in range(scenario.accumulation):
                part = slice(rank * per_rank + i * micro, rank * per_rank + (i + 1) * micro)
                loss = loss_of(model, tokens[part], targets[part]) / scenario.accumulation
                loss.backward()
                step_loss += loss.detach()
        if len(ranks) > 1:
            average_over_simulated_ranks(model, len(ranks))
        if scenario.clip_norm is not None:
            clip(scenario.clip_norm)
        optimizer.step()
        optimizer.zero_grad()
        if scenario.eval_between_steps:
            with torch.no_grad():
                loss_of(model, tokens[:2], targets[:2])
        if len(ranks) < world_size:
            dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world_size)
    return losses


@torch.no_grad()
def average_over_simulated_ranks(model: nn.Module, world_size: int) -> None:
    """Reference side: grads summed over the ranks' slices, divided once, as the engine does.

    A parameter no slice used keeps ``grad is None``, as under DDP: the optimizer
    skips it (no decoupled weight decay, no momentum), and so does the engine's.
    """
    for param in model.parameters():
        if param.requires_grad and param.grad is not None:
            param.grad.div_(world_size)


def run_reference(name: str, world_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    scenario = SCENARIOS[name]
    reference = dataclasses.replace(scenario, param_dtype=torch.float32)
    model = build_model(reference)
    # Activation checkpointing changes memory, not math: the reference runs without it.
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(scenario, params)
    losses = train(
        model,
        optimizer,
        reference,
        global_batches(scenario),
        clip=lambda max_norm: torch.nn.utils.clip_grad_norm_(params, max_norm),
        ranks=range(world_size),
        world_size=world_size,
    )
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_sharded(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """On every rank of an initialized gloo group: shard, train, gather full weights."""
    scenario = SCENARIOS[name]
    model = build_model(scenario)
    engine = shard_model(
        model,
        zero_stage=scenario.zero_stage,
        activation_checkpointing=list(scenario.checkpoint_units)
        if scenario.checkpoint_units
        else None,
        param_dtype=scenario.param_dtype,
        shard_size=scenario.shard_size,
    )
    optimizer = make_optimizer(scenario, engine.sharded_parameters())
    losses = train(
        model,
        optimizer,
        scenario,
        global_batches(scenario),
        clip=engine.clip_grad_norm_,
        ranks=[dist.get_rank()],
        world_size=dist.get_world_size(),
    )
    state = {k: v.detach().clone() for k, v in engine.full_state_dict().items()}
    engine.close()
    return losses, state


def run_many_sharded(names: list[str]) -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    """Several scenarios in one spawn (process start-up dominates on 2 cores); rank 0 reports."""
    results = {name: run_sharded(name) for name in names}
    return results if dist.get_rank() == 0 else {}
