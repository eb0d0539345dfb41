"""MockAsyncLM, the AsyncLM base behaviour it inherits, and load_model_by_name."""

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from genlm.backend.llm import MockAsyncLM, load_model_by_name


@pytest.fixture(scope="module")
def mock_lm(smollm2_tokenizer):
    return MockAsyncLM(smollm2_tokenizer)


def test_logprobs_are_normalized_and_sized_by_the_vocabulary(mock_lm):
    logps = mock_lm.next_token_logprobs_sync([1, 2, 3])
    assert logps.shape == (len(mock_lm.byte_vocab),)
    assert logps.dtype == torch.float32
    assert torch.logsumexp(logps, 0).item() == pytest.approx(0.0, abs=1e-4)


async def test_same_prefix_same_vector_and_different_prefixes_differ(mock_lm):
    a, b, c = await asyncio.gather(
        mock_lm.next_token_logprobs([5, 6]),
        mock_lm.next_token_logprobs([5, 6]),
        mock_lm.next_token_logprobs([5, 7]),
    )
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(a, mock_lm.next_token_logprobs_sync([5, 6]))


async def test_callers_of_the_same_prefix_in_one_batch_each_get_their_own_vector(mock_lm):
    a, b, c = await asyncio.gather(*(mock_lm.next_token_logprobs([5, 6]) for _ in range(3)))
    assert torch.equal(a, b) and torch.equal(a, c)
    a[0] = 123.0  # a caller edits its vector in place
    b[:] = 0.0
    assert torch.equal(c, mock_lm.next_token_logprobs_sync([5, 6]))


def test_deterministic_across_processes(mock_lm, default_model_dir):
    code = (
        "from transformers import AutoTokenizer\n"
        "from genlm.backend.llm import MockAsyncLM\n"
        f"lm = MockAsyncLM(AutoTokenizer.from_pretrained({default_model_dir!r}))\n"
        "print(repr(lm.next_token_logprobs_sync([11, 22, 33])[:5].tolist()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    expected = mock_lm.next_token_logprobs_sync([11, 22, 33])[:5].tolist()
    assert eval(out) == expected


async def test_thousand_concurrent_requests_fill_whole_batches(mock_lm):
    prefixes = [[i % 500, i] for i in range(1000)]
    batcher = mock_lm.batcher
    batches, requests = batcher.num_batches, batcher.num_requests
    results = await asyncio.gather(*(mock_lm.next_token_logprobs(p) for p in prefixes))
    assert len(results) == 1000
    for prefix, logps in zip(prefixes[:20], results[:20], strict=True):
        assert torch.equal(logps, mock_lm.next_token_logprobs_sync(prefix))
    # Every batch full but the last (the speed is measured in benchmark/, not asserted here).
    assert batcher.num_requests - requests == 1000
    assert batcher.num_batches - batches == -(-1000 // batcher.batch_size)


async def test_ten_thousand_requests_are_all_served(mock_lm):
    results = await asyncio.gather(*(mock_lm.next_token_logprobs([i]) for i in range(10_000)))
    assert len(results) == 10_000


async def test_batch_next_token_logprobs(mock_lm):
    prefixes = [[1], [1, 2], [3]]
    batch = await mock_lm.batch_next_token_logprobs(prefixes)
    expected = torch.stack([mock_lm.next_token_logprobs_sync(p) for p in prefixes])
    assert torch.equal(batch, expected)
    assert torch.equal(mock_lm.batch_next_token_logprobs_sync(prefixes), expected)


@pytest.mark.parametrize(
    "bad, error, message",
    [
        ([], ValueError, "empty"),
        ([1, -1], ValueError, "-1"),
        ([1, 10**9], ValueError, "1000000000"),
        ([1, 2.5], TypeError, "2.5"),
        ([True], TypeError, "True"),
        ("abc", TypeError, "string"),
        (np.zeros((2, 2), dtype=int), ValueError, "1-D"),
    ],
)
async def test_bad_token_ids_are_rejected_before_model_work(mock_lm, bad, error, message):
    with pytest.raises(error, match=message):
        await mock_lm.next_token_logprobs(bad)
    with pytest.raises(error, match=message):
        mock_lm.next_token_logprobs_sync(bad)


async def test_accepts_numpy_and_torch_ids(mock_lm):
    expected = mock_lm.next_token_logprobs_sync([4, 5])
    assert torch.equal(await mock_lm.next_token_logprobs(np.array([4, 5])), expected)
    assert torch.equal(await mock_lm.next_token_logprobs(torch.tensor([4, 5])), expected)


async def test_sample_is_reproducible_and_stops_at_eos(mock_lm):
    first = await mock_lm.sample([1, 2], max_tokens=12, eos_token_ids=[], seed=7)
    again = await mock_lm.sample([1, 2], max_tokens=12, eos_token_ids=[], seed=7)
    assert first == again
    assert len(first) == 12
    eos = first[3]
    stopped = await mock_lm.sample([1, 2], max_tokens=12, eos_token_ids=[eos], seed=7)
    assert stopped == first[: first.index(eos)]
    batch = await mock_lm.batch_sample([[1, 2], [3]], max_tokens=4, eos_token_ids=[], seed=7)
    assert len(batch) == 2 and all(len(s) == 4 for s in batch)
    assert batch[0] == first[:4]


async def test_sample_rejects_bad_arguments(mock_lm):
    with pytest.raises(ValueError, match="temperature"):
        await mock_lm.sample([1], max_tokens=2, eos_token_ids=[], temperature=0)
    with pytest.raises(ValueError, match="max_tokens"):
        await mock_lm.sample([1], max_tokens=-1, eos_token_ids=[])


async def test_mock_adapters_are_distinct_deterministic_distributions(smollm2_tokenizer):
    lm = MockAsyncLM(smollm2_tokenizer)
    base = lm.next_token_logprobs_sync([5, 6])
    with pytest.raises(ValueError, match=r"'a'.*add_new_lora"):
        await lm.next_token_logprobs([5, 6], lora_name="a")
    lm.add_new_lora("/adapters/a", "a")
    lm.add_new_lora("/adapters/b", "b")
    a, b, base_again = await asyncio.gather(
        lm.next_token_logprobs([5, 6], lora_name="a"),
        lm.next_token_logprobs([5, 6], lora_name="b"),
        lm.next_token_logprobs([5, 6]),
    )
    assert torch.equal(base, base_again)
    assert not torch.equal(a, base) and not torch.equal(a, b)
    other = MockAsyncLM(smollm2_tokenizer)
    other.add_new_lora("/elsewhere/a", "a")
    assert torch.equal(a, other.next_token_logprobs_sync([5, 6], lora_name="a"))
    assert torch.logsumexp(a, 0).item() == pytest.approx(0.0, abs=1e-4)
    lm.set_lora(lora_name="a")
    assert torch.equal(lm.next_token_logprobs_sync([5, 6]), a)  # None: the default adapter
    lm.clear_lora()
    assert torch.equal(lm.next_token_logprobs_sync([5, 6]), base)
    lm.remove_lora("a")
    with pytest.raises(ValueError, match="add_new_lora"):
        lm.next_token_logprobs_sync([5, 6], lora_name="a")
    with pytest.raises(ValueError, match="add_new_lora"):
        lm.remove_lora("a")


async def test_reset_async_queries_cancels_queued_requests(mock_lm):
    queued = asyncio.ensure_future(mock_lm.next_token_logprobs([9, 9, 9]))
    await asyncio.sleep(0)
    mock_lm.reset_async_queries()
    with pytest.raises(asyncio.CancelledError):
        await queued


def test_load_model_by_name_mock(default_model_dir):
    llm = load_model_by_name(default_model_dir, backend="mock")
    assert isinstance(llm, MockAsyncLM)
    assert llm.tokenizer.eos_token_id is not None


def _machine(monkeypatch, cuda: bool, vllm: bool) -> None:
    """Pretend CUDA is (not) available and vllm is (not) installed."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: (
            (find_spec("json") if vllm else None) if name == "vllm" else find_spec(name, *args)
        ),
    )


@pytest.mark.parametrize(
    "cuda, vllm, chosen, logged",
    [
        (False, False, "hf", 0),
        (False, True, "hf", 0),
        (True, True, "vllm", 0),
        (True, False, "hf", 1),
    ],
)
def test_default_backend_is_vllm_only_with_cuda_and_vllm(
    monkeypatch, caplog, default_model_dir, cuda, vllm, chosen, logged
):
    from genlm.backend.llm import loading

    _machine(monkeypatch, cuda, vllm)
    loaded = {}
    for name in ("vllm", "hf"):  # what each backend would load, without a model or a GPU
        monkeypatch.setitem(loading.BACKENDS, name, ("genlm.backend.llm.mock", "MockAsyncLM"))
    monkeypatch.setattr(
        MockAsyncLM, "from_name", classmethod(lambda cls, name, **kw: loaded.setdefault("x", cls))
    )
    with caplog.at_level("WARNING", logger=loading.__name__):
        assert loading.default_backend() == chosen
        caplog.clear()
        load_model_by_name(default_model_dir)
    lines = [r.getMessage() for r in caplog.records if r.name == loading.__name__]
    assert len(lines) == logged
    if logged:
        assert "vllm is not installed" in lines[0] and "[vllm]" in lines[0]


def test_on_python_below_3_11_the_hf_line_says_vllm_needs_3_11(monkeypatch, caplog):
    """The vllm extra's marker in pyproject.toml installs nothing below 3.11: the line says
    why instead of naming the extra."""
    from genlm.backend.llm import loading

    pyproject = Path(__file__).parents[1].joinpath("pyproject.toml").read_text()
    assert re.search(r"""^vllm = \["vllm[^;"]*; python_version >= '3\.11'"\]$""", pyproject, re.M)
    _machine(monkeypatch, cuda=True, vllm=False)
    monkeypatch.setattr(sys, "version_info", (3, 10, 14, "final", 0))
    with caplog.at_level("WARNING", logger=loading.__name__):
        assert loading.default_backend() == "hf"
    (line,) = [r.getMessage() for r in caplog.records if r.name == loading.__name__]
    assert "vLLM needs Python >= 3.11 (this is 3.10)" in line and "[vllm]" not in line


def test_cuda_without_vllm_loads_hf_and_never_raises_import_error(monkeypatch, default_model_dir):
    """The real modules: no backend was named, so vllm's absence is no error."""
    import sys

    from genlm.backend.llm import loading

    _machine(monkeypatch, cuda=True, vllm=False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    picked = {}
    hf_module, hf_class = loading.BACKENDS["hf"]
    real = getattr(__import__(hf_module, fromlist=[hf_class]), hf_class)
    monkeypatch.setattr(
        real, "from_name", classmethod(lambda cls, name, **kw: picked.setdefault("cls", cls))
    )
    assert load_model_by_name(default_model_dir) is real
    with pytest.raises(ImportError, match=r"needs vllm: pip install -e .*\[vllm\]"):
        load_model_by_name(default_model_dir, backend="vllm")


def test_load_model_by_name_unknown_backend_lists_the_valid_ones():
    with pytest.raises(ValueError) as info:
        load_model_by_name("anything", backend="tpu")
    for name in ("vllm", "hf", "mlx", "sgl", "mock"):
        assert name in str(info.value)


def test_import_is_lazy():
    code = (
        "import sys, genlm.backend\n"
        "heavy = {'torch', 'transformers', 'numba', 'vllm', 'mlx', 'sglang', 'peft'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


async def test_a_request_whose_adapter_is_removed_while_queued_fails_alone(smollm2_tokenizer):
    lm = MockAsyncLM(smollm2_tokenizer)
    lm.add_new_lora("/adapters/a", "a")
    doomed = asyncio.ensure_future(lm.next_token_logprobs([1, 2], lora_name="a"))
    kept = asyncio.ensure_future(lm.next_token_logprobs([1, 2]))
    await asyncio.sleep(0)  # both queued in one batch
    lm.remove_lora("a")
    with pytest.raises(ValueError, match="'a'.*add_new_lora"):
        await doomed
    assert torch.equal(await kept, MockAsyncLM(smollm2_tokenizer).next_token_logprobs_sync([1, 2]))
    assert lm.batcher.num_batches == 1


CLOSED = r"used after cleanup\(\) or close\(\)"


async def test_requests_waiting_at_close_get_the_closed_error_not_a_cancellation(
    smollm2_tokenizer,
):
    lm = MockAsyncLM(smollm2_tokenizer)
    waiting = [asyncio.ensure_future(lm.next_token_logprobs([i + 1])) for i in range(3)]
    await asyncio.sleep(0)  # queued; their batch has not run
    lm.close()
    for task in waiting:
        with pytest.raises(RuntimeError, match=f"^MockAsyncLM {CLOSED}"):
            await task
        assert not task.cancelled()
    assert lm.batcher.num_batches == 0
    with pytest.raises(RuntimeError, match=CLOSED):
        await lm.next_token_logprobs([1])


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.TaskGroup is Python 3.11's")
async def test_a_task_group_sees_the_closed_error_of_requests_waiting_at_close(
    smollm2_tokenizer,
):
    """A cancelled child would end the group quietly, as if nothing had gone wrong."""
    lm = MockAsyncLM(smollm2_tokenizer)
    with pytest.raises(ExceptionGroup) as raised:  # noqa: F821 - Python >= 3.11
        async with asyncio.TaskGroup() as group:
            for i in range(3):
                group.create_task(lm.next_token_logprobs([i + 1]))
            await asyncio.sleep(0)
            lm.close()
    errors = raised.value.exceptions
    assert len(errors) == 3 and all(isinstance(e, RuntimeError) for e in errors)
    assert all(re.search(CLOSED, str(e)) for e in errors)
