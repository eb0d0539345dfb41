"""The measured source tree's `AsyncTransformer`, built and looked into in one way for this
tree and for a ``--compare`` baseline (an older commit may lack an option, or keep a part
under another name): `library_lm` builds one on either decode path; `graph_counts` and
`pool_mb` read what its decode steps ran as and the KV pool it holds."""

from __future__ import annotations

import inspect
from typing import Any

# What a graph LM's decode steps ran as besides replays (`DecodeGraphs`' counters): none of
# them should happen inside a timed window, which is then the steady state.
GRAPH_EVENTS = ("captures", "checks", "eager_steps")
# The KV pool's share of the free device memory where the tree sizes CUDA pools so: small,
# so that the budget sizes it (two LMs and the floors share the device).
POOL_FRACTION = 0.01


def library_lm(model: Any, tokenizer: Any, device: str, graphs: bool, **options: Any) -> Any:
    """An `AsyncTransformer` of the source tree measured, with ``cuda_graphs=graphs``; on a
    CPU (the dry run) graphs get the stand-in recorder (a replay runs the forward again),
    so that the dry run goes through the graph path's code too. Where the tree sizes a
    CUDA pool by the free memory as well, only `POOL_FRACTION` of it: the KV budget sizes
    the pool, as LMs and floors share the device."""
    from unittest import mock

    import genlm.backend.llm.hf.model as hf_model
    from genlm.backend.llm.hf.graphs import EagerRecorder

    options["cuda_graphs"] = graphs
    if "cuda_kv_memory_fraction" in inspect.signature(hf_model.AsyncTransformer).parameters:
        options["cuda_kv_memory_fraction"] = POOL_FRACTION
    if device.startswith("cuda") or not graphs:
        return hf_model.AsyncTransformer(model, tokenizer, **options)
    # where the tree builds its graphs: the runner's module, or (before it) the LM's
    try:
        import genlm.backend.llm.hf.runner as builder
    except ImportError:
        builder = hf_model
    with mock.patch.object(builder, "recorder_for", lambda device: EagerRecorder()):
        return hf_model.AsyncTransformer(model, tokenizer, **options)


def decode_graphs(lm: Any) -> Any:
    """The LM's `DecodeGraphs` (its runner's; a tree from before the runner held them
    as ``_graphs``), or None without graphs."""
    runner = getattr(lm, "runner", None)
    return getattr(runner, "graphs", None) if runner is not None else getattr(lm, "_graphs", None)


def graph_counts(lm: Any) -> dict[str, int | None] | None:
    """What the LM's decode steps ran as so far (`DecodeGraphs`' counters; None where the
    tree has no such counter), or None without graphs."""
    graphs = decode_graphs(lm)
    if graphs is None:
        return None
    return {key: getattr(graphs, key, None) for key in ("replays", *GRAPH_EVENTS)}


def pool_mb(lm: Any) -> float | None:
    """MiB of the LM's KV pool as allocated now (its runner's; ``_pool`` in a tree from
    before the runner), or None where it holds none yet."""
    runner = getattr(lm, "runner", None)
    pool = getattr(runner, "pool", None) if runner is not None else getattr(lm, "_pool", None)
    if pool is None or not getattr(pool, "layers", None):
        return None
    return sum(layer.numel() * layer.element_size() for layer in pool.layers) / 2**20
