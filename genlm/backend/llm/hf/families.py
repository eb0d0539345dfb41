"""Which models `AsyncTransformer`'s paged step can serve with KV reuse: the per-family
rules its layout probe asks (`kv_reuse_refusal`). The paged step is right where a token's
KV depends only on the tokens before it and their positions, and attention on the 4-D mask
given; a family that departs from that runs each request's whole prefix. The rules and the
families they refuse: docs/families.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from genlm.backend.llm.hf.step import SlidingWindow


def kv_reuse_refusal(model: Any, layers: Sequence[object]) -> str | None:
    """Why the paged step cannot give ``model``'s rows (whose one-token forward built the
    cache ``layers``), or None where it can."""
    config = model.config.get_text_config()
    context = getattr(config, "max_position_embeddings", None)
    if not all(attention_layer(layer) for layer in layers):
        return "its cache has layers other than attention (recurrent or state-space)"
    return (
        window_refusal(config, layers, context)
        or alibi_from_mask(config)
        or position_dependent_rope(config, context)
    )


def attention_layer(layer: object) -> bool:
    """Whether a cache layer holds attention KV: a full layer, or a sliding window's."""
    if getattr(layer, "keys", None) is None or getattr(layer, "values", None) is None:
        return False
    return type(layer) in (DynamicLayer, DynamicSlidingWindowLayer)


def windows(layers: Sequence[object], context: int | None) -> list[int | None]:
    """Each attention cache layer's sliding window, None where it attends to the whole
    ``context`` (a full layer, or a window that covers the context)."""
    found = [getattr(layer, "sliding_window", None) for layer in layers]
    return [None if context is not None and w is not None and w >= context else w for w in found]


def window_refusal(config: Any, layers: Sequence[object], context: int | None) -> str | None:
    """Why a model's sliding layers cannot run steps: cache layers other than its config's
    ``layer_types`` (a chunked attention's, say), windows of several sizes, or sliding and
    full layers without ``layer_types`` to tell apart (a step's masks go by layer type)."""
    kinds = [
        "sliding_attention" if type(layer) is DynamicSlidingWindowLayer else "full_attention"
        for layer in layers
    ]
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and list(layer_types) != kinds:
        return f"its cache layers are not its layer_types {list(layer_types)}"
    sizes = set(windows(layers, context))
    if len(sizes - {None}) > 1:
        return "its sliding layers' windows differ"
    if len(sizes) > 1 and layer_types is None:
        return "its sliding and full layers have no layer_types"
    return None


def sliding_window(model: Any, layers: Sequence[object]) -> SlidingWindow | None:
    """The sliding window of ``model`` (which `kv_reuse_refusal` accepts) whose probe
    built the cache ``layers``; None where every layer attends to the whole context."""
    config = model.config.get_text_config()
    sizes = windows(layers, getattr(config, "max_position_embeddings", None))
    size = next((size for size in sizes if size is not None), None)
    if size is None:
        return None
    return SlidingWindow(size, tuple(size is not None for size in sizes))


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
    parameters = getattr(config, "rope_parameters", None)
    if not isinstance(parameters, Mapping):
        return None
    nested = [value for value in parameters.values() if isinstance(value, Mapping)]
    for rope in nested or [parameters]:  # one set, or one per layer type
        if rope.get("rope_type") != "longrope":
            continue
        switch = rope.get("original_max_position_embeddings")
        if context is None or switch is None or switch < context:
            return (
                f"its longrope RoPE switches factors past position {switch}, within its "
                f"context of {context}"
            )
    return None
