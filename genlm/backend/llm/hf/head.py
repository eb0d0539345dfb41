"""`OutputHead`: a model's LM head applied by `AsyncTransformer` itself, the tokenizer's
columns only, into one buffer reused from step to step (a fresh ``[rows, vocab]`` tensor is
page-faulted in on every CPU step). Only for a model whose logits are exactly its head's
output (`plain_head`); any other model runs its own forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class OutputHead:
    """The first ``vocab_size`` rows of a linear LM head, applied into a reused buffer."""

    def __init__(self, linear: torch.nn.Linear, vocab_size: int):
        self.linear = linear
        self.vocab_size = vocab_size
        self._logits: torch.Tensor | None = None

    def logprobs(self, hidden: torch.Tensor, out: torch.Tensor, reuse: bool = True) -> None:
        """``log_softmax(head(hidden))`` over the tokenizer's vocabulary, in float32, into
        ``out`` (``hidden``: ``[rows, hidden_size]``; under ``torch.inference_mode``, as
        the forward runs)."""
        torch.log_softmax(self.logits(hidden, reuse), dim=-1, dtype=torch.float32, out=out)

    def logits(self, hidden: torch.Tensor, reuse: bool = True) -> torch.Tensor:
        """The head's logits over the tokenizer's vocabulary (the benchmarks clock them
        apart from the log-softmax), in the reused buffer (valid until the next call) or,
        if not ``reuse``, in a tensor of their own."""
        weight = self.linear.weight[: self.vocab_size]
        rows = hidden.shape[0]
        logits = self._logits
        if not reuse or logits is None or logits.shape[0] < rows or logits.dtype != weight.dtype:
            logits = torch.empty((rows, self.vocab_size), dtype=weight.dtype, device=weight.device)
            if reuse:
                self._logits = logits
        logits = logits[:rows]
        if self.linear.bias is None:
            return torch.mm(hidden, weight.t(), out=logits)
        return torch.addmm(self.linear.bias[: self.vocab_size], hidden, weight.t(), out=logits)

    def free(self) -> None:
        """Let the logits buffer go (the next call makes a new one)."""
        self._logits = None


def plain_head(model: PreTrainedModel, vocab_size: int, device: torch.device) -> OutputHead | None:
    """An `OutputHead` for ``model`` if its logits are exactly its output head (a plain
    ``nn.Linear``, no hooks) applied to its base model's last hidden state, else None.
    Checked on a one-token probe: the head's input must be the base model's output, and
    the forward return the head's output itself, unchanged (not scaled, capped, converted)."""
    head = model.get_output_embeddings()
    base = getattr(model, "base_model", model)  # a bare nn.Module has none
    if (
        type(head) is not torch.nn.Linear
        or base is model
        or head._forward_hooks
        or head._forward_pre_hooks
        or hasattr(head, "_hf_hook")
        or head.weight.device.type == "meta"
    ):
        return None
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def record(module: torch.nn.Module, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        seen.append((inputs[0], output, output.clone()))

    input_ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    hook = head.register_forward_hook(record)
    try:
        with torch.inference_mode():
            logits = model(input_ids=input_ids, use_cache=False, logits_to_keep=1).logits
            hidden = base(input_ids=input_ids, use_cache=False).last_hidden_state
    finally:
        hook.remove()
    if len(seen) != 1:
        return None
    head_input, head_output, head_values = seen[0]
    plain = (
        head_input.shape == hidden.shape
        and torch.equal(head_input, hidden)
        and logits is head_output
        and torch.equal(logits, head_values)
    )
    return OutputHead(head, vocab_size) if plain else None
