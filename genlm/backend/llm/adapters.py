"""Checks of a LoRA adapter directory, made before any backend touches its model.

A failed `add_new_lora` must leave the model and the adapter registry as they were, so what
can be known without changing the model is checked first: the directory, its config, its
weights file (read in full; errors name the file), and for a peft adapter the shape of every
low-rank matrix against the base model's module it adapts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from genlm.backend.checks import first_line

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
MLX_WEIGHTS = "adapters.safetensors"
# What a hub id's snapshot needs: the adapter's config and weights (peft's or mlx-lm's).
ADAPTER_FILES = (PEFT_CONFIG, *PEFT_WEIGHTS, MLX_WEIGHTS)
# peft saves keys as "base_model.model.<module path>.lora_A.weight" (no adapter name).
_PEFT_PREFIX = "base_model.model."


def adapter_directory(lora_path: Any) -> Path:
    """``lora_path`` as an existing directory holding ``adapter_config.json``: a local
    directory (``~`` expanded), else a hub id resolved as peft resolves it (`hub_adapter`);
    `FileNotFoundError` naming the path or id otherwise."""
    path = Path(str(lora_path)).expanduser()
    if not path.is_dir():
        if not looks_like_hub_id(str(lora_path)):
            raise FileNotFoundError(f"LoRA adapter directory {str(lora_path)!r} does not exist")
        path = hub_adapter(str(lora_path))
    config = path / PEFT_CONFIG
    if not config.is_file():
        raise FileNotFoundError(f"LoRA adapter directory {str(path)!r} has no {PEFT_CONFIG}")
    return path


def looks_like_hub_id(name: str) -> bool:
    """Whether ``name`` can be a Hugging Face repository id (``org/name`` or ``name``), and
    is not written as a path (absolute, ``./``, ``~``, a backslash)."""
    if name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_adapter(repo_id: str) -> Path:
    """The local snapshot of the adapter repository ``repo_id``, through huggingface_hub as
    peft loads one: from the local Hugging Face cache (``HF_HUB_CACHE``), downloaded first
    where the hub is reachable, the cache alone when ``HF_HUB_OFFLINE=1``. Only the adapter's
    files (`ADAPTER_FILES`). `FileNotFoundError` naming the id, the cache and the offline
    setting when it cannot be had."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = constants.HF_HUB_OFFLINE
    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(ADAPTER_FILES)))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        where = (
            f"it is not in the local Hugging Face cache {constants.HF_HUB_CACHE!r} and "
            "HF_HUB_OFFLINE=1 forbids a download"
            if offline
            else f"it could not be had from the Hugging Face Hub: {first_line(error)}"
        )
        raise FileNotFoundError(
            f"LoRA adapter {repo_id!r} is no local directory, and as a hub id {where}"
        ) from None


def read_config(path: Path) -> dict[str, Any]:
    """The adapter's ``adapter_config.json`` (`ValueError` naming it if it is not a JSON object)."""
    file = path / PEFT_CONFIG
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read {str(file)!r}: {first_line(error)}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(file)!r} does not hold a JSON object")
    return config


def read_peft_adapter(lora_path: Any) -> tuple[Path, dict[str, torch.Tensor]]:
    """The directory and weights of a peft LoRA adapter, both read in full.

    Raises `FileNotFoundError` for a missing directory, config or weights file, and
    `ValueError` naming the file for a config that is no peft LoRA config or weights that
    cannot be read (truncated, corrupt, not safetensors).
    """
    path = adapter_directory(lora_path)
    config = read_config(path)
    if config.get("peft_type") not in (None, "LORA"):
        raise ValueError(
            f"{str(path / PEFT_CONFIG)!r} is a {config['peft_type']} adapter, not LoRA"
        )
    files = [path / name for name in PEFT_WEIGHTS if (path / name).is_file()]
    if not files:
        raise FileNotFoundError(
            f"LoRA adapter directory {str(path)!r} has no weights ({' or '.join(PEFT_WEIGHTS)})"
        )
    try:
        if files[0].suffix == ".safetensors":
            from safetensors.torch import load_file

            weights = load_file(str(files[0]))
        else:
            weights = torch.load(files[0], map_location="cpu", weights_only=True)
    except Exception as error:  # safetensors and torch raise their own types for bad files
        raise ValueError(
            f"cannot read the LoRA weights {str(files[0])!r} (truncated or corrupt?): "
            f"{first_line(error)}"
        ) from None
    if not isinstance(weights, dict) or not weights:
        raise ValueError(f"the LoRA weights {str(files[0])!r} hold no tensors")
    return path, weights


def check_peft_shapes(weights: dict[str, torch.Tensor], model: torch.nn.Module, path: Path) -> None:
    """Raise `ValueError` unless every ``lora_A``/``lora_B`` matrix fits the linear layer of
    ``model`` it adapts (``A: [r, in]``, ``B: [out, r]``, the same ``r``)."""
    ranks: dict[str, int] = {}
    for key, tensor in weights.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker not in key:
                continue
            module_path = key.split(marker)[0].removeprefix(_PEFT_PREFIX)
            try:
                module = model.get_submodule(module_path)
            except AttributeError:
                raise ValueError(
                    f"the LoRA adapter {str(path)!r} adapts {module_path!r}, which the base "
                    "model does not have: it was made for another model"
                ) from None
            # A layer peft wraps already (other adapters loaded): check its base layer.
            base_layer = getattr(module, "get_base_layer", None)
            if callable(base_layer):
                module = base_layer()
            if not isinstance(module, torch.nn.Linear) or tensor.ndim != 2:
                continue
            rank, expected = (
                (tensor.shape[0], module.in_features)
                if part == "lora_A"
                else (tensor.shape[1], module.out_features)
            )
            size = tensor.shape[1] if part == "lora_A" else tensor.shape[0]
            if size != expected or ranks.setdefault(module_path, rank) != rank:
                raise ValueError(
                    f"the LoRA adapter {str(path)!r} does not fit the base model: "
                    f"{key} has shape {tuple(tensor.shape)}, but {module_path} is "
                    f"{module.in_features} -> {module.out_features}"
                )


def check_mlx_adapter(lora_path: Any) -> Path:
    """The directory of an mlx-lm adapter (``adapter_config.json`` with ``num_layers``, and
    ``adapters.safetensors``); a peft adapter is refused with what to do instead."""
    path = adapter_directory(lora_path)
    config = read_config(path)
    if "peft_type" in config or "num_layers" not in config:
        raise ValueError(
            f"{str(path)!r} is not an mlx-lm adapter (its {PEFT_CONFIG} has no 'num_layers'"
            f"{'; it is a peft adapter' if 'peft_type' in config else ''}): AsyncMlxLM loads "
            "adapters trained or converted with mlx-lm (mlx_lm.lora); serve a peft adapter "
            "with AsyncTransformer or AsyncVirtualLM"
        )
    if not (path / MLX_WEIGHTS).is_file():
        raise FileNotFoundError(f"mlx-lm adapter directory {str(path)!r} has no {MLX_WEIGHTS}")
    return path
