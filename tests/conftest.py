"""Shared fixtures: the offline default model (converted once per machine) and its tokenizer."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_model_dir():
    """Directory of SmolLM2-135M-Instruct as a clean HF checkpoint (converted from the GGUF once)."""
    from genlm.backend.models import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="session")
def smollm2_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    """The default model in float32 on CPU, loaded once per test session."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model.eval()
