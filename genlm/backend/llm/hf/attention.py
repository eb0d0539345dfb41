"""Cascade attention, `AsyncTransformer`'s attention over a prefix every row of a step
shares, and how a model reaches it: its own attention implementation (`use_cascade`),
which the model's forwards that pass their paged cache (`genlm.backend.llm.hf.cache`) as
``genlm_cache=`` run, and every other forward runs as transformers' ``sdpa``."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# The attention implementation `use_cascade` gives a model: `sdpa_or_cascade_attention`.
CASCADE_ATTENTION = "genlm_cascade"


def cascade_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over a prefix shared by every row plus each row's own tokens.

    The shared keys are read once for all rows (one matmul per KV head over every row's
    queries), each row's own keys (``key``/``value``, ``attention_mask`` a boolean
    ``[rows, 1, new, own]`` mask) apart; the two softmax parts are merged exactly through
    their running maximum and sums (log-sum-exp). The forward's paged cache comes in
    ``kwargs["genlm_cache"]`` (see `sdpa_or_cascade_attention`); padding shared slots, if
    any, are hidden by its layer's ``shared_mask``.
    """
    layer = kwargs["genlm_cache"].layers[module.layer_idx]
    shared_keys, shared_values = layer.shared_kv()
    rows, q_heads, new, dim = query.shape
    kv_heads = key.shape[1]
    groups = q_heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    q = query.reshape(rows, kv_heads, groups * new, dim) * scale
    flat = q.transpose(0, 1).reshape(kv_heads, rows * groups * new, dim)
    shared = torch.matmul(flat, shared_keys.transpose(1, 2))
    shared = shared.view(kv_heads, rows, groups * new, -1).transpose(0, 1)
    if layer.shared_mask is not None:
        shared = torch.where(layer.shared_mask, shared, float("-inf"))
    own = torch.matmul(q, key.transpose(2, 3)).view(rows, kv_heads, groups, new, -1)
    own = torch.where(attention_mask[:, :, None], own, float("-inf"))
    own = own.view(rows, kv_heads, groups * new, -1)
    top = torch.maximum(shared.amax(-1, keepdim=True), own.amax(-1, keepdim=True))
    shared = shared.sub_(top).exp_()
    own = own.sub_(top).exp_()
    total = shared.sum(-1, keepdim=True) + own.sum(-1, keepdim=True)
    shared_out = torch.matmul(
        shared.transpose(0, 1).reshape(kv_heads, rows * groups * new, -1), shared_values
    )
    out = shared_out.view(kv_heads, rows, groups * new, dim).transpose(0, 1)
    out = (out + torch.matmul(own, value)) / total
    return out.reshape(rows, q_heads, new, dim).transpose(1, 2), None


def sdpa_or_cascade_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """`cascade_attention` for a forward that passes its paged cache as ``genlm_cache=``
    (the model hands its call's keyword arguments to every attention call), else
    transformers' ``sdpa`` attention: the attention `use_cascade` gives a model."""
    if "genlm_cache" in kwargs:
        assert attention_mask is not None  # a cascade forward passes its boolean mask
        return cascade_attention(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_cascade(model: PreTrainedModel, num_layers: int) -> bool:
    """Make `sdpa_or_cascade_attention` the attention of ``model``, a model that runs
    ``sdpa``: registered with transformers under a name of its own, `CASCADE_ATTENTION`
    (with ``sdpa``'s masks), and set as the model's implementation (`set_attention`).
    transformers' own entries stay as they are, and so does every other model; this one
    runs ``sdpa`` as before, but for the forwards that pass ``genlm_cache=``. Whether each
    of its attention modules (one per KV layer) now finds it (a model that cannot switch
    keeps its ``sdpa`` and no cascade runs)."""
    if model.config._attn_implementation not in ("sdpa", CASCADE_ATTENTION):
        return False
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(CASCADE_ATTENTION, sdpa_or_cascade_attention)
    AttentionMaskInterface.register(CASCADE_ATTENTION, sdpa_mask)
    set_attention(model, CASCADE_ATTENTION)
    modules = attention_modules(model)
    registries = [
        getattr(sys.modules[type(module).__module__], "ALL_ATTENTION_FUNCTIONS", None)
        for module in modules
    ]
    return len(modules) == num_layers and all(
        getattr(getattr(module, "config", None), "_attn_implementation", None) == CASCADE_ATTENTION
        and registry is not None
        and registry.get_interface(CASCADE_ATTENTION, None) is sdpa_or_cascade_attention
        for module, registry in zip(modules, registries, strict=True)
    )


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s attention modules: those with a KV layer (``layer_idx``) and KV heads."""
    return [
        module
        for module in model.modules()
        if hasattr(module, "layer_idx") and hasattr(module, "num_key_value_groups")
    ]


def set_attention(model: torch.nn.Module, implementation: str) -> None:
    """Set ``model``'s attention implementation (that of the outermost transformers model:
    ``model``, or the one a wrapper of it holds), which its attention modules look up at
    each forward."""
    from transformers import PreTrainedModel

    outermost = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if outermost is not None:
        outermost.set_attn_implementation(implementation)
