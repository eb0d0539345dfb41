"""`OutputHead` (the LM head applied into reused memory) and `plain_head`, which lets only
models whose logits are exactly their head's output over their base model use it: each
is checked against the model's own forward (transformers' code, not ours)."""

import pytest
import torch
from small_models import tiny_llama
from transformers import LlamaForCausalLM

from genlm.backend.llm.hf import AsyncTransformer
from genlm.backend.llm.hf.head import OutputHead, plain_head

VOCAB = 1000


def own_forward(model, vocab_size, ids):
    """The model's own forward of a whole context, its last row's float32 logprobs."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        return torch.log_softmax(logits[:vocab_size].float(), -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_head_gives_the_linear_layers_logprobs_over_the_first_columns(dtype, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, VOCAB + 24, bias=bias).to(dtype)  # 24 padding rows
    head = OutputHead(linear, VOCAB)
    hidden = torch.randn(5, 16, dtype=dtype)
    out = torch.empty(5, VOCAB)
    with torch.inference_mode():  # as the forward runs it
        head.logprobs(hidden, out)
        want = torch.log_softmax(linear(hidden)[:, :VOCAB].float(), -1)
    assert torch.allclose(out, want, atol=1e-6)
    # the buffer is reused (fewer rows next, then more): each call stands alone
    with torch.inference_mode():
        head.logprobs(hidden[:2] * 2, out[:2])
        head.logprobs(hidden, out)
    assert torch.allclose(out, want, atol=1e-6)


class ScaledLlama(LlamaForCausalLM):
    """A Llama whose forward scales its logits after the head (as Cohere's and Granite's do)."""

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits = output.logits * 0.5
        return output


class CappedInPlaceLlama(LlamaForCausalLM):
    """A Llama that softcaps its logits in place (the same tensor comes back, changed)."""

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits.div_(3.0).tanh_().mul_(3.0)
        return output


def variant(cls, vocab_size):
    model = tiny_llama(vocab_size, std=0.3)
    other = cls(model.config).eval()
    other.load_state_dict(model.state_dict())
    return other


def test_a_plain_llama_uses_the_head(smollm2_tokenizer):
    model = tiny_llama(len(smollm2_tokenizer))
    assert isinstance(plain_head(model, len(smollm2_tokenizer), torch.device("cpu")), OutputHead)


@pytest.mark.parametrize("cls", [ScaledLlama, CappedInPlaceLlama])
def test_a_model_that_changes_its_logits_runs_its_own_forward(smollm2_tokenizer, cls):
    model = variant(cls, len(smollm2_tokenizer))
    assert plain_head(model, len(smollm2_tokenizer), torch.device("cpu")) is None
    lm = AsyncTransformer(model, smollm2_tokenizer, batch_size=4)
    assert lm.runner.forward.head is None
    prompt = list(range(5, 40))
    rows = lm.batch_next_token_logprobs_sync([prompt + [7], prompt + [8]])
    for ids, row in zip([prompt + [7], prompt + [8]], rows, strict=True):
        assert torch.allclose(row, own_forward(model, lm.vocab_size, ids), atol=1e-4)


def test_a_hooked_or_wrapped_head_is_left_to_the_model(smollm2_tokenizer):
    model = tiny_llama(len(smollm2_tokenizer))
    hook = model.lm_head.register_forward_hook(lambda module, inputs, output: output * 2)
    assert plain_head(model, len(smollm2_tokenizer), torch.device("cpu")) is None
    hook.remove()
    model.lm_head = torch.nn.Sequential(model.lm_head)  # not a plain Linear
    assert plain_head(model, len(smollm2_tokenizer), torch.device("cpu")) is None


def test_rows_through_the_head_are_the_models_own_forward(smollm2_tokenizer):
    model = tiny_llama(len(smollm2_tokenizer), std=0.3)
    lm = AsyncTransformer(model, smollm2_tokenizer, batch_size=8)
    assert lm.runner.forward.head is not None
    prompt = list(range(5, 90))
    contexts = [prompt + [i + 1] for i in range(6)]
    for step in range(3):
        rows = lm.batch_next_token_logprobs_sync(contexts)
        for ids, row in zip(contexts, rows, strict=True):
            assert torch.allclose(row, own_forward(model, lm.vocab_size, ids), atol=1e-4)
        contexts = [c + [(31 * i + step) % 900 + 1] for i, c in enumerate(contexts)]
