"""Token-character tries: map token distributions onto byte prefixes."""

from genlm.backend._lazy import lazy_exports

__all__ = ["TokenCharacterTrie", "ParallelTokenCharacterTrie", "AsyncTokenCharacterTrie"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "TokenCharacterTrie": ".base",
        "ParallelTokenCharacterTrie": ".parallel",
        "AsyncTokenCharacterTrie": ".async_impl",
    },
)
