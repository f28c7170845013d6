"""Summaries, targets (:func:`check_targets`) and figures of ``bench_laplace.py``."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._load import BUSY_WARN_PERCENT
from benchmarks._problems import LAPLACE_NUM_CLASSES as NUM_CLASSES
from benchmarks._problems import LAPLACE_NUM_PARAMS as EXPECTED_NUM_PARAMS
from benchmarks._report import VERDICTS, figure, ok, phase_of, ratio
from benchmarks._worker import GiB

PHASES: tuple[str, ...] = ("fit", "glm", "nn")
# Targets
REFERENCE = "lowrank_exact"
KRON_PEER = "kron_backpack"
FULL_PEER = "full_backpack"
#: Exact fit time <= this times the BackPACK-kron fit time, per problem (digits: none on
#: the fit alone, see TARGET_MARGLIK_VS_KRON).
TARGET_EXACT_VS_KRON = {"3c3d": 2.0, "2c2d": 2.0, "mlp": 2.0}
#: MC fit time <= this times the BackPACK-kron fit time, per problem (1x elsewhere).
TARGET_MC_VS_KRON = {"3c3d": 0.5, "2c2d": 0.5, "mlp": 1.0}
#: Exact fit + marglik prior tuning <= this times kron's (where marglik was timed).
TARGET_MARGLIK_VS_KRON = 3.0
TARGET_LANCZOS_SPEEDUP = 5.0  # Lanczos fit time >= 5x exact fit time
TARGET_GLM_MEMORY_BYTES = 2 * GiB  # GLM predictive peak memory on 3c3d
TARGET_GLM_MEMORY_PROBLEM = "3c3d"


def _phase(records: Sequence[dict], method: str, phase: str) -> dict | None:
    """The record of a phase of a method (``None`` if the method did not run)."""
    return phase_of(records, phase, method=method)


def _ok(records: Sequence[dict], method: str, phase: str) -> dict | None:
    """The record of a phase of a method if it succeeded, else ``None``."""
    return ok(_phase(records, method, phase))


def _cell(r: dict | None, key: str, scale: float = 1.0, fmt: str = "{:.3g}") -> str:
    """A table cell: the value of a successful phase, or its failure status."""
    if r is None:
        return "-"
    if r.get("status") != "ok":
        return str(r.get("status", "fail")).upper()
    value = r.get(key)
    return "-" if value is None else fmt.format(value / scale)


def _rel_dev_eigenvalues(a: Sequence[float], b: Sequence[float], k: int) -> float:
    """``max_i |a_i - b_i| / |b_i|`` over the leading ``k`` (``nan`` if empty)."""
    devs = [abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a[:k], b[:k])]
    return max(devs) if devs else math.nan


def _target(name: str, value: float | None, passed: bool | None, text: str) -> dict:
    return {"name": name, "value": value, "passed": passed,
            "text": text if value is not None else "missing or failed run"}


def _bounded(name: str, value: float | None, bound: float | None, note: str = "") -> dict:
    """The target ``value <= bound`` on a ratio (``bound`` ``None``: informative)."""
    return _target(name, value, None if value is None or not bound else value <= bound,
                   f"ratio {value or 0:.2f}{note}")


def _time_ratio(a: dict | None, b: dict | None) -> float | None:
    return ratio(a and a["time_s"], b and b["time_s"])


def _with_marglik(r: dict | None) -> float | None:
    return None if r is None or r.get("marglik_time_s") is None else \
        r["time_s"] + r["marglik_time_s"]


def _fit_targets(problem: str, records: Sequence[dict]) -> list[dict[str, Any]]:
    """Exact and MC fits against BackPACK-``kron`` (and ``full``, with marglik tuning)."""
    ref, mc, kron = (_ok(records, m, "fit") for m in (REFERENCE, "lowrank_mc", KRON_PEER))
    bound = TARGET_EXACT_VS_KRON.get(problem)
    targets = [_bounded(f"{REFERENCE} fit <= {bound:g}x {KRON_PEER} fit" if bound else
                        f"{REFERENCE} fit / {KRON_PEER} fit (informative)",
                        _time_ratio(ref, kron), bound)]
    full = _with_marglik(_ok(records, FULL_PEER, "fit"))
    ours, kron_total = _with_marglik(ref), _with_marglik(kron)
    if ours is not None and full is not None:
        targets.append(_bounded(f"{REFERENCE} fit+marglik <= {FULL_PEER} fit+marglik",
                                ours / full, 1.0))
    if ours is not None and kron_total is not None:
        targets.append(_bounded(f"{REFERENCE} fit+marglik <= {TARGET_MARGLIK_VS_KRON:g}x "
                                f"{KRON_PEER} fit+marglik", ours / kron_total,
                                TARGET_MARGLIK_VS_KRON))
    bound = TARGET_MC_VS_KRON.get(problem, 1.0)
    targets.append(_bounded(f"lowrank_mc fit <= {bound:g}x {KRON_PEER} fit",
                            _time_ratio(mc, kron), bound))
    return targets


def _sketch_targets(problem: str, records: Sequence[dict]) -> list[dict[str, Any]]:
    """The defaults and the opt-in sketch against the same bounds, with their kept trace."""
    targets, kron = [], _ok(records, KRON_PEER, "fit")
    kron_total = _with_marglik(kron)
    for method, base, bounds, kind in (
            ("lowrank_default", REFERENCE, TARGET_EXACT_VS_KRON, "default arguments"),
            ("lowrank_exact_sketch", REFERENCE, TARGET_EXACT_VS_KRON, "opt-in, approximate"),
            ("lowrank_mc_sketch", "lowrank_mc", TARGET_MC_VS_KRON, "opt-in, approximate")):
        sketch, streamed = _ok(records, method, "fit"), _ok(records, base, "fit")
        if not (sketch and kron):
            continue
        kept = f"kept trace {sketch.get('kept_fraction', float('nan')):.3f}"
        if streamed and streamed.get("kept_fraction") is not None:
            kept += f" (streaming {streamed['kept_fraction']:.3f})"
        bound = bounds.get(problem, None if base == REFERENCE else 1.0)
        if bound:
            targets.append(_bounded(f"{method} fit <= {bound:g}x {KRON_PEER} fit ({kind})",
                                    sketch["time_s"] / kron["time_s"], bound, f", {kept}"))
        total = _with_marglik(sketch)
        if base == REFERENCE and total is not None and kron_total is not None:
            targets.append(_bounded(
                f"{method} fit+marglik <= {TARGET_MARGLIK_VS_KRON:g}x {KRON_PEER} "
                f"fit+marglik ({kind})", total / kron_total, TARGET_MARGLIK_VS_KRON,
                f", {kept}"))
    return targets


def check_targets(problem: str, records: Sequence[dict]) -> list[dict[str, Any]]:
    """The targets of one problem's method records: per target ``name``, ``value`` (ratio
    or bytes), ``text`` and ``passed`` (``None``: not measurable; a Lanczos run that timed
    out passes the speed-up target if its lower bound does)."""
    targets = _fit_targets(problem, records) + _sketch_targets(problem, records)
    ref, lanczos = _ok(records, REFERENCE, "fit"), _phase(records, "lanczos", "fit")
    name = f"lanczos fit >= {TARGET_LANCZOS_SPEEDUP:g}x {REFERENCE} fit"
    status = (lanczos or {}).get("status") if ref else None
    if status == "ok":
        speedup = lanczos["time_s"] / ref["time_s"]
        targets.append(_target(name, speedup, speedup >= TARGET_LANCZOS_SPEEDUP,
                               f"speed-up {speedup:.2f}"))
    elif status == "timeout":
        bound = lanczos["time_to_failure_s"] / ref["time_s"]
        targets.append(_target(name, bound, True if bound >= TARGET_LANCZOS_SPEEDUP else None,
                               f"speed-up > {bound:.2f} (Lanczos timed out)"))
    else:
        targets.append(_target(name, None, None, ""))
    name = f"{REFERENCE} GLM predictive peak memory < {TARGET_GLM_MEMORY_BYTES / GiB:g} GiB"
    if problem != TARGET_GLM_MEMORY_PROBLEM:
        name += f" (target for {TARGET_GLM_MEMORY_PROBLEM}; informative here)"
    glm = _ok(records, REFERENCE, "glm") or {}
    delta = glm.get("peak_delta_bytes")
    passed = None if delta is None or problem != TARGET_GLM_MEMORY_PROBLEM else \
        delta < TARGET_GLM_MEMORY_BYTES
    targets.append(_target(name, delta, passed, "" if delta is None else
                           f"{delta / GiB:.3f} GiB above the fitted state "
                           f"({glm['peak_bytes'] / GiB:.2f} GiB absolute process peak)"))
    return targets


def _print_table(problem: str, records: Sequence[dict], args: argparse.Namespace):
    """Print times and peak memory per method and phase, failures and warnings."""
    print(f"\n=== {problem}: D = {EXPECTED_NUM_PARAMS[problem]:,}, C = "
          f"{NUM_CLASSES[problem]}, n_train = {args.n_train} (batch {args.batch_size}), "
          f"n_test = {args.n_test}, rank = {args.rank}, NN samples = {args.nn_samples} ===")
    width = max(len(r["method"]) for r in records) + 2
    print("\nTimes in seconds; memory in GiB: peak above the state before the phase")
    print("(GLM abs: absolute peak RSS of the worker during the GLM predictive)\n")
    print(f"{'method':<{width}}{'fit [s]':>10}{'GLM [s]':>10}{'NN [s]':>10}"
          f"{'fit mem':>10}{'GLM mem':>10}{'NN mem':>10}{'GLM abs':>10}{'kept':>8}")
    for r in records:
        fit, glm, nn_ = (r["phases"].get(p) for p in PHASES)
        kept = fit.get("kept_fraction") if fit else None
        row = f"{r['method']:<{width}}" + "".join(
            f"{_cell(p, 'time_s'):>10}" for p in (fit, glm, nn_)) + "".join(
            f"{_cell(p, key, GiB, '{:.2f}'):>10}" for p, key in (
                (fit, "peak_delta_bytes"), (glm, "peak_delta_bytes"),
                (nn_, "peak_delta_bytes"), (glm, "peak_bytes"))) + \
            f"{'-' if kept is None else f'{kept:.3f}':>8}"
        if fit and fit.get("marglik_time_s") is not None:
            row += f"  marglik {fit['marglik_time_s']:.3g} s"
        if fit and fit.get("fit_path"):
            row += f"  ({fit['fit_path']})"
        print(row)
    print("(kept: fraction of the GGN trace held by the kept eigenpairs)")
    fails: dict[tuple, list[str]] = {}  # (method, status, reason, when) -> phases
    for r in records:
        for p, pr in r["phases"].items():
            when = pr.get("time_to_failure_s")
            if pr.get("status") != "ok":
                fails.setdefault((r["method"], pr.get("status"), str(pr.get("reason"))[:300],
                                  "" if when is None else f" after {when:.1f} s"), []).append(p)
    if fails:
        print("\nFailures and skips:")
        for (m, status, reason, when), phases in fails.items():
            print(f"  {m} {'/'.join(phases)}: {status}{when}: {reason}")
    for r in records:
        for p, pr in r["phases"].items():
            for w in pr.get("warnings", []):
                print(f"  WARNING {r['method']} {p}: {w}")


def _eigenvalue_check(records: Sequence[dict], rank: int) -> dict[str, dict]:
    """Leading GGN eigenvalues of ours against Lanczos's (informative)."""
    lanczos, devs = _ok(records, "lanczos", "fit"), {}
    if not (lanczos and lanczos.get("eigenvalues")):
        return devs
    print("\nLeading GGN eigenvalues vs. Lanczos (max relative deviation, informative):")
    for m in ("lowrank_exact", "lowrank_mc"):
        r = _ok(records, m, "fit")
        if r is not None and r.get("eigenvalues"):
            devs[m] = {k: _rel_dev_eigenvalues(r["eigenvalues"], lanczos["eigenvalues"], k)
                       for k in (1, 10, rank)}
            print("  " + m + ": " + ", ".join(f"top {k}: {v:.2e}" for k, v in devs[m].items()))
    return devs


def _load_check(records: Sequence[dict]) -> dict[str, Any]:
    """The CPU share of other processes during the workers and their timed phases."""
    loads = [(r["method"], w.get("other_cpu_percent_during")) for r in records
             for w in r.get("workers") or [r, *r.get("restarts", [])]
             if w.get("other_cpu_percent_during") is not None]
    # per timed phase (CPU accounting has ~10 ms granularity: phases >= 0.5 s only)
    phase_loads = {f"{r['method']} {p}": pr["other_cpu_percent_during_phase"]
                   for r in records for p, pr in r["phases"].items()
                   if pr.get("status") == "ok" and pr.get("time_s", 0.0) >= 0.5
                   and pr.get("other_cpu_percent_during_phase") is not None}
    noisy = {k: v for k, v in phase_loads.items() if v > BUSY_WARN_PERCENT}
    if noisy:
        worst = ", ".join(f"{k} ({v:.0f}%)" for k, v in
                          sorted(noisy.items(), key=lambda kv: -kv[1]))
        print(f"\n  WARNING: other processes used more than {BUSY_WARN_PERCENT:g}% of the "
              f"CPU during timed phases: {worst}; these timings may be distorted.")
    elif any(v > BUSY_WARN_PERCENT for _, v in loads):
        busy = sorted({m for m, v in loads if v > BUSY_WARN_PERCENT})
        print(f"\n  Note: other processes used more than {BUSY_WARN_PERCENT:g}% of the CPU "
              f"during the workers of {busy} (not necessarily during timed phases).")
    return {"max_other_cpu_percent_during": max((v for _, v in loads), default=None),
            "max_other_cpu_percent_during_timed_phases": max(phase_loads.values(),
                                                             default=None)}


def summarize(problem: str, records: Sequence[dict], args: argparse.Namespace) -> dict[str, Any]:
    """Print the result table, failures and targets of a problem's method records; the
    summary (targets, eigenvalue deviations, CPU load)."""
    _print_table(problem, records, args)
    summary = {"eigenvalue_deviation_from_lanczos": _eigenvalue_check(records, args.rank),
               **_load_check(records), "targets": check_targets(problem, records)}
    print(f"\nTargets ({problem}):")
    for t in summary["targets"]:
        verdict = "n/a" if t["passed"] is None else VERDICTS[t["passed"]]
        print(f"  [{verdict:>4}] {t['name']}: {t['text']}")
    return summary


def _bars(ax, entries: Sequence[dict | None], value_of, style: dict[str, Any]):
    """One bar per method; failures hatched (log panels) or a red cross (linear)."""
    values = [value_of(r) if r and r.get("status") == "ok" else None for r in entries]
    ok_vals = [v for v in values if v is not None and v > 0]
    top, log = max(ok_vals, default=1.0), style.get("log", True)
    low = min(ok_vals, default=1.0) if log else 0.0
    label, x0, width = style.get("label"), style.get("offset", 0.0), style.get("width", 0.8)
    for i, (r, v) in enumerate(zip(entries, values)):
        x = i + x0
        if r is None:  # the phase does not apply (Lanczos has no predictive)
            if log:
                ax.text(x, low, "n/a", ha="center", va="bottom", fontsize=7)
        elif v is not None:
            ax.bar(x, v, width, color=style["colors"][i], label=label)
            label = None
            if log:
                ax.text(x, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
        elif not log:
            ax.plot(x, 0.02 * top, "x", color="tab:red", ms=5)
        else:  # failed or skipped: hatched bar up to the time of the failure (if known)
            bound = r.get("time_to_failure_s")
            ax.bar(x, bound or top, width, color="none", edgecolor="tab:red", hatch="//")
            ax.text(x, low, str(r.get("status")).upper() + (f" after {bound:.4g} s" if bound
                                                            else ""),
                    rotation=90, ha="center", va="bottom", fontsize=7, color="tab:red")


def plot(problem: str, records: Sequence[dict], path: Path, info: dict[str, Any], args):
    """Bar charts of fit time, predictive times and peak memory per method."""
    methods = [r["method"] for r in records]
    kinds = {"ours": "tab:blue", "laplace": "tab:gray", "lanczos": "tab:orange"}
    colors = [kinds[r["kind"]] for r in records]
    with figure(path, 1, 4, figsize=(18, 4.8)) as (fig, axes):
        for ax, (phase, title) in zip(axes, (
                ("fit", "fit time [s]"), ("glm", "GLM probit predictive time [s]"),
                ("nn", f"NN MC predictive time [s] (S={args.nn_samples})"))):
            _bars(ax, [_phase(records, m, phase) for m in methods], lambda r: r["time_s"],
                  {"colors": colors})
            ax.set_yscale("log")
            ax.set_title(title, fontsize=9)
        for j, (phase, color) in enumerate((("fit", "tab:blue"), ("glm", "tab:green"),
                                            ("nn", "tab:purple"))):
            _bars(axes[3], [_phase(records, m, phase) for m in methods],
                  lambda r: r["peak_delta_bytes"] / GiB,
                  {"offset": (j - 1) * 0.27, "width": 0.27, "colors": [color] * len(methods),
                   "label": phase, "log": False})
        axes[3].plot([], [], "x", color="tab:red", label="failed/skipped")
        axes[3].axhline(TARGET_GLM_MEMORY_BYTES / GiB, color="k", ls="--", lw=1,
                        label="2 GiB")
        axes[3].set_title("peak memory above the state before the phase [GiB]", fontsize=9)
        axes[3].legend(fontsize=7)
        for ax in axes:
            ax.set_xticks(range(len(methods)))
            ax.set_xticklabels(methods, rotation=60, ha="right", fontsize=7)
            ax.grid(alpha=0.3, axis="y", which="both")
        fig.suptitle(f"{problem} (D={EXPECTED_NUM_PARAMS[problem]:,}): Laplace on all "
                     f"weights, n_train={args.n_train}, n_test={args.n_test}, rank={args.rank} "
                     f"[{info.get('device_name', '')}; hatched: failed/skipped]", fontsize=10)
