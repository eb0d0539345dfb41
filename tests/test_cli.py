"""The `python -m genlm.backend sis` demo, end to end."""

import os
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from genlm.backend.__main__ import INTERRUPTED_STATUS, invoked_as

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "genlm.backend", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
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
        (["--temperature", "0"], "--temperature"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "inf"], "--temperature"),
        (["--temperature", "1e400"], "--temperature"),  # overflows to inf
        (["--temperature", "warm"], "--temperature"),
        (["--particles", "x"], "--particles"),
        (["--max-tokens", "1.5"], "--max-tokens"),
        (["--seed", "one"], "--seed"),
        (["--backend", "tpu"], "--backend"),
        (["--dtype", "int4"], "--dtype"),
        (["--dtype", "float16"], "--dtype"),  # the mock backend takes no dtype
        (["--no-such-option"], "--no-such-option"),
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
    from genlm.backend.demos.sis import run_sis
    from genlm.backend.llm import MockAsyncLM

    class ShortContext(MockAsyncLM):
        max_context_length = 5

    with ShortContext(smollm2_tokenizer) as lm:
        particles = await run_sis(lm, [1, 2, 3], 4, max_tokens=10)
    assert all(len(p.token_ids) + p.finished <= 3 for p in particles)


def test_a_bad_command_is_one_line_without_the_usage():
    result = run_cli("bogus")
    one_line_usage_error(result, "bogus")
    assert "usage:" not in result.stderr and result.stderr.startswith("python -m genlm.backend:")
    one_line_usage_error(run_cli(), "COMMAND")


def test_a_missing_extra_is_one_line_naming_this_checkouts_install_command(default_model_dir):
    """vLLM is not in the main venv (nor SGLang): the CLI says how to install the extra
    from this checkout, not from PyPI (where genlm-backend is another library)."""
    for backend, extra in [("vllm", "vllm"), ("sgl", "sgl")]:
        result = run_cli("sis", "--backend", backend, "--model", default_model_dir)
        one_line_usage_error(result, "--backend", f"pip install -e '{ROOT}[{extra}]'")


def test_a_tiny_temperature_draws_the_top_token(default_model_dir):
    """Every finite temperature > 0 is accepted, as by the library's `sample`: 1e-320 is
    greedy (every particle the same tokens), not a NaN in multinomial."""
    result = run_cli(
        "sis", "--backend", "mock", "--model", default_model_dir, "--temperature", "1e-320",
        "--particles", "3", "--max-tokens", "4",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    samples = {line.split("  ", 2)[2] for line in result.stdout.splitlines() if "w=" in line}
    assert len(samples) == 1


def test_proposal_logprobs_match_a_float64_softmax():
    import torch

    from genlm.backend.demos.sis import proposal_logprobs

    logps = torch.log_softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), 0)
    for temperature in (0.5, 1.0, 3.0):
        expected = torch.log_softmax(logps.double() / temperature, dim=0)
        assert torch.allclose(proposal_logprobs(logps, temperature), expected, atol=1e-12)
    greedy = proposal_logprobs(logps, 1e-320)
    assert greedy.argmax() == logps.argmax() and greedy.max() == 0.0
    assert not greedy.isnan().any()


def test_version_names_the_program_and_the_installed_version():
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"python -m genlm.backend {version('genlm-backend')}"


def test_the_program_is_named_as_invoked():
    assert invoked_as("/x/genlm/backend/__main__.py") == "python -m genlm.backend"
    assert invoked_as("/venv/bin/genlm-backend") == "genlm-backend"
    script = Path(sys.executable).with_name("genlm-backend")
    if not script.exists():
        pytest.skip("the genlm-backend script is not installed in this venv")
    result = subprocess.run(
        [str(script), "sis", "--particles", "0"], capture_output=True, text=True, timeout=600
    )
    one_line_usage_error(result, "--particles")
    assert result.stderr.startswith("genlm-backend sis: error:")
    usage = subprocess.run([str(script), "--help"], capture_output=True, text=True).stdout
    assert usage.startswith("usage: genlm-backend ")


def test_help_states_every_default():
    sis = run_cli("sis", "--help").stdout
    assert "(default: float32 for hf; for vllm and sgl, auto" in " ".join(sis.split())
    for option in ("--prompt", "--temperature", "--model", "--backend", "--upstream-logs"):
        assert option in sis
    assert " ".join(sis.split()).count("default") >= 9


def test_ctrl_c_ends_in_one_line_and_status_130(default_model_dir, tmp_path):
    command = [sys.executable, "-m", "genlm.backend", "sis", "--backend", "mock"]
    command += ["--model", default_model_dir, "--particles", "64", "--max-tokens", "100000"]
    stderr_path = tmp_path / "stderr"
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
        deadline = time.monotonic() + 300
        while "sampling" not in stderr_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        stdout, _ = process.communicate(timeout=120)
    errors = stderr_path.read_text()
    assert process.returncode == INTERRUPTED_STATUS, errors
    assert "Traceback" not in errors and "KeyboardInterrupt" not in errors
    assert errors.rstrip().splitlines()[-1] == "python -m genlm.backend: interrupted"
    assert stdout.startswith("Loaded")


@pytest.mark.parametrize("switch", [None, "flag", "env"])
def test_upstream_logs_are_quiet_unless_asked_for(switch):
    """bitsandbytes warns on import about a missing optional kernel package (on CPUs with
    AVX512-BF16); the CLI's quieting hides it, --upstream-logs or the variable shows it;
    our own warnings are never hidden."""
    code = (
        "import logging, sys\n"
        "from genlm.backend.__main__ import build_parser\n"
        "from genlm.backend.logs import quiet_upstream_logs\n"
        "args = build_parser().parse_args(sys.argv[1:])\n"
        "if not args.upstream_logs:\n"
        "    quiet_upstream_logs()\n"
        "logging.getLogger('bitsandbytes.backends.cpu.ops').warning('upstream noise')\n"
        "logging.getLogger('vllm.engine').warning('vllm noise')\n"
        "logging.getLogger('genlm.backend.llm').warning('our own warning')\n"
        "import os; print(os.environ.get('VLLM_LOGGING_LEVEL'))\n"
    )
    argv = ["sis"] + (["--upstream-logs"] if switch == "flag" else [])
    env = {**os.environ, "GENLM_BACKEND_UPSTREAM_LOGS": "1" if switch == "env" else ""}
    env.pop("VLLM_LOGGING_LEVEL", None)
    result = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env
    )
    assert "our own warning" in result.stderr
    shown = switch is not None
    assert ("upstream noise" in result.stderr) == shown
    assert ("vllm noise" in result.stderr) == shown
    assert result.stdout.strip() == ("None" if shown else "ERROR")
