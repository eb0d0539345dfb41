"""`TransformerRunner`: `AsyncTransformer`'s forward over a batch's rows.

It holds what the forward needs: the model (and its peft wrapper once an adapter is
loaded), the paged KV pool, the LM head applied into a reused buffer, the choice of
cascade attention and the CUDA graphs of decode steps. `PrefixCachedLM` hands it a
plan's rows (`run`); it groups them by new tokens, builds each group's inputs
(`genlm.backend.llm.hf.paged`), runs the model over the pool's `Cache`
(`genlm.backend.llm.hf.cache`) with cascade attention where rows share a prefix
(`genlm.backend.llm.hf.attention`) and the head (`genlm.backend.llm.hf.head`), and
returns the rows' logprobs; it never calls the store or the LM.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache

from genlm.backend.kv.pool import Chain
from genlm.backend.kv.store import RowPlan
from genlm.backend.kv.torch_pool import TorchBlockPool
from genlm.backend.llm.hf.attention import CASCADE_ATTENTION, use_cascade
from genlm.backend.llm.hf.cache import paged_cache, step_cache
from genlm.backend.llm.hf.graphs import DecodeGraphs, recorder_for
from genlm.backend.llm.hf.head import plain_head
from genlm.backend.llm.hf.options import cache_keyword
from genlm.backend.llm.hf.paged import StepInputs, attention_mask, cascade_blocks, step_inputs
from genlm.backend.llm.prefix import plan_order, row_groups

# peft's name for "no adapter" in a mixed-adapter batch.
BASE_ADAPTER = "__base__"


class TransformerRunner:
    """The forward of a transformers causal LM over a batch's rows (a `RowRunner`).

    Args:
        model: the model (in eval mode).
        vocab_size: the tokenizer's vocabulary: the columns of each row's logprobs.
        pool: the KV pool (None: the model's KV cannot be reused; each row runs its
            whole prefix).
        max_batch_tokens: most new tokens run in one forward.
        lora_batching: ``"mixed"`` or ``"grouped"`` (`AsyncTransformer`).
        cuda_graphs: replay decode steps of up to ``batch_size`` rows from CUDA graphs,
            where they can be captured.
    """

    def __init__(
        self,
        model: Any,
        vocab_size: int,
        pool: TorchBlockPool | None,
        *,
        max_batch_tokens: int,
        lora_batching: str,
        cuda_graphs: bool,
        batch_size: int,
    ):
        self.model = model
        self.vocab_size = vocab_size
        self.pool = pool
        self.max_batch_tokens = max_batch_tokens
        self.lora_batching = lora_batching
        self.peft: Any = None  # the peft model wrapping self.model, once an adapter is loaded
        self._peft_names: dict[str, str] = {}  # adapter name -> its name inside peft
        self._adapter_ids = itertools.count()
        self.input_device = model.get_input_embeddings().weight.device
        self.output_device = model.get_output_embeddings().weight.device
        self._cache_keyword = cache_keyword(model)
        self.head = plain_head(model, vocab_size, self.input_device)
        self.cascade = pool is not None and use_cascade(model, pool.layout.num_layers)
        self.graphs = self._decode_graphs(batch_size) if cuda_graphs else None

    def read_past(self, chain: Chain, tokens: int) -> torch.Tensor:
        """A copy of the KV of a chain's first ``tokens`` tokens:
        ``[layers, 2, kv_heads, tokens, head_dim]``."""
        assert self.pool is not None  # chains go with KV reuse
        return self.pool.read(chain, tokens)

    def free(self) -> None:
        """Let go of the head's logits buffer and the captured graphs."""
        if self.head is not None:
            self.head.free()
        if self.graphs is not None:
            self.graphs.clear()

    def _decode_graphs(self, batch_size: int) -> DecodeGraphs | None:
        """CUDA graphs of decode steps of up to ``batch_size`` rows, where they can be
        captured: cascade attention over the paged KV (the step's shapes are then its
        bucket's), on a CUDA device, with no quantized weights (their kernels are not
        checked for capture)."""
        recorder = recorder_for(self.input_device)
        if (
            recorder is None
            or not self.cascade
            or self.output_device != self.input_device
            or getattr(self.model, "hf_quantizer", None) is not None
        ):
            return None
        return DecodeGraphs(
            self._graph_forward, recorder, self.input_device, self.vocab_size, batch_size
        )

    def load_adapter(self, lora_path: str, lora_name: str) -> None:
        """Check the adapter, load it under a fresh peft name, and only then let it replace
        an adapter registered under ``lora_name``: any failure leaves the model and the
        registry as they were (no LoRA layers left injected)."""
        try:
            import peft
        except ImportError as error:
            from genlm.backend._install import install_hint

            raise ImportError(f"LoRA adapters need peft: {install_hint('lora')}") from error
        from genlm.backend.llm.adapters import check_peft_shapes, read_peft_adapter

        path, weights = read_peft_adapter(lora_path)
        check_peft_shapes(weights, self.model, path)
        # peft sees its own names: a user's name may hold "." (not a module name), be
        # "__base__", or be part of peft's "lora_" prefix, which peft misreads.
        peft_name = f"genlm{next(self._adapter_ids)}"
        try:
            if self.peft is None:
                self.peft = peft.PeftModel.from_pretrained(
                    self.model, str(path), adapter_name=peft_name
                ).eval()
            else:
                self.peft.load_adapter(str(path), adapter_name=peft_name)
                self.peft.eval()
        except Exception:
            self._unload_partial_peft_adapter(peft_name)
            raise
        replaced = self._peft_names.get(lora_name)
        self._peft_names[lora_name] = peft_name
        if self.graphs is not None:
            self.graphs.clear()  # graphs run the plain model, captured over its old modules
        if replaced is not None:
            self._unload_peft_adapter(replaced)

    def _unload_partial_peft_adapter(self, peft_name: str) -> None:
        """Undo a failed load of ``peft_name``: unload what peft added of it, or, if the
        model had no adapter before, put every layer peft wrapped back to its base layer."""
        if self.peft is not None:  # it serves other adapters: remove only this one
            if peft_name in self.peft.peft_config:
                self._unload_peft_adapter(peft_name)
            return
        from peft.tuners.tuners_utils import BaseTunerLayer

        for name, module in list(self.model.named_modules()):
            if isinstance(module, BaseTunerLayer):
                parent, _, child = name.rpartition(".")
                setattr(self.model.get_submodule(parent), child, module.get_base_layer())
        if hasattr(self.model, "peft_config"):  # peft marks the models it wraps
            del self.model.peft_config

    def unload_adapter(self, lora_name: str) -> None:
        self._unload_peft_adapter(self._peft_names.pop(lora_name))

    def _unload_peft_adapter(self, peft_name: str) -> None:
        if not set(self._peft_names.values()) - {peft_name}:
            # peft cannot serve with no adapter left: restore the plain model (in place).
            self.peft.unload()
            self.peft = None
        else:
            with warnings.catch_warnings():
                # Which adapter peft calls "active" is moot: every forward names its adapters.
                warnings.filterwarnings("ignore", "Adapter .* was active which is now deleted")
                self.peft.delete_adapter(peft_name)

    def _forward(
        self, loras: Sequence[str | None], cache: Cache | None = None, **kwargs: Any
    ) -> Any:
        """The model's forward for rows served by ``loras`` (one adapter name or None per row),
        reading and writing KV through ``cache``."""
        if cache is not None:
            kwargs[self._cache_keyword] = cache
        if self.peft is None:
            return self.model(**kwargs)
        names = [BASE_ADAPTER if lora is None else self._peft_names[lora] for lora in loras]
        return self.peft(**kwargs, adapter_names=names)

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
        with torch.inference_mode():
            out = torch.empty(
                (len(rows), self.vocab_size), dtype=torch.float32, device=self.output_device
            )
            offset = 0
            for indices in groups:
                same = [rows[i] for i in indices]
                batch = out if len(groups) == 1 else out[offset : offset + len(same)]
                offset += len(same)
                if pool is None:
                    self._run_without_kv(same, batch)
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
        if self.graphs is not None and self.peft is None and self.graphs.run(plans, pool, out):
            return
        cascade = self.cascade and new_tokens <= self.max_batch_tokens
        skip = cascade_blocks(plans, pool.block_size) if cascade else 0
        step = step_inputs(plans, pool.block_size, skip, self.input_device)
        loras = [plan.lora for plan in plans]
        if skip:
            self._cascade_forward(pool, step, loras, out)
            return
        # A prefix longer than max_batch_tokens (a single plan) is prefilled in chunks.
        for chunk in range(0, new_tokens, self.max_batch_tokens):
            end = min(new_tokens, chunk + self.max_batch_tokens)
            past = step.past + chunk
            mask = None
            if step.padded or (past and end - chunk > 1):
                mask = self._additive_or_boolean(attention_mask(step.first, past, end - chunk))
            cache = paged_cache(
                pool,
                step.write[:, chunk:end].flatten(),
                step.read[:, : step.past + end],
                past,
            )
            self._forward_logprobs(
                loras,
                out,
                cache,
                input_ids=step.input_ids[:, chunk:end],
                attention_mask=mask,
                position_ids=step.position_ids[:, chunk:end],
                use_cache=True,
            )

    def _cascade_forward(
        self,
        pool: TorchBlockPool,
        step: StepInputs,
        loras: Sequence[str | None],
        out: torch.Tensor,
        reuse_logits: bool = True,
    ) -> None:
        """Cascade attention: the shared prefix is read once per layer; each row reads only
        its own tokens (the model's attention, `sdpa_or_cascade_attention`, picks it by the
        ``genlm_cache`` keyword, which the model passes on to it)."""
        cache = step_cache(pool, step)
        self._forward_logprobs(
            loras,
            out,
            cache,
            reuse_logits,
            input_ids=step.input_ids,
            attention_mask=attention_mask(step.first, step.past, step.input_ids.shape[1]),
            position_ids=step.position_ids,
            genlm_cache=cache,
            use_cache=True,
        )

    def _graph_forward(self, step: StepInputs, out: torch.Tensor) -> None:
        """A decode step as `DecodeGraphs` captures it: the plain model (no adapter), its
        logits in memory of the step's own (the head's reused buffer would outlive it)."""
        assert self.pool is not None  # graphs go with KV reuse
        self._cascade_forward(self.pool, step, [None] * step.input_ids.shape[0], out, False)

    def _run_without_kv(self, plans: list[RowPlan], out: torch.Tensor) -> None:
        """Fallback for models without reusable KV: one plain forward of whole prefixes of
        one length, their logprobs into ``out``."""
        input_ids = torch.tensor([plan.ids for plan in plans], device=self.input_device)
        self._forward_logprobs(
            [plan.lora for plan in plans], out, input_ids=input_ids, use_cache=False
        )

    def _forward_logprobs(
        self,
        loras: Sequence[str | None],
        out: torch.Tensor,
        cache: Cache | None = None,
        reuse_logits: bool = True,
        **inputs: Any,
    ) -> None:
        """The forward's logprobs at each row's last position, into ``out``: the base model
        and our `OutputHead` (logits in reused memory, unless not ``reuse_logits``) where
        `plain_head` found the model's logits to be its head's and no adapter is loaded,
        else the model's own forward."""
        if self.head is None or self.peft is not None:
            logits = self._forward(loras, cache, logits_to_keep=1, **inputs).logits
            self._logprobs(logits[:, -1], out)
            return
        if cache is not None:
            inputs[self._cache_keyword] = cache
        hidden = self.model.base_model(**inputs).last_hidden_state
        self.head.logprobs(hidden[:, -1], out, reuse_logits)

    def _additive_or_boolean(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` as the model's attention wants it: boolean for sdpa, additive for eager."""
        if self.model.config._attn_implementation in ("sdpa", CASCADE_ATTENTION):
            return mask
        assert self.pool is not None  # masks go with KV reuse
        dtype = self.pool.layout.dtype
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return additive.masked_fill_(~mask, torch.finfo(dtype).min)

    def _logprobs(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Normalized float32 log-probabilities over the tokenizer's vocabulary (padding
        dropped), into ``out`` if given."""
        return torch.log_softmax(logits[:, : self.vocab_size].float(), dim=-1, out=out)

    def uncached(self, ids: tuple[int, ...], lora: str | None) -> torch.Tensor:
        with torch.inference_mode():
            input_ids = torch.tensor([ids], device=self.input_device)
            logits = self._forward(
                [lora], input_ids=input_ids, use_cache=False, logits_to_keep=1
            ).logits
            return self._logprobs(logits[:, -1])[0]
