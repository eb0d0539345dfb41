"""`decode_vocab`: the byte and string vocabularies of a Hugging Face tokenizer."""

from __future__ import annotations

from itertools import repeat
from operator import methodcaller
from typing import Any

from genlm.backend.tokenization.bytes import get_byte_vocab
from genlm.backend.tokenization.token import Token

BYTE2STR_FALLBACKS = ("tokenizer", "latin1", "replace")


def decode_vocab(
    tokenizer: Any, byte2str_fallback: str = "tokenizer"
) -> tuple[list[Token], list[str]]:
    """``(byte_vocab, str_vocab)`` for every token id ``0 .. len(tokenizer) - 1``.

    (If the tokenizer's ids skip numbers, the lists run up to its largest id and the
    skipped ids get ``b""``/``""``.)

    ``byte_vocab[i]`` is ``Token(i, bytes token i contributes to a decoded text)``;
    ``str_vocab[i]`` is those bytes as UTF-8, or for invalid UTF-8 (a piece of a
    multi-byte character) what ``byte2str_fallback`` says: ``"tokenizer"`` for the
    tokenizer's own token string, ``"latin1"`` or ``"replace"`` (U+FFFD for bad bytes).
    Raises `ValueError` for another fallback, and `ByteVocabError` (a `ValueError`
    naming the tokenizer) when no method finds the exact bytes.
    """
    _check_fallback(byte2str_fallback)
    if type(tokenizer).__module__.startswith("tokenizers"):  # a raw `tokenizers.Tokenizer`
        raise TypeError(
            "decode_vocab takes a transformers tokenizer, got a tokenizers.Tokenizer: wrap it "
            "as transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)"
        )
    byte_strings = get_byte_vocab(tokenizer)
    str_vocab = bytes_to_strs(tokenizer, byte_strings, byte2str_fallback)
    return _as_tokens(byte_strings), str_vocab


def bytes_to_strs(tokenizer: Any, byte_vocab: list[bytes], byte2str_fallback: str) -> list[str]:
    """Each token's bytes as a string, invalid UTF-8 handled by ``byte2str_fallback``."""
    _check_fallback(byte2str_fallback)
    strs = list(map(methodcaller("decode", "utf-8", "replace"), byte_vocab))
    for token_id, text in enumerate(strs):
        if "\ufffd" in text:  # invalid UTF-8, or a real U+FFFD: only these need a second look
            try:
                byte_vocab[token_id].decode()
            except UnicodeDecodeError:
                strs[token_id] = _fallback_str(
                    tokenizer, token_id, byte_vocab[token_id], byte2str_fallback
                )
    return strs


def _fallback_str(tokenizer: Any, token_id: int, token: bytes, fallback: str) -> str:
    if fallback == "tokenizer":
        return str(tokenizer.convert_ids_to_tokens(token_id))
    if fallback == "latin1":
        return token.decode("latin1")
    return token.decode("utf-8", errors="replace")


def _check_fallback(byte2str_fallback: str) -> None:
    if byte2str_fallback not in BYTE2STR_FALLBACKS:
        raise ValueError(
            f"Unknown byte2str_fallback {byte2str_fallback!r}; use one of {BYTE2STR_FALLBACKS}"
        )


def _as_tokens(byte_strings: list[bytes]) -> list[Token]:
    """``Token(i, byte_strings[i])`` for all i, without re-validating each argument.

    Builds tens of thousands of tokens, so it bypasses ``Token.__new__``'s type checks
    (the ids are ``range`` ints and the values are ``bytes`` by construction).
    """
    tokens = list(map(bytes.__new__, repeat(Token), byte_strings))
    for token_id, token in enumerate(tokens):
        token.__dict__["token_id"] = token_id  # Token.__setattr__ refuses: it is immutable
    return tokens
