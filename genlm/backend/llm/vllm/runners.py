"""Which of vLLM's model runners an engine will run, and whether the logits processors its
options name can run on it, checked before the engine starts.

vLLM has two model runners, and each loads only the logits processors that subclass its own
base class (`RUNNER_BASES`): the V1 runner, which vLLM's CPU build runs, and Model Runner
V2, the default of its CUDA builds. The engine picks one from its config
(``VllmConfig.use_v2_model_runner``: ``VLLM_USE_V2_MODEL_RUNNER`` when set, else V2 unless
Triton is missing or a feature V2 lacks is on). The processor of the default capture
subclasses both; a processor of the caller's own (a capture object's, or named in
``engine_opts``) that subclasses the other runner's class would make vLLM refuse the engine
with an error that names no way out, so `check_logits_processors` refuses it first.
"""

from __future__ import annotations

import importlib
from typing import Any

# Each runner's name and the base class (module:qualname) of the processors it loads.
RUNNER_BASES = {
    "V1": "vllm.v1.sample.logits_processor:LogitsProcessor",
    "V2": "vllm.v1.worker.gpu.sample.logits_processor:LogitsProcessor",
}
RUNNER_NAMES = {"V1": "V1 model runner", "V2": "Model Runner V2"}


def model_runner(vllm_config: Any) -> str:
    """``"V2"`` or ``"V1"``: the runner an engine of ``vllm_config`` runs (the engine's own
    decision, ``VllmConfig.use_v2_model_runner``)."""
    return "V2" if vllm_config.use_v2_model_runner else "V1"


def load_qualified(name: str) -> Any:
    """The object that ``name`` (``module:qualname``, as vLLM names processors) names."""
    module_name, separator, qualname = name.partition(":")
    if not separator or not module_name or not qualname:
        raise ValueError(f"a logits processor is named 'module:qualname', got {name!r}")
    try:
        obj: Any = importlib.import_module(module_name)
        for attribute in qualname.split("."):
            obj = getattr(obj, attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot load the logits processor {name!r}: {error}") from error
    return obj


def check_logits_processors(vllm_config: Any) -> None:
    """Raise ``ValueError``, naming the ways out, for a logits processor in the engine's
    options (``model_config.logits_processors``: names or classes) that its model runner
    does not load. Call it before the engine starts."""
    runner = model_runner(vllm_config)
    base = load_qualified(RUNNER_BASES[runner])
    for processor in vllm_config.model_config.logits_processors or ():
        cls = processor if isinstance(processor, type) else load_qualified(processor)
        if isinstance(cls, type) and issubclass(cls, base):
            continue
        other = "V1" if runner == "V2" else "V2"
        switch = "0" if runner == "V2" else "1"
        raise ValueError(
            f"The logits processor {processor!r} cannot run on this vLLM engine's "
            f"{RUNNER_NAMES[runner]}, which loads subclasses of {RUNNER_BASES[runner]} only. "
            "Build the LM with capture='processor' (the default: its processor serves both "
            "runners) or capture='logprobs' (vLLM's own logprobs=-1 rows, slower), without "
            "other processors in engine_opts['logits_processors'], or run vLLM's "
            f"{RUNNER_NAMES[other]}: set VLLM_USE_V2_MODEL_RUNNER={switch} in the environment "
            "before the engine starts."
        )
