"""AsyncTransformer on the real default model (SmolLM2-135M, float32, CPU).

Every answer is checked against an independent plain forward of the whole prefix
(`reference`), never against the cache under test.
"""

import asyncio
import warnings

import pytest
import torch

from genlm.backend.kv.pool import BLOCK_SIZE
from genlm.backend.llm.hf import AsyncTransformer, cache_keyword

# Rows of our HF backend (batched, padded, KV from the paged store, cascade attention) vs a
# plain transformers forward of the same float32 model on the same CPU: the same kernels on
# other matrix shapes, so only the order of float32 sums differs (a few 1e-6 typically,
# SPEC's bound 1e-4 for logprobs of magnitude up to ~50). A wrong row is off by > 0.1.
TOL = 1e-4


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer):
    return smollm2_tokenizer.encode("The old clockmaker opened his shop and said")


@pytest.fixture
def lm(hf_model, smollm2_tokenizer):
    return AsyncTransformer(hf_model, smollm2_tokenizer, batch_size=16)


def reference(model, ids, vocab_size):
    """Plain forward of the whole prefix, no cache, renormalized over the tokenizer's vocabulary."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(ids)])).logits[0, -1, :vocab_size]
        return torch.log_softmax(logits.float(), -1)


def kv_cache(model, **inputs):
    """The KV cache of a plain forward (named ``cache`` or ``past_key_values`` by release)."""
    return getattr(model(**inputs, use_cache=True), cache_keyword(model))


def assert_close(lm, ids, got):
    expected = reference(lm.model, ids, lm.vocab_size)
    assert got.shape == expected.shape == (len(lm.byte_vocab),)
    assert got.dtype == torch.float32
    diff = (got - expected).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff} for a prefix of {len(ids)} tokens"


class ForwardLog:
    """Wraps a model's forward to record the shape of every ``input_ids``."""

    def __init__(self, model, monkeypatch, fail_times=0):
        self.shapes = []
        self.fail_times = fail_times
        inner = model.forward

        def forward(*args, **kwargs):
            self.shapes.append(tuple(kwargs["input_ids"].shape))
            if self.fail_times:
                self.fail_times -= 1
                raise RuntimeError("forward failed on purpose")
            return inner(*args, **kwargs)

        monkeypatch.setattr(model, "forward", forward)

    @property
    def tokens(self):
        return sum(rows * length for rows, length in self.shapes)


def test_cache_keyword_is_the_model_class_own_under_an_instance_wrapper(hf_model, monkeypatch):
    """A profiler's ``forward(**kwargs)`` set on the instance, or a wrapper class taking
    ``**kwargs``, hides the signature: the keyword still follows the model's class and the
    installed release (else transformers 5.24+ warns on every forward)."""
    import transformers
    from packaging.version import Version

    keyword = cache_keyword(hf_model)
    new = Version(transformers.__version__) >= Version("5.24")
    assert keyword == ("cache" if new else "past_key_values")
    monkeypatch.setattr(hf_model, "forward", lambda **kwargs: None)
    assert cache_keyword(hf_model) == keyword
    assert cache_keyword(PaddedHead(hf_model, extra=1)) == keyword  # forward(**kwargs) class


def test_uncached_is_the_plain_forward(lm, prompt):
    got = lm.next_token_logprobs_uncached(prompt)
    assert_close(lm, prompt, got)
    assert torch.logsumexp(got, 0).item() == pytest.approx(0.0, abs=1e-4)  # float32 normalization


def test_sync_answers_match_before_and_after_caching(lm, prompt):
    first = lm.next_token_logprobs_sync(prompt)
    assert_close(lm, prompt, first)
    assert torch.equal(lm.next_token_logprobs_sync(prompt), first)  # logprobs cache hit
    longer = prompt + [1000, 2000]
    assert_close(lm, longer, lm.next_token_logprobs_sync(longer))


async def test_mixed_length_batch_matches_uncached(lm, prompt, monkeypatch):
    short, full = prompt[:6], prompt
    lm.batch_next_token_logprobs_sync([short, full])  # KV for two different past lengths
    queries = [
        full + [450],  # past 9, 1 new token
        short + [17],  # past 6, 1 new token: padded against the row above
        prompt[:3],  # its KV comes from below (a slice of a longer prefix's)
        [5],  # nothing cached: past 0, padded in the 1-new-token group
        full + [450, 451, 452],  # past 9, 3 new tokens
        short + [17, 18, 19],  # past 6, 3 new tokens: padded
        prompt[:2] + [3, 4, 5, 6],  # past 2 (from below), 4 new tokens
        short,  # logprobs cache hit
        full + [450],  # duplicate
    ]
    log = ForwardLog(lm.model, monkeypatch)
    results = await asyncio.gather(*(lm.next_token_logprobs(q) for q in queries))
    assert sorted(log.shapes) == [(1, 4), (2, 3), (4, 1)]
    for ids, got in zip(queries, results, strict=True):
        assert_close(lm, ids, got)
    assert list(lm.batcher.batch_sizes) == [len(set(map(tuple, queries)))]


async def test_extending_by_one_token_runs_only_that_token(lm, prompt, monkeypatch):
    await lm.next_token_logprobs(prompt)
    log = ForwardLog(lm.model, monkeypatch)
    children = [prompt + [t] for t in (11, 12, 13, 14)]
    results = await asyncio.gather(*(lm.next_token_logprobs(c) for c in children))
    assert log.shapes == [(4, 1)]  # one batched forward of 4 rows x 1 new token
    grandchild = children[2] + [99]
    node, next_index, past, base = lm.walk_cache(grandchild)
    assert next_index == base == len(grandchild) - 1
    assert past.shape[-2] == next_index
    results.append(await lm.next_token_logprobs(grandchild))
    assert log.shapes[-1] == (1, 1)
    for ids, got in zip(children + [grandchild], results, strict=True):
        assert_close(lm, ids, got)


async def test_particle_loop_matches_uncached_at_every_step(lm, prompt):
    contexts = {}

    async def particle(index):
        generator = torch.Generator().manual_seed(index)
        ctx = list(prompt)
        for _ in range(5):
            logps = await lm.next_token_logprobs(ctx)
            contexts[tuple(ctx)] = logps
            ctx = ctx + [torch.multinomial(logps.exp(), 1, generator=generator).item()]

    await asyncio.gather(*(particle(i) for i in range(4)))
    for ids, got in contexts.items():
        assert_close(lm, ids, got)


async def test_tiny_kv_budget_evicts_and_stays_correct(hf_model, smollm2_tokenizer, prompt):
    budget = 600_000  # about a dozen tokens of KV: forces eviction every step
    lm = AsyncTransformer(hf_model, smollm2_tokenizer, max_kv_bytes=budget, max_logprobs_bytes=0)
    seen = []

    async def particle(index):
        generator = torch.Generator().manual_seed(index)
        ctx = list(prompt)
        for _ in range(4):
            logps = await lm.next_token_logprobs(ctx)
            seen.append((tuple(ctx), logps))
            assert lm.kv_nbytes <= budget
            ctx = ctx + [torch.multinomial(logps.exp(), 1, generator=generator).item()]

    await asyncio.gather(*(particle(i) for i in range(3)))
    for ids, got in seen:
        assert_close(lm, ids, got)
    # an evicted prefix is recomputed transparently
    assert_close(lm, seen[0][0], lm.next_token_logprobs_sync(seen[0][0]))


async def test_budget_bounds_kv_in_a_longer_run(hf_model, smollm2_tokenizer, prompt):
    budget = 8 << 20
    lm = AsyncTransformer(hf_model, smollm2_tokenizer, max_kv_bytes=budget)
    peak = 0

    async def particle(index):
        nonlocal peak
        ctx = list(prompt) + [index]
        for step in range(12):
            await lm.next_token_logprobs(ctx)
            peak = max(peak, lm.kv_nbytes)
            ctx = ctx + [100 + step]

    await asyncio.gather(*(particle(i) for i in range(8)))
    assert 0 < peak <= budget


def test_after_clear_kv_cache_and_clear_cache(lm, prompt):
    ids = prompt + [300]
    lm.next_token_logprobs_sync(ids)
    lm.clear_kv_cache()
    assert lm.kv_nbytes == 0
    assert lm.walk_cache(ids + [5])[1] == 0
    assert_close(lm, ids + [5], lm.next_token_logprobs_sync(ids + [5]))
    assert_close(lm, ids, lm.next_token_logprobs_sync(ids))  # logprobs survived
    lm.clear_cache()
    assert lm.kv_nbytes == 0 and not lm.cache.children
    assert_close(lm, ids, lm.next_token_logprobs_sync(ids))


def pool_blocks(lm):
    """Blocks the backend's pool tensors really hold (each layer's K and V)."""
    layers = lm._pool.layers
    assert len(layers) == lm._pool.layout.num_layers
    assert {layer.shape[1] for layer in layers} == {lm.store.capacity * lm.store.block_size}
    return lm.store.capacity


async def test_the_pool_stays_within_budget_plus_the_rows_and_shrinks_on_clears(
    hf_model, smollm2_tokenizer, prompt, monkeypatch
):
    import genlm.backend.kv.store as kv_store

    monkeypatch.setattr(kv_store, "INITIAL_BLOCKS", 4)  # small steps: many resizes
    budget_blocks = 6
    lm = AsyncTransformer(hf_model, smollm2_tokenizer, max_kv_bytes=budget_blocks * 737_280)
    assert lm.store.block_bytes == 737_280  # SmolLM2-135M fp32: 30 layers x 2 x 3 x 64 x 4 x 16
    size = lm.store.block_size
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    contexts = [list(prompt) + [i] for i in range(4)]
    seen, bound = {}, 1 + budget_blocks
    for step in range(12):
        # what the rows of this batch may hold: their KV, plus one partly filled block each
        bound = max(bound, 1 + sum(-(-len(ctx) // size) + 1 for ctx in contexts))
        answers = await asyncio.gather(*(lm.next_token_logprobs(ctx) for ctx in contexts))
        assert pool_blocks(lm) <= bound
        if step % 3 == 2:  # checked against plain forwards below (a sample: they are slow)
            seen.update(zip(map(tuple, contexts), answers, strict=True))
        contexts = [
            ctx + [torch.multinomial(logps.exp(), 1, generator=generator).item()]
            for ctx, logps, generator in zip(contexts, answers, generators, strict=True)
        ]
        if step % 4 == 3:  # resample: pairs of particles fork from one ancestor
            contexts = [list(contexts[i // 2 * 2]) for i in range(4)]
    assert pool_blocks(lm) > 1 + budget_blocks  # the rows held more than the budget
    for ids, got in seen.items():
        assert_close(lm, ids, got)
    lm.cache_kv(contexts[0])
    lm.clear_kv_cache()
    assert pool_blocks(lm) == 4
    assert_close(lm, contexts[1], lm.next_token_logprobs_sync(contexts[1]))
    await asyncio.gather(*(lm.next_token_logprobs(ctx + [5]) for ctx in contexts))
    assert pool_blocks(lm) > 4
    lm.clear_cache()
    assert pool_blocks(lm) == 4
    assert_close(lm, contexts[2], lm.next_token_logprobs_sync(contexts[2]))


def test_a_trimmed_pool_keeps_the_pinned_prompt_exact(
    hf_model, smollm2_tokenizer, prompt, monkeypatch
):
    import genlm.backend.kv.store as kv_store

    monkeypatch.setattr(kv_store, "INITIAL_BLOCKS", 4)
    lm = AsyncTransformer(hf_model, smollm2_tokenizer, max_kv_bytes=0)
    lm.cache_kv(prompt)  # one block, the lowest free one
    sizes = []
    resize = lm._pool.resize
    monkeypatch.setattr(lm._pool, "resize", lambda blocks: sizes.append(blocks) or resize(blocks))
    long = [prompt + [t] * 40 for t in (5, 6, 7, 8)]  # 4 rows of 4 blocks
    lm.batch_next_token_logprobs_sync(long)
    # the batch grew the pool; once its rows let go (nothing unpinned kept) trim halved it
    assert max(sizes) >= 16 and pool_blocks(lm) == max(sizes) // 2
    lm.batch_next_token_logprobs_sync([prompt + [9]])
    assert pool_blocks(lm) == max(sizes) // 4
    log = ForwardLog(lm.model, monkeypatch)
    got = lm.next_token_logprobs_sync(prompt + [77])
    assert log.shapes == [(1, 1)]  # the pinned prompt's KV was used after the shrinks
    assert_close(lm, prompt + [77], got)
    past = lm.walk_cache(prompt + [77])[2]
    expected = kv_cache(hf_model, input_ids=torch.tensor([prompt]))
    assert torch.allclose(past[5, 1], expected.layers[5].values[0], atol=TOL)  # KV: as rows


def test_cache_kv_pins_the_prompt(hf_model, smollm2_tokenizer, prompt, monkeypatch):
    lm = AsyncTransformer(hf_model, smollm2_tokenizer, max_kv_bytes=400_000)
    lm.cache_kv(prompt)
    for token in range(5):  # traffic that evicts everything unpinned
        lm.next_token_logprobs_sync([token + 40, token + 41, token + 42])
    node, next_index, past, base = lm.walk_cache(prompt + [77])
    assert (next_index, base) == (len(prompt), len(prompt))
    lm.clear_cache()
    lm.cache_kv(prompt)
    log = ForwardLog(lm.model, monkeypatch)
    extended = lm.next_token_logprobs_sync(prompt + [77])
    again = lm.next_token_logprobs_sync(prompt + [78])
    assert log.shapes == [(1, 1), (1, 1)]  # the pinned prompt is never rerun
    assert_close(lm, prompt + [77], extended)
    assert_close(lm, prompt + [78], again)
    lm.clear_kv_cache()
    assert lm.walk_cache(prompt + [77])[1] == 0


def test_add_query_and_batch_evaluate_queries(lm, prompt):
    queries = [prompt, prompt + [3], prompt]
    assert [lm.add_query(q) for q in queries] == [0, 1, 2]
    results = lm.batch_evaluate_queries()
    assert len(results) == 3 and torch.equal(results[0], results[2])
    for ids, got in zip(queries, results, strict=True):
        assert_close(lm, ids, got)
    assert lm.batch_evaluate_queries() == []
    batch = lm.batch_next_token_logprobs_sync([prompt[:4], prompt[:5]])
    assert batch.shape == (2, lm.vocab_size)
    assert_close(lm, prompt[:5], batch[1])


@pytest.mark.parametrize(
    "bad, error, needle",
    [
        ([], ValueError, "empty"),
        ([1, 2, 10**9], ValueError, "1000000000"),
        ([1, -3], ValueError, "-3"),
        ([1, 2.5], TypeError, "2.5"),
        (["7"], TypeError, "'7'"),
    ],
)
async def test_bad_input_fails_before_model_work(lm, monkeypatch, bad, error, needle):
    log = ForwardLog(lm.model, monkeypatch)
    for call in (lm.next_token_logprobs_sync, lm.next_token_logprobs_uncached, lm.cache_kv):
        with pytest.raises(error, match=needle):
            call(bad)
    with pytest.raises(error, match=needle):
        await lm.next_token_logprobs(bad)
    assert log.shapes == []


async def test_a_failed_batch_reaches_every_caller_and_the_next_batch_works(
    lm, prompt, monkeypatch
):
    ForwardLog(lm.model, monkeypatch, fail_times=1)
    queries = [prompt + [t] for t in range(3)]
    outcomes = await asyncio.gather(
        *(lm.next_token_logprobs(q) for q in queries), return_exceptions=True
    )
    assert all(isinstance(o, RuntimeError) and "on purpose" in str(o) for o in outcomes)
    results = await asyncio.gather(*(lm.next_token_logprobs(q) for q in queries))
    for ids, got in zip(queries, results, strict=True):
        assert_close(lm, ids, got)


async def test_a_cancelled_caller_does_not_disturb_the_others(lm, prompt):
    tasks = [asyncio.create_task(lm.next_token_logprobs(prompt + [t])) for t in range(4)]
    await asyncio.sleep(0)
    tasks[1].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[1], asyncio.CancelledError)
    for t in (0, 2, 3):
        assert_close(lm, prompt + [t], done[t])
    lm.reset_async_queries()
    assert_close(lm, prompt + [9], await lm.next_token_logprobs(prompt + [9]))


class PaddedHead(torch.nn.Module):
    """A model whose output layer has extra rows beyond the tokenizer (with huge logits)."""

    def __init__(self, model, extra):
        super().__init__()
        self.inner = model
        self.config = model.config
        weight = model.get_output_embeddings().weight
        self.head = torch.nn.Linear(weight.shape[1], weight.shape[0] + extra, bias=False)
        self.extra = extra

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def get_output_embeddings(self):
        return self.head

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        padding = torch.full((*out.logits.shape[:-1], self.extra), 50.0)
        out.logits = torch.cat([out.logits, padding], dim=-1)
        return out


async def test_padded_output_rows_are_dropped_and_renormalized(hf_model, smollm2_tokenizer, prompt):
    lm = AsyncTransformer(PaddedHead(hf_model, extra=64), smollm2_tokenizer)
    results = await asyncio.gather(
        lm.next_token_logprobs(prompt), lm.next_token_logprobs(prompt + [8])
    )
    results.append(lm.next_token_logprobs_uncached(prompt))
    for ids, got in zip([prompt, prompt + [8], prompt], results, strict=True):
        assert got.shape == (len(lm.byte_vocab),)
        expected = reference(hf_model, ids, lm.vocab_size)
        assert (got - expected).abs().max().item() <= TOL


async def test_without_kv_reuse_the_fallback_is_still_exact(
    hf_model, smollm2_tokenizer, prompt, monkeypatch
):
    monkeypatch.setattr(AsyncTransformer, "_probe_kv_layout", lambda self: (None, "test"))
    with pytest.warns(UserWarning, match="KV reuse is off"):
        lm = AsyncTransformer(hf_model, smollm2_tokenizer)
    queries = [prompt, prompt + [5], prompt[:4]]
    results = await asyncio.gather(*(lm.next_token_logprobs(q) for q in queries))
    for ids, got in zip(queries, results, strict=True):
        assert_close(lm, ids, got)
    with pytest.raises(NotImplementedError, match="KV reuse"):
        lm.cache_kv(prompt + [1, 2])


async def test_eager_attention_uses_an_additive_mask(default_model_dir, smollm2_tokenizer, prompt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    lm = AsyncTransformer(model, smollm2_tokenizer)
    lm.next_token_logprobs_sync(prompt[:5])
    queries = [prompt, prompt[:5] + [9], prompt[:5] + [9, 10, 11], prompt[:2] + [3, 4, 5, 6]]
    results = await asyncio.gather(*(lm.next_token_logprobs(q) for q in queries))
    for ids, got in zip(queries, results, strict=True):
        assert_close(lm, ids, got)


# peft 0.21's get_peft_model reads a property transformers 5.23 deprecated
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_switching(random_lora, smollm2_tokenizer, prompt, tmp_path):
    pytest.importorskip("peft")
    adapted = random_lora(tmp_path / "lora")
    ids = prompt + [42]
    with_lora = reference(adapted, ids, len(smollm2_tokenizer))
    with adapted.disable_adapter():
        base = reference(adapted, ids, len(smollm2_tokenizer))
    # the adapter changes the answer by far more than TOL (random B of scale ~1: > 1 seen)
    assert (with_lora - base).abs().max().item() > 1e-2

    lm = AsyncTransformer(adapted.unload(), smollm2_tokenizer)  # the base model, LoRA removed
    with pytest.raises(ValueError, match="add_new_lora"):
        lm.set_lora(lora_name="missing")
    assert torch.allclose(lm.next_token_logprobs_sync(ids), base, atol=TOL)
    lm.add_new_lora(tmp_path / "lora", lora_name="mine")
    assert torch.allclose(lm.next_token_logprobs_sync(ids), base, atol=TOL)  # loaded, not active
    lm.set_lora(lora_name="mine")
    assert torch.allclose(lm.next_token_logprobs_sync(ids), with_lora, atol=TOL)
    assert torch.allclose(lm.next_token_logprobs_uncached(ids), with_lora, atol=TOL)
    lm.clear_lora()
    assert torch.allclose(lm.next_token_logprobs_sync(ids), base, atol=TOL)


def test_bitsandbytes_8bit_loads_and_agrees_on_the_top_token(
    default_model_dir, hf_model, smollm2_tokenizer, caplog
):
    pytest.importorskip("bitsandbytes")
    caplog.set_level("WARNING", logger="bitsandbytes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = AsyncTransformer.from_name(default_model_dir, bitsandbytes_opts={"load_in_8bit": True})
        assert type(lm.model.model.layers[0].mlp.up_proj).__name__ == "Linear8bitLt"
        for text in ["The capital of France is", "One, two, three,", "def hello():"]:
            ids = smollm2_tokenizer.encode(text)
            expected = reference(hf_model, ids, lm.vocab_size).argmax().item()
            assert lm.next_token_logprobs_sync(ids).argmax().item() == expected
    notices = [r for r in caplog.records if r.getMessage().startswith("MatMul8bitLt")]
    assert len(notices) <= 1  # bitsandbytes' cast notice once, not once per matmul


def test_from_name_options(default_model_dir, hf_model, smollm2_tokenizer, monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    import genlm.backend.models as models

    loaded_tokenizers = []
    monkeypatch.setattr(
        models,
        "load_tokenizer",
        lambda model_id: loaded_tokenizers.append(model_id) or smollm2_tokenizer,
    )
    calls = []

    def record(path, **kwargs):
        calls.append((path, kwargs))
        return hf_model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", record)
    lm = AsyncTransformer.from_name(
        default_model_dir, hf_opts={"torch_dtype": "float32"}, batch_size=3, max_kv_bytes=10
    )
    assert calls[-1] == (default_model_dir, {"device_map": "auto", "dtype": torch.float32})
    assert (lm.batcher.batch_size, lm.max_kv_bytes) == (3, 10)
    AsyncTransformer.from_name(default_model_dir, hf_opts={"dtype": torch.bfloat16})
    assert calls[-1][1]["dtype"] is torch.bfloat16
    AsyncTransformer.from_name(default_model_dir)
    assert calls[-1][1] == {"device_map": "auto", "dtype": "auto"}
    with pytest.raises(ValueError, match="float8"):
        AsyncTransformer.from_name(default_model_dir, hf_opts={"dtype": "float8"})
    with pytest.raises(ValueError, match="both"):
        AsyncTransformer.from_name(
            default_model_dir, hf_opts={"dtype": "float", "torch_dtype": "float"}
        )

    # a .gguf file: its directory plus gguf_file; the tokenizer comes from the file itself
    gguf = str(tmp_path / "model.Q4.gguf")
    (tmp_path / "model.Q4.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")  # must exist: checked first
    AsyncTransformer.from_name(gguf)
    assert calls[-1][0] == str(tmp_path)
    assert calls[-1][1]["gguf_file"] == "model.Q4.gguf"
    assert loaded_tokenizers[-1] == gguf


@pytest.fixture(scope="module")
def long_prompt(smollm2_tokenizer):
    text = "The old clockmaker opened his shop and said good morning to the town. " * 8
    return smollm2_tokenizer.encode(text)[:90]  # 5 full blocks and a partial one


async def test_particles_share_the_prompt_blocks_and_cascade_attention_is_exact(
    lm, long_prompt, monkeypatch, random_walks
):
    import genlm.backend.llm.hf as hf

    calls = []
    cascade = hf.cascade_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return cascade(*args, **kwargs)

    monkeypatch.setattr(hf, "cascade_attention", counted)
    seen = await random_walks(lm, long_prompt, 5)
    assert calls  # the shared prompt was read once per layer for all rows
    assert lm.model.config._attn_implementation == "sdpa"  # chosen per call, never switched
    for ids, got in seen.items():
        assert_close(lm, ids, got)
        assert got.untyped_storage().nbytes() == got.nbytes  # no batch block pinned
    # the prompt's KV is held once: its 90 tokens plus each particle's own 3 tokens, in blocks
    block = lm.store.block_bytes
    prompt_blocks = -(-len(long_prompt) // BLOCK_SIZE)
    assert lm.kv_nbytes <= (prompt_blocks + 5) * block


def test_pinned_long_prompt_forks_and_evictions_stay_exact(
    hf_model, smollm2_tokenizer, long_prompt
):
    lm = AsyncTransformer(hf_model, smollm2_tokenizer, max_kv_bytes=3 << 20)
    lm.cache_kv(long_prompt)
    forks = [long_prompt + [t, t + 1] for t in (5, 6, 7, 8)]
    results = lm.batch_next_token_logprobs_sync(forks)
    assert lm.kv_nbytes <= 3 << 20
    for ids, got in zip(forks, results, strict=True):
        assert_close(lm, ids, got)
    walk = lm.walk_cache(long_prompt + [9])
    node, next_index, past, base = walk  # the reference design's 4-tuple
    assert next_index == base == len(long_prompt) and node.pinned
    assert (walk.node, walk.next_token_index, walk.base) == (node, next_index, base)
    reference_past = kv_cache(hf_model, input_ids=torch.tensor([long_prompt]))
    assert torch.allclose(past[3, 0], reference_past.layers[3].keys[0], atol=TOL)  # KV: as rows


def test_cascade_attention_is_softmax_attention_over_shared_plus_own_keys():
    from types import SimpleNamespace

    from genlm.backend.llm.hf import cascade_attention

    torch.manual_seed(0)
    rows, kv_heads, groups, new, dim, shared, own = 3, 2, 3, 2, 8, 5, 4
    query = torch.randn(rows, kv_heads * groups, new, dim)
    shared_k, shared_v = torch.randn(kv_heads, shared, dim), torch.randn(kv_heads, shared, dim)
    key, value = torch.randn(rows, kv_heads, own, dim), torch.randn(rows, kv_heads, own, dim)
    mask = torch.ones(rows, 1, new, own, dtype=torch.bool)
    mask[0, :, :, :2] = False  # row 0 is left-padded by two
    mask[:, :, 0, -1] = False  # causal: the first new token does not see the second
    layer = SimpleNamespace(shared_kv=lambda: (shared_k, shared_v))
    cache = SimpleNamespace(layers=[None, layer])
    module = SimpleNamespace(layer_idx=1)
    got, _ = cascade_attention(module, query, key, value, mask, scaling=0.3, genlm_cache=cache)

    # independent: expand the shared keys to every row, repeat KV heads, one softmax
    full_k = torch.cat([shared_k.expand(rows, -1, -1, -1), key], 2).repeat_interleave(groups, 1)
    full_v = torch.cat([shared_v.expand(rows, -1, -1, -1), value], 2).repeat_interleave(groups, 1)
    full_mask = torch.cat([torch.ones(rows, 1, new, shared, dtype=torch.bool), mask], -1)
    scores = (query @ full_k.transpose(-1, -2) * 0.3).masked_fill(~full_mask, float("-inf"))
    expected = (scores.softmax(-1) @ full_v).transpose(1, 2)
    assert got.shape == expected.shape == (rows, new, kv_heads * groups, dim)
    # float32 attention on a few small random tensors, two orders of summation: ~1e-7 seen
    assert torch.allclose(got, expected, atol=1e-5)
