"""What makes `gpu.sh` come back whole from a device call with a time limit.

Such a call returns only what the command leaves in one folder (a handful of files), and
kills the command at its limit. So a run keeps a deadline (`Budget`: a part that would end
after it is skipped, and a further repeat is timed only while the parts still to come
fit), records what each part did (`gpu_run.json`: done, failed or skipped, and why), logs
its output (`gpu.log`), and after each part packs all it has written into one archive
(`pack`), replacing the previous one: a run killed at its limit still returns what it did.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import tarfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

clock = time.monotonic  # the budget's clock (a test moves it on)
PACK_RESERVE_S = 15.0  # kept back from the deadline: the last part's clean-up and the packing
LOG = "gpu.log"
RECORD = "gpu_run"


@dataclass
class Budget:
    """The time left to a deadline ``deadline_s`` seconds after the start (None: no
    deadline), less `PACK_RESERVE_S`. ``estimates``: about how long each part takes (the
    plan's figures); ``upcoming``: the parts not yet started, in order."""

    deadline_s: float | None
    estimates: dict[str, float]
    upcoming: list[str]
    started: float = field(default_factory=lambda: clock())

    def left(self) -> float:
        if self.deadline_s is None:
            return math.inf
        return self.deadline_s - PACK_RESERVE_S - (clock() - self.started)

    def timeout(self) -> float | None:
        """The seconds left, as a child process's timeout; None without a deadline."""
        return None if self.deadline_s is None else max(self.left(), 0.0)

    def fits(self, seconds: float) -> bool:
        """Whether ``seconds`` more work ends before the deadline."""
        return seconds <= self.left()

    def spares(self, seconds: float) -> bool:
        """Whether ``seconds`` more of the running part leave the estimated time of every
        part still to come: the test of a further repeat (all the parts once first)."""
        return self.fits(seconds + sum(self.estimates.get(part, 0.0) for part in self.upcoming))


def pack(folder: Path, archive: Path) -> None:
    """Every file under ``folder`` (but the archive) into the gzipped tar ``archive``, under
    the folder's name; written beside it, then renamed over it, so that it is whole."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(archive.name + ".partial")
    skip = {archive.resolve(), partial.resolve()}
    with tarfile.open(partial, "w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and path.resolve() not in skip:
                tar.add(path, arcname=str(Path(folder.name) / path.relative_to(folder)))
    os.replace(partial, archive)


class Run:
    """One run's record of its parts (``out/gpu_run.json``) and its archive: `part` runs a
    part, or skips it at the deadline, then writes the record and packs ``packed`` (``out``
    unless given: a baseline's run packs its caller's folder) into ``archive``, if any."""

    def __init__(
        self,
        out: Path,
        archive: Path | None,
        budget: Budget,
        setup: dict[str, Any],
        between: Callable[[], None],
        packed: Path | None = None,
    ):
        self.out = out
        self.archive = archive
        self.budget = budget
        self.setup = setup
        self.between = between  # after each part: free what it held
        self.packed = packed or out
        self.rows: list[dict[str, Any]] = []

    def part(self, name: str, run: Callable[[], str | None], stops_itself: bool = False) -> bool:
        """Run the part ``name`` unless its estimate does not fit before the deadline (a
        part that `stops_itself` there, between its cells, starts while time is left); an
        exception is printed and recorded, so that the other parts still run. ``run``
        returns a note for the record (what it skipped, say). Whether it ran through."""
        self.budget.upcoming.remove(name)
        estimate = 0.0 if stops_itself else self.budget.estimates.get(name, 0.0)
        left = self.budget.left()
        if left <= 0 or not self.budget.fits(estimate):
            detail = (
                f"skipped: about {estimate:.0f} s, {max(left, 0):.0f} s left before the deadline"
            )
            print(f"\n== {name}: {detail}", flush=True)
            self.record(name, "skipped", 0.0, detail)
            return False
        print(f"\n== {name}", flush=True)
        start = clock()
        status, detail = "done", ""
        try:
            detail = run() or ""
        except Exception as error:  # noqa: BLE001 - report it, then go on with the other parts
            traceback.print_exc()
            status, detail = "failed", f"{type(error).__name__}: {error}"
        finally:
            self.between()
        seconds = clock() - start
        print(f"== {name}: {seconds:.0f} s", flush=True)
        self.record(name, status, seconds, detail)
        return status == "done"

    def record(self, name: str, status: str, seconds: float, detail: str) -> None:
        self.rows.append({"part": name, "status": status, "seconds": seconds, "detail": detail})
        self.save()

    def save(self) -> None:
        """Write the record and pack (also after a part's cell: `gpu.py`'s ``save``)."""
        self.out.mkdir(parents=True, exist_ok=True)
        result = {
            "benchmark": RECORD,
            "setup": {
                **self.setup,
                "deadline_s": self.budget.deadline_s,
                "pack_reserve_s": PACK_RESERVE_S,
                "estimates_s": self.budget.estimates,
            },
            "rows": self.rows,
            "table": ["part", "status", "seconds", "detail"],
        }
        (self.out / f"{RECORD}.json").write_text(json.dumps(result, indent=2) + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
        if self.archive is not None:
            pack(self.packed, self.archive)

    def skipped(self) -> list[str]:
        return [row["part"] for row in self.rows if row["status"] == "skipped"]


class _Tee(io.TextIOBase):
    """A text stream that writes into ``log`` as well."""

    def __init__(self, stream: TextIO, log: TextIO):
        self.stream = stream
        self.log = log

    def write(self, text: str) -> int:
        self.log.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()
        self.log.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()


@contextmanager
def logged(path: Path) -> Iterator[None]:
    """All this process prints (``sys.stdout`` and ``sys.stderr``) into ``path`` as well."""
    path.parent.mkdir(parents=True, exist_ok=True)
    streams = sys.stdout, sys.stderr
    with path.open("w") as log:
        sys.stdout, sys.stderr = _Tee(streams[0], log), _Tee(streams[1], log)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = streams
