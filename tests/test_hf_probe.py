"""The probe of `AsyncTransformer`'s steps at construction (`genlm.backend.llm.hf.probe`):
a right model keeps its cascade without a word, in float32 and in half precision; a fault
planted in the cascade or in the paged step makes the LM step down (no cascade, then each
request's whole prefix) with one warning naming the difference, and its rows stay right
against a plain transformers forward of each whole context; the probe runs the cascade
over padded rows, leaves nothing behind, runs `PROBE_FORWARDS` forwards once per model,
and none without KV reuse. A fault is planted on a model of its own (verdicts are kept
per model object)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from families import family, family_model
from small_models import tiny_llama
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from genlm.backend.kv.blocks import INITIAL_BLOCKS
from genlm.backend.llm.hf import AsyncTransformer
from genlm.backend.llm.hf import forward as forward_module
from genlm.backend.llm.hf import runner as runner_module
from genlm.backend.llm.hf import step as step_module
from genlm.backend.llm.hf.probe import PROBE_FORWARDS, SHARED_TOKENS

TOL = 1e-4  # float32 rows: the LM's against one plain forward
MODEL = {"hidden_size": 32, "std": 0.3}


@pytest.fixture
def tiny_model(smollm2_tokenizer):
    """A model of its own for each test: no verdict kept for it."""
    return tiny_llama(len(smollm2_tokenizer), attn_implementation="sdpa", **MODEL)


def open_lm(model, tokenizer):
    """An LM over ``model`` and every warning its construction gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = AsyncTransformer(model, tokenizer, batch_size=32)
    return lm, [str(w.message) for w in caught]


def found_difference(message):
    """The difference a step-down warning states (the first, if several)."""
    return float(re.search(r"differ from its uncached forward by (\S+),", message).group(1))


def worst_row(model, lm, seed=0):
    """The largest difference of the LM's rows from a plain forward of each whole context,
    over a shared 100-token prompt and 8 particles decoding from it for 3 steps, then a
    batch of mixed cached lengths and multi-token extensions."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(0, lm.vocab_size, (n,), generator=generator).tolist()

    prompt = tokens(100)
    batches = [[prompt]]
    particles = [prompt + tokens(1) for _ in range(8)]
    for _ in range(3):
        batches.append(particles)
        particles = [p + tokens(1) for p in particles]
    batches.append([prompt[:40] + tokens(1), prompt + tokens(3), prompt[:20] + tokens(30)])
    worst = 0.0
    for contexts in batches:
        for context, row in zip(contexts, lm.batch_next_token_logprobs_sync(contexts), strict=True):
            with torch.inference_mode():
                ids = torch.tensor([context])
                logits = model(input_ids=ids, use_cache=False).logits[0, -1]
            expected = torch.log_softmax(logits[: lm.vocab_size].float(), -1)
            worst = max(worst, (row - expected).abs().max().item())
    return worst


def ignore_shared_prompt(module, query, key, value, attention_mask, **kwargs):
    """Cascade attention as StableLM's and Nemotron's layers ran it before the step's cache
    reached attention through a context variable: plain sdpa over each row's own keys."""
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def positions_off_by_one(monkeypatch):
    """Plant a fault in the paged step: new tokens after a cached past one position late."""
    build = forward_module.model_inputs

    def shifted(pool, step, begin, end, *options):
        cache, inputs = build(pool, step, begin, end, *options)
        if step.shared.shape[0] + step.past + begin:
            inputs["position_ids"] = inputs["position_ids"] + 1
        return cache, inputs

    monkeypatch.setattr(forward_module, "model_inputs", shifted)


# -- a right model keeps its path ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_llama_keeps_its_cascade_without_a_warning(smollm2_tokenizer, dtype):
    """In half precision our steps round differently from the model's own forward (up to
    0.3 in bfloat16 on SmolLM2), and on a CPU its batches round alike: the tolerance's
    floor keeps the cascade."""
    model = tiny_llama(len(smollm2_tokenizer), attn_implementation="sdpa", **MODEL).to(dtype)
    lm, caught = open_lm(model, smollm2_tokenizer)
    with lm:
        assert (lm.kv_reuse, lm.runner.cascade, caught) == (True, True, [])


@pytest.mark.parametrize("name", ["stablelm", "nemotron"])
def test_families_whose_layers_drop_attentions_keywords_keep_right_rows(smollm2_tokenizer, name):
    model = family_model(family(name), len(smollm2_tokenizer))
    lm, caught = open_lm(model, smollm2_tokenizer)
    with lm:
        assert (lm.kv_reuse, lm.runner.cascade, caught) == (True, True, [])
        assert worst_row(model, lm) <= TOL


# -- planted faults: the LM steps down -----------------------------------------------------


def test_a_cascade_that_ignores_the_shared_prompt_is_turned_off(
    smollm2_tokenizer, tiny_model, monkeypatch
):
    monkeypatch.setattr(step_module, "cascade_attention", ignore_shared_prompt)
    lm, caught = open_lm(tiny_model, smollm2_tokenizer)
    with lm:
        assert (lm.kv_reuse, lm.runner.cascade) == (True, False)
        (message,) = caught
        assert message.startswith("cascade attention is off for this model (with it, its rows")
        assert message.endswith("): its steps run without it")
        assert found_difference(message) > 1.0
        assert worst_row(tiny_model, lm) <= TOL


def test_a_paged_step_with_positions_off_by_one_runs_whole_prefixes(
    smollm2_tokenizer, tiny_model, monkeypatch
):
    positions_off_by_one(monkeypatch)
    lm, caught = open_lm(tiny_model, smollm2_tokenizer)
    with lm:
        assert (lm.kv_reuse, lm.runner.cascade) == (False, False)
        (message,) = caught
        assert message.startswith(
            "KV reuse is off for this model (the probe of its paged step found with cascade "
            "attention, its rows differ from its uncached forward by "
        )
        assert "; without, its rows differ from its uncached forward by " in message
        assert message.endswith("): every request runs its whole prefix")
        assert found_difference(message) > 0.1
        assert worst_row(tiny_model, lm) <= TOL


def test_a_paged_step_that_fails_runs_whole_prefixes(smollm2_tokenizer, tiny_model, monkeypatch):
    """As Bloom's did before its family was refused: a step of mixed cached lengths fails."""
    build = forward_module.model_inputs

    def failing(pool, step, begin, end, *options):
        if step.padded:
            raise ValueError("too many values to unpack (expected 2)")
        return build(pool, step, begin, end, *options)

    monkeypatch.setattr(forward_module, "model_inputs", failing)
    lm, caught = open_lm(tiny_model, smollm2_tokenizer)
    with lm:
        assert not lm.kv_reuse
        assert caught == [
            "KV reuse is off for this model (the probe of its paged step found with cascade "
            "attention, its steps fail: ValueError: too many values to unpack (expected 2); "
            "without, its steps fail: ValueError: too many values to unpack (expected 2)): "
            "every request runs its whole prefix"
        ]
        assert worst_row(tiny_model, lm) <= TOL


def test_a_model_without_cascade_steps_down_to_whole_prefixes_once(smollm2_tokenizer, monkeypatch):
    """Eager attention runs no cascade: a faulty paged step goes straight to whole prefixes."""
    model = tiny_llama(len(smollm2_tokenizer), attn_implementation="eager", **MODEL)
    positions_off_by_one(monkeypatch)
    lm, caught = open_lm(model, smollm2_tokenizer)
    with lm:
        assert not lm.kv_reuse
        (message,) = caught
        assert message.startswith(
            "KV reuse is off for this model (the probe of its paged step found its rows differ "
        )
        assert worst_row(model, lm) <= TOL


# -- what the probe leaves and costs -------------------------------------------------------


def test_the_probe_leaves_no_state(smollm2_tokenizer, tiny_model):
    lm, _ = open_lm(tiny_model, smollm2_tokenizer)
    with lm:
        store = lm.store
        assert dict(store.roots) == {}
        assert (store.held_blocks, store.kv_nbytes, store.logprobs_nbytes) == (0, 0, 0)
        assert store.capacity == INITIAL_BLOCKS  # the pool as a fresh store sizes it
        assert lm.runner.forward.head._logits is None  # the head's buffer let go


class ForwardCounter:
    """Counts the forwards of a model's decoder (its base model), from ``with`` on."""

    def __init__(self, model):
        self.model, self.count = model, 0

    def __enter__(self):
        self.hook = self.model.base_model.register_forward_hook(self._count)
        return self

    def _count(self, *args):
        self.count += 1

    def __exit__(self, *exc_info):
        self.hook.remove()


def construction_forwards(model, tokenizer):
    with ForwardCounter(model) as counter:
        open_lm(model, tokenizer)[0].close()
    return counter.count


def test_the_probe_costs_its_stated_forwards_once_per_model(
    smollm2_tokenizer, tiny_model, monkeypatch
):
    probed = construction_forwards(tiny_model, smollm2_tokenizer)
    again = construction_forwards(tiny_model, smollm2_tokenizer)  # the verdict kept
    monkeypatch.setattr(runner_module, "prove_fast_path", lambda runner: None)
    unprobed = construction_forwards(tiny_model, smollm2_tokenizer)
    assert (probed - unprobed, again - unprobed) == (PROBE_FORWARDS, 0)


def test_a_kept_verdict_steps_down_and_warns_again(smollm2_tokenizer, tiny_model, monkeypatch):
    monkeypatch.setattr(step_module, "cascade_attention", ignore_shared_prompt)
    first, second = (open_lm(tiny_model, smollm2_tokenizer) for _ in range(2))
    for lm, caught in (first, second):
        with lm:
            assert (lm.kv_reuse, lm.runner.cascade, len(caught)) == (True, False, 1)
    assert first[1] == second[1]


def test_the_probe_runs_the_cascade_over_padded_rows(smollm2_tokenizer, tiny_model, monkeypatch):
    """Its steps as the runner builds them: the rows' cached lengths, new tokens and the
    prompt's blocks read once (cascade attention)."""
    seen = []
    build = runner_module.step_inputs

    def recorded(plans, block_size, skip_blocks, device):
        seen.append(([plan.start for plan in plans], plans[0].new_tokens, skip_blocks))
        return build(plans, block_size, skip_blocks, device)

    monkeypatch.setattr(runner_module, "step_inputs", recorded)
    open_lm(tiny_model, smollm2_tokenizer)[0].close()
    shared = SHARED_TOKENS
    assert seen == [([0], shared, 0), ([shared, shared - 2], 1, 4), ([shared, shared + 1], 3, 4)]


@pytest.mark.parametrize(
    "make",
    [
        lambda vocab: family_model(family("bloom"), vocab),
        lambda vocab: tiny_llama(vocab, max_positions=64, **MODEL),
    ],
    ids=["without-kv-reuse", "context-shorter-than-the-probe"],
)
def test_the_probe_does_not_run(smollm2_tokenizer, monkeypatch, make):
    model = make(len(smollm2_tokenizer))
    probed = construction_forwards(model, smollm2_tokenizer)
    monkeypatch.setattr(runner_module, "prove_fast_path", lambda runner: None)
    assert probed == construction_forwards(model, smollm2_tokenizer)
