"""`AsyncTransformer`: a Hugging Face transformers causal LM behind the `AsyncLM` interface.

Many particles await ``next_token_logprobs`` on prefixes that share most of their
tokens. The request plan, the cache calls and the batcher come from
`genlm.backend.llm.prefix.PrefixCachedLM`, the paged KV from `genlm.backend.kv` (a
`TorchBlockPool`: one tensor per layer); this module is the forward over a batch's row plans
(each a block chain and new tokens, one row of the batch), per group of rows with the
same number ``t`` of new tokens:

1. builds the group's inputs (ids, positions, write and read slots) on the host as ONE
   tensor that reaches the device in one copy (`genlm.backend.llm.hf.paged`), and runs
   ONE forward over the ``rows x t`` new tokens with explicit position ids and a 4-D
   mask (none when nothing is padded); a small `Cache` writes each layer's new KV into
   the rows' blocks and reads each row's KV through its chain (left-padded to the
   longest past with an all-zero block; the padding is masked). When the rows share a
   prefix of at least ``CASCADE_MIN_SHARED`` tokens, `cascade_attention` reads the shared
   blocks once per layer for all rows and only each row's own tokens through its chain;
2. applies the LM head at the last position only, over the tokenizer's
   ``len(byte_vocab)`` columns, and ``log_softmax``es them (float32) into a fresh
   ``[rows, vocab]`` batch: for a model whose logits are its plain head's output
   (`genlm.backend.llm.hf.head.plain_head`), the base model runs and `OutputHead`
   projects into a reused logits buffer; any other model runs its own forward
   (``logits_to_keep=1``). The base stores views of the batch's rows and the chains at
   the requests' nodes (the batch's memory counted once in the logprobs budget).

A step's op count (kernel launches on a GPU) is the same for 8 rows as for 128, at any
context length (tests/test_hf_step.py, benchmark/bench_host.py). With ``cuda_graphs=True``
a decode step (one new token per row) on CUDA is a replay of its shape bucket's CUDA graph
instead (`genlm.backend.llm.hf.graphs`); off by default: the eager step is the path a GPU
has run, and graphs become the default once a GPU run shows them right and faster.

Design choices (measured with benchmark/bench_lm.py, SmolLM2-135M, CPU):

- Blocks, not per-row buffers: particles sharing a prompt share its blocks, so the KV
  held is the prompt once plus each particle's own tokens (plus at most one partly
  filled block per fork), and an extension by one token writes one token's KV.
- Rows are grouped by ``t`` so no query row is padded (the usual step has ``t = 1``
  for everyone; a fresh prompt or a recomputed prefix forms its own group), hence
  no fully-masked attention rows and no NaNs from them.
- Memory: KV stays within ``max_kv_bytes`` between batches (docs/kv-store.md); the
  pool resizes one layer at a time, so it is never held twice while it copies. On CUDA
  the pool is sized once, at construction (`fixed_pool_capacity`: at least the budget,
  and a share of the free memory), and never moves.

LoRA adapters (peft) are chosen per request. Each adapter has its own prefix tree (all
under the same budgets), and rows of several adapters share one forward: peft's
mixed-adapter batches (``adapter_names=``) add each row's own low-rank update to the
shared base matmuls (``lora_batching="grouped"`` runs one forward per adapter instead;
measured slower, see benchmark/bench_lm.py ``--loras``).

Models whose cache is not a plain stack of same-shaped full-attention layers
(sliding windows, recurrent states, layers on several devices, ...) or whose
attention is neither ``sdpa`` nor ``eager`` still work, without KV reuse: each
request then runs its whole prefix.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from genlm.backend.checks import (
    check_budget,
    check_options,
    choice_option,
    fraction_option,
    int_option,
)
from genlm.backend.kv.pool import BLOCK_SIZE, KVLayout, NoKVPool, uniform_layout
from genlm.backend.kv.store import PrefixKVStore, RowPlan
from genlm.backend.kv.torch_pool import TorchBlockPool
from genlm.backend.llm.hf.attention import CASCADE_ATTENTION, use_cascade
from genlm.backend.llm.hf.cache import paged_cache, step_cache
from genlm.backend.llm.hf.graphs import DecodeGraphs, recorder_for
from genlm.backend.llm.hf.head import plain_head
from genlm.backend.llm.hf.options import (
    bitsandbytes_config,
    cache_keyword,
    normalize_dtype,
    quiet_bitsandbytes,
)
from genlm.backend.llm.hf.paged import StepInputs, attention_mask, cascade_blocks, step_inputs
from genlm.backend.llm.loading import check_vocab_fits
from genlm.backend.llm.prefix import PrefixCachedLM, plan_order, row_groups

# peft's name for "no adapter" in a mixed-adapter batch.
BASE_ADAPTER = "__base__"
LORA_BATCHING = ("mixed", "grouped")

DEFAULT_MAX_KV_BYTES = 1 << 30
DEFAULT_MAX_LOGPROBS_BYTES = 256 << 20
# The share of the device's free memory (after the model is loaded) that a CUDA KV pool
# takes at least (`cuda_kv_memory_fraction`'s default).
CUDA_KV_MEMORY_FRACTION = 0.5


class AsyncTransformer(PrefixCachedLM[torch.Tensor]):
    """A transformers causal LM with auto-batching and a prefix tree of cached KV and logprobs.

    Each returned log-probability vector is the caller's own copy.

    Args:
        hf_model: an ``AutoModelForCausalLM`` (put in eval mode).
        hf_tokenizer: its tokenizer.
        batch_size: most requests per batch.
        timeout: longest wait (seconds) for a batch to fill while the event loop is busy.
        max_kv_bytes: budget for cached KV states (least recently used evicted first;
            prompts pinned with `cache_kv` are outside it): what is kept between batches;
            a running batch's rows may hold more.
        max_logprobs_bytes: budget for cached next-token log-probabilities.
        max_batch_tokens: most new tokens run in one forward (larger groups are split,
            a longer prefix is prefilled in chunks).
        lora_batching: ``"mixed"`` (rows of several LoRA adapters in one forward) or
            ``"grouped"`` (one forward per adapter).
        cuda_graphs: on a CUDA device, replay decode steps from CUDA graphs (captured per
            shape bucket; `genlm.backend.llm.hf.graphs`); no effect elsewhere. Off by
            default until a GPU run shows them right and faster (docs/kv-store.md).
        cuda_kv_memory_fraction: on a CUDA device, the KV pool is allocated here and never
            resized: the larger of ``max_kv_bytes`` and this share of the device's free
            memory (after the model is loaded), in ``(0, 1)``. Pinned prompts and a
            running batch's rows must fit in it; a batch that cannot fails before any work.
            No effect elsewhere (a CPU pool follows what is held).
    """

    OPTION_CHECKS = {
        **PrefixCachedLM.OPTION_CHECKS,
        "max_kv_bytes": check_budget,
        "max_logprobs_bytes": check_budget,
        "max_batch_tokens": int_option(minimum=1),
        "lora_batching": choice_option(*LORA_BATCHING),
        "cuda_graphs": choice_option(True, False),
        "cuda_kv_memory_fraction": fraction_option,
    }

    def __init__(
        self,
        hf_model: Any,
        hf_tokenizer: Any,
        batch_size: int = 20,
        timeout: float | None = 0.02,
        *,
        max_kv_bytes: int | None = DEFAULT_MAX_KV_BYTES,
        max_logprobs_bytes: int | None = DEFAULT_MAX_LOGPROBS_BYTES,
        max_batch_tokens: int = 4096,
        lora_batching: str = "mixed",
        cuda_graphs: bool = False,
        cuda_kv_memory_fraction: float = CUDA_KV_MEMORY_FRACTION,
    ):
        check_options(
            self.OPTION_CHECKS,
            {
                "batch_size": batch_size,
                "timeout": timeout,
                "max_kv_bytes": max_kv_bytes,
                "max_logprobs_bytes": max_logprobs_bytes,
                "max_batch_tokens": max_batch_tokens,
                "lora_batching": lora_batching,
                "cuda_graphs": cuda_graphs,
                "cuda_kv_memory_fraction": cuda_kv_memory_fraction,
            },
        )
        super().__init__(hf_tokenizer)
        self.model = hf_model.eval()
        # Read once: every prefix of every step is checked against it (a config lookup goes
        # through transformers' __getattribute__).
        self._max_positions: int | None = getattr(
            self.model.config.get_text_config(), "max_position_embeddings", None
        )
        quiet_bitsandbytes(self.model)
        check_vocab_fits(self.vocab_size, self.model.get_output_embeddings().weight.shape[0])
        self.max_kv_bytes = max_kv_bytes
        self.max_logprobs_bytes = max_logprobs_bytes
        self.max_batch_tokens = max_batch_tokens
        self.lora_batching = lora_batching
        self._peft: Any = None  # the peft model wrapping self.model, once an adapter is loaded
        self._peft_names: dict[str, str] = {}  # adapter name -> its name inside peft
        self._adapter_ids = itertools.count()
        self._input_device = self.model.get_input_embeddings().weight.device
        self._output_device = self.model.get_output_embeddings().weight.device
        self._cache_keyword = cache_keyword(self.model)
        layout, reason = self._probe_kv_layout()
        self._pool = None if layout is None else TorchBlockPool(layout)
        self._head = plain_head(self.model, self.vocab_size, self._input_device)
        self._cascade = self._pool is not None and use_cascade(
            self.model, self._pool.layout.num_layers
        )
        self._graphs = self._decode_graphs(batch_size) if cuda_graphs else None
        store = PrefixKVStore(
            self._pool or NoKVPool(reason),
            max_kv_bytes,
            max_logprobs_bytes,
            fixed_capacity=None
            if layout is None
            else fixed_pool_capacity(
                self._input_device, layout, max_kv_bytes, cuda_kv_memory_fraction
            ),
        )
        self._init_prefix_cache(store, batch_size, timeout, "genlm-hf")

    @classmethod
    def from_name(
        cls,
        model_id: str,
        bitsandbytes_opts: dict[str, Any] | None = None,
        hf_opts: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> AsyncTransformer:
        """Load a tokenizer and ``AutoModelForCausalLM`` from a hub id, a local directory or a ``.gguf`` file.

        Args:
            model_id: what to load.
            bitsandbytes_opts: keyword arguments of ``transformers.BitsAndBytesConfig``
                (e.g. ``{"load_in_8bit": True}``); needs the ``bnb`` extra.
            hf_opts: keyword arguments for ``from_pretrained``; defaults ``device_map="auto"``
                and ``dtype="auto"`` (``torch_dtype`` is accepted too, as a dtype or a name
                such as ``"float32"`` or ``"bfloat16"``).
            **kwargs: passed to `AsyncTransformer` (``batch_size``, ``max_kv_bytes``, ...).
        """
        from transformers import AutoModelForCausalLM

        from genlm.backend.models import (
            explained_load_errors,
            gguf_from_pretrained_args,
            load_tokenizer,
        )

        for name, value in (("hf_opts", hf_opts), ("bitsandbytes_opts", bitsandbytes_opts)):
            if value is not None and not isinstance(value, dict):
                raise TypeError(
                    f"{name} must be a dict of keyword arguments or None, got "
                    f"{type(value).__name__}: {value!r} (e.g. hf_opts={{'dtype': 'float16'}})"
                )
        cls.check_constructor_options(kwargs)
        opts = dict(hf_opts or {})
        normalize_dtype(opts)
        opts = {"device_map": "auto", "dtype": "auto", **opts}
        if bitsandbytes_opts is not None:
            opts["quantization_config"] = bitsandbytes_config(bitsandbytes_opts)
        path, gguf = gguf_from_pretrained_args(model_id)
        tokenizer = load_tokenizer(model_id)
        with explained_load_errors(model_id):
            model = AutoModelForCausalLM.from_pretrained(path, **gguf, **opts)
        return cls(model, tokenizer, **kwargs)

    # -- public API ---------------------------------------------------------------------------

    @property
    def max_context_length(self) -> int | None:
        """The model's ``max_position_embeddings`` (None if its config has none)."""
        return self._max_positions

    @property
    def device(self) -> torch.device:
        """The device of the model's output layer, where the returned rows are."""
        return self._output_device

    def next_token_logprobs_uncached(
        self, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> torch.Tensor:
        """Reference answer: one plain forward of the whole prefix, no cache of any kind."""
        ids, lora = self._query(token_ids, lora_name)
        return self.batcher.run_sync(self._uncached, ids, lora)

    def _close(self) -> None:
        """The base's close, then the head's logits buffer and the graphs let go."""
        super()._close()
        if self._head is not None:
            self._head.free()
        if self._graphs is not None:
            self._graphs.clear()

    def _decode_graphs(self, batch_size: int) -> DecodeGraphs | None:
        """CUDA graphs of decode steps of up to ``batch_size`` rows, where they can be
        captured: cascade attention over the paged KV (the step's shapes are then its
        bucket's), on a CUDA device, with no quantized weights (their kernels are not
        checked for capture)."""
        recorder = recorder_for(self._input_device)
        if (
            recorder is None
            or not self._cascade
            or self._output_device != self._input_device
            or getattr(self.model, "hf_quantizer", None) is not None
        ):
            return None
        return DecodeGraphs(
            self._graph_forward, recorder, self._input_device, self.vocab_size, batch_size
        )

    # -- LoRA ----------------------------------------------------------------------------------

    def _load_adapter(self, lora_path: str, lora_name: str) -> None:
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
            if self._peft is None:
                self._peft = peft.PeftModel.from_pretrained(
                    self.model, str(path), adapter_name=peft_name
                ).eval()
            else:
                self._peft.load_adapter(str(path), adapter_name=peft_name)
                self._peft.eval()
        except Exception:
            self._unload_partial_peft_adapter(peft_name)
            raise
        replaced = self._peft_names.get(lora_name)
        self._peft_names[lora_name] = peft_name
        if self._graphs is not None:
            self._graphs.clear()  # graphs run the plain model, captured over its old modules
        if replaced is not None:
            self._unload_peft_adapter(replaced)

    def _unload_partial_peft_adapter(self, peft_name: str) -> None:
        """Undo a failed load of ``peft_name``: unload what peft added of it, or, if the
        model had no adapter before, put every layer peft wrapped back to its base layer."""
        if self._peft is not None:  # it serves other adapters: remove only this one
            if peft_name in self._peft.peft_config:
                self._unload_peft_adapter(peft_name)
            return
        from peft.tuners.tuners_utils import BaseTunerLayer

        for name, module in list(self.model.named_modules()):
            if isinstance(module, BaseTunerLayer):
                parent, _, child = name.rpartition(".")
                setattr(self.model.get_submodule(parent), child, module.get_base_layer())
        if hasattr(self.model, "peft_config"):  # peft marks the models it wraps
            del self.model.peft_config

    def _unload_adapter(self, lora_name: str) -> None:
        self._unload_peft_adapter(self._peft_names.pop(lora_name))

    def _unload_peft_adapter(self, peft_name: str) -> None:
        if not set(self._peft_names.values()) - {peft_name}:
            # peft cannot serve with no adapter left: restore the plain model (in place).
            self._peft.unload()
            self._peft = None
        else:
            with warnings.catch_warnings():
                # Which adapter peft calls "active" is moot: every forward names its adapters.
                warnings.filterwarnings("ignore", "Adapter .* was active which is now deleted")
                self._peft.delete_adapter(peft_name)

    def _forward(
        self, loras: Sequence[str | None], cache: Cache | None = None, **kwargs: Any
    ) -> Any:
        """The model's forward for rows served by ``loras`` (one adapter name or None per row),
        reading and writing KV through ``cache``."""
        if cache is not None:
            kwargs[self._cache_keyword] = cache
        if self._peft is None:
            return self.model(**kwargs)
        names = [BASE_ADAPTER if lora is None else self._peft_names[lora] for lora in loras]
        return self._peft(**kwargs, adapter_names=names)

    # -- batch evaluation (runs on the batcher's worker thread) --------------------------------

    def _run_rows(self, rows: Sequence[RowPlan]) -> torch.Tensor:
        """The rows' logprobs as one ``[rows, vocab]`` batch of its own, in order (the tree
        keeps views of its rows). Rows with the same number of new tokens (and adapter,
        with ``lora_batching="grouped"``) run in one forward each, split to respect
        ``max_batch_tokens``; without KV reuse, rows of one length together."""
        pool = self._pool
        grouped = self.lora_batching == "grouped"
        if pool is None:
            groups = row_groups(rows, lambda row: len(row.ids))
        else:
            groups = row_groups(rows, lambda row: (row.new_tokens, grouped and row.lora))
        with torch.inference_mode():
            out = torch.empty(
                (len(rows), self._vocab_size), dtype=torch.float32, device=self._output_device
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
        if self._graphs is not None and self._peft is None and self._graphs.run(plans, pool, out):
            return
        cascade = self._cascade and new_tokens <= self.max_batch_tokens
        skip = cascade_blocks(plans, pool.block_size) if cascade else 0
        step = step_inputs(plans, pool.block_size, skip, self._input_device)
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
        assert self._pool is not None  # graphs go with KV reuse
        self._cascade_forward(self._pool, step, [None] * step.input_ids.shape[0], out, False)

    def _run_without_kv(self, plans: list[RowPlan], out: torch.Tensor) -> None:
        """Fallback for models without reusable KV: one plain forward of whole prefixes of
        one length, their logprobs into ``out``."""
        input_ids = torch.tensor([plan.ids for plan in plans], device=self._input_device)
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
        if self._head is None or self._peft is not None:
            logits = self._forward(loras, cache, logits_to_keep=1, **inputs).logits
            self._logprobs(logits[:, -1], out)
            return
        if cache is not None:
            inputs[self._cache_keyword] = cache
        hidden = self.model.base_model(**inputs).last_hidden_state
        self._head.logprobs(hidden[:, -1], out, reuse_logits)

    def _additive_or_boolean(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` as the model's attention wants it: boolean for sdpa, additive for eager."""
        if self.model.config._attn_implementation in ("sdpa", CASCADE_ATTENTION):
            return mask
        assert self._pool is not None  # masks go with KV reuse
        dtype = self._pool.layout.dtype
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return additive.masked_fill_(~mask, torch.finfo(dtype).min)

    def _logprobs(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Normalized float32 log-probabilities over the tokenizer's vocabulary (padding
        dropped), into ``out`` if given."""
        return torch.log_softmax(logits[:, : self.vocab_size].float(), dim=-1, out=out)

    def _uncached(self, ids: tuple[int, ...], lora: str | None) -> torch.Tensor:
        with torch.inference_mode():
            input_ids = torch.tensor([ids], device=self._input_device)
            logits = self._forward(
                [lora], input_ids=input_ids, use_cache=False, logits_to_keep=1
            ).logits
            return self._logprobs(logits[:, -1])[0]

    def _probe_kv_layout(self) -> tuple[KVLayout | None, str]:
        """Run one token to learn the KV shape, and whether this design can reuse it."""
        implementation = getattr(self.model.config, "_attn_implementation", None)
        if implementation not in ("sdpa", "eager", CASCADE_ATTENTION):
            return None, f"attention implementation {implementation!r}"
        with torch.inference_mode():
            input_ids = torch.zeros((1, 1), dtype=torch.long, device=self._input_device)
            output = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
            cache = getattr(output, self._cache_keyword)
        if not isinstance(cache, DynamicCache) or not cache.layers:
            return None, f"its cache is a {type(cache).__name__}"
        layers = [
            (getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in cache.layers
        ]
        if any(type(layer) is not DynamicLayer for layer in cache.layers) or any(
            keys is None or values is None for keys, values in layers
        ):
            return None, "its cache has layers other than full attention"
        return uniform_layout(layers)


def fixed_pool_capacity(
    device: torch.device, layout: KVLayout, max_kv_bytes: int | None, memory_fraction: float
) -> int | None:
    """The blocks of a KV pool on ``device`` sized once, at construction, as vLLM sizes its
    KV cache, or None where the pool follows what is held.

    On CUDA: block 0 and the larger of the KV budget and ``memory_fraction`` of the
    device's free memory. The budget stays a caching limit (what is kept between
    batches, `PrefixKVStore.evict`); the rest of the pool is room for a running batch's
    rows, so that a long run does not fail once its particles' own tokens outgrow the
    budget. The pool never moves, so captured graphs hold its addresses for good (and
    the caching allocator would keep a grown pool's memory anyway). Elsewhere None: a
    CPU pool's unwritten blocks cost no memory and a shrunk one goes back to the system.
    """
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    pool_bytes = max(int(free * memory_fraction), max_kv_bytes or 0)
    return 1 + pool_bytes // layout.block_bytes(BLOCK_SIZE)
