"""AsyncTransformer on the real default model (SmolLM2-135M, float32, CPU).

Every answer is checked against an independent plain forward of the whole prefix
(`reference`), never against the cache under test.
"""

import asyncio
import warnings

import pytest
import torch

from genlm.backend.kv.pool import BLOCK_SIZE
from genlm.backend.kv.tree import walk
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_uncached_is_the_plain_forward(lm, prompt):
    got = lm.next_token_logprobs_uncached(prompt)
    assert_close(lm, prompt, got)
    assert torch.logsumexp(got, 0).item() == pytest.approx(0.0, abs=1e-4)  # float32 normalization
    with pytest.raises(ValueError, match="empty"):
        lm.next_token_logprobs_uncached([])


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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
    # the CPU's device_map; CUDA's is tests/test_hf_device_map.py's
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
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


@pytest.mark.slow
async def test_particles_share_the_prompt_blocks_and_cascade_attention_is_exact(
    lm, long_prompt, monkeypatch, random_walks
):
    import genlm.backend.llm.hf.step as attention

    calls = []
    cascade = attention.cascade_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return cascade(*args, **kwargs)

    monkeypatch.setattr(attention, "cascade_attention", counted)
    seen = await random_walks(lm, long_prompt, 5)
    assert calls  # the shared prompt was read once per layer for all rows
    # the model's own attention: transformers' sdpa but for the forwards that pass their cache
    assert lm.model.config._attn_implementation == attention.CASCADE_ATTENTION
    for ids, got in seen.items():
        assert_close(lm, ids, got)
        cached = walk(lm.cache, ids)[0].logprobs
        if cached is not None:  # the caller's copy, not the tree's row
            assert got.untyped_storage().data_ptr() != cached.untyped_storage().data_ptr()
    # the prompt's KV is held once: its 90 tokens plus each particle's own 3 tokens, in blocks
    block = lm.store.block_bytes
    prompt_blocks = -(-len(long_prompt) // BLOCK_SIZE)
    assert lm.kv_nbytes <= (prompt_blocks + 5) * block


@pytest.mark.slow
def test_walk_cache_past_is_the_plain_forwards_kv(hf_model, smollm2_tokenizer, long_prompt):
    """`walk_cache`'s ``past`` (HF layout ``[layers, 2, kv_heads, tokens, head_dim]``) of a
    pinned prompt whose last block forks appended to and copied: a plain forward's KV."""
    lm = AsyncTransformer(hf_model, smollm2_tokenizer)
    lm.cache_kv(long_prompt)
    lm.batch_next_token_logprobs_sync([long_prompt + [t, t + 1] for t in (5, 6, 7, 8)])
    walk = lm.walk_cache(long_prompt + [9])
    node, next_index, past, base = walk  # the reference design's 4-tuple
    assert next_index == base == len(long_prompt) and node.pinned
    assert (walk.node, walk.next_token_index, walk.past, walk.base) == (
        node,
        next_index,
        past,
        base,
    )
    expected = kv_cache(hf_model, input_ids=torch.tensor([long_prompt]))
    assert past.shape == (30, 2, 3, len(long_prompt), 64)
    assert torch.allclose(past[3, 0], expected.layers[3].keys[0], atol=TOL)
    assert torch.allclose(past[5, 1], expected.layers[5].values[0], atol=TOL)


def test_cascade_attention_is_softmax_attention_over_shared_plus_own_keys():
    from types import SimpleNamespace

    from genlm.backend.llm.hf import cascade_attention
    from genlm.backend.llm.hf.step import STEP_CACHE

    torch.manual_seed(0)
    rows, kv_heads, groups, new, dim, shared, own = 3, 2, 3, 2, 8, 5, 4
    query = torch.randn(rows, kv_heads * groups, new, dim)
    shared_k, shared_v = torch.randn(kv_heads, shared, dim), torch.randn(kv_heads, shared, dim)
    key, value = torch.randn(rows, kv_heads, own, dim), torch.randn(rows, kv_heads, own, dim)
    mask = torch.ones(rows, 1, new, own, dtype=torch.bool)
    mask[0, :, :, :2] = False  # row 0 is left-padded by two
    mask[:, :, 0, -1] = False  # causal: the first new token does not see the second
    # padding shared slots (zero keys and values, as slot 0 reads) hidden by the cache's mask
    pad = torch.zeros(kv_heads, 3, dim)
    layers = {1: (torch.cat([shared_k, pad], 1), torch.cat([shared_v, pad], 1))}
    cache = SimpleNamespace(
        shared_kv=layers.get, shared_mask=torch.arange(shared + 3) < shared, window=None
    )
    module = SimpleNamespace(layer_idx=1)
    token = STEP_CACHE.set(cache)  # the step's cache, as `ModelForward.step` makes it current
    try:
        got, _ = cascade_attention(module, query, key, value, mask, scaling=0.3)
    finally:
        STEP_CACHE.reset(token)

    # independent: expand the shared keys to every row, repeat KV heads, one softmax
    full_k = torch.cat([shared_k.expand(rows, -1, -1, -1), key], 2).repeat_interleave(groups, 1)
    full_v = torch.cat([shared_v.expand(rows, -1, -1, -1), value], 2).repeat_interleave(groups, 1)
    full_mask = torch.cat([torch.ones(rows, 1, new, shared, dtype=torch.bool), mask], -1)
    scores = (query @ full_k.transpose(-1, -2) * 0.3).masked_fill(~full_mask, float("-inf"))
    expected = (scores.softmax(-1) @ full_v).transpose(1, 2)
    assert got.shape == expected.shape == (rows, new, kv_heads * groups, dim)
    # float32 attention on a few small random tensors, two orders of summation: ~1e-7 seen
    assert torch.allclose(got, expected, atol=1e-5)
