"""Checkpoints of optimizers with several param groups (issue 11): by name, any world size, DDP.

The optimizer here is what users write: three AdamW groups over the model's own
parameters (attention matrices, other matrices, vectors), each with its own lr
and weight decay, a per-step StepLR that changes every group's lr, and one
parameter that no step ever uses (it never gets a grad, so it has no optimizer
state, as under DDP). Every run is a real Trainer on gloo ranks.

Data: every optimizer step covers the same 6 rows whatever the world size (6 //
world rows per rank, DistributedSampler without shuffling), so a run at 2 ranks
and one at 3 are the same optimisation up to float round-off, and a checkpoint
saved at one world size can be checked against a straight run at the other.
The saves are taken at the end of the first epoch (3 steps), where Lightning
resumes exactly (see tests/test_strategy_checkpoint.py).

Three spawns do every fit and return plain facts: ``_runs_at_3`` (straight runs
and saves at 3 ranks), ``_runs_at_2`` (straight runs and saves at 2 ranks, under
yafsdp and DDP, and every resume that lands at 2 ranks), ``_resumes_at_3``.
"""

from __future__ import annotations

import gc
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_yafsdp import YaFSDPStrategy
from lightning_yafsdp.checkpoint import (
    CheckpointMismatchError,
    consolidate_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from tests import checkpoint_scenarios as sc
from tests.distributed import dist_run
from tests.lightning_models import CausalLMModule, RankTaggedTokens

ROWS_PER_STEP = 6
STEPS_PER_EPOCH = 3
GROUPS = (  # (lr, weight decay) of the attention matrices, other matrices, vectors
    (1e-2, 0.1),
    (5e-3, 0.05),
    (2e-2, 0.0),
)
# yafsdp vs DDP, or 2 vs 3 ranks: the same math reduced in another order. Measured:
# yafsdp and DDP agree exactly here; across world sizes losses agree to 9e-8 and a resumed
# run's weights to 1.2e-7 (absolute) with the run it continues (see "resharding" below).
PARITY = 1e-5


class GroupedLM(CausalLMModule):
    """The shared tiny Llama with three param groups, a StepLR and an unused ``spare``.

    Args:
        seed: ``0`` builds the reference weights; another seed other weights (a
            resume must overwrite them all).
        renamed: a ``state_dict()`` override that saves every entry under ``"net/"`` +
            its name (and the matching ``load_state_dict``).
    """

    def __init__(self, seed: int = 0, *, renamed: bool = False) -> None:
        super().__init__(lr=GROUPS[0][0])
        if seed:
            torch.manual_seed(seed)
            self.model = self._build()
        torch.manual_seed(100 + seed)
        self.spare = nn.Linear(4, 4)  # never in forward: no grad, no optimizer state
        self.renamed = renamed
        self.saved_keys: list[list[str]] = []

    def configure_optimizers(self):
        named = list(self.named_parameters())
        attention = [p for n, p in named if ".attention." in n]
        matrices = [p for n, p in named if ".attention." not in n and p.dim() >= 2]
        vectors = [p for n, p in named if p.dim() < 2]
        groups = [
            {"params": params, "lr": lr, "weight_decay": wd}
            for params, (lr, wd) in zip((attention, matrices, vectors), GROUPS, strict=True)
        ]
        optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def state_dict(self, *args, **kwargs):
        state = super().state_dict(*args, **kwargs)
        return {f"net/{k}": v for k, v in state.items()} if self.renamed else state

    def load_state_dict(self, state_dict, *args, **kwargs):
        if self.renamed:
            state_dict = {k.removeprefix("net/"): v for k, v in state_dict.items()}
        return super().load_state_dict(state_dict, *args, **kwargs)

    def on_save_checkpoint(self, checkpoint) -> None:
        self.saved_keys.append(sorted(checkpoint["state_dict"]))


class _SaveAtEpochEnd(pl.Callback):
    """``trainer.save_checkpoint(path)`` after step 3 (the first epoch's last batch)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == STEPS_PER_EPOCH:
            trainer.save_checkpoint(self.path)


def _loader() -> DataLoader:
    world = torch.distributed.get_world_size()
    dataset = RankTaggedTokens(ROWS_PER_STEP * STEPS_PER_EPOCH)
    sampler = DistributedSampler(dataset, shuffle=False)
    return DataLoader(dataset, batch_size=ROWS_PER_STEP // world, sampler=sampler)


def _strategy(kind: str):
    if kind == "ddp":
        return DDPStrategy(find_unused_parameters=True, timeout=timedelta(seconds=120))
    return YaFSDPStrategy(state_dict_type=kind)  # "sharded" or "full"


def _fit(
    kind: str,
    *,
    steps: int,
    save: str | None = None,
    resume: str | None = None,
    callbacks: tuple = (),
    **module,
):
    """One fit; returns plain facts (``weights`` on rank 0 only)."""
    model = GroupedLM(seed=1 if resume else 0, **module)
    trainer = pl.Trainer(
        strategy=_strategy(kind),
        accelerator="cpu",
        devices=torch.distributed.get_world_size(),
        max_steps=steps,
        callbacks=[*callbacks, *([_SaveAtEpochEnd(save)] if save else [])],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,  # see _loader
    )
    trainer.fit(model, _loader(), ckpt_path=resume)
    if kind == "ddp":
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        weights = {k: v.clone() for k, v in trainer.strategy.engine.full_state_dict().items()}
    facts = {
        "losses": list(model.train_losses),
        "weights": weights if trainer.is_global_zero else None,
        "global_step": trainer.global_step,
        "groups": [(g["lr"], g["weight_decay"]) for g in trainer.optimizers[0].param_groups],
        "saved_keys": model.saved_keys,
    }
    del model, trainer
    gc.collect()  # no DDP module may outlive the process group
    return facts


# -- the spawned runs ------------------------------------------------------------------------


def _runs_at_3(root: str) -> dict:
    return {
        "straight": _fit("sharded", steps=6, save=f"{root}/w3-sharded"),
        "first-full": _fit("full", steps=3, save=f"{root}/w3-full.ckpt"),
    }


def _runs_at_2(root: str) -> dict:
    facts = {
        "straight": _fit("sharded", steps=6, save=f"{root}/w2-sharded"),
        "first-full": _fit("full", steps=3, save=f"{root}/w2-full.ckpt"),
        "ddp": _fit("ddp", steps=6, save=f"{root}/w2-ddp.ckpt"),
        "renamed": _fit("sharded", steps=6, save=f"{root}/w2-renamed", renamed=True),
    }
    for name, kind, path in (
        ("from-w3-sharded", "sharded", "w3-sharded"),
        ("from-w3-full", "sharded", "w3-full.ckpt"),
        ("from-ddp", "sharded", "w2-ddp.ckpt"),
        ("ddp-from-full", "ddp", "w2-full.ckpt"),
    ):
        facts[name] = _fit(kind, steps=6, resume=f"{root}/{path}")
    facts["renamed-resumed"] = _fit("sharded", steps=6, resume=f"{root}/w2-renamed", renamed=True)
    facts.update(_weight_averaging_runs(root))
    return facts


def _weight_averaging_runs(root: str) -> dict:
    """``WeightAveraging`` saves our weights as ``"current_model_state"``, its own as weights."""

    def fit(kind: str, **options) -> dict:
        return _fit(kind, callbacks=(WeightAveraging(use_buffers=True),), **options)["weights"]

    return {
        "averaged": fit("sharded", steps=6, save=f"{root}/w2-averaged"),
        "averaged-ddp": fit("ddp", steps=6),
        "averaged-first-full": fit("full", steps=3, save=f"{root}/w2-averaged-full.ckpt"),
        "averaged-from-sharded": fit("sharded", steps=6, resume=f"{root}/w2-averaged"),
        "averaged-from-full": fit("sharded", steps=6, resume=f"{root}/w2-averaged-full.ckpt"),
    }


def _resumes_at_3(root: str) -> dict:
    return {
        "from-w2-sharded": _fit("sharded", steps=6, resume=f"{root}/w2-sharded"),
        "from-w2-full": _fit("sharded", steps=6, resume=f"{root}/w2-full.ckpt"),
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("param-groups-ckpt")


@pytest.fixture(scope="module")
def at_3(root) -> list[dict]:
    return dist_run(3, _runs_at_3, str(root), timeout_s=300)


@pytest.fixture(scope="module")
def at_2(root, at_3) -> list[dict]:
    return dist_run(2, _runs_at_2, str(root), timeout_s=600)


@pytest.fixture(scope="module")
def resumed_at_3(root, at_2) -> list[dict]:
    return dist_run(3, _resumes_at_3, str(root), timeout_s=300)


# -- helpers -------------------------------------------------------------------------------


def _global_losses(ranks: list[dict], run: str) -> torch.Tensor:
    """Per-step loss of all 6 rows: every rank has as many rows, so the mean of the ranks'."""
    return torch.tensor([r[run]["losses"] for r in ranks]).mean(0)


def _assert_resumed(resumed: dict, resumed_ranks, run: str, *, losses_of, weights_of):
    """Steps 4-6 of ``run`` match a straight run's, and so do its final weights and lrs.

    Args:
        losses_of: ``(ranks, run)`` whose steps 4-6 the resumed losses must match.
        weights_of: the straight run whose final weights and lrs must match.
    """
    ranks, reference = losses_of
    torch.testing.assert_close(
        _global_losses(resumed_ranks, run),
        _global_losses(ranks, reference)[STEPS_PER_EPOCH:],
        rtol=PARITY,
        atol=0,
    )
    assert resumed["global_step"] == weights_of["global_step"] == 6
    assert resumed["groups"] == weights_of["groups"]  # every group's lr (scheduled) and decay
    assert resumed["weights"].keys() == weights_of["weights"].keys()
    for name, value in weights_of["weights"].items():
        scale = value.abs().max()
        assert (resumed["weights"][name] - value).abs().max() <= PARITY * scale, name


# -- resharding ------------------------------------------------------------------------------
# The weights of a run saved at N ranks and resumed at M are compared with the straight
# run at N: AdamW's first steps amplify the round-off of another reduction order (2 vs 3
# ranks: up to 6e-5 on some weights after 6 steps, losses within 1e-7), which the resumed
# run inherits from its first 3 steps; the steps after the resume add 1e-7 at most.


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_three_group_checkpoint_of_2_ranks_resumes_at_3_ranks(at_2, at_3, resumed_at_3, kind):
    run = f"from-w2-{kind}"
    resumed = resumed_at_3[0][run]
    _assert_resumed(resumed, resumed_at_3, run, losses_of=(at_3, "straight"),
                    weights_of=at_2[0]["straight"])  # fmt: skip


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_three_group_checkpoint_of_3_ranks_resumes_at_2_ranks(at_2, at_3, kind):
    run = f"from-w3-{kind}"
    _assert_resumed(at_2[0][run], at_2, run, losses_of=(at_2, "straight"),
                    weights_of=at_3[0]["straight"])  # fmt: skip


def test_the_scheduled_lrs_of_all_three_groups_are_what_they_were(at_2):
    decayed = [(lr * 0.5**3, wd) for lr, wd in GROUPS]  # StepLR(2, 0.5) after 6 steps
    assert at_2[0]["straight"]["groups"] == decayed
    assert at_2[0]["from-w3-sharded"]["groups"] == decayed


# -- DDP -------------------------------------------------------------------------------------


def test_a_ddp_checkpoint_with_three_groups_resumes_under_yafsdp_like_ddp_goes_on(at_2):
    _assert_resumed(at_2[0]["from-ddp"], at_2, "from-ddp", losses_of=(at_2, "ddp"),
                    weights_of=at_2[0]["ddp"])  # fmt: skip


def test_a_yafsdp_full_checkpoint_resumes_under_ddp(at_2):
    _assert_resumed(at_2[0]["ddp-from-full"], at_2, "ddp-from-full",
                    losses_of=(at_2, "straight"), weights_of=at_2[0]["straight"])  # fmt: skip


def test_the_full_file_holds_torch_optimizer_layout_with_names(root, at_2):
    checkpoint = torch.load(root / "w2-full.ckpt", weights_only=False)
    model = GroupedLM()
    names = [n for n, _ in model.named_parameters()]
    optimizer = checkpoint["optimizer_states"][0]
    groups = optimizer["param_groups"]
    after_3_steps = [(lr * 0.5, wd) for lr, wd in GROUPS]  # StepLR(2, 0.5)
    assert [(g["lr"], g["weight_decay"]) for g in groups] == after_3_steps
    flat_ids = [i for g in groups for i in g["params"]]
    assert flat_ids == list(range(len(names)))  # torch numbers them group by group
    id_of = {n: i for g in groups for i, n in zip(g["params"], g["param_names"], strict=True)}
    assert sorted(id_of) == sorted(names)
    spare = {id_of["spare.weight"], id_of["spare.bias"]}
    assert set(optimizer["state"]) == set(range(len(names))) - spare  # unused: no state
    shapes = dict(model.named_parameters())
    for group in groups:
        for i, name in zip(group["params"], group["param_names"], strict=True):
            if i in optimizer["state"]:
                assert optimizer["state"][i]["exp_avg"].shape == shapes[name].shape, name
    # DDP's own optimizer accepts it as it is
    fresh = GroupedLM().configure_optimizers()["optimizer"]
    fresh.load_state_dict(optimizer)


def test_the_sharded_checkpoint_names_every_group_with_its_hyperparameters(root, at_2):
    checkpoint = consolidate_checkpoint(root / "w2-sharded")
    groups = checkpoint["optimizer_0"]["param_groups"]
    assert [(g["lr"], g["weight_decay"], g["betas"]) for g in groups] == [
        (lr * 0.5, wd, (0.9, 0.95)) for lr, wd in GROUPS
    ]
    model = GroupedLM()
    attention = [n for n, _ in model.named_parameters() if ".attention." in n]
    assert groups[0]["params"] == attention
    state = checkpoint["optimizer_0"]["state"]
    assert "spare.weight" not in state and "model.norm.weight" in state
    assert state["model.norm.weight"]["exp_avg"].shape == (64,)
    assert checkpoint["yafsdp"]["format_version"] == 2


# -- WeightAveraging ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_weight_averaging_checkpoint_resumes_both_the_model_and_its_average(at_2, kind):
    # At the end of fit the callback copies the average into the model: the final weights
    # are the average of all 6 steps' weights, right only if both were restored.
    straight, resumed = at_2[0]["averaged"], at_2[0][f"averaged-from-{kind}"]
    assert all(torch.equal(resumed[k], v) for k, v in straight.items())
    ddp = at_2[0]["averaged-ddp"]
    assert all((ddp[k] - v).abs().max() <= PARITY * v.abs().max() for k, v in straight.items())


def test_weight_averaging_writes_the_current_weights_sharded(root, at_2):
    checkpoint = consolidate_checkpoint(root / "w2-averaged")
    current, averaged = checkpoint["current_model_state"], checkpoint["model"]
    assert current.keys() == averaged.keys()
    name = "model.output.weight"
    assert current[name].shape == averaged[name].shape == (256, 64)
    assert not torch.equal(current[name], averaged[name])


# -- state_dict() and on_save_checkpoint ----------------------------------------------------------


def test_a_state_dict_override_is_what_is_saved_and_it_resumes_exactly(root, at_2):
    consolidated = consolidate_checkpoint(root / "w2-renamed", weights_only=True)["model"]
    assert consolidated and all(k.startswith("net/") for k in consolidated)
    straight, resumed = at_2[0]["renamed"], at_2[0]["renamed-resumed"]
    assert straight["losses"][STEPS_PER_EPOCH:] == resumed["losses"]
    assert all(torch.equal(resumed["weights"][k], v) for k, v in straight["weights"].items())


def test_on_save_checkpoint_sees_the_same_state_dict_keys_on_every_rank_as_under_ddp(at_2):
    yafsdp = [rank["straight"]["saved_keys"] for rank in at_2]
    ddp = [rank["ddp"]["saved_keys"] for rank in at_2]
    assert yafsdp[0] and yafsdp == ddp == [yafsdp[0]] * len(at_2)


# -- torch level: two optimizers, index-keyed files that do not fit --------------------


def _three_groups(model) -> list[dict]:
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if ".attention." in n], "weight_decay": 0.1},
        {"params": [p for n, p in named if ".attention." not in n and p.dim() >= 2],
         "weight_decay": 0.1},
        {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]  # fmt: skip


class _TwoOptimizers:
    """SGD with momentum on the attention matrices, AdamW on the rest, stepped together."""

    def __init__(self, model) -> None:
        named = list(model.named_parameters())
        self.optimizers = [
            torch.optim.SGD([p for n, p in named if ".attention." in n], lr=0.1, momentum=0.9),
            torch.optim.AdamW([p for n, p in named if ".attention." not in n], lr=1e-2),
        ]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()


def _two_optimizers_round_trip(root: str) -> dict:
    model, engine, _ = sc.build_sharded()
    both = _TwoOptimizers(model)
    sc.train_steps(model, both, range(3))
    save_checkpoint(f"{root}/two", engine, optimizers=both.optimizers)
    save_checkpoint(f"{root}/two.pt", engine, optimizers=both.optimizers, state_dict_type="full")
    sc.train_steps(model, both, range(3, 6))
    expected = sc.full_weights(engine)
    result = {}
    for name in ("two", "two.pt"):
        model, engine, _ = sc.build_sharded(seed=1)
        both = _TwoOptimizers(model)
        load_checkpoint(f"{root}/{name}", engine, optimizers=both.optimizers)
        sc.train_steps(model, both, range(3, 6))
        result[name] = sc.max_difference(sc.full_weights(engine), expected)
    return result


def _index_keyed_errors(root: str) -> dict:
    """A DDP-style file with three groups, loaded into optimizers it does not fit."""
    plain = sc.build_llama()
    optimizer = torch.optim.AdamW(_three_groups(plain), lr=1e-2)
    sc.train_steps(plain, optimizer, range(1))
    saved = optimizer.state_dict()
    named = {id(p): n for n, p in plain.named_parameters()}
    for group, current in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        group["param_names"] = [named[id(p)] for p in current["params"]]
    if torch.distributed.get_rank() == 0:  # one writer: two ranks writing one file tear it
        state = {"state_dict": plain.state_dict(), "optimizer_states": [saved]}
        torch.save(state, f"{root}/ddp.pt")
    torch.distributed.barrier()
    errors = {}
    for label, build in (
        ("two groups", lambda m: [g for g in _three_groups(m)[:2]]),
        ("other order", lambda m: [_three_groups(m)[1], _three_groups(m)[0],
                                   _three_groups(m)[2]]),
        ("same sizes, other names", lambda m: _swapped_first_two(_three_groups(m))),
    ):  # fmt: skip
        model, engine, _ = sc.build_sharded(seed=1)
        before = sc.full_weights(engine)
        try:
            load_checkpoint(f"{root}/ddp.pt", engine, optimizers=[torch.optim.AdamW(build(model))])
        except CheckpointMismatchError as error:
            errors[label] = str(error)
        errors[f"{label}: untouched"] = sc.max_difference(sc.full_weights(engine), before) == 0
    return errors


def _swapped_first_two(groups: list[dict]) -> list[dict]:
    params = list(groups[0]["params"])
    params[0], params[1] = params[1], params[0]  # wq and wk of layer 0
    return [{**groups[0], "params": params}, *groups[1:]]


def _torch_level_runs(root: str) -> dict:
    return {
        **_two_optimizers_round_trip(root),
        "errors": _index_keyed_errors(root),
    }


@pytest.fixture(scope="module")
def torch_level(tmp_path_factory) -> dict:
    return dist_run(2, _torch_level_runs, str(tmp_path_factory.mktemp("torch-level")))[0]


@pytest.mark.parametrize("name", ["two", "two.pt"])
def test_two_optimizers_over_parts_of_the_model_resume_exactly(torch_level, name):
    assert torch_level[name] == 0.0


def test_an_index_keyed_state_that_does_not_fit_is_refused_and_nothing_is_loaded(torch_level):
    errors = torch_level["errors"]
    labels = ("two groups", "other order", "same sizes, other names")
    assert all(errors[f"{label}: untouched"] for label in labels)
    assert "has 3 param groups, the current optimizer 2" in errors["two groups"]
    assert (
        "param group 0, parameter 0: the checkpoint has 'layers.0.attention.wq.weight'"
        in (errors["other order"])
    )
    swapped = "the checkpoint has 'layers.0.attention.wq.weight' there, the current optimizer "
    assert swapped + "'layers.0.attention.wk.weight'" in errors["same sizes, other names"]
