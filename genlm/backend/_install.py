"""The install command that error messages suggest for an optional extra of this package.

This package is installed from its repository (editable or as a wheel built there), not
from PyPI, where ``genlm-backend`` is another library: a hint names a command that
installs *this* package's extra.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

# The checkout root when this package is an editable install or run from a clone.
_CHECKOUT = Path(__file__).resolve().parents[2]


def install_hint(extra: str) -> str:
    """``pip install -e '<checkout>[extra]'`` from a checkout; otherwise how to install the
    extra from this repository (never PyPI's ``genlm-backend``)."""
    if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "genlm").is_dir():
        return f"pip install -e '{_CHECKOUT}[{extra}]'"
    return (
        f"pip install -e '.[{extra}]' in a checkout of this package's repository "
        "(PyPI's genlm-backend is a different library)"
    )


def import_extra(module: str, extra: str, needs: str) -> ModuleType:
    """``import module``, or ImportError saying ``needs`` (what needs it) and the command
    that installs ``extra``."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"{needs}: {install_hint(extra)}") from error
