"""The tries' input and output checks, shared by the sequential, parallel and async tries.

Weights (``ws``) are a numpy array, a torch tensor (any device) or a sequence of numbers,
one per vocabulary position (``[B, V]`` when batched); an ``out=`` is a float32 numpy array
or torch tensor of the result's shape that the result is written into. Both are checked
before any work, with a `TypeError` or `ValueError` naming what is wrong. torch is never
imported here: a tensor can only come from a caller that imported it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    Out = np.ndarray | torch.Tensor


def is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def as_weights(ws: Any) -> Any:
    """``ws`` as a real-valued numpy array or torch tensor, checked before any work.

    Tensors are returned as they are and anything else as ``np.asarray(ws)``; numbers of
    any width (bool, int, float) pass. Raises `TypeError` for complex, string, object
    (e.g. ``None``) weights, which a conversion to float would silently turn into NaN
    or truncate, and `ValueError` for a meta tensor (it has no values) or a ragged list.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(ws, torch.Tensor):
        if ws.is_meta:
            raise ValueError("weights are a meta tensor, which has no values: pass real data")
        integer = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
        if not (ws.dtype.is_floating_point or ws.dtype in integer):
            raise TypeError(f"weights must be real numbers (bool, int or float), got {ws.dtype}")
        return ws
    try:
        array = np.asarray(ws)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"weights must be a numeric vector (numpy array, torch tensor or list of numbers), "
            f"got a {type(ws).__name__} that is not one: {error}"
        ) from None
    if array.dtype.kind not in "biuf":
        raise TypeError(
            f"weights must be real numbers (bool, int or float), got dtype {array.dtype}"
            + (" (None or other objects among them?)" if array.dtype.kind == "O" else "")
        )
    return array


def check_weights_shape(shape: tuple[int, ...], vocab_size: int, batched: bool) -> None:
    """Raise `ValueError` unless ``shape`` is ``(vocab_size,)`` (or ``(B, vocab_size)``)."""
    if batched and (len(shape) != 2 or shape[1] != vocab_size):
        raise ValueError(
            f"batched weights must have shape [B, {vocab_size}] (or be a list of vectors), "
            f"got shape {tuple(shape)}"
        )
    if not batched and (len(shape) != 1 or shape[0] != vocab_size):
        raise ValueError(
            f"weights must be 1-D with one entry per vocabulary position "
            f"(length {vocab_size}), got shape {tuple(shape)}"
        )


def checked_weights(ws: Any, vocab_size: int, batched: bool = False) -> Any:
    """``ws`` as `as_weights` gives it, of shape ``[vocab_size]`` (``[B, vocab_size]`` if
    ``batched``)."""
    ws = as_weights(ws)
    check_weights_shape(tuple(ws.shape), vocab_size, batched)
    return ws


def as_numpy(ws: Any) -> np.ndarray:
    """A float32 or float64 numpy view (or copy) of weights checked by `as_weights` (a
    numpy array or a torch tensor on any device); float32/float64 CPU inputs are not copied."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(ws, torch.Tensor):
        ws = ws.detach()
        if ws.dtype not in (torch.float32, torch.float64):
            ws = ws.to(torch.float64)
        return ws.cpu().numpy()
    return ws if ws.dtype in (np.float32, np.float64) else ws.astype(np.float64)


def checked_out(out: Any, shape: tuple[int, ...]) -> Any:
    """``out`` if it is a float32 numpy array or torch tensor of ``shape`` that a result can
    be written into, else `TypeError` (not an array or tensor) or `ValueError` naming what
    is wrong: its dtype or shape, or why it cannot be written (`_unwritable`)."""
    if is_tensor(out):
        dtype_ok = out.dtype == sys.modules["torch"].float32
    elif isinstance(out, np.ndarray):
        dtype_ok = out.dtype == np.float32
    else:
        raise TypeError(f"out must be a numpy array or torch tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape or not dtype_ok:
        raise ValueError(
            f"out must be a float32 array or tensor of shape {shape}, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    problem = _unwritable(out)
    if problem is not None:
        raise ValueError(f"out {problem}: pass a writable float32 array or tensor")
    return out


def _unwritable(out: Any) -> str | None:
    """Why a result cannot be written into ``out`` (None: it can): a read-only array (numpy's
    own error, or numba's typing error in the compiled sweeps, or torch writing it anyway), a
    meta tensor (a write does nothing), a tensor autograd tracks or an inference tensor
    outside inference mode (torch refuses the write after the work), or elements sharing
    memory (a stride of 0, as in an expanded view)."""
    if isinstance(out, np.ndarray):
        if not out.flags.writeable:
            return "is read-only"
    else:
        torch = sys.modules["torch"]
        if out.is_meta:
            return "is a meta tensor, which has no memory to write into"
        if out.requires_grad:
            return "requires grad (autograd forbids writing into it)"
        if out.is_inference() and not torch.is_inference_mode_enabled():
            return "is an inference tensor, writable only under torch.inference_mode()"
    if any(stride == 0 and size > 1 for stride, size in zip(_strides(out), out.shape, strict=True)):
        return "has elements that share memory (a stride of 0, as in an expanded view)"
    return None


def _strides(out: Any) -> tuple[int, ...]:
    return tuple(out.strides) if isinstance(out, np.ndarray) else tuple(out.stride())


def write_into(result: Any, out: Any) -> Any:
    """``out`` holding ``result`` (the same object when ``out`` is ``result``)."""
    if out is result:
        return out
    if is_tensor(out):
        torch = sys.modules["torch"]
        out.copy_(torch.from_numpy(result) if isinstance(result, np.ndarray) else result)
    else:
        out[...] = result
    return out
