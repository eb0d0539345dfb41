"""The `python -m genlm.backend sis` demo, end to end."""

import subprocess
import sys

import pytest


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "genlm.backend", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("backend", ["mock", "hf"])
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
