r"""A convolution weight's explicit block that keeps its two factors for its Gram matrix.

Row ``(v, n)`` of the block is ``G_vn X_n`` flattened: ``G_vn`` ``(out, P)`` the vector
backpropagated to the layer's ``P`` output positions, ``X_n`` ``(P, Q)`` the sample's
unfolded input patches. Then ``<G_vn X_n, G_wm X_m> = <G_vn (X_n X_m^T), G_wm>``: per pair
of samples ``P^2 Q + V out P^2 + V^2 out P`` multiply-adds instead of the rows'
``V^2 out Q``, far fewer where positions are few (the late layers of a CNN). The rows stay
for every other product (docs/benchmarks/design_measurements.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowrank_laplace.factor.dense_block import DenseBlock, symmetrized

#: The factors' Gram is taken where its multiply-adds are below the rows' by this factor
#: (its products are narrower, so slower per multiply-add).
FACTORED_GRAM_ADVANTAGE = 2.0


def factored_gram_pays(num_vectors: int, out: int, positions: int, patch: int) -> bool:
    """Whether a conv block's Gram is cheaper from its factors than from its rows.

    Args:
        num_vectors: Vectors per sample ``V``.
        out: Output channels.
        positions: Output positions ``P``.
        patch: Entries of one input patch ``Q`` (input channels times kernel size).
    """
    factored = positions * (positions * patch + num_vectors * out * positions
                            + num_vectors**2 * out)
    return FACTORED_GRAM_ADVANTAGE * factored < num_vectors**2 * out * patch


class ConvBlock(DenseBlock):
    """A convolution weight's rows ``(V N, out Q)`` with their factors (see the module).

    Args:
        rows: ``B``, rows in ``(v, n)`` order.
        grads: ``G`` by sample, ``(N, V, out, P)``, contiguous and the block's own (the
            backpropagated matrix may be reused or multiplied in place once the block is
            formed).
        patches: ``X`` ``(N, P, Q)``.
    """

    def __init__(self, rows: Tensor, grads: Tensor, patches: Tensor):
        super().__init__(rows)
        self.grads, self.patches = grads, patches

    @property
    def nbytes(self) -> int:
        """Bytes the block holds, its factors included."""
        return super().nbytes + sum(t.numel() * t.element_size()
                                    for t in (self.grads, self.patches))

    def to(self, dtype: torch.dtype) -> "ConvBlock":
        """See ``Block.to``."""
        if self.dtype == dtype:
            return self
        return ConvBlock(self.rows.to(dtype), self.grads.to(dtype), self.patches.to(dtype))

    def scale_(self, alpha: float) -> "ConvBlock":
        """See ``Block.scale_``."""
        self.rows.mul_(alpha)
        self.grads.mul_(alpha)
        return self

    def take_samples(self, start: int, stop: int, num_vectors: int) -> "ConvBlock":
        """See ``Block.take_samples``: the rows copied, the factors sliced."""
        rows = super().take_samples(start, stop, num_vectors).rows
        return ConvBlock(rows, self.grads[start:stop], self.patches[start:stop])

    def gram(self) -> Tensor:
        """``B B^T`` from the factors, ``(M, M)``, exactly symmetric.

        The patches' Gram ``K`` first; then, for each sample ``m``, ``G_vn K_nm`` of the
        samples ``n <= m`` and its products with ``G_wm``; the other half mirrored.
        """
        num, num_vectors, out, positions = self.grads.shape
        kernel = DenseBlock(self.patches.reshape(num * positions, -1)).gram()
        left = self.grads.view(num, num_vectors * out, positions)
        right = self.grads.view(num, num_vectors, out * positions)
        gram = left.new_empty(num, num_vectors, num, num_vectors)  # [n, v, m, w]
        for m in range(num):
            cols = slice(m * positions, (m + 1) * positions)
            k_nm = kernel[: (m + 1) * positions, cols].view(m + 1, positions, positions)
            left_k = torch.bmm(left[: m + 1], k_nm).view(m + 1, num_vectors, -1)
            block = torch.bmm(left_k, right[m].T.expand(m + 1, -1, -1))  # [n, v, w]
            gram[: m + 1, :, m] = block
            gram[m, :, :m] = block[:m].permute(2, 0, 1)
        rows = num_vectors * num  # the diagonal sample blocks need not be bitwise symmetric
        return symmetrized(gram.permute(1, 0, 3, 2).reshape(rows, rows))
