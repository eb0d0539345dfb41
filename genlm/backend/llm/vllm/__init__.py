"""The vLLM backend: `AsyncVirtualLM` (`lm`), the engine's loop and handle (`loop`), its
streaming-input `sessions`, the full-vocabulary `capture` (the caller's half) and its
logits `processor` (the engine's half), the model runner's check (`runners`), the engine
options `from_name` sets (`defaults`) and the vLLM names used (`api`). Names resolve on
first use: vLLM's processes import `processor`, and nothing of the client.
Type checkers read them from the ``TYPE_CHECKING`` imports, which never run."""

from typing import TYPE_CHECKING

from genlm.backend._lazy import lazy_exports

if TYPE_CHECKING:
    from .capture import (
        CaptureSpaceError,
        EngineLogprobsCapture,
        LogitsProcessorCapture,
        MissingRowsError,
    )
    from .defaults import engine_options, logging_configured
    from .lm import AsyncVirtualLM, hash_to_int
    from .processor import CAPTURE_KEY, CAPTURE_PROCESSOR
    from .sessions import RequestEndedError, StepStalledError

__all__ = [
    "AsyncVirtualLM",
    "LogitsProcessorCapture",
    "EngineLogprobsCapture",
    "MissingRowsError",
    "CaptureSpaceError",
    "RequestEndedError",
    "StepStalledError",
    "CAPTURE_KEY",
    "CAPTURE_PROCESSOR",
    "engine_options",
    "hash_to_int",
    "logging_configured",
]

# Each public name and the module that defines it (imported on first use).
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "AsyncVirtualLM": ".lm",
        "LogitsProcessorCapture": ".capture",
        "EngineLogprobsCapture": ".capture",
        "MissingRowsError": ".capture",
        "CaptureSpaceError": ".capture",
        "RequestEndedError": ".sessions",
        "StepStalledError": ".sessions",
        "CAPTURE_KEY": ".processor",
        "CAPTURE_PROCESSOR": ".processor",
        "engine_options": ".defaults",
        "hash_to_int": ".lm",
        "logging_configured": ".defaults",
    },
)
