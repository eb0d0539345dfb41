"""AsyncMlxLM on the real default model (MLX CPU build), checked against independent forwards.

The references are an uncached float32 transformers forward of the whole prefix and a
plain mlx-lm forward of the whole prefix through a fresh ``make_prompt_cache`` (no
store). MLX's Linux CPU wheel multiplies matrices with a reference BLAS, so prompts stay
short.
"""

import asyncio
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from held_memory import assert_rows_hold_only_themselves

from genlm.backend.llm.mlx import AsyncMlxLM

# MLX vs transformers, both float32 on the CPU: other kernels (MLX's own GEMM, fused RoPE and
# RMSNorm, exp/log), so roundings differ per layer and add up over 30 layers: up to ~2e-4
# seen on AMD EPYC (AVX2); 5e-4 leaves room for other CPU kinds.
HF_TOLERANCE = 5e-4
# Batched / cached rows vs a plain mlx-lm forward of the whole prefix, same kernels on other
# shapes (padding, chains read from the pool): only the order of sums differs (SPEC: 1e-4).
SELF_TOLERANCE = 1e-4

pytestmark = pytest.mark.mlx


@pytest.fixture(scope="module")
def mlx_loaded(default_model_dir):
    mlx_lm = pytest.importorskip("mlx_lm")
    return mlx_lm.load(default_model_dir)


@pytest.fixture(scope="module")
def lm(mlx_loaded):
    model, tokenizer = mlx_loaded
    return AsyncMlxLM(model, tokenizer, batch_size=8)


@pytest.fixture(scope="module")
def reference(hf_model):
    """Log-probabilities from one uncached HF forward pass over the whole prefix."""
    memo = {}

    def logprobs(ids):
        key = tuple(ids)
        if key not in memo:
            with torch.no_grad():
                logits = hf_model(torch.tensor([key])).logits[0, -1].float()
            memo[key] = torch.log_softmax(logits, dim=-1)
        return memo[key]

    return logprobs


def plain_run(model, cache, ids):
    """Plain mlx-lm: run ``ids`` through ``cache`` (mlx-lm's own), as mlx-lm's generate
    does (a prefill whose logits are never computed, then the last token); the
    next-token log-probabilities over the tokenizer's vocabulary."""
    import mlx.core as mx

    if len(ids) > 1:
        model(mx.array([list(ids[:-1])]), cache=cache)
    logits = model(mx.array([list(ids[-1:])]), cache=cache)[0, -1]
    return normalized(logits)


def normalized(logits):
    """Log-softmax of MLX logits, normalized in float64 (exact to float32 rounding)."""
    import mlx.core as mx

    logits = torch.from_numpy(np.array(logits.astype(mx.float32)))
    return torch.log_softmax(logits.double(), -1).float()


@pytest.fixture(scope="module")
def plain(mlx_loaded):
    """Log-probabilities from a plain mlx-lm forward of the whole prefix (fresh cache)."""
    from mlx_lm.models.cache import make_prompt_cache

    model = mlx_loaded[0]
    memo = {}

    def logprobs(ids):
        key = tuple(ids)
        if key not in memo:
            memo[key] = plain_run(model, make_prompt_cache(model), key)
        return memo[key]

    return logprobs


class PlainAfterPrompt:
    """Plain mlx-lm with its own ``KVCache`` (no store): a prompt run once from a fresh
    cache, then each continuation run from a copy of that cache."""

    def __init__(self, model, prompt):
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.prompt = model, tuple(prompt)
        self.cache = make_prompt_cache(model)
        self.prompt_logprobs = plain_run(model, self.cache, self.prompt)

    def __call__(self, ids):
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        ids = tuple(ids)
        assert ids[: len(self.prompt)] == self.prompt
        if ids == self.prompt:
            return self.prompt_logprobs
        copies = []
        for layer in self.cache:
            copy = KVCache()
            copy.keys, copy.values = mx.array(layer.keys), mx.array(layer.values)
            copy.offset = layer.offset
            copies.append(copy)
        return plain_run(self.model, copies, ids[len(self.prompt) :])


def nodes(lm):
    """Every node of every prefix tree of ``lm``'s store."""
    stack = list(lm.store.roots.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        yield node


@pytest.fixture(scope="module")
def prompts(lm):
    encode = lm.tokenizer.encode
    return {
        "short": encode("Hello", add_special_tokens=False),
        "mid": encode("The capital of France is", add_special_tokens=False),
        "long": encode(
            "Once upon a time, in a land far away, there lived a", add_special_tokens=False
        ),
    }


def max_diff(a, b):
    return (a - b).abs().max().item()


class RecordingModel:
    """Wraps an mlx-lm model: records the shape of every input and can be made to fail."""

    def __init__(self, model):
        self.inner = model
        self.shapes = []
        self.fail = False

    def __call__(self, inputs, *args, **kwargs):
        self.shapes.append(tuple(inputs.shape))
        if self.fail:
            raise RuntimeError("injected model failure")
        return self.inner(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.slow
def test_loads_float32_weights_and_the_configs_rope_theta(lm, default_model_dir):
    from mlx.utils import tree_flatten

    config = json.loads((Path(default_model_dir) / "config.json").read_text())
    assert lm.model.args.rope_theta == config["rope_theta"]
    dtypes = {str(p.dtype) for _, p in tree_flatten(lm.model.parameters())}
    assert dtypes == {"mlx.core.float32"}
    assert not type(lm.tokenizer).__module__.startswith("mlx_lm")  # the HF tokenizer itself
    assert lm.kv_reuse


@pytest.mark.slow
async def test_each_returned_row_holds_only_itself(lm, prompts):
    ids = [prompts["short"], prompts["mid"], prompts["long"], prompts["short"]]
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in ids))
    rows.append(lm.next_token_logprobs_sync(prompts["mid"]))
    assert_rows_hold_only_themselves(rows, lm.vocab_size)


async def test_single_request_matches_hf(lm, prompts, reference):
    lm.clear_cache()
    ids = prompts["long"]
    logps = await lm.next_token_logprobs(ids)
    assert logps.shape == (len(lm.byte_vocab),)
    assert logps.dtype == torch.float32
    assert torch.logsumexp(logps, 0).item() == pytest.approx(0.0, abs=1e-4)  # float32 sum
    assert max_diff(logps, reference(ids)) <= HF_TOLERANCE
    lm.clear_cache()
    assert max_diff(lm.next_token_logprobs_sync(ids), reference(ids)) <= HF_TOLERANCE


@pytest.mark.slow
async def test_cached_prefixes_run_only_the_new_tokens_and_match_hf(mlx_loaded, prompts, reference):
    model = RecordingModel(mlx_loaded[0])
    lm = AsyncMlxLM(model, mlx_loaded[1], batch_size=8)
    base = prompts["mid"]
    await lm.next_token_logprobs(base)
    assert lm.walk_cache(base)[3] == len(base)

    rows = [base + [330], base + [330, 5099], base + [28], prompts["long"][:2]]
    model.shapes.clear()
    results = await asyncio.gather(*(lm.next_token_logprobs(ids) for ids in rows))
    assert lm.batcher.batch_sizes[-1] == len(rows)
    # A prefill pass over the tokens before each row's last (rows with one such token
    # together), then one pass on every row's last token.
    assert model.shapes == [(2, 1), (len(rows), 1)]
    for ids, logps in zip(rows, results, strict=True):
        assert max_diff(logps, reference(ids)) <= HF_TOLERANCE, ids
        node, next_index, past, depth = lm.walk_cache(ids)
        # the last token always runs: the KV used stops one token short of the prefix
        assert (next_index, depth, len(past)) == (len(ids) - 1, len(ids), len(model.layers))
        assert node.logprobs is not None and past[0].keys.shape[2] == len(ids) - 1

    model.shapes.clear()
    again = await lm.next_token_logprobs(rows[1])
    assert model.shapes == []  # answered from the cache
    assert torch.equal(again, results[1])


@pytest.mark.slow
def test_cache_is_bounded_by_cache_size_and_evicts_least_recently_used(mlx_loaded, plain):
    lm = AsyncMlxLM(*mlx_loaded, cache_size=2)
    rows = [[500 + i, 17, 18] for i in range(4)]
    for ids in rows:
        lm.next_token_logprobs_sync(ids)
    assert len([n for n in nodes(lm) if n.chain is not None]) == 2
    assert len([n for n in nodes(lm) if n.logprobs is not None]) == 2
    assert lm.store.held_blocks == 2  # the evicted prefixes' blocks are free again
    assert lm.walk_cache(rows[0])[2] is None  # the oldest was evicted
    assert lm.walk_cache(rows[3])[3] == 3
    for ids in [*rows, rows[3] + [19], rows[0] + [19]]:
        assert max_diff(lm.next_token_logprobs_sync(ids), plain(ids)) <= SELF_TOLERANCE, ids
    assert len([n for n in nodes(lm) if n.chain is not None]) == 2


@pytest.mark.slow
def test_cache_size_zero_keeps_nothing_between_batches(mlx_loaded, plain):
    lm = AsyncMlxLM(*mlx_loaded, cache_size=0)
    ids = [510, 511, 512]
    for _ in range(2):
        assert max_diff(lm.next_token_logprobs_sync(ids), plain(ids)) <= SELF_TOLERANCE
        assert lm.store.held_blocks == 0 and not any(n.logprobs is not None for n in nodes(lm))


@pytest.mark.slow
def test_max_logprobs_bytes_keeps_the_most_recent_rows(mlx_loaded, lm):
    row_bytes = 4 * lm.vocab_size  # a float32 row
    budgeted = AsyncMlxLM(*mlx_loaded, max_logprobs_bytes=2 * row_bytes)
    for ids in [[520 + i, 17] for i in range(3)]:
        budgeted.next_token_logprobs_sync(ids)
    kept = [node for node in nodes(budgeted) if node.logprobs is not None]
    assert budgeted.store.logprobs_nbytes == 2 * row_bytes and len(kept) == 2
    assert all(node.token == 17 and node.parent.token != 520 for node in kept)  # oldest went
    budgeted.close()


@pytest.fixture(scope="module")
def long_prompt(lm):
    text = "The old clockmaker opened his shop and said good morning to the town. " * 3
    return lm.tokenizer.encode(text, add_special_tokens=False)[:40]  # 2 full blocks + 8


@pytest.mark.slow
def test_walk_cache_past_is_mlx_lms_own_kv_and_a_model_continues_from_it(
    mlx_loaded, lm, long_prompt
):
    """`walk_cache`'s ``past`` (one mlx-lm ``KVCache`` per layer) of a pinned prompt whose
    last block forks appended to and copied: mlx-lm's own KV, and mlx-lm continues from it."""
    import mlx.core as mx

    plain = PlainAfterPrompt(mlx_loaded[0], long_prompt)
    lm = AsyncMlxLM(*mlx_loaded, batch_size=8)
    lm.cache_kv(long_prompt)
    lm.batch_next_token_logprobs_sync([long_prompt + [t, t + 1] for t in (5, 6, 7, 8)])
    node, next_index, past, base = lm.walk_cache(long_prompt + [9])
    assert next_index == base == len(long_prompt) and node.pinned
    for layer in (0, 17):
        keys, values = plain.cache[layer].keys, plain.cache[layer].values
        assert past[layer].offset == len(long_prompt)
        assert mx.abs(past[layer].keys - keys[..., : len(long_prompt), :]).max().item() <= 1e-4
        assert mx.abs(past[layer].values - values[..., : len(long_prompt), :]).max().item() <= 1e-4
    continued = plain_run(mlx_loaded[0], past, [9])
    assert max_diff(continued, plain(long_prompt + [9])) <= SELF_TOLERANCE


@pytest.mark.slow
async def test_sample_is_seeded_stops_at_eos_and_follows_the_model(lm, prompts, reference):
    prompt = prompts["mid"]
    greedy = []
    for _ in range(3):
        greedy.append(int(reference(prompt + greedy).argmax()))
    assert await lm.sample(prompt, 3, eos_token_ids=[], temperature=1e-4) == greedy
    stop = greedy[1]
    expected = greedy[: greedy.index(stop)]
    assert await lm.sample(prompt, 3, eos_token_ids=[stop], temperature=1e-4) == expected
    first = await lm.sample(prompt, 3, eos_token_ids=[], seed=7)
    assert len(first) == 3
    assert await lm.sample(prompt, 3, eos_token_ids=[], seed=7) == first


def tiny_llama(vocab_size, layer_types, sliding_window=None, cache_class=None):
    """A small random-weight mlx-lm llama (optionally with a custom cache layer class)."""
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=len(layer_types),
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    model = llama.Model(args)
    if cache_class is not None:
        model.make_cache = lambda: [cache_class() for _ in layer_types]
    return model


def uncached_logprobs(model, ids):
    import mlx.core as mx

    return normalized(model(mx.array([ids]))[0, -1])


# Sliding-window models: tiny random mlx-lm models whose sliding layers (``RotatingKVCache``)
# see 16 tokens, against 100-token prompts. The references are the model's own uncached
# forward (mlx-lm builds the window into its mask), never transformers: mlx-lm's Gemma 3
# rows differ from transformers' by ~0.017.
WINDOW = 16


def tiny_gemma3(vocab_size, window=WINDOW):
    """A small random-weight mlx-lm Gemma 3: two sliding-window layers, then a global one."""
    import mlx.core as mx
    from mlx_lm.models import gemma3_text

    mx.random.seed(0)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=3,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        vocab_size=vocab_size,
        sliding_window=window,
        sliding_window_pattern=3,
    )
    return gemma3_text.Model(args)


def tiny_hybrid_llama(vocab_size, window=WINDOW):
    """A small random-weight mlx-lm llama with sliding layers around a full one."""
    layers = ["sliding_attention", "full_attention", "sliding_attention"]
    return tiny_llama(vocab_size, layers, window)


def tiny_gpt_oss(vocab_size, window=WINDOW):
    """A small random-weight mlx-lm gpt-oss: a sliding and a full layer, attention sinks
    and a mixture of experts."""
    import mlx.core as mx
    from mlx_lm.models import gpt_oss

    mx.random.seed(0)
    args = gpt_oss.ModelArgs(
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=64,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"],
    )
    return gpt_oss.Model(args)


SLIDING_MODELS = {
    "gemma3": tiny_gemma3,
    "llama-hybrid": tiny_hybrid_llama,
    "gpt-oss": tiny_gpt_oss,
}


@pytest.fixture(params=sorted(SLIDING_MODELS))
def sliding(request, smollm2_tokenizer):
    """``(make_model, tokenizer)`` for each sliding-window family."""
    pytest.importorskip("mlx_lm")
    return SLIDING_MODELS[request.param], smollm2_tokenizer


def random_ids(rng, count):
    return rng.integers(1, 40_000, count).tolist()


def reusing_lm(model, tokenizer, **options):
    """An `AsyncMlxLM` that must reuse KV (any warning fails)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lm = AsyncMlxLM(model, tokenizer, **options)
    assert lm.kv_reuse
    return lm


def last_position_logprobs(model, ids):
    """The model's own uncached forward with its output layer on the last position only:
    the row the whole call gives (checked below), at a tenth of the time on MLX's CPU
    build, whose matrix products over a 49,152-token head are slow."""
    import mlx.core as mx

    hidden = model.model(mx.array([ids]))[:, -1:]
    head = model.lm_head if "lm_head" in model else model.model.embed_tokens.as_linear
    return normalized(head(hidden)[0, -1])


def assert_rows_match_the_uncached_forward(model, rows, results):
    """Each row against ``model``'s uncached forward (a `RecordingModel`'s inner model:
    the references are not recorded), once per distinct row."""
    model = getattr(model, "inner", model)
    references = {}
    for ids, logps in zip(rows, results, strict=True):
        if tuple(ids) not in references:
            references[tuple(ids)] = last_position_logprobs(model, ids)
        assert max_diff(logps, references[tuple(ids)]) <= SELF_TOLERANCE, ids


def test_the_window_shapes_the_reference_rows(sliding):
    """The window matters to these rows: a forward that let sliding layers see the whole
    prefix would be far outside the tolerance the tests below hold."""
    from mlx_lm.models.cache import RotatingKVCache

    make_model, tokenizer = sliding
    model, unwindowed = make_model(len(tokenizer)), make_model(len(tokenizer), window=4096)
    kinds = [type(layer) for layer in model.make_cache()]
    assert RotatingKVCache in kinds and len(set(kinds)) == 2
    ids = random_ids(np.random.default_rng(0), 100)
    assert max_diff(uncached_logprobs(model, ids), uncached_logprobs(unwindowed, ids)) > 0.1
    assert torch.equal(last_position_logprobs(model, ids), uncached_logprobs(model, ids))


async def test_sliding_windows_one_prompt(sliding):
    make_model, tokenizer = sliding
    model = RecordingModel(make_model(len(tokenizer)))
    lm = reusing_lm(model, tokenizer)
    prompt = random_ids(np.random.default_rng(1), 100)
    assert_rows_match_the_uncached_forward(model, [prompt], [await lm.next_token_logprobs(prompt)])
    model.shapes.clear()
    extended = prompt + [7]
    assert_rows_match_the_uncached_forward(
        model, [extended], [lm.next_token_logprobs_sync(extended)]
    )
    assert model.shapes == [(1, 1)]  # the prompt's KV reused: only the new token ran


async def test_sliding_windows_particles_with_resampling(sliding):
    """12 particles sample a token each step and are resampled by its probability, so
    they fork, die and duplicate, across a block boundary (112 tokens)."""
    make_model, tokenizer = sliding
    model = RecordingModel(make_model(len(tokenizer)))
    lm = reusing_lm(model, tokenizer, batch_size=12)
    rng = np.random.default_rng(2)
    particles = [random_ids(rng, 100)] * 12
    for step in range(16):
        model.shapes.clear()
        rows = await asyncio.gather(*(lm.next_token_logprobs(ids) for ids in particles))
        assert_rows_match_the_uncached_forward(model, particles, rows)
        if step:  # every particle's past is cached: one token per distinct particle runs
            assert model.shapes == [(len(set(map(tuple, particles))), 1)]
        probs = [row.double().exp().numpy() for row in rows]
        tokens = [int(rng.choice(len(p), p=p / p.sum())) for p in probs]
        weights = np.array([p[t] for p, t in zip(probs, tokens, strict=True)])
        survivors = rng.choice(12, size=12, p=weights / weights.sum())
        particles = [particles[i] + [tokens[i]] for i in survivors]


async def test_sliding_windows_shared_prompt_then_decode_steps(sliding):
    make_model, tokenizer = sliding
    model = RecordingModel(make_model(len(tokenizer)))
    lm = reusing_lm(model, tokenizer, batch_size=8)
    rng = np.random.default_rng(3)
    prompt = random_ids(rng, 100)
    lm.cache_kv(prompt)
    rows = [prompt + [token] for token in random_ids(rng, 4)]
    for _ in range(16):
        model.shapes.clear()
        results = await asyncio.gather(*(lm.next_token_logprobs(ids) for ids in rows))
        assert_rows_match_the_uncached_forward(model, rows, results)
        assert model.shapes == [(len(rows), 1)]
        rows = [ids + [int(logps.argmax())] for ids, logps in zip(rows, results, strict=True)]


async def test_sliding_windows_mixed_cached_lengths_and_extensions(sliding):
    """One batch of rows whose cached pasts end at other lengths (inside and past the
    window), extended by one to 23 tokens, prefilled in steps of 7."""
    make_model, tokenizer = sliding
    model = make_model(len(tokenizer))
    lm = reusing_lm(model, tokenizer, batch_size=8, prefill_step_size=7)
    rng = np.random.default_rng(4)
    prompt = random_ids(rng, 100)
    for length in (10, 37, 100):
        lm.next_token_logprobs_sync(prompt[:length])
    rows = [
        prompt[:10] + random_ids(rng, 4),
        prompt[:37] + random_ids(rng, 1),
        prompt + random_ids(rng, 23),
        prompt[:37] + random_ids(rng, 17),
        random_ids(rng, 45),
        prompt[:60],
    ]
    results = await asyncio.gather(*(lm.next_token_logprobs(ids) for ids in rows))
    assert lm.batcher.batch_sizes[-1] == len(rows)
    assert_rows_match_the_uncached_forward(model, rows, results)


def test_sliding_windows_walk_cache_past_is_mlx_lms_own_cache(smollm2_tokenizer):
    """`walk_cache`'s ``past`` holds a ``RotatingKVCache`` of the window's last tokens for
    each sliding layer, from which mlx-lm continues by one token or several."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    model = tiny_gemma3(len(smollm2_tokenizer))
    lm = reusing_lm(model, smollm2_tokenizer)
    prompt = random_ids(np.random.default_rng(5), 100)
    lm.cache_kv(prompt)
    for extension in ([7], [7, 8, 9]):
        past = lm.walk_cache(prompt + extension).past
        assert [type(layer) for layer in past] == [RotatingKVCache, RotatingKVCache, KVCache]
        assert [layer.keys.shape[2] for layer in past] == [WINDOW, WINDOW, len(prompt)]
        assert all(layer.offset == len(prompt) for layer in past)
        logits = model(mx.array([extension]), cache=past)[0, -1]
        assert max_diff(normalized(logits), uncached_logprobs(model, prompt + extension)) <= (
            SELF_TOLERANCE
        )


def tiny_gemma3n(vocab_size):
    """A small random-weight mlx-lm Gemma 3n: two sliding and two full layers, the last two
    sharing the KV of the first ones (read through their cache's ``keys_and_values``)."""
    import mlx.core as mx
    from mlx_lm.models import gemma3n

    mx.random.seed(0)
    layers = 4
    text = dict(
        model_type="gemma3n_text",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=vocab_size,
        num_key_value_heads=2,
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=vocab_size,
        sliding_window=WINDOW,
        max_position_embeddings=4096,
        rope_local_base_freq=10_000.0,
        rope_theta=1_000_000.0,
        final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.0] * layers,
        hidden_size_per_layer_input=8,
        altup_num_inputs=2,
        altup_coef_clip=120.0,
        altup_correct_scale=True,
        altup_active_idx=0,
        laurel_rank=4,
    )
    return gemma3n.Model(gemma3n.ModelArgs(model_type="gemma3n", text_config=text))


async def test_kv_shared_layers_reuse_kv_as_mlx_lms_own_cache_runs_them(smollm2_tokenizer):
    """Gemma 3n's KV-shared layers read an earlier layer's cache. The reference is mlx-lm's
    own cached forward: its uncached one gives those layers KV of their own."""
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import make_prompt_cache

    model = tiny_gemma3n(len(smollm2_tokenizer))
    lm = reusing_lm(model, smollm2_tokenizer, batch_size=8, prefill_step_size=7)
    rng = np.random.default_rng(6)
    prompt = random_ids(rng, 100)
    for length in (37, 100):
        lm.next_token_logprobs_sync(prompt[:length])
    rows = [prompt + random_ids(rng, 5), prompt[:37] + [3], random_ids(rng, 30), prompt + [9]]
    for _ in range(3):  # a mixed batch, then decode steps
        results = await asyncio.gather(*(lm.next_token_logprobs(ids) for ids in rows))
        for ids, logps in zip(rows, results, strict=True):
            own = plain_run(model, make_prompt_cache(model), ids)
            assert max_diff(logps, own) <= SELF_TOLERANCE, ids
        rows = [ids + [int(logps.argmax())] for ids, logps in zip(rows, results, strict=True)]
    assert max_diff(uncached_logprobs(model, rows[0]), own) > 0.1


class ReadsItsCacheArrays(RecordingModel):
    """A model that reads its cache layers' ``keys`` itself, beyond mlx-lm's cache protocol."""

    def __call__(self, inputs, *args, cache=None, **kwargs):
        if cache is not None:
            assert all(layer.keys is None or layer.keys.size for layer in cache)
        return super().__call__(inputs, *args, cache=cache, **kwargs)


async def test_a_model_failing_over_the_paged_cache_runs_whole_prefixes(smollm2_tokenizer):
    pytest.importorskip("mlx_lm")
    model = ReadsItsCacheArrays(tiny_gemma3(len(smollm2_tokenizer)))
    with pytest.warns(UserWarning, match="paged cache fails: AttributeError: .*keys"):
        lm = AsyncMlxLM(model, smollm2_tokenizer, batch_size=8)
    assert not lm.kv_reuse
    rows = [random_ids(np.random.default_rng(7), 40), [4], [5, 6]]
    results = await asyncio.gather(*(lm.next_token_logprobs(ids) for ids in rows))
    assert_rows_match_the_uncached_forward(model, rows, results)


def keeping_rotating_cache():
    """mlx-lm's cache for ``max_kv_size`` (a window that keeps its first 4 tokens)."""
    from mlx_lm.models.cache import RotatingKVCache

    return RotatingKVCache(max_size=16, keep=4)


async def test_unreusable_cache_layers_warn_once_and_disable_prefix_caching(smollm2_tokenizer):
    pytest.importorskip("mlx_lm")
    layers = ["full_attention", "full_attention"]
    model = tiny_llama(len(smollm2_tokenizer), layers, cache_class=keeping_rotating_cache)
    with pytest.warns(UserWarning, match=r"KV reuse is off.*RotatingKVCache\(keep=4\)"):
        lm = AsyncMlxLM(model, smollm2_tokenizer, batch_size=8)
    assert not lm.kv_reuse
    rows = [list(range(1, 8)), [8], [9, 10, 11], list(range(1, 10))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = await asyncio.gather(*(lm.next_token_logprobs(ids) for ids in rows[:3]))
        second = await lm.next_token_logprobs(rows[3])  # extends rows[0]: no KV to reuse
    assert lm.batcher.batch_sizes[0] == 3
    assert lm.walk_cache(rows[3])[2] is None
    for ids, logps in zip(rows, [*first, second], strict=True):
        assert max_diff(logps, uncached_logprobs(model, ids)) <= SELF_TOLERANCE, ids
    with pytest.raises(NotImplementedError, match="KV reuse"):
        lm.cache_kv(rows[0])


def tiny_mamba(vocab_size):
    """A small random-weight mlx-lm Mamba: recurrent state-space layers (``ArraysCache``)."""
    import mlx.core as mx
    from mlx_lm.models import mamba

    mx.random.seed(0)
    args = mamba.ModelArgs(
        model_type="mamba",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        state_size=8,
        num_hidden_layers=2,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=4,
    )
    return mamba.Model(args)


def concatenating_llama(vocab_size):
    from mlx_lm.models.cache import ConcatenateKVCache

    layers = ["full_attention", "full_attention"]
    return tiny_llama(vocab_size, layers, cache_class=ConcatenateKVCache)


@pytest.mark.parametrize(
    "make_model, kind",
    [(concatenating_llama, "ConcatenateKVCache"), (tiny_mamba, "ArraysCache")],
)
async def test_other_cache_layers_run_whole_prefixes(smollm2_tokenizer, make_model, kind):
    pytest.importorskip("mlx_lm")
    model = make_model(len(smollm2_tokenizer))
    with pytest.warns(UserWarning, match=f"KV reuse is off.*{kind}"):
        lm = AsyncMlxLM(model, smollm2_tokenizer, batch_size=8)
    assert not lm.kv_reuse
    rows = [[1, 2, 3], [4], [5, 6], [7, 8, 9]]
    results = await asyncio.gather(*(lm.next_token_logprobs(ids) for ids in rows))
    for ids, logps in zip(rows, results, strict=True):
        assert max_diff(logps, uncached_logprobs(model, ids)) <= SELF_TOLERANCE, ids


@pytest.mark.slow
def test_load_model_by_name_mlx(default_model_dir, reference):
    pytest.importorskip("mlx_lm")
    from genlm.backend.llm import load_model_by_name

    lm = load_model_by_name(default_model_dir, backend="mlx", llm_opts={"cache_size": 3})
    assert isinstance(lm, AsyncMlxLM) and lm.cache_size == 3
    assert max_diff(lm.next_token_logprobs_sync([504, 17]), reference([504, 17])) <= HF_TOLERANCE


@pytest.mark.parametrize(
    "option, error",
    [
        ({"prefill_step_size": 0}, ValueError),
        ({"cache_size": -1}, ValueError),
        ({"max_kv_bytes": 1.5}, TypeError),
        ({"max_kv_bytes": -1}, ValueError),
        ({"max_logprobs_bytes": "1GB"}, TypeError),
        ({"max_logprobs_bytes": -1}, ValueError),
    ],
)
def test_constructor_rejects_bad_options_before_touching_the_model(option, error):
    pytest.importorskip("mlx_lm")
    with pytest.raises(error, match=f"{next(iter(option))} must be"):
        AsyncMlxLM(None, None, **option)


def test_a_model_with_fewer_outputs_than_tokens_is_rejected(smollm2_tokenizer):
    pytest.importorskip("mlx_lm")
    model = tiny_llama(100, ["full_attention"])
    with pytest.raises(ValueError, match="output layer 100"):
        AsyncMlxLM(model, smollm2_tokenizer)


@pytest.mark.slow
def test_prefill_in_small_steps_matches_hf(mlx_loaded, prompts, reference):
    lm = AsyncMlxLM(*mlx_loaded, prefill_step_size=3)
    rows = [prompts["long"], prompts["mid"]]
    for ids, logps in zip(rows, lm.batch_next_token_logprobs_sync(rows), strict=True):
        assert max_diff(logps, reference(ids)) <= HF_TOLERANCE


def test_module_imports_without_mlx_and_use_names_the_extra():
    code = (
        "import sys\n"
        "sys.modules['mlx'] = sys.modules['mlx.core'] = sys.modules['mlx_lm'] = None\n"
        "from genlm.backend.llm.mlx import AsyncMlxLM\n"
        "try:\n"
        "    AsyncMlxLM.from_name('anything')\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "pip install -e '" in out and "[mlx]'" in out
