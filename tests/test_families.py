"""Every model family users load, as a tiny random model (benchmark/families.py): in four
scenarios its rows are within `TOL` of the model's own uncached forward, through the path
its LM takes (KV reuse and cascade attention, or each request's whole prefix), which
`PATHS` states per family and docs/families.md lists.

The scenarios: one prompt; 16 particles with resampling (crossing position 64, where the
longrope family switches factors); a shared 100-token prompt, then cascade steps of
particles decoding from it; a batch of mixed cached lengths and multi-token extensions.
Sliding windows (16 tokens) are shorter than the prompts. A family's model is built once
for its scenarios (they run in family order).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from families import (
    CONTEXT,
    FAMILIES,
    LONGROPE_ORIGINAL_CONTEXT,
    WINDOW,
    Family,
    family,
    family_model,
)
from transformers.cache_utils import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
)

from genlm.backend.llm.hf import AsyncTransformer
from genlm.backend.llm.hf.families import kv_reuse_refusal

TOL = 1e-4  # float32 rows: batched / KV-reused / cascade vs one plain forward
DOCS_TABLE = Path(__file__).resolve().parents[1] / "docs" / "families.md"


@dataclass(frozen=True)
class LMPath:
    """How an LM serves a family: KV reuse (else each request runs its whole prefix, and
    the construction warns with ``refusal``), and cascade attention over shared prompts."""

    kv_reuse: bool
    cascade: bool
    refusal: str = ""


REUSE_AND_CASCADE = LMPath(True, True)
REUSE_ONLY = LMPath(True, False)  # attention modules that do not look up our cascade
ALIBI = LMPath(False, False, "builds its ALiBi bias from a 2-D attention mask")

PATHS: dict[str, LMPath] = {
    "llama": REUSE_AND_CASCADE,
    "llama-dynamic-ntk": REUSE_AND_CASCADE,
    "mistral": REUSE_AND_CASCADE,
    "mistral-window-covers-context": REUSE_AND_CASCADE,
    "gemma": REUSE_AND_CASCADE,
    "gemma2": REUSE_ONLY,
    "gemma3": REUSE_AND_CASCADE,
    "gemma3-window-covers-context": REUSE_AND_CASCADE,
    "phi3": REUSE_AND_CASCADE,
    "phi3-longrope": LMPath(False, False, "its longrope RoPE switches factors past position 64"),
    "qwen2": REUSE_AND_CASCADE,
    "qwen3": REUSE_AND_CASCADE,
    "smollm3": REUSE_AND_CASCADE,
    "stablelm": REUSE_AND_CASCADE,
    "nemotron": REUSE_AND_CASCADE,
    "gpt2": REUSE_ONLY,
    "gpt-neox": REUSE_ONLY,
    "falcon-rotary": REUSE_ONLY,
    "falcon-alibi": ALIBI,
    "bloom": ALIBI,
    "mpt": REUSE_ONLY,
    "starcoder2": REUSE_AND_CASCADE,
    "cohere": REUSE_AND_CASCADE,
    "cohere2": REUSE_AND_CASCADE,
    "granite": REUSE_AND_CASCADE,
    "olmo": REUSE_AND_CASCADE,
    "mixtral": REUSE_AND_CASCADE,
    "qwen2-moe": REUSE_AND_CASCADE,
    "gpt-oss": REUSE_ONLY,
    "deepseek-v3": LMPath(False, False, "its layers' KV shapes differ"),
}

# -- the scenarios: each returns its rows' largest difference from the uncached forward -----


class Rows:
    """An LM's rows against the model's own uncached forward, on random tokens."""

    def __init__(self, model, lm, seed):
        self.model, self.lm = model, lm
        self.generator = torch.Generator().manual_seed(seed)
        self.worst = 0.0

    def tokens(self, n):
        return torch.randint(0, self.lm.vocab_size, (n,), generator=self.generator).tolist()

    def check(self, contexts):
        """One batch of the LM's rows for ``contexts``, against the reference."""
        rows = self.lm.batch_next_token_logprobs_sync(contexts)
        for row, reference in zip(rows, self.uncached(contexts), strict=True):
            self.worst = max(self.worst, (row - reference).abs().max().item())

    def uncached(self, contexts):
        """Each context's logprobs from one plain forward of whole prefixes, no cache
        (contexts of one length batched together)."""
        by_length = {}
        for i, context in enumerate(contexts):
            by_length.setdefault(len(context), []).append(i)
        out = [None] * len(contexts)
        with torch.inference_mode():
            for indices in by_length.values():
                ids = torch.tensor([contexts[i] for i in indices])
                logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1]
                rows = torch.log_softmax(logits[:, : self.lm.vocab_size].float(), -1)
                for i, row in zip(indices, rows, strict=True):
                    out[i] = row
        return out


def one_prompt(rows):
    """A 100-token prompt, nothing cached."""
    rows.check([rows.tokens(100)])


def resampling(rows):
    """16 particles from a 62-token prompt for 3 steps (prefixes of 63 to 65 tokens),
    resampled (some copied, some dropped) between steps."""
    prompt = rows.tokens(62)
    particles = [prompt + rows.tokens(1) for _ in range(16)]
    for _ in range(3):
        rows.check(particles)
        picks = torch.randint(0, 16, (16,), generator=rows.generator).tolist()
        particles = [particles[i] + rows.tokens(1) for i in picks]


def cascade(rows):
    """A 100-token prompt, then 8 particles decoding from it for 3 steps."""
    prompt = rows.tokens(100)
    rows.check([prompt])
    particles = [prompt + rows.tokens(1) for _ in range(8)]
    for _ in range(3):
        rows.check(particles)
        particles = [p + rows.tokens(1) for p in particles]


def mixed(rows):
    """Prefixes of 20, 40 and 90 tokens cached, then one batch extending them by 1, 3 and
    30 tokens (40 + 30 crosses position 64) beside a fresh 50-token prompt."""
    prompt = rows.tokens(90)
    rows.check([prompt[:20], prompt[:40], prompt])
    rows.check(
        [
            prompt[:20] + rows.tokens(1),
            prompt + rows.tokens(1),
            prompt[:40] + rows.tokens(1),
            prompt[:20] + rows.tokens(3),
            prompt + rows.tokens(3),
            prompt[:40] + rows.tokens(30),
            rows.tokens(50),
        ]
    )


SCENARIOS: dict[str, Callable[[Rows], None]] = {
    "one-prompt": one_prompt,
    "resampling": resampling,
    "cascade": cascade,
    "mixed": mixed,
}


def open_lm(model, tokenizer):
    """An LM over ``model`` and the KV-reuse warnings its construction gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = AsyncTransformer(model, tokenizer, batch_size=32)
    return lm, [str(w.message) for w in caught if "KV reuse is off" in str(w.message)]


def check_path(lm, refusals, expected: LMPath):
    assert (lm.kv_reuse, lm.runner.cascade) == (expected.kv_reuse, expected.cascade)
    if expected.kv_reuse:
        assert refusals == []
    else:
        (refusal,) = refusals
        assert expected.refusal in refusal


# -- the contract over the families ----------------------------------------------------------


@pytest.fixture(scope="module")
def model_of(smollm2_tokenizer):
    """``model_of(family)``: its tiny model, kept while its scenarios run."""
    held: dict[str, object] = {}

    def get(tiny: Family):
        if tiny.name not in held:
            held.clear()
            held[tiny.name] = family_model(tiny, len(smollm2_tokenizer))
        return held[tiny.name]

    return get


@pytest.fixture(scope="module")
def table(summary_lines):
    """The largest difference per family and scenario, printed at the end of the run."""
    found: dict[str, dict[str, str]] = {}
    yield found
    summary_lines.append("families: path, then max |row - uncached forward| per scenario")
    for name, cells in found.items():
        path = PATHS[name]
        route = "whole prefix" if not path.kv_reuse else "cascade" if path.cascade else "reuse"
        summary_lines.append(
            f"  {name:30} {route:12} " + "  ".join(f"{s}={v}" for s, v in cells.items())
        )


def cases():
    return list(_cases())


def _cases():
    for tiny in FAMILIES:
        for scenario in SCENARIOS:
            marks = []
            if not tiny.available():
                marks.append(pytest.mark.skip(reason=f"transformers has no {tiny.config}"))
            yield pytest.param(tiny, scenario, marks=marks, id=f"{tiny.name}-{scenario}")


@pytest.mark.parametrize(("tiny", "scenario"), cases())
def test_rows_match_the_uncached_forward(smollm2_tokenizer, model_of, table, tiny, scenario):
    model = model_of(tiny)
    lm, refusals = open_lm(model, smollm2_tokenizer)
    with lm:
        check_path(lm, refusals, PATHS[tiny.name])
        rows = Rows(model, lm, seed=list(SCENARIOS).index(scenario))
        cells = table.setdefault(tiny.name, {})
        try:
            SCENARIOS[scenario](rows)
        except Exception as error:
            cells[scenario] = type(error).__name__
            raise
        cells[scenario] = f"{rows.worst:.1e}"
        assert rows.worst <= TOL


def test_every_family_has_its_path_stated():
    assert sorted(PATHS) == sorted(tiny.name for tiny in FAMILIES)


# -- RoPE whose factors depend on the forward's longest position -----------------------------


def test_longrope_switching_within_the_context_turns_kv_reuse_off(smollm2_tokenizer):
    """The family's switch (position 64) lies within its context (256): the warning says so."""
    lm, refusals = open_lm(
        family_model(family("phi3-longrope"), len(smollm2_tokenizer)), smollm2_tokenizer
    )
    with lm:
        assert not lm.kv_reuse
    assert refusals == [
        "KV reuse is off for this model (its longrope RoPE switches factors past position "
        f"{LONGROPE_ORIGINAL_CONTEXT}, within its context of {CONTEXT}): every request runs "
        "its whole prefix"
    ]


def test_longrope_switching_only_past_the_context_keeps_kv_reuse(smollm2_tokenizer):
    """Phi-3-mini-4k's case: its original context is its context, so a forward within it
    never switches factors: rows across the whole context stay right with reuse."""
    longrope = family("phi3-longrope")
    options = dict(longrope.options)
    options["rope_parameters"] = {
        **options["rope_parameters"],
        "factor": 1.0,
        "original_max_position_embeddings": CONTEXT,
    }
    options["original_max_position_embeddings"] = CONTEXT
    tiny = Family("phi3-longrope-4k", longrope.config, options)
    model = family_model(tiny, len(smollm2_tokenizer))
    lm, refusals = open_lm(model, smollm2_tokenizer)
    with lm:
        assert lm.kv_reuse and refusals == []
        rows = Rows(model, lm, seed=1)
        prompt = rows.tokens(CONTEXT)
        rows.check([prompt[:60], prompt[:200]])
        rows.check([prompt[:66], prompt[:230] + [prompt[230]], prompt])
        assert rows.worst <= TOL


def test_dynamic_ntk_keeps_kv_reuse_up_to_its_context(smollm2_tokenizer):
    """Dynamic NTK rescales only once a forward runs past the context: up to the last
    position rows are right with reuse, and a longer prefix is refused."""
    model = family_model(family("llama-dynamic-ntk"), len(smollm2_tokenizer))
    lm, refusals = open_lm(model, smollm2_tokenizer)
    with lm:
        assert lm.kv_reuse and refusals == []
        rows = Rows(model, lm, seed=2)
        prompt = rows.tokens(CONTEXT + 1)
        rows.check([prompt[:100], prompt[:200]])
        rows.check([prompt[:104], prompt[: CONTEXT - 1], prompt[:CONTEXT]])
        assert rows.worst <= TOL
        with pytest.raises(ValueError, match=f"{CONTEXT}"):
            lm.next_token_logprobs_sync(prompt)


# -- sliding windows ---------------------------------------------------------------------------


def window_cases():
    """Every layer sliding (Mistral); sliding and full layers (Gemma 3: a mask per layer
    type) with cascade attention, and eager (additive masks, no cascade)."""
    yield pytest.param("mistral", {}, id="every-layer-sliding")
    yield pytest.param("gemma3", {}, id="hybrid")
    yield pytest.param("gemma3", {"attn_implementation": "eager"}, id="hybrid-eager")


@pytest.mark.parametrize(("name", "options"), list(window_cases()))
def test_sliding_layers_ignore_keys_out_of_their_window(
    smollm2_tokenizer, monkeypatch, name, options
):
    """A 100-token prompt (6 times the window), prefixes of it cached at lengths inside and
    beyond the window, then one batch extending them by 1, 3 and 20 tokens beside a fresh
    prompt, then particles decoding from the prompt with cascade attention (whose shared
    prefix runs past a sliding layer's window): rows as the model's own uncached forward,
    which differ clearly from those of the same weights attending to the whole context."""
    import genlm.backend.llm.hf.step as step

    tiny = family(name)
    tiny = Family(tiny.name, tiny.config, {**tiny.options, **options})
    model = family_model(tiny, len(smollm2_tokenizer))
    sliding = [kind == "sliding_attention" for kind in layer_kinds(model)]
    cascades = []
    cascade_attention = step.cascade_attention

    def spied(module, *args, **kwargs):
        shared = step.STEP_CACHE.get().shared
        cascades.append((sliding[module.layer_idx], shared.shape[0]))
        return cascade_attention(module, *args, **kwargs)

    monkeypatch.setattr(step, "cascade_attention", spied)
    lm, refusals = open_lm(model, smollm2_tokenizer)
    with lm:
        assert lm.kv_reuse and refusals == []
        assert lm.runner.cascade == ("attn_implementation" not in options)
        rows = Rows(model, lm, seed=3)
        prompt = rows.tokens(100)
        rows.check([prompt[:10], prompt[:40], prompt])
        rows.check(
            [
                prompt[:10] + rows.tokens(1),
                prompt[:40] + rows.tokens(3),
                prompt + rows.tokens(1),
                prompt + rows.tokens(20),
                rows.tokens(30),
            ]
        )
        particles = [prompt + rows.tokens(1) for _ in range(8)]
        for _ in range(2):
            rows.check(particles)
            particles = [p + rows.tokens(1) for p in particles]
        assert rows.worst <= TOL
    if lm.runner.cascade:
        assert any(is_sliding and shared > WINDOW for is_sliding, shared in cascades)
    else:
        assert cascades == []
    wide = Family("wide", tiny.config, {**tiny.options, "sliding_window": CONTEXT})
    contexts = [prompt, particles[0]]
    windowed = Rows(model, lm, 0).uncached(contexts)
    whole = Rows(family_model(wide, len(smollm2_tokenizer)), lm, 0).uncached(contexts)
    assert min((a - b).abs().max().item() for a, b in zip(windowed, whole, strict=True)) > 0.1


def test_a_prefill_in_chunks_keeps_each_sliding_layers_window(smollm2_tokenizer):
    """A 100-token prompt run in forwards of 24 tokens (`max_batch_tokens`), fresh and
    extending a cached prefix: each chunk's queries read the earlier chunks' keys within
    their window only."""
    model = family_model(family("gemma3"), len(smollm2_tokenizer))
    with AsyncTransformer(model, smollm2_tokenizer, max_batch_tokens=24) as lm:
        assert lm.kv_reuse
        rows = Rows(model, lm, seed=4)
        prompt = rows.tokens(100)
        rows.check([prompt])
        rows.check([prompt[:30]])
        rows.check([prompt[:30] + rows.tokens(70)])
        assert rows.worst <= TOL


def layer_kinds(model):
    """Each layer's kind, as the config names it (every layer sliding without types)."""
    config = model.config.get_text_config()
    kinds = getattr(config, "layer_types", None)
    return kinds or ["sliding_attention"] * config.num_hidden_layers


def cache_layer(kind, **options):
    """A cache layer of ``kind`` holding one token's KV."""
    layer = kind(**options)
    layer.keys = layer.values = torch.zeros(1, 2, 1, 16)
    return layer


def refusal_cases():
    full, sliding = (
        cache_layer(DynamicLayer),
        cache_layer(DynamicSlidingWindowLayer, sliding_window=WINDOW),
    )
    narrower = cache_layer(DynamicSlidingWindowLayer, sliding_window=WINDOW // 2)
    recurrent = cache_layer(LinearAttentionAndFullAttentionLayer)
    gemma3 = ["sliding_attention", "full_attention"]
    yield pytest.param(
        "gemma3",
        [sliding, sliding],
        f"its cache layers are not its layer_types {gemma3}",
        id="types",
    )
    yield pytest.param(
        "mistral", [sliding, narrower], "its sliding layers' windows differ", id="windows"
    )
    yield pytest.param(
        "mistral", [sliding, full], "its sliding and full layers have no layer_types", id="untyped"
    )
    yield pytest.param(
        "llama",
        [full, recurrent],
        "its cache has layers other than attention (recurrent or state-space)",
        id="recurrent",
    )


@pytest.mark.parametrize(("name", "layers", "reason"), list(refusal_cases()))
def test_kv_reuse_is_refused_for_windows_a_steps_masks_cannot_state(
    smollm2_tokenizer, name, layers, reason
):
    model = family_model(family(name), len(smollm2_tokenizer))
    assert kv_reuse_refusal(model, layers) == reason


@pytest.mark.parametrize("refused", ["attn_logit_softcapping", "sinks"])
def test_cascade_is_refused_where_attention_is_not_a_plain_softmax(smollm2_tokenizer, refused):
    """Soft-capped scores (Gemma 2) or attention sinks (gpt-oss) on a model that runs
    ``sdpa``: cascade attention, a plain softmax, would drop them."""
    from genlm.backend.llm.hf.step import attention_modules, use_cascade

    model = family_model(family("gemma3"), len(smollm2_tokenizer))
    assert model.config._attn_implementation == "sdpa"
    module = attention_modules(model)[1]
    setattr(module, refused, 50.0 if refused == "attn_logit_softcapping" else torch.zeros(4))
    assert not use_cascade(model, 2)
    setattr(module, refused, None)
    assert use_cascade(model, 2)


# -- the docs' table of families -------------------------------------------------------------


def test_the_docs_table_states_every_familys_path():
    """docs/families.md lists each family this file runs, with its path as `PATHS` has it."""
    documented = {}
    for line in DOCS_TABLE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and re.fullmatch(r"`[\w.-]+`", cells[0]):
            documented[cells[0].strip("`")] = (cells[1], cells[2])
    expected = {
        name: ("yes" if path.kv_reuse else "no", "yes" if path.cascade else "no")
        for name, path in PATHS.items()
    }
    assert documented == expected
