"""Issue 29: every option checked before any work, a repr that never crashes, and closed
means closed.

Bad options are sent to ``from_name`` with the loaders replaced by a sentinel that fails
the test if reached (so a refusal provably comes before any model loads), and to the
constructors with no model at all (the checks come first); good ones must reach the
sentinel. Closed LMs get every public method and must raise without starting a thread
(closed async tries: tests/test_trie_async.py).
"""

import inspect
import sys
import weakref

import pytest
import torch

from genlm.backend.checks import (
    check_budget,
    check_choice,
    check_int,
    check_seconds,
    fraction_option,
)
from genlm.backend.kv.mlx_pool import MlxBlockPool
from genlm.backend.kv.pool import KVLayout
from genlm.backend.kv.store import PrefixKVStore
from genlm.backend.kv.torch_pool import TorchBlockPool
from genlm.backend.llm import MockAsyncLM
from genlm.backend.sampling import check_sampling_args

NAN, INF = float("nan"), float("inf")


class Loaded(Exception):
    """Raised by the stand-in loaders: the options passed their checks."""


@pytest.fixture
def no_loading(monkeypatch):
    """Every loader `from_name` may reach raises `Loaded`."""
    import genlm.backend.models as models

    def loaded(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(models, "load_tokenizer", loaded)
    monkeypatch.setattr(models, "check_model_name", loaded)


# -- the checks themselves ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, error, message",
    [
        (NAN, TypeError, "max_kv_bytes must be an int number of bytes >= 0 or None .*float: nan"),
        (INF, TypeError, "float: inf"),
        (1.5e9, TypeError, "float: 1500000000.0"),
        (True, TypeError, "bool: True"),
        ("1GB", TypeError, "str: '1GB'"),
        (-1, ValueError, "max_kv_bytes must be an int number of bytes >= 0 or None .*got -1"),
    ],
)
def test_a_budget_is_an_int_number_of_bytes_or_none(value, error, message):
    with pytest.raises(error, match=message):
        check_budget("max_kv_bytes", value)


@pytest.mark.parametrize("value", [None, 0, 1, 2 << 40])
def test_budgets_accept_none_and_non_negative_ints(value):
    check_budget("max_kv_bytes", value)


def test_ints_seconds_and_choices_name_the_option_the_value_and_what_is_allowed():
    with pytest.raises(TypeError, match="size must be an int, got bool: False"):
        check_int("size", False)
    with pytest.raises(ValueError, match="size must be >= 1, got 0"):
        check_int("size", 0, minimum=1)
    for bad in (NAN, INF, -1, "1", True):
        with pytest.raises(ValueError, match=r"wait must be a finite number of seconds >= 0"):
            check_seconds("wait", bad)
    check_seconds("wait", None)
    with pytest.raises(ValueError, match=r"how must be one of \('a', 'b'\), got 'c'"):
        check_choice("how", "c", ("a", "b"))
    with pytest.raises(ValueError, match="got 1"):
        check_choice("how", 1, (True, "a"))  # 1 == True, but it is not the choice True


@pytest.mark.parametrize("bad", [10**400, -(10**400), NAN, 0, 1])
def test_a_fraction_no_float_holds_is_refused_naming_the_option(bad):
    """10**400 is an int that no float holds: a ValueError naming the option, not the
    OverflowError of its conversion."""
    with pytest.raises(ValueError, match=r"share must be a number strictly between 0 and 1, got "):
        fraction_option("share", bad)
    fraction_option("share", 0.25)


# -- from_name: every option checked before a model loads ----------------------------------------


HF_BAD_OPTIONS = [
    ({"max_batch_tokens": 0}, ValueError, "max_batch_tokens must be >= 1, got 0"),
    ({"max_batch_tokens": None}, TypeError, "max_batch_tokens must be an int, got NoneType"),
    ({"lora_batching": "bogus"}, ValueError, r"lora_batching must be one of .*'bogus'"),
    ({"max_kv_bytes": NAN}, TypeError, "max_kv_bytes must be an int number of bytes"),
    ({"max_kv_bytes": -1}, ValueError, "max_kv_bytes must be an int number of bytes"),
    ({"max_kv_bytes": 0.5}, TypeError, "max_kv_bytes .*float: 0.5"),
    ({"max_kv_bytes": True}, TypeError, "max_kv_bytes .*bool: True"),
    ({"max_logprobs_bytes": INF}, TypeError, "max_logprobs_bytes .*float: inf"),
    ({"batch_size": 0}, ValueError, "batch_size must be >= 1, got 0"),
    ({"timeout": -1}, ValueError, "timeout must be a finite number of seconds >= 0"),
    *(
        (
            {"cuda_kv_memory_fraction": bad},
            ValueError,
            f"cuda_kv_memory_fraction must be a number strictly between 0 and 1, got {bad!r}",
        )
        for bad in (0, 1, 1.5, -0.1, NAN, INF, True, "0.5", None, 10**400)
    ),
    ({"prefill_step_size": 4}, TypeError, "AsyncTransformer takes no option 'prefill_step_size'"),
]
MLX_BAD_OPTIONS = [
    ({"prefill_step_size": 0}, ValueError, "prefill_step_size must be >= 1, got 0"),
    ({"cache_size": -1}, ValueError, "cache_size must be >= 0, got -1"),
    ({"cache_size": 2.0}, TypeError, "cache_size must be an int, got float: 2.0"),
    ({"max_kv_bytes": NAN}, TypeError, "max_kv_bytes must be an int number of bytes"),
    ({"max_logprobs_bytes": -5}, ValueError, "max_logprobs_bytes .*got -5"),
    ({"batch_size": "8"}, TypeError, "batch_size must be an int, got str: '8'"),
    ({"timeout": NAN}, ValueError, "timeout must be a finite number of seconds >= 0"),
    ({"max_batch_tokens": 4}, TypeError, "AsyncMlxLM takes no option 'max_batch_tokens'"),
]
MOCK_BAD_OPTIONS = [
    ({"batch_size": 0}, ValueError, "batch_size must be >= 1, got 0"),
    ({"timeout": INF}, ValueError, "timeout must be a finite number of seconds >= 0"),
    ({"max_kv_bytes": 1}, TypeError, "MockAsyncLM takes no option 'max_kv_bytes'"),
]


def hf_class():
    from genlm.backend.llm.hf import AsyncTransformer

    return AsyncTransformer


def mlx_class():
    pytest.importorskip("mlx_lm")
    from genlm.backend.llm.mlx import AsyncMlxLM

    return AsyncMlxLM


@pytest.mark.parametrize("options, error, message", HF_BAD_OPTIONS)
def test_hf_options_are_refused_before_the_model_loads(no_loading, options, error, message):
    with pytest.raises(error, match=message):
        hf_class().from_name("any/model", **options)


@pytest.mark.parametrize("name", ["hf_opts", "bitsandbytes_opts"])
@pytest.mark.parametrize("bad", ["dtype=float16", [("dtype", "float16")]])
def test_hf_loading_options_are_dicts_refused_before_the_model_loads(no_loading, name, bad):
    message = rf"{name} must be a dict of keyword arguments or None, got {type(bad).__name__}"
    with pytest.raises(TypeError, match=message):
        hf_class().from_name("any/model", **{name: bad})


def test_bitsandbytes_opts_without_bitsandbytes_name_the_extra(no_loading, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # its import raises ImportError
    message = r"bitsandbytes_opts needs bitsandbytes: pip install -e .*\[bnb\]"
    with pytest.raises(ImportError, match=message):
        hf_class().from_name("any/model", bitsandbytes_opts={"load_in_8bit": True})


@pytest.mark.parametrize("options, error, message", HF_BAD_OPTIONS[:-1])
def test_hf_constructor_checks_its_options_first(options, error, message):
    with pytest.raises(error, match=message):  # no model, no tokenizer: the checks come first
        hf_class()(None, None, **options)


@pytest.mark.mlx
@pytest.mark.parametrize("options, error, message", MLX_BAD_OPTIONS)
def test_mlx_options_are_refused_before_the_model_loads(no_loading, options, error, message):
    with pytest.raises(error, match=message):
        mlx_class().from_name("any/model", **options)


@pytest.mark.mlx
@pytest.mark.parametrize("options, error, message", MLX_BAD_OPTIONS[:-1])
def test_mlx_constructor_checks_its_options_first(options, error, message):
    with pytest.raises(error, match=message):
        mlx_class()(None, None, **options)


@pytest.mark.parametrize("options, error, message", MOCK_BAD_OPTIONS)
def test_mock_options_are_refused_before_the_tokenizer_loads(no_loading, options, error, message):
    with pytest.raises(error, match=message):
        MockAsyncLM.from_name("any/model", **options)


@pytest.mark.parametrize(
    "options",
    [
        {"max_kv_bytes": None, "max_logprobs_bytes": None},
        {"max_kv_bytes": 0, "max_batch_tokens": 1, "lora_batching": "grouped", "timeout": None},
    ],
)
def test_hf_documented_values_are_accepted(no_loading, options):
    with pytest.raises(Loaded):
        hf_class().from_name("any/model", **options)


@pytest.mark.mlx
def test_mlx_documented_values_are_accepted(no_loading):
    with pytest.raises(Loaded):
        mlx_class().from_name("any/model", max_kv_bytes=None, cache_size=0, prefill_step_size=1)


# -- the KV layer's own arguments ---------------------------------------------------------------


class TinyPool:
    block_size = 4
    block_bytes = 8

    def resize(self, blocks):
        pass


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"max_kv_bytes": NAN}, TypeError, "max_kv_bytes .*float: nan"),
        ({"max_kv_bytes": -1}, ValueError, "max_kv_bytes .*got -1"),
        ({"max_kv_bytes": 10.5}, TypeError, "max_kv_bytes .*float: 10.5"),
        ({"max_kv_bytes": False}, TypeError, "max_kv_bytes .*bool: False"),
        ({"max_logprobs_bytes": INF}, TypeError, "max_logprobs_bytes .*float: inf"),
        ({"max_kv_entries": -1}, ValueError, "max_kv_entries must be >= 0, got -1"),
        ({"max_logprobs_entries": 1.0}, TypeError, "max_logprobs_entries must be an int or None"),
    ],
)
def test_store_budgets_are_checked(options, error, message):
    with pytest.raises(error, match=message):
        PrefixKVStore(TinyPool(), **options)


def test_a_store_refuses_a_pool_without_a_positive_block_size():
    pool = TinyPool()
    pool.block_size = 0
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        PrefixKVStore(pool)


@pytest.mark.parametrize("field", ["num_layers", "num_heads", "head_dim", "itemsize"])
@pytest.mark.parametrize("bad, error", [(-1, ValueError), (0, ValueError), (2.0, TypeError)])
def test_kv_layout_sizes_are_positive_ints(field, bad, error):
    sizes = {"num_layers": 2, "num_heads": 2, "head_dim": 4, "itemsize": 4, field: bad}
    with pytest.raises(error, match=f"KVLayout.{field} must be"):
        KVLayout(dtype=torch.float32, **sizes)


@pytest.mark.parametrize("pool", [TorchBlockPool, MlxBlockPool])
@pytest.mark.parametrize("bad, error", [(0, ValueError), (-16, ValueError), (16.0, TypeError)])
def test_block_pools_refuse_a_bad_block_size(pool, bad, error):
    layout = KVLayout(2, 2, 4, torch.float32, 4, torch.device("cpu"))
    with pytest.raises(error, match="block_size must be"):
        pool(layout, block_size=bad)


# -- temperature -------------------------------------------------------------------------------


def test_temperature_is_finite_and_within_what_the_backend_accepts():
    check_sampling_args(1, 1e300)  # our own draw scales in float64: any finite t > 0 works
    check_sampling_args(1, 2.0, max_temperature=2.0)
    for bad in (1e300, 2.5, INF, NAN, 0.0, -1.0):
        with pytest.raises(ValueError, match=r"temperature must be a finite number in \(0, 2.0\]"):
            check_sampling_args(1, bad, max_temperature=2.0)


async def test_sample_refuses_a_temperature_above_the_backends_maximum(smollm2_tokenizer):
    class Bounded(MockAsyncLM):
        max_temperature = 2.0

    with Bounded(smollm2_tokenizer) as lm:
        with pytest.raises(ValueError, match=r"in \(0, 2.0\], got 1e\+300"):
            await lm.sample([1, 2], 3, [0], temperature=1e300)
        with pytest.raises(ValueError, match=r"in \(0, 2.0\], got 3"):
            await lm.batch_sample([[1], [2]], 3, [0], temperature=3)
        assert lm.batcher.num_batches == 0
    with MockAsyncLM(smollm2_tokenizer) as lm:
        assert len(await lm.sample([1, 2], 3, [], temperature=1e300, seed=0)) == 3


# -- repr never crashes --------------------------------------------------------------------------

CHAIN = 5000


class ListPool:
    """A pure-Python pool: enough for the store to hand out blocks."""

    block_size = 16
    block_bytes = 64

    def __init__(self):
        self.blocks = 0

    def resize(self, blocks):
        self.blocks = blocks

    def copy(self, copies):
        pass

    def read(self, chain, tokens):
        return list(range(tokens))


def test_a_5000_token_chain_prints_one_short_line_per_node():
    store = PrefixKVStore(ListPool(), nbytes=len)
    ids = (7,) * CHAIN
    plan = store.plan([(ids, None)], 8, pin=True)  # the prefix's KV, pinned (`cache_kv`)
    store.commit(plan, [[0.0] * 8])
    root, deep = store.root(None), plan.rows[0].node
    assert repr(root) == (
        "KVNode(depth=0, token=None, children=1, blocks=0, pinned=False, logprobs=False)"
    )
    assert repr(deep) == (
        f"KVNode(depth={CHAIN}, token=7, children=0, blocks={-(-CHAIN // 16)}, pinned=True, "
        "logprobs=True)"
    )
    from genlm.backend.cache import TokenTrie

    assert TokenTrie is type(root)


async def test_the_cache_and_a_walk_print_short_after_a_5000_token_prefix(smollm2_tokenizer):
    from test_prefix_contract import FakeLM

    ids = [i % 1000 + 1 for i in range(CHAIN)]
    with FakeLM(smollm2_tokenizer) as lm:
        lm.next_token_logprobs_sync(ids)
        assert repr(lm.cache).startswith("KVNode(depth=0, token=None, children=1,")
        walk = lm.walk_cache(ids + [5])
        text = repr(walk)
        assert text == (
            f"CacheWalk(node=KVNode(depth={CHAIN}, token={ids[-1]}, children=0, "
            f"blocks={-(-CHAIN // 16)}, pinned=False, logprobs=True), "
            f"next_token_index={CHAIN}, past=<list of length {CHAIN}>, base={CHAIN})"
        )
        assert len(repr(lm.walk_cache([1]))) < 200


def test_a_walk_describes_a_tensor_past_by_its_shape():
    from genlm.backend.kv.store import KVNode
    from genlm.backend.llm.prefix import CacheWalk

    walk = CacheWalk(KVNode(), 3, torch.zeros(2, 2, 1, 3, 4), 3)
    assert "past=<Tensor of shape (2, 2, 1, 3, 4)>" in repr(walk)
    assert "past=None" in repr(CacheWalk(KVNode(), 0, None, 0))


# -- closed means closed -------------------------------------------------------------------------

LM_METHODS = [
    ("next_token_logprobs", [1]),
    ("next_token_logprobs_sync", [1]),
    ("batch_next_token_logprobs", [[1]]),
    ("batch_next_token_logprobs_sync", [[1]]),
    ("batch_next_token_logprobs_sync", []),
    ("sample", [1], 2, [0]),
    ("batch_sample", [[1]], 2, [0]),
    ("add_new_lora", "some/adapter", "a"),
    ("remove_lora", "a"),
    ("set_lora",),
    ("clear_lora",),
    ("clear_cache",),
    ("reset_async_queries",),
]
PREFIX_METHODS = [
    ("clear_kv_cache",),
    ("cache_kv", [1]),
    ("walk_cache", [1]),
    ("add_query", [1]),
    ("batch_evaluate_queries",),
]
METHODS = {
    "mock": LM_METHODS,
    "fake": LM_METHODS + PREFIX_METHODS,
    "hf": LM_METHODS + PREFIX_METHODS + [("next_token_logprobs_uncached", [1])],
    "mlx": LM_METHODS + PREFIX_METHODS,
}


def make_lm(kind, tokenizer):
    """A fast LM of each kind: the mock, the contract suite's fake, a tiny random Llama on
    transformers and on mlx-lm (the default model's vocabulary)."""
    if kind == "mock":
        return MockAsyncLM(tokenizer)
    if kind == "fake":
        from test_prefix_contract import FakeLM

        return FakeLM(tokenizer)
    if kind == "hf":
        from small_models import tiny_llama

        from genlm.backend.llm.hf import AsyncTransformer

        return AsyncTransformer(tiny_llama(len(tokenizer), 16, 2, 1), tokenizer)
    from test_mlx import tiny_llama

    return mlx_class()(tiny_llama(len(tokenizer), ["full_attention"]), tokenizer)


@pytest.fixture(
    scope="module", params=["mock", "fake", "hf", pytest.param("mlx", marks=pytest.mark.mlx)]
)
def closed_lm(request, smollm2_tokenizer):
    """An LM of each kind that served one request, then was closed (twice: idempotent)."""
    lm = make_lm(request.param, smollm2_tokenizer)
    lm.next_token_logprobs_sync([1, 2])
    lm.close()
    lm.close()
    return request.param, lm


def has_worker(batcher):
    """Whether ``batcher`` holds a worker thread (it starts one only through its executor)."""
    return batcher._executor is not None


ALL_CALLS = METHODS["hf"] + [call for call in METHODS["mlx"] if call not in METHODS["hf"]]


@pytest.mark.parametrize("call", ALL_CALLS, ids=[call[0] for call in ALL_CALLS])
async def test_every_method_of_a_closed_lm_raises_and_starts_no_thread(closed_lm, call):
    kind, lm = closed_lm
    if call not in METHODS[kind]:
        pytest.skip(f"{kind} has no {call[0]}")
    name, *args = call
    assert not has_worker(lm.batcher)
    with pytest.raises(RuntimeError, match=r"used after cleanup\(\) or close\(\)"):
        result = getattr(lm, name)(*args)
        if inspect.iscoroutine(result):
            await result
    assert not has_worker(lm.batcher)


async def test_a_call_racing_close_past_its_open_check_runs_nothing(closed_lm):
    """A call on another thread that passed the open check just before `close` reaches
    the batcher after it: it raises the LM's own closed error, starts no worker, and runs
    nothing on freed memory."""
    from genlm.backend.llm.base import Query

    kind, lm = closed_lm
    ids = Query((1, 2, 3))
    closed = rf"^{type(lm).__name__} used after cleanup\(\) or close\(\)"
    with pytest.raises(RuntimeError, match=closed):
        lm._rows_sync([ids])
    with pytest.raises(RuntimeError, match=closed):
        await lm.batcher.submit(ids)
    assert not has_worker(lm.batcher)


def pool_memory(kind, pool):
    """What holds a prefix-caching LM's KV memory: the fake's list of slots, HF's layer
    tensors (on CPU, each over a memory map of its own), MLX's keys and values arrays."""
    return {"fake": lambda: pool.data, "hf": lambda: pool.layers}.get(
        kind, lambda: pool.keys + pool.values
    )()


@pytest.mark.parametrize("kind", ["fake", "hf", pytest.param("mlx", marks=pytest.mark.mlx)])
async def test_close_frees_the_trees_logprobs_and_kv_memory_the_lm_still_holds(
    kind, smollm2_tokenizer
):
    """A closed LM kept alive (a reference, a cycle) holds no cache: `close` lets go of the
    trees (a root kept from before is empty), the logprobs, every KV block and the pool's
    memory itself (the layers are gone, not shrunk), HF's logprobs buffer and the
    `add_query` queue. `kv_nbytes` is then 0 and `cache` an empty root."""
    lm = make_lm(kind, smollm2_tokenizer)
    lm.cache_kv([1, 2, 3])  # a pinned prompt, outside the budget
    await lm.batch_next_token_logprobs([[1, 2, 3, 4], [5, 6]])
    lm.add_query([7])
    root, store, pool = lm.cache, lm.store, lm.runner.pool
    assert root.children and store.held_blocks and lm.kv_nbytes and store.logprobs_nbytes
    arrays = [] if kind == "fake" else [weakref.ref(array) for array in pool_memory(kind, pool)]
    assert pool_memory(kind, pool) and all(ref() is not None for ref in arrays)
    assert kind != "hf" or lm.runner.forward.head._logits is not None
    lm.close()
    lm.close()  # idempotent
    assert pool_memory(kind, pool) == [] and all(ref() is None for ref in arrays)
    assert store.held_blocks == 0 and store.logprobs_nbytes == 0 and store.roots == {}
    assert not root.children and lm._queries == []
    assert kind != "hf" or lm.runner.forward.head._logits is None
    assert lm.kv_nbytes == 0 and not lm.cache.children and lm.cache.logprobs is None
