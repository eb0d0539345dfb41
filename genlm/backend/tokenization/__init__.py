"""Exact byte vocabularies of Hugging Face tokenizers."""

from genlm.backend._lazy import lazy_exports

__all__ = ["decode_vocab", "Token", "bytes_to_strs"]

__getattr__, __dir__ = lazy_exports(
    __name__, {"decode_vocab": ".vocab", "bytes_to_strs": ".vocab", "Token": ".token"}
)
