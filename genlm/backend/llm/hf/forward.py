"""`ModelForward`: a transformers causal LM's forward over a step's inputs, into rows of
log-probabilities.

It holds the model, its peft wrapper once an adapter is loaded (rows of several adapters
in one forward, ``adapter_names=``), and the LM head applied into a reused buffer
(`genlm.backend.llm.hf.head`): a forward over a paged step (`logprobs_into`, with the
pool's `Cache`), the cascade step (`cascade_step`), the decode step CUDA graphs capture
(`decode_step`), whole prefixes without KV reuse and the uncached reference. The runner
(`genlm.backend.llm.hf.runner`) and the graphs (`genlm.backend.llm.hf.graphs`) call it;
it calls neither.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache

from genlm.backend.kv.store import RowPlan
from genlm.backend.kv.torch_pool import TorchBlockPool
from genlm.backend.llm.hf.attention import CASCADE_ATTENTION
from genlm.backend.llm.hf.cache import step_cache
from genlm.backend.llm.hf.head import plain_head
from genlm.backend.llm.hf.options import cache_keyword
from genlm.backend.llm.hf.paged import StepInputs, attention_mask

# peft's name for "no adapter" in a mixed-adapter batch.
BASE_ADAPTER = "__base__"


class ModelForward:
    """A model's forward into rows of float32 logprobs over ``vocab_size`` tokens.

    Args:
        model: the model (in eval mode).
        vocab_size: the tokenizer's vocabulary: the columns of each row.
        pool: the KV pool the steps read and write (None: no KV reuse).
    """

    def __init__(self, model: Any, vocab_size: int, pool: TorchBlockPool | None):
        self.model = model
        self.vocab_size = vocab_size
        self.pool = pool
        self.peft: Any = None  # the peft model wrapping self.model, once an adapter is loaded
        self._peft_names: dict[str, str] = {}  # adapter name -> its name inside peft
        self._adapter_ids = itertools.count()
        self.input_device = model.get_input_embeddings().weight.device
        self.output_device = model.get_output_embeddings().weight.device
        self._cache_keyword = cache_keyword(model)
        self.head = plain_head(model, vocab_size, self.input_device)

    def free(self) -> None:
        """Let go of the head's logits buffer."""
        if self.head is not None:
            self.head.free()

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
        if self.head is None or self.peft is not None:
            logits = self._forward(loras, cache, logits_to_keep=1, **inputs).logits
            self._logprobs(logits[:, -1], out)
            return
        if cache is not None:
            inputs[self._cache_keyword] = cache
        hidden = self.model.base_model(**inputs).last_hidden_state
        self.head.logprobs(hidden[:, -1], out, reuse_logits)

    def model_mask(self, mask: torch.Tensor) -> torch.Tensor:
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
        """The reference answer: one plain forward of the whole prefix, no cache."""
        with torch.inference_mode():
            input_ids = torch.tensor([ids], device=self.input_device)
            logits = self._forward(
                [lora], input_ids=input_ids, use_cache=False, logits_to_keep=1
            ).logits
            return self._logprobs(logits[:, -1])[0]
