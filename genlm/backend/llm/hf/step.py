"""`AsyncTransformer`'s attention backend, as vLLM writes one: a step's inputs (`StepInputs`)
and their builder (`host_step`: one int64 host tensor, one copy to the device, so a step's
ops do not grow with its rows or context), the model's inputs built from them
(`model_inputs`: eager step, prefill chunk and graph capture alike), the paged cache the
attention modules write and read (`PagedCache`), and cascade attention. The cache reaches
attention through a context variable (`STEP_CACHE`), a channel no decoder layer can drop.
Narrative: docs/kv-store.md.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from genlm.backend.kv.store import RowPlan
from genlm.backend.kv.torch_pool import TorchBlockPool

CASCADE_MIN_SHARED = 64  # shared tokens from which a group uses cascade attention
# The attention implementation `use_cascade` gives a model: `sdpa_or_cascade_attention`.
CASCADE_ATTENTION = "genlm_cascade"


@dataclass(frozen=True)
class StepShape:
    """The sizes of a step's inputs: ``rows`` rows of ``new`` tokens, each reading ``past``
    keys before them through its own slots, after ``shared`` slots every row reads."""

    rows: int
    new: int
    past: int
    shared: int

    @property
    def sizes(self) -> tuple[int, ...]:
        """Lengths of the fields of the step's one int64 tensor, in order: input ids,
        positions, write slots, read slots, first keys, shared slots, shared slots in use."""
        rows, tokens = self.rows, self.rows * self.new
        return tokens, tokens, tokens, rows * (self.past + self.new), rows, self.shared, 1


@dataclass(frozen=True)
class StepInputs:
    """A step's inputs, all views of one device tensor. ``read`` holds each row's tokens
    after the ``shared`` ones, left-padded to ``past + new`` keys with slot 0 (block 0, all
    zeros); ``first`` is each row's first unpadded key in ``read``; ``shared`` the slots
    every row reads first (cascade attention, if any), of which the first ``shared_used``
    are the prefix's (the rest padding, when ``shared_padded``)."""

    input_ids: torch.Tensor  # [rows, new]
    position_ids: torch.Tensor  # [rows, new]
    write: torch.Tensor  # [rows, new]
    read: torch.Tensor  # [rows, past + new]
    first: torch.Tensor  # [rows]
    shared: torch.Tensor  # [shared]
    shared_used: torch.Tensor  # [1]
    past: int  # keys before the new tokens in ``read``
    padded: bool  # some row may have fewer past tokens than ``past``
    shared_padded: bool = False

    @classmethod
    def split(
        cls, flat: torch.Tensor, shape: StepShape, padded: bool, shared_padded: bool = False
    ) -> StepInputs:
        """The views of ``flat``, a tensor laid out as ``shape.sizes``."""
        ids, positions, write, read, first, shared, used = flat.split(shape.sizes)
        ids, positions, write, read = (
            t.view(shape.rows, -1) for t in (ids, positions, write, read)
        )
        return cls(
            ids, positions, write, read, first, shared, used, shape.past, padded, shared_padded
        )


@dataclass(frozen=True)
class SlidingWindow:
    """The window of a model's sliding layers (``sliding``: whether each KV layer is one):
    a query attends to the ``size`` keys up to its own (key position > query position -
    ``size``, as transformers' sliding masks)."""

    size: int
    sliding: tuple[bool, ...]


def cascade_blocks(plans: Sequence[RowPlan], block_size: int) -> int:
    """The blocks at the start of every plan's chain, within every plan's past, that a
    step's cascade attention reads once for all its plans, or 0 (a lone plan, or fewer than
    ``CASCADE_MIN_SHARED`` shared tokens). The common prefix of the lexicographically first
    and last chains."""
    if len(plans) < 2:
        return 0
    limit = min(plan.start for plan in plans) // block_size
    cut = [plan.chain[:limit] for plan in plans]
    low, high = min(cut), max(cut)
    blocks = next((i for i, (a, b) in enumerate(zip(low, high, strict=True)) if a != b), len(low))
    return blocks if blocks * block_size >= CASCADE_MIN_SHARED else 0


def exact_shape(plans: Sequence[RowPlan], block_size: int, skip_blocks: int) -> StepShape:
    """The smallest shape of the plans' step with ``skip_blocks`` shared blocks."""
    skip = skip_blocks * block_size
    past = max(plan.start for plan in plans) - skip
    return StepShape(len(plans), plans[0].new_tokens, past, skip)


def host_step(
    plans: Sequence[RowPlan], block_size: int, skip_blocks: int, shape: StepShape, pin: bool
) -> torch.Tensor:
    """The step's builder: the plans' inputs as one host int64 tensor laid out as ``shape``
    (at least their `exact_shape`), built with numpy over each plan's own blocks (the
    shared ``skip_blocks`` once). Rows beyond the plans are padding: token 0 at position 0,
    writing and reading only the scratch slot; keys beyond a row's are left padding; shared
    slots beyond the prefix's read slot 0 (masked by ``shared_used``)."""
    count, new, rows = len(plans), shape.new, shape.rows
    skip = skip_blocks * block_size
    starts = np.fromiter((plan.start for plan in plans), np.int64, count)
    own = [plan.chain[skip_blocks:] for plan in plans]
    lengths = np.fromiter(map(len, own), np.int64, count)
    table = np.zeros((count, int(lengths.max())), np.int64)
    table[np.arange(table.shape[1]) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(own), np.int64, int(lengths.sum())
    )
    width = shape.past + new
    host = torch.zeros(sum(shape.sizes), dtype=torch.int64, pin_memory=pin)
    fields = np.split(host.numpy(), np.cumsum(shape.sizes)[:-1])
    ids, positions, write = (field.reshape(rows, new) for field in fields[:3])
    read, first, shared, used = fields[3].reshape(rows, width), fields[4], fields[5], fields[6]
    ids[:count] = np.fromiter(
        itertools.chain.from_iterable(plan.ids[plan.start :] for plan in plans),
        np.int64,
        count * new,
    ).reshape(count, new)
    by_row = np.arange(count)[:, None]
    token = starts[:, None] + np.arange(new)
    positions[:count] = token
    token -= skip
    write[:count] = table[by_row, token // block_size] * block_size + token % block_size
    pad = shape.past - (starts - skip)
    key = np.arange(width) - pad[:, None]
    hidden = key < 0
    key[hidden] = 0
    slots = table[by_row, key // block_size] * block_size + key % block_size
    slots[hidden] = 0
    read[:count] = slots
    first[:count] = pad
    # padding rows write the last slot of block 0, which no chain uses (slot 0, read for
    # left padding, stays zero: every key read is finite)
    scratch = block_size - 1
    write[count:] = scratch
    read[count:, shape.past :] = scratch
    first[count:] = shape.past
    shared[:skip] = (
        np.asarray(plans[0].chain[:skip_blocks], np.int64)[:, None] * block_size
        + np.arange(block_size)
    ).ravel()
    used[0] = skip
    return host


def step_inputs(
    plans: Sequence[RowPlan], block_size: int, skip_blocks: int, device: torch.device
) -> StepInputs:
    """The plans' inputs in their `exact_shape`, moved to ``device`` in one copy (from
    pinned memory, non-blocking, on CUDA)."""
    shape = exact_shape(plans, block_size, skip_blocks)
    host = host_step(plans, block_size, skip_blocks, shape, pin=device.type == "cuda")
    padded = min(plan.start for plan in plans) - skip_blocks * block_size < shape.past
    return StepInputs.split(host.to(device, non_blocking=True), shape, padded)


class _PagedLayer(DynamicLayer):
    """A layer of a `PagedCache`, over the pool's layer ``kv`` (``[2, slots, heads, dim]``):
    update writes the new tokens' KV into their ``write`` slots and returns each row's KV
    gathered through its ``read`` slots (``[rows, heads, past + t, dim]``)."""

    def __init__(self, kv: torch.Tensor, write: torch.Tensor, read: torch.Tensor, past: int):
        super().__init__()
        self.kv, self.write, self.read, self.past = kv, write, read, past
        self.dtype, self.device = kv.dtype, kv.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        heads, dim = key_states.shape[1], key_states.shape[3]
        for pool, states in zip(self.kv.unbind(0), (key_states, value_states), strict=True):
            pool.index_copy_(0, self.write, states.transpose(1, 2).reshape(-1, heads, dim))
        keys, values = self.kv[:, self.read].transpose(2, 3).unbind(0)
        return keys, values

    def get_seq_length(self) -> int:
        return self.past


class PagedCache(Cache):
    """A transformers `Cache` over the pool for one forward: its layers write the ``write``
    slots and read the ``read`` rows, after the ``shared`` slots every row attends to with
    cascade attention (None: no cascade), of which ``shared_mask`` hides the padding ones
    and ``shared_window`` those out of each query's window on the ``window``'s sliding
    layers. Inside ``with``, the current one (`STEP_CACHE`)."""

    _token: Token[PagedCache | None]

    def __init__(
        self,
        pool: TorchBlockPool,
        write: torch.Tensor,
        read: torch.Tensor,
        past: int,
        shared: torch.Tensor | None,
        shared_mask: torch.Tensor | None,
        window: SlidingWindow | None,
        shared_window: torch.Tensor | None,
    ):
        self.shared, self.shared_mask, self.pool_layers = shared, shared_mask, pool.layers
        self.window, self.shared_window = window, shared_window
        super().__init__(layers=[_PagedLayer(kv, write, read, past) for kv in pool.layers])

    def shared_kv(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The prefix every row shares, read once: keys and values ``[heads, shared, dim]``."""
        return self.pool_layers[layer][:, self.shared].transpose(1, 2).unbind(0)

    def __enter__(self) -> PagedCache:
        self._token = STEP_CACHE.set(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        STEP_CACHE.reset(self._token)


# The paged cache of the forward this thread runs now (`PagedCache`, entered by
# `ModelForward.step`), which cascade attention reads its shared prefix from.
STEP_CACHE: ContextVar[PagedCache | None] = ContextVar("genlm_step_cache", default=None)


def model_inputs(
    pool: TorchBlockPool,
    step: StepInputs,
    begin: int,
    end: int,
    mask_dtype: torch.dtype | None,
    window: SlidingWindow | None = None,
) -> tuple[PagedCache, dict[str, Any]]:
    """The model's inputs for new tokens ``begin:end`` of each row of ``step``: its
    `PagedCache` (cascade attention when the step has shared slots) and the ids, positions
    and ``[rows, 1, new, keys]`` mask (boolean, or additive in ``mask_dtype`` for eager
    attention; none when no row is padded and the tokens run causally from the start).
    With a sliding ``window`` the mask also hides keys out of each query's window: one
    mask, or one per layer type (``config.layer_types``) where some layers attend fully."""
    new, past = end - begin, step.past + begin
    shared = step.shared if step.shared.shape[0] else None
    mask: torch.Tensor | dict[str, torch.Tensor] | None = None
    shared_window = None
    if window is not None or shared is not None or step.padded or (past and new > 1):
        keys = torch.arange(past + new, device=step.first.device)
        queries = keys[past:, None]
        mask = ((keys >= step.first[:, None, None]) & (keys <= queries))[:, None]
        if window is not None:
            # a key's distance from a query in ``read`` is their positions' distance
            sliding = mask & (keys > queries - window.size)
            by_type = {"full_attention": mask, "sliding_attention": sliding}  # a hybrid's
            mask = sliding if all(window.sliding) else by_type
            if shared is not None:  # the shared keys (positions 0, 1, ...) in each window
                slots = torch.arange(shared.shape[0], device=shared.device)
                shared_window = slots > step.position_ids[:, begin:end, None] - window.size
                shared_window = shared_window[:, None]
        if mask_dtype is not None and isinstance(mask, dict):
            mask = {name: _additive(part, mask_dtype) for name, part in mask.items()}
        elif mask_dtype is not None and isinstance(mask, torch.Tensor):
            mask = _additive(mask, mask_dtype)
    shared_mask = None
    if shared is not None and step.shared_padded:
        shared_mask = torch.arange(shared.shape[0], device=shared.device) < step.shared_used
    whole = begin == 0 and end == step.input_ids.shape[1]  # no slicing: no op
    read = step.read if whole else step.read[:, : step.past + end]
    write, ids, positions = (
        (field if whole else field[:, begin:end])
        for field in (step.write, step.input_ids, step.position_ids)
    )
    cache = PagedCache(
        pool, write.flatten(), read, past, shared, shared_mask, window, shared_window
    )
    return cache, dict(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Eager attention's additive mask in ``dtype`` for a boolean ``mask``: 0 where a key
    is read, the dtype's lowest value where not."""
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill_(~mask, torch.finfo(dtype).min)


def cascade_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over a prefix shared by every row (the current `PagedCache`'s, read once
    for all rows: one matmul per KV head) plus each row's own keys (``attention_mask``: a
    boolean ``[rows, 1, new, own]`` mask); the two softmax parts merge exactly (log-sum-exp)."""
    cache = STEP_CACHE.get()
    assert cache is not None and attention_mask is not None  # a cascade step's forward
    shared_keys, shared_values = cache.shared_kv(module.layer_idx)
    rows, q_heads, new, dim = query.shape
    kv_heads = key.shape[1]
    groups = q_heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    q = query.reshape(rows, kv_heads, groups * new, dim) * scale
    flat = q.transpose(0, 1).reshape(kv_heads, rows * groups * new, dim)
    shared = torch.matmul(flat, shared_keys.transpose(1, 2))
    window = (
        cache.shared_window if cache.window and cache.window.sliding[module.layer_idx] else None
    )
    if window is not None:  # a sliding layer: the shared keys out of each query's window
        shared = torch.where(window, shared.view(kv_heads, rows, groups, new, -1), float("-inf"))
    shared = shared.view(kv_heads, rows, groups * new, -1).transpose(0, 1)
    if cache.shared_mask is not None:
        shared = torch.where(cache.shared_mask, shared, float("-inf"))
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
    """`cascade_attention` inside a step with a shared prefix (its `PagedCache` current),
    else transformers' ``sdpa`` attention: the attention `use_cascade` gives a model."""
    cache = STEP_CACHE.get()
    if cache is not None and cache.shared is not None:
        return cascade_attention(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_cascade(model: Any, num_layers: int) -> bool:
    """Make `sdpa_or_cascade_attention` (registered with transformers as
    `CASCADE_ATTENTION`, with ``sdpa``'s masks) the attention of ``model``, a model that
    runs ``sdpa``; other models and transformers' own entries are left as they are.
    Whether each of its attention modules (one per KV layer) now finds it: a model that
    cannot switch, or is not a `plain_softmax`, keeps its ``sdpa`` and runs no cascade."""
    modules = attention_modules(model)
    implementation = model.config._attn_implementation
    if implementation not in ("sdpa", CASCADE_ATTENTION) or not all(map(plain_softmax, modules)):
        return False
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(CASCADE_ATTENTION, sdpa_or_cascade_attention)
    AttentionMaskInterface.register(CASCADE_ATTENTION, sdpa_mask)
    set_attention(model, CASCADE_ATTENTION)
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


def plain_softmax(module: torch.nn.Module) -> bool:
    """Whether an attention module's weights are the plain softmax of its scaled scores, as
    cascade attention computes them: no logit soft-capping (Gemma 2's) and no attention
    sinks (gpt-oss')."""
    return (
        getattr(module, "attn_logit_softcapping", None) is None
        and getattr(module, "sinks", None) is None
    )


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s attention modules: those with a KV layer (``layer_idx``) and KV heads."""
    return [
        module
        for module in model.modules()
        if hasattr(module, "layer_idx") and hasattr(module, "num_key_value_groups")
    ]


def set_attention(model: torch.nn.Module, implementation: str) -> None:
    """Set the attention implementation of ``model`` (or of the transformers model a
    wrapper of it holds), which its attention modules look up at each forward."""
    from transformers import PreTrainedModel

    outermost = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if outermost is not None:
        outermost.set_attn_implementation(implementation)
