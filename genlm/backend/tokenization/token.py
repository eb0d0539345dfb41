"""`Token`: the exact bytes of one vocabulary entry, tagged with its id.

A `Token` *is* its bytes (``len``, indexing, slicing, iteration, ``b"".join``,
``.decode()`` all behave as on ``bytes``) but two tokens compare, hash and sort
by ``token_id``, so distinct vocabulary entries with equal bytes stay distinct.
Tokens are immutable (like ``bytes``): ``token_id`` cannot be reassigned, since a
token's hash, and so its place in every dict and set holding it, depends on it.
"""

from __future__ import annotations

import numbers
from typing import Any


class Token(bytes):
    """A vocabulary entry: ``Token(token_id, byte_string)``."""

    token_id: int

    def __new__(cls, token_id: int, byte_string: bytes) -> Token:
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
            raise TypeError(f"token_id must be an int, got {type(token_id).__name__}: {token_id!r}")
        if token_id < 0:
            raise ValueError(f"token_id must be >= 0, got {token_id}")
        if not isinstance(byte_string, (bytes, bytearray)):
            raise TypeError(
                f"byte_string must be bytes, got {type(byte_string).__name__}: {byte_string!r}"
            )
        token = super().__new__(cls, byte_string)
        token.__dict__["token_id"] = int(token_id)
        return token

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"Token is immutable: cannot set {name!r}; build a new Token(token_id, byte_string)"
        )

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Token is immutable: cannot delete {name!r}")

    @property
    def byte_string(self) -> bytes:
        """The token's bytes as a plain ``bytes`` object."""
        return bytes(self)

    @staticmethod
    def as_bytes(x: Any) -> Any:
        """Plain bytes of a `Token`; any other value is returned unchanged."""
        return bytes(x) if isinstance(x, Token) else x

    @staticmethod
    def is_plain_bytes(x: Any) -> bool:
        """True for ``bytes`` that are not a `Token`."""
        return isinstance(x, bytes) and not isinstance(x, Token)

    def __repr__(self) -> str:
        return f"Token(token_id={self.token_id}, byte_string={bytes(self)!r})"

    __str__ = __repr__

    def __hash__(self) -> int:
        return hash(("Token", self.token_id))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id == other.token_id
        return bytes.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    def _compare(self, other: object, op: str) -> Any:
        if isinstance(other, Token):
            return getattr(self.token_id, op)(other.token_id)
        return getattr(bytes, op)(self, other)

    def __lt__(self, other: object) -> bool:
        return self._compare(other, "__lt__")

    def __le__(self, other: object) -> bool:
        return self._compare(other, "__le__")

    def __gt__(self, other: object) -> bool:
        return self._compare(other, "__gt__")

    def __ge__(self, other: object) -> bool:
        return self._compare(other, "__ge__")

    def __reduce__(self) -> tuple:
        return (Token, (self.token_id, bytes(self)))

    def __deepcopy__(self, memo: dict) -> Token:
        return Token(self.token_id, bytes(self))

    def __copy__(self) -> Token:
        return self
