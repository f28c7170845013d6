r"""The sketch's random test matrix ``Omega`` (``D x l``), kept per parameter slice.

A matrix-shaped weight's slice holds Khatri-Rao columns ``p_k (x) q_k``, kept as ``p``
(``l x out``) and ``q`` (``l x in``); other slices are Gaussian ``l x d`` tensors.
:class:`BasisOmega` puts warm-start basis columns first.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from lowrank_laplace.factor.blocks import Block, DenseBlock

#: Entries of a Gaussian slice per generator (the draw does not depend on threads).
_TEST_ENTRIES = 2**20
#: The generator of job ``i`` is seeded with ``seed * _SEED_STRIDE + i``.
_SEED_STRIDE = 1_000_003

Part = Union[Tensor, Tuple[Tensor, Tensor]]


def _summed(products: Iterable[Tensor]) -> Tensor:
    """The products' sum, accumulated in place into the first, in order."""
    total = None
    for prod in products:
        total = prod if total is None else total.add_(prod)
    return total


class Omega:
    r"""A ``D x l`` test matrix, entries of variance ``1 / D``, uncorrelated.

    Args:
        cols: Columns ``l``.
        dim: Rows ``D``.
        like: A tensor with the draw's dtype and device.
        seed: Seed; the draw depends only on it, the shapes and the device type.
        shapes: The parameter shapes, in order (``None``: one Gaussian slice).
        kronecker: Give matrix-shaped parameters Khatri-Rao slices.

    Raises:
        ValueError: If the shapes do not hold ``dim`` entries.
    """

    def __init__(self, cols: int, dim: int, like: Tensor, seed: int,
                 shapes: Optional[Sequence[torch.Size]] = None, kronecker: bool = True):
        if shapes is None:
            shapes = [torch.Size([dim])]
        if sum(shape.numel() for shape in shapes) != dim:
            raise ValueError(f"The parameter shapes {list(shapes)} do not hold {dim} entries.")
        self.cols, self.dim = cols, dim
        self.dtype, self.device = like.dtype, like.device
        self.sizes = [shape.numel() for shape in shapes]
        std = dim**-0.5
        parts: List[Optional[Part]] = []
        jobs: List[Tuple[int, Optional[Tensor], Optional[torch.Size]]] = []
        for position, shape in enumerate(shapes):
            if kronecker and len(shape) == 2:
                parts.append(None)  # filled by its job
                jobs.append((position, None, shape))
                continue
            part = torch.empty(cols, shape.numel(), dtype=like.dtype, device=like.device)
            parts.append(part)
            rows = max(1, _TEST_ENTRIES // max(shape.numel(), 1))
            jobs.extend((position, chunk, None) for chunk in part.split(rows))

        def fill(job: int) -> None:
            generator = torch.Generator(device=like.device)
            generator.manual_seed(seed * _SEED_STRIDE + job)
            position, chunk, shape = jobs[job]
            if shape is None:
                chunk.normal_(0.0, std, generator=generator)
                return
            p, q = (torch.randn(cols, size, generator=generator, dtype=like.dtype,
                                device=like.device) for size in shape)
            parts[position] = (p.mul_(std), q)

        workers = min(len(jobs), torch.get_num_threads()) if like.device.type == "cpu" else 1
        if workers > 1:
            with ThreadPoolExecutor(workers) as pool:  # torch releases the GIL
                list(pool.map(fill, range(len(jobs))))
        else:
            for job in range(len(jobs)):
                fill(job)
        self.parts: List[Part] = parts  # type: ignore[assignment]

    def factors(self, position: int) -> Optional[Tuple[Tensor, Tensor]]:
        """``(p, q)`` of a Khatri-Rao slice, ``None`` for a Gaussian one."""
        part = self.parts[position]
        return part if isinstance(part, tuple) else None

    def slice(self, position: int) -> Tensor:
        """One parameter's slice as an ``l x d`` tensor (a Khatri-Rao slice is formed)."""
        part = self.parts[position]
        if isinstance(part, tuple):
            p, q = part
            return (p[:, :, None] * q[:, None, :]).reshape(self.cols, -1)
        return part

    def dense(self) -> Tensor:
        """The whole matrix, ``(D, l)``: a view of a contiguous ``(l, D)`` tensor."""
        out = torch.empty(self.cols, self.dim, dtype=self.dtype, device=self.device)
        for position, piece in enumerate(out.split(self.sizes, dim=1)):
            piece.copy_(self.slice(position))
        return out.T

    def nbytes(self) -> int:
        """Bytes held (the Khatri-Rao slices only by their factors)."""
        tensors = [t for part in self.parts
                   for t in (part if isinstance(part, tuple) else (part,))]
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, dtype: Optional[torch.dtype] = None,
           device: Optional[torch.device] = None) -> "Omega":
        """The same matrix in another dtype or on another device."""
        other = object.__new__(Omega)
        other.__dict__.update(self.__dict__)
        other.dtype = dtype or self.dtype
        other.device = torch.device(device) if device is not None else self.device

        def move(t: Tensor) -> Tensor:
            return t.to(dtype=other.dtype, device=other.device)

        other.parts = [tuple(move(t) for t in part) if isinstance(part, tuple) else move(part)
                       for part in self.parts]
        return other

    def block_products(self, blocks: Sequence[Block]) -> Tensor:
        """``V^T Omega`` from a factor's blocks (one per slice), ``(M, l)``; slices unformed.

        Each block's product after the first is added into the first's (no temporaries).
        """
        total = None
        for i, block in enumerate(blocks):
            factors = self.factors(i)
            total = block.t_matmul(self.parts[i].T, total) if factors is None \
                else block.t_matmul_khatri_rao(*factors, total)
        return total

    def t_matmul(self, x: Tensor) -> Tensor:
        """``Omega^T x`` for ``x`` of shape ``(D, K)`` (any layout), ``(l, K)``."""
        # a Khatri-Rao slice: the columns of x as rows of an explicit block
        return _summed(self.parts[i] @ xs if self.factors(i) is None
                       else DenseBlock(xs.T).t_matmul_khatri_rao(*self.factors(i)).T
                       for i, xs in enumerate(x.split(self.sizes)))

    def add_to_(self, y: Tensor, alpha: float) -> Tensor:
        """``y += alpha Omega`` in place, for ``y`` of shape ``(D, l)``."""
        for position, ys in enumerate(y.split(self.sizes)):
            pq = self.factors(position)
            if pq is None:
                ys.add_(self.parts[position].T, alpha=alpha)
                continue
            p, q = pq
            rows = ys.T.view(self.cols, p.shape[1], q.shape[1])
            rows.baddbmm_(p[:, :, None], q[:, None, :], alpha=alpha)
        return y

    def gram(self) -> Tensor:
        """``Omega^T Omega``, ``(l, l)``; a Khatri-Rao slice gives ``(p p^T) * (q q^T)``."""
        return _summed((p[0] @ p[0].T) * (p[1] @ p[1].T) if isinstance(p, tuple) else p @ p.T
                       for p in self.parts)


class BasisOmega:
    r"""The test matrix ``[W, Omega]``: a warm start's basis columns before random ones.

    Shares :class:`Omega`'s interface (docs/concepts.md, "One-pass sketch").

    Args:
        basis: ``W``, ``(D, b)`` (copied in ``omega``'s dtype).
        omega: The random columns.
    """

    def __init__(self, basis: Tensor, omega: Omega):
        if basis.shape[0] != omega.dim:
            raise ValueError(f"The basis has {basis.shape[0]} rows, the test matrix {omega.dim}.")
        self.basis = basis.T.to(dtype=omega.dtype, device=omega.device).contiguous()  # (b, D)
        self.omega = omega
        self.cols, self.dim = basis.shape[1] + omega.cols, omega.dim
        self.dtype, self.device, self.sizes = omega.dtype, omega.device, omega.sizes

    def dense(self) -> Tensor:
        """The whole matrix, ``(D, l)``: a view of a contiguous ``(l, D)`` tensor."""
        return torch.cat([self.basis, self.omega.dense().T]).T

    def nbytes(self) -> int:
        """Bytes held."""
        return self.basis.numel() * self.basis.element_size() + self.omega.nbytes()

    def block_products(self, blocks: Sequence[Block]) -> Tensor:
        """``V^T [W, Omega]`` from a factor's blocks (one per slice), ``(M, l)``."""
        own = None
        for block, part in zip(blocks, self.basis.split(self.sizes, dim=1)):
            own = block.t_matmul(part.T, own)  # added into the first, as Omega's
        return torch.cat([own, self.omega.block_products(blocks)], dim=1)

    def t_matmul(self, x: Tensor) -> Tensor:
        """``[W, Omega]^T x`` for ``x`` of shape ``(D, K)``, ``(l, K)``."""
        return torch.cat([self.basis @ x, self.omega.t_matmul(x)])

    def add_to_(self, y: Tensor, alpha: float) -> Tensor:
        """``y += alpha [W, Omega]`` in place, for ``y`` of shape ``(D, l)``."""
        b = self.basis.shape[0]
        y[:, :b].add_(self.basis.T, alpha=alpha)
        self.omega.add_to_(y[:, b:], alpha)
        return y

    def gram(self) -> Tensor:
        """``[W, Omega]^T [W, Omega]``, ``(l, l)``."""
        cross = self.omega.t_matmul(self.basis.T)  # Omega^T W, (l - b, b)
        top = torch.cat([self.basis @ self.basis.T, cross.T], dim=1)
        return torch.cat([top, torch.cat([cross, self.omega.gram()], dim=1)])
