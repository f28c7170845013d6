"""The worker side of the benchmarks: one configuration's phases in a fresh process.

A worker (started by :func:`benchmarks._harness.run_worker`) builds its problem untimed,
then prints a ``setup`` record and one per measured phase (:func:`measure`) as JSON lines,
so the driver keeps what finished when a later phase fails or the worker dies.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import json
import os
import resource
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks._load import REPO_ROOT, CpuShare

GiB = 2**30
#: Prefix of a worker's record lines.
MARKER = "__BENCH_RECORD__"
#: Modules that the measured calls may load lazily on their first call.
DEFAULT_PREIMPORTS: tuple[str, ...] = (
    "torch._dynamo", "torch._decomp.decompositions_for_jvp", "scipy.sparse.linalg",
    "backpack")
#: Besides those, for workers of laplace-torch posteriors.
LAPLACE_PREIMPORTS: tuple[str, ...] = (*DEFAULT_PREIMPORTS, "curvlinops", "laplace")


class Tuning:
    """A package option that is becoming the constant ``constant`` of ``module``."""

    def __init__(self, module: str, constant: str):
        self.module, self.constant = module, constant

    def keyword(self, name: str, value: Any, rank: int) -> dict[str, Any]:
        """The ``Laplace(...)`` keyword of a package without the constant."""
        return {name: value}


class FractionOfRank(Tuning):
    """A constant given as a fraction of the rank, whose keyword option counts columns."""

    def keyword(self, name: str, value: Any, rank: int) -> dict[str, Any]:
        return {name: max(0, round(value * rank))}


#: ``Laplace(...)`` option -> the module constant replacing it.
TUNINGS: dict[str, Tuning] = {
    "sketch_test_matrix": Tuning("lowrank_laplace.fitting.sketch", "TEST_MATRIX"),
    "dense_max_dim": Tuning("lowrank_laplace.fitting.plan", "DENSE_MAX_DIM"),
    "oversampling": FractionOfRank("lowrank_laplace.fitting.plan", "OVERSAMPLING"),
    "probe_size": Tuning("lowrank_laplace.posterior.probe", "PROBE_SIZE"),
}


def set_tuning(name: str, value: Any, rank: int = 100) -> dict[str, Any]:
    """Set a tuning (a key of :data:`TUNINGS`, ``value`` in the constant's units) for this
    worker before it builds a posterior: the module constant where the package has it, else
    the returned keyword options of ``Laplace(...)`` (``rank`` converts fractions)."""
    tuning = TUNINGS[name]
    try:
        module = importlib.import_module(tuning.module)
    except ImportError:
        module = None
    if module is None or not hasattr(module, tuning.constant):
        return tuning.keyword(name, value, rank)
    setattr(module, tuning.constant, value)
    return {}


def num_cores() -> int:
    """The number of CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (non-Linux)
        return os.cpu_count() or 1


def proc_status_bytes(key: str) -> int | None:
    """An entry (in kB) of ``/proc/self/status`` in bytes, e.g. ``'VmSize'`` (Linux)."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f
                         if line.startswith(key + ":")), None)
    except (OSError, ValueError, IndexError):
        return None


def rss_bytes(key: str = "VmRSS") -> int:
    """The resident set size (``VmRSS``) or its high-water mark since
    :func:`reset_peak_rss` (``VmHWM``); without ``/proc`` the process's peak."""
    value = proc_status_bytes(key)
    if value is None:
        value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        value *= 1 if sys.platform == "darwin" else 1024
    return value


def reset_peak_rss() -> bool:
    """Reset the RSS high-water mark to the current RSS (Linux >= 4.0); whether it did."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def limit_address_space(max_bytes: int) -> int | None:
    """Cap the address space (``RLIMIT_AS``; ``<= 0``: none), so that allocations beyond it
    fail with a catchable error instead of swapping or the OOM killer (not for CUDA, whose
    driver reserves huge virtual ranges); the cap in effect."""
    if max_bytes <= 0:
        return None
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            max_bytes = min(max_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (max_bytes, hard))
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return None
    return max_bytes


def set_memory_cap(limit_bytes: int, device: torch.device) -> dict[str, Any]:
    """Cap the address space at most to what the machine can back (not on CUDA):
    ``mem_limit_bytes`` (the cap or ``None``) and, if lowered, ``mem_limit_requested_bytes``."""
    info: dict[str, Any] = {"mem_limit_bytes": None}
    if device.type == "cuda" or limit_bytes <= 0:
        return info
    cap = limit_bytes
    with contextlib.suppress(ImportError):
        import psutil

        backed = psutil.virtual_memory().available + psutil.Process().memory_info().vms
        if backed < cap:
            info["mem_limit_requested_bytes"], cap = cap, backed
    info["mem_limit_bytes"] = limit_address_space(cap)
    return info


def is_oom(exc: BaseException) -> bool:
    """Whether an exception means running out of memory."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    msg = str(exc).lower()
    return any(s in msg for s in ("out of memory", "can't allocate memory", "not enough memory"))


def failure_record(exc: BaseException) -> dict[str, str]:
    """``status`` (``'oom'`` or ``'error'``), ``reason`` and ``traceback`` of a failure."""
    return {"status": "oom" if is_oom(exc) else "error",
            "reason": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": traceback.format_exc()[-4000:]}


def emit(record: dict[str, Any]):
    """Print a record as one marked JSON line, after everything printed before."""
    sys.stdout.flush()
    print(MARKER + json.dumps(record), flush=True)


@contextlib.contextmanager
def failures_reported() -> Iterator[None]:
    """Report an exception that escapes the block as a failed ``setup`` record."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 (report every failure)
        emit({"phase": "setup", **failure_record(exc)})


def preimport(names: Iterable[str] = DEFAULT_PREIMPORTS):
    """Import what the measured calls would import lazily (failures are ignored)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            with contextlib.suppress(Exception):
                __import__(name)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Set torch's default dtype inside the block (laplace-torch builds tensors in it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def git(*args: str) -> str | None:
    """The output of a git command in the repository (``None`` if it fails)."""
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def library_fingerprint() -> dict[str, Any]:
    """The state of the ``lowrank_laplace`` sources (they may change between runs):
    ``git_head``, ``dirty`` (uncommitted changes; ``None``: unknown) and ``sources_sha1``."""
    info: dict[str, Any] = {}
    head = git("rev-parse", "HEAD")
    if head:
        info["git_head"] = head.strip()
    status = git("status", "--porcelain", "--", "lowrank_laplace")
    info["dirty"] = None if status is None else bool(status.strip())
    digest = hashlib.sha1()
    package = REPO_ROOT / "lowrank_laplace"
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    info["sources_sha1"] = digest.hexdigest()
    return info


def measure(phase: str, fn: Callable[[], Any], device: torch.device,
            load_pid: int = 0) -> tuple[dict, Any]:
    """Time ``fn()`` as ``phase``: its record (``status``, ``time_s`` or a failure's
    ``time_to_failure_s`` and ``reason``, peak memory with and above what the process held
    before, CPU share of others and of the load ``load_pid``) and output (``None``: failed)."""
    gc.collect()
    record: dict[str, Any] = {"phase": phase}
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        cuda_before = torch.cuda.memory_allocated(device)
    record["peak_reset"] = reset_peak_rss()
    rss_before, out = rss_bytes(), None
    share = CpuShare(load_pid=load_pid)
    start = time.perf_counter()
    try:
        out = fn()
        if cuda:
            torch.cuda.synchronize(device)
        record["time_s"] = time.perf_counter() - start
        record["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 (every failure is a result)
        record["time_to_failure_s"] = time.perf_counter() - start
        record.update(failure_record(exc))
    shares = share.stop()
    if "others" in shares:
        record["other_cpu_percent_during_phase"] = shares["others"]
    if "load" in shares:
        record["load_cpu_percent_during_phase"] = shares["load"]
    rss_peak = rss_bytes("VmHWM")
    record.update(rss_before_bytes=rss_before, rss_peak_bytes=rss_peak,
                  rss_peak_delta_bytes=max(0, rss_peak - rss_before),
                  peak_bytes=rss_peak, peak_delta_bytes=max(0, rss_peak - rss_before))
    if cuda:
        cuda_peak = torch.cuda.max_memory_allocated(device)
        record.update(cuda_before_bytes=cuda_before, cuda_peak_bytes=cuda_peak,
                      peak_bytes=cuda_peak, peak_delta_bytes=max(0, cuda_peak - cuda_before))
    if record["status"] != "ok":
        gc.collect()  # release what the failed phase left behind
    return record, out


def worker_setup(config: dict[str, Any]) -> dict[str, Any]:
    """Start a worker: threads (``0``: usable cores, ``None``: torch's default), memory
    cap (``mem_limit_gib``), library fingerprint; the setup record so far, which the
    script completes and passes to :func:`run_phases`."""
    device = torch.device(config.get("device", "cpu"))
    preimport(("psutil",))  # before any memory cap: the load measurement needs it
    threads = config.get("threads", 0)
    if threads is not None:
        torch.set_num_threads(threads or num_cores())
    setup = {"phase": "setup", "status": "ok", "threads": torch.get_num_threads(),
             "device": str(device), "lowrank_laplace": library_fingerprint()}
    setup.update(set_memory_cap(int(config.get("mem_limit_gib", 0) * GiB), device))
    return setup


def run_phases(setup: dict[str, Any], phases: Sequence[tuple], config: dict[str, Any],
               preimports: Sequence[str] = LAPLACE_PREIMPORTS, stop_on_failure: bool = True):
    """Emit the setup record, then measure and emit every phase ``(name, fn)`` or ``(name, fn,
    describe)``, where ``describe(out)`` adds fields of a successful phase's output."""
    device = torch.device(config.get("device", "cpu"))
    preimport(preimports)
    setup.update(rss_bytes=rss_bytes(), rss_peak_bytes=rss_bytes("VmHWM"))
    if device.type == "cuda":
        setup["cuda_allocated_bytes"] = torch.cuda.memory_allocated(device)
    emit(setup)
    for name, fn, *describe in phases:
        record, out = measure(name, fn, device, config.get("load_pid", 0))
        if out is not None and describe:
            record.update(describe[0](out))
        del out
        emit(record)
        if stop_on_failure and record["status"] != "ok":
            return


def run_result(config: dict[str, Any], fn: Callable[[], dict]):
    """A worker whose one phase, ``result``, computes a JSON-able result (its ``result``)."""
    run_phases(worker_setup(config), [("result", fn, lambda out: {"result": out})], config)


def probs_warnings(n_test: int, C: int) -> Callable[[Any], dict]:
    """A ``describe`` of :func:`run_phases`: the problems of predictive probabilities."""
    def describe(probs: Any) -> dict:
        if not isinstance(probs, torch.Tensor):
            return {"warnings": [f"predictive returned {type(probs).__name__}, expected a "
                                 "tensor"]}
        problems = []
        if tuple(probs.shape) != (n_test, C):
            problems.append(f"shape {tuple(probs.shape)} != {(n_test, C)}")
        if not torch.isfinite(probs).all():
            problems.append("non-finite probabilities")
        elif (err := (probs.sum(-1) - 1).abs().max().item()) > 1e-3:
            problems.append(f"probabilities do not sum to 1 (max error {err:.2e})")
        return {"warnings": problems} if problems else {}

    return describe


def fit_within(fit: Callable[[Any], Any], loader: Any, budget_s: float) -> tuple[Any, dict]:
    """The loader a fit gets within ``budget_s`` seconds (``0``: all of it), and the
    record's fields ``n_fit``, ``n_requested`` (if shrunk) and ``probe_failure``: untimed
    fits of one batch (a warm-up), one and two batches give the fixed cost and the cost
    per batch; if the whole loader would exceed the budget, the first batches that fit it.
    """
    from torch.utils.data import DataLoader, Subset

    n, size, times = len(loader.dataset), loader.batch_size, []
    prefix = lambda k: DataLoader(Subset(loader.dataset, range(min(n, k * size))), size)  # noqa: E731
    if budget_s <= 0 or len(loader) < 3:
        return loader, {"n_fit": n}
    try:
        for batches in (1, 1, 2):
            start = time.perf_counter()
            fit(prefix(batches))
            times.append(time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001
        return loader, {"n_fit": n, "probe_failure": failure_record(exc)["reason"][:300]}
    batches = max(1, int((budget_s - times[1]) / max(times[2] - times[1], 1e-3)) + 1)
    if batches >= len(loader):
        return loader, {"n_fit": n}
    return prefix(batches), {"n_fit": batches * size, "n_requested": n}


def chunks_within(predict: Callable[[Any], Tensor], chunks: Sequence, budget_s: float
                  ) -> Tensor:
    """``predict`` of the chunks that fit ``budget_s`` seconds at the pace so far (``0``:
    all; the first always runs), concatenated along the points' axis."""
    outs: list[Tensor] = []
    start = time.perf_counter()
    for chunk in chunks:
        spent = time.perf_counter() - start
        if outs and budget_s > 0 and spent * (len(outs) + 1) / len(outs) > budget_s:
            break
        outs.append(predict(chunk).detach())
    return torch.cat(outs, dim=-2 if outs[0].dim() == 3 else 0)


def ggn_eigsh(model: nn.Module, loss_func: nn.Module, batches: list, num_data: int,
              k: int) -> tuple[Tensor, Tensor, int]:
    """Top-k eigenpairs (descending) of the GGN of ``num_data`` points in ``batches`` by
    SciPy's ``eigsh`` on curvlinops' operator (float32), and its number of products."""
    import numpy as np
    from curvlinops import GGNLinearOperator
    from scipy.sparse.linalg import LinearOperator, eigsh

    params = [p for p in model.parameters() if p.requires_grad]
    op = GGNLinearOperator(model, loss_func, params, batches, check_deterministic=False,
                           num_data=num_data).to_scipy(dtype=np.float32)
    count = [0]

    def matvec(x: Any) -> Any:
        count[0] += 1 if x.ndim == 1 else x.shape[1]
        return op.matvec(x)

    evals, evecs = eigsh(LinearOperator(op.shape, matvec=matvec, dtype=op.dtype), k=k,
                         which="LA")
    order = np.argsort(evals)[::-1].copy()
    return (torch.from_numpy(evals[order].copy()), torch.from_numpy(evecs[:, order].copy()),
            count[0])
