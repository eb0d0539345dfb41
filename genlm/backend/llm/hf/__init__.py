"""Hugging Face transformers backend: `AsyncTransformer` (the LM, `model`), its forward over
a batch's rows (`TransformerRunner`, `runner`) through the model's own (`ModelForward`,
`forward`), the model as the LMs over it share it (`shared`), a step's inputs over the paged KV (`paged`), the transformers cache over the
pool (`cache`), cascade attention (`attention`), the CUDA graphs of its decode steps
(`graphs`), its LM head (`head`) and its loading options (`options`)."""

from genlm.backend.llm.hf.attention import (
    CASCADE_ATTENTION,
    cascade_attention,
    sdpa_or_cascade_attention,
)
from genlm.backend.llm.hf.cache import paged_cache
from genlm.backend.llm.hf.forward import BASE_ADAPTER, ModelForward
from genlm.backend.llm.hf.model import (
    DEFAULT_MAX_KV_BYTES,
    DEFAULT_MAX_LOGPROBS_BYTES,
    LORA_BATCHING,
    AsyncTransformer,
)
from genlm.backend.llm.hf.options import cache_keyword
from genlm.backend.llm.hf.paged import CASCADE_MIN_SHARED
from genlm.backend.llm.hf.runner import TransformerRunner

__all__ = [
    "BASE_ADAPTER",
    "CASCADE_ATTENTION",
    "CASCADE_MIN_SHARED",
    "DEFAULT_MAX_KV_BYTES",
    "DEFAULT_MAX_LOGPROBS_BYTES",
    "LORA_BATCHING",
    "AsyncTransformer",
    "ModelForward",
    "TransformerRunner",
    "cache_keyword",
    "cascade_attention",
    "paged_cache",
    "sdpa_or_cascade_attention",
]
