"""`AsyncSGLTransformer`: the SGLang backend (GPU), through SGLang's offline ``Engine`` API.

Full-vocabulary next-token log-probabilities come from SGLang's public ``generate``
arguments: one new token per request with ``return_logprob=True`` and
``token_ids_logprob`` set to every token id of the tokenizer, read back from
``meta_info["output_token_ids_logprobs"]``. Requests go through the shared
`AutoBatcher` (one ``generate`` call per batch, on the batcher's worker thread), which
runs the engine's own event loop (`give_engine_its_own_loop`), so an engine built inside
a running event loop (async code, a notebook cell) serves like one built outside.
sglang is imported only when an engine is built.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from genlm.backend._install import install_hint
from genlm.backend.llm.engine import EngineLM
from genlm.backend.llm.options import takes_options
from genlm.backend.llm.protocols import SGLEngine
from genlm.backend.llm.request import Query

SGL_INSTALL_HINT = install_hint("sgl")


def import_sglang() -> Any:
    """Import sglang, or raise an ImportError naming the pip extra that installs it."""
    try:
        import sglang
    except ImportError as error:
        raise ImportError(
            f"The SGLang backend (AsyncSGLTransformer) needs sglang: {SGL_INSTALL_HINT} "
            "(SGLang needs a CUDA GPU)."
        ) from error
    return sglang


def engine_tokenizer(sgl_model: SGLEngine) -> Any:
    """The Hugging Face tokenizer an SGLang ``Engine`` loaded (it has no public getter)."""
    return sgl_model.tokenizer_manager.tokenizer


def row_from_meta_info(meta_info: dict[str, Any], width: int) -> torch.Tensor:
    """The ``[width]`` row of log-probabilities of the first generated position.

    Entries are ``(logprob, token_id, text)``; ids missing from the answer get -inf.
    """
    (position,) = meta_info["output_token_ids_logprobs"][:1]
    row = torch.full((width,), float("-inf"))
    ids = torch.tensor([entry[1] for entry in position], dtype=torch.long)
    values = torch.tensor([entry[0] for entry in position], dtype=torch.float32)
    keep = ids < width
    row[ids[keep]] = values[keep]
    return row


def give_engine_its_own_loop(sgl_model: SGLEngine) -> None:
    """Give the engine a new event loop if the one it holds is running (the caller's).

    ``sglang.Engine`` keeps as ``.loop`` the event loop running where it was built (a new
    one if none was) and runs each blocking call (``generate``, ...) with
    ``loop.run_until_complete``, here on the batcher's worker thread. A loop that runs
    elsewhere cannot be run there ("This event loop is already running"); the engine's
    tasks start on its first request, so until then the loop can be replaced.
    """
    loop = getattr(sgl_model, "loop", None)
    if isinstance(loop, asyncio.AbstractEventLoop) and loop.is_running():
        sgl_model.loop = asyncio.new_event_loop()


class AsyncSGLTransformer(EngineLM):
    """An SGLang ``Engine`` behind the `AsyncLM` interface.

    Args:
        sgl_model: an ``sglang.Engine`` (anything with its ``generate``, ``flush_cache``,
            ``shutdown`` and ``tokenizer_manager.tokenizer``).

    The other arguments are the options of `EngineLM` (``cache_size``, ``cache_opts``)
    and `BatchedAsyncLM` (``batch_size``, ``timeout``), each an attribute of the LM too.
    """

    @takes_options
    def __init__(
        self,
        sgl_model: SGLEngine,
        cache_size: int = EngineLM.cache_size.default,
        cache_opts: dict[str, Any] | None = EngineLM.cache_opts.default,
        batch_size: int = EngineLM.batch_size.default,
        timeout: float | None = EngineLM.timeout.default,
    ):
        self.sgl_model = sgl_model
        give_engine_its_own_loop(sgl_model)
        super().__init__(
            engine_tokenizer(sgl_model), cache_size, cache_opts, batch_size, timeout, "genlm-sgl"
        )
        self._all_token_ids = list(range(self.vocab_size))

    @classmethod
    def from_name(
        cls,
        model_id: str,
        engine_opts: dict[str, Any] | None = None,
        gpu_id: int = 0,
        **kwargs: Any,
    ) -> AsyncSGLTransformer:
        """Start an SGLang engine for ``model_id`` on GPU ``gpu_id`` (inside a running
        event loop too: see `give_engine_its_own_loop`).

        Args:
            engine_opts: keyword arguments for ``sglang.Engine`` (its ``ServerArgs``),
                e.g. ``dtype``, ``mem_fraction_static``, ``tp_size``.
            gpu_id: the first GPU to use (``base_gpu_id``).
            **kwargs: for the constructor (``cache_size``, ``batch_size``, ...).
        """
        cls.check_constructor_options(kwargs)
        sglang = import_sglang()
        engine = sglang.Engine(model_path=model_id, base_gpu_id=gpu_id, **(engine_opts or {}))
        return cls(engine, **kwargs)

    def _compute_batch(self, keys: list[Query]) -> torch.Tensor:
        """One ``generate`` call: the ``[B, V]`` next-token log-probabilities of ``keys``."""
        self._check_open()
        adapters = {}
        if any(key.lora is not None for key in keys):
            # SGLang's per-request adapter: the name given to load_lora_adapter, None for base.
            adapters["lora_path"] = [key.lora for key in keys]
        outputs = self.sgl_model.generate(
            input_ids=[list(key.token_ids) for key in keys],
            # temperature 1: SGLang may report temperature-scaled log-probabilities.
            sampling_params={"max_new_tokens": 1, "temperature": 1.0},
            return_logprob=True,
            token_ids_logprob=[self._all_token_ids] * len(keys),
            **adapters,
        )
        if isinstance(outputs, dict):
            outputs = [outputs]
        if len(outputs) != len(keys):
            raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {len(keys)} requests")
        rows = torch.stack(
            [row_from_meta_info(out["meta_info"], self.vocab_size) for out in outputs]
        )
        return torch.log_softmax(rows, dim=-1)

    def _load_lora(self, lora_path: str, lora_name: str) -> None:
        """Load the adapter into the engine (``enable_lora`` in ``engine_opts``); a name
        registered again is unloaded first."""
        if lora_name in self.lora_paths:
            self._unload_lora(lora_name)
        self.batcher.run_sync(
            lambda: self.sgl_model.load_lora_adapter(lora_name=lora_name, lora_path=lora_path)
        )

    def _unload_lora(self, lora_name: str) -> None:
        self.batcher.run_sync(lambda: self.sgl_model.unload_lora_adapter(lora_name=lora_name))
        self._clear_lora_results(lora_name)

    def clear_kv_cache(self) -> None:
        """Empty SGLang's prefix (radix) KV cache."""
        self._check_open()
        self.batcher.run_sync(self.sgl_model.flush_cache)

    def _stop_engine(self) -> None:
        self.sgl_model.shutdown()
