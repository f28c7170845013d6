"""How busy the machine is (:class:`CpuShare`, waits for a quiet machine), and a
competing process that makes it busy (:class:`CompetingLoad`: ``python -m
benchmarks._load``, square float32 matmuls until ``SIGTERM``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: The repository root (the folder that holds the ``benchmarks`` package).
REPO_ROOT = Path(__file__).resolve().parent.parent
#: Warn about (and retry runs beside) other processes above this CPU share.
BUSY_WARN_PERCENT = 20.0
#: Prefix of the competing load's ready and report lines.
LOAD_MARKER = "__BENCH_LOAD__"


def system_busy_cpu_seconds() -> float | None:
    """Busy CPU seconds of the machine since boot (``None`` without psutil)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return None
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq"))


def own_cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    """User plus system CPU seconds of this process or of its reaped children."""
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def process_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of another process (``None``: unknown)."""
    if not pid:
        return None
    try:
        import psutil

        times = psutil.Process(pid).cpu_times()
    except Exception:  # noqa: BLE001 (psutil missing or process gone)
        return None
    return times.user + times.system


class CpuShare:
    """The CPU share of other processes during a span from now (noisy for short spans:
    accounting has about 10 ms granularity); ``who``: whose CPU time is the span's own
    (``RUSAGE_SELF``: a worker's phase, ``RUSAGE_CHILDREN``: the driver's reaped workers),
    ``load_pid``: a competing load's process, counted apart (``0``: none)."""

    def __init__(self, who: int = resource.RUSAGE_SELF, load_pid: int = 0):
        self.who, self.load_pid = who, load_pid
        self.busy0, self.own0 = system_busy_cpu_seconds(), own_cpu_seconds(who)
        self.load0 = process_cpu_seconds(load_pid)
        self.start = time.perf_counter()

    def stop(self) -> dict[str, float]:
        """The shares of the span so far in percent of all cores: ``others`` (not this
        process, its children or the load) and with a load ``load``; empty without psutil."""
        wall = time.perf_counter() - self.start
        busy1 = system_busy_cpu_seconds()
        if self.busy0 is None or busy1 is None or wall <= 0:
            return {}
        now = process_cpu_seconds(self.load_pid)
        load_s = None if now is None or self.load0 is None else now - self.load0
        capacity = wall * (os.cpu_count() or 1) / 100.0
        own = own_cpu_seconds(self.who) - self.own0 + (load_s or 0.0)
        shares = {"others": max(0.0, (busy1 - self.busy0 - own) / capacity)}
        if load_s is not None:
            shares["load"] = load_s / capacity
        return shares


def wait_for_idle_cpu(max_wait_s: float) -> float | None:
    """Wait up to ``max_wait_s`` seconds (``0``: measure once) for an (almost) idle CPU;
    the last measured utilisation in percent of all cores (``None`` without psutil)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return None
    busy = psutil.cpu_percent(interval=0.5)
    deadline = time.perf_counter() + max_wait_s
    while busy > BUSY_WARN_PERCENT and time.perf_counter() < deadline:
        busy = psutil.cpu_percent(interval=2.0)
    return busy


def busy_processes(patterns: Sequence[str], min_cpu_percent: float = 5.0,
                   interval: float = 1.0) -> list[str]:
    """``'pid cpu% command'`` of the other processes whose command line contains one of
    ``patterns`` and that used at least ``min_cpu_percent`` of a core over ``interval``
    seconds (the caller's own process tree is ignored; empty without psutil)."""
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
        if proc.info["pid"] not in own and any(p in cmdline for p in patterns):
            with contextlib.suppress(psutil.Error):
                proc.cpu_percent(None)  # starts the measurement
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


def wait_for_processes(patterns: Sequence[str], max_wait_s: float, poll_s: float = 30.0,
                       log: Callable[[str], None] | None = print) -> list[str]:
    """Wait up to ``max_wait_s`` seconds until no other process matching ``patterns``
    (e.g. ``'pytest'``) uses CPU; the busy processes of the last poll (empty: quiet)."""
    deadline = time.perf_counter() + max_wait_s
    busy = busy_processes(patterns)
    while busy and time.perf_counter() < deadline:
        if log is not None:
            log(f"  waiting for {len(busy)} busy process(es): {busy[0]}")
        time.sleep(max(0.0, min(poll_s, deadline - time.perf_counter())))
        busy = busy_processes(patterns)
    return busy


def read_lines(stream, lines: queue.Queue | None, tail: Any = None):
    """Forward a stream's lines into a queue (``None`` at the end), its last ones to ``tail``."""
    for line in stream:
        if tail is not None:
            tail.append(line)
        if lines is not None:
            lines.put(line)
    if lines is not None:
        lines.put(None)


def kill_group(proc: subprocess.Popen):
    """Kill a process and its process group (started in its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


class CompetingLoad:
    """A busy process of ``size x size`` matmuls on ``threads`` threads beside a worker."""

    def __init__(self, threads: int, size: int, env: dict[str, str]):
        cmd = [sys.executable, "-m", "benchmarks._load", f"--threads={threads}",
               f"--size={size}"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, cwd=REPO_ROOT, env=env,
                                     start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=read_lines, args=(self.proc.stdout, self.lines),
                                       daemon=True)
        self.thread.start()
        self.ready = False
        deadline = time.perf_counter() + 120.0
        with contextlib.suppress(queue.Empty):
            while not self.ready and time.perf_counter() < deadline:
                line = self.lines.get(timeout=max(0.0, deadline - time.perf_counter()))
                if line is None:
                    break
                self.ready = line.startswith(LOAD_MARKER)
        time.sleep(1.0)  # let it reach its steady state

    @property
    def pid(self) -> int:
        """Process id of the load."""
        return self.proc.pid

    def stop(self) -> dict[str, Any]:
        """Stop the load (``SIGTERM``, then its process group is killed): ``ready``, ``pid``
        and the products per second it reached (if it reported)."""
        report: dict[str, Any] = {"pid": self.proc.pid}
        try:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_group(self.proc)
        self.thread.join(timeout=5)
        with self.lines.mutex:
            lines = list(self.lines.queue)
        for line in lines:
            if line and line.startswith(LOAD_MARKER):
                report.update(json.loads(line[len(LOAD_MARKER):]))
        report["ready"] = self.ready  # not a late ready line's
        return report


def matmul_load(threads: int, size: int):
    """The competing work: float32 matmuls until ``SIGTERM``, reporting its rate."""
    import torch

    stop: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen) / size**0.5
    for _ in range(3):
        a = torch.tanh(a @ b)
    print(LOAD_MARKER + json.dumps({"ready": True}), flush=True)
    count, start = 0, time.perf_counter()
    while not stop:
        a = torch.tanh(a @ b)
        count += 1
    seconds = time.perf_counter() - start
    print(LOAD_MARKER + json.dumps({"matmuls": count, "seconds": seconds,
                                    "matmuls_per_s": count / max(seconds, 1e-9),
                                    "threads": threads, "size": size}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The competing load of the benchmarks.")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size", type=int, default=512)
    ARGS = parser.parse_args()
    matmul_load(ARGS.threads, ARGS.size)
