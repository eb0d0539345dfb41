"""A guard that fails the test in which our code calls something its library deprecated.

A deprecation counts when the nearest caller outside the library that issued it (and outside
call plumbing such as ``torch.nn.Module.__call__``) is ``genlm.backend`` code: a
``DeprecationWarning``/``FutureWarning``/``PendingDeprecationWarning`` through
``warnings.warn``, or a "deprecated" line logged by ``transformers``. Our own deliberate
deprecations (``mass_sum``, plain-bytes tries) are issued *by* genlm.backend and do not count;
nor do deprecations between third-party libraries (peft calling transformers).
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from types import FrameType

import genlm.backend

OUR_CODE = str(Path(genlm.backend.__file__).parent) + "/"
DEPRECATIONS = (DeprecationWarning, FutureWarning, PendingDeprecationWarning)
# Frames that only forward a call: a deprecation seen through them belongs to their caller.
PLUMBING = (
    "/torch/nn/modules/module.py",
    "/functools.py",
    "/contextlib.py",
    "/accelerate/hooks.py",
)


def _library(filename: str) -> str:
    """The installed distribution a file belongs to (its first folder under site-packages),
    else its own folder."""
    head, marker, tail = filename.partition("/site-packages/")
    return marker + tail.split("/", 1)[0] if marker else str(Path(filename).parent)


def blamed_on_us(frame: FrameType | None) -> bool:
    """Whether the first caller outside the issuing frame's library and call plumbing is ours."""
    if frame is None or frame.f_code.co_filename.startswith(OUR_CODE):
        return False  # none, or one of our own deliberate deprecations
    issuer = _library(frame.f_code.co_filename)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(OUR_CODE):
            return True
        if _library(filename) != issuer and not filename.endswith(PLUMBING):
            return False
        frame = frame.f_back
    return False


class DeprecationGuard(logging.Handler):
    """Records each deprecation our code triggers (`found`). Installed once per session; a guard
    installed on top (the guard's own tests) records alone until it is uninstalled."""

    current: DeprecationGuard | None = None

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.found: list[str] = []

    def install(self) -> None:
        self._warn, self._below = warnings.warn, DeprecationGuard.current
        DeprecationGuard.current = self
        warnings.warn = self._checked_warn  # type: ignore[assignment]
        logging.getLogger("transformers").addHandler(self)

    def uninstall(self) -> None:
        warnings.warn = self._warn
        DeprecationGuard.current = self._below
        logging.getLogger("transformers").removeHandler(self)

    def _checked_warn(self, message, category=None, stacklevel=1, source=None, **kwargs):
        if isinstance(message, Warning):
            category = type(message)
        if DeprecationGuard.current is self and issubclass(category or UserWarning, DEPRECATIONS):
            if blamed_on_us(sys._getframe(1)):
                self.found.append(f"{category.__name__}: {message}")
        return self._warn(message, category, stacklevel + 1, source, **kwargs)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if DeprecationGuard.current is not self or "deprecated" not in message.lower():
            return
        frame = sys._getframe(1)
        # Skip logging's own frames: the issuer is the frame that logged.
        while frame is not None and frame.f_code.co_filename != record.pathname:
            frame = frame.f_back
        if blamed_on_us(frame):
            self.found.append(f"{record.name}: {message}")
