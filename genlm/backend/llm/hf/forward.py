"""`ModelForward`: a transformers causal LM's forward over a step's inputs
(`genlm.backend.llm.hf.step`), into rows of log-probabilities.

One step entry (`ModelForward.step`) for an eager step, a long prefill in chunks and a CUDA
graph's capture; the forward of whole prefixes where KV cannot be reused, and the uncached
reference. It holds the model (shared with the other LMs over it:
`genlm.backend.llm.hf.shared`, set as a batch needs it by `serving`), the names of this
LM's adapters in the shared peft model (rows of several adapters in one forward), and the
LM head applied into a reused buffer (`genlm.backend.llm.hf.head`). At construction it
probes whether the model's KV can be reused (`kv_layout`) and sets its attention.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from genlm.backend.kv.pool import KVLayout, uniform_layout
from genlm.backend.kv.store import RowPlan
from genlm.backend.kv.torch_pool import TorchBlockPool
from genlm.backend.llm.hf.families import kv_reuse_refusal, sliding_window
from genlm.backend.llm.hf.head import plain_head
from genlm.backend.llm.hf.options import cache_keyword
from genlm.backend.llm.hf.shared import SharedModel
from genlm.backend.llm.hf.step import (
    CASCADE_ATTENTION,
    SlidingWindow,
    StepInputs,
    attention_modules,
    model_inputs,
    set_attention,
    use_cascade,
)

# peft's name for "no adapter" in a mixed-adapter batch.
BASE_ADAPTER = "__base__"


class ModelForward:
    """A model's forward into rows of float32 logprobs over ``vocab_size`` tokens.

    Args:
        model: the model (put in eval mode while an LM serves it).
        vocab_size: the tokenizer's vocabulary: the columns of each row.

    Its ``pool`` is the KV pool the steps read and write (None: the model's KV cannot be
    reused, for the reason ``kv_reason``), ``window`` its sliding layers' window (None:
    none); ``cascade``, whether the model runs cascade attention
    (`genlm.backend.llm.hf.step.use_cascade`).
    """

    def __init__(self, model: Any, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size
        self.shared = SharedModel.of(model)
        self.adapters: dict[str, str] = {}  # this LM's adapter names -> their names in peft
        self._embedding = model.get_input_embeddings()
        self.input_device = self._embedding.weight.device
        self._dtype = self._embedding.weight.dtype
        self.output_device = model.get_output_embeddings().weight.device
        self._cache_keyword = cache_keyword(model)
        with self.shared.lock:
            self.shared.join(model, self)
            try:
                layout, self.kv_reason = kv_layout(model, self._cache_keyword)
                self.pool = None if layout is None else TorchBlockPool(layout.kv)
                self.window = None if layout is None else layout.window
                self.head = plain_head(model, vocab_size, self.input_device)
                self._set_attention()
            except BaseException:
                self.shared.leave(model, self, [])
                raise

    def _set_attention(self) -> None:
        """With KV reuse, the attention implementation this LM's steps run (``attention``):
        cascade attention where the model can take it, else the model's own; the one the
        model had before noted, for the last LM's `close` to restore."""
        model = self.model
        found = model.config._attn_implementation
        self.cascade = self.pool is not None and use_cascade(model, self.pool.layout.num_layers)
        configs = {id(m.config): m.config for m in attention_modules(model) if hasattr(m, "config")}
        self._configs: list[Any] = list(configs.values()) or [model.config]
        current = self._configs[0]._attn_implementation
        if current != found and found != CASCADE_ATTENTION:
            self.shared.given_attention = found
        self.attention = None if self.pool is None else current
        self._mask_dtype: torch.dtype | None = None  # sdpa's masks (and ours) are boolean
        if self.pool is not None and current not in ("sdpa", CASCADE_ATTENTION):
            self._mask_dtype = self.pool.layout.dtype  # eager attention adds its mask

    def step_down(self, *, kv_reuse: bool, reason: str = "") -> None:
        """Run steps without cascade attention and, unless ``kv_reuse``, without KV reuse
        (each request's whole prefix, for ``reason``): where the probe of the steps found
        them wrong (`genlm.backend.llm.hf.probe`)."""
        self.cascade = False
        if not kv_reuse:
            self.pool, self.kv_reason, self.attention, self._mask_dtype = None, reason, None, None

    def close(self) -> None:
        """Let go of the head's logits buffer and of the model: this LM's adapters removed,
        and, if no other LM serves it, the model as it was given (`SharedModel.leave`)."""
        if self.head is not None:
            self.head.free()
        self.shared.leave(self.model, self, list(self.adapters.values()))
        self.adapters.clear()

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Hold the model for a batch's forwards (the lock of the LMs over it), set as they
        need it: in eval mode and with this LM's attention implementation (a user's own
        restored after), in the dtype and on the device the LM was built for (else
        RuntimeError), and with no LoRA layers but the LMs' (`SharedModel.check_lora_layers`)."""
        model = self.model
        with self.shared.lock:
            weight = self._embedding.weight
            if weight.dtype != self._dtype or weight.device != self.input_device:
                raise RuntimeError(
                    f"this AsyncTransformer was built for the model in {self._dtype} on "
                    f"{self.input_device}, which is now in {weight.dtype} on {weight.device}: "
                    "move it back, or create a new AsyncTransformer (its KV is the old one)"
                )
            self.shared.check_lora_layers(model)
            training = model.training
            switched = self._switched_attention()
            if training:
                model.eval()
            try:
                if switched is not None:
                    wanted, found = switched
                    set_attention(model, wanted)
                    if self._switched_attention() is not None:
                        raise RuntimeError(
                            f"the model's attention implementation was switched to {found!r} "
                            f"under this AsyncTransformer, whose steps need {wanted!r}, and "
                            "cannot be set back"
                        )
                yield
            finally:
                if switched is not None:
                    set_attention(model, switched[1])
                if training:
                    model.train()

    def _switched_attention(self) -> tuple[str, str] | None:
        """This LM's attention implementation and the one a user set on the model in its
        place, or None (also without KV reuse, where any gives right rows)."""
        wanted = self.attention
        if wanted is None:
            return None
        for config in self._configs:
            if config._attn_implementation != wanted:
                return wanted, config._attn_implementation
        return None

    def step(
        self,
        step: StepInputs,
        out: torch.Tensor,
        loras: Sequence[str | None] | None = None,
        *,
        max_tokens: int | None = None,
        reuse_logits: bool = True,
    ) -> None:
        """The step's forward over the paged KV: each row's new tokens' KV written into its
        chain, the logprobs of its last into ``out``. Rows served by ``loras`` (one adapter
        name or None per row; None: all the base model's); new tokens beyond
        ``max_tokens`` (a lone long prefill) run in chunks; the logits in the head's
        reused buffer unless not ``reuse_logits`` (a graph's capture)."""
        assert self.pool is not None  # steps go with KV reuse
        new = step.input_ids.shape[1]
        chunk = max_tokens or new
        for begin in range(0, new, chunk):
            cache, inputs = model_inputs(
                self.pool, step, begin, min(new, begin + chunk), self._mask_dtype, self.window
            )
            inputs[self._cache_keyword] = cache
            with cache:
                self._logprobs_into(loras, out, inputs, reuse_logits=reuse_logits)

    def whole_prefixes(self, plans: list[RowPlan], out: torch.Tensor) -> None:
        """Fallback for models without reusable KV: one plain forward of whole prefixes of
        one length, their logprobs into ``out``."""
        input_ids = torch.tensor([plan.ids for plan in plans], device=self.input_device)
        inputs = {"input_ids": input_ids, "use_cache": False}
        self._logprobs_into([plan.lora for plan in plans], out, inputs)

    def uncached(self, ids: tuple[int, ...], lora: str | None) -> torch.Tensor:
        """The reference answer: one plain forward of the whole prefix, no cache."""
        return self.uncached_rows([ids], lora)[0, -1]

    def uncached_rows(
        self, contexts: Sequence[Sequence[int]], lora: str | None, positions: int = 1
    ) -> torch.Tensor:
        """The reference answers of ``contexts`` of one length and of their prefixes: one
        plain forward of the model's own, no cache, into the float32 logprobs after each
        of their last ``positions`` tokens (``[rows, positions, vocab]``)."""
        with self.serving(), torch.inference_mode():
            input_ids = torch.tensor(contexts, device=self.input_device)
            inputs = {"input_ids": input_ids, "use_cache": False}
            logits = self._own_logits([lora] * len(contexts), inputs, positions)
            return torch.log_softmax(logits[..., : self.vocab_size].float(), dim=-1)

    def _logprobs_into(
        self,
        loras: Sequence[str | None] | None,
        out: torch.Tensor,
        inputs: dict[str, Any],
        reuse_logits: bool = True,
    ) -> None:
        """The forward's float32 logprobs at each row's last position over the tokenizer's
        vocabulary (padding dropped), into ``out``: the base model and our `OutputHead`
        (logits in reused memory, unless not ``reuse_logits``) where `plain_head` found the
        model's logits to be its head's and no adapter is loaded; else the model's own
        forward (`_own_logits`)."""
        if self.head is not None and self.shared.peft is None:
            hidden = self.model.base_model(**inputs).last_hidden_state
            self.head.logprobs(hidden[:, -1], out, reuse_logits)
            return
        logits = self._own_logits(loras, inputs, 1)
        torch.log_softmax(logits[:, -1, : self.vocab_size].float(), dim=-1, out=out)

    def _own_logits(
        self, loras: Sequence[str | None] | None, inputs: dict[str, Any], positions: int
    ) -> torch.Tensor:
        """The model's own forward's logits at the last ``positions`` positions, through
        peft (naming each row's adapter) when one is loaded."""
        peft = self.shared.peft
        if peft is None:
            return self.model(**inputs, logits_to_keep=positions).logits
        loras = loras or [None] * inputs["input_ids"].shape[0]
        names = [BASE_ADAPTER if name is None else self.adapters[name] for name in loras]
        return peft(**inputs, logits_to_keep=positions, adapter_names=names).logits


@dataclass(frozen=True)
class PagedLayout:
    """What a model's steps need to know of its KV: its shape, and its sliding window."""

    kv: KVLayout
    window: SlidingWindow | None


def kv_layout(model: Any, keyword: str) -> tuple[PagedLayout | None, str]:
    """Run one token to learn the KV shape, and whether this design can reuse it (else
    None, and why not)."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager", CASCADE_ATTENTION):
        return None, f"attention implementation {implementation!r}"
    with torch.inference_mode():
        device = model.get_input_embeddings().weight.device
        input_ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        cache = getattr(model(input_ids=input_ids, use_cache=True, logits_to_keep=1), keyword)
    if not isinstance(cache, DynamicCache) or not cache.layers:
        return None, f"its cache is a {type(cache).__name__}"
    layers: list[Any] = cache.layers
    refusal = kv_reuse_refusal(model, layers)
    if refusal is not None:
        return None, refusal
    layout, reason = uniform_layout([(layer.keys, layer.values) for layer in layers])
    if layout is None:
        return None, reason
    return PagedLayout(layout, sliding_window(model, layers)), reason
