"""Decode steps replayed from captured graphs (`genlm.backend.llm.hf.graphs`).

A CPU has no CUDA graphs: these tests give `AsyncTransformer` the `EagerRecorder` (a
"replay" runs the captured forward again over the bucket's static buffers), so what they
check is everything around the capture: the shape buckets, the padding rows, keys and
shared slots, the static buffers reused from step to step, the checks of a replay against
the eager forward and the fallback when one fails. Every row is compared with a plain
transformers forward of its whole context. benchmark/gpu.sh runs the CUDA capture itself.
"""

import logging

import pytest
import torch
from small_models import tiny_llama

import genlm.backend.llm.hf.model as hf_model
from genlm.backend.llm.hf import AsyncTransformer
from genlm.backend.llm.hf.graphs import (
    MAX_ROWS,
    MAX_WIDTH,
    EagerRecorder,
    bucket_shape,
    recorder_for,
    round_up,
)
from genlm.backend.llm.hf.paged import StepShape

TOL = 1e-4  # float32 rows vs one plain forward
MODEL = {"hidden_size": 32, "std": 0.3}


class CountingRecorder(EagerRecorder):
    """The eager stand-in, counting captures and replays."""

    def __init__(self):
        self.captures = 0
        self.replays = 0
        self.eager_runs = 0

    def run_eagerly(self, forward):
        self.eager_runs += 1
        forward()

    def capture(self, forward):
        self.captures += 1

        def replay():
            self.replays += 1
            forward()

        return replay


@pytest.fixture(scope="module")
def tiny_model(smollm2_tokenizer):
    return tiny_llama(len(smollm2_tokenizer), attn_implementation="sdpa", **MODEL)


@pytest.fixture
def recorder(monkeypatch):
    recorder = CountingRecorder()
    monkeypatch.setattr(hf_model, "recorder_for", lambda device: recorder)
    return recorder


def expected(model, vocab_size, ids):
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        return torch.log_softmax(logits[:vocab_size].float(), -1)


def assert_rows(model, lm, contexts, rows):
    for ids, row in zip(contexts, rows, strict=True):
        assert torch.allclose(row, expected(model, lm.vocab_size, ids), atol=TOL), len(ids)


def test_buckets_round_up_by_at_most_a_quarter_and_widths_by_powers_of_four():
    for n in range(1, 5000):
        rounded = round_up(n, 1)
        assert n <= rounded <= max(n, 1.25 * n)
        assert round_up(rounded, 1) == rounded  # a bucket is its own bucket
    assert round_up(3, 16) == 16
    assert len({round_up(n, 1) for n in range(1, 257)}) == 28
    shape = bucket_shape(StepShape(rows=100, new=1, past=70, shared=1030))
    assert shape == StepShape(rows=112, new=1, past=255, shared=1280)
    assert bucket_shape(StepShape(rows=1, new=1, past=0, shared=0)) == StepShape(1, 1, 63, 16)
    assert bucket_shape(StepShape(rows=4, new=2, past=9, shared=0)) is None  # not a decode step
    assert bucket_shape(StepShape(rows=MAX_ROWS + 1, new=1, past=9, shared=0)) is None
    assert bucket_shape(StepShape(rows=2, new=1, past=MAX_WIDTH - 1, shared=0)).past == 4095
    assert bucket_shape(StepShape(rows=2, new=1, past=MAX_WIDTH, shared=0)) is None


def test_no_graphs_on_a_cpu_or_when_turned_off(tiny_model, smollm2_tokenizer, recorder):
    assert recorder_for(torch.device("cpu")) is None
    assert AsyncTransformer(tiny_model, smollm2_tokenizer)._graphs is not None  # recorder
    assert AsyncTransformer(tiny_model, smollm2_tokenizer, cuda_graphs=False)._graphs is None


def test_a_bad_cuda_graphs_option_is_refused_before_any_work(tiny_model, smollm2_tokenizer):
    with pytest.raises(ValueError, match=r"cuda_graphs must be one of \(True, False\), got 'yes'"):
        AsyncTransformer(tiny_model, smollm2_tokenizer, cuda_graphs="yes")


@pytest.mark.parametrize(("particles", "prompt_tokens"), [(1, 20), (9, 150), (6, 40)])
async def test_replayed_steps_are_the_plain_forwards(
    tiny_model, smollm2_tokenizer, recorder, particles, prompt_tokens
):
    """Padded rows (9 -> 10), padded shared slots (144 shared tokens -> 160), one row
    reading its whole past as "shared", forks copying a partial block: each step's rows
    are the plain forwards', and later steps (which read the KV the replays wrote) too."""
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, batch_size=16)
    prompt = [(13 * j) % 700 + 2 for j in range(prompt_tokens)]
    await lm.next_token_logprobs(prompt)
    contexts = [prompt + [i + 1] for i in range(particles)]
    for step in range(5):
        rows = await lm.batch_next_token_logprobs(contexts)
        assert_rows(tiny_model, lm, contexts, rows)
        contexts = [contexts[-1] if i == 0 else c for i, c in enumerate(contexts)]  # a fork
        contexts = [c + [(17 * i + step) % 500 + 1] for i, c in enumerate(contexts)]
    assert recorder.captures == 1  # one bucket: the rows, widths and shared slots stay in it
    assert recorder.replays == 5
    assert lm._graphs.failure is None


def test_steps_of_other_buckets_and_prefills_in_the_same_batch(
    tiny_model, smollm2_tokenizer, recorder
):
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, batch_size=32)
    prompt = list(range(3, 90))
    lm.next_token_logprobs_sync(prompt)
    few = [prompt + [i + 1] for i in range(3)]
    many = [prompt + [i + 1, 7] for i in range(12)]
    lm.batch_next_token_logprobs_sync(few + many)
    for contexts in (few, many, [prompt[:10] + [5]]):
        # decode steps of two buckets (3 and 12 rows), two new tokens (eager), each beside
        # a 60-token prefill (eager)
        contexts = [c + [9] for c in contexts]
        queries = contexts + [list(range(200, 260))]
        assert_rows(tiny_model, lm, queries, lm.batch_next_token_logprobs_sync(queries))
    # the 12-row bucket's larger output buffer replaced the 3-row one's, and its graph
    assert recorder.captures == 2 and [b.rows for b in lm._graphs.graphs] == [12]
    assert one_output_buffer(lm._graphs)
    few = [c + [9, 9] for c in few]
    assert_rows(tiny_model, lm, few, lm.batch_next_token_logprobs_sync(few))
    assert recorder.captures == 3  # a smaller bucket: added beside the larger one
    assert [b.rows for b in lm._graphs.graphs] == [12, 3]
    assert one_output_buffer(lm._graphs)


def one_output_buffer(graphs):
    """Whether every graph writes its rows into the same buffer."""
    storages = {graph.out.untyped_storage().data_ptr() for graph in graphs.graphs.values()}
    return storages == {graphs._out.untyped_storage().data_ptr()}


def sized_once(monkeypatch, tiny_model, smollm2_tokenizer):
    """Give the LMs made after this the pool a CUDA device gets (sized once from the KV
    budget) on the CPU; returns the bytes of one block."""
    block = AsyncTransformer(tiny_model, smollm2_tokenizer).store.block_bytes

    def capacity(device, layout, max_kv_bytes):
        return 1 + max_kv_bytes // block

    monkeypatch.setattr(hf_model, "fixed_pool_capacity", capacity)
    return block


def test_a_pool_sized_once_never_moves_and_its_graphs_are_never_captured_again(
    tiny_model, smollm2_tokenizer, recorder, monkeypatch
):
    """A burst that fills the pool evicts instead of growing it; clears keep it: the layers'
    addresses never change, and the bucket captured first is replayed after all that."""
    block = sized_once(monkeypatch, tiny_model, smollm2_tokenizer)
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, batch_size=64, max_kv_bytes=40 * block)
    assert lm.store.capacity == lm.store.fixed_capacity == 41
    addresses = [layer.data_ptr() for layer in lm._pool.layers]
    prompt = list(range(3, 40))
    contexts = [prompt + [i + 1] for i in range(2)]  # 3 blocks each
    lm.batch_next_token_logprobs_sync(contexts)
    for token in (5, 6, 7):  # capture, then two checked replays
        contexts = [c + [token] for c in contexts]
        assert_rows(tiny_model, lm, contexts, lm.batch_next_token_logprobs_sync(contexts))
    assert recorder.captures == 1 and recorder.eager_runs == 3
    # 13 unrelated prefixes of 3 blocks each: 39 blocks, 34 free: the particles are evicted
    fresh = [[900 + i] + list(range(300, 340)) for i in range(13)]
    assert_rows(tiny_model, lm, fresh, lm.batch_next_token_logprobs_sync(fresh))
    assert [lm.walk_cache(c + [1])[1] for c in contexts] == [0, 0]
    for token in (8, 9):  # their contexts computed again, then a decode step: a replay
        contexts = [c + [token] for c in contexts]
        assert_rows(tiny_model, lm, contexts, lm.batch_next_token_logprobs_sync(contexts))
    lm.clear_kv_cache()
    lm.clear_cache()
    assert lm.store.capacity == 41
    assert [layer.data_ptr() for layer in lm._pool.layers] == addresses
    assert recorder.captures == 1 and recorder.eager_runs == 3


def test_a_batch_that_a_pool_sized_once_cannot_hold_fails_before_any_work(
    tiny_model, smollm2_tokenizer, recorder, monkeypatch
):
    """... with an error that names the budget; the LM serves the next batch that fits."""
    block = sized_once(monkeypatch, tiny_model, smollm2_tokenizer)
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, batch_size=64, max_kv_bytes=8 * block)
    too_many = [[i + 1] * 40 for i in range(4)]  # 3 blocks each: 12 of 8
    with pytest.raises(RuntimeError, match=r"the KV pool, sized once at 8 blocks, cannot hold"):
        lm.batch_next_token_logprobs_sync(too_many)
    assert lm.store.held_blocks == 0
    assert_rows(tiny_model, lm, too_many[:2], lm.batch_next_token_logprobs_sync(too_many[:2]))


def test_a_lone_row_reads_no_shared_prefix_and_captures_once(
    tiny_model, smollm2_tokenizer, recorder
):
    """A lone row takes the model's no-cascade decision (`cascade_blocks`): its whole past
    is its own keys, in a width bucket that a long generation meets rarely, not shared
    slots whose bucket changes every 16 tokens and then every quarter."""
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, batch_size=4)
    context = [(13 * j) % 700 + 2 for j in range(70)]
    for step in range(96):
        row = lm.next_token_logprobs_sync(context)
        if step % 16 == 0:
            assert_rows(tiny_model, lm, [context], [row])
        context = context + [(7 * step) % 500 + 1]
    assert recorder.captures == 1  # 70 to 165 keys: the 255-key width bucket
    assert [(b.rows, b.past, b.shared) for b in lm._graphs.graphs] == [(1, 255, 16)]
    assert lm._graphs.replays == 95


def test_rows_sharing_fewer_than_the_cascade_minimum_take_no_shared_slots(
    tiny_model, smollm2_tokenizer, recorder
):
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, batch_size=8)
    prompt = list(range(3, 51))  # 3 full blocks: 48 shared tokens, under CASCADE_MIN_SHARED
    lm.next_token_logprobs_sync(prompt)
    contexts = [prompt + [i + 1] for i in range(4)]
    for step in range(3):
        assert_rows(tiny_model, lm, contexts, lm.batch_next_token_logprobs_sync(contexts))
        contexts = [c + [step + 2] for c in contexts]
    assert [(b.past, b.shared) for b in lm._graphs.graphs] == [(63, 16)]


class Skewed(torch.overrides.TorchFunctionMode):
    """Adds 0.5 to every log-softmax written into an ``out=`` tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.log_softmax and "out" in (kwargs or {}):
            kwargs["out"].add_(0.5)
        return result


class SkewedReplay(CountingRecorder):
    """A capture whose replays are off from the first (a broken graph)."""

    def capture(self, forward):
        def replay():
            self.replays += 1
            with Skewed():
                forward()

        self.captures += 1
        return replay


class StaleReplay(CountingRecorder):
    """A capture whose replays repeat the captured step (inputs baked into the graph)."""

    def capture(self, forward):
        def replay():
            self.replays += 1

        self.captures += 1
        return replay


@pytest.mark.parametrize(("recorder", "replays"), [(SkewedReplay, 1), (StaleReplay, 2)])
def test_a_replay_that_differs_from_the_eager_forward_turns_graphs_off(
    tiny_model, smollm2_tokenizer, monkeypatch, caplog, recorder, replays
):
    """At capture (skewed) or at the next step's check (stale): a warning, the step and
    every later one run eagerly, and every row served is right."""
    recorder = recorder()
    monkeypatch.setattr(hf_model, "recorder_for", lambda device: recorder)
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, batch_size=8)
    prompt = list(range(3, 50))
    lm.next_token_logprobs_sync(prompt)
    contexts = [prompt + [i + 1] for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="genlm.backend.llm.hf.graphs"):
        for step in range(4):
            assert_rows(tiny_model, lm, contexts, lm.batch_next_token_logprobs_sync(contexts))
            contexts = [c + [step + 2] for c in contexts]
    assert lm._graphs.failure.startswith(
        "GraphMismatch: a replayed step differs from the eager forward by"
    )
    assert [r.getMessage() for r in caplog.records] == [
        f"CUDA graphs off for this model, steps run eagerly ({lm._graphs.failure})"
    ]
    assert lm._graphs.graphs == {}
    assert recorder.replays == replays  # none after the failure


def test_a_capture_that_fails_turns_graphs_off(tiny_model, smollm2_tokenizer, monkeypatch):
    class Refusing(CountingRecorder):
        def capture(self, forward):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(hf_model, "recorder_for", lambda device: Refusing())
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, batch_size=8)
    prompt = list(range(3, 50))
    contexts = [prompt + [i + 1] for i in range(4)]
    lm.batch_next_token_logprobs_sync([prompt])
    for _ in range(2):
        assert_rows(tiny_model, lm, contexts, lm.batch_next_token_logprobs_sync(contexts))
        contexts = [c + [3] for c in contexts]
    assert lm._graphs.failure == ("RuntimeError: operation not permitted when stream is capturing")


def test_a_replayed_step_launches_a_few_kernels_besides_its_replay_for_any_rows(
    tiny_model, smollm2_tokenizer, recorder
):
    """Around the replay a step launches a fixed handful of kernels (its inputs copied in,
    its rows out, one copy of the rows for their callers): as many for 8 rows as for 128."""
    from op_count import OpCounter

    def kernels_besides_the_replay(n):
        lm = AsyncTransformer(tiny_model, smollm2_tokenizer, batch_size=n)
        contexts = [list(range(3, 90)) + [i + 1] for i in range(n)]
        for token in (2, 3, 4, 5):  # the prefill, the capture, two checked replays
            lm.batch_next_token_logprobs_sync(contexts)
            contexts = [c + [token] for c in contexts]
        (graph,) = lm._graphs.graphs.values()
        replays, graph.replay = [], lambda: replays.append(1)  # the replay itself not counted
        serve, counter = lm._serve_batch, OpCounter()

        def counted(*args):  # on the batcher's worker: plan, step, the callers' rows
            with counter:
                return serve(*args)

        lm._serve_batch = counted
        rows = lm._run_batch([lm._query(c) for c in contexts])  # one row per caller
        assert len(rows) == n and replays == [1] and lm._graphs.replays == 4
        return counter.kernels

    few, many = kernels_besides_the_replay(8), kernels_besides_the_replay(128)
    assert few == many
    assert sum(few.values()) <= 5, few  # host tensor, batch, copy in, rows out, callers' copy
