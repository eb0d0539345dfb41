"""``genlm.backend.llm.vllm_capture:FullLogitsCapture``, the logits processor's name before
the vLLM package, which engine options may still name: it loads the same class."""

from genlm.backend.llm.vllm.processor import __getattr__ as __getattr__
