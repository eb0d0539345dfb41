"""Exact bytes of every token of a Hugging Face tokenizer.

`get_byte_vocab` tries, in order:

1. a ``byte_decoder`` attribute (slow GPT-2-style tokenizers), checked by `check_byte_decoder`;
2. the fast tokenizer's own decoder pipeline (``backend_tokenizer.decoder``), replayed on each
   token: ``ByteLevel`` (GPT-2, Llama-3, Qwen, SmolLM, tiktoken conversions) maps each character
   through the GPT-2 byte table; ``Replace("▁", " ")`` / ``Metaspace`` with ``ByteFallback``
   (Llama-2, Mistral, Gemma) turn ``▁`` into a space and ``<0x0A>`` into byte 0x0A;
3. decoding every token after a fixed context token, for any other tokenizer with ``decode``.

Added and special tokens are always their content's UTF-8 (that is what `encode` matches
in the text). Ids with no token (gaps below the largest id) get ``b""``: no text encodes to them.
Each candidate is accepted only if it reproduces a set of probe texts exactly through
``tokenizer.encode(text, add_special_tokens=False)``.

A token's bytes are what it contributes *inside* a text. Two boundary effects of SentencePiece
tokenizers are deliberately not part of them: the ``▁`` their pre-tokenizer prepends to a text
that does not start with a space (so ``encode("hello")`` gives ``["▁hell", "o"]``, whose bytes
are ``b" hello"``), and the decoder's matching ``Strip`` of one leading space of the whole text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate, pairwise
from typing import Any


class ByteVocabError(ValueError):
    """No method produced an exact byte vocabulary for the tokenizer."""


class ByteDecoderError(ValueError):
    """A character-to-byte table does not reproduce the tokenizer's encodings."""


# Texts every method's result must reproduce. They are unchanged by NFKC normalization, so
# tokenizers that normalize (exactness then only holds for normalized text) still pass.
PROBE_TEXTS = (
    "Hello, world! 1234567890",
    "def f(x):\n\treturn x  *  2\r\n",
    "naïve café — Größe, señor, Ωμέγα; ¿qué? 9,99 €",
    "日本語のテキスト、中文。한국어",
    "emoji 🙂🚀👩‍👩‍👧 and symbols ∑ ≠ ©",
    " leading and trailing  ",
)

_GAP_SCAN_LIMIT = 1 << 20  # ids past len(tokenizer) searched for tokens displaced by gaps

_DECODE_OPTIONS = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}


def gpt2_byte_decoder() -> dict[str, int]:
    """The GPT-2 byte-level table: printable stand-in character -> byte value."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    decoder = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in set(printable))
    decoder.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return decoder


def describe(tokenizer: Any) -> str:
    """A short name for error messages: class and ``name_or_path``."""
    name = getattr(tokenizer, "name_or_path", None)
    return f"{type(tokenizer).__name__}({name!r})" if name else type(tokenizer).__name__


def get_byte_vocab(tokenizer: Any) -> list[bytes]:
    """The exact bytes of every token id ``0 .. len(tokenizer) - 1``.

    Raises `ByteVocabError` (a `ValueError`) naming the tokenizer when no method
    reproduces the probe texts.
    """
    failures = []
    for name, method in _METHODS:
        try:
            vocab = method(tokenizer)
            if vocab is not None:
                _check_probes(tokenizer, vocab)
                return vocab
        except (ValueError, LookupError, TypeError, AttributeError) as error:
            failures.append(f"{name}: {error}")
    reasons = "; ".join(failures) or "it has neither a byte decoder nor a decode method"
    raise ByteVocabError(
        f"Could not decode byte representation of the vocabulary of {describe(tokenizer)}: "
        f"{reasons}"
    )


def check_byte_decoder(tokenizer: Any, byte_decoder: Mapping[str, int]) -> None:
    """Raise `ByteDecoderError` unless ``byte_decoder`` (character -> byte) maps the token
    strings of the probe texts' encodings back to exactly those texts' UTF-8 bytes."""
    added = _added_tokens(tokenizer)
    for text in PROBE_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = []
        for token_id, token in zip(ids, tokenizer.convert_ids_to_tokens(ids), strict=True):
            if token_id in added:
                pieces.append(added[token_id])
                continue
            try:
                pieces.append(bytes(byte_decoder[char] for char in token))
            except KeyError as error:
                raise ByteDecoderError(
                    f"token {token_id} {token!r} of {describe(tokenizer)} has a character "
                    f"missing from the byte decoder: {error.args[0]!r}"
                ) from None
        decoded = b"".join(pieces)
        if decoded != text.encode():
            raise ByteDecoderError(
                f"the byte decoder turns the encoding of {text!r} by {describe(tokenizer)} "
                f"into {decoded!r}"
            )


def _check_probes(tokenizer: Any, vocab: Sequence[bytes]) -> None:
    """Raise `ByteVocabError` unless ``vocab`` reproduces every probe text.

    A single space the tokenizer itself prepends (SentencePiece's ``▁`` prefix) is allowed.
    """
    for text in PROBE_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        joined = b"".join(vocab[i] for i in ids)
        expected = text.encode()
        if joined != expected and not (joined == b" " + expected and not text.startswith(" ")):
            raise ByteVocabError(f"the tokens of {text!r} join to {joined!r}")


def _vocab_size(tokenizer: Any, added: Mapping[int, bytes]) -> int:
    return max(len(tokenizer), max(added, default=-1) + 1)


def _added_tokens(tokenizer: Any) -> dict[int, bytes]:
    """Added and special tokens: id -> UTF-8 of their content."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): str(getattr(t, "content", t)).encode() for i, t in decoder.items()}


def _from_byte_decoder(tokenizer: Any) -> list[bytes] | None:
    """Slow byte-level tokenizers expose their character -> byte table as ``byte_decoder``."""
    byte_decoder = getattr(tokenizer, "byte_decoder", None)
    if not isinstance(byte_decoder, Mapping):
        return None
    check_byte_decoder(tokenizer, byte_decoder)
    added = _added_tokens(tokenizer)
    n = _vocab_size(tokenizer, added)
    tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
    return [
        added[i] if i in added else bytes(byte_decoder[c] for c in token) if token else b""
        for i, token in enumerate(tokens)
    ]


def _from_backend_decoder(tokenizer: Any) -> list[bytes] | None:
    """Replay the fast tokenizer's decoder pipeline on each token string separately."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    if backend.decoder is None:
        raise ByteVocabError("the backend tokenizer has no decoder")
    steps = _flatten(json.loads(backend.decoder.__getstate__()))
    added = {i: t.content.encode() for i, t in backend.get_added_tokens_decoder().items()}
    n = _vocab_size(tokenizer, added)
    pieces: list[str | bytes | None] = list(_backend_token_strings(backend, n))
    for i, content in added.items():
        pieces[i] = content
    fused = False
    for step in steps:
        kind = step["type"]
        if kind == "Fuse":
            fused = True
        elif kind == "Strip" and fused:
            continue  # strips the ends of the whole text only, not of each token
        elif kind in _STEPS:
            pieces = _STEPS[kind](pieces, step)
        else:
            raise ByteVocabError(f"unsupported decoder step {kind!r}")
    return [p if isinstance(p, bytes) else b"" if p is None else p.encode() for p in pieces]


def _backend_token_strings(backend: Any, n: int) -> list[str | None]:
    """The token string of every id, ``None`` for ids without one.

    ``len(tokenizer)`` counts tokens, so each id below it without a token means one
    token has an id at or above it: scan on until all are found.
    """
    pieces = list(map(backend.id_to_token, range(n)))
    missing = pieces.count(None)
    for token_id in range(n, n + _GAP_SCAN_LIMIT if missing else n):
        piece = backend.id_to_token(token_id)
        pieces.append(piece)
        missing -= piece is not None
        if not missing:
            break
    while len(pieces) > n and pieces[-1] is None:
        pieces.pop()
    return pieces


def _flatten(decoder: dict) -> list[dict]:
    if decoder["type"] == "Sequence":
        return [step for sub in decoder["decoders"] for step in _flatten(sub)]
    return [decoder]


def _strings_only(transform: Callable[[str], Any]) -> Callable[[list], list]:
    return lambda pieces: [transform(p) if isinstance(p, str) else p for p in pieces]


def _replace(pieces: list, step: dict) -> list:
    pattern = step["pattern"]
    if "String" not in pattern:
        raise ByteVocabError(f"unsupported Replace pattern {pattern!r}")
    old, new = pattern["String"], step["content"]
    return _strings_only(lambda p: p.replace(old, new))(pieces)


def _metaspace(pieces: list, step: dict) -> list:
    # The decoder also drops the leading space of the first token: a text-boundary effect.
    replacement = step["replacement"]
    return _strings_only(lambda p: p.replace(replacement, " "))(pieces)


def _byte_fallback_value(piece: str) -> bytes | None:
    """``"<0x0A>"`` -> ``b"\\n"``, as tokenizers' ``ByteFallback`` decoder reads it."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    return None


def _byte_fallback(pieces: list, step: dict) -> list:
    def convert(piece: str) -> str | bytes:
        value = _byte_fallback_value(piece)
        return piece if value is None else value

    return _strings_only(convert)(pieces)


def _byte_level(pieces: list, step: dict) -> list:
    """GPT-2 byte-level characters -> bytes, all tokens at once through a lookup table.

    Like tokenizers' ``ByteLevel`` decoder, a token with a character outside the table
    stands for its own UTF-8.
    """
    import numpy as np

    others = [i for i, p in enumerate(pieces) if not isinstance(p, str)]
    strings = list(pieces)
    for i in others:
        strings[i] = ""
    table = _byte_level_table()
    codes = np.frombuffer("".join(strings).encode("utf-32-le"), dtype=np.uint32)
    values = table[np.minimum(codes, table.size - 1)]
    data = values.astype(np.uint8).tobytes()
    offsets = list(accumulate(map(len, strings), initial=0))
    decoded = [data[start:end] for start, end in pairwise(offsets)]
    foreign = np.flatnonzero(values > 255)
    if foreign.size:
        for k in set(np.searchsorted(offsets, foreign, side="right").tolist()):
            decoded[k - 1] = strings[k - 1].encode()
    for i in others:
        decoded[i] = pieces[i]
    return decoded


_TABLE_CACHE: list = []


def _byte_level_table() -> Any:
    """numpy array: code point -> byte value; its last entry, 256, stands for any other character."""
    if not _TABLE_CACHE:
        import numpy as np

        byte_decoder = gpt2_byte_decoder()
        table = np.full(max(map(ord, byte_decoder)) + 2, 256, dtype=np.uint16)
        for char, value in byte_decoder.items():
            table[ord(char)] = value
        _TABLE_CACHE.append(table)
    return _TABLE_CACHE[0]


def _from_decoding_in_context(tokenizer: Any) -> list[bytes] | None:
    """Decode each token after a fixed context token and keep what it adds to the text.

    The context keeps leading spaces that a decoder strips at the start of a text. A token
    that is not valid UTF-8 on its own must be a ``<0xHH>`` byte token.
    """
    if not callable(getattr(tokenizer, "decode", None)):
        return None
    added = _added_tokens(tokenizer)
    n = _vocab_size(tokenizer, added)
    context = list(tokenizer.encode("a", add_special_tokens=False))
    prefix = tokenizer.decode(context, **_DECODE_OPTIONS)
    names = tokenizer.convert_ids_to_tokens(list(range(n)))
    vocab = []
    for token_id, name in enumerate(names):
        if token_id in added:
            vocab.append(added[token_id])
            continue
        text = tokenizer.decode([*context, token_id], **_DECODE_OPTIONS)
        if not text.startswith(prefix):
            raise ByteVocabError(f"decoding token {token_id} after {prefix!r} gives {text!r}")
        piece = text[len(prefix) :]
        if "\ufffd" in piece and "\ufffd" not in str(name):
            value = _byte_fallback_value(str(name))
            if value is None:
                raise ByteVocabError(f"token {token_id} {name!r} does not decode to valid UTF-8")
            vocab.append(value)
        else:
            vocab.append(piece.encode())
    return vocab


_STEPS: dict[str, Callable[[list, dict], list]] = {
    "ByteLevel": _byte_level,
    "Replace": _replace,
    "Metaspace": _metaspace,
    "ByteFallback": _byte_fallback,
}

_METHODS: tuple[tuple[str, Callable[[Any], list[bytes] | None]], ...] = (
    ("byte_decoder", _from_byte_decoder),
    ("backend decoder", _from_backend_decoder),
    ("decoding in context", _from_decoding_in_context),
)
