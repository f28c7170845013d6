"""Benchmark models beyond plain stacks: torchvision ResNet-18 and a transformer encoder.

Three questions, each configuration in a fresh worker process (this script with
``--worker``) that reports time and peak memory of the measured call only (imports,
model and data creation excluded) as JSON lines on stdout:

``eigh``
    Top-``k`` eigenpairs (default 10) of the mini-batch GGN of a ``CrossEntropyLoss``
    (``reduction='mean'``): ``lowrank_laplace.ggn_eigh`` (``backend='auto'``: BackPACK
    with its converter for ResNet-18, torch.func for the transformer) against SciPy's
    ``eigsh(which='LA')`` on curvlinops' ``GGNLinearOperator`` (float32; the peer of
    ``bench_eigh.py``). The result's eigenvalues are compared with ``eigsh``'s.
``laplace``
    ``Laplace(model, "classification", hessian_structure="lowrank_ggn")`` fitted on
    ``n_train`` random points (exact GGN and a 1-sample Monte-Carlo GGN, rank
    ``--rank``) and its GLM probit predictive on ``n_test`` points, against
    laplace-torch's ``kron`` with each of its backends (``kron_default``: curvlinops'
    KFAC in laplace-torch 0.3; ``kron_backpack``, ``kron_asdl``); the MC target
    compares with the fastest that fits. ``grad_pass`` (one forward and backward pass
    of the loss over the training batches) is the floor any curvature fit pays.
``backends``
    ``ggn_eigh`` top-``k`` on DeepOBS ``3c3d`` (``_problems.py``), where both engines
    apply: ``backend='functorch'`` against ``backend='backpack'``, same batch.

Models:

- ``resnet18``: ``torchvision.models.resnet18(num_classes=10)`` in eval mode on
  CIFAR-10-shaped random inputs (3x32x32), D = 11,181,642.
- ``transformer``: token embedding (vocabulary ``--vocab``) plus a learned position
  embedding, ``nn.TransformerEncoder`` (``--layers`` layers of width ``--width``,
  4 heads, feed-forward 4x width, no dropout), a padding mask (random lengths between
  a quarter of the sequence and all of it, padding token 0), mean pooling over the
  unpadded positions and a linear head to 10 classes, in eval mode. Every worker of
  this model runs attention with PyTorch's math kernel and without the fused
  encoder fast path (``torch.backends.mha.set_fastpath_enabled(False)``), since the
  peers' forward-mode products need them; all methods share that setting.

Targets (printed with PASS/FAIL): top-``k`` eigenpairs at least 3x faster than
``eigsh`` on both models; the Monte-Carlo fit no slower than ``kron``; the torch.func
engine within 2x of the BackPACK engine on ``3c3d``.

The default sizes are for a CPU run of about ten minutes (2 cores): ``eigh`` at
N = 16 (ResNet-18) and N = 32 (transformer), ``laplace`` on 32 / 8 points
(ResNet-18) and 256 / 128 points (transformer), ``backends`` at N = 128. On a GPU,
use ``--device cuda --N 128 --n-train 1024 --n-test 128`` (the issue's sizes; models,
data and every method's curvature on the GPU, peak memory as CUDA's allocator peak).

Examples:
    Smoke test (tiny sizes, about two minutes)::

        python -m benchmarks.bench_models --quick

    Default CPU run, then copy the tables into ``benchmarks/results/tables/``::

        python -m benchmarks.bench_models

Results are written to ``<out>/models.json`` and ``<out>/models.png``; the rows of the
docs' tables to ``<out>/models_tables/*.json`` (their ``sources`` name
``docs/benchmarks/models.json``, where the raw run is kept).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks import _harness, _laplace_worker, _problems
from benchmarks._harness import BUSY_WARN_PERCENT, REPO_ROOT, GiB

RESULT_MARKER = "__BENCH_MODELS_RESULT__"
MODELS: tuple[str, ...] = ("resnet18", "transformer")
NUM_CLASSES = 10
#: Methods of each part.
PART_METHODS: dict[str, tuple[str, ...]] = {
    "eigh": ("ours", "eigsh"),
    "laplace": ("lowrank_exact", "lowrank_mc", "kron_default", "kron_backpack", "kron_asdl",
                "grad_pass"),
    "backends": ("backpack", "functorch"),
}
PARTS: tuple[str, ...] = tuple(PART_METHODS)
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
}
#: laplace-torch's `kron` with each of its curvature backends.
KRONS: tuple[str, ...] = ("kron_default", "kron_backpack", "kron_asdl")
#: Targets: eigsh time / ours time, MC fit / kron fit, torch.func / BackPACK time.
TARGET_EIGH_SPEEDUP = 3.0
TARGET_MC_VS_KRON = 1.0
TARGET_FUNC_VS_BACKPACK = 2.0
#: Package versions recorded besides the harness defaults.
PACKAGES: tuple[str, ...] = (*_harness.DEFAULT_PACKAGES, "laplace-torch", "torchvision")


###############################################################################
#                                  Models                                     #
###############################################################################


class TransformerClassifier(nn.Module):
    """Token and position embeddings, a masked transformer encoder, mean pooling, head.

    Token 0 is padding: it is masked in attention and left out of the pooling.

    Args:
        vocab: Vocabulary size (token 0 pads).
        width: Model width.
        layers: Number of encoder layers.
        seq_len: Sequence length.
        num_classes: Number of classes.
    """

    def __init__(self, vocab: int, width: int, layers: int, seq_len: int, num_classes: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.pos = nn.Parameter(0.02 * torch.randn(seq_len, width))
        layer = nn.TransformerEncoderLayer(width, 4, dim_feedforward=4 * width, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens: Tensor) -> Tensor:
        """Classify token sequences.

        Args:
            tokens: Token ids, shape ``(N, seq_len)``; 0 pads.

        Returns:
            Logits, shape ``(N, num_classes)``.
        """
        pad = tokens == 0
        h = self.encoder(self.embed(tokens) + self.pos, src_key_padding_mask=pad)
        keep = (~pad).to(h.dtype)[..., None]
        return self.head((h * keep).sum(1) / keep.sum(1))


def make_model(name: str, n: int, args: argparse.Namespace) -> tuple[nn.Module, Tensor, Tensor]:
    """Create a model (seeded) and ``n`` random labelled inputs.

    Args:
        name: ``'resnet18'``, ``'transformer'`` or ``'3c3d'``.
        n: Number of data points.
        args: Parsed command line arguments (seed, transformer sizes).

    Returns:
        ``(model, X, y)``, the model in eval mode.

    Raises:
        ValueError: If the model name is unknown.
    """
    if name == "3c3d":
        model, _, X, y = _problems.make_problem("3c3d", n, seed=args.seed)
        return model.eval(), X, y
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed + 1)
    if name == "resnet18":
        import torchvision

        model = torchvision.models.resnet18(num_classes=NUM_CLASSES)
        X = torch.randn(n, 3, 32, 32, generator=generator)
    elif name == "transformer":
        model = TransformerClassifier(args.vocab, args.width, args.layers, args.seq_len,
                                      NUM_CLASSES)
        lengths = torch.randint(max(1, args.seq_len // 4), args.seq_len + 1, (n,),
                                generator=generator)
        tokens = torch.randint(1, args.vocab, (n, args.seq_len), generator=generator)
        X = tokens * (torch.arange(args.seq_len)[None] < lengths[:, None])
    else:
        raise ValueError(f"Unknown model {name!r}.")
    y = torch.randint(0, NUM_CLASSES, (n,), generator=generator)
    return model.eval(), X, y


def _attention_for_forward_mode():
    """Attention kernels with forward-mode derivatives (math SDPA, no fused fast path)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.mha.set_fastpath_enabled(False)
    # entered for the whole worker process (kept referenced: collecting the context
    # manager would restore the default kernels)
    _KEPT.append(sdpa_kernel(SDPBackend.MATH))
    _KEPT[-1].__enter__()


_KEPT: list = []


###############################################################################
#                                  Worker                                     #
###############################################################################


def _emit(record: dict[str, Any]):
    """Print a record as one JSON line on stdout (see :func:`_harness.emit`).

    Args:
        record: The record.
    """
    _harness.emit(RESULT_MARKER, record)


def _eigh_call(method: str, model: nn.Module, X: Tensor, y: Tensor, args: argparse.Namespace
               ) -> tuple[Callable[[], Any], dict[str, Any]]:
    """The measured call of an ``eigh`` or ``backends`` method.

    Args:
        method: ``'ours'``, ``'eigsh'``, ``'backpack'`` or ``'functorch'``.
        model: The network.
        X: Inputs.
        y: Labels.
        args: Parsed command line arguments of the worker.

    Returns:
        The call (returning eigenvalues, eigenvectors) and a dict it fills with
        extra information (engine used, number of GGN-vector products).
    """
    loss_func = nn.CrossEntropyLoss()
    extra: dict[str, Any] = {}
    if method == "eigsh":
        import curvlinops  # noqa: F401

        def call():
            evals, evecs, count = _harness.ggn_eigsh(model, loss_func, [(X, y)], len(y), args.k)
            extra["num_products"] = count
            return evals, evecs

        return call, extra

    import lowrank_laplace as ll

    backend = "auto" if method == "ours" else method

    def call():
        torch.manual_seed(args.seed)
        result = ll.ggn_eigh(model, loss_func, X, y, top_k=args.k, backend=backend,
                             low_memory=args.low_memory)
        extra["backend_used"] = result.backend
        extra["kept_fraction"] = float(result.eigenvalues.sum() / result.trace)
        return result.eigenvalues, result.eigenvectors

    return call, extra


def _laplace_phases(method: str, model: nn.Module, X: Tensor, y: Tensor,
                    args: argparse.Namespace) -> list[tuple[str, Callable[[], Any]]]:
    """The measured phases of a ``laplace`` method.

    Args:
        method: A method of the ``laplace`` part.
        model: The network.
        X: Training inputs followed by test inputs.
        y: Labels.
        args: Parsed command line arguments of the worker.

    Returns:
        ``(phase, call)`` pairs: ``fit`` (returns the fitted object) and, except
        for ``grad_pass``, ``glm`` (returns the predictive probabilities).
    """
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(X[: args.n_train], y[: args.n_train]),
                        batch_size=min(args.batch_size, args.n_train), shuffle=False)
    X_test = X[args.n_train :]
    if method == "grad_pass":
        loss_func = nn.CrossEntropyLoss(reduction="sum")

        def grad_pass():
            for xb, yb in loader:
                model.zero_grad(set_to_none=True)
                loss_func(model(xb), yb).backward()
            model.zero_grad(set_to_none=True)

        return [("fit", grad_pass)]

    import laplace

    import lowrank_laplace  # noqa: F401 (registers hessian_structure="lowrank_ggn")

    if method.startswith("kron"):
        kwargs: dict[str, Any] = {"hessian_structure": "kron"}
        if method != "kron_default":
            from laplace.curvature import AsdlGGN, BackPackGGN

            kwargs["backend"] = BackPackGGN if method == "kron_backpack" else AsdlGGN
    else:
        kwargs = {"hessian_structure": "lowrank_ggn", "rank": args.rank,
                  "mc_samples": 1 if method == "lowrank_mc" else 0}
    state: dict[str, Any] = {}

    def fit():
        torch.manual_seed(args.seed)
        la = laplace.Laplace(model, "classification", subset_of_weights="all", **kwargs)
        la.fit(loader)
        state["la"] = la
        return la

    def glm():
        return state["la"](X_test, pred_type="glm", link_approx="probit").detach()

    return [("fit", fit), ("glm", glm)]


def run_worker(args: argparse.Namespace):
    """Run one configuration and print one record per measured phase.

    Args:
        args: Parsed command line arguments of the worker.
    """
    threads = args.threads or _harness.num_cores()
    torch.set_num_threads(threads)
    device = torch.device(args.device)
    base = {"part": args.part, "model": args.model, "method": args.method}
    setup = {**base, "phase": "setup", "status": "ok", "threads": threads}
    setup.update(_laplace_worker._set_memory_cap(int(args.mem_limit_gib * GiB), device))
    if args.model == "transformer":
        _attention_for_forward_mode()
    n = args.n_train + args.n_test if args.part == "laplace" else args.N
    model, X, y = make_model(args.model, n, args)
    model, X, y = model.to(device), X.to(device), y.to(device)
    setup["D"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    setup["N"] = n
    if args.part == "laplace":
        phases = _laplace_phases(args.method, model, X, y, args)
        extra: dict[str, Any] = {}
    else:
        call, extra = _eigh_call(args.method, model, X, y, args)
        phases = [("eigh", call)]
    setup["lowrank_laplace"] = _laplace_worker.library_fingerprint()
    _harness.preimport((*_harness.DEFAULT_PREIMPORTS, "curvlinops", "laplace"))
    _emit(setup)

    for phase, fn in phases:
        record, out = _laplace_worker._measure(phase, fn, device)
        record.update(base)
        if out is not None and phase == "eigh":
            evals, evecs = out
            record["eigenvalues"] = evals.detach().double().sort(descending=True).values.tolist()
            record["eigenvectors_shape"] = list(evecs.shape)
            record.update(extra)
        elif out is not None and phase == "fit" and args.method != "grad_pass":
            record["H_type"] = type(out.H).__name__
            if args.method.startswith("lowrank"):
                record["kept_fraction"] = float(out.kept_fraction)
                record["backend_used"] = out.factor_backend_used
        elif out is not None and phase == "glm":
            problems = _laplace_worker._check_probs(out, args.n_test, NUM_CLASSES)
            if problems:
                record["warnings"] = problems
        _emit(record)
        if record["status"] != "ok":
            return


def worker_main(args: argparse.Namespace):
    """Run the worker; report a failure outside the measured phases as a record.

    Args:
        args: Parsed command line arguments of the worker.
    """
    with _harness.failures_reported(RESULT_MARKER, part=args.part, model=args.model,
                                    method=args.method, phase="setup"):
        run_worker(args)


###############################################################################
#                                  Driver                                     #
###############################################################################


def sizes(part: str, model: str, args: argparse.Namespace) -> dict[str, int]:
    """Batch or data sizes of a configuration.

    Args:
        part: ``'eigh'``, ``'laplace'`` or ``'backends'``.
        model: Model name.
        args: Parsed command line arguments of the driver.

    Returns:
        ``{'N': ...}`` for ``eigh``/``backends``, ``{'n_train': ..., 'n_test': ...}``
        for ``laplace``.
    """
    def pick(name: str) -> int:
        value = getattr(args, name)
        return value if value is not None else getattr(args, f"{name}_defaults")[model]

    if part == "laplace":
        return {"n_train": pick("n_train"), "n_test": pick("n_test")}
    return {"N": pick("N")}


def run_config(part: str, model: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one configuration in a fresh process and collect its phase records.

    Args:
        part: Part name.
        model: Model name.
        method: Method name.
        args: Parsed command line arguments of the driver.

    Returns:
        ``{'part', 'model', 'method', 'sizes', 'setup', 'phases': {phase: record},
        'cpu_busy_before_percent', 'subprocess_wall_s'}``; a worker that timed out or
        died leaves a failure record for the phase it was in.
    """
    size = sizes(part, model, args)
    cmd = _harness.module_command(
        "benchmarks.bench_models", "--worker", f"--part={part}", f"--model={model}",
        f"--method={method}", f"--k={args.k}", f"--seed={args.seed}", f"--threads={args.threads}",
        f"--rank={args.rank}", f"--batch-size={args.batch_size}",
        f"--mem-limit-gib={args.mem_limit_gib}", f"--vocab={args.vocab}", f"--width={args.width}",
        f"--layers={args.layers}", f"--seq-len={args.seq_len}", f"--device={args.device}")
    cmd += [f"--{key.replace('_', '-')}={value}" for key, value in size.items()]
    if args.low_memory:
        cmd.append("--low-memory")
    busy = _harness.wait_for_idle_cpu(args.wait_idle)
    result: dict[str, Any] = {"part": part, "model": model, "method": method, "sizes": size,
                              "cpu_busy_before_percent": busy, "phases": {}}
    start = time.perf_counter()
    stdout, stderr, failure = "", "", None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              cwd=REPO_ROOT, env=_harness.worker_env(args), check=False)
        stdout, stderr = proc.stdout, proc.stderr
        if proc.returncode:
            status, reason = _harness.classify_exit(proc.returncode)
            failure = {"status": status, "reason": reason}
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        failure = {"status": "timeout", "reason": f"timeout after {args.timeout:.0f} s"}
    result["subprocess_wall_s"] = time.perf_counter() - start
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            record = json.loads(line[len(RESULT_MARKER):])
            if record.get("phase") == "setup":
                result["setup"] = record
            else:
                result["phases"][record["phase"]] = record
    expected = ["eigh"] if part != "laplace" else (
        ["fit"] if method == "grad_pass" else ["fit", "glm"])
    missing = [p for p in expected if p not in result["phases"]]
    setup = result.get("setup", {})
    if missing and setup.get("status", "ok") != "ok":
        failure = {"status": setup["status"], "reason": setup.get("reason")}
    if missing and all(r.get("status") == "ok" for r in result["phases"].values()):
        failure = failure or {"status": "error", "reason": "no result"}
        result["phases"][missing[0]] = {"phase": missing[0], **failure,
                                        "stderr_tail": stderr[-2000:]}
    return result


def _ok(results: Sequence[dict], part: str, model: str, method: str, phase: str
        ) -> dict | None:
    """The successful record of a phase, ``None`` if missing or failed."""
    for r in results:
        if (r["part"], r["model"], r["method"]) == (part, model, method):
            record = r["phases"].get(phase)
            return record if record and record.get("status") == "ok" else None
    return None


def _phase(results: Sequence[dict], part: str, model: str, method: str, phase: str
           ) -> dict | None:
    """The record of a phase (any status), ``None`` if not run."""
    for r in results:
        if (r["part"], r["model"], r["method"]) == (part, model, method):
            return r["phases"].get(phase)
    return None


def _max_rel_dev(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Largest relative deviation of eigenvalues ``a`` from reference ``b``."""
    if not a or not b or len(a) != len(b):
        return None
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _ratio(num: dict | None, den: dict | None) -> float | None:
    """Time ratio of two phase records (``None`` if either failed)."""
    if num is None or den is None or not den.get("time_s"):
        return None
    return num["time_s"] / den["time_s"]


def summarize(results: Sequence[dict], args: argparse.Namespace) -> dict[str, Any]:
    """Evaluate the targets.

    Args:
        results: Configuration results of :func:`run_config`.
        args: Parsed command line arguments of the driver.

    Returns:
        Per model and target: the measured ratio, whether it passes (``None``: not
        measurable) and, where a peer failed, why.
    """
    summary: dict[str, Any] = {}
    for model in args.models:
        ours, peer = (_ok(results, "eigh", model, m, "eigh") for m in ("ours", "eigsh"))
        speedup = _ratio(peer, ours)
        summary[f"eigh_speedup_{model}"] = {
            "value": speedup, "target": TARGET_EIGH_SPEEDUP,
            "ok": None if speedup is None else speedup >= TARGET_EIGH_SPEEDUP,
            "max_rel_dev": _max_rel_dev(ours and ours["eigenvalues"],
                                        peer and peer["eigenvalues"]),
        }
        # the fastest `kron` that fits the model (default backend first)
        mc = _ok(results, "laplace", model, "lowrank_mc", "fit")
        krons = [k for k in (_ok(results, "laplace", model, m, "fit") for m in KRONS) if k]
        kron = min(krons, key=lambda r: r["time_s"]) if krons else None
        ratio = _ratio(mc, kron)
        failures = [f"{m}: {r.get('reason')}" for m in KRONS
                    if (r := _phase(results, "laplace", model, m, "fit"))
                    and r.get("status") != "ok"]
        summary[f"mc_vs_kron_{model}"] = {
            "value": ratio, "target": TARGET_MC_VS_KRON,
            "ok": None if ratio is None else ratio <= TARGET_MC_VS_KRON,
            "peer_failure": None if kron or not failures else "; ".join(failures),
            "mc_vs_grad_pass": _ratio(mc, _ok(results, "laplace", model, "grad_pass", "fit")),
        }
    if "backends" in args.parts:
        func, bp = (_ok(results, "backends", "3c3d", m, "eigh")
                    for m in ("functorch", "backpack"))
        ratio = _ratio(func, bp)
        summary["functorch_vs_backpack_3c3d"] = {
            "value": ratio, "target": TARGET_FUNC_VS_BACKPACK,
            "ok": None if ratio is None else ratio <= TARGET_FUNC_VS_BACKPACK,
            "max_rel_dev": _max_rel_dev(func and func["eigenvalues"],
                                        bp and bp["eigenvalues"]),
        }
    return summary


def _fmt(value: float | None, digits: int = 3) -> str:
    """Format a number with ``digits`` significant digits (``'-'`` for ``None``)."""
    return "-" if value is None else f"{value:.{digits}g}"


def _gib(record: dict | None) -> str:
    """Peak memory above the baseline of a phase in GiB."""
    return "-" if record is None else f"{record['peak_delta_bytes'] / GiB:.2f}"


def _load(records: Sequence[dict | None]) -> str:
    """Largest CPU share of other processes during the given phases, in percent."""
    values = [r.get("other_cpu_percent_during_phase") for r in records if r]
    values = [v for v in values if v is not None]
    return "-" if not values else f"{max(values):.0f}"


def _status(record: dict | None) -> str:
    """A short description of a failed phase."""
    if record is None:
        return "not run"
    reason = str(record.get("reason") or "")
    return f"{record.get('status', '?')}: {reason.splitlines()[0][:80]}" if reason else \
        str(record.get("status"))


def table_records(payload: dict[str, Any], source: str) -> dict[str, dict]:
    """The docs' table records (``render_tables.py`` format) of a run.

    Args:
        payload: The run as written to ``models.json``.
        source: Path of the kept raw run, relative to the repository root.

    Returns:
        Records by table id: ``models_eigh``, ``models_laplace``, ``backends_3c3d``
        and ``models_targets`` (only those whose part ran).
    """
    info, results, args = payload["machine"], payload["results"], payload["args"]
    machine = {key: info.get(key) for key in ("cpu_name", "cpu_count", "cpu_count_usable",
                                               "device", "device_name", "total_memory_bytes",
                                               "platform")}
    versions = {"python": info.get("python"), "torch": info.get("torch")}
    versions.update({key[len("version_"):]: value for key, value in info.items()
                     if key.startswith("version_")})
    versions["lowrank_laplace commit"] = payload.get("git_head", "?")[:7]
    common = {"date": info["date"][:10], "machine": machine, "versions": versions,
              "sources": [source]}
    busy = [r.get("cpu_busy_before_percent") for r in results]
    busy = [b for b in busy if b is not None]
    load = (f"Other processes used up to {max(busy):.0f}% of the CPU right before a worker "
            "started; the `others' CPU` column is their share during the measured call."
            if busy else "")
    tables: dict[str, dict] = {}
    models = args["models"]
    names = {"resnet18": "ResNet-18", "transformer": "transformer", "3c3d": "3c3d"}
    if "eigh" in args["parts"]:
        rows = []
        for model in models:
            peer = _ok(results, "eigh", model, "eigsh", "eigh")
            for method in PART_METHODS["eigh"]:
                rec = _phase(results, "eigh", model, method, "eigh")
                ok = rec if rec and rec.get("status") == "ok" else None
                n = next(r["sizes"]["N"] for r in results
                         if (r["part"], r["model"]) == ("eigh", model))
                label = LABELS[method]
                if ok and ok.get("backend_used"):
                    label += f" [{ok['backend_used']}]"
                dev = "-" if method == "eigsh" or not ok else \
                    _fmt(_max_rel_dev(ok["eigenvalues"], peer and peer["eigenvalues"]), 2)
                rows.append([names[model], n, label,
                             _fmt(ok["time_s"]) if ok else _status(rec), _gib(ok),
                             ok.get("num_products", "-") if ok else "-", dev,
                             _fmt(_ratio(peer, ok)) + "x" if ok and peer else "-",
                             _load([ok])])
        tables["models_eigh"] = {**common, "note": load, "columns": [
            "model", "N", "method", "time [s]", "peak above baseline [GiB]",
            "GGN-vector products", f"max rel. deviation from `eigsh` (top {args['k']})",
            "`eigsh` time / time", "others' CPU [%]"], "rows": rows}
    if "laplace" in args["parts"]:
        rows = []
        for model in models:
            for method in PART_METHODS["laplace"]:
                fit = _phase(results, "laplace", model, method, "fit")
                glm = _phase(results, "laplace", model, method, "glm")
                fit_ok = fit if fit and fit.get("status") == "ok" else None
                glm_ok = glm if glm and glm.get("status") == "ok" else None
                size = next(r["sizes"] for r in results
                            if (r["part"], r["model"]) == ("laplace", model))
                note = ""
                if fit_ok and "kept_fraction" in fit_ok:
                    note = (f"rank {args['rank']}, {100 * fit_ok['kept_fraction']:.0f}% of "
                            f"the trace, {fit_ok.get('backend_used')}")
                rows.append([names[model], f"{size['n_train']} / {size['n_test']}",
                             LABELS[method], _fmt(fit_ok["time_s"]) if fit_ok else _status(fit),
                             _gib(fit_ok),
                             "n/a" if method == "grad_pass" else
                             (_fmt(glm_ok["time_s"]) if glm_ok else
                              ("-" if not fit_ok else _status(glm))),
                             _gib(glm_ok), note, _load([fit_ok, glm_ok])])
        tables["models_laplace"] = {**common, "note": load, "columns": [
            "model", "train / test points", "method", "fit [s]", "fit peak [GiB]",
            "GLM predictive [s]", "GLM peak [GiB]", "", "others' CPU [%]"], "rows": rows}
    if "backends" in args["parts"]:
        bp = _ok(results, "backends", "3c3d", "backpack", "eigh")
        rows = []
        for method in PART_METHODS["backends"]:
            rec = _phase(results, "backends", "3c3d", method, "eigh")
            ok = rec if rec and rec.get("status") == "ok" else None
            rows.append([LABELS[method], _fmt(ok["time_s"]) if ok else _status(rec), _gib(ok),
                         "-" if method == "backpack" or not ok else
                         _fmt(_max_rel_dev(ok["eigenvalues"], bp and bp["eigenvalues"]), 2),
                         _fmt(_ratio(ok, bp)) + "x" if ok and bp else "-", _load([ok])])
        n = next((r["sizes"]["N"] for r in results if r["part"] == "backends"), None)
        tables["backends_3c3d"] = {**common, "note": f"N = {n}, top {args['k']}. {load}",
                                   "columns": [
            "engine", "time [s]", "peak above baseline [GiB]",
            "max rel. deviation from BackPACK", "time / BackPACK time", "others' CPU [%]"],
            "rows": rows}
    summary = payload["summary"]
    rows = []
    for key, item in summary.items():
        if key.startswith("eigh_speedup_"):
            name = f"top-{args['k']} eigenpairs >= {TARGET_EIGH_SPEEDUP:g}x faster than `eigsh`"
            model = key[len("eigh_speedup_"):]
            value = "-" if item["value"] is None else f"{item['value']:.2f}x"
        elif key.startswith("mc_vs_kron_"):
            name = "MC fit no slower than `kron` (fastest backend that fits)"
            model = key[len("mc_vs_kron_"):]
            value = "-" if item["value"] is None else f"{item['value']:.2f}x"
            if item.get("peer_failure"):
                value = "`kron` cannot fit this model with any backend"
        else:
            name = f"torch.func engine within {TARGET_FUNC_VS_BACKPACK:g}x of BackPACK"
            model = "3c3d"
            value = "-" if item["value"] is None else f"{item['value']:.2f}x"
        verdict = {True: "PASS", False: "FAIL", None: "not measurable"}[item["ok"]]
        rows.append([name, names[model], value, verdict])
    tables["models_targets"] = {**common, "note": "Ratios of the three tables above.",
                                "columns": ["target", "model", "measured", "verdict"],
                                "rows": rows}
    return tables


def plot(payload: dict[str, Any], path: Path):
    """Bar charts of the measured times (log scale), failed runs as red crosses.

    Args:
        payload: The run as written to ``models.json``.
        path: Output path of the figure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, args = payload["results"], payload["args"]
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
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.4), squeeze=False)
    for ax, (title, bars) in zip(axes[0], panels):
        for i, (method, part, phase, model) in enumerate(bars):
            rec = _ok(results, part, model, method, phase)
            color = "tab:blue" if method in {"ours", "lowrank_exact", "lowrank_mc",
                                             "functorch"} else "tab:gray"
            if rec is None:
                ax.plot(i, 1.0, "x", color="tab:red", ms=9)
                continue
            ax.bar(i, rec["time_s"], color=color, alpha=1.0 if phase != "glm" else 0.55)
            ax.text(i, rec["time_s"], f"{rec['time_s']:.3g}", ha="center", va="bottom",
                    fontsize=7)
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels([m + ("" if ph in {"eigh", "fit"} else f"\n{ph}")
                            for m, _, ph, _ in bars], rotation=45, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("time [s]")
        ax.set_title(title, fontsize=9)
    info = payload["machine"]
    where = info.get("device_name") if info.get("device") == "cuda" else \
        f"{info.get('cpu_name')} ({info.get('cpu_count_usable')} cores)"
    fig.suptitle(f"{where}, torch {info.get('torch')}; red x: failed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print_record(result: dict[str, Any]):
    """Print one line per phase of a configuration."""
    for phase, rec in result["phases"].items():
        head = f"  [{result['part']} {result['model']} {result['sizes']}] {result['method']:<14} " \
               f"{phase:<5}"
        if rec.get("status") == "ok":
            msg = f"{rec['time_s']:9.3f} s, peak +{rec['peak_delta_bytes'] / GiB:.2f} GiB"
            if rec.get("eigenvalues"):
                msg += f", lambda_1 = {rec['eigenvalues'][0]:.6g}"
            if rec.get("backend_used"):
                msg += f", engine {rec['backend_used']}"
            others = rec.get("other_cpu_percent_during_phase")
            if others is not None and others > BUSY_WARN_PERCENT:
                msg += f" [other processes: {others:.0f}% CPU]"
        else:
            msg = f"{str(rec.get('status')).upper()}: {str(rec.get('reason'))[:200]}"
        print(f"{head} {msg}", flush=True)


def driver_main(args: argparse.Namespace) -> dict[str, Any]:
    """Run all configurations, write JSON, tables and figure, print the targets.

    Args:
        args: Parsed command line arguments of the driver.

    Returns:
        The summary of the targets.
    """
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = _harness.machine_info(args.device, PACKAGES)
    print(f"Machine: {info['cpu_name']} ({info['cpu_count_usable']} usable cores), "
          f"{info['device_name'] if args.device == 'cuda' else 'no GPU'}, torch {info['torch']}",
          flush=True)
    head = _laplace_worker.library_fingerprint().get("git_head", "?")
    plan = [(part, model, method) for part in args.parts
            for model in (("3c3d",) if part == "backends" else args.models)
            for method in PART_METHODS[part]]
    results: list[dict[str, Any]] = []
    start = time.perf_counter()

    def payload(summary=None):
        return {"machine": info, "git_head": head, "args": {
            "parts": list(args.parts), "models": list(args.models), "k": args.k,
            "rank": args.rank, "batch_size": args.batch_size, "seed": args.seed,
            "threads": args.threads or _harness.num_cores(), "low_memory": args.low_memory,
            "transformer": {"vocab": args.vocab, "width": args.width, "layers": args.layers,
                            "seq_len": args.seq_len, "heads": 4, "ff": 4 * args.width},
            "timeout_s": args.timeout, "mem_limit_gib": args.mem_limit_gib,
            "worker_env": {"OPENBLAS_NUM_THREADS": args.blas_threads or None,
                           "OMP_WAIT_POLICY": args.omp_wait_policy or None}},
            "results": results, "summary": summary,
            "total_wall_s": time.perf_counter() - start}

    json_path = out / "models.json"
    for part, model, method in plan:
        result = run_config(part, model, method, args)
        results.append(result)
        _print_record(result)
        json_path.write_text(json.dumps(payload(), indent=2))
    summary = summarize(results, args)
    final = payload(summary)
    json_path.write_text(json.dumps(final, indent=2))
    png_path = out / "models.png"
    plot(final, png_path)
    tables_dir = out / "models_tables"
    tables_dir.mkdir(exist_ok=True)
    for table_id, record in table_records(final, "docs/benchmarks/models.json").items():
        (tables_dir / f"{table_id}.json").write_text(json.dumps(record, indent=2) + "\n")
    print("\nTargets:")
    for key, item in summary.items():
        value = "-" if item["value"] is None else f"{item['value']:.2f}x"
        extra = f" ({item['peer_failure'][:100]})" if item.get("peer_failure") else ""
        print(f"  {key:<32} {value:>8} (target {item['target']:g}x): "
              f"{_harness.verdict(item['ok'])}{extra}")
    print(f"\nWrote {json_path}, {png_path} and {tables_dir}/ "
          f"in {(time.perf_counter() - start) / 60:.1f} min")
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse command line arguments.

    Args:
        argv: Arguments; defaults to ``sys.argv[1:]``.

    Returns:
        Parsed arguments, with ``<size>_defaults`` per model for the sizes left open.
    """
    parser = _harness.script_parser(__doc__)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--N", type=int, default=None,
                        help="Batch of the eigenpairs (default: resnet18 16, transformer "
                        "32, 3c3d 128).")
    parser.add_argument("--n-train", type=int, default=None,
                        help="Laplace training points (default: resnet18 32, transformer 256).")
    parser.add_argument("--n-test", type=int, default=None,
                        help="GLM predictive points (default: resnet18 8, transformer 128).")
    parser.add_argument("--k", type=int, default=10, help="Number of leading eigenpairs.")
    parser.add_argument("--rank", type=int, default=100, help="Rank of `lowrank_ggn`.")
    parser.add_argument("--batch-size", type=int, default=128, help="Laplace loader batch.")
    parser.add_argument("--low-memory", action="store_true",
                        help="ggn_eigh with low_memory=True (two passes).")
    parser.add_argument("--vocab", type=int, default=1000, help="Transformer vocabulary.")
    parser.add_argument("--width", type=int, default=128, help="Transformer width.")
    parser.add_argument("--layers", type=int, default=4, help="Transformer layers.")
    parser.add_argument("--seq-len", type=int, default=64, help="Transformer sequence length.")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="Time limit per worker process in seconds.")
    parser.add_argument("--mem-limit-gib", type=float, default=18.0,
                        help="Address-space cap of a worker (0: none).")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="Device of models, data and curvature.")
    parser.add_argument("--out", default=str(_harness.RESULTS_DIR), help="Output directory.")
    parser.add_argument("--seed", type=int, default=0, help="Random seed.")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads in workers (0: number of usable cores).")
    _harness.add_worker_env_arguments(parser)
    parser.add_argument("--wait-idle", type=float, default=0.0,
                        help="Before each worker, wait up to this many seconds for other "
                        f"processes to leave the CPU (< {BUSY_WARN_PERCENT:g}%% busy).")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke test: tiny sizes (N 4, 16 / 4 points, 2-layer "
                        "transformer of width 32), output in <out>/quick.")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.N_defaults = {"resnet18": 16, "transformer": 32, "3c3d": 128}
    args.n_train_defaults = {"resnet18": 32, "transformer": 256}
    args.n_test_defaults = {"resnet18": 8, "transformer": 128}
    if args.quick and not args.worker:
        args.N_defaults = {"resnet18": 4, "transformer": 8, "3c3d": 16}
        args.n_train_defaults = {"resnet18": 8, "transformer": 16}
        args.n_test_defaults = {"resnet18": 2, "transformer": 4}
        args.width, args.layers, args.seq_len, args.k = 32, 2, 16, 4
        args.out = str(Path(args.out) / "quick")
    if args.worker:
        args.N = args.N or 0
        args.n_train, args.n_test = args.n_train or 0, args.n_test or 0
    return args


def main(argv: Sequence[str] | None = None):
    """Entry point (``argv`` defaults to ``sys.argv[1:]``): see :func:`_harness.run_script`."""
    _harness.run_script(argv, parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
