"""Issue 30: the lint step of `make test` passes in a source copy without ``.git`` (a
`git archive`, an unpacked sdist), where ruff reads no ``.gitignore``: every local venv
is excluded by name in pyproject.toml."""

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENVS = [".venv", ".venv-vllm", ".venv-latest", ".venv-vllm-latest"]
BAD = "import os\nx=1;y = 2\n"  # F401 unused import, E702 two statements on a line


def ruff(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=cwd, capture_output=True, text=True
    )


@pytest.fixture
def archived_copy(tmp_path):
    """``git archive HEAD`` unpacked, plus a file with lint errors in each local venv."""
    pytest.importorskip("ruff")
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    copy = tmp_path / "copy"
    copy.mkdir()
    archive = subprocess.run(
        f"git -C {shlex.quote(str(REPO))} archive HEAD | tar -x -C {shlex.quote(str(copy))}",
        shell=True,
        capture_output=True,
        text=True,
    )
    if archive.returncode:
        pytest.skip(f"not a git checkout: {archive.stderr.strip()}")
    assert not (copy / ".git").exists()
    for venv in VENVS:
        (copy / venv).mkdir()
        (copy / venv / "bad.py").write_text(BAD)
    return copy


def test_lint_passes_in_a_git_archive_copy_with_local_venvs(archived_copy):
    planted = ruff("check", "--no-cache", "--isolated", ".venv-vllm/bad.py", cwd=archived_copy)
    assert planted.returncode == 1 and "F401" in planted.stdout  # the plant has errors
    for args in (["check", "--no-cache", "."], ["format", "--check", "--no-cache", "."]):
        result = ruff(*args, cwd=archived_copy)
        assert result.returncode == 0, result.stdout + result.stderr
