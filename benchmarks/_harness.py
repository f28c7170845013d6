"""Shared helpers of the benchmark scripts (process isolation, memory, machine info).

The benchmark scripts run every configuration in a fresh worker process (the
script itself with ``--worker``) that reports its record as JSON on stdout. This
module holds what the drivers and workers of all scripts share:

- measuring memory: RSS high-water marks (resettable on Linux), CUDA peaks,
  recognizing out-of-memory errors and capping a worker's address space,
- the workers' environment (thread pools) and waiting for a quiet machine,
- classifying how a worker process ended, and machine/software information,
- starting a script of this package in a fresh interpreter (``python -m``) and its
  entry point (a worker with ``--worker``, else the driver).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import resource
import signal
import subprocess
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

GiB = 2**30
#: The repository root: the folder that holds the ``benchmarks`` package.
REPO_ROOT = Path(__file__).resolve().parent.parent
#: Default output folder of the scripts (git-ignored).
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# Warn about competing processes if the CPU was busier than this before a run.
BUSY_WARN_PERCENT = 20.0

#: Modules that benchmarked methods may load lazily on their first call.
DEFAULT_PREIMPORTS: tuple[str, ...] = (
    "torch._dynamo",
    "torch._decomp.decompositions_for_jvp",
    "scipy.sparse.linalg",
    "backpack",
)

#: Packages whose versions :func:`machine_info` records by default.
DEFAULT_PACKAGES: tuple[str, ...] = (
    "numpy",
    "scipy",
    "curvlinops-for-pytorch",
    "backpack-for-pytorch",
    "lowrank_laplace",
    "lowrank-laplace",
)


###############################################################################
#                              Worker side                                    #
###############################################################################


def num_cores() -> int:
    """Return the number of CPU cores available to this process.

    Returns:
        Number of usable cores.
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (non-Linux)
        return os.cpu_count() or 1


def maxrss_bytes() -> int:
    """Return the RSS high-water mark of this process in bytes.

    Returns:
        ``ru_maxrss`` converted to bytes (it is in KiB on Linux, bytes on macOS).
    """
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def _proc_status_bytes(key: str) -> int | None:
    """Read a memory entry (in kB) of ``/proc/self/status``.

    Args:
        key: Entry name, e.g. ``'VmHWM'`` or ``'VmRSS'``.

    Returns:
        The value in bytes, ``None`` if unavailable (non-Linux).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def current_rss_bytes() -> int:
    """Return the current resident set size of this process in bytes.

    Returns:
        ``VmRSS`` on Linux, else the high-water mark as an upper bound.
    """
    rss = _proc_status_bytes("VmRSS")
    return maxrss_bytes() if rss is None else rss


def peak_rss_bytes() -> int:
    """Return the RSS high-water mark since the last :func:`reset_peak_rss`.

    Returns:
        ``VmHWM`` on Linux, else ``ru_maxrss`` (high-water mark of the process).
    """
    hwm = _proc_status_bytes("VmHWM")
    return maxrss_bytes() if hwm is None else hwm


def reset_peak_rss() -> bool:
    """Reset the RSS high-water mark to the current RSS (Linux >= 4.0).

    Writes ``5`` to ``/proc/self/clear_refs``. This allows per-phase peak memory
    measurements of several phases in one process.

    Returns:
        Whether the reset worked (otherwise the peak is that of the whole process).
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def limit_address_space(max_bytes: int) -> int | None:
    """Cap the virtual address space of this process (``RLIMIT_AS``).

    Allocations beyond the cap fail with ``MemoryError``/``RuntimeError`` (which
    can be recorded) instead of driving the machine into swapping or the OOM
    killer. Do not use with CUDA (its driver reserves huge virtual ranges).

    Args:
        max_bytes: The cap in bytes (``<= 0``: leave unlimited).

    Returns:
        The cap that is in effect, ``None`` if none could be set.
    """
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


def sync(device: torch.device):
    """Synchronize CUDA (no-op on CPU).

    Args:
        device: The device used.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(exc: BaseException) -> bool:
    """Check whether an exception signals running out of memory.

    Args:
        exc: The exception.

    Returns:
        Whether the exception is an out-of-memory error.
    """
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    msg = str(exc).lower()
    return any(s in msg for s in ("out of memory", "can't allocate memory", "not enough memory"))


def failure_record(exc: BaseException) -> dict[str, str]:
    """The fields a worker reports for a failed call (inside the ``except`` block).

    Args:
        exc: The exception being handled.

    Returns:
        ``status`` (``'oom'`` or ``'error'``), ``reason`` (type and message) and the
        end of the ``traceback``.
    """
    return {
        "status": "oom" if is_oom(exc) else "error",
        "reason": f"{type(exc).__name__}: {exc}"[:2000],
        "traceback": traceback.format_exc()[-4000:],
    }


def emit(marker: str, record: dict[str, Any]):
    """Print a worker's record as one JSON line on stdout, after everything printed before.

    Args:
        marker: Prefix by which the driver recognises the line.
        record: The record.
    """
    sys.stdout.flush()
    print(marker + json.dumps(record), flush=True)


@contextlib.contextmanager
def failures_reported(marker: str, **fields: Any) -> Iterator[None]:
    """Report an exception that escapes the block as a record instead of raising it.

    Args:
        marker: Prefix of the record line (see :func:`emit`).
        **fields: Fields of the record before those of :func:`failure_record`.

    Yields:
        Nothing; the block runs inside.
    """
    try:
        yield
    except Exception as exc:  # noqa: BLE001 (report every failure)
        emit(marker, {**fields, **failure_record(exc)})


def cuda_baseline(device: torch.device) -> int | None:
    """Reset CUDA's peak statistics before a measured call.

    Args:
        device: The device used.

    Returns:
        The bytes allocated on the device right now, ``None`` on the CPU.
    """
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_memory(
    device: torch.device, cuda_before: int | None, rss_peak: int, rss_peak_delta: int
) -> dict[str, int]:
    """Peak memory of a measured call: CUDA's allocator peak on a GPU, else the RSS peak.

    Args:
        device: The device used.
        cuda_before: What :func:`cuda_baseline` returned before the call.
        rss_peak: RSS high-water mark of the call in bytes.
        rss_peak_delta: Its increase over the RSS before the call in bytes.

    Returns:
        ``peak_bytes`` and ``peak_delta_bytes`` (above the memory held before the
        call) and, on a GPU, ``cuda_peak_bytes``.
    """
    if device.type != "cuda":
        return {"peak_bytes": rss_peak, "peak_delta_bytes": rss_peak_delta}
    cuda_peak = torch.cuda.max_memory_allocated(device)
    return {"cuda_peak_bytes": cuda_peak, "peak_bytes": cuda_peak,
            "peak_delta_bytes": max(0, cuda_peak - cuda_before)}


def preimport(names: Iterable[str] = DEFAULT_PREIMPORTS):
    """Import modules that the methods load lazily on their first call.

    The first forward-mode AD call imports ``torch._dynamo`` (and with it several
    hundred modules, about 1 s); SciPy's ARPACK and BackPACK may also be imported
    lazily. Import time is excluded from all measurements, so load these modules
    before the timed call of every method.

    Args:
        names: Module names (failures to import are ignored).
    """
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            with contextlib.suppress(Exception):  # best effort
                __import__(name)


class CountingMatvec:
    """Wrap a matrix-vector product to count how often it is called.

    Attributes:
        count: Number of multiplied vectors.
    """

    def __init__(self, f: Callable):
        """Store the wrapped function.

        Args:
            f: Matrix-vector (or matrix-matrix) product on NumPy arrays.
        """
        self.f = f
        self.count = 0

    def __call__(self, x: Any) -> Any:
        """Multiply and count.

        Args:
            x: NumPy vector or matrix.

        Returns:
            The product.
        """
        self.count += 1 if x.ndim == 1 else x.shape[1]
        return self.f(x)


def ggn_eigsh(
    model: nn.Module, loss_func: nn.Module, batches: list, num_data: int, k: int
) -> tuple[Tensor, Tensor, int]:
    """Top-k eigenpairs of a GGN by SciPy's ``eigsh`` on curvlinops' GGN operator.

    The operator (deterministic check off) is exported with
    ``to_scipy(dtype=float32)``; its products are counted.

    Args:
        model: The network (its trainable parameters).
        loss_func: Loss function (its reduction defines the GGN's scale).
        batches: ``(X, y)`` batches the GGN sums over.
        num_data: Number of data points in ``batches``.
        k: Number of leading eigenpairs.

    Returns:
        Eigenvalues ``(k,)`` in descending order, eigenvectors ``(D, k)`` and the
        number of GGN-vector products.
    """
    import numpy as np
    from curvlinops import GGNLinearOperator
    from scipy.sparse.linalg import LinearOperator, eigsh

    params = [p for p in model.parameters() if p.requires_grad]
    op = GGNLinearOperator(
        model, loss_func, params, batches, check_deterministic=False, num_data=num_data
    ).to_scipy(dtype=np.float32)
    matvec = CountingMatvec(op.matvec)
    counted = LinearOperator(op.shape, matvec=matvec, dtype=op.dtype)
    evals, evecs = eigsh(counted, k=k, which="LA")
    order = np.argsort(evals)[::-1].copy()
    return (
        torch.from_numpy(evals[order].copy()),
        torch.from_numpy(evecs[:, order].copy()),
        matvec.count,
    )


###############################################################################
#                              Driver side                                    #
###############################################################################


def add_worker_env_arguments(parser: argparse.ArgumentParser):
    """Add ``--blas-threads`` and ``--omp-wait-policy``, read by :func:`worker_env`.

    Args:
        parser: The driver's argument parser.
    """
    parser.add_argument("--blas-threads", type=int, default=1,
                        help="OPENBLAS_NUM_THREADS for NumPy/SciPy in workers (0: do not set).")
    parser.add_argument("--omp-wait-policy", default="PASSIVE",
                        help="OMP_WAIT_POLICY in workers ('' to inherit).")


def module_command(module: str, *args: str) -> list[str]:
    """Command line that runs a module of this package in a fresh interpreter.

    Run it with ``cwd=REPO_ROOT`` and the environment of :func:`worker_env`, which
    both let the interpreter find the ``benchmarks`` package from any directory.

    Args:
        module: Dotted module name, e.g. ``'benchmarks.bench_eigh'``.
        *args: Its command line arguments.

    Returns:
        ``[sys.executable, '-m', module, *args]``.
    """
    return [sys.executable, "-m", module, *args]


def script_parser(doc: str) -> argparse.ArgumentParser:
    """Argument parser of a script that is its own worker (see :func:`run_script`).

    Args:
        doc: The script's docstring; its first paragraph describes the script.

    Returns:
        A parser whose help shows the defaults, with the hidden ``--worker`` flag.
    """
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def run_script(
    argv: Sequence[str] | None,
    parse_args: Callable[[Sequence[str] | None], argparse.Namespace],
    worker_main: Callable[[argparse.Namespace], Any],
    driver_main: Callable[[argparse.Namespace], Any],
):
    """Entry point of a script that is its own worker process.

    Args:
        argv: Command line arguments; ``None`` for ``sys.argv[1:]``.
        parse_args: Parses the script's arguments (with :func:`script_parser`).
        worker_main: Runs one configuration (with ``--worker``).
        driver_main: Runs all configurations, each in a worker process.
    """
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
    else:
        driver_main(args)


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """Environment of the worker processes.

    ``PYTHONPATH`` starts with :data:`REPO_ROOT`, so that a worker finds the
    ``benchmarks`` package (see :func:`module_command`). Two settings make timings
    on small (virtual) machines reproducible and are applied to *all* workers alike:

    - NumPy/SciPy ship their own OpenBLAS, separate from PyTorch's MKL/OpenMP.
      With both thread pools busy-waiting, the matrix-vector products inside
      ``eigsh`` slowed down by up to 20x on a 2-core VM. The NumPy/SciPy BLAS
      threads are therefore limited to ``--blas-threads`` (default 1); PyTorch
      keeps ``--threads`` threads.
    - With OpenMP's default (active, spinning) wait policy, PyTorch on a 2-vCPU
      VM was randomly (per process) up to 6x slower than with one thread.
      ``OMP_WAIT_POLICY`` is set to ``--omp-wait-policy`` (default ``PASSIVE``).

    Args:
        args: Parsed command line arguments of the driver (``blas_threads`` and
            ``omp_wait_policy`` are used).

    Returns:
        The environment variables.
    """
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *paths])
    if args.blas_threads > 0:
        env["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    if args.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    return env


def write_results(
    path: Path,
    settings: dict[str, Any],
    args: argparse.Namespace,
    info: dict[str, Any],
    records: list[dict[str, Any]],
    summary: dict[str, Any] | None,
):
    """Write the results of a problem to a JSON file.

    Args:
        path: Output path.
        settings: The run's settings (first in the file).
        args: Parsed command line arguments of the driver (``threads``,
            ``blas_threads`` and ``omp_wait_policy`` are recorded).
        info: Machine information.
        records: The records so far.
        summary: The problem's summary (``None`` while running).
    """
    payload = {
        **settings,
        "threads": args.threads or num_cores(),
        "worker_env": {
            "OPENBLAS_NUM_THREADS": args.blas_threads or None,
            "OMP_WAIT_POLICY": args.omp_wait_policy or None,
        },
        "machine": info,
        "records": records,
        "summary": summary,
    }
    path.write_text(json.dumps(payload, indent=2))


def other_cpu_load(interval: float = 0.5) -> float | None:
    """Measure the system-wide CPU utilization while no worker is running.

    Other processes competing for the (few) cores distort the timings, so this is
    recorded with each run and reported in the summary.

    Args:
        interval: Measurement interval in seconds.

    Returns:
        CPU utilization in percent (all cores), ``None`` if psutil is missing.
    """
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return None
    return psutil.cpu_percent(interval=interval)


def system_busy_cpu_seconds() -> float | None:
    """Busy CPU seconds of the whole machine since boot, summed over cores.

    Counts user, nice, system, irq and softirq time; guest time is already part
    of user time and steal time belongs to the hypervisor, so both are left out.

    Returns:
        The CPU seconds, ``None`` without psutil.
    """
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return None
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq"))


def own_cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    """User plus system CPU seconds of this process (all threads) or its children.

    Args:
        who: ``resource.RUSAGE_SELF`` or ``resource.RUSAGE_CHILDREN`` (reaped
            children only).

    Returns:
        The CPU seconds.
    """
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def other_cpu_percent(busy_s: float | None, own_s: float, wall_s: float) -> float | None:
    """CPU share that other processes used during a time span.

    Args:
        busy_s: Increase of :func:`system_busy_cpu_seconds` over the span.
        own_s: Increase of the own (or children's) CPU seconds over the span.
        wall_s: Length of the span in seconds.

    Returns:
        Percent of all cores (``None`` if ``busy_s`` is ``None`` or the span is
        empty). CPU accounting has a granularity of about 10 ms, so values of short
        spans are noisy.
    """
    if busy_s is None or wall_s <= 0:
        return None
    return max(0.0, 100.0 * (busy_s - own_s) / (wall_s * (os.cpu_count() or 1)))


def wait_for_idle_cpu(max_wait_s: float) -> float | None:
    """Wait up to ``max_wait_s`` seconds for the CPU to become (almost) idle.

    Args:
        max_wait_s: Maximum waiting time; ``0`` measures the load once.

    Returns:
        The last measured CPU utilization in percent (``None`` without psutil);
        above :data:`BUSY_WARN_PERCENT` if the waiting time ran out.
    """
    busy = other_cpu_load()
    deadline = time.perf_counter() + max_wait_s
    while busy is not None and busy > BUSY_WARN_PERCENT and time.perf_counter() < deadline:
        busy = other_cpu_load(interval=2.0)
    return busy


def busy_processes(
    patterns: Sequence[str], min_cpu_percent: float = 5.0, interval: float = 1.0
) -> list[str]:
    """Find other processes whose command line matches a pattern and that use CPU.

    The process tree of the caller (itself, its ancestors and descendants) is
    ignored.

    Args:
        patterns: Substrings searched in each process's command line.
        min_cpu_percent: CPU utilization (percent of one core, measured over
            ``interval``) from which a process counts as busy.
        interval: Measurement interval in seconds.

    Returns:
        ``'pid cpu% command'`` descriptions of the busy matching processes (empty
        without psutil or without patterns).
    """
    if not patterns:
        return []
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return []
    me = psutil.Process()
    own = {me.pid} | {p.pid for p in me.parents()}
    with contextlib.suppress(psutil.Error):
        own |= {p.pid for p in me.children(recursive=True)}
    matches = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info.get("cmdline") or [])
        if proc.info["pid"] in own or not any(p in cmdline for p in patterns):
            continue
        with contextlib.suppress(psutil.Error):
            proc.cpu_percent(None)  # start the measurement
            matches.append((proc, cmdline))
    if not matches:
        return []
    time.sleep(interval)
    busy = []
    for proc, cmdline in matches:
        with contextlib.suppress(psutil.Error):
            cpu = proc.cpu_percent(None)
            if cpu >= min_cpu_percent:
                busy.append(f"{proc.pid} {cpu:.0f}% {cmdline[:120]}")
    return busy


def wait_for_processes(
    patterns: Sequence[str],
    max_wait_s: float,
    poll_s: float = 30.0,
    log: Callable[[str], None] | None = print,
) -> list[str]:
    """Wait until no other process matching ``patterns`` uses CPU.

    Args:
        patterns: Substrings of command lines to wait for (e.g. ``'pytest'``).
        max_wait_s: Maximum waiting time in seconds.
        poll_s: Polling interval in seconds.
        log: Function printing progress messages (``None``: silent).

    Returns:
        The busy processes found at the last poll (empty if the machine became
        quiet in time).
    """
    deadline = time.perf_counter() + max_wait_s
    busy = busy_processes(patterns)
    while busy and time.perf_counter() < deadline:
        if log is not None:
            log(f"  waiting for {len(busy)} busy process(es): {busy[0]}")
        time.sleep(max(0.0, min(poll_s, deadline - time.perf_counter())))
        busy = busy_processes(patterns)
    return busy


def classify_exit(returncode: int) -> tuple[str, str]:
    """Classify the exit of a worker that did not report a result.

    Args:
        returncode: Return code of the process (negative: killed by a signal).

    Returns:
        ``(status, reason)``; the status is ``'oom'`` for ``SIGKILL`` (likely the
        kernel's OOM killer), ``'killed'`` for other signals, else ``'error'``.
    """
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:
            sig = str(-returncode)
        if sig == "SIGKILL":
            return "oom", f"killed by signal {sig} (likely out of memory)"
        return "killed", f"killed by signal {sig}"
    return "error", f"exit code {returncode} without result"


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence.

    Args:
        values: The values.

    Returns:
        The median (mean of the two middle values for an even count).
    """
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])


def machine_info(device: str, packages: Sequence[str] = DEFAULT_PACKAGES) -> dict[str, Any]:
    """Collect information about the machine and software.

    Args:
        device: Device string used for the benchmark.
        packages: Distributions whose versions are recorded (if installed).

    Returns:
        Dictionary with the date (UTC), CPU count, memory, device name and package
        versions.
    """
    import datetime
    import importlib.metadata

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "cpu_count": os.cpu_count(),
        "cpu_count_usable": num_cores(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
    }
    cpu_name = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info["cpu_name"] = cpu_name
    if device.startswith("cuda") and torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(torch.device(device))
    else:
        info["device_name"] = cpu_name
    try:
        import psutil

        info["total_memory_bytes"] = psutil.virtual_memory().total
    except ImportError:  # pragma: no cover
        pass
    for pkg in packages:
        try:
            info[f"version_{pkg}"] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return info


def verdict(ok: bool | None) -> str:
    """Format the outcome of a check.

    Args:
        ok: Whether the check passed, ``None`` if it could not be evaluated.

    Returns:
        ``'PASSED'``, ``'FAILED'`` or ``'n/a (missing runs)'``.
    """
    if ok is None:
        return "n/a (missing runs)"
    return "PASSED" if ok else "FAILED"


def read_lines(stream, q: "queue.Queue | None", tail: "deque | None" = None):
    """Forward the lines of a worker's stream into a queue (``None`` marks the end).

    Args:
        stream: Text stream.
        q: Queue receiving the lines (``None``: only keep a tail).
        tail: Deque collecting the last lines (``None``: do not collect).
    """
    for line in stream:
        if tail is not None:
            tail.append(line)
        if q is not None:
            q.put(line)
    if q is not None:
        q.put(None)


def kill_group(proc: subprocess.Popen):
    """Kill a worker and its process group (started in its own session).

    Args:
        proc: The worker.
    """
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()

