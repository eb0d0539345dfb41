"""The paged KV layer of `AsyncTransformer`: a decode step's index tensors, the transformers
`Cache` that writes and reads the pool's slots, and cascade attention.

A step (rows with the same number ``t`` of new tokens) is described to the device by ONE
int64 tensor built on the host with numpy (`step_inputs`): input ids, positions, write
slots, read slots (left-padded), each row's first unpadded key, the shared prefix's slots.
It reaches the device in one copy (from pinned memory, non-blocking, on CUDA) and is
sliced there, so the ops a step launches do not depend on its number of rows or on
their context length: one write and one gather per layer and K/V, whatever the batch.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from genlm.backend.kv.torch_pool import TorchBlockPool
from genlm.backend.llm.prefix import QueryPlan

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CASCADE_MIN_SHARED = 64  # shared tokens from which a group uses cascade attention


# Padding rows write their one token's KV here (the last slot of block 0, which no chain
# uses; slot 0, read for left padding, stays zero: every key read is finite).
def scratch_slot(block_size: int) -> int:
    return block_size - 1


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
        tokens = self.rows * self.new
        return (
            tokens,
            tokens,
            tokens,
            self.rows * (self.past + self.new),
            self.rows,
            self.shared,
            1,
        )


@dataclass(frozen=True)
class StepInputs:
    """A group's forward inputs, all views of one device tensor.

    ``read`` holds each row's tokens after the ``shared`` ones, left-padded to
    ``past + new`` keys with slot 0 (block 0, all zeros); ``first`` is each row's first
    unpadded key in ``read``; ``shared`` the slots every row reads first (cascade), of
    which the first ``shared_used`` are the prefix's (the rest padding, when
    ``shared_padded``).
    """

    input_ids: torch.Tensor  # [rows, new]
    position_ids: torch.Tensor  # [rows, new]
    write: torch.Tensor  # [rows, new]
    read: torch.Tensor  # [rows, past + new]
    first: torch.Tensor  # [rows]
    shared: torch.Tensor  # [shared]
    shared_used: torch.Tensor  # [1]
    past: int  # keys before the new tokens in ``read``
    padded: bool  # some row may have fewer past tokens than ``past``
    shared_padded: bool

    @classmethod
    def split(
        cls, flat: torch.Tensor, shape: StepShape, padded: bool, shared_padded: bool
    ) -> StepInputs:
        """The views of ``flat``, a tensor laid out as ``shape.sizes``."""
        ids, positions, write, read, first, shared, used = flat.split(shape.sizes)
        rows = shape.rows
        return cls(
            ids.view(rows, shape.new),
            positions.view(rows, shape.new),
            write.view(rows, shape.new),
            read.view(rows, shape.past + shape.new),
            first,
            shared,
            used,
            shape.past,
            padded,
            shared_padded,
        )


def shared_blocks(plans: Sequence[QueryPlan], block_size: int) -> int:
    """Blocks at the start of every plan's chain that all plans share, within every plan's
    past: the common prefix of the lexicographically first and last chains (so one pass
    over one chain, not over every plan's)."""
    limit = min(plan.start for plan in plans) // block_size
    cut = [plan.chain[:limit] for plan in plans]
    low, high = min(cut), max(cut)
    return next((i for i, (a, b) in enumerate(zip(low, high, strict=True)) if a != b), len(low))


def cascade_blocks(plans: Sequence[QueryPlan], block_size: int) -> int:
    """The `shared_blocks` a step's cascade attention reads once for all its plans, or 0
    (no cascade: a lone plan, or fewer than ``CASCADE_MIN_SHARED`` shared tokens). The
    one decision for the eager step and its CUDA graph alike: a lone row reading its
    whole past as shared would change graph buckets every few tokens."""
    if len(plans) < 2:
        return 0
    blocks = shared_blocks(plans, block_size)
    return blocks if blocks * block_size >= CASCADE_MIN_SHARED else 0


def exact_shape(plans: Sequence[QueryPlan], block_size: int, skip_blocks: int) -> StepShape:
    """The smallest shape of the plans' step with ``skip_blocks`` shared blocks."""
    skip = skip_blocks * block_size
    past = max(plan.start for plan in plans) - skip
    return StepShape(len(plans), plans[0].new_tokens, past, skip)


def host_step(
    plans: Sequence[QueryPlan], block_size: int, skip_blocks: int, shape: StepShape, pin: bool
) -> torch.Tensor:
    """The plans' inputs as one host int64 tensor laid out as ``shape`` (at least their
    `exact_shape`), built with numpy over each plan's own blocks (the shared
    ``skip_blocks`` once). Rows beyond the plans are padding: token 0 at position 0,
    writing and reading only the scratch slot; keys beyond a row's are left padding;
    shared slots beyond the prefix's read slot 0 (masked by ``shared_used``)."""
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
    scratch = scratch_slot(block_size)
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
    plans: Sequence[QueryPlan], block_size: int, skip_blocks: int, device: torch.device
) -> StepInputs:
    """The plans' inputs in their `exact_shape`, moved to ``device`` in one copy (from
    pinned memory, non-blocking, on CUDA)."""
    shape = exact_shape(plans, block_size, skip_blocks)
    host = host_step(plans, block_size, skip_blocks, shape, pin=device.type == "cuda")
    padded = min(plan.start for plan in plans) - skip_blocks * block_size < shape.past
    return StepInputs.split(host.to(device, non_blocking=True), shape, padded, False)


def attention_mask(first: torch.Tensor, past: int, new: int) -> torch.Tensor:
    """Boolean ``[rows, 1, new, past + new]`` mask: a row sees its own keys (from
    ``first[row]`` on: the left padding hidden) causally."""
    keys = torch.arange(past + new, device=first.device)
    queries = torch.arange(past, past + new, device=first.device)
    return ((keys >= first[:, None, None]) & (keys <= queries[:, None]))[:, None]


class _PagedLayer(DynamicLayer):
    """A cache layer over one layer's block pool: update writes the new tokens' KV into
    their slots and returns each row's KV gathered from its chain (``[rows, heads, past + t, dim]``)."""

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        write: torch.Tensor,
        read: torch.Tensor,
        past_length: int,
        shared: torch.Tensor | None = None,
        shared_mask: torch.Tensor | None = None,
    ):
        super().__init__()
        self.pool_keys, self.pool_values = keys, values
        self.write, self.read, self.shared = write, read, shared
        self.shared_mask = shared_mask
        self.dtype, self.device = keys.dtype, keys.device
        self.past_length = past_length
        self.is_initialized = True

    def shared_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix every row shares (cascade attention), read once: ``[heads, shared, dim]``."""
        return (
            self.pool_keys[self.shared].transpose(0, 1),
            self.pool_values[self.shared].transpose(0, 1),
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, heads, new, dim = key_states.shape
        self.pool_keys.index_copy_(
            0, self.write, key_states.transpose(1, 2).reshape(rows * new, heads, dim)
        )
        self.pool_values.index_copy_(
            0, self.write, value_states.transpose(1, 2).reshape(rows * new, heads, dim)
        )
        return self.pool_keys[self.read].transpose(1, 2), self.pool_values[self.read].transpose(
            1, 2
        )

    def get_seq_length(self) -> int:
        return self.past_length


def paged_cache(
    pool: TorchBlockPool,
    write: torch.Tensor,
    read: torch.Tensor,
    past_length: int,
    shared: torch.Tensor | None = None,
    shared_used: torch.Tensor | None = None,
) -> Cache:
    """A transformers `Cache` over ``pool`` whose layers write ``write`` slots and read
    ``read`` rows (after the ``shared`` slots every row attends to, with cascade attention;
    of them only the first ``shared_used`` when it is given)."""
    mask = None
    if shared is not None and shared_used is not None:
        mask = torch.arange(shared.shape[0], device=shared.device) < shared_used
    return Cache(
        layers=[
            _PagedLayer(layer[0], layer[1], write, read, past_length, shared, mask)
            for layer in pool.layers
        ]
    )


def step_cache(pool: TorchBlockPool, step: StepInputs) -> Cache:
    """The paged cache of a step whose rows read the shared slots first (cascade)."""
    used = step.shared_used if step.shared_padded else None
    return paged_cache(pool, step.write.flatten(), step.read, step.past, step.shared, used)


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
    their running maximum and sums (log-sum-exp). The layer's paged cache comes in
    ``kwargs["genlm_cache"]`` (see `sdpa_or_cascade_attention`); padding shared slots, if
    any, are hidden by its ``shared_mask``.
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
    """transformers' ``sdpa`` attention, or `cascade_attention` for a forward that passes
    its paged cache as ``genlm_cache=``: the choice is made per call, by that keyword.

    Registered (by `register_cascade`) as the ``"sdpa"`` entry of transformers' attention
    registry, so no model config is switched around a forward: every other forward, of
    any model in any thread, passes no ``genlm_cache`` and gets plain ``sdpa``.
    """
    if "genlm_cache" in kwargs:
        assert attention_mask is not None  # a cascade forward passes its boolean mask
        return cascade_attention(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_cascade(model: PreTrainedModel, num_layers: int) -> bool:
    """Register `sdpa_or_cascade_attention` as ``"sdpa"``; whether ``model`` runs ``sdpa``
    and each of its attention modules (one per KV layer) looks ``sdpa`` up in a registry
    that now answers it (a model with its own ``sdpa`` would ignore ``genlm_cache=``)."""
    if model.config._attn_implementation != "sdpa":
        return False
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa", sdpa_or_cascade_attention)
    modules = [
        module
        for module in model.modules()
        if hasattr(module, "layer_idx") and hasattr(module, "num_key_value_groups")
    ]
    registries = [
        getattr(sys.modules[type(module).__module__], "ALL_ATTENTION_FUNCTIONS", None)
        for module in modules
    ]
    return len(modules) == num_layers and all(
        registry is not None and registry.get_interface("sdpa", None) is sdpa_or_cascade_attention
        for registry in registries
    )
