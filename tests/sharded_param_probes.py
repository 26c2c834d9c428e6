"""Rank functions for the per-parameter sharded views (core engine, plain torch loops).

A small model whose blocks can be skipped (LayerDrop) and whose per-block branch can be
used on one rank only, trained with two optimizers over parts of it, against a
single-process reference that runs every rank's slice and averages the grads as DDP does
(a parameter no slice used keeps ``grad is None``).
"""

from __future__ import annotations

import copy
import io

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_yafsdp.core import shard_model
from lightning_yafsdp.core.optim.optim_step import register_elementwise_optimizer

WIDTH, VOCAB, LAYERS = 24, 40, 3
# (skipped block on every rank, block whose branch runs on rank 0 only, micro-batches)
SCHEDULE = [(None, None, 1), (1, None, 1), (None, 2, 1), (2, 0, 2), (None, None, 1)]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH, bias=False)
        self.branch = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = x + self.down(F.gelu(self.up(self.norm(x))))
        return h + self.branch(h) if use_branch else h


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens, skip=None, branch=None):
        x = self.embed(tokens)
        for index, block in enumerate(self.blocks):
            if index != skip:
                x = block(x, use_branch=index == branch)
        return self.head(x)


def _build() -> Net:
    torch.manual_seed(7)
    return Net()


def _optimizers(model: Net, elementwise_custom: bool):
    """AdamW with three groups (by p.dim(), by name, by module) and SGD over the head."""
    named = [(n, p) for n, p in model.named_parameters() if not n.startswith("head.")]
    decay = [p for n, p in named if p.dim() >= 2 and not n.startswith("embed")]
    no_decay = [p for n, p in named if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3},
        {"params": list(model.embed.parameters()), "lr": 3e-3},
    ]
    first = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.05)
    head_optimizer = PlainSGD if elementwise_custom else torch.optim.SGD
    second = head_optimizer(model.head.parameters(), lr=0.05, momentum=0.9)
    return first, second


class PlainSGD(torch.optim.Optimizer):
    """An elementwise optimizer the engine does not know: it runs on the dispatch path."""

    def __init__(self, params, lr: float, momentum: float) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = p.grad.clone()
                else:
                    state["buf"].mul_(group["momentum"]).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])


def _data(step: int, micro: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + micro)
    tokens = torch.randint(0, VOCAB, (2 * world_size, 6), generator=generator)
    return tokens, torch.roll(tokens, 1, dims=1)


def _train(model, optimizers, world_size: int, rank: int | None, schedule) -> list[float]:
    """One schedule; ``rank=None`` is the reference (all slices, grads averaged)."""
    first, second = optimizers
    losses = []
    for step, (skip, branch_block, micros) in enumerate(schedule):
        total = 0.0
        # The reference divides this step's summed grads by the world size, not the
        # grads still held from an earlier step (the head's, between its steps).
        held = {p: p.grad for p in model.parameters()} if rank is None else {}
        if rank is None:
            model.zero_grad()
        for micro in range(micros):
            tokens, targets = _data(step, micro, world_size)
            ranks = range(world_size) if rank is None else [rank]
            for r in ranks:
                rows = slice(2 * r, 2 * r + 2)
                branch = branch_block if (branch_block is not None and r == 0) else None
                skip_here = skip if micro == 0 else None
                logits = model(tokens[rows], skip=skip_here, branch=branch)
                loss = F.cross_entropy(logits.flatten(0, 1), targets[rows].flatten()) / micros
                loss.backward()
                total += loss.item()
        if rank is None:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(world_size)
                if held[p] is not None:
                    p.grad = held[p] if p.grad is None else p.grad + held[p]
        else:
            value = torch.tensor(total)
            dist.all_reduce(value)
            total = value.item()
        losses.append(total / world_size)
        first.step()
        first.zero_grad()
        if step % 2 == 1:  # the head's grads accumulate over two steps
            second.step()
            second.zero_grad()
    return losses


def reference_training(
    world_size: int, elementwise_custom: bool = False, schedule=SCHEDULE
) -> dict:
    model = _build()
    optimizers = _optimizers(model, elementwise_custom)
    losses = _train(model, optimizers, world_size, None, schedule)
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def sharded_training(elementwise_custom: bool = False, schedule=SCHEDULE) -> dict:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    reference = _build()
    model = _build()
    engine = shard_model(model)
    facts = _structure_facts(model, reference)
    optimizers = _optimizers(model, elementwise_custom)
    facts["group_sizes"] = [len(g["params"]) for g in optimizers[0].param_groups]
    facts["reference_group_sizes"] = [
        len(g["params"]) for g in _optimizers(reference, False)[0].param_groups
    ]
    facts["losses"] = _train(model, optimizers, world_size, rank, schedule)
    facts["grads_after_zero_grad"] = [p.grad is None for p in model.parameters()]
    with engine.summon_full_params():
        facts["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    facts["second_state_types"] = sorted(
        {type(v).__name__ for s in optimizers[1].state.values() for v in s.values()}
    )
    return facts


def _structure_facts(model: Net, reference: Net) -> dict:
    seen_in_forward = {}

    def record(module, args):  # runs after the unit's own pre-hook installed the views
        seen_in_forward["params"] = sorted({type(p).__name__ for p in module.parameters()})
        seen_in_forward["attribute"] = type(module.up.__dict__.get("weight")).__name__

    handle = model.blocks[1].register_forward_pre_hook(record)
    tokens, _ = _data(0, 0, 1)
    with torch.no_grad():
        model(tokens)
    handle.remove()
    return {
        "names": [n for n, _ in model.named_parameters()],
        "reference_names": [n for n, _ in reference.named_parameters()],
        "shapes": [tuple(p.shape) for p in model.parameters()],
        "reference_shapes": [tuple(p.shape) for p in reference.parameters()],
        "dims": [p.dim() for p in model.parameters()],
        "is_parameter": all(isinstance(p, nn.Parameter) for p in model.parameters()),
        "submodule_names": [n for n, _ in model.blocks[0].named_parameters()],
        "in_forward": seen_in_forward,
        "outside_forward": type(model.blocks[1].up.weight).__name__,
    }


# -- refusals and copies --------------------------------------------------------------------


def refusals_and_copies() -> dict:
    model = _build()
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = shard_model(model)
    facts = {"full_bytes": full_bytes}
    facts["outside_forward"] = _message(lambda: model.blocks[0].up(torch.randn(2, WIDTH)))
    facts["view"] = _message(lambda: model.head.weight.view(-1))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    facts["saved_bytes"] = buffer.tell()
    twin = copy.deepcopy(model)
    facts["copy_types"] = sorted({type(p).__name__ for p in twin.parameters()})
    facts["copy_shares_storage"] = any(
        p._local.untyped_storage().data_ptr() == q._local.untyped_storage().data_ptr()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True)
    )
    facts["copy_forward"] = _message(lambda: twin(torch.zeros(1, 3, dtype=torch.long)))
    tokens, targets = _data(0, 0, dist.get_world_size())
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    facts["norm_vs_full"] = _norms(model, engine)
    model.head.weight.grad = model.head.weight.grad.clone()  # a replaced grad
    facts["replaced_grad"] = _message(
        lambda: F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    )
    facts["shape_dependent"] = _shape_dependent_optimizer(model)
    facts["failed_step_restored"] = _failed_step_is_undone(model)
    return facts


def _norms(model: Net, engine) -> dict:
    """Global norms from the sharded grads vs the same norms of the gathered grads."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    per_param = [float(g.norm(2)) for g in grads]
    full = [g.full_tensor() for g in grads]
    clip_total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    return {
        "per_param": per_param,
        "per_param_full": [float(f.norm(2)) for f in full],
        "inf": float(grads[0].norm(float("inf"))),
        "inf_full": float(full[0].norm(float("inf"))),
        "clip_total": clip_total,
        "engine_total": float(engine.clip_grad_norm_(1e9)),
        "full_total": float(torch.stack([f.norm(2) for f in full]).norm(2)),
    }


class GramOptimizer(torch.optim.Optimizer):
    """Shape-dependent (like Shampoo/Muon): needs the full matrix."""

    def __init__(self, params) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.dim() == 2:
                    p.sub_(p.grad @ p.grad.T @ p.grad)


def _shape_dependent_optimizer(model: Net) -> str:
    model.head.weight.grad = None
    model.zero_grad()
    tokens, targets = _data(1, 0, dist.get_world_size())
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    return _message(GramOptimizer(model.parameters()).step)


class FailingAdamW(torch.optim.AdamW):
    """Raises inside step(), after the engine swapped its parameters for pieces."""

    def step(self, closure=None):
        raise RuntimeError("boom inside step")


register_elementwise_optimizer(FailingAdamW)


def _failed_step_is_undone(model: Net) -> bool:
    optimizer = FailingAdamW(model.parameters(), lr=1e-3)
    params = list(optimizer.param_groups[0]["params"])
    raised = _message(optimizer.step)
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long))  # the next forward undoes the swap
    same = all(a is b for a, b in zip(params, optimizer.param_groups[0]["params"], strict=True))
    return "boom" in raised and same


def _message(fn) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


# -- runs: coalesced optimizer steps equal per-piece steps ----------------------------------

OPTIMIZER_CONFIGS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
    "adamw_foreach": lambda groups: torch.optim.AdamW(groups, lr=1e-2, foreach=True),
    "adamw_fused": lambda groups: torch.optim.AdamW(groups, lr=1e-2, fused=True),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2, weight_decay=0.01),
    "sgd_momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-3),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=1e-2),
    "adagrad_fused": lambda groups: torch.optim.Adagrad(groups, lr=1e-2, fused=True),
    # Scalar state besides `step` (mu_product; eta and mu): each parameter keeps its own.
    "nadam": lambda groups: torch.optim.NAdam(groups, lr=1e-2),
    "asgd": lambda groups: torch.optim.ASGD(groups, lr=0.1, lambd=0.5, alpha=1.0, t0=0),
}


def _grouped(model: Net, interleaved: bool) -> list[dict]:
    params = list(model.parameters())
    if interleaved:  # worst case: no two neighbours in one group
        return [{"params": params[0::2]}, {"params": params[1::2], "lr": 3e-3}]
    half = len(params) // 2
    return [{"params": params[:half]}, {"params": params[half:], "lr": 3e-3}]


def runs_equal_pieces(configs: tuple[str, ...]) -> dict:
    """Every config trained twice, with and without runs: weights and state must be equal."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for name in configs:
        for interleaved in (False, True):
            outcome = []
            for coalesce in (True, False):
                model = _build()
                engine = shard_model(model)
                engine.optimizer_swap.coalesce = coalesce
                optimizer = OPTIMIZER_CONFIGS[name](_grouped(model, interleaved))
                _train(model, (optimizer, _NoStep()), world_size, rank, SCHEDULE)
                with engine.summon_full_params():
                    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
                steps = [
                    float(optimizer.state[p]["step"])
                    for p in model.parameters()
                    if "step" in optimizer.state.get(p, {})
                ]
                outcome.append((weights, steps))
            (with_runs, with_steps), (pieces, piece_steps) = outcome
            results[(name, interleaved)] = {
                "max_diff": max(float((with_runs[k] - pieces[k]).abs().max()) for k in pieces),
                "steps_equal": with_steps == piece_steps,
                "steps_vary": len(set(piece_steps)) > 1,  # LayerDrop skipped some params
            }
    return results


class _NoStep:
    """Stands in for the second optimizer: the first one owns every parameter here."""

    def step(self) -> None:
        pass

    def zero_grad(self) -> None:
        pass


def reductions_are_global() -> dict:
    """Whole-tensor reductions of sharded grads and weights vs the gathered tensors."""
    model = _build()
    shard_model(model)
    tokens, targets = _data(0, 0, dist.get_world_size())
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    out = {}
    for name, param in model.named_parameters():
        if param.grad is None:  # the branches: unused in this forward
            continue
        grad, full = param.grad, param.grad.full_tensor()
        out[name] = [
            (float(grad.pow(2).sum()), float(full.pow(2).sum())),
            (float(grad.mean()), float(full.mean()), float(full.abs().mean())),
            (float(grad.abs().max()), float(full.abs().max())),
            (float(grad.amin()), float(full.amin())),
            (bool(torch.isfinite(grad).all()), bool(torch.isfinite(full).all())),
            (bool((grad > 1e9).any()), bool((full > 1e9).any())),
        ]
    out["refused"] = _message(lambda: model.head.weight.sum(dim=0))
    return out


def raw_memory_writers_are_refused() -> str:
    """peft's save_pretrained outside summon_full_params: refused, never a partial file."""
    import tempfile

    import peft
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    shard_model(model)
    return _message(lambda: model.save_pretrained(tempfile.mkdtemp()))


def hidden_alias_is_refused() -> str:
    model = _build()
    object.__setattr__(model.blocks[0], "ref", model.head.weight)
    return _message(lambda: shard_model(model))


def unsharded_state_is_refused_at_step() -> str:
    """A DDP run's optimizer.state_dict() loaded straight into the sharded optimizer."""
    reference = _build()
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    tokens, targets = _data(0, 0, 1)
    F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten()).backward()
    plain.step()
    model = _build()
    shard_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(plain.state_dict())
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    return _message(optimizer.step)
