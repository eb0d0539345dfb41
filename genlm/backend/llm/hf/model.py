"""`AsyncTransformer`: a Hugging Face transformers causal LM behind the `AsyncLM` interface.

It checks the options, loads the model and builds the LM's parts: the request plan, cache
calls and batcher of `PrefixCachedLM`, the paged KV of `genlm.backend.kv` (a
`TorchBlockPool`, which follows what is held, except under CUDA graphs, whose captures hold
its addresses: then it is sized once, `fixed_pool_capacity`) and the forward over a batch's
rows (`TransformerRunner`). LoRA adapters (peft) are chosen per request, each with its own
prefix tree. A model whose KV cannot be reused (docs/families.md) runs whole prefixes.
The design: docs/kv-store.md, docs/lora.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from genlm.backend.checks import (
    check_budget,
    choice_option,
    dict_option,
    fraction_option,
    int_option,
)
from genlm.backend.kv.pool import BLOCK_SIZE, KVLayout, NoKVPool
from genlm.backend.kv.store import PrefixKVStore
from genlm.backend.llm.hf.options import (
    bitsandbytes_config,
    default_device_map,
    normalize_dtype,
    quiet_bitsandbytes,
)
from genlm.backend.llm.hf.runner import TransformerRunner
from genlm.backend.llm.loading import check_vocab_fits
from genlm.backend.llm.options import Option, takes_options
from genlm.backend.llm.prefix import PrefixCachedLM

LORA_BATCHING = ("mixed", "grouped")

DEFAULT_MAX_KV_BYTES = 1 << 30
DEFAULT_MAX_LOGPROBS_BYTES = 256 << 20
CUDA_KV_MEMORY_FRACTION = 0.5  # `cuda_kv_memory_fraction`'s default


class AsyncTransformer(PrefixCachedLM[torch.Tensor]):
    """A transformers causal LM with auto-batching and a prefix tree of cached KV and logprobs.

    Each returned log-probability vector is the caller's own copy.

    Args:
        hf_model: an ``AutoModelForCausalLM`` (put in eval mode).
        hf_tokenizer: its tokenizer.

    The other arguments are the options below (``batch_size`` and ``timeout`` as on
    `BatchedAsyncLM`), each an attribute of the LM too.

    With KV reuse, construction probes the steps against the model's uncached forward
    (`genlm.backend.llm.hf.probe`: five forwards of 292 tokens in all, 2.4 s for
    SmolLM2-135M on one CPU core; once per model object), and steps down where they
    differ, with a warning (docs/families.md).
    """

    runner: TransformerRunner

    max_kv_bytes: Option[int | None] = Option(
        DEFAULT_MAX_KV_BYTES, check_budget, at="store.max_kv_bytes"
    )
    """Budget (bytes, None: unbounded) for cached KV states, least recently used evicted
    first (prompts pinned with `cache_kv` are outside it): what is kept between batches;
    a running batch's rows may hold more. Assignable: the next batch evicts down to it."""

    max_logprobs_bytes: Option[int | None] = Option(
        DEFAULT_MAX_LOGPROBS_BYTES, check_budget, at="store.max_logprobs_bytes"
    )
    """Budget (bytes, None: unbounded) for cached next-token log-probabilities.
    Assignable: the next batch that computes a row evicts down to it."""

    max_batch_tokens = Option(4096, int_option(minimum=1), at="runner.max_batch_tokens")
    """Most new tokens run in one forward (larger groups are split, a longer prefix is
    prefilled in chunks). Assignable, with effect on the next batches."""

    lora_batching = Option("mixed", choice_option(*LORA_BATCHING), at="runner.lora_batching")
    """``"mixed"`` (rows of several LoRA adapters in one forward) or ``"grouped"`` (one
    forward per adapter). Assignable, with effect on the next batches."""

    cuda_graphs = Option(False, choice_option(True, False), assignable=False)
    """On a CUDA device, replay decode steps from CUDA graphs (captured per shape bucket;
    `genlm.backend.llm.hf.graphs`); no effect elsewhere. Off by default until a GPU run
    shows them right and faster (docs/kv-store.md). Fixed at construction."""

    cuda_kv_memory_fraction = Option(CUDA_KV_MEMORY_FRACTION, fraction_option, assignable=False)
    """With ``cuda_graphs=True`` on a CUDA device, the KV pool is sized once, at construction
    (the graphs hold its addresses): the larger of ``max_kv_bytes`` and this share, in
    ``(0, 1)``, of the device's free memory once the model is loaded; a batch that does not
    fit fails before any work. No effect otherwise. Fixed at construction."""

    @takes_options
    def __init__(
        self,
        hf_model: Any,
        hf_tokenizer: Any,
        batch_size: int = PrefixCachedLM.batch_size.default,
        timeout: float | None = PrefixCachedLM.timeout.default,
        *,
        max_kv_bytes: int | None = max_kv_bytes.default,
        max_logprobs_bytes: int | None = max_logprobs_bytes.default,
        max_batch_tokens: int = max_batch_tokens.default,
        lora_batching: str = lora_batching.default,
        cuda_graphs: bool = cuda_graphs.default,
        cuda_kv_memory_fraction: float = cuda_kv_memory_fraction.default,
    ):
        super().__init__(hf_tokenizer)
        self.model = hf_model  # in eval mode while an LM serves it (`SharedModel`)
        # Read once: every prefix of every step is checked against it (config lookups are slow).
        self._max_positions: int | None = getattr(
            self.model.config.get_text_config(), "max_position_embeddings", None
        )
        quiet_bitsandbytes(self.model)
        check_vocab_fits(self.vocab_size, self.model.get_output_embeddings().weight.shape[0])
        runner = TransformerRunner(
            self.model,
            self.vocab_size,
            max_batch_tokens=max_batch_tokens,
            lora_batching=lora_batching,
            cuda_graphs=cuda_graphs,
            batch_size=batch_size,
        )
        pool = runner.pool
        store = PrefixKVStore(
            pool or NoKVPool(runner.forward.kv_reason),
            max_kv_bytes,
            max_logprobs_bytes,
            fixed_capacity=None
            if pool is None
            else fixed_pool_capacity(
                runner.forward.input_device,
                pool.layout,
                max_kv_bytes,
                cuda_kv_memory_fraction,
                cuda_graphs=cuda_graphs,
            ),
        )
        self._init_prefix_cache(store, runner, batch_size, timeout, "genlm-hf")

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
            hf_opts: keyword arguments for ``from_pretrained``; defaults ``dtype="auto"``
                (``torch_dtype`` is accepted too, as a dtype or a name such as ``"float32"``
                or ``"bfloat16"``) and a ``device_map`` that keeps the model on one device
                (`default_device_map`: on CUDA the current GPU, and a ValueError where the
                model does not fit there; ``{"device_map": "auto"}`` spreads it).
            **kwargs: passed to `AsyncTransformer` (``batch_size``, ``max_kv_bytes``, ...).
        """
        from transformers import AutoModelForCausalLM

        from genlm.backend.models import (
            explained_load_errors,
            gguf_from_pretrained_args,
            load_tokenizer,
        )

        dict_option("hf_opts", hf_opts)
        dict_option("bitsandbytes_opts", bitsandbytes_opts)
        cls.check_constructor_options(kwargs)
        opts = dict(hf_opts or {})
        normalize_dtype(opts)
        opts = {"dtype": "auto", **opts}
        if bitsandbytes_opts is not None:
            opts["quantization_config"] = bitsandbytes_config(bitsandbytes_opts)
        path, gguf = gguf_from_pretrained_args(model_id)
        tokenizer = load_tokenizer(model_id)
        if "device_map" not in opts:
            opts["device_map"] = default_device_map(model_id, path, {**gguf, **opts})
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
        return self.runner.forward.output_device

    def next_token_logprobs_uncached(
        self, token_ids: Sequence[int], *, lora_name: str | None = None
    ) -> torch.Tensor:
        """Reference answer: one plain forward of the whole prefix, no cache of any kind."""
        ids, lora = self._query(token_ids, lora_name)
        return self.batcher.run_sync(self.runner.forward.uncached, ids, lora)


def fixed_pool_capacity(
    device: torch.device,
    layout: KVLayout,
    max_kv_bytes: int | None,
    memory_fraction: float,
    *,
    cuda_graphs: bool,
) -> int | None:
    """The blocks of a KV pool sized once, at construction, as vLLM sizes its KV cache:
    with CUDA graphs on a CUDA device (their captures hold the layers' addresses), block 0
    and the larger of the KV budget and ``memory_fraction`` of the device's free memory (the
    rest beyond the budget is room for a running batch's rows). Otherwise None: the pool
    follows what is held (docs/kv-store.md, "Pool size")."""
    if device.type != "cuda" or not cuda_graphs:
        return None
    free, _ = torch.cuda.mem_get_info(device)
    pool_bytes = max(int(free * memory_fraction), max_kv_bytes or 0)
    return 1 + pool_bytes // layout.block_bytes(BLOCK_SIZE)
