"""A Llama-style decoder, written to be read top to bottom and sharded.

Order: config, norm, rotary embedding, attention, MLP, block, model, and last the
mapping to Hugging Face ``LlamaForCausalLM`` used by the parity tests.

[Note: parameter access] Rules this file keeps for the sharding engine:

* every parameter is reached through its owning module at forward time (``self.wq(x)``),
  never through an alias cached elsewhere, because the engine swaps ``module.weight``
  for a gathered view just before the module runs and frees it just after;
* a block only touches its own parameters, and blocks are called as modules
  (``layer(h, ...)``) so that the engine's forward hooks fire;
* the model can be built on the meta device, moved with ``to_empty`` and then filled
  by ``init_weights()``; derived tensors (rotary tables) and the embedding tie are
  restored by ``to_empty`` itself, so loading a checkpoint instead of calling
  ``init_weights()`` also works.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    import transformers

__all__ = [
    "LLAMA_CONFIGS",
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "TransformerBlock",
    "apply_rotary_embedding",
    "hf_llama_config",
    "llama_ffn_hidden_dim",
    "llama_to_hf_state_dict",
]

INIT_STD = 0.02
"""Standard deviation of the normal init for every matrix (GPT-2 / Llama practice)."""


# --------------------------------------------------------------------------- config


def llama_ffn_hidden_dim(
    dim: int, *, multiple_of: int = 256, ffn_dim_multiplier: float | None = None
) -> int:
    """Return the SwiGLU hidden width Meta's reference code derives from ``dim``.

    SwiGLU has three matrices instead of two, so Llama takes 2/3 of the classic 4 * dim
    to keep the MLP's parameter count, scales it by ``ffn_dim_multiplier`` and rounds up
    to ``multiple_of`` for matmul-friendly shapes.

    Args:
        dim: Model width (elements).
        multiple_of: Round the result up to a multiple of this. Defaults to 256.
        ffn_dim_multiplier: Optional extra scale (1.3 for Llama 3 8B). Defaults to None.

    Returns:
        The hidden width in elements, e.g. 11008 for ``dim=4096`` (Llama 2 7B).
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


@dataclass
class LlamaConfig:
    """Shape and regularisation of a :class:`Llama` model.

    Attributes:
        vocab_size: Number of token ids. Defaults to 256 (byte-level).
        dim: Width of the residual stream (elements). Defaults to 64.
        n_layers: Number of transformer blocks. Defaults to 4.
        n_heads: Number of query heads; ``dim`` must divide evenly by it. Defaults to 4.
        n_kv_heads: Number of key/value heads for grouped-query attention; must divide
            ``n_heads``. Defaults to None, meaning ``n_heads`` (plain multi-head).
        ffn_hidden_dim: SwiGLU hidden width (elements); see :func:`llama_ffn_hidden_dim`
            for Llama's rounding rule. Defaults to 192.
        max_seq_len: Longest sequence the rotary tables cover (tokens). Defaults to 128.
        rope_theta: Rotary base wavelength. Defaults to 10000.0.
        norm_eps: Epsilon inside RMSNorm. Defaults to 1e-5.
        tie_embeddings: Share one matrix between the token embedding and the output
            projection. Defaults to False.
        embedding_norm: Apply an RMSNorm right after the token embedding, a YaLM-100B
            practice that damps early loss spikes in large runs. Defaults to False.
        dropout: Dropout probability on attention weights and on each residual branch;
            0.0 turns dropout off. Defaults to 0.0.
        fp32_residual: Keep the residual stream in fp32 whatever the weights' dtype, a
            YaLM-100B practice: bf16 weights and matmuls, fp32 residual additions; see
            [Note: fp32 residual]. With fp32 weights it changes nothing. Defaults to False.
    """

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_hidden_dim: int = 192
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    embedding_norm: bool = False
    dropout: float = 0.0
    fp32_residual: bool = False

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for name in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_hidden_dim",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"LlamaConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                "every head needs the same width: pick dim as a multiple of n_heads"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head width dim/n_heads={self.head_dim} is odd, but rotary embeddings "
                "rotate pairs of channels: pick dim and n_heads so that it is even"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig.n_heads={self.n_heads} is not divisible by "
                f"n_kv_heads={self.n_kv_heads}; grouped-query attention shares each "
                "key/value head among an equal number of query heads"
            )
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(
                f"rope_theta ({self.rope_theta}) and norm_eps ({self.norm_eps}) must be > 0"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LlamaConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head (elements)."""
        return self.dim // self.n_heads

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> LlamaConfig:
        """Build a preset from :data:`LLAMA_CONFIGS`, optionally changing some fields.

        Args:
            name: A key of :data:`LLAMA_CONFIGS`, e.g. ``"tiny"`` or ``"llama3-8b"``.
            **overrides: Fields to replace, e.g. ``max_seq_len=2048``.

        Raises:
            ValueError: If ``name`` is not a preset or an override is not a field.
        """
        if name not in LLAMA_CONFIGS:
            raise ValueError(
                f"unknown Llama preset {name!r}; valid names: {', '.join(LLAMA_CONFIGS)}"
            )
        field_names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - field_names)
        if unknown:
            raise ValueError(
                f"unknown LlamaConfig field(s) {unknown} in overrides for preset {name!r}; "
                f"valid fields: {', '.join(sorted(field_names))}"
            )
        return cls(**{**LLAMA_CONFIGS[name], **overrides})


# Published shapes (Meta's params.json / HF config.json). max_seq_len is the context
# the model was pre-trained at without rope scaling; Llama 3.2 1B's 128K context needs
# the "llama3" rope scaling, which this model does not implement.
LLAMA_CONFIGS: dict[str, dict[str, Any]] = {
    # ~230K parameters: fast enough for every CPU test.
    "tiny": dict(
        vocab_size=256,
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden_dim=192,
        max_seq_len=128,
    ),
    # ~50M parameters with byte-level vocab: a quick real-GPU smoke run.
    "debug-50m": dict(
        vocab_size=256,
        dim=512,
        n_layers=16,
        n_heads=8,
        n_kv_heads=4,
        ffn_hidden_dim=1536,
        max_seq_len=2048,
    ),
    "llama-1b": dict(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden_dim=8192,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    "llama3-8b": dict(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden_dim=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama2-7b": dict(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_hidden_dim=11008, max_seq_len=4096
    ),
    "llama2-70b": dict(
        vocab_size=32000,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_hidden_dim=28672,
        max_seq_len=4096,
    ),
    "llama3-70b": dict(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_hidden_dim=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}


# --------------------------------------------------------------------------- norm


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned per-channel gain.

    The statistics are computed in fp32 and the result cast back to the input dtype
    before the gain, because a bf16 mean of squares over thousands of channels loses
    enough precision to shift every activation.

    Args:
        dim: Number of channels (elements) in the last dimension.
        eps: Added to the mean square before the reciprocal square root.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def reset_parameters(self) -> None:
        """Set the gain to ones (the norm starts as a pure normaliser)."""
        nn.init.ones_(self.weight)


# --------------------------------------------------------------------------- rotary
#
# [Note: rotary layout] Meta's reference code rotates interleaved channel pairs
# (0, 1), (2, 3), ... as complex numbers; Hugging Face rotates channel i with channel
# i + head_dim/2 (``rotate_half``) and permutes wq/wk rows when converting Meta
# checkpoints. We use the rotate_half layout so our weights map 1:1 onto HF
# ``LlamaForCausalLM`` with no permutation (and loading Meta's consolidated.pth needs
# the same row permutation HF's converter applies).


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys by their position (rotate_half layout).

    Args:
        x: Tensor of shape ``[batch, heads, seq, head_dim]``.
        cos: Table of shape ``[seq, head_dim]`` in ``x``'s dtype.
        sin: Table of shape ``[seq, head_dim]`` in ``x``'s dtype.

    Returns:
        The rotated tensor, same shape and dtype as ``x``.
    """
    return x * cos + _rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """Holds cos/sin tables for positions ``0 .. max_seq_len - 1``.

    The tables are precomputed once rather than per step, and kept as non-persistent
    buffers: they are derived from the config, so checkpoints need not store them, and
    a meta-device model gets them back from :meth:`reset_tables` (called by
    ``Llama.to_empty`` and ``Llama.init_weights``), since ``to_empty`` leaves buffers
    uninitialised.

    Args:
        head_dim: Width of one attention head (elements, even).
        max_seq_len: Number of positions to cover (tokens).
        theta: Rotary base wavelength.
    """

    def __init__(self, head_dim: int, *, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)
        self.reset_tables()

    @torch.no_grad()
    def reset_tables(self) -> None:
        """Recompute the tables in fp32 on the buffers' device (no-op cost on meta)."""
        device = self.cos.device
        # Same arithmetic as HF's default rope so the parity test can be tight.
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
        inv_freq = 1.0 / (self.theta ** (exponents / self.head_dim))
        positions = torch.arange(self.max_seq_len, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # rotate_half layout
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def reset_parameters(self) -> None:
        """Alias of ``reset_tables``: the name meta-device initialisers look for."""
        self.reset_tables()

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, sin)`` for the first ``seq_len`` positions, cast to ``dtype``."""
        return self.cos[:seq_len].to(dtype), self.sin[:seq_len].to(dtype)


# --------------------------------------------------------------------------- attention


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads and rotary positions.

    Args:
        config: Model shape; uses ``dim``, ``n_heads``, ``n_kv_heads`` and ``dropout``.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary_embedding(q, cos, sin)
        k = apply_rotary_embedding(k, cos, sin)
        # The fused SDPA kernels keep softmax statistics in fp32 even for bf16 inputs, so
        # no manual upcast is needed. enable_gqa lets query head h read key/value head
        # h // (n_heads / n_kv_heads) without materialising repeated K/V copies.
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def init_weights(self, *, std: float, residual_std: float) -> None:
        """Normal init; ``wo`` writes into the residual stream so it gets ``residual_std``."""
        for linear in (self.wq, self.wk, self.wv):
            nn.init.normal_(linear.weight, std=std)
        nn.init.normal_(self.wo.weight, std=residual_std)


# --------------------------------------------------------------------------- mlp


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``.

    Args:
        dim: Width of the residual stream (elements).
        hidden_dim: SwiGLU hidden width (elements).
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down, back to the residual
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, *, std: float, residual_std: float) -> None:
        """Normal init; ``w2`` writes into the residual stream so it gets ``residual_std``."""
        nn.init.normal_(self.w1.weight, std=std)
        nn.init.normal_(self.w3.weight, std=std)
        nn.init.normal_(self.w2.weight, std=residual_std)


# --------------------------------------------------------------------------- block
#
# [Note: fp32 residual] With ``fp32_residual`` the residual stream ``h`` is fp32 from the
# embedding to the final norm, while every matmul still runs in the compute dtype:
#
# * ``Llama.forward`` casts the embedding output to fp32 and hands the blocks rotary
#   tables in the embedding weight's dtype (the compute dtype), as without the flag;
# * a block casts each norm output to the dtype of the weights it feeds (bf16 under
#   bf16-true; fp32 under bf16-mixed, where autocast does the bf16 matmul) and adds
#   the branch output back as ``h = h + out.float()``;
# * the final norm output is cast to the output head's weight dtype.
#
# With fp32 weights every cast is a no-op, so the flag does not change the result.
# Under the sharding engine, ``cast_forward_inputs=True`` would cast ``h`` to bf16 at
# every block boundary: build it with ``cast_forward_inputs=False`` (the recipe runner
# does so when ``practices.fp32_residual`` is on).


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``.

    This is the unit the sharding engine wraps: its forward touches only its own
    parameters; the rotary tables arrive as arguments.

    Args:
        config: Model shape.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim)
        self.residual_dropout = nn.Dropout(config.dropout) if config.dropout else nn.Identity()
        self.fp32_residual = config.fp32_residual

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.fp32_residual:
            return self._forward_fp32_residual(x, cos, sin)
        h = x + self.residual_dropout(self.attention(self.attention_norm(x), cos, sin))
        return h + self.residual_dropout(self.feed_forward(self.ffn_norm(h)))

    def _forward_fp32_residual(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Same block with an fp32 residual stream; see [Note: fp32 residual]."""
        h = x.float()  # no-op unless something upstream cast the stream down
        attn_in = self.attention_norm(h).to(self.attention.wq.weight.dtype)
        h = h + self.residual_dropout(self.attention(attn_in, cos, sin)).float()
        ffn_in = self.ffn_norm(h).to(self.feed_forward.w1.weight.dtype)
        return h + self.residual_dropout(self.feed_forward(ffn_in)).float()

    def init_weights(self, *, std: float, residual_std: float) -> None:
        """Initialise this block's parameters in a fixed order (deterministic per seed)."""
        self.attention_norm.reset_parameters()
        self.attention.init_weights(std=std, residual_std=residual_std)
        self.ffn_norm.reset_parameters()
        self.feed_forward.init_weights(std=std, residual_std=residual_std)


# --------------------------------------------------------------------------- model


class Llama(nn.Module):
    """Llama-style decoder-only language model.

    Built on a real device it is initialised right away (``init_weights()``). For large
    models build it under ``with torch.device("meta"):`` (free), then call
    ``model.to_empty(device=...)`` and ``model.init_weights()`` or load a checkpoint.

    Args:
        config: Model shape, see :class:`LlamaConfig`.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.embedding_norm = (
            RMSNorm(config.dim, eps=config.norm_eps) if config.embedding_norm else None
        )
        self.embedding_dropout = nn.Dropout(config.dropout) if config.dropout else nn.Identity()
        self.rope = RotaryEmbedding(
            config.head_dim, max_seq_len=config.max_seq_len, theta=config.rope_theta
        )
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()
        self.init_weights()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Compute next-token logits.

        Args:
            tokens: Token ids, ``LongTensor`` of shape ``[batch, seq]`` with
                ``seq <= config.max_seq_len``.

        Returns:
            Logits of shape ``[batch, seq, vocab_size]`` in the weights' dtype.
        """
        return self.output(self.hidden_states(tokens))

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """Everything but the output head: the final norm's output, the head's input.

        A loss that runs the head itself (over chunks of tokens: [Note: chunked loss],
        ``training/chunked_loss.py``) calls this, then ``self.output`` on each chunk.

        Returns:
            ``[batch, seq, dim]``, in the head's weight dtype under ``fp32_residual``.
        """
        seq_len = tokens.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {seq_len} tokens exceeds max_seq_len={self.config.max_seq_len}; "
                "shorten the batch or build the model with a larger max_seq_len"
            )
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope(seq_len, h.dtype)  # compute dtype, even with fp32_residual
        if self.config.fp32_residual:
            h = h.float()  # see [Note: fp32 residual]
        if self.embedding_norm is not None:
            h = self.embedding_norm(h)
        h = self.embedding_dropout(h)
        for layer in self.layers:
            h = layer(h, cos, sin)  # called as a module so sharding hooks fire
        if self.config.fp32_residual:
            return self.norm(h).to(self.output.weight.dtype)
        return self.norm(h)

    def tie_weights(self) -> None:
        """Make ``output.weight`` the same Parameter as ``tok_embeddings.weight`` if tied."""
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> Llama:
        """Move to ``device`` without copying, then restore what must not be garbage.

        ``nn.Module.to_empty`` gives each module a fresh Parameter when leaving the meta
        device, which silently unties the embeddings, and leaves the rotary tables
        uninitialised. Both are structure, not weights, so they are restored here; the
        weights stay uninitialised until ``init_weights()`` or a checkpoint load.
        """
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        self.rope.reset_tables()
        return self

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter in place, deterministically for a given torch seed.

        Matrices draw from N(0, 0.02^2); the projections that write into the residual
        stream (``wo``, ``w2``) use std ``0.02 / sqrt(2 * n_layers)`` so the residual
        variance does not grow with depth (GPT-2); norm gains are ones. The tie and the
        rotary tables are restored first, so this also completes a meta-device build.
        """
        self.tie_weights()
        self.rope.reset_tables()
        nn.init.normal_(self.tok_embeddings.weight, std=INIT_STD)
        if self.embedding_norm is not None:
            self.embedding_norm.reset_parameters()
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layers)
        for layer in self.layers:
            layer.init_weights(std=INIT_STD, residual_std=residual_std)
        self.norm.reset_parameters()
        if not self.config.tie_embeddings:
            nn.init.normal_(self.output.weight, std=INIT_STD)

    @torch.no_grad()
    def init_submodule(self, module: nn.Module) -> None:
        """Initialise one submodule exactly as ``init_weights`` would.

        For sharded meta-device builds that materialise one piece at a time
        (``shard_model(..., param_init_fn=model.init_submodule)``): called on a
        block, the embeddings, the output head, a norm or the rotary tables.
        """
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layers)
        if isinstance(module, TransformerBlock):
            module.init_weights(std=INIT_STD, residual_std=residual_std)
        elif isinstance(module, (RMSNorm, RotaryEmbedding)):
            module.reset_parameters()
        elif isinstance(module, (nn.Embedding, nn.Linear)):
            nn.init.normal_(module.weight, std=INIT_STD)
        elif any(True for _ in module.parameters(recurse=False)):
            raise ValueError(
                f"init_submodule does not know how to initialise {type(module).__name__}"
            )

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        """Count parameters (elements), a tied matrix once; works on the meta device.

        Args:
            exclude_embeddings: Leave out the token embedding table (a lookup, not a
                matmul). When embeddings are tied this also removes the output
                projection, since it is the same matrix. Defaults to False.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.tok_embeddings.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Estimate training FLOPs per token (forward + backward) at ``seq_len``.

        Uses the PaLM paper's formula (Chowdhery et al. 2022, appendix B):
        ``6 * N + 12 * n_layers * dim * seq_len``, where ``N`` counts every parameter
        used in a matmul (all but the embedding lookup; the output projection counts even
        when tied) and the second term is the attention score and value matmuls,
        counted without the causal-mask saving.

        Args:
            seq_len: Training sequence length (tokens).
        """
        matmul_params = self.num_parameters(exclude_embeddings=True)
        if self.config.tie_embeddings:
            matmul_params += self.output.weight.numel()
        return 6 * matmul_params + 12 * self.config.n_layers * self.config.dim * seq_len


# --------------------------------------------------------------------------- Hugging Face


def hf_llama_config(config: LlamaConfig) -> transformers.LlamaConfig:
    """Return the ``transformers.LlamaConfig`` of the same architecture.

    HF has no residual dropout; ``dropout`` maps to its attention dropout only, so the
    two models agree in eval mode.

    Raises:
        ValueError: If ``config.embedding_norm`` is set (HF Llama has no such norm).
        ImportError: If ``transformers`` is not installed (it is optional).
    """
    _reject_embedding_norm(config)
    import transformers  # optional dependency: only the interop path needs it

    rope_kwargs: dict[str, Any]
    if int(transformers.__version__.split(".")[0]) >= 5:
        rope_kwargs = {"rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta}}
    else:
        rope_kwargs = {"rope_theta": config.rope_theta}
    return transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.ffn_hidden_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=config.dropout,
        **rope_kwargs,
    )


# Our name -> HF LlamaForCausalLM name; "{}" is the layer index.
_HF_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_HF_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def llama_to_hf_state_dict(
    state_dict: dict[str, torch.Tensor], config: LlamaConfig
) -> dict[str, torch.Tensor]:
    """Rename a :class:`Llama` state dict to ``transformers.LlamaForCausalLM`` keys.

    Tensors are passed through unchanged (no copy, no permutation) because both models
    use the rotate_half rotary layout; see [Note: rotary layout].

    Args:
        state_dict: ``Llama.state_dict()`` (both embedding keys present when tied).
        config: The config the state dict was built with.

    Returns:
        A new dict loadable with ``LlamaForCausalLM.load_state_dict(..., strict=True)``.

    Raises:
        ValueError: On a key this mapping does not know, or if ``embedding_norm`` is set.
    """
    _reject_embedding_norm(config)
    hf_state_dict = {}
    for name, tensor in state_dict.items():
        hf_name = _HF_TOP_NAMES.get(name)
        if hf_name is None and name.startswith("layers."):
            _, index, suffix = name.split(".", 2)
            if suffix in _HF_LAYER_NAMES and int(index) < config.n_layers:
                hf_name = f"model.layers.{index}.{_HF_LAYER_NAMES[suffix]}"
        if hf_name is None:
            raise ValueError(
                f"state dict key {name!r} has no Hugging Face Llama counterpart; pass "
                "Llama.state_dict() of a model built from the same config"
            )
        hf_state_dict[hf_name] = tensor
    return hf_state_dict


def _reject_embedding_norm(config: LlamaConfig) -> None:
    if config.embedding_norm:
        raise ValueError(
            "embedding_norm=True has no Hugging Face LlamaForCausalLM counterpart; "
            "convert only models built with embedding_norm=False"
        )
