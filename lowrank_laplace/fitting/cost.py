"""The cost model that sizes a fit: merges, sketches and the dense sum in Gram multiply-adds.

A merge of ``M`` columns into the ``D x k`` basis costs, besides the products with ``V``
every column pays once (``~2 D k`` per sample, ``2 D_gram k`` per column), memory passes
over the basis (``~180 D k``), a float64 eigendecomposition (``EIGH_WEIGHT (k + M)^3``),
the columns' Gram matrix (``M^2 D_gram``) and a fixed ``OVERHEAD``; weights measured on
CPU (docs/benchmarks/design_measurements.md).

The functions' arguments: ``columns_per_sample`` (columns of ``V`` per sample), ``keep``
(``k``, or ``l`` for a sketch), ``dim`` (``D``), ``gram_dim`` (``D_gram``), ``num_data``
(samples streamed by this process).
"""

from __future__ import annotations

#: Fixed cost of one merge's small operations, in Gram multiply-adds.
OVERHEAD = 7.5e8
#: A float64 eigendecomposition of size ``n`` costs ~``EIGH_WEIGHT n^3``.
EIGH_WEIGHT = 28.0


def merge_cost(samples: int, columns_per_sample: int, keep: int, dim: int,
                gram_dim: int) -> float:
    """Cost of one streaming merge of ``samples`` samples."""
    m = samples * columns_per_sample
    return EIGH_WEIGHT * (keep + m) ** 3 + 180.0 * dim * keep + m * m * gram_dim + OVERHEAD


def streaming_cost(columns_per_sample: int, keep: int, dim: int, gram_dim: int,
                   num_data: int, samples: int) -> float:
    """Return the cost of streaming ``num_data`` samples in merges of ``samples`` (and a rest)."""
    samples = max(1, min(samples, num_data))
    full, rest = divmod(num_data, samples)
    cost = full * merge_cost(samples, columns_per_sample, keep, dim, gram_dim)
    if rest:
        cost += merge_cost(rest, columns_per_sample, keep, dim, gram_dim)
    return cost + 2.0 * keep * num_data * (dim + gram_dim * columns_per_sample)


def sketch_cost(columns_per_sample: int, keep: int, dim: int, gram_dim: int,
                num_data: int) -> float:
    """Return the cost of a one-pass sketch: two products with ``V``, then ``D l^2`` work."""
    return (2.0 * keep * num_data * (dim + gram_dim * columns_per_sample)
            + 3.0 * dim * keep * keep)


def dense_cost(dim: int, num_columns: int) -> float:
    """Return the cost of summing ``num_columns`` columns densely (``D^2`` each) and one eigh."""
    return float(num_columns) * dim * dim + EIGH_WEIGHT * float(dim) ** 3


def dense_bytes(dim: int, itemsize: int) -> int:
    """Memory of the dense path: the ``D x D`` sum and its float64 eigendecomposition."""
    return dim * dim * (itemsize + 3 * 8)


def merge_size(columns_per_sample: int, keep: int, dim: int, gram_dim: int, num_data: int,
               limit: int) -> int:
    """Return the samples per merge (``1`` to ``min(limit, num_data)``) minimising the cost."""

    def total(samples: int) -> float:
        return streaming_cost(columns_per_sample, keep, dim, gram_dim, num_data, samples)

    upper = max(1, min(limit, num_data))
    candidates = {min(upper, max(1, round(2 ** (e / 4)))) for e in range(80)}
    candidates |= {-(-num_data // parts) for parts in range(1, 9)} & set(range(1, upper + 1))
    return min(sorted(candidates), key=total)
