"""The `python -m genlm.backend sis` demo, end to end."""

import subprocess
import sys

import pytest


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "genlm.backend", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("backend", ["mock", pytest.param("hf", marks=pytest.mark.slow)])
def test_sis_demo_prints_weighted_continuations_and_throughput(default_model_dir, backend):
    result = run_cli(
        "sis",
        "--model",
        default_model_dir,
        "--backend",
        backend,
        "--prompt",
        "Montreal is",
        "--particles",
        "3",
        "--max-tokens",
        "4",
        "--temperature",
        "1.5",
    )
    assert result.returncode == 0, result.stderr
    assert "Prompt: 'Montreal is'" in result.stdout
    assert result.stdout.count("w=") == 3
    assert "tokens/s" in result.stdout
    assert "sampling" in result.stderr  # the progress bar


def test_sis_demo_rejects_bad_arguments():
    result = run_cli("sis", "--particles", "0")
    assert result.returncode != 0
    assert "--particles" in result.stderr


def one_line_usage_error(result, *needles):
    """Exit status 2, no traceback, and an argparse error line naming what was wrong."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    error = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(error) == 1, result.stderr
    for needle in needles:
        assert needle in error[0], error[0]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--seed", str(2**64)], "--seed"),
        (["--seed", "-1"], "--seed"),
        (["--seed", str(2**63 - 3), "--particles", "5"], "--seed"),
        (["--temperature", "0"], "--temperature"),
        (["--prompt", ""], "--prompt"),
        (["--model", "/no/such/model/dir"], "--model"),
        (["--model", "someone/not-downloaded"], "someone/not-downloaded"),
    ],
)
def test_bad_arguments_get_one_line_and_status_2(args, needle):
    one_line_usage_error(run_cli("sis", "--backend", "mock", *args), needle)


def test_a_model_that_cannot_be_loaded_is_one_line_naming_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a directory, but no model in it
    result = run_cli("sis", "--backend", "hf", "--model", str(tmp_path))
    one_line_usage_error(result, "--model", str(tmp_path))


def test_a_prompt_that_is_not_utf8_is_refused_in_one_line(default_model_dir):
    command = [sys.executable, "-m", "genlm.backend", "sis", "--backend", "mock"]
    command += ["--model", default_model_dir, "--prompt"]
    result = subprocess.run(
        [*(c.encode() for c in command), b"caf\xe9 au lait"], capture_output=True, timeout=600
    )
    result.stderr = result.stderr.decode()
    one_line_usage_error(result, "--prompt", "UTF-8")


def test_a_closed_output_pipe_ends_quietly(default_model_dir):
    command = f"{sys.executable} -m genlm.backend sis --backend mock --model {default_model_dir}"
    command += " --particles 50 --max-tokens 3 | head -1"
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr
    assert result.stdout.startswith("Loaded")


def test_help_is_plain_text_and_names_each_option_and_default():
    top = run_cli("--help")
    assert top.returncode == 0 and "``" not in top.stdout and "sis" in top.stdout
    sis = run_cli("sis", "--help").stdout
    for option, default in [("--particles", "10"), ("--max-tokens", "10"), ("--seed", "0")]:
        assert option in sis and f"(default: {default})" in sis
    assert "``" not in sis


async def test_particles_stop_at_the_context_length(smollm2_tokenizer):
    from genlm.backend.__main__ import run_sis
    from genlm.backend.llm import MockAsyncLM

    class ShortContext(MockAsyncLM):
        max_context_length = 5

    with ShortContext(smollm2_tokenizer) as lm:
        particles = await run_sis(lm, [1, 2, 3], 4, max_tokens=10)
    assert all(len(p.token_ids) + p.finished <= 3 for p in particles)
