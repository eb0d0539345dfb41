"""`ModelForward`: a transformers causal LM's forward over a step's inputs, into rows of
log-probabilities.

It holds the model (shared with the other LMs over it: `genlm.backend.llm.hf.shared`), the
names of this LM's adapters in the shared peft model (rows of several adapters in one
forward, ``adapter_names=``), and the LM head applied into a reused buffer
(`genlm.backend.llm.hf.head`): a forward over a paged step (`logprobs_into`, with the
pool's `Cache`), the cascade step (`cascade_step`), the decode step CUDA graphs capture
(`decode_step`), whole prefixes without KV reuse and the uncached reference. At
construction it probes whether the model's KV can be reused (`kv_layout`) and sets its
attention. The runner (`genlm.backend.llm.hf.runner`) and the graphs
(`genlm.backend.llm.hf.graphs`) call it; it calls neither.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from genlm.backend.kv.pool import KVLayout, uniform_layout
from genlm.backend.kv.store import RowPlan
from genlm.backend.kv.torch_pool import TorchBlockPool
from genlm.backend.llm.hf.attention import (
    CASCADE_ATTENTION,
    attention_modules,
    set_attention,
    use_cascade,
)
from genlm.backend.llm.hf.cache import step_cache
from genlm.backend.llm.hf.head import plain_head
from genlm.backend.llm.hf.options import cache_keyword
from genlm.backend.llm.hf.paged import StepInputs, attention_mask
from genlm.backend.llm.hf.shared import SharedModel

# peft's name for "no adapter" in a mixed-adapter batch.
BASE_ADAPTER = "__base__"


class ModelForward:
    """A model's forward into rows of float32 logprobs over ``vocab_size`` tokens.

    Args:
        model: the model (put in eval mode while an LM serves it).
        vocab_size: the tokenizer's vocabulary: the columns of each row.

    Its ``pool`` is the KV pool the steps read and write (None: the model's KV cannot be
    reused, for the reason ``kv_reason``); ``cascade``, whether the model runs cascade
    attention (`genlm.backend.llm.hf.attention.use_cascade`).
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
                self.pool = None if layout is None else TorchBlockPool(layout)
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

    def _forward(
        self, loras: Sequence[str | None], cache: Cache | None = None, **kwargs: Any
    ) -> Any:
        """The model's forward for rows served by ``loras`` (one adapter name or None per row),
        reading and writing KV through ``cache``."""
        if cache is not None:
            kwargs[self._cache_keyword] = cache
        peft = self.shared.peft
        if peft is None:
            return self.model(**kwargs)
        names = [BASE_ADAPTER if lora is None else self.adapters[lora] for lora in loras]
        return peft(**kwargs, adapter_names=names)

    def cascade_step(
        self,
        step: StepInputs,
        loras: Sequence[str | None],
        out: torch.Tensor,
        reuse_logits: bool = True,
    ) -> None:
        """Cascade attention: the shared prefix is read once per layer; each row reads only
        its own tokens (the model's attention, `sdpa_or_cascade_attention`, picks it by the
        ``genlm_cache`` keyword, which the model passes on to it)."""
        assert self.pool is not None  # steps go with KV reuse
        cache = step_cache(self.pool, step)
        self.logprobs_into(
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

    def decode_step(self, step: StepInputs, out: torch.Tensor) -> None:
        """A decode step as `DecodeGraphs` captures it: the plain model (no adapter), its
        logits in memory of the step's own (the head's reused buffer would outlive it)."""
        self.cascade_step(step, [None] * step.input_ids.shape[0], out, False)

    def whole_prefixes(self, plans: list[RowPlan], out: torch.Tensor) -> None:
        """Fallback for models without reusable KV: one plain forward of whole prefixes of
        one length, their logprobs into ``out``."""
        input_ids = torch.tensor([plan.ids for plan in plans], device=self.input_device)
        self.logprobs_into([plan.lora for plan in plans], out, input_ids=input_ids, use_cache=False)

    def logprobs_into(
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
        if self.head is None or self.shared.peft is not None:
            logits = self._forward(loras, cache, logits_to_keep=1, **inputs).logits
            self._logprobs(logits[:, -1], out)
            return
        if cache is not None:
            inputs[self._cache_keyword] = cache
        hidden = self.model.base_model(**inputs).last_hidden_state
        self.head.logprobs(hidden[:, -1], out, reuse_logits)

    def model_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` as the model's attention wants it: boolean for sdpa, additive for eager."""
        if self.attention in ("sdpa", CASCADE_ATTENTION):
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
        """The reference answer: one plain forward of the whole prefix, no cache."""
        with self.serving(), torch.inference_mode():
            input_ids = torch.tensor([ids], device=self.input_device)
            logits = self._forward(
                [lora], input_ids=input_ids, use_cache=False, logits_to_keep=1
            ).logits
            return self._logprobs(logits[:, -1])[0]


def kv_layout(model: Any, keyword: str) -> tuple[KVLayout | None, str]:
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
    layers = [
        (getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in cache.layers
    ]
    if any(type(layer) is not DynamicLayer for layer in cache.layers) or any(
        keys is None or values is None for keys, values in layers
    ):
        return None, "its cache has layers other than full attention"
    return uniform_layout(layers)
