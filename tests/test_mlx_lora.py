"""AsyncMlxLM's per-request LoRA adapters on the real default model (MLX CPU build).

Each adapter is a random mlx-lm LoRA adapter written in mlx-lm's own format; the
reference for its rows is an uncached forward of a model with that adapter fused into
the weights by mlx-lm's ``LoRALinear.fuse`` (W + scale * (A @ B)^T), and for base rows
an uncached forward of the base model.
"""

import asyncio

import numpy as np
import pytest
import torch

from genlm.backend.llm.mlx import AsyncMlxLM, _share_weights_copy

# Same backend, float32: LoRA layers (base matmul + low-rank update) vs the adapter fused
# into the weights, cached vs uncached: the order of float32 sums (SPEC: 1e-4). A row of the
# wrong adapter is off by far more (random A, B of scale 0.05 on two layers).
TOLERANCE = 1e-4

pytestmark = [pytest.mark.mlx, pytest.mark.slow]  # the real default model

PROMPTS = ([504, 3458, 282], [400, 401, 402, 403, 404], [700, 17])


@pytest.fixture(scope="module")
def base_model(default_model_dir):
    mlx_lm = pytest.importorskip("mlx_lm")
    return mlx_lm.load(default_model_dir)


def write_adapter(model, path, seed, num_layers=2, rank=4, scale=2.0):
    """Save a random LoRA adapter for ``model``'s last ``num_layers`` blocks as ``mlx_lm.lora``
    does (``adapters.safetensors`` + ``adapter_config.json``); return ``model`` with it fused."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.tuner.lora import LoRALinear
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import save_config

    lora_parameters = {"rank": rank, "scale": scale, "dropout": 0.0}
    tuned = _share_weights_copy(model)
    tuned.freeze()
    linear_to_lora_layers(tuned, num_layers, lora_parameters)
    mx.random.seed(seed)
    lora_layers = [(n, m) for n, m in tuned.named_modules() if isinstance(m, LoRALinear)]
    for _, layer in lora_layers:
        layer.lora_a = 0.05 * mx.random.normal(layer.lora_a.shape)
        layer.lora_b = 0.05 * mx.random.normal(layer.lora_b.shape)  # non-zero: a real change
    path.mkdir()
    mx.save_safetensors(
        str(path / "adapters.safetensors"), dict(tree_flatten(tuned.trainable_parameters()))
    )
    config = {
        "fine_tune_type": "lora",
        "num_layers": num_layers,
        "lora_parameters": lora_parameters,
    }
    save_config(config, path / "adapter_config.json")
    tuned.update_modules(tree_unflatten([(n, layer.fuse()) for n, layer in lora_layers]))
    return tuned.eval()


_REFERENCES = {}


def reference(model, ids):
    """Next-token log-probabilities from one uncached forward of the whole prefix."""
    import mlx.core as mx

    key = (id(model), tuple(ids))
    if key not in _REFERENCES:
        logits = torch.from_numpy(np.array(model(mx.array([list(ids)]))[0, -1].astype(mx.float32)))
        # normalized in float64: MLX's one-pass float32 sum is off by ~1e-4 over this vocabulary
        _REFERENCES[key] = torch.log_softmax(logits.double(), -1).float()
    return _REFERENCES[key]


@pytest.fixture(scope="module")
def adapters(base_model, tmp_path_factory):
    """Three adapters: ``{key: (path, fused model)}``; ``a2`` is a second version of ``a``."""
    root = tmp_path_factory.mktemp("mlx-adapters")
    return {
        key: (root / key, write_adapter(base_model[0], root / key, seed))
        for seed, key in enumerate(("a", "b", "a2"))
    }


def check(logps, model, ids):
    expected = reference(model, ids)
    assert logps.shape == expected.shape
    assert (logps - expected).abs().max().item() <= TOLERANCE, ids


@pytest.fixture
def lm(base_model, adapters):
    lm = AsyncMlxLM(*base_model, batch_size=16)
    lm.add_new_lora(adapters["a"][0], "a")
    lm.add_new_lora(adapters["b"][0], "b")
    return lm


def test_adapter_rows_match_the_fused_model_and_base_rows_the_base_model(lm, base_model, adapters):
    base = base_model[0]
    fused_a = adapters["a"][1]
    adapted = lm.batch_next_token_logprobs_sync(PROMPTS, lora_name="a")
    plain = lm.batch_next_token_logprobs_sync(PROMPTS)
    for ids, row_a, row in zip(PROMPTS, adapted, plain, strict=True):
        check(row_a, fused_a, ids)
        check(row, base, ids)
        assert (row_a - row).abs().max().item() > 0.05  # the adapter changes the answer
    check(lm.next_token_logprobs_sync(PROMPTS[0], lora_name="a"), fused_a, PROMPTS[0])


def test_an_adapter_shares_the_base_models_weight_arrays(lm, base_model):
    from mlx.utils import tree_flatten

    base_arrays = {id(a) for _, a in tree_flatten(base_model[0].parameters())}
    adapter_arrays = {id(a) for _, a in tree_flatten(lm.runner.adapters["a"].parameters())}
    assert base_arrays <= adapter_arrays
    assert len(adapter_arrays - base_arrays) == 2 * 2 * 7  # A and B of 7 linears in 2 blocks


async def test_base_and_two_adapters_awaited_together_share_one_batch(lm, base_model, adapters):
    models = {None: base_model[0], "a": adapters["a"][1], "b": adapters["b"][1]}
    requests = [(ids, lora) for lora in models for ids in PROMPTS]
    results = await asyncio.gather(
        *(lm.next_token_logprobs(ids, lora_name=lora) for ids, lora in requests)
    )
    assert lm.batcher.batch_sizes[-1] == len(requests)
    for (ids, lora), logps in zip(requests, results, strict=True):
        check(logps, models[lora], ids)
    prompt = PROMPTS[1]
    greedy = [int(reference(models["b"], prompt).argmax())]
    greedy.append(int(reference(models["b"], prompt + greedy).argmax()))
    assert await lm.sample(prompt, 2, [], temperature=1e-4, lora_name="b") == greedy


async def test_cached_rows_and_kv_never_cross_adapters(lm, base_model, adapters):
    base, fused_a = base_model[0], adapters["a"][1]
    prompt = PROMPTS[1]
    check(await lm.next_token_logprobs(prompt), base, prompt)
    check(await lm.next_token_logprobs(prompt, lora_name="a"), fused_a, prompt)
    check(await lm.next_token_logprobs(prompt), base, prompt)
    assert lm.walk_cache(prompt, lora_name="b")[2] is None  # b has computed nothing yet
    for lora, model in ((None, base), ("a", fused_a), (None, base)):
        for extension in ([17], [17, 30]):
            ids = prompt + extension
            check(await lm.next_token_logprobs(ids, lora_name=lora), model, ids)
            assert lm.walk_cache(ids, lora_name=lora)[3] == len(ids)
    lm.cache_kv([300, 301], lora_name="a")
    assert lm.walk_cache([300, 301, 302])[2] is None
    check(await lm.next_token_logprobs([300, 301, 302]), base, [300, 301, 302])
    check(lm.next_token_logprobs_sync([300, 301, 302], lora_name="a"), fused_a, [300, 301, 302])
    lm.set_lora(lora_name="a")  # the default adapter serves lora_name=None
    check(await lm.next_token_logprobs(prompt + [5]), fused_a, prompt + [5])
    lm.clear_lora()
    check(await lm.next_token_logprobs(prompt + [5]), base, prompt + [5])


def test_each_adapter_shares_its_own_prompt_blocks_between_forks(lm, base_model, adapters):
    models = {None: base_model[0], "a": adapters["a"][1]}
    prompt = list(range(430, 448))  # a full block and 2 tokens
    forks = [prompt + [1], prompt + [2]]
    for lora, model in models.items():
        check(lm.next_token_logprobs_sync(prompt, lora_name=lora), model, prompt)
        results = lm.batch_next_token_logprobs_sync(forks, lora_name=lora)
        for ids, got in zip(forks, results, strict=True):
            check(got, model, ids)
    # per adapter: the prompt's 2 blocks, shared by its forks; the first fork appends to the
    # partly filled block, the second copies it
    assert lm.store.held_blocks == len(models) * (2 + 1)


async def test_registering_a_name_again_rebinds_it_and_drops_its_cache(lm, base_model, adapters):
    prompt = PROMPTS[0]
    await lm.next_token_logprobs(prompt, lora_name="a")
    await lm.next_token_logprobs(prompt, lora_name="b")
    kept = lm.walk_cache(prompt, lora_name="b")[0].logprobs
    lm.add_new_lora(adapters["a2"][0], "a")
    assert lm.walk_cache(prompt, lora_name="a")[2] is None
    check(await lm.next_token_logprobs(prompt, lora_name="a"), adapters["a2"][1], prompt)
    ids = prompt + [17]
    check(await lm.next_token_logprobs(ids, lora_name="a"), adapters["a2"][1], ids)
    assert lm.walk_cache(prompt, lora_name="b")[0].logprobs is kept  # b's cache stays


async def test_removed_or_unknown_adapters_raise_value_error(lm, base_model, tmp_path):
    task = asyncio.create_task(lm.next_token_logprobs(PROMPTS[0], lora_name="a"))
    other = asyncio.create_task(lm.next_token_logprobs(PROMPTS[1]))  # same batch, base model
    await asyncio.sleep(0)  # queued, not yet run
    lm.remove_lora("a")
    with pytest.raises(ValueError, match="'a'.*add_new_lora"):
        await task
    check(await other, base_model[0], PROMPTS[1])  # only the removed adapter's caller fails
    with pytest.raises(ValueError, match="'a'.*add_new_lora"):
        await lm.next_token_logprobs(PROMPTS[0], lora_name="a")
    with pytest.raises(ValueError, match="'a'.*add_new_lora"):
        lm.next_token_logprobs_sync(PROMPTS[0], lora_name="a")
    with pytest.raises(ValueError, match="'a'"):
        lm.walk_cache(PROMPTS[0], lora_name="a")
    with pytest.raises(ValueError, match="'a'"):
        lm.remove_lora("a")
    assert "a" not in lm.runner.adapters and "a" not in lm.store.roots
    with pytest.raises(FileNotFoundError, match="missing"):
        lm.add_new_lora(tmp_path / "missing", "c")
    assert "c" not in lm.lora_paths
    check(await lm.next_token_logprobs(PROMPTS[0]), base_model[0], PROMPTS[0])


def test_a_failed_add_keeps_the_adapter_of_that_name_and_says_why(
    lm, adapters, base_model, random_lora, tmp_path
):
    import shutil

    random_lora(tmp_path / "peft", seed=5)  # a peft adapter: not mlx-lm's format
    no_weights = tmp_path / "no-weights"
    shutil.copytree(adapters["b"][0], no_weights)
    (no_weights / "adapters.safetensors").unlink()
    truncated = tmp_path / "truncated"
    shutil.copytree(adapters["b"][0], truncated)
    weights = truncated / "adapters.safetensors"
    weights.write_bytes(weights.read_bytes()[:300])
    for path, error, message in [
        (tmp_path / "peft", ValueError, "peft adapter.*AsyncTransformer"),
        (no_weights, FileNotFoundError, "adapters.safetensors"),
        (truncated, ValueError, "cannot load the mlx-lm adapter"),
        (tmp_path / "missing", FileNotFoundError, "does not exist"),
    ]:
        with pytest.raises(error, match=message):
            lm.add_new_lora(path, "a")
        check(lm.next_token_logprobs_sync(PROMPTS[0], lora_name="a"), adapters["a"][1], PROMPTS[0])
        check(lm.next_token_logprobs_sync(PROMPTS[1]), base_model[0], PROMPTS[1])
    assert sorted(lm.lora_paths) == ["a", "b"]


async def test_two_lms_over_one_model_keep_their_rows_and_close_leaves_it_as_given(
    base_model, adapters
):
    """Adapters load into a copy of the modules (`_share_weights_copy`): one LM's adapter
    never reaches another LM's base rows over the same model, nor the model itself."""
    import mlx.core as mx

    model, tokenizer = base_model
    before = np.array(model(mx.array([PROMPTS[1]]))[0, -1])
    first = AsyncMlxLM(model, tokenizer, batch_size=4)
    second = AsyncMlxLM(model, tokenizer, batch_size=4)
    loading = asyncio.to_thread(first.add_new_lora, adapters["a"][0], "a")
    _, *rows = await asyncio.gather(loading, *(second.next_token_logprobs(p) for p in PROMPTS))
    for ids, row in zip(PROMPTS, rows, strict=True):
        check(row, model, ids)
    for ids in PROMPTS:
        check(first.next_token_logprobs_sync(ids, lora_name="a"), adapters["a"][1], ids)
        check(second.next_token_logprobs_sync(ids), model, ids)
        check(first.next_token_logprobs_sync(ids), model, ids)
    first.close()
    second.close()
    assert np.array_equal(np.array(model(mx.array([PROMPTS[1]]))[0, -1]), before)
