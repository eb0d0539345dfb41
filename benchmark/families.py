"""Tiny random models of the causal-LM families transformers ships, built from their
config classes: the families `tests/test_families.py` checks rows on, for benchmarks too.

Each `Family` is a config class and the few fields that make it tiny (2 layers of width
64, CPU-fast) and keep what sets the family apart: sliding windows of 16 tokens (shorter
than the tests' 100-token prompts), ALiBi, partial rotary, soft-capping, logit scales,
mixtures of experts, MLA. Every family has a context of `CONTEXT` tokens;
`family_model` builds one with a tokenizer's vocabulary and weights drawn wide enough
that rows differ clearly between contexts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CONTEXT = 256  # every family's max_position_embeddings
WINDOW = 16  # sliding windows: shorter than any test prompt
# Phi-3 longrope: the RoPE factors switch from short to long past this position.
LONGROPE_ORIGINAL_CONTEXT = 64

# The fields most Llama-like configs share: 2 layers of width 64, 4 query and 2 KV heads.
LLAMA_LIKE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": CONTEXT,
}
HEAD_DIM = 16


@dataclass(frozen=True)
class Family:
    """A tiny model of one family: transformers' config class ``config`` (its name) with
    ``options`` (the vocabulary comes from the tokenizer); ``note`` says what it checks."""

    name: str
    config: str
    options: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    def available(self) -> bool:
        """Whether the installed transformers has this family's config class."""
        import transformers

        return hasattr(transformers, self.config)


def _longrope() -> dict[str, Any]:
    """Phi-3's longrope with short and long factors apart (so the switch shows in rows)."""
    half = HEAD_DIM // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * half,
        "long_factor": [1.0 + i for i in range(half)],
        "factor": CONTEXT / LONGROPE_ORIGINAL_CONTEXT,
        "original_max_position_embeddings": LONGROPE_ORIGINAL_CONTEXT,
    }


FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaConfig", LLAMA_LIKE),
    Family(
        "llama-dynamic-ntk",
        "LlamaConfig",
        {**LLAMA_LIKE, "rope_parameters": {"rope_type": "dynamic", "factor": 4.0}},
        "dynamic NTK RoPE: frequencies change only past the context",
    ),
    Family("mistral", "MistralConfig", {**LLAMA_LIKE, "sliding_window": WINDOW}, "window 16"),
    Family(
        "mistral-window-covers-context",
        "MistralConfig",
        {**LLAMA_LIKE, "sliding_window": CONTEXT},
        "a window as long as the context: full attention",
    ),
    Family("gemma", "GemmaConfig", {**LLAMA_LIKE, "head_dim": HEAD_DIM}),
    Family(
        "gemma2",
        "Gemma2Config",
        {
            **LLAMA_LIKE,
            "head_dim": HEAD_DIM,
            "query_pre_attn_scalar": HEAD_DIM,
            "sliding_window": WINDOW,
        },
        "sliding and global layers, soft-capping",
    ),
    Family(
        "gemma3",
        "Gemma3TextConfig",
        {
            **LLAMA_LIKE,
            "head_dim": HEAD_DIM,
            "query_pre_attn_scalar": HEAD_DIM,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        "sliding and global layers",
    ),
    Family(
        "gemma3-window-covers-context",
        "Gemma3TextConfig",
        {
            **LLAMA_LIKE,
            "head_dim": HEAD_DIM,
            "query_pre_attn_scalar": HEAD_DIM,
            "sliding_window": CONTEXT,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        "sliding and global layers, the window as long as the context",
    ),
    Family("phi3", "Phi3Config", {**LLAMA_LIKE, "sliding_window": WINDOW}, "window 16"),
    Family(
        "phi3-longrope",
        "Phi3Config",
        {
            **LLAMA_LIKE,
            "original_max_position_embeddings": LONGROPE_ORIGINAL_CONTEXT,
            "rope_parameters": _longrope(),
        },
        "longrope: factors depend on the forward's longest position",
    ),
    Family("qwen2", "Qwen2Config", LLAMA_LIKE),
    Family("qwen3", "Qwen3Config", {**LLAMA_LIKE, "head_dim": HEAD_DIM}),
    Family(
        "smollm3",
        "SmolLM3Config",
        {**LLAMA_LIKE, "no_rope_layers": [1, 0]},
        "a NoPE layer (no rotary) beside a RoPE one",
    ),
    Family(
        "stablelm",
        "StableLmConfig",
        {**LLAMA_LIKE, "partial_rotary_factor": 0.25, "qk_layernorm": True},
        "partial rotary, per-head q/k norms",
    ),
    Family("nemotron", "NemotronConfig", {**LLAMA_LIKE, "partial_rotary_factor": 0.5}),
    Family(
        "gpt2",
        "GPT2Config",
        {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": CONTEXT},
        "learned positions",
    ),
    Family(
        "gpt-neox",
        "GPTNeoXConfig",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": CONTEXT,
        },
        "partial rotary, parallel residual",
    ),
    Family(
        "falcon-rotary",
        "FalconConfig",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": CONTEXT,
        },
        "multi-query attention",
    ),
    Family(
        "falcon-alibi",
        "FalconConfig",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": CONTEXT,
            "alibi": True,
            "multi_query": False,
        },
        "ALiBi from a 2-D mask",
    ),
    Family(
        "bloom",
        "BloomConfig",
        {"hidden_size": 64, "n_layer": 2, "n_head": 4},
        "ALiBi from a 2-D mask",
    ),
    Family(
        "mpt",
        "MptConfig",
        {"d_model": 64, "n_heads": 4, "n_layers": 2, "expansion_ratio": 2, "max_seq_len": CONTEXT},
        "ALiBi from positions",
    ),
    Family(
        "starcoder2",
        "Starcoder2Config",
        {**LLAMA_LIKE, "sliding_window": WINDOW},
        "window 16",
    ),
    Family("cohere", "CohereConfig", {**LLAMA_LIKE, "logit_scale": 0.5}, "logit scale"),
    Family(
        "cohere2",
        "Cohere2Config",
        {
            **LLAMA_LIKE,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        "sliding and global layers",
    ),
    Family(
        "granite",
        "GraniteConfig",
        {
            **LLAMA_LIKE,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.0,
        },
        "embedding, residual, attention and logit scales",
    ),
    Family("olmo", "OlmoConfig", LLAMA_LIKE),
    Family(
        "mixtral",
        "MixtralConfig",
        {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2},
        "mixture of experts",
    ),
    Family(
        "qwen2-moe",
        "Qwen2MoeConfig",
        {
            **LLAMA_LIKE,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
        "mixture of experts with a shared expert",
    ),
    Family(
        "gpt-oss",
        "GptOssConfig",
        {
            **LLAMA_LIKE,
            "head_dim": HEAD_DIM,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": CONTEXT // 4,
            },
        },
        "sliding and global layers, attention sinks, experts, YaRN",
    ),
    Family(
        "deepseek-v3",
        "DeepseekV3Config",
        {
            **LLAMA_LIKE,
            "num_key_value_heads": 4,
            "moe_intermediate_size": 32,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
        },
        "multi-head latent attention (MLA), experts",
    ),
)


def family(name: str) -> Family:
    """The family called ``name`` in `FAMILIES`."""
    return next(f for f in FAMILIES if f.name == name)


def family_model(
    tiny: Family, vocab_size: int, *, std: float = 0.2, head_std: float = 0.05, seed: int = 0
) -> Any:
    """A random model of ``tiny`` with ``vocab_size`` tokens, float32, in eval mode.

    Weights from ``torch.manual_seed(seed)``: every matrix (embeddings, projections,
    experts, routers) drawn from N(0, ``std``), the output head from N(0, ``head_std``)
    unless tied to the embeddings; norms and biases as transformers initialises them.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    # no special tokens: the families' defaults lie outside a smaller vocabulary
    special = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    config = getattr(transformers, tiny.config)(vocab_size=vocab_size, **special, **tiny.options)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    head = model.get_output_embeddings().weight
    tied = head is model.get_input_embeddings().weight
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, head_std if parameter is head and not tied else std)
    return model
