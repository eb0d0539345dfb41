"""`TransformerRunner`: `AsyncTransformer`'s forward over a batch's rows (a `RowRunner`).

`PrefixCachedLM` hands it a plan's rows (`run`: each a block chain and new tokens, one
row of the batch); it calls down only, never the store or the LM. Per group of rows with
the same number ``t`` of new tokens (no query row is padded, so no fully masked
attention rows and no NaNs from them; the usual step has ``t = 1`` for everyone):

1. the group's inputs (ids, positions, write and read slots) are built on the host as
   ONE tensor that reaches the device in one copy (`genlm.backend.llm.hf.paged`), and
   ONE forward runs over the ``rows x t`` new tokens with explicit position ids and a 4-D
   mask (none when nothing is padded), through the model's forward
   (`genlm.backend.llm.hf.forward.ModelForward`); a small `Cache` writes each layer's
   new KV into the rows' blocks and reads each row's KV through its chain. When the rows
   share a prefix of at least ``CASCADE_MIN_SHARED`` tokens, cascade attention reads the
   shared blocks once per layer for all rows and only each row's own tokens through its
   chain; longer groups run in chunks of ``max_batch_tokens``;
2. the LM head runs at the last position only, over the tokenizer's columns, into a
   fresh float32 ``[rows, vocab]`` batch of log-probabilities.

A step's op count (kernel launches on a GPU) is the same for 8 rows as for 128, at any
context length (tests/test_hf_step.py, benchmark/bench_host.py). With ``cuda_graphs``
a decode step on CUDA is a replay of its shape bucket's CUDA graph instead
(`genlm.backend.llm.hf.graphs`); off by default: the eager step is the path a GPU has
run, and graphs become the default once a GPU run shows them right and faster.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from genlm.backend.kv.pool import Chain
from genlm.backend.kv.store import RowPlan
from genlm.backend.kv.torch_pool import TorchBlockPool
from genlm.backend.llm.hf.cache import paged_cache
from genlm.backend.llm.hf.forward import ModelForward
from genlm.backend.llm.hf.graphs import DecodeGraphs, recorder_for
from genlm.backend.llm.hf.paged import attention_mask, cascade_blocks, step_inputs
from genlm.backend.llm.prefix import plan_order, row_groups


class TransformerRunner:
    """The forward of a transformers causal LM over a batch's rows.

    Args:
        model: the model.
        vocab_size: the tokenizer's vocabulary: the columns of each row's logprobs.
        max_batch_tokens: most new tokens run in one forward.
        lora_batching: ``"mixed"`` or ``"grouped"`` (`AsyncTransformer`).
        cuda_graphs: replay decode steps of up to ``batch_size`` rows from CUDA graphs,
            where they can be captured.
    """

    def __init__(
        self,
        model: Any,
        vocab_size: int,
        *,
        max_batch_tokens: int,
        lora_batching: str,
        cuda_graphs: bool,
        batch_size: int,
    ):
        self.forward = ModelForward(model, vocab_size)
        self.pool = self.forward.pool  # None: the model's KV cannot be reused
        self.max_batch_tokens = max_batch_tokens
        self.lora_batching = lora_batching
        self.cascade = self.forward.cascade
        self.graphs = self._decode_graphs(batch_size) if cuda_graphs else None

    def read_past(self, chain: Chain, tokens: int) -> torch.Tensor:
        """A copy of the KV of a chain's first ``tokens`` tokens:
        ``[layers, 2, kv_heads, tokens, head_dim]``."""
        assert self.pool is not None  # chains go with KV reuse
        return self.pool.read(chain, tokens)

    def load_adapter(self, lora_path: str, lora_name: str) -> None:
        """Load an adapter into the model's shared peft model, and only then let it replace
        this LM's adapter of that name; the graphs, captured over the model's old modules,
        are dropped."""
        forward = self.forward
        peft_name = forward.shared.load_adapter(forward.model, lora_path)
        replaced = forward.adapters.get(lora_name)
        forward.adapters[lora_name] = peft_name
        if replaced is not None:
            forward.shared.unload_adapter(replaced)
        if self.graphs is not None:
            self.graphs.clear()

    def unload_adapter(self, lora_name: str) -> None:
        self.forward.shared.unload_adapter(self.forward.adapters.pop(lora_name))

    def free(self) -> None:
        """Let go of the captured graphs and of the model (`ModelForward.close`)."""
        if self.graphs is not None:
            self.graphs.clear()
        self.forward.close()

    def _decode_graphs(self, batch_size: int) -> DecodeGraphs | None:
        """CUDA graphs of decode steps of up to ``batch_size`` rows, where they can be
        captured: cascade attention over the paged KV (the step's shapes are then its
        bucket's), on a CUDA device, with no quantized weights (their kernels are not
        checked for capture)."""
        forward = self.forward
        recorder = recorder_for(forward.input_device)
        if (
            recorder is None
            or not self.cascade
            or forward.output_device != forward.input_device
            or getattr(forward.model, "hf_quantizer", None) is not None
        ):
            return None
        return DecodeGraphs(
            forward.decode_step, recorder, forward.input_device, forward.vocab_size, batch_size
        )

    def run(self, rows: Sequence[RowPlan]) -> torch.Tensor:
        """The rows' logprobs as one ``[rows, vocab]`` batch of its own, in order (the tree
        keeps views of its rows). Rows with the same number of new tokens (and adapter,
        with ``lora_batching="grouped"``) run in one forward each, split to respect
        ``max_batch_tokens``; without KV reuse, rows of one length together."""
        pool = self.pool
        grouped = self.lora_batching == "grouped"
        if pool is None:
            groups = row_groups(rows, lambda row: len(row.ids))
        else:
            groups = row_groups(rows, lambda row: (row.new_tokens, grouped and row.lora))
        with self.forward.serving(), torch.inference_mode():
            out = torch.empty(
                (len(rows), self.forward.vocab_size),
                dtype=torch.float32,
                device=self.forward.output_device,
            )
            offset = 0
            for indices in groups:
                same = [rows[i] for i in indices]
                batch = out if len(groups) == 1 else out[offset : offset + len(same)]
                offset += len(same)
                if pool is None:
                    self.forward.whole_prefixes(same, batch)
                    continue
                per_forward = max(1, self.max_batch_tokens // same[0].new_tokens)
                for i in range(0, len(same), per_forward):
                    self._run_group(pool, same[i : i + per_forward], batch[i : i + per_forward])
            order = plan_order(groups)
            return out if order is None else out[torch.tensor(order, device=out.device)]

    def _run_group(self, pool: TorchBlockPool, plans: list[RowPlan], out: torch.Tensor) -> None:
        """One forward for plans sharing their number of new tokens: their logprobs into
        ``out``, and their new tokens' KV written into their chains. Its inputs reach the
        device as one tensor (`step_inputs`), so its ops do not grow with the plans or their
        context."""
        new_tokens = plans[0].new_tokens
        forward = self.forward
        graphs = self.graphs
        if graphs is not None and forward.shared.peft is None and graphs.run(plans, pool, out):
            return
        cascade = self.cascade and new_tokens <= self.max_batch_tokens
        skip = cascade_blocks(plans, pool.block_size) if cascade else 0
        step = step_inputs(plans, pool.block_size, skip, forward.input_device)
        loras = [plan.lora for plan in plans]
        if skip:
            forward.cascade_step(step, loras, out)
            return
        # A prefix longer than max_batch_tokens (a single plan) is prefilled in chunks.
        for chunk in range(0, new_tokens, self.max_batch_tokens):
            end = min(new_tokens, chunk + self.max_batch_tokens)
            past = step.past + chunk
            mask = None
            if step.padded or (past and end - chunk > 1):
                mask = forward.model_mask(attention_mask(step.first, past, end - chunk))
            cache = paged_cache(
                pool,
                step.write[:, chunk:end].flatten(),
                step.read[:, : step.past + end],
                past,
            )
            forward.logprobs_into(
                loras,
                out,
                cache,
                input_ids=step.input_ids[:, chunk:end],
                attention_mask=mask,
                position_ids=step.position_ids[:, chunk:end],
                use_cache=True,
            )
