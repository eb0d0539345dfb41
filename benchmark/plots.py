"""Draw the benchmark plots: `benchmark/results/<name>.json` -> `docs/images/bench-*.png`.

Every benchmark script writes its measurements as JSON, then calls
``plot_results(name)`` so the plots on the docs' performance page follow the
latest run. ``python benchmark/plots.py [name ...]`` redraws them from the stored
results (all of them without arguments) without measuring anything again.

A result file is a JSON object whose ``"rows"`` (a list of flat records, one per
measurement) are drawn as lines by each spec in its ``"plots"`` list:

    {"x": "n_particles", "y": "tokens_per_s", "series": "implementation",
     "title": "...", "xlabel": "...", "ylabel": "...", "logx": true, "logy": false,
     "file": "bench-lm-throughput.png"}

``series`` (optional) names the field that splits rows into lines; ``where``
(optional, a dict) keeps only rows whose fields equal the given values.

Results written without a ``"plots"`` list get their plots from a function in
`DERIVED_PLOTS`, which reshapes the rows first (e.g. ``trie.json``: time per call into
distributions per second, against the vocabulary size).

``python benchmark/plots.py --readme`` also rewrites the results section of
`benchmark/README.md` (included by the docs' performance page) with one Markdown table
per result: the columns listed in the result's optional ``"table"``, else those in
`TABLE_COLUMNS`, else all. ``--markdown`` only prints the tables.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCHMARK_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCHMARK_DIR / "results"
IMAGES_DIR = BENCHMARK_DIR.parent / "docs" / "images"


def line_plot(
    rows: Sequence[dict[str, Any]],
    x: str,
    y: str,
    file: str | Path,
    series: str | None = None,
    title: str = "",
    xlabel: str | None = None,
    ylabel: str | None = None,
    logx: bool = False,
    logy: bool = False,
    where: dict[str, Any] | None = None,
) -> Path:
    """Plot ``y`` against ``x`` for ``rows``, one line per value of ``series``; return the PNG path.

    A relative ``file`` is placed in `IMAGES_DIR`. Rows missing ``x`` or ``y`` (a
    configuration that was skipped) are left out.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    selected = [
        row
        for row in rows
        if row.get(x) is not None
        and row.get(y) is not None
        and all(row.get(key) == value for key, value in (where or {}).items())
    ]
    if not selected:
        raise ValueError(f"no rows with both {x!r} and {y!r} to plot for {file}")
    lines: dict[str, list[tuple[float, float]]] = {}
    for row in selected:
        label = str(row.get(series, "")) if series else y
        lines.setdefault(label, []).append((row[x], row[y]))

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for label, points in lines.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(sorted({row[x] for row in selected})))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))

    path = Path(file)
    if not path.is_absolute():
        path = IMAGES_DIR / path
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def trie_plots(result: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``trie.json``: distributions per second against the vocabulary size, per trie and call.

    Its rows hold ``min_ms`` per call (already per distribution for the batched calls);
    the async figure times ``concurrent`` awaited ``weight_sum`` calls together.
    """
    calls = {
        "weight_sum": ("weight_sum", 1),
        "batch_weight_sum": (f"batch_weight_sum (B={result.get('batch')})", 1),
        f"async {result.get('concurrent')} x weight_sum": (
            f"{result.get('concurrent')} concurrent async weight_sum",
            result.get("concurrent"),
        ),
    }
    rows = [
        {
            "vocab_size": result["vocab_sizes"][row["vocab"]],
            "call": f"{row['trie']}: {calls[row['figure']][0]}",
            "distributions_per_s": 1e3 * calls[row["figure"]][1] / row["min_ms"],
        }
        for row in result["rows"]
        if row["figure"] in calls
    ]
    spec = {
        "x": "vocab_size",
        "y": "distributions_per_s",
        "series": "call",
        "title": "Trie weight_sum throughput (CPU, 1 thread, best of repeats)",
        "xlabel": "vocabulary size (tokens)",
        "ylabel": "distributions / s",
        "logx": True,
        "logy": True,
        "file": "bench-trie-vocab.png",
    }
    return rows, [spec]


DERIVED_PLOTS = {"trie": trie_plots}


def plot_results(
    name: str, results_dir: Path = RESULTS_DIR, images_dir: Path | None = None
) -> list[Path]:
    """Draw every plot of ``results_dir/<name>.json``; return the PNG paths.

    Plots go to `IMAGES_DIR` (the docs' images) unless ``images_dir`` is given (e.g. for
    a dry run that must not replace the published plots).
    """
    result = json.loads((results_dir / f"{name}.json").read_text())
    rows, specs = result.get("rows", []), result.get("plots", [])
    if not specs and name in DERIVED_PLOTS:
        rows, specs = DERIVED_PLOTS[name](result)
    if images_dir is not None:
        specs = [{**spec, "file": Path(images_dir) / spec["file"]} for spec in specs]
    return [line_plot(rows, **spec) for spec in specs]


# Columns shown in the Markdown tables when a result does not list its own ``"table"``.
# A few steps of a slow model: the seconds themselves, beside the ratios.
SECONDS_COLUMNS = [
    "implementation",
    "n_particles",
    "tokens",
    "seconds",
    "cpu_seconds",
    "tokens_per_s",
    "ratio",
    "cpu_ratio",
]
TABLE_COLUMNS = {
    "lm": ["implementation", "n_particles", "tokens_per_s", "ratio", "cpu_ratio"],
    "lm_mlx": ["implementation", "n_particles", "tokens_per_s", "ratio", "cpu_ratio"],
    "lm_prompt1024": [
        "implementation",
        "n_particles",
        "tokens_per_s",
        "ratio_static",
        "ratio_dynamic",
        "cpu_ratio",
        "kv_held_mb",
        "kv_live_mb",
        "kv_held_over_live",
    ],
    "lm_gemma3_prompt512": SECONDS_COLUMNS,
    "lm_tiny_gemma3_prompt512": SECONDS_COLUMNS,
    "trie": ["vocab", "trie", "figure", "min_ms", "median_ms", "target_ms"],
    "tokenization": ["measurement", "min_s", "median_s", "target_s", "meets_target"],
}
README = BENCHMARK_DIR / "README.md"
README_START = "<!-- --8<-- [start:results] -->"
README_END = "<!-- --8<-- [end:results] -->"


def markdown_table(name: str, results_dir: Path = RESULTS_DIR) -> str:
    """The rows of ``results_dir/<name>.json`` as a Markdown table, under a line on its set-up."""
    result = json.loads((results_dir / f"{name}.json").read_text())
    rows = result.get("rows", [])
    columns = (
        result.get("table")
        or TABLE_COLUMNS.get(name)
        or list(dict.fromkeys(key for row in rows for key in row))
    )
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    lines += [
        "| " + " | ".join(_cell(row.get(column)) for column in columns) + " |" for row in rows
    ]
    setup = result.get("setup") or result.get("machine")
    if isinstance(setup, dict):
        described = ", ".join(
            f"{key}: {_cell(value)}"
            for key, value in setup.items()
            if value not in ("", None) and not isinstance(value, dict)
        )
        lines = [f"Set-up: {described}.", ""] + lines
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value).replace("|", "\\|")


def update_readme(
    names: Sequence[str], readme: Path = README, results_dir: Path = RESULTS_DIR
) -> None:
    """Replace the results section of `benchmark/README.md` with tables of ``names``.

    The section sits between snippet markers, so the docs' performance page includes
    the same tables.
    """
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        raise ValueError(f"{readme} has no {README_START} ... {README_END} section")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    tables = results_section(names, results_dir)
    readme.write_text(f"{head}{README_START}\n\n{tables}\n\n{README_END}{tail}")


def result_names(results_dir: Path = RESULTS_DIR) -> list[str]:
    """The name of every result file in ``results_dir``, sorted."""
    return sorted(path.stem for path in results_dir.glob("*.json"))


def results_section(names: Sequence[str], results_dir: Path = RESULTS_DIR) -> str:
    """One ``### `<name>.json` `` heading and table per result: the section of
    `benchmark/README.md`, and the tables the docs' performance page renders at build time
    (docs/hooks.py)."""
    return "\n\n".join(
        f"### `{name}.json`\n\n{markdown_table(name, results_dir)}" for name in names
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="result names (default: every results/*.json)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--markdown", action="store_true", help="print the tables, draw nothing")
    output.add_argument(
        "--readme", action="store_true", help="also rewrite the tables in benchmark/README.md"
    )
    args = parser.parse_args(argv)
    names = args.names or result_names()
    if args.markdown:
        for name in names:
            print(f"### {name}\n\n{markdown_table(name)}\n")
        return
    for name in names:
        for path in plot_results(name):
            print(f"{name}: wrote {path.relative_to(BENCHMARK_DIR.parent)}")
    if args.readme:
        update_readme(names)
        print(f"updated {README.relative_to(BENCHMARK_DIR.parent)}")


if __name__ == "__main__":
    main()
