r"""A linear layer's block of ``V^T``, rows ``vec(s_{vn} z_n^T)`` kept as the factors ``s``, ``z``.

Its methods are documented at ``Block``. Shapes: ``V`` vectors per sample, ``N``
samples, ``M = V N`` rows, ``d = out in`` entries, ``K`` vectors in a product.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional, Tuple

import torch
from torch import Tensor

from lowrank_laplace.factor import weights
from lowrank_laplace.factor.weights import SMALL_DTYPE, Weight, weight_slice, weighted_product
from lowrank_laplace.utils.linalg import stored_transposed

#: ``KronBlock.matmul_add_`` (docs/benchmarks/design_measurements.md): weights of at
#: most this many entries add into a transposed output by one wide product.
_ONE_PRODUCT_MAX = 2**14
#: Those small layers' per-sample products ``acc`` (``c x K x out``) are formed for
#: chunks of about this many entries, at least this many samples each.
_ACC_ENTRIES = 2**20
_ACC_MIN_ROWS = 16
#: The chunks on a GPU, where each is a few kernel launches a small fit waits on.
_ACC_ENTRIES_DEVICE = 2**24
#: From this many columns (and below 512 samples) one product per output unit.
_PER_UNIT_MIN_COLUMNS = 32
#: ``KronBlock.t_matmul`` forms ``z X`` by one wide product, not one narrow product per
#: output unit (or per column), for at most this many columns...
_ONE_PRODUCT_MAX_COLUMNS = 16
#: ...and of rows stored transposed (the sketch's) for weights of at most this many
#: entries, where it measured faster (docs/benchmarks/design_measurements.md).
_ONE_PRODUCT_MAX_TRANSPOSED = 2**12

if TYPE_CHECKING:
    from lowrank_laplace.factor.blocks import Block


class KronBlock:
    """Linear-layer weight block, rows ``vec(s_{vn} z_n^T)`` ordered ``m = v N + n`` (BackPACK's).

    Args:
        s: Backpropagated vectors at the layer output, ``(V, N, out)``.
        z: Layer inputs, ``(N, in)``.
    """

    #: Kept as factors (see ``Block.factored``).
    factored = True

    def __init__(self, s: Tensor, z: Tensor):
        self.s = s
        self.z = z

    @property
    def num_rows(self) -> int:
        """Rows ``M = V N``."""
        return self.s.shape[0] * self.s.shape[1]

    @property
    def num_vectors(self) -> int:
        """Vectors per sample ``V``."""
        return self.s.shape[0]

    @property
    def num_samples(self) -> int:
        """Samples ``N``."""
        return self.s.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        """The block's dtype (of its backpropagated vectors)."""
        return self.s.dtype

    @property
    def nbytes(self) -> int:
        """Bytes the block's factors hold."""
        return self.s.numel() * self.s.element_size() + self.z.numel() * self.z.element_size()

    def _flat_s(self) -> Tensor:
        """``s`` as ``(M, out)``."""
        return self.s.reshape(self.num_rows, self.s.shape[2])

    def wide_parts(self, U: Tensor, weight: Weight
                   ) -> Iterator[Tuple["KronBlock", Tensor, Weight]]:
        """See ``Block.wide_parts``: the whole block, ``U`` widened by :meth:`wide_slices`."""
        wide = self.to(SMALL_DTYPE)
        product = 0
        for lo, hi, sub in wide.wide_slices(U.shape[1]):
            product = product + weighted_product(sub, U, weight, slice(lo, hi))
        yield wide, product, weight_slice(weight, slice(None))

    def wide_slices(self, width: int) -> Iterator[Tuple[int, int, "KronBlock"]]:
        """See ``Block.wide_slices``: slices of output units, rows ``(out, in)`` contiguous."""
        wide = self.to(SMALL_DTYPE)
        in_dim = wide.z.shape[1]
        step = max(1, weights.WIDE_ENTRIES // max(in_dim * width, 1))
        for lo in range(0, wide.s.shape[2], step):
            hi = min(lo + step, wide.s.shape[2])
            yield lo * in_dim, hi * in_dim, KronBlock(wide.s[:, :, lo:hi], wide.z)

    def to(self, dtype: torch.dtype) -> "KronBlock":
        """See ``Block.to`` (still factored)."""
        if self.s.dtype == dtype and self.z.dtype == dtype:
            return self
        return KronBlock(self.s.to(dtype), self.z.to(dtype))

    def scale_(self, alpha: float) -> "KronBlock":
        """See ``Block.scale_``."""
        self.s = self.s * alpha
        return self

    def take_samples(self, start: int, stop: int, num_vectors: int) -> "KronBlock":
        """See ``Block.take_samples`` (still factored, ``s`` copied contiguous)."""
        return KronBlock(self.s[:, start:stop].contiguous(), self.z[start:stop])

    def to_dense(self) -> Tensor:
        """See ``Block.to_dense``."""
        dense = self.s[:, :, :, None] * self.z[None, :, None, :]
        return dense.reshape(self.num_rows, -1)

    def gram(self) -> Tensor:
        """See ``Block.gram``: from the two small Gram matrices of ``s`` and ``z``."""
        return self.cross(self)

    def cross(self, other: Block) -> Tensor:
        """See ``Block.cross``."""
        if not isinstance(other, KronBlock):
            return self.t_matmul(other.to_dense().T)
        (v, n), (v2, n2) = self.s.shape[:2], other.s.shape[:2]
        ss = (self._flat_s() @ other._flat_s().T).reshape(v, n, v2, n2)
        zz = self.z @ other.z.T
        return (ss * zz[None, :, None, :]).reshape(v * n, v2 * n2)

    def row_sq_norms(self) -> Tensor:
        """See ``Block.row_sq_norms``."""
        return ((self.s**2).sum(2) * (self.z**2).sum(1)[None]).flatten()

    def diag_outer(self) -> Tensor:
        """See ``Block.diag_outer`` (not expanded)."""
        return torch.einsum("vno,ni->oi", self.s**2, self.z**2).flatten()

    def t_matmul(self, x: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """See ``Block.t_matmul`` (not expanded)."""
        if out is not None:
            return out.add_(self.t_matmul(x))
        if x.dtype != self.dtype:  # blocks of several dtypes: the wider one
            return self.to(w := torch.promote_types(self.dtype, x.dtype)).t_matmul(x.to(w))
        out_dim, (n, in_dim), k = self.s.shape[2], self.z.shape, x.shape[1]
        if stored_transposed(x):  # read along the rows of x^T: X_k is (out, in)
            x_t = x.T.view(k, out_dim, in_dim)
            if out_dim * in_dim <= _ONE_PRODUCT_MAX_TRANSPOSED:  # z @ (K out, in)^T at once
                zx = (self.z @ x_t.reshape(k * out_dim, in_dim).T).view(n, k, out_dim)
                zx = zx.transpose(1, 2)
            else:  # per column k: z (N, in) @ X_k^T (in, out)
                zx = torch.bmm(self.z.expand(k, n, in_dim), x_t.transpose(1, 2)).permute(1, 2, 0)
        elif k <= _ONE_PRODUCT_MAX_COLUMNS:  # z (N, in) @ X (in, out K): one wide product
            wide = x.reshape(out_dim, in_dim, k).transpose(0, 1).reshape(in_dim, out_dim * k)
            zx = (self.z @ wide).view(n, out_dim, k)
        else:  # per output unit o: z (N, in) @ X_o (in, K); X = x viewed as (out, in, K)
            zx = (self.z @ x.reshape(out_dim, in_dim, k)).transpose(0, 1)
        # per sample n: s_n (V, out) @ zx_n (out, K), zx (N, out, K)
        res = torch.bmm(self.s.transpose(0, 1), zx)  # (N, V, K)
        return res.transpose(0, 1).reshape(self.num_rows, -1)

    def t_matmul_khatri_rao(self, p: Tensor, q: Tensor, out: Optional[Tensor] = None
                            ) -> Tensor:
        r"""Khatri-Rao product: ``(B x)_{vn,k} = (s_{vn}^\top p_k)(z_n^\top q_k)``.

        Into ``out``: one fused multiply-add, no ``M x K`` temporary of the product.
        """
        if p.dtype != self.dtype:  # blocks of several dtypes: the wider one
            wide = torch.promote_types(self.dtype, p.dtype)
            return self.to(wide).t_matmul_khatri_rao(p.to(wide), q.to(wide), out)
        if p.shape[1] != self.s.shape[2] or q.shape[1] != self.z.shape[1]:
            raise ValueError(
                f"Khatri-Rao factors of sizes {p.shape[1]} x {q.shape[1]} do not match "
                f"the block's {self.s.shape[2]} x {self.z.shape[1]}.")
        if out is not None:
            out.view(*self.s.shape[:2], -1).addcmul_(self.s @ p.T, self.z @ q.T)
            return out
        return ((self.s @ p.T) * (self.z @ q.T)).reshape(self.num_rows, -1)

    def matmul(self, y: Tensor) -> Tensor:
        """See ``Block.matmul`` (not expanded)."""
        if y.dtype != self.dtype:  # blocks of several dtypes: the wider one
            return self.to(w := torch.promote_types(self.dtype, y.dtype)).matmul(y.to(w))
        out = y.new_zeros(self.s.shape[2] * self.z.shape[1], y.shape[1])
        return self.matmul_add_(out, y)

    def matmul_add_(self, out: Tensor, y: Tensor) -> Tensor:
        """See ``Block.matmul_add_``; ``out`` may be a view of rows of a ``(K, D)`` tensor."""
        if out.dtype != self.dtype or y.dtype != out.dtype:  # blocks of several dtypes
            return self.to(out.dtype).matmul_add_(out, y.to(out.dtype))
        if y.shape[1] == 0:  # no columns (an empty spectrum)
            return out
        v, n = self.s.shape[:2]
        out_dim, in_dim = self.s.shape[2], self.z.shape[1]
        if stored_transposed(out):
            k = y.shape[1]
            if out_dim * in_dim <= _ONE_PRODUCT_MAX:
                # small layers: acc^T (K out, c) @ z (c, in) per chunk of c samples, in
                # out^T's own layout (K, out, in): the sum adds along its rows
                ys, st = y.reshape(v, n, k).permute(1, 2, 0), self.s.transpose(0, 1)
                entries = _ACC_ENTRIES if y.device.type == "cpu" else _ACC_ENTRIES_DEVICE
                rows = max(_ACC_MIN_ROWS, entries // max(k * out_dim, 1))
                # one buffer for every chunk: fresh pages cost as much as the products
                prod = y.new_zeros(k * out_dim, in_dim)
                buffer = y.new_empty(min(rows, n), k, out_dim)
                for start in range(0, n, rows):
                    stop = min(start + rows, n)
                    acc = torch.bmm(ys[start:stop], st[start:stop], out=buffer[: stop - start])
                    prod.addmm_(acc.view(stop - start, -1).T, self.z[start:stop])
                out.T.view(k, out_dim, in_dim).add_(prod.view(k, out_dim, in_dim))
                return out
            acc = torch.bmm(y.reshape(v, n, k).permute(1, 2, 0), self.s.transpose(0, 1))
            # per column k: out^T_k (out, in) += acc_k (out, N) @ z (N, in)
            out.T.view(k, out_dim, in_dim).baddbmm_(acc.permute(1, 2, 0),
                                                    self.z.expand(k, n, in_dim))
            return out
        acc = self.s.permute(1, 2, 0) @ y.reshape(v, n, -1).transpose(0, 1)  # (N, out, K)
        view = out.view(out_dim, in_dim, -1)
        if n < 512 and acc.shape[2] >= _PER_UNIT_MIN_COLUMNS:
            # per output unit o: z^T (in, N) @ acc_o (N, K), added in place
            view.baddbmm_(self.z.T.expand(out_dim, in_dim, n), acc.transpose(0, 1))
            return out
        # many samples or few columns: one wide product per slab of 16 output units
        for start in range(0, out_dim, 16):
            slab = acc[:, start : start + 16].reshape(n, -1)
            prod = (self.z.T @ slab).view(in_dim, -1, view.shape[2])
            view[start : start + 16].add_(prod.transpose(0, 1))
        return out

    def weighted_gram(self, weight: Weight) -> Tensor:
        """See ``Block.weighted_gram`` (factored for both kinds of weight)."""
        if isinstance(weight, Tensor) and weight.numel() > 1:
            w = weight.reshape(self.s.shape[2], self.z.shape[1])  # (out, in)
            zz = torch.einsum("ni,pi,oi->npo", self.z, self.z, w)
            v, n = self.s.shape[:2]
            return torch.einsum("vno,kpo,npo->vnkp", self.s, self.s, zz).reshape(v * n, v * n)
        return self.gram() * weight

    def sample_gram(self, num_vectors: int, weight: Weight = 1.0) -> Tensor:
        """See ``Block.sample_gram`` (factored for both kinds of weight)."""
        if isinstance(weight, Tensor) and weight.numel() > 1:
            w = weight.reshape(self.s.shape[2], self.z.shape[1])  # (out, in)
            a = (self.z**2) @ w.T  # (N, out)
            return torch.einsum("vno,kno,no->nvk", self.s, self.s, a)
        zz = (self.z**2).sum(1)
        return torch.einsum("vno,kno->nvk", self.s, self.s) * (zz * weight)[:, None, None]
