"""`OpCounter`: the aten ops a piece of code runs, and the GPU kernels they stand for,
counted (deterministic, unlike time).

A step's kernel count stands in for its launches on a GPU, on any machine. Used by
``bench_host.py`` (a decode step against the hand-written floor) and by tests/test_hf_step.py,
tests/test_hf_graphs.py and tests/test_sampling.py (counts that must not grow with the
particles or the context).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

# Inputs of one launch of CUDA's batched cat kernel (``CAT_ARRAY_BATCH_SIZE`` in ATen's
# cuda/Shape.cu, for contiguous inputs): ``cat`` and ``stack`` launch one per this many.
CAT_INPUTS_PER_KERNEL = 128


class OpCounter(TorchDispatchMode):
    """Counts the aten ops its thread runs while it is entered, by overload: ``counts``,
    every op that reaches the dispatcher below autograd (views included), and ``kernels``,
    the kernel launches they stand for on a GPU (`kernel_launches`)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.kernels: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        self.counts[name] += 1
        self.kernels[name] += kernel_launches(func, args)
        return func(*args, **(kwargs or {}))


def kernel_launches(func: Any, args: Any) -> int:
    """The kernels an aten op launches on CUDA, at most: none for a view, one per tensor
    for a ``_foreach_*`` op (``_foreach_clone`` launches a clone each; arithmetic ones may
    fuse tensors into fewer), one per `CAT_INPUTS_PER_KERNEL` inputs for ``cat`` and
    ``stack``, one for any other op (an allocation too)."""
    if func.is_view:
        return 0
    name = func.overloadpacket.__name__
    if name.startswith("_foreach_"):
        return len(args[0])
    if name in ("cat", "stack"):
        return -(-len(args[0]) // CAT_INPUTS_PER_KERNEL)
    return 1
