"""Model Runner V2's request bookkeeping, replayed with a vLLM release's own code: the part
of scripts/vllm_gate_probe.py (the gate's running half) that drives our processor as the
CUDA build's engine does.

`COMPILED` names what runs from the release's source, each function compiled alone (no
vLLM import): ``RequestState``'s slot free list, ``GPUModelRunner.finish_requests`` /
``add_requests`` / ``_remove_request`` (a session's next chunk, or a preempted request
scheduled again, is removed and added anew), the ``Sampler``'s ``add_request`` /
``apply_staged_writes`` / ``apply_sampling_params`` with our processor after vLLM's own,
and ``sort_batch_req_ids`` (a step's row order). They are bound to objects that hold the
state they keep (`Bound`); what else they touch is absorbed (`Absorb`), and vLLM's own
processors, asked nothing by these requests, pass (`Idle`).

`Engine.step` runs them in the order the release's ``execute_model`` and
``gather_batch_req_state`` do (read in their source: `ORDER`), and samples a step before
the next is scheduled, as one GPU's executor does under async scheduling; the lag of async
scheduling shows where it can: a finished request reaches the worker one or two steps
after its output, a sample request may run a step past it (`Scheduler`). The client is
ours: `LogitsProcessorCapture`, its files reused batch after batch (`KEEP_FILES`) and
NaN-filled per batch, over a random workload (`Client`): sessions continued with a new
target per chunk, left paused or closed; one-shot rows; sample requests without a target;
prompts prefilled over two steps, some preempted in between; the start-up's sampler
warm-up first. Every row a batch reads must be its request's logits (`logits_of`);
`PLANTS` are bugs the replay must catch (``vllm_gate.py --plant``).
"""

from __future__ import annotations

import ast
import inspect
import random
import tempfile
import traceback
import types
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from vllm_gate_source import MissingDefinition, SamplingParams, compiled_function, definition

from genlm.backend.llm.vllm.capture import LogitsProcessorCapture

STATES = "vllm/v1/worker/gpu/states.py"
RUNNER = "vllm/v1/worker/gpu/model_runner.py"
SAMPLER = "vllm/v1/worker/gpu/sample/sampler.py"
# The release's functions the replay runs: (file, qualname).
COMPILED = (
    (STATES, "RequestState.add_request"),
    (STATES, "RequestState.remove_request"),
    (RUNNER, "GPUModelRunner._remove_request"),
    (RUNNER, "GPUModelRunner.finish_requests"),
    (RUNNER, "GPUModelRunner.add_requests"),
    (SAMPLER, "Sampler.add_request"),
    (SAMPLER, "Sampler.apply_staged_writes"),
    (SAMPLER, "Sampler.apply_sampling_params"),
    (RUNNER, "sort_batch_req_ids"),
)
# The order `Engine.step` follows, as the release's code has it: (file, function, what it
# calls, in that order).
ORDER = (
    (RUNNER, "GPUModelRunner.execute_model", ("self.finish_requests(", "self.add_requests(")),
    (
        RUNNER,
        "GPUModelRunner.gather_batch_req_state",
        ("sort_batch_req_ids(", "self.req_states.req_id_to_index"),
    ),
)
MAX_REQS = 24  # the engine's request slots (max_num_seqs)
WIDTH = 50  # a row's width for the client (the tokenizer's vocabulary)
LOGITS_WIDTH = 56  # the model's logits (a padded vocabulary: the processor cuts rows)
CLIENT_STEPS = 400
SESSION_BUDGET = MAX_REQS - 8  # paused sessions the client keeps (`Sessions._budget`'s role)


def logits_of(req_id: str, length: int) -> torch.Tensor:
    """The model's logits for ``req_id`` after ``length`` tokens: a function of the two
    alone, so that a row written in the wrong place cannot pass for the right one."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{req_id}/{length}".encode()))
    return torch.randn(LOGITS_WIDTH, generator=generator)


# The release's code, and what it runs on.


def compile_release(root: Path, given: Mapping[str, object]) -> dict[str, types.FunctionType]:
    """`COMPILED`, by qualname; `MissingDefinition` names every one the release lacks."""
    code, missing = {}, []
    for relative, qualname in COMPILED:
        try:
            code[qualname] = compiled_function(root, relative, qualname, given)
        except MissingDefinition as error:
            missing.append(str(error))
    if missing:
        raise MissingDefinition("; ".join(missing))
    return code


def order_failures(root: Path) -> list[str]:
    """The `ORDER` entries the release's source does not follow."""
    failures = []
    for relative, qualname, calls in ORDER:
        source = (root / relative).read_text() if (root / relative).is_file() else ""
        node = definition(ast.parse(source), qualname)
        text = "" if node is None else ast.get_source_segment(source, node) or ""
        positions = [text.find(call) for call in calls]
        if -1 in positions or positions != sorted(positions):
            failures.append(f"{relative}: {qualname} does not call {' then '.join(calls)}")
    return failures


class Absorb:
    """Engine state the replay does not model (token and block tables, LoRA, penalties,
    staged device writes): any attribute, item or call is taken and ignored."""

    def __getattr__(self, name: str) -> Absorb:
        return self

    def __getitem__(self, key: object) -> Absorb:
        return self

    def __setitem__(self, key: object, value: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> Absorb:
        return self


ABSORB = Absorb()


class Bound:
    """One of the engine's objects: the release's ``methods`` bound to it, ``state`` as
    given, any other attribute absorbed."""

    def __init__(self, methods: Mapping[str, types.FunctionType], **state: object):
        self.__dict__.update(state)
        for name, function in methods.items():
            setattr(self, name, types.MethodType(function, self))

    def __getattr__(self, name: str) -> Absorb:
        return ABSORB


class Idle:
    """vLLM's own logits processors and thinking budget: these requests ask nothing of them."""

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        return False

    def apply_staged_writes(self) -> None:
        pass

    def apply(self, logits: torch.Tensor, ctx: object) -> torch.Tensor:
        return logits


class SamplingStates:
    """Stands in for the sampler's temperature, top-k, top-p and min-p state, which acts
    after the logits processors: a request needs the logits pass for it when its
    temperature is neither 0 (greedy) nor 1 (as vLLM's says, these left at their defaults)."""

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        return sampling_params.temperature not in (0.0, 1.0)

    def apply_staged_writes(self) -> None:
        pass

    def apply_temperature(self, *args: object) -> None:
        pass

    def apply_min_p(self, *args: object) -> None:
        pass


@dataclass
class NewRequest:
    """The fields of the scheduler's ``NewRequestData`` that ``add_requests`` reads."""

    req_id: str
    sampling_params: SamplingParams
    prompt_len: int
    num_computed_tokens: int
    prefill_token_ids: list[int] = field(init=False)
    prompt_token_ids: list[int] = field(init=False)
    block_ids: tuple = ()
    lora_request: None = None
    mm_features: tuple = ()
    pooling_params: None = None

    def __post_init__(self) -> None:
        self.prefill_token_ids = self.prompt_token_ids = [0] * self.prompt_len


@dataclass
class SchedulerOutput:
    """The fields of the scheduler's ``SchedulerOutput`` that the replayed code reads."""

    scheduled_new_reqs: list[NewRequest]
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    num_scheduled_tokens: dict[str, int]


def call_by_name(function: Callable, known: Mapping[str, object]) -> object:
    """``function`` called with ``known``'s values for the parameters it has, by name (the
    release may add, drop or reorder them); a required one not in ``known`` is an error."""
    parameters = inspect.signature(function).parameters
    unknown = [
        name
        for name, parameter in parameters.items()
        if name not in known and parameter.default is inspect.Parameter.empty
    ]
    if unknown:
        raise RuntimeError(
            f"{function.__qualname__} now takes {unknown}: give scripts/vllm_gate_replay.py "
            "values for them"
        )
    return function(**{name: known[name] for name in parameters if name in known})


class Engine:
    """The worker's request state, model runner and sampler, the release's ``code``, with
    ``processor`` after vLLM's own logits processors."""

    def __init__(self, code: Mapping[str, types.FunctionType], processor: object):
        def methods(owner: str) -> dict[str, types.FunctionType]:
            prefix = owner + "."
            return {q.removeprefix(prefix): f for q, f in code.items() if q.startswith(prefix)}

        self.req_states = Bound(
            methods("RequestState"),
            req_id_to_index={},
            index_to_req_id={},
            free_indices=list(range(MAX_REQS)),
            num_speculative_steps=0,
        )
        self.sampler = Bound(
            methods("Sampler"),
            sampling_states=SamplingStates(),
            thinking_budget_state=Idle(),
            trace_replay_state=None,
            logits_processors=[Idle(), Idle(), Idle(), processor],
            needs_logits_processing=np.zeros(MAX_REQS, dtype=bool),
        )
        self.runner = Bound(
            methods("GPUModelRunner"),
            req_states=self.req_states,
            sampler=self.sampler,
            pooling_runner=None,
            pp_handler=None,
            encoder_cache=None,
            adaptive_verification=None,
            is_last_pp_rank=True,
        )
        self.sort_batch_req_ids = code["sort_batch_req_ids"]

    def warm_up(self) -> None:
        """The start-up's sampler passes (``_dummy_sampler_run``): one with no request, then
        one with warm-up parameters in every slot."""
        slots = np.arange(MAX_REQS, dtype=np.intp)
        logits = torch.randn(MAX_REQS, LOGITS_WIDTH)
        self.sample(slots, logits)
        for slot in range(MAX_REQS):
            self.sampler.add_request(slot, SamplingParams(temperature=0.9))
        self.sampler.apply_staged_writes()
        self.sample(slots, logits)

    def step(self, output: SchedulerOutput, lengths: Mapping[str, int]) -> None:
        """One engine step: ``execute_model``'s bookkeeping, then the step's batch sampled,
        row ``i`` the logits of the ``i``-th request in ``sort_batch_req_ids``' order after
        ``lengths[request]`` tokens."""
        self.runner.finish_requests(output)
        self.runner.add_requests(output)
        if not output.num_scheduled_tokens:
            return  # execute_model returns before the forward pass
        req_ids = call_by_name(
            self.sort_batch_req_ids,
            {
                "num_tokens_per_req": output.num_scheduled_tokens,
                "draft_tokens": {},
                "decode_query_len": 1,
            },
        )
        assert isinstance(req_ids, list)
        index = self.req_states.req_id_to_index
        slots = np.fromiter((index[r] for r in req_ids), dtype=np.intp, count=len(req_ids))
        self.sample(slots, torch.stack([logits_of(r, lengths[r]) for r in req_ids]))

    def sample(self, slots: np.ndarray, logits: torch.Tensor) -> None:
        """``Sampler.apply_sampling_params`` as ``Sampler.sample`` calls it (no speculative
        decoding: one row per request)."""
        mapping, rows = torch.from_numpy(slots), len(slots)
        call_by_name(
            self.sampler.apply_sampling_params,
            {
                "logits": logits,
                "expanded_idx_mapping": mapping,
                "idx_mapping": mapping,
                "idx_mapping_np": slots,
                "pos": torch.zeros(rows, dtype=torch.int64),
                "input_ids": torch.zeros(rows, dtype=torch.int64),
                "expanded_local_pos": torch.zeros(rows, dtype=torch.int32),
                "seq_lens_upper_bound_np": np.zeros(rows, dtype=np.int32),
                "skip_top_k_top_p": True,
            },
        )


# The engine core's side and the client's.


@dataclass
class Request:
    """A request as the scheduler sees it: ``chunks``, the tokens its prefill runs per
    step (two steps for a long prompt), then ``decodes`` more steps until its output (a
    sample request's other tokens), and ``overrun`` steps past it (async scheduling's
    step scheduled before the scheduler knows the request is done)."""

    req_id: str
    params: SamplingParams
    context: int  # tokens before its (first) sampled token
    computed: int  # of those, already in the KV cache when it is added
    chunks: list[int]
    arrives: int  # the engine step at which the scheduler first sees it
    decodes: int = 0
    overrun: int = 0
    preempt: bool = False  # preempted once, between its prefill chunks
    session: bool = False  # paused after its output, until its next chunk or its close
    done: bool = False  # its output reached the client


class Scheduler:
    """What the engine core tells the worker each step: the requests new to it (a first
    chunk, a session's next chunk, a preempted request again), those it preempts or
    finished, and how many tokens each scheduled request runs."""

    def __init__(self, engine: Engine, rng: random.Random):
        self.engine, self.rng = engine, rng
        self.steps = 0
        self.waiting: list[Request] = []
        self.running: dict[str, Request] = {}
        self.held: set[str] = set()  # requests holding a slot in the worker
        self.finishing: dict[str, int] = {}  # request -> step whose output frees it
        self.paused: set[str] = set()  # sessions waiting for their next chunk
        self.added = self.continued = self.preempted = 0

    def submit(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, req_id: str) -> None:
        """The request is over (its output sent, or its session closed): the worker hears
        of it one or two steps on."""
        self.paused.discard(req_id)
        self.finishing[req_id] = self.steps + self.rng.choice((1, 2))

    def step(self) -> None:
        self.steps += 1
        finished = {r for r, step in self.finishing.items() if step <= self.steps}
        for req_id in finished:
            del self.finishing[req_id]
            self.held.discard(req_id)
        preempted, new, tokens = set(), [], {}
        for request in list(self.running.values()):
            if request.preempt and 0 < request.computed < request.context:
                preempted.add(request.req_id)
                del self.running[request.req_id]
                self.held.discard(request.req_id)
                request.preempt, request.computed = False, 0
                request.chunks, request.arrives = [request.context], self.steps + 1
                self.waiting.insert(0, request)
                self.preempted += 1
            else:
                tokens[request.req_id] = request.chunks[0] if request.chunks else 1
        for request in list(self.waiting):
            again = request.req_id in self.held  # a paused session's next chunk
            if request.arrives > self.steps or (not again and len(self.held) >= MAX_REQS):
                continue
            self.waiting.remove(request)
            self.held.add(request.req_id)
            self.paused.discard(request.req_id)
            self.running[request.req_id] = request
            self.added += 1
            self.continued += again
            new.append(
                NewRequest(request.req_id, request.params, request.context, request.computed)
            )
            tokens[request.req_id] = request.chunks[0]
        lengths = {r: self.running[r].computed + n for r, n in tokens.items()}
        self.engine.step(SchedulerOutput(new, finished, preempted, tokens), lengths)
        for req_id, n in tokens.items():
            self._advance(self.running[req_id], n)

    def _advance(self, request: Request, tokens: int) -> None:
        request.computed += tokens
        if request.chunks:
            request.chunks.pop(0)
        elif request.decodes:
            request.decodes -= 1
        elif request.overrun:
            request.overrun -= 1
        if request.chunks or request.decodes:
            return
        request.done = True
        if request.overrun:
            return
        del self.running[request.req_id]
        if request.session:
            self.paused.add(request.req_id)
        else:
            self.finish(request.req_id)


@dataclass
class Tally:
    """The rows the client read, and how many of them were wrong or never written."""

    rows: int = 0
    wrong: int = 0
    missing: int = 0


class Client:
    """Our side: each step one capture batch of the rows its queries ask for, over paused
    sessions continued (a new target per chunk), new sessions and one-shot requests (some
    with long prompts), and sample requests; paused sessions past the budget are closed."""

    def __init__(self, scheduler: Scheduler, capture: LogitsProcessorCapture, rng: random.Random):
        self.scheduler, self.capture, self.rng = scheduler, capture, rng
        self.contexts: dict[str, int] = {}  # sessions -> their context length
        self.ids = 0

    def _new_id(self, kind: str) -> str:
        self.ids += 1
        return f"{kind}-{self.ids}"

    def _request(
        self, req_id: str, context: int, computed: int, chunks: list[int], session: bool = False
    ) -> Request:
        """A request that reaches the scheduler at its next step, or (a quarter of them)
        the one after."""
        arrives = self.scheduler.steps + 1 + (self.rng.random() < 0.25)
        return Request(
            req_id, SamplingParams(), context, computed, chunks, arrives, session=session
        )

    def step(self, tally: Tally) -> None:
        rng, scheduler = self.rng, self.scheduler
        paused = sorted(scheduler.paused)
        rng.shuffle(paused)
        continued = paused[: rng.randint(0, min(6, len(paused)))]
        for req_id in paused[len(continued) :]:
            if rng.random() < 0.15:
                del self.contexts[req_id]
                scheduler.finish(req_id)
        queries: list[Request] = []  # their targets once the batch has its file
        for req_id in continued:
            context = self.contexts[req_id] = self.contexts[req_id] + 1
            queries.append(self._request(req_id, context, context - 1, [1], session=True))
        for _ in range(rng.randint(0, 4)):
            context = rng.randint(2, 40)
            session = rng.random() < 0.5 and len(self.contexts) < SESSION_BUDGET
            req_id = self._new_id("session" if session else "once")
            if session:
                self.contexts[req_id] = context
            chunks = [16, context - 16] if context > 30 else [context]
            request = self._request(req_id, context, 0, chunks, session=session)
            request.preempt = len(chunks) > 1 and rng.random() < 0.4
            queries.append(request)
        with self.capture.batch(len(queries), WIDTH) as batch:
            for row, request in enumerate(queries):
                request.params = SamplingParams(**batch.sampling_kwargs(row))
            requests = list(queries)
            if rng.random() < 0.5:
                max_tokens = rng.randint(1, 3)
                draw = self._request(self._new_id("sample"), 5, 0, [5])
                draw.params = SamplingParams(temperature=rng.choice((0.0, 0.7, 1.0)))
                draw.decodes = max_tokens - 1
                draw.overrun = int(max_tokens > 1 and rng.random() < 0.5)
                requests.append(draw)
            for request in requests:
                scheduler.submit(request)
            for _ in range(50):
                if all(request.done for request in requests):
                    break
                scheduler.step()
            else:
                raise RuntimeError("the replay's scheduler stopped making progress")
            for row, request in enumerate(queries):
                written = batch.rows[row]
                tally.rows += 1
                if torch.isnan(written).any():
                    tally.missing += 1
                elif not torch.equal(written, logits_of(request.req_id, request.context)[:WIDTH]):
                    tally.wrong += 1


# Bugs the replay must catch, planted in the processor class from here (the gate's side).


def rows_as_slots(cls: type) -> type:
    class RowsAsSlots(cls):
        """Takes row ``i`` for slot ``i`` (the V1 runner's layout): ignores ``ctx``."""

        def apply(self, logits, ctx=None):
            return super().apply(logits, None)

    return RowsAsSlots


def first_target_kept(cls: type) -> type:
    class FirstTargetKept(cls):
        """Keeps a slot's earlier target when a request, or a session's next chunk, is
        added to it again."""

        def add_request(self, req_idx, sampling_params):
            return req_idx in self.targets or super().add_request(req_idx, sampling_params)

    return FirstTargetKept


PLANTS: dict[str, Callable[[type], type]] = {
    "rows-as-slots": rows_as_slots,
    "first-target-kept": first_target_kept,
}


def replay(
    root: Path,
    version: str,
    context_class: type,
    processor_class: type,
    plant: str | None,
    report: Callable[[bool, str], None],
) -> None:
    """Compile `COMPILED` from the release under ``root`` (with its ``LogitsContext``),
    check `ORDER`, and run `CLIENT_STEPS` client steps on ``processor_class`` (with the
    bug ``plant`` planted); ``report`` each finding."""
    where = f"vllm {version}'s source at {root}"
    try:
        code = compile_release(root, {"LogitsContext": context_class})
    except MissingDefinition as error:
        report(False, f"V2 replay: {where} lacks what it runs: {error}")
        return
    report(
        True,
        f"V2 replay compiles from {where}: "
        + ", ".join(f"{qualname} ({Path(relative).name})" for relative, qualname in COMPILED),
    )
    failures = order_failures(root)
    report(
        not failures,
        "V2 replay's engine order is the release's: "
        + "; ".join(f"{q} calls {' then '.join(calls)}" for _, q, calls in ORDER)
        + (f": {failures}" if failures else ""),
    )
    cls = processor_class if plant is None else PLANTS[plant](processor_class)
    engine = Engine(code, cls(None, None))
    rng, tally = random.Random(0), Tally()
    scheduler = Scheduler(engine, rng)
    try:
        engine.warm_up()
        with tempfile.TemporaryDirectory(prefix="vllm-gate-replay-") as directory:
            capture = LogitsProcessorCapture(directory)
            client = Client(scheduler, capture, rng)
            for _ in range(CLIENT_STEPS):
                client.step(tally)
            capture.close()
    except Exception as error:  # noqa: BLE001 (reported: the gate's finding)
        frame = traceback.extract_tb(error.__traceback__)[-1]
        report(
            False,
            f"V2 replay stopped at engine step {scheduler.steps} ({frame.filename}:"
            f"{frame.lineno}): {type(error).__name__}: {error}",
        )
        return
    report(
        tally.rows > 0 and not tally.wrong and not tally.missing,
        f"V2 replay{f' (planted: {plant})' if plant else ''}: {CLIENT_STEPS} client steps, "
        f"{scheduler.steps} engine steps; {scheduler.added} requests added into "
        f"{MAX_REQS} slots ({scheduler.continued} continued sessions and "
        f"{scheduler.preempted} preempted requests added again); {tally.rows} rows read, "
        f"{tally.wrong} wrong, {tally.missing} missing",
    )
