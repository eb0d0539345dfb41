"""genlm.backend: fast, asynchronous, auto-batched language models for probabilistic programs.

Public names are imported lazily so that ``import genlm.backend`` stays cheap.
"""

from genlm.backend._lazy import lazy_exports

__all__ = [
    "load_model_by_name",
    "AsyncVirtualLM",
    "AsyncTransformer",
    "decode_vocab",
    "Token",
    "TokenCharacterTrie",
    "ParallelTokenCharacterTrie",
    "AsyncTokenCharacterTrie",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "load_model_by_name": ".llm",
        "AsyncVirtualLM": ".llm",
        "AsyncTransformer": ".llm",
        "decode_vocab": ".tokenization",
        "Token": ".tokenization",
        "TokenCharacterTrie": ".trie",
        "ParallelTokenCharacterTrie": ".trie",
        "AsyncTokenCharacterTrie": ".trie",
    },
)
