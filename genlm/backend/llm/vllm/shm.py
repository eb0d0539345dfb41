"""The shared memory a vLLM engine's processes leave behind when they die uncleanly.

vLLM's engine core and workers talk through POSIX shared memory (one ``SharedMemory`` ring
buffer per process that writes) and hold named semaphores (``multiprocessing`` locks:
the executor's, tqdm's), each registered with the resource tracker that every process of
the engine shares with ours, and each removed by the process that made it when that
process exits. A process that dies without removing them leaves its files in ``/dev/shm``,
still registered, and when our process exits the tracker removes them and warns "There
appear to be N leaked shared_memory objects". That happens when a worker is killed (say by
the OOM killer), and when an engine core fails: it resets its SIGTERM handler, then waits
for its workers to exit, and vLLM's shutdown stops it with SIGTERM before it is done.

`watch_shared_memory` notes the files the engine's processes map while they run (by inode:
glibc maps a semaphore it creates under a temporary name); once every one of those
processes has exited, `remove_left_behind` removes the ones still there, as their
processes would have, and takes them off the tracker. Linux only (``/proc``); elsewhere
both do nothing.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any, Protocol

SHM_DIR = "/dev/shm"
# How often (seconds) `remove_left_behind` checks whether the engine's processes have exited.
EXIT_POLL = 0.1


def tracked_name(file_name: str) -> tuple[str, str] | None:
    """The resource tracker's name and type for a file of `SHM_DIR` that multiprocessing
    names: ``SharedMemory``'s ``psm_*`` segments, and its locks' ``/mp-*`` semaphores,
    which glibc keeps as ``sem.mp-*``. None for any other file (not ours to remove)."""
    if file_name.startswith("psm_"):
        return "/" + file_name, "shared_memory"
    if file_name.startswith("sem.mp-"):
        return "/" + file_name.removeprefix("sem."), "semaphore"
    return None


def mapped_inodes(pid: int | str) -> set[int]:
    """The inodes of the `SHM_DIR` files that process ``pid`` maps (none if unreadable)."""
    inodes = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(SHM_DIR + "/"):
                    inodes.add(int(fields[4]))
    except OSError:
        pass
    return inodes


class Process(Protocol):
    """What is used of a psutil ``Process`` (which never mistakes a reused pid for its own)."""

    pid: int

    def is_running(self) -> bool: ...

    def status(self) -> str: ...


class EngineSharedMemory:
    """The engine's processes and the inodes of the shared-memory files they map; files that
    this process maps too are left to it."""

    def __init__(self, processes: list[Process]):
        self.processes = processes
        inodes = set().union(*(mapped_inodes(process.pid) for process in processes))
        self.inodes = inodes - mapped_inodes("self")

    def all_exited(self, deadline: float) -> bool:
        """Whether every process has exited (a zombie counts), waiting until ``deadline``
        (a ``time.monotonic()`` value) at most."""
        while any(_running(process) for process in self.processes):
            if time.monotonic() >= deadline:
                return False
            time.sleep(EXIT_POLL)
        return True

    def remove_left_behind(self) -> list[str]:
        """Remove the files left behind and take them off the resource tracker; their names."""
        from multiprocessing import resource_tracker

        try:
            entries = list(os.scandir(SHM_DIR))
        except OSError:
            return []
        removed = []
        for entry in entries:
            name = tracked_name(entry.name)
            if name is None or entry.inode() not in self.inodes:
                continue
            try:
                os.unlink(entry.path)
            except OSError:
                continue  # gone already, or not ours to remove: the tracker keeps it
            # The tracker holds the name from the dead process (it shares our tracker) and
            # forgets it on UNREGISTER; registering it first (a set: once is once) makes
            # sure it holds it, since an UNREGISTER of a name it lacks prints a traceback.
            resource_tracker.register(*name)
            resource_tracker.unregister(*name)
            removed.append(entry.name)
        return removed


def _running(process: Process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


_WATCHED: weakref.WeakKeyDictionary[Any, EngineSharedMemory] = weakref.WeakKeyDictionary()


def engine_processes(engine: Any) -> list[Process]:
    """The processes of a vLLM ``AsyncLLM`` (its engine cores and their workers) as psutil
    ``Process`` objects; none for an engine without local processes (a stand-in, Ray)."""
    client = getattr(engine, "engine_core", None)
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    cores = getattr(manager, "processes", None) or []
    if not cores:
        return []
    import psutil

    processes = []
    for pid in (getattr(core, "pid", None) for core in cores):
        if not isinstance(pid, int):
            continue  # not started (psutil would take None for this process)
        try:
            process = psutil.Process(pid)
            processes += [process, *process.children(recursive=True)]
        except psutil.Error:
            continue
    return processes


def watch_shared_memory(engine: Any) -> None:
    """Note the shared-memory files of ``engine``'s processes (once per engine; call it
    while they run, once the engine is ready)."""
    if engine not in _WATCHED:
        processes = engine_processes(engine)
        if processes:
            _WATCHED[engine] = EngineSharedMemory(processes)


def remove_left_behind(engine: Any, deadline: float) -> None:
    """After ``engine``'s shutdown: once all its processes have exited (waited for until
    ``deadline``, a ``time.monotonic()`` value; if some still run, their files are theirs to
    remove), remove the shared-memory files they left behind (see the module doc)."""
    watched = _WATCHED.pop(engine, None)
    if watched is not None and watched.all_exited(deadline):
        watched.remove_left_behind()
