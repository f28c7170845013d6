"""The memory budget of a fit: bytes, and the samples whose ``V`` fits them."""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from lowrank_laplace.utils.batches import (
    available_memory,
    batch_device,
    format_bytes,
    parse_memory,
)

DEFAULT_MEMORY_BUDGET = 2**30


def resolve_memory_budget(budget: Union[int, float, None], device: torch.device) -> int:
    """Return a memory budget in bytes.

    Args:
        budget: Bytes, a fraction in ``(0, 1]`` of free memory, a size such as ``"2GiB"``,
            or ``None`` (1 GiB on the CPU; on CUDA a quarter of free memory, at least 1 GiB).
        device: Where ``V`` lives.

    Raises:
        ValueError: For a non-positive budget or a fraction above 1.
    """
    budget = parse_memory(budget)
    if budget is None:
        if device.type == "cuda":
            return max(DEFAULT_MEMORY_BUDGET, available_memory(device) // 4)
        return DEFAULT_MEMORY_BUDGET
    if budget <= 0:
        raise ValueError(f"memory_budget must be positive, got {budget}.")
    if isinstance(budget, float) and budget <= 1:
        return int(budget * available_memory(device))
    return int(budget)


def micro_batch_size(engine: Any, X: Any, num_vectors: Optional[int],
                     budget: Union[int, float, None], cap: Optional[int],
                     one_block: bool = False) -> int:
    """Return the samples per backward pass within the memory budget and the user's cap.

    Args:
        engine: The engine that computes ``V``.
        X: A batch of inputs.
        num_vectors: Columns per sample (``None``: the loss's exact factor).
        budget: ``memory_budget`` as given.
        cap: ``micro_batch_size`` as given, or ``None``.
        one_block: Passes hold one block of ``V`` at a time (``low_memory``).

    Raises:
        ValueError: If one sample does not fit the budget.
    """
    size, _ = samples_in_budget(engine, X, num_vectors, budget, one_block)
    return size if cap is None else min(size, cap)


def samples_in_budget(engine: Any, X: Any, num_vectors: Optional[int],
                       budget: Union[int, float, None], one_block: bool) -> Tuple[int, int]:
    """Samples whose ``V`` fits the budget, and the bytes of one sample's ``V``.

    Raises:
        ValueError: If one sample does not fit the budget (:func:`samples_that_fit`).
    """
    per_sample = engine.bytes_per_sample(X, num_vectors, one_block=one_block)
    return samples_that_fit(per_sample, resolve_memory_budget(budget, batch_device(X)))


def samples_that_fit(per_sample: int, budget: int) -> Tuple[int, int]:
    """Samples of ``per_sample`` bytes that fit ``budget`` bytes, and ``per_sample``.

    Raises:
        ValueError: If one sample does not fit the budget.
    """
    if per_sample > budget:
        raise ValueError(
            f"memory_budget={budget:,} bytes is too small for one sample (about "
            f"{per_sample:,} bytes of V): raise memory_budget, use mc_samples=1, or "
            "subset_of_weights='last_layer'.")
    return max(1, budget // per_sample), per_sample


def dense_identity(dim: int, dtype: torch.dtype, device: torch.device,
                   budget: Union[int, float, None], what: str) -> torch.Tensor:
    """Return ``I_D`` for a dense ``D x D`` result, after checking that it fits the budget.

    Args:
        dim: ``D``.
        dtype: The result's dtype.
        device: Its device.
        budget: ``memory_budget`` as given.
        what: The result's name, for the message.

    Raises:
        ValueError: If the matrix and its workspace exceed the budget.
    """
    need = 2 * dim * dim * (torch.finfo(dtype).bits // 8)  # identity and result
    budget = resolve_memory_budget(budget, device)
    if need > budget:
        raise ValueError(
            f"{what} is a dense {dim:,} x {dim:,} matrix ({format_bytes(need)} with "
            f"its workspace), over memory_budget={budget:,} bytes: use "
            "posterior_variance (its diagonal), functional_variance / "
            "functional_covariance (outputs) or sample(), or raise memory_budget.")
    return torch.eye(dim, dtype=dtype, device=device)
