"""Worker side of ``bench_eigh.py``: the compared methods and their measurement.

Holds the implementations of the compared eigen-solvers (``lowrank_laplace``'s
``ggn_eigh`` variants, PyHessian-style power iteration on ``torch.func``
GGN-vector products, SciPy's ``eigsh`` on curvlinops' GGN operator), the untimed
checks of returned eigenvectors, and the worker that times one configuration and
prints its record as JSON on stdout.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks import _harness
from benchmarks._problems import NUM_CLASSES, make_problem

#: ``ours`` variants: name -> (``mc_samples``, whether to sub-sample the batch).
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
RESULT_MARKER = "__BENCH_EIGH_RESULT__"

# Power iteration hyper-parameters (PyHessian defaults).
POWER_MAX_ITER = 100
POWER_TOL = 1e-3

# Shared helpers (see _harness.py)
_num_cores = _harness.num_cores
_maxrss_bytes = _harness.maxrss_bytes
_sync = _harness.sync
_preimport = _harness.preimport


def _cpu_busy_seconds() -> tuple[float | None, float]:
    """Return the busy CPU time of the whole system and of this process.

    Their difference over the timed call is the CPU time that *other* processes
    took from the benchmark (recorded as ``cpu_others_during_percent``). The
    system-wide count is :func:`_harness.system_busy_cpu_seconds` (which excludes
    steal time and does not count guest time twice).

    Returns:
        System-wide busy CPU seconds summed over cores (``None`` where unavailable),
        and the CPU seconds (user + system) of this process.
    """
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return _harness.system_busy_cpu_seconds(), usage.ru_utime + usage.ru_stime


###############################################################################
#                           GGN-vector products                               #
###############################################################################


class GGNVectorProduct:
    """Mini-batch GGN-vector products of a cross-entropy loss via ``torch.func``.

    The product ``G v = J^T H J v`` is computed as (i) a forward-mode
    Jacobian-vector product ``J v`` of the model output, (ii) multiplication with
    the analytic Hessian of the (mean-reduced) cross-entropy loss w.r.t. the
    logits, ``H_n = (diag(p_n) - p_n p_n^T) / N``, and (iii) a reverse-mode
    vector-Jacobian product whose forward pass is computed once and cached (like
    PyHessian caches the gradient graph).

    Vectors are flat tensors of length ``D`` ordered like ``model.parameters()``.

    Attributes:
        num_products: Number of GGN-vector products computed so far.
    """

    def __init__(self, model: nn.Module, loss_func: nn.CrossEntropyLoss, X: Tensor, y: Tensor):
        """Set up the forward pass and the cached VJP.

        Args:
            model: The network.
            loss_func: Cross-entropy loss; its ``reduction`` must be ``'mean'`` or
                ``'sum'``.
            X: Mini-batch inputs.
            y: Mini-batch labels (unused by the GGN of the cross-entropy loss, but
                kept for a uniform signature).

        Raises:
            ValueError: If the loss function is not supported.
        """
        from torch.func import vjp

        supported = isinstance(loss_func, nn.CrossEntropyLoss) and (
            loss_func.reduction in {"mean", "sum"}
        )
        if not supported:
            raise ValueError("Only CrossEntropyLoss with mean/sum reduction supported.")

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = tuple(p.detach() for _, p in named)
        self._shapes = [p.shape for p in self._params]
        self._numels = [p.numel() for p in self._params]
        self.dim = sum(self._numels)
        self._model = model
        self._X = X
        self.num_products = 0

        out, self._vjp_fn = vjp(self._f, *self._params)
        out = out.detach()
        scale = 1.0 / X.shape[0] if loss_func.reduction == "mean" else 1.0
        self._probs = out.softmax(dim=-1)
        self._scale = scale

    def _f(self, *params: Tensor) -> Tensor:
        """Evaluate the model functionally.

        Args:
            *params: Model parameters.

        Returns:
            The model output (logits) on the mini-batch.
        """
        from torch.func import functional_call

        return functional_call(self._model, dict(zip(self._names, params)), (self._X,))

    def _unflatten(self, v: Tensor) -> tuple[Tensor, ...]:
        """Convert a flat vector into parameter-shaped tensors.

        Args:
            v: Flat vector of length ``D``.

        Returns:
            Tensors with the shapes of the parameters.
        """
        return tuple(t.reshape(s) for t, s in zip(v.split(self._numels), self._shapes))

    def __call__(self, v: Tensor) -> Tensor:
        """Multiply the mini-batch GGN onto a flat vector.

        Args:
            v: Flat vector of length ``D``.

        Returns:
            Flat vector ``G v``.
        """
        from torch.func import jvp

        with torch.no_grad():
            _, Jv = jvp(self._f, self._params, self._unflatten(v))
            p = self._probs
            HJv = self._scale * (p * Jv - p * (p * Jv).sum(dim=-1, keepdim=True))
        Gv = self._vjp_fn(HJv)
        self.num_products += 1
        return torch.cat([g.detach().flatten() for g in Gv])


###############################################################################
#                             Peer methods                                    #
###############################################################################


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
    """PyHessian-style power iteration with deflation for the top-k eigenpairs.

    Follows ``pyhessian.hessian.eigenvalues``: for each eigenpair, start from a
    random normalized vector, and repeat (orthonormalize against the previously
    found eigenvectors, multiply with the matrix, Rayleigh quotient, normalize)
    until the relative change of the eigenvalue estimate drops below ``tol`` or
    ``max_iter`` products were used.

    Args:
        ggnvp: Function computing matrix-vector products with the flat vector.
        dim: Dimension ``D`` of the matrix.
        k: Number of leading eigenpairs.
        max_iter: Maximum number of matrix-vector products per eigenpair.
        tol: Relative tolerance on the change of the eigenvalue estimate.
        device: Device of the vectors.
        dtype: Data type of the vectors.
        generator: Random number generator for the initial vectors.

    Returns:
        Eigenvalues of shape ``(k,)`` (in the order found, i.e. approximately
        descending) and eigenvectors of shape ``(D, k)``.
    """
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
            tmp_eigenvalue = (Gv @ v).item()
            v = Gv / (Gv.norm() + 1e-6)
            if eigenvalue is None:
                eigenvalue = tmp_eigenvalue
            elif abs(eigenvalue - tmp_eigenvalue) / (abs(eigenvalue) + 1e-6) < tol:
                eigenvalue = tmp_eigenvalue
                break
            else:
                eigenvalue = tmp_eigenvalue
        eigenvalues.append(eigenvalue)
        eigenvectors.append(v)

    return torch.tensor(eigenvalues), torch.stack(eigenvectors, dim=1)


def eigsh_curvlinops(
    model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor, k: int
) -> tuple[Tensor, Tensor, int]:
    """Top-k GGN eigenpairs with SciPy's ``eigsh`` on curvlinops' GGN operator.

    The curvlinops operator is a PyTorch linear operator; it is exported to SciPy
    with ``to_scipy(dtype=float32)``. The deterministic check (which costs extra
    forward-backward passes) is disabled. Operator construction is included in the
    measured time as part of the method.

    Args:
        model: The network.
        loss_func: Loss function.
        X: Mini-batch inputs.
        y: Mini-batch labels.
        k: Number of leading eigenpairs.

    Returns:
        Eigenvalues ``(k,)`` in descending order, eigenvectors ``(D, k)`` and the
        number of GGN-vector products used.
    """
    return _harness.ggn_eigsh(model, loss_func, [(X, y)], X.shape[0], k)


###############################################################################
#                                  Worker                                     #
###############################################################################


def _verify(ggnvp: GGNVectorProduct, evecs: Tensor, device: torch.device) -> dict[str, Any]:
    """Check returned eigenvectors with independent GGN-vector products.

    Args:
        ggnvp: GGN-vector product (independent of the benchmarked method).
        evecs: Eigenvectors of shape ``(D, k)``.
        device: Device for the products.

    Returns:
        Rayleigh quotients ``v_i^T G v_i``, relative residuals
        ``||G v_i - r_i v_i|| / |r_i|`` and the orthonormality error
        ``max |V^T V - I|`` (for unit-normalized columns in the residuals).
    """
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
    return {
        "rayleigh": rayleigh,
        "rel_residual": residual,
        "orthonormality_error": ortho_err,
    }


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Run a single configuration and measure time and memory of the call.

    Args:
        args: Parsed command line arguments of the worker.

    Returns:
        The record of this configuration. Besides time and memory, it contains
        the eigenvalues and (unless ``--no-verify``) untimed checks of the
        eigenvectors with independent GGN-vector products: Rayleigh quotients and
        relative residuals w.r.t. the full mini-batch GGN (``rayleigh``,
        ``rel_residual``) and, for sub-sampled variants, w.r.t. the GGN on the
        sub-sample (``sub_rayleigh``, ``sub_rel_residual``).
    """
    device = torch.device(args.device)
    threads = args.threads or _num_cores()
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)

    record: dict[str, Any] = {
        "problem": args.problem,
        "method": args.method,
        "label": PAPER_LABELS.get(args.method, args.method),
        "N": args.N,
        "k": args.k,
        "device": str(device),
        "threads": threads,
        "status": "error",
    }

    model, loss_func, X, y = make_problem(
        args.problem, args.N, seed=args.seed, device=device, dtype=torch.float32
    )
    D = sum(p.numel() for p in model.parameters())
    C = NUM_CLASSES[args.problem]
    record.update({"D": D, "C": C})

    # Prepare the call (imports and argument preparation are not timed)
    extra: dict[str, Any] = {}
    if args.method in OURS_CASES:
        import lowrank_laplace as ll

        mc_samples, subsample, low_memory = OURS_CASES[args.method]
        subsampling = list(range(args.N // 8)) if subsample else None
        extra.update(
            {
                "mc_samples": mc_samples,
                "low_memory": low_memory,
                "subsampling_size": (len(subsampling) if subsampling is not None else None),
            }
        )

        def call() -> tuple[Tensor, Tensor]:
            torch.manual_seed(args.seed)
            result = ll.ggn_eigh(
                model,
                loss_func,
                X,
                y,
                top_k=args.k,
                mc_samples=mc_samples,
                subsampling=subsampling,
                low_memory=low_memory,
            )
            return result.eigenvalues, result.eigenvectors

    elif args.method == "power":

        def call() -> tuple[Tensor, Tensor]:
            ggnvp = GGNVectorProduct(model, loss_func, X, y)
            generator = torch.Generator().manual_seed(args.seed)
            evals, evecs = power_iteration(
                ggnvp, ggnvp.dim, args.k, device=device, generator=generator
            )
            extra["num_products"] = ggnvp.num_products
            return evals, evecs

    elif args.method == "eigsh":
        import curvlinops  # noqa: F401
        import scipy.sparse.linalg  # noqa: F401

        def call() -> tuple[Tensor, Tensor]:
            evals, evecs, count = eigsh_curvlinops(model, loss_func, X, y, args.k)
            extra["num_products"] = count
            return evals, evecs

    else:
        raise ValueError(f"Unknown method {args.method!r}. Available: {METHODS}.")
    _preimport()

    # Memory baseline right before the call
    gc.collect()
    cuda_before = _harness.cuda_baseline(device)
    rss_before = _maxrss_bytes()
    try:
        import psutil

        record["rss_current_before_bytes"] = psutil.Process().memory_info().rss
    except ImportError:  # pragma: no cover
        pass

    sys_before, own_before = _cpu_busy_seconds()
    _sync(device)
    start = time.perf_counter()
    evals, evecs = call()
    _sync(device)
    record["time_s"] = time.perf_counter() - start
    sys_after, own_after = _cpu_busy_seconds()
    if sys_before is not None:
        # CPU used by *other* processes during the call, in % of all cores
        others = (sys_after - sys_before) - (own_after - own_before)
        capacity = record["time_s"] * (os.cpu_count() or 1)
        record["cpu_others_during_percent"] = max(0.0, 100 * others / capacity)
    record["cpu_own_during_s"] = own_after - own_before

    rss_after = _maxrss_bytes()
    record["rss_peak_bytes"] = rss_after
    record["rss_baseline_bytes"] = rss_before
    record["rss_peak_delta_bytes"] = max(0, rss_after - rss_before)
    record.update(
        _harness.peak_memory(device, cuda_before, rss_after, record["rss_peak_delta_bytes"])
    )
    if device.type == "cuda":
        record["cuda_baseline_bytes"] = cuda_before
        record["cuda_peak_delta_bytes"] = record["peak_delta_bytes"]
    record.update(extra)

    # Inspect the result (not timed)
    evals = torch.as_tensor(evals).detach().flatten().cpu().double()
    evecs = torch.as_tensor(evecs).detach()
    record["eigenvalues_raw"] = evals.tolist()
    record["eigenvalues_descending"] = bool(
        (evals[:-1] >= evals[1:]).all().item() if evals.numel() > 1 else True
    )
    order = evals.argsort(descending=True)
    record["eigenvalues"] = evals[order].tolist()
    record["eigenvectors_shape"] = list(evecs.shape)
    problems = []
    if evals.numel() != args.k:
        problems.append(f"expected {args.k} eigenvalues, got {evals.numel()}")
    if list(evecs.shape) != [D, evals.numel()]:
        problems.append(f"eigenvectors shape {list(evecs.shape)} != [{D}, K]")
    if args.method in OURS_CASES and not record["eigenvalues_descending"]:
        # part of the library's contract; power iteration makes no such promise
        problems.append("eigenvalues not in descending order")
    if not torch.isfinite(evals).all():
        problems.append("non-finite eigenvalues")
    if problems:
        record["warnings"] = problems

    if args.verify and list(evecs.shape) == [D, evals.numel()]:
        # w.r.t. the full mini-batch GGN
        ggnvp = GGNVectorProduct(model, loss_func, X, y)
        record.update(_verify(ggnvp, evecs[:, order], device))
        # w.r.t. the GGN on the sub-sampled mini-batch (target of ``*_sub``)
        if args.method in OURS_CASES and OURS_CASES[args.method][1]:
            sub = list(range(args.N // 8))
            ggnvp_sub = GGNVectorProduct(model, loss_func, X[sub], y[sub])
            checks = _verify(ggnvp_sub, evecs[:, order], device)
            record["sub_rayleigh"] = checks["rayleigh"]
            record["sub_rel_residual"] = checks["rel_residual"]

    record["status"] = "ok"
    return record


def worker_main(args: argparse.Namespace):
    """Run the worker and print its record as JSON on stdout.

    Args:
        args: Parsed command line arguments of the worker.
    """
    try:
        record = run_worker(args)
    except BaseException as exc:  # noqa: BLE001 (report every failure)
        record = {
            "problem": args.problem,
            "method": args.method,
            "N": args.N,
            "k": args.k,
            **_harness.failure_record(exc),
        }
    _harness.emit(RESULT_MARKER, record)
