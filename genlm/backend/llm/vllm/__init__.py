"""The vLLM backend: `AsyncVirtualLM`, full-vocabulary next-token log-probabilities from a
vLLM engine in which the particles live.

The engine is vLLM's ``AsyncLLM``, built and driven on its own event-loop thread (`loop`),
so it serves alike wherever it is built, inside a running event loop or a notebook
included. Each engine has one `handle.EngineHandle`, shared by every LM over it: that loop
and the engine's `sessions`. A request that extends a live request's context by one token
continues that request as one more chunk of a streaming-input session, so a step costs
what vLLM's own decoding costs. The full distribution comes back through the `capture`:
a logits processor in the process that samples, or vLLM's own ``logprobs=-1``. `lm` is the
LM, `defaults` the engine options that `AsyncVirtualLM.from_name` sets, `api` the vLLM
names the backend uses.

The names below resolve on first use: vLLM's processes import `capture`, for its logits
processor, and nothing else of the client.
"""

from typing import TYPE_CHECKING

from genlm.backend._lazy import lazy_exports

if TYPE_CHECKING:
    from genlm.backend.llm.vllm.capture import (
        CAPTURE_KEY,
        CAPTURE_PROCESSOR,
        EngineLogprobsCapture,
        LogitsProcessorCapture,
        MissingRowsError,
    )
    from genlm.backend.llm.vllm.defaults import engine_options, logging_configured
    from genlm.backend.llm.vllm.lm import AsyncVirtualLM, hash_to_int
    from genlm.backend.llm.vllm.sessions import RequestEndedError, StepStalledError

__all__ = [
    "AsyncVirtualLM",
    "LogitsProcessorCapture",
    "EngineLogprobsCapture",
    "MissingRowsError",
    "RequestEndedError",
    "StepStalledError",
    "CAPTURE_KEY",
    "CAPTURE_PROCESSOR",
    "engine_options",
    "hash_to_int",
    "logging_configured",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
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
    },
)
