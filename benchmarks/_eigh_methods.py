"""Worker side of ``bench_eigh.py``: the compared eigen-solvers, the untimed checks of
their eigenvectors and the worker that times one configuration."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks._problems import NUM_CLASSES, make_problem
from benchmarks._worker import DEFAULT_PREIMPORTS, ggn_eigsh, run_phases, worker_setup

#: ``ours`` variants: (mc_samples, curvature on N/8 samples, low_memory two-pass mode).
OURS_CASES: dict[str, tuple[int, bool, bool]] = {
    "ours_exact_full": (0, False, False),
    "ours_exact_sub": (0, True, False),
    "ours_mc_full": (1, False, False),
    "ours_mc_sub": (1, True, False),
    "ours_exact_full_2pass": (0, False, True),
}
#: Labels used in the ViViT paper for the ``ours`` variants.
PAPER_LABELS: dict[str, str] = {
    "ours_exact_full": "vivit exact mb",
    "ours_exact_sub": "vivit exact sub",
    "ours_mc_full": "vivit mc mb",
    "ours_mc_sub": "vivit mc sub",
    "ours_exact_full_2pass": "vivit exact mb, low_memory",
    "power": "power iteration",
    "eigsh": "eigsh (Lanczos)",
}
METHODS: tuple[str, ...] = (*OURS_CASES, "power", "eigsh")

# Power iteration hyper-parameters (PyHessian defaults).
POWER_MAX_ITER = 100
POWER_TOL = 1e-3


class GGNVectorProduct:
    """Mini-batch GGN-vector products ``G v = J^T H J v`` of a cross-entropy loss (mean or
    sum; ``y`` unused) via ``torch.func``: a forward-mode ``J v``, the logits' Hessian
    ``H_n = (diag(p_n) - p_n p_n^T) / N`` and a reverse-mode product whose forward pass is
    cached (as PyHessian caches the gradient graph); ``num_products`` counts them."""

    def __init__(self, model: nn.Module, loss_func: nn.CrossEntropyLoss, X: Tensor, y: Tensor):
        from torch.func import vjp

        if not isinstance(loss_func, nn.CrossEntropyLoss) or \
                loss_func.reduction not in {"mean", "sum"}:
            raise ValueError("Only CrossEntropyLoss with mean/sum reduction supported.")

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = tuple(p.detach() for _, p in named)
        self._shapes = [p.shape for p in self._params]
        self._numels = [p.numel() for p in self._params]
        self.dim = sum(self._numels)
        self._model, self._X, self.num_products = model, X, 0
        out, self._vjp_fn = vjp(self._f, *self._params)
        self._probs = out.detach().softmax(dim=-1)
        self._scale = 1.0 / X.shape[0] if loss_func.reduction == "mean" else 1.0

    def _f(self, *params: Tensor) -> Tensor:
        """The model's output (logits) on the mini-batch, as a function of the parameters."""
        from torch.func import functional_call

        return functional_call(self._model, dict(zip(self._names, params)), (self._X,))

    def _unflatten(self, v: Tensor) -> tuple[Tensor, ...]:
        """A flat vector of length ``D`` as parameter-shaped tensors."""
        return tuple(t.reshape(s) for t, s in zip(v.split(self._numels), self._shapes))

    def __call__(self, v: Tensor) -> Tensor:
        """``G v`` for a flat vector ``v`` of length ``D``."""
        from torch.func import jvp

        with torch.no_grad():
            _, Jv = jvp(self._f, self._params, self._unflatten(v))
            p = self._probs
            HJv = self._scale * (p * Jv - p * (p * Jv).sum(dim=-1, keepdim=True))
        Gv = self._vjp_fn(HJv)
        self.num_products += 1
        return torch.cat([g.detach().flatten() for g in Gv])


def power_iteration(
    ggnvp: Callable[[Tensor], Tensor],
    dim: int,
    k: int,
    max_iter: int = POWER_MAX_ITER,
    tol: float = POWER_TOL,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """PyHessian-style power iteration with deflation (``pyhessian.hessian.eigenvalues``):
    per eigenpair, from a random vector, orthonormalize against those found, multiply,
    Rayleigh quotient, normalize, until the estimate changes by less than ``tol``
    (relative) or after ``max_iter`` products; eigenvalues ``(k,)`` as found, vectors
    ``(D, k)``."""
    eigenvalues: list[float] = []
    eigenvectors: list[Tensor] = []

    def orthonormalize(w: Tensor) -> Tensor:
        for u in eigenvectors:
            w = w - (w @ u) * u
        return w / (w.norm() + 1e-6)

    for _ in range(k):
        v = torch.randn(dim, generator=generator, dtype=dtype).to(device)
        v = v / v.norm()
        eigenvalue: float | None = None
        for _ in range(max_iter):
            v = orthonormalize(v)
            Gv = ggnvp(v)
            previous, eigenvalue = eigenvalue, (Gv @ v).item()
            v = Gv / (Gv.norm() + 1e-6)
            if previous is not None and abs(previous - eigenvalue) / (abs(previous) + 1e-6) < tol:
                break
        eigenvalues.append(eigenvalue)
        eigenvectors.append(v)

    return torch.tensor(eigenvalues), torch.stack(eigenvectors, dim=1)


def _verify(ggnvp: GGNVectorProduct, evecs: Tensor, device: torch.device) -> dict[str, Any]:
    """Check eigenvectors ``(D, k)`` with independent GGN-vector products: Rayleigh
    quotients ``r_i``, relative residuals ``||G v_i - r_i v_i|| / |r_i|`` (unit columns)
    and the orthonormality error ``max |V^T V - I|``."""
    V = evecs.to(device=device, dtype=torch.float32)
    gram = V.T @ V
    ortho_err = (gram - torch.eye(V.shape[1], device=device)).abs().max().item()
    rayleigh, residual = [], []
    for i in range(V.shape[1]):
        v = V[:, i] / V[:, i].norm()
        Gv = ggnvp(v)
        r = (v @ Gv).item()
        rayleigh.append(r)
        residual.append(((Gv - r * v).norm() / max(abs(r), 1e-30)).item())
    return {"rayleigh": rayleigh, "rel_residual": residual, "orthonormality_error": ortho_err}


def _ours(model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor, config: dict,
          extra: dict) -> Callable[[], tuple[Tensor, Tensor]]:
    """``ggn_eigh`` in the variant of :data:`OURS_CASES`."""
    import lowrank_laplace as ll

    mc_samples, subsample, low_memory = OURS_CASES[config["method"]]
    subsampling = list(range(config["N"] // 8)) if subsample else None
    extra.update(mc_samples=mc_samples, low_memory=low_memory,
                 subsampling_size=None if subsampling is None else len(subsampling))

    def call() -> tuple[Tensor, Tensor]:
        torch.manual_seed(config["seed"])
        result = ll.ggn_eigh(model, loss_func, X, y, top_k=config["k"], mc_samples=mc_samples,
                             subsampling=subsampling, low_memory=low_memory)
        return result.eigenvalues, result.eigenvectors

    return call


def _power(model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor, config: dict,
           extra: dict) -> Callable[[], tuple[Tensor, Tensor]]:
    """Power iteration on ``torch.func`` GGN-vector products (their set-up is timed)."""
    def call() -> tuple[Tensor, Tensor]:
        ggnvp = GGNVectorProduct(model, loss_func, X, y)
        generator = torch.Generator().manual_seed(config["seed"])
        evals, evecs = power_iteration(ggnvp, ggnvp.dim, config["k"], device=X.device,
                                       generator=generator)
        extra["num_products"] = ggnvp.num_products
        return evals, evecs

    return call


def _eigsh(model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor, config: dict,
           extra: dict) -> Callable[[], tuple[Tensor, Tensor]]:
    """SciPy's ``eigsh`` on curvlinops' GGN operator (its construction is timed)."""
    import curvlinops  # noqa: F401

    def call() -> tuple[Tensor, Tensor]:
        evals, evecs, extra["num_products"] = ggn_eigsh(model, loss_func, [(X, y)], len(y),
                                                        config["k"])
        return evals, evecs

    return call


#: Method -> the builder of its measured call.
CALLS: dict[str, Callable] = {**dict.fromkeys(OURS_CASES, _ours), "power": _power,
                              "eigsh": _eigsh}


def inspect(out: tuple[Tensor, Tensor], model: nn.Module, loss_func: nn.Module, X: Tensor,
            y: Tensor, config: dict) -> dict[str, Any]:
    """Untimed checks of a result: eigenvalues, shapes and (``verify``) its eigenvectors."""
    evals = torch.as_tensor(out[0]).detach().flatten().cpu().double()
    evecs = torch.as_tensor(out[1]).detach()
    D, k = sum(p.numel() for p in model.parameters()), config["k"]
    order = evals.argsort(descending=True)
    record: dict[str, Any] = {
        "eigenvalues_raw": evals.tolist(), "eigenvalues": evals[order].tolist(),
        "eigenvalues_descending": bool((evals[:-1] >= evals[1:]).all().item()
                                       if evals.numel() > 1 else True),
        "eigenvectors_shape": list(evecs.shape)}
    problems = []
    if evals.numel() != k:
        problems.append(f"expected {k} eigenvalues, got {evals.numel()}")
    if list(evecs.shape) != [D, evals.numel()]:
        problems.append(f"eigenvectors shape {list(evecs.shape)} != [{D}, K]")
    if config["method"] in OURS_CASES and not record["eigenvalues_descending"]:
        # part of the library's contract; power iteration makes no such promise
        problems.append("eigenvalues not in descending order")
    if not torch.isfinite(evals).all():
        problems.append("non-finite eigenvalues")
    if problems:
        record["warnings"] = problems
    if config["verify"] and list(evecs.shape) == [D, evals.numel()]:
        record.update(_verify(GGNVectorProduct(model, loss_func, X, y), evecs[:, order],
                              X.device))
        if config["method"] in OURS_CASES and OURS_CASES[config["method"]][1]:
            sub = list(range(config["N"] // 8))
            checks = _verify(GGNVectorProduct(model, loss_func, X[sub], y[sub]),
                             evecs[:, order], X.device)
            record["sub_rayleigh"] = checks["rayleigh"]
            record["sub_rel_residual"] = checks["rel_residual"]
    return record


def worker_main(config: dict[str, Any]):
    """Run one configuration: the ``eigh`` phase, then the untimed checks of its result."""
    setup = worker_setup(config)
    torch.manual_seed(config["seed"])
    model, loss_func, X, y = make_problem(config["problem"], config["N"], seed=config["seed"],
                                          device=config["device"], dtype=torch.float32)
    setup.update(D=sum(p.numel() for p in model.parameters()), C=NUM_CLASSES[config["problem"]],
                 label=PAPER_LABELS.get(config["method"], config["method"]))
    extra: dict[str, Any] = {}
    call = CALLS[config["method"]](model, loss_func, X, y, config, extra)

    def describe(out: tuple[Tensor, Tensor]) -> dict[str, Any]:
        return {**extra, **inspect(out, model, loss_func, X, y, config)}

    run_phases(setup, [("eigh", call, describe)], config, preimports=DEFAULT_PREIMPORTS)
