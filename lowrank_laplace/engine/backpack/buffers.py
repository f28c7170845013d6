"""Output buffers an engine reuses from pass to pass while nothing else holds them.

A convolution's expanded weight rows are the largest tensor of a BackPACK pass, a
max-pool's scattered matrix the next. On the CPU every fresh allocation of that size is
mapped anew and its pages faulted in and zeroed by the kernel; writing each pass's into
the previous pass's buffer, once its factor is merged and dropped, skips that
(docs/benchmarks/design_measurements.md).
"""

from __future__ import annotations

from typing import Dict, Hashable, Tuple

import torch
from torch import Tensor

# PyTorch's count of the references to a tensor's storage (views included); a private
# binding, so without it nothing is reused
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def held_elsewhere(tensor: Tensor) -> bool:
    """Whether anything but ``tensor`` itself references its storage (a view, a block)."""
    if _use_count is None:
        return True
    storage = tensor.untyped_storage()  # one reference of its own while it lives
    return _use_count(storage._cdata) > 2


class RowBuffers:
    """One buffer per key, handed out again only when its last contents were dropped."""

    def __init__(self) -> None:
        self._buffers: Dict[Hashable, Tensor] = {}

    def empty(self, key: Hashable, shape: Tuple[int, ...], like: Tensor) -> Tensor:
        """An uninitialised tensor of ``shape`` with ``like``'s dtype and device.

        The key's previous buffer when it matches and no block still reads it, else a new
        one, kept for the next call.
        """
        buffer = self._buffers.get(key)
        if (buffer is None or buffer.shape != shape or buffer.dtype != like.dtype
                or buffer.device != like.device or held_elsewhere(buffer)):
            buffer = like.new_empty(shape)
            self._buffers[key] = buffer
        return buffer

    def clear(self) -> None:
        """Release every buffer."""
        self._buffers.clear()
