"""Targets (:func:`summarize`), the docs' table records and the figure of
``bench_models.py``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _report
from benchmarks._report import (
    VERDICTS,
    find,
    fmt,
    gib,
    max_rel_dev,
    ok,
    phase_of,
    ratio,
    status_text,
    table_common,
)

MODELS: tuple[str, ...] = ("resnet18", "transformer")
#: Methods of each part.
PART_METHODS: dict[str, tuple[str, ...]] = {
    "eigh": ("ours", "eigsh"),
    "laplace": ("lowrank_exact", "lowrank_mc", "kron_default", "kron_backpack", "kron_asdl",
                "grad_pass"),
    "backends": ("backpack", "functorch"),
    "scale": ("lowrank_default", "ll_kron", "ll_full", "kron_default", "kron_backpack",
              "kron_asdl", "train_epoch"),
    "mnist": ("real_data",),
}
PARTS: tuple[str, ...] = tuple(PART_METHODS)
#: Parts run without ``--parts`` (``scale`` and ``mnist`` are meant for a GPU).
DEFAULT_PARTS: tuple[str, ...] = ("eigh", "laplace", "backends")
SCALE_PHASES: tuple[str, ...] = ("fit", "marglik", "glm", "samples")
#: The ``mnist`` worker's phases: training the MAP, then its metrics and each posterior's.
MNIST_PHASES: tuple[str, ...] = ("train", "map", "lowrank_default", "ll_kron", "ll_full")
#: Training and test points the ``scale`` targets name, and their bounds in seconds.
SCALE_SIZES = (50_000, 10_000)
TARGET_SCALE_FIT_MARGLIK_S = 600.0
TARGET_SCALE_GLM_S = 120.0
LABELS: dict[str, str] = {
    "ours": "ours (`ggn_eigh`, backend auto)",
    "eigsh": "scipy `eigsh` on curvlinops' GGN",
    "lowrank_exact": "`lowrank_ggn`, exact",
    "lowrank_mc": "`lowrank_ggn`, MC (M=1)",
    "kron_default": "`kron`, default backend",
    "kron_backpack": "`kron`, BackPACK backend",
    "kron_asdl": "`kron`, ASDL backend",
    "grad_pass": "one gradient pass (floor)",
    "backpack": "BackPACK engine",
    "functorch": "torch.func engine",
    "lowrank_default": "`lowrank_ggn`, all weights, default arguments",
    "ll_kron": "`kron`, last layer", "ll_full": "`full`, last layer",
    "train_epoch": "one training epoch (Adam)", "map": "MAP",
}
#: laplace-torch's `kron` with each of its curvature backends.
KRONS: tuple[str, ...] = ("kron_default", "kron_backpack", "kron_asdl")
#: Targets: eigsh time / ours time, MC fit / kron fit, torch.func / BackPACK time.
TARGET_EIGH_SPEEDUP = 3.0
TARGET_MC_VS_KRON = 1.0
TARGET_FUNC_VS_BACKPACK = 2.0


def _ok(results: Sequence[dict], part: str, model: str, method: str, phase: str
        ) -> dict | None:
    """The successful record of a phase, ``None`` if missing or failed."""
    return ok(phase_of(results, phase, part=part, model=model, method=method))


def _ratio(num: dict | None, den: dict | None) -> float | None:
    """Time ratio of two phase records (``None`` if either failed)."""
    return ratio(num and num["time_s"], den and den.get("time_s"))


def summarize(results: Sequence[dict], settings: dict[str, Any]) -> dict[str, Any]:
    """The targets of the records of a run (``settings``: its ``models`` and ``parts``): per
    model and target the measured ratio, ``ok`` (``None``: not measurable) and, where a
    peer failed, why."""
    summary: dict[str, Any] = _scale_targets(results) if "scale" in settings["parts"] else {}
    for model in settings["models"] if {"eigh", "laplace"} & set(settings["parts"]) else ():
        ours, peer = (_ok(results, "eigh", model, m, "eigh") for m in ("ours", "eigsh"))
        speedup = _ratio(peer, ours)
        summary[f"eigh_speedup_{model}"] = {
            "value": speedup, "target": TARGET_EIGH_SPEEDUP,
            "ok": None if speedup is None else speedup >= TARGET_EIGH_SPEEDUP,
            "max_rel_dev": max_rel_dev(ours and ours["eigenvalues"],
                                       peer and peer["eigenvalues"]),
        }
        # the fastest `kron` that fits the model (default backend first)
        mc = _ok(results, "laplace", model, "lowrank_mc", "fit")
        krons = [k for k in (_ok(results, "laplace", model, m, "fit") for m in KRONS) if k]
        kron = min(krons, key=lambda r: r["time_s"]) if krons else None
        ratio = _ratio(mc, kron)
        failures = [f"{m}: {r.get('reason')}" for m in KRONS
                    if (r := phase_of(results, "fit", part="laplace", model=model, method=m))
                    and r.get("status") != "ok"]
        summary[f"mc_vs_kron_{model}"] = {
            "value": ratio, "target": TARGET_MC_VS_KRON,
            "ok": None if ratio is None else ratio <= TARGET_MC_VS_KRON,
            "peer_failure": None if kron or not failures else "; ".join(failures),
            "mc_vs_grad_pass": _ratio(mc, _ok(results, "laplace", model, "grad_pass", "fit")),
        }
    if "backends" in settings["parts"]:
        func, bp = (_ok(results, "backends", "3c3d", m, "eigh")
                    for m in ("functorch", "backpack"))
        ratio = _ratio(func, bp)
        summary["functorch_vs_backpack_3c3d"] = {
            "value": ratio, "target": TARGET_FUNC_VS_BACKPACK,
            "ok": None if ratio is None else ratio <= TARGET_FUNC_VS_BACKPACK,
            "max_rel_dev": max_rel_dev(func and func["eigenvalues"], bp and bp["eigenvalues"]),
        }
    return summary


def _scale_targets(results: Sequence[dict]) -> dict[str, Any]:
    """Our fit + marglik and GLM times against the ``scale`` targets, a shrunk phase's
    scaled to all its points (measurable at the sizes the targets name)."""
    ours = find(results, part="scale", method="lowrank_default") or {}
    fit, marglik, glm = (_ok(results, "scale", "resnet18", "lowrank_default", p)
                         for p in ("fit", "marglik", "glm"))
    full = (ours.get("n_train"), ours.get("n_test")) == SCALE_SIZES
    both = fit and marglik and fit["time_s"] * ours["n_train"] / fit["n_fit"] + \
        marglik["time_s"]
    glm_s = glm and glm["time_s"] * ours["n_test"] / glm["n_pred"]
    where = f" s ({SCALE_SIZES[0]:,} / {SCALE_SIZES[1]:,} points)"
    return {key: {"name": f"{what} under {bound:g}{where}", "value": value, "unit": " s",
                  "target": bound, "ok": None if not (value and full) else value <= bound}
            for key, what, value, bound in (
                ("scale_fit_marglik", "default fit + marglik", both, TARGET_SCALE_FIT_MARGLIK_S),
                ("scale_glm", "GLM predictive", glm_s, TARGET_SCALE_GLM_S))}


def _scale_rows(results: Sequence[dict]) -> list[list]:
    rows = []
    for method in PART_METHODS["scale"]:
        r = find(results, part="scale", method=method)
        if r is None:
            continue
        fit = _ok(results, "scale", "resnet18", method, "fit") or {}
        cells = [("-" if p is None else status_text(p, 60)) if not (p and p["status"] == "ok")
                 else fmt(p["time_s"]) + (f" ({p['n_pred']:,} points)" if "n_pred" in p else "")
                 for p in (r["phases"].get(ph) for ph in SCALE_PHASES)]
        rows.append([LABELS[method], f"{fit.get('n_fit', r['n_train']):,} / {r['n_test']:,}",
                     *cells, gib(r.get("worker_peak_bytes")),
                     fmt(fit["kept_fraction"], 2) if "kept_fraction" in fit else "-"])
    return rows


def _mnist_rows(results: Sequence[dict]) -> list[list]:
    phases = (find(results, part="mnist") or {"phases": {}})["phases"]
    return [[LABELS[p], *([fmt(r["metrics"][k]) for k in ("accuracy", "nll", "ece")]
                          if (r := phases.get(p)) and r["status"] == "ok"
                          else [status_text(r, 80), "-", "-"])] for p in MNIST_PHASES[1:]]


def _gib(record: dict | None) -> str:
    """Peak memory above the baseline of a phase in GiB."""
    return gib(record and record["peak_delta_bytes"])


def _load(records: Sequence[dict | None]) -> str:
    """Largest CPU share of other processes during the given phases, in percent."""
    values = [r.get("other_cpu_percent_during_phase") for r in records if r]
    values = [v for v in values if v is not None]
    return "-" if not values else f"{max(values):.0f}"


#: Model names in the tables.
NAMES = {"resnet18": "ResNet-18", "transformer": "transformer", "3c3d": "3c3d"}


def _size(results: Sequence[dict], part: str, model: str | None = None) -> dict:
    """The sizes of a part's run on a model (older files keep them under ``sizes``)."""
    r = next((r for r in results if r["part"] == part and model in (None, r["model"])), {})
    return r.get("sizes", r)


def _eigh_rows(results: Sequence[dict], s: dict[str, Any]) -> list[list]:
    rows = []
    for model in s["models"]:
        peer = _ok(results, "eigh", model, "eigsh", "eigh")
        for method in PART_METHODS["eigh"]:
            rec = phase_of(results, "eigh", part="eigh", model=model, method=method)
            done = ok(rec)
            label = LABELS[method] + (f" [{done['backend_used']}]" if done and
                                      done.get("backend_used") else "")
            dev = "-" if method == "eigsh" or not done else \
                fmt(max_rel_dev(done["eigenvalues"], peer and peer["eigenvalues"]), 2)
            rows.append([NAMES[model], _size(results, "eigh", model)["N"], label,
                         fmt(done["time_s"]) if done else status_text(rec, 80), _gib(done),
                         done.get("num_products", "-") if done else "-", dev,
                         fmt(_ratio(peer, done)) + "x" if done and peer else "-",
                         _load([done])])
    return rows


def _laplace_rows(results: Sequence[dict], s: dict[str, Any]) -> list[list]:
    rows = []
    for model in s["models"]:
        size = _size(results, "laplace", model)
        for method in PART_METHODS["laplace"]:
            fit, glm = (phase_of(results, phase, part="laplace", model=model, method=method)
                        for phase in ("fit", "glm"))
            fit_ok, glm_ok = ok(fit), ok(glm)
            note = "" if not fit_ok or "kept_fraction" not in fit_ok else \
                (f"rank {s['rank']}, {100 * fit_ok['kept_fraction']:.0f}% of the trace, "
                 f"{fit_ok.get('backend_used')}")
            rows.append([NAMES[model], f"{size['n_train']} / {size['n_test']}", LABELS[method],
                         fmt(fit_ok["time_s"]) if fit_ok else status_text(fit, 80),
                         _gib(fit_ok), "n/a" if method == "grad_pass" else
                         (fmt(glm_ok["time_s"]) if glm_ok else
                          ("-" if not fit_ok else status_text(glm, 80))),
                         _gib(glm_ok), note, _load([fit_ok, glm_ok])])
    return rows


def _backends_rows(results: Sequence[dict]) -> list[list]:
    bp = _ok(results, "backends", "3c3d", "backpack", "eigh")
    rows = []
    for method in PART_METHODS["backends"]:
        rec = phase_of(results, "eigh", part="backends", model="3c3d", method=method)
        done = ok(rec)
        rows.append([LABELS[method], fmt(done["time_s"]) if done else status_text(rec, 80),
                     _gib(done), "-" if method == "backpack" or not done else
                     fmt(max_rel_dev(done["eigenvalues"], bp and bp["eigenvalues"]), 2),
                     fmt(_ratio(done, bp)) + "x" if done and bp else "-", _load([done])])
    return rows


def _target_rows(summary: dict[str, Any], k: int) -> list[list]:
    rows = []
    for key, item in summary.items():
        value = "-" if item["value"] is None else f"{item['value']:.2f}{item.get('unit', 'x')}"
        if "name" in item:
            rows.append([item["name"], "ResNet-18", value, VERDICTS[item["ok"]]])
            continue
        if key.startswith("eigh_speedup_"):
            name = f"top-{k} eigenpairs >= {TARGET_EIGH_SPEEDUP:g}x faster than `eigsh`"
            model = key[len("eigh_speedup_"):]
        elif key.startswith("mc_vs_kron_"):
            name = "MC fit no slower than `kron` (fastest backend that fits)"
            model = key[len("mc_vs_kron_"):]
            if item.get("peer_failure"):
                value = "`kron` cannot fit this model with any backend"
        else:
            name = f"torch.func engine within {TARGET_FUNC_VS_BACKPACK:g}x of BackPACK"
            model = "3c3d"
        rows.append([name, NAMES[model], value, VERDICTS[item["ok"]]])
    return rows


def table_records(payload: dict[str, Any], source: str) -> dict[str, dict]:
    """The docs' table records of a run, by id."""
    results, s = payload["records"], payload["settings"]
    common = table_common(payload, [source])
    busy = [b for r in results if (b := r.get("cpu_busy_before_percent")) is not None]
    load = (f"Other processes used up to {max(busy):.0f}% of the CPU right before a worker "
            "started; the `others' CPU` column is their share during the measured call."
            if busy else "")
    tables: dict[str, dict] = {}
    if "eigh" in s["parts"]:
        tables["models_eigh"] = {**common, "note": load, "columns": [
            "model", "N", "method", "time [s]", "peak above baseline [GiB]",
            "GGN-vector products", f"max rel. deviation from `eigsh` (top {s['k']})",
            "`eigsh` time / time", "others' CPU [%]"], "rows": _eigh_rows(results, s)}
    if "laplace" in s["parts"]:
        tables["models_laplace"] = {**common, "note": load, "columns": [
            "model", "train / test points", "method", "fit [s]", "fit peak [GiB]",
            "GLM predictive [s]", "GLM peak [GiB]", "", "others' CPU [%]"],
            "rows": _laplace_rows(results, s)}
    if "backends" in s["parts"]:
        tables["backends_3c3d"] = {
            **common, "note": f"N = {_size(results, 'backends').get('N')}, top {s['k']}. "
            f"{load}", "columns": ["engine", "time [s]", "peak above baseline [GiB]",
                                    "max rel. deviation from BackPACK", "time / BackPACK time",
                                    "others' CPU [%]"], "rows": _backends_rows(results)}
    if "scale" in s["parts"]:
        tables["models_scale"] = {**common, "note": load, "columns": [
            "method", "fitted / test points", "fit [s]", "marglik [s]", "GLM predictive [s]",
            f"{s['samples']} NN samples [s]", "worker peak [GiB]", "kept share"],
            "rows": _scale_rows(results)}
    if "mnist" in s["parts"]:
        size = _size(results, "mnist")
        tables["models_mnist"] = {**common, "note": f"ResNet-18 trained {s['epochs']} "
                                  f"epochs on up to {size.get('n_train')} MNIST images; "
                                  f"test metrics on {size.get('n_test')}.", "columns": [
            "method", "accuracy", "NLL", "ECE"], "rows": _mnist_rows(results)}
    tables["models_targets"] = {**common, "note": "Ratios of the three tables above.",
                                "columns": ["target", "model", "measured", "verdict"],
                                "rows": _target_rows(payload["summary"], s["k"])}
    return tables


def plot(payload: dict[str, Any], path: Path):
    """Bar charts of a run's measured times (log scale), failed runs as red crosses."""
    results, args = payload["records"], payload["settings"]
    panels = []
    for model in args["models"]:
        if "eigh" in args["parts"]:
            panels.append((f"{model}: top-{args['k']} eigenpairs",
                           [(m, "eigh", "eigh", model) for m in PART_METHODS["eigh"]]))
        if "laplace" in args["parts"]:
            panels.append((f"{model}: Laplace fit / GLM predictive",
                           [(m, "laplace", ph, model) for m in PART_METHODS["laplace"]
                            for ph in (("fit",) if m == "grad_pass" else ("fit", "glm"))]))
    if "backends" in args["parts"]:
        panels.append((f"3c3d: top-{args['k']} eigenpairs by engine",
                       [(m, "backends", "eigh", "3c3d") for m in PART_METHODS["backends"]]))
    if not panels:
        return
    ours = {"ours", "lowrank_exact", "lowrank_mc", "functorch"}
    with _report.figure(path, 1, len(panels), figsize=(4.2 * len(panels), 4.4),
                        squeeze=False) as (fig, axes):
        for ax, (title, bars) in zip(axes[0], panels):
            for i, (method, part, phase, model) in enumerate(bars):
                rec = _ok(results, part, model, method, phase)
                _report.value_bar(ax, i, rec and rec["time_s"],
                                  color="tab:blue" if method in ours else "tab:gray",
                                  alpha=1.0 if phase != "glm" else 0.55)
            ax.set_xticks(range(len(bars)))
            ax.set_xticklabels([m + ("" if ph in {"eigh", "fit"} else f"\n{ph}")
                                for m, _, ph, _ in bars], rotation=45, ha="right", fontsize=7)
            ax.set_yscale("log")
            ax.set_ylabel("time [s]")
            ax.set_title(title, fontsize=9)
        info = payload["machine"]
        fig.suptitle(f"{_report.machine_text(info)}, torch {info.get('torch')}; red x: failed",
                     fontsize=9)
