"""`AsyncTransformer.from_name`'s default ``device_map``: on CUDA the whole model on the
current GPU where its weights fit, else an error naming the ways to split it; a caller's
own ``device_map`` kept; on the CPU transformers' ``"auto"`` as before.

CUDA is a stand-in (``torch.cuda``'s ``is_available``, ``current_device`` and
``mem_get_info``) and ``from_pretrained`` records its arguments and stops, so nothing is
placed on a device; the model is a tiny random Llama saved as a config (no weights).
"""

import pytest
import torch

from genlm.backend.llm.hf import AsyncTransformer
from genlm.backend.llm.hf.options import ONE_DEVICE_WEIGHT_SHARE


class Loaded(Exception):
    """Raised by the stand-in ``from_pretrained`` once it has recorded its arguments."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny Llama's config and the default model's tokenizer (no weights: never loaded),
    and the bytes of its float32 weights, counted on the real model's tensors."""
    from small_models import tiny_llama

    path = tmp_path_factory.mktemp("tiny")
    model = tiny_llama(len(smollm2_tokenizer))
    model.config.save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    tensors = [*model.parameters(), *model.buffers()]
    return str(path), sum(tensor.numel() * tensor.element_size() for tensor in tensors)


@pytest.fixture
def from_pretrained_kwargs(monkeypatch):
    """The keyword arguments of the next ``AutoModelForCausalLM.from_pretrained`` call."""
    from transformers import AutoModelForCausalLM

    recorded: dict = {}

    def record(path, **kwargs):
        recorded.update(kwargs)
        raise Loaded

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", record)
    return recorded


def cuda(monkeypatch, device: int, free: int) -> list[int]:
    """Pretend CUDA is there, ``device`` current with ``free`` bytes free; returns the list
    of devices whose memory was asked for."""
    asked: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device)

    def mem_get_info(index=None):
        asked.append(index)
        return free, 4 * free

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return asked


def device_map_of(model_dir: str, **from_name_kwargs) -> None:
    """Run ``from_name`` up to ``from_pretrained`` (which records what it was given)."""
    with pytest.raises(Loaded):
        AsyncTransformer.from_name(model_dir, **from_name_kwargs)


def test_a_model_that_fits_goes_whole_on_the_current_gpu(
    monkeypatch, tiny_dir, from_pretrained_kwargs
):
    path, weights = tiny_dir
    asked = cuda(monkeypatch, device=1, free=int(weights / ONE_DEVICE_WEIGHT_SHARE) + 1)
    device_map_of(path)
    assert from_pretrained_kwargs["device_map"] == {"": 1}
    assert asked == [1]


def test_a_model_that_does_not_fit_says_so_and_names_the_ways_to_split_it(
    monkeypatch, tiny_dir, from_pretrained_kwargs
):
    path, weights = tiny_dir
    cuda(monkeypatch, device=0, free=int(weights / ONE_DEVICE_WEIGHT_SHARE) - 1)
    with pytest.raises(ValueError) as raised:
        AsyncTransformer.from_name(path)
    message = str(raised.value)
    assert f"about {weights / 2**30:.2f} GiB" in message and "cuda:0" in message
    assert "does not fit on one GPU" in message
    assert "tensor_parallel_size" in message and "backend='vllm'" in message
    assert "hf_opts={'device_map': 'auto'}" in message
    assert not from_pretrained_kwargs  # nothing was loaded


def test_the_estimate_follows_the_dtype_it_loads_in(monkeypatch, tiny_dir, from_pretrained_kwargs):
    """bfloat16 halves the float32 weights: they fit where float32 would not."""
    path, weights = tiny_dir
    cuda(monkeypatch, device=0, free=int(0.6 * weights / ONE_DEVICE_WEIGHT_SHARE))
    with pytest.raises(ValueError, match="does not fit"):
        AsyncTransformer.from_name(path)
    device_map_of(path, hf_opts={"dtype": "bfloat16"})
    assert from_pretrained_kwargs["device_map"] == {"": 0}


@pytest.mark.parametrize("device_map", ["auto", {"": "cpu"}, None])
def test_a_callers_device_map_is_kept_and_no_memory_is_asked(
    monkeypatch, tiny_dir, from_pretrained_kwargs, device_map
):
    path, _ = tiny_dir
    asked = cuda(monkeypatch, device=0, free=0)
    device_map_of(path, hf_opts={"device_map": device_map})
    assert from_pretrained_kwargs["device_map"] == device_map
    assert asked == []


def test_without_cuda_transformers_auto_as_before(monkeypatch, tiny_dir, from_pretrained_kwargs):
    path, _ = tiny_dir
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device_map_of(path)
    assert from_pretrained_kwargs["device_map"] == "auto"


def test_quantized_weights_are_counted_at_their_bits(monkeypatch, tiny_dir, from_pretrained_kwargs):
    """4-bit weights take an eighth of float32's, 8-bit ones a quarter: where a fifth of the
    float32 bytes is free, the 4-bit model fits and the 8-bit one does not."""
    pytest.importorskip("bitsandbytes")
    path, weights = tiny_dir
    cuda(monkeypatch, device=0, free=int(0.2 * weights / ONE_DEVICE_WEIGHT_SHARE))
    device_map_of(path, bitsandbytes_opts={"load_in_4bit": True})
    assert from_pretrained_kwargs["device_map"] == {"": 0}
    with pytest.raises(ValueError, match="does not fit"):
        AsyncTransformer.from_name(path, bitsandbytes_opts={"load_in_8bit": True})


def test_a_corrupt_config_is_the_loaders_error_not_a_size(monkeypatch, tmp_path, smollm2_tokenizer):
    cuda(monkeypatch, device=0, free=1 << 40)
    smollm2_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises((OSError, ValueError), match="could not load"):
        AsyncTransformer.from_name(str(tmp_path))
