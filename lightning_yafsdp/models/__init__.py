"""Reference models trained by the lightning_yafsdp examples and tests (torch only)."""

from lightning_yafsdp.models.llama import (
    LLAMA_CONFIGS,
    Attention,
    FeedForward,
    Llama,
    LlamaConfig,
    RMSNorm,
    RotaryEmbedding,
    TransformerBlock,
    apply_rotary_embedding,
    hf_llama_config,
    llama_ffn_hidden_dim,
    llama_to_hf_state_dict,
)

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
