"""`RecentEntries`: a map that keeps what was added lately, sized to its callers' steps.

A decode step looks up what the previous step added (the validated prefixes its requests
extend, the tree nodes made for them), so an entry is needed for about one step. Entries
are kept in two generations: the current one takes new entries; once it is full, the
previous one is dropped and the current one becomes the previous. A generation is full at
``entries`` entries (at first two steps of 128 particles, whatever the context length: a
step's bookkeeping is the same at 64 and at 1,024 tokens) or at ``max_tokens`` tokens
(what bounds the memory of long prefixes); its user doubles ``entries`` (`grow`) when it
finds that an entry it needed was dropped (its steps are larger).

Entries that live a few steps are collected young: a validated prefix is a tuple of its
whole context, and one that reaches the collector's older generations is walked again at
each of their collections (with generations of a million tokens, each prefix of 128
particles on a 1,024-token prompt lived 8 to 16 steps). A lookup probes both generations
and a rotation swaps two dicts: what a step calls depends on its requests alone.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# Entries a generation holds at first: two steps of 128 particles.
RECENT_ENTRIES = 256
# Most entries a generation grows to.
MAX_RECENT_ENTRIES = 1 << 20
# Most tokens a generation holds (the entries' ``tokens`` summed).
RECENT_TOKENS = 1 << 20


class RecentEntries(Generic[K, V]):
    """Values by key, each standing for ``tokens`` tokens (see `add`), kept until the
    generation after the one they were added in is full. Callers on several threads may
    race: the worst outcome is a lost entry."""

    def __init__(self, max_tokens: int = RECENT_TOKENS, entries: int = RECENT_ENTRIES):
        self.max_tokens = max_tokens
        self.entries = entries
        self._current: dict[K, V] = {}
        self._previous: dict[K, V] = {}
        self._tokens = 0

    def get(self, key: K) -> V | None:
        """The value of ``key``, or None."""
        return self._current.get(key, self._previous.get(key))

    def add(self, key: K, value: V, tokens: int) -> dict[K, V] | None:
        """Keep ``value`` for ``key``, ``tokens`` long (what ``max_tokens`` counts); the
        generation this drops, if it rotates."""
        self._tokens += tokens
        dropped = None
        if len(self._current) >= self.entries or self._tokens > self.max_tokens:
            dropped, self._previous, self._current = self._previous, self._current, {}
            self._tokens = tokens
        self._current[key] = value
        return dropped

    def grow(self) -> None:
        """Make a generation hold twice the entries (an entry was dropped before its use)."""
        self.entries = min(MAX_RECENT_ENTRIES, 2 * self.entries)
