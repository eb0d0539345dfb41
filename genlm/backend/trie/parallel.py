"""`ParallelTokenCharacterTrie`: the trie's weight functions as torch sparse kernels.

The structure is the one of `TokenCharacterTrie`; on top of it a reachability
matrix ``M[node, leaf]`` (1 when the leaf is in the node's subtree) is kept in
CSR form, one row per node. Columns are leaves in node order, so each row's
columns are one contiguous, sorted run (preorder numbering makes every subtree a
contiguous id range) and weights are permuted to leaf order by one gather.

- sums: ``M @ W`` (one sparse matrix product for a whole batch);
- maxima: ``scatter_reduce`` with ``"amax"`` of the gathered weights onto rows.

That is the path on CUDA, where the matrix is built with the trie. On CPU the
compiled sweep of `TokenCharacterTrie` is several times faster than torch's sparse
kernels (measured in ``benchmark/bench_trie.py``), so it is used instead and the
matrix is only built if ``M`` is read or `sparse_kernels` is switched on. Results
are float32 numpy arrays either way, so callers get the same types from both tries:
on CUDA, one device-to-host copy per call into reused pinned blocks (`ResultBlocks`;
faster than into fresh pageable memory). A caller who wants the result on the
device passes ``out=`` a tensor there, and no host copy is made.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from genlm.backend.trie._results import ResultBlocks
from genlm.backend.trie._weights import checked_out, checked_weights
from genlm.backend.trie.base import TokenCharacterTrie

if TYPE_CHECKING:
    import torch

    from genlm.backend.trie._weights import Out


class ParallelTokenCharacterTrie(TokenCharacterTrie):
    """`TokenCharacterTrie` computing its weights with torch on ``device``.

    Args:
        decode: the vocabulary (see `TokenCharacterTrie`).
        device: ``"cpu"``, ``"cuda"`` (or ``"cuda:N"``), or None for cuda when available.

    Attributes:
        sparse_kernels: whether weights go through the sparse matrix ``M`` with torch
            (the default on CUDA); on CPU the compiled sweep of `TokenCharacterTrie`
            is several times faster than torch's sparse kernels, so it is the default
            there. Results are float32 either way.

    Raises:
        ValueError: unknown device, or cuda requested but unavailable.
    """

    def __init__(self, decode: Sequence[Any], device: str | None = None):
        self.device = _resolve_device(device)
        super().__init__(decode)
        self.sparse_kernels = self.device != "cpu"
        self._results = ResultBlocks(pinned=self.device != "cpu")
        if self.sparse_kernels:
            self._reachability  # noqa: B018 - precompute the matrix next to the model

    @cached_property
    def _reachability(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(M, rows, leaf_order)``: the CSR matrix, the row of each of its entries, and
        the vocabulary position of each column."""
        import torch

        leaf_nodes = np.flatnonzero(self._position >= 0)
        first = np.searchsorted(leaf_nodes, np.arange(self.num_nodes))
        last = np.searchsorted(leaf_nodes, np.arange(self.num_nodes) + self._subtree_size)
        counts = last - first
        crow = np.zeros(self.num_nodes + 1, np.int64)
        np.cumsum(counts, out=crow[1:])
        nnz = int(crow[-1])
        columns = np.arange(nnz, dtype=np.int64) - np.repeat(crow[:-1] - first, counts)
        rows = np.repeat(np.arange(self.num_nodes, dtype=np.int64), counts)
        device = self.device
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
            matrix = torch.sparse_csr_tensor(
                torch.as_tensor(crow, device=device),
                torch.as_tensor(columns, device=device),
                torch.ones(nnz, dtype=torch.float32, device=device),
                size=(self.num_nodes, len(leaf_nodes)),
                check_invariants=False,  # valid by construction
            )
        leaf_order = torch.as_tensor(self._position[leaf_nodes].astype(np.int64), device=device)
        return matrix, torch.as_tensor(rows, device=device), leaf_order

    @property
    def M(self) -> torch.Tensor:
        """Sparse CSR ``[num_nodes, num_leaves]`` reachability: ``M[node, j]`` is 1 when the
        j-th leaf (in node order) is below ``node``."""
        return self._reachability[0]

    def _tensor(self, ws: Any, batched: bool) -> torch.Tensor:
        """Validated float32 ``[B, V]`` tensor on the trie's device, columns in leaf order."""
        import torch

        if batched and isinstance(ws, (list, tuple)):
            rows = [self._tensor(w, batched=False)[0] for w in ws]
            if not rows:
                return torch.empty((0, len(self.decode)), device=self.device)
            return torch.stack(rows)
        ws = checked_weights(ws, len(self.decode), batched)
        if not isinstance(ws, torch.Tensor):
            ws = torch.from_numpy(ws.astype(np.float32, copy=False))
        ws = ws.detach().to(device=self.device, dtype=torch.float32)
        ws = ws if batched else ws[None]
        return ws.index_select(1, self._reachability[2])

    def _sparse_sum(self, ws: torch.Tensor) -> torch.Tensor:
        matrix = self.M
        return (matrix @ ws[0])[None] if ws.shape[0] == 1 else (matrix @ ws.T).T

    def _sparse_max(self, ws: torch.Tensor) -> torch.Tensor:
        import torch

        matrix, rows, _ = self._reachability
        out = torch.full((ws.shape[0], self.num_nodes), -torch.inf, device=self.device)
        index = rows.expand(ws.shape[0], -1)
        return out.scatter_reduce_(1, index, ws.index_select(1, matrix.col_indices()), "amax")

    def _deliver(self, result: torch.Tensor, out: Out | None) -> Out:
        """``result`` (``[B, num_nodes]`` on the device) in ``out``, or in a leased host
        block: one copy, from the device straight into pinned memory on CUDA."""
        import torch

        target = self._results.take(*result.shape) if out is None else out
        (target if isinstance(target, torch.Tensor) else torch.from_numpy(target)).copy_(result)
        return target

    def weight_sum(self, ws: Any, out: Out | None = None) -> Out:
        """Per node, the sum of ``ws`` over the positions below it (float32; NaN propagates).
        ``out``: a float32 ``[num_nodes]`` numpy array or torch tensor (on the trie's
        device: no host copy) to write into; it is returned."""
        if not self.sparse_kernels:
            return self._single(self.batch_weight_sum, ws, out)
        return self._deliver_row(self._sparse_sum(self._tensor(ws, batched=False)), out)

    def weight_max(self, ws: Any, out: Out | None = None) -> Out:
        """Per node, the max of ``ws`` over the positions below it (float32; NaN propagates).
        ``out``: as in `weight_sum`."""
        if not self.sparse_kernels:
            return self._single(self.batch_weight_max, ws, out)
        return self._deliver_row(self._sparse_max(self._tensor(ws, batched=False)), out)

    def batch_weight_sum(self, ws: Any, out: Out | None = None) -> Out:
        """`weight_sum` of B distributions in one kernel call -> float32 ``[B, num_nodes]``.
        ``out``: a float32 ``[B, num_nodes]`` numpy array or torch tensor (on the trie's
        device: no host copy) to write into; it is returned. Without it the result is a
        numpy array the caller owns (see `TokenCharacterTrie.batch_weight_sum`)."""
        if not self.sparse_kernels:
            return super().batch_weight_sum(ws, out)
        ws = self._tensor(ws, batched=True)
        out = None if out is None else checked_out(out, (ws.shape[0], self.num_nodes))
        return self._deliver(self._sparse_sum(ws), out)

    def batch_weight_max(self, ws: Any, out: Out | None = None) -> Out:
        """`weight_max` of B distributions in one kernel call -> float32 ``[B, num_nodes]``
        (``out``: as in `batch_weight_sum`)."""
        if not self.sparse_kernels:
            return super().batch_weight_max(ws, out)
        ws = self._tensor(ws, batched=True)
        out = None if out is None else checked_out(out, (ws.shape[0], self.num_nodes))
        return self._deliver(self._sparse_max(ws), out)

    def _deliver_row(self, result: torch.Tensor, out: Out | None) -> Out:
        if out is None:
            return self._deliver(result, None)[0]
        self._deliver(result, checked_out(out, (self.num_nodes,))[None])
        return out

    def _single(self, batched: Any, ws: Any, out: Out | None) -> Out:
        """One distribution through a batched method (``out`` checked as a single's)."""
        if out is None:
            return batched([ws])[0]
        batched([ws], checked_out(out, (self.num_nodes,))[None])
        return out


def _resolve_device(device: Any) -> str:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    name = str(device)
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or None, got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return name
