"""The HF step beyond Llama: tiny random models of other families (benchmark/families.py)
in the cascade scenario (a prompt of >= 64 tokens shared by particles that fork and step,
with a shorter prefix of another group in the same batches), every row against the model's own
uncached forward of its whole context. StableLM's and Nemotron's decoder layers do not pass
the forward's keyword arguments on to attention (their cascade must reach its cache another
way); Gemma 3 is a hybrid of sliding and global layers (a mask per layer type); GPT-2
has absolute positions (KV reuse, no cascade: its attention has no KV heads to group);
Mixtral is an MoE."""

import asyncio

import pytest
import torch
from families import family, family_model

import genlm.backend.llm.hf.step as step_module
from genlm.backend.llm.hf import AsyncTransformer

TOL = 1e-4  # float32 rows: paged, cascade, batched vs one plain forward
PROMPT = [(13 * j) % 700 + 2 for j in range(70)]  # 4 full blocks shared, then a partial one
# What each family's step runs: KV reuse, and cascade attention over the shared prompt.
PATHS = {
    "stablelm": (True, True),
    "nemotron": (True, True),
    "gemma3": (True, True),
    "gpt2": (True, False),
    "mixtral": (True, True),
}


def plain_row(model, ids):
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        return torch.log_softmax(logits.float(), -1)


@pytest.mark.filterwarnings("ignore:KV reuse is off:UserWarning")
@pytest.mark.parametrize("name", sorted(PATHS))
async def test_cascade_scenario_rows_are_the_uncached_forwards(
    smollm2_tokenizer, name, monkeypatch
):
    model = family_model(family(name), len(smollm2_tokenizer))
    cascades = []
    cascade = step_module.cascade_attention

    def counted(*args, **kwargs):
        cascades.append(1)
        return cascade(*args, **kwargs)

    monkeypatch.setattr(step_module, "cascade_attention", counted)
    lm = AsyncTransformer(model, smollm2_tokenizer, batch_size=16)
    assert (lm.kv_reuse, lm.runner.cascade) == PATHS[name]
    await lm.next_token_logprobs(PROMPT)
    contexts = [[*PROMPT, i + 1] for i in range(6)]
    for step in range(3):
        # forks: particles 0-2 take particle 3's path; a shorter prefix in another group
        queries = [*contexts, [*PROMPT[:30], step + 5, 9]]
        rows = await asyncio.gather(*(lm.next_token_logprobs(ids) for ids in queries))
        for ids, row in zip(queries, rows, strict=True):
            diff = (row - plain_row(model, ids)).abs().max().item()
            assert diff <= TOL, f"{name}: {len(ids)} tokens off by {diff}"
        contexts = [contexts[3] if i < 3 else c for i, c in enumerate(contexts)]
        contexts = [c + [(17 * i + step) % 500 + 1] for i, c in enumerate(contexts)]
    assert bool(cascades) == PATHS[name][1]
    lm.close()
