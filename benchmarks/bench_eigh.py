"""Benchmark top-k eigenpairs of the mini-batch GGN (ViViT paper's run-time figure).

Compares the time and peak memory to obtain the top-``k`` eigenpairs of the
mini-batch generalized Gauss-Newton (GGN) matrix of a ``CrossEntropyLoss``
(``reduction='mean'``) for

- ``ours_*``: ``lowrank_laplace.ggn_eigh`` in four variants (exact or 1-sample
  Monte-Carlo GGN, full mini-batch or the first ``N // 8`` samples),
  corresponding to the paper's "vivit exact mb", "vivit exact sub",
  "vivit mc mb" and "vivit mc sub",
- ``power``: PyHessian-style power iteration with deflation on GGN-vector
  products computed with ``torch.func`` (at most 100 products per eigenpair,
  relative tolerance ``1e-3`` on the eigenvalue estimate),
- ``eigsh``: ``scipy.sparse.linalg.eigsh(k=k, which='LA')`` (ARPACK/Lanczos) on
  curvlinops' ``GGNLinearOperator`` (float32, default tolerance).

Every configuration (method, problem, k) runs in a fresh subprocess (this script
with ``--worker``) that reports wall time and memory of the eigen-solver call only
(model and data creation and imports are excluded) as JSON on stdout. Timeouts,
OOM kills and exceptions are recorded as failures and do not abort the run.

Examples:
    Smoke test (small MLP, N=32, k in {1, 2})::

        python benchmarks/bench_eigh.py --quick

    Full run of the paper's figure on CPU::

        python benchmarks/bench_eigh.py --problems 3c3d 2c2d --N 128 --N-2c2d 64

Results are written to ``<out>/eigh_<problem>.json`` and
``<out>/eigh_<problem>.png``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import resource
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

_problems = importlib.import_module("_problems")
_harness = importlib.import_module("_harness")
EXPECTED_NUM_PARAMS = _problems.EXPECTED_NUM_PARAMS
NUM_CLASSES = _problems.NUM_CLASSES
PROBLEMS = _problems.PROBLEMS
make_problem = _problems.make_problem

#: ``ours`` variants: name -> (``mc_samples``, whether to sub-sample the batch).
OURS_CASES: dict[str, tuple[int, bool]] = {
    "ours_exact_full": (0, False),
    "ours_exact_sub": (0, True),
    "ours_mc_full": (1, False),
    "ours_mc_sub": (1, True),
}
#: Labels used in the ViViT paper for the ``ours`` variants.
PAPER_LABELS: dict[str, str] = {
    "ours_exact_full": "vivit exact mb",
    "ours_exact_sub": "vivit exact sub",
    "ours_mc_full": "vivit mc mb",
    "ours_mc_sub": "vivit mc sub",
    "power": "power iteration",
    "eigsh": "eigsh (Lanczos)",
}
METHODS: tuple[str, ...] = (*OURS_CASES, "power", "eigsh")
REFERENCE = "ours_exact_full"
RESULT_MARKER = "__BENCH_EIGH_RESULT__"

# Targets of the benchmark (ours_exact_full at the largest k).
TARGET_SPEEDUP_POWER = 10.0
TARGET_SPEEDUP_EIGSH = 2.0
# Relative tolerance for the power-vs-eigsh sanity check on the top eigenvalue.
SANITY_RTOL = 1e-2

# Power iteration hyper-parameters (PyHessian defaults).
POWER_MAX_ITER = 100
POWER_TOL = 1e-3

GiB = _harness.GiB
# Warn about competing processes if the CPU was busier than this before a run.
BUSY_WARN_PERCENT = _harness.BUSY_WARN_PERCENT

# Shared helpers (see _harness.py)
_CountingMatvec = _harness.CountingMatvec
_num_cores = _harness.num_cores
_maxrss_bytes = _harness.maxrss_bytes
_sync = _harness.sync
_is_oom = _harness.is_oom
_preimport = _harness.preimport
_verdict = _harness.verdict
worker_env = _harness.worker_env
other_cpu_load = _harness.other_cpu_load
machine_info = _harness.machine_info


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
    import numpy as np
    from curvlinops import GGNLinearOperator
    from scipy.sparse.linalg import LinearOperator, eigsh

    params = [p for p in model.parameters() if p.requires_grad]
    op = GGNLinearOperator(
        model,
        loss_func,
        params,
        [(X, y)],
        check_deterministic=False,
        num_data=X.shape[0],
    ).to_scipy(dtype=np.float32)
    matvec = _CountingMatvec(op.matvec)
    counted = LinearOperator(op.shape, matvec=matvec, dtype=op.dtype)
    evals, evecs = eigsh(counted, k=k, which="LA")
    order = np.argsort(evals)[::-1].copy()
    return (
        torch.from_numpy(evals[order].copy()),
        torch.from_numpy(evecs[:, order].copy()),
        matvec.count,
    )


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
        if str(REPO_ROOT) not in sys.path:
            sys.path.append(str(REPO_ROOT))
        import lowrank_laplace as ll

        mc_samples, subsample = OURS_CASES[args.method]
        subsampling = list(range(args.N // 8)) if subsample else None
        extra.update(
            {
                "mc_samples": mc_samples,
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
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        cuda_before = torch.cuda.memory_allocated(device)
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
    if device.type == "cuda":
        cuda_peak = torch.cuda.max_memory_allocated(device)
        record["cuda_peak_bytes"] = cuda_peak
        record["cuda_baseline_bytes"] = cuda_before
        record["cuda_peak_delta_bytes"] = max(0, cuda_peak - cuda_before)
        record["peak_delta_bytes"] = record["cuda_peak_delta_bytes"]
        record["peak_bytes"] = cuda_peak
    else:
        record["peak_delta_bytes"] = record["rss_peak_delta_bytes"]
        record["peak_bytes"] = rss_after
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
            "status": "oom" if _is_oom(exc) else "error",
            "reason": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
    sys.stdout.flush()
    print(RESULT_MARKER + json.dumps(record), flush=True)


###############################################################################
#                                  Driver                                     #
###############################################################################


def run_subprocess(
    problem: str, method: str, N: int, k: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Run one configuration in a fresh Python process.

    Args:
        problem: Problem name.
        method: Method name.
        N: Mini-batch size.
        k: Number of eigenpairs.
        args: Parsed command line arguments of the driver.

    Returns:
        The worker's record, or a failure record (timeout, killed, crash).
    """
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        f"--problem={problem}",
        f"--method={method}",
        f"--N={N}",
        f"--k={k}",
        f"--device={args.device}",
        f"--seed={args.seed}",
        f"--threads={args.threads}",
    ]
    if not args.verify:
        cmd.append("--no-verify")
    busy = _harness.wait_for_idle_cpu(args.wait_idle)
    base = {
        "problem": problem,
        "method": method,
        "N": N,
        "k": k,
        "cpu_busy_before_percent": busy,
    }
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=args.timeout,
            cwd=REPO_ROOT,
            env=worker_env(args),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {
            **base,
            "status": "timeout",
            "reason": f"timeout after {args.timeout:.0f} s",
            "subprocess_wall_s": time.perf_counter() - start,
        }
    wall = time.perf_counter() - start

    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            record = json.loads(line[len(RESULT_MARKER) :])
            record["subprocess_wall_s"] = wall
            record["cpu_busy_before_percent"] = busy
            if record.get("status") != "ok" and proc.stderr:
                record["stderr_tail"] = proc.stderr[-2000:]
            return record

    status, reason = _harness.classify_exit(proc.returncode)
    return {
        **base,
        "status": status,
        "reason": reason,
        "returncode": proc.returncode,
        "stderr_tail": proc.stderr[-2000:],
        "subprocess_wall_s": wall,
    }


def run_config(
    problem: str, method: str, N: int, k: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Run one configuration ``--repeats`` times, each in a fresh process.

    Args:
        problem: Problem name.
        method: Method name.
        N: Mini-batch size.
        k: Number of eigenpairs.
        args: Parsed command line arguments of the driver.

    Returns:
        The record of the first successful run with ``time_s`` replaced by the
        median over successful runs (all times in ``times_s``) and the peak memory
        by the maximum; the first failure record if no run succeeded.
    """
    runs = []
    for _ in range(max(1, args.repeats)):
        runs.append(run_subprocess(problem, method, N, k, args))
        if runs[-1].get("status") in {"timeout", "oom", "killed"}:
            break  # do not waste time on repeating hopeless runs
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return runs[0]
    record = dict(ok[0])
    record["times_s"] = [r["time_s"] for r in ok]
    record["time_s"] = _harness.median(record["times_s"])
    for key in ("peak_delta_bytes", "peak_bytes"):
        record[key] = max(r[key] for r in ok)
    during = [r.get("cpu_others_during_percent") for r in ok]
    during = [d for d in during if d is not None]
    record["cpu_others_during_percent"] = max(during) if during else None
    busy = [r.get("cpu_busy_before_percent") for r in runs]
    busy = [b for b in busy if b is not None]
    record["cpu_busy_before_percent"] = max(busy) if busy else None
    if len(ok) < len(runs):
        record["failed_repeats"] = [
            {"status": r.get("status"), "reason": r.get("reason")}
            for r in runs
            if r.get("status") != "ok"
        ]
    return record


def _ok(records: Sequence[dict[str, Any]], method: str, k: int) -> dict | None:
    """Find the successful record of a method at a given k.

    Args:
        records: All records of a problem.
        method: Method name.
        k: Number of eigenpairs.

    Returns:
        The record, or ``None`` if there is none or it failed.
    """
    for r in records:
        if r["method"] == method and r["k"] == k and r.get("status") == "ok":
            return r
    return None


def _rel_dev(a: float, b: float) -> float:
    """Relative deviation of ``a`` from ``b``.

    Args:
        a: Value.
        b: Reference value.

    Returns:
        ``|a - b| / |b|``.
    """
    return abs(a - b) / max(abs(b), 1e-30)


def eigenvalue_deviations(
    records: Sequence[dict[str, Any]], methods: Sequence[str], ks: Sequence[int]
) -> dict[str, dict[str, float]]:
    """Compute per-method maximum relative deviations of eigenvalues from eigsh.

    The top eigenvalue of each (method, k) is compared with the top eigenvalue of
    eigsh at the same k (or, if missing, eigsh at any k). All eigenvalues are
    compared against the eigenvalues of the eigsh run with the largest k.

    Args:
        records: All records of a problem.
        methods: Method names.
        ks: Numbers of eigenpairs.

    Returns:
        Dictionary ``method -> {'top': max dev of top eigenvalue, 'all': max dev of
        all eigenvalues}`` (``nan`` if not available).
    """
    eigsh_runs = {k: _ok(records, "eigsh", k) for k in ks}
    eigsh_runs = {k: r for k, r in eigsh_runs.items() if r is not None}
    result: dict[str, dict[str, float]] = {}
    if not eigsh_runs:
        return {m: {"top": math.nan, "all": math.nan} for m in methods}
    largest = eigsh_runs[max(eigsh_runs)]["eigenvalues"]
    for m in methods:
        top, allv = [], []
        for k in ks:
            r = _ok(records, m, k)
            if r is None or not r.get("eigenvalues"):
                continue
            ref = eigsh_runs.get(k, eigsh_runs[max(eigsh_runs)])["eigenvalues"]
            top.append(_rel_dev(r["eigenvalues"][0], ref[0]))
            for a, b in zip(r["eigenvalues"], largest):
                allv.append(_rel_dev(a, b))
        result[m] = {
            "top": max(top) if top else math.nan,
            "all": max(allv) if allv else math.nan,
        }
    return result


def _fmt_time(r: dict[str, Any] | None, failed: dict[str, Any] | None) -> str:
    """Format a time entry of the table.

    Args:
        r: Successful record or ``None``.
        failed: Failed record or ``None``.

    Returns:
        Formatted string.
    """
    if r is not None:
        return f"{r['time_s']:.3g}"
    if failed is not None:
        return failed.get("status", "fail").upper()
    return "-"


def summarize(
    problem: str,
    N: int,
    records: Sequence[dict[str, Any]],
    methods: Sequence[str],
    ks: Sequence[int],
) -> dict[str, Any]:
    """Print tables and target checks, and return the summary.

    Args:
        problem: Problem name.
        N: Mini-batch size used.
        records: All records of the problem.
        methods: Method names.
        ks: Numbers of eigenpairs.

    Returns:
        Summary dictionary (ratios, target checks, deviations).
    """
    D = EXPECTED_NUM_PARAMS[problem]
    C = NUM_CLASSES[problem]
    V_bytes = D * N * C * 4
    summary: dict[str, Any] = {"V_bytes": V_bytes}

    def failed(m: str, k: int) -> dict[str, Any] | None:
        for r in records:
            if r["method"] == m and r["k"] == k and r.get("status") != "ok":
                return r
        return None

    devs = eigenvalue_deviations(records, methods, ks)
    summary["eigenvalue_deviation_from_eigsh"] = devs

    print(f"\n=== {problem}: D = {D:,}, N = {N}, C = {C} ===")
    print(f"size of V (D*N*C*4 bytes, float32): {V_bytes / GiB:.2f} GiB")
    width = max(len(m) for m in methods) + 2
    header = "".join(f"{'k=' + str(k):>10}" for k in ks)
    print(f"\nTime [s]\n{'method':<{width}}{header}{'dev top':>10}{'dev all':>10}")
    for m in methods:
        row = "".join(f"{_fmt_time(_ok(records, m, k), failed(m, k)):>10}" for k in ks)
        print(f"{m:<{width}}{row}{devs[m]['top']:>10.2e}{devs[m]['all']:>10.2e}")
    print("(dev top/all: max relative deviation of the top / all eigenvalues from eigsh)")

    print(
        f"\nPeak memory above baseline [GiB] (absolute peak in parentheses)\n"
        f"{'method':<{width}}" + "".join(f"{'k=' + str(k):>16}" for k in ks)
    )
    for m in methods:
        cells = []
        for k in ks:
            r = _ok(records, m, k)
            if r is None:
                f = failed(m, k)
                cells.append(f"{(f or {}).get('status', '-').upper():>16}")
            else:
                delta, peak = r["peak_delta_bytes"] / GiB, r["peak_bytes"] / GiB
                cells.append(f"{delta:>7.2f} ({peak:5.2f})")
        print(f"{m:<{width}}" + "".join(cells))

    fails = [r for r in records if r.get("status") != "ok"]
    if fails:
        print("\nFailures:")
        for r in fails:
            print(f"  {r['method']} k={r['k']}: {r.get('status')}: {r.get('reason')}")

    warn = [r for r in records if r.get("warnings")]
    for r in warn:
        print(f"  WARNING {r['method']} k={r['k']}: {'; '.join(r['warnings'])}")

    busy = [
        r.get("cpu_busy_before_percent")
        for r in records
        if r.get("cpu_busy_before_percent") is not None
    ]
    if busy and max(busy) > BUSY_WARN_PERCENT:
        n_busy = sum(b > BUSY_WARN_PERCENT for b in busy)
        print(
            f"  WARNING: other processes used up to {max(busy):.0f}% CPU right "
            f"before {n_busy}/{len(busy)} runs; timings may be distorted."
        )
    summary["max_cpu_busy_before_percent"] = max(busy) if busy else None
    # CPU accounting has 10 ms granularity: judge only calls of >= 0.5 s
    during = {
        (r["method"], r["k"]): r["cpu_others_during_percent"]
        for r in records
        if r.get("cpu_others_during_percent") is not None and r["time_s"] >= 0.5
    }
    contended = {key: v for key, v in during.items() if v > BUSY_WARN_PERCENT}
    if contended:
        worst = ", ".join(
            f"{m} k={k} ({v:.0f}%)"
            for (m, k), v in sorted(contended.items(), key=lambda kv: -kv[1])[:6]
        )
        print(
            f"  WARNING: other processes used > {BUSY_WARN_PERCENT:g}% of the CPU "
            f"during {len(contended)}/{len(during)} timed calls; worst: {worst}"
        )
    summary["contended_runs"] = [
        {"method": m, "k": k, "cpu_others_during_percent": v} for (m, k), v in contended.items()
    ]

    kmax = max(ks)
    ref = _ok(records, REFERENCE, kmax)
    note = "" if kmax == 10 else " (targets are defined for k = 10)"
    print(f"\nTargets at k = {kmax}{note}:")
    targets = (("power", TARGET_SPEEDUP_POWER), ("eigsh", TARGET_SPEEDUP_EIGSH))
    for peer, target in targets:
        r = _ok(records, peer, kmax)
        if ref is None or r is None:
            print(f"  {peer}/{REFERENCE}: n/a (missing or failed run)")
            summary[f"speedup_vs_{peer}"] = None
            summary[f"target_vs_{peer}_met"] = None
            continue
        ratio = r["time_s"] / ref["time_s"]
        met = ratio >= target
        summary[f"speedup_vs_{peer}"] = ratio
        summary[f"target_vs_{peer}_met"] = met
        print(
            f"  {peer}/{REFERENCE} = {ratio:.2f} (target >= {target:g}x): "
            f"{'MET' if met else 'NOT MET'}"
        )
    if ref is not None:
        ratio = ref["peak_delta_bytes"] / V_bytes
        summary["ours_peak_delta_over_V"] = ratio
        print(
            f"  peak memory of {REFERENCE}: {ref['peak_delta_bytes'] / GiB:.2f} GiB "
            f"above baseline ({ref['peak_bytes'] / GiB:.2f} GiB absolute) = "
            f"{ratio:.2f} x size of V ({V_bytes / GiB:.2f} GiB)"
        )

    # Sanity check: power iteration vs. eigsh on the top eigenvalue
    if "power" in methods and "eigsh" in methods:
        dev = devs["power"]["top"]
        ok = None if math.isnan(dev) else dev <= SANITY_RTOL
        summary["sanity_power_vs_eigsh"] = {"max_rel_dev_top": dev, "passed": ok}
        print(
            f"\nSanity check power vs eigsh (top eigenvalue, rtol {SANITY_RTOL:g}): "
            f"max rel. dev. {dev:.2e} -> {_verdict(ok)}"
        )
    if REFERENCE in methods and "eigsh" in methods:
        dev = devs[REFERENCE]["all"]
        ok = None if math.isnan(dev) else dev <= SANITY_RTOL
        summary["sanity_ours_vs_eigsh"] = {"max_rel_dev_all": dev, "passed": ok}
        print(
            f"Sanity check {REFERENCE} vs eigsh (all eigenvalues, rtol "
            f"{SANITY_RTOL:g}): max rel. dev. {dev:.2e} -> "
            f"{_verdict(ok)}"
        )
    return summary


def plot(
    problem: str,
    N: int,
    records: Sequence[dict[str, Any]],
    methods: Sequence[str],
    ks: Sequence[int],
    path: Path,
    info: dict[str, Any],
):
    """Plot time and peak memory versus k for each method.

    Args:
        problem: Problem name.
        N: Mini-batch size used.
        records: All records of the problem.
        methods: Method names.
        ks: Numbers of eigenpairs.
        path: Output path of the figure.
        info: Machine information.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    D = EXPECTED_NUM_PARAMS[problem]
    V_bytes = D * N * NUM_CLASSES[problem] * 4
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    markers = "osDv^<>p"
    for i, m in enumerate(methods):
        pts = [(k, _ok(records, m, k)) for k in ks]
        pts = [(k, r) for k, r in pts if r is not None]
        label = f"{m} ({PAPER_LABELS[m]})" if m in OURS_CASES else m
        marker = markers[i % len(markers)]
        if not pts:
            ax_t.plot([], [], marker=marker, label=label + " [failed]")
            ax_m.plot([], [], marker=marker)
            continue
        kk = [k for k, _ in pts]
        ax_t.plot(
            kk,
            [r["time_s"] for _, r in pts],
            marker=markers[i % len(markers)],
            label=label,
        )
        ax_m.plot(
            kk,
            [r["peak_delta_bytes"] / GiB for _, r in pts],
            marker=markers[i % len(markers)],
            label=label,
        )
    ax_m.axhline(
        V_bytes / GiB,
        color="k",
        ls="--",
        lw=1,
        label=f"size of V ({V_bytes / GiB:.2f} GiB)",
    )
    ax_t.set_yscale("log")
    ax_t.set_xlabel("k (number of leading eigenpairs)")
    ax_t.set_ylabel("time [s]")
    ax_t.set_title(f"{problem} (D={D:,}, N={N}): run time")
    ax_m.set_xlabel("k (number of leading eigenpairs)")
    ax_m.set_ylabel("peak memory above baseline [GiB]")
    ax_m.set_title(f"peak memory ({info.get('device_name', '')})", fontsize=9)
    for ax in (ax_t, ax_m):
        ax.set_xticks(list(ks))
        ax.grid(alpha=0.3, which="both")
    ax_t.legend(fontsize=7)
    ax_m.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _dump(
    path: Path,
    problem: str,
    N: int,
    records: list[dict[str, Any]],
    info: dict[str, Any],
    args: argparse.Namespace,
    summary: dict[str, Any] | None = None,
):
    """Write the results of a problem to a JSON file.

    Args:
        path: Output path.
        problem: Problem name.
        N: Mini-batch size used.
        records: All records so far.
        info: Machine information.
        args: Parsed command line arguments of the driver.
        summary: Summary from :func:`summarize` (``None`` while running).
    """
    D, C = EXPECTED_NUM_PARAMS[problem], NUM_CLASSES[problem]
    payload = {
        "problem": problem,
        "N": N,
        "D": D,
        "C": C,
        "V_bytes": D * N * C * 4,
        "ks": list(args.ks),
        "methods": list(args.methods),
        "timeout_s": args.timeout,
        "seed": args.seed,
        "repeats": args.repeats,
        "threads": args.threads or _num_cores(),
        "worker_env": {
            "OPENBLAS_NUM_THREADS": args.blas_threads or None,
            "OMP_WAIT_POLICY": args.omp_wait_policy or None,
        },
        "machine": info,
        "records": records,
        "summary": summary,
    }
    path.write_text(json.dumps(payload, indent=2))


def driver_main(args: argparse.Namespace):
    """Run all configurations, write JSON and figures, print the summary.

    Args:
        args: Parsed command line arguments of the driver.
    """
    if args.quick:
        args.problems = ["mlp"]
        args.ks = [1, 2]
        args.N_mlp = 32 if args.N_mlp is None else args.N_mlp
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info(args.device)
    print(
        f"Machine: {info['cpu_name']} ({info['cpu_count']} CPUs, "
        f"{info['cpu_count_usable']} usable), torch {info['torch']}, "
        f"device {args.device} ({info['device_name']})"
    )

    all_summaries = {}
    for problem in args.problems:
        N = getattr(args, f"N_{problem}", None) or args.N
        print(
            f"\n### Problem {problem}: N = {N}, ks = {args.ks}, methods = {args.methods}",
            flush=True,
        )
        records: list[dict[str, Any]] = []
        json_path = out / f"eigh_{problem}.json"

        for k in args.ks:
            for method in args.methods:
                record = run_config(problem, method, N, k, args)
                records.append(record)
                if record.get("status") == "ok":
                    msg = (
                        f"{record['time_s']:9.3f} s, peak +"
                        f"{record['peak_delta_bytes'] / GiB:.2f} GiB, "
                        f"lambda_1 = {record['eigenvalues'][0]:.6g}"
                    )
                    if "num_products" in record:
                        msg += f", {record['num_products']} GGNVPs"
                    others = record.get("cpu_others_during_percent")
                    if others is not None and others > BUSY_WARN_PERCENT:
                        msg += f" [other processes: {others:.0f}% CPU]"
                else:
                    msg = f"{record.get('status', '?').upper()}: {record.get('reason')}"
                print(f"  [{problem} N={N}] {method:<16} k={k:<3} {msg}", flush=True)
                _dump(json_path, problem, N, records, info, args)

        summary = summarize(problem, N, records, args.methods, args.ks)
        _dump(json_path, problem, N, records, info, args, summary)
        png_path = out / f"eigh_{problem}.png"
        plot(problem, N, records, args.methods, args.ks, png_path, info)
        print(f"\nWrote {json_path} and {png_path}")
        all_summaries[problem] = summary
    return all_summaries


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse command line arguments.

    Args:
        argv: Arguments; defaults to ``sys.argv[1:]``.

    Returns:
        Parsed arguments.
    """
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--problems",
        nargs="+",
        default=["3c3d", "2c2d"],
        choices=PROBLEMS,
        help="Problems to benchmark.",
    )
    parser.add_argument("--N", type=int, default=128, help="Mini-batch size.")
    for p in PROBLEMS:
        parser.add_argument(
            f"--N-{p}",
            dest=f"N_{p}",
            type=int,
            default=None,
            help=f"Mini-batch size for {p} (overrides --N).",
        )
    parser.add_argument(
        "--ks",
        nargs="+",
        type=int,
        default=[1, 2, 4, 6, 8, 10],
        help="Numbers of leading eigenpairs.",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=METHODS,
        help="Methods to benchmark.",
    )
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda'.")
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="Time limit per subprocess in seconds.",
    )
    parser.add_argument(
        "--out",
        default=str(HERE / "results"),
        help="Output directory for JSON files and figures.",
    )
    parser.add_argument("--seed", type=int, default=0, help="Random seed.")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads in workers (0: number of usable cores).",
    )
    parser.add_argument(
        "--blas-threads",
        type=int,
        default=1,
        help="OPENBLAS_NUM_THREADS for NumPy/SciPy in workers (0: do not set).",
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        help="Before each run, wait up to this many seconds for other processes to "
        f"leave the CPU (< {BUSY_WARN_PERCENT:g}%% busy); 0: do not wait.",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="Fresh-process runs per configuration (median time is reported).",
    )
    parser.add_argument(
        "--omp-wait-policy",
        default="PASSIVE",
        help="OMP_WAIT_POLICY in workers ('' to inherit).",
    )
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="Skip the (untimed) check of the returned eigenvectors "
        "with independent GGN-vector products (verify: %(default)s).",
    )
    parser.add_argument(
        "--quick", action="store_true", help="Smoke test: problem mlp, N=32, ks 1 2."
    )
    # worker-only arguments
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--problem", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.N = getattr(args, f"N_{args.problem}", None) or args.N
    return args


def main(argv: Sequence[str] | None = None):
    """Entry point.

    Args:
        argv: Command line arguments; defaults to ``sys.argv[1:]``.
    """
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
    else:
        driver_main(args)


if __name__ == "__main__":
    main()
