"""`genlm.backend.llm.vllm.shm`: what a killed process leaves in shared memory is removed,
and multiprocessing's resource tracker does not warn about it at exit (no vLLM needed:
a plain child process plays the engine's worker; tests/test_vllm.py has the real engine).
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("psutil")
if not os.path.isdir("/proc/self") or not os.path.isdir("/dev/shm"):
    pytest.skip("Linux shared memory (/proc, /dev/shm) only", allow_module_level=True)

# A child makes a shared-memory segment and a lock (as vLLM's worker makes its ring buffer
# and tqdm its lock), attaches to one of ours, and is killed. Prints what was removed, and
# which of the files are still in /dev/shm.
KILLED_CHILD_SCRIPT = """
import multiprocessing, os, sys, time
from multiprocessing import shared_memory
import psutil
from genlm.backend.llm.vllm.shm import EngineSharedMemory

def child(ours, pipe):
    segment = shared_memory.SharedMemory(create=True, size=4096)
    lock = multiprocessing.get_context("spawn").Lock()
    attached = shared_memory.SharedMemory(name=ours)
    pipe.send([segment.name, "sem." + lock._semlock.name.lstrip("/")])
    time.sleep(600)

if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    ours = shared_memory.SharedMemory(create=True, size=4096)
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=child, args=(ours.name, writer))
    process.start()
    files = reader.recv()
    watched = EngineSharedMemory([psutil.Process(process.pid)])
    print("while running:", watched.all_exited(time.monotonic() + 0.3))
    process.kill()
    process.join()
    print("once killed:", watched.all_exited(time.monotonic() + 10))
    print("removed:", sorted(watched.remove_left_behind()) == sorted(files))
    print("left:", [name for name in [*files, ours.name] if os.path.exists("/dev/shm/" + name)])
    ours.close()
    ours.unlink()
"""


def test_the_files_of_a_killed_process_are_removed_and_the_tracker_stays_quiet(tmp_path):
    script = tmp_path / "killed_child.py"
    script.write_text(KILLED_CHILD_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[:3] == ["while running: False", "once killed: True", "removed: True"]
    # the child's two files are gone; the segment this process made and shares is its own
    assert lines[3].startswith("left: ['psm_") and lines[3].count("'") == 2, lines[3]
    assert "leaked" not in run.stderr and "Traceback" not in run.stderr, run.stderr
