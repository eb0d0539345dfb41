"""`OpCounter`: the aten ops a piece of code runs, counted (deterministic, unlike time).

On a GPU each non-view op is a kernel launch, so a step's op count stands in for its
launches on any machine. Used by ``bench_host.py`` (a decode step against the
hand-written floor) and by tests/test_hf_step.py and tests/test_sampling.py (counts that
must not grow with the particles or the context).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts the aten ops its thread runs while it is entered, by overload (every op that
    reaches the dispatcher below autograd, views included)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))
