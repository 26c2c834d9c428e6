"""Hybrid sharding (HSDP): shard groups of 2 ranks, replicated, on 4 (2 x 2) CPU ranks.

Through the Trainer: ``YaFSDPStrategy(shard_size=2)`` and ``device_mesh=(2, 2)`` train
like ``strategy="ddp"`` (per-step losses, final weights) with accumulation and norm
clipping, eager and meta-device builds, ZeRO-2 and activation checkpointing. Through the
engine's checkpoint API: an HSDP checkpoint is written once per element (replica 0's
ranks only) and loads into pure sharding at 1, 3 and 4 ranks, into another shard size,
and a pure checkpoint loads into HSDP; training then continues as if uninterrupted.
(Engine-level 2 x 2 and 3 x 2 parity with many models: tests/test_core_parity.py;
traffic per group against the estimate's formula: tests/test_estimate.py.)
"""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from lightning_yafsdp import YaFSDPStrategy
from lightning_yafsdp.checkpoint import load_checkpoint, save_checkpoint
from lightning_yafsdp.models.llama import TransformerBlock
from tests import checkpoint_scenarios as sc
from tests.distributed import dist_run
from tests.lightning_models import CausalLMModule, token_loader
from tests.test_strategy import STEPS, TRAIN_ROWS, _trainer, _update_error

# [Tolerance: HSDP vs DDP] measured on this tree: losses within 4e-7 relative, weights
# within 1e-5 of their update; with the replicate all_reduce skipped (each replica
# stepping on its own half of the batch) the first loss still agrees but the weights
# are off by about 0.5 of their update.
LOSS_RTOL = 1e-6
UPDATE_RTOL = 5e-5
WEIGHT_RTOL = 1e-6  # relative to the weights themselves (meta builds)
ACROSS_MESHES = 1e-5  # absolute, on weights after 3 more steps: reduction order only


def _fit_facts(strategy, *, build: str = "eager", **trainer_options) -> dict:
    torch.manual_seed(1)  # a meta build's init seed is drawn from rank 0's generator
    model = CausalLMModule(build=build, lr=1e-3)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = _trainer(strategy, devices=4, **trainer_options)
    trainer.fit(model, token_loader(TRAIN_ROWS * 2))
    facts = {"losses": model.train_losses, "initial": initial}
    if isinstance(trainer.strategy, YaFSDPStrategy):
        mesh = trainer.strategy.mesh
        facts["mesh"] = (mesh.replicate_size, mesh.shard_size)
        # Lightning sets the environment up again for every run: the groups are kept.
        trainer.validate(model, token_loader(8), verbose=False)
        facts["mesh_kept"] = trainer.strategy.mesh is mesh is trainer.strategy.engine.mesh
        full = trainer.strategy.engine.full_state_dict()
        facts["weights"] = {k: v.clone() for k, v in full.items()}
    else:
        facts["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return facts


def _spread_warnings(hostnames: list[str]) -> list[str]:
    """The warnings about spread shard groups of a 2 x 2 fit on these (pretend) machines."""
    with (
        mock.patch("socket.gethostname", return_value=hostnames[dist.get_rank()]),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        _fit_facts(YaFSDPStrategy(shard_size=2), max_steps=1)
    return [str(w.message) for w in caught if "shard groups span" in str(w.message)]


def _trainer_runs() -> dict:
    runs = {
        "ddp": _fit_facts("ddp"),
        "hsdp": _fit_facts(YaFSDPStrategy(shard_size=2)),
        "hsdp-mesh-zero2-ckpt": _fit_facts(
            YaFSDPStrategy(
                device_mesh=(2, 2), zero_stage=2, activation_checkpointing=TransformerBlock
            )
        ),
        # A meta-device build is initialized per group from one seed: the same weights
        # for every mesh, so HSDP must equal flat sharding of the same build.
        "meta-hsdp": _fit_facts(YaFSDPStrategy(shard_size=2), build="configure_model"),
        "meta-flat": _fit_facts(YaFSDPStrategy(shard_size=4), build="configure_model"),
    }
    try:
        _fit_facts(YaFSDPStrategy(shard_size=3), max_steps=1)
    except ValueError as error:
        runs["refused"] = str(error)
    runs["warned-cyclic"] = _spread_warnings(["node-a", "node-b", "node-a", "node-b"])
    runs["warned-block"] = _spread_warnings(["node-a", "node-a", "node-b", "node-b"])
    gc.collect()  # no DDP module may outlive the process group
    return runs


@pytest.fixture(scope="module")
def trainer_runs() -> list[dict]:
    return dist_run(4, _trainer_runs, timeout_s=400)


def _assert_same_training(run: dict, ours: str, reference: str) -> None:
    assert len(run[ours]["losses"]) == STEPS * 2
    torch.testing.assert_close(
        torch.tensor(run[ours]["losses"]),
        torch.tensor(run[reference]["losses"]),
        rtol=LOSS_RTOL,
        atol=0,
    )
    if run[reference]["initial"]:
        error, where = _update_error(run, ours, reference)
        assert error <= UPDATE_RTOL, f"{where} off by {error:.3g} of its update"
        return
    # Meta-device builds: no initial weights outside the engine; relative to the weights.
    for name, expected in run[reference]["weights"].items():
        error = (run[ours]["weights"][name] - expected).norm() / expected.norm()
        assert error <= WEIGHT_RTOL, f"{name} off by {error:.3g}"


def test_hsdp_2x2_trains_like_ddp_with_accumulation_and_clipping(trainer_runs):
    for run in trainer_runs:
        assert run["hsdp"]["mesh"] == (2, 2)
        assert run["hsdp"]["mesh_kept"]
        _assert_same_training(run, "hsdp", "ddp")


def test_a_device_mesh_tuple_with_zero2_and_activation_checkpointing_trains_like_ddp(
    trainer_runs,
):
    for run in trainer_runs:
        assert run["hsdp-mesh-zero2-ckpt"]["mesh"] == (2, 2)
        _assert_same_training(run, "hsdp-mesh-zero2-ckpt", "ddp")


def test_a_meta_device_build_trains_the_same_under_hsdp_and_flat_sharding(trainer_runs):
    for run in trainer_runs:
        assert run["meta-flat"]["mesh"] == (1, 4)
        assert run["meta-hsdp"]["mesh"] == (2, 2)
        _assert_same_training(run, "meta-hsdp", "meta-flat")


def test_a_shard_size_that_does_not_divide_the_world_is_refused_with_the_divisors(
    trainer_runs,
):
    message = trainer_runs[0]["refused"]
    assert "shard_size=3 does not divide the world size 4" in message
    assert "[1, 2, 4]" in message


def test_shard_groups_numbered_across_machines_are_warned_about_once(trainer_runs):
    # Ranks 0, 2 on one machine and 1, 3 on another: shard group [0, 1] spans both.
    rank0, *others = (run["warned-cyclic"] for run in trainer_runs)
    assert len(rank0) == 1 and others == [[], [], []], (rank0, others)
    assert "2 of 2 shard groups span more machines than they need" in rank0[0]
    assert "ranks 0-1 run on 2 machines (node-a, node-b)" in rank0[0]
    assert "--distribution=block" in rank0[0] and "shard_size=4" in rank0[0]
    assert all(run["warned-block"] == [] for run in trainer_runs)


def test_which_shard_groups_need_fewer_machines():
    from lightning_yafsdp.adapters.hosts import spread_shard_groups

    block = ["a"] * 4 + ["b"] * 4
    assert spread_shard_groups(block, 4) == []
    assert spread_shard_groups(block, 8) == []  # two machines are the fewest it needs
    # Groups that straddle machines because 6 does not divide 8 are not the launcher's.
    assert spread_shard_groups([m for m in "abc" for _ in range(8)], 6) == []
    assert spread_shard_groups([m for m in "ab" for _ in range(6)], 4) == []
    assert spread_shard_groups(["a", "b"] * 4, 4) == [(0, ["a", "b"]), (4, ["a", "b"])]
    # 16-rank groups on four 8-rank machines: two machines each, or all four if cyclic.
    assert spread_shard_groups([m for m in "abcd" for _ in range(8)], 16) == []
    machines = ["a", "b", "c", "d"]
    assert spread_shard_groups(machines * 8, 16) == [(0, machines), (16, machines)]


def test_bad_mesh_arguments_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="not both"):
        YaFSDPStrategy(shard_size=2, device_mesh=(2, 2))
    with pytest.raises(ValueError, match="positive integer"):
        YaFSDPStrategy(shard_size=0)
    with pytest.raises(ValueError, match=r"\(replicas, shard_size\)"):
        YaFSDPStrategy(device_mesh=(2, 2, 2))


# -- checkpoints across meshes -------------------------------------------------------------


def _bytes_by_rank(path: str) -> dict[int, int]:
    """Bytes of the DCP data files of a checkpoint, by the rank that wrote them."""
    sizes: dict[int, int] = {}
    for file in Path(path).glob("__*_*.distcp"):
        rank = int(file.name.split("_")[2])
        sizes[rank] = sizes.get(rank, 0) + file.stat().st_size
    return sizes


def _items_by_rank(path: str) -> dict[int, list[str]]:
    """The names of the items each rank's files hold (DCP metadata)."""
    metadata = FileSystemReader(path).read_metadata()
    items: dict[int, list[str]] = {}
    for index, info in metadata.storage_data.items():
        rank = int(info.relative_path.split("_")[2])
        items.setdefault(rank, []).append(index.fqn)
    return items


def _save_on_every_mesh(root: str) -> dict:
    """On 4 ranks: save under HSDP and flat; load each into the other meshes; continue."""
    facts: dict = {}
    for name, shard_size in (("hsdp", 2), ("flat", 4)):
        model, engine, optimizer = sc.build_sharded(shard_size=shard_size)
        sc.train_steps(model, optimizer, range(3))
        save_checkpoint(f"{root}/{name}", engine, optimizers=[optimizer])
        save_checkpoint(f"{root}/{name}.pt", engine, optimizers=[optimizer], state_dict_type="full")
        facts[f"{name}-saved"] = sc.full_weights(engine)
        sc.train_steps(model, optimizer, range(3, 6))
        facts[f"{name}-continued"] = sc.full_weights(engine)
    for source in ("hsdp", "flat", "hsdp.pt"):
        for shard_size in (1, 2, 4):
            facts[(source, shard_size)] = _load_and_continue(f"{root}/{source}", shard_size)
    if dist.get_rank() == 0:
        facts["bytes"] = {name: _bytes_by_rank(f"{root}/{name}") for name in ("hsdp", "flat")}
        facts["items"] = _items_by_rank(f"{root}/hsdp")
    return facts


def _load_and_continue(path: str, shard_size: int | None = None) -> dict:
    model, engine, optimizer = sc.build_sharded(seed=1, shard_size=shard_size)
    load_checkpoint(path, engine, optimizers=[optimizer])
    loaded = sc.full_weights(engine)
    sc.train_steps(model, optimizer, range(3, 6))
    return {"loaded": loaded, "continued": sc.full_weights(engine)}


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("hsdp-ckpt")
    return root, dist_run(4, _save_on_every_mesh, str(root), timeout_s=240)[0]


def test_only_the_first_replica_writes_weights_and_optimizer_state(saved_at_4):
    _, facts = saved_at_4

    # Ranks 2 and 3 (the second replica) hold the same boxes as ranks 0 and 1; DCP's
    # deduplication keeps the lowest rank's, so they write no weight and no per-element
    # state tensor (at most objects and scalars, if any).
    def is_sharded(name: str) -> bool:
        return name.startswith("model.") or (".state." in name and not name.endswith(".step"))

    for rank in (2, 3):
        tensors = [n for n in facts["items"].get(rank, []) if is_sharded(n)]
        assert tensors == [], f"rank {rank} wrote {tensors[:3]}"
    hsdp, flat = facts["bytes"]["hsdp"], facts["bytes"]["flat"]
    assert hsdp.get(2, 0) + hsdp.get(3, 0) < 0.15 * (hsdp[0] + hsdp[1])
    # Together the ranks write what the flat checkpoint holds, not twice that.
    assert sum(hsdp.values()) < 1.1 * sum(flat.values())


def test_inspect_tells_the_mesh_a_checkpoint_was_written_under(saved_at_4):
    from rich.console import Console

    from lightning_yafsdp.checkpoint import inspect_checkpoint
    from lightning_yafsdp.cli.checkpoints import render_inspection

    root, _ = saved_at_4
    for name in ("hsdp", "hsdp.pt"):
        info = inspect_checkpoint(root / name)
        assert (info["world_size"], info["shard_size"]) == (4, 2), name
        console = Console(width=200, record=True)
        console.print(render_inspection(info))
        assert "4 rank(s): 2 replicas x 2 sharded ranks" in console.export_text()
    assert inspect_checkpoint(root / "flat")["shard_size"] == 4


@pytest.mark.parametrize("source", ["hsdp", "flat", "hsdp.pt"])
@pytest.mark.parametrize("shard_size", [1, 2, 4])
def test_a_checkpoint_loads_into_every_mesh_of_4_ranks_and_training_continues(
    saved_at_4, source, shard_size
):
    _, facts = saved_at_4
    writer = source.removesuffix(".pt")
    result = facts[(source, shard_size)]
    assert sc.max_difference(result["loaded"], facts[f"{writer}-saved"]) == 0.0
    assert sc.max_difference(result["continued"], facts[f"{writer}-continued"]) < ACROSS_MESHES


def test_hsdp_and_flat_sharding_train_the_same_weights(saved_at_4):
    _, facts = saved_at_4
    assert sc.max_difference(facts["hsdp-continued"], facts["flat-continued"]) < ACROSS_MESHES


@pytest.mark.parametrize("world_size", [1, 3])
def test_an_hsdp_checkpoint_loads_at_another_world_size_and_training_continues(
    saved_at_4, world_size
):
    root, facts = saved_at_4
    result = dist_run(world_size, _load_and_continue, str(root / "hsdp"), timeout_s=120)[0]
    assert sc.max_difference(result["loaded"], facts["hsdp-saved"]) == 0.0
    assert sc.max_difference(result["continued"], facts["hsdp-continued"]) < ACROSS_MESHES


# -- Fabric ------------------------------------------------------------------------------------


def _fabric_runs() -> dict:
    from lightning_yafsdp.fabric import YaFSDPStrategy as FabricYaFSDPStrategy
    from tests import fabric_loops as fl

    runs = {}
    for name, strategy in (("ddp", "ddp"), ("hsdp", FabricYaFSDPStrategy(shard_size=2))):
        fabric = fl.make_fabric(strategy)
        model = fabric.setup_module(fl.build_llama())
        optimizer = fabric.setup_optimizers(fl.decay_split_adamw(model))
        norms: list[float] = []
        losses = fl.train_steps(fabric, model, optimizer, range(fl.STEPS), norms)
        runs[name] = {"losses": losses, "norms": norms, "weights": fl.full_weights(model)}
    runs["initial"] = fl.build_llama().state_dict()
    gc.collect()
    return runs


def test_fabric_hsdp_2x2_equals_ddp_losses_clipping_norms_and_weights():
    runs = dist_run(4, _fabric_runs, timeout_s=240)
    for run in runs:
        ours, ddp = run["hsdp"], run["ddp"]
        torch.testing.assert_close(
            torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), rtol=LOSS_RTOL, atol=0
        )
        # The clipping norm counts each element once: a replica counted twice would
        # make it sqrt(2) times DDP's.
        torch.testing.assert_close(
            torch.tensor(ours["norms"]), torch.tensor(ddp["norms"]), rtol=LOSS_RTOL, atol=0
        )
        for name, expected in ddp["weights"].items():
            update = (expected - run["initial"][name]).norm()
            error = (ours["weights"][name] - expected).norm() / update
            assert error <= UPDATE_RTOL, f"{name} off by {error:.3g} of its update"


# -- the default, and the estimate ---------------------------------------------------------


def test_the_default_shards_inside_one_node_on_several_nodes_and_over_all_ranks_on_one():
    from lightning_yafsdp.core.comm.mesh import default_shard_size

    assert default_shard_size(None, world_size=16, num_nodes=2) == 8
    assert default_shard_size(None, world_size=8, num_nodes=1) == 8
    assert default_shard_size(4, world_size=16, num_nodes=2) == 4
    with pytest.raises(ValueError, match="does not divide the world size 16"):
        default_shard_size(3, world_size=16, num_nodes=2)


def test_the_estimate_of_a_multi_node_run_is_that_of_one_node_plus_the_replicate_traffic():
    from lightning_yafsdp.config import ConfigError, load_config
    from lightning_yafsdp.estimate import estimate

    nodes = ["trainer.devices=2", "trainer.num_nodes=2"]
    hybrid = estimate(load_config(None, nodes))
    one_node = estimate(load_config(None, ["trainer.devices=2"]))
    flat = estimate(load_config(None, [*nodes, "strategy.shard_size=4"]))
    assert (hybrid.world_size, hybrid.shard_size, flat.shard_size) == (4, 2, 4)
    assert hybrid.engine_report() == one_node.engine_report()
    assert flat.master_shards < hybrid.master_shards
    shards = sum(g.shard_numel for g in (*hybrid.units, *hybrid.residents))
    assert hybrid.comm_per_step["replicate_all_reduce"] == shards * 4 * hybrid.micro_batches
    assert "replicate_all_reduce" not in flat.comm_per_step
    with pytest.raises(ConfigError, match=r"shard_size=3 does not divide the world size 4"):
        estimate(load_config(None, [*nodes, "strategy.shard_size=3"]))
