"""Language-model backends, all behind the `AsyncLM` interface."""

from genlm.backend._lazy import lazy_exports

__all__ = [
    "AsyncLM",
    "MockAsyncLM",
    "AsyncTransformer",
    "AsyncVirtualLM",
    "AsyncMlxLM",
    "AsyncSGLTransformer",
    "load_model_by_name",
    "PrefixHandle",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "AsyncLM": ".base",
        "MockAsyncLM": ".mock",
        "AsyncTransformer": ".hf",
        "AsyncVirtualLM": ".vllm",
        "AsyncMlxLM": ".mlx",
        "AsyncSGLTransformer": ".sgl",
        "load_model_by_name": ".loading",
        "PrefixHandle": ".handle",
    },
)
