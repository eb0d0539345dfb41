"""Token-character tries checked against brute force over random vocabularies."""

import shutil
import warnings

import numpy as np
import pytest
import torch

from genlm.backend import ParallelTokenCharacterTrie, Token, TokenCharacterTrie


def sparse_parallel_trie(vocab):
    """A parallel trie computing through its sparse matrix (the CUDA path), here on CPU."""
    trie = ParallelTokenCharacterTrie(vocab, device="cpu")
    trie.sparse_kernels = True
    return trie


TRIES = [TokenCharacterTrie, ParallelTokenCharacterTrie, sparse_parallel_trie]


def random_vocab(seed, size=150, stem=b""):
    """Tokens over a small alphabet (so prefixes are shared), with the empty token, all
    single bytes of the alphabet, and some byte strings repeated under distinct ids.
    With ``stem``, most tokens start with a prefix of it (long shared prefixes)."""
    rng = np.random.default_rng(seed)
    strings = [b"", *(bytes([c]) for c in b"abc\x00\xff")]
    while len(strings) < size:
        if strings and rng.random() < 0.1:
            strings.append(strings[int(rng.integers(len(strings)))])  # duplicate bytes
        else:
            head = stem[: int(rng.integers(len(stem) + 1))]
            strings.append(head + bytes(rng.choice(list(b"abc\x00\xff"), int(rng.integers(1, 7)))))
    order = rng.permutation(len(strings))
    return [Token(int(i), strings[j]) for i, j in enumerate(order)]


def symbols(entry):
    if isinstance(entry, bytes):
        return list(entry)
    try:
        return list(entry)
    except TypeError:
        return [entry]


def brute_force(trie, vocab, ws, reduce):
    """For every node, reduce ``ws`` over the entries whose symbols start with its prefix
    (a leaf: its own entry only)."""
    leaf_position = {int(leaf): int(pos) for pos, leaf in trie.idx_to_leaf}
    seqs = [symbols(entry) for entry in vocab]
    out = np.empty(trie.num_nodes)
    for node in range(trie.num_nodes):
        if node in leaf_position:
            out[node] = ws[leaf_position[node]]
            continue
        prefix = trie.node2prefix[node]
        below = [ws[j] for j, seq in enumerate(seqs) if seq[: len(prefix)] == prefix]
        out[node] = reduce(below) if below else (-np.inf if reduce is max else 0.0)
    return out


def np_max(values):
    return np.max(values)


@pytest.mark.parametrize("stem", [b"", b"abc\x00abc\x00abc\x00"])
@pytest.mark.parametrize("seed", range(4))
def test_structure_matches_the_distinct_prefixes(seed, stem):
    vocab = random_vocab(seed, stem=stem)
    trie = TokenCharacterTrie(vocab)
    expected_prefixes = {tuple(e[:k]) for e in map(list, vocab) for k in range(len(e) + 1)}
    leaves = {int(leaf) for leaf in trie.idx_to_leaf[:, 1]}
    internal = [n for n in range(trie.num_nodes) if n not in leaves]
    assert {tuple(trie.node2prefix[n]) for n in internal} == expected_prefixes
    assert len(internal) == len(expected_prefixes)  # one node per distinct prefix
    assert trie.num_nodes == len(expected_prefixes) + len(vocab)  # plus one leaf per position
    assert trie.root == 0 and trie.node2prefix[0] == []
    for pos, leaf in trie.idx_to_leaf:
        token = vocab[pos]
        assert trie.leaf2word[leaf] == (bytes(token), token.token_id)
        assert trie.word2leaf[(bytes(token), token.token_id)] == leaf
        assert trie.node2prefix[leaf] == list(token)
    for node, kids in enumerate(trie.children):
        assert list(trie.jump[node]) == sorted(kids.values())
        byte_edges = [key for key in sorted(kids, key=kids.get) if isinstance(key, int)]
        assert byte_edges == sorted(byte_edges)  # siblings numbered in byte order
        for key, child in kids.items():
            assert child > node  # preorder: parents before children
            if child in leaves:
                assert key[0] is None and trie.idx_to_leaf[key[1], 1] == child
            else:
                assert trie.node2prefix[child] == trie.node2prefix[node] + [key]
    position = {node: i for i, node in enumerate(trie.ordering)}
    assert all(
        position[child] < position[node]
        for node in range(trie.num_nodes)
        for child in trie.children[node].values()
    )


@pytest.mark.parametrize("trie_class", TRIES)
@pytest.mark.parametrize("seed", range(3))
def test_weights_match_brute_force(trie_class, seed):
    vocab = random_vocab(seed, stem=b"ab\x00cab\xffba" if seed == 2 else b"")
    trie = trie_class(vocab)
    rng = np.random.default_rng(100 + seed)
    # 9 rows: batched sums run in chunks of 8 lanes, then a single row
    batch = rng.random((9, len(vocab)))
    batch[1] = np.log(batch[1])  # negative weights for max
    # float32 sums of up to a few hundred weights in [0, 1) (or their logs) vs float64 brute
    # force: ~1e-7 relative per addition; rtol 1e-5 covers the accumulation, atol the zeros
    tol = dict(rtol=1e-5, atol=1e-5)
    sums = np.stack([brute_force(trie, vocab, ws, sum) for ws in batch])
    maxs = np.stack([brute_force(trie, vocab, ws, np_max) for ws in batch])
    for ws, ws_sums, ws_maxs in zip(batch[:3], sums, maxs, strict=False):
        np.testing.assert_allclose(trie.weight_sum(ws), ws_sums, **tol)
        np.testing.assert_allclose(trie.weight_max(ws), ws_maxs, **tol)
    strided = np.asfortranarray(batch)  # rows that are not contiguous
    for given in (
        batch,
        list(batch),
        strided,
        batch.astype(np.float32),
        torch.tensor(batch),
        [torch.tensor(w) for w in batch],
    ):
        assert trie.batch_weight_sum(given).shape == (9, trie.num_nodes)
        np.testing.assert_allclose(trie.batch_weight_sum(given), sums, **tol)
        np.testing.assert_allclose(trie.batch_weight_max(given), maxs, **tol)
        np.testing.assert_allclose(trie.batch_weight_sum(given[:3]), sums[:3], **tol)
    single = torch.tensor(batch[0], dtype=torch.float32)
    np.testing.assert_allclose(trie.weight_sum(single), sums[0], **tol)
    assert isinstance(trie.weight_sum(single), np.ndarray)


@pytest.mark.parametrize("parallel_class", TRIES[1:])
def test_sequential_and_parallel_agree_on_a_larger_vocabulary(parallel_class):
    vocab = random_vocab(7, size=3000)
    ws = torch.softmax(torch.randn(len(vocab), generator=torch.Generator().manual_seed(0)), 0)
    sequential, parallel = TokenCharacterTrie(vocab), parallel_class(vocab)
    np.testing.assert_allclose(
        parallel.weight_sum(ws), sequential.weight_sum(ws), rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(parallel.weight_max(ws), sequential.weight_max(ws), rtol=1e-6)
    batch = torch.stack([ws, ws.flip(0)])
    np.testing.assert_allclose(
        parallel.batch_weight_sum(batch), sequential.batch_weight_sum(batch), rtol=1e-5, atol=1e-7
    )
    assert sequential.weight_sum(ws)[sequential.root] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("trie_class", TRIES)
def test_nan_weights_propagate_to_every_ancestor(trie_class):
    vocab = [Token(0, b"ab"), Token(1, b"ac"), Token(2, b"b")]
    trie = trie_class(vocab)
    ws = np.array([np.nan, 0.5, 0.25])
    leaves = {int(leaf) for leaf in trie.idx_to_leaf[:, 1]}
    ancestors = {
        n
        for n in range(trie.num_nodes)
        if n not in leaves and trie.node2prefix[n] in ([], [97], [97, 98])
    }
    expected = ancestors | {trie.word2leaf[(b"ab", 0)]}
    assert len(expected) == 4
    clean = np.array([0.125, 0.5, 0.25])  # a NaN in one batched row stays in its row
    batch = np.stack([clean, ws, clean])
    for result in (
        trie.weight_sum(ws),
        trie.weight_max(ws),
        trie.batch_weight_sum(batch)[1],
        trie.batch_weight_max(batch)[1],
    ):
        assert {int(n) for n in np.flatnonzero(np.isnan(result))} == expected
    for method in (trie.batch_weight_sum, trie.batch_weight_max):
        assert not np.isnan(method(batch)[[0, 2]]).any()


def test_plain_bytes_warn_once_and_use_their_bytes_as_keys():
    with pytest.warns(
        DeprecationWarning, match="^Passing plain bytes to TokenCharacterTrie is deprecated"
    ) as record:
        trie = TokenCharacterTrie([b"cat", b"cats", b"dog"])
    assert len([w for w in record if w.category is DeprecationWarning]) == 1
    assert set(trie.word2leaf) == {b"cat", b"cats", b"dog"}
    np.testing.assert_allclose(trie.weight_sum([1.0, 2.0, 4.0])[trie.root], 7.0)


def test_mixed_vocabulary_with_an_end_of_sequence_object():
    eos = object()
    vocab = [Token(0, b"ab"), Token(1, b"a"), eos, "ab", ("x", 97)]
    trie = TokenCharacterTrie(vocab)
    assert trie.word2leaf[eos] == trie.idx_to_leaf[2, 1]
    assert trie.node2prefix[trie.word2leaf[eos]] == [eos]
    assert trie.children[trie.root][eos] in trie.children[trie.root].values()
    assert trie.node2prefix[trie.word2leaf["ab"]] == ["a", "b"]  # str: its characters
    ws = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    np.testing.assert_allclose(trie.weight_sum(ws), brute_force(trie, vocab, ws, sum))
    np.testing.assert_allclose(
        ParallelTokenCharacterTrie(vocab, "cpu").weight_sum(ws), brute_force(trie, vocab, ws, sum)
    )
    assert trie.node2prefix[trie.children[trie.root][97]] == [97]  # byte edges are ints


@pytest.mark.parametrize("trie_class", TRIES)
def test_empty_vocabulary_has_only_the_root(trie_class):
    trie = trie_class([])
    assert trie.num_nodes == 1
    assert trie.weight_sum(np.zeros(0)).tolist() == [0.0]
    assert trie.weight_max(np.zeros(0)).tolist() == [-np.inf]
    assert trie.batch_weight_sum(np.zeros((2, 0))).tolist() == [[0.0], [0.0]]


def test_deprecated_mass_sum_names():
    vocab = random_vocab(1, size=30)
    trie = TokenCharacterTrie(vocab)
    ws = np.random.default_rng(0).random(len(vocab))
    with pytest.warns(DeprecationWarning, match="weight_sum"):
        np.testing.assert_allclose(trie.mass_sum(ws), trie.weight_sum(ws))
    with pytest.warns(DeprecationWarning, match="batch_weight_sum"):
        np.testing.assert_allclose(trie.batch_mass_sum([ws]), trie.batch_weight_sum([ws]))


@pytest.mark.parametrize("trie_class", TRIES)
def test_bad_weights_are_rejected(trie_class):
    trie = trie_class([Token(0, b"a"), Token(1, b"b")])
    for bad in (np.ones(3), np.ones((1, 2)), torch.ones(1)):
        with pytest.raises(ValueError, match="length 2"):
            trie.weight_sum(bad)
        with pytest.raises(ValueError, match="length 2"):
            trie.weight_max(bad)
    for bad in (np.ones(2), np.ones((2, 3))):
        with pytest.raises(ValueError, match=r"\[B, 2\]"):
            trie.batch_weight_sum(bad)
    with pytest.raises(ValueError, match="length 2"):
        trie.batch_weight_max([np.ones(2), np.ones(5)])


@pytest.mark.parametrize("trie_class", TRIES)
def test_batched_results_into_a_given_array(trie_class):
    vocab = random_vocab(3)
    trie = trie_class(vocab)
    ws = np.random.default_rng(0).random((10, len(vocab)))
    out = np.full((10, trie.num_nodes), np.nan, np.float32)
    assert trie.batch_weight_sum(ws, out=out) is out
    np.testing.assert_allclose(out, trie.batch_weight_sum(ws), rtol=1e-6)
    assert trie.batch_weight_max(ws, out=out) is out
    np.testing.assert_array_equal(out, trie.batch_weight_max(ws))
    for bad in (np.empty((9, trie.num_nodes), np.float32), np.empty((10, trie.num_nodes))):
        with pytest.raises(ValueError, match="out must be a float32 array"):
            trie.batch_weight_sum(ws, out=bad)


@pytest.mark.parametrize("trie_class", TRIES)
def test_a_result_is_the_callers_later_calls_do_not_change_it(trie_class):
    """Result blocks are reused, but never while any view of an earlier result lives."""
    from genlm.backend.trie._results import ResultBlocks

    vocab = random_vocab(4)
    trie = trie_class(vocab)
    trie._results = ResultBlocks(min_bytes=0)  # lease these small results too
    rng = np.random.default_rng(1)
    first_ws, later_ws = rng.random((2, 6, len(vocab)))
    expected = np.stack([brute_force(trie, vocab, w, sum) for w in first_ws])
    sums, maxs = trie.batch_weight_sum(first_ws), trie.batch_weight_max(first_ws)
    single = trie.weight_sum(first_ws[0])
    row_view = trie.batch_weight_sum(first_ws)[2, 1:]  # the array it came from is dropped
    for _ in range(3):
        trie.batch_weight_sum(later_ws)
        trie.batch_weight_max(later_ws)
        trie.weight_sum(later_ws[0])
        kept = trie.batch_weight_sum(later_ws[:4])  # a smaller batch in a larger free block
        np.testing.assert_allclose(kept[3], brute_force(trie, vocab, later_ws[3], sum), rtol=1e-5)
    np.testing.assert_allclose(sums, expected, rtol=1e-5)
    np.testing.assert_allclose(single, expected[0], rtol=1e-5)
    np.testing.assert_allclose(row_view, expected[2, 1:], rtol=1e-5)
    np.testing.assert_array_equal(
        maxs, np.stack([brute_force(trie, vocab, w, max) for w in first_ws]).astype(np.float32)
    )
    assert trie._results.allocated >= 3  # results were leased blocks, some reused


@pytest.mark.parametrize("trie_class", TRIES)
def test_results_into_a_given_tensor(trie_class):
    """``out=`` a torch tensor (the device path; here on the CPU) is filled and returned."""
    vocab = random_vocab(5)
    trie = trie_class(vocab)
    ws = torch.rand(4, len(vocab), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sums = np.stack([brute_force(trie, vocab, w.numpy(), sum) for w in ws])
    maxs = np.stack([brute_force(trie, vocab, w.numpy(), max) for w in ws])
    out = torch.full((4, trie.num_nodes), torch.nan)
    assert trie.batch_weight_sum(ws, out=out) is out
    np.testing.assert_allclose(out.numpy(), sums, rtol=1e-5)
    assert trie.batch_weight_max(ws, out=out) is out
    np.testing.assert_allclose(out.numpy(), maxs, rtol=1e-6)
    row = torch.full((trie.num_nodes,), torch.nan)
    assert trie.weight_sum(ws[1], out=row) is row
    np.testing.assert_allclose(row.numpy(), sums[1], rtol=1e-5)
    assert trie.weight_max(ws[2], out=row) is row
    np.testing.assert_allclose(row.numpy(), maxs[2], rtol=1e-6)
    array_row = np.full(trie.num_nodes, np.nan, np.float32)
    assert trie.weight_sum(ws[3], out=array_row) is array_row
    np.testing.assert_allclose(array_row, sums[3], rtol=1e-5)


@pytest.mark.parametrize("trie_class", TRIES)
def test_a_bad_out_is_refused(trie_class):
    vocab = random_vocab(6)
    trie = trie_class(vocab)
    ws = np.ones((2, len(vocab)))
    for bad in (
        torch.empty(2, trie.num_nodes, dtype=torch.float64),
        torch.empty(3, trie.num_nodes),
        np.empty((2, trie.num_nodes + 1), np.float32),
    ):
        with pytest.raises(ValueError, match="out must be a float32 array or tensor of shape"):
            trie.batch_weight_sum(ws, out=bad)
    for bad in (
        torch.empty(trie.num_nodes, dtype=torch.float64),
        torch.empty(1, trie.num_nodes),
        np.empty(trie.num_nodes + 1, np.float32),
    ):
        with pytest.raises(ValueError, match="out must be a float32 array or tensor of shape"):
            trie.weight_max(ws[0], out=bad)
    with pytest.raises(TypeError, match="out must be a numpy array or torch tensor, got list"):
        trie.batch_weight_max(ws, out=[[0.0] * trie.num_nodes] * 2)


def read_only(shape):
    array = np.zeros(shape, np.float32)
    array.flags.writeable = False
    return array


def inference_tensor(shape):
    with torch.inference_mode():
        return torch.zeros(shape)


UNWRITABLE_OUTS = {  # kind -> (a float32 out of a given shape that cannot be written, why)
    "read-only": (read_only, "is read-only"),
    "meta": (lambda shape: torch.empty(shape, device="meta"), "is a meta tensor"),
    "grad": (lambda shape: torch.zeros(shape, requires_grad=True), "requires grad"),
    "inference": (inference_tensor, "is an inference tensor"),
    "expanded": (lambda shape: torch.zeros(1).expand(shape), "has elements that share memory"),
}


@pytest.mark.parametrize("trie_class", TRIES)
@pytest.mark.parametrize("kind", UNWRITABLE_OUTS)
@pytest.mark.parametrize("batched", [False, True])
def test_an_out_that_cannot_be_written_is_refused_before_any_work(trie_class, kind, batched):
    """One plain `ValueError` from every trie (not numba's typing error, torch's error after
    the work, or a meta tensor silently left unwritten); a writable one of the same kind
    is filled."""
    vocab = random_vocab(7)
    trie = trie_class(vocab)
    ws = np.random.default_rng(7).random((2, len(vocab)))
    make, message = UNWRITABLE_OUTS[kind]
    shape = (2, trie.num_nodes) if batched else (trie.num_nodes,)
    for method in ("sum", "max"):
        call = getattr(trie, f"batch_weight_{method}" if batched else f"weight_{method}")
        with pytest.raises(ValueError, match=f"^out {message}"):
            call(ws if batched else ws[0], out=make(shape))
    writable = np.zeros(shape, np.float32)
    expected = np.stack([brute_force(trie, vocab, w, sum) for w in ws])
    trie.batch_weight_sum(ws, out=writable) if batched else trie.weight_sum(ws[0], out=writable)
    np.testing.assert_allclose(writable, expected if batched else expected[0], rtol=1e-5)


def test_result_blocks_are_leased_until_every_view_is_gone():
    from genlm.backend.trie._results import ResultBlocks

    blocks = ResultBlocks(min_bytes=0)
    held = blocks.take(3, 5)
    held[...] = 1.0
    slice_of_it = held[1:, 2:].T
    del held
    other = blocks.take(2, 5)  # the first block is still leased through the slice
    other[...] = 2.0
    assert blocks.allocated == 2
    np.testing.assert_array_equal(slice_of_it, np.ones((3, 2)))
    del slice_of_it, other
    assert len(blocks.free) == 2
    blocks.take(3, 5)
    blocks.take(1, 5)
    assert blocks.allocated == 2  # both reused: nothing new allocated
    blocks.take(4, 5)
    assert blocks.allocated == 3  # no free block is large enough


def test_small_pageable_results_are_plain_arrays():
    from genlm.backend.trie._results import ResultBlocks

    blocks = ResultBlocks(min_bytes=1000)
    assert blocks.take(2, 100).flags.owndata and blocks.allocated == 0
    assert not blocks.take(3, 100).flags.owndata and blocks.allocated == 1


def test_result_blocks_keep_at_most_max_bytes_free():
    from genlm.backend.trie._results import ResultBlocks

    blocks = ResultBlocks(max_bytes=2 * 10 * 4, min_bytes=0)
    taken = [blocks.take(1, 10) for _ in range(4)]
    del taken
    assert len(blocks.free) == 2
    for _ in range(3):  # larger than max_bytes: the latest is kept, and reused
        blocks.take(5, 10)
    assert blocks.allocated == 5 and [b.shape for b in blocks.free] == [(5, 10)]


def test_duplicate_entries_are_rejected():
    with pytest.raises(ValueError, match="Duplicate word in vocabulary"):
        TokenCharacterTrie([Token(0, b"a"), Token(1, b"b"), Token(0, b"a")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match="Duplicate word in vocabulary"):
            TokenCharacterTrie([b"a", b"a"])
    with pytest.raises(ValueError, match="Duplicate word in vocabulary"):
        TokenCharacterTrie([Token(5, b"x"), Token(0, b"a"), Token(1, b"a"), Token(0, b"a")])
    with pytest.raises(ValueError, match="Duplicate word in vocabulary"):
        TokenCharacterTrie([Token(0, b"a"), "eos", "eos"])
    with pytest.raises(TypeError, match="hashable"):
        TokenCharacterTrie([["a"]])


def test_devices():
    vocab = [Token(0, b"a")]
    for device in ("gpu", "cpu:0", "cuda:x", 3):
        with pytest.raises(ValueError, match="device"):
            ParallelTokenCharacterTrie(vocab, device=device)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            ParallelTokenCharacterTrie(vocab, device="cuda")
        assert ParallelTokenCharacterTrie(vocab).device == "cpu"


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` binary not installed")
def test_visualize_renders_with_dot():
    import graphviz

    vocab = [Token(0, b"cat"), Token(1, b"cats"), Token(2, b"dog"), Token(3, b"d\\g\n")]
    trie = TokenCharacterTrie(vocab)
    graph = trie.visualize(trie.weight_sum([0.4, 0.1, 0.3, 0.2]))
    assert isinstance(graph, graphviz.Digraph)
    svg = graph.pipe(format="svg").decode()
    assert svg.lstrip().startswith("<?xml") and "</svg>" in svg
    assert "End&#45;of&#45;Token (ID: 1)" in svg or "End-of-Token (ID: 1)" in svg
    assert "doublecircle" in graph.source and "0.5" in svg
    bundle = TokenCharacterTrie(vocab).visualize()._repr_mimebundle_(include=["image/svg+xml"])
    assert "<svg" in bundle["image/svg+xml"]  # what Jupyter displays
    with pytest.raises(ValueError, match="one weight per node"):
        trie.visualize(np.ones(3))
