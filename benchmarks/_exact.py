"""The exact full-GGN Laplace posterior of a small network, in float64 (``bench_faithful``).

laplace-torch's GGN over the training set, ``G = sum_n J_n^T Lambda_n J_n = A^T A`` (rows
of ``A``: ``s_nk^T J_n`` with ``Lambda_n = S_n S_n^T``; ``J_n`` from ``torch.func``), is
held densely in the smaller space: ``G`` (``D x D``) or the Gram matrix ``K = A A^T``
(``M x M``), whose eigenvectors ``w`` give ``G``'s as ``A^T w / sqrt(lambda)``.

Shape glossary:
    D: parameters; N: training inputs; C: outputs; K: loss-factor columns per input
    (``C - 1`` for the softmax cross-entropy, ``C`` for regression); M = N K; B: batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import Tensor, nn

Inputs = Union[Tensor, Mapping[str, Tensor]]
#: Spaces the dense matrix can live in.
SPACES = ("parameters", "gram", "auto")


def trainable_names(model: nn.Module) -> list[str]:
    """Names of the parameters laplace-torch's ``"all"`` covers (those requiring grad)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def num_inputs(inputs: Inputs) -> int:
    """Number of inputs in a tensor or a dict of tensors."""
    return len(next(iter(inputs.values()))) if isinstance(inputs, Mapping) else len(inputs)


def take(inputs: Inputs, index: Union[slice, Tensor]) -> Inputs:
    """Rows ``index`` of a tensor or of every tensor of a dict."""
    if isinstance(inputs, Mapping):
        return {key: value[index] for key, value in inputs.items()}
    return inputs[index]


def chunks(inputs: Inputs, size: int) -> Iterator[Inputs]:
    """Consecutive chunks of at most ``size`` inputs."""
    total = num_inputs(inputs)
    for start in range(0, total, size):
        yield take(inputs, slice(start, min(start + size, total)))


def jacobians(model: nn.Module, names: Sequence[str], inputs: Inputs) -> tuple[Tensor, Tensor]:
    """Per-input Jacobians ``(B, C, D)`` of the outputs w.r.t. the named parameters (in
    the order of the flattened vector) and the outputs ``(B, C)`` (``torch.func``)."""
    from torch.func import functional_call, jacrev, vmap

    state = {k: v.detach() for k, v in model.named_parameters()}
    state.update({k: v.detach() for k, v in model.named_buffers()})
    chosen = {name: state.pop(name) for name in names}

    def single(params, x):
        batch = ({k: v.unsqueeze(0) for k, v in x.items()} if isinstance(x, Mapping)
                 else x.unsqueeze(0))
        out = functional_call(model, {**state, **params}, (batch,))
        return out.squeeze(0), out.squeeze(0)

    jac, out = vmap(jacrev(single, has_aux=True), in_dims=(None, 0))(chosen, inputs)
    flat = torch.cat([jac[name].flatten(2) for name in names], dim=2)
    return flat, out


def loss_sqrt(logits: Tensor, likelihood: str, sigma: float = 1.0) -> Tensor:
    """Square roots ``S_n`` ``(B, C, K)`` of the loss Hessians ``Lambda_n = S_n S_n^T`` of
    outputs ``(B, C)``: the softmax Hessian's ``C - 1`` nonzero eigen-directions
    (``"classification"``), or ``I / sigma`` (``"regression"``)."""
    if likelihood == "regression":
        eye = torch.eye(logits.shape[1], dtype=logits.dtype)
        return eye.expand(logits.shape[0], -1, -1) / sigma
    p = torch.softmax(logits, dim=-1)
    hessian = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    evals, evecs = torch.linalg.eigh(hessian)  # ascending: the first is the null one
    return evecs[:, :, 1:] * evals[:, None, 1:].clamp(min=0).sqrt()


def factor_rows(model: nn.Module, names: Sequence[str], inputs: Inputs, likelihood: str,
                sigma: float = 1.0, chunk: int = 64) -> Iterator[Tensor]:
    """Rows of ``A`` (``G = A^T A``) in blocks ``(B K, D)`` of ``chunk`` inputs."""
    for part in chunks(inputs, chunk):
        J, f = jacobians(model, names, part)
        S = loss_sqrt(f, likelihood, sigma)
        yield torch.einsum("bck,bcd->bkd", S, J).reshape(-1, J.shape[-1])


def _top_eigenpairs(matrix: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest eigenpairs of a dense symmetric matrix (ARPACK, tol 0)."""
    from scipy.sparse.linalg import eigsh

    n = matrix.shape[0]
    if k >= n - 1:
        values, vectors = torch.linalg.eigh(matrix)
        return values.flip(0)[:k], vectors.flip(1)[:, :k]
    dense = matrix.numpy()
    start = np.random.default_rng(0).standard_normal(n)
    values, vectors = eigsh(dense, k=k, which="LA", v0=start, tol=0)
    order = np.argsort(values)[::-1]
    return (torch.from_numpy(values[order].copy()),
            torch.from_numpy(np.ascontiguousarray(vectors[:, order])))


def marglik_prior(eigenvalues: Tensor, sq_norm: float, low: float = 1e-8,
                  high: float = 1e8) -> float:
    """The scalar prior precision maximising laplace-torch's marginal likelihood: where
    ``sum_i lambda_i / (delta (lambda_i + delta)) = sq_norm`` (``|theta_MAP - prior_mean|^2``;
    decreasing in ``delta``), by bisection in ``log delta`` between ``low`` and ``high``."""
    lam = eigenvalues.double()
    lo, hi = math.log(low), math.log(high)
    for _ in range(200):
        mid = (lo + hi) / 2
        delta = math.exp(mid)
        lo, hi = (mid, hi) if float((lam / (delta * (lam + delta))).sum()) > sq_norm else (lo, mid)
    return math.exp((lo + hi) / 2)


@dataclass
class ExactGGN:
    """The dense GGN of a training set and the exact posterior algebra on it.

    Attributes:
        matrix: ``G`` (``D x D``) or ``K = A A^T`` (``M x M``).
        factor: ``A`` (``M x D``) in the Gram space, ``None`` in the parameter space.
        dim: ``D``.
        eigenvalues: All eigenvalues in the chosen space, descending, clamped at zero.
        trace: ``tr G``.
        seconds: Wall-clock time of assembly and eigenvalues.
    """

    matrix: Tensor
    factor: Optional[Tensor]
    dim: int
    eigenvalues: Tensor
    trace: float
    seconds: dict[str, float] = field(default_factory=dict)
    _chol: dict[float, Tensor] = field(default_factory=dict, repr=False)
    _pairs: Optional[tuple[Tensor, Tensor]] = field(default=None, repr=False)

    @property
    def space(self) -> str:
        """``"parameters"`` or ``"gram"``."""
        return "parameters" if self.factor is None else "gram"

    def top_pairs(self, rank: int) -> tuple[Tensor, Tensor]:
        """The exact top-``rank`` eigenpairs ``(lambda (r,), U (D, r))`` of ``G`` (ARPACK
        on the dense matrix, to machine precision)."""
        if self._pairs is None or self._pairs[0].numel() < rank:
            values, vectors = _top_eigenpairs(self.matrix, rank)
            if self.factor is not None:
                vectors = self.factor.T @ vectors / values.clamp(min=1e-300).sqrt()
            self._pairs = (values, vectors)
        return self._pairs[0][:rank], self._pairs[1][:, :rank]

    def _cholesky(self, delta: float) -> Tensor:
        if delta not in self._chol:
            shifted = self.matrix + delta * torch.eye(len(self.matrix), dtype=self.matrix.dtype)
            self._chol = {delta: torch.linalg.cholesky(shifted)}
        return self._chol[delta]

    def variance(self, J: Tensor, delta: float) -> Tensor:
        """``J_n P^{-1} J_n^T`` ``(B, C, C)`` of Jacobians ``(B, C, D)``, ``P = G + delta I``
        (a Cholesky factor of ``P``, or of ``delta I + K`` by the Woodbury identity)."""
        B, C, D = J.shape
        rows = J.reshape(B * C, D).double()
        L = self._cholesky(delta)
        if self.factor is None:
            half = torch.linalg.solve_triangular(L, rows.T, upper=False)
            cov = half.T @ half
        else:  # P^{-1} = (I - A^T (delta I + K)^{-1} A) / delta
            cross = torch.linalg.solve_triangular(L, self.factor @ rows.T, upper=False)
            cov = (rows @ rows.T - cross.T @ cross) / delta
        index = torch.arange(B)
        return cov.reshape(B, C, B, C)[index, :, index, :]


def build_ggn(model: nn.Module, inputs: Inputs, likelihood: str, sigma: float = 1.0,
              space: str = "auto", chunk: int = 64) -> ExactGGN:
    """Assemble the exact GGN of ``model`` (float64, at its MAP) on all training inputs and
    all its eigenvalues, in ``space`` ``"parameters"``, ``"gram"`` or ``"auto"`` (the
    smaller), ``chunk`` inputs per Jacobian evaluation."""
    import time

    if space not in SPACES:
        raise ValueError(f"space must be one of {SPACES}, got {space!r}.")
    names = trainable_names(model)
    dim = sum(dict(model.named_parameters())[n].numel() for n in names)
    start = time.perf_counter()
    first = next(factor_rows(model, names, take(inputs, slice(0, 1)), likelihood, sigma))
    rows = num_inputs(inputs) * first.shape[0]
    if space == "auto":
        space = "parameters" if dim <= rows else "gram"
    blocks = factor_rows(model, names, inputs, likelihood, sigma, chunk)
    if space == "parameters":
        matrix = torch.zeros(dim, dim, dtype=torch.float64)
        for block in blocks:
            matrix.addmm_(block.T, block)
        factor = None
    else:
        factor = torch.cat(list(blocks))
        matrix = factor @ factor.T
    matrix = (matrix + matrix.T) / 2
    assembled = time.perf_counter()
    eigenvalues = torch.linalg.eigvalsh(matrix).flip(0).clamp(min=0)
    done = time.perf_counter()
    return ExactGGN(matrix, factor, dim, eigenvalues, float(matrix.diagonal().sum()),
                    {"assemble": assembled - start, "eigenvalues": done - assembled})


def probit(f_mu: Tensor, f_var: Tensor) -> Tensor:
    """laplace-torch's probit GLM predictive of output means and covariances."""
    kappa = 1 / torch.sqrt(1.0 + math.pi / 8 * f_var.diagonal(dim1=1, dim2=2))
    return torch.softmax(kappa * f_mu, dim=-1)


def exact_predictive(ggn: ExactGGN, model: nn.Module, inputs: Inputs, delta: float,
                     ranks: Sequence[int], chunk: int = 64) -> dict[str, Any]:
    """The exact GLM predictive of test inputs at prior ``delta``, split at the exact
    top-``r`` eigenpairs for each of ``ranks``.

    Returns:
        ``f_mu (B, C)``, ``f_var (B, C, C)`` and ``split``: per rank, the complement's
        variance (``J P^{-1} J^T`` minus ``(J U_r) diag(1 / (lambda + delta)) (J U_r)^T``,
        traced) and Jacobian energy ``|J|_F^2 - |J U_r|_F^2``, each ``(B,)``.
    """
    names = trainable_names(model)
    top = max(ranks)
    lam, U = ggn.top_pairs(top)
    mus, variances = [], []
    parts: dict[int, dict[str, list[Tensor]]] = {r: {"trace": [], "energy": []} for r in ranks}
    for part in chunks(inputs, chunk):
        J, f = jacobians(model, names, part)
        J = J.double()
        var = ggn.variance(J, delta)
        mus.append(f.double())
        variances.append(var)
        JU = J @ U
        total = var.diagonal(dim1=1, dim2=2).sum(-1)
        energy = (J**2).sum((1, 2))
        for r in ranks:
            kept = ((JU[..., :r] ** 2) / (lam[:r] + delta)).sum((1, 2))
            parts[r]["trace"].append(total - kept)
            parts[r]["energy"].append(energy - (JU[..., :r] ** 2).sum((1, 2)))
    split = {r: {k: torch.cat(v) for k, v in p.items()} for r, p in parts.items()}
    return {"f_mu": torch.cat(mus), "f_var": torch.cat(variances), "split": split}
