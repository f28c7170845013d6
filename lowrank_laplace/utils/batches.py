"""Tensor or dict batches (a dict's tensors with ``N`` rows are per sample), and memory."""

from __future__ import annotations

import copy
import math
import os
from typing import Any, Optional

import torch
from torch import Tensor


def batch_size(inputs: Any) -> int:
    """Return the number of samples ``N`` of a tensor or dict batch (its first batched tensor)."""
    if isinstance(inputs, Tensor):
        return inputs.shape[0] if inputs.ndim else 0
    sizes = [v.shape[0] for v in inputs.values() if isinstance(v, Tensor) and v.ndim]
    return sizes[0] if sizes else 0


def take(inputs: Any, index: Any, n: Optional[int] = None) -> Any:
    """Return the samples ``index`` (a slice or indices) of a tensor or dict batch, of its type.

    ``n`` is the batch size (``None``: found); dict entries of another leading size stay whole.
    """
    if isinstance(inputs, Tensor):
        return inputs[index]
    n = batch_size(inputs) if n is None else n
    out = copy.copy(inputs)
    for key, value in inputs.items():
        if isinstance(value, Tensor) and value.ndim and value.shape[0] == n:
            out[key] = value[index]
    return out


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on a device.

    CUDA: the driver's free memory; CPU: ``MemAvailable`` of ``/proc/meminfo``, else the free
    physical pages.
    """
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def format_bytes(size: float) -> str:
    """Return ``size`` bytes for a message, in the largest binary unit it fills (``"1.5 GiB"``).

    Three significant digits, so that two sizes compared in a message differ where they do.
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{int(size)} bytes"


def parse_memory(budget: Any) -> Any:
    """Turn a memory size with a unit (``"1GB"``, ``"512 MiB"``) into bytes.

    Args:
        budget: A string with a unit, or bytes, a fraction or ``None`` (returned as is).

    Returns:
        Bytes as ``int`` for a string, else ``budget``.

    Raises:
        ValueError: For anything else, or a string that is not a number with a unit.
    """
    if not isinstance(budget, str):
        if budget is not None and (isinstance(budget, bool)
                                   or not isinstance(budget, (int, float))):
            raise ValueError(f"memory_budget must be bytes, a fraction or e.g. '2GiB', "
                             f"got {budget!r}.")
        if isinstance(budget, float) and not (
                math.isfinite(budget) and (budget <= 1 or budget.is_integer())):
            raise ValueError(
                f"memory_budget={budget!r} is not a size: a float is a fraction of free "
                "memory in (0, 1] (or a whole number of bytes); pass bytes as an int or "
                "a string such as '2GiB'.")
        return budget
    text = budget.strip().lower().replace(" ", "")
    number = text.rstrip("kmgtib")
    unit = text[len(number):] or "b"
    try:
        return int(float(number) * _UNITS[unit])
    except (KeyError, ValueError):
        raise ValueError(
            f"memory_budget {budget!r} is not a size: use bytes (int), a fraction of "
            "free memory (float in (0, 1]) or a string such as '512MB' or '2GiB'.") from None


def refuse_meta(what: str, values: Any) -> None:
    """Refuse tensors on the ``meta`` device among ``values`` (which hold no data).

    Args:
        what: What they are, for the message (``"inputs"``, ``"targets"``).
        values: Tensors and other values.

    Raises:
        ValueError: Naming the way out.
    """
    if any(isinstance(t, Tensor) and t.is_meta for t in values):
        raise ValueError(
            f"The {what} are on the meta device, which holds shapes but no values: "
            "move the batch to a device with data (e.g. .to('cpu')).")


def to_device(inputs: Any, device: torch.device) -> Any:
    """Return a tensor or dict batch with its tensors moved to ``device``.

    Raises:
        ValueError: For tensors on the ``meta`` device (:func:`refuse_meta`).
    """
    refuse_meta("inputs", [inputs] if isinstance(inputs, Tensor) else inputs.values())
    if isinstance(inputs, Tensor):
        return inputs.to(device)
    out = copy.copy(inputs)
    for key, value in inputs.items():
        if isinstance(value, Tensor):
            out[key] = value.to(device)
    return out


def batch_device(inputs: Any) -> torch.device:
    """The device of a tensor or dict batch (its first tensor; CPU if none)."""
    if isinstance(inputs, Tensor):
        return inputs.device
    for value in inputs.values():
        if isinstance(value, Tensor):
            return value.device
    return torch.device("cpu")
