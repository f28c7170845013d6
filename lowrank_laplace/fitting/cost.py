"""The cost model that sizes a fit: merges, sketches and the dense sum in Gram multiply-adds.

A merge of ``M`` columns into the ``D x k`` basis costs, besides the products with ``V``
that every column pays once (``~2 D k`` per sample for factored linear weights,
``2 D_gram k`` per column for the rest), a few memory passes over the basis (``~180 D
k``), a float64 eigendecomposition of size ``k + M`` (``EIGH_WEIGHT (k + M)^3``), the
Gram matrix of its columns (``M^2 D_gram``, ``D_gram`` the expanded parameters plus
``out + in`` per factored linear weight) and a fixed ``OVERHEAD``; the weights were
measured on CPU (docs/benchmarks/design_measurements.md).

Shape glossary:
    D: parameters; k: kept eigenpairs (rank + oversampling); M: columns of a merge;
    l: sketch columns.
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
    """Cost of streaming ``num_data`` samples in merges of ``samples`` (remainder included).

    Args:
        columns_per_sample: Columns of ``V`` per sample.
        keep: ``k``.
        dim: ``D``.
        gram_dim: ``D_gram``.
        num_data: Samples streamed.
        samples: Samples per merge.

    Returns:
        The estimated cost.
    """
    samples = max(1, min(samples, num_data))
    full, rest = divmod(num_data, samples)
    cost = full * merge_cost(samples, columns_per_sample, keep, dim, gram_dim)
    if rest:
        cost += merge_cost(rest, columns_per_sample, keep, dim, gram_dim)
    return cost + 2.0 * keep * num_data * (dim + gram_dim * columns_per_sample)


def sketch_cost(columns_per_sample: int, keep: int, dim: int, gram_dim: int,
                num_data: int) -> float:
    """Cost of a one-pass sketch: the two products with ``V`` and the final ``D l^2`` work.

    Args:
        columns_per_sample: Columns of ``V`` per sample.
        keep: ``l``.
        dim: ``D``.
        gram_dim: ``D_gram``.
        num_data: Samples streamed.

    Returns:
        The estimated cost.
    """
    return (2.0 * keep * num_data * (dim + gram_dim * columns_per_sample)
            + 3.0 * dim * keep * keep)


def dense_cost(dim: int, num_columns: int) -> float:
    """Cost of summing ``H`` densely (``D^2`` per column) and one float64 eigh.

    Args:
        dim: ``D``.
        num_columns: Columns of ``V`` over the data.

    Returns:
        The estimated cost.
    """
    return float(num_columns) * dim * dim + EIGH_WEIGHT * float(dim) ** 3


def dense_bytes(dim: int, itemsize: int) -> int:
    """Memory of the dense path: the ``D x D`` sum and its float64 eigendecomposition."""
    return dim * dim * (itemsize + 3 * 8)


def merge_size(columns_per_sample: int, keep: int, dim: int, gram_dim: int, num_data: int,
               limit: int) -> int:
    """Samples per streaming merge that minimise :func:`streaming_cost`.

    Args:
        columns_per_sample: Columns of ``V`` per sample.
        keep: ``k``.
        dim: ``D``.
        gram_dim: ``D_gram``.
        num_data: Samples streamed by this process.
        limit: Largest admissible merge (memory budget).

    Returns:
        The number of samples per merge, in ``[1, max(1, min(limit, num_data))]``.
    """
    def total(samples: int) -> float:
        return streaming_cost(columns_per_sample, keep, dim, gram_dim, num_data, samples)

    upper = max(1, min(limit, num_data))
    candidates = {min(upper, max(1, round(2 ** (e / 4)))) for e in range(80)}
    candidates |= {-(-num_data // parts) for parts in range(1, 9)} & set(range(1, upper + 1))
    return min(sorted(candidates), key=total)
