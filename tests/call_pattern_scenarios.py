"""Call patterns real models use, run sharded (``shard_model``) and as an unsharded reference.

Both sides build the same small model from the same seed and run the same plain
torch loop; a sharded rank trains on its slice of each global batch, the reference
backpropagates every rank's slice in turn and divides the summed grads by the world
size (what DDP computes). SGD without momentum: a parameter that gets no grad in a
step gets a zero grad in a flat shard and None under DDP, which SGD treats alike
(AdamW would not: per-parameter None grads are a later issue).
Module-level functions so that ``dist_run`` can pickle them.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_yafsdp.core import shard_model

DIM = 16
CLASSES = 5
GLOBAL_BATCH = 8
N_UNITS = 4


@dataclass(frozen=True)
class Pattern:
    """One way of calling the model; every field has the plain-torch meaning."""

    model: str = "net"  # "net" (below) or "hf_llama" (transformers, 2 layers, tiny)
    calls: str = "plain"  # "plain", "shared" (layers.1 called 3x), "layerdrop", "per_rank_drop"
    # None, "torch_reentrant" (around each unit call), "engine" (non-reentrant, hooks
    # outside), "hf_reentrant" (gradient_checkpointing_enable with use_reentrant=True)
    checkpoint: str | None = None
    outputs: str = "tensor"  # "tensor", "dataclass", "object", "opaque" (refused)
    no_grad_pass: bool = False  # a no-grad forward of the same model before backward (DPO)
    # step 1: a unit's forward raises; step 2: the loss raises; step 3: a unit's backward
    # raises (each attempt is retried, as an out-of-memory handler or BatchSizeFinder does)
    failures: bool = False
    aux_first_step: bool = False  # a root parameter that gets a grad only in step 0
    extra_on_even: bool = False  # a unit parameter that gets a grad only in even steps
    two_backwards: bool = False  # two losses of one forward, two backward calls (retain_graph)
    accumulation: int = 1
    zero_stage: int = 3
    steps: int = 4


PATTERNS = {
    "shared_module": Pattern(calls="shared"),
    "shared_module_zero2": Pattern(calls="shared", zero_stage=2),
    "layerdrop": Pattern(calls="layerdrop"),
    "layerdrop_in_accumulation": Pattern(calls="layerdrop", accumulation=2),
    "unused_params": Pattern(aux_first_step=True, extra_on_even=True),
    "unused_params_in_accumulation": Pattern(
        aux_first_step=True, extra_on_even=True, accumulation=2
    ),
    "torch_reentrant_checkpoint": Pattern(checkpoint="torch_reentrant"),
    "no_grad_pass": Pattern(no_grad_pass=True),
    "no_grad_pass_checkpointed": Pattern(no_grad_pass=True, checkpoint="engine"),
    "no_grad_pass_reentrant": Pattern(no_grad_pass=True, checkpoint="torch_reentrant"),
    "dataclass_outputs": Pattern(outputs="dataclass"),
    "object_outputs": Pattern(outputs="object"),
    "exceptions": Pattern(failures=True, steps=5),
    "shared_reentrant_no_grad": Pattern(
        calls="shared", checkpoint="torch_reentrant", no_grad_pass=True
    ),
    "two_backwards_per_step": Pattern(two_backwards=True),
    "two_backwards_checkpointed": Pattern(two_backwards=True, checkpoint="engine"),
    "hf_reentrant_checkpoint": Pattern(model="hf_llama", checkpoint="hf_reentrant", steps=3),
    "hf_reentrant_no_grad_pass": Pattern(
        model="hf_llama", checkpoint="hf_reentrant", no_grad_pass=True, steps=3
    ),
}


@dataclass
class Carried:
    """A block's output as a dataclass (pytree cannot see into it)."""

    hidden: torch.Tensor
    scale: float = 1.0


class CarriedObject:
    """A block's output as a plain object with attributes."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


class FrozenPair(tuple):
    """A tuple subclass with no attributes: pytree and the engine cannot see into it."""

    __slots__ = ()


class SimulatedOutOfMemory(RuntimeError):
    pass


def _unwrap(x):
    if isinstance(x, (Carried, CarriedObject)):
        return x.hidden
    if isinstance(x, FrozenPair):
        return x[0]
    return x


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise SimulatedOutOfMemory("simulated out of memory inside a unit's backward")


class Block(nn.Module):
    def __init__(self, outputs: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.extra = nn.Linear(DIM, DIM)
        self.outputs = outputs
        self.fail_next_forward = False
        self.fail_next_backward = False

    def forward(self, x, use_extra: bool = False):
        h = _unwrap(x)
        h = h + self.fc2(F.gelu(self.fc1(self.norm(h))))
        if self.fail_next_forward:
            self.fail_next_forward = False
            raise SimulatedOutOfMemory("simulated out of memory inside a unit's forward")
        if use_extra:
            h = h + self.extra(h)
        if self.fail_next_backward:
            self.fail_next_backward = False
            h = _RaiseInBackward.apply(h)
        if self.outputs == "dataclass":
            return Carried(h)
        if self.outputs == "object":
            return CarriedObject(h)
        if self.outputs == "opaque":
            return FrozenPair((h, h))
        return h


class Net(nn.Module):
    def __init__(self, pattern: Pattern) -> None:
        super().__init__()
        self.pattern = pattern
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(Block(pattern.outputs) for _ in range(N_UNITS))
        self.head = nn.Linear(DIM, CLASSES)
        self.aux_head = nn.Linear(DIM, CLASSES)
        self.reentrant = pattern.checkpoint == "torch_reentrant"

    def call_order(self, step: int, rank: int) -> list[int]:
        calls = self.pattern.calls
        if calls == "shared":
            return [0, 1, 1, 1, 2, 3]
        if calls == "layerdrop" and step % 2 == 1:
            return [0, 3]
        if calls == "per_rank_drop" and step == 1 and rank == 1:
            return [0, 1, 3]
        return list(range(N_UNITS))

    def forward(self, x: torch.Tensor, step: int = 0, rank: int = 0) -> torch.Tensor:
        h = self.inp(x)
        use_extra = self.pattern.extra_on_even and step % 2 == 0
        for index in self.call_order(step, rank):
            layer = self.layers[index]
            if self.reentrant and torch.is_grad_enabled():
                h = checkpoint(layer, h, use_extra, use_reentrant=True)
            else:
                h = layer(h, use_extra)
        h = _unwrap(h)
        out = self.head(h)
        if not (self.pattern.aux_first_step and step > 0):
            out = out + self.aux_head(h)
        return out


class HFNet(nn.Module):
    """A tiny Hugging Face Llama behind the loop's ``(x, step, rank)`` signature."""

    def __init__(self, pattern: Pattern) -> None:
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            attn_implementation="eager",
            use_cache=False,
        )
        self.hf = transformers.LlamaForCausalLM(config)
        if pattern.checkpoint == "hf_reentrant":
            self.hf.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": True}
            )
        self.hf.train()

    def forward(self, x: torch.Tensor, step: int = 0, rank: int = 0) -> torch.Tensor:
        return self.hf(input_ids=x).logits.flatten(0, 1)


def build(pattern: Pattern) -> nn.Module:
    torch.manual_seed(7)
    return HFNet(pattern) if pattern.model == "hf_llama" else Net(pattern)


def unit_names(pattern: Pattern) -> list[str]:
    if pattern.model == "hf_llama":
        return ["hf.model.layers.0", "hf.model.layers.1"]
    return [f"layers.{i}" for i in range(N_UNITS)]


def batches(pattern: Pattern) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    if pattern.model == "hf_llama":
        shape = (GLOBAL_BATCH, 6)
        return [
            (
                torch.randint(0, 64, shape, generator=generator),
                torch.randint(0, 64, shape, generator=generator),
            )
            for _ in range(pattern.steps)
        ]
    return [
        (
            torch.randn(GLOBAL_BATCH, DIM, generator=generator),
            torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=generator),
        )
        for _ in range(pattern.steps)
    ]


def losses_of(model, pattern, x, y, *, step, rank) -> list[torch.Tensor]:
    """The losses to backpropagate one after the other (two: the graph is retained)."""
    if not pattern.two_backwards:
        return [loss_of(model, pattern, x, y, step=step, rank=rank)]
    out = model(x, step, rank)
    return [F.cross_entropy(out, y), 0.05 * out.pow(2).mean()]


def loss_of(model, pattern, x, y, *, step, rank, fail_in_loss=False) -> torch.Tensor:
    out = model(x, step, rank)
    if pattern.model == "hf_llama":
        y = y.flatten()
    loss = F.cross_entropy(out, y)
    if pattern.no_grad_pass:  # a DPO-style reference pass of the same model
        with torch.no_grad():
            reference = model(x, step, rank)
        loss = loss + 0.1 * (out * reference.softmax(-1)).sum(-1).mean()
    if fail_in_loss:
        raise ValueError("simulated failure between forward and backward")
    return loss


def train(model, optimizer, pattern, *, ranks, world_size, on_step_start=None) -> list[float]:
    """The plain loop both sides run; returns the global loss of every step."""
    per_rank = GLOBAL_BATCH // world_size
    micro = per_rank // pattern.accumulation
    losses = []
    for step, (x, y) in enumerate(batches(pattern)):
        if on_step_start is not None:
            on_step_start(step)
        step_loss = torch.zeros(())
        for rank in ranks:
            for i in range(pattern.accumulation):
                part = slice(rank * per_rank + i * micro, rank * per_rank + (i + 1) * micro)
                sub_step = step * pattern.accumulation + i
                if pattern.failures and len(ranks) == 1:
                    _fail_once(model, pattern, x[part], y[part], step=sub_step, rank=rank)
                losses_now = losses_of(model, pattern, x[part], y[part], step=sub_step, rank=rank)
                for position, loss in enumerate(losses_now):
                    retain = position + 1 < len(losses_now)
                    (loss / pattern.accumulation).backward(retain_graph=retain)
                    step_loss += loss.detach() / pattern.accumulation
        if len(ranks) > 1:
            with torch.no_grad():
                for param in model.parameters():
                    if param.grad is not None:
                        param.grad.div_(len(ranks))
        optimizer.step()
        optimizer.zero_grad()
        if len(ranks) < world_size:
            dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world_size)
    return losses


def _fail_once(model, pattern, x, y, *, step, rank) -> None:
    """Sharded side only: the failed attempts an OOM retry or a bad batch produce."""
    if step == 1:
        model.layers[2].fail_next_forward = True
        try:
            loss_of(model, pattern, x, y, step=step, rank=rank)
        except SimulatedOutOfMemory:
            pass
        else:
            raise AssertionError("the simulated failure did not happen")
    if step == 2:
        try:
            loss_of(model, pattern, x, y, step=step, rank=rank, fail_in_loss=True)
        except ValueError:
            pass
    if step == 3:
        model.layers[1].fail_next_backward = True
        try:
            loss_of(model, pattern, x, y, step=step, rank=rank).backward()
        except SimulatedOutOfMemory:
            pass
        else:
            raise AssertionError("the simulated failure in backward did not happen")


def run_reference(name: str, world_size: int = 2) -> tuple[list[float], dict]:
    pattern = dataclasses.replace(PATTERNS[name], checkpoint=None)  # the same math
    model = build(pattern)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = train(model, optimizer, pattern, ranks=range(world_size), world_size=world_size)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_sharded(name: str) -> dict:
    """On every rank: shard, train, record the last step, gather full weights."""
    pattern = PATTERNS[name]
    model = build(pattern)
    engine = shard_model(
        model,
        units=unit_names(pattern),
        zero_stage=pattern.zero_stage,
        activation_checkpointing="all" if pattern.checkpoint == "engine" else None,
    )
    optimizer = torch.optim.SGD(engine.sharded_parameters(), lr=0.1)
    recorder = _LastStepRecorder(engine, last_step=pattern.steps - 1)
    losses = train(
        model,
        optimizer,
        pattern,
        ranks=[dist.get_rank()],
        world_size=dist.get_world_size(),
        on_step_start=recorder.on_step_start,
    )
    recorder.stop()
    state = {k: v.detach().clone() for k, v in engine.full_state_dict().items()}
    log = recorder.log
    slots = {u.name: (u.weight_buffer.index, u.grad_buffer.index) for u in engine.units}
    engine.close()
    return {
        "losses": losses,
        "state": state,
        "log": log,
        "slots": slots,
        "reduce_scatters": Counter(e.unit for e in log if e.op == "reduce_scatter_issue"),
        "gathers": Counter(e.unit for e in log if e.op == "gather_issue"),
    }


class _LastStepRecorder:
    def __init__(self, engine, *, last_step: int) -> None:
        self.engine, self.last_step = engine, last_step
        self._context = None
        self.log = []

    def on_step_start(self, step: int) -> None:
        if step == self.last_step:
            self._context = self.engine.recording()
            self.log = self._context.__enter__()

    def stop(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self.log = list(self.log)


def run_many_sharded(names: list[str]) -> dict:
    """Several patterns in one spawn (process start-up dominates); rank 0 reports."""
    results = {name: run_sharded(name) for name in names}
    return results if dist.get_rank() == 0 else {}


# -- refusals and the collective order guard -------------------------------------------------


def refusals() -> dict[str, str]:
    """Errors raised before the first step for patterns that cannot work."""
    messages = {}
    for name, pattern in {
        "opaque_output": Pattern(outputs="opaque"),
        "per_rank_drop": Pattern(calls="per_rank_drop"),
    }.items():
        model = build(pattern)
        engine = shard_model(model, units=[f"layers.{i}" for i in range(N_UNITS)])
        optimizer = torch.optim.SGD(engine.sharded_parameters(), lr=0.1)
        started = time.monotonic()
        try:
            train(model, optimizer, pattern, ranks=[dist.get_rank()], world_size=2)
        except Exception as error:  # noqa: BLE001 - the message is the fact under test
            messages[name] = (type(error).__name__, str(error), time.monotonic() - started)
        else:
            messages[name] = ("no error", "", time.monotonic() - started)
        engine.close()
    return messages


def order_check_cost(steps: int = 30) -> dict[str, float]:
    """Milliseconds per training step with and without the order check, the exchange
    line's positions per step, and the engine's collectives per step either way."""
    pattern = Pattern()
    model = build(pattern)
    engine = shard_model(model, units=[f"layers.{i}" for i in range(N_UNITS)])
    optimizer = torch.optim.SGD(engine.sharded_parameters(), lr=0.1)
    x, y = batches(pattern)[0]
    rank = dist.get_rank()
    part = slice(rank * 4, rank * 4 + 4)

    def timed(n: int) -> float:
        dist.barrier()
        started = time.perf_counter()
        for step in range(n):
            loss_of(model, pattern, x[part], y[part], step=step, rank=rank).backward()
            optimizer.step()
            optimizer.zero_grad()
        dist.barrier()
        return (time.perf_counter() - started) * 1000 / n

    def calls_per_step() -> float:
        return sum(engine.comm_stats.calls.values()) / steps

    result = {}
    line = engine.scheduler.line
    for repeat in range(2):  # interleaved, twice, to even out noise on a shared machine
        engine.verify_collective_order(True)
        result["guard"] = type(engine.scheduler.order_guard).__name__
        timed(3)
        engine.comm_stats.reset()
        position = line.position
        result[f"on_{repeat}"] = timed(steps)
        result["positions_per_step"] = (line.position - position) / steps
        result["calls_on"] = calls_per_step()
        engine.verify_collective_order(False)
        timed(3)
        engine.comm_stats.reset()
        position = line.position
        result[f"off_{repeat}"] = timed(steps)
        result["calls_off"] = calls_per_step()
        result["positions_off"] = line.position - position
    engine.close()
    return result
