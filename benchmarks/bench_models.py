"""Benchmark models beyond plain stacks: torchvision ResNet-18 and a transformer encoder.

Three questions, each configuration in a fresh worker process (this script with
``--worker``, see ``_harness.py``) that reports time and peak memory of the measured
calls only (imports, model and data creation excluded):

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

The default sizes are for a CPU run on a few cores: ``eigh`` at
N = 16 (ResNet-18) and N = 32 (transformer), ``laplace`` on 32 / 8 points
(ResNet-18) and 256 / 128 points (transformer), ``backends`` at N = 128. On a GPU,
use ``--device cuda --N 128 --n-train 1024 --n-test 128`` (the targets' sizes; models,
data and every method's curvature on the GPU, peak memory as CUDA's allocator peak).

Examples:
    Smoke test (tiny sizes)::

        python -m benchmarks.bench_models --quick

    Default CPU run, then copy the tables into ``benchmarks/results/tables/``::

        python -m benchmarks.bench_models

Results are written to ``<out>/models.json`` and ``<out>/models.png``; the rows of the
docs' tables to ``<out>/models_tables/*.json`` (their ``sources`` name
``docs/benchmarks/models.json``, where the raw run is kept). Targets, tables and the
figure live in ``_models_report.py``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks import _harness, _problems
from benchmarks._models_report import MODELS, PART_METHODS, PARTS, plot, summarize, table_records
from benchmarks._report import DEFAULT_PACKAGES, VERDICTS, machine_info, write_tables
from benchmarks._worker import ggn_eigsh, num_cores, probs_warnings, run_phases, worker_setup

NUM_CLASSES = 10
#: Sizes by model when the command line leaves them open: CPU runs, and ``--quick``.
SIZES = {"N": {"resnet18": 16, "transformer": 32, "3c3d": 128},
         "n_train": {"resnet18": 32, "transformer": 256},
         "n_test": {"resnet18": 8, "transformer": 128}}
QUICK_SIZES = {"N": {"resnet18": 4, "transformer": 8, "3c3d": 16},
               "n_train": {"resnet18": 8, "transformer": 16},
               "n_test": {"resnet18": 2, "transformer": 4}}


###############################################################################
#                                  Models                                     #
###############################################################################


class TransformerClassifier(nn.Module):
    """Token and position embeddings, a masked transformer encoder, mean pooling, head.

    Token 0 (of ``vocab``) is padding: it is masked in attention and left out of the
    pooling; ``layers`` encoder layers of width ``width`` with 4 heads.
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
        """Logits ``(N, num_classes)`` of token ids ``(N, seq_len)``."""
        pad = tokens == 0
        h = self.encoder(self.embed(tokens) + self.pos, src_key_padding_mask=pad)
        keep = (~pad).to(h.dtype)[..., None]
        return self.head((h * keep).sum(1) / keep.sum(1))


def make_model(name: str, n: int, config: dict[str, Any]) -> tuple[nn.Module, Tensor, Tensor]:
    """``(model, X, y)``: ``'resnet18'``, ``'transformer'`` or ``'3c3d'`` (seeded, eval
    mode; the transformer's sizes from the configuration) and ``n`` random labelled
    inputs."""
    if name == "3c3d":
        model, _, X, y = _problems.make_problem("3c3d", n, seed=config["seed"])
        return model.eval(), X, y
    torch.manual_seed(config["seed"])
    generator = torch.Generator().manual_seed(config["seed"] + 1)
    if name == "resnet18":
        import torchvision

        model = torchvision.models.resnet18(num_classes=NUM_CLASSES)
        X = torch.randn(n, 3, 32, 32, generator=generator)
    else:
        seq_len, vocab = config["seq_len"], config["vocab"]
        model = TransformerClassifier(vocab, config["width"], config["layers"], seq_len,
                                      NUM_CLASSES)
        lengths = torch.randint(max(1, seq_len // 4), seq_len + 1, (n,), generator=generator)
        tokens = torch.randint(1, vocab, (n, seq_len), generator=generator)
        X = tokens * (torch.arange(seq_len)[None] < lengths[:, None])
    y = torch.randint(0, NUM_CLASSES, (n,), generator=generator)
    return model.eval(), X, y


###############################################################################
#                                  Worker                                     #
###############################################################################


def _eigh_call(method: str, model: nn.Module, X: Tensor, y: Tensor, config: dict[str, Any]
               ) -> tuple[Callable[[], Any], dict[str, Any]]:
    """The measured call of an ``eigh`` or ``backends`` method (``'ours'``, ``'eigsh'``,
    ``'backpack'``, ``'functorch'``): it returns eigenvalues and eigenvectors and fills
    the returned dict (engine used, number of GGN-vector products)."""
    loss_func = nn.CrossEntropyLoss()
    extra: dict[str, Any] = {}
    if method == "eigsh":
        import curvlinops  # noqa: F401

        def call():
            evals, evecs, count = ggn_eigsh(model, loss_func, [(X, y)], len(y), config["k"])
            extra["num_products"] = count
            return evals, evecs

        return call, extra

    import lowrank_laplace as ll

    backend = "auto" if method == "ours" else method

    def call():
        torch.manual_seed(config["seed"])
        result = ll.ggn_eigh(model, loss_func, X, y, top_k=config["k"], backend=backend,
                             low_memory=config["low_memory"])
        extra["backend_used"] = result.backend
        extra["kept_fraction"] = float(result.eigenvalues.sum() / result.trace)
        return result.eigenvalues, result.eigenvectors

    return call, extra


def _laplace_phases(method: str, model: nn.Module, X: Tensor, y: Tensor,
                    config: dict[str, Any]) -> list[tuple[str, Callable[[], Any]]]:
    """The measured phases ``(name, call, describe)`` of a ``laplace`` method on training
    inputs followed by test inputs ``X``: ``fit`` and, except for ``grad_pass``,
    ``glm``."""
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(X[: config["n_train"]], y[: config["n_train"]]),
                        batch_size=min(config["batch_size"], config["n_train"]), shuffle=False)
    X_test = X[config["n_train"] :]
    if method == "grad_pass":
        loss_func = nn.CrossEntropyLoss(reduction="sum")

        def grad_pass():
            for xb, yb in loader:
                model.zero_grad(set_to_none=True)
                loss_func(model(xb), yb).backward()
            model.zero_grad(set_to_none=True)

        return [("fit", grad_pass, lambda out: {})]

    import laplace

    import lowrank_laplace  # noqa: F401 (registers hessian_structure="lowrank_ggn")

    if method.startswith("kron"):
        kwargs: dict[str, Any] = {"hessian_structure": "kron"}
        if method != "kron_default":
            from laplace.curvature import AsdlGGN, BackPackGGN

            kwargs["backend"] = BackPackGGN if method == "kron_backpack" else AsdlGGN
    else:
        kwargs = {"hessian_structure": "lowrank_ggn", "rank": config["rank"],
                  "mc_samples": 1 if method == "lowrank_mc" else 0}
    state: dict[str, Any] = {}

    def fit():
        torch.manual_seed(config["seed"])
        la = laplace.Laplace(model, "classification", subset_of_weights="all", **kwargs)
        la.fit(loader)
        state["la"] = la
        return la

    def glm():
        return state["la"](X_test, pred_type="glm", link_approx="probit").detach()

    def fitted(la) -> dict[str, Any]:
        if not method.startswith("lowrank"):
            return {"H_type": type(la.H).__name__}
        return {"H_type": type(la.H).__name__, "kept_fraction": float(la.kept_fraction),
                "backend_used": la.factor_backend_used}

    return [("fit", fit, fitted),
            ("glm", glm, probs_warnings(len(X_test), NUM_CLASSES))]


def worker_main(config: dict[str, Any]):
    """Run one configuration and emit one record per measured phase.

    The transformer's workers run attention with PyTorch's math kernel and without the
    fused encoder fast path, since the peers' forward-mode products need them.

    Args:
        config: The configuration (see :func:`configurations`).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    setup = worker_setup(config)
    device = torch.device(config["device"])
    if config["model"] == "transformer":
        torch.backends.mha.set_fastpath_enabled(False)
    n = config["n_train"] + config["n_test"] if config["part"] == "laplace" else config["N"]
    model, X, y = make_model(config["model"], n, config)
    model, X, y = model.to(device), X.to(device), y.to(device)
    setup.update(D=sum(p.numel() for p in model.parameters() if p.requires_grad), N=n)
    if config["part"] == "laplace":
        phases = _laplace_phases(config["method"], model, X, y, config)
    else:
        call, extra = _eigh_call(config["method"], model, X, y, config)
        phases = [("eigh", call, lambda out: {
            "eigenvalues": out[0].detach().double().sort(descending=True).values.tolist(),
            "eigenvectors_shape": list(out[1].shape), **extra})]
    kernel = sdpa_kernel(SDPBackend.MATH) if config["model"] == "transformer" else None
    with kernel or contextlib.nullcontext():
        run_phases(setup, phases, config)


###############################################################################
#                                  Driver                                     #
###############################################################################


def configurations(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every ``(part, model, method)`` configuration with its sizes."""
    common = {k: getattr(args, k) for k in (
        "k", "seed", "threads", "rank", "batch_size", "mem_limit_gib", "vocab", "width",
        "layers", "seq_len", "device", "low_memory")}
    configs = []
    for part in args.parts:
        for model in ("3c3d",) if part == "backends" else args.models:
            names = ("n_train", "n_test") if part == "laplace" else ("N",)
            size = {k: getattr(args, k) or args.sizes[k][model] for k in names}
            phases = ["fit", "glm"] if part == "laplace" else ["eigh"]
            configs += [{"part": part, "model": model, "method": method, **size, **common,
                         "phases": ["fit"] if method == "grad_pass" else phases}
                        for method in PART_METHODS[part]]
    return configs


def driver_main(args: argparse.Namespace) -> dict[str, Any]:
    """Run all configurations, write JSON, tables and figure, print the targets.

    Args:
        args: Parsed command line arguments of the driver.

    Returns:
        The summary of the targets.
    """
    out = Path(args.out)
    info = machine_info(args.device, (*DEFAULT_PACKAGES, "laplace-torch", "torchvision"))
    print(f"Machine: {info['cpu_name']} ({info['cpu_count_usable']} usable cores), "
          f"{info['device_name'] if args.device == 'cuda' else 'no GPU'}, torch {info['torch']}",
          flush=True)
    settings = {"parts": list(args.parts), "models": list(args.models), "device": args.device,
                "threads": args.threads or num_cores(),
                "transformer": {"vocab": args.vocab, "width": args.width, "layers": args.layers,
                                "seq_len": args.seq_len, "heads": 4, "ff": 4 * args.width},
                **{k: getattr(args, k) for k in ("k", "rank", "batch_size", "seed",
                                                 "low_memory", "timeout", "mem_limit_gib")}}
    plan = _harness.Plan("benchmarks.bench_models", configurations(args),
                         ("part", "model", "method"), out / "models.json", settings, info)
    records = plan.run(args)
    summary = summarize(records, settings)
    payload = plan.write(records, summary, args)
    plot(payload, out / "models.png")
    write_tables(table_records(payload, "docs/benchmarks/models.json"), out / "models_tables")
    print("\nTargets:")
    for key, item in summary.items():
        value = "-" if item["value"] is None else f"{item['value']:.2f}x"
        extra = f" ({item['peer_failure'][:100]})" if item.get("peer_failure") else ""
        print(f"  {key:<32} {value:>8} (target {item['target']:g}x): "
              f"{VERDICTS[item['ok']]}{extra}")
    print(f"\nWrote {plan.path} and {out / 'models.png'}")
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv``; default ``sys.argv[1:]``); ``sizes`` holds the
    sizes by model that the command line leaves open."""
    parser = _harness.script_parser(
        __doc__, "timeout", "mem_limit_gib", "device", "out", "seed", "threads",
        "blas_threads", "omp_wait_policy", "wait_for", "wait_max", "wait_poll", "wait_idle",
        "retry_busy", "repeat", timeout=900.0, out=str(_harness.RESULTS_DIR))
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
    parser.add_argument("--quick", action="store_true",
                        help="Smoke test: tiny sizes (N 4, 16 / 4 points, 2-layer "
                        "transformer of width 32), output in <out>/quick.")
    args = parser.parse_args(argv)
    args.sizes = QUICK_SIZES if args.quick else SIZES
    if args.quick:
        args.width, args.layers, args.seq_len, args.k = 32, 2, 16, 4
        args.out = str(Path(args.out) / "quick")
    return args


def main(argv: Sequence[str] | None = None):
    """Entry point (``argv`` defaults to ``sys.argv[1:]``): see :func:`_harness.run_script`."""
    return _harness.run_script(argv, parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
