"""Per-request LoRA adapters on AsyncTransformer (peft), on the real default model.

Two peft adapters with non-zero B matrices are created and saved here; every adapter row
is checked against a plain forward of a model with that adapter merged into its weights
(`merge_and_unload`), every base row against the plain base model.
"""

import asyncio
import sys

import pytest
import torch

from genlm.backend.llm.hf import AsyncTransformer

peft = pytest.importorskip("peft")
pytestmark = [
    pytest.mark.slow,
    # peft 0.21's get_peft_model reads a property transformers 5.23 deprecated
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

# Adapter rows (peft's mixed-adapter batches over the paged KV store) vs a plain forward of
# the adapter merged into the weights (merge_and_unload): the low-rank update is added after
# the base matmul instead of inside it, so float32 sums run in another order (1e-5 seen).
# A row of the wrong adapter is off by > 0.1 (see test_the_adapters_change_the_answer).
TOL = 1e-4


def load_base(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapter_dirs(random_lora, tmp_path_factory):
    """Two saved adapters on q/v projections, randomly initialised (B != 0)."""
    root = tmp_path_factory.mktemp("adapters")
    for name, seed in [("a", 1), ("b", 2)]:
        random_lora(root / name, seed)
    return {name: str(root / name) for name in ("a", "b")}


@pytest.fixture(scope="module")
def references(default_model_dir, adapter_dirs):
    """``references[name](ids)``: a plain forward of the merged model (``None``: the base)."""
    models = {None: load_base(default_model_dir)}
    for name, path in adapter_dirs.items():
        adapted = peft.PeftModel.from_pretrained(load_base(default_model_dir), path)
        models[name] = adapted.merge_and_unload().eval()

    def make(model):
        def forward(ids):
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([list(ids)])).logits[0, -1]
                return torch.log_softmax(logits.float(), -1)

        return forward

    return {name: make(model) for name, model in models.items()}


@pytest.fixture(scope="module")
def base_model(default_model_dir):
    """One model for every LM here: adding adapters wraps it in place, removing them all
    unwraps it, so each test leaves it plain."""
    return load_base(default_model_dir)


@pytest.fixture
def lm(base_model, smollm2_tokenizer, adapter_dirs):
    lm = AsyncTransformer(base_model, smollm2_tokenizer, batch_size=32)
    for name, path in adapter_dirs.items():
        lm.add_new_lora(path, name)
    yield lm
    for name in list(lm.lora_paths):
        lm.remove_lora(name)
    lm.close()


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer):
    return smollm2_tokenizer.encode("The old clockmaker opened his shop and said")


def check(references, lora, ids, got):
    expected = references[lora](ids)
    assert got.shape == expected.shape and got.dtype == torch.float32
    diff = (got - expected).abs().max().item()
    assert diff <= TOL, f"adapter {lora!r}: max abs diff {diff} for {len(ids)} tokens"


def test_the_adapters_change_the_answer(references, prompt):
    assert (references["a"](prompt) - references[None](prompt)).abs().max() > 1e-1
    assert (references["a"](prompt) - references["b"](prompt)).abs().max() > 1e-1


def test_uncached_and_sync_rows_equal_the_merged_model(lm, references, prompt):
    for lora in (None, "a", "b"):
        check(references, lora, prompt, lm.next_token_logprobs_uncached(prompt, lora_name=lora))
        check(references, lora, prompt, lm.next_token_logprobs_sync(prompt, lora_name=lora))


async def test_base_and_two_adapters_share_one_batch(lm, references, prompt):
    lm.next_token_logprobs_sync(prompt[:6], lora_name="a")  # KV under a only
    queries = [
        (None, prompt),
        ("a", prompt),
        ("b", prompt),
        ("a", prompt[:6] + [17]),  # reuses a's KV
        (None, prompt[:6] + [17]),  # must not reuse a's KV
        ("b", prompt[:6] + [17, 18, 19]),
        (None, prompt[:3]),
    ]
    batches = lm.batcher.num_batches
    results = await asyncio.gather(
        *(lm.next_token_logprobs(ids, lora_name=lora) for lora, ids in queries)
    )
    assert lm.batcher.num_batches == batches + 1
    for (lora, ids), got in zip(queries, results, strict=True):
        check(references, lora, ids, got)
    rows = await lm.batch_next_token_logprobs([prompt, prompt[:3]], lora_name="b")
    check(references, "b", prompt, rows[0])
    check(references, "b", prompt[:3], rows[1])


async def test_cached_and_kv_reused_rows_never_cross_adapters(lm, references, prompt):
    for lora in (None, "a", None, "b", "a"):  # the same prefix, cached under each in turn
        check(references, lora, prompt, await lm.next_token_logprobs(prompt, lora_name=lora))
    longer = prompt + [450, 451]
    for lora in ("b", None, "a"):  # extensions that find KV only in their own tree
        check(references, lora, longer, await lm.next_token_logprobs(longer, lora_name=lora))
    node, start, past, base = lm.walk_cache(longer + [9], lora_name="a")
    assert past is not None and start == base == len(longer)
    assert lm.walk_cache(longer + [9], lora_name="b")[1] == len(longer)
    lm.cache_kv(prompt[:5], lora_name="a")
    assert lm.walk_cache(prompt[:5] + [3], lora_name=None)[0] is not node
    check(references, None, prompt[:5] + [3], lm.next_token_logprobs_sync(prompt[:5] + [3]))


def test_default_adapter_follows_set_lora(lm, references, prompt):
    lm.set_lora(lora_name="a")
    check(references, "a", prompt, lm.next_token_logprobs_sync(prompt))
    check(references, "a", prompt + [7], lm.next_token_logprobs_uncached(prompt + [7]))
    lm.clear_lora()
    check(references, None, prompt, lm.next_token_logprobs_sync(prompt))


async def test_remove_then_use_raises_and_the_batcher_keeps_serving(lm, references, prompt):
    lm.remove_lora("b")
    with pytest.raises(ValueError, match=r"'b'.*add_new_lora"):
        await lm.next_token_logprobs(prompt, lora_name="b")
    with pytest.raises(ValueError, match="add_new_lora"):
        lm.next_token_logprobs_uncached(prompt, lora_name="b")
    with pytest.raises(ValueError, match="add_new_lora"):
        lm.remove_lora("b")
    with pytest.raises(TypeError, match="lora_name"):
        await lm.next_token_logprobs(prompt, lora_name=3)
    check(references, "a", prompt, await lm.next_token_logprobs(prompt, lora_name="a"))


def test_re_registering_a_name_rebinds_it_cached_rows_included(
    lm, references, prompt, adapter_dirs
):
    check(references, "a", prompt, lm.next_token_logprobs_sync(prompt, lora_name="a"))
    lm.add_new_lora(adapter_dirs["b"], "a")  # b's weights under the name "a"
    check(references, "b", prompt, lm.next_token_logprobs_sync(prompt, lora_name="a"))
    check(references, "b", prompt + [5], lm.next_token_logprobs_sync(prompt + [5], lora_name="a"))


async def test_one_forward_per_adapter_when_grouped(
    base_model, smollm2_tokenizer, adapter_dirs, references, prompt
):
    lm = AsyncTransformer(base_model, smollm2_tokenizer, lora_batching="grouped")
    try:
        lm.add_new_lora(adapter_dirs["a"], "my.adapter")  # "." is not a module name in peft
        queries = [(None, prompt), ("my.adapter", prompt), ("my.adapter", prompt[:4])]
        results = await asyncio.gather(
            *(lm.next_token_logprobs(ids, lora_name=lora) for lora, ids in queries)
        )
        for (lora, ids), got in zip(queries, results, strict=True):
            check(references, lora and "a", ids, got)
    finally:
        lm.remove_lora("my.adapter")
        lm.close()


def test_bad_lora_batching_is_refused(base_model, smollm2_tokenizer):
    with pytest.raises(ValueError, match="lora_batching"):
        AsyncTransformer(base_model, smollm2_tokenizer, lora_batching="interleaved")


# -- a failed add_new_lora changes nothing -----------------------------------------------------


def broken_adapters(adapter_dirs, tmp_path):
    """Adapter directories that fail in different ways, from copies of adapter "a"."""
    import shutil

    from safetensors.torch import load_file, save_file

    def copy(name):
        target = tmp_path / name
        shutil.copytree(adapter_dirs["a"], target)
        return target

    no_weights = copy("no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    truncated = copy("truncated")
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])
    wrong_shape = copy("wrong-shape")
    tensors = load_file(wrong_shape / "adapter_model.safetensors")
    key = next(k for k in tensors if ".lora_A." in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], 7)  # 7 inputs: no layer of the model
    save_file(tensors, wrong_shape / "adapter_model.safetensors")
    no_config = copy("no-config")
    (no_config / "adapter_config.json").unlink()
    return [
        (no_weights, FileNotFoundError, "has no weights"),
        (truncated, ValueError, "truncated or corrupt"),
        (wrong_shape, ValueError, "does not fit the base model"),
        (no_config, FileNotFoundError, "adapter_config.json"),
        (tmp_path / "missing", FileNotFoundError, "does not exist"),
    ]


def assert_untouched(lm, references, prompt):
    """Base rows equal the plain base model; no peft layer is left in it."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    assert (lm.next_token_logprobs_uncached(prompt) - references[None](prompt)).abs().max() <= TOL
    if lm.runner.forward.shared.peft is None:
        assert not any(isinstance(m, BaseTunerLayer) for m in lm.model.modules())


def test_a_failed_first_adapter_leaves_the_model_plain(
    base_model, smollm2_tokenizer, adapter_dirs, references, prompt, tmp_path
):
    with AsyncTransformer(base_model, smollm2_tokenizer) as lm:
        for path, error, message in broken_adapters(adapter_dirs, tmp_path):
            with pytest.raises(error, match=message) as caught:
                lm.add_new_lora(path, "x")
            assert str(path) in str(caught.value)
            assert lm.lora_paths == {}
            assert_untouched(lm, references, prompt)


def test_a_failure_inside_peft_after_injecting_layers_is_undone(
    base_model, smollm2_tokenizer, adapter_dirs, references, prompt, monkeypatch
):
    def fail(self, *args, **kwargs):
        raise RuntimeError("disk gone while loading")  # peft has wrapped the layers by now

    with AsyncTransformer(base_model, smollm2_tokenizer) as lm:
        with monkeypatch.context() as patch:
            patch.setattr(peft.PeftModel, "load_adapter", fail)
            with pytest.raises(RuntimeError, match="disk gone"):
                lm.add_new_lora(adapter_dirs["a"], "a")
        assert lm.lora_paths == {} and lm.runner.forward.shared.peft is None
        assert_untouched(lm, references, prompt)
        lm.add_new_lora(adapter_dirs["a"], "a")  # and a later add works
        row = lm.next_token_logprobs_sync(prompt, lora_name="a")
        assert (row - references["a"](prompt)).abs().max() <= TOL
        lm.remove_lora("a")


def test_re_registering_with_a_bad_adapter_keeps_the_old_weights(
    lm, references, prompt, adapter_dirs, tmp_path
):
    for path, error, _ in broken_adapters(adapter_dirs, tmp_path):
        with pytest.raises(error):
            lm.add_new_lora(path, "b")
        assert lm.lora_paths["b"] == adapter_dirs["b"]
        row = lm.next_token_logprobs_sync(prompt, lora_name="b")
        assert (row - references["b"](prompt)).abs().max() <= TOL
        assert_untouched(lm, references, prompt)
    lm.remove_lora("b")  # still registered, removable


def test_without_peft_an_adapter_is_refused_with_what_to_install(lm, adapter_dirs, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    with pytest.raises(ImportError, match=r"LoRA adapters need peft: pip install -e .*\[lora\]"):
        lm.add_new_lora(adapter_dirs["a"], "c")
    assert sorted(lm.lora_paths) == ["a", "b"]


# -- adapters by hub id --------------------------------------------------------------------------


def test_an_adapter_by_hub_id_loads_from_the_hugging_face_cache(
    base_model, smollm2_tokenizer, adapter_dirs, references, prompt, hub_cache
):
    """Offline, a hub id resolves to its snapshot in the local cache (as peft resolves
    it); one that is not there fails naming the id and the offline setting, changing
    nothing."""
    hub_cache("genlm-test/lora-a", adapter_dirs["a"])
    with AsyncTransformer(base_model, smollm2_tokenizer) as lm:
        lm.add_new_lora("genlm-test/lora-a", "a")
        row = lm.next_token_logprobs_sync(prompt, lora_name="a")
        assert (row - references["a"](prompt)).abs().max() <= TOL
        for missing in ("genlm-test/missing", "no-such-adapter"):
            with pytest.raises(FileNotFoundError, match=rf"'{missing}'.*HF_HUB_OFFLINE=1"):
                lm.add_new_lora(missing, "m")
        assert lm.lora_paths == {"a": "genlm-test/lora-a"}
        lm.remove_lora("a")
        assert_untouched(lm, references, prompt)
