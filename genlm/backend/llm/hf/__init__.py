"""Hugging Face transformers backend: `AsyncTransformer` (`model`), its runner (`runner`),
step (`forward`), attention backend (`step`), shared model object (`shared`), CUDA graphs
(`graphs`), LM head (`head`), loading options (`options`) and family rules (`families`)."""

from genlm.backend.llm.hf.forward import BASE_ADAPTER, ModelForward
from genlm.backend.llm.hf.model import (
    DEFAULT_MAX_KV_BYTES,
    DEFAULT_MAX_LOGPROBS_BYTES,
    LORA_BATCHING,
    AsyncTransformer,
)
from genlm.backend.llm.hf.options import cache_keyword
from genlm.backend.llm.hf.runner import TransformerRunner
from genlm.backend.llm.hf.step import CASCADE_ATTENTION, CASCADE_MIN_SHARED, cascade_attention

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
]
