"""`AsyncMlxLM`: the `AsyncLM` interface on an mlx-lm model (Apple silicon, or Linux CPU).

The request plan, the cache calls, input validation and the batcher come from
`genlm.backend.llm.prefix.PrefixCachedLM`, with the same meanings as for
`AsyncTransformer`, the paged KV from `genlm.backend.kv` (an `MlxBlockPool`: a keys and a
values ``mx.array`` per layer); its `MlxRunner` is the forward over a batch's row plans (each
a block chain and new tokens, one row of the batch), per adapter:

1. prefills each row's new tokens but the last (rows with as many such tokens together,
   in steps of ``prefill_step_size``), then runs every row's last token in one forward.
   Each layer gets a `_PagedCache` (mlx-lm's cache protocol: ``offset``,
   ``update_and_fetch``, ``make_mask``, ``keys_and_values``): it scatters the new tokens' K/V into their chain
   slots and returns each row's K/V gathered through its chain, left-padded to the
   longest row with block-0 slots that the mask hides; RoPE gets each row's own offset,
   as with mlx-lm's ``BatchKVCache``. A sliding-window layer (mlx-lm's
   ``RotatingKVCache``) keeps every token in the pool like a full one: its mask hides
   the keys older than its window, as the model's own uncached forward does;
2. keeps the logits of the last position only (MLX is lazy: the prefill's logits are
   never computed), over the tokenizer's vocabulary, as float32 log-probabilities.

``cache_size`` bounds how many prefixes keep their KV (unpinned chains) and how many
keep their logprobs, least recently used first; ``max_kv_bytes`` and
``max_logprobs_bytes`` optionally bound their bytes, as on `AsyncTransformer`. Prompts
pinned with `cache_kv` are outside these budgets.

Models with other cache layers (quantized, recurrent or state-space states, a
``RotatingKVCache`` that keeps its first tokens), or whose forward fails over the paged
cache (tried on two tokens at construction), still work, without KV reuse: a warning
says so, each request runs its whole prefix with a fresh ``make_prompt_cache`` (rows of
one length together), and `cache_kv` raises ``NotImplementedError``.

LoRA adapters are loaded by mlx-lm itself (``mlx_lm.tuner.utils.load_adapters``: an
``adapter_config.json`` and ``adapters.safetensors`` directory, as ``mlx_lm.lora`` writes)
into a copy of the model that holds the very same base weight arrays, so an adapter costs
only its own low-rank matrices. Each adapter has its own prefix tree in the store (all
under the same budgets), so KV is only ever reused for the adapter it was computed with;
a batch mixing adapters runs one batched forward per adapter.

mlx streams belong to the thread that created them, so every MLX graph is built and
evaluated on the batcher's single worker thread (the base routes the blocking calls and
cache calls there, adapter loading goes through `AutoBatcher.run_sync` too); the model's
weights, the probe forward and the pool are evaluated up front where they are created.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from genlm.backend._install import install_hint
from genlm.backend.checks import check_budget, first_line, int_option
from genlm.backend.kv.mlx_pool import MlxBlockPool
from genlm.backend.kv.pool import Chain, KVLayout, NoKVPool, uniform_layout
from genlm.backend.kv.rows import plan_order, row_groups
from genlm.backend.kv.store import PrefixKVStore, RowPlan
from genlm.backend.kv.tree import KVNode
from genlm.backend.llm.loading import check_vocab_fits
from genlm.backend.llm.options import Option, takes_options
from genlm.backend.llm.prefix import PrefixCachedLM

if TYPE_CHECKING:
    from mlx_lm.models.cache import KVCache, RotatingKVCache

MLX_INSTALL_HINT = install_hint("mlx")


def _import_mlx() -> Any:
    """Import and return ``mlx.core``, with an install hint when mlx or mlx-lm is missing."""
    try:
        import mlx.core as mx
        import mlx_lm  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"AsyncMlxLM needs the mlx and mlx-lm packages: {MLX_INSTALL_HINT}"
        ) from error
    return mx


def _hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside an mlx-lm ``TokenizerWrapper`` (or ``tokenizer`` itself).

    Written against mlx-lm 0.32.2, whose wrapper keeps it in the private ``_tokenizer``
    attribute and has no public accessor.
    """
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


def _share_weights_copy(model: Any) -> Any:
    """A copy of an mlx-lm model's modules that holds the very same arrays (none is copied).

    Adapter layers can then be loaded into the copy without touching the original.
    """
    mx = _import_mlx()
    shared = {}
    for _, module in model.named_modules():
        for value in (*module.values(), *vars(module).values()):
            if isinstance(value, mx.array):
                shared[id(value)] = value
    return copy.deepcopy(model, shared)


@dataclass(frozen=True, slots=True)
class _Step:
    """One forward over the pool, shared by every layer's `_PagedCache`.

    ``read``: ``[rows, width]`` pool slots of each row's tokens up to the last one this
    forward runs, left-padded with slot 0; ``write``: the slots of the tokens it runs,
    row after row; ``offset``: each row's position of its first token run (an int when
    all rows agree); ``left_padding``: each row's padded slots (None: none).
    """

    read: Any
    write: Any
    offset: Any
    left_padding: Any
    width: int


class _PagedCache:
    """mlx-lm's cache protocol for one layer of one forward over the block pool.

    ``update_and_fetch`` scatters the new tokens' K/V into their slots and returns each
    row's K/V gathered through its chain (``[rows, kv_heads, width, head_dim]``), the whole
    chain even for a sliding-window layer: the mask the model asks for with its window
    (``make_mask``'s ``window_size``) hides the older keys, as in its uncached forward.
    ``keys_and_values`` hands the same K/V to later layers that share this layer's cache
    (Gemma 3n's KV-shared layers).
    """

    def __init__(self, pool: MlxBlockPool, layer: int, step: _Step):
        self.pool, self.layer, self.step = pool, layer, step
        self.fetched: tuple[Any, Any] | None = None  # what update_and_fetch returned

    @property
    def offset(self) -> Any:
        return self.step.offset

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        rows, heads, new, dim = keys.shape
        step = self.step
        fetched = []
        for layers, states in ((self.pool.keys, keys), (self.pool.values, values)):
            # Gathered after the write, so the scatter can reuse the pool's buffer.
            layer = layers[self.layer]
            layer[step.write] = states.transpose(0, 2, 1, 3).reshape(rows * new, heads, dim)
            fetched.append(layer[step.read].transpose(0, 2, 1, 3))
        self.fetched = fetched[0], fetched[1]
        return self.fetched

    def keys_and_values(self) -> tuple[Any, Any] | None:
        return self.fetched

    def make_mask(
        self, n: int, return_array: bool = False, window_size: int | None = None, **_: Any
    ) -> Any:
        from mlx_lm.models.base import create_causal_mask
        from mlx_lm.models.cache import create_attention_mask

        past = self.step.width - n
        if self.step.left_padding is None:
            return create_attention_mask(n, past, return_array, window_size)
        return create_causal_mask(
            n, past, window_size=window_size, left_padding=self.step.left_padding
        )


class MlxRunner:
    """The forward of an mlx-lm model over a batch's rows (a `RowRunner`): one forward per
    adapter through the paged pool (`_PagedCache`, mlx-lm's cache protocol), or without
    KV reuse one per adapter and prefix length through a fresh mlx-lm cache.

    Args:
        model: the mlx-lm model (its parameters evaluated).
        vocab_size: the tokenizer's vocabulary: the columns of each row's logprobs.
        pool: the KV pool (None: the model's KV cannot be reused).
        prefill_step_size: most tokens per row fed to the model in one prefill pass.
    """

    def __init__(
        self, model: Any, vocab_size: int, pool: MlxBlockPool | None, prefill_step_size: int
    ):
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.vocab_size = vocab_size
        self.pool = pool
        self.prefill_step_size = prefill_step_size
        # each cache layer's sliding window (None: full attention), for `read_past`
        self.windows = [_window(layer) for layer in make_prompt_cache(model)]
        self.adapters: dict[str, Any] = {}  # adapter name -> model holding its LoRA layers

    def free(self) -> None:
        """Nothing to let go of: no buffer outlives a batch."""

    def load_adapter(self, lora_path: str, lora_name: str) -> None:
        """Load an mlx-lm adapter directory (``adapter_config.json``, ``adapters.safetensors``)
        into a model of its own: the base model and an adapter registered under the same
        name are untouched until it has loaded."""
        from mlx_lm.tuner.utils import load_adapters

        from genlm.backend.llm.adapters import check_mlx_adapter

        mx = _import_mlx()
        path = str(check_mlx_adapter(lora_path))
        try:
            model = load_adapters(_share_weights_copy(self.model), path)
        except (ValueError, KeyError, AttributeError, TypeError, OSError, RuntimeError) as error:
            raise ValueError(
                f"cannot load the mlx-lm adapter {lora_path!r} onto this model: "
                f"{type(error).__name__}: {first_line(error)}"
            ) from None
        model.eval()
        mx.eval(model.parameters())
        self.adapters[lora_name] = model

    def unload_adapter(self, lora_name: str) -> None:
        del self.adapters[lora_name]

    def _model(self, lora: str | None) -> Any:
        """The model serving adapter ``lora`` (``None``: the base model)."""
        return self.model if lora is None else self.adapters[lora]

    def run(self, rows: Sequence[RowPlan]) -> torch.Tensor:
        """One forward per adapter (without KV reuse: per adapter and prefix length); the
        rows' logprobs as one ``[rows, vocab]`` batch of its own."""
        pool = self.pool
        if pool is None:
            groups = row_groups(rows, lambda row: (row.lora, len(row.ids)))
        else:
            groups = row_groups(rows, lambda row: row.lora)
        batches = []
        for indices in groups:
            same = [rows[i] for i in indices]
            batches.append(
                self._run_without_kv(same) if pool is None else self._run_paged(pool, same)
            )
        order = plan_order(groups)
        return torch.from_numpy(batches[0] if order is None else np.concatenate(batches)[order])

    def _run_paged(self, pool: MlxBlockPool, plans: list[RowPlan]) -> np.ndarray:
        """Rows of one adapter through the block pool: a prefill of their new tokens but the
        last (plans with as many together), then one forward over every plan's last token."""
        mx = _import_mlx()
        model = self._model(plans[0].lora)
        by_head: dict[int, list[RowPlan]] = {}
        for plan in plans:
            by_head.setdefault(plan.new_tokens - 1, []).append(plan)
        for head, same in by_head.items():
            for begin in range(0, head, self.prefill_step_size):
                tokens = min(self.prefill_step_size, head - begin)
                firsts = [plan.start + begin for plan in same]
                inputs, cache = self._paged_inputs(pool, same, firsts, tokens)
                model(inputs, cache=cache)
                mx.eval(pool.keys, pool.values)
        firsts = [len(plan.ids) - 1 for plan in plans]
        inputs, cache = self._paged_inputs(pool, plans, firsts, 1)
        logprobs = self._logprobs(model(inputs, cache=cache))
        mx.eval(logprobs, pool.keys, pool.values)
        return np.array(logprobs)

    def _paged_inputs(
        self, pool: MlxBlockPool, plans: list[RowPlan], firsts: list[int], tokens: int
    ) -> tuple[Any, list[_PagedCache]]:
        """The model's inputs to run ``plan.ids[first : first + tokens]`` of each plan: the
        token ids and a `_PagedCache` per layer (every plan's chain is set)."""
        mx = _import_mlx()
        ends = [first + tokens for first in firsts]
        width = max(ends)
        read = np.zeros((len(plans), width), dtype=np.int32)
        write = []
        for i, (plan, first, end) in enumerate(zip(plans, firsts, ends, strict=True)):
            slots = pool.slots(plan.chain, end)
            read[i, width - end :] = slots
            write.append(slots[first:])
        padding = [width - end for end in ends]
        step = _Step(
            read=mx.array(read),
            write=mx.array(np.concatenate(write)),
            offset=firsts[0] if max(padding) == 0 else mx.array(firsts),
            left_padding=mx.array(padding) if max(padding) else None,
            width=width,
        )
        inputs = mx.array(
            [
                list(plan.ids[first:end])
                for plan, first, end in zip(plans, firsts, ends, strict=True)
            ]
        )
        return inputs, [_PagedCache(pool, layer, step) for layer in range(len(pool.keys))]

    def _run_without_kv(self, plans: list[RowPlan]) -> np.ndarray:
        """Whole prefixes of one length and adapter through a fresh mlx-lm cache."""
        from mlx_lm.models.cache import make_prompt_cache

        mx = _import_mlx()
        model = self._model(plans[0].lora)
        length = len(plans[0].ids)
        cache = make_prompt_cache(self.model)
        tokens = mx.array([plan.ids for plan in plans])
        for begin in range(0, length - 1, self.prefill_step_size):
            end = min(length - 1, begin + self.prefill_step_size)
            model(tokens[:, begin:end], cache=cache)
            mx.eval([layer.state for layer in cache])
        logprobs = self._logprobs(model(tokens[:, -1:], cache=cache))
        mx.eval(logprobs)
        return np.array(logprobs)

    def _logprobs(self, logits: Any) -> Any:
        """``[rows, V]`` float32 log-probabilities of the last position, over the tokenizer's
        vocabulary (a model's padding columns dropped)."""
        mx = _import_mlx()
        logits = logits[:, -1, : self.vocab_size].astype(mx.float32)
        return logits - _logsumexp(logits)

    def read_past(self, chain: Chain, tokens: int) -> list[KVCache | RotatingKVCache]:
        """One mlx-lm cache per layer holding a copy of a chain's first ``tokens``, which the
        model continues from as from its own: a ``KVCache`` (keys and values ``[1, kv_heads,
        tokens, head_dim]``), or for a sliding layer a ``RotatingKVCache`` holding the last
        ``min(tokens, window)`` in order (its ``state`` as mlx-lm 0.32 orders it)."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        mx = _import_mlx()
        assert self.pool is not None  # chains go with KV reuse
        past: list[KVCache | RotatingKVCache] = []
        for (keys, values), window in zip(self.pool.read(chain, tokens), self.windows, strict=True):
            if window is None:
                full = KVCache()
                full.keys, full.values, full.offset = keys, values, tokens
                past.append(full)
            else:
                sliding = RotatingKVCache(max_size=window)
                keys, values = keys[..., -window:, :], values[..., -window:, :]
                # (keys, values, offset, keep, max_size, index of the next write)
                sliding.state = (keys, values, tokens, 0, window, keys.shape[2])
                past.append(sliding)
        mx.eval([(layer.keys, layer.values) for layer in past])  # on this thread's stream
        return past


class AsyncMlxLM(PrefixCachedLM["list[KVCache | RotatingKVCache]"]):
    """Asynchronous, auto-batched mlx-lm model with a prefix tree of cached KV and logprobs.

    Each returned log-probability vector is the caller's own copy: editing it in place
    changes nothing the cache holds.

    Args:
        mlx_lm_model: a model from ``mlx_lm.load``.
        tokenizer: its tokenizer (mlx-lm's ``TokenizerWrapper`` or the Hugging Face one).

    The other arguments are the options below (``batch_size`` and ``timeout`` as on
    `BatchedAsyncLM`), each an attribute of the LM too.
    """

    runner: MlxRunner

    batch_size = PrefixCachedLM.batch_size.with_default(5)
    timeout = PrefixCachedLM.timeout.with_default(0.001)

    prefill_step_size = Option(2048, int_option(minimum=1), at="runner.prefill_step_size")
    """Most tokens per row fed to the model in one prefill pass. Assignable, with effect on
    the next batches."""

    cache_size = Option(
        400, int_option(minimum=0), at=("store.max_kv_entries", "store.max_logprobs_entries")
    )
    """Most prefixes whose KV (and, apart, logprobs) are kept, least recently used evicted
    first (0: nothing is kept between batches), over every adapter's prefix tree together;
    prompts pinned with `cache_kv` are outside it. Assignable: the next batch evicts down
    to it (logprobs: the next that computes a row)."""

    max_kv_bytes: Option[int | None] = Option(None, check_budget, at="store.max_kv_bytes")
    """Optional cap (bytes) on the KV blocks those prefixes hold. Assignable: the next
    batch evicts down to it."""

    max_logprobs_bytes: Option[int | None] = Option(
        None, check_budget, at="store.max_logprobs_bytes"
    )
    """Optional cap (bytes) on the cached log-probabilities. Assignable: the next batch
    that computes a row evicts down to it."""

    @takes_options
    def __init__(
        self,
        mlx_lm_model: Any,
        tokenizer: Any,
        batch_size: int = batch_size.default,
        timeout: float | None = timeout.default,
        prefill_step_size: int = prefill_step_size.default,
        cache_size: int = cache_size.default,
        *,
        max_kv_bytes: int | None = max_kv_bytes.default,
        max_logprobs_bytes: int | None = max_logprobs_bytes.default,
    ):
        mx = _import_mlx()
        super().__init__(_hf_tokenizer(tokenizer))
        self.mlx_tokenizer = tokenizer
        self.model = mlx_lm_model
        mx.eval(mlx_lm_model.parameters())
        layout, reason = self._probe_kv_layout()
        pool = None if layout is None else MlxBlockPool(layout)
        runner = MlxRunner(mlx_lm_model, self.vocab_size, pool, prefill_step_size)
        store = PrefixKVStore(
            pool or NoKVPool(reason),
            max_kv_bytes=max_kv_bytes,
            max_logprobs_bytes=max_logprobs_bytes,
            max_kv_entries=cache_size,
            max_logprobs_entries=cache_size,
        )
        self._init_prefix_cache(store, runner, batch_size, timeout, "genlm-mlx")

    @property
    def max_context_length(self) -> int | None:
        """The model's ``max_position_embeddings`` (None if its arguments have none), as HF."""
        args = getattr(self.model, "args", None)
        limit = getattr(args, "max_position_embeddings", None)
        return limit if isinstance(limit, int) and limit > 0 else None

    @classmethod
    def from_name(cls, model_name: str, **kwargs: Any) -> AsyncMlxLM:
        """Load ``model_name`` (a local directory or hub id) with ``mlx_lm.load``.

        The weights keep the dtype they are stored in; ``kwargs`` go to the constructor.
        """
        cls.check_constructor_options(kwargs)
        _import_mlx()
        import mlx_lm

        from genlm.backend.models import check_model_name, explained_load_errors

        path = check_model_name(model_name)
        with explained_load_errors(model_name):
            model, tokenizer = mlx_lm.load(path)[:2]
        return cls(model, tokenizer, **kwargs)

    def _probe_kv_layout(self) -> tuple[KVLayout | None, str]:
        """Run one token to learn the KV shape, and whether this design can reuse it (then
        run two through the paged cache); check that the output layer covers the
        tokenizer's vocabulary."""
        from mlx_lm.models.cache import make_prompt_cache

        mx = _import_mlx()
        cache = make_prompt_cache(self.model)
        logits = self.model(mx.array([[0]]), cache=cache)
        mx.eval(logits, [layer.state for layer in cache])
        check_vocab_fits(self.vocab_size, logits.shape[-1])
        others = {_kind(layer) for layer in cache if not _pageable(layer)}
        if others or not cache:
            return None, (
                f"its cache layers are {sorted(others)}, not only KVCache and "
                "RotatingKVCache keeping no first tokens"
            )
        layout, reason = uniform_layout([(layer.keys, layer.values) for layer in cache])
        if layout is not None:
            reason = _paged_forward_error(self.model, self.vocab_size, layout)
        return (None if reason else layout), reason


def _paged_forward_error(model: Any, vocab_size: int, layout: KVLayout) -> str:
    """Why ``model`` cannot run over the paged cache ('' if it can), from a forward of two
    tokens through a scratch pool: a model that reaches into its cache beyond the
    protocol `_PagedCache` speaks fails here, once, instead of on every request."""
    pool = MlxBlockPool(layout)
    pool.resize(2)  # block 0 (zeros) and the row's block
    row = RowPlan(slot=0, ids=(0, 0), lora=None, node=KVNode(), start=0, new_tokens=2, chain=(1,))
    try:
        MlxRunner(model, vocab_size, pool, prefill_step_size=1).run([row])
    except Exception as error:  # whatever the model's own code raises
        return f"its forward over a paged cache fails: {type(error).__name__}: {first_line(error)}"
    finally:
        pool.free()
    return ""


def _pageable(layer: Any) -> bool:
    """Whether the pool can stand in for an mlx-lm cache layer: a plain ``KVCache``, or a
    ``RotatingKVCache`` (a sliding window) that keeps none of the first tokens (kept ones,
    as with ``make_prompt_cache``'s ``max_kv_size``, stay visible past the window)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    return type(layer) is KVCache or (type(layer) is RotatingKVCache and layer.keep == 0)


def _window(layer: Any) -> int | None:
    """An mlx-lm cache layer's sliding window: a ``RotatingKVCache``'s size (None: none)."""
    from mlx_lm.models.cache import RotatingKVCache

    return layer.max_size if type(layer) is RotatingKVCache else None


def _kind(layer: Any) -> str:
    """An mlx-lm cache layer's class name, with a ``RotatingKVCache``'s kept first tokens."""
    keep = getattr(layer, "keep", 0)
    return type(layer).__name__ + (f"(keep={keep})" if keep else "")


def _logsumexp(logits: Any, chunk: int = 256) -> Any:
    """Each row's log-sum-exp (``[rows, 1]``), summed in two levels: MLX's CPU build sums
    a row in one sequential pass, whose float32 rounding over a vocabulary of ~50,000 left
    rows normalized only to ~1e-4 (`mx.logsumexp`); sums of ``chunk`` terms, then of
    those, stay within ~1e-6."""
    mx = _import_mlx()
    top = mx.max(logits, axis=-1, keepdims=True)
    terms = mx.exp(logits - top)
    rows, vocab = terms.shape
    if vocab % chunk:
        terms = mx.pad(terms, [(0, 0), (0, chunk - vocab % chunk)])
    total = terms.reshape(rows, -1, chunk).sum(axis=-1).sum(axis=-1, keepdims=True)
    return top + mx.log(total)
