"""Data-parallel fits: the process group to merge across and sums over its processes."""

from __future__ import annotations

from typing import Any


def resolve_process_group(process_group: Any):
    """The process group to merge across, or ``None`` for a single process."""
    import torch.distributed as dist

    if isinstance(process_group, str) and process_group == "default":
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    if process_group is None or dist.get_world_size(process_group) == 1:
        return None
    return process_group
