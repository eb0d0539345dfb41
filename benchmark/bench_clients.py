"""The client libraries' own README workloads on this package, against bare forwards.

Four workloads, each run on the default model (SmolLM2-135M-Instruct, float32, CPU, one
torch thread) with the HF backend, once per seed, on a cold prefix cache:

- ``regex``: genlm-control's README regex example: AWRS over a ``BoolFSA``, 10 particles,
  up to 30 tokens, resampling at ESS 0.5.
- ``json``: its JSON-schema example: AWRS over ``JsonSchema``, a chat-template prompt, EOS
  ``<|im_end|>``, temperature 0.8, 10 particles, up to 40 tokens.
- ``beam``: genlm-bytes' README beam: ``ByteBeamState`` with K = 5, prefill
  ``b"An apple a day keeps the "``, then 40 greedy bytes.
- ``sis``: genlm-control SMC with direct token sampling and no resampling, 32 particles,
  up to 24 tokens.

For each run the script measures

- ``wall``: the workload's wall time;
- ``backend``: the wall time during which at least one client call awaits the LM
  (``next_token_logprobs`` / ``batch_next_token_logprobs``): what the client waits for;
- ``forward``: the time inside the model's forward calls during the run (its transformer
  body and LM head, which the library may apply itself; the library's KV reads and writes
  happen inside them);
- ``bare``: the same forwards (same rows, new tokens and context lengths) on the bare
  model with no library, each replayed right after the library's (so both see the same
  load on the machine; the replay is left out of ``backend``): a transformers
  ``DynamicCache`` holding each row's context (filled outside the timing, as a
  hand-written loop keeps it between steps), then the forward and ``log_softmax``, timed.

``share``: what the library adds to the bare forwards while the clients wait (goal: at
most 10% in every workload), as (1 + outside)(1 + in_forward) - 1, where ``outside`` =
backend / forward - 1 (the library's own work between forwards) and ``in_forward`` = the
forwards' CPU time over the bare forwards' CPU time - 1 (the library's paged KV inside
them). CPU time keeps other load on the machine out of the comparison; ``wall_share`` =
backend / bare - 1 in wall time is printed beside it.

    python benchmark/bench_clients.py                      # every workload, seeds 0 1 2
    python benchmark/bench_clients.py --workloads beam --seeds 0

Results: a table, and benchmark/results/clients.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "clients.json"

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["Alice", "Bob", "Charlie"]},
        "age": {"type": "integer", "minimum": 20, "maximum": 80},
    },
}
BOOK_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1},
        "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
        "genre": {"type": "string", "enum": ["fiction", "non-fiction", "mystery"]},
    },
}
SYSTEM = (
    "You need to generate a JSON object that matches the schema below. Only generate the "
    "JSON object on a single line with no other text."
)


@dataclass
class Forward:
    """One model forward: rows, new tokens per row, context length before them."""

    rows: int
    new_tokens: int
    past: int


@dataclass
class Probe:
    """Wraps one LM for a run: the wall time during which a caller awaits it, and each
    model forward, timed, then replayed at once on the bare model (`bare_forward`), so
    that both see the same load on the machine. The replay's time (with filling its
    cache) is taken out of the backend's."""

    cache_keyword: str
    backend: float = 0.0
    forward: float = 0.0
    forward_cpu: float = 0.0
    bare: float = 0.0
    bare_cpu: float = 0.0
    forwards: list[Forward] = field(default_factory=list)
    _replaying: float = 0.0
    _pending: int = 0
    _since: float = 0.0

    def attach(self, lm: Any) -> None:
        for name in ("next_token_logprobs", "batch_next_token_logprobs"):
            setattr(lm, name, self._awaited(getattr(lm, name)))
        model_forward = lm.model.forward
        body = lm.model.base_model  # run by the model's forward or before the library's head
        body_forward = body.forward
        generator = torch.Generator().manual_seed(0)
        replaying = False

        def forward(*args: Any, **kwargs: Any) -> Any:
            nonlocal replaying
            if replaying:  # the bare model's own forward runs its body: not the library's
                return body_forward(*args, **kwargs)
            started, started_cpu = time.perf_counter(), time.thread_time()
            output = body_forward(*args, **kwargs)
            finished = time.perf_counter()
            self.forward += finished - started
            self.forward_cpu += time.thread_time() - started_cpu
            input_ids, positions = kwargs["input_ids"], kwargs.get("position_ids")
            past = 0 if positions is None else int(positions[:, 0].max())
            step = Forward(*input_ids.shape, past)
            self.forwards.append(step)
            replaying = True
            try:
                wall, cpu = bare_forward(
                    lm.model, model_forward, step, self.cache_keyword, generator
                )
            finally:
                replaying = False
            self.bare += wall
            self.bare_cpu += cpu
            self._replaying += time.perf_counter() - finished
            return output

        body.forward = forward
        head = lm.runner.forward.head
        if head is not None:  # the library's LM head is part of its forward
            logits = head.logits

            def head_logits(hidden: Any, *args: Any) -> Any:
                started, started_cpu = time.perf_counter(), time.thread_time()
                try:
                    return logits(hidden, *args)
                finally:
                    self.forward += time.perf_counter() - started
                    self.forward_cpu += time.thread_time() - started_cpu

            head.logits = head_logits

    @staticmethod
    def detach(lm: Any) -> None:
        for name in ("next_token_logprobs", "batch_next_token_logprobs"):
            delattr(lm, name)
        del lm.model.base_model.forward
        if lm.runner.forward.head is not None:
            del lm.runner.forward.head.logits

    def _awaited(self, method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def call(*args: Any, **kwargs: Any) -> Any:
            if self._pending == 0:
                self._since = time.perf_counter()
                self._replaying = 0.0
            self._pending += 1
            try:
                return await method(*args, **kwargs)
            finally:
                self._pending -= 1
                if self._pending == 0:
                    self.backend += time.perf_counter() - self._since - self._replaying

        return call


def bare_forward(
    model: Any,
    model_forward: Callable[..., Any],
    step: Forward,
    cache_keyword: str,
    generator: torch.Generator,
) -> tuple[float, float]:
    """Wall and CPU seconds ``step`` takes on the bare model (forward + ``log_softmax``), each
    row's context in a ``DynamicCache`` filled outside the timing (random keys and values)."""
    from transformers import DynamicCache

    config = model.config
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    cache = DynamicCache(config=config)
    if step.past:
        shape = (step.rows, heads, step.past, head_dim)
        for layer in range(config.num_hidden_layers):
            keys = torch.randn(shape, generator=generator, dtype=dtype)
            values = torch.randn(shape, generator=generator, dtype=dtype)
            cache.update(keys, values, layer)
    ids = torch.randint(config.vocab_size, (step.rows, step.new_tokens), generator=generator)
    mask = torch.ones(step.rows, step.past + step.new_tokens, dtype=torch.long)
    started, started_cpu = time.perf_counter(), time.thread_time()
    logits = model_forward(
        input_ids=ids,
        attention_mask=mask,
        use_cache=True,
        logits_to_keep=1,
        **{cache_keyword: cache},
    ).logits
    torch.log_softmax(logits[:, -1].float(), dim=-1)
    return time.perf_counter() - started, time.thread_time() - started_cpu


# -- the workloads: each takes the LM and returns a short description of what it produced --


async def run_regex(lm: Any) -> str:
    from genlm.control import BoolFSA, PromptedLLM

    llm = PromptedLLM(lm)
    llm.set_prompt_from_str("Here is my honest opinion:")
    fsa = BoolFSA.from_regex(r" SMC is (🔥🔥|😍😍|🤌🤌) with LMs")
    return await _awrs_smc(llm, fsa, max_tokens=30)


async def run_json(lm: Any) -> str:
    from genlm.control import JsonSchema, PromptedLLM

    llm = PromptedLLM(lm, eos_byte_strings=[b"<|im_end|>"], temperature=0.8)
    llm.prompt_ids = list(
        lm.tokenizer.apply_chat_template(
            conversation=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": json.dumps(PERSON_SCHEMA)},
                {"role": "assistant", "content": '{"name": "Alice", "age": 30}'},
                {"role": "user", "content": json.dumps(BOOK_SCHEMA)},
            ],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
    )
    return await _awrs_smc(llm, JsonSchema(BOOK_SCHEMA), max_tokens=40)


async def run_beam(lm: Any) -> str:
    from genlm.bytes import BeamParams, ByteBeamState

    beam = await ByteBeamState.initial(lm, BeamParams(K=5, prune_threshold=0.05))
    text = b"An apple a day keeps the "
    try:
        beam = await beam.prefill(text)
        for _ in range(40):
            best = int(np.argmax((await beam.logp_next()).ps))
            if best > 255:  # genlm-bytes' end-of-sequence markers
                break
            text += bytes([best])
            beam = await (beam.prune() << best)
    finally:
        await beam.cleanup()
    return repr(text.decode("utf-8", "replace"))


async def run_sis(lm: Any) -> str:
    from genlm.control import SMC, PromptedLLM, direct_token_sampler

    llm = PromptedLLM(lm)
    llm.set_prompt_from_str("Montreal is")
    smc = SMC(direct_token_sampler(llm))
    try:
        sequences = await smc(n_particles=32, ess_threshold=0.0, max_tokens=24)
    finally:
        await smc.cleanup()
    return f"{len(sequences.contexts)} particles, {sum(map(len, sequences.contexts))} tokens"


async def _awrs_smc(llm: Any, potential: Any, max_tokens: int) -> str:
    """The README examples' sampling: AWRS of ``llm`` under ``potential`` (coerced to its
    tokens), SMC with 10 particles resampled at ESS 0.5; the most probable text."""
    from genlm.control import AWRS

    sampler = AWRS(llm, potential.coerce(llm, f=b"".join))
    try:
        sequences = await sampler.smc(n_particles=10, ess_threshold=0.5, max_tokens=max_tokens)
    finally:
        await sampler.cleanup()
    return _top(sequences.decoded_posterior)


def _top(posterior: dict[str, float]) -> str:
    if not posterior:
        return "(no complete sequence)"
    text, probability = max(posterior.items(), key=lambda item: item[1])
    return f"{text!r} ({probability:.2f})"


WORKLOADS: dict[str, Callable[[Any], Awaitable[str]]] = {
    "regex": run_regex,
    "json": run_json,
    "beam": run_beam,
    "sis": run_sis,
}


@dataclass
class Run:
    """One workload run, or the sum of several (`add`)."""

    workload: str
    seeds: int
    wall: float
    backend: float
    forward: float
    forward_cpu: float
    bare: float
    bare_cpu: float
    forwards: int
    rows: int
    output: str = ""

    def add(self, other: Run) -> Run:
        sums = {
            key: getattr(self, key) + getattr(other, key)
            for key in ("seeds", "wall", "backend", "forward", "forward_cpu", "bare", "bare_cpu")
            + ("forwards", "rows")
        }
        return Run(self.workload, **sums)

    def shares(self) -> dict[str, float]:
        """``outside``: the library's time outside the forwards while the client waits, over
        the forwards' time; ``in_forward``: the forwards' CPU time over the bare forwards';
        ``share``: what the library adds to the bare forwards, (1 + outside)(1 + in_forward)
        - 1, in CPU time where load on the machine would blur wall time (``wall_share``:
        backend / bare - 1 in wall time)."""
        outside = self.backend / self.forward - 1
        in_forward = self.forward_cpu / self.bare_cpu - 1
        return {
            "outside": outside,
            "in_forward": in_forward,
            "share": (1 + outside) * (1 + in_forward) - 1,
            "wall_share": self.backend / self.bare - 1,
        }


def run_once(lm: Any, workload: str, seed: int, cache_keyword: str) -> Run:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    lm.clear_cache()
    probe = Probe(cache_keyword)
    probe.attach(lm)
    try:
        started = time.perf_counter()
        output = asyncio.run(WORKLOADS[workload](lm))
        wall = time.perf_counter() - started
    finally:
        Probe.detach(lm)
    return Run(
        workload,
        1,
        wall,
        probe.backend,
        probe.forward,
        probe.forward_cpu,
        probe.bare,
        probe.bare_cpu,
        len(probe.forwards),
        sum(step.rows for step in probe.forwards),
        output,
    )


def table_line(run: Run, first: str) -> str:
    shares = run.shares()
    return (
        f"{run.workload:8} {first:>5} {run.wall:7.2f} {run.backend:9.2f} {run.forward:9.2f} "
        f"{run.bare:7.2f} {shares['outside']:8.1%} {shares['in_forward']:10.1%} "
        f"{shares['share']:6.1%} {shares['wall_share']:10.1%} {run.forwards:>8} {run.rows:>5}"
    )


HEADER = (
    f"{'workload':8} {'':>5} {'wall s':>7} {'backend s':>9} {'forward s':>9} {'bare s':>7} "
    f"{'outside':>8} {'in_forward':>10} {'share':>6} {'wall_share':>10} {'forwards':>8} "
    f"{'rows':>5}"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results (%(default)s)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genlm.backend.llm import AsyncTransformer
    from genlm.backend.llm.hf import cache_keyword
    from genlm.backend.models import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lm = AsyncTransformer(model, AutoTokenizer.from_pretrained(path))
    keyword = cache_keyword(model)

    runs: list[Run] = []
    print(HEADER.replace("     ", "seed ", 1))
    for workload in args.workloads:
        for seed in args.seeds:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the clients' own warnings (sparse tensors...)
                run = run_once(lm, workload, seed, keyword)
            runs.append(run)
            print(f"{table_line(run, str(seed))}  {run.output[:50]}", flush=True)
    rows = []
    print(f"\n{HEADER}")
    for workload in args.workloads:
        mine = [run for run in runs if run.workload == workload]
        total = mine[0]
        for run in mine[1:]:
            total = total.add(run)
        print(table_line(total, "all"))
        row = {key: value for key, value in asdict(total).items() if key != "output"}
        rows.append(row | total.shares())
    setup = {
        "model": "SmolLM2-135M-Instruct (float32), hf backend",
        "seeds": " ".join(map(str, args.seeds)),
        "statistic": "sums over the seeds (times in seconds)",
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "load_average_1min": os.getloadavg()[0],
    }
    columns = ["workload", "seeds", "wall", "backend", "forward", "bare", "outside"]
    result = {
        "benchmark": "clients",
        "setup": setup,
        "table": columns + ["in_forward", "share", "wall_share", "forwards", "rows"],
        "rows": rows,
        "runs": [asdict(run) for run in runs],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
