"""Hugging Face transformers backend: `AsyncTransformer` (the LM, `model`), its forward over
a batch's rows (`TransformerRunner`, `runner`) through the model's own step (`ModelForward`,
`forward`), the model as the LMs over it share it (`shared`), the step's attention backend:
its inputs, the paged cache and cascade attention (`step`), the CUDA graphs of its decode
steps (`graphs`), its LM head (`head`) and its loading options (`options`)."""

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
