"""Small random models built from a config, for runs that need no real model or a model
shape SmolLM2 lacks.

`tiny_llama` builds one in memory: the tiny model of ``bench_host.py`` (a nearly free
forward, so a step costs what the library does around it) and of the tests that check a
step's ops and rows (tests/test_hf_step.py, tests/test_checks.py). `save_small_llama`
writes the Llama that splits over two tensor-parallel workers: used by
``tests/test_vllm.py`` (the multi-worker agreement checks) and ``bench_vllm.py`` (the
multi-worker configuration), so both run the same model. `tiny_gemma3` builds a small
sliding-window hybrid, Gemma 3's layout (``bench_lm.py --model tiny-gemma3``). Tiny models
of every family transformers ships: benchmark/families.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tiny_llama(
    vocab_size: int,
    hidden_size: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    *,
    layers: int = 2,
    max_positions: int = 2048,
    attn_implementation: str | None = None,
    std: float | None = None,
    head_std: float | None = None,
    seed: int = 0,
    **config: Any,
) -> Any:
    """A random ``LlamaForCausalLM`` in float32, in eval mode: ``layers`` layers of width
    ``hidden_size`` (MLP twice that), ``heads`` query and ``kv_heads`` KV heads of dim
    ``hidden_size // heads``, an output head of its own.

    Weights come from ``torch.manual_seed(seed)``: transformers' initialisation, or with
    ``std`` every weight but the norms drawn from N(0, std) (the output head from N(0,
    ``head_std``) if given), wide enough that rows differ clearly between contexts.
    ``attn_implementation``: None for transformers' default (sdpa); ``config``: more
    `LlamaConfig` fields.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    llama_config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
        **config,
    )
    return _random_model(LlamaForCausalLM, llama_config, seed, std, head_std)


TINY_GEMMA3_LAYERS = (
    "sliding_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
)


def tiny_gemma3(
    vocab_size: int,
    hidden_size: int = 64,
    heads: int = 4,
    kv_heads: int = 1,
    *,
    layer_types: tuple[str, ...] = TINY_GEMMA3_LAYERS,
    sliding_window: int = 32,
    max_positions: int = 2048,
    attn_implementation: str | None = "sdpa",
    std: float | None = None,
    seed: int = 0,
) -> Any:
    """A random ``Gemma3ForCausalLM`` (text only) in float32, in eval mode: a sliding-window
    hybrid as Gemma 3 270M is (there 15 of 18 layers slide over 512 tokens), small enough for
    a CI run. ``layer_types`` gives each layer's kind (default: sliding layers before and
    after one full-attention layer), ``sliding_window`` their window; ``heads`` query and
    ``kv_heads`` KV heads of dim ``hidden_size // heads``; tied embeddings, as Gemma's.
    Weights from ``torch.manual_seed(seed)``: transformers' initialisation, or with ``std``
    every weight but the norms drawn from N(0, std).
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    head_dim = hidden_size // heads
    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=len(layer_types),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        layer_types=list(layer_types),
        sliding_window=sliding_window,
        max_position_embeddings=max_positions,
        attn_implementation=attn_implementation,
    )
    return _random_model(Gemma3ForCausalLM, config, seed, std)


def _random_model(
    model_class: Any, config: Any, seed: int, std: float | None, head_std: float | None = None
) -> Any:
    """``model_class(config)`` in float32, in eval mode, weights from ``torch.manual_seed(seed)``:
    transformers' initialisation, or with ``std`` every weight but the norms redrawn from
    N(0, ``std``), the output head's from N(0, ``head_std``) if given (and not tied)."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    if std is None:
        return model
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                lm_head = head_std is not None and name.startswith("lm_head")
                parameter.normal_(0.0, head_std if lm_head else std)
    return model


def save_small_llama(tokenizer: Any, path: str | Path) -> str:
    """Save a small random Llama with ``tokenizer``'s vocabulary in ``path``; returns ``path``.

    Its heads split over two workers (8 query / 2 KV heads of dim 64: vLLM's CPU attention
    takes head dims 64 and 128 only; SmolLM2's 9 heads do not split). Weights are drawn
    wide (std 0.2) so that rows differ clearly between contexts (one token apart: up to
    ~7 nats); the output head at std 0.05, as at 0.2 the logits span ~40 nats and float32
    sum-order differences reach 2.3e-4 from transformers (seen). Saved in float32.
    """
    model = tiny_llama(
        len(tokenizer),
        512,
        8,
        2,
        layers=3,
        max_positions=1024,
        std=0.2,
        head_std=0.05,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
