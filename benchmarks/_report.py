"""What the benchmark drivers write: the run's machine record, progress lines, table rows.

The table records follow ``render_tables.py``'s format (``date``, ``machine``,
``versions``, ``sources``, ``columns``, ``rows``); :func:`table_common` fills the first
four from a run's JSON file, the helpers below format the cells every script shares.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks._load import BUSY_WARN_PERCENT
from benchmarks._worker import GiB, library_fingerprint, num_cores

#: Packages whose versions :func:`machine_info` records by default.
DEFAULT_PACKAGES: tuple[str, ...] = (
    "numpy", "scipy", "curvlinops-for-pytorch", "backpack-for-pytorch", "lowrank_laplace",
    "lowrank-laplace")
#: The machine fields a table record copies from its run.
MACHINE_FIELDS: tuple[str, ...] = ("cpu_name", "cpu_count", "cpu_count_usable", "device",
                                   "device_name", "total_memory_bytes", "platform")
#: How a target's outcome reads in a table.
VERDICTS = {True: "PASS", False: "FAIL", None: "not measurable"}


def machine_info(device: str, packages: Sequence[str] = DEFAULT_PACKAGES) -> dict[str, Any]:
    """The date (UTC), machine, device, ``version_<package>`` of ``packages``, the library's
    sources (:func:`library_fingerprint`) and the load average at the start of a run."""
    import datetime
    import platform

    import torch

    cpu_name = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu_name = next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), cpu_name)
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "cpu_name": cpu_name, "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__, "device": device,
        "device_name": torch.cuda.get_device_name(0) if cuda else cpu_name,
        "cpu_count_usable": num_cores()}
    with contextlib.suppress(ImportError):
        import psutil

        info["total_memory_bytes"] = psutil.virtual_memory().total
    for pkg in packages:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[f"version_{pkg}"] = importlib.metadata.version(pkg)
    info["lowrank_laplace_sources"] = library_fingerprint()
    info["loadavg_at_start"] = list(os.getloadavg())
    return info


def print_machine(info: dict[str, Any]):
    """Print a run's machine, device, versions beyond the defaults, commit and load."""
    versions = "".join(f", {key[len('version_'):]} {value}" for key, value in info.items()
                       if key.startswith("version_") and
                       key[len("version_"):] not in DEFAULT_PACKAGES)
    head = info["lowrank_laplace_sources"]
    print(f"Machine: {info['cpu_name']} ({info['cpu_count']} CPUs, {info['cpu_count_usable']} "
          f"usable), device {info['device']} ({info['device_name']}), torch {info['torch']}"
          f"{versions}; commit {head.get('git_head', '?')[:7]}"
          f"{' (dirty)' if head.get('dirty') else ''}; load average "
          f"{info['loadavg_at_start'][0]:.2f}", flush=True)


def progress_line(key: str, record: dict[str, Any]) -> str:
    """One line about a finished run: every phase's time or status, and what it found."""
    parts, said = [], set()
    for phase, r in record["phases"].items():
        if r.get("status") == "ok":
            parts.append(f"{phase} {r['time_s']:.3g} s (+{r['peak_delta_bytes'] / GiB:.2f} "
                         "GiB)")
        else:  # each reason once
            reason = str(r.get("reason"))[:120]
            parts.append(f"{phase} {str(r.get('status')).upper()}" +
                         ("" if reason in said else f": {reason}"))
            said.add(reason)
    found = {k: v for r in record["phases"].values() for k, v in r.items()}
    for name, text in (("kept_fraction", "kept {:.3f}"), ("num_products", "{} GGNVPs"),
                       ("num_matvecs", "{} GGNVPs"), ("factor_backend_used", "engine {}"),
                       ("backend_used", "engine {}"), ("fit_path", "path {}")):
        if found.get(name) is not None:
            parts.append(text.format(found[name]))
    if record.get("worker_peak_bytes") is not None:
        parts.append(f"worker peak {record['worker_peak_bytes'] / GiB:.2f} GiB")
    if record.get("other_cpu_percent_during") is not None:
        parts.append(f"others {record['other_cpu_percent_during']:.0f}% CPU")
    if record.get("load"):
        parts.append(f"load {record['load'].get('matmuls_per_s', 0):.0f} matmuls/s")
    if record.get("setup", {}).get("mem_limit_requested_bytes"):
        parts.append(f"memory cap lowered to {record['setup']['mem_limit_bytes'] / GiB:.1f} "
                     "GiB (busy machine)")
    return f"  {key}: " + ", ".join(parts)


def fmt(value: float | None, digits: int = 3) -> str:
    """A number with ``digits`` significant digits (``'-'`` for ``None``)."""
    return "-" if value is None else f"{value:.{digits}g}"


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, ``None`` if either is missing or ``b`` is zero."""
    return None if a is None or not b else a / b


def find(records: Iterable[dict], **fields: Any) -> dict | None:
    """The first record whose fields have the given values, ``None`` if none."""
    return next((r for r in records if all(r.get(k) == v for k, v in fields.items())), None)


def ok(r: dict | None) -> dict | None:
    """A phase's record if it succeeded, else ``None``."""
    return r if r and r.get("status") == "ok" else None


def phase_ok(record: dict | None, phase: str) -> dict | None:
    """A configuration's phase record if it succeeded, else ``None``."""
    return None if record is None else ok(record["phases"].get(phase))


def phase_of(records: Iterable[dict], phase: str, **fields: Any) -> dict | None:
    """A phase's record (any status) of the first configuration with the given fields."""
    r = find(records, **fields)
    return None if r is None else r["phases"].get(phase)


def gib(value: float | None) -> str:
    """Bytes in GiB with two decimals (``'-'`` for ``None``)."""
    return "-" if value is None else f"{value / GiB:.2f}"


def max_rel_dev(a: Sequence[float] | None, b: Sequence[float] | None) -> float | None:
    """The largest ``|a_i - b_i| / |b_i|`` (``None``: empty, or lengths differ)."""
    if not a or not b or len(a) != len(b):
        return None
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def target(name: str, where: str, value: float | None, bound: float, **extra: Any) -> dict:
    """A checked target ``value <= bound`` (``passed`` ``None``: not measurable)."""
    return {"name": name, "where": where, "value": value, "bound": bound,
            "passed": None if value is None else value <= bound, **extra}


def others_cpu(record: dict | None) -> float | None:
    """The largest CPU share of other processes during a record's successful phases."""
    if record is None:
        return None
    values = [v for r in record["phases"].values() if r.get("status") == "ok"
              and (v := r.get("other_cpu_percent_during_phase")) is not None]
    return max(values) if values else record.get("other_cpu_percent_during")


def status_text(r: dict | None, width: int = 60) -> str:
    """A failed phase's cell: its status (a timeout's limit, the allocation that ran out of
    memory) and the first line of its reason; ``'-'`` for a skipped phase."""
    if r is None:
        return "not run"
    status, reason = str(r.get("status", "?")), str(r.get("reason") or "")
    if status == "skipped":
        return "-"
    if status == "timeout":
        return f"timeout (> {r.get('time_to_failure_s', 0):.0f} s)"
    if status == "oom":
        text = "out of memory" + (f" after {r['time_to_failure_s']:.0f} s"
                                  if r.get("time_to_failure_s") else "")
        match = re.search(r"allocate (\d+) bytes", reason)
        return text + (f" (allocating {int(match[1]) / GiB:.2g} GiB more)" if match else "")
    lines = reason.splitlines()
    return f"{status}: {lines[0][:width]}" if lines else status


def failure_text(record: dict | None, width: int = 60) -> str:
    """The cell of a configuration without a result: its first failure (``'-'``: none)."""
    if record is None:
        return "not run"
    failed = [r for r in (record.get("setup", {}), *record["phases"].values())
              if r.get("status") not in ("ok", "skipped", None)]
    return status_text(failed[0], width) if failed else "-"


def table_common(payload: dict[str, Any], sources: Sequence[str]) -> dict[str, Any]:
    """``date``, ``machine``, ``versions`` and ``sources`` (where the run's raw file is kept)
    of a run's table records; the ``lowrank_laplace commit`` is the workers' (it says if
    the sources changed during the run)."""
    info, records = payload["machine"], payload["records"]
    versions = {"python": info.get("python"), "torch": info.get("torch")}
    versions.update({key[len("version_"):]: value for key, value in info.items()
                     if key.startswith("version_")})
    prints = [r["setup"]["lowrank_laplace"] for r in records
              if r.get("setup", {}).get("lowrank_laplace")]
    heads = sorted({f.get("git_head", "?")[:7] for f in prints}) or \
        [payload.get("git_head", "?")[:7]]
    commit = ", ".join(heads)
    if len({f.get("sources_sha1") for f in prints}) > 1:
        commit += " (sources changed during the run)"
    if any(f.get("dirty") for f in prints) or \
            any(r.get("setup", {}).get("lowrank_laplace_dirty") for r in records):
        commit += " with uncommitted changes"
    versions["lowrank_laplace commit"] = commit
    return {"date": info["date"][:10], "machine": {k: info.get(k) for k in MACHINE_FIELDS},
            "versions": versions, "sources": list(sources)}


def _measured(t: dict) -> str:
    """A checked target's ratio."""
    return "-" if t["value"] is None else f"{t['value']:.2f}x"


def _peer(t: dict) -> str:
    """Why a checked target's peer failed, in parentheses."""
    return f" ({t['peer_failure']})" if t.get("peer_failure") else ""


def target_rows(targets: Iterable[dict]) -> list[list[str]]:
    """Table rows of checked targets: name, where, the measured ratio, the verdict."""
    return [[t["name"], t["where"], _measured(t) + _peer(t), VERDICTS[t["passed"]]]
            for t in targets]


def print_targets(targets: Iterable[dict]):
    """Print checked targets, one line each."""
    for t in targets:
        verdict = "n/a" if t["passed"] is None else VERDICTS[t["passed"]]
        print(f"  TARGET [{t['where']}] {t['name']}: {_measured(t)} -> {verdict}{_peer(t)}",
              flush=True)


def write_tables(tables: dict[str, dict], folder: str | Path):
    """Write table records (``<id>.json``) into a folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for table_id, record in tables.items():
        (folder / f"{table_id}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"Wrote the table records to {folder}/", flush=True)


def read_run(path: Path) -> dict[str, Any] | None:
    """A run's JSON file for ``--replot`` (``None``, said, if there is none)."""
    if not path.exists():
        print(f"--replot: no {path}")
        return None
    return json.loads(path.read_text())


def warn_others(records: Iterable[dict]):
    """Warn if other processes used much of the CPU during a record's measured phase."""
    others = [v for v in (others_cpu(r) for r in records) if v is not None]
    if others and max(others) > BUSY_WARN_PERCENT:
        print(f"  WARNING: other processes used up to {max(others):.0f}% of the CPU during "
              "a measured phase; timings may be inflated.", flush=True)


def machine_text(info: dict[str, Any]) -> str:
    """The GPU of a run, or its CPU and cores, for a figure's title."""
    if info.get("device") == "cuda":
        return info.get("device_name")
    return f"{info.get('cpu_name')} ({info.get('cpu_count_usable')} cores)"


@contextlib.contextmanager
def figure(path: str | Path, *shape: int, dpi: int = 120, rect: tuple | None = None,
           **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """A matplotlib figure and its axes (``plt.subplots(*shape, **subplots)``, Agg backend),
    laid out (``rect``: the part the axes fill) and written to ``path`` after the block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*shape, **subplots)
    yield fig, axes
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def value_bar(ax: Any, x: float, value: float | None, missing: float = 1.0,
              text: str = "{:.3g}", fontsize: int = 7, **bar: Any):
    """A bar labelled with its value; a missing one is a red cross at ``missing``."""
    if value is None:
        ax.plot(x, missing, "x", color="tab:red", ms=9)
        return
    ax.bar(x, value, **bar)
    ax.text(x, value, text.format(value), ha="center", va="bottom", fontsize=fontsize)


def box_legend(fig: Any, colors: Sequence[str], labels: Sequence[str]):
    """A legend of coloured boxes in the figure's upper right corner, in one row."""
    from matplotlib.patches import Rectangle

    fig.legend([Rectangle((0, 0), 1, 1, color=c) for c in colors], list(labels),
               loc="upper right", fontsize=8, ncol=len(labels))
