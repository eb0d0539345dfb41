"""`AsyncVirtualLM`: a vLLM engine behind the `AsyncLM` interface (see the package doc).

Requests (next-token log-probabilities and samples alike) go through the shared
`AutoBatcher`: each batch is one step of the engine's `Sessions`, run on the engine's loop
while the batcher's worker thread waits for it. vllm itself is imported only when an
engine is built.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import logging
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from genlm.backend.batching import AutoBatcher
from genlm.backend.llm.base import owned_rows
from genlm.backend.llm.engine import EngineLM
from genlm.backend.llm.handle import PrefixHandle
from genlm.backend.llm.options import Option, takes_options
from genlm.backend.llm.protocols import LogprobsCapture, VLLMEngine
from genlm.backend.llm.request import Query
from genlm.backend.llm.vllm import api
from genlm.backend.llm.vllm.capture import (
    EngineLogprobsCapture,
    LogitsProcessorCapture,
    MissingRowsError,
    make_capture,
)
from genlm.backend.llm.vllm.defaults import from_name_options
from genlm.backend.llm.vllm.loop import engine_handle, start_engine
from genlm.backend.llm.vllm.runners import check_logits_processors
from genlm.backend.llm.vllm.sessions import STALL_TIMEOUT, StepRequest

logger = logging.getLogger(__name__)

# The highest sampling temperature vLLM's ``SamplingParams`` accepts.
MAX_TEMPERATURE = 2.0


def hash_to_int(value: str) -> int:
    """A deterministic integer in ``[1, 2**31 - 1]`` for ``value`` (vLLM's LoRA ids)."""
    digest = hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1) + 1


def check_stall_timeout(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite number of seconds > 0."""
    if isinstance(value, bool) or not (isinstance(value, int | float) and 0 < value < math.inf):
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")


@dataclass(frozen=True)
class _SampleRequest:
    """One `sample` call: vLLM draws the tokens, in the same engine step as the queries."""

    prompt: tuple[int, ...]
    max_tokens: int
    eos_token_ids: tuple[int, ...]
    temperature: float
    seed: int | None
    nonce: int | None  # makes unseeded requests distinct, so they are never merged
    lora: str | None = None

    def sampling_params(self, vllm: Any) -> Any:
        """vLLM's ``SamplingParams`` for these draws (``vllm``: `api.vllm_api`)."""
        return vllm.SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=self.seed,
            stop_token_ids=list(self.eos_token_ids),
            ignore_eos=True,
            detokenize=False,
        )

    def tokens(self, output: Any) -> list[int]:
        """The tokens vLLM drew, up to the first end-of-sequence token (not included)."""
        tokens = list(output.outputs[0].token_ids)
        stops = [i for i, token in enumerate(tokens) if token in self.eos_token_ids]
        return tokens[: stops[0]] if stops else tokens


# A batch's keys, all served by one engine step, and what each gets: a query its row of
# next-token log-probabilities, a sample request its tokens.
_StepKey = Query | _SampleRequest
_StepAnswer = torch.Tensor | list[int]


class AsyncVirtualLM(EngineLM):
    """A vLLM engine behind the `AsyncLM` interface, with particles living in the engine.

    Args:
        llm_engine: a ``vllm.AsyncLLM`` (anything with its async ``generate``,
            ``get_tokenizer`` and ``shutdown``); `from_name` builds one.
        logprobs_capture: how full-vocabulary logprobs come back: a
            `LogitsProcessorCapture` (the engine must list `CAPTURE_PROCESSOR` in its
            ``logits_processors``) or an `EngineLogprobsCapture` (``max_logprobs=-1``).

    The other arguments are the options of `EngineLM` (``cache_size``, ``cache_opts``),
    `BatchedAsyncLM` (``batch_size``, ``timeout``: the batches are shared by logprobs and
    sampling requests) and ``stall_timeout`` below, each an attribute of the LM too.

    Raises ``ValueError`` for an engine built inside a running event loop by the caller
    (`genlm.backend.llm.vllm.loop.engine_handle`); `from_name` has no such limit.
    """

    # Wider than the base class's (queries alone): samples share the queries' steps.
    batcher: AutoBatcher[_StepKey, _StepAnswer]  # type: ignore[assignment]

    stall_timeout: Option[float] = Option(STALL_TIMEOUT, check_stall_timeout)
    """Longest time (seconds) a step may go without any output from the engine; then it
    fails its callers with `StepStalledError` instead of waiting forever. Assignable: the
    next steps wait at most the new time."""

    @takes_options
    def __init__(
        self,
        llm_engine: VLLMEngine,
        logprobs_capture: LogprobsCapture,
        cache_size: int = EngineLM.cache_size.default,
        cache_opts: dict[str, Any] | None = EngineLM.cache_opts.default,
        batch_size: int = EngineLM.batch_size.default,
        timeout: float | None = EngineLM.timeout.default,
        stall_timeout: float = stall_timeout.default,
    ):
        self.llm_engine: Any = llm_engine  # None once closed
        self.logprobs_capture = logprobs_capture
        self._max_model_len = engine_max_model_len(llm_engine)
        self._handle = engine_handle(llm_engine)
        super().__init__(
            llm_engine.get_tokenizer(), cache_size, cache_opts, batch_size, timeout, "genlm-vllm"
        )
        self._nonces = itertools.count()
        _OPEN_LMS.add(self)
        atexit.unregister(_close_open_lms)  # registered anew: runs before vLLM's exit hooks
        atexit.register(_close_open_lms)
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
                that fits it (`genlm.backend.llm.vllm.defaults`), unless given here.
            capture: ``"processor"`` (logits processor, fast), ``"logprobs"`` (vLLM's
                ``logprobs=-1``), or a capture object, e.g.
                ``LogitsProcessorCapture(directory=...)`` for a directory that the
                machines of the sampling workers share. A probe request checks that the
                logits processor's rows reach this process (`_check_capture`). Every
                logits processor the engine options name (the capture's, engine_opts')
                is checked against the engine's model runner before the engine starts
                (`check_logits_processors`): the default's serves both.
                A `LogitsProcessorCapture`'s directory must hold the file of a full batch
                (``batch_size`` rows of the model's vocabulary), checked before the engine
                starts (`LogitsProcessorCapture.check_room`): else the default directory
                gives way to the temp dir, or `CaptureSpaceError` names the fixes.
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
        vllm = api.import_vllm()
        opts = from_name_options(model_name, engine_opts, logprobs_capture)
        args = vllm.AsyncEngineArgs(model=model_name, **opts)
        vllm_config = api.engine_config(args)
        check_logits_processors(vllm_config)
        width = model_vocab_size(vllm_config)
        if isinstance(logprobs_capture, LogitsProcessorCapture) and width is not None:
            logprobs_capture.check_room(
                kwargs.get("batch_size", EngineLM.batch_size.default), width
            )
        engine = start_engine(
            lambda: vllm.AsyncLLMEngine.from_vllm_config(
                vllm_config,
                enable_log_requests=args.enable_log_requests,
                disable_log_stats=args.disable_log_stats,
            )
        )
        try:
            lm = cls(engine, logprobs_capture, **kwargs)
        except BaseException:
            engine_handle(engine).stop()
            raise
        try:
            lm._check_capture()
        except BaseException:
            lm.close()
            raise
        return lm

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
            self.batcher.run_sync(self._compute_batch, [probe])
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

    def _owned(self, rows: list[Any]) -> list[Any]:
        """A step's answers as `_compute_batch` made them: its query rows are already the
        callers' own there (the answers mix them with sampled tokens)."""
        return rows

    def _compute_batch(self, keys: list[_StepKey]) -> list[_StepAnswer]:  # type: ignore[override]
        """One engine step for a batch of queries and sample requests (see `_StepKey`)."""
        self._check_open()
        vllm = api.vllm_api()
        queries = [key for key in keys if isinstance(key, Query)]
        samples = [key for key in keys if isinstance(key, _SampleRequest)]
        with self.logprobs_capture.batch(len(queries), self.vocab_size) as batch:
            params = [
                vllm.SamplingParams(
                    max_tokens=1,
                    temperature=0.0,
                    detokenize=False,
                    output_kind=vllm.DELTA,
                    **batch.sampling_kwargs(i),
                )
                for i in range(len(queries))
            ]
            requests = [
                self._request(step_context(q.token_ids), q.lora, p)
                for q, p in zip(queries, params, strict=True)
            ]
            draws = [self._request(r.prompt, r.lora, r.sampling_params(vllm)) for r in samples]
            # A step with adapter rows runs without sessions (Sessions.step).
            outputs = self._handle.loop.run(
                self._handle.sessions.step(requests, draws, self.stall_timeout)
            )
            # Rows of their own: the batch's log_softmax is freed once the step ends.
            logprobs = owned_rows(
                torch.log_softmax(batch.read(outputs[: len(queries)]), dim=-1).unbind()
            )
        answers: dict[_StepKey, _StepAnswer] = dict(zip(queries, logprobs, strict=True))
        for request, output in zip(samples, outputs[len(queries) :], strict=True):
            answers[request] = request.tokens(output)
        return [answers[key] for key in keys]

    def _request(
        self, token_ids: tuple[int, ...] | PrefixHandle, lora: str | None, params: Any
    ) -> StepRequest:
        """A request of a step, with vLLM's ``LoRARequest`` for its adapter. LMs with other
        captures on this engine never continue its sessions (its ``kind``)."""
        lora_request = (
            None
            if lora is None
            else api.vllm_api().LoRARequest(lora, hash_to_int(lora), self._adapter_dirs[lora])
        )
        return StepRequest(token_ids, lora, lora_request, params, type(self.logprobs_capture))

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
            prompt=as_tuple(query.token_ids),
            max_tokens=int(max_tokens),
            eos_token_ids=tuple(sorted(eos)),
            temperature=float(temperature),
            seed=None if seed is None else int(seed),
            nonce=next(self._nonces) if seed is None else None,
            lora=query.lora,
        )
        tokens = await self.batcher.submit(request)
        assert isinstance(tokens, list)  # a sample request's answer
        return tokens

    def _load_lora(self, lora_path: str, lora_name: str) -> None:
        """Adapters load lazily, on the first request naming them (``enable_lora=True``), so
        the adapter is checked here first (files readable, shapes fit the base model: a
        bad one is refused before it is registered); re-registering a name makes the
        engine drop the weights it holds for it."""
        directory = self._check_adapter(lora_path)
        if lora_name in self.lora_paths:
            self.batcher.run_sync(self._unload_engine_lora, lora_name)
        self._clear_lora_results(lora_name)
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
        self.batcher.run_sync(self._unload_engine_lora, lora_name)
        self._clear_lora_results(lora_name)

    def _unload_engine_lora(self, lora_name: str) -> None:
        """Close the adapter's sessions, unload its weights, and drop vLLM's prefix cache
        (its blocks are keyed by the adapter's id, which a re-registration keeps)."""
        self._handle.loop.run(self._unload_engine_lora_async(lora_name))

    async def _unload_engine_lora_async(self, lora_name: str) -> None:
        await self._handle.sessions.close()
        remove_lora = getattr(self.llm_engine, "remove_lora", None)
        if remove_lora is not None:
            await remove_lora(hash_to_int(lora_name))
        reset_prefix_cache = getattr(self.llm_engine, "reset_prefix_cache", None)
        if reset_prefix_cache is not None:
            await reset_prefix_cache()

    def _close(self) -> None:
        # A step in flight ends now (its callers get EngineLoopClosedError) instead of
        # holding the batcher's worker, which `close` waits for, until the engine answers.
        self._handle.loop.cancel_running()
        super()._close()
        self.logprobs_capture.close()

    def _stop_engine(self) -> None:
        self.llm_engine = None
        self._handle.stop()


def as_tuple(ids: Sequence[int]) -> tuple[int, ...]:
    """A query's ids as a tuple: validated ids as they are (a `TokenIds`, its hash kept),
    a handle's read once."""
    return ids if isinstance(ids, tuple) else tuple(ids)


def step_context(ids: Sequence[int]) -> tuple[int, ...] | PrefixHandle:
    """A query's context for `Sessions`: a handle as it is (its session is found from it),
    other ids as a tuple."""
    return ids if isinstance(ids, PrefixHandle) else as_tuple(ids)


def engine_max_model_len(engine: Any) -> int | None:
    """The engine's ``max_model_len`` (prompt and drawn tokens), None where it has no config."""
    model_config = getattr(getattr(engine, "vllm_config", None), "model_config", None)
    length = getattr(model_config, "max_model_len", None)
    return length if isinstance(length, int) else None


def model_vocab_size(vllm_config: Any) -> int | None:
    """The width of the model's logits (``ModelConfig.get_vocab_size``), None where the
    config publishes none."""
    get_vocab_size = getattr(getattr(vllm_config, "model_config", None), "get_vocab_size", None)
    size = get_vocab_size() if callable(get_vocab_size) else None
    return size if isinstance(size, int) and size > 0 else None


_OPEN_LMS: weakref.WeakSet[AsyncVirtualLM] = weakref.WeakSet()


def _close_open_lms() -> None:
    """Close the LMs still open when the interpreter exits, while their engines and loops
    still run: left to vLLM's own exit hooks, the engine dies under its output handler
    (an ``EngineDeadError`` traceback, a leaked-shared-memory warning)."""
    for lm in list(_OPEN_LMS):
        lm.close()
