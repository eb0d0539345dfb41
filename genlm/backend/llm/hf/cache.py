"""The transformers `Cache` of `AsyncTransformer`'s forwards over the paged KV pool: each
layer writes the new tokens' KV into their slots of the pool and reads each row's KV
through its slots (`genlm.backend.llm.hf.paged` builds the slots)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from genlm.backend.kv.torch_pool import TorchBlockPool
from genlm.backend.llm.hf.paged import StepInputs


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
