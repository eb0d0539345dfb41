"""The logits processor's old qualified name, ``genlm.backend.llm.vllm_capture:FullLogitsCapture``,
which engine options written before the vLLM package still name: vLLM loads it here and
gets `genlm.backend.llm.vllm.capture`'s processor."""

from genlm.backend.llm.vllm.capture import __getattr__ as __getattr__
