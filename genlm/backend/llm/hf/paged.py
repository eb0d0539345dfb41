"""A step's inputs for `AsyncTransformer`'s paged KV: the index tensors of its rows.

A step (rows with the same number ``t`` of new tokens) is described to the device by ONE
int64 tensor built on the host with numpy (`step_inputs`): input ids, positions, write
slots, read slots (left-padded), each row's first unpadded key, the shared prefix's slots.
It reaches the device in one copy (from pinned memory, non-blocking, on CUDA) and is
sliced there, so the ops a step launches do not depend on its number of rows or on
their context length: one write and one gather per layer and K/V, whatever the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from genlm.backend.kv.store import RowPlan

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


def shared_blocks(plans: Sequence[RowPlan], block_size: int) -> int:
    """Blocks at the start of every plan's chain that all plans share, within every plan's
    past: the common prefix of the lexicographically first and last chains (so one pass
    over one chain, not over every plan's)."""
    limit = min(plan.start for plan in plans) // block_size
    cut = [plan.chain[:limit] for plan in plans]
    low, high = min(cut), max(cut)
    return next((i for i, (a, b) in enumerate(zip(low, high, strict=True)) if a != b), len(low))


def cascade_blocks(plans: Sequence[RowPlan], block_size: int) -> int:
    """The `shared_blocks` a step's cascade attention reads once for all its plans, or 0
    (no cascade: a lone plan, or fewer than ``CASCADE_MIN_SHARED`` shared tokens). The
    one decision for the eager step and its CUDA graph alike: a lone row reading its
    whole past as shared would change graph buckets every few tokens."""
    if len(plans) < 2:
        return 0
    blocks = shared_blocks(plans, block_size)
    return blocks if blocks * block_size >= CASCADE_MIN_SHARED else 0


def exact_shape(plans: Sequence[RowPlan], block_size: int, skip_blocks: int) -> StepShape:
    """The smallest shape of the plans' step with ``skip_blocks`` shared blocks."""
    skip = skip_blocks * block_size
    past = max(plan.start for plan in plans) - skip
    return StepShape(len(plans), plans[0].new_tokens, past, skip)


def host_step(
    plans: Sequence[RowPlan], block_size: int, skip_blocks: int, shape: StepShape, pin: bool
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
    plans: Sequence[RowPlan], block_size: int, skip_blocks: int, device: torch.device
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
