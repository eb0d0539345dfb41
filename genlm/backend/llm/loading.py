"""`load_model_by_name`: pick a backend by name and load a model with it."""

from __future__ import annotations

import importlib
from typing import Any

from genlm.backend.llm.base import AsyncLM

# backend name -> (module, class name); modules are imported only when chosen.
BACKENDS: dict[str, tuple[str, str]] = {
    "vllm": ("genlm.backend.llm.vllm", "AsyncVirtualLM"),
    "hf": ("genlm.backend.llm.hf", "AsyncTransformer"),
    "mlx": ("genlm.backend.llm.mlx", "AsyncMlxLM"),
    "sgl": ("genlm.backend.llm.sgl", "AsyncSGLTransformer"),
    "mock": ("genlm.backend.llm.base", "MockAsyncLM"),
}


def default_backend() -> str:
    """``"vllm"`` when CUDA is available, else ``"hf"``."""
    import torch

    return "vllm" if torch.cuda.is_available() else "hf"


def load_model_by_name(
    name: str, backend: str | None = None, llm_opts: dict[str, Any] | None = None
) -> AsyncLM:
    """Load ``name`` (a hub id, a local directory or a ``.gguf`` file) with a backend.

    Args:
        name: the model to load.
        backend: one of ``"vllm"``, ``"hf"``, ``"mlx"``, ``"sgl"``, ``"mock"``;
            ``None`` picks vllm when CUDA is available, else hf.
        llm_opts: keyword arguments for the backend's ``from_name``.

    Raises:
        ValueError: for an unknown backend (the message lists the valid ones).
        ImportError: when the backend's optional package is missing (names the pip extra).
    """
    backend = default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(
            f"Unknown backend {backend!r}; valid backends are: {', '.join(sorted(BACKENDS))}"
        )
    module_name, class_name = BACKENDS[backend]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls.from_name(name, **(llm_opts or {}))
