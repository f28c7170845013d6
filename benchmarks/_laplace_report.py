"""Summaries, targets and figures of ``bench_laplace.py``.

Prints the result table, failures, eigenvalue checks and CPU-load warnings of a
problem (:func:`summarize`), evaluates the benchmark's targets
(:func:`check_targets`) and draws the bar charts (:func:`plot`) from the method
records written by the driver.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._harness import BUSY_WARN_PERCENT, GiB
from benchmarks._laplace_worker import EXPECTED_NUM_PARAMS, NUM_CLASSES, PHASES

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
    """Find the record of a phase of a method.

    Args:
        records: Method records of a problem.
        method: Method name.
        phase: Phase name.

    Returns:
        The phase record, ``None`` if the method was not run.
    """
    for r in records:
        if r["method"] == method:
            return r["phases"].get(phase)
    return None


def _ok(records: Sequence[dict], method: str, phase: str) -> dict | None:
    """Find the successful record of a phase of a method.

    Args:
        records: Method records of a problem.
        method: Method name.
        phase: Phase name.

    Returns:
        The phase record if it succeeded, else ``None``.
    """
    r = _phase(records, method, phase)
    return r if r is not None and r.get("status") == "ok" else None


def _fmt_cell(r: dict | None, key: str, scale: float = 1.0, fmt: str = "{:.3g}") -> str:
    """Format a table cell: the value of a successful phase or its failure status.

    Args:
        r: Phase record or ``None``.
        key: Value to show.
        scale: Divisor of the value.
        fmt: Format of the value.

    Returns:
        The cell text.
    """
    if r is None:
        return "-"
    if r.get("status") != "ok":
        return str(r.get("status", "fail")).upper()
    value = r.get(key)
    return "-" if value is None else fmt.format(value / scale)


def _verdict(ok: bool | None) -> str:
    """Format the outcome of a target check.

    Args:
        ok: Whether the target is met, ``None`` if it cannot be evaluated.

    Returns:
        ``'PASS'``, ``'FAIL'`` or ``'n/a'``.
    """
    if ok is None:
        return "n/a"
    return "PASS" if ok else "FAIL"


def _rel_dev_eigenvalues(a: Sequence[float], b: Sequence[float], k: int) -> float:
    """Maximum relative deviation of the leading ``k`` eigenvalues of ``a`` from ``b``.

    Args:
        a: Eigenvalues (descending).
        b: Reference eigenvalues (descending).
        k: Number of leading eigenvalues compared.

    Returns:
        ``max_i |a_i - b_i| / |b_i|`` over ``i < k`` (``nan`` if empty).
    """
    devs = [abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a[:k], b[:k])]
    return max(devs) if devs else math.nan


def check_targets(problem: str, records: Sequence[dict]) -> list[dict[str, Any]]:
    """Evaluate the benchmark's targets on one problem.

    A Lanczos run that timed out gives a lower bound on its time, which passes the
    speed-up target if the bound already does.

    Args:
        problem: Problem name.
        records: Method records of the problem.

    Returns:
        One dictionary per target: ``name``, ``value`` (ratio or bytes), ``text``
        and ``passed`` (``None`` if not evaluable).
    """
    targets = []
    ref = _ok(records, REFERENCE, "fit")
    mc = _ok(records, "lowrank_mc", "fit")
    kron = _ok(records, KRON_PEER, "fit")

    def add(name, value, passed, text):
        targets.append({"name": name, "value": value, "passed": passed, "text": text})

    bound = TARGET_EXACT_VS_KRON.get(problem)
    name = (f"{REFERENCE} fit <= {bound:g}x {KRON_PEER} fit" if bound
            else f"{REFERENCE} fit / {KRON_PEER} fit (informative)")
    if ref and kron:
        ratio = ref["time_s"] / kron["time_s"]
        add(name, ratio, ratio <= bound if bound else None, f"ratio {ratio:.2f}")
    else:
        add(name, None, None, "missing or failed run")

    def with_marglik(r):
        return None if r is None or r.get("marglik_time_s") is None else \
            r["time_s"] + r["marglik_time_s"]

    full = with_marglik(_ok(records, FULL_PEER, "fit"))
    ours, kron_total = with_marglik(ref), with_marglik(kron)
    if ours is not None and (full is not None or kron_total is not None):
        if full is not None:
            ratio = ours / full
            add(f"{REFERENCE} fit+marglik <= {FULL_PEER} fit+marglik", ratio, ratio <= 1.0,
                f"ratio {ratio:.2f}")
        if kron_total is not None:
            ratio = ours / kron_total
            add(f"{REFERENCE} fit+marglik <= {TARGET_MARGLIK_VS_KRON:g}x {KRON_PEER} "
                "fit+marglik", ratio, ratio <= TARGET_MARGLIK_VS_KRON, f"ratio {ratio:.2f}")

    bound = TARGET_MC_VS_KRON.get(problem, 1.0)
    name = f"lowrank_mc fit <= {bound:g}x {KRON_PEER} fit"
    if mc and kron:
        ratio = mc["time_s"] / kron["time_s"]
        add(name, ratio, ratio <= bound, f"ratio {ratio:.2f}")
    else:
        add(name, None, None, "missing or failed run")

    # the library's defaults and the opt-in sketch against the same bounds, with the
    # trace they keep
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
        ratio = sketch["time_s"] / kron["time_s"]
        if bound:
            add(f"{method} fit <= {bound:g}x {KRON_PEER} fit ({kind})", ratio,
                ratio <= bound, f"ratio {ratio:.2f}, {kept}")
        total = with_marglik(sketch)
        if base == REFERENCE and total is not None and kron_total is not None:
            ratio = total / kron_total
            add(f"{method} fit+marglik <= {TARGET_MARGLIK_VS_KRON:g}x {KRON_PEER} fit+marglik "
                f"({kind})", ratio, ratio <= TARGET_MARGLIK_VS_KRON,
                f"ratio {ratio:.2f}, {kept}")

    name = f"lanczos fit >= {TARGET_LANCZOS_SPEEDUP:g}x {REFERENCE} fit"
    lanczos = _phase(records, "lanczos", "fit")
    if ref and lanczos and lanczos.get("status") == "ok":
        ratio = lanczos["time_s"] / ref["time_s"]
        add(name, ratio, ratio >= TARGET_LANCZOS_SPEEDUP, f"speed-up {ratio:.2f}")
    elif ref and lanczos and lanczos.get("status") == "timeout":
        bound = lanczos["time_to_failure_s"] / ref["time_s"]
        passed = True if bound >= TARGET_LANCZOS_SPEEDUP else None
        add(name, bound, passed, f"speed-up > {bound:.2f} (Lanczos timed out)")
    else:
        add(name, None, None, "missing or failed run")

    name = f"{REFERENCE} GLM predictive peak memory < {TARGET_GLM_MEMORY_BYTES / GiB:g} GiB"
    if problem != TARGET_GLM_MEMORY_PROBLEM:
        name += f" (target for {TARGET_GLM_MEMORY_PROBLEM}; informative here)"
    glm = _ok(records, REFERENCE, "glm")
    if glm:
        delta = glm["peak_delta_bytes"]
        passed = delta < TARGET_GLM_MEMORY_BYTES
        text = (
            f"{delta / GiB:.3f} GiB above the fitted state "
            f"({glm['peak_bytes'] / GiB:.2f} GiB absolute process peak)"
        )
        add(name, delta, passed if problem == TARGET_GLM_MEMORY_PROBLEM else None, text)
    else:
        add(name, None, None, "missing or failed run")
    return targets


def summarize(problem: str, records: Sequence[dict], args: argparse.Namespace) -> dict[str, Any]:
    """Print the result table, failures and targets of a problem.

    Args:
        problem: Problem name.
        records: Method records of the problem.
        args: Parsed command line arguments of the driver.

    Returns:
        Summary (targets, eigenvalue deviations, CPU load warnings).
    """
    D, C = EXPECTED_NUM_PARAMS[problem], NUM_CLASSES[problem]
    summary: dict[str, Any] = {}
    print(
        f"\n=== {problem}: D = {D:,}, C = {C}, n_train = {args.n_train} "
        f"(batch {args.batch_size}), n_test = {args.n_test}, rank = {args.rank}, "
        f"NN samples = {args.nn_samples} ==="
    )
    width = max(len(r["method"]) for r in records) + 2
    header = (
        f"{'method':<{width}}{'fit [s]':>10}{'GLM [s]':>10}{'NN [s]':>10}"
        f"{'fit mem':>10}{'GLM mem':>10}{'NN mem':>10}{'GLM abs':>10}{'kept':>8}"
    )
    print("\nTimes in seconds; memory in GiB: peak above the state before the phase")
    print("(GLM abs: absolute peak RSS of the worker during the GLM predictive)\n")
    print(header)
    for r in records:
        m = r["method"]
        fit, glm, nn_ = (r["phases"].get(p) for p in PHASES)
        kept = fit.get("kept_fraction") if fit else None
        row = (
            f"{m:<{width}}"
            f"{_fmt_cell(fit, 'time_s'):>10}{_fmt_cell(glm, 'time_s'):>10}"
            f"{_fmt_cell(nn_, 'time_s'):>10}"
            f"{_fmt_cell(fit, 'peak_delta_bytes', GiB, '{:.2f}'):>10}"
            f"{_fmt_cell(glm, 'peak_delta_bytes', GiB, '{:.2f}'):>10}"
            f"{_fmt_cell(nn_, 'peak_delta_bytes', GiB, '{:.2f}'):>10}"
            f"{_fmt_cell(glm, 'peak_bytes', GiB, '{:.2f}'):>10}"
            f"{'-' if kept is None else f'{kept:.3f}':>8}"
        )
        if fit and fit.get("marglik_time_s") is not None:
            row += f"  marglik {fit['marglik_time_s']:.3g} s"
        if fit and fit.get("fit_path"):
            row += f"  ({fit['fit_path']})"
        print(row)
    print("(kept: fraction of the GGN trace held by the kept eigenpairs)")

    fails: dict[tuple, list[str]] = {}  # (method, status, reason, when) -> phases
    for r in records:
        for p, pr in r["phases"].items():
            if pr.get("status") == "ok":
                continue
            when = pr.get("time_to_failure_s")
            when = f" after {when:.1f} s" if when is not None else ""
            key = (r["method"], pr.get("status"), str(pr.get("reason"))[:300], when)
            fails.setdefault(key, []).append(p)
    if fails:
        print("\nFailures and skips:")
        for (m, status, reason, when), phases in fails.items():
            print(f"  {m} {'/'.join(phases)}: {status}{when}: {reason}")
    for r in records:
        for p, pr in r["phases"].items():
            for w in pr.get("warnings", []):
                print(f"  WARNING {r['method']} {p}: {w}")

    # Sanity check (informative): leading eigenvalues of ours vs. Lanczos
    lanczos = _ok(records, "lanczos", "fit")
    summary["eigenvalue_deviation_from_lanczos"] = {}
    if lanczos and lanczos.get("eigenvalues"):
        print("\nLeading GGN eigenvalues vs. Lanczos (max relative deviation, informative):")
        for m in ("lowrank_exact", "lowrank_mc"):
            r = _ok(records, m, "fit")
            if r is None or not r.get("eigenvalues"):
                continue
            devs = {
                k: _rel_dev_eigenvalues(r["eigenvalues"], lanczos["eigenvalues"], k)
                for k in (1, 10, args.rank)
            }
            summary["eigenvalue_deviation_from_lanczos"][m] = devs
            print("  " + m + ": " + ", ".join(f"top {k}: {v:.2e}" for k, v in devs.items()))

    loads = [
        (r["method"], w.get("other_cpu_percent_during"))
        for r in records
        for w in r["workers"]
        if w.get("other_cpu_percent_during") is not None
    ]
    summary["max_other_cpu_percent_during"] = max((v for _, v in loads), default=None)
    # per timed phase (CPU accounting has ~10 ms granularity: phases >= 0.5 s only)
    phase_loads = {
        f"{r['method']} {p}": pr["other_cpu_percent_during_phase"]
        for r in records
        for p, pr in r["phases"].items()
        if pr.get("status") == "ok"
        and pr.get("time_s", 0.0) >= 0.5
        and pr.get("other_cpu_percent_during_phase") is not None
    }
    summary["max_other_cpu_percent_during_timed_phases"] = max(phase_loads.values(), default=None)
    noisy = {k: v for k, v in phase_loads.items() if v > BUSY_WARN_PERCENT}
    if noisy:
        worst = ", ".join(
            f"{k} ({v:.0f}%)" for k, v in sorted(noisy.items(), key=lambda kv: -kv[1])
        )
        print(
            f"\n  WARNING: other processes used more than {BUSY_WARN_PERCENT:g}% of the CPU "
            f"during timed phases: {worst}; these timings may be distorted."
        )
    elif any(v > BUSY_WARN_PERCENT for _, v in loads):
        busy = sorted({m for m, v in loads if v > BUSY_WARN_PERCENT})
        print(
            f"\n  Note: other processes used more than {BUSY_WARN_PERCENT:g}% of the CPU "
            f"during the workers of {busy} (not necessarily during timed phases)."
        )

    targets = check_targets(problem, records)
    summary["targets"] = targets
    print(f"\nTargets ({problem}):")
    for t in targets:
        print(f"  [{_verdict(t['passed']):>4}] {t['name']}: {t['text']}")
    return summary


def plot(problem: str, records: Sequence[dict], path: Path, info: dict[str, Any], args):
    """Bar charts of fit time, predictive times and peak memory per method.

    Failed or skipped phases are drawn as hatched placeholder bars labelled with
    their status.

    Args:
        problem: Problem name.
        records: Method records of the problem.
        path: Output path of the figure.
        info: Machine information.
        args: Parsed command line arguments of the driver.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [r["method"] for r in records]
    panels = [
        ("fit", "fit time [s]"),
        ("glm", "GLM probit predictive time [s]"),
        ("nn", f"NN MC predictive time [s] (S={args.nn_samples})"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.8))
    colors = {"ours": "tab:blue", "laplace": "tab:gray", "lanczos": "tab:orange"}
    kinds = {r["method"]: r["kind"] for r in records}
    x = list(range(len(methods)))

    def bars(ax, phase, value_of, offset=0.0, width=0.8, color=None, label=None, log=True):
        """Draw one bar per method; failures hatched with their status."""
        entries = [_phase(records, m, phase) for m in methods]
        values = [value_of(r) if r and r.get("status") == "ok" else None for r in entries]
        ok_vals = [v for v in values if v is not None and v > 0]
        top = max(ok_vals, default=1.0)
        low = min(ok_vals, default=1.0) if log else 0.0
        for i, (r, v) in enumerate(zip(entries, values)):
            c = color or colors[kinds[methods[i]]]
            if r is None:  # phase does not apply (Lanczos has no predictive)
                if log:
                    ax.text(i + offset, low, "n/a", ha="center", va="bottom", fontsize=7)
                continue
            if v is not None:
                ax.bar(i + offset, v, width, color=c, label=label)
                label = None
                if log:
                    ax.text(i + offset, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
                continue
            status = str(r.get("status"))
            if not log:  # memory panel: a red cross per failed or skipped phase
                ax.plot(i + offset, 0.02 * top, "x", color="tab:red", ms=5)
                continue
            # failed or skipped: hatched bar up to the time of the failure (if known)
            bound = r.get("time_to_failure_s")
            ax.bar(i + offset, bound or top, width, color="none", edgecolor="tab:red", hatch="//")
            text = status.upper() + (f" after {bound:.4g} s" if bound else "")
            ax.text(
                i + offset,
                low,
                text,
                rotation=90,
                ha="center",
                va="bottom",
                fontsize=7,
                color="tab:red",
            )

    for ax, (phase, title) in zip(axes, panels):
        bars(ax, phase, lambda r: r["time_s"])
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)

    ax = axes[3]
    width = 0.27
    for j, (phase, color) in enumerate(
        (("fit", "tab:blue"), ("glm", "tab:green"), ("nn", "tab:purple"))
    ):
        bars(
            ax,
            phase,
            lambda r: r["peak_delta_bytes"] / GiB,
            (j - 1) * width,
            width,
            color,
            phase,
            log=False,
        )
    ax.plot([], [], "x", color="tab:red", label="failed/skipped")
    ax.axhline(TARGET_GLM_MEMORY_BYTES / GiB, color="k", ls="--", lw=1, label="2 GiB")
    ax.set_title("peak memory above the state before the phase [GiB]", fontsize=9)
    ax.legend(fontsize=7)

    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(methods, rotation=60, ha="right", fontsize=7)
        ax.grid(alpha=0.3, axis="y", which="both")
    fig.suptitle(
        f"{problem} (D={EXPECTED_NUM_PARAMS[problem]:,}): Laplace on all weights, "
        f"n_train={args.n_train}, n_test={args.n_test}, rank={args.rank} "
        f"[{info.get('device_name', '')}; hatched: failed/skipped]",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _progress(problem: str, record: dict[str, Any]) -> str:
    """One-line description of a method's phases.

    Args:
        problem: Problem name.
        record: Method record.

    Returns:
        The line.
    """
    parts = []
    for phase, r in record["phases"].items():
        if r.get("status") == "ok":
            parts.append(f"{phase} {r['time_s']:.3g} s (+{r['peak_delta_bytes'] / GiB:.2f} GiB)")
        else:
            parts.append(f"{phase} {str(r.get('status')).upper()}")
    fit = record["phases"].get("fit", {})
    if fit.get("kept_fraction") is not None:
        parts.append(f"kept {fit['kept_fraction']:.3f}")
    if fit.get("num_matvecs") is not None:
        parts.append(f"{fit['num_matvecs']} GGNVPs")
    for w in record["workers"]:
        cap = w.get("setup", {}).get("mem_limit_bytes")
        if w.get("setup", {}).get("mem_limit_requested_bytes") and cap:
            parts.append(f"memory cap lowered to {cap / GiB:.1f} GiB (busy machine)")
            break
    return f"  [{problem}] {record['method']:<14} " + ", ".join(parts)
