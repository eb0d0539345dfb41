"""`load_model_by_name`: pick a backend by name and load a model with it; `check_vocab_fits`:
the check every backend runs on a loaded model and tokenizer."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from typing import Any

from genlm.backend.llm.base import AsyncLM

logger = logging.getLogger(__name__)

# backend name -> (module, class name); modules are imported only when chosen.
BACKENDS: dict[str, tuple[str, str]] = {
    "vllm": ("genlm.backend.llm.vllm", "AsyncVirtualLM"),
    "hf": ("genlm.backend.llm.hf", "AsyncTransformer"),
    "mlx": ("genlm.backend.llm.mlx", "AsyncMlxLM"),
    "sgl": ("genlm.backend.llm.sgl", "AsyncSGLTransformer"),
    "mock": ("genlm.backend.llm.mock", "MockAsyncLM"),
}


# The oldest Python that vLLM's releases support (the vllm extra's marker in pyproject.toml).
VLLM_MIN_PYTHON = (3, 11)


def check_vocab_fits(tokenizer_vocab: int, model_vocab: int) -> None:
    """Refuse a tokenizer that does not belong to the model: it has more tokens than the
    model has output rows, or far fewer (a model pads its output layer beyond its tokenizer
    by a little: at most max(128, 1%) rows here; Qwen2.5 pads 271 of 151,936)."""
    padding = model_vocab - tokenizer_vocab
    if padding < 0 or padding > max(128, model_vocab // 100):
        raise ValueError(
            f"The tokenizer has {tokenizer_vocab} tokens but the model's output layer "
            f"{model_vocab}: they do not belong together (pass the model's own tokenizer)"
        )


def default_backend() -> str:
    """``"vllm"`` when CUDA is available and vllm is installed, else ``"hf"``.

    A CUDA machine without vllm gets hf and one logged warning: on Python below 3.11,
    which vLLM's releases do not support (the ``vllm`` extra installs nothing there),
    saying so; else naming the ``vllm`` extra. A backend the caller did not name is never
    an `ImportError`.
    """
    import torch

    if not torch.cuda.is_available():
        return "hf"
    if importlib.util.find_spec("vllm") is None:
        if sys.version_info < VLLM_MIN_PYTHON:
            logger.warning(
                "CUDA is available but vLLM needs Python >= %d.%d (this is %d.%d): loading "
                "with the hf backend",
                *VLLM_MIN_PYTHON,
                *sys.version_info[:2],
            )
            return "hf"
        from genlm.backend._install import install_hint

        logger.warning(
            "CUDA is available but vllm is not installed: loading with the hf backend "
            "(%s for the vLLM one)",
            install_hint("vllm"),
        )
        return "hf"
    return "vllm"


def load_model_by_name(
    name: str, backend: str | None = None, llm_opts: dict[str, Any] | None = None
) -> AsyncLM:
    """Load ``name`` (a hub id, a local directory or a ``.gguf`` file) with a backend.

    Args:
        name: the model to load.
        backend: one of ``"vllm"``, ``"hf"``, ``"mlx"``, ``"sgl"``, ``"mock"``;
            ``None`` picks vllm when CUDA is available and vllm is installed, else hf
            (see `default_backend`).
        llm_opts: keyword arguments for the backend's ``from_name``.

    Raises:
        ValueError: for an unknown backend (the message lists the valid ones), or a
            local path that does not exist or holds no model (see `check_model_name`).
        TypeError: ``name`` is not a str (or path), ``llm_opts`` not a dict or holding an
            option the backend does not take (e.g. ``hf_opts`` for vllm: ``from_name``
            checks its options before any engine starts, `check_constructor_options`).
        ImportError: when the named backend's optional package is missing (names the pip
            extra); never for the default backend.
    """
    from genlm.backend.models import check_model_name

    if backend is not None and (not isinstance(backend, str) or backend not in BACKENDS):
        raise ValueError(
            f"Unknown backend {backend!r}; valid backends are: {', '.join(sorted(BACKENDS))}"
        )
    if llm_opts is not None and not isinstance(llm_opts, dict):
        raise TypeError(f"llm_opts must be a dict or None, got {type(llm_opts).__name__}")
    name = check_model_name(name)
    backend = default_backend() if backend is None else backend
    module_name, class_name = BACKENDS[backend]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls.from_name(name, **(llm_opts or {}))
