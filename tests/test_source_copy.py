"""Issue 30: `make test` works in a source copy without ``.git`` (a `git archive`, an
unpacked sdist). Each step that could lean on git is checked in such a copy, in seconds:
the lint (ruff reads ``.gitignore`` only inside a git work tree, so every local venv is
excluded by name in pyproject.toml), the package's metadata and version (static, never
from git), and the scripts `make test` runs (none calls git)."""

import ast
import os
import re
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


def test_the_package_metadata_builds_in_a_git_archive_copy_without_git(archived_copy, tmp_path):
    """setuptools makes the copy's metadata at pyproject's version with no git to call (a
    ``git`` first on PATH records any call and fails)."""
    bin_dir, calls, out = tmp_path / "bin", tmp_path / "git-calls", tmp_path / "metadata"
    bin_dir.mkdir()
    out.mkdir()
    (bin_dir / "git").write_text(f'#!/bin/sh\necho "$@" >> {shlex.quote(str(calls))}\nexit 1\n')
    (bin_dir / "git").chmod(0o755)
    build = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta; "
            "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))",
            str(out),
        ],
        cwd=archived_copy,
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    version = re.search(r'^version = "(.+)"$', (archived_copy / "pyproject.toml").read_text(), re.M)
    assert version, "pyproject.toml states no static version"
    metadata = (out / build.stdout.split()[-1] / "METADATA").read_text()
    assert f"\nVersion: {version[1]}\n" in metadata
    assert not calls.exists(), calls.read_text()


def make_test_files() -> list[Path]:
    """The files `make test` runs: the Makefile's ``test`` recipe, then each file of
    scripts/ that one of them names outside its comments, transitively."""
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    assert recipe, "the Makefile has no test target"
    files: list[Path] = []
    texts = [recipe[1]]
    while texts:
        for name in re.findall(r"scripts/[\w.-]+", _code(texts.pop())):
            path = REPO / name
            if path not in files and path.suffix in (".sh", ".py"):
                files.append(path)
                texts.append(path.read_text())
    return files


def _code(text: str) -> str:
    """Shell text without its comments (whole-line ones and `` # ...`` tails)."""
    lines = (line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return "\n".join(re.sub(r"\s#.*$", "", line) for line in lines)


def _calls_git(path: Path) -> bool:
    if path.suffix == ".py":
        strings = (
            node.value
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
        )
        return any(re.match(r"git(\s|$)", string) for string in strings)
    return re.search(r"(^|[\s;&|(`])git(\s|$)", _code(path.read_text()), re.M) is not None


def test_the_scripts_of_make_test_call_no_git():
    files = make_test_files()
    names = {path.name for path in files}
    assert {"test.sh", "setup.sh", "install_check.sh", "docs.sh"} <= names, names
    assert [path.name for path in files if _calls_git(path)] == []


def test_a_git_call_in_a_script_is_seen(tmp_path):
    script, program = tmp_path / "s.sh", tmp_path / "p.py"
    script.write_text("# git is not needed here\nset -e\nv=$(git describe)\n")
    program.write_text('import subprocess\nsubprocess.run(["git", "ls-files"])\n')
    assert _calls_git(script) and _calls_git(program)
    script.write_text("# git archive HEAD\necho digit gitter  # then git\n")
    program.write_text("# git\nprint('a git repository')\n")
    assert not _calls_git(script) and not _calls_git(program)
