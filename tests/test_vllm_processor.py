"""The engine's half of the capture (`genlm.backend.llm.vllm.processor`) under both of vLLM's
model runners, with vLLM's own loaders, validators and base classes, without an engine.

vLLM's CPU build runs the V1 runner only (Model Runner V2 needs a Triton with a CPU
backend), so V2's hooks are driven here as its model runner and sampler drive them
(`V2Runner`), and every row written is compared with the logits the test gave, row by row.
The V1 runner is driven through a real engine in tests/test_vllm.py. Runs in the vLLM
environment: ``.venv-vllm/bin/pytest -m vllm tests/test_vllm_processor.py``.
"""

import importlib
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from genlm.backend.llm.vllm import CAPTURE_KEY, CAPTURE_PROCESSOR, AsyncVirtualLM  # noqa: E402
from genlm.backend.llm.vllm.runners import check_logits_processors  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    # vLLM's own modules use a torch.jit API that torch 2.13 deprecated
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

OLD_NAMES = [
    "genlm.backend.llm.vllm.capture:FullLogitsCapture",
    "genlm.backend.llm.vllm_capture:FullLogitsCapture",
]


def load_v1(names):
    from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns

    return _load_logitsprocs_by_fqcns(names)


def load_v2(names):
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_by_fqcns

    return _load_v2_logitsprocs_by_fqcns(names)


def test_both_runners_loaders_take_the_processor_by_its_name_and_its_old_names():
    """vLLM's V1 loader and Model Runner V2's (the CUDA builds' default) each check that a
    processor subclasses their own base class: both take the one class, by every name."""
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as LogitsProcessorV2

    names = [CAPTURE_PROCESSOR, *OLD_NAMES]
    v1, v2 = load_v1(names), load_v2(names)
    assert len({*v1, *v2}) == 1
    (processor,) = set(v1)
    assert issubclass(processor, LogitsProcessor) and issubclass(processor, LogitsProcessorV2)
    assert CAPTURE_PROCESSOR == f"{processor.__module__}:{processor.__qualname__}"
    assert CAPTURE_PROCESSOR.startswith("genlm.backend.llm.vllm.processor:")
    for name in OLD_NAMES:
        module, qualname = name.split(":")
        assert getattr(importlib.import_module(module), qualname) is processor


def capture_params(target=None, **kwargs):
    """A request's parameters as the LM sends them (greedy, one token), asking for its row
    at ``target`` = (path, row, width), or for nothing."""
    extra = None if target is None else {CAPTURE_KEY: target}
    return SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra, **kwargs)


def test_both_runners_validators_check_the_capture_target():
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters
    from vllm.v1.worker.gpu.sample.logits_processor import (
        build_custom_logits_processors_params_validator,
    )

    validators = [
        lambda params: validate_logits_processors_parameters([CAPTURE_PROCESSOR], params),
        build_custom_logits_processors_params_validator([CAPTURE_PROCESSOR]),
    ]
    for validate in validators:
        validate(capture_params(("/dev/shm/rows", 0, 8)))
        validate(capture_params())
        with pytest.raises(VLLMValidationError, match=r"must be \(path, row, width\)"):
            validate(capture_params("rows"))


@pytest.mark.parametrize(
    "name", ["genlm.backend.llm.vllm.processor", "genlm.backend.llm.vllm_capture"]
)
def test_the_engine_side_processor_imports_nothing_of_the_client(name):
    """vLLM's processes import the processor's module: it brings in no LM, base class,
    batcher or the caller's half of the capture (nor their imports)."""
    client = [
        "genlm.backend.llm.base",
        "genlm.backend.llm.vllm.lm",
        "genlm.backend.llm.vllm.capture",
        "genlm.backend.batching",
    ]
    code = (
        "import importlib, sys\n"
        f"processor = importlib.import_module({name!r}).FullLogitsCapture\n"
        "print(processor.__name__, 'vllm' in sys.modules, "
        f"[m for m in {client!r} if m in sys.modules])\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[-2] == "FullLogitsCapture True []"


# Model Runner V2, driven.


def new_v2_processor(vocab_size, max_num_reqs):
    """The processor as Model Runner V2 makes it: vLLM's own `build_custom_logits_processors`
    (its loader, then the constructor with V2's arguments)."""
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors

    zeros = torch.zeros(max_num_reqs, dtype=torch.int32)
    req_states = SimpleNamespace(
        device=torch.device("cpu"),
        max_num_reqs=max_num_reqs,
        vocab_size=vocab_size,
        all_token_ids=None,
        prompt_len=zeros,
        prefill_len=zeros,
        total_len=zeros,
    )
    (processor,) = build_custom_logits_processors(
        SimpleNamespace(), req_states, False, [CAPTURE_PROCESSOR]
    )
    return processor


class V2Runner:
    """Drives a processor as vLLM's Model Runner V2 and its sampler do (vLLM 0.32/0.33,
    vllm/v1/worker/gpu/: model_runner.py ``add_requests`` and ``finish_requests``,
    states.py's slot free list, sample/sampler.py ``add_request`` and
    ``apply_sampling_params``):

    - a request takes the slot last freed (``free_indices.pop()``), and the sampler calls
      ``add_request(slot, params)``; a streaming-input chunk of a live request (every step of
      a session) removes the request and adds it again, with the chunk's parameters;
    - a finished request's slot goes back to the free list; processors are not told;
    - each step calls ``apply_staged_writes()``, then, if any scheduled request's
      ``add_request`` returned True, ``apply(logits, ctx)`` once for the batch, whose row
      ``i`` belongs to slot ``ctx.idx_mapping_np[i]``.
    """

    def __init__(self, processor, max_num_reqs):
        self.processor = processor
        self.free = list(range(max_num_reqs))
        self.slots = {}  # request id -> slot
        self.needs_processing = np.zeros(max_num_reqs, dtype=bool)

    def add(self, request_id, params):
        """A new request, or a live one's next streaming chunk: what the processor's
        ``add_request`` answered (whether it processes the request's logits)."""
        self.finish(request_id)
        slot = self.slots[request_id] = self.free.pop()
        self.needs_processing[slot] = self.processor.add_request(slot, params)
        return self.needs_processing[slot]

    def finish(self, request_id):
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)

    def warm_up(self, num_reqs):
        """The sampler's warm-up pass (model_runner.py ``_dummy_sampler_run``): slots
        0..n-1 get the warm-up parameters, and a dummy batch of those slots is sampled."""
        params = SamplingParams.for_sampler_warmup()
        for slot in range(num_reqs):
            self.needs_processing[slot] = self.processor.add_request(slot, params)
        self.processor.apply_staged_writes()
        slots = np.arange(num_reqs, dtype=np.int32)
        self._apply(torch.randn(num_reqs, 7), slots, slots, np.zeros(num_reqs, dtype=np.int32))

    def step(self, request_ids, logits, drafts=None):
        """Sample the scheduled requests, in this order; ``drafts`` (request id -> k) gives
        a request k + 1 rows, as under speculative decoding."""
        self.processor.apply_staged_writes()
        slots = np.array([self.slots[r] for r in request_ids], dtype=np.int32)
        rows = [1 + (drafts or {}).get(r, 0) for r in request_ids]
        row_slots = np.repeat(slots, rows)
        local_pos = np.concatenate([np.arange(n, dtype=np.int32) for n in rows])
        assert logits.shape[0] == len(row_slots)
        self._apply(logits, slots, row_slots, local_pos)

    def _apply(self, logits, slots, row_slots, local_pos):
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

        if not self.needs_processing[slots].any():
            return
        before = logits.clone()
        ctx = LogitsContext(
            expanded_idx_mapping=torch.from_numpy(row_slots.astype(np.int64)),
            idx_mapping=torch.from_numpy(slots.astype(np.int64)),
            idx_mapping_np=slots,
            expanded_local_pos=torch.from_numpy(local_pos),
            input_ids=torch.zeros(len(row_slots), dtype=torch.int64),
            pos=torch.zeros(len(row_slots), dtype=torch.int64),
            seq_lens_upper_bound_np=np.ones(len(slots), dtype=np.int32),
        )
        assert torch.equal(self.processor.apply(logits, ctx), before)  # logits left alone


class CaptureFiles:
    """Capture files as the caller makes them: float32 rows of a width, NaN until written."""

    def __init__(self, directory, widths):
        self.paths = [str(directory / f"rows{i}.f32") for i in range(len(widths))]
        self.widths = widths
        self.reset()

    def reset(self):
        for path, width in zip(self.paths, self.widths, strict=True):
            np.full((4, width), np.nan, dtype=np.float32).tofile(path)

    def target(self, file, row):
        return (self.paths[file], row, self.widths[file])

    def rows(self):
        return [
            np.fromfile(path, dtype=np.float32).reshape(4, width)
            for path, width in zip(self.paths, self.widths, strict=True)
        ]

    def assert_written(self, expected):
        """``expected``: {(file, row): logits row}; each is cut or padded with -inf to the
        file's width, every other row is still NaN."""
        for file, rows in enumerate(self.rows()):
            for row in range(rows.shape[0]):
                values = expected.get((file, row))
                if values is None:
                    assert np.isnan(rows[row]).all(), f"file {file} row {row} written"
                    continue
                width = rows.shape[1]
                want = np.full(width, -np.inf, dtype=np.float32)
                n = min(width, len(values))
                want[:n] = values[:n].numpy()
                np.testing.assert_array_equal(rows[row], want, err_msg=f"file {file} row {row}")
        self.reset()


VOCAB = 7  # logits rows of 7; files of width 5 (rows cut) and 9 (padded with -inf)


def test_v2_hooks_driven_as_model_runner_v2_drives_them_write_exactly_the_right_rows(tmp_path):
    files = CaptureFiles(tmp_path, widths=[5, 9])
    runner = V2Runner(new_v2_processor(VOCAB, max_num_reqs=6), max_num_reqs=6)

    # The sampler's warm-up pass: no request names a file, nothing is written.
    runner.warm_up(6)
    files.assert_written({})

    # Step 1: a, c and d ask for rows (d greedy, like every query of the LM; the others
    # sampled), b is another caller's request (no target), in the scheduler's order.
    assert runner.add("a", capture_params(files.target(0, 0)))
    assert not runner.add("b", SamplingParams(max_tokens=4))
    assert runner.add("c", capture_params(files.target(1, 3), seed=1))
    assert runner.add("d", capture_params(files.target(0, 2)))
    logits = torch.randn(4, VOCAB)
    runner.step(["c", "a", "d", "b"], logits)
    files.assert_written({(1, 3): logits[0], (0, 0): logits[1], (0, 2): logits[2]})

    # Step 2: a and c continue their sessions with a new chunk each, now asking for other
    # rows (c in the other file); d ended and e takes its slot; b runs on untouched.
    d_slot = runner.slots["d"]
    runner.finish("d")
    runner.add("a", capture_params(files.target(1, 0)))
    runner.add("c", capture_params(files.target(0, 1)))
    assert runner.add("e", capture_params(files.target(0, 3)))
    assert runner.slots["e"] == d_slot
    logits = torch.randn(4, VOCAB)
    runner.step(["b", "e", "a", "c"], logits)
    files.assert_written({(0, 3): logits[1], (1, 0): logits[2], (0, 1): logits[3]})

    # Step 3: e's next chunk asks for nothing; a ended and f, without a target, takes its
    # slot, which held a's target; c goes on alone among requests without targets.
    runner.add("e", SamplingParams(max_tokens=1))
    a_slot = runner.slots["a"]
    runner.finish("a")
    assert not runner.add("f", SamplingParams(max_tokens=2))
    assert runner.slots["f"] == a_slot
    logits = torch.randn(4, VOCAB)
    runner.step(["f", "c", "e", "b"], logits)
    files.assert_written({(0, 1): logits[1]})

    # Step 4: no request in the batch asked: V2 skips the processors altogether.
    runner.finish("c")
    runner.step(["f", "e", "b"], torch.randn(3, VOCAB))
    files.assert_written({})

    # Step 5, speculative decoding: b has 2 draft rows and g 1; g's own row is its first
    # (local position 0), the next token's distribution after its committed context.
    runner.add("g", capture_params(files.target(1, 2)))
    logits = torch.randn(6, VOCAB)
    runner.step(["b", "g", "f"], logits, drafts={"b": 2, "g": 1})
    files.assert_written({(1, 2): logits[3]})


def test_both_runners_write_the_same_rows_for_the_same_requests(tmp_path):
    """One step of the same requests under the V1 runner (persistent-batch indices from
    ``BatchUpdate``) and under V2 (slots, rows in another order) writes the same rows."""
    from vllm.v1.sample.logits_processor import BatchUpdate

    files = CaptureFiles(tmp_path, widths=[5, 9])
    targets = {"a": files.target(1, 1), "b": None, "c": files.target(0, 0)}
    logits = {name: torch.randn(VOCAB) for name in targets}
    expected = {(1, 1): logits["a"], (0, 0): logits["c"]}

    v1 = load_v1([CAPTURE_PROCESSOR])[0](SimpleNamespace(), torch.device("cpu"), False)
    order = ["b", "c", "a"]
    added = [(i, capture_params(targets[name]), [1, 2], []) for i, name in enumerate(order)]
    v1.update_state(BatchUpdate(batch_size=3, removed=[], added=added, moved=[]))
    v1.apply(torch.stack([logits[name] for name in order]))
    files.assert_written(expected)

    runner = V2Runner(new_v2_processor(VOCAB, max_num_reqs=4), max_num_reqs=4)
    for name in targets:
        runner.add(name, capture_params(targets[name]))
    order = ["a", "b", "c"]
    runner.step(order, torch.stack([logits[name] for name in order]))
    files.assert_written(expected)


def test_a_row_the_processor_cannot_write_is_skipped_and_the_engine_serves_on(tmp_path, caplog):
    """A target whose file is gone (the caller removed it): nothing raised in the engine;
    one warning; the caller finds the row unwritten (tests/test_vllm.py)."""
    files = CaptureFiles(tmp_path, widths=[5, 9])
    runner = V2Runner(new_v2_processor(VOCAB, max_num_reqs=2), max_num_reqs=2)
    runner.add("a", capture_params((str(tmp_path / "gone.f32"), 0, 5)))
    runner.add("b", capture_params(files.target(1, 0)))
    logits = torch.randn(2, VOCAB)
    runner.step(["a", "b"], logits)
    files.assert_written({(1, 0): logits[1]})
    assert "genlm logits capture cannot write" in caplog.text


# The engine's runner checked before it starts.


def v1_only_processor():
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class V1Only(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            pass

        def apply(self, logits):
            return logits

        def is_argmax_invariant(self):
            return True

        def update_state(self, batch_update):
            pass

    return V1Only


def v2_only_processor():
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

    class V2Only(LogitsProcessor):
        def apply(self, logits, ctx):
            return logits

    return V2Only


def engine_config(v2, processors):
    return SimpleNamespace(
        use_v2_model_runner=v2, model_config=SimpleNamespace(logits_processors=processors)
    )


@pytest.mark.parametrize("v2", [False, True], ids=["V1", "V2"])
def test_the_runner_check_takes_the_capture_processor_under_both_runners(v2):
    processor = load_v1([CAPTURE_PROCESSOR])[0]
    check_logits_processors(engine_config(v2, [CAPTURE_PROCESSOR, *OLD_NAMES, processor]))
    check_logits_processors(engine_config(v2, None))


def test_the_runner_check_refuses_the_other_runners_processors():
    with pytest.raises(ValueError, match="Model Runner V2.*VLLM_USE_V2_MODEL_RUNNER=0"):
        check_logits_processors(engine_config(True, [CAPTURE_PROCESSOR, v1_only_processor()]))
    with pytest.raises(ValueError, match="V1 model runner.*VLLM_USE_V2_MODEL_RUNNER=1"):
        check_logits_processors(engine_config(False, [v2_only_processor()]))


def engine_threads():
    return {t for t in threading.enumerate() if t.name == "genlm-vllm-engine"}


def test_from_name_refuses_a_capture_the_engines_runner_cannot_drive_before_it_starts(
    default_model_dir,
):
    """vLLM's CPU build runs the V1 runner (its own config's decision): a capture object
    whose processor is V2's only is refused from that config, before any engine process
    or loop starts."""
    import psutil

    processor = v2_only_processor()
    capture = SimpleNamespace(
        engine_opts={"logits_processors": [processor]}, batch=None, close=None
    )
    children, threads = psutil.Process().children(recursive=True), engine_threads()
    started = time.monotonic()
    with pytest.raises(ValueError, match="cannot run on this vLLM engine's V1 model runner"):
        AsyncVirtualLM.from_name(default_model_dir, capture=capture)
    assert time.monotonic() - started < 120
    assert psutil.Process().children(recursive=True) == children
    assert engine_threads() <= threads


# The V1 runner's bookkeeping and the files, as the processor keeps them.


def test_batch_update_bookkeeping_follows_added_removed_and_moved_requests():
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from genlm.backend.llm.vllm.processor import apply_batch_update

    def added(index, row):
        return (index, capture_params(None if row is None else ("rows.f32", row, 4)), [1, 2], [])

    def update(removed=(), new=(), moved=()):
        return BatchUpdate(batch_size=4, removed=list(removed), added=list(new), moved=list(moved))

    targets = {}
    apply_batch_update(targets, update(new=[added(0, 10), added(1, None), added(2, 12)]))
    assert targets == {0: ("rows.f32", 10, 4), 2: ("rows.f32", 12, 4)}
    apply_batch_update(targets, None)
    assert set(targets) == {0, 2}
    # Request 0 finishes and a new one takes its slot; the last row is condensed into slot 1.
    apply_batch_update(
        targets,
        update(
            removed=[0],
            new=[added(0, 20)],
            moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)],
        ),
    )
    assert targets == {0: ("rows.f32", 20, 4), 1: ("rows.f32", 12, 4)}
    apply_batch_update(targets, update(moved=[(0, 1, MoveDirectionality.SWAP)]))
    assert targets == {1: ("rows.f32", 20, 4), 0: ("rows.f32", 12, 4)}
    # An untagged request replacing a tagged one clears the slot.
    apply_batch_update(targets, update(new=[added(1, None)]))
    assert targets == {0: ("rows.f32", 12, 4)}


def test_write_row_pads_or_cuts_to_the_row_width(tmp_path):
    from genlm.backend.llm.vllm.processor import MappedFiles, write_row

    path = tmp_path / "rows.f32"
    np.zeros(2 * 3, dtype=np.float32).tofile(path)
    files = MappedFiles()
    write_row(files, (str(path), 1, 3), torch.tensor([1.0, 2.0]))
    write_row(files, (str(path), 0, 3), torch.tensor([4.0, 5.0, 6.0, 7.0]))
    assert list(files.maps) == [str(path)]  # mapped once, for both rows
    rows = np.fromfile(path, dtype=np.float32).reshape(2, 3)
    assert rows.tolist() == [[4.0, 5.0, 6.0], [1.0, 2.0, float("-inf")]]


def test_mapped_files_keep_a_few_unused_maps_and_drop_replaced_files(tmp_path):
    """The caller reuses its files between steps, when no request names them: their maps
    stay (the `KEEP_UNUSED` most recent), and a path that names a new file is mapped anew."""
    from genlm.backend.llm.vllm.processor import MappedFiles, write_row

    paths = [str(tmp_path / f"rows{i}.f32") for i in range(MappedFiles.KEEP_UNUSED + 2)]
    files = MappedFiles()
    for path in paths:
        np.zeros(3, dtype=np.float32).tofile(path)
        write_row(files, (path, 0, 3), torch.tensor([1.0, 2.0, 3.0]))
    files.keep_only({paths[0]})  # paths[0] in use: now the most recently used
    assert list(files.maps) == paths[-MappedFiles.KEEP_UNUSED :] + [paths[0]]
    os.unlink(paths[-1])
    np.full(3, 9.0, dtype=np.float32).tofile(paths[-1])  # a new file at the same path
    files.check({paths[-1], paths[-2]})
    assert paths[-1] not in files.maps and paths[-2] in files.maps
    write_row(files, (paths[-1], 0, 3), torch.tensor([4.0, 5.0, 6.0]))
    assert np.fromfile(paths[-1], dtype=np.float32).tolist() == [4.0, 5.0, 6.0]


def test_v2_requests_naming_a_replaced_file_map_it_anew(tmp_path):
    """Under V2 too: a file the caller removed and made anew at the same path (a request of
    the next step names it) is mapped again, so the row lands in the new file."""
    files = CaptureFiles(tmp_path, widths=[5, 9])
    runner = V2Runner(new_v2_processor(VOCAB, max_num_reqs=2), max_num_reqs=2)
    runner.add("a", capture_params(files.target(0, 0)))
    logits = torch.randn(1, VOCAB)
    runner.step(["a"], logits)
    files.assert_written({(0, 0): logits[0]})
    os.unlink(files.paths[0])
    files.reset()  # a new file at the same path
    runner.add("a", capture_params(files.target(0, 1)))
    logits = torch.randn(1, VOCAB)
    runner.step(["a"], logits)
    files.assert_written({(0, 1): logits[0]})
