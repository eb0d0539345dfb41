"""Capture files take their space when they are made: a directory without room (a
container's 64 MB ``/dev/shm``) gives the temp dir or a `CaptureSpaceError` naming the
fixes, never a process killed by SIGBUS at its first write into the mapping (no vLLM
needed; the mid-run and pre-start cases run on the stand-in engine, tests/test_vllm_standin.py).
"""

import errno
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from genlm.backend.llm.vllm import capture as capture_module
from genlm.backend.llm.vllm.capture import CaptureSpaceError, LogitsProcessorCapture

REAL_FALLOCATE = getattr(os, "posix_fallocate", None)
CAPTURE_LOGGER = "genlm.backend.llm.vllm.capture"


def no_room(fd, offset, length):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def not_supported(fd, offset, length):
    raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))


def files_in(directory):
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("reserve", ["posix_fallocate", "none (macOS)", "EOPNOTSUPP"])
def test_a_file_holds_its_whole_size_on_disk_before_any_row_is_written(
    reserve, tmp_path, monkeypatch
):
    """A batch of 3 rows takes a file of 4: the fourth row, never written, has its blocks
    too (a sparse file would have only the three the NaN fill wrote)."""
    if reserve == "none (macOS)":
        monkeypatch.delattr(os, "posix_fallocate", raising=False)
    elif reserve == "EOPNOTSUPP":
        monkeypatch.setattr(os, "posix_fallocate", not_supported)
    elif REAL_FALLOCATE is None:
        pytest.skip("this OS has no posix_fallocate")
    capture = LogitsProcessorCapture(directory=str(tmp_path))
    width = 4096
    with capture.batch(3, width) as batch:
        stat = os.stat(batch.path)
        assert stat.st_size == 4 * width * 4
        assert stat.st_blocks * 512 >= 4 * width * 4
    capture.close()


def test_a_given_directory_without_room_raises_naming_it_the_bytes_and_the_fixes(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(os, "posix_fallocate", no_room)
    capture = LogitsProcessorCapture(directory=str(tmp_path))
    with pytest.raises(CaptureSpaceError) as error:
        with capture.batch(20, 128_256):
            pass
    message = str(error.value)
    assert isinstance(error.value, OSError) and error.value.errno == errno.ENOSPC
    assert str(tmp_path) in message
    assert f"{32 * 128_256 * 4:,} bytes" in message  # 20 rows take a file of 32
    for fix in ("--shm-size", "--ipc=host", "LogitsProcessorCapture(directory=...)"):
        assert fix in message
    assert "capture='logprobs'" in message
    assert files_in(tmp_path) == []  # the file that found no room is removed
    assert capture.directory == str(tmp_path)  # a given directory has no fallback


@pytest.fixture
def shm_and_tmp(tmp_path, monkeypatch):
    """A stand-in ``/dev/shm`` (the default directory) and temp dir (the fallback)."""
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    monkeypatch.setattr(capture_module, "shared_memory_dir", lambda: str(shm))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return shm, tmp


def full_directory(directory):
    """A ``posix_fallocate`` for which ``directory`` has no room (the others have)."""

    def fallocate(fd, offset, length):
        if Path(os.readlink(f"/proc/self/fd/{fd}")).parent == directory:
            no_room(fd, offset, length)
        REAL_FALLOCATE(fd, offset, length)

    return fallocate


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux's /proc")
def test_a_full_default_directory_gives_way_to_the_temp_dir_with_one_warning(
    shm_and_tmp, monkeypatch, caplog
):
    shm, tmp = shm_and_tmp
    monkeypatch.setattr(os, "posix_fallocate", full_directory(shm))
    capture = LogitsProcessorCapture()
    with caplog.at_level(logging.WARNING, logger=CAPTURE_LOGGER):
        with capture.batch(2, 8) as batch:
            assert Path(batch.path).parent == tmp
        with capture.batch(8, 8) as batch:  # a new file: made there at once
            assert Path(batch.path).parent == tmp
    (record,) = [r for r in caplog.records if r.name == CAPTURE_LOGGER]
    assert str(shm) in record.getMessage() and str(tmp) in record.getMessage()
    assert f"{2 * 8 * 4:,} bytes" in record.getMessage()
    assert files_in(shm) == [] and len(files_in(tmp)) == 2  # both kept for later batches
    # No second fallback: the temp dir full too is the error, naming it.
    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(CaptureSpaceError, match=re.escape(f"in {tmp} (")):
        with capture.batch(32, 8):
            pass
    capture.close()
    assert files_in(tmp) == []


def test_the_error_names_both_directories_where_neither_has_room(shm_and_tmp, monkeypatch, caplog):
    shm, tmp = shm_and_tmp
    monkeypatch.setattr(os, "posix_fallocate", no_room)
    capture = LogitsProcessorCapture()
    with caplog.at_level(logging.WARNING, logger=CAPTURE_LOGGER):
        with pytest.raises(CaptureSpaceError) as error:
            capture.check_room(5, 100)
    assert f"in {shm} (" in str(error.value) and f"or in {tmp} (" in str(error.value)
    assert f"{8 * 100 * 4:,} bytes" in str(error.value)
    assert [r for r in caplog.records if r.name == CAPTURE_LOGGER] == []
    assert files_in(shm) == files_in(tmp) == []
    assert capture.directory == str(shm)  # nothing moved


def test_check_room_makes_the_file_and_removes_it(tmp_path):
    capture = LogitsProcessorCapture(directory=str(tmp_path))
    capture.check_room(20, 1000)
    assert files_in(tmp_path) == []


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs (a container's full /dev/shm), where this test may mount one."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
            check=True,
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {error}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=False, timeout=30)


# The batch that used to die with SIGBUS (8 rows of a 128k vocabulary: 4.1 MB, on the
# 1 MiB tmpfs), in a capture given that directory, in one without posix_fallocate, and in
# the default capture whose /dev/shm it is. Prints what happened.
TINY_TMPFS_SCRIPT = """
import os, sys, tempfile
from genlm.backend.llm.vllm import capture

tiny, tmp = sys.argv[1], sys.argv[2]

def full_batch(directory=None):
    with capture.LogitsProcessorCapture(directory=directory).batch(8, 128_256) as batch:
        return os.path.dirname(batch.path)

try:
    full_batch(tiny)
except capture.CaptureSpaceError as error:
    print("given:", error)
fallocate = os.posix_fallocate
del os.posix_fallocate
try:
    full_batch(tiny)
except capture.CaptureSpaceError as error:
    print("zeros:", error)
os.posix_fallocate = fallocate
capture.shared_memory_dir = lambda: tiny
tempfile.tempdir = tmp
print("default:", full_batch() == tmp)
print("left:", os.listdir(tiny))
"""


@pytest.mark.skipif(REAL_FALLOCATE is None, reason="this OS has no posix_fallocate")
def test_a_batch_on_a_full_tmpfs_gets_the_error_or_the_fallback_and_no_signal(tiny_tmpfs, tmp_path):
    script = tmp_path / "tiny_tmpfs.py"
    script.write_text(TINY_TMPFS_SCRIPT)
    fallback = tmp_path / "fallback"
    fallback.mkdir()
    run = subprocess.run(
        [sys.executable, str(script), str(tiny_tmpfs), str(fallback)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert run.returncode not in (-signal.SIGBUS, 128 + signal.SIGBUS), run.stderr[-3000:]
    assert run.returncode == 0, run.stderr[-3000:]
    given, zeros, default, left = run.stdout.splitlines()
    needed = f"{8 * 128_256 * 4:,} bytes"
    for line in (given, zeros):
        assert f"in {tiny_tmpfs} (" in line and needed in line and "--shm-size" in line, line
    assert default == "default: True"
    assert left == "left: []"
    assert "No room for a vLLM capture file" in run.stderr  # the fallback's warning
