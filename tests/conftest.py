"""Suite-wide pytest hooks."""

import os

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips tests marked ``cuda`` on machines without a usable CUDA device."""
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


def _restore_environment(saved: dict[str, str]) -> None:
    # Key by key, not clear() + update(): the environment is never empty in between.
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@pytest.fixture(autouse=True, scope="module")
def _module_environment_restored():
    """Every test module ends with the environment it started with.

    A fit inside the test process leaves variables behind (``seed_everything`` sets
    ``PL_GLOBAL_SEED``, which Lightning's strategies then use to reseed every rank), and
    each later ``dist_run`` rank and launched script would inherit them: a test's
    verdict would depend on which tests ran before it. Module-scoped fixtures (a fit
    shared by a module's tests) run before any test's own restore, hence this one too.
    """
    saved = dict(os.environ)
    yield
    _restore_environment(saved)


@pytest.fixture(autouse=True)
def _environment_restored():
    """Every test ends with the environment it started with (see above)."""
    saved = dict(os.environ)
    yield
    _restore_environment(saved)
