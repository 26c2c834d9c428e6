"""Each front door refuses the other one's ``YaFSDPStrategy`` with one line naming the right class.

The Trainer takes ``lightning_yafsdp.YaFSDPStrategy``, Fabric takes
``lightning_yafsdp.fabric.YaFSDPStrategy``; Lightning's own error for the wrong one names
neither ([Note: the other front door's strategy], ``_registration.py``).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import lightning.pytorch as pl
import pytest

import lightning_yafsdp
import lightning_yafsdp.fabric
from lightning_yafsdp._registration import STRATEGY_CHECK_METHOD, STRATEGY_CHECKS

REPO = Path(__file__).resolve().parents[1]


def test_fabric_given_the_trainers_strategy_names_the_fabric_class() -> None:
    with pytest.raises(ValueError) as refused:
        L.Fabric(strategy=lightning_yafsdp.YaFSDPStrategy(zero_stage=2), accelerator="cpu")
    assert str(refused.value) == (
        "Fabric(strategy=lightning_yafsdp.YaFSDPStrategy(...)) got the Trainer's strategy "
        "class, and Fabric runs only lightning.fabric strategies: use "
        "lightning_yafsdp.fabric.YaFSDPStrategy(...) with the same arguments, or "
        'strategy="yafsdp"'
    )


def test_the_trainer_given_fabrics_strategy_names_the_trainer_class() -> None:
    with pytest.raises(ValueError) as refused:
        pl.Trainer(strategy=lightning_yafsdp.fabric.YaFSDPStrategy(), accelerator="cpu")
    assert str(refused.value) == (
        "Trainer(strategy=lightning_yafsdp.fabric.YaFSDPStrategy(...)) got Fabric's strategy "
        "class, and the Trainer runs only lightning.pytorch strategies: use "
        'lightning_yafsdp.YaFSDPStrategy(...) with the same arguments, or strategy="yafsdp"'
    )


def test_each_front_door_still_takes_its_own_class_and_other_strategies() -> None:
    assert isinstance(
        pl.Trainer(strategy=lightning_yafsdp.YaFSDPStrategy(), accelerator="cpu").strategy,
        lightning_yafsdp.YaFSDPStrategy,
    )
    fabric = L.Fabric(strategy=lightning_yafsdp.fabric.YaFSDPStrategy(), accelerator="cpu")
    assert isinstance(fabric.strategy, lightning_yafsdp.fabric.YaFSDPStrategy)
    with pytest.raises(ValueError, match="invalid strategy name"):  # Lightning's own check
        L.Fabric(strategy=object(), accelerator="cpu")


@pytest.mark.parametrize("front_door", sorted(STRATEGY_CHECKS))
def test_lightning_still_checks_the_strategy_in_the_method_we_wrap(front_door: str) -> None:
    module_name, class_name = STRATEGY_CHECKS[front_door]
    connector = getattr(importlib.import_module(module_name), class_name, None)
    assert connector is not None, (
        f"{module_name}.{class_name} is gone in this Lightning release: find where the "
        "connector checks `strategy` and update STRATEGY_CHECKS in _registration.py"
    )
    check = getattr(connector, STRATEGY_CHECK_METHOD, None)
    assert getattr(check, "_yafsdp_names_the_right_class", False), (
        f"{class_name}.{STRATEGY_CHECK_METHOD} is gone or unwrapped: the wrong front door's "
        "strategy gets Lightning's generic error again; update _registration.py"
    )


@pytest.mark.parametrize("front_door", sorted(STRATEGY_CHECKS))
def test_the_strategy_is_found_when_lightning_passes_it_by_position(front_door: str) -> None:
    module_name, class_name = STRATEGY_CHECKS[front_door]
    check = getattr(
        getattr(importlib.import_module(module_name), class_name), STRATEGY_CHECK_METHOD
    )
    other = {"lightning.pytorch": lightning_yafsdp.fabric, "lightning.fabric": lightning_yafsdp}
    wrong = other[front_door].YaFSDPStrategy()
    with pytest.raises(ValueError, match="strategy class, and"):
        check(object(), wrong, "cpu", "32-true", None)  # no connector is needed to refuse


def test_the_refusal_holds_when_lightning_yafsdp_is_imported_before_lightning() -> None:
    script = (
        "import lightning_yafsdp\n"
        "import lightning as L\n"
        "try:\n"
        "    L.Fabric(strategy=lightning_yafsdp.YaFSDPStrategy(), accelerator='cpu')\n"
        "except ValueError as err:\n"
        "    print(err)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "use lightning_yafsdp.fabric.YaFSDPStrategy(...)" in result.stdout
