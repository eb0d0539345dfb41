"""Structural types of the engine objects the backends drive, for the type checker.

vLLM and SGLang are optional and untyped here, so their objects are described by what
the backends call on them, not by their classes: a test's stand-in engine satisfies
the same `Protocol` as the real one, and nothing here imports an engine package.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class HasTokenizer(Protocol):
    """An object holding a Hugging Face tokenizer as ``.tokenizer``."""

    tokenizer: Any


class SGLEngine(Protocol):
    """What `AsyncSGLTransformer` uses of an ``sglang.Engine``."""

    @property
    def tokenizer_manager(self) -> HasTokenizer: ...

    def generate(self, *, input_ids: list[list[int]], **kwargs: Any) -> Any:
        """One dict per request (a dict alone for one request)."""

    def flush_cache(self) -> Any: ...

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> Any: ...

    def unload_lora_adapter(self, lora_name: str) -> Any: ...

    def shutdown(self) -> None: ...

    loop: asyncio.AbstractEventLoop  # where its blocking calls run (run_until_complete)


class VLLMEngine(Protocol):
    """What `AsyncVirtualLM` uses of a ``vllm.AsyncLLM`` (its sessions stream
    ``generate``; adapter and prefix-cache calls are optional, looked up by name)."""

    def get_tokenizer(self) -> Any: ...

    def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any
    ) -> AsyncIterator[Any]: ...

    def shutdown(self, timeout: float | None = None) -> None: ...


class CaptureBatch(Protocol):
    """One batch of a capture: how each request asks for its full-vocabulary row, and
    reading the batch's rows back from the engine's outputs as a ``[n, width]`` tensor."""

    def sampling_kwargs(self, row: int) -> dict[str, Any]: ...

    def read(self, outputs: Sequence[Any]) -> torch.Tensor: ...


class LogprobsCapture(Protocol):
    """How `AsyncVirtualLM` gets full-vocabulary logprobs: engine options it needs, and a
    context manager per batch of ``n`` rows of ``width`` values."""

    engine_opts: dict[str, Any]

    def batch(self, n: int, width: int) -> AbstractContextManager[CaptureBatch]: ...

    def close(self) -> None:
        """Free what the capture keeps between batches (it stays usable)."""
        ...
