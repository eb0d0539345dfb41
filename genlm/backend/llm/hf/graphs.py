"""CUDA graphs of `AsyncTransformer`'s decode steps: `DecodeGraphs` wraps the model's step
(`ModelForward.step`) on a step padded to its shape bucket (`bucket_shape`), one graph per
bucket over static buffers. A wrong row is never served: a bucket's capture and first
replays are checked against the eager forward, and a difference, or a capture or replay
that raises, turns graphs off for the LM. The graphs hold the KV pool's addresses: with
graphs on, the pool is sized once. Design, buckets and covering graphs: docs/kv-store.md.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from genlm.backend.checks import first_line
from genlm.backend.kv.store import RowPlan
from genlm.backend.llm.hf.step import StepInputs, StepShape, exact_shape, host_step

logger = logging.getLogger(__name__)

MAX_ROWS = 256  # larger decode steps run eagerly
# Rows reading more of their own keys run eagerly: a bucket up to 4x a row's keys would
# gather up to 4x the KV an eager step does, at lengths where the gather dominates a step.
MAX_WIDTH = 4096
MAX_GRAPHS = 16  # graphs kept, least recently used dropped first
CHECKED_REPLAYS = 2  # replays of each graph compared with the eager forward
# A replay runs the eager forward's kernels on the same inputs: any difference beyond
# rounding means the capture is wrong (float32 log-probabilities).
REPLAY_TOLERANCE = 1e-3

Forward = Callable[[StepInputs, torch.Tensor], None]


def round_up(n: int, minimum: int) -> int:
    """``n`` (at least ``minimum``) rounded up to 2 or 3 times a power of two: at most 50%
    more, two values per doubling."""
    n = max(n, minimum)
    if n <= 2:
        return n
    step = 1 << (n.bit_length() - 2)
    return -(-n // step) * step


def round_down(n: int) -> int:
    """The largest of `round_up`'s values (2 or 3 times a power of two) up to ``n`` >= 1."""
    step = 1 << max(n.bit_length() - 2, 0)
    return n // step * step


def bucket_shape(shape: StepShape) -> StepShape | None:
    """The graph bucket of a decode step's exact shape (None: the step runs eagerly): rows
    up by at most half (`round_up`), shared slots to a power of two from 16, own keys to a
    power of 4 from 64, so that a growing prefix changes buckets rarely."""
    if shape.new != 1 or shape.rows > MAX_ROWS or shape.past >= MAX_WIDTH:
        return None
    width = 64
    while width < shape.past + 1:
        width *= 4
    shared = 1 << max(shape.shared - 1, 15).bit_length()
    return StepShape(round_up(shape.rows, 1), 1, width - 1, shared)


class Recorder(Protocol):
    """Runs a step's forward eagerly and captures it for replay."""

    def run_eagerly(self, forward: Callable[[], None]) -> None: ...

    def capture(self, forward: Callable[[], None]) -> Callable[[], None]:
        """Capture ``forward`` (without running it); returns its replay."""
        ...


class CudaRecorder:
    """CUDA graphs: captured on a side stream, every graph in one memory pool (a graph's
    memory is scratch: its inputs and outputs live outside the pool, and replays never
    overlap), in ``thread_local`` mode so other threads may use the device meanwhile."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    def run_eagerly(self, forward: Callable[[], None]) -> None:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                forward()
        finally:  # a forward that raised halfway: later work still comes after its kernels
            current.wait_stream(self.stream)

    def capture(self, forward: Callable[[], None]) -> Callable[[], None]:
        """Capture ``forward`` with ``torch.cuda.graph``; if that raises, undo what a
        failed capture leaves behind, then raise. torch 2.13's ``graph.__exit__`` raises
        before ending the allocation to ``self.pool`` (every later ``empty_cache()`` would
        fail: `_end_pool_allocation` ends it) and before restoring the stream (our own
        stream context does). Nothing captured ran, so no sync is needed; the pinned-memory
        allocator's leftover refuses only a capture into this pool, never asked again."""
        graph = torch.cuda.CUDAGraph()
        try:
            with (
                torch.cuda.stream(self.stream),
                torch.cuda.graph(
                    graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
                ),
            ):
                forward()
        except BaseException:
            del graph
            self._end_pool_allocation()
            raise
        return graph.replay

    def _end_pool_allocation(self) -> None:
        """After a failed capture: end the allocator's allocation to the pool if it is still
        on, and give back the pool reference its start took, as
        ``torch.cuda.memory.use_mem_pool`` ends its own."""
        index = self.stream.device_index
        try:
            torch._C._cuda_endAllocateToPool(index, self.pool)
        except RuntimeError:  # "endAllocatePool: not currently recording to mempool_id"
            return
        torch._C._cuda_releasePool(index, self.pool)


class EagerRecorder:
    """A stand-in for CUDA graphs on any device: a replay runs the forward again."""

    def run_eagerly(self, forward: Callable[[], None]) -> None:
        forward()

    def capture(self, forward: Callable[[], None]) -> Callable[[], None]:
        return forward


def recorder_for(device: torch.device) -> Recorder | None:
    """What captures steps on ``device``: CUDA graphs on a CUDA device, nothing elsewhere."""
    return CudaRecorder(device) if device.type == "cuda" else None


@dataclass
class _Graph:
    """One bucket's static buffers and the replay of its forward over them."""

    inputs: torch.Tensor  # int64, laid out as the bucket's `StepShape.sizes`
    step: StepInputs  # views of ``inputs``
    out: torch.Tensor  # [bucket rows, vocab] float32 log-probabilities
    replay: Callable[[], None]
    checks_left: int = CHECKED_REPLAYS


class GraphMismatch(RuntimeError):
    """A replayed step's rows differ from the eager forward's."""


class DecodeGraphs:
    """Decode steps replayed from one CUDA graph per shape bucket (see the module's doc).

    ``forward(step, out)`` runs the model over a step's inputs, its log-probabilities into
    ``out``, allocating only scratch memory; ``block_size`` is the KV pool's. Every graph
    writes its rows into one output buffer of ``max_rows`` rows (at most `MAX_ROWS`)."""

    def __init__(
        self,
        forward: Forward,
        recorder: Recorder,
        device: torch.device,
        vocab_size: int,
        block_size: int,
        max_rows: int = MAX_ROWS,
    ):
        self.forward = forward
        self.recorder = recorder
        self.device = device
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.max_rows = round_up(min(max_rows, MAX_ROWS), 1)
        self.graphs: OrderedDict[StepShape, _Graph] = OrderedDict()
        self.checked: set[StepShape] = set()  # buckets whose replays matched the eager forward
        self.failure: str | None = None  # why graphs are off for good
        # captures, replays, eager forwards checked against, steps run eagerly
        self.captures = self.replays = self.checks = self.eager_steps = 0
        self._out: torch.Tensor | None = None  # allocated at the first capture

    def run(self, plans: Sequence[RowPlan], skip: int, out: torch.Tensor) -> bool:
        """The plans' decode step, reading ``skip`` shared blocks (`cascade_blocks`), from
        a captured graph, rows into ``out``: its inputs built for the graph's bucket
        (`host_step`). False (nothing computed) when the step fits no bucket or graphs are
        off: run it eagerly."""
        if plans[0].new_tokens != 1:
            return False
        if self.failure is not None:
            self.eager_steps += 1
            return False
        exact = exact_shape(plans, self.block_size, skip)
        bucket = bucket_shape(exact)
        if bucket is None or bucket.rows > self.max_rows:
            self.eager_steps += 1
            return False
        if bucket not in self.graphs:
            bucket, skip = self._covering(exact, skip) or (self._spare(bucket, exact), skip)
        host = host_step(plans, self.block_size, skip, bucket, pin=self.device.type == "cuda")
        rows = len(plans)
        try:
            graph = self.graphs.get(bucket)
            if graph is None:
                graph = self._capture(bucket, host)
            else:
                self.graphs.move_to_end(bucket)
                graph.inputs.copy_(host, non_blocking=True)
                graph.replay()
                self.replays += 1
                if graph.checks_left:
                    self._check(graph, rows)
                    if not graph.checks_left:
                        self.checked.add(bucket)
        except Exception as error:  # capture refused, or a replay that is not the forward
            self.failure = _failure(error)
            self.clear()
            logger.warning("CUDA graphs off for this model, steps run eagerly (%s)", self.failure)
            self.eager_steps += 1
            return False
        out.copy_(graph.out[:rows])
        return True

    def clear(self) -> None:
        """Drop every graph (each bucket captures anew) and the output buffer."""
        self.graphs.clear()
        self._out = None

    def _covering(self, exact: StepShape, skip: int) -> tuple[StepShape, int] | None:
        """The captured bucket with the fewest rows that holds the step of shape ``exact``
        (reading ``skip`` shared blocks), and how many of those blocks it reads as shared;
        None if none does. A graph holds a step with at most twice its rows, in its own
        widths once the shared blocks beyond its slots are read as each row's own keys."""
        best: tuple[StepShape, int] | None = None
        block_size = self.block_size
        for shape in self.graphs:
            if not exact.rows <= shape.rows <= 2 * exact.rows:
                continue
            shared = min(skip, shape.shared // block_size)
            past = exact.past + (skip - shared) * block_size
            held = bucket_shape(StepShape(exact.rows, 1, past, shared * block_size))
            if held is None or (held.past, held.shared) != (shape.past, shape.shared):
                continue
            if best is None or (shape.rows, -shape.shared) < (best[0].rows, -best[0].shared):
                best = (shape, shared)
        return best

    def _spare(self, bucket: StepShape, exact: StepShape) -> StepShape:
        """The bucket to capture for a step of shape ``exact`` that no graph holds: its own
        ``bucket``, or, where graphs of its widths exist (its number of rows varies), the
        same widths with rows to spare, up to twice the step's (within `max_rows`)."""
        widths = (bucket.past, bucket.shared)
        if all((shape.past, shape.shared) != widths for shape in self.graphs):
            return bucket
        return replace(bucket, rows=round_down(min(2 * exact.rows, self.max_rows)))

    def _capture(self, bucket: StepShape, host: torch.Tensor) -> _Graph:
        """A new graph for ``bucket``, its first step (inputs ``host``) captured and
        replayed: the graph's out holds the step's rows. Unless the bucket was checked
        before, the step runs eagerly first and the replay must match it."""
        inputs = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        inputs.copy_(host, non_blocking=True)
        step = StepInputs.split(inputs, bucket, True, shared_padded=True)
        if self._out is None:  # allocated outside the graphs' pool
            self._out = torch.empty(
                (self.max_rows, self.vocab_size), dtype=torch.float32, device=self.device
            )
        graph = _Graph(inputs, step, self._out[: bucket.rows], lambda: None)

        def forward() -> None:
            self.forward(step, graph.out)

        checked = bucket in self.checked
        if not checked:
            self.recorder.run_eagerly(forward)
            self.checks += 1
            eager = graph.out.clone()
        graph.replay = self.recorder.capture(forward)
        self.captures += 1
        graph.replay()
        self.replays += 1
        if checked:
            graph.checks_left = 0
        else:
            _compare(graph.out, eager)
        self.graphs[bucket] = graph
        if len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return graph

    def _check(self, graph: _Graph, rows: int) -> None:
        """Compare a replay's rows with the eager forward's (which writes the same KV again)."""
        replayed = graph.out[:rows].clone()
        self.recorder.run_eagerly(lambda: self.forward(graph.step, graph.out))
        self.checks += 1
        _compare(replayed, graph.out[:rows])
        graph.checks_left -= 1


def _failure(error: BaseException) -> str:
    """``Type: first line`` of ``error``, after that of the error it was raised while
    handling, if any (a failed capture's CUDA error hides the forward's own)."""
    cause = error.__cause__ or error.__context__
    described = f"{type(error).__name__}: {first_line(error)}"
    return described if cause is None else f"{described} (after {_failure(cause)})"


def _compare(replayed: torch.Tensor, eager: torch.Tensor) -> None:
    if not torch.allclose(replayed, eager, rtol=0.0, atol=REPLAY_TOLERANCE):
        worst = (replayed - eager).abs().nan_to_num(float("inf")).max().item()
        raise GraphMismatch(f"a replayed step differs from the eager forward by {worst:.3g}")
