"""Loading options of `AsyncTransformer`: dtype names, bitsandbytes' log noise, and the
keyword under which a model's forward takes its KV cache."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

_DTYPE_NAMES = {
    "float": torch.float32,
    "float32": torch.float32,
    "fp32": torch.float32,
    "half": torch.float16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class _FirstOnly(logging.Filter):
    """Lets a message through once per process, then drops its repeats."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix, self.seen = prefix, False

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.prefix):
            return True
        seen, self.seen = self.seen, True
        return not seen


# bitsandbytes logs this for every 8-bit matmul of a float32 input: 210 lines per forward of
# a 30-layer model. Once says it all.
_BNB_CAST_NOTICE = _FirstOnly("MatMul8bitLt: inputs will be cast")


def quiet_bitsandbytes(model: torch.nn.Module) -> None:
    """Show bitsandbytes' cast notice once, for a model with 8-bit layers."""
    if any(type(module).__name__ == "Linear8bitLt" for module in model.modules()):
        logger = logging.getLogger("bitsandbytes.autograd._functions")
        if _BNB_CAST_NOTICE not in logger.filters:
            logger.addFilter(_BNB_CAST_NOTICE)


def cache_keyword(model: torch.nn.Module) -> str:
    """The name under which ``model``'s forward takes and returns its KV cache: ``cache``
    from transformers 5.24 on (there ``past_key_values`` is deprecated, to go in 5.40),
    ``past_key_values`` in older releases and in remote-code models that keep it.

    Read from the class, so that a wrapper set on the instance (a profiler's) changes
    nothing; a wrapper class whose forward takes only ``**kwargs`` gets the installed
    transformers' name.
    """
    parameters = inspect.signature(type(model).forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    import transformers
    from packaging.version import Version

    return "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"


def normalize_dtype(opts: dict[str, Any]) -> None:
    """Accept ``torch_dtype`` or ``dtype``, as a `torch.dtype` or a name; store it as ``dtype``."""
    if "torch_dtype" in opts:
        if "dtype" in opts:
            raise ValueError("hf_opts sets both 'dtype' and 'torch_dtype'; pass only one")
        opts["dtype"] = opts.pop("torch_dtype")
    dtype = opts.get("dtype")
    if isinstance(dtype, str) and dtype != "auto":
        name = dtype.removeprefix("torch.")
        if name not in _DTYPE_NAMES:
            raise ValueError(
                f"Unknown dtype {dtype!r}; use a torch.dtype, 'auto' or one of {sorted(_DTYPE_NAMES)}"
            )
        opts["dtype"] = _DTYPE_NAMES[name]


def bitsandbytes_config(bitsandbytes_opts: dict[str, Any]) -> Any:
    """``transformers.BitsAndBytesConfig(**bitsandbytes_opts)``, or ImportError naming the
    ``bnb`` extra when bitsandbytes is not installed."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        from genlm.backend._install import install_hint

        raise ImportError(f"bitsandbytes_opts needs bitsandbytes: {install_hint('bnb')}") from error
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(**bitsandbytes_opts)
