"""LightningModules and fits for the per-parameter view tests (issue 11).

Every fit here runs twice in the same spawn: under ``strategy="yafsdp"`` and under
``strategy="ddp"`` (``find_unused_parameters=True``, so that DDP leaves the grad of a
parameter no rank used at None, which is what the engine must reproduce), with
``precision="32-true"`` and the same data. Both sides start from the same weights:

- ``build="eager"``: the model is built in ``__init__`` from a fixed seed, identical
  under both strategies;
- ``build="configure_model"``: under yafsdp the model is built on the meta device and
  initialized by the engine; its full weights at ``on_fit_start`` are then loaded into
  the DDP run's model (built in ``configure_model`` with real tensors). This is how the
  meta path is compared against DDP without depending on the init scheme.

What a fit returns is plain facts (losses, weights, norms, group sizes), so that a rank
can send them back from ``dist_run``.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import transformers
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_yafsdp  # noqa: F401 - registers strategy="yafsdp"
from lightning_yafsdp import YaFSDPStrategy
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor
from tests.zoo_models import full_weights

VOCAB = 32
SEQ = 8
DIM = 16
BATCH = 2  # rows per rank per micro-batch
STEPS = 4


# -- data -------------------------------------------------------------------------------------


class TokenRows(Dataset):
    """Random token rows from a fixed seed (the DistributedSampler splits them by rank)."""

    def __init__(self, num_rows: int, *, vocab: int = VOCAB, seed: int = 1234) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (num_rows, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


def token_loader(world_size: int, *, accumulate: int = 1, vocab: int = VOCAB) -> DataLoader:
    """Exactly ``STEPS`` optimizer steps of ``BATCH`` rows per rank and micro-batch."""
    rows = STEPS * accumulate * BATCH * world_size
    return DataLoader(TokenRows(rows, vocab=vocab), batch_size=BATCH, shuffle=False)


def fixed_tokens(vocab: int = VOCAB) -> torch.Tensor:
    """The batch on which trained models are compared."""
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(99))


# -- models -----------------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm residual block with two parameters that are not always used.

    ``branch`` runs only when ``use_branch`` is set (a test sets it on one rank in one
    step); ``spare`` never runs, so no rank ever gives it a grad.
    """

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.branch = nn.Linear(DIM, DIM)
        self.spare = nn.Linear(DIM, DIM)
        self.use_branch = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        if self.use_branch:
            h = h + self.branch(h)
        return h


class ViewNet(nn.Module):
    """Embedding, three blocks (the units), a final norm, a head; ``skipped`` is LayerDrop."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.skipped: set[int] = set()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for index, layer in enumerate(self.layers):
            if index not in self.skipped:
                x = layer(x)
        return self.head(self.norm(x))


def tiny_llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM * 2, intermediate_size=DIM * 4, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ * 2,
        use_cache=False, attn_implementation="eager",
    )  # fmt: skip


def build_model(kind: str) -> nn.Module:
    if kind == "net":
        return ViewNet()
    if kind == "hf_llama":
        return transformers.LlamaForCausalLM(tiny_llama_config())
    raise ValueError(f"unknown model kind {kind!r}")


# -- how the optimizer is built ---------------------------------------------------------------


def param_groups(module: nn.Module, how: str) -> list[dict]:
    """The param-group partitions users write, over ``module.model``'s parameters.

    ``"by_module"``: the blocks at one lr with decay, everything else at another without;
    ``"by_name"``: no decay on biases and norm weights (name rules); ``"by_dim"``: the
    nanoGPT/litgpt split, decay for ``p.dim() >= 2``; ``"single"``: one group.
    """
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if how == "single":
        return [{"params": [p for _, p in named]}]
    if how == "by_module":
        in_layers = {id(p) for p in module.model.layers.parameters()}
        return [
            {"params": list(module.model.layers.parameters()), "lr": 1e-2, "weight_decay": 0.1},
            {"params": [p for _, p in named if id(p) not in in_layers], "lr": 3e-2,
             "weight_decay": 0.0},
        ]  # fmt: skip
    if how == "by_name":
        no_decay = [p for n, p in named if n.endswith("bias") or "norm" in n]
        decay = [p for n, p in named if not (n.endswith("bias") or "norm" in n)]
        return [
            {"params": decay, "lr": 2e-2, "weight_decay": 0.2},
            {"params": no_decay, "lr": 1e-2, "weight_decay": 0.0},
        ]
    if how == "by_dim":
        return [
            {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
        ]
    raise ValueError(f"unknown grouping {how!r}")


def describe_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """What each group holds, in terms that must be the same under DDP and yafsdp."""
    return [
        {
            "num_params": len(group["params"]),
            "numel": sum(p.numel() for p in group["params"]),
            "shapes": [tuple(p.shape) for p in group["params"]],
            "lr": group["lr"],
            "weight_decay": group["weight_decay"],
        }
        for group in optimizer.param_groups
    ]


def total_grad_norm(optimizer: torch.optim.Optimizer) -> float:
    """``torch.nn.utils.get_total_norm`` of the optimizer's grads (collective when sharded)."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads).item()


# -- the automatic-optimization module ------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One fit: how the model is built and grouped, and which params skip a step.

    Attributes:
        model: ``"net"`` (:class:`ViewNet`) or ``"hf_llama"`` (a tiny LlamaForCausalLM).
        build: ``"eager"`` or ``"configure_model"`` (see the module docstring).
        groups: a grouping of :func:`param_groups`.
        accumulate: ``accumulate_grad_batches``.
        layerdrop: block 2 is skipped on odd steps (on every rank); with accumulation,
            block 1 is also skipped on the first micro-batch of every window.
        rank0_branch: block 1's ``branch`` runs only on rank 0 and only in step 1.
        clip_val: ``gradient_clip_val`` (norm), or None.
        log_grad_norm: log ``lightning.pytorch.utilities.grad_norm(self, 2)`` before
            every optimizer step.
        ema: a ``WeightAveraging`` averaging function (``"ema_avg_fn"`` or
            ``"ema_multi_avg_fn"``), or None.
        freeze: which parameters get ``requires_grad=False`` before sharding (see
            :func:`freeze`), or None.
    """

    model: str = "net"
    build: str = "eager"
    groups: str = "single"
    accumulate: int = 1
    layerdrop: bool = False
    rank0_branch: bool = False
    clip_val: float | None = None
    log_grad_norm: bool = False
    ema: str | None = None
    freeze: str | None = None


# What stays trainable under each freezing rule (a name test on the parameter's name).
FREEZE_RULES: dict[str, Callable[[str], bool]] = {
    # A LoRA-like base: the block's second projection and the norms train, the embedding,
    # the head and every other block weight are frozen (mixed units, frozen-only root units).
    "base": lambda name: "fc2" in name or "o_proj" in name or "norm" in name,
    # Only norms and biases train: the blocks hold no trainable weight (frozen-only units).
    "all_but_norms": lambda name: "norm" in name or name.endswith("bias"),
}


def freeze(model: nn.Module, rule: str) -> None:
    trainable = FREEZE_RULES[rule]
    for name, param in model.named_parameters():
        param.requires_grad_(trainable(name))


class ViewModule(pl.LightningModule):
    """Trains a :class:`Variant` with AdamW; records losses, clip norms and grad norms."""

    def __init__(self, variant: Variant, *, initial: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.variant = variant
        self.initial = initial
        self.model: nn.Module | None = None
        self.losses: list[float] = []
        self.clip_norms: list[tuple[float, float]] = []  # (before, after) per clipping
        self.grad_norms: list[dict[str, float]] = []
        self.groups: list[dict] = []
        if variant.build == "eager":
            torch.manual_seed(0)
            self.model = build_model(variant.model)
            if variant.freeze is not None:
                freeze(self.model, variant.freeze)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = build_model(self.variant.model)
        if self.variant.freeze is not None:
            freeze(self.model, self.variant.freeze)
        if self.initial is not None:  # the DDP side of a configure_model comparison
            self.load_state_dict(self.initial)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.variant.model == "hf_llama":
            return self.model(input_ids=tokens).logits
        return self.model(tokens)

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self._choose_paths(batch_idx)
        logits = self(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def _choose_paths(self, batch_idx: int) -> None:
        if self.variant.model != "net":
            return
        step, micro = divmod(batch_idx, self.variant.accumulate)
        skipped = set()
        if self.variant.layerdrop and step % 2 == 1:
            skipped.add(2)
        if self.variant.layerdrop and self.variant.accumulate > 1 and micro == 0:
            skipped.add(1)
        self.model.skipped = skipped
        self.model.layers[1].use_branch = (
            self.variant.rank0_branch and step == 1 and self.global_rank == 0
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW(param_groups(self, self.variant.groups), lr=1e-2)
        self.groups = describe_groups(optimizer)
        return optimizer

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        # The user's way to see the clipping: the total norm of the optimizer's grads
        # before and after Lightning clips them.
        before = total_grad_norm(optimizer)
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.clip_norms.append((before, total_grad_norm(optimizer)))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.variant.log_grad_norm:
            from lightning.pytorch.utilities import grad_norm

            norms = grad_norm(self, norm_type=2)
            self.log_dict(norms)
            self.grad_norms.append({name: float(value) for name, value in norms.items()})


# -- running one comparison ------------------------------------------------------------------


def trainer_for(strategy: Any, *, world_size: int, **overrides: Any) -> pl.Trainer:
    options = dict(
        accelerator="cpu",
        devices=world_size,
        precision="32-true",
        max_steps=STEPS,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    options.update(overrides)
    return pl.Trainer(strategy=strategy, **options)


def strategy_for(name: str, **yafsdp_options: Any) -> Any:
    """``"yafsdp"`` or ``"ddp"`` (find_unused_parameters=True), with a short timeout."""
    if name == "yafsdp":
        return YaFSDPStrategy(timeout=timedelta(seconds=60), **yafsdp_options)
    if name == "ddp":
        return DDPStrategy(find_unused_parameters=True, timeout=timedelta(seconds=60))
    raise ValueError(f"unknown strategy {name!r}")


class InitialWeights(pl.Callback):
    """The full weights when training starts (after sharding, before the first step)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weights = full_weights(trainer, pl_module)


class WeightsAtTrainEnd(pl.Callback):
    """The full weights at ``on_train_end``, before a later callback changes them."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weights = full_weights(trainer, pl_module)


def ema_callback(kind: str) -> pl.Callback:
    from lightning.pytorch.callbacks import WeightAveraging
    from torch.optim.swa_utils import get_ema_avg_fn, get_ema_multi_avg_fn

    if kind == "ema_avg_fn":
        return WeightAveraging(avg_fn=get_ema_avg_fn(0.8))
    if kind == "ema_multi_avg_fn":
        return WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.7))
    raise ValueError(f"unknown averaging {kind!r}")


def fit_variant(variant: Variant, strategy: str, *, initial=None, **yafsdp_options) -> dict:
    """One fit of ``variant`` under ``strategy``; plain facts of this rank."""
    world_size = torch.distributed.get_world_size()
    module = ViewModule(variant, initial=initial)
    start, end = InitialWeights(), WeightsAtTrainEnd()
    callbacks = [start, end]
    if variant.ema is not None:
        callbacks.append(ema_callback(variant.ema))  # after `end`: it sees the trained weights
    trainer = trainer_for(
        strategy_for(strategy, **yafsdp_options),
        world_size=world_size,
        accumulate_grad_batches=variant.accumulate,
        gradient_clip_val=variant.clip_val,
        callbacks=callbacks,
    )
    trainer.fit(module, token_loader(world_size, accumulate=variant.accumulate))
    return {
        "losses": module.losses,
        "parameters": [(n, tuple(p.shape), p.requires_grad) for n, p in module.named_parameters()],
        "sharded": [n for n, p in module.named_parameters() if isinstance(p, RangeShardedTensor)],
        "initial": start.weights,
        "trained": end.weights,
        "final": full_weights(trainer, module),
        "groups": module.groups,
        "clip_norms": module.clip_norms,
        "grad_norms": module.grad_norms,
        "steps": trainer.global_step,
    }


def compare_variant(variant: Variant, subject: str = "yafsdp", **yafsdp_options) -> dict:
    """``{"subject": facts, "ddp": facts}``: the subject first, then DDP from its start.

    ``subject`` is ``"yafsdp"``; ``"ddp"`` checks the harness itself (DDP against DDP).
    """
    ours = fit_variant(variant, subject, **yafsdp_options)
    initial = ours["initial"] if variant.build == "configure_model" else None
    return {"subject": ours, "ddp": fit_variant(variant, "ddp", initial=initial)}


def compare_all(variants: dict[str, Variant], subject: str = "yafsdp") -> dict[str, dict]:
    """Every variant in one multi-rank run; see :func:`guarded`."""
    return {name: guarded(compare_variant, variant, subject) for name, variant in variants.items()}


def guarded(compare: Callable[..., dict], *args: Any) -> dict:
    """``compare(*args)``, or ``{"error": traceback}``: one failing fit keeps the others'
    facts (a rank left waiting in a collective raises after the strategy's timeout)."""
    try:
        return compare(*args)
    except Exception:  # noqa: BLE001 - the tests report it
        return {"error": traceback.format_exc()}


def pair(facts: dict, name: str) -> tuple[dict, dict]:
    """The ``(subject, ddp)`` facts of comparison ``name``; fails with its error if any."""
    result = facts[name]
    if "error" in result:
        raise AssertionError(f"{name} raised:\n{result['error']}")
    return result["subject"], result["ddp"]


# -- two optimizers, manual optimization (a GAN) -------------------------------------------

LATENT = 8


class GanNet(nn.Module):
    """A generator and a discriminator (the two units), each with its own optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(
            nn.Linear(LATENT, 2 * DIM), nn.LayerNorm(2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM)
        )
        self.discriminator = nn.Sequential(
            nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, 1)
        )


GAN_UNITS = ["model.generator", "model.discriminator"]


class RealRows(Dataset):
    """Real samples for the discriminator: shifted Gaussian rows from a fixed seed."""

    def __init__(self, num_rows: int) -> None:
        generator = torch.Generator().manual_seed(4321)
        self.rows = torch.randn(num_rows, DIM, generator=generator) * 0.5 + 1.0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]


class GanModule(pl.LightningModule):
    """Alternating generator / discriminator steps with manual optimization.

    Each optimizer zeroes, clips (``self.clip_gradients``, norm) and steps only its own
    sub-module's parameters. The generator's backward also fills the discriminator's
    grads, which its own ``zero_grad`` then drops: clipping the generator's optimizer
    must not count them.
    """

    def __init__(self, *, build: str = "eager", initial: dict | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.build = build
        self.initial = initial
        self.model: GanNet | None = None
        self.losses: list[tuple[float, float]] = []
        self.clip_norms: dict[str, list[tuple[float, float]]] = {"g": [], "d": []}
        if build == "eager":
            torch.manual_seed(0)
            self.model = GanNet()

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GanNet()
            if self.initial is not None:
                self.load_state_dict(self.initial)

    def _clip(self, optimizer, key: str, value: float) -> None:
        before = total_grad_norm(optimizer)
        self.clip_gradients(optimizer, gradient_clip_val=value, gradient_clip_algorithm="norm")
        self.clip_norms[key].append((before, total_grad_norm(optimizer)))

    def training_step(self, real: torch.Tensor, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        noise = torch.Generator().manual_seed(1000 * batch_idx + self.global_rank)
        z = torch.randn(real.shape[0], LATENT, generator=noise)
        fake = self.model.generator(z)
        loss_g = F.softplus(-self.model.discriminator(fake)).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        self._clip(opt_g, "g", 0.05)
        opt_g.step()

        loss_d = F.softplus(-self.model.discriminator(real)).mean()
        loss_d = loss_d + F.softplus(self.model.discriminator(fake.detach())).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        self._clip(opt_d, "d", 0.02)
        opt_d.step()
        self.losses.append((loss_g.item(), loss_d.item()))

    def configure_optimizers(self):
        opt_g = torch.optim.AdamW(self.model.generator.parameters(), lr=1e-2, weight_decay=0.05)
        opt_d = torch.optim.Adam(self.model.discriminator.parameters(), lr=2e-2, betas=(0.5, 0.9))
        return opt_g, opt_d


def fit_gan(strategy: str, *, build: str, initial: dict | None = None) -> dict:
    world_size = torch.distributed.get_world_size()
    module = GanModule(build=build, initial=initial)
    start = InitialWeights()
    options = {"units": GAN_UNITS} if strategy == "yafsdp" else {}
    # Manual optimization counts every optimizer's step: two per batch.
    trainer = trainer_for(
        strategy_for(strategy, **options), world_size=world_size, max_steps=2 * STEPS,
        callbacks=[start],
    )  # fmt: skip
    loader = DataLoader(RealRows(STEPS * BATCH * world_size), batch_size=BATCH)
    trainer.fit(module, loader)
    return {
        "losses": module.losses,
        "initial": start.weights,
        "final": full_weights(trainer, module),
        "clip_norms": module.clip_norms,
        "steps": trainer.global_step,
    }


def compare_gan(build: str, subject: str = "yafsdp") -> dict:
    ours = fit_gan(subject, build=build)
    initial = ours["initial"] if build == "configure_model" else None
    return {"subject": ours, "ddp": fit_gan("ddp", build=build, initial=initial)}


# -- comparing facts ----------------------------------------------------------------------------


def assert_same_losses(ours: list, ddp: list, *, rtol: float) -> None:
    assert len(ours) == len(ddp) > 0
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ddp), rtol=rtol, atol=0)


def assert_same_weights(ours: dict, ddp: dict, *, atol: float) -> None:
    """Same names, and every tensor within ``atol`` (weights here are of order 0.1-1)."""
    assert sorted(ours) == sorted(ddp)
    for name, expected in ddp.items():
        difference = (ours[name] - expected).abs().max().item() if expected.numel() else 0.0
        assert ours[name].shape == expected.shape, name
        assert difference <= atol, f"{name}: off by {difference:.3g} (allowed {atol:g})"
