"""The recipe schema: what ``yafsdp train`` and ``yafsdp estimate`` read.

A recipe is a YAML file merged over these dataclasses with omegaconf, then the
command line's ``key=value`` overrides over that. Every default here is the
embedded default recipe (``recipes/tiny-cpu.yaml`` spells the same values out):
a tiny Llama trained on the Python standard library's own sources, byte-level, on
two CPU processes, in about two and a half minutes. So ``yafsdp train`` with no recipe
works from any directory, with nothing to download.

[Note: config validation] Everything that can be checked without starting a
process is checked in :func:`load_config`: unknown keys (with the closest valid
key), wrong types (omegaconf), and values out of range (each dataclass's
``__post_init__``). The launcher starts processes only after that.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

__all__ = [
    "ConfigError",
    "CurriculumConfig",
    "DataConfig",
    "DivergenceGuardConfig",
    "ModelConfig",
    "OptimConfig",
    "PracticesConfig",
    "RunConfig",
    "ScheduleConfig",
    "StrategyConfig",
    "ThermometerConfig",
    "TrainerConfig",
    "find_recipe",
    "load_config",
    "to_yaml",
]


class ConfigError(ValueError):
    """A recipe or override that cannot work; the message names the key and the fix."""


def _check_choice(section: str, name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ConfigError(
            f"{section}.{name}={value!r} is not one of {', '.join(map(repr, choices))}"
        )


# Lightning's short precision spellings (``_PRECISION_INPUT_STR_ALIAS_CONVERSION`` in
# lightning.fabric.connector; a test checks they agree), kept here so that reading a
# recipe does not import Lightning.
PRECISION_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", "64": "64-true"}
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


def _check_positive(section: str, **values: Any) -> None:
    for name, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{section}.{name} must be > 0, got {value!r}")


# --------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    """Which model to train.

    Attributes:
        kind: ``"llama"`` (this package's reference decoder) or ``"hf"`` (a Hugging
            Face causal LM from a local directory; needs the ``hf`` extra).
        preset: Llama preset (``LlamaConfig.from_name``): tiny, debug-50m, llama-1b,
            llama3-8b, llama2-7b, llama2-70b, llama3-70b.
        hf_path: ``kind="hf"``: a local directory with ``config.json`` (and weights
            when ``pretrained``). Never downloads.
        pretrained: ``kind="hf"``: load the weights in ``hf_path``; False initialises
            from the config alone (on the meta device, one unit at a time).
        vocab_size, dim, n_layers, n_heads, n_kv_heads, ffn_hidden_dim, max_seq_len,
        rope_theta, norm_eps, tie_embeddings: override the preset's field (None keeps
            the preset's value).
        loss_chunk_size: Tokens per chunk of the output head and the cross-entropy
            ([Note: chunked loss]): ``"auto"`` (default: vocabularies of 32768 or more
            in chunks of at most 2 GiB of fp32 logits, 4096 tokens at Llama-3's 128256;
            smaller ones whole), ``"none"`` (the whole logits; also ``0`` or ``false``)
            or a number of tokens. Reference model only; ``kind="hf"`` computes the
            whole logits.
    """

    kind: str = "llama"
    preset: str = "tiny"
    hf_path: str | None = None
    pretrained: bool = False
    vocab_size: int | None = None
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_hidden_dim: int | None = None
    max_seq_len: int | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None
    tie_embeddings: bool | None = None
    loss_chunk_size: str = "auto"

    def __post_init__(self) -> None:
        _check_choice("model", "kind", self.kind, ("llama", "hf"))
        chunk = self.loss_chunk_size = str(self.loss_chunk_size)
        if chunk in ("False", "false"):  # YAML reads `off` and `false` as a boolean
            chunk = self.loss_chunk_size = "none"
        if chunk not in ("auto", "none") and not _is_count(chunk):
            raise ConfigError(
                f"model.loss_chunk_size={chunk!r}: use 'auto', 'none' or a number of tokens"
            )
        if self.kind == "hf" and chunk not in ("auto", "none", "0"):
            raise ConfigError(
                f"model.loss_chunk_size={chunk} needs model.kind='llama': a Hugging Face "
                "model computes its logits inside its own forward; use model.loss_chunk_size"
                "=none (or auto) with model.kind='hf'"
            )
        if self.kind == "hf" and not self.hf_path:
            raise ConfigError(
                "model.kind='hf' needs model.hf_path: a local directory holding config.json "
                "(and the weights if model.pretrained=true); nothing is downloaded"
            )
        if self.kind == "llama":
            from lightning_yafsdp.models.llama import LLAMA_CONFIGS

            if self.preset not in LLAMA_CONFIGS:
                close = difflib.get_close_matches(self.preset, LLAMA_CONFIGS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"model.preset={self.preset!r} is not a Llama preset{hint} "
                    f"(valid: {', '.join(LLAMA_CONFIGS)})"
                )

    def llama_overrides(self) -> dict[str, Any]:
        """The preset fields this section changes (those not None)."""
        names = (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_hidden_dim",
            "max_seq_len",
            "rope_theta",
            "norm_eps",
            "tie_embeddings",
        )
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


@dataclass
class DataConfig:
    """Where tokens come from and how they are batched.

    Attributes:
        source: ``"stdlib"`` (this Python's standard library sources: present on every
            machine), ``"text"`` (a UTF-8 file, a directory of ``*.txt``/``*.md``/
            ``*.py`` files, or a glob), ``"jsonl"`` (one JSON object a line, text in
            ``jsonl_field``) or ``"bin"`` (a flat uint16/uint32 token file written by
            ``yafsdp prepare``).
        path: File, directory or glob for text/jsonl/bin; unused for stdlib.
        jsonl_field: JSON key that holds the text. Defaults to ``"text"``.
        tokenizer: ``"byte"`` (UTF-8 bytes, vocab 256) or a local Hugging Face
            tokenizer directory.
        max_bytes: Cap on the text read from stdlib/text/jsonl sources (bytes).
        seq_len: Tokens per training sequence (the model reads ``seq_len`` tokens and
            predicts the next ``seq_len``).
        batch_size: Sequences per micro-batch per rank.
        val_fraction: Fraction of the token stream (its tail) held out for validation.
        num_workers: DataLoader worker processes per rank.
        seed: Order of files for the stdlib source (deterministic for a given seed).
    """

    source: str = "stdlib"
    path: str | None = None
    jsonl_field: str = "text"
    tokenizer: str = "byte"
    max_bytes: int = 4_000_000
    seq_len: int = 128
    batch_size: int = 16
    val_fraction: float = 0.05
    num_workers: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        _check_choice("data", "source", self.source, ("stdlib", "text", "jsonl", "bin"))
        if self.source != "stdlib" and not self.path:
            raise ConfigError(f"data.source={self.source!r} needs data.path (file, dir or glob)")
        _check_positive("data", max_bytes=self.max_bytes, seq_len=self.seq_len)
        _check_positive("data", batch_size=self.batch_size)
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0, got {self.num_workers}")


@dataclass
class OptimConfig:
    """AdamW.

    Attributes:
        name: The optimizer: ``"adamw"`` (the only one so far).
        lr: Peak learning rate.
        weight_decay: Decoupled weight decay of matrices (norm gains get none).
        betas: Adam's (beta1, beta2).
        eps: Adam's epsilon.
        grad_clip: Clip the global gradient norm to this; 0 turns clipping off.
    """

    name: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        _check_choice("optim", "name", self.name, ("adamw",))
        _check_positive("optim", lr=self.lr, eps=self.eps)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {self.betas}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError("optim.grad_clip and optim.weight_decay must be >= 0")


@dataclass
class ScheduleConfig:
    """Learning-rate schedule over ``trainer.max_steps`` optimizer steps.

    Attributes:
        warmup_steps: Linear warm-up from 0 to ``optim.lr``.
        decay: ``"cosine"``, ``"linear"`` or ``"constant"`` after warm-up.
        min_lr_ratio: Final LR as a fraction of ``optim.lr``.
        total_steps: Optimizer steps the warm-up and decay span (the LR stays at the
            floor after them). None: ``trainer.max_steps`` of a fresh run; a resumed run
            keeps the length its checkpoint was trained with (raising
            ``trainer.max_steps`` on a resume does not re-stretch the decay; set this
            to re-stretch it).
    """

    warmup_steps: int = 30
    decay: str = "cosine"
    min_lr_ratio: float = 0.1
    total_steps: int | None = None

    def __post_init__(self) -> None:
        _check_choice("schedule", "decay", self.decay, ("cosine", "linear", "constant"))
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("schedule.warmup_steps must be >= 0, min_lr_ratio in [0, 1]")
        if self.total_steps is not None and self.total_steps < 1:
            raise ConfigError(
                f"schedule.total_steps={self.total_steps} must be >= 1 (or null: trainer.max_steps)"
            )


@dataclass
class TrainerConfig:
    """Lightning Trainer options and where outputs go.

    Attributes:
        accelerator: ``"cpu"``, ``"gpu"``/``"cuda"`` or ``"auto"``.
        devices: Processes per node: a count >= 1, ``"auto"`` or ``"-1"`` (every GPU;
            refused on CPU).
        num_nodes: Number of nodes (SLURM sets the rest).
        precision: ``"32-true"``, ``"bf16-mixed"`` or ``"bf16-true"``; Lightning's
            aliases ``32`` and ``bf16`` (= ``bf16-mixed``) are accepted and written
            out in full.
        max_steps: Optimizer steps to run.
        accumulate_grad_batches: Micro-batches per optimizer step.
        val_check_interval: Validate every this many training batches.
        limit_val_batches: Validation batches per rank each time (0: no validation).
        log_every_n_steps: Metric logging period (steps).
        logger: ``"csv"`` (default), ``"tensorboard"`` or ``"none"``.
        output_dir: Runs go to ``output_dir/run_name``.
        run_name: Default: the recipe name and a timestamp.
        checkpoint_every_n_steps: Save a checkpoint this often; 0 saves none.
        seed: Seed of every rank (weights, data order).
        progress_bar: Lightning's rich progress bar.
    """

    accelerator: str = "cpu"
    devices: str = "2"
    num_nodes: int = 1
    precision: str = "32-true"
    max_steps: int = 450
    accumulate_grad_batches: int = 1
    val_check_interval: int = 150
    limit_val_batches: int = 8
    log_every_n_steps: int = 10
    logger: str = "csv"
    output_dir: str = "runs"
    run_name: str | None = None
    checkpoint_every_n_steps: int = 150
    seed: int = 1234
    progress_bar: bool = True

    def __post_init__(self) -> None:
        _check_choice("trainer", "accelerator", self.accelerator, ("cpu", "gpu", "cuda", "auto"))
        self.precision = PRECISION_ALIASES.get(str(self.precision), self.precision)
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"trainer.precision={self.precision!r} is not one of "
                f"{', '.join(map(repr, PRECISIONS))} (or Lightning's aliases '32', 'bf16'); "
                "16-bit float (16-mixed, 16-true) and 64-true are not supported by recipes"
            )
        _check_choice("trainer", "logger", self.logger, ("csv", "tensorboard", "none"))
        if not (self.devices == "auto" or self.devices.lstrip("-").isdigit()):
            raise ConfigError(f"trainer.devices must be an int or 'auto', got {self.devices!r}")
        if self.devices != "auto" and int(self.devices) < 1 and self.devices != "-1":
            raise ConfigError(
                f"trainer.devices={self.devices}: give the number of processes per node (>= 1), "
                "'auto', or -1 (every GPU)"
            )
        _check_positive(
            "trainer",
            num_nodes=self.num_nodes,
            max_steps=self.max_steps,
            accumulate_grad_batches=self.accumulate_grad_batches,
            val_check_interval=self.val_check_interval,
            log_every_n_steps=self.log_every_n_steps,
        )
        if self.limit_val_batches < 0 or self.checkpoint_every_n_steps < 0:
            raise ConfigError("trainer.limit_val_batches and checkpoint_every_n_steps >= 0")

    def lightning_devices(self) -> int | str:
        return self.devices if self.devices == "auto" else int(self.devices)


@dataclass
class StrategyConfig:
    """How the model is sharded.

    Attributes:
        name: ``"yafsdp"`` (default) or ``"ddp"`` (unsharded, for comparisons).
        zero_stage: 3 (re-gather weights in backward) or 2 (keep them; more memory,
            a third less traffic).
        reduce_dtype: ``"float32"`` or ``"bfloat16"``: gradient buffers and the
            reduce-scatter.
        activation_checkpointing: ``"none"``, ``"all"``, a number of units (``"4"``:
            the first four recompute their forward in backward), or ``"auto"``: as few
            units as fit ``activation_memory_gb`` by ``yafsdp estimate``'s formula
            (every recomputed unit costs time).
        activation_memory_gb: The activation budget per rank for ``"auto"`` (GiB).
        sync_module_states: Broadcast rank 0's weights before sharding.
        shard_size: Hybrid sharding: shard over groups of this many consecutive ranks,
            replicate across the groups. ``null`` (default): one node's ranks when
            ``trainer.num_nodes > 1``, else every rank. ``yafsdp estimate`` shows the
            memory per rank it gives.
        verify_checksums: Compare a resumed checkpoint's files with the CRC-32s recorded
            at save before loading it (default true; ``strategy.verify_checksums=false``
            on the command line skips it, e.g. for a checkpoint edited on purpose).
        async_save: Write checkpoints in the background while training goes on
            (default false): a save copies the shards to CPU memory and returns; a
            thread writes and commits them. A failed write is said at the next step and
            raised at the next save or at the end of the run.
        vocab_chunks: Run an embedding or head larger than a block (tied or not) in row
            chunks of at most a block each, so no buffer is vocabulary-sized; what stays
            whole is named by ``yafsdp estimate``.
        blocks_per_unit: ``"auto"`` (default): consecutive small blocks are gathered and
            reduced as one unit of at most 4M elements (at least 4 units of blocks kept;
            blocks of more than 2M elements stay one per unit), so few collectives
            carry enough bytes; a number: that many blocks per unit (``1``: one block per
            unit). ``yafsdp estimate`` prints the units chosen; activation checkpointing
            counts these units.
    """

    name: str = "yafsdp"
    zero_stage: int = 3
    reduce_dtype: str = "float32"
    activation_checkpointing: str = "none"
    activation_memory_gb: float | None = None
    sync_module_states: bool = False
    shard_size: int | None = None
    verify_checksums: bool = True
    async_save: bool = False
    vocab_chunks: bool = True
    blocks_per_unit: str = "auto"

    def __post_init__(self) -> None:
        _check_choice("strategy", "name", self.name, ("yafsdp", "ddp"))
        per_unit = str(self.blocks_per_unit)
        if per_unit != "auto" and not (_is_count(per_unit) and int(per_unit) >= 1):
            raise ConfigError(
                f"strategy.blocks_per_unit={self.blocks_per_unit!r}: use 'auto' or a whole "
                "number of blocks >= 1 (1: one block per unit)"
            )
        size = self.shard_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ConfigError(f"strategy.shard_size={size!r}: a positive integer, or null")
        _check_choice("strategy", "zero_stage", self.zero_stage, (2, 3))
        _check_choice("strategy", "reduce_dtype", self.reduce_dtype, ("float32", "bfloat16"))
        ac = self.activation_checkpointing
        if ac not in ("none", "all", "auto") and not _is_count(ac):
            raise ConfigError(
                f"strategy.activation_checkpointing={ac!r}: use 'none', 'all', 'auto' or a "
                "number of units"
            )
        if ac == "auto" and not self.activation_memory_gb:
            raise ConfigError(
                "strategy.activation_checkpointing='auto' needs strategy.activation_memory_gb "
                "(the activation budget per rank, GiB)"
            )

    @property
    def blocks_per_unit_value(self) -> int | str:
        """``blocks_per_unit`` as the strategies take it: ``"auto"`` or an int."""
        per_unit = str(self.blocks_per_unit)
        return per_unit if per_unit == "auto" else int(per_unit)


@dataclass
class CurriculumConfig:
    """YaLM curriculum: start with short sequences and small batches, grow them.

    Attributes:
        enabled: Turn the curriculum on.
        start_seq_len: Sequence length at step 0 (tokens); grows linearly to
            ``data.seq_len`` at ``warmup_steps``, in multiples of ``multiple_of``.
        start_batch_size: Sequences per micro-batch at step 0 (None: no batch warm-up);
            grows linearly to ``data.batch_size``.
        warmup_steps: Optimizer steps of the warm-up.
        multiple_of: Round sequence lengths down to a multiple of this.
    """

    enabled: bool = False
    start_seq_len: int = 32
    start_batch_size: int | None = None
    warmup_steps: int = 100
    multiple_of: int = 8

    def __post_init__(self) -> None:
        _check_positive(
            "practices.curriculum",
            start_seq_len=self.start_seq_len,
            start_batch_size=self.start_batch_size,
            warmup_steps=self.warmup_steps,
            multiple_of=self.multiple_of,
        )


@dataclass
class ThermometerConfig:
    """YaLM "thermometers": per-unit activation max/min and the global grad norm.

    Attributes:
        enabled: Turn them on.
        every_n_steps: Measure on one step in this many (hooks exist only then).
    """

    enabled: bool = False
    every_n_steps: int = 50

    def __post_init__(self) -> None:
        _check_positive("practices.thermometers", every_n_steps=self.every_n_steps)


@dataclass
class DivergenceGuardConfig:
    """Roll back when the loss goes NaN/inf or spikes.

    Attributes:
        enabled: Turn the guard on.
        snapshot_every_n_steps: Keep an in-memory copy of the master shards and the
            optimizer state this often (steps); a rollback returns to the latest.
        spike_factor: A loss above ``spike_factor`` x its running mean is a spike.
        spike_warmup_steps: No spike detection before this step (the loss falls fast).
        skip_batches: Extra batches to skip after the offending one.
        lr_cut: Multiply the learning rate by this after each rollback (1.0: keep it).
        max_rollbacks: Give up (raise) after this many rollbacks.
    """

    enabled: bool = False
    snapshot_every_n_steps: int = 50
    spike_factor: float = 2.0
    spike_warmup_steps: int = 100
    skip_batches: int = 0
    lr_cut: float = 1.0
    max_rollbacks: int = 10

    def __post_init__(self) -> None:
        _check_positive(
            "practices.divergence_guard",
            snapshot_every_n_steps=self.snapshot_every_n_steps,
            spike_factor=self.spike_factor,
            lr_cut=self.lr_cut,
            max_rollbacks=self.max_rollbacks,
        )
        if self.skip_batches < 0 or self.lr_cut > 1.0:
            raise ConfigError("practices.divergence_guard: skip_batches >= 0, lr_cut in (0, 1]")


@dataclass
class PracticesConfig:
    """The YaLM-100B training practices, as switches.

    Attributes:
        embedding_norm: An RMSNorm right after the token embedding (reference Llama).
        dropout: Dropout probability; 0 (off) when data is plentiful (+15% speed).
        fp32_loss: Softmax/cross-entropy of the logits in fp32. Norm statistics and
            the attention softmax are fp32 in the reference model regardless.
        fp32_residual: Keep the residual stream (every residual addition) in fp32
            while weights and matmuls stay bf16 (reference Llama only). The strategy
            then leaves unit inputs uncast (``cast_forward_inputs=False``). Costs fp32
            activations between blocks; no effect under ``32-true``.
        curriculum, thermometers, divergence_guard: see their sections.
    """

    embedding_norm: bool = False
    dropout: float = 0.0
    fp32_loss: bool = True
    fp32_residual: bool = False
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    thermometers: ThermometerConfig = field(default_factory=ThermometerConfig)
    divergence_guard: DivergenceGuardConfig = field(default_factory=DivergenceGuardConfig)

    def __post_init__(self) -> None:
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"practices.dropout must be in [0, 1), got {self.dropout}")


@dataclass
class RunConfig:
    """A whole recipe. The defaults are the embedded ``tiny-cpu`` recipe.

    Attributes:
        recipe: The recipe's name: in the startup panel and the default run name
            (default: the recipe file's name).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    practices: PracticesConfig = field(default_factory=PracticesConfig)
    recipe: str = "tiny-cpu"

    def __post_init__(self) -> None:
        curriculum = self.practices.curriculum
        if curriculum.enabled:
            if curriculum.start_seq_len > self.data.seq_len:
                raise ConfigError(
                    f"practices.curriculum.start_seq_len={curriculum.start_seq_len} exceeds "
                    f"data.seq_len={self.data.seq_len}"
                )
            start_batch = curriculum.start_batch_size
            if start_batch is not None and start_batch > self.data.batch_size:
                raise ConfigError(
                    f"practices.curriculum.start_batch_size={start_batch} exceeds "
                    f"data.batch_size={self.data.batch_size}"
                )
        if self.practices.fp32_residual and self.model.kind != "llama":
            raise ConfigError(
                "practices.fp32_residual is only available for the reference model "
                f"(model.kind='llama'), not model.kind={self.model.kind!r}: set it to false "
                "or train the reference Llama"
            )
        if self.strategy.name != "yafsdp" and self.strategy.activation_checkpointing != "none":
            raise ConfigError("strategy.activation_checkpointing needs strategy.name='yafsdp'")
        if self.strategy.name == "ddp" and self.practices.divergence_guard.enabled:
            raise ConfigError(
                "practices.divergence_guard needs strategy.name='yafsdp': DDP cannot skip the "
                "backward of a bad step (its reducer expects every forward to be followed by one)"
            )


# --------------------------------------------------------------------------- loading

_RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def find_recipe(name_or_path: str) -> Path:
    """Resolve a recipe argument: a YAML path, or a name in ``./recipes`` or the source tree.

    Raises:
        ConfigError: if no such file exists, listing the recipes that do.
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    stem = path.name.removesuffix(".yaml").removesuffix(".yml")
    for folder in (Path.cwd() / "recipes", _RECIPES_DIR):
        candidate = folder / f"{stem}.yaml"
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in _RECIPES_DIR.glob("*.yaml")) if _RECIPES_DIR.is_dir() else []
    close = difflib.get_close_matches(stem, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(
        f"recipe {name_or_path!r} not found (neither a file nor a name in ./recipes)."
        f"{hint} Known recipes: {', '.join(known) or 'none'}"
    )


def load_config(recipe: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Merge a recipe over the schema, then ``key=value`` overrides; validate everything.

    Args:
        recipe: A YAML path or recipe name; None for the embedded default (tiny-cpu).
        overrides: Dotlist items such as ``"optim.lr=3e-4"``.

    Returns:
        The validated :class:`RunConfig`.

    Raises:
        ConfigError: on an unknown key (naming the closest valid one), a wrong type,
            a malformed override or a value out of range.
    """
    merged: DictConfig = OmegaConf.structured(RunConfig)
    if recipe is not None:
        path = find_recipe(str(recipe))
        try:
            loaded = OmegaConf.load(path)
        except Exception as err:  # YAML syntax errors come in many types
            raise ConfigError(f"{path}: not valid YAML: {err}") from err
        merged = _merge(merged, loaded, source=str(path))
        if "recipe" not in loaded:
            merged.recipe = path.stem
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(
                f"override {item!r} is not of the form key=value (e.g. optim.lr=3e-4)"
            )
    if overrides:
        try:
            dotlist = OmegaConf.from_dotlist(list(overrides))
        except OmegaConfBaseException as err:
            raise ConfigError(f"command line overrides: {err}") from err
        merged = _merge(merged, dotlist, source="command line")
    try:
        config = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as err:
        raise ConfigError(_describe(err, source="recipe")) from err
    assert isinstance(config, RunConfig)
    return config


def to_yaml(config: RunConfig) -> str:
    """The resolved config as YAML (what is printed and saved next to the run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def _merge(base: DictConfig, other: Any, *, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)  # type: ignore[return-value]
    except ConfigError:
        raise
    except OmegaConfBaseException as err:
        raise ConfigError(_describe(err, source=source)) from err


def _describe(err: OmegaConfBaseException, *, source: str) -> str:
    full_key = str(getattr(err, "full_key", "") or "")
    if isinstance(err, ConfigKeyError) or "not in" in str(err):
        key = full_key or str(getattr(err, "key", ""))
        return f"{source}: unknown key '{key}'{_closest(key)}"
    if isinstance(err, ValidationError):
        expected = _expected_type(full_key)
        value = getattr(err, "value", None) if hasattr(err, "value") else None
        detail = str(err).splitlines()[0]
        what = f" (expected {expected})" if expected else ""
        shown = f" got {value!r};" if value is not None else ""
        return f"{source}: wrong type for '{full_key}'{what}:{shown} {detail}"
    return f"{source}: {str(err).splitlines()[0]}"


def _closest(full_key: str) -> str:
    parts = full_key.split(".")
    cls: Any = RunConfig
    for part in parts[:-1]:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields or not dataclasses.is_dataclass(_field_type(cls, part)):
            return ""
        cls = _field_type(cls, part)
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(parts[-1], names, n=1, cutoff=0.5)
    prefix = ".".join(parts[:-1])
    valid = ", ".join(names)
    if close:
        suggestion = f"{prefix}.{close[0]}" if prefix else close[0]
        return f"; did you mean '{suggestion}'? (valid keys here: {valid})"
    return f"; valid keys here: {valid}"


def _field_type(cls: Any, name: str) -> Any:
    import typing

    return typing.get_type_hints(cls)[name]


def _expected_type(full_key: str) -> str:
    parts = full_key.split(".")
    cls: Any = RunConfig
    try:
        for part in parts[:-1]:
            cls = _field_type(cls, part)
        hint = _field_type(cls, parts[-1])
    except (KeyError, TypeError):
        return ""
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _is_count(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also takes '²' and '٣', which ``int`` refuses."""
    return text.isascii() and text.isdigit()
