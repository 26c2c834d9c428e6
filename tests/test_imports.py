"""Import boundaries and the package's entry points, checked in fresh interpreters."""

import re
import subprocess
import sys
from pathlib import Path

import lightning_yafsdp

_LIGHTNING_MODULES = ("lightning", "pytorch_lightning", "lightning_fabric")


def _run_python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_importing_core_and_its_modules_loads_no_lightning():
    # Every module of core/, not only its __init__: a submodule that imports lightning
    # breaks the rule even if __init__ does not re-export it yet.
    probe = (
        "import importlib, pkgutil, sys\n"
        "import lightning_yafsdp.core as core\n"
        "for info in pkgutil.walk_packages(core.__path__, 'lightning_yafsdp.core.'):\n"
        "    importlib.import_module(info.name)\n"
        f"roots = {_LIGHTNING_MODULES!r}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in roots))\n"
    )
    proc = _run_python("-c", probe)

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", (
        f"lightning_yafsdp.core must stay torch-only, but importing it loaded: {proc.stdout}"
    )


def test_python_dash_m_prints_the_version():
    proc = _run_python("-m", "lightning_yafsdp", "--version")

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"yafsdp {lightning_yafsdp.__version__}"


def test_yafsdp_console_script_prints_the_version():
    script = Path(sys.executable).parent / "yafsdp"
    assert script.exists(), (
        f"no 'yafsdp' console script beside {sys.executable}: install the package into "
        "this environment (pip install -e '.[test]')"
    )
    proc = subprocess.run(
        [str(script), "--version"], capture_output=True, text=True, timeout=120, check=False
    )

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"yafsdp {lightning_yafsdp.__version__}"


def test_version_is_the_one_in_pyproject():
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"', pyproject, flags=re.MULTILINE)

    assert declared is not None
    assert lightning_yafsdp.__version__ == declared.group(1)


def test_strategy_is_registered_whichever_is_imported_first():
    orders = (
        "import lightning_yafsdp, lightning",
        "import lightning, lightning_yafsdp",
        "from lightning_yafsdp import YaFSDPStrategy\nimport lightning",
    )
    for order in orders:
        probe = (
            f"{order}\n"
            "from lightning.pytorch.strategies import StrategyRegistry\n"
            "import lightning_yafsdp\n"
            "assert 'yafsdp' in StrategyRegistry\n"
            "t = lightning.Trainer(strategy='yafsdp', accelerator='cpu', devices=1, logger=False)\n"
            "print(type(t.strategy).__name__)\n"
        )
        proc = _run_python("-c", probe)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip().splitlines()[-1] == "YaFSDPStrategy", order
