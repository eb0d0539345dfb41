"""benchmark/plots.py: result JSON -> plots and Markdown tables."""

import json

import plots
import pytest

RESULT = {
    "setup": {"model": "tiny", "threads": 1, "nested": {"skipped": True}},
    "rows": [
        {"n": 1, "tokens_per_s": 10.0, "impl": "lib"},
        {"n": 8, "tokens_per_s": 60.0, "impl": "lib"},
        {"n": 1, "tokens_per_s": 12.0, "impl": "floor"},
        {"n": 8, "tokens_per_s": None, "impl": "floor"},
    ],
    "plots": [{"x": "n", "y": "tokens_per_s", "series": "impl", "logx": True, "file": "x.png"}],
}


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "IMAGES_DIR", tmp_path / "images")
    (tmp_path / "demo.json").write_text(json.dumps(RESULT))
    return tmp_path


def test_plot_results_draws_each_declared_plot(results_dir):
    (path,) = plots.plot_results("demo", results_dir)
    assert path == results_dir / "images" / "x.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_results_into_another_images_dir(results_dir, tmp_path):
    (path,) = plots.plot_results("demo", results_dir, tmp_path / "dry")
    assert path == tmp_path / "dry" / "x.png" and path.is_file()
    assert not (results_dir / "images").exists()


def test_line_plot_without_matching_rows_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no rows"):
        plots.line_plot(RESULT["rows"], "n", "missing", tmp_path / "y.png")


def test_markdown_table_lists_rows_and_setup(results_dir):
    table = plots.markdown_table("demo", results_dir).splitlines()
    assert table[0] == "Set-up: model: tiny, threads: 1."
    assert table[2] == "| n | tokens_per_s | impl |"
    assert table[4] == "| 1 | 10 | lib |"
    assert table[7] == "| 8 |  | floor |"


def test_trie_results_become_distributions_per_second():
    result = {
        "vocab_sizes": {"small": 100},
        "batch": 4,
        "concurrent": 8,
        "rows": [
            {"vocab": "small", "trie": "sequential", "figure": "weight_sum", "min_ms": 2.0},
            {"vocab": "small", "trie": "sequential", "figure": "build", "min_ms": 50.0},
            {"vocab": "small", "trie": "parallel", "figure": "async 8 x weight_sum", "min_ms": 4.0},
        ],
    }
    rows, (spec,) = plots.trie_plots(result)
    assert [(r["call"], r["distributions_per_s"]) for r in rows] == [
        ("sequential: weight_sum", 500.0),
        ("parallel: 8 concurrent async weight_sum", 2000.0),
    ]
    assert spec["x"] == "vocab_size" and rows[0]["vocab_size"] == 100


def test_update_readme_replaces_only_the_results_section(results_dir):
    readme = results_dir / "README.md"
    readme.write_text(f"intro\n{plots.README_START}\nold\n{plots.README_END}\nend\n")
    plots.update_readme(["demo"], readme, results_dir)
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{plots.README_END}\nend\n")
    assert "old" not in text and "### `demo.json`" in text
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="no"):
        plots.update_readme(["demo"], readme, results_dir)
