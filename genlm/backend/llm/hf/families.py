"""Which models `AsyncTransformer`'s paged step can serve with KV reuse: the per-family
rules its layout probe asks (`kv_reuse_refusal`).

The paged step runs each forward over new tokens only, with explicit positions and a 4-D
mask, and reads the rest from the KV of earlier forwards. That is right where a token's
keys and values depend only on the tokens before it and their positions, and the
attention on the mask given. Where a family departs from that, its model runs each
request's whole prefix instead (`genlm.backend.kv.pool.NoKVPool` warns with the reason):

- cache layers other than full attention (a sliding window shorter than the context,
  recurrent states): the store holds full-attention KV only. A window at or beyond the
  context is full attention, and keeps reuse.
- ALiBi built from a 2-D attention mask (Bloom, Falcon with ``alibi=True``): the bias
  is computed from the mask's columns, and a step's mask is 4-D. (MPT builds its ALiBi
  from positions: right.)
- RoPE whose factors depend on the forward's longest position (``longrope`` with
  ``original_max_position_embeddings`` below the context): a forward past that position
  rotates every token with the long factors, so KV cached by a shorter forward no longer
  matches. Dynamic NTK changes its frequencies only past the context, which the LM
  refuses: it keeps reuse.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


def kv_reuse_refusal(model: Any, layers: Sequence[object]) -> str | None:
    """Why the paged step cannot give ``model``'s rows (whose one-token forward built the
    cache ``layers``), or None where it can."""
    config = model.config.get_text_config()
    context = getattr(config, "max_position_embeddings", None)
    if not all(full_attention(layer, context) for layer in layers):
        return "its cache has layers other than full attention"
    return alibi_from_mask(config) or position_dependent_rope(config, context)


def full_attention(layer: object, context: int | None) -> bool:
    """Whether a cache layer holds full-attention KV: a plain layer, or a sliding window
    that covers the whole ``context`` (every key is within any query's window)."""
    if getattr(layer, "keys", None) is None or getattr(layer, "values", None) is None:
        return False
    if type(layer) is DynamicSlidingWindowLayer:
        return context is not None and layer.sliding_window >= context
    return type(layer) is DynamicLayer


def alibi_from_mask(config: Any) -> str | None:
    """Why a model whose ALiBi bias is built from a 2-D attention mask cannot run steps."""
    if config.model_type == "bloom" or (
        config.model_type == "falcon" and getattr(config, "alibi", False)
    ):
        return f"{config.model_type} builds its ALiBi bias from a 2-D attention mask"
    return None


def position_dependent_rope(config: Any, context: int | None) -> str | None:
    """Why a model whose RoPE factors change with the forward's longest position, within
    its context, cannot reuse KV across forwards."""
    for parameters in rope_parameter_sets(config):
        if parameters.get("rope_type") != "longrope":
            continue
        switch = parameters.get("original_max_position_embeddings")
        if context is None or switch is None or switch < context:
            return (
                f"its longrope RoPE switches factors past position {switch}, within its "
                f"context of {context}"
            )
    return None


def rope_parameter_sets(config: Any) -> Iterator[Mapping[str, Any]]:
    """The config's RoPE parameters: one set, or one per layer type."""
    parameters = getattr(config, "rope_parameters", None)
    if not isinstance(parameters, Mapping):
        return
    nested = [value for value in parameters.values() if isinstance(value, Mapping)]
    yield from nested or [parameters]
