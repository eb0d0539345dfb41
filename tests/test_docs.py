"""Every ```python block of the docs runs (docs cannot rot).

The pages: README.md, DEVELOPING.md and every docs/*.md, found by globbing, so a new page is
picked up without editing this file. Each block is a complete program, run on its own in a
fresh namespace with ``__name__ == "__main__"`` (a block that leans on a name another block
defined fails), except on a page that says ``<!-- docs-test: one-program -->``: there the
blocks are one program, run in order in one namespace (the getting-started tutorial).
Blocks tagged ``notebook`` run as Jupyter runs cells: each compiled with top-level
``await`` and awaited on one running event loop (what IPython's kernel does).

An HTML comment just before a block (invisible in the built site) tags it:

    <!-- docs-test: slow mlx -->
    ```python

| tag | meaning |
|---|---|
| ``slow`` | loads the real default model (pytest ``slow``) |
| ``mlx`` | needs mlx-lm (pytest ``mlx``; skipped without it) |
| ``vllm`` | runs in the vLLM venv, as a script in its own process, by tests/test_vllm_docs.py |
| ``sglang`` | needs sglang; runs as a script in its own process |
| ``gpu`` | needs CUDA (pytest ``gpu``; skipped without it) |
| ``notebook`` | a notebook cell: top-level ``await``, run inside a running event loop |
| ``gpus=N`` | needs N CUDA devices (implies ``gpu``) |
| ``workers=N`` | starts N vLLM workers: needs N CUDA devices where CUDA is present, else N cores |

A traceback from a block names the markdown file and its line. This module imports nothing
beyond the standard library and pytest at the top: tests/test_vllm_docs.py imports it from
the vLLM venv.
"""

from __future__ import annotations

import ast
import asyncio
import gc
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from io import StringIO
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

BLOCK_TAGS = {"slow", "mlx", "vllm", "sglang", "gpu", "notebook"}
PAGE_TAGS = {"one-program"}
GPUS_TAG = re.compile(r"gpus=(\d+)$")
WORKERS_TAG = re.compile(r"workers=(\d+)$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<tags>.*?)-->\s*$")
FENCE_OPEN = re.compile(r"^(?P<indent>\s*)```(?P<info>[^`]*)$")
FENCE_CLOSE = re.compile(r"^\s*```\s*$")
SCRIPT_TIMEOUT_S = 600


def pages(root: Path = ROOT) -> list[Path]:
    """The pages whose blocks run: README.md, DEVELOPING.md and every docs/*.md."""
    return [root / "README.md", root / "DEVELOPING.md", *sorted((root / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    """One ```python block: its dedented source, the 1-based line of its first source line
    in the page, and the tags of the docs-test comment just before it."""

    path: Path
    number: int
    line: int
    source: str
    tags: frozenset[str]


def parse(path: Path, markdown: str | None = None) -> tuple[list[Block], frozenset[str]]:
    """The ```python blocks of a page, in order, and the page's own tags."""
    lines = (path.read_text() if markdown is None else markdown).splitlines()
    blocks: list[Block] = []
    page_tags: set[str] = set()
    pending: set[str] = set()
    index = 0
    while index < len(lines):
        line = lines[index]
        marker = MARKER.match(line)
        fence = FENCE_OPEN.match(line)
        if marker:
            tags = set(marker["tags"].split())
            page_tags |= tags & PAGE_TAGS
            pending = tags - PAGE_TAGS
        elif fence:
            body_start = index + 1
            index = body_start
            while index < len(lines) and not FENCE_CLOSE.match(lines[index]):
                index += 1
            if fence["info"].split()[:1] == ["python"]:
                indent = fence["indent"]
                body = [text.removeprefix(indent) for text in lines[body_start:index]]
                source = "\n".join(body) + "\n"
                blocks.append(
                    Block(path, len(blocks) + 1, body_start + 1, source, frozenset(pending))
                )
            pending = set()
        elif line.strip():
            pending = set()
        index += 1
    return blocks, frozenset(page_tags)


def python_blocks(markdown: str) -> list[str]:
    """The bodies of the ```python fenced blocks of ``markdown``, in order."""
    return [block.source for block in parse(Path("page.md"), markdown)[0]]


@dataclass(frozen=True)
class Program:
    """What runs as one program: one block, or every block of a one-program page."""

    blocks: tuple[Block, ...]

    @property
    def path(self) -> Path:
        return self.blocks[0].path

    @property
    def tags(self) -> frozenset[str]:
        return frozenset().union(*(block.tags for block in self.blocks))

    @property
    def id(self) -> str:
        page = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name
        if len(self.blocks) == 1:
            return f"{page}:{self.blocks[0].line}"
        return f"{page}:all"

    def source(self) -> str:
        """The program as one file: each block at its own line of the page (so lint and
        tracebacks point at the page's lines)."""
        text = ""
        for block in self.blocks:
            text += "\n" * (block.line - 1 - text.count("\n")) + block.source
        return text

    def gpus(self) -> int:
        return max(self._counts(GPUS_TAG), default=1 if "gpu" in self.tags else 0)

    def workers(self) -> int:
        return max(self._counts(WORKERS_TAG), default=0)

    def _counts(self, tag: re.Pattern[str]) -> list[int]:
        """The N of each ``name=N`` tag that ``tag`` matches."""
        return [int(m[1]) for t in self.tags if (m := tag.match(t))]

    def marks(self) -> list[pytest.MarkDecorator]:
        marks = [getattr(pytest.mark, tag) for tag in ("slow", "mlx", "vllm") if tag in self.tags]
        return marks + ([pytest.mark.gpu] if self.gpus() else [])


def programs(path: Path, markdown: str | None = None) -> list[Program]:
    blocks, page_tags = parse(path, markdown)
    if "one-program" in page_tags:
        return [Program(tuple(blocks))] if blocks else []
    return [Program((block,)) for block in blocks]


def all_programs(root: Path = ROOT) -> list[Program]:
    return [program for page in pages(root) for program in programs(page)]


def params(selected: list[Program]) -> list:
    return [pytest.param(program, id=program.id, marks=program.marks()) for program in selected]


def skip_unless_runnable(program: Program) -> None:
    """Skip, saying why, a program whose package or devices are not here."""
    needs = ["mlx_lm"] * ("mlx" in program.tags) + ["sglang"] * ("sglang" in program.tags)
    needs += ["vllm"] * ("vllm" in program.tags)
    for package in needs:
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{program.id} needs {package}, which is not installed here")
    if gpus := program.gpus():
        import torch

        if torch.cuda.device_count() < gpus:
            pytest.skip(
                f"{program.id} needs {gpus} CUDA device(s); {torch.cuda.device_count()} here"
            )
    if workers := program.workers():
        import torch

        cuda = torch.cuda.is_available()
        devices = torch.cuda.device_count() if cuda else os.cpu_count() or 1
        if devices < workers:
            kind = "CUDA devices" if cuda else "cores"
            pytest.skip(
                f"{program.id} runs {workers} vLLM workers, one each; {devices} {kind} here"
            )


def run_in_process(program: Program) -> dict:
    """Run the program in a fresh namespace, as ``__main__``; return the namespace."""
    namespace: dict = {"__name__": "__main__"}
    exec(compile(program.source(), str(program.path), "exec"), namespace)
    return namespace


def run_in_notebook(program: Program) -> dict:
    """Run the program's blocks as notebook cells, in order, in one namespace: each compiled
    with top-level ``await`` allowed and awaited on one running event loop, as IPython's
    kernel runs cells (so ``asyncio.run`` inside one fails, as it does in Jupyter)."""
    namespace: dict = {"__name__": "__main__"}

    async def cells() -> None:
        for block in program.blocks:
            source = "\n" * (block.line - 1) + block.source
            flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
            result = eval(compile(source, str(block.path), "exec", flags=flags), namespace)
            if inspect.iscoroutine(result):
                await result

    asyncio.run(cells())
    return namespace


def run_script(program: Program, tmp_path: Path, env: dict[str, str] | None = None) -> str:
    """Run the program as a script in its own process (vLLM and SGLang start their engines in
    subprocesses); fail with its output unless it exits with 0. Returns its output."""
    script = tmp_path / f"{program.path.stem}_{program.blocks[0].line}.py"
    script.write_text(program.source())
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    run_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run_env.update({**(env or {}), "PYTHONPATH": pythonpath})
    try:
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=run_env,
            capture_output=True,
            text=True,
            timeout=SCRIPT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{program.id} ran past {SCRIPT_TIMEOUT_S} s:\n{error.stdout}\n{error.stderr}")
    output = done.stdout + done.stderr
    if done.returncode != 0:
        pytest.fail(f"{program.id} exited with {done.returncode}:\n{output[-6000:]}", pytrace=False)
    return output


def run(program: Program, tmp_path: Path) -> None:
    skip_unless_runnable(program)
    if "sglang" in program.tags:
        run_script(program, tmp_path)
        return
    namespace = run_in_notebook(program) if "notebook" in program.tags else run_in_process(program)
    # Free what the program left open (an LM it did not close) before the next one runs.
    base = sys.modules.get("genlm.backend.llm.base")
    for value in namespace.values():
        if base is not None and isinstance(value, base.AsyncLM):
            value.close()
    namespace.clear()
    gc.collect()


MAIN = [program for program in all_programs() if "vllm" not in program.tags]


@pytest.mark.parametrize("program", params(MAIN))
def test_docs_block_runs(program, tmp_path):
    """Each block of README.md, DEVELOPING.md and docs/*.md outside the vLLM venv's runs."""
    run(program, tmp_path)


# -- the collector itself ------------------------------------------------------------------------


def test_every_page_is_collected():
    found = {path.name for path in pages()}
    assert {"README.md", "DEVELOPING.md", "index.md", "getting-started.md", "tries.md"} <= found
    assert found >= {path.name for path in DOCS.glob("*.md")}
    counts = {path.name: len(parse(path)[0]) for path in pages()}
    assert counts["getting-started.md"] >= 8 and counts["backends.md"] >= 4
    assert counts["DEVELOPING.md"] >= 1  # the MyLM skeleton, indented in a list item


def test_snippet_included_blocks_are_collected():
    """A page that includes another file (pymdownx.snippets) shows its blocks: that file must
    itself be a collected page, or its blocks must not be python."""
    collected = {path.resolve() for path in pages()}
    for page in DOCS.glob("*.md"):
        for included in re.findall(r'^--8<-- "([^":]+)', page.read_text(), re.MULTILINE):
            target = (ROOT / included).resolve()
            assert target in collected or not parse(target)[0], f"{page.name} includes {included}"


def test_tags_are_known():
    for program in all_programs():
        for tag in program.tags:
            known = tag in BLOCK_TAGS or GPUS_TAG.match(tag) or WORKERS_TAG.match(tag)
            assert known, f"{program.id}: unknown tag {tag!r}"


def test_blocks_that_load_the_default_model_are_slow():
    """`-m "not slow"` skips every block that loads a real model."""
    for program in all_programs():
        if "default_model_path" in program.source():
            assert program.tags & {"slow", "vllm", "sglang"}, f"{program.id} is not tagged slow"


def test_no_block_loads_a_hub_id():
    """Docs run offline: a hub id ("org/name") may appear in a comment, never in the code."""
    hub_id = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
    for program in all_programs():
        for token in tokenize.generate_tokens(StringIO(program.source()).readline):
            if token.type == tokenize.STRING:
                text = token.string.strip("'\"")
                assert not hub_id.match(text), f"{program.id}, line {token.start[0]}: {text}"


def test_every_program_passes_pyflakes():
    """Undefined names, unused imports and syntax errors fail here, also in the blocks that
    cannot run on this machine (GPU, SGLang, vLLM outside its venv)."""
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed in this venv")
    failures = []
    for program in all_programs():
        # Top-level await is what a notebook cell is for.
        ignore = ["--ignore", "F704"] if "notebook" in program.tags else []
        lint = subprocess.run(
            [str(ruff), "check", "--isolated", "--no-cache", "--select", "F,E9", "--quiet"]
            + ignore
            + ["--output-format", "concise", "--stdin-filename", f"{program.id}.py", "-"],
            input=program.source(),
            capture_output=True,
            text=True,
        )
        if lint.returncode != 0:
            failures.append(f"{program.id}:\n{lint.stdout}{lint.stderr}")
    assert not failures, "\n".join(failures)


def test_python_blocks_are_found_in_order():
    markdown = "text\n```python\na = 1\n```\n```bash\nmake\n```\n\n```python\nb = a\n```\n"
    assert python_blocks(markdown) == ["a = 1\n", "b = a\n"]


def test_tags_indented_blocks_and_titles_are_read():
    markdown = (
        "<!-- docs-test: slow gpus=2 -->\n\n"
        '```python title="x.py"\nx = 1\n```\n'
        "text between\n```python\ny = 2\n```\n"
        "1. a list item:\n\n    <!-- docs-test: mlx -->\n    ```python\n    class A:\n        z = 3\n    ```\n"
    )
    blocks, page_tags = parse(Path("page.md"), markdown)
    assert [b.source for b in blocks] == ["x = 1\n", "y = 2\n", "class A:\n    z = 3\n"]
    assert [set(b.tags) for b in blocks] == [{"slow", "gpus=2"}, set(), {"mlx"}]
    assert [b.line for b in blocks] == [4, 8, 14] and not page_tags
    assert Program((blocks[0],)).gpus() == 2


def test_a_block_with_more_workers_than_devices_is_skipped_saying_why():
    (block,), _ = parse(
        Path("page.md"), "<!-- docs-test: workers=4096 -->\n```python\nx = 1\n```\n"
    )
    assert Program((block,)).workers() == 4096
    with pytest.raises(pytest.skip.Exception, match="runs 4096 vLLM workers, one each; .* here"):
        skip_unless_runnable(Program((block,)))


def test_a_failing_block_fails_the_page(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\nprose\n\n```python\nassert 1 == 2\n```\n")
    first, failing = programs(page)
    run_in_process(first)
    with pytest.raises(AssertionError) as error:
        run_in_process(failing)
    assert error.traceback[-1].path == page and error.traceback[-1].lineno + 1 == 8


def test_a_block_that_uses_another_blocks_names_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n```python\nassert x == 1\n```\n")
    with pytest.raises(NameError):
        run_in_process(programs(page)[1])
    page.write_text("<!-- docs-test: one-program -->\n" + page.read_text())
    (program,) = programs(page)
    assert run_in_process(program)["x"] == 1
    page.write_text(page.read_text().replace("x == 1", "x == 2"))
    with pytest.raises(AssertionError):
        run_in_process(programs(page)[0])


def test_a_failing_script_fails_the_page(tmp_path):
    """The runner of the vLLM and SGLang blocks: a script's failure fails its test."""
    page = tmp_path / "page.md"
    page.write_text(
        '<!-- docs-test: sglang -->\n```python\nraise SystemExit("planted failure")\n```\n'
    )
    (program,) = programs(page)
    with pytest.raises(pytest.fail.Exception, match="planted failure"):
        run_script(program, tmp_path)
    page.write_text('```python\nimport genlm.backend\nprint("ran", __name__)\n```\n')
    assert "ran __main__" in run_script(programs(page)[0], tmp_path)


def test_the_docs_check_fails_on_a_broken_reference(tmp_path):
    """`scripts/docs.sh` (the docs step of `make test`) on a copy of the docs with one
    planted cross-reference to nothing: the build must fail and name it."""
    import shutil

    parts = ("mkdocs.yml", "docs", "genlm", "DEVELOPING.md", "benchmark", "scripts")
    for part in parts:
        source, target = ROOT / part, tmp_path / part
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if source.is_dir() else shutil.copy)(source, target)
    page = tmp_path / "docs" / "index.md"
    page.write_text(page.read_text() + "\nSee [a page][no-such-target].\n")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    build = subprocess.run(
        ["bash", "scripts/docs.sh"],
        cwd=tmp_path,
        env={**os.environ, "MKDOCS": str(mkdocs)},
        capture_output=True,
        text=True,
    )
    assert build.returncode != 0
    assert "no-such-target" in build.stderr + build.stdout


def mkdocs_build(cwd: Path, site: Path) -> subprocess.CompletedProcess:
    """A strict build of this repository's docs, run from ``cwd``."""
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed in this venv")
    return subprocess.run(
        [str(mkdocs), "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=cwd,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
    )


def test_the_docs_build_from_another_directory(tmp_path):
    """Snippets (the developer guide includes DEVELOPING.md) resolve from mkdocs.yml's
    directory, not the working directory; the performance tables come with them."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    build = mkdocs_build(elsewhere, tmp_path / "site")
    assert build.returncode == 0, build.stderr
    developing = (tmp_path / "site" / "developing" / "index.html").read_text()
    assert "Developing" in developing or "developing" in developing
    performance = (tmp_path / "site" / "performance" / "index.html").read_text()
    for result in sorted((ROOT / "benchmark" / "results").glob("*.json")):
        assert result.name in performance, result.name


def _benchmark_hook():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def _shown(value) -> list[str]:
    """The ways a table may print a JSON value (3 significant digits for floats)."""
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return [str(value).replace("|", "\\|")] if value is not None else [""]
    return [f"{value:.3g}", f"{value:.0f}"]


def test_the_performance_page_shows_every_row_of_every_results_file():
    """The page's tables are made from benchmark/results/*.json at build time: each file has
    a section, and each row's numbers are in that section (read from the JSON here)."""
    import json

    performance = (DOCS / "performance.md").read_text()
    hooks = _benchmark_hook()
    assert hooks.TABLES_MARKER in performance
    page = hooks.on_page_markdown(performance)
    sections = page.split("### `")[1:]
    results = sorted((ROOT / "benchmark" / "results").glob("*.json"))
    assert [section.split(".json`", 1)[0] for section in sections] == [r.stem for r in results]
    for result, section in zip(results, sections, strict=True):
        header, _, *table = [line for line in section.splitlines() if line.startswith("|")]
        columns = [cell.strip() for cell in header.strip("|").split("|")]
        rows = json.loads(result.read_text())["rows"]
        assert len(table) == len(rows), result.name
        for line, row in zip(table, rows, strict=True):
            cells = [cell.strip() for cell in line.strip("|").split(" | ")]
            for column, cell in zip(columns, cells, strict=True):
                assert cell in _shown(row.get(column)), (result.name, column, line)


def test_benchmark_readme_tables_are_those_of_the_results():
    """benchmark/README.md carries the same tables (plots.py --readme writes them)."""
    hooks = _benchmark_hook()
    readme = (ROOT / "benchmark" / "README.md").read_text()
    assert hooks.benchmark_tables() in readme, "run: .venv/bin/python benchmark/plots.py --readme"


def test_notebook_cells_run_with_top_level_await_inside_a_running_loop(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs-test: one-program -->\n"
        "<!-- docs-test: notebook -->\n```python\nimport asyncio\n"
        "x = await asyncio.sleep(0, result=41)\n```\n"
        "<!-- docs-test: notebook -->\n```python\ny = x + 1\n```\n"
    )
    (program,) = programs(page)
    assert "notebook" in program.tags
    assert run_in_notebook(program)["y"] == 42
    page.write_text(
        "<!-- docs-test: notebook -->\n```python\nimport asyncio\n\n\n"
        "async def main():\n    return 1\n\n\ncoroutine = main()\ntry:\n"
        "    asyncio.run(coroutine)\nfinally:\n    coroutine.close()\n```\n"
    )
    with pytest.raises(RuntimeError, match="running event loop"):
        run_in_notebook(programs(page)[0])


# Commands that only this repository's venv provides: a page runs them through `.venv/bin/`
# (or `.venv-vllm/bin/`), or after `source .venv/bin/activate` in the same block.
VENV_COMMANDS = {"python", "python3", "pytest", "mkdocs", "genlm-backend", "ruff", "mypy"}
SHELL_FENCE = re.compile(r"^\s*```(?:bash|sh|shell|console)\s*$")


def shell_commands(markdown: str) -> list[tuple[int, str]]:
    """(line number, command) of each command line in the page's shell blocks; a command's
    leading VAR=value assignments are dropped, comments and continuation lines too."""
    commands, lines, index = [], markdown.splitlines(), 0
    while index < len(lines):
        if SHELL_FENCE.match(lines[index]):
            index += 1
            while index < len(lines) and not FENCE_CLOSE.match(lines[index]):
                words = lines[index].split("#", 1)[0].split()
                while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                    words.pop(0)
                if words and words[0] != "export":
                    commands.append((index + 1, " ".join(words)))
                index += 1
        index += 1
    return commands


def bare_venv_commands(markdown: str) -> list[str]:
    """The commands that name a venv-only program without its venv path."""
    found, activated = [], False
    for line, command in shell_commands(markdown):
        program = command.split()[0]
        activated = activated or command.startswith("source .venv")
        if program in VENV_COMMANDS and not activated and command.split()[1:3] != ["-m", "venv"]:
            found.append(f"line {line}: {command}")
    return found


def test_shell_commands_name_the_venv_they_run_in():
    """Every command in the docs runs as written from a fresh clone after the set-up: the
    ones only the venv has go through `.venv/bin/` (a bare `python -m genlm.backend` fails
    with "No module named 'genlm'" unless .venv is activated)."""
    failures = [
        f"{page.name} {found}" for page in pages() for found in bare_venv_commands(page.read_text())
    ]
    assert not failures, "\n".join(failures)


def test_the_venv_command_check_finds_bare_commands():
    page = (
        "```bash\npython -m genlm.backend sis\n.venv/bin/pytest -q\nHF_HUB_OFFLINE=1 pytest x\n"
        "python -m venv .v\n```\n```bash\nsource .venv/bin/activate\nmkdocs build\n```\n"
    )
    assert bare_venv_commands(page) == ["line 2: python -m genlm.backend sis", "line 4: pytest x"]


USER_PAGES = [
    ROOT / "README.md",
    *(p for p in sorted(DOCS.glob("*.md")) if p.name != "developing.md"),
]


def test_user_pages_hold_no_commit_hashes_or_issue_numbers():
    """History (commits, issues, what was measured when) lives in DEVELOPING.md."""
    history = re.compile(
        r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b|\bissues? #?\d+", re.I
    )
    for page in USER_PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            assert not history.search(line), f"{page.name}:{number}: {line}"
