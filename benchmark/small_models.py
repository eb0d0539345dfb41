"""Small random models built from a config, for runs that need a model shape SmolLM2 lacks.

`save_small_llama` writes the Llama that splits over two tensor-parallel workers: used by
``tests/test_vllm.py`` (the multi-worker agreement checks) and ``bench_vllm.py`` (the
multi-worker configuration), so both run the same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_small_llama(tokenizer: Any, path: str | Path) -> str:
    """Save a small random Llama with ``tokenizer``'s vocabulary in ``path``; returns ``path``.

    Its heads split over two workers (8 query / 2 KV heads of dim 64: vLLM's CPU attention
    takes head dims 64 and 128 only; SmolLM2's 9 heads do not split). Weights are drawn
    wide (std 0.2) so that rows differ clearly between contexts (one token apart: up to
    ~7 nats); the output head at std 0.05, as at 0.2 the logits span ~40 nats and float32
    sum-order differences reach 2.3e-4 from transformers (seen). Saved in float32.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.05 if name.startswith("lm_head") else 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
