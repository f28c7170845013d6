"""A competing process for the shared-machine benchmarks (``bench_shared``, ``bench_lora``).

The ``loaded`` condition runs a worker beside a busy process: :func:`matmul_load` is
that process's work, :class:`CompetingLoad` starts it, waits until it is busy, measures
its CPU time and stops it, and :func:`process_cpu_seconds` reads another process's CPU
time (the workers use it to report the load's share during a phase).
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import threading
import time
from typing import Any

import torch

from benchmarks._harness import REPO_ROOT, kill_group, read_lines


def process_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of another process (all its threads).

    Args:
        pid: Process id (``0``: none).

    Returns:
        The CPU seconds, ``None`` without psutil or if the process is gone.
    """
    if not pid:
        return None
    try:
        import psutil

        times = psutil.Process(pid).cpu_times()
    except Exception:  # noqa: BLE001 (psutil missing or process gone)
        return None
    return times.user + times.system


def matmul_load(threads: int, size: int, marker: str):
    """The competing work: square float32 matmuls on ``threads`` threads until ``SIGTERM``.

    Prints a ``marker`` line when ready (after a few products), and on ``SIGTERM`` one
    with the products per second.

    Args:
        threads: torch threads.
        size: Matrix size.
        marker: Prefix of the lines it prints.
    """
    stop: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen) / size**0.5
    for _ in range(3):
        a = torch.tanh(a @ b)
    print(marker + json.dumps({"ready": True}), flush=True)
    count, start = 0, time.perf_counter()
    while not stop:
        a = torch.tanh(a @ b)
        count += 1
    seconds = time.perf_counter() - start
    print(marker + json.dumps({"matmuls": count, "seconds": seconds,
                               "matmuls_per_s": count / max(seconds, 1e-9),
                               "threads": threads, "size": size}), flush=True)


class CompetingLoad:
    """A busy process beside a worker: started, awaited until ready, then stopped.

    Args:
        cmd: Its command (a script running :func:`matmul_load`).
        env: Its environment.
        marker: The prefix of its ready and report lines.
    """

    def __init__(self, cmd: list[str], env: dict[str, str], marker: str):
        self.marker = marker
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, cwd=REPO_ROOT, env=env,
                                     start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=read_lines, args=(self.proc.stdout, self.lines),
                                       daemon=True)
        self.thread.start()
        self.ready = False
        deadline = time.perf_counter() + 120.0
        while not self.ready and time.perf_counter() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                break
            if line is None:
                break
            self.ready = line.startswith(marker)
        time.sleep(1.0)  # let it reach its steady state
        self.cpu0 = process_cpu_seconds(self.proc.pid)

    @property
    def pid(self) -> int:
        """Process id of the load."""
        return self.proc.pid

    def cpu_seconds(self) -> float | None:
        """CPU seconds the load used since it became ready."""
        now = process_cpu_seconds(self.proc.pid)
        return None if now is None or self.cpu0 is None else now - self.cpu0

    def stop(self) -> dict[str, Any]:
        """Stop the load (``SIGTERM``; its process group is killed if it lingers) and report.

        Returns:
            ``ready``, ``pid`` and the products per second it reached (if it reported).
        """
        report: dict[str, Any] = {"ready": self.ready, "pid": self.proc.pid}
        try:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_group(self.proc)
        self.thread.join(timeout=5)
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                break
            if line and line.startswith(self.marker):
                report.update(json.loads(line[len(self.marker):]))
        report["ready"] = self.ready  # not a late ready line's
        return report
