"""Upstream log noise off: one call, made by the command line and the examples.

vLLM logs dozens of INFO lines per engine start, and warnings about its own interfaces
("Passing raw prompts to InputProcessor is deprecated"); bitsandbytes warns on import that
an optional CPU kernel package is missing. None of it is about the user's program.
`quiet_upstream_logs` turns those loggers down to errors; this package's own loggers
(``genlm.backend.*``) and Python warnings are untouched. Set
``GENLM_BACKEND_UPSTREAM_LOGS=1`` (or pass ``--upstream-logs`` on the command line) to see
everything again. Importing ``genlm.backend`` changes no logging: only this call does.
"""

from __future__ import annotations

import logging
import os

UPSTREAM_LOGS_VARIABLE = "GENLM_BACKEND_UPSTREAM_LOGS"
# Python loggers of the libraries whose output is noise to a user, turned down to ERROR.
QUIET_LOGGERS = ("bitsandbytes", "vllm")


def upstream_logs_wanted() -> bool:
    """Whether ``GENLM_BACKEND_UPSTREAM_LOGS`` asks for the upstream logs (1/true/yes/on)."""
    return os.environ.get(UPSTREAM_LOGS_VARIABLE, "").strip().lower() in {"1", "true", "yes", "on"}


def quiet_upstream_logs() -> None:
    """Show only errors from vLLM (this process and the engine processes it starts) and
    bitsandbytes, unless ``GENLM_BACKEND_UPSTREAM_LOGS`` is set. Call it before the
    backend loads. A ``VLLM_LOGGING_LEVEL`` set by the caller is kept."""
    if upstream_logs_wanted():
        return
    # vLLM configures its loggers from this variable when it is imported, in every process.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
