"""The model object a user hands to `AsyncTransformer` stays theirs (SPEC §3): LMs over one
model object each give their own right rows, while the other loads adapters; a user's own
change of the model's attention implementation, train mode, dtype, device or adapters
under a live LM gives right rows or a clear error; `close` leaves the model as it was
given. Rows are checked against an uncached forward of a separate copy of the model (an
adapter's: of a copy with the adapter merged into its weights), on a tiny random Llama.
"""

import asyncio
import copy

import pytest
import torch
from small_models import tiny_llama

from genlm.backend.llm.hf import AsyncTransformer

peft = pytest.importorskip("peft")
pytestmark = [
    # peft 0.21's get_peft_model reads a property transformers 5.23 deprecated
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

TOL = 1e-4  # float32 rows: KV-reused, cascade or peft's unmerged update vs one plain forward
MODEL = {"hidden_size": 32, "std": 0.3}
PROMPT = [(13 * j) % 700 + 2 for j in range(70)]  # shared by the particles: cascade (>= 64)
LORA = {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def fresh_model(tokenizer, **config):
    return tiny_llama(len(tokenizer), attn_implementation="sdpa", **MODEL, **config)


def save_adapter(model, path, seed):
    """A LoRA adapter of ``model``'s shape with random non-zero B, saved at ``path``; returns
    a copy of the model with it merged into its weights."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(**LORA, init_lora_weights=False)
    adapted = peft.get_peft_model(copy.deepcopy(model), config)
    adapted.save_pretrained(path)
    return adapted.merge_and_unload().eval()


def plain_row(model, ids):
    """log_softmax of one plain forward of the whole context (no cache)."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(ids)]), use_cache=False).logits[0, -1]
        return torch.log_softmax(logits.float(), -1)


def assert_rows(rows, references):
    """Every ``(ids, lora) -> row`` is the reference model's plain forward of ``ids``."""
    assert rows
    for (ids, lora), row in rows.items():
        diff = (row - plain_row(references[lora], ids)).abs().max().item()
        assert diff <= TOL, f"adapter {lora!r}, {len(ids)} tokens: off by {diff}"


async def particles(lm, rows, count=4, steps=3, lora=None, between=None):
    """``count`` particles on `PROMPT`, gathered: each extends its context by ``steps``
    tokens, awaiting every prefix's row (into ``rows``); ``between(step)`` runs after each
    step of particle 0 (the others go on meanwhile)."""

    async def particle(index):
        ctx = [*PROMPT, index + 1]
        for step in range(steps):
            rows[tuple(ctx), lora] = await lm.next_token_logprobs(ctx, lora_name=lora)
            ctx = ctx + [(7 * index + 11 * step) % 900 + 1]
            if index == 0 and between is not None:
                await between(step)

    await asyncio.gather(*(particle(i) for i in range(count)))


def user_logits(model):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([PROMPT]), use_cache=False).logits


async def test_two_lms_over_one_model_each_give_their_own_rows_while_one_loads_an_adapter(
    smollm2_tokenizer, tmp_path
):
    model = fresh_model(smollm2_tokenizer)
    references = {None: copy.deepcopy(model), "a": save_adapter(model, tmp_path / "a", 1)}
    first = AsyncTransformer(model, smollm2_tokenizer, batch_size=8)
    second = AsyncTransformer(model, smollm2_tokenizer, batch_size=8)
    first_rows, second_rows = {}, {}

    async def load(step):
        if step == 0:  # on the first LM, mid-run: its worker loads it as the second steps
            await asyncio.to_thread(first.add_new_lora, str(tmp_path / "a"), "a")

    await asyncio.gather(
        particles(first, first_rows, between=load),
        particles(second, second_rows, steps=4),
    )
    await asyncio.gather(
        particles(first, first_rows, lora="a"),
        particles(second, second_rows, steps=5),
        particles(first, first_rows, steps=5),
    )
    assert_rows(first_rows, references)
    assert_rows(second_rows, references)
    assert (first_rows[(*PROMPT, 1), "a"] - first_rows[(*PROMPT, 1), None]).abs().max() > 0.1
    first.close()  # its adapter goes; the second LM's rows stay right
    rows = {}
    await particles(second, rows, steps=6)
    assert_rows(rows, references)
    second.close()


def test_close_leaves_the_model_as_it_was_given(smollm2_tokenizer, tmp_path):
    model = fresh_model(smollm2_tokenizer).train()
    save_adapter(model, tmp_path / "a", 1)
    model.eval()
    before = user_logits(model)
    modules = [(name, type(module)) for name, module in model.named_modules()]
    model.train()
    grads = [p.requires_grad for p in model.parameters()]
    given = model.config._attn_implementation

    lm = AsyncTransformer(model, smollm2_tokenizer, batch_size=8)
    lm.add_new_lora(str(tmp_path / "a"), "a")
    lm.batch_next_token_logprobs_sync([[*PROMPT, 1], [*PROMPT, 2]], lora_name="a")
    lm.next_token_logprobs_sync([*PROMPT, 3])
    lm.close()

    assert model.training and all(m.training for m in model.modules())
    assert model.config._attn_implementation == given
    assert [p.requires_grad for p in model.parameters()] == grads
    assert [(name, type(module)) for name, module in model.named_modules()] == modules
    assert not hasattr(model, "peft_config")
    assert torch.equal(user_logits(model.eval()), before)


def test_the_last_of_two_lms_to_close_restores_the_model(smollm2_tokenizer):
    model = fresh_model(smollm2_tokenizer).train()
    first = AsyncTransformer(model, smollm2_tokenizer)
    second = AsyncTransformer(model, smollm2_tokenizer)
    assert not model.training
    first.close()
    assert not model.training  # the second still serves it
    second.next_token_logprobs_sync([*PROMPT, 1])
    second.close()
    assert model.training and model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("switched_to", ["sdpa", "eager"])
async def test_a_users_switch_of_attention_under_a_live_lm_keeps_the_rows_right(
    smollm2_tokenizer, switched_to
):
    model = fresh_model(smollm2_tokenizer)
    references = {None: copy.deepcopy(model)}
    lm = AsyncTransformer(model, smollm2_tokenizer, batch_size=8)
    rows = {}

    async def switch(step):
        if step == 0:
            model.set_attn_implementation(switched_to)

    await particles(lm, rows, between=switch)
    await particles(lm, rows, steps=5)
    assert_rows(rows, references)
    assert model.config._attn_implementation == switched_to  # the user's choice, kept
    lm.close()
    assert model.config._attn_implementation == switched_to


async def test_a_users_train_mode_under_a_live_lm_keeps_the_rows_right(smollm2_tokenizer):
    model = fresh_model(smollm2_tokenizer, attention_dropout=0.5)
    references = {None: copy.deepcopy(model)}
    lm = AsyncTransformer(model, smollm2_tokenizer, batch_size=8)
    rows = {}
    model.train()
    await particles(lm, rows)
    lm.next_token_logprobs_sync(PROMPT[:20])  # a row without cascade: sdpa's own dropout
    rows[tuple(PROMPT[:20]), None] = lm.next_token_logprobs_uncached(PROMPT[:20])
    assert_rows(rows, references)
    assert model.training
    lm.close()
    assert model.training


def test_a_users_change_of_dtype_or_device_is_a_clear_error(smollm2_tokenizer):
    model = fresh_model(smollm2_tokenizer)
    reference = copy.deepcopy(model)
    lm = AsyncTransformer(model, smollm2_tokenizer, batch_size=8)
    lm.next_token_logprobs_sync([*PROMPT, 1])
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match=r"float32.*float64.*new AsyncTransformer"):
        lm.next_token_logprobs_sync([*PROMPT, 2])
    with pytest.raises(RuntimeError, match=r"float64"):
        lm.next_token_logprobs_uncached([*PROMPT, 2])
    model.to(torch.float32)  # back as it was built for (exactly): served again
    row = lm.next_token_logprobs_sync([*PROMPT, 2])
    assert (row - plain_row(reference, [*PROMPT, 2])).abs().max() <= TOL
    lm.close()


def test_lora_layers_a_user_injects_under_a_live_lm_are_a_clear_error(smollm2_tokenizer, tmp_path):
    model = fresh_model(smollm2_tokenizer)
    reference = copy.deepcopy(model)
    lm = AsyncTransformer(model, smollm2_tokenizer, batch_size=8)
    lm.next_token_logprobs_sync([*PROMPT, 1])
    config = peft.LoraConfig(**LORA, init_lora_weights=False)
    users = peft.get_peft_model(model, config)
    with pytest.raises(RuntimeError, match="LoRA layers that no AsyncTransformer"):
        lm.next_token_logprobs_sync([*PROMPT, 2])
    users.unload()
    row = lm.next_token_logprobs_sync([*PROMPT, 2])
    assert (row - plain_row(reference, [*PROMPT, 2])).abs().max() <= TOL
    lm.close()
