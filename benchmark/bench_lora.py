"""Per-request LoRA adapters on the SIS loop: particles split across adapters vs one adapter.

N particles run the README's SIS loop on AsyncTransformer with two peft adapters loaded.
Configurations, interleaved in the same run:

- ``one adapter``: every particle asks for adapter ``a``;
- ``split``: particle i asks for ``[None, "a", "b"][i % 3]`` (base model and two adapters),
  so every batch mixes three adapters.

Each runs with ``lora_batching="mixed"`` (peft's mixed-adapter batches: one forward) and
``"grouped"`` (one forward per adapter). ``ratio`` = split time / one-adapter time (same
batching mode). Every row the split runs return at their last step is checked against
a plain forward of the merged-weights model of its adapter (``max abs diff``).

    python benchmark/bench_lora.py                  # N = 32, 16 tokens, 28-token prompt
    python benchmark/bench_lora.py --particles 8 32 --repeats 5

Adapters: random peft LoRA (r = 8 on q/k/v/o projections, non-zero B), created in a
temporary directory. Results: a table and benchmark/results/lora.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lm import RESULTS_DIR, _default_model_dir, load_hf, prompt_ids  # noqa: E402

ADAPTERS = ("a", "b")
SPLIT = (None, "a", "b")


def make_adapters(args: argparse.Namespace, directory: Path) -> dict[str, str]:
    """Save two random LoRA adapters (different seeds) for the benchmark model."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    path = args.model or str(_default_model_dir())
    paths = {}
    for seed, name in enumerate(ADAPTERS, start=1):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        config = peft.LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            init_lora_weights=False,
        )
        peft.get_peft_model(model, config).save_pretrained(directory / name)
        paths[name] = str(directory / name)
    return paths


async def sis(
    lm: Any, prompt: list[int], loras: list[str | None], n_tokens: int, seed: int
) -> list[tuple[list[int], str | None, Any]]:
    """The README loop, particle i under adapter ``loras[i]``; each particle's last
    ``(context, adapter, logprobs)``."""
    import torch

    async def particle(index: int) -> tuple[list[int], str | None, Any]:
        generator = torch.Generator().manual_seed(seed + index)
        ctx, lora = list(prompt), loras[index]
        for _ in range(n_tokens):
            logps = await lm.next_token_logprobs(ctx, lora_name=lora)
            last = (ctx, lora, logps)
            ctx = ctx + [torch.multinomial(logps.exp(), 1, generator=generator).item()]
        return last

    return list(await asyncio.gather(*(particle(i) for i in range(len(loras)))))


def timed(lm: Any, prompt: list[int], loras: list[str | None], n_tokens: int, seed: int) -> Any:
    lm.clear_cache()
    gc.collect()
    start = time.perf_counter()
    lasts = asyncio.run(sis(lm, prompt, loras, n_tokens, seed))
    return time.perf_counter() - start, lasts


def merged_references(args: argparse.Namespace, paths: dict[str, str]) -> dict[Any, Any]:
    """``{adapter: model}``: the base model and each adapter merged into its weights."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    path = args.model or str(_default_model_dir())

    def base() -> Any:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    models = {None: base()}
    for name, adapter in paths.items():
        models[name] = peft.PeftModel.from_pretrained(base(), adapter).merge_and_unload().eval()
    return models


def max_diff(models: dict[Any, Any], lasts: list[tuple[list[int], str | None, Any]]) -> float:
    import torch

    worst = 0.0
    with torch.inference_mode():
        for ctx, lora, got in lasts:
            logits = models[lora](input_ids=torch.tensor([ctx])).logits[0, -1, : got.shape[0]]
            expected = torch.log_softmax(logits.float(), -1)
            worst = max(worst, (got - expected).abs().max().item())
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model dir (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--particles", type=int, nargs="+", default=[32])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from genlm.backend.llm.hf import AsyncTransformer

    _, tokenizer = load_hf(args)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        paths = make_adapters(args, Path(directory))
        references = merged_references(args, paths)
        print(
            f"{'N':>4} {'batching':>9} {'one adapter s':>14} {'split s':>9} "
            f"{'ratio':>6} {'split tok/s':>12} {'max abs diff':>13}"
        )
        for n in args.particles:
            for mode in ("mixed", "grouped"):
                model, _ = load_hf(args)
                lm = AsyncTransformer(model, tokenizer, batch_size=n, lora_batching=mode)
                for name, path in paths.items():
                    lm.add_new_lora(path, name)
                prompt = prompt_ids(lm, args.prompt_tokens)
                one = ["a"] * n
                split = [SPLIT[i % len(SPLIT)] for i in range(n)]
                timed(lm, prompt, split, 2, seed=0)  # warm-up
                one_runs, split_runs, diff = [], [], 0.0
                for r in range(args.repeats):  # interleaved: both see the same machine load
                    one_runs.append(timed(lm, prompt, one, args.tokens, r)[0])
                    seconds, lasts = timed(lm, prompt, split, args.tokens, r)
                    split_runs.append(seconds)
                    diff = max(diff, max_diff(references, lasts))
                for name in ADAPTERS:
                    lm.remove_lora(name)  # unwraps the shared model for the next mode
                lm.close()
                row = {
                    "n_particles": n,
                    "lora_batching": mode,
                    "one_adapter_seconds_min": min(one_runs),
                    "one_adapter_seconds_median": statistics.median(one_runs),
                    "split_seconds_min": min(split_runs),
                    "split_seconds_median": statistics.median(split_runs),
                    "ratio": min(split_runs) / min(one_runs),
                    "split_tokens_per_s": n * args.tokens / min(split_runs),
                    "max_abs_diff_vs_merged": diff,
                }
                rows.append(row)
                print(
                    f"{n:>4} {mode:>9} {row['one_adapter_seconds_min']:>14.2f} "
                    f"{row['split_seconds_min']:>9.2f} {row['ratio']:>6.2f} "
                    f"{row['split_tokens_per_s']:>12.1f} {diff:>13.2e}"
                )
    result = {
        "benchmark": "lora",
        "setup": {
            "model": args.model or "SmolLM2-135M-Instruct (float32)",
            "adapters": "2 random peft LoRA, r=8 on q/k/v/o",
            "split": "particle i on base, a, b in turn (i mod 3)",
            "prompt_tokens": args.prompt_tokens,
            "tokens_per_particle": args.tokens,
            "repeats": args.repeats,
            "statistic": "min and median of interleaved repeats",
            "torch_threads": torch.get_num_threads(),
            "load_average_1min": os.getloadavg()[0],
        },
        "rows": rows,
    }
    if not args.no_json:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = RESULTS_DIR / "lora.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
