"""`Token`: bytes for every byte operation, its id for identity (==, hash, ordering)."""

import copy
import pickle

import pytest

from genlm.backend.tokenization import Token
from genlm.backend.tokenization.vocab import _as_tokens


def test_behaves_as_its_bytes():
    token = Token(5, b"ab")
    assert isinstance(token, bytes)
    assert len(token) == 2
    assert token[0] == 97 and token[-1] == 98
    assert token[:1] == b"a" and type(token[:1]) is bytes
    assert list(token) == [97, 98]
    assert b"".join([token, Token(6, b"cd")]) == b"abcd"
    assert token.decode() == "ab"
    assert token + b"c" == b"abc"
    assert b"b" in token
    assert Token(0, b"").decode() == ""


def test_attributes_and_repr():
    token = Token(5, b"ab")
    assert token.token_id == 5
    assert token.byte_string == b"ab" and type(token.byte_string) is bytes
    assert repr(token) == "Token(token_id=5, byte_string=b'ab')"
    assert repr(Token(7, b"\xe6\n")) == "Token(token_id=7, byte_string=b'\\xe6\\n')"


def test_accepts_bytearray():
    token = Token(1, bytearray(b"xy"))
    assert token == b"xy" and token.token_id == 1


@pytest.mark.parametrize(
    "token_id, byte_string",
    [("1", b"a"), (1.0, b"a"), (True, b"a"), (None, b"a"), (1, "a"), (1, None), (1, [97])],
)
def test_bad_arguments_raise_type_error(token_id, byte_string):
    with pytest.raises(TypeError):
        Token(token_id, byte_string)


def test_equality_and_hash_use_the_id():
    same_bytes = [Token(1, b"a"), Token(2, b"a")]
    assert same_bytes[0] != same_bytes[1]
    assert not same_bytes[0] == same_bytes[1]
    assert len(set(same_bytes)) == 2
    assert Token(3, b"a") == Token(3, b"b")
    assert hash(Token(3, b"a")) == hash(Token(3, b"b"))
    assert {Token(3, b"a"): "x"}[Token(3, b"zz")] == "x"


def test_comparison_with_plain_bytes_uses_the_bytes():
    token = Token(9, b"b")
    assert token == b"b" and token != b"a"
    assert token > b"a" and token < b"c" and token >= b"b" and token <= b"b"
    assert token != "b"


def test_ordering_uses_the_id():
    tokens = [Token(3, b"a"), Token(1, b"z"), Token(2, b"m")]
    assert [t.token_id for t in sorted(tokens)] == [1, 2, 3]
    assert Token(1, b"z") < Token(2, b"a") and Token(2, b"a") > Token(1, b"z")
    assert Token(1, b"z") <= Token(1, b"a") and Token(1, b"a") >= Token(1, b"z")


@pytest.mark.parametrize(
    "clone",
    [
        lambda t: pickle.loads(pickle.dumps(t)),
        lambda t: pickle.loads(pickle.dumps(t, protocol=0)),
        copy.deepcopy,
        copy.copy,
    ],
)
def test_pickle_and_copies_keep_id_and_bytes(clone):
    token = Token(42, b"\x00\xffab")
    cloned = clone(token)
    assert type(cloned) is Token
    assert cloned.token_id == 42 and cloned.byte_string == b"\x00\xffab"
    nested = clone([token, {"t": token}])
    assert nested[0].token_id == 42 and nested[1]["t"].byte_string == b"\x00\xffab"


def test_as_bytes_and_is_plain_bytes():
    token = Token(1, b"a")
    assert type(Token.as_bytes(token)) is bytes and Token.as_bytes(token) == b"a"
    assert Token.as_bytes(b"x") == b"x" and Token.as_bytes(5) == 5
    assert Token.is_plain_bytes(b"a")
    assert not Token.is_plain_bytes(token)
    assert not Token.is_plain_bytes("a") and not Token.is_plain_bytes(bytearray(b"a"))


def test_bulk_construction_matches_the_constructor():
    """`decode_vocab` builds its tokens without `Token.__new__`; they must be identical."""
    byte_strings = [b"a", b"", b"\xe6", b"a"]
    built = _as_tokens(byte_strings)
    expected = [Token(i, b) for i, b in enumerate(byte_strings)]
    assert [repr(t) for t in built] == [repr(t) for t in expected]
    assert all(type(t) is Token for t in built)
    assert [pickle.loads(pickle.dumps(t)).token_id for t in built] == [0, 1, 2, 3]
