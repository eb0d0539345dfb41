"""The CUDA paths: the HF backend, the tries and the output cache on a GPU (skipped without one).

Models are tiny Llamas with random weights and SmolLM2's tokenizer shipped with
`benchmark/gpu.py`, so these run on a CUDA machine where nothing can be downloaded and
no model is installed; `bash benchmark/gpu.sh` runs them. The tests are plain functions
(no pytest-asyncio needed). Every answer is compared with an independent computation:
a plain forward of the whole prefix, on the CPU where it says so, or a brute-force sum.
"""

import asyncio

import gpu
import numpy as np
import pytest
import torch
from gpu_first import host_syncs

from genlm.backend.cache import OutputCache
from genlm.backend.llm.hf import AsyncTransformer
from genlm.backend.tokenization import Token
from genlm.backend.trie import (
    AsyncTokenCharacterTrie,
    ParallelTokenCharacterTrie,
    TokenCharacterTrie,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
# CUDA rows vs a CPU float32 forward: other kernels, and TF32 is off for float32 matmuls in
# torch by default, so only summation order differs; on a GPU not yet measured (no GPU lent).
TOL = 1e-4


@pytest.fixture(scope="module")
def tokenizer():
    return gpu.load_tokenizer()


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return gpu.prompt_of(tokenizer, 20)


# The share of free device memory a pool sized once for graphs takes here: the tests' LMs
# share one device, and each is closed when its test ends.
GRAPH_POOL_FRACTION = 0.01


@pytest.fixture
def open_lm():
    """Make `AsyncTransformer`s (with graphs, a pool of `GRAPH_POOL_FRACTION`) that are
    closed when the test ends, so that no test leaves device memory to the collector."""
    made = []

    def make(model, tokenizer, **options):
        if options.get("cuda_graphs"):
            options.setdefault("cuda_kv_memory_fraction", GRAPH_POOL_FRACTION)
        made.append(AsyncTransformer(model, tokenizer, **options))
        return made[-1]

    yield make
    for lm in made:
        lm.close()


def reference(model, ids, vocab_size):
    """Plain forward of the whole prefix on the model's device, no cache, float32 on the CPU."""
    device = model.get_input_embeddings().weight.device
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(ids)], device=device)).logits
        return torch.log_softmax(logits[0, -1, :vocab_size].float(), -1).cpu()


def gather(lm, prefixes):
    async def run():
        return await asyncio.gather(*(lm.next_token_logprobs(p) for p in prefixes))

    return asyncio.run(run())


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_batched_and_kv_reused_rows_match_cpu_forwards(open_lm, tokenizer, prompt, attention):
    cpu_model = gpu.build_model("tiny", "cpu", attn_implementation=attention)
    model = gpu.build_model("tiny", "cuda", attn_implementation=attention)
    model.load_state_dict(cpu_model.state_dict())
    lm = open_lm(model, tokenizer, batch_size=16)
    first = [prompt, prompt[:7], prompt[:7] + [11], prompt[3:]]
    second = [prompt + [5], prompt[:7] + [11, 12], prompt[:7] + [13, 14, 15], prompt[3:] + [1]]
    for prefixes in (first, second):  # padded mixed lengths, then extensions of cached KV
        for ids, got in zip(prefixes, gather(lm, prefixes), strict=True):
            assert got.device.type == "cuda" and got.dtype == torch.float32
            expected = reference(cpu_model, ids, lm.vocab_size)
            assert (got.cpu() - expected).abs().max().item() <= TOL
    assert lm.kv_nbytes > 0
    node, start, past, _ = lm.walk_cache(prompt + [5, 6])
    assert start == len(prompt) + 1 and past.device.type == "cuda"
    expected = reference(cpu_model, prompt + [5, 6], lm.vocab_size)
    assert (lm.next_token_logprobs_sync(prompt + [5, 6]).cpu() - expected).abs().max() <= TOL


def test_a_small_kv_budget_evicts_cuda_buffers_and_stays_exact(open_lm, tokenizer, prompt):
    model = gpu.build_model("tiny", "cuda")
    budget = 64 * 1024
    lm = open_lm(model, tokenizer, batch_size=8, max_kv_bytes=budget)
    contexts = [prompt[: 4 + i] for i in range(8)]
    for step in range(4):
        for ids, got in zip(contexts, gather(lm, contexts), strict=True):
            assert (got.cpu() - reference(model, ids, lm.vocab_size)).abs().max() <= TOL
        assert lm.kv_nbytes <= budget
        contexts = [ids + [step + 1] for ids in contexts]


def test_bfloat16_model_answers_float32_normalized_rows(open_lm, tokenizer, prompt):
    model = gpu.build_model("tiny-bf16", "cuda")
    lm = open_lm(model, tokenizer)
    for got in gather(lm, [prompt, prompt[:5], prompt[:5] + [9]]):
        assert got.dtype == torch.float32 and got.device.type == "cuda"
        assert abs(torch.logsumexp(got, 0).item()) <= TOL


def test_decode_steps_replayed_from_cuda_graphs_are_the_plain_forwards(open_lm, tokenizer, prompt):
    """Particles forking and extending a shared prompt: every decode step after the first
    of its bucket is a graph replay, and every row is a CPU forward's."""
    cpu_model = gpu.build_model("tiny", "cpu")
    model = gpu.build_model("tiny", "cuda")
    model.load_state_dict(cpu_model.state_dict())
    lm = open_lm(model, tokenizer, batch_size=16, cuda_graphs=True)
    lm.next_token_logprobs_sync(prompt + prompt)
    contexts = [prompt + prompt + [i + 1] for i in range(9)]  # 9 rows: a padding row
    for step in range(12):
        for ids, got in zip(contexts, lm.batch_next_token_logprobs_sync(contexts), strict=True):
            assert (got.cpu() - reference(cpu_model, ids, lm.vocab_size)).abs().max() <= TOL
        contexts = [contexts[-1] if i == 0 else c for i, c in enumerate(contexts)]  # a fork
        contexts = [c + [(7 * i + step) % 300 + 1] for i, c in enumerate(contexts)]
    graphs = lm.runner.graphs
    assert graphs is not None and graphs.failure is None, graphs and graphs.failure
    assert graphs.captures >= 1 and graphs.replays >= 12


def test_a_capture_that_fails_on_the_device_leaves_the_lm_and_the_device_usable(
    open_lm, tokenizer, prompt
):
    """A forward that syncs with the host while it is captured (refused, and the capture
    invalidated): the step and later ones run eagerly with rows equal to CPU forwards;
    the worker thread is back on the default stream, no capture is left underway
    (empty_cache works) and another LM captures and replays its graphs."""
    cpu_model = gpu.build_model("tiny", "cpu")
    model = gpu.build_model("tiny", "cuda")
    model.load_state_dict(cpu_model.state_dict())
    lm = open_lm(model, tokenizer, batch_size=16, cuda_graphs=True)
    forward = lm.runner.graphs.forward

    def syncing(step, out):
        forward(step, out)
        if torch.cuda.is_current_stream_capturing():
            out.sum().item()

    lm.runner.graphs.forward = syncing
    lm.next_token_logprobs_sync(prompt + prompt)
    contexts = [prompt + prompt + [i + 1] for i in range(5)]
    for step in range(4):
        for ids, got in zip(contexts, lm.batch_next_token_logprobs_sync(contexts), strict=True):
            assert (got.cpu() - reference(cpu_model, ids, lm.vocab_size)).abs().max() <= TOL
        contexts = [c + [(7 * i + step) % 300 + 1] for i, c in enumerate(contexts)]
    assert lm.runner.graphs.failure is not None and lm.runner.graphs.replays == 0
    worker_stream = lm.batcher.run_sync(torch.cuda.current_stream)
    assert worker_stream == torch.cuda.default_stream()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    other = open_lm(model, tokenizer, batch_size=16, cuda_graphs=True)
    for step in range(4):
        for ids, got in zip(contexts, other.batch_next_token_logprobs_sync(contexts), strict=True):
            assert (got.cpu() - reference(cpu_model, ids, lm.vocab_size)).abs().max() <= TOL
        contexts = [c + [step + 2] for c in contexts]
    assert other.runner.graphs.failure is None and other.runner.graphs.replays >= 3


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_decode_step_makes_no_host_sync(open_lm, tokenizer, prompt, cuda_graphs):
    """The eager step (the default) and a replayed one: inputs in one pinned copy, rows
    out on the device; the host waits for nothing."""
    model = gpu.build_model("tiny", "cuda")
    lm = open_lm(model, tokenizer, batch_size=64, cuda_graphs=cuda_graphs)
    contexts = [prompt + [i + 1] for i in range(64)]
    for step in range(4):  # with graphs: capture, two checked replays, one more
        lm.batch_next_token_logprobs_sync(contexts)
        contexts = [c + [step + 2] for c in contexts]
    torch.cuda.synchronize()
    replays = lm.runner.graphs.replays if cuda_graphs else 0
    _, syncs = host_syncs(lambda: lm.batch_next_token_logprobs_sync(contexts))
    if cuda_graphs:
        assert lm.runner.graphs.replays == replays + 1
    else:
        assert lm.runner.graphs is None
    assert syncs == []


def test_a_default_lm_reserves_what_it_holds_and_gives_back_what_it_trims(tokenizer, prompt):
    """No pool sized once without graphs: the caching allocator's reserve grows for a long
    batch, comes back down when the pool trims, and back to the model's own after
    `close()` (so a vLLM engine or another LM built next finds the memory free)."""
    model = gpu.build_model("tiny", "cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with_model = torch.cuda.memory_reserved()
    lm = AsyncTransformer(model, tokenizer, batch_size=64, max_kv_bytes=1 << 20)
    started = lm.store.capacity
    long_rows = [[i + 1] + prompt * 40 for i in range(32)]  # ~50 blocks each
    lm.batch_next_token_logprobs_sync(long_rows)
    grown = torch.cuda.memory_reserved()
    assert (
        lm.store.capacity > 8 * started
        and grown > with_model + lm.store.capacity // 2 * lm.store.block_bytes
    )
    for _ in range(8):
        lm.next_token_logprobs_sync(prompt[:3])
    assert lm.store.capacity == started
    trimmed = torch.cuda.memory_reserved()
    assert trimmed - with_model <= (grown - with_model) / 4
    lm.close()
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() - with_model <= 4 << 20


def test_bad_ids_fail_before_the_device(open_lm, tokenizer, prompt):
    lm = open_lm(gpu.build_model("tiny", "cuda"), tokenizer)
    vocab = lm.vocab_size
    for bad in ([vocab], [1, -1], [vocab + 10**6]):
        with pytest.raises(ValueError, match=str(bad[-1])):
            lm.next_token_logprobs_sync(bad)
        with pytest.raises(ValueError, match=str(bad[-1])):
            lm.next_token_logprobs_uncached(bad)
        with pytest.raises(ValueError, match=str(bad[-1])):
            gather(lm, [prompt, bad])
    torch.cuda.synchronize()  # a device-side assert would surface here
    expected = reference(lm.model, prompt, vocab)
    assert (lm.next_token_logprobs_sync(prompt).cpu() - expected).abs().max() <= TOL


VOCAB = [Token(i, s) for i, s in enumerate([b"a", b"ab", b"abc", b"b", b"ba", b"c", b"ab"])]


def brute_force(trie, ws, reduce):
    """Per node, ``reduce`` of the weights of the tokens whose bytes start with its prefix
    (a leaf: its own token only)."""
    leaf_position = {int(leaf): int(position) for position, leaf in trie.idx_to_leaf}
    out = []
    for node in range(trie.num_nodes):
        if node in leaf_position:
            out.append(ws[leaf_position[node]])
            continue
        prefix = list(trie.node2prefix[node])
        out.append(
            reduce(w for w, t in zip(ws, VOCAB, strict=True) if list(t)[: len(prefix)] == prefix)
        )
    return np.array(out)


def test_parallel_trie_on_cuda_matches_brute_force():
    trie = ParallelTokenCharacterTrie(VOCAB)
    assert trie.device == "cuda" and trie.sparse_kernels and trie.M.device.type == "cuda"
    batch = torch.softmax(torch.randn(3, len(VOCAB), generator=torch.Generator().manual_seed(0)), 1)
    sums = np.stack([brute_force(trie, ws.tolist(), sum) for ws in batch])
    maxs = np.stack([brute_force(trie, ws.tolist(), max) for ws in batch])
    for given in (batch, batch.cuda(), batch.numpy(), list(batch.cuda())):
        np.testing.assert_allclose(trie.batch_weight_sum(given), sums, rtol=1e-5)
        np.testing.assert_allclose(trie.batch_weight_max(given), maxs, rtol=1e-6)
    np.testing.assert_allclose(trie.weight_sum(batch[1].cuda()), sums[1], rtol=1e-5)
    np.testing.assert_allclose(trie.weight_max(batch[1].cuda()), maxs[1], rtol=1e-6)
    sequential = TokenCharacterTrie(VOCAB)  # fed CUDA tensors, it copies them to the host
    np.testing.assert_allclose(sequential.weight_sum(batch[2].cuda()), sums[2], rtol=1e-5)


def test_parallel_trie_results_in_pinned_blocks_or_a_device_tensor():
    """Host results come from reused pinned blocks (never one a caller still holds); an
    ``out`` tensor on the device gets the result with no host copy."""
    trie = ParallelTokenCharacterTrie(VOCAB)
    batch = torch.softmax(torch.randn(4, len(VOCAB), generator=torch.Generator().manual_seed(2)), 1)
    sums = np.stack([brute_force(trie, ws.tolist(), sum) for ws in batch])
    held = trie.batch_weight_sum(batch.cuda())
    assert torch.from_numpy(held).is_pinned()
    for _ in range(3):
        trie.batch_weight_sum(batch.flip(0).cuda())
    np.testing.assert_allclose(held, sums, rtol=1e-5)
    assert trie._results.allocated == 2
    out = torch.full((4, trie.num_nodes), torch.nan, device="cuda")
    assert trie.batch_weight_sum(batch.cuda(), out=out) is out
    np.testing.assert_allclose(out.cpu().numpy(), sums, rtol=1e-5)
    row = torch.full((trie.num_nodes,), torch.nan, device="cuda")
    assert trie.weight_max(batch[0].cuda(), out=row) is row
    np.testing.assert_allclose(row.cpu().numpy(), brute_force(trie, batch[0].tolist(), max))


def test_sampling_a_batch_of_cuda_rows_syncs_once():
    """`TokenSampler`'s kernel: one device-to-host copy for the whole batch."""
    from genlm.backend.sampling import sample_rows

    rows = list(torch.randn(128, 49_152, device="cuda").log_softmax(1))
    generator = torch.Generator("cuda").manual_seed(0)
    sample_rows(rows, 1.0, generator)  # warm-up
    torch.cuda.synchronize()
    tokens, syncs = host_syncs(lambda: sample_rows(rows, 1.0, generator))
    assert len(tokens) == 128 and all(0 <= t < 49_152 for t in tokens)
    assert len(syncs) == 1, syncs


def test_async_trie_batches_cuda_weights():
    async_trie = AsyncTokenCharacterTrie.from_vocab(VOCAB, backend="parallel")
    assert async_trie.trie.device == "cuda"
    batch = torch.softmax(torch.randn(5, len(VOCAB), generator=torch.Generator().manual_seed(1)), 1)

    async def run():
        return await asyncio.gather(*(async_trie.weight_sum(ws.cuda()) for ws in batch))

    got = asyncio.run(run())
    async_trie.shutdown()
    for ws, sums in zip(batch, got, strict=True):
        np.testing.assert_allclose(sums, brute_force(async_trie.trie, ws.tolist(), sum), rtol=1e-5)


def test_output_cache_keeps_cuda_values_off_the_gpu():
    cache = OutputCache(2, move_to_cpu=True)
    before = torch.cuda.memory_allocated()
    value = torch.arange(4096.0, device="cuda")
    expected = value.cpu()
    cache[[1, 2]] = value
    del value
    assert torch.cuda.memory_allocated() == before  # the cache holds a CPU copy only
    got = cache[[1, 2]]
    assert got.device.type == "cuda" and torch.equal(got.cpu(), expected)
