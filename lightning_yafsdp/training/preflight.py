"""Checks of a recipe's inputs before any process starts or any file is written.

``load_config`` checks the recipe itself (keys, types, ranges); this module
checks what the recipe points at on this machine: the local Hugging Face
directory, the data files, the tokenizer, the devices, the logger's package.
Each problem is one :class:`ConfigError` line naming the key, what was found
and the fix, so ``yafsdp train`` and ``yafsdp estimate`` fail in a second
instead of a traceback from every rank after the launch.
"""

from __future__ import annotations

import glob
from pathlib import Path

from lightning_yafsdp.config import ConfigError, RunConfig


def check_inputs(config: RunConfig, *, training: bool) -> list[str]:
    """Raise on the first missing input; return warnings worth printing.

    Args:
        config: The resolved recipe.
        training: True for ``yafsdp train`` (data, devices and logger are checked
            too); False for ``yafsdp estimate`` (only the model is built).

    Raises:
        ConfigError: naming the key, the missing input and the fix.
    """
    _check_model(config)
    if not training:
        return []
    _check_data(config)
    _check_devices(config)
    _check_output_dir(config)
    from lightning_yafsdp.adapters.hosts import oversubscription_warning
    from lightning_yafsdp.training.metrics_log import check_logger_available

    check_logger_available(config.trainer.logger)
    warning = oversubscription_warning(
        _ranks_per_node(config), config.trainer.accelerator, setting="trainer.devices"
    )
    return [warning] if warning else []


def _check_model(config: RunConfig) -> None:
    model = config.model
    if model.kind != "hf":
        return
    path = Path(str(model.hf_path))
    if not (path / "config.json").is_file():
        found = "does not exist" if not path.exists() else "has no config.json"
        raise ConfigError(
            f"model.hf_path={model.hf_path!r} {found}: it must be a local Hugging Face model "
            "directory (save_pretrained writes one); nothing is downloaded"
        )
    weights = [*path.glob("*.safetensors"), *path.glob("*.bin"), *path.glob("*.index.json")]
    if model.pretrained and not weights:
        raise ConfigError(
            f"model.pretrained=true but {path} holds no weights (*.safetensors / *.bin): "
            "save them there, or set model.pretrained=false to train from the config alone"
        )


def _check_data(config: RunConfig) -> None:
    data = config.data
    if data.source == "bin":
        if not Path(str(data.path)).is_file():
            raise ConfigError(
                f"data.path={data.path!r} does not exist: data.source=bin reads a token file "
                "written by `yafsdp prepare --output FILE`"
            )
    elif data.source in ("text", "jsonl") and not glob.glob(str(data.path)):
        raise ConfigError(
            f"data.path={data.path!r} matches no file or directory (data.source={data.source})"
        )
    if data.tokenizer != "byte" and not Path(data.tokenizer).is_dir():
        raise ConfigError(
            f"data.tokenizer={data.tokenizer!r} is neither 'byte' nor a local tokenizer "
            "directory (tokenizer.save_pretrained writes one); nothing is downloaded"
        )


def _check_devices(config: RunConfig) -> None:
    import torch

    trainer = config.trainer
    wants_gpu = trainer.accelerator in ("gpu", "cuda")
    if wants_gpu and not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.accelerator={trainer.accelerator!r} but torch sees no CUDA GPU "
            f"(torch {torch.__version__}): set trainer.accelerator=cpu, or install a CUDA build"
        )
    on_cpu = trainer.accelerator == "cpu" or not torch.cuda.is_available()
    if trainer.devices == "-1" and on_cpu:
        raise ConfigError(
            "trainer.devices=-1 means every GPU, and this run is on CPU: give a number of "
            "processes, e.g. trainer.devices=2"
        )


def _check_output_dir(config: RunConfig) -> None:
    """``trainer.output_dir`` can hold a run folder: a probe folder is created in its
    nearest existing ancestor and removed (nothing stays behind)."""
    import tempfile

    wanted = Path(config.trainer.output_dir).absolute()
    existing = next(p for p in (wanted, *wanted.parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is a file")
        Path(tempfile.mkdtemp(prefix=".yafsdp-probe-", dir=existing)).rmdir()
    except OSError as err:
        raise ConfigError(
            f"trainer.output_dir={config.trainer.output_dir!r} cannot hold run folders "
            f"({err}): set trainer.output_dir to a writable directory"
        ) from err


def _ranks_per_node(config: RunConfig) -> int:
    devices = config.trainer.lightning_devices()
    if devices == "auto":
        return 1 if config.trainer.accelerator == "cpu" else max(1, _gpu_count())
    return int(devices) if int(devices) > 0 else max(1, _gpu_count())


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()
