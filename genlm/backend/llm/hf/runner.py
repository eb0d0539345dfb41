"""`TransformerRunner`: `AsyncTransformer`'s forward over a batch's rows (a `RowRunner`).

It calls down only: rows grouped by their number of new tokens (`genlm.backend.kv.rows`; no
query row is padded, so no fully masked attention rows), each group's cascade decided
(`cascade_blocks`), its inputs built (`genlm.backend.llm.hf.step`) and the model's step run
(`ModelForward.step`) or replayed from a CUDA graph (`genlm.backend.llm.hf.graphs`), the
model held as the batch needs it (`ModelForward.serving`). A step's ops do not grow with its
rows or their context. The design: docs/kv-store.md ("One batch").
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from genlm.backend.kv.pool import Chain
from genlm.backend.kv.rows import plan_order, row_groups
from genlm.backend.kv.store import RowPlan
from genlm.backend.kv.torch_pool import TorchBlockPool
from genlm.backend.llm.hf.forward import ModelForward
from genlm.backend.llm.hf.graphs import DecodeGraphs, recorder_for
from genlm.backend.llm.hf.probe import prove_fast_path
from genlm.backend.llm.hf.step import cascade_blocks, step_inputs


class TransformerRunner:
    """The forward of a transformers causal LM over a batch's rows.

    ``vocab_size``: the columns of each row's logprobs; ``max_batch_tokens`` and
    ``lora_batching`` as `AsyncTransformer`'s options; ``cuda_graphs``: replay decode steps
    of up to ``batch_size`` rows from CUDA graphs, where they can be captured."""

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
        self.graphs: DecodeGraphs | None = None
        try:
            prove_fast_path(self)  # may turn the cascade off, or KV reuse
        except BaseException:
            self.forward.close()
            raise
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
            or self.pool is None
            or not self.cascade
            or forward.output_device != forward.input_device
            or getattr(forward.model, "hf_quantizer", None) is not None
        ):
            return None
        # a captured step's logits in memory of its own (the head's buffer would outlive it)
        step = partial(forward.step, reuse_logits=False)
        device, vocab = forward.input_device, forward.vocab_size
        return DecodeGraphs(step, recorder, device, vocab, self.pool.block_size, batch_size)

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
        order = plan_order(groups)
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
            return out if order is None else out[torch.tensor(order, device=out.device)]

    def _run_group(self, pool: TorchBlockPool, plans: list[RowPlan], out: torch.Tensor) -> None:
        """One step for plans sharing their number of new tokens (a longer one than
        ``max_batch_tokens``, a lone prefill, in chunks): their logprobs into ``out``, and
        their new tokens' KV written into their chains."""
        forward = self.forward
        cascade = self.cascade and plans[0].new_tokens <= self.max_batch_tokens
        skip = cascade_blocks(plans, pool.block_size) if cascade else 0
        graphs = self.graphs
        if graphs is not None and forward.shared.peft is None and graphs.run(plans, skip, out):
            return
        step = step_inputs(plans, pool.block_size, skip, forward.input_device)
        loras = [plan.lora for plan in plans]
        forward.step(step, out, loras, max_tokens=self.max_batch_tokens)
