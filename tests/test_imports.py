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


_IMPORTS_LIGHTNING = re.compile(r"^(?:from lightning[. ]|import lightning\b)", re.MULTILINE)
# What the two strategy modules import: only these can be half-built when Lightning's
# import (which they started) registers "yafsdp" and imports the strategy modules.
_STRATEGY_IMPORTS = ("adapters", "fabric", "precision.py")


def _strategy_dependencies_importing_lightning() -> list[str]:
    root = Path(lightning_yafsdp.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in _STRATEGY_IMPORTS and _IMPORTS_LIGHTNING.search(path.read_text()):
            name = ".".join(("lightning_yafsdp", *path.relative_to(root).with_suffix("").parts))
            found.append(name.removesuffix(".__init__"))
    return found


def _registered_after_importing_first(module: str) -> subprocess.Popen:
    probe = (
        "import importlib, sys\n"
        "importlib.import_module(sys.argv[1])\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "registries = (StrategyRegistry, STRATEGY_REGISTRY)\n"
        "print([type(registry.get('yafsdp')).__module__ for registry in registries])\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", probe, module],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_every_module_the_strategies_import_can_be_imported_first():
    # ``from lightning_yafsdp.precision import YaFSDPPrecision`` as a program's first
    # import failed with a circular ImportError ([Note: registering while our own modules
    # load]). Each module first, in its own interpreter, two at a time (two cores).
    modules = _strategy_dependencies_importing_lightning()
    assert {"lightning_yafsdp.precision", "lightning_yafsdp.adapters.options"} <= set(modules)
    expected = "['lightning_yafsdp.strategy', 'lightning_yafsdp.fabric.strategy']"
    for pair in (modules[i : i + 2] for i in range(0, len(modules), 2)):
        running = {module: _registered_after_importing_first(module) for module in pair}
        for module, proc in running.items():
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"import {module} first:\n{err[-2000:]}"
            assert out.strip().splitlines()[-1] == expected, (module, out)


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
