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

# Allocations: on CUDA the caching allocator hands out memory it holds, with no kernel.
ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})

# ``_foreach_*`` ops with a fused CUDA kernel (ATen's ForeachBinaryOpScalar.cu,
# ForeachBinaryOpList.cu, ForeachUnaryOp.cu: ``multi_tensor_apply``), by the tensor lists
# each launch reads and writes (its "depth"). Other ``_foreach_*`` ops launch a kernel per
# tensor (``_foreach_clone`` clones each).
FUSED_FOREACH_DEPTH = {
    "_foreach_mul.Scalar": 2,  # inputs, outputs (out of place)
    "_foreach_copy_.default": 2,  # sources, targets
    "_foreach_zero_.default": 1,
}
# ``multi_tensor_apply``'s limits per launch (ATen's cuda/MultiTensorApply.cuh,
# ``DepthToMaxConfig<true>``: the 32 KB kernel arguments of a CUDA >= 12.1 build on a
# driver >= 530 and a Volta or newer GPU, as the GPU lock's CUDA 13 torch on an H100/H200
# runs; 110/64/... tensors and 320 blocks with 4 KB arguments): each tensor in chunks of
# ``MULTI_TENSOR_CHUNK`` elements, one block per chunk.
MULTI_TENSOR_CHUNK = 65536
MULTI_TENSOR_MAX_TENSORS = {1: 770, 2: 448, 3: 336, 4: 252, 5: 210}
MULTI_TENSOR_MAX_BLOCKS = 2240


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
    """The kernels an aten op launches on CUDA, at most: none for a view or an allocation,
    `multi_tensor_launches` for a fused ``_foreach_*`` op, one per tensor for another
    ``_foreach_*`` op, one per `CAT_INPUTS_PER_KERNEL` inputs for ``cat`` and ``stack``,
    one for any other op."""
    name = func.overloadpacket.__name__
    if func.is_view or name in ALLOCATIONS:
        return 0
    depth = FUSED_FOREACH_DEPTH.get(f"{name}.{func._overloadname}")
    if depth is not None:
        return multi_tensor_launches([t.numel() for t in args[0]], depth)
    if name.startswith("_foreach_"):
        return len(args[0])
    if name in ("cat", "stack"):
        return -(-len(args[0]) // CAT_INPUTS_PER_KERNEL)
    return 1


def multi_tensor_launches(sizes: list[int], depth: int) -> int:
    """The launches of ATen's ``multi_tensor_apply`` over tensors of ``sizes`` elements:
    a launch when its blocks are full, or its tensors are and the last one's chunks are
    all placed (a tensor whose chunks spill over starts the next launch)."""
    launches = blocks = tensors = 0
    for size in sizes:
        if size == 0:
            continue
        tensors += 1
        chunks = -(-size // MULTI_TENSOR_CHUNK)
        for chunk in range(chunks):
            blocks += 1
            last = chunk == chunks - 1
            if (tensors == MULTI_TENSOR_MAX_TENSORS[depth] and last) or (
                blocks == MULTI_TENSOR_MAX_BLOCKS
            ):
                launches += 1
                blocks = 0
                tensors = 0 if last else 1
    return launches + (blocks > 0)
