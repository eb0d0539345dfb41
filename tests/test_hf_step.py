"""A decode step of `AsyncTransformer` on a tiny random Llama (fast, no real model): its
kernel count (launches on a GPU) and host syncs do not grow with the particles or the
context, and its rows stay exact (against a plain transformers forward of each whole
context)."""

import threading

import pytest
import torch
from held_memory import assert_rows_hold_only_themselves
from op_count import OpCounter, kernel_launches, multi_tensor_launches
from small_models import tiny_gemma3, tiny_llama

from genlm.backend.kv.pool import BlockCopy, KVLayout
from genlm.backend.kv.torch_pool import TorchBlockPool
from genlm.backend.kv.tree import subtree, walk
from genlm.backend.llm.hf import AsyncTransformer

TOL = 1e-4  # float32 rows: batched / KV-reused / cascade vs one plain forward
# Hidden 32 (4 query / 2 KV heads of dim 8), weights wide enough that rows differ clearly
# between contexts.
MODEL = {"hidden_size": 32, "std": 0.3}


@pytest.fixture(scope="module")
def tiny_model(smollm2_tokenizer):
    return tiny_llama(len(smollm2_tokenizer), attn_implementation="sdpa", **MODEL)


def expected(model, vocab_size, ids):
    """The plain forward of the whole context: no cache, one row."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        return torch.log_softmax(logits[:vocab_size].float(), -1)


def counted_steps(lm, contexts, steps):
    """Run ``steps`` decode steps (each particle appends a token of its own, and gets a row
    of its own, as an awaiting caller does) and return each step's `OpCounter`, taken in
    the batcher's worker (`_answer_batch`: plan, forward, the callers' rows)."""
    counters = []
    serve = lm._answer_batch

    def counted(*args):
        assert threading.current_thread() is not threading.main_thread()
        with OpCounter() as counter:
            rows = serve(*args)
        counters.append(counter)
        return rows

    lm._answer_batch = counted
    for step in range(steps):
        assert len(lm._rows_sync([lm._query(c) for c in contexts])) == len(contexts)
        contexts = [c + [(7 * i + 11 * step) % 1000 + 1] for i, c in enumerate(contexts)]
    return counters


def particles(n, prompt):
    return [prompt + [i + 1] for i in range(n)]


@pytest.mark.parametrize(
    ("family", "attn_implementation", "prompt_tokens"),
    # with cascade attention; without (eager: none); a sliding-window hybrid (window 32)
    [("llama", "sdpa", 64), ("llama", "eager", 20), ("gemma3", "sdpa", 64)],
)
def test_a_steps_kernel_count_does_not_grow_with_particles_or_context(
    smollm2_tokenizer, family, attn_implementation, prompt_tokens
):
    if family == "llama":
        model = tiny_llama(len(smollm2_tokenizer), attn_implementation=attn_implementation, **MODEL)
    else:
        model = tiny_gemma3(len(smollm2_tokenizer), attn_implementation=attn_implementation)

    def step_kernels(n, context):
        lm = AsyncTransformer(model, smollm2_tokenizer, batch_size=n)
        prompt = [(5 * j) % 900 + 3 for j in range(context)]
        lm.next_token_logprobs_sync(prompt)
        # the steps after the first (for which a CPU pool grows to hold 128 rows' blocks)
        return [c.kernels for c in counted_steps(lm, particles(n, prompt), 3)[1:]]

    few = step_kernels(8, prompt_tokens)
    many = step_kernels(128, prompt_tokens)
    longer = step_kernels(8, prompt_tokens + 448)
    assert few == many == longer, (few, many, longer)


def test_kernels_are_counted_as_a_gpu_launches_them():
    """A view or an allocation launches none, a fused ``_foreach_*`` op one per chunk of
    tensors (ATen's ``multi_tensor_apply``), another ``_foreach_*`` op one per tensor, a
    ``cat`` one per 128 inputs: as CUDA's kernels do (the dispatcher sees one call each)."""
    rows = list(torch.zeros(300, 4).unbind())
    with torch.inference_mode(), OpCounter() as counter:
        torch._foreach_clone(rows[:5])
        copies = torch._foreach_mul(rows, 1.0)  # 300 tensors of one chunk: one launch
        torch._foreach_copy_([torch.empty_like(row) for row in rows[:2]], rows[:2])
        torch.cat(rows)
        torch.stack(rows[:128])
        rows[0].view(2, 2)
        rows[0] + 1
    assert counter.kernels == {
        "aten._foreach_clone.default": 5,
        "aten._foreach_mul.Scalar": 1,
        "aten.empty_like.default": 0,
        "aten._foreach_copy_.default": 1,
        "aten.cat.default": 3,
        "aten.stack.default": 1,
        "aten.view.default": 0,
        "aten.add.Tensor": 1,
    }
    assert sum(counter.counts.values()) == 9 and len(copies) == 300
    assert kernel_launches(torch.ops.aten.slice.Tensor, (rows[0],)) == 0


def test_a_fused_foreach_op_launches_once_per_chunk_of_tensors():
    """``multi_tensor_apply``'s launches: 448 tensors or 2,240 chunks of 65,536 elements
    each, a tensor split over two launches counted in both."""
    assert multi_tensor_launches([], 2) == 0
    assert multi_tensor_launches([49_152] * 128, 2) == 1  # 128 rows of SmolLM2's vocabulary
    assert multi_tensor_launches([131_072] * 128, 2) == 1  # 256 chunks
    assert multi_tensor_launches([49_152] * 449, 2) == 2
    assert multi_tensor_launches([65_536 * 1_000, 65_536 * 2_000], 2) == 2  # 3,000 chunks
    assert multi_tensor_launches([65_536 * 2_240, 1], 2) == 2
    assert multi_tensor_launches([1] * 771, 1) == 2


def test_a_step_makes_no_host_sync_per_particle(tiny_model, smollm2_tokenizer):
    syncs = {}
    for n in (8, 32):
        lm = AsyncTransformer(tiny_model, smollm2_tokenizer, batch_size=n)
        prompt = list(range(3, 80))
        lm.next_token_logprobs_sync(prompt)
        counters = counted_steps(lm, particles(n, prompt), 2)
        syncs[n] = [
            c.counts["aten._local_scalar_dense.default"] + c.counts["aten.item.default"]
            for c in counters
        ]
    assert syncs[8] == syncs[32]
    assert max(syncs[32]) <= 2


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
async def test_rows_of_forks_and_mixed_lengths_are_the_plain_forwards(
    smollm2_tokenizer, attn_implementation
):
    model = tiny_llama(len(smollm2_tokenizer), attn_implementation=attn_implementation, **MODEL)
    lm = AsyncTransformer(model, smollm2_tokenizer, batch_size=16)
    vocab = lm.vocab_size
    prompt = [(13 * j) % 700 + 2 for j in range(70)]  # 4 full blocks shared, then a partial one
    await lm.next_token_logprobs(prompt)
    contexts = particles(6, prompt)
    for step in range(3):
        # forks: particles 0-2 copy particle 3's path (a partly filled block is copied on
        # write), plus a fresh prefix and a shorter one in the same batch (other groups)
        queries = [*contexts, prompt[:30] + [step + 5, 9], prompt[:-7]]
        rows = await lm.batch_next_token_logprobs(queries)
        for ids, row in zip(queries, rows, strict=True):
            assert torch.allclose(row, expected(model, vocab, ids), atol=TOL), ids
        contexts = [contexts[3] if i < 3 else c for i, c in enumerate(contexts)]
        contexts = [c + [(17 * i + step) % 500 + 1] for i, c in enumerate(contexts)]


async def test_callers_rows_are_their_own_and_the_tree_counts_each_batch_once(
    tiny_model, smollm2_tokenizer
):
    """A batch's callers get a copy of its rows with storage of their own each: editing a
    row changes neither what the tree holds nor another caller's row, and a kept row holds
    only itself. The tree keeps views of each forward's batch, whose memory the logprobs
    budget counts once, until the batch's last row goes."""
    row_bytes = 4 * len(smollm2_tokenizer)
    lm = AsyncTransformer(
        tiny_model, smollm2_tokenizer, batch_size=8, max_logprobs_bytes=10 * row_bytes
    )
    prompt = list(range(3, 70))
    contexts = particles(8, prompt)
    await lm.next_token_logprobs(prompt)
    rows = lm._rows_sync([lm._query(c) for c in contexts])
    cached = [walk(lm.cache, tuple(c))[0].logprobs for c in contexts]
    assert len({row.untyped_storage().data_ptr() for row in cached}) == 1  # one batch
    assert_rows_hold_only_themselves(rows, lm.vocab_size)
    rows[3].fill_(0.0)  # a caller's edit reaches neither the tree nor the other callers
    for ids, row in [*zip(contexts, cached, strict=True), (contexts[2], rows[2])]:
        assert torch.allclose(row, expected(tiny_model, lm.vocab_size, ids), atol=TOL)
    assert lm.store.logprobs_nbytes == 9 * row_bytes  # the prompt's row and the batch of 8
    lm.next_token_logprobs_sync(prompt + [100])  # one row more: the budget is full
    assert lm.store.logprobs_nbytes == 10 * row_bytes
    # room made for one row more: the least recently used rows are the batch's (the
    # prompt's is used as each row's KV source), and its memory goes only with the last
    # of them, so all eight go for one
    lm.next_token_logprobs_sync(prompt + [101])
    kept = [walk(lm.cache, tuple(c))[0].logprobs is not None for c in [prompt, *contexts]]
    assert kept == [True] + [False] * 8 and lm.store.logprobs_nbytes == 3 * row_bytes
    again = lm.next_token_logprobs_sync(contexts[2])
    assert torch.allclose(again, expected(tiny_model, lm.vocab_size, contexts[2]), atol=TOL)
    again.fill_(0.0)  # nor an edit of a cached row's copy, nor of a stacked batch of them
    lm.batch_next_token_logprobs_sync(contexts).fill_(0.0)
    again = await lm.next_token_logprobs(contexts[2])
    assert torch.allclose(again, expected(tiny_model, lm.vocab_size, contexts[2]), atol=TOL)


def test_a_batch_larger_than_the_logprobs_budget_keeps_the_rows_that_fit(
    tiny_model, smollm2_tokenizer
):
    """Rows of a batch the budget cannot hold whole are copied apart: the most recent
    rows that fit stay cached (views would pin the batch, which does not fit)."""
    row_bytes = 4 * len(smollm2_tokenizer)
    lm = AsyncTransformer(
        tiny_model, smollm2_tokenizer, batch_size=8, max_logprobs_bytes=3 * row_bytes
    )
    contexts = particles(8, list(range(3, 40)))
    lm.batch_next_token_logprobs_sync(contexts)
    kept = [walk(lm.cache, tuple(c))[0].logprobs for c in contexts]
    assert [row is not None for row in kept] == [False] * 5 + [True] * 3
    assert lm.store.logprobs_nbytes == 3 * row_bytes
    for context, row in zip(contexts[5:], kept[5:], strict=True):
        assert row.untyped_storage().nbytes() == row_bytes
        assert torch.allclose(row, expected(tiny_model, lm.vocab_size, context), atol=TOL)


def test_rows_of_earlier_batches_stay_theirs_when_the_next_batches_run(
    tiny_model, smollm2_tokenizer
):
    """A batch's logprobs are written into one buffer that every batch reuses: the rows a
    caller holds and those the tree serves again stay the rows of their own contexts."""
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, batch_size=8)
    vocab = lm.vocab_size
    prompt = list(range(3, 40))
    first = particles(4, prompt)
    held = lm.batch_next_token_logprobs_sync(first)
    held_one = lm.next_token_logprobs_sync(first[0] + [5])
    lm.batch_next_token_logprobs_sync([c + [9] for c in first] + [prompt[:10]])  # two groups
    for ids, row in zip(first, held, strict=True):
        assert torch.allclose(row, expected(tiny_model, vocab, ids), atol=TOL)
    assert torch.allclose(held_one, expected(tiny_model, vocab, first[0] + [5]), atol=TOL)
    assert torch.equal(lm.batch_next_token_logprobs_sync(first), held)  # from the tree


def test_block_copies_copy_each_tokens_slot_and_nothing_else():
    layout = KVLayout(3, 2, 4, torch.float32, 4, torch.device("cpu"))
    pool = TorchBlockPool(layout, block_size=4)
    pool.resize(8)
    torch.manual_seed(0)
    for layer in pool.layers:
        layer.copy_(torch.randn(layer.shape))
    before = [layer.clone() for layer in pool.layers]
    copies = [BlockCopy(1, 5, 3), BlockCopy(2, 6, 4), BlockCopy(1, 7, 1)]
    pool.copy(copies)
    for old, layer in zip(before, pool.layers, strict=True):
        want = old.clone()
        for copy in copies:  # independent: token by token
            for j in range(copy.tokens):
                want[:, copy.target * 4 + j] = old[:, copy.source * 4 + j]
        assert torch.equal(layer, want)


async def test_a_prompt_longer_than_max_batch_tokens_is_prefilled_in_exact_chunks(
    tiny_model, smollm2_tokenizer
):
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, batch_size=4, max_batch_tokens=16)
    prompt = [(11 * j) % 600 + 4 for j in range(75)]
    queries = [prompt, prompt[:40] + [7, 8, 9]]  # 5 chunks; 3 rows of 16 tokens, split
    rows = await lm.batch_next_token_logprobs(queries)
    for ids, row in zip(queries, rows, strict=True):
        assert torch.allclose(row, expected(tiny_model, lm.vocab_size, ids), atol=TOL)
    children = [prompt + [t] for t in range(20, 24)]
    for ids, row in zip(children, await lm.batch_next_token_logprobs(children), strict=True):
        assert torch.allclose(row, expected(tiny_model, lm.vocab_size, ids), atol=TOL)


def test_cascade_is_the_models_own_attention_and_transformers_sdpa_stays(smollm2_tokenizer):
    """The cascade is reached through the model's call: the model's attention is set to one
    of our own name, which runs transformers' sdpa for any other forward (the same logits
    as before), and transformers' ``sdpa`` entry is left as it was for every other model."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from genlm.backend.llm.hf import CASCADE_ATTENTION

    model = tiny_llama(len(smollm2_tokenizer), attn_implementation="sdpa", **MODEL)
    ids = torch.tensor([list(range(3, 40))])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    with AsyncTransformer(model, smollm2_tokenizer) as lm:
        assert lm.runner.cascade and model.config._attn_implementation == CASCADE_ATTENTION
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
        with torch.inference_mode():
            assert torch.equal(model(input_ids=ids).logits, before)


def test_clearing_the_kv_detaches_the_nodes_it_empties_and_rows_stay_right(
    tiny_model, smollm2_tokenizer
):
    """Rounds of requests under a logprobs budget of two rows, each followed by
    `clear_kv_cache`: the tree keeps the paths to the two rows kept and no node more, the
    same size every round; the rows computed after a clear (on no KV, or on the KV of a
    prefix computed since) are those of the uncached forward."""
    row_bytes = 4 * len(smollm2_tokenizer)
    lm = AsyncTransformer(
        tiny_model, smollm2_tokenizer, batch_size=8, max_logprobs_bytes=2 * row_bytes
    )
    prompt = list(range(3, 40))
    sizes = []
    for round_ in range(3):
        contexts = [prompt + [100 * round_ + i + 1] for i in range(4)]
        lm.batch_next_token_logprobs_sync([prompt])
        lm.batch_next_token_logprobs_sync(contexts)
        lm.batch_next_token_logprobs_sync([c + [5] for c in contexts])
        lm.clear_kv_cache()
        nodes = subtree(lm.cache)
        sizes.append(len(nodes))
        kept = [walk(lm.cache, tuple(c + [5]))[0].logprobs is not None for c in contexts]
        assert kept == [False, False, True, True]
        for ids in (contexts[0] + [5], contexts[0] + [5, 6], prompt + [7]):
            got = lm.next_token_logprobs_sync(ids)
            torch.testing.assert_close(got, lm.next_token_logprobs_uncached(ids), atol=TOL, rtol=0)
    # the root, the prompt's nodes, and each of the two rows kept: its context's and its own
    assert sizes == [1 + len(prompt) + 2 * 2] * 3


def test_cascade_blocks_are_the_chains_longest_common_prefix(
    tiny_model, smollm2_tokenizer, monkeypatch
):
    """`cascade_blocks`' binary search finds, for every group of a resampled population,
    the blocks a brute-force walk over the chains finds (the common prefix within every
    plan's past, if long enough for the cascade)."""
    from genlm.backend.llm.hf import runner, step

    groups = []

    def checked(plans, block_size):
        found = step.cascade_blocks(plans, block_size)
        limit = min(plan.start for plan in plans) // block_size
        common = 0
        while common < limit and len({plan.chain[common] for plan in plans}) == 1:
            common += 1
        if len(plans) < 2 or common * block_size < step.CASCADE_MIN_SHARED:
            common = 0
        groups.append((found, common))
        return found

    monkeypatch.setattr(runner, "cascade_blocks", checked)
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, batch_size=32)
    prompt = [(13 * i) % 900 + 5 for i in range(100)]
    lm.next_token_logprobs_sync(prompt)  # the prompt's KV, which the particles share
    contexts = [prompt + [i % 4 + 1] for i in range(12)]
    for index in range(20):
        lm.batch_next_token_logprobs_sync(contexts)
        ancestors = [(5 * i + index) % len(contexts) for i in range(len(contexts))]
        contexts = [contexts[a] + [(3 * i + index) % 7 + 1] for i, a in enumerate(ancestors)]
    lm.close()
    assert groups and all(found == common for found, common in groups)
    assert any(common > 0 for _, common in groups)
