"""A decode step's host work is O(particles + new tokens), never O(context).

Python calls are counted (``sys.setprofile``: every Python and C function call) in one
steady decode step of many particles over a `PrefixCachedLM` whose forward and pool cost
nothing: the caller-side check of every request (`_query_list`) and the batch's walk,
plan, allocation and bookkeeping (`_answer_batch`). The counts must be the same for a
64-token and a 1,024-token prompt; the ids a previous step validated are not checked
again one by one.
"""

import collections
import copy
import enum
import gc
import pickle
import random
import sys

import numpy as np
import pytest
import torch

import genlm.backend.kv.store as kv_store
from genlm.backend.kv.store import PrefixKVStore
from genlm.backend.llm.base import MockAsyncLM
from genlm.backend.llm.prefix import PrefixCachedLM

PARTICLES = 128


class NullPool:
    """A `BlockPool` with no memory: the forward below neither reads nor writes KV."""

    block_size = 16
    block_bytes = 100

    def resize(self, blocks):
        pass

    def free(self):
        pass

    def copy(self, copies):
        pass

    def slots(self, chain, tokens):
        raise AssertionError("the null forward reads no slots")

    def read(self, chain, tokens):
        raise AssertionError("the null forward reads no KV")


class NullLM(PrefixCachedLM):
    """A `PrefixCachedLM` whose forward costs one call per row, whatever the context (the
    LM is its own `RowRunner`)."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        store = PrefixKVStore(NullPool())
        self._init_prefix_cache(store, self, 4 * PARTICLES, 0.02, "genlm-null")

    def load_adapter(self, lora_path, lora_name):
        pass

    def unload_adapter(self, lora_name):
        pass

    def read_past(self, chain, tokens):
        raise AssertionError("the null forward keeps no KV")

    def free(self):
        pass

    def run(self, rows):
        return torch.zeros(len(rows), 2)


def calls_in_a_decode_step(tokenizer, prompt_length, particles=PARTICLES, steps=3):
    """Calls by function name in the last of ``steps`` steps after the prompt's prefill,
    every particle appending its own token each step (so they fork off the prompt)."""
    rng = random.Random(0)
    counts: collections.Counter = collections.Counter()

    def count(frame, event, arg):
        if event == "call":
            counts[frame.f_code.co_name] += 1
        elif event == "c_call":
            counts["C " + getattr(arg, "__name__", "?")] += 1

    with NullLM(tokenizer) as lm:
        prompt = [rng.randrange(lm.vocab_size) for _ in range(prompt_length)]
        lm._answer_batch(lm._query_list([prompt]))
        contexts = [list(prompt) for _ in range(particles)]
        for step in range(steps):
            for context in contexts:
                context.append(rng.randrange(lm.vocab_size))
            if step == steps - 1:
                sys.setprofile(count)
            try:
                rows = lm._answer_batch(lm._query_list(contexts))
            finally:
                sys.setprofile(None)
            assert len(rows) == particles
    return counts


def test_a_decode_step_makes_as_many_calls_at_1024_tokens_of_context_as_at_64(
    smollm2_tokenizer,
):
    short = calls_in_a_decode_step(smollm2_tokenizer, 64)
    long = calls_in_a_decode_step(smollm2_tokenizer, 1024)
    grown = {name: (short[name], long[name]) for name in long if long[name] > short[name]}
    # A few calls may differ (the pool grows at another step); per-id or per-block work
    # would add thousands.
    excess = sum(after - before for before, after in grown.values())
    assert excess <= 20, f"calls that grow with the context (64 -> 1024 tokens): {grown}"
    # Each request is validated once, none of its ids by a per-id call.
    assert long["validate_token_ids"] == PARTICLES
    assert long["checked_id"] == 0


def test_a_decode_step_makes_a_constant_number_of_calls_per_particle(smollm2_tokenizer):
    small, medium, large = (
        sum(calls_in_a_decode_step(smollm2_tokenizer, 64, n).values()) for n in (32, 64, 128)
    )
    assert abs((large - medium) - 2 * (medium - small)) <= 20, (small, medium, large)


@pytest.fixture(scope="module")
def mock(smollm2_tokenizer):
    with MockAsyncLM(smollm2_tokenizer) as lm:
        yield lm


@pytest.mark.parametrize(
    "extension, error, message",
    [
        ([True], TypeError, r"token id True at position 3 is not an integer \(bool\)"),
        ([2.0], TypeError, r"token id 2.0 at position 3 is not an integer \(float\)"),
        ([-1], ValueError, r"token id -1 at position 3 is outside the vocabulary"),
        ([49152], ValueError, r"token id 49152 at position 3 is outside the vocabulary"),
        ([2**70], ValueError, r"at position 3 is outside the vocabulary"),
    ],
)
def test_a_bad_id_after_a_validated_prefix_is_named(mock, extension, error, message):
    prefix = [5, 6, 7]
    mock.next_token_logprobs_sync(prefix)  # validated: only the new id is checked next
    with pytest.raises(error, match=message):
        mock.next_token_logprobs_sync(prefix + extension)


@pytest.mark.parametrize(
    "equal_but_not_ints, error, message",
    [
        ([5.0, 6, 7, 8], TypeError, r"token id 5.0 at position 0 is not an integer"),
        ([5, True, 7, 8], TypeError, r"token id True at position 1 is not an integer"),
        (
            [5, 6, np.float64(7), 8],
            TypeError,
            r"7\.0\)? at position 2 is not an integer \(float64\)",
        ),
    ],
)
def test_ids_equal_to_a_validated_prefix_are_still_checked_for_type(
    mock, equal_but_not_ints, error, message
):
    mock.next_token_logprobs_sync([5, 6, 7])
    mock.next_token_logprobs_sync([5, 6, 7, 8])
    with pytest.raises(error, match=message):
        mock.next_token_logprobs_sync(equal_but_not_ints)


def test_numpy_integers_in_a_list_are_accepted_as_ints(mock):
    ids = mock.validate_token_ids([np.int64(4), np.uint16(5), 6])
    assert ids == (4, 5, 6) and all(type(i) is int for i in ids)
    expected = mock.next_token_logprobs_sync([4, 5, 6])
    assert torch.equal(mock.next_token_logprobs_sync(list(np.array([4, 5, 6]))), expected)
    assert torch.equal(mock.next_token_logprobs_sync(torch.tensor([4, 5, 6])), expected)


def test_a_decode_step_walks_the_tree_from_the_previous_steps_nodes(smollm2_tokenizer, monkeypatch):
    """Each request of a step extends a prefix of the step before by one id: the tree is
    walked from that prefix's node (one id), not from the root (1,025 ids), and a prefix
    asked again from its own node (none); the nodes are the ones a walk from the root finds."""
    rng = random.Random(0)
    walked = []
    with NullLM(smollm2_tokenizer) as lm:
        walk = kv_store.walk

        def counted(node, ids):
            walked.append(len(ids) - node.depth)
            found = walk(node, ids)
            assert found == walk(lm.store.root(None), ids)
            return found

        monkeypatch.setattr(kv_store, "walk", counted)  # the store's walks
        prompt = [rng.randrange(lm.vocab_size) for _ in range(1024)]
        contexts = [[*prompt, rng.randrange(lm.vocab_size)] for _ in range(8)]
        lm._answer_batch(lm._query_list([prompt]))
        for _ in range(3):
            walked.clear()
            lm._answer_batch(lm._query_list(contexts))
            assert walked == [1] * len(contexts)
            walked.clear()
            lm._answer_batch(lm._query_list(contexts))  # the same prefixes again
            assert walked == [0] * len(contexts)
            for context in contexts:
                context.append(rng.randrange(lm.vocab_size))


def test_an_adapters_node_is_remembered_apart_from_the_base_models(mock):
    """Each tree's node is remembered for its own key; a prefix's entry starts from its
    parent's nodes, and remembering one for the prefix leaves the parent's as they were."""
    from genlm.backend.kv.tree import KVNode
    from genlm.backend.llm.prefix import node_hint, remember_node

    parent = mock.validate_token_ids([4, 5, 6])
    base, adapter, other = KVNode(), KVNode(), KVNode()
    remember_node(parent, None, base)
    remember_node(parent, "a", adapter)
    child = mock.validate_token_ids([4, 5, 6, 7])
    assert node_hint(child, None) is base and node_hint(child, "a") is adapter
    assert node_hint(child, "b") is None and node_hint((4, 5, 6, 7), None) is None
    remember_node(child, "a", other)
    remember_node(child, "b", other)
    assert node_hint(child, "a") is other and node_hint(child, "b") is other
    assert node_hint(parent, "a") is adapter and node_hint(parent, "b") is None
    assert node_hint(parent, None) is base


def test_no_prefix_outlives_the_requests_of_a_decode_step(smollm2_tokenizer):
    """What validation and the tree keep of a prefix is a plain tuple (which the collector
    stops tracking), never a `TokenIds` (a tuple subclass, which every collection would
    walk): once a step's requests are answered, none is alive, however many steps ran."""
    from genlm.backend.llm.request import TokenIds

    rng = random.Random(0)
    with NullLM(smollm2_tokenizer) as lm:
        contexts = [[1, 2, 3] for _ in range(16)]
        for _ in range(20):
            for context in contexts:
                context.append(rng.randrange(lm.vocab_size))
            lm._answer_batch(lm._query_list(contexts))
            gc.collect()
            assert not [o for o in gc.get_objects() if type(o) is TokenIds]


@pytest.mark.parametrize(
    "duplicate", [copy.copy, copy.deepcopy, lambda ids: pickle.loads(pickle.dumps(ids))]
)
def test_a_validated_prefix_copies_and_pickles_as_its_ids(mock, duplicate):
    """A copy keeps the ids and the hash (the same as ``tuple``'s, so both kinds of key mix
    in a dict), not the entry of the index that validated it."""
    mock.validate_token_ids([4, 5, 6])
    ids = mock.validate_token_ids([4, 5, 6, 7])
    again = duplicate(ids)
    assert type(again) is type(ids) and again == (4, 5, 6, 7)
    assert hash(again) == hash(ids) == hash((4, 5, 6, 7))
    assert {(4, 5, 6, 7): 1}[again] == 1 and {again: 1}[(4, 5, 6, 7)] == 1
    assert ids.entry is not None and again.entry is None


class TokenEnum(enum.IntEnum):
    """An int subclass: not an exact int, which validation converts it to."""

    FIVE = 5


@pytest.mark.parametrize(
    "changed",
    [
        lambda prefix: [TokenEnum.FIVE, *prefix[1:]],  # an int subclass of the same value
        lambda prefix: [np.int64(prefix[0]), *prefix[1:]],
        lambda prefix: [prefix[0] + 1, *prefix[1:]],  # another id, same length and tail
        lambda prefix: [*prefix[:-1], prefix[-1] + 1],
        lambda prefix: prefix[:-1],  # shorter
        lambda prefix: [7, *prefix],  # longer
        lambda prefix: tuple(prefix),
    ],
)
def test_a_request_near_a_validated_prefix_is_validated_as_itself(mock, changed):
    """Validation compares a request with the prefix it extends: whatever differs (an id,
    a type, the length), the result is the request's own ids as exact ints, checked
    against ``tuple(map(int, ...))`` of them."""
    prefix = [5, *range(100, 130)]
    mock.validate_token_ids(prefix)
    request = [*changed(prefix), 42]
    checked = mock.validate_token_ids(request)
    assert checked == tuple(int(i) for i in request)
    assert all(type(i) is int for i in checked)
    assert hash(checked) == hash(tuple(checked))
    again = mock.validate_token_ids([*request, 43])  # and the one after it
    assert again == (*checked, 43) and hash(again) == hash((*checked, 43))


@pytest.mark.parametrize(
    "bad, error, message",
    [
        (True, TypeError, r"token id True at position 10 is not an integer \(bool\)"),
        (2.5, TypeError, r"token id 2.5 at position 10 is not an integer \(float\)"),
        (-3, ValueError, r"token id -3 at position 10 is outside the vocabulary"),
        (10**6, ValueError, r"token id 1000000 at position 10 is outside the vocabulary"),
        ("7", TypeError, r"token id '7' at position 10 is not an integer \(str\)"),
    ],
)
def test_a_bad_id_inside_a_validated_prefix_is_named(mock, bad, error, message):
    prefix = list(range(200, 240))
    mock.validate_token_ids(prefix)
    request = [*prefix, 9]
    request[10] = bad
    with pytest.raises(error, match=message):
        mock.validate_token_ids(request)


def first_bad_position(request, vocab_size):
    """The position of the first id that is not an integer (bools excluded) in
    ``[0, vocab_size)``, or None: the check validation must agree with."""
    for position, token_id in enumerate(request):
        integer = isinstance(token_id, int | np.integer) and not isinstance(token_id, bool)
        if not integer or not 0 <= token_id < vocab_size:
            return position
    return None


def test_validation_agrees_with_an_independent_check_over_random_forks():
    """Prefixes extended, forked, repeated and altered at random, on an index whose
    generations turn over every few requests: each request is validated exactly as a
    check of every id says (its ids as exact ints, or the error naming the first bad id),
    whichever validated prefix it extends, equals or nearly equals."""
    from genlm.backend.llm.request import PrefixIndex

    rng = random.Random(0)
    vocab = 50
    index = PrefixIndex(vocab, budget=3000)
    bad = [-1, vocab, 2.0, True, [3], np.float64(4)]
    history = [[1]]
    for _ in range(3000):
        request = list(rng.choice(history[-20:] if rng.random() < 0.9 else history))
        move = rng.random()
        if move < 0.6:
            request.append(rng.randrange(vocab))
        elif move < 0.75:
            request.append(rng.choice(bad))
        elif move < 0.9:
            request[rng.randrange(len(request))] = rng.choice([*bad, np.int64(7), 7, 8])
            request.append(rng.randrange(vocab))
        position = first_bad_position(request, vocab)
        if position is None:
            checked = index.validated(request)
            assert checked == tuple(int(i) for i in request)
            assert all(type(i) is int for i in checked)
            history.append(request)
        else:
            with pytest.raises((TypeError, ValueError), match=f" at position {position} "):
                index.validated(request)
