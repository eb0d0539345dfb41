"""Loading options of `AsyncTransformer`: dtype names, bitsandbytes' log noise, the keyword
under which a model's forward takes its KV cache, and the device a model goes on."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

_DTYPE_NAMES = {
    **dict.fromkeys(("float", "float32", "fp32"), torch.float32),
    **dict.fromkeys(("half", "float16", "fp16"), torch.float16),
    **dict.fromkeys(("bfloat16", "bf16"), torch.bfloat16),
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
    from transformers 5.24 on, ``past_key_values`` before and in remote-code models that
    keep it. Read from the class (a wrapper set on the instance changes nothing); a forward
    taking only ``**kwargs`` gets the installed transformers' name."""
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
    from transformers import BitsAndBytesConfig

    from genlm.backend._install import import_extra

    import_extra("bitsandbytes", "bnb", "bitsandbytes_opts needs bitsandbytes")

    return BitsAndBytesConfig(**bitsandbytes_opts)


# The most of a CUDA device's free memory that a model's weights may take for the model to
# go on that device alone: the rest holds the activations, the logits and the KV pool.
ONE_DEVICE_WEIGHT_SHARE = 0.9

# Keyword arguments of ``from_pretrained`` that say where the config is or how to read it.
_CONFIG_OPTIONS = ("trust_remote_code", "revision", "subfolder", "cache_dir", "token", "gguf_file")


def default_device_map(
    model_id: str, path: str, from_pretrained_kwargs: dict[str, Any]
) -> str | dict[str, int]:
    """The ``device_map`` for loading ``model_id`` where the caller named none: without CUDA
    ``"auto"``; with CUDA the whole model on the current device (``"auto"`` would spread it
    over every GPU, without KV reuse), or ValueError naming the ways to split it where its
    weights take more than ``ONE_DEVICE_WEIGHT_SHARE`` of the free memory."""
    if not torch.cuda.is_available():
        return "auto"
    device = torch.cuda.current_device()
    free, _ = torch.cuda.mem_get_info(device)
    from genlm.backend.models import explained_load_errors

    with explained_load_errors(model_id):
        needed = weight_bytes(path, from_pretrained_kwargs)
    if needed <= ONE_DEVICE_WEIGHT_SHARE * free:
        return {"": device}
    raise ValueError(
        f"{model_id}'s weights take about {needed / 2**30:.2f} GiB, more than "
        f"{ONE_DEVICE_WEIGHT_SHARE:.0%} of the {free / 2**30:.2f} GiB free on cuda:{device}: "
        "the model does not fit on one GPU. Split it over several GPUs with the vLLM backend's "
        "tensor parallelism (load_model_by_name(name, backend='vllm', llm_opts={'engine_opts': "
        "{'tensor_parallel_size': N}})), or spread its layers with transformers "
        "(hf_opts={'device_map': 'auto'}: the layers then run one GPU after another, without "
        "KV reuse)"
    )


def weight_bytes(path: str, from_pretrained_kwargs: dict[str, Any]) -> int:
    """About the bytes ``from_pretrained(path, **from_pretrained_kwargs)``'s weights take:
    the model built on the meta device (nothing loaded), at the dtype it will load in
    (``dtype``, else the config's, else float32) or, quantized, at 4 or 8 bits a weight."""
    from accelerate.utils import CustomDtype, compute_module_sizes
    from transformers import AutoConfig, AutoModelForCausalLM

    config_kwargs = {k: v for k, v in from_pretrained_kwargs.items() if k in _CONFIG_OPTIONS}
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, trust_remote_code=config_kwargs.get("trust_remote_code", False)
        )
    quantization = from_pretrained_kwargs.get("quantization_config") or getattr(
        config, "quantization_config", None
    )
    dtype: Any
    if quantization is not None:
        settings = quantization if isinstance(quantization, dict) else quantization.to_dict()
        four_bit = settings.get("load_in_4bit") or settings.get("bits") == 4
        dtype = CustomDtype.INT4 if four_bit else torch.int8
    else:
        dtype = from_pretrained_kwargs.get("dtype", "auto")
        if dtype == "auto":
            dtype = getattr(config, "dtype", None) or torch.float32
    return int(compute_module_sizes(model, dtype=dtype)[""])
