"""The vLLM backend: `AsyncVirtualLM` (`lm`), the engine's loop and handle (`loop`), its
streaming-input `sessions`, the full-vocabulary `capture`, the engine options `from_name`
sets (`defaults`) and the vLLM names used (`api`). Names resolve on first use: vLLM's
processes import `capture`, for its logits processor, and nothing else of the client."""

from genlm.backend._lazy import lazy_exports

# Each public name and the module that defines it (imported on first use).
_EXPORTS = {
    "AsyncVirtualLM": ".lm",
    "LogitsProcessorCapture": ".capture",
    "EngineLogprobsCapture": ".capture",
    "MissingRowsError": ".capture",
    "RequestEndedError": ".sessions",
    "StepStalledError": ".sessions",
    "CAPTURE_KEY": ".capture",
    "CAPTURE_PROCESSOR": ".capture",
    "engine_options": ".defaults",
    "hash_to_int": ".lm",
    "logging_configured": ".defaults",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
