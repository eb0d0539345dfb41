"""CUDA graphs of `AsyncTransformer`'s decode steps.

A decode step (one new token per row; every row reads a shared prefix first, with cascade
attention) launches the same kernels for every step of the same shapes: its rows, the keys
each row reads through its own slots, the shared slots. `DecodeGraphs` rounds a step's
shape up to a bucket (`bucket_shape`: padding rows write and read only a scratch slot,
padding keys and shared slots are masked), captures one CUDA graph per bucket over static
device buffers, and runs a step as one copy of its inputs into the bucket's buffer (from
pinned memory, non-blocking), one replay, and one copy of its rows out: the forward's
Python and its hundreds of kernel launches per step are gone.

A bucket's first step runs the forward eagerly on the static buffers (its answer, and the
warm-up a capture needs), then is captured and replayed; its first two replays are checked
against the eager forward. If one differs, or capture fails (a forward that syncs with the
host, or whose kernels depend on the data), a warning is logged and the LM runs every later
step eagerly: a wrong row is never served. A bucket captured again (dropped from the LRU,
or over a larger output buffer) is not checked again: its kernels are the checked ones.
The graphs hold the KV pool's addresses: on CUDA the pool is sized once and never moves
(`genlm.backend.llm.hf.model.fixed_pool_capacity`).

Only the capture is CUDA's: `EagerRecorder` "replays" by running the forward again, so the
buckets, the padding and the static buffers are tested on a CPU.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from genlm.backend.kv.torch_pool import TorchBlockPool
from genlm.backend.llm.hf.paged import StepInputs, StepShape, cascade_blocks, exact_shape, host_step
from genlm.backend.llm.prefix import QueryPlan

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
    """``n`` (at least ``minimum``) rounded up to 4, 5, 6 or 7 times a power of two: at
    most 25% more, and few distinct values."""
    n = max(n, minimum)
    if n <= 4:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def bucket_shape(shape: StepShape) -> StepShape | None:
    """The graph bucket of a decode step's exact shape (None: the step runs eagerly).

    Rows and shared slots round up by at most 25%; each row's keys (its own tokens, after
    the shared ones) to a power of 4 from 64, so that a row's growth by one token per step
    changes buckets rarely (a 1,000-token generation meets 3 widths); past `MAX_WIDTH` keys
    a step runs eagerly."""
    if shape.new != 1 or shape.rows > MAX_ROWS or shape.past >= MAX_WIDTH:
        return None
    width = 64
    while width < shape.past + 1:
        width *= 4
    return StepShape(round_up(shape.rows, 1), 1, width - 1, round_up(shape.shared, 16))


class Recorder(Protocol):
    """Runs a step's forward eagerly and captures it for replay."""

    def run_eagerly(self, forward: Callable[[], None]) -> None: ...

    def capture(self, forward: Callable[[], None]) -> Callable[[], None]:
        """Capture ``forward`` (without running it); returns its replay."""
        ...


class CudaRecorder:
    """CUDA graphs: captured on a side stream, every graph in one memory pool (a graph's
    memory is scratch: its inputs and outputs are buffers allocated outside the pool, and
    replays never overlap), in ``thread_local`` mode so other threads may use the device
    while a step is captured."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    def run_eagerly(self, forward: Callable[[], None]) -> None:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            forward()
        current.wait_stream(self.stream)

    def capture(self, forward: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(
            graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
        ):
            forward()
        return graph.replay


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
    ``out``, allocating only scratch memory (nothing it allocates may outlive it)."""

    def __init__(self, forward: Forward, recorder: Recorder, device: torch.device, vocab_size: int):
        self.forward = forward
        self.recorder = recorder
        self.device = device
        self.vocab_size = vocab_size
        self.graphs: OrderedDict[StepShape, _Graph] = OrderedDict()
        self.checked: set[StepShape] = set()  # buckets whose replays matched the eager forward
        self.failure: str | None = None  # why graphs are off for good
        self.captures = 0
        self.replays = 0
        self._out = torch.empty((0, vocab_size), dtype=torch.float32, device=device)

    def run(self, plans: Sequence[QueryPlan], pool: TorchBlockPool, out: torch.Tensor) -> bool:
        """The plans' decode step from its bucket's graph, rows into ``out``. False (nothing
        computed) when the step fits no bucket or graphs are off: run it eagerly."""
        if self.failure is not None or plans[0].new_tokens != 1:
            return False
        skip = cascade_blocks(plans, pool.block_size)
        bucket = bucket_shape(exact_shape(plans, pool.block_size, skip))
        if bucket is None:
            return False
        host = host_step(plans, pool.block_size, skip, bucket, pin=self.device.type == "cuda")
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
            self.failure = f"{type(error).__name__}: {error}"
            self.clear()
            logger.warning("CUDA graphs off for this model, steps run eagerly (%s)", self.failure)
            return False
        out.copy_(graph.out[:rows])
        return True

    def clear(self) -> None:
        """Drop every graph (the next step of each bucket captures anew)."""
        self.graphs.clear()
        self._out = self._out.new_empty((0, self.vocab_size))

    def _capture(self, bucket: StepShape, host: torch.Tensor) -> _Graph:
        """A new graph for ``bucket``, its first step (inputs ``host``) captured and
        replayed: the graph's out holds the step's rows. Unless the bucket was checked
        before, the step runs eagerly first and the replay must match it."""
        inputs = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        inputs.copy_(host, non_blocking=True)
        step = StepInputs.split(inputs, bucket, padded=True, shared_padded=True)
        graph = _Graph(inputs, step, self._out_rows(bucket.rows), lambda: None)

        def forward() -> None:
            self.forward(step, graph.out)

        checked = bucket in self.checked
        if not checked:
            self.recorder.run_eagerly(forward)
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
        """Compare a replay's rows with the eager forward's on the same inputs (which writes
        the same KV again)."""
        replayed = graph.out[:rows].clone()
        self.recorder.run_eagerly(lambda: self.forward(graph.step, graph.out))
        _compare(replayed, graph.out[:rows])
        graph.checks_left -= 1

    def _out_rows(self, rows: int) -> torch.Tensor:
        """``rows`` rows of the one output buffer (allocated outside the graphs' pool). A
        larger one replaces it and the graphs captured over the old one are dropped (each
        is captured again, unchecked, at its next step), so that one buffer is alive, the
        largest bucket's: graphs kept over buffers of growing sizes held up to ~6 times it
        (buckets 25% apart), 64 MB a buffer at 128 rows of a 128k vocabulary."""
        if self._out.shape[0] < rows:
            self.clear()
            self._out = torch.empty(
                (rows, self.vocab_size), dtype=torch.float32, device=self.device
            )
        return self._out[:rows]


def _compare(replayed: torch.Tensor, eager: torch.Tensor) -> None:
    if not torch.allclose(replayed, eager, rtol=0.0, atol=REPLAY_TOLERANCE):
        worst = (replayed - eager).abs().nan_to_num(float("inf")).max().item()
        raise GraphMismatch(f"a replayed step differs from the eager forward by {worst:.3g}")
