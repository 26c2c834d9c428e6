"""A checkpoint's weights as a Hugging Face model: names, ``config.json``, verified shapes.

Two kinds of checkpoint reach here:

* the built-in Llama (``lightning_yafsdp.models.llama``, what ``yafsdp train`` trains
  by default) stores our reference names (``layers.0.attention.wq.weight``). Its
  architecture comes from the run's ``config.yaml`` (``yafsdp train`` writes it in the
  run directory, beside ``checkpoints/``) or, for a checkpoint without one, from the
  user's Hugging Face config. The names are mapped onto ``LlamaForCausalLM``'s; the
  tensors need no permutation because our rotary embedding already uses HF's
  rotate_half layout ([Note: rotary layout] in ``models/llama.py``). A user's config
  must describe the same architecture (every field that changes the logits is
  compared), and ``embedding_norm``, which HF Llama lacks, is refused.
* a Hugging Face model (``model.kind: hf``) already stores HF names; its config is the
  user's, or the run's ``model.hf_path``.

Either way the result is checked against the HF model the config builds (on the meta
device, free): a name missing, unexpected or of another shape is refused before
anything is written, so ``from_pretrained`` never gets a silently random model.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_yafsdp.checkpoint.errors import name_list
from lightning_yafsdp.export.directory import ExportError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from lightning_yafsdp.config import RunConfig
    from lightning_yafsdp.models.llama import LlamaConfig

RUN_CONFIG_FILENAME = "config.yaml"

# Every name of a built-in Llama state dict has one of these forms.
_BUILTIN_MARKERS = ("tok_embeddings.weight", "layers.0.attention.wq.weight")


def find_run_config(checkpoint: str | os.PathLike) -> Path | None:
    """The ``config.yaml`` of the run that wrote ``checkpoint``, if it is where
    ``yafsdp train`` puts it: ``RUN/checkpoints/last.ckpt`` or ``RUN/hpc_ckpt_1.ckpt``."""
    checkpoint = Path(checkpoint).absolute()
    for run_dir in (checkpoint.parent.parent, checkpoint.parent):
        if (run_dir / RUN_CONFIG_FILENAME).is_file():
            return run_dir / RUN_CONFIG_FILENAME
    return None


def load_run_config(path: str | os.PathLike) -> RunConfig:
    """The model sections (``model``, ``practices``) of a run's ``config.yaml``.

    Only what fixes the architecture is read: a run whose data has moved since still
    exports.

    Raises:
        ExportError: the file is not a run config this version reads.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from lightning_yafsdp.config import RunConfig

    if not Path(path).is_file():
        raise ExportError(
            f"run config {str(path)!r} does not exist; pass the config.yaml that yafsdp train "
            "wrote in the checkpoint's run directory"
        )
    try:
        loaded = OmegaConf.load(path)
        sections = {key: loaded[key] for key in ("model", "practices") if key in loaded}
        config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), sections))
    except (OSError, ValueError, OmegaConfBaseException) as err:
        raise ExportError(
            f"{str(path)!r} is not a run config this version can read ({err}); pass the "
            "config.yaml of the run that wrote the checkpoint with --run-config"
        ) from err
    assert isinstance(config, RunConfig)
    return config


def to_hugging_face(
    state: dict[str, torch.Tensor],
    *,
    run_config: RunConfig | None,
    hf_config: PretrainedConfig | None,
) -> tuple[dict[str, torch.Tensor], PretrainedConfig]:
    """Map ``state`` (names as stored, prefix stripped) onto a Hugging Face model.

    Args:
        state: the checkpoint's weights.
        run_config: the run's config (``load_run_config``), None when unknown.
        hf_config: a user's config to write; None builds it (built-in Llama) or takes
            the run's ``model.hf_path`` (HF model).

    Returns:
        ``(state under HF names, the config to write as config.json)``.

    Raises:
        ExportError: what cannot be converted, naming it and the fix.
    """
    builtin = (
        run_config.model.kind == "llama"
        if run_config is not None
        else any(marker in state for marker in _BUILTIN_MARKERS)
    )
    if builtin:
        state, config = _builtin_llama_to_hf(state, run_config=run_config, hf_config=hf_config)
    else:
        config = hf_config if hf_config is not None else _config_of_hf_run(run_config)
    return _checked_against(config, state), config


def load_hf_config(source: Any) -> PretrainedConfig:
    """A ``PretrainedConfig`` from one, a dict with ``model_type``, or a local directory
    (or ``config.json``) path; never downloads."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return copy.deepcopy(source)  # the export may set its dtype: not the caller's object
    if isinstance(source, dict):
        fields = dict(source)
        return AutoConfig.for_model(fields.pop("model_type", "llama"), **fields)
    path = Path(source)
    try:
        return AutoConfig.from_pretrained(
            path.parent if path.name == "config.json" else path, local_files_only=True
        )
    except (OSError, ValueError) as err:
        raise ExportError(
            f"no Hugging Face config at {str(path)!r} ({type(err).__name__}); pass a local "
            "directory holding config.json"
        ) from err


# -- built-in Llama ---------------------------------------------------------------------------


def _builtin_llama_to_hf(
    state: dict[str, torch.Tensor],
    *,
    run_config: RunConfig | None,
    hf_config: PretrainedConfig | None,
) -> tuple[dict[str, torch.Tensor], PretrainedConfig]:
    from lightning_yafsdp.models.llama import hf_llama_config, llama_to_hf_state_dict

    if run_config is not None:
        from lightning_yafsdp.training.models import llama_config

        llama = llama_config(run_config)
    elif hf_config is not None:
        llama = _llama_config_from_hf(hf_config)
    else:
        raise ExportError(
            "the checkpoint holds the built-in Llama, but no config.yaml of its run was found "
            "(yafsdp train writes it in the run directory, beside checkpoints/); pass "
            "--run-config RUN/config.yaml or --hf-config DIR"
        )
    if llama.embedding_norm or "embedding_norm.weight" in state:
        raise ExportError(
            "the model was trained with practices.embedding_norm=true, an RMSNorm after the "
            "token embedding that Hugging Face LlamaForCausalLM does not have, so it cannot be "
            "exported for from_pretrained; export without --hf/--hf-config to keep our names"
        )
    generated = hf_llama_config(llama)
    if hf_config is not None:
        _check_same_architecture(hf_config, generated)
    try:
        hf_state = llama_to_hf_state_dict(state, llama)
    except ValueError as err:
        raise ExportError(f"{err} (is --run-config the config of this checkpoint's run?)") from err
    return hf_state, hf_config if hf_config is not None else generated


# HF config fields that change a Llama's logits (rope theta is compared separately).
_ARCHITECTURE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
)


def _check_same_architecture(user: PretrainedConfig, ours: PretrainedConfig) -> None:
    differences = [
        f"{field}={getattr(user, field, None)!r} (the model has {getattr(ours, field)!r})"
        for field in _ARCHITECTURE_FIELDS
        if getattr(user, field, None) != getattr(ours, field)
    ]
    if _rope(user) != _rope(ours):
        differences.append(f"rope={_rope(user)} (the model has {_rope(ours)})")
    if differences:
        raise ExportError(
            "the --hf-config does not describe the trained model: "
            + "; ".join(differences)
            + ". Fix those fields, or use --hf to write the model's own config"
        )


def _rope(config: PretrainedConfig) -> tuple[str, float]:
    """(rope type, theta) under transformers 4 (rope_theta, rope_scaling) or 5
    (rope_parameters)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = parameters.get("rope_type") or scaling.get("rope_type") or "default"
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    return kind, float(theta) if theta is not None else float("nan")


def _llama_config_from_hf(config: PretrainedConfig) -> LlamaConfig:
    from lightning_yafsdp.models.llama import LlamaConfig

    if getattr(config, "model_type", None) != "llama":
        raise ExportError(
            f"the checkpoint holds the built-in Llama but --hf-config is a "
            f"{getattr(config, 'model_type', None)!r} config; pass a Llama config or "
            "--run-config RUN/config.yaml"
        )
    return LlamaConfig(
        vocab_size=config.vocab_size,
        dim=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads,
        ffn_hidden_dim=config.intermediate_size,
        max_seq_len=config.max_position_embeddings,
        rope_theta=_rope(config)[1],
        norm_eps=config.rms_norm_eps,
        tie_embeddings=bool(config.tie_word_embeddings),
    )


# -- Hugging Face model -----------------------------------------------------------------------


def _config_of_hf_run(run_config: RunConfig | None) -> PretrainedConfig:
    if run_config is None or not run_config.model.hf_path:
        raise ExportError(
            "--hf needs the model's Hugging Face config and no config.yaml of the run was "
            "found beside the checkpoint; pass --hf-config DIR (a local model or config "
            "directory) or --run-config RUN/config.yaml"
        )
    path = run_config.model.hf_path
    if not Path(path).is_dir():
        raise ExportError(
            f"the run's model.hf_path {path!r} is not a directory here (relative paths are "
            "read from the current directory); pass --hf-config DIR"
        )
    return load_hf_config(path)


# -- the check every export passes ------------------------------------------------------------


def _checked_against(
    config: PretrainedConfig, state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``state`` without tied aliases, once it fits the model ``config`` builds exactly."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as err:
        raise ExportError(f"transformers cannot build a causal LM from the config: {err}") from err
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    aliases = _tied_aliases(model)
    untied = [
        alias
        for alias, source in aliases.items()
        if alias in state and source in state and not torch.equal(state[alias], state[source])
    ]
    if untied:
        raise ExportError(
            f"the config ties {name_list(untied)} to another weight, but the checkpoint holds "
            "different values for them; pass the config of the model that was trained"
        )
    state = {name: t for name, t in state.items() if name not in aliases}
    missing = sorted(set(expected) - set(state) - set(aliases))
    unexpected = sorted(set(state) - set(expected))
    reshaped = sorted(
        f"{name} {tuple(t.shape)} vs {expected[name]}"
        for name, t in state.items()
        if name in expected and tuple(t.shape) != expected[name]
    )
    for problem, names in (
        ("lacks weights the config's model has", missing),
        ("has weights the config's model lacks", unexpected),
        ("has weights of other shapes than the config's model", reshaped),
    ):
        if names:
            raise ExportError(
                f"the checkpoint {problem}: {name_list(names, limit=5)}; pass the config of "
                "the model that was trained (--hf-config DIR or --run-config RUN/config.yaml)"
            )
    return state


def _tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Alias -> source for parameters that are another name's tensor (``lm_head.weight``
    when tied): ``from_pretrained`` ties them back, as for ``save_pretrained``'s output."""
    first_name: dict[int, str] = {}
    aliases = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first_name:
            aliases[name] = first_name[id(parameter)]
        else:
            first_name[id(parameter)] = name
    return aliases


# -- the tokenizer ------------------------------------------------------------------------------


def write_tokenizer(out_dir: Path, run_config: RunConfig | None) -> str:
    """Write the run's tokenizer into a Hugging Face export; return a line saying what.

    [Note: exported tokenizer] ``data.tokenizer: byte`` (UTF-8 bytes, token id = byte
    value, vocab 256, no special tokens) becomes a ``tokenizers`` byte-level BPE with
    no merges whose 256 tokens are the bytes in id order, so ``AutoTokenizer``
    encodes and decodes exactly as training did. A local tokenizer directory is
    loaded and saved again. A run whose config is unknown gets no tokenizer (which
    one trained it cannot be known); the line says so and how to pass the config.
    """
    if run_config is None:
        return (
            "no tokenizer written: the run's config.yaml was not found beside the "
            "checkpoint, so its data.tokenizer is unknown; pass --run-config FILE"
        )
    spec = run_config.data.tokenizer
    tokenizer = _byte_tokenizer() if spec == "byte" else _local_tokenizer(spec)
    tokenizer.save_pretrained(out_dir)
    what = "the byte tokenizer (vocab 256)" if spec == "byte" else f"the tokenizer of {spec}"
    return f"wrote {what} to {out_dir}: AutoTokenizer.from_pretrained({str(out_dir)!r})"


def _byte_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    as_char = bytes_to_unicode()  # byte value -> the printable character BPE stores
    vocab = {as_char[byte]: byte for byte in range(256)}
    model = models.BPE(vocab=vocab, merges=[])
    tokenizer = Tokenizer(model)
    # No regex split and no prefix space: the text's bytes, one token each, in order.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False)


def _local_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ExportError(
            f"the run's data.tokenizer={path!r} is not a local directory here, so no "
            "tokenizer can be written; run the export where it is, or copy it in"
        )
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
