"""Shared fixtures: the offline default model (converted once per machine) and its tokenizer;
the guard against deprecated calls from our code (tests/deprecations.py); a temporary
Hugging Face cache for adapters by hub id."""

import os
import sys
from pathlib import Path

import pytest
from deprecations import DeprecationGuard

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The benchmarks' modules (the op counter, the small random models, the GPU command...)
# serve the tests too: importable by their own names, as the benchmark scripts import them.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

DEPRECATION_GUARD = DeprecationGuard()
SUMMARY = pytest.StashKey[list]()


def pytest_configure(config):
    DEPRECATION_GUARD.install()
    config.stash[SUMMARY] = []


def pytest_terminal_summary(terminalreporter, config):
    for line in config.stash[SUMMARY]:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def summary_lines(request):
    """Lines to print at the end of the run (figures a closing note quotes)."""
    return request.config.stash[SUMMARY]


def pytest_unconfigure(config):
    DEPRECATION_GUARD.uninstall()


@pytest.fixture(autouse=True)
def no_deprecated_calls_from_our_code():
    """Fails the test in which genlm.backend called a deprecated API of another library
    (also from a worker thread or a shared fixture it set up)."""
    yield
    found = list(DEPRECATION_GUARD.found)
    DEPRECATION_GUARD.found.clear()
    if found:
        pytest.fail("genlm.backend called deprecated APIs:\n" + "\n".join(found), pytrace=False)


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


@pytest.fixture(scope="session")
def random_lora(default_model_dir):
    """``random_lora(path, seed)``: a peft LoRA adapter (r=4 on q/v projections, random
    non-zero B) on a fresh float32 copy of the default model, saved at ``path``; returns
    the peft model, adapter enabled."""
    import torch

    def make(path, seed=0):
        import peft
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        config = peft.LoraConfig(
            r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        )
        model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
        adapted = peft.get_peft_model(model, config).eval()
        adapted.save_pretrained(path)
        return adapted

    return make


@pytest.fixture(scope="session")
def random_walks():
    """``await random_walks(lm, prompt, particles, steps=3)``: concurrent particles, each
    extending ``prompt`` by ``steps`` random tokens (seeded by its index) and awaiting the
    logprobs of every prefix on the way; returns ``{prefix: logprobs}``."""
    import asyncio

    import torch

    async def walk(lm, prompt, particles, steps=3):
        seen = {}

        async def particle(index):
            generator = torch.Generator().manual_seed(index)
            ctx = list(prompt)
            for _ in range(steps):
                seen[tuple(ctx)] = await lm.next_token_logprobs(ctx)
                ctx = ctx + [torch.randint(0, 40_000, (1,), generator=generator).item()]

        await asyncio.gather(*(particle(i) for i in range(particles)))
        return seen

    return walk


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """``hub_cache(repo_id, directory)``: the files of ``directory`` placed in a temporary
    Hugging Face cache the way huggingface_hub lays out a downloaded snapshot (``blobs/``,
    ``snapshots/<revision>/`` of links to them, ``refs/main``), with the hub offline (so a
    hub id resolves from this cache or not at all); returns the snapshot directory."""
    import hashlib

    from huggingface_hub import constants

    cache = tmp_path / "hf-hub-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def place(repo_id, directory):
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        revision = hashlib.sha1(repo_id.encode()).hexdigest()
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True)
        (repo / "blobs").mkdir()
        for file in sorted(Path(directory).iterdir()):
            if file.is_file():
                blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
                blob.write_bytes(file.read_bytes())
                (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
        return snapshot

    return place
