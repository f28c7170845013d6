"""The benchmarks' driver: configurations in, one fresh worker process per run, JSON out.

A script is its own worker: ``python -m benchmarks.<script> --worker --config JSON`` runs
one configuration (``_worker.py``); without ``--worker`` it is the driver, which hands its
configurations (small dicts) to a :class:`Plan`. Every run is a fresh worker process
(:func:`run_worker`) with a time limit per phase, where a timeout, a crash or a kill
becomes the failure record of the running phase; the driver may wait for a quiet
machine first, records the CPU share of other processes, repeats disturbed runs, takes
medians of repeats (:func:`median_record`) and rewrites the JSON file after every run,
which ``--resume`` reuses.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import queue
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import _load
from benchmarks._load import BUSY_WARN_PERCENT, REPO_ROOT, CpuShare
from benchmarks._report import progress_line
from benchmarks._worker import MARKER, failures_reported

#: Default output folder of the scripts (git-ignored).
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
#: Time limit of a worker's start (imports, model and data), at least ``--timeout``.
SETUP_TIMEOUT_S = 300.0
#: Failures after which repeating a configuration is not worth it.
HOPELESS = ("timeout", "oom", "killed")

#: The driver options the scripts share (each script picks its own and their defaults).
ARGUMENTS: dict[str, dict[str, Any]] = {
    "device": {"default": "cpu", "help": "Device of models, data and curvature ('cpu', 'cuda')."},
    "threads": {"type": int, "default": 0, "help": "torch threads in workers (0: usable cores)."},
    "blas_threads": {"type": int, "default": 1, "help": "OPENBLAS_NUM_THREADS for "
                     "NumPy/SciPy in workers (0: do not set)."},
    "omp_wait_policy": {"default": "PASSIVE", "help": "OMP_WAIT_POLICY in workers ('' to "
                        "inherit)."},
    "timeout": {"type": float, "default": 3600.0, "help": "Time limit per phase of a "
                "worker in seconds."},
    "mem_limit_gib": {"type": float, "default": 18.0, "help": "Address-space cap "
                      "(RLIMIT_AS) of CPU workers in GiB, lowered to what the machine can "
                      "back; 0: no cap."},
    "seed": {"type": int, "default": 0, "help": "Random seed."},
    "out": {"default": None, "help": "Output directory (default: benchmarks/results; with "
            "--quick benchmarks/results/quick)."},
    "repeat": {"flags": ("--repeat", "--repeats"), "type": int, "default": 1,
               "help": "Fresh-process runs of every configuration, in rounds over them; "
               "the record holds every phase's median time."},
    "wait_for": {"nargs": "*", "default": [], "metavar": "PATTERN", "help": "Before each "
                 "worker, wait while other processes whose command line contains one of "
                 "these strings use CPU (e.g. pytest bench_)."},
    "wait_max": {"type": float, "default": 1200.0, "help": "Maximum wait for --wait-for [s]."},
    "wait_poll": {"type": float, "default": 30.0, "help": "Polling interval of --wait-for [s]."},
    "wait_idle": {"type": float, "default": 0.0, "help": "Before each worker, wait up to "
                  "this many seconds for the CPU to be less than "
                  f"{BUSY_WARN_PERCENT:g}%% busy; 0: do not wait."},
    "retry_busy": {"type": int, "default": 0, "help": "Repeat a run up to this many times "
                   f"if other processes used more than {BUSY_WARN_PERCENT:g}%% of the CPU "
                   "during it (the least disturbed run is kept)."},
    "resume": {"action": "store_true", "help": "Reuse the records of configurations "
               "already in the output file of a run with the same settings."},
    "rerun": {"nargs": "*", "default": [], "metavar": "KEY", "help": "With --resume: run "
              "these configurations again."},
    "replot": {"action": "store_true", "help": "Run nothing: summaries, figures and tables "
               "of the existing output files."},
}


def script_parser(doc: str, *names: str, **defaults: Any) -> argparse.ArgumentParser:
    """The argument parser of a script that is its own worker (:func:`script_main`),
    described by its docstring's first paragraph, with the hidden ``--worker`` and
    ``--config``, the shared options ``names`` (of :data:`ARGUMENTS`) and its ``defaults``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    for name in names:
        spec = dict(ARGUMENTS[name])
        flags = spec.pop("flags", ("--" + name.replace("_", "-"),))
        parser.add_argument(*flags, dest=name, **spec)
    parser.set_defaults(**defaults)
    return parser


def script_main(parse_args: Callable[[Sequence[str] | None], argparse.Namespace],
                worker: Callable[[dict], Any], driver: Callable[[argparse.Namespace], Any]
                ) -> Callable[[Sequence[str] | None], Any]:
    """A script's entry point ``main(argv=None)`` (``argv`` defaults to ``sys.argv[1:]``):
    with ``--worker --config JSON`` it runs one configuration (a failure outside its
    phases becomes a failed ``setup`` record), else the driver (what it returns)."""
    def main(argv: Sequence[str] | None = None) -> Any:
        args = parse_args(argv)
        if not args.worker:
            return driver(args)
        with failures_reported():
            worker(json.loads(args.config))
        return None

    return main


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of the worker processes: ``PYTHONPATH`` starts with the repository
    root; ``OPENBLAS_NUM_THREADS`` is ``--blas-threads`` (NumPy's and PyTorch's thread
    pools do not busy-wait for each other) and ``OMP_WAIT_POLICY`` ``--omp-wait-policy``
    (``docs/benchmarks/measurements.md`` has the measurements); without them, or
    ``0``/``''``, unset."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *paths])
    if getattr(args, "blas_threads", 0) > 0:
        env["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    if getattr(args, "omp_wait_policy", ""):
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    return env


def classify_exit(returncode: int) -> tuple[str, str]:
    """``(status, reason)`` of a worker that ended without reporting a phase: ``'oom'``
    for ``SIGKILL`` (likely the kernel's OOM killer), ``'killed'``, else ``'error'``."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:
            sig = str(-returncode)
        if sig == "SIGKILL":
            return "oom", f"killed by signal {sig} (likely out of memory)"
        return "killed", f"killed by signal {sig}"
    return "error", f"exit code {returncode} without result"


def _missing(record: dict[str, Any]) -> str | None:
    """The phase a worker was in: setup, or the first expected phase not reported."""
    if record.get("setup", {}).get("status") != "ok":
        return "setup"
    return next((p for p in record["expected"] if p not in record["phases"]), None)


def _collect(proc: subprocess.Popen, lines: queue.Queue, record: dict[str, Any],
             timeout: float) -> dict[str, Any] | None:
    """Read a worker's records until it ends; the failure that ended it, if any."""
    deadline = time.perf_counter() + max(timeout, SETUP_TIMEOUT_S)
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.perf_counter()))
        except queue.Empty:
            _load.kill_group(proc)
            limit = timeout if "setup" in record else max(timeout, SETUP_TIMEOUT_S)
            return {"status": "timeout", "time_to_failure_s": limit,
                    "reason": f"phase exceeded the time limit of {limit:g} s (worker killed)"}
        if line is None:  # the worker ended
            proc.wait()
            reported = [record.get("setup", {"status": "ok"}), *record["phases"].values()]
            if _missing(record) is None or any(r.get("status") != "ok" for r in reported):
                return None
            return dict(zip(("status", "reason"), classify_exit(proc.returncode)))
        try:
            entry = json.loads(line[len(MARKER):]) if line.startswith(MARKER) else None
        except ValueError:  # a garbled line (the worker's own output in between)
            entry = None
        if entry is not None:
            if entry["phase"] == "setup":
                record["setup"] = entry
            else:
                record["phases"][entry["phase"]] = entry
            if _missing(record) is None:
                return None
            deadline = time.perf_counter() + timeout


def _close(record: dict[str, Any], failure: dict | None, stderr: str, device: str):
    """Give the phase that was running its failure and the phases after it a skip."""
    if failure is not None:
        phase, failure["stderr_tail"] = _missing(record), stderr[-2000:]
        if phase == "setup":
            record["setup"] = {"phase": "setup", **failure}
        elif phase is not None:
            record["phases"][phase] = {"phase": phase, **failure}
    setup = record.get("setup", {})
    reason = "an earlier phase failed" if setup.get("status") == "ok" else \
        f"setup failed: {setup.get('reason')}"
    for phase in record.pop("expected"):
        record["phases"].setdefault(phase, {"phase": phase, "status": "skipped",
                                            "reason": reason})
    key = "cuda_peak_bytes" if device.startswith("cuda") else "rss_peak_bytes"
    peaks = [r.get(key) for r in (setup, *record["phases"].values())]
    record["worker_peak_bytes"] = max((p for p in peaks if p is not None), default=None)


def run_worker(module: str, config: dict[str, Any], args: argparse.Namespace) -> dict:
    """Run one configuration in a fresh worker process of ``module``: its record.

    ``config`` is what the worker gets as JSON: ``phases`` it reports after ``setup``;
    ``load`` (``{"threads", "size", "env"}``) starts a competing process beside it;
    ``timeout`` overrides ``--timeout``; ``launcher`` (e.g. torchrun's) replaces the
    interpreter.
    """
    record: dict[str, Any] = {**config, "phases": {}, "expected": list(config["phases"])}
    busy_procs = _load.wait_for_processes(getattr(args, "wait_for", []),
                                          getattr(args, "wait_max", 0.0),
                                          poll_s=getattr(args, "wait_poll", 30.0))
    record["cpu_busy_before_percent"] = _load.wait_for_idle_cpu(getattr(args, "wait_idle", 0))
    record["loadavg_before"] = list(os.getloadavg())
    if busy_procs:
        record["busy_processes_before"] = busy_procs
    spec, load = config.get("load"), None
    if spec:
        env = worker_env(args if spec.get("env") == "worker" else argparse.Namespace())
        load = _load.CompetingLoad(spec["threads"], spec["size"], env)
    cmd = [*config.get("launcher", [sys.executable]), "-m", module, "--worker", "--config",
           json.dumps({**config, "load_pid": load.pid if load else 0})]
    share = CpuShare(resource.RUSAGE_CHILDREN, load.pid if load else 0)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO_ROOT, env=worker_env(args), start_new_session=True)
    lines: queue.Queue = queue.Queue()
    tail: deque = deque(maxlen=60)
    readers = [threading.Thread(target=_load.read_lines, args=a, daemon=True)
               for a in ((proc.stdout, lines), (proc.stderr, None, tail))]
    for reader in readers:
        reader.start()
    try:
        failure = _collect(proc, lines, record, config.get("timeout") or args.timeout)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        _load.kill_group(proc)
    except BaseException:  # the driver is interrupted: leave no process behind
        _load.kill_group(proc)
        if load is not None:
            load.stop()
        raise
    for reader in readers:
        reader.join(timeout=5)
    shares = share.stop()  # before the load is stopped and reaped
    record["subprocess_wall_s"] = time.perf_counter() - share.start
    record["other_cpu_percent_during"] = shares.get("others")
    if load is not None:
        record["load"] = {**load.stop(), "cpu_percent_during": shares.get("load")}
    _close(record, failure, "".join(tail), config.get("device", "cpu"))
    return record


def hopeless(record: dict[str, Any]) -> bool:
    """Whether a run failed so that repeating it is not worth it (timeout, memory, kill)."""
    first = next(iter(record["phases"].values()), {})
    return any(r.get("status") in HOPELESS for r in (record.get("setup", {}), first))


def run_config(module: str, config: dict[str, Any], args: argparse.Namespace,
               run: Callable[[str, dict, argparse.Namespace], dict] = run_worker) -> dict:
    """Run a configuration (``run``: one worker); repeat it while other processes
    disturbed it (``--retry-busy``). The least disturbed run's record
    (``busy_attempt_loads``: every attempt's share)."""
    best, loads, retries = None, [], max(0, getattr(args, "retry_busy", 0))
    for attempt in range(1 + retries):
        record = run(module, config, args)
        load = record.get("other_cpu_percent_during")
        loads.append(load)
        if best is None or (load is not None and
                            load < (best.get("other_cpu_percent_during") or 0.0)):
            best = record
        if load is None or load <= BUSY_WARN_PERCENT or hopeless(record) or \
                any(r.get("status") == "timeout" for r in record["phases"].values()):
            break
        if attempt < retries:
            print(f"  other processes used {load:.0f}% of the CPU during the run; "
                  "repeating it", flush=True)
    if len(loads) > 1:
        best["busy_attempt_loads"] = loads
    return best


def _total(record: dict[str, Any]) -> float | None:
    times = [r.get("time_s") if r.get("status") == "ok" else None
             for r in record["phases"].values()]
    return None if None in times else sum(times)


def median_record(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record of repeated runs of a configuration: the run of median total time, with
    every phase's ``*time_s`` the median over the runs in which it succeeded
    (``repeat_<field>`` lists them), its peaks and others' CPU share the largest."""
    if len(runs) == 1:
        return runs[0]
    totals = sorted((t, i) for i, r in enumerate(runs) if (t := _total(r)) is not None)
    record = copy.deepcopy(runs[totals[(len(totals) - 1) // 2][1]] if totals else runs[0])
    for phase, entry in record["phases"].items():
        done = [r["phases"][phase] for r in runs
                if r["phases"].get(phase, {}).get("status") == "ok"]
        timed = [k for k, v in entry.items() if k.endswith("time_s") and
                 isinstance(v, (int, float)) and entry.get("status") == "ok" and done]
        for key in timed:
            values = [r[key] for r in done if r.get(key) is not None]
            entry[key], entry[f"repeat_{key}"] = statistics.median(values), values
        for key in ("peak_bytes", "peak_delta_bytes") if timed else ():
            entry[key] = max(r[key] for r in done)
        loads = [r["phases"].get(phase, {}).get("other_cpu_percent_during_phase")
                 for r in runs]
        if any(v is not None for v in loads):  # the most disturbed of the runs
            entry["repeat_other_cpu_percent_during_phase"] = loads
            entry["other_cpu_percent_during_phase"] = max(v for v in loads if v is not None)
    others = [r.get("other_cpu_percent_during") for r in runs]
    record["repeat_other_cpu_percent_during"] = others
    record["other_cpu_percent_during"] = max((v for v in others if v is not None),
                                             default=None)
    record["worker_peak_bytes"] = max((r["worker_peak_bytes"] for r in runs
                                       if r.get("worker_peak_bytes")), default=None)
    record["repeat_total_s"] = [t for t, _ in totals]
    record["repeats"] = len(runs)
    return record


class Plan:
    """The configurations of one output file (``path``), run by :meth:`run` and written by
    :meth:`write`.

    A configuration's ``repeat`` (else ``--repeat``) is its number of runs, ``skip`` why it
    runs none; ``key`` names the fields that name it (``'a/b/c'``, for ``--rerun``);
    ``None`` entries of ``settings`` are filled from the workers' setup records (e.g.
    ``D``). ``run_one`` runs a configuration once (:func:`run_worker`); ``label`` starts
    its progress lines.
    """

    def __init__(self, module: str, configs: list[dict], key: Sequence[str], path: Path,
                 settings: dict[str, Any], info: dict[str, Any]):
        self.module, self.configs, self.key_fields = module, configs, tuple(key)
        self.path, self.settings, self.info = Path(path), settings, info
        self.run_one: Callable[[str, dict, argparse.Namespace], dict] = run_worker
        self.label = ""

    def key(self, config: dict[str, Any]) -> str:
        """A configuration's name, e.g. ``'small/sdpa/quiet/kron'``."""
        return "/".join(str(config[f]) for f in self.key_fields)

    def head(self, key: str) -> str:
        """How a configuration's progress line starts, e.g. ``'[3c3d] lowrank_exact'``."""
        return f"[{self.label}] {key}" if self.label else f"[{key}]"

    def previous(self, args: argparse.Namespace, same: Sequence[str]) -> dict[str, dict]:
        """Records of the file's earlier run, by key, if its ``same`` settings match."""
        if not (getattr(args, "resume", False) and self.path.exists()):
            return {}
        payload = json.loads(self.path.read_text())
        old = payload.get("settings", payload)  # older files hold the settings on top
        old = {"device": payload.get("machine", {}).get("device"), **old}
        mismatch = [k for k in (*same, "device") if old.get(k) != self.settings.get(k)]
        if mismatch:
            print(f"  --resume: not reusing {self.path} (different {', '.join(mismatch)})")
            return {}
        return {self.key(r): r for r in payload.get("records", [])
                if self.key(r) not in getattr(args, "rerun", [])}

    def run(self, args: argparse.Namespace, same: Sequence[str] = ()) -> list[dict]:
        """Run every configuration (rounds over the repeats, saved after each run); the records."""
        done = self.previous(args, same)
        for key, record in done.items():
            print(progress_line(self.head(key), record) + " (from the previous run)",
                  flush=True)
        runs: dict[str, list] = {self.key(c): [] for c in self.configs
                                 if self.key(c) not in done}
        rounds = max([c.get("repeat", getattr(args, "repeat", 1)) for c in self.configs],
                     default=0)
        for round_ in range(rounds):
            for config in self.configs:
                key, n = self.key(config), config.get("repeat", getattr(args, "repeat", 1))
                if key not in runs or round_ >= n or \
                        (runs[key] and (hopeless(runs[key][-1]) or config.get("skip"))):
                    continue
                runs[key].append(self.skipped(config) if config.get("skip") else
                                 run_config(self.module, config, args, self.run_one))
                print(progress_line(self.head(key), runs[key][-1]) +
                      (f" (run {round_ + 1} of {n})" if n > 1 else ""), flush=True)
                self.write(self.records(done, runs), None, args)
        return self.records(done, runs)

    @staticmethod
    def skipped(config: dict[str, Any]) -> dict[str, Any]:
        """The record of a configuration that cannot run (``skip``: why)."""
        return {**config, "phases": {p: {"phase": p, "status": "skipped",
                                         "reason": config["skip"]} for p in config["phases"]}}

    def records(self, done: dict[str, dict], runs: dict[str, list]) -> list[dict]:
        """The records so far, in plan order."""
        records = []
        for config in self.configs:
            key = self.key(config)
            if key in done:
                records.append(done[key])
            elif runs.get(key):
                records.append(median_record(runs[key]))
        return records

    def payload(self, records: list[dict], summary: Any, args: argparse.Namespace) -> dict:
        """The JSON file's content."""
        settings = dict(self.settings)
        setups = [r["setup"] for r in records if r.get("setup", {}).get("status") == "ok"]
        for name in [k for k, v in settings.items() if v is None and setups]:
            settings[name] = setups[0].get(name)
        return {"settings": settings, "machine": self.info,
                "git_head": self.info["lowrank_laplace_sources"].get("git_head", "?"),
                "worker_env": {"OPENBLAS_NUM_THREADS": getattr(args, "blas_threads", 0) or None,
                               "OMP_WAIT_POLICY": getattr(args, "omp_wait_policy", "") or None},
                "records": records, "summary": summary}

    def write(self, records: list[dict], summary: Any, args: argparse.Namespace) -> dict:
        """Write the JSON file (``summary`` ``None`` while running); its content."""
        payload = self.payload(records, summary, args)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(payload, indent=2))
        return payload


def run_results(module: str, configs: dict[str, dict], args: argparse.Namespace) -> dict:
    """Run one :func:`_worker.run_result` worker per configuration; the results by name."""
    results = {}
    for name, config in configs.items():
        record = run_config(module, {**config, "phases": ["result"]}, args)
        print(progress_line(name, record), flush=True)
        phase = record["phases"]["result"]
        if record.get("setup", {}).get("status") != "ok":
            phase = record.get("setup", phase)
        results[name] = phase.get("result") or {k: phase.get(k) for k in ("status", "reason")}
    return results
