"""Every strategy argument is checked when the strategy is built, in one line.

[Note: arguments checked in the constructor] (lightning_yafsdp/adapters/arguments.py).
The bad values are listed in tests/strategy_arguments.py; each is tried on the Trainer's
and on Fabric's ``YaFSDPStrategy``, in this process (no rank is launched): a refusal
after launch would cost seconds and pages of tracebacks, and a value never refused
trains the wrong thing. What needs the run's size is refused by ``Trainer(...)`` /
``Fabric(...)``, which know the devices before they launch anything.
"""

from __future__ import annotations

import warnings
from datetime import timedelta

import lightning as L
import lightning.pytorch as pl
import pytest
import torch
from omegaconf import ListConfig
from torch import nn

from lightning_yafsdp import YaFSDPStrategy
from lightning_yafsdp.adapters.hosts import OversubscribedWarning, usable_cores
from lightning_yafsdp.fabric import YaFSDPStrategy as FabricYaFSDPStrategy
from tests.strategy_arguments import CONSTRUCTOR, WORLD_SIZE, label

STRATEGIES = {"trainer": YaFSDPStrategy, "fabric": FabricYaFSDPStrategy}


def _assert_one_line(error: BaseException, expected: str) -> None:
    message = str(error)
    assert "\n" not in message, message
    assert expected in message, message


@pytest.mark.parametrize("front_door", sorted(STRATEGIES))
@pytest.mark.parametrize(
    ("kwargs", "expected"), CONSTRUCTOR, ids=[label(k) for k, _ in CONSTRUCTOR]
)
def test_a_bad_argument_is_refused_by_the_constructor_in_one_line(front_door, kwargs, expected):
    with pytest.raises((TypeError, ValueError)) as info:
        STRATEGIES[front_door](**kwargs)
    _assert_one_line(info.value, expected)


@pytest.mark.parametrize(
    ("kwargs", "run", "expected"), WORLD_SIZE, ids=[label({**k, **r}) for k, r, _ in WORLD_SIZE]
)
def test_an_argument_the_world_size_rules_out_is_refused_before_launch(kwargs, run, expected):
    with pytest.raises(ValueError) as info:
        pl.Trainer(strategy=YaFSDPStrategy(**kwargs), accelerator="cpu", **run)
    _assert_one_line(info.value, expected)
    with pytest.raises(ValueError) as info:
        L.Fabric(strategy=FabricYaFSDPStrategy(**kwargs), accelerator="cpu", **run)
    _assert_one_line(info.value, expected)


@pytest.mark.parametrize(
    ("written", "canonical"),
    [
        ({"reduce_dtype": "float32"}, {"reduce_dtype": torch.float32}),
        ({"reduce_dtype": "fp32"}, {"reduce_dtype": torch.float32}),
        ({"reduce_dtype": "bfloat16"}, {"reduce_dtype": torch.bfloat16}),
        ({"reduce_dtype": "BF16"}, {"reduce_dtype": torch.bfloat16}),
        ({"reduce_dtype": torch.bfloat16}, {"reduce_dtype": torch.bfloat16}),
        ({"timeout": 90}, {"timeout": timedelta(seconds=90)}),
        ({"timeout": 1.5}, {"timeout": timedelta(seconds=1.5)}),
        ({"timeout": timedelta(minutes=2)}, {"timeout": timedelta(minutes=2)}),
        ({"norm_classes": "torch.nn.LayerNorm"}, {"norm_classes": nn.LayerNorm}),
        ({"norm_classes": ["torch.nn.RMSNorm"]}, {"norm_classes": (nn.RMSNorm,)}),
        ({"norm_classes": ()}, {"norm_classes": ()}),
        ({"device_mesh": [2, 1]}, {"device_mesh": (2, 1)}),
        ({"process_group_backend": "GLOO"}, {"process_group_backend": "gloo"}),
        ({"activation_checkpointing": range(2)}, {"activation_checkpointing": [0, 1]}),
        ({"units": ListConfig(["model.layers.0"])}, {"units": ["model.layers.0"]}),
        ({"device_mesh": ListConfig([1, 2])}, {"device_mesh": (1, 2)}),
    ],
    ids=lambda d: label(d),
)
def test_yaml_spellings_are_accepted_and_stored_canonically(written, canonical):
    for strategy in STRATEGIES.values():
        options = strategy(**written).options
        for name, value in canonical.items():
            stored = getattr(options, name)
            assert stored == value and type(stored) is type(value), (name, stored)


def test_the_backend_the_strategy_connects_with_is_the_canonical_spelling():
    assert YaFSDPStrategy(process_group_backend="Gloo").process_group_backend == "gloo"
    assert FabricYaFSDPStrategy(process_group_backend="Gloo").process_group_backend == "gloo"


def test_more_cpu_ranks_than_cores_is_warned_by_trainer_and_fabric_before_launch() -> None:
    # A plain Trainer(...)/Fabric(...) hears it too, not only `yafsdp train`.
    cores = usable_cores()
    for build in (
        lambda d: pl.Trainer(strategy=YaFSDPStrategy(), accelerator="cpu", devices=d),
        lambda d: L.Fabric(strategy=FabricYaFSDPStrategy(), accelerator="cpu", devices=d),
    ):
        with pytest.warns(OversubscribedWarning) as caught:
            build(cores + 1)
        (warning,) = caught
        assert f"{cores + 1} CPU ranks on {cores} usable core(s)" in str(warning.message)
        assert f"set devices={cores} or fewer" in str(warning.message)
        with warnings.catch_warnings():
            warnings.simplefilter("error", OversubscribedWarning)
            build(cores)
