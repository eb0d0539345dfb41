"""The files one request crosses: `AsyncTransformer.next_token_logprobs` traced call by call.

The tiny random Llama of ``bench_host.py`` serves a prompt, then one particle's decode
step (its prompt plus one token) is traced with ``sys.setprofile`` on every thread (the
event loop's and the batcher's worker): each call of a named Python function in a
``genlm/backend`` file is recorded in order (``--all``: comprehensions and lambdas too,
which CPython 3.11 runs as functions of their own), calls elsewhere (asyncio, torch,
transformers) are skipped, so are coroutines resumed, and a crossing is a call whose file is not the previous
recorded call's. Printed: the path, file by file (with the function first called in it),
and the number of crossings (deterministic; no timing). ``--packages`` counts the
crossings between packages instead, each of `PACKAGES` one (the store and its parts, the
HF backend's modules, ...), every other module one of its own.

    python benchmark/crossings.py            # one decode step of one particle
    python benchmark/crossings.py --prompt-tokens 300 --cascade
        # 2 particles on a shared prompt of >= 64 tokens: the step runs cascade attention
    python benchmark/crossings.py --packages
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import inspect  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

BENCHMARK_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARK_DIR))

from bench_host import tiny_model  # noqa: E402

PACKAGE = "genlm/backend/"
RESUMABLE = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR
# Packages counted as one place by ``--packages``.
PACKAGES = ("kv/", "llm/hf/", "llm/vllm/", "trie/", "tokenization/")


def traced_files(run: Any, everything: bool = False, packages: bool = False) -> list[str]:
    """The ``genlm/backend`` files (with ``packages``: the `PACKAGES`, or files) of the
    Python calls made while ``run()`` runs, in order, consecutive repeats merged, each with
    the function first called in it."""
    files: list[str] = []
    started: dict[int, Any] = {}
    lock = threading.Lock()

    def record(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        if frame.f_code.co_flags & RESUMABLE:
            if id(frame) in started:
                return  # a coroutine or generator resumed: the way back, not a call
            started[id(frame)] = frame  # kept alive: its id stays its own
        if frame.f_code.co_name.startswith("<") and not everything:
            return
        path = frame.f_code.co_filename.replace(os.sep, "/")
        at = path.find(PACKAGE)
        if at < 0:
            return
        name = path[at + len(PACKAGE) :]
        if packages:
            name = next((package for package in PACKAGES if name.startswith(package)), name)
        with lock:
            if not files or files[-1].partition(":")[0] != name:
                files.append(f"{name}:{frame.f_code.co_name}")

    threading.setprofile(record)
    sys.setprofile(record)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return files


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=20)
    parser.add_argument(
        "--cascade", action="store_true", help="two particles (cascade attention's path)"
    )
    parser.add_argument("--all", action="store_true", help="count comprehensions and lambdas")
    parser.add_argument("--packages", action="store_true", help="count crossings of packages")
    args = parser.parse_args(argv)

    from genlm.backend.llm.hf import AsyncTransformer

    model, tokenizer = tiny_model()
    prompt = list(range(5, 5 + args.prompt_tokens))
    particles = 2 if args.cascade else 1
    with AsyncTransformer(model, tokenizer, batch_size=particles, cuda_graphs=False) as lm:
        contexts = [prompt + [i + 1] for i in range(particles)]

        async def step(contexts: list[list[int]]) -> None:
            await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))

        asyncio.run(step(contexts))  # the prompt's prefill and the particles' nodes
        contexts = [c + [7] for c in contexts]
        lm.batcher.pause()  # its next worker thread starts inside the trace (and is traced)
        loop = asyncio.new_event_loop()
        try:
            files = traced_files(
                lambda: loop.run_until_complete(step(contexts)), args.all, args.packages
            )
        finally:
            loop.close()
    print("\n".join(files))
    distinct = {entry.partition(":")[0] for entry in files}
    places = "packages or files" if args.packages else "files"
    print(f"crossings: {len(files) - 1} ({len(files)} {places} in a row, {len(distinct)} distinct)")


if __name__ == "__main__":
    main()
