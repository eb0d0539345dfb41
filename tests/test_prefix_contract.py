"""The prefix-cache contract of `PrefixCachedLM`, written once and run on every backend.

Backends (the ``backend`` fixture):

- ``fake``: a tiny `PrefixCachedLM` over a pure-Python `BlockPool` whose "KV" of a token
  is ``(token, position, adapter)``. Its forward reads a row's past from the pool and
  its logprobs are a hash of that past plus the new tokens, so a row computed from the
  wrong KV (another prefix's, another adapter's, a stale or missing block) comes out
  different. Runs in milliseconds.
- ``hf``: `AsyncTransformer` on the default model (float32, CPU), checked against an
  uncached ``model(input_ids=...)`` forward (log_softmax of the last logits).
- ``mlx``: `AsyncMlxLM` on the default model, checked against a plain mlx-lm forward of
  the whole prefix through a fresh ``make_prompt_cache``.

Every answer is compared with an independent computation of the whole prefix, never with
the cache under test; work is asserted as counts (tokens fed to the model, blocks held,
pool sizes), never as wall-clock time.
"""

import asyncio
import collections
import functools
import hashlib

import pytest
import torch

import genlm.backend.kv.blocks as kv_blocks
from genlm.backend.kv.pool import NoKVPool
from genlm.backend.kv.store import PrefixKVStore
from genlm.backend.kv.tree import walk
from genlm.backend.llm import base
from genlm.backend.llm.prefix import PrefixCachedLM

# -- the fake backend -------------------------------------------------------------------------

FAKE_BLOCK = 16  # as the real backends' (small blocks are test_kv_store.py's)


def fake_logprobs(entries, vocab_size):
    """Next-token logprobs as a pure function of a sequence of KV entries."""
    digest = hashlib.blake2b(repr(tuple(entries)).encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    return torch.log_softmax(torch.randn(vocab_size, generator=generator), -1)


@functools.cache
def _decoded_vocab(tokenizer):
    return base.decode_vocab(tokenizer)


def fake_entries(ids, lora):
    """The KV entries of a whole prefix, computed from scratch."""
    return [(token, position, lora) for position, token in enumerate(ids)]


class FakePool:
    """A `BlockPool` of Python lists: each slot holds the entry written there."""

    block_size = FAKE_BLOCK
    block_bytes = 100

    def __init__(self):
        self.data: list = []

    def resize(self, blocks):
        self.data = (self.data + [None] * (blocks * FAKE_BLOCK))[: blocks * FAKE_BLOCK]

    def free(self):
        self.data = []

    def copy(self, copies):
        for copy in copies:
            for j in range(copy.tokens):
                self.data[copy.target * FAKE_BLOCK + j] = self.data[copy.source * FAKE_BLOCK + j]

    def slots(self, chain, tokens):
        return [chain[j // FAKE_BLOCK] * FAKE_BLOCK + j % FAKE_BLOCK for j in range(tokens)]

    def read(self, chain, tokens):
        return [self.data[slot] for slot in self.slots(chain, tokens)]


class FakeLM(PrefixCachedLM):
    """A `PrefixCachedLM` whose forward is a deterministic function of the KV it reads (the
    LM is its own `RowRunner`)."""

    def __init__(
        self,
        tokenizer,
        batch_size=16,
        timeout=0.02,
        max_kv_bytes=None,
        max_logprobs_bytes=None,
        kv_reuse=True,
    ):
        super().__init__(tokenizer)
        self.pool = FakePool() if kv_reuse else None
        store = PrefixKVStore(self.pool or NoKVPool("fake"), max_kv_bytes, max_logprobs_bytes)
        self._init_prefix_cache(store, self, batch_size, timeout, "genlm-fake")
        self.fed: list[int] = []  # tokens fed per forward
        self.fail = 0  # forwards still to fail
        self.adapters: set[str] = set()

    def load_adapter(self, lora_path, lora_name):
        self.adapters.add(lora_name)

    def unload_adapter(self, lora_name):
        self.adapters.discard(lora_name)

    def read_past(self, chain, tokens):
        return self.pool.read(chain, tokens)

    def free(self):
        pass

    def run(self, plans):
        if self.fail:
            self.fail -= 1
            raise RuntimeError("forward failed on purpose")
        self.fed.append(sum(plan.new_tokens for plan in plans))
        results = []
        for plan in plans:
            assert plan.lora is None or plan.lora in self.adapters
            if self.pool is None:
                assert plan.start == 0
                entries = fake_entries(plan.ids, plan.lora)
            else:
                entries = self.pool.read(plan.chain, plan.start)
                new = fake_entries(plan.ids, plan.lora)[plan.start :]
                for slot, entry in zip(
                    self.pool.slots(plan.chain, len(plan.ids))[plan.start :], new, strict=True
                ):
                    self.pool.data[slot] = entry
                entries += new
            results.append(fake_logprobs(entries, self.vocab_size))
        return torch.stack(results)


# -- one harness per backend ------------------------------------------------------------------


class Harness:
    """How the contract drives one backend: make an LM, the independent answer for a
    prefix, the tokens fed to the model, failing forwards, the pool's real size."""

    tolerance = adapter_tolerance = 0.0

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def assert_exact(self, lm, ids, got, lora=None):
        expected = self.expected(lm, tuple(ids), lora)
        assert got.shape == expected.shape == (len(lm.byte_vocab),)
        assert got.dtype == torch.float32
        diff = (got - expected).abs().max().item()
        tolerance = self.tolerance if lora is None else self.adapter_tolerance
        assert diff <= tolerance, f"max abs diff {diff} for a prefix of {len(ids)} tokens"

    def no_kv_reuse(self):
        """Make the next `make` build an LM whose KV cannot be reused."""
        raise NotImplementedError

    def pool(self, lm):
        return lm.runner.pool


class ModelHarness(Harness):
    """A real model's harness: its wrapped forward records ``(rows, tokens)`` shapes in
    ``shapes`` and fails while ``fail`` is above zero."""

    def fed(self):
        return sum(rows * tokens for rows, tokens in self.shapes)

    def fail_next(self, times=1):
        self.fail = times


class FakeHarness(Harness):
    def __init__(self, monkeypatch, tokenizer):
        super().__init__(monkeypatch)
        self.tokenizer = tokenizer
        self.kv_reuse = True
        # the fake makes many LMs of one tokenizer: decode its vocabulary once
        decoded = _decoded_vocab(tokenizer)
        monkeypatch.setattr(base, "decode_vocab", lambda tok: tuple(map(list, decoded)))

    def make(self, **options):
        self.lm = FakeLM(self.tokenizer, kv_reuse=self.kv_reuse, **options)
        return self.lm

    def no_kv_reuse(self):
        self.kv_reuse = False

    def expected(self, lm, ids, lora):
        return fake_logprobs(fake_entries(ids, lora), lm.vocab_size)

    def fed(self):
        return sum(self.lm.fed)

    def fail_next(self, times=1):
        self.lm.fail = times

    def pool_blocks(self, lm):
        return len(lm.runner.pool.data) // FAKE_BLOCK

    @staticmethod
    def past_tokens(past):
        return len(past)

    def add_adapter(self, lm, path, name):
        lm.add_new_lora(str(path), name)


class HFHarness(ModelHarness):
    # Batched, padded, paged (cascade) rows vs a plain float32 forward on the same CPU: only
    # the order of float32 sums differs (a few 1e-6 typically; SPEC's bound 1e-4).
    tolerance = 1e-4
    # Rows of conftest's random LoRA (B ~ N(0, 1), alpha / r = 4: every layer's activations
    # scaled up, rounding with them) through peft's adapter_names forward vs the peft model's
    # plain forward: up to 1.1e-4 seen (a 2-token row over the adapter's cached KV); a row of
    # the wrong adapter or KV is off by > 1e-2.
    adapter_tolerance = 2e-4

    def __init__(self, monkeypatch, model, tokenizer, random_lora):
        super().__init__(monkeypatch)
        self.model, self.tokenizer, self.random_lora = model, tokenizer, random_lora
        self.with_adapters = []
        self.references = {}
        self.adapted = {}
        self.shapes = []
        self.fail = 0
        self.recording = True  # off while a reference runs: its forward is not counted
        # The transformer body: the library's forward runs it through the model's forward
        # or, with the model's plain LM head, directly (`OutputHead`).
        body = model.base_model
        inner = body.forward

        def forward(*args, **kwargs):
            if self.recording:
                self.shapes.append(tuple(kwargs["input_ids"].shape))
                if self.fail:
                    self.fail -= 1
                    raise RuntimeError("forward failed on purpose")
            return inner(*args, **kwargs)

        monkeypatch.setattr(body, "forward", forward)

    def make(self, **options):
        from genlm.backend.llm.hf import AsyncTransformer

        lm = AsyncTransformer(self.model, self.tokenizer, **{"batch_size": 16, **options})
        self.shapes.clear()  # the layout probe
        return lm

    def no_kv_reuse(self):
        from genlm.backend.llm.hf import forward

        self.monkeypatch.setattr(forward, "kv_layout", lambda *args: (None, "test"))

    def expected(self, lm, ids, lora):
        key = (ids, lora)
        references = HF_REFERENCES if lora is None else self.references
        if key not in references:
            forward = self.model if lora is None else self.adapted[lora]
            self.recording = False
            try:
                with torch.inference_mode():
                    logits = forward(input_ids=torch.tensor([list(ids)])).logits[0, -1]
            finally:
                self.recording = True
            references[key] = torch.log_softmax(logits[: lm.vocab_size].float(), -1)
        return references[key]

    def pool_blocks(self, lm):
        layers = lm.runner.pool.layers
        assert len(layers) == lm.runner.pool.layout.num_layers
        sizes = {layer.shape[1] for layer in layers}
        assert len(sizes) == 1
        return sizes.pop() // lm.store.block_size

    @staticmethod
    def past_tokens(past):
        return past.shape[-2]  # [layers, 2, kv_heads, tokens, head_dim]

    def add_adapter(self, lm, path, name):
        pytest.importorskip("peft")
        adapted = self.random_lora(path, seed=len(self.adapted))
        self.adapted[name] = adapted
        self.with_adapters.append(lm)
        lm.add_new_lora(str(path), name)


# The base model's plain mlx-lm answers and KV (the last 16 prefixes), for the session.
MLX_REFERENCES: dict = {}
MLX_CACHES: collections.OrderedDict = collections.OrderedDict()
HF_REFERENCES: dict = {}


class MlxHarness(ModelHarness):
    # Batched, paged rows vs a plain mlx-lm forward of the whole prefix: the same kernels on
    # other shapes, only the order of sums differs (SPEC: 1e-4).
    tolerance = adapter_tolerance = 1e-4

    def __init__(self, monkeypatch, loaded):
        super().__init__(monkeypatch)
        self.inner, self.tokenizer = loaded
        self.references = {}
        self.adapted = {}
        self.shapes = []
        self.fail = 0

    def make(self, **options):
        from genlm.backend.llm.mlx import AsyncMlxLM

        harness = self

        class Recording:
            """The model, recording the shape of every input (and failing on demand). It holds
            the model itself: an adapter's copy of it (deepcopy) copies the model too."""

            def __init__(self, model):
                self.inner = model

            def __call__(self, inputs, *args, **kwargs):
                harness.shapes.append(tuple(inputs.shape))
                if harness.fail:
                    harness.fail -= 1
                    raise RuntimeError("forward failed on purpose")
                return self.inner(inputs, *args, **kwargs)

            def __getattr__(self, name):
                if name == "inner":  # not set yet (deepcopy builds the copy bare)
                    raise AttributeError(name)
                return getattr(self.inner, name)

        lm = AsyncMlxLM(Recording(self.inner), self.tokenizer, **{"batch_size": 16, **options})
        self.shapes.clear()  # the layout probe
        return lm

    def no_kv_reuse(self):
        from genlm.backend.llm.mlx import AsyncMlxLM

        self.monkeypatch.setattr(AsyncMlxLM, "_probe_kv_layout", lambda s: (None, "test"))

    def expected(self, lm, ids, lora):
        """A plain mlx-lm forward (`test_mlx.plain_run`): of the whole prefix through a fresh
        cache, or, for the base model, of the tokens past the longest prefix already run,
        through a copy of mlx-lm's own ``KVCache`` of that prefix (no store involved)."""
        from mlx_lm.models.cache import KVCache, make_prompt_cache
        from test_mlx import plain_run

        if lora is not None:
            key = (ids, lora)
            if key not in self.references:
                model = self.adapted[lora]
                self.references[key] = plain_run(model, make_prompt_cache(model), ids)
            return self.references[key]
        if ids not in MLX_REFERENCES:
            known = [k for k in range(len(ids) - 1, 0, -1) if ids[:k] in MLX_CACHES]
            cache = make_prompt_cache(self.inner)
            if known:
                for layer, (keys, values) in zip(cache, MLX_CACHES[ids[: known[0]]], strict=True):
                    layer.keys, layer.values, layer.offset = keys, values, known[0]
            MLX_REFERENCES[ids] = plain_run(self.inner, cache, ids[known[0] if known else 0 :])
            MLX_CACHES[ids] = [
                (layer.keys[..., : len(ids), :], layer.values[..., : len(ids), :])
                for layer in cache
            ]
            while len(MLX_CACHES) > 16:
                MLX_CACHES.popitem(last=False)
            assert all(isinstance(layer, KVCache) for layer in cache)
        return MLX_REFERENCES[ids]

    def pool_blocks(self, lm):
        sizes = {array.shape[0] for array in lm.runner.pool.keys + lm.runner.pool.values}
        assert len(sizes) == 1 and len(lm.runner.pool.keys) == lm.runner.pool.layout.num_layers
        return sizes.pop() // lm.store.block_size

    @staticmethod
    def past_tokens(past):
        return past[0].keys.shape[2]  # one mlx-lm KVCache per layer

    def add_adapter(self, lm, path, name):
        from test_mlx_lora import write_adapter

        self.adapted[name] = write_adapter(self.inner, path, seed=len(self.adapted))
        lm.add_new_lora(str(path), name)


@pytest.fixture(scope="module")
def mlx_loaded(default_model_dir):
    mlx_lm = pytest.importorskip("mlx_lm")
    return mlx_lm.load(default_model_dir)


# Scenarios of the store's policy alone (eviction order, budgets over many steps).
STORE_POLICY = {
    "test_eviction_releases_the_least_recently_used_prefix_first",
    "test_a_tiny_budget_evicts_every_step_and_rows_stay_exact",
}


@pytest.fixture(
    params=[
        "fake",
        pytest.param("hf", marks=pytest.mark.slow),
        pytest.param("mlx", marks=[pytest.mark.slow, pytest.mark.mlx]),
    ]
)
def backend(request, monkeypatch, smollm2_tokenizer):
    if request.param == "mlx" and request.node.originalname in STORE_POLICY:
        # The store's policy alone (the base plans, the backend only runs rows): fake and
        # HF check it; MLX's CPU build runs a token ~10x slower than torch.
        pytest.skip("store policy: checked on the fake and HF backends")
    if request.param == "fake":
        yield FakeHarness(monkeypatch, smollm2_tokenizer)
    elif request.param == "hf":
        model, lora = request.getfixturevalue("hf_model"), request.getfixturevalue("random_lora")
        harness = HFHarness(monkeypatch, model, smollm2_tokenizer, lora)
        yield harness
        for lm in harness.with_adapters:  # the shared model gets its plain layers back
            lm.close()
    else:
        yield MlxHarness(monkeypatch, request.getfixturevalue("mlx_loaded"))


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer):
    return smollm2_tokenizer.encode("The old clockmaker opened his shop and said")  # 9 tokens


@pytest.fixture(scope="module")
def long_prompt(smollm2_tokenizer):
    text = "The old clockmaker opened his shop and said good morning to the town. " * 3
    return smollm2_tokenizer.encode(text)[:40]  # 2 blocks of 16 and 8 tokens


def blocks(lm, tokens):
    return -(-tokens // lm.store.block_size)


# -- the contract -----------------------------------------------------------------------------


async def test_rows_of_every_kind_in_one_batch_are_exact(backend, prompt):
    lm = backend.make()
    short, full = prompt[:6], prompt
    lm.batch_next_token_logprobs_sync([short, full])  # KV for two different past lengths
    queries = [
        full + [450],  # past 9, 1 new token
        short + [17],  # past 6, 1 new token
        prompt[:3],  # its KV comes from below (a slice of a longer prefix's)
        [5],  # nothing cached
        full + [450, 451, 452],  # past 9, 3 new tokens
        short + [17, 18, 19],  # past 6, 3 new tokens
        prompt[:2] + [3, 4, 5, 6],  # past 2 (from below), 4 new tokens
        short,  # logprobs cache hit
        full + [450],  # duplicate
    ]
    fed = backend.fed()
    results = await asyncio.gather(*(lm.next_token_logprobs(q) for q in queries))
    assert list(lm.batcher.batch_sizes)[-1] == len(set(map(tuple, queries)))
    # only the new tokens ran: 1 + 1 + 1 + 1 + 3 + 3 + 4 (the prefix of 3 reruns its last)
    assert backend.fed() - fed == 14
    for ids, got in zip(queries, results, strict=True):
        backend.assert_exact(lm, ids, got)
    for got in results:  # normalized (MLX's mx.logsumexp alone was off by 1.3e-4 here)
        assert torch.logsumexp(got.double(), 0).item() == pytest.approx(0.0, abs=1e-4)
    assert torch.equal(results[0], results[-1])
    results[-1][0] = 123.0  # the duplicate's caller edits its own row
    backend.assert_exact(lm, queries[0], results[0])


async def test_children_run_only_their_token_and_cached_rows_run_nothing(backend, prompt):
    lm = backend.make()
    first = await lm.next_token_logprobs(prompt)
    fed = backend.fed()
    children = [prompt + [t] for t in (11, 12, 13, 14)]
    results = await asyncio.gather(*(lm.next_token_logprobs(c) for c in children))
    assert backend.fed() - fed == 4  # one token per child
    grandchild = children[2] + [99]
    node, next_index, past, base = lm.walk_cache(grandchild)
    assert next_index == base == len(grandchild) - 1 == backend.past_tokens(past)
    results.append(await lm.next_token_logprobs(grandchild))
    assert backend.fed() - fed == 5
    for ids, got in zip(children + [grandchild], results, strict=True):
        backend.assert_exact(lm, ids, got)
    again = await lm.next_token_logprobs(prompt)
    assert backend.fed() - fed == 5 and torch.equal(again, first)  # from the logprobs cache
    again[0] = 123.0  # the caller's own copy
    assert not torch.equal(lm.next_token_logprobs_sync(prompt), again)


async def test_forks_share_the_prompt_blocks_and_every_row_is_exact(
    backend, long_prompt, random_walks
):
    lm = backend.make(max_kv_bytes=None)
    particles = 4
    seen = await random_walks(lm, long_prompt, particles)
    for ids, got in seen.items():
        backend.assert_exact(lm, ids, got)
    # the prompt's blocks are held once; each particle adds at most its own partial block(s)
    own = blocks(lm, (len(long_prompt) % lm.store.block_size) + 2)
    assert lm.store.held_blocks <= blocks(lm, len(long_prompt)) + particles * own
    assert lm.kv_nbytes == lm.store.held_blocks * lm.store.block_bytes  # nothing pinned


def test_cache_kv_pins_the_prompt_outside_the_budget_until_a_clear(backend, long_prompt):
    probe = backend.make()
    budget = probe.store.block_bytes  # one block
    lm = backend.make(max_kv_bytes=budget)
    backend.expected(lm, tuple(long_prompt), None)  # MLX: later references continue from it
    assert lm.cache_kv(long_prompt) is None
    forks = [long_prompt + [t, t + 1] for t in (5, 6, 7, 8)]
    fed = backend.fed()
    for ids, got in zip(forks, lm.batch_next_token_logprobs_sync(forks), strict=True):
        backend.assert_exact(lm, ids, got)
    assert backend.fed() - fed == 4 * 2  # the pinned prompt never reruns
    assert lm.kv_nbytes <= budget  # forks were evicted; the pinned prompt is outside it
    for token in range(2):  # traffic that evicts everything unpinned
        lm.next_token_logprobs_sync([token + 40, token + 41, token + 42] * 6)  # 2 blocks
        assert lm.kv_nbytes <= budget
    node, next_index, past, base = lm.walk_cache(long_prompt + [77])
    assert next_index == base == len(long_prompt) == backend.past_tokens(past) and node.pinned
    fed = backend.fed()
    backend.assert_exact(lm, long_prompt + [77], lm.next_token_logprobs_sync(long_prompt + [77]))
    assert backend.fed() - fed == 1
    lm.clear_kv_cache()
    assert lm.store.held_blocks == 0  # the pin and every row's hold are gone
    assert lm.walk_cache(long_prompt + [77]) == (lm.cache, 0, None, 0)
    lm.cache_kv(long_prompt[:5])
    lm.clear_cache()
    assert lm.walk_cache(long_prompt) == (lm.cache, 0, None, 0)
    assert lm.store.held_blocks == 0


async def test_a_tiny_budget_evicts_every_step_and_rows_stay_exact(backend, prompt):
    probe = backend.make()
    budget = 2 * probe.store.block_bytes
    lm = backend.make(max_kv_bytes=budget)
    seen = []

    async def particle(index):
        generator = torch.Generator().manual_seed(index)
        ctx = list(prompt) + [index]
        for _ in range(3):
            logps = await lm.next_token_logprobs(ctx)
            seen.append((tuple(ctx), logps))
            assert lm.kv_nbytes <= budget
            ctx = ctx + [torch.randint(0, 40_000, (1,), generator=generator).item()]

    await asyncio.gather(*(particle(i) for i in range(3)))
    for ids, got in seen:
        backend.assert_exact(lm, ids, got)
    # an evicted prefix is recomputed transparently
    lm.clear_cache()
    assert lm.walk_cache(seen[0][0]) == (lm.cache, 0, None, 0)
    backend.assert_exact(lm, seen[0][0], lm.next_token_logprobs_sync(seen[0][0]))


def test_eviction_releases_the_least_recently_used_prefix_first(backend):
    probe = backend.make()
    lm = backend.make(max_kv_bytes=2 * probe.store.block_bytes)
    rows = [[500 + i, 17, 18] for i in range(4)]  # one block each
    for ids in rows[:2]:
        lm.next_token_logprobs_sync(ids)
    lm.next_token_logprobs_sync(rows[0])  # a logprobs hit: rows[0] is used again
    lm.next_token_logprobs_sync(rows[2])  # evicts rows[1], the least recently used
    assert lm.store.held_blocks == 2
    assert [lm.walk_cache(ids + [19])[1] for ids in rows[:3]] == [3, 0, 3]
    lm.next_token_logprobs_sync(rows[3])  # evicts rows[0]
    assert [lm.walk_cache(ids + [19])[1] for ids in rows] == [0, 0, 3, 3]
    lm = backend.make(max_kv_bytes=2 * probe.store.block_bytes)
    for ids in rows[:3]:
        lm.next_token_logprobs_sync(ids)
    lm.next_token_logprobs_sync(rows[0] + [19])  # uses (and extends) rows[0]'s KV
    assert lm.walk_cache(rows[0] + [19, 20])[1] == 4
    for ids in [*rows, rows[3] + [19], rows[0] + [19]]:
        backend.assert_exact(lm, ids, lm.next_token_logprobs_sync(ids))


async def test_the_pool_grows_for_the_rows_and_shrinks_on_clears_and_trims(
    backend, prompt, monkeypatch
):
    monkeypatch.setattr(kv_blocks, "INITIAL_BLOCKS", 4)  # small steps: many resizes
    probe = backend.make()
    budget_blocks = 2
    lm = backend.make(max_kv_bytes=budget_blocks * probe.store.block_bytes)
    backend.expected(lm, tuple(prompt), None)  # MLX: later references continue from it
    assert backend.pool_blocks(lm) == lm.store.capacity == 4
    contexts = [list(prompt) + [i] for i in range(4)]
    bound = 1 + sum(blocks(lm, len(ctx)) + 1 for ctx in contexts)
    answers = await asyncio.gather(*(lm.next_token_logprobs(ctx) for ctx in contexts))
    grown = backend.pool_blocks(lm)
    assert 1 + budget_blocks < grown == lm.store.capacity <= bound  # the rows held more
    for ids, got in zip(contexts, answers, strict=True):
        backend.assert_exact(lm, ids, got)
    lm.cache_kv(prompt)
    lm.clear_kv_cache()  # pinned blocks too
    assert backend.pool_blocks(lm) == 4
    backend.assert_exact(lm, contexts[1], lm.next_token_logprobs_sync(contexts[1]))

    # trim: with nothing unpinned kept, a grown pool halves once the batch's rows let go,
    # and the pinned prompt (in the lowest blocks) survives the shrink (the store's policy
    # of repeated halvings: test_kv_store.py)
    lm = backend.make(max_kv_bytes=0)
    lm.cache_kv(prompt)
    sizes = []
    pool = backend.pool(lm)
    resize = pool.resize
    monkeypatch.setattr(pool, "resize", lambda n: sizes.append(n) or resize(n))
    lm.batch_next_token_logprobs_sync([prompt + [t] * 8 for t in (5, 6, 7, 8)])  # 2 blocks each
    assert max(sizes) >= 8 and backend.pool_blocks(lm) == max(sizes) // 2
    fed = backend.fed()
    backend.assert_exact(lm, prompt + [77], lm.next_token_logprobs_sync(prompt + [77]))
    assert backend.fed() - fed == 1  # the pinned prompt's KV was used after the shrink
    lm.clear_cache()
    assert backend.pool_blocks(lm) == 4
    backend.assert_exact(lm, prompt + [78], lm.next_token_logprobs_sync(prompt + [78]))


def test_clear_kv_cache_keeps_logprobs_and_clear_cache_forgets_all(backend, prompt):
    lm = backend.make()
    ids = prompt + [300]
    first = lm.next_token_logprobs_sync(ids)
    assert lm.walk_cache(ids + [5])[1] == len(ids)
    lm.next_token_logprobs_sync(ids + [4])  # ran on the KV of ids (held while it ran)
    lm.clear_kv_cache()  # every block is free again: none left held by a finished row
    assert lm.kv_nbytes == 0 and lm.store.held_blocks == 0
    assert lm.walk_cache(ids + [5]) == (lm.cache, 0, None, 0)
    fed = backend.fed()
    assert torch.equal(lm.next_token_logprobs_sync(ids), first)  # logprobs survived
    assert backend.fed() == fed
    backend.assert_exact(lm, ids + [5], lm.next_token_logprobs_sync(ids + [5]))
    assert backend.fed() - fed == len(ids) + 1  # no KV left: the whole prefix ran
    lm.clear_cache()
    assert lm.kv_nbytes == 0 and not lm.cache.children
    backend.assert_exact(lm, ids, lm.next_token_logprobs_sync(ids))
    assert backend.fed() - fed == 2 * len(ids) + 1


def test_add_query_and_batch_evaluate_queries(backend, prompt):
    lm = backend.make()
    queries = [prompt, prompt + [3], prompt]
    assert [lm.add_query(q) for q in queries] == [0, 1, 2]
    results = lm.batch_evaluate_queries()
    assert len(results) == 3 and torch.equal(results[0], results[2])
    for ids, got in zip(queries, results, strict=True):
        backend.assert_exact(lm, ids, got)
    assert lm.batch_evaluate_queries() == []
    lm.add_query(prompt)
    lm.reset_async_queries()  # empties the queue too
    assert lm.batch_evaluate_queries() == []
    batch = lm.batch_next_token_logprobs_sync([prompt[:4], prompt[:5]])
    assert batch.shape == (2, lm.vocab_size)
    backend.assert_exact(lm, prompt[:5], batch[1])


BAD_INPUTS = [
    ([], ValueError, "empty"),
    ([1, 2, 10**9], ValueError, "1000000000"),
    ([1, -3], ValueError, "-3"),
    ([1, 2.5], TypeError, "2.5"),
    (["7"], TypeError, "'7'"),
]


async def test_bad_input_fails_before_any_model_work(backend):
    lm = backend.make()
    batches = len(lm.batcher.batch_sizes)
    for bad, error, needle in BAD_INPUTS:
        for call in (lm.next_token_logprobs_sync, lm.cache_kv, lm.walk_cache, lm.add_query):
            with pytest.raises(error, match=needle):
                call(bad)
        with pytest.raises(error, match=needle):
            await lm.next_token_logprobs(bad)
        with pytest.raises(error, match=needle):
            lm.batch_next_token_logprobs_sync([[1, 2], bad])
    assert backend.fed() == 0 and len(lm.batcher.batch_sizes) == batches
    assert lm.batch_evaluate_queries() == [] and not lm.cache.children


async def test_a_failed_batch_reaches_every_caller_and_leaves_nothing_behind(backend, prompt):
    lm = backend.make()
    lm.cache_kv(prompt)
    held, logprobs_nbytes = lm.store.held_blocks, lm.store.logprobs_nbytes
    backend.fail_next()
    queries = [prompt + [t] for t in range(3)] + [[300], [301, 302]]
    outcomes = await asyncio.gather(
        *(lm.next_token_logprobs(q) for q in queries), return_exceptions=True
    )
    assert all(isinstance(o, RuntimeError) and "on purpose" in str(o) for o in outcomes)
    assert lm.store.held_blocks == held  # the rows' blocks went back; the pin stayed
    assert walk(lm.cache, tuple(queries[0]))[1] <= len(prompt)
    assert lm.store.logprobs_nbytes == logprobs_nbytes
    fed = backend.fed()
    results = await asyncio.gather(*(lm.next_token_logprobs(q) for q in queries))
    assert backend.fed() - fed == 3 + 1 + 2  # the pinned prompt is still used
    for ids, got in zip(queries, results, strict=True):
        backend.assert_exact(lm, ids, got)


async def test_a_cancelled_caller_does_not_disturb_the_others(backend, prompt):
    lm = backend.make()
    backend.assert_exact(lm, prompt, lm.next_token_logprobs_sync(prompt))
    tasks = [asyncio.create_task(lm.next_token_logprobs(prompt + [t])) for t in range(4)]
    await asyncio.sleep(0)
    tasks[1].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[1], asyncio.CancelledError)
    for t in (0, 2, 3):
        backend.assert_exact(lm, prompt + [t], done[t])
    # queued requests dropped by reset_async_queries are cancelled; later ones are served
    tasks = [asyncio.create_task(lm.next_token_logprobs([320 + i])) for i in range(3)]
    await asyncio.sleep(0)
    lm.reset_async_queries()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(d, asyncio.CancelledError) for d in done)
    backend.assert_exact(lm, [321], await lm.next_token_logprobs([321]))


async def test_without_kv_reuse_every_row_runs_its_whole_prefix_exactly(backend, prompt):
    backend.no_kv_reuse()
    with pytest.warns(UserWarning, match="KV reuse is off"):
        lm = backend.make()
    assert not lm.kv_reuse
    lm.next_token_logprobs_sync(prompt)
    queries = [prompt + [5], prompt[:4], [7, 8]]
    fed = backend.fed()
    results = await asyncio.gather(*(lm.next_token_logprobs(q) for q in queries))
    assert backend.fed() - fed == sum(map(len, queries))
    for ids, got in zip(queries, results, strict=True):
        backend.assert_exact(lm, ids, got)
    assert lm.walk_cache(prompt + [5, 6]) == (lm.cache, 0, None, 0)
    with pytest.raises(NotImplementedError, match="KV reuse"):
        lm.cache_kv(prompt + [1, 2])


# peft 0.21's get_peft_model reads a property transformers 5.23 deprecated
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
async def test_adapters_have_their_own_rows_and_kv(backend, prompt, tmp_path):
    lm = backend.make()
    with pytest.raises(ValueError, match="add_new_lora"):
        lm.set_lora(lora_name="mine")
    ids = prompt + [42]
    for row in (ids, ids + [7]):  # the base model's answers, before any adapter is loaded
        backend.expected(lm, tuple(row), None)
    backend.add_adapter(lm, tmp_path / "mine", "mine")
    base = lm.next_token_logprobs_sync(ids)
    backend.assert_exact(lm, ids, base)
    fed = backend.fed()
    adapted = lm.next_token_logprobs_sync(ids, lora_name="mine")
    assert backend.fed() - fed == len(ids)  # the base model's KV is not reused
    backend.assert_exact(lm, ids, adapted, lora="mine")
    assert (adapted - base).abs().max().item() > 1e-2  # the adapter changes the answer
    # both in one batch, each on its own cached KV
    rows = [(ids + [7], None), (ids + [7], "mine"), (ids + [8, 9], "mine")]
    fed = backend.fed()
    results = await asyncio.gather(*(lm.next_token_logprobs(i, lora_name=n) for i, n in rows))
    assert backend.fed() - fed == 1 + 1 + 2
    for (row, name), got in zip(rows, results, strict=True):
        backend.assert_exact(lm, row, got, lora=name)
    lm.set_lora(lora_name="mine")
    backend.assert_exact(lm, ids + [8], lm.next_token_logprobs_sync(ids + [8]), lora="mine")
    lm.clear_lora()
    assert torch.equal(lm.next_token_logprobs_sync(ids), base)
    lm.remove_lora("mine")
    assert "mine" not in lm.store.roots
    with pytest.raises(ValueError, match="add_new_lora"):
        lm.next_token_logprobs_sync(ids, lora_name="mine")
    assert torch.equal(lm.next_token_logprobs_sync(ids), base)
