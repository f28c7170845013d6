"""Host-device traffic of a ``lowrank_ggn`` fit, from a ``torch.profiler`` trace.

In a fresh worker, a ``lowrank_ggn`` fit on a DeepOBS problem with the data on the device
runs once to warm up, once timed and once profiled, whose events count the host-device
copies, the synchronising scalar reads (:data:`PATTERNS`) and the batches. With ``--top
K`` the first fit is profiled instead of the warm-up and its ``K`` costliest operators on
device and host are listed. Without CUDA it runs on the CPU. Writes
``<out>/gpu_trace_<problem>.json`` (with ``--chrome`` also a Chrome trace)::

    python -m benchmarks.gpu_trace --device cuda --problem 3c3d --n-train 1024
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import _harness, _problems
from benchmarks._report import machine_info
from benchmarks._worker import run_result

#: Substrings of profiler event names, by what they count.
PATTERNS = {
    "memcpy_htod": ("Memcpy HtoD",),
    "memcpy_dtoh": ("Memcpy DtoH",),
    "scalar_reads": ("aten::_local_scalar_dense",),
    "copies_to_or_from_host": ("aten::_to_copy",),  # also dtype casts on one device
}


def count_events(prof: Any) -> dict[str, dict[str, float]]:
    """Per key of :data:`PATTERNS`, the ``count`` and total ``time_ms`` (device time for
    CUDA activities, else CPU time) of a finished profile's events."""
    counts, times = Counter(), Counter()
    for event in prof.events():
        for key, patterns in PATTERNS.items():
            if any(p in event.name for p in patterns):
                counts[key] += 1
                device_us = getattr(event, "device_time_total", 0.0) or 0.0
                times[key] += (device_us or event.cpu_time_total) / 1e3
    return {k: {"count": int(counts[k]), "time_ms": round(times[k], 3)} for k in PATTERNS}


def top_operators(prof: Any, k: int, key: str) -> list[dict[str, Any]]:
    """The ``k`` operators of most self time on the ``"device"`` or ``"host"`` in a finished
    profile: ``name``, ``calls``, ``self_ms`` and ``total_ms`` (CPU time with children)."""
    def self_us(e: Any) -> float:
        if key == "host":
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", 0.0) or 0.0

    events = sorted(prof.key_averages(), key=self_us, reverse=True)[:k]
    return [{"name": e.key, "calls": int(e.count), "self_ms": round(self_us(e) / 1e3, 3),
             "total_ms": round(e.cpu_time_total / 1e3, 3)} for e in events]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, time and profile one fit; return the record (in a worker process)."""
    from laplace import Laplace

    import lowrank_laplace  # noqa: F401  (registers lowrank_ggn)

    device = torch.device(args.device if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    model, _, X, y = _problems.make_problem(args.problem, args.n_train, device=device)
    X, y = X.to(device), y.to(device)
    loader = DataLoader(TensorDataset(X, y), batch_size=args.batch_size)
    warm = DataLoader(TensorDataset(X[: args.batch_size], y[: args.batch_size]),
                      batch_size=args.batch_size)

    def fit(data):
        la = Laplace(model, "classification", subset_of_weights="all",
                     hessian_structure="lowrank_ggn", rank=args.rank,
                     mc_samples=args.mc_samples)
        la.fit(data)
        if cuda:
            torch.cuda.synchronize(device)
        return la

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    top: dict[str, Any] = {}
    if args.top:  # the process's first fit, profiled: where a user's first wait goes
        with profile(activities=activities) as cold:
            start = time.perf_counter()
            fit(loader)
            top["cold_profiled_fit_s"] = round(time.perf_counter() - start, 3)
        top["top_device"] = top_operators(cold, args.top, "device")
        top["top_host"] = top_operators(cold, args.top, "host")
    else:
        fit(warm)
    start = time.perf_counter()
    la = fit(loader)
    seconds = time.perf_counter() - start
    with profile(activities=activities) as prof:
        fit(loader)
    if args.chrome:
        prof.export_chrome_trace(str(Path(args.out) / f"gpu_trace_{args.problem}.trace.json"))
    return {"problem": args.problem, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__, "n_train": args.n_train, "batch_size": args.batch_size,
            "rank": args.rank, "mc_samples": args.mc_samples, "fit_s": round(seconds, 3),
            "batches": len(loader), "kept_fraction": float(la.kept_fraction),
            "events": count_events(prof), **top, "machine": machine_info(str(device))}


def parse_args(argv=None) -> argparse.Namespace:
    """Parse the command line."""
    parser = _harness.script_parser(__doc__, "timeout", "out", out=str(_harness.RESULTS_DIR))
    parser.add_argument("--problem", default="3c3d", choices=_problems.PROBLEMS)
    parser.add_argument("--device", default="cuda", help="cuda (falls back to cpu)")
    parser.add_argument("--n-train", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rank", type=int, default=100)
    parser.add_argument("--mc-samples", type=int, default=0)
    parser.add_argument("--chrome", action="store_true", help="also write a Chrome trace")
    parser.add_argument("--top", type=int, default=0,
                        help="profile the first fit and list its K costliest operators")
    return parser.parse_args(argv)


def driver_main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the fits in a fresh worker process; print and write its record."""
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = {k: getattr(args, k) for k in ("problem", "device", "n_train", "batch_size",
                                             "rank", "mc_samples", "chrome", "top")}
    record = _harness.run_results("benchmarks.gpu_trace", {args.problem: {
        **config, "out": str(out), "threads": None}}, args)[args.problem]
    path = out / f"gpu_trace_{args.problem}.json"
    path.write_text(json.dumps(record, indent=2))
    if "events" not in record:
        print(f"{args.problem}: {record.get('status')}: {record.get('reason')}; wrote {path}")
        return record
    ev = record["events"]
    print(f"{record['problem']} on {record['device_name']}: fit {record['fit_s']} s, "
          f"{record['batches']} batches; {record.get('cold_profiled_fit_s', '-')} s "
          f"first fit (profiled); Memcpy HtoD {ev['memcpy_htod']['count']} "
          f"({ev['memcpy_htod']['time_ms']} ms), DtoH {ev['memcpy_dtoh']['count']} "
          f"({ev['memcpy_dtoh']['time_ms']} ms), scalar reads "
          f"{ev['scalar_reads']['count']}; wrote {path}")
    for key in ("top_device", "top_host"):
        for op in record.get(key, []):
            print(f"  {key} {op['self_ms']:9.2f} ms self {op['total_ms']:9.2f} ms total "
                  f"{op['calls']:6d}x {op['name']}")
    return record


main = _harness.script_main(parse_args, lambda config: run_result(
    config, lambda: run(argparse.Namespace(**config))), driver_main)


if __name__ == "__main__":
    main()
