"""The Python blocks of the docs run, in order, in one namespace per page (docs cannot rot)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def python_blocks(markdown: str) -> list[str]:
    """The bodies of the ```python fenced blocks of `markdown`, in order."""
    return PYTHON_BLOCK.findall(markdown)


def run_page(name: str) -> dict:
    """Execute the page's Python blocks in order in one namespace; return the namespace."""
    page = DOCS / name
    namespace: dict = {"__name__": page.stem.replace("-", "_")}
    for number, block in enumerate(python_blocks(page.read_text()), start=1):
        exec(compile(block, f"{name}, python block {number}", "exec"), namespace)
    return namespace


def test_python_blocks_are_found_in_order():
    markdown = "text\n```python\na = 1\n```\n```bash\nmake\n```\n\n```python\nb = a\n```\n"
    assert python_blocks(markdown) == ["a = 1\n", "b = a\n"]


def test_a_failing_block_fails_the_page(tmp_path, monkeypatch):
    (tmp_path / "page.md").write_text("```python\nx = 1\n```\n```python\nassert x == 2\n```\n")
    monkeypatch.setattr(f"{__name__}.DOCS", tmp_path)
    with pytest.raises(AssertionError):
        run_page("page.md")


def test_tries_page_runs():
    namespace = run_page("tries.md")
    assert len(python_blocks((DOCS / "tries.md").read_text())) >= 2
    assert namespace["masses"].max() == pytest.approx(1.0)  # the root holds all the weight


@pytest.mark.slow
def test_getting_started_runs(default_model_dir, capsys):
    assert len(python_blocks((DOCS / "getting-started.md").read_text())) >= 8
    run_page("getting-started.md")
    assert "P(next token starts with ' a')" in capsys.readouterr().out


@pytest.mark.slow
def test_readme_pattern_runs(default_model_dir):
    """The README's first example (32 particles on the default model) runs as printed."""
    block = python_blocks((ROOT / "README.md").read_text())[0]
    namespace: dict = {"__name__": "readme"}
    exec(compile(block, "README.md, python block 1", "exec"), namespace)
    samples, prompt = namespace["samples"], namespace["prompt_ids"]
    assert len(samples) == 32
    assert all(len(s) == len(prompt) + 10 and s[: len(prompt)] == prompt for s in samples)


def test_the_docs_check_fails_on_a_broken_reference(tmp_path):
    """`scripts/docs.sh` (the docs step of `make test`) on a copy of the docs with one
    planted cross-reference to nothing: the build must fail and name it."""
    import os
    import shutil
    import subprocess
    import sys

    parts = ("mkdocs.yml", "docs", "genlm", "DEVELOPING.md", "benchmark/README.md", "scripts")
    for part in parts:
        source, target = ROOT / part, tmp_path / part
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if source.is_dir() else shutil.copy)(source, target)
    page = tmp_path / "docs" / "index.md"
    page.write_text(page.read_text() + "\nSee [a page][no-such-target].\n")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    run = subprocess.run(
        ["bash", "scripts/docs.sh"],
        cwd=tmp_path,
        env={**os.environ, "MKDOCS": str(mkdocs)},
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0
    assert "no-such-target" in run.stderr + run.stdout
