"""Random draws of engine passes: replayed across passes, or kept private to a fit."""

from __future__ import annotations

from typing import ContextManager, Optional, Tuple

import torch
from torch import Tensor


class RNGReplay:
    """Replay the random draws of an engine pass (MC samples, dropout) in later passes.

    Every ``with`` block starts from the state saved at creation and leaves the RNG as
    :meth:`mark` found it after the first pass.

    Args:
        device: The device of the inputs (its CUDA generator is replayed too).
    """

    def __init__(self, device: torch.device):
        self.device, self.start, self.after_first = device, rng_state(device), None

    def mark(self) -> None:
        """Record the state after the first pass."""
        self.after_first = rng_state(self.device)

    def restart(self) -> None:
        """Set the RNG back to the saved state (before a pass that counts as first)."""
        set_rng_state(self.start, self.device)

    def __enter__(self) -> "RNGReplay":
        if self.after_first is None:
            self.mark()
        set_rng_state(self.start, self.device)
        return self

    def __exit__(self, *exc) -> None:
        set_rng_state(self.after_first, self.device)


class PrivateRNG:
    """Runs ``with`` blocks on a private, seeded stream of the global RNG (BackPACK's MC draws).

    The fit neither depends on nor advances the caller's RNG (the loader's shuffling uses it).
    """

    def __init__(self, seed: int, device: torch.device):
        self.seed, self.device, self.state = seed, device, None  # the stream's state

    def __enter__(self) -> None:
        self.saved = rng_state(self.device)
        if self.state is None:  # seed only the generators of the fit's device
            torch.random.default_generator.manual_seed(self.seed)
            if self.device.type == "cuda":
                index = self.device.index if self.device.index is not None else \
                    torch.cuda.current_device()
                torch.cuda.default_generators[index].manual_seed(self.seed)
        else:
            set_rng_state(self.state, self.device)

    def __exit__(self, *exc) -> None:
        self.state = rng_state(self.device)
        set_rng_state(self.saved, self.device)


def forked_rng(device: torch.device) -> ContextManager:
    """``torch.random.fork_rng`` of the CPU generator and ``device``'s (draws inside are undone)."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def rng_state(device: torch.device) -> Tuple[Tensor, Optional[Tensor]]:
    """Return the CPU generator's state and, for a CUDA device, that device's (or ``None``)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: Tuple[Tensor, Optional[Tensor]], device: torch.device) -> None:
    """Restore a state ``(cpu_state, cuda_state or None)`` from :func:`rng_state` on ``device``."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
