"""The host work of a decode step: `AsyncTransformer` on a tiny random Llama on the CPU.

The model (`small_models.tiny_llama`: 2 layers, hidden 64, SmolLM2's 49,152-token
vocabulary from ``benchmark/data``, random weights; nothing is downloaded) makes the
forward nearly free, so what a step costs is what the library does around it. For N
particles on a P-token prompt, each step is one ``batch_next_token_logprobs_sync`` over
the N contexts, then one batched ``multinomial`` draw (outside the timed step). Measured
per step, against the hand-written floor in the same run (one prefill of the prompt
expanded to N rows of a ``DynamicCache``, then one batched forward and ``log_softmax``
per token):

- ``ops``: aten ops of one step, counted with `op_count.OpCounter` (every op that
  reaches the dispatcher below autograd, views included), and ``kernels``: the kernel
  launches they stand for on a GPU (`op_count.kernel_launches`: a ``_foreach_*`` op over
  N tensors is N, a view none). Deterministic. The library's counts cover the caller's
  thread (the rows stacked) and the batcher's worker (``_answer_batch``: plan, forward,
  rows out).
- ``ms``: wall time per step (median over the timed steps), in the steady state of a long
  run: the timed steps follow ``--warmup`` steps (12), by which the library's logprobs
  budget (256 MB: 11 steps of 128 rows of 49k tokens) is full, so a step reuses the
  memory of the batch it evicts. ``fill_ms`` (and ``floor_fill_ms``): the median over the
  warmup steps after the first, while the budget fills with fresh memory (on a VM whose
  page faults are slow, each new 25 MB batch costs several ms; the floor keeps nothing).
- ``host_ms``: wall time per step outside the model's forward (the transformer body and
  the LM head, clocked by hooks): the index building, the prefix tree, the log-softmax,
  the rows' copies, ... ``host_mean_ms``: its mean, which counts the steps where the
  collector walks its older generations (gen1: every ~10 steps at N=128).

- ``check_ms``: what SPEC's requests cost before any library work: one pass over each of
  the step's N contexts (lists of ints) that checks every id is an exact int
  (``operator.countOf(map(type, ids), int)``, in C; the library's validation makes this
  pass over every request, then compares one that extends a validated prefix with it).
  Timed apart, per step, outside ``ms``. ``host_ms - check_ms`` is the library's own host
  work.

``--form``: a step as one ``batch_next_token_logprobs_sync`` (``batch``), each particle an
asyncio task awaiting its own row (``tasks``, as clients call), or the same with each
particle holding a `PrefixHandle` that it extends by its token (``handles``: the same steps
and draws; its ``check_ms`` is 0, the handle's ids being checked as it is extended).
Several forms run interleaved in one run, each to its own file (issue 47's targets for
``handles`` at N=128: host ms at 1,024 tokens <= 1.10x at 64, and <= 0.75x the list form's).

Each configuration runs ``--repeats`` times (3, round-robin, each timing the median of
the runs), each time in a fresh process with glibc's malloc thresholds fixed
(``MALLOC_MMAP_THRESHOLD_`` 32 MiB, ``MALLOC_TRIM_THRESHOLD_`` 1 GiB; ``--glibc-malloc
default`` leaves them alone). By default glibc moves its mmap threshold up each time it
frees a mapped chunk, so whether a step's fresh 25 MB batches and 196 KB rows come back
from the heap (no page faults) or from new mappings (about 6,000 faults a step, at ~1.4
us each on this VM) depends on the order of earlier frees: at 128 x 1,024 the same code
measured 11-13 or 22-28 ms of host time per step, run to run, on either side of a change.
The floor gets the same thresholds. Fixed, the steady state is the heap's, run after run.

Targets (issue 28): at N=128 and a 1,024-token prompt, ops <= 2x the floor's and <= 1.25x
N=8's; ``host_ms`` at 1,024 <= 1.2x at 64; ``ms`` <= the floor's; (issue 39) ``kernels``
at N=128 equal to N=8's. Timings need a quiet
machine (one torch thread); op counts do not. ``--collector off`` runs the steps with
CPython's cyclic collector disabled: what the collector's walks of young containers (the
caller's 128 contexts among them) add to the host time.

    python benchmark/bench_host.py                  # N = 8, 128 x prompt = 64, 1024, 3 runs each
    python benchmark/bench_host.py --collector off --particles 128   # -> host_collector_off.json
    python benchmark/bench_host.py --ops-only       # op counts only (fast, deterministic)
    python benchmark/bench_host.py --form tasks handles --particles 128 --repeats 5
        # lists vs handles, interleaved -> host_tasks.json, host_handles.json
    python benchmark/bench_host.py --profile 30 --particles 128 --prompt-tokens 1024
        # the timed steps' Python calls, GC collections and top 30 functions (cProfile,
        # both threads), per configuration, in this process (no timings)

Results: a table, and benchmark/results/host.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import operator  # noqa: E402
import platform  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

BENCHMARK_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCHMARK_DIR / "results"
# The columns of the docs' table (a row also holds its op counts by name).
TABLE = [
    "particles",
    "prompt_tokens",
    "ops",
    "floor_ops",
    "kernels",
    "floor_kernels",
    "syncs",
    "ms",
    "host_ms",
    "host_mean_ms",
    "check_ms",
    "floor_ms",
    "fill_ms",
    "floor_fill_ms",
]
sys.path.insert(0, str(BENCHMARK_DIR))

from op_count import OpCounter  # noqa: E402
from small_models import tiny_llama  # noqa: E402


class ForwardClock:
    """Seconds spent in the model's forward (hooks around the transformer body,
    ``model.base_model``, and its LM head), to tell the host's share of a step. The
    library runs the head itself where the model allows it (`OutputHead`): then
    its ``logits`` are clocked instead of the head module."""

    def __init__(self, model: Any, head: Any = None):
        self.seconds = 0.0
        self._start = 0.0
        self._hooks = [
            hook
            for module in (model.base_model, model.get_output_embeddings())
            for hook in (
                module.register_forward_pre_hook(self._enter),
                module.register_forward_hook(self._leave),
            )
        ]
        if head is not None:
            logits = head.logits

            def clocked(hidden: Any, *args: Any) -> Any:
                self._enter()
                try:
                    return logits(hidden, *args)
                finally:
                    self._leave()

            head.logits = clocked

    def remove(self) -> None:
        """Take the hooks off the model (the next configuration brings its own)."""
        for hook in self._hooks:
            hook.remove()

    def _enter(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def _leave(self, *_: Any) -> None:
        self.seconds += time.perf_counter() - self._start


class StepProfile:
    """cProfile of the library's timed steps on both of its threads: the caller's
    (validation, the rows stacked) and the batcher's worker's (plan, forward, tree), which
    `AutoBatcher.run_sync` runs; and the garbage collections they triggered. Deterministic
    counts (calls, collections) for work on a shared machine, where times are not."""

    def __init__(self, lm: Any):
        self.caller = cProfile.Profile()
        self.worker = cProfile.Profile()
        self.steps = 0
        self.collections = [0, 0, 0]
        self.retained: list[int] = []  # GC-tracked objects a step leaves allocated
        self._active = False
        run_sync = lm.batcher.run_sync

        def profiled(fn: Callable[..., Any], *args: Any) -> Any:
            if not self._active:
                return run_sync(fn, *args)

            def on_worker() -> Any:
                self.worker.enable()
                try:
                    return fn(*args)
                finally:
                    self.worker.disable()

            return run_sync(on_worker)

        lm.batcher.run_sync = profiled

    def step(self, run: Callable[[], Any]) -> Any:
        """``run()``, profiled."""
        before = [generation["collections"] for generation in gc.get_stats()]
        self._active = True
        self.caller.enable()
        try:
            return run()
        finally:
            self.caller.disable()
            self._active = False
            after = [generation["collections"] for generation in gc.get_stats()]
            self.collections = [
                c + b - a for c, a, b in zip(self.collections, before, after, strict=True)
            ]
            self.steps += 1

    def count_retained(self, run: Callable[[], Any]) -> Any:
        """``run()`` with the collector off, unprofiled: the GC-tracked objects it leaves
        allocated (what brings the next young collection nearer: CPython collects the
        youngest generation every 700 of them)."""
        gc.disable()
        try:
            before = gc.get_count()[0]
            result = run()
            self.retained.append(gc.get_count()[0] - before)
        finally:
            gc.enable()
        return result

    def report(self, top: int) -> str:
        """Calls and collections per step, and the ``top`` functions by own time."""
        import io

        out = io.StringIO()
        stats = pstats.Stats(self.caller, stream=out).add(self.worker)
        per_step = ", ".join(f"gen{g} {c / self.steps:.2f}" for g, c in enumerate(self.collections))
        builtin = sum(
            calls
            for (filename, *_), (_, calls, *_) in stats.stats.items()  # type: ignore[attr-defined]
            if filename == "~"
        )
        total = stats.total_calls  # type: ignore[attr-defined]
        out.write(
            f"{self.steps} steps: {total / self.steps:.0f} calls per step (cProfile, both "
            f"threads), {(total - builtin) / self.steps:.0f} of Python functions and "
            f"{builtin / self.steps:.0f} of builtins; GC collections per step: {per_step}; GC-tracked "
            f"objects a step leaves allocated: {self.retained}\n"
        )
        stats.sort_stats("tottime").print_stats(top)
        return out.getvalue()


def library_steps(
    model: Any,
    tokenizer: Any,
    prompt: list[int],
    n: int,
    steps: int,
    count_ops: bool,
    profile_from: int | None = None,
    form: str = "batch",
) -> dict[str, Any]:
    """``steps`` decode steps of N particles through `AsyncTransformer`: per-step wall and
    host seconds, and the op count of the last step (when ``count_ops``); with
    ``profile_from``, a `StepProfile` of the steps from that one on (``profile``). A step
    is one ``batch_next_token_logprobs_sync`` (``form="batch"``), or each particle an
    asyncio task awaiting its own ``next_token_logprobs`` (``"tasks"``, as clients call:
    each row the caller's own copy), or the same with each particle holding a
    `PrefixHandle` it extends by its token (``"handles"``: same steps and draws)."""
    import asyncio

    import torch

    from genlm.backend.llm.hf import AsyncTransformer

    lm = AsyncTransformer(model, tokenizer, batch_size=n)
    gc.collect()  # the earlier configurations' garbage and this LM's construction, not the steps'
    clock = ForwardClock(model, lm.runner.forward.head)
    profile = None if profile_from is None else StepProfile(lm)
    worker_counters: list[OpCounter] = []
    serve = lm._answer_batch

    def counted(*args: Any) -> Any:
        with OpCounter() as counter:
            rows = serve(*args)
        worker_counters.append(counter)
        return rows

    loop = asyncio.new_event_loop()

    def step_rows(contexts: list[Any], lm: AsyncTransformer = lm) -> Any:
        if form == "batch":
            return lm.batch_next_token_logprobs_sync(contexts)

        async def gathered() -> list[Any]:
            return await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))

        return loop.run_until_complete(gathered())

    generator = torch.Generator().manual_seed(0)
    first = lm.batch_next_token_logprobs_sync([prompt])
    draws = torch.multinomial(first[0].exp(), n, replacement=True, generator=generator)
    start: Any = lm.handle(prompt) if form == "handles" else prompt
    contexts = [start + [token] for token in draws.tolist()]
    walls, hosts, checks = [], [], []
    ops: Counter[str] = Counter()
    kernels: Counter[str] = Counter()
    for step in range(steps):
        start = time.perf_counter()
        if form != "handles":  # a handle's ids were checked as it was extended
            for context in contexts:
                operator.countOf(map(type, context), int)
        checks.append(time.perf_counter() - start)
        last = count_ops and step == steps - 1
        if last:  # the batch form's path, and the batcher's (the tasks form's)
            lm._answer_batch = lm.batcher.process_batch = counted  # type: ignore[method-assign]
        clock.seconds = 0.0
        start = time.perf_counter()
        if last:
            with OpCounter() as caller:
                rows = step_rows(contexts)
            ops = caller.counts + worker_counters[-1].counts
            kernels = caller.kernels + worker_counters[-1].kernels
        elif profile is not None and profile_from is not None and step >= profile_from:
            run = functools.partial(step_rows, contexts)
            rows = profile.step(run) if step < steps - 4 else profile.count_retained(run)
        else:
            rows = step_rows(contexts)
        wall = time.perf_counter() - start
        walls.append(wall)
        hosts.append(wall - clock.seconds)
        batch = rows if form == "batch" else torch.stack(rows)
        tokens = torch.multinomial(batch.exp(), 1, generator=generator).flatten().tolist()
        contexts = [context + [token] for context, token in zip(contexts, tokens, strict=True)]
    clock.remove()
    lm.close()  # its tree, pool and worker must not weigh on the next configuration
    loop.close()
    del lm, rows, batch, first
    return {
        "walls": walls,
        "hosts": hosts,
        "checks": checks,
        "ops": ops,
        "kernels": kernels,
        "profile": profile,
    }


def floor_steps(model: Any, prompt: list[int], n: int, steps: int) -> dict[str, Any]:
    """The hand-written loop: prefill once, expand the prompt's KV to N rows, then one
    batched ``DynamicCache`` forward and ``log_softmax`` per token (ops: its last step)."""
    import torch
    from transformers import DynamicCache

    from genlm.backend.llm.hf import cache_keyword

    keyword = cache_keyword(model)
    gc.collect()  # as for the library: the steps start from a collected heap
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    cache = DynamicCache(config=model.config)
    walls: list[float] = []
    ops: Counter[str] = Counter()
    kernels: Counter[str] = Counter()
    with torch.inference_mode():
        out = model(
            input_ids=torch.tensor([prompt]), **{keyword: cache}, use_cache=True, logits_to_keep=1
        )
        for layer in cache.layers:
            layer.keys = layer.keys.repeat_interleave(n, dim=0)
            layer.values = layer.values.repeat_interleave(n, dim=0)
        logps = torch.log_softmax(out.logits[:, -1, :vocab].float(), -1).expand(n, -1)
        tokens = torch.multinomial(logps.exp(), 1, generator=generator)
        positions = torch.full((n, 1), len(prompt))

        def step() -> torch.Tensor:
            out = model(
                input_ids=tokens,
                position_ids=positions,
                **{keyword: cache},
                use_cache=True,
                logits_to_keep=1,
            )
            return torch.log_softmax(out.logits[:, -1, :vocab].float(), -1)

        for index in range(steps):
            start = time.perf_counter()
            if index == steps - 1:
                with OpCounter() as counter:
                    logps = step()
                ops, kernels = counter.counts, counter.kernels
            else:
                logps = step()
            walls.append(time.perf_counter() - start)
            tokens = torch.multinomial(logps.exp(), 1, generator=generator)
            positions = positions + 1
    return {"walls": walls, "ops": ops, "kernels": kernels}


def measure(
    model: Any,
    tokenizer: Any,
    n: int,
    prompt_tokens: int,
    steps: int,
    warmup: int,
    form: str = "batch",
) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(prompt_tokens)
    prompt = torch.randint(0, len(tokenizer), (prompt_tokens,), generator=generator).tolist()
    library = library_steps(model, tokenizer, prompt, n, warmup + steps, True, form=form)
    floor = floor_steps(model, prompt, n, warmup + steps)
    median: Callable[[list[float]], float] = lambda xs: 1e3 * statistics.median(xs[warmup:])  # noqa: E731
    filling: Callable[[list[float]], float] = lambda xs: 1e3 * statistics.median(xs[1:warmup])  # noqa: E731
    return {
        "particles": n,
        "prompt_tokens": prompt_tokens,
        "ops": sum(library["ops"].values()),
        "floor_ops": sum(floor["ops"].values()),
        "kernels": sum(library["kernels"].values()),
        "floor_kernels": sum(floor["kernels"].values()),
        "syncs": library["ops"]["aten._local_scalar_dense.default"],
        "ms": median(library["walls"]),
        "host_ms": median(library["hosts"]),
        "host_mean_ms": 1e3 * statistics.mean(library["hosts"][warmup:]),
        "check_ms": median(library["checks"]),
        "floor_ms": median(floor["walls"]),
        "fill_ms": filling(library["walls"]) if warmup > 1 else None,
        "floor_fill_ms": filling(floor["walls"]) if warmup > 1 else None,
        "op_counts": dict(library["ops"].most_common()),
        "floor_op_counts": dict(floor["ops"].most_common()),
    }


def tiny_model() -> tuple[Any, Any]:
    """The tiny Llama and its tokenizer (one torch thread)."""
    import torch
    from gpu import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer()
    return tiny_llama(len(tokenizer), max_positions=4096, attn_implementation="sdpa"), tokenizer


def measure_here(
    n: int, prompt_tokens: int, steps: int, warmup: int, form: str = "batch"
) -> dict[str, Any]:
    """`measure` in this process, on the tiny Llama."""
    model, tokenizer = tiny_model()
    return measure(model, tokenizer, n, prompt_tokens, steps, warmup, form)


def profile_here(
    n: int, prompt_tokens: int, steps: int, warmup: int, top: int, form: str = "batch"
) -> str:
    """`StepProfile.report` of ``steps`` library steps after ``warmup``, then three steps
    with the collector off (objects left allocated) and one that counts ops, on the same
    prompt as `measure`."""
    import torch

    model, tokenizer = tiny_model()
    generator = torch.Generator().manual_seed(prompt_tokens)
    prompt = torch.randint(0, len(tokenizer), (prompt_tokens,), generator=generator).tolist()
    library = library_steps(model, tokenizer, prompt, n, warmup + steps + 4, True, warmup, form)
    return library["profile"].report(top)


# glibc's malloc thresholds in `measure_apart`'s processes (see the module's doc).
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def measure_apart(
    n: int,
    prompt_tokens: int,
    steps: int,
    warmup: int,
    fixed_malloc: bool = True,
    collector: bool = True,
    form: str = "batch",
) -> dict[str, Any]:
    """`measure` in a fresh Python process: each configuration starts from the same heap
    (after another configuration's steps, what the C allocator kept of the freed
    memory made a step's page faults, and its time, depend on the order of the runs),
    with glibc's malloc thresholds fixed unless not ``fixed_malloc``, and the cyclic
    collector disabled unless ``collector``."""
    command = [sys.executable, __file__, "--one", str(n), str(prompt_tokens)]
    command += ["--steps", str(steps), "--warmup", str(warmup)]
    command += ["--collector", "on" if collector else "off", "--form", form]
    env = {**os.environ, **(FIXED_MALLOC if fixed_malloc else {})}
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.splitlines()[-1])


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's result over its repeated runs: each timing the median of the
    runs' (``host_ms_runs``: every run's ``host_ms``); counts from the first run (the same
    in every run)."""
    first = runs[0]
    merged = dict(first)
    for key, value in first.items():
        if (key == "ms" or key.endswith("_ms")) and value is not None:
            merged[key] = statistics.median(run[key] for run in runs)
    merged["host_ms_runs"] = [run["host_ms"] for run in runs]
    return merged


# Each form of a step, and its results file's suffix.
FORMS = {"batch": "", "tasks": "_tasks", "handles": "_handles"}


def check_targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 28's CPU targets, from the N=8/128 x prompt 64/1,024 results."""
    by = {(r["particles"], r["prompt_tokens"]): r for r in results}
    if not {(8, 1024), (128, 64), (128, 1024)} <= by.keys():
        return {}
    big, small, short = by[128, 1024], by[8, 1024], by[128, 64]
    return {
        "ops_vs_floor_at_128x1024": big["ops"] / big["floor_ops"],  # <= 2
        "ops_128_vs_8_at_1024": big["ops"] / small["ops"],  # <= 1.25
        "kernels_128_vs_8_at_1024": big["kernels"] / small["kernels"],  # == 1
        "host_ms_1024_vs_64_at_128": big["host_ms"] / short["host_ms"],  # <= 1.2
        # information: the library's own host work, without the requests' check
        "host_less_check_1024_vs_64_at_128": (big["host_ms"] - big["check_ms"])
        / (short["host_ms"] - short["check_ms"]),
        "ms_vs_floor_at_128x1024": big["ms"] / big["floor_ms"],  # <= 1
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, nargs="+", default=[8, 128])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per configuration")
    parser.add_argument(
        "--warmup", type=int, default=12, help="untimed steps first (the logprobs budget fills)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="fresh processes per configuration, round-robin (the median of each timing)",
    )
    parser.add_argument("--ops-only", action="store_true", help="count ops, skip timing")
    parser.add_argument("--out", type=Path, help="default: results/host.json (see --collector)")
    parser.add_argument(
        "--profile", type=int, metavar="TOP", help="profile the timed steps (see above)"
    )
    parser.add_argument(
        "--glibc-malloc",
        choices=["fixed", "default"],
        default="fixed",
        help="glibc's malloc thresholds in each configuration's process (see above)",
    )
    parser.add_argument(
        "--collector",
        choices=["on", "off"],
        default="on",
        help="CPython's cyclic collector during the steps (off: results to host_collector_off.json)",
    )
    parser.add_argument(
        "--form",
        choices=list(FORMS),
        nargs="+",
        default=["batch"],
        help="a step as one batch call, as a task per particle (tasks), or as a task per "
        "particle holding a handle (handles); several: interleaved in one run, each form's "
        "results to its own file (host.json, host_tasks.json, host_handles.json)",
    )
    parser.add_argument("--one", type=int, nargs=2, help=argparse.SUPPRESS)  # N, prompt
    args = parser.parse_args(argv)
    steps, warmup = (1, 1) if args.ops_only else (args.steps, args.warmup)
    if args.one:
        if args.collector == "off":
            gc.disable()
        print(json.dumps(measure_here(*args.one, steps, warmup, args.form[0])))
        return
    if args.profile is not None:
        for n in args.particles:
            for prompt_tokens in args.prompt_tokens:
                print(f"N={n} prompt={prompt_tokens}")
                print(profile_here(n, prompt_tokens, steps, warmup, args.profile, args.form[0]))
        return
    header = (
        f"{'N':>4} {'prompt':>6} {'ops':>6} {'floor':>6} {'kernels':>7} {'floor':>6} "
        f"{'syncs':>5} {'ms':>8} {'host ms':>8} "
        f"{'host mean':>9} {'check ms':>8} {'floor ms':>8} {'fill ms':>8} {'floor fill':>10}"
    )
    print(header)
    configurations = [
        (form, n, p) for form in args.form for n in args.particles for p in args.prompt_tokens
    ]
    runs: dict[tuple[str, int, int], list[dict[str, Any]]] = {c: [] for c in configurations}
    repeats = 1 if args.ops_only else args.repeats
    for repeat in range(repeats):  # round-robin: drift over the run hits every configuration
        for form, n, prompt_tokens in configurations:
            r = measure_apart(
                n,
                prompt_tokens,
                steps,
                warmup,
                args.glibc_malloc == "fixed",
                args.collector == "on",
                form,
            )
            runs[form, n, prompt_tokens].append(r)
            print(
                f"{n:>4} {prompt_tokens:>6} {r['ops']:>6} {r['floor_ops']:>6} "
                f"{r['kernels']:>7} {r['floor_kernels']:>6} {r['syncs']:>5} "
                f"{r['ms']:>8.2f} {r['host_ms']:>8.2f} {r['host_mean_ms']:>9.2f} "
                f"{r['check_ms']:>8.2f} {r['floor_ms']:>8.2f} "
                f"{r['fill_ms'] or 0:>8.2f} {r['floor_fill_ms'] or 0:>10.2f}"
                + (f"  {form}" if len(args.form) > 1 else "")
                + (f"   (repeat {repeat + 1} of {repeats})" if repeats > 1 else "")
            )
    by_form = {
        form: [median_run(runs[c]) for c in configurations if c[0] == form] for form in args.form
    }
    for form, results in by_form.items():
        if repeats > 1:
            print(f"medians over the repeats ({form}):")
            for r in results:
                print(
                    f"{r['particles']:>4} {r['prompt_tokens']:>6} {r['ms']:>8.2f} ms "
                    f"{r['host_ms']:>8.2f} host ms {r['check_ms']:>8.2f} check ms "
                    f"{r['floor_ms']:>8.2f} floor ms"
                )
    targets = {form: check_targets(results) for form, results in by_form.items()}
    if "handles" in by_form:
        targets["handles"].update(handle_targets(by_form["handles"], by_form))
    for form, values in targets.items():
        for name, value in values.items():
            print(f"{form}: {name}: {value:.2f}")
    if args.ops_only:
        return
    import torch

    for form, results in by_form.items():
        suffix = FORMS[form] + ("" if args.collector == "on" else "_collector_off")
        out = args.out if args.out and len(args.form) == 1 else RESULTS_DIR / f"host{suffix}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "machine": platform.processor() or platform.machine(),
                    "torch": torch.__version__,
                    "steps": steps,
                    "warmup": warmup,
                    "repeats": repeats,
                    "glibc_malloc": args.glibc_malloc,
                    "collector": args.collector,
                    "form": form,
                    "forms_in_run": args.form,
                    "targets": targets[form],
                    "table": TABLE,
                    "rows": results,
                },
                indent=1,
            )
            + "\n"
        )
        print(f"wrote {out}")


def handle_targets(
    handles: list[dict[str, Any]], by_form: dict[str, list[dict[str, Any]]]
) -> dict[str, float]:
    """Issue 47's figures at N=128: the handle form's host ms at 1,024 tokens over 64
    (<= 1.10; 1.05 the stretch), and over the list forms' of the same run at 1,024 (<= 0.75)."""
    by = {(r["particles"], r["prompt_tokens"]): r for r in handles}
    if not {(128, 64), (128, 1024)} <= by.keys():
        return {}
    figures = {"host_ms_1024_vs_64_at_128": by[128, 1024]["host_ms"] / by[128, 64]["host_ms"]}
    for form in ("tasks", "batch"):
        lists = {(r["particles"], r["prompt_tokens"]): r for r in by_form.get(form, [])}
        if (128, 1024) in lists:
            figures[f"host_ms_vs_{form}_at_128x1024"] = (
                by[128, 1024]["host_ms"] / lists[128, 1024]["host_ms"]
            )
    return figures


if __name__ == "__main__":
    main()
