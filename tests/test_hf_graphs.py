"""Decode steps replayed from captured graphs (`genlm.backend.llm.hf.graphs`).

A CPU has no CUDA graphs: these tests give `AsyncTransformer` the `EagerRecorder` (a
"replay" runs the captured forward again over the bucket's static buffers), so what they
check is everything around the capture: the shape buckets, the padding rows, keys and
shared slots, the static buffers reused from step to step, the checks of a replay against
the eager forward and the fallback when one fails. Every row is compared with a plain
transformers forward of its whole context. benchmark/gpu.sh runs the CUDA capture itself.
"""

import functools
import logging

import pytest
import torch
from small_models import tiny_llama

import genlm.backend.llm.hf.model as hf_model
import genlm.backend.llm.hf.runner as hf_runner
from genlm.backend.kv.pool import KVLayout
from genlm.backend.kv.torch_pool import TorchBlockPool
from genlm.backend.llm.hf import AsyncTransformer
from genlm.backend.llm.hf.graphs import (
    MAX_ROWS,
    MAX_WIDTH,
    CudaRecorder,
    EagerRecorder,
    bucket_shape,
    recorder_for,
    round_down,
    round_up,
)
from genlm.backend.llm.hf.step import StepShape

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
    monkeypatch.setattr(hf_runner, "recorder_for", lambda device: recorder)
    return recorder


def expected(model, vocab_size, ids):
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        return torch.log_softmax(logits[:vocab_size].float(), -1)


def assert_rows(model, lm, contexts, rows):
    for ids, row in zip(contexts, rows, strict=True):
        assert torch.allclose(row, expected(model, lm.vocab_size, ids), atol=TOL), len(ids)


def test_buckets_round_rows_up_by_at_most_half_shared_slots_to_powers_of_two_widths_of_four():
    values = {round_up(n, 1) for n in range(1, 5000)}
    for n in range(1, 5000):
        rounded = round_up(n, 1)
        assert n <= rounded <= 1.5 * n
        assert round_up(rounded, 1) == rounded  # a bucket is its own bucket
        below = round_down(n)
        assert below <= n and below in values and not any(below < v <= n for v in values)
    assert round_up(3, 16) == 16
    assert sorted(v for v in values if v <= 256) == [
        1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256
    ]  # fmt: skip
    shape = bucket_shape(StepShape(rows=100, new=1, past=70, shared=1030))
    assert shape == StepShape(rows=128, new=1, past=255, shared=2048)
    assert bucket_shape(StepShape(rows=1, new=1, past=0, shared=0)) == StepShape(1, 1, 63, 16)
    assert bucket_shape(StepShape(rows=5, new=1, past=64, shared=1024)).shared == 1024
    assert bucket_shape(StepShape(rows=4, new=2, past=9, shared=0)) is None  # not a decode step
    assert bucket_shape(StepShape(rows=MAX_ROWS + 1, new=1, past=9, shared=0)) is None
    assert bucket_shape(StepShape(rows=2, new=1, past=MAX_WIDTH - 1, shared=0)).past == 4095
    assert bucket_shape(StepShape(rows=2, new=1, past=MAX_WIDTH, shared=0)) is None


def test_graphs_are_off_by_default_and_on_a_cpu(tiny_model, smollm2_tokenizer, recorder):
    """The default is the eager step, the path a GPU has run; graphs only when asked for,
    and only where a recorder is (a CUDA device; here the stand-in)."""
    assert recorder_for(torch.device("cpu")) is None
    assert AsyncTransformer(tiny_model, smollm2_tokenizer).runner.graphs is None
    asked = AsyncTransformer(tiny_model, smollm2_tokenizer, cuda_graphs=True)
    assert asked.runner.graphs is not None and asked.runner.graphs.recorder is recorder
    assert AsyncTransformer(tiny_model, smollm2_tokenizer, cuda_graphs=False).runner.graphs is None


def test_a_bad_cuda_graphs_option_is_refused_before_any_work(tiny_model, smollm2_tokenizer):
    with pytest.raises(ValueError, match=r"cuda_graphs must be one of \(True, False\), got 'yes'"):
        AsyncTransformer(tiny_model, smollm2_tokenizer, cuda_graphs="yes")


@pytest.mark.parametrize(("particles", "prompt_tokens"), [(1, 20), (9, 150), (6, 40)])
async def test_replayed_steps_are_the_plain_forwards(
    tiny_model, smollm2_tokenizer, recorder, particles, prompt_tokens
):
    """Padded rows (9 -> 12), padded shared slots (144 shared tokens -> 256), one row
    reading its whole past as "shared", forks copying a partial block: each step's rows
    are the plain forwards', and later steps (which read the KV the replays wrote) too."""
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, cuda_graphs=True, batch_size=16)
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
    assert lm.runner.graphs.failure is None
    # the capture's eager forward and two checked replays; no step ran eagerly
    assert (lm.runner.graphs.checks, lm.runner.graphs.eager_steps) == (3, 0)


def test_steps_of_other_buckets_and_prefills_in_the_same_batch(
    tiny_model, smollm2_tokenizer, recorder
):
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, cuda_graphs=True, batch_size=32)
    prompt = list(range(3, 90))
    lm.next_token_logprobs_sync(prompt)
    few = [prompt + [i + 1] for i in range(3)]
    many = [prompt + [i + 1, 7] for i in range(12)]
    lm.batch_next_token_logprobs_sync(few + many)  # 3 rows captured; 12 of 2 tokens: eager
    for contexts in (few, many, [prompt[:10] + [5]]):
        # decode steps of 3 and 12 rows, then a prefill of 12 tokens (eager), each beside a
        # 60-token prefill (eager)
        contexts = [c + [9] for c in contexts]
        queries = contexts + [list(range(200, 260))]
        assert_rows(tiny_model, lm, queries, lm.batch_next_token_logprobs_sync(queries))
    # 12 rows after a graph of 3 with the same widths: rows that vary, captured to spare
    assert recorder.captures == 2 and [b.rows for b in lm.runner.graphs.graphs] == [3, 24]
    assert (
        one_output_buffer(lm.runner.graphs) and lm.runner.graphs._out.shape[0] == 32
    )  # batch_size
    few = [c + [9, 9] for c in few]
    assert_rows(tiny_model, lm, few, lm.batch_next_token_logprobs_sync(few))
    many = [c + [9, 9] for c in many]  # 12 rows: held by the 24-row graph
    assert_rows(tiny_model, lm, many, lm.batch_next_token_logprobs_sync(many))
    assert recorder.captures == 2 and [b.rows for b in lm.runner.graphs.graphs] == [3, 24]


def one_output_buffer(graphs):
    """Whether every graph writes its rows into the same buffer."""
    storages = {graph.out.untyped_storage().data_ptr() for graph in graphs.graphs.values()}
    return storages == {graphs._out.untyped_storage().data_ptr()}


def sized_once(monkeypatch, tiny_model, smollm2_tokenizer, free_blocks=0):
    """Give the LMs made after this the pool a CUDA device gets on the CPU: the real
    `fixed_pool_capacity`, as on a device with ``free_blocks`` blocks' worth of free
    memory per `CUDA_KV_MEMORY_FRACTION` (0: the pool is the KV budget's); returns the
    bytes of one block."""
    block = AsyncTransformer(tiny_model, smollm2_tokenizer).store.block_bytes
    free = int(free_blocks * block / hf_model.CUDA_KV_MEMORY_FRACTION)
    sized = hf_model.fixed_pool_capacity
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    monkeypatch.setattr(
        hf_model,
        "fixed_pool_capacity",
        lambda device, *args, **kwargs: sized(torch.device("cuda"), *args, **kwargs),
    )
    return block


def test_a_cuda_pool_for_graphs_is_the_larger_of_the_budget_and_a_share_of_the_free_memory(
    tiny_model, smollm2_tokenizer, monkeypatch
):
    layout = AsyncTransformer(tiny_model, smollm2_tokenizer).runner.pool.layout
    block = layout.block_bytes(16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * block, 0))
    cuda = torch.device("cuda")
    sized = functools.partial(hf_model.fixed_pool_capacity, cuda_graphs=True)
    assert sized(torch.device("cpu"), layout, block, 0.5) is None
    assert sized(cuda, layout, 10 * block, 0.5) == 1 + 50
    assert sized(cuda, layout, 80 * block + 5, 0.5) == 1 + 80
    assert sized(cuda, layout, None, 0.25) == 1 + 25


def test_a_default_lm_on_cuda_reserves_nothing_and_its_pool_follows_what_is_held(
    tiny_model, smollm2_tokenizer, monkeypatch
):
    """Without graphs a CUDA pool is not sized once (whatever the free memory): it starts
    small, grows for a batch and trims back, as on the CPU."""
    block = sized_once(monkeypatch, tiny_model, smollm2_tokenizer, free_blocks=10_000)
    layout = AsyncTransformer(tiny_model, smollm2_tokenizer).runner.pool.layout
    assert (
        hf_model.fixed_pool_capacity(torch.device("cuda"), layout, block, 0.5, cuda_graphs=False)
        is None
    )
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, batch_size=64, max_kv_bytes=8 * block)
    start = lm.store.capacity
    assert start < 10_000
    rows = [[i + 1] * 300 for i in range(8)]  # 19 blocks each, 152 in all
    assert_rows(tiny_model, lm, rows, lm.batch_next_token_logprobs_sync(rows))
    assert lm.store.capacity > start
    for _ in range(4):
        lm.batch_next_token_logprobs_sync([[7]])
    assert lm.store.capacity == start


def test_the_budget_is_what_a_cuda_pool_keeps_and_a_running_batch_may_use_the_rest(
    tiny_model, smollm2_tokenizer, recorder, monkeypatch
):
    """A budget of 8 blocks in a pool of 40 (a share of the free memory): a batch of 12
    blocks runs, then what is kept shrinks back to the budget; a batch over the pool fails
    before any work, and the next one is served."""
    block = sized_once(monkeypatch, tiny_model, smollm2_tokenizer, free_blocks=40)
    lm = AsyncTransformer(
        tiny_model, smollm2_tokenizer, cuda_graphs=True, batch_size=64, max_kv_bytes=8 * block
    )
    assert lm.store.capacity == 41
    rows = [[i + 1] * 40 for i in range(4)]  # 3 blocks each: 12 of 8
    assert_rows(tiny_model, lm, rows, lm.batch_next_token_logprobs_sync(rows))
    assert lm.kv_nbytes <= 8 * block
    too_many = [[i + 100] * 40 for i in range(14)]  # 42 blocks
    with pytest.raises(RuntimeError, match=r"the KV pool, sized once at 40 blocks, cannot hold"):
        lm.batch_next_token_logprobs_sync(too_many)
    assert_rows(tiny_model, lm, too_many[:13], lm.batch_next_token_logprobs_sync(too_many[:13]))
    assert lm.kv_nbytes <= 8 * block and lm.store.capacity == 41


def test_a_pool_sized_once_never_moves_and_its_graphs_are_never_captured_again(
    tiny_model, smollm2_tokenizer, recorder, monkeypatch
):
    """A burst that fills the pool evicts instead of growing it; clears keep it: the layers'
    addresses never change, and the bucket captured first is replayed after all that."""
    block = sized_once(monkeypatch, tiny_model, smollm2_tokenizer)
    lm = AsyncTransformer(
        tiny_model, smollm2_tokenizer, cuda_graphs=True, batch_size=64, max_kv_bytes=40 * block
    )
    assert lm.store.capacity == 41
    addresses = [layer.data_ptr() for layer in lm.runner.pool.layers]
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
    assert [layer.data_ptr() for layer in lm.runner.pool.layers] == addresses
    assert recorder.captures == 1 and recorder.eager_runs == 3


def test_a_batch_that_a_pool_sized_once_cannot_hold_fails_before_any_work(
    tiny_model, smollm2_tokenizer, recorder, monkeypatch
):
    """... with an error that names the budget; the LM serves the next batch that fits."""
    block = sized_once(monkeypatch, tiny_model, smollm2_tokenizer)
    lm = AsyncTransformer(
        tiny_model, smollm2_tokenizer, cuda_graphs=True, batch_size=64, max_kv_bytes=8 * block
    )
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
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, cuda_graphs=True, batch_size=4)
    context = [(13 * j) % 700 + 2 for j in range(70)]
    for step in range(96):
        row = lm.next_token_logprobs_sync(context)
        if step % 16 == 0:
            assert_rows(tiny_model, lm, [context], [row])
        context = context + [(7 * step) % 500 + 1]
    assert recorder.captures == 1  # 70 to 165 keys: the 255-key width bucket
    assert [(b.rows, b.past, b.shared) for b in lm.runner.graphs.graphs] == [(1, 255, 16)]
    assert lm.runner.graphs.replays == 95


def test_rows_sharing_fewer_than_the_cascade_minimum_take_no_shared_slots(
    tiny_model, smollm2_tokenizer, recorder
):
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, cuda_graphs=True, batch_size=8)
    prompt = list(range(3, 51))  # 3 full blocks: 48 shared tokens, under CASCADE_MIN_SHARED
    lm.next_token_logprobs_sync(prompt)
    contexts = [prompt + [i + 1] for i in range(4)]
    for step in range(3):
        assert_rows(tiny_model, lm, contexts, lm.batch_next_token_logprobs_sync(contexts))
        contexts = [c + [step + 2] for c in contexts]
    assert [(b.past, b.shared) for b in lm.runner.graphs.graphs] == [(63, 16)]


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
    monkeypatch.setattr(hf_runner, "recorder_for", lambda device: recorder)
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, cuda_graphs=True, batch_size=8)
    prompt = list(range(3, 50))
    lm.next_token_logprobs_sync(prompt)
    contexts = [prompt + [i + 1] for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="genlm.backend.llm.hf.graphs"):
        for step in range(4):
            assert_rows(tiny_model, lm, contexts, lm.batch_next_token_logprobs_sync(contexts))
            contexts = [c + [step + 2] for c in contexts]
    assert lm.runner.graphs.failure.startswith(
        "GraphMismatch: a replayed step differs from the eager forward by"
    )
    assert [r.getMessage() for r in caplog.records] == [
        f"CUDA graphs off for this model, steps run eagerly ({lm.runner.graphs.failure})"
    ]
    assert lm.runner.graphs.graphs == {}
    assert recorder.replays == replays  # none after the failure


class FailsAtCapture(CountingRecorder):
    def capture(self, forward):
        self.captures += 1
        raise RuntimeError("operation not permitted when stream is capturing")


class FailsAtReplay(CountingRecorder):
    """Replays fail from the fourth on (after the capture's and the two checked ones)."""

    def capture(self, forward):
        self.captures += 1

        def replay():
            self.replays += 1
            if self.replays > 3:
                raise RuntimeError("CUDA error: an illegal instruction was encountered")
            forward()

        return replay


class RaisesInsideTheForward(torch.overrides.TorchFunctionMode):
    """Raises at the second layer's KV write: what a capture does at an op it refuses,
    after the ops before it were recorded (here: ran, writing the first layer's KV)."""

    def __init__(self):
        super().__init__()
        self.writes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.index_copy_:
            self.writes += 1
            if self.writes > 2:
                raise RuntimeError("operation not permitted when stream is capturing")
        return func(*args, **(kwargs or {}))


class FailsMidForward(CountingRecorder):
    """Its capture records the forward by running it, and an op inside raises."""

    def capture(self, forward):
        self.captures += 1
        with RaisesInsideTheForward():
            forward()
        return forward


@pytest.mark.parametrize(
    ("failing", "message"),
    [
        (FailsAtCapture, "RuntimeError: operation not permitted when stream is capturing"),
        (FailsAtReplay, "RuntimeError: CUDA error: an illegal instruction was encountered"),
        (FailsMidForward, "RuntimeError: operation not permitted when stream is capturing"),
    ],
)
def test_a_capture_or_replay_that_raises_turns_graphs_off_and_the_step_runs_eagerly(
    tiny_model, smollm2_tokenizer, monkeypatch, caplog, failing, message
):
    """The step that failed still returns its rows (eagerly), later steps too, and the
    recorder is never used again."""
    recorder = failing()
    monkeypatch.setattr(hf_runner, "recorder_for", lambda device: recorder)
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, cuda_graphs=True, batch_size=8)
    prompt = [(13 * j) % 700 + 2 for j in range(70)]
    contexts = [prompt + [i + 1] for i in range(4)]
    lm.batch_next_token_logprobs_sync([prompt])
    with caplog.at_level(logging.WARNING, logger="genlm.backend.llm.hf.graphs"):
        for step in range(6):
            assert_rows(tiny_model, lm, contexts, lm.batch_next_token_logprobs_sync(contexts))
            contexts = [c + [(5 * i + step) % 300 + 1] for i, c in enumerate(contexts)]
    assert lm.runner.graphs.failure == message
    assert [r.getMessage() for r in caplog.records] == [
        f"CUDA graphs off for this model, steps run eagerly ({message})"
    ]
    assert lm.runner.graphs.graphs == {} and recorder.captures == 1
    assert recorder.replays == (4 if failing is FailsAtReplay else 0)
    assert lm.runner.graphs.eager_steps == (
        3 if failing is FailsAtReplay else 6
    )  # incl. the failed


def test_a_replayed_step_launches_a_few_kernels_besides_its_replay_for_any_rows(
    tiny_model, smollm2_tokenizer, recorder
):
    """Around the replay a step launches a fixed handful of kernels (its inputs copied in,
    its rows out, one copy of the rows for their callers): as many for 8 rows as for 128."""
    from op_count import OpCounter

    def kernels_besides_the_replay(n):
        lm = AsyncTransformer(tiny_model, smollm2_tokenizer, cuda_graphs=True, batch_size=n)
        contexts = [list(range(3, 90)) + [i + 1] for i in range(n)]
        for token in (2, 3, 4, 5):  # the prefill, the capture, two checked replays
            lm.batch_next_token_logprobs_sync(contexts)
            contexts = [c + [token] for c in contexts]
        (graph,) = lm.runner.graphs.graphs.values()
        replays, graph.replay = [], lambda: replays.append(1)  # the replay itself not counted
        serve, counter = lm._answer_batch, OpCounter()

        def counted(*args):  # on the batcher's worker: plan, step, the callers' rows
            with counter:
                return serve(*args)

        lm._answer_batch = counted
        rows = lm._rows_sync([lm._query(c) for c in contexts])  # one row per caller
        assert len(rows) == n and replays == [1] and lm.runner.graphs.replays == 4
        return counter.kernels

    few, many = kernels_besides_the_replay(8), kernels_besides_the_replay(128)
    assert few == many
    assert sum(few.values()) <= 5, few  # host tensor, batch, copy in, rows out, callers' copy


class FakeCuda:
    """What `CudaRecorder.capture` meets on a GPU, modelled on a CPU: torch's own
    ``torch.cuda.graph`` context manager (torch/cuda/graphs.py, run as it is) over stand-ins
    for what it calls into. They follow ATen's ``CUDAGraph::capture_begin`` /
    ``capture_end`` (aten/src/ATen/cuda/CUDAGraph.cpp) and the caching allocator: the
    capture's start registers it with the allocator (``beginAllocateToPool``: a pool
    reference, refused if the pool is being recorded to already); its end raises on an
    invalidated capture (``cudaStreamEndCapture``) before ending that registration;
    ``empty_cache`` asserts that no capture is underway; a graph whose capture ended gives
    its pool reference back when it is dropped."""

    def __init__(self, monkeypatch):
        self.default = object()
        self.current = self.default  # this thread's current stream
        self.underway = []  # pools the allocator records to (``captures_underway``)
        self.references = {}  # pool -> references (``use_count``)
        self.invalidated = False
        fake = self

        class Graph:
            def capture_begin(self, pool=None, capture_error_mode="global", **kwargs):
                assert fake.current is not fake.default  # a side stream
                if pool in fake.underway:
                    raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
                fake.references[pool] = fake.references.get(pool, 0) + 1
                fake.underway.append(pool)
                self.pool, self.ended, fake.invalidated = pool, False, False

            def capture_end(self):
                if fake.invalidated:
                    raise RuntimeError(
                        "CUDA error: operation not permitted when stream is capturing"
                    )
                fake.underway.remove(self.pool)
                self.ended = True

            def replay(self):
                pass

            def __del__(self):
                if getattr(self, "ended", False):
                    fake.references[self.pool] -= 1

        class Stream:
            device_index = 0

            def __init__(self, device=None):
                pass

        class StreamContext:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                self.previous, fake.current = fake.current, self.stream

            def __exit__(self, *args):
                fake.current = self.previous

        def empty_cache():
            if fake.underway:
                raise RuntimeError("INTERNAL ASSERT FAILED: captures_underway.empty()")

        def end_allocate_to_pool(device, pool):
            if pool not in fake.underway:
                raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
            fake.underway.remove(pool)

        def release_pool(device, pool):
            fake.references[pool] -= 1

        for name, value in {
            "CUDAGraph": Graph,
            "Stream": Stream,
            "stream": StreamContext,
            "graph_pool_handle": lambda: (0, 1),
            "current_stream": lambda device=None: fake.current,
            "synchronize": lambda device=None: None,
            "empty_cache": empty_cache,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: None, raising=False)
        monkeypatch.setattr(
            torch._C, "_cuda_endAllocateToPool", end_allocate_to_pool, raising=False
        )
        monkeypatch.setattr(torch._C, "_cuda_releasePool", release_pool, raising=False)

    def sync(self):
        """An op that syncs with the host: refused, and the capture invalidated."""
        self.invalidated = True
        raise RuntimeError("operation not permitted when stream is capturing")


def test_the_fake_cuda_shows_what_a_plain_failed_capture_leaves_behind(monkeypatch):
    """Without `CudaRecorder`'s care, torch's context manager leaves the capture stream
    current and the allocator recording (so the test below can fail)."""
    fake = FakeCuda(monkeypatch)
    stream, pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
    with pytest.raises(RuntimeError, match="operation not permitted"):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), pool=pool, stream=stream):
            fake.sync()
    assert fake.current is stream and fake.underway == [pool]
    with pytest.raises(RuntimeError, match="INTERNAL ASSERT"):
        torch.cuda.empty_cache()


def test_a_failed_cuda_capture_leaves_the_device_as_it_found_it(monkeypatch):
    """A forward that syncs (invalidating the capture) or raises in Python: the error
    reaches `DecodeGraphs`, this thread's stream is the one it was, no capture is left
    underway (empty_cache works, the pool can be captured into again) and no pool
    reference is left but the live graphs'."""
    fake = FakeCuda(monkeypatch)
    recorder = CudaRecorder(torch.device("cuda"))
    ran = []
    replay = recorder.capture(lambda: ran.append(1))
    assert ran == [1] and fake.current is fake.default and fake.references[recorder.pool] == 1

    def fails_in_python():
        raise ValueError("a Python error inside the forward")

    for forward, error in ((fake.sync, RuntimeError), (fails_in_python, ValueError)):
        with pytest.raises(error):
            recorder.capture(forward)
        assert fake.current is fake.default and fake.underway == []
        torch.cuda.empty_cache()
        assert fake.references[recorder.pool] == 1  # the first graph's, still alive
    recorder.capture(lambda: None)  # the pool can be recorded to again
    del replay
    assert fake.references[recorder.pool] == 0


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A tokenizer of the 256 bytes alone: a small vocabulary, so that a long run of many
    particles costs little."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    raw = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(alphabet)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=raw)


def test_smc_with_resampling_captures_a_handful_of_graphs_after_its_first_steps(
    byte_tokenizer, recorder
):
    """128 particles for 256 steps, resampled every 5 (multinomially, by the probability
    of a token under 40): after each resampling the distinct rows fall to about half and
    recover. Past the first 16 steps at most 4 graphs are captured: a graph of 128 rows
    holds 64 to 128, one more for the dips, at each width the particles' own keys grow
    into (255 and 1,023 keys). Rows checked against plain forwards along the way."""
    model = tiny_llama(len(byte_tokenizer), attn_implementation="sdpa", **MODEL)
    lm = AsyncTransformer(model, byte_tokenizer, cuda_graphs=True, batch_size=128)
    generator = torch.Generator().manual_seed(0)
    prompt = [(13 * j) % 250 + 2 for j in range(70)]
    particles, weights = [prompt] * 128, torch.zeros(128)
    captured, distinct = [], []
    for step in range(256):
        rows = lm.batch_next_token_logprobs_sync(particles)
        if step % 64 == 63:
            assert_rows(model, lm, particles[::40], rows[::40])
        tokens = torch.multinomial(rows.exp(), 1, generator=generator)[:, 0].tolist()
        weights += rows[:, :40].logsumexp(1)
        particles = [p + [t] for p, t in zip(particles, tokens, strict=True)]
        if step % 5 == 4:
            chosen = torch.multinomial(weights.softmax(0), 128, True, generator=generator)
            particles, weights = [particles[i] for i in chosen.tolist()], torch.zeros(128)
        captured.append(recorder.captures)
        distinct.append(len(set(map(tuple, particles))))
    assert min(distinct[16:]) < 80 and max(distinct[16:]) == 128  # falling and recovering
    assert captured[-1] - captured[15] <= 4, captured
    assert lm.runner.graphs.failure is None and lm.runner.graphs.replays >= 240


def test_a_shared_prefix_that_grows_runs_on_the_graph_it_had(
    tiny_model, smollm2_tokenizer, recorder
):
    """Particles all descending from one of them (SMC's genealogy collapsing): their
    shared prefix grows from 64 to 96 tokens, whose bucket has no graph; the graph of 64
    shared slots holds them, reading the 32 new shared tokens as each row's own keys."""
    lm = AsyncTransformer(tiny_model, smollm2_tokenizer, cuda_graphs=True, batch_size=8)
    prompt = [(13 * j) % 700 + 2 for j in range(70)]
    lm.next_token_logprobs_sync(prompt)
    contexts = [prompt + [i + 1] for i in range(6)]
    for step in range(30):
        rows = lm.batch_next_token_logprobs_sync(contexts)
        if step in (0, 29):
            assert_rows(tiny_model, lm, contexts, rows)
        contexts = [c + [(11 * i + step) % 400 + 1] for i, c in enumerate(contexts)]
    (bucket,) = lm.runner.graphs.graphs
    assert (bucket.shared, recorder.captures) == (64, 1)
    ancestor = contexts[0]  # 101 tokens: 6 full blocks
    contexts = [ancestor + [i + 1] for i in range(6)]
    for step in range(3):
        assert_rows(tiny_model, lm, contexts, lm.batch_next_token_logprobs_sync(contexts))
        contexts = [c + [step + 2] for c in contexts]
    assert list(lm.runner.graphs.graphs) == [bucket] and recorder.captures == 1


def test_a_cuda_pool_gives_the_layers_it_replaces_back_to_the_device(monkeypatch):
    """The caching allocator would keep a replaced layer reserved: a CUDA pool empties the
    cache after each resize and after `free` (not after its first allocation)."""
    layout = KVLayout(2, 2, 4, torch.float32, 4, torch.device("cuda"))
    pool = TorchBlockPool(layout)
    monkeypatch.setattr(pool, "_empty", lambda shape: torch.zeros(shape))
    released = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(len(pool.layers)))
    pool.resize(4)
    assert released == []
    pool.layers[1][:, 16:32] = 1.0
    pool.resize(8)
    assert released == [2] and pool.layers[1][:, 16:32].eq(1).all()
    pool.resize(2)
    assert released == [2, 2] and pool.layers[1][:, 16:32].eq(1).all()
    pool.free()
    assert released == [2, 2, 0]
