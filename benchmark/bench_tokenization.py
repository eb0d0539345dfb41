"""Import time of ``genlm.backend`` and speed of ``decode_vocab`` on SmolLM2's tokenizer.

(a) ``import genlm.backend`` in a fresh interpreter, timed inside it (interpreter start-up
    excluded), ``--import-runs`` times; afterwards no heavy module (torch, transformers,
    numba, vllm, mlx, ...) may be in ``sys.modules``. Target: <= 0.25 s.
(b) ``decode_vocab`` on the SmolLM2-135M tokenizer (49,152 tokens, GPT-2 byte-level BPE),
    after one warm-up call, ``--runs`` times, each after a ``gc.collect()`` (otherwise a
    full collection of the ~340k objects transformers holds lands in some runs: the
    49k `Token` objects each call makes count towards its trigger). Target: <= 0.15 s
    (reference design: 0.44 s).

    python benchmark/bench_tokenization.py

Results: a table, and benchmark/results/tokenization.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
HEAVY_MODULES = ("torch", "transformers", "tokenizers", "numba", "vllm", "mlx", "mlx_lm", "sglang")
IMPORT_TARGET_S = 0.25
DECODE_VOCAB_TARGET_S = 0.15

_IMPORT_PROBE = f"""
import json, sys, time
start = time.perf_counter()
import genlm.backend
elapsed = time.perf_counter() - start
heavy = sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules)
print(json.dumps({{"seconds": elapsed, "heavy": heavy}}))
"""


def import_times(runs: int) -> tuple[list[float], list[str]]:
    """Seconds to ``import genlm.backend`` in ``runs`` fresh interpreters; heavy modules seen."""
    seconds, heavy = [], set()
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True, check=True
        )
        result = json.loads(out.stdout)
        seconds.append(result["seconds"])
        heavy.update(result["heavy"])
    return seconds, sorted(heavy)


def decode_vocab_times(runs: int) -> tuple[list[float], int]:
    """Seconds per ``decode_vocab`` call on the SmolLM2 tokenizer (after a warm-up call)."""
    from transformers import AutoTokenizer

    from genlm.backend.models import default_model_path
    from genlm.backend.tokenization import decode_vocab

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path()))
    byte_vocab, _ = decode_vocab(tokenizer)
    seconds = []
    for _ in range(runs):
        gc.collect()  # each run starts from a clean heap, as a program's single call would
        start = time.perf_counter()
        result = decode_vocab(tokenizer)
        seconds.append(time.perf_counter() - start)
        del result  # freed outside the timed region
    return seconds, len(byte_vocab)


def row(measurement: str, seconds: list[float], target: float, **extra: Any) -> dict[str, Any]:
    return {
        "measurement": measurement,
        "runs": len(seconds),
        "min_s": round(min(seconds), 4),
        "median_s": round(statistics.median(seconds), 4),
        "target_s": target,
        "meets_target": statistics.median(seconds) <= target,
        **extra,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--import-runs", type=int, default=7)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--no-json", action="store_true", help="print only")
    args = parser.parse_args(argv)

    seconds, heavy = import_times(args.import_runs)
    rows = [row("import genlm.backend", seconds, IMPORT_TARGET_S, heavy_modules=", ".join(heavy))]
    rows[0]["meets_target"] = rows[0]["meets_target"] and not heavy
    seconds, n_tokens = decode_vocab_times(args.runs)
    rows.append(row(f"decode_vocab SmolLM2 ({n_tokens} tokens)", seconds, DECODE_VOCAB_TARGET_S))

    print(f"{'measurement':42s} {'min s':>8s} {'median s':>9s} {'target s':>9s}  ok")
    for r in rows:
        print(
            f"{r['measurement']:42s} {r['min_s']:8.4f} {r['median_s']:9.4f} "
            f"{r['target_s']:9.2f}  {'yes' if r['meets_target'] else 'NO'}"
        )
    if heavy:
        print(f"heavy modules imported by `import genlm.backend`: {', '.join(heavy)}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if not args.no_json:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        result = {
            "benchmark": "tokenization",
            "machine": {
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "load_1m": load,
            },
            "table": ["measurement", "runs", "min_s", "median_s", "target_s", "meets_target"],
            "rows": rows,
        }
        path = RESULTS_DIR / "tokenization.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
