"""The running half of scripts/vllm_gate.py, in a fresh interpreter: ``vllm_gate_probe.py
ROOT --version VERSION [--plant BUG]`` for the vllm source under ROOT.

Loads the release's two logits-processor base classes from their modules' source (they need
none of vLLM's compiled parts: ``torch`` and a stand-in ``vllm.SamplingParams``), puts them
where the processor imports them from, and then:

- runs each model runner's loader function, compiled from the release's source (its other
  globals are the standard library's, or stand-ins for vLLM's logger and CUDA guard), on
  `CAPTURE_PROCESSOR` and the processor's older names: one class, accepted by both;
- checks that the class is not abstract and that each of its methods takes the arguments
  its base classes' methods declare;
- drives it once through each runner's hooks with the release's ``BatchUpdate`` and
  ``LogitsContext``, and reads the row back from a capture file;
- replays Model Runner V2's request bookkeeping with the release's own code, our processor
  in its sampler and our capture as the client (scripts/vllm_gate_replay.py); ``--plant``
  plants one of its `PLANTS` in the processor there, which the replay must catch.

Pieces of the release run without vLLM as scripts/vllm_gate_source.py has them. Prints
``ok``/``FAIL`` lines; exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import logging
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
from vllm_gate_replay import PLANTS, replay
from vllm_gate_source import SamplingParams, compiled_function, load_source, stand_in_module


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the directory holding the release's vllm/")
    parser.add_argument("--version", required=True, help="the release's version, for the report")
    parser.add_argument("--plant", choices=sorted(PLANTS), help="a bug the replay must catch")
    return parser.parse_args()


ARGS = _arguments()
ROOT: Path = ARGS.root
V1_INTERFACE = "vllm/v1/sample/logits_processor/interface.py"
V2_INTERFACE = "vllm/v1/worker/gpu/sample/logits_processor/interface.py"
V1_LOADER = ("vllm/v1/sample/logits_processor/__init__.py", "_load_logitsprocs_by_fqcns")
V2_LOADER = (
    "vllm/v1/worker/gpu/sample/logits_processor/loader.py",
    "_load_v2_logitsprocs_by_fqcns",
)
# Stand-ins for the vLLM names the loaders use besides the base class.
STAND_INS = {"guard_cuda_initialization": contextlib.nullcontext}
failures: list[str] = []


def report(ok: bool, line: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {line}", flush=True)
    if not ok:
        failures.append(line)


def install_base_classes() -> tuple[types.ModuleType, types.ModuleType]:
    for name in ("vllm", "vllm.v1", "vllm.v1.sample", "vllm.v1.worker", "vllm.v1.worker.gpu"):
        stand_in_module(name)
    sys.modules["vllm"].SamplingParams = SamplingParams  # type: ignore[attr-defined]
    stand_in_module("vllm.v1.worker.gpu.sample")
    stand_in_module("vllm.utils", __path__=[])
    stand_in_module("vllm.utils.torch_utils", **STAND_INS)
    v1 = load_source("vllm.v1.sample.logits_processor.interface", ROOT / V1_INTERFACE)
    v2 = load_source("vllm.v1.worker.gpu.sample.logits_processor.interface", ROOT / V2_INTERFACE)
    # The packages the processor imports the base classes from (their real __init__ files
    # re-export these names: checked statically).
    stand_in_module("vllm.v1.sample.logits_processor", **vars(v1))
    stand_in_module("vllm.v1.worker.gpu.sample.logits_processor", **vars(v2))
    return v1, v2


def loader_function(relative: str, name: str, base: type):
    """The release's loader ``name`` from ``relative``, compiled alone: its other vLLM
    names are the base class, a logger and `STAND_INS`."""
    given = {"LogitsProcessor": base, "logger": logging.getLogger("vllm-gate"), **STAND_INS}
    return compiled_function(ROOT, relative, name, given)


def check_loaders(v1: types.ModuleType, v2: types.ModuleType) -> type | None:
    from genlm.backend.llm.vllm.processor import CAPTURE_PROCESSOR

    names = [
        CAPTURE_PROCESSOR,
        "genlm.backend.llm.vllm.capture:FullLogitsCapture",
        "genlm.backend.llm.vllm_capture:FullLogitsCapture",
    ]
    loaded = {}
    for label, (relative, name), base in (
        ("V1", V1_LOADER, v1.LogitsProcessor),
        ("V2", V2_LOADER, v2.LogitsProcessor),
    ):
        where = f"{label} loader ({relative}: {name})"
        try:
            classes = loader_function(relative, name, base)(names)
        except Exception as error:  # noqa: BLE001 (reported: the gate's finding)
            report(False, f"{where} refuses the capture: {type(error).__name__}: {error}")
            continue
        one = len(set(classes)) == 1 and issubclass(classes[0], base)
        report(one, f"{where} loads {', '.join(names)} as one subclass of its base class")
        loaded[label] = classes[0]
    if len(loaded) == 2 and loaded["V1"] is loaded["V2"]:
        return loaded["V1"]
    report(False, "both loaders load the same class")
    return None


def check_methods(cls: type, v1: types.ModuleType, v2: types.ModuleType) -> None:
    report(not inspect.isabstract(cls), f"{cls.__name__} is not abstract under either base")
    for label, base in (("V1", v1.LogitsProcessor), ("V2", v2.LogitsProcessor)):
        declared = [
            name
            for name, value in vars(base).items()
            if callable(getattr(base, name))
            and (not name.startswith("_") or name == "__init__")
            and not isinstance(value, type)
        ]
        wrong = []
        for name in declared:
            parameters = list(inspect.signature(getattr(base, name)).parameters.values())
            arguments = [None] * sum(
                p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters
            )
            try:
                inspect.signature(getattr(cls, name)).bind(*arguments)
            except TypeError as error:
                wrong.append(f"{name}: {error}")
        report(
            not wrong,
            f"{cls.__name__}'s methods take the arguments {label}'s base class declares "
            f"({', '.join(declared)})" + (f": {wrong}" if wrong else ""),
        )


def check_hooks(cls: type, v1: types.ModuleType, v2: types.ModuleType) -> None:
    from genlm.backend.llm.vllm.processor import CAPTURE_KEY

    width = 6
    with tempfile.TemporaryDirectory() as directory:
        path = str(Path(directory) / "rows.f32")
        logits = torch.randn(2, width)

        def rows():
            return np.fromfile(path, dtype=np.float32).reshape(2, width)

        params = SamplingParams({CAPTURE_KEY: (path, 1, width)})
        np.full((2, width), np.nan, dtype=np.float32).tofile(path)
        processor = cls(None, torch.device("cpu"), False)
        added = [(0, params, None, [])]
        processor.update_state(v1.BatchUpdate(batch_size=1, removed=[], added=added, moved=[]))
        processor.apply(logits[:1])
        written = np.array_equal(rows()[1], logits[0].numpy()) and np.isnan(rows()[0]).all()
        report(
            written and processor.is_argmax_invariant() is False,
            "V1 hooks (update_state with the release's BatchUpdate, apply(logits)) write "
            "the request's row, greedy requests included",
        )

        np.full((2, width), np.nan, dtype=np.float32).tofile(path)
        processor = cls(None, None)
        takes = processor.add_request(3, params) is True
        declines = processor.add_request(5, SamplingParams()) is False
        processor.apply_staged_writes()
        fields = {field.name: None for field in dataclasses.fields(v2.LogitsContext)}
        slots = np.array([5, 3], dtype=np.int32)
        fields.update(
            idx_mapping_np=slots,
            idx_mapping=torch.from_numpy(slots),
            expanded_idx_mapping=torch.from_numpy(slots),
            expanded_local_pos=torch.zeros(2, dtype=torch.int32),
        )
        processor.apply(logits, v2.LogitsContext(**fields))
        written = np.array_equal(rows()[1], logits[1].numpy()) and np.isnan(rows()[0]).all()
        report(
            takes and declines and written,
            "V2 hooks (add_request per slot, apply_staged_writes, apply(logits, ctx) with the "
            "release's LogitsContext) write slot 3's row from batch row 1 and nothing for "
            "a request without a target",
        )


def main() -> int:
    try:
        v1, v2 = install_base_classes()
        cls = check_loaders(v1, v2)
        if cls is not None:
            check_methods(cls, v1, v2)
            check_hooks(cls, v1, v2)
            replay(ROOT, ARGS.version, v2.LogitsContext, cls, ARGS.plant, report)
    except Exception as error:  # noqa: BLE001 (reported: the gate's finding)
        report(False, f"the probe failed: {type(error).__name__}: {error}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
