"""`AsyncTransformer`: a Hugging Face transformers causal LM behind the `AsyncLM` interface.

Many particles await ``next_token_logprobs`` on prefixes that share most of their
tokens. The request plan, the cache calls and the batcher come from
`genlm.backend.llm.prefix.PrefixCachedLM`, the paged KV from `genlm.backend.kv` (a
`TorchBlockPool`: one tensor per layer); this module is the forward over planned rows
(each a block chain and new tokens), per group of rows with the same number ``t`` of
new tokens:

1. runs ONE forward over the ``rows x t`` new tokens with explicit position ids and a
   4-D mask (none when nothing is padded); a small `Cache` writes each layer's new KV
   into the rows' blocks and reads each row's KV through its chain (left-padded to the
   longest past with an all-zero block; the padding is masked). When the rows share a
   prefix of at least ``CASCADE_MIN_SHARED`` tokens, `cascade_attention` reads the shared
   blocks once per layer for all rows and only each row's own tokens through its chain;
2. applies the LM head at the last position only (``logits_to_keep=1``), keeps the
   tokenizer's ``len(byte_vocab)`` columns and ``log_softmax``es them (float32), and
   returns each row's logprobs as a tensor of its own (no batch storage pinned); the
   base stores them and the chains at the requests' nodes.

Design choices (measured with benchmark/bench_lm.py, SmolLM2-135M, CPU):

- Blocks, not per-row buffers: particles sharing a prompt share its blocks, so the KV
  held is the prompt once plus each particle's own tokens (plus at most one partly
  filled block per fork), and an extension by one token writes one token's KV.
- Rows are grouped by ``t`` so no query row is padded (the usual step has ``t = 1``
  for everyone; a fresh prompt or a recomputed prefix forms its own group), hence
  no fully-masked attention rows and no NaNs from them.
- Memory: KV stays within ``max_kv_bytes`` between batches (docs/kv-store.md); the
  pool resizes one layer at a time, so it is never held twice while it copies.

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

import inspect
import itertools
import logging
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from genlm.backend.checks import check_budget, check_options, choice_option, int_option
from genlm.backend.kv.pool import BLOCK_SIZE, KVLayout, NoKVPool, uniform_layout
from genlm.backend.kv.store import PrefixKVStore
from genlm.backend.kv.torch_pool import TorchBlockPool
from genlm.backend.llm.base import check_vocab_fits
from genlm.backend.llm.prefix import PrefixCachedLM, Row, run_grouped

# peft's name for "no adapter" in a mixed-adapter batch.
BASE_ADAPTER = "__base__"
LORA_BATCHING = ("mixed", "grouped")

DEFAULT_MAX_KV_BYTES = 1 << 30
DEFAULT_MAX_LOGPROBS_BYTES = 256 << 20
_DTYPE_NAMES = {
    "float": torch.float32,
    "float32": torch.float32,
    "fp32": torch.float32,
    "half": torch.float16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


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
    ):
        super().__init__()
        self.pool_keys, self.pool_values = keys, values
        self.write, self.read, self.shared = write, read, shared
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
) -> Cache:
    """A transformers `Cache` over ``pool`` whose layers write ``write`` slots and read
    ``read`` rows (after the ``shared`` slots every row attends to, with cascade attention)."""
    return Cache(
        layers=[
            _PagedLayer(layer[0], layer[1], write, read, past_length, shared)
            for layer in pool.layers
        ]
    )


CASCADE_MIN_SHARED = 64  # shared tokens from which a group uses cascade attention


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
    ``kwargs["genlm_cache"]`` (see `sdpa_or_cascade_attention`).
    """
    shared_keys, shared_values = kwargs["genlm_cache"].layers[module.layer_idx].shared_kv()
    rows, q_heads, new, dim = query.shape
    kv_heads = key.shape[1]
    groups = q_heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    q = query.reshape(rows, kv_heads, groups * new, dim)
    flat = q.transpose(0, 1).reshape(kv_heads, rows * groups * new, dim)
    shared = torch.matmul(flat, shared_keys.transpose(1, 2)).mul_(scale)
    shared = shared.view(kv_heads, rows, groups * new, -1).transpose(0, 1)
    own = torch.matmul(q, key.transpose(2, 3)).mul_(scale)
    own = own.view(rows, kv_heads, groups, new, -1).masked_fill_(
        ~attention_mask[:, :, None], float("-inf")
    )
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

    Registered (by `_cascade_usable`) as the ``"sdpa"`` entry of transformers' attention
    registry, so no model config is switched around a forward: every other forward, of
    any model in any thread, passes no ``genlm_cache`` and gets plain ``sdpa``.
    """
    if "genlm_cache" in kwargs:
        assert attention_mask is not None  # a cascade forward passes its boolean mask
        return cascade_attention(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


class _FirstOnly(logging.Filter):
    """Lets a message through once per process, then drops its repeats."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix, self.seen = prefix, False

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.prefix):
            return True
        seen, self.seen = self.seen, True
        return not seen


# bitsandbytes logs this for every 8-bit matmul of a float32 input: 210 lines per forward of
# a 30-layer model. Once says it all.
_BNB_CAST_NOTICE = _FirstOnly("MatMul8bitLt: inputs will be cast")


def _quiet_bitsandbytes(model: torch.nn.Module) -> None:
    """Show bitsandbytes' cast notice once, for a model with 8-bit layers."""
    if any(type(module).__name__ == "Linear8bitLt" for module in model.modules()):
        logger = logging.getLogger("bitsandbytes.autograd._functions")
        if _BNB_CAST_NOTICE not in logger.filters:
            logger.addFilter(_BNB_CAST_NOTICE)


def cache_keyword(model: torch.nn.Module) -> str:
    """The name under which ``model``'s forward takes and returns its KV cache: ``cache``
    from transformers 5.24 on (there ``past_key_values`` is deprecated, to go in 5.40),
    ``past_key_values`` in older releases and in remote-code models that keep it.

    Read from the class, so that a wrapper set on the instance (a profiler's) changes
    nothing; a wrapper class whose forward takes only ``**kwargs`` gets the installed
    transformers' name.
    """
    parameters = inspect.signature(type(model).forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    import transformers
    from packaging.version import Version

    return "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"


def _normalize_dtype(opts: dict[str, Any]) -> None:
    """Accept ``torch_dtype`` or ``dtype``, as a `torch.dtype` or a name; store it as ``dtype``."""
    if "torch_dtype" in opts:
        if "dtype" in opts:
            raise ValueError("hf_opts sets both 'dtype' and 'torch_dtype'; pass only one")
        opts["dtype"] = opts.pop("torch_dtype")
    dtype = opts.get("dtype")
    if isinstance(dtype, str) and dtype != "auto":
        name = dtype.removeprefix("torch.")
        if name not in _DTYPE_NAMES:
            raise ValueError(
                f"Unknown dtype {dtype!r}; use a torch.dtype, 'auto' or one of {sorted(_DTYPE_NAMES)}"
            )
        opts["dtype"] = _DTYPE_NAMES[name]


class AsyncTransformer(PrefixCachedLM[torch.Tensor]):
    """A transformers causal LM with auto-batching and a prefix tree of cached KV and logprobs.

    Each returned log-probability vector is the caller's own copy.

    Args:
        hf_model: an ``AutoModelForCausalLM`` (put in eval mode).
        hf_tokenizer: its tokenizer.
        batch_size: most requests per batch.
        timeout: longest wait (seconds) for a batch to fill while the event loop is busy.
        max_kv_bytes: budget for cached KV states (least recently used evicted first;
            prompts pinned with `cache_kv` are outside it).
        max_logprobs_bytes: budget for cached next-token log-probabilities.
        max_batch_tokens: most new tokens run in one forward (larger groups are split,
            a longer prefix is prefilled in chunks).
        lora_batching: ``"mixed"`` (rows of several LoRA adapters in one forward) or
            ``"grouped"`` (one forward per adapter).
    """

    OPTION_CHECKS = {
        **PrefixCachedLM.OPTION_CHECKS,
        "max_kv_bytes": check_budget,
        "max_logprobs_bytes": check_budget,
        "max_batch_tokens": int_option(minimum=1),
        "lora_batching": choice_option(*LORA_BATCHING),
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
            },
        )
        super().__init__(hf_tokenizer)
        self.model = hf_model.eval()
        _quiet_bitsandbytes(self.model)
        check_vocab_fits(self.vocab_size, self.model.get_output_embeddings().weight.shape[0])
        self.max_kv_bytes = max_kv_bytes
        self.max_logprobs_bytes = max_logprobs_bytes
        self.max_batch_tokens = max_batch_tokens
        self.lora_batching = lora_batching
        self._peft: Any = None  # the peft model wrapping self.model, once an adapter is loaded
        self._peft_names: dict[str, str] = {}  # adapter name -> its name inside peft
        self._adapter_ids = itertools.count()
        self._input_device = self.model.get_input_embeddings().weight.device
        self._cache_keyword = cache_keyword(self.model)
        layout, reason = self._probe_kv_layout()
        self._pool = None if layout is None else TorchBlockPool(layout)
        self._cascade = self._cascade_usable()
        store = PrefixKVStore(self._pool or NoKVPool(reason), max_kv_bytes, max_logprobs_bytes)
        self._init_prefix_cache(store, self._pool is not None, batch_size, timeout, "genlm-hf")

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
        _normalize_dtype(opts)
        opts = {"device_map": "auto", "dtype": "auto", **opts}
        if bitsandbytes_opts is not None:
            try:
                import bitsandbytes  # noqa: F401
            except ImportError as error:
                raise ImportError(
                    "bitsandbytes_opts needs bitsandbytes: pip install 'genlm-backend[bnb]'"
                ) from error
            from transformers import BitsAndBytesConfig

            opts["quantization_config"] = BitsAndBytesConfig(**bitsandbytes_opts)
        path, gguf = gguf_from_pretrained_args(model_id)
        tokenizer = load_tokenizer(model_id)
        with explained_load_errors(model_id):
            model = AutoModelForCausalLM.from_pretrained(path, **gguf, **opts)
        return cls(model, tokenizer, **kwargs)

    # -- public API ---------------------------------------------------------------------------

    @property
    def max_context_length(self) -> int | None:
        """The model's ``max_position_embeddings`` (None if its config has none)."""
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    def next_token_logprobs_uncached(
        self, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> torch.Tensor:
        """Reference answer: one plain forward of the whole prefix, no cache of any kind."""
        ids, lora = self._query(token_ids, lora_name)
        return self.batcher.run_sync(self._uncached, ids, lora)

    # -- LoRA ----------------------------------------------------------------------------------

    def _load_adapter(self, lora_path: str, lora_name: str) -> None:
        """Check the adapter, load it under a fresh peft name, and only then let it replace
        an adapter registered under ``lora_name``: any failure leaves the model and the
        registry as they were (no LoRA layers left injected)."""
        try:
            import peft
        except ImportError as error:
            raise ImportError(
                "LoRA adapters need peft: pip install 'genlm-backend[lora]'"
            ) from error
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
            self._discard_adapter(peft_name)
            raise
        replaced = self._peft_names.get(lora_name)
        self._peft_names[lora_name] = peft_name
        if replaced is not None:
            self._delete_peft_adapter(replaced)

    def _discard_adapter(self, peft_name: str) -> None:
        """Undo a failed load of ``peft_name``: delete what peft added of it, or, if the
        model had no adapter before, put every layer peft wrapped back to its base layer."""
        if self._peft is not None:  # it serves other adapters: remove only this one
            if peft_name in self._peft.peft_config:
                self._delete_peft_adapter(peft_name)
            return
        from peft.tuners.tuners_utils import BaseTunerLayer

        for name, module in list(self.model.named_modules()):
            if isinstance(module, BaseTunerLayer):
                parent, _, child = name.rpartition(".")
                setattr(self.model.get_submodule(parent), child, module.get_base_layer())
        if hasattr(self.model, "peft_config"):  # peft marks the models it wraps
            del self.model.peft_config

    def _delete_adapter(self, lora_name: str) -> None:
        self._delete_peft_adapter(self._peft_names.pop(lora_name))

    def _delete_peft_adapter(self, peft_name: str) -> None:
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

    def _run_rows(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """Rows with the same number of new tokens (and adapter, with ``lora_batching=
        "grouped"``) in one forward each, split to respect ``max_batch_tokens``; without
        KV reuse, rows of one length together."""
        pool = self._pool
        with torch.inference_mode():
            if pool is None:
                return run_grouped(rows, lambda row: len(row.ids), self._run_without_kv)
            grouped = self.lora_batching == "grouped"

            def run(same: list[Row]) -> list[torch.Tensor]:
                step = max(1, self.max_batch_tokens // same[0].new_tokens)
                return [
                    logprobs
                    for i in range(0, len(same), step)
                    for logprobs in self._run_group(pool, same[i : i + step])
                ]

            return run_grouped(rows, lambda row: (row.new_tokens, grouped and row.lora), run)

    def _run_group(self, pool: TorchBlockPool, rows: list[Row]) -> list[torch.Tensor]:
        """One forward for rows sharing their number of new tokens: their logprobs, and their
        new tokens' KV written into their chains."""
        new_tokens = rows[0].new_tokens
        past_length = max(row.start for row in rows)
        slots = [pool.slots(row.chain, len(row.ids)) for row in rows]
        starts = torch.tensor([row.start for row in rows], device=self._input_device)
        input_ids = torch.tensor([row.ids[row.start :] for row in rows], device=self._input_device)
        write = torch.stack([own[row.start :] for row, own in zip(rows, slots, strict=True)])
        loras = [row.lora for row in rows]
        shared = self._shared_tokens(rows) if new_tokens <= self.max_batch_tokens else 0
        if shared:
            # Cascade: the shared prefix is read once per layer; each row reads only its own
            # tokens (`sdpa_or_cascade_attention` picks it by the ``genlm_cache`` keyword).
            read = self._padded(slots, shared)
            cache = paged_cache(pool, write.flatten(), read, past_length, slots[0][:shared])
            logits = self._forward(
                loras,
                input_ids=input_ids,
                attention_mask=self._attention_mask(
                    starts - shared, past_length - shared, new_tokens, boolean=True
                ),
                position_ids=starts[:, None] + torch.arange(new_tokens, device=self._input_device),
                cache=cache,
                genlm_cache=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits
        else:
            read = self._padded(slots, 0)
            padded = any(row.start < past_length for row in rows)
            # A prefix longer than max_batch_tokens (a single row) is prefilled in chunks.
            for chunk in range(0, new_tokens, self.max_batch_tokens):
                end = min(new_tokens, chunk + self.max_batch_tokens)
                past = past_length + chunk
                mask = None
                if padded or (past and end - chunk > 1):
                    mask = self._attention_mask(starts + chunk, past, end - chunk)
                cache = paged_cache(
                    pool, write[:, chunk:end].flatten(), read[:, : past_length + end], past
                )
                logits = self._forward(
                    loras,
                    input_ids=input_ids[:, chunk:end],
                    attention_mask=mask,
                    position_ids=(starts + chunk)[:, None]
                    + torch.arange(end - chunk, device=self._input_device),
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                ).logits
        return [row.clone() for row in self._logprobs(logits[:, -1])]

    @staticmethod
    def _padded(slots: list[torch.Tensor], skip: int) -> torch.Tensor:
        """Read slots of the rows' tokens after the first ``skip``, left-padded to the longest
        row with slot 0 (block 0, all zeros; the mask hides it)."""
        width = max(len(own) for own in slots) - skip
        reads = []
        for own in slots:
            own = own[skip:]
            pad = torch.zeros(width - len(own), dtype=own.dtype, device=own.device)
            reads.append(torch.cat([pad, own]))
        return torch.stack(reads)

    def _shared_tokens(self, rows: list[Row]) -> int:
        """Tokens in full blocks at the start of every row's chain and inside every row's
        past: cascade attention reads them once (0: too few rows or tokens to bother)."""
        if not self._cascade or len(rows) < 2:
            return 0
        limit = min(row.start for row in rows) // BLOCK_SIZE
        chains = [row.chain for row in rows]
        first = chains[0]
        blocks = 0
        while blocks < limit and all(chain[blocks] == first[blocks] for chain in chains):
            blocks += 1
        shared = blocks * BLOCK_SIZE
        return shared if shared >= CASCADE_MIN_SHARED else 0

    def _run_without_kv(self, rows: list[Row]) -> list[torch.Tensor]:
        """Fallback for models without reusable KV: one plain forward of whole prefixes of
        one length."""
        input_ids = torch.tensor([row.ids for row in rows], device=self._input_device)
        loras = [row.lora for row in rows]
        logits = self._forward(loras, input_ids=input_ids, use_cache=False, logits_to_keep=1).logits
        return [row.clone() for row in self._logprobs(logits[:, -1])]

    def _attention_mask(
        self, starts: torch.Tensor, past_length: int, new_tokens: int, boolean: bool = False
    ) -> torch.Tensor:
        """``[rows, 1, new, past + new]`` mask: a row sees its own past (left-padded) causally
        (boolean for sdpa and cascade attention, additive for eager)."""
        keys = torch.arange(past_length + new_tokens, device=self._input_device)
        queries = past_length + torch.arange(new_tokens, device=self._input_device)
        first = (past_length - starts)[:, None, None]
        mask = (keys >= first) & (keys[None, None, :] <= queries[None, :, None])
        mask = mask[:, None]
        if boolean or self.model.config._attn_implementation == "sdpa":
            return mask
        assert self._pool is not None  # masks go with KV reuse
        dtype = self._pool.layout.dtype
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return additive.masked_fill_(~mask, torch.finfo(dtype).min)

    def _logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """Normalized float32 log-probabilities over the tokenizer's vocabulary (padding dropped)."""
        return torch.log_softmax(logits[:, : self.vocab_size].float(), dim=-1)

    def _uncached(self, ids: tuple[int, ...], lora: str | None) -> torch.Tensor:
        with torch.inference_mode():
            input_ids = torch.tensor([ids], device=self._input_device)
            logits = self._forward(
                [lora], input_ids=input_ids, use_cache=False, logits_to_keep=1
            ).logits
            return self._logprobs(logits[:, -1])[0]

    def _cascade_usable(self) -> bool:
        """Whether groups may use cascade attention: KV reuse is on, the model runs ``sdpa``,
        and each of its attention modules (one per KV layer) looks ``sdpa`` up in a registry
        that now answers `sdpa_or_cascade_attention` (a model with its own ``sdpa`` would
        ignore ``genlm_cache=``)."""
        if self._pool is None or self.model.config._attn_implementation != "sdpa":
            return False
        from transformers import AttentionInterface

        AttentionInterface.register("sdpa", sdpa_or_cascade_attention)
        modules = [
            module
            for module in self.model.modules()
            if hasattr(module, "layer_idx") and hasattr(module, "num_key_value_groups")
        ]
        registries = [
            getattr(sys.modules[type(module).__module__], "ALL_ATTENTION_FUNCTIONS", None)
            for module in modules
        ]
        return len(modules) == self._pool.layout.num_layers and all(
            registry is not None
            and registry.get_interface("sdpa", None) is sdpa_or_cascade_attention
            for registry in registries
        )

    def _probe_kv_layout(self) -> tuple[KVLayout | None, str]:
        """Run one token to learn the KV shape, and whether this design can reuse it."""
        implementation = getattr(self.model.config, "_attn_implementation", None)
        if implementation not in ("sdpa", "eager"):
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
