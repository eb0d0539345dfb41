"""MkDocs hooks (mkdocs.yml ``hooks:``): the performance page's tables are generated from
``benchmark/results/*.json`` at every build, so the page shows each results file as it is."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Where a page wants the tables of every benchmark result.
TABLES_MARKER = "<!-- benchmark-tables -->"


def benchmark_plots() -> ModuleType:
    """benchmark/plots.py, which writes the same tables into benchmark/README.md."""
    spec = importlib.util.spec_from_file_location(
        "benchmark_plots", ROOT / "benchmark" / "plots.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def benchmark_tables() -> str:
    plots = benchmark_plots()
    return plots.results_section(plots.result_names())


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if TABLES_MARKER not in markdown:
        return markdown
    return markdown.replace(TABLES_MARKER, benchmark_tables())
