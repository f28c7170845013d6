"""The lowrank-laplace command end to end on a tiny configuration."""

import json
import subprocess
import sys
import warnings

import pytest
import torch

from lowrank_laplace.toolkit import calibration, cli, options, rank_study, spectrum_demo
from lowrank_laplace.toolkit.cli import build_parser, main

TINY = ["spectrum", "--epochs", "0", "--batch-size", "24", "--top-k", "3", "--model", "mlp"]


@pytest.mark.slow
def test_spectrum_writes_report(tmp_path, capsys):
    assert main(TINY + ["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "exact, full batch" in out and "mc (M=1), sub-sampled" in out
    report = json.loads((tmp_path / "spectrum.json").read_text())
    assert len(report["cases"]) == 4
    for entry in report["cases"].values():
        evals = torch.tensor(entry["eigenvalues"])
        assert entry["rank"] == evals.numel() > 0
        assert torch.all(evals[:-1] >= evals[1:])
        # the trace is the sum of all eigenvalues, so the top-k keep at most all of it
        assert evals.sum().item() == pytest.approx(entry["trace"], rel=1e-4)
        assert 0 < entry["top_k_kept_fraction"] <= 1 + 1e-6
        assert len(entry["gamma_snr"]) == len(entry["lambda_snr"]) == 3
    assert (tmp_path / "spectrum.png").stat().st_size > 1000
    assert (tmp_path / "snr.png").stat().st_size > 1000


def test_spectrum_without_out_prints_only(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(TINY) == 0
    assert "exact, full batch" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def _numeric_options():
    """(sub-command, option, nonsense value) for every numeric option of the command."""
    cases = []
    for name, sub in build_parser()._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            if action.type in (options.POSITIVE, options.NONNEGATIVE, options.SEED):
                bad = ["-1", "abc", "1.5", "nan"] + (["0"] if action.type is options.POSITIVE
                                                     else [])
                bad += [str(2**32)] if action.type is options.SEED else []
                cases += [(name, action.option_strings[0], v) for v in bad]
            elif action.dest == "ranks":
                cases += [(name, "--ranks", v) for v in ("0", "abc", "10,-1", ",", "2.5")]
            elif action.dest == "angles":
                cases += [(name, "--angles", v) for v in ("0,abc", "nan", "0,inf", ",")]
    return cases


NUMERIC = _numeric_options()


def test_numeric_options_are_all_checked():
    options = {(sub, opt) for sub, opt, _ in NUMERIC}
    assert {("spectrum", "--batch-size"), ("spectrum", "--top-k"), ("spectrum", "--epochs"),
            ("spectrum", "--seed"), ("calibrate", "--epochs"), ("calibrate", "--n-train"),
            ("calibrate", "--n-test"), ("calibrate", "--batch-size"), ("calibrate", "--rank"),
            ("calibrate", "--mc-samples"), ("calibrate", "--seed"),
            ("calibrate", "--angles")} <= options
    # no option that takes a number is left as a plain int/float
    for sub in build_parser()._subparsers._group_actions[0].choices.values():
        assert not [a.dest for a in sub._actions if a.type in (int, float)]


@pytest.mark.parametrize("command, option, value", NUMERIC,
                         ids=[f"{c}{o}={v}" for c, o, v in NUMERIC])
def test_numeric_nonsense_exits_2_before_any_work(command, option, value, capsys, monkeypatch,
                                                  tmp_path):
    def no_work(*args, **kwargs):
        raise AssertionError("work started before the options were checked")

    monkeypatch.setattr(spectrum_demo, "load_digits", no_work)
    monkeypatch.setattr(calibration, "run", no_work)
    monkeypatch.setattr(rank_study, "run", no_work)
    assert main([command, f"{option}={value}", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"lowrank-laplace {command}: error")
    assert option in err and repr(value) in err
    assert not (tmp_path / "out").exists()


def test_numeric_nonsense_exits_2_as_a_command():
    proc = subprocess.run([sys.executable, "-m", "lowrank_laplace", "calibrate", "--rank", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "lowrank-laplace calibrate: error: argument --rank: expected a positive integer, "
        "got '0' (see lowrank-laplace calibrate --help)"]


@pytest.mark.parametrize("field, value, message", [
    ("rank", 0, "rank"), ("epochs", -1, "epochs"), ("n_train", -5, "n_train"),
    ("batch_size", 0, "batch_size"), ("mc_samples", -1, "mc_samples"), ("n_test", 2.5, "n_test"),
    ("seed", -3, "seed"), ("angles", [0.0, float("nan")], "angles"), ("angles", [], "angles"),
    ("solver", "lanczos", "solver"), ("rank", 3659, "rank"), ("mc_samples", 11, "mc_samples"),
    ("methods", ["map", "map"], "listed twice"), ("seed", 2**32, "seed"),
    ("epochs", "3", "invalid epochs '3'"), ("out", "", "use --out . for the current folder"),
])
def test_calibration_config_checked_before_any_work(field, value, message, tmp_path):
    config = calibration.CalibrationConfig(dataset="digits", out=str(tmp_path / "out"))
    setattr(config, field, value)
    with pytest.raises(calibration.UserError, match=message):
        calibration.run(config)
    assert not (tmp_path / "out").exists()


def test_config_defaults_are_the_commands(tmp_path):
    # the configs and the parser read their defaults from the same option table
    args = build_parser().parse_args(["calibrate"])
    config = calibration.CalibrationConfig()
    assert config.angles == args.angles and config.out == str(args.out) == "results"
    assert (config.rank, config.epochs, config.weight_decay) == (args.rank, 30, 10.0)
    study = rank_study.RankStudyConfig()
    assert study.ranks == [10, 30, 100, 300, 1000] and study.angles == [0.0, 60.0, 90.0]
    assert study.residuals == list(options.RESIDUAL_MODELS) and study.methods is None
    options.check_study(rank_study.RankStudyConfig(  # sequences may be tuples
        dataset="digits", angles=(0, 45), ranks=(4,), residuals=("none",), out=str(tmp_path)))


def test_help_shows_every_default(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # no line breaks inside long defaults
    parser = build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        text = " ".join(sub.format_help().split())
        options = [a for a in sub._actions if a.dest != "help"]
        assert text.count("(default: ") == len(options), name
        for action in options:
            assert f"(default: {action.default})" in text, (name, action.dest)


def test_spectrum_out_checked_before_computing(tmp_path, capsys, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("trained before checking --out")

    monkeypatch.setattr(spectrum_demo, "train", no_training)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(TINY + ["--out", str(blocker / "sub")]) == 2
    assert "cannot write to output directory" in capsys.readouterr().err


def test_spectrum_top_k_beyond_the_subsample(capsys):
    assert main(TINY[:-2] + ["--top-k", "4"]) == 2  # N = 24: sub-sample of 3
    assert "--top-k must be at most 3" in capsys.readouterr().err


@pytest.mark.slow
def test_command_output_has_no_warnings(tmp_path):
    # a fresh process: import-time warnings count too
    proc = subprocess.run([sys.executable, "-W", "default", "-m", "lowrank_laplace"] + TINY
                          + ["--out", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "Warning" not in proc.stdout


@pytest.mark.slow
def test_library_import_keeps_warning_filters():
    # third-party packages add their own filters when imported; ours adds none
    code = ("import warnings, torch, numpy, scipy, sklearn, backpack, torchmetrics\n"
            "import matplotlib.pyplot, laplace\n"
            "before = list(warnings.filters)\n"
            "import lowrank_laplace, lowrank_laplace.toolkit.cli\n"
            "import lowrank_laplace.toolkit.calibration\n"
            "assert warnings.filters == before, [f for f in warnings.filters if f not in before]\n")
    _run_python(code)


def _run_python(code: str) -> None:
    """Run ``code`` in a fresh interpreter and check that it succeeds."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_command_restores_warning_filters(tmp_path):
    before = list(warnings.filters)
    assert main(TINY) == 0
    assert warnings.filters == before
    with cli.quiet_warnings():
        with pytest.warns(UserWarning, match="unrelated"):  # other warnings still show
            warnings.warn("unrelated", UserWarning, stacklevel=1)
    assert warnings.filters == before


@pytest.mark.parametrize("args, message", [
    (["--dataset", "cifar"], "unknown dataset 'cifar'"),
    (["--model", "resnet"], "unknown model 'resnet'"),
    (["--batch-size", "3"], "--batch-size must lie in"),
])
def test_user_errors_are_one_line(args, message, capsys, monkeypatch):
    def no_data(*args, **kwargs):
        raise AssertionError("data loaded before the options were checked")

    monkeypatch.setattr(spectrum_demo, "load_digits", no_data)
    assert main(TINY + args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert err.startswith("lowrank-laplace: error")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_absent(capsys):
    assert main(TINY + ["--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_unwritable_output(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(TINY + ["--out", str(blocker / "sub")]) == 2
    assert "cannot write to output directory" in capsys.readouterr().err


def test_python_dash_m():
    proc = subprocess.run([sys.executable, "-m", "lowrank_laplace", "--help"],
                          capture_output=True, text=True, check=True)
    assert "spectrum" in proc.stdout


def test_parsing_imports_no_command():
    # --help and argument errors need the parser only: the commands' modules are
    # imported when a command runs
    code = ("import sys\n"
            "from lowrank_laplace.toolkit.cli import main\n"
            "assert main(['calibrate', '--rank', '0']) == 2\n"
            "assert main(['rank-study', '--help']) == 0\n"
            "assert main(['calibrate', '--methods', 'full_all']) == 2\n"
            "assert main(['calibrate', '--mc-samples', '1000', '--out', '']) == 2\n"
            "names = ('calibration', 'rank_study', 'spectrum_demo', 'posteriors', 'training')\n"
            "loaded = [n for n in names if 'lowrank_laplace.toolkit.' + n in sys.modules]\n"
            "loaded += [m for m in ('torch', 'laplace', 'matplotlib') if m in sys.modules]\n"
            "assert not loaded, loaded\n")
    _run_python(code)


def test_residual_names_match_the_library():
    from lowrank_laplace.posterior.residual import RESIDUALS

    assert options.RESIDUAL_MODELS == tuple(RESIDUALS)
    assert build_parser().parse_args(["rank-study"]).residuals == ",".join(RESIDUALS)


CAL = ["calibrate", "--dataset", "digits", "--epochs", "1", "--n-train", "300", "--n-test", "80",
       "--rank", "20", "--angles", "0,45"]


@pytest.mark.slow
def test_calibrate_marglik_trained_row(tmp_path, capsys):
    """The opt-in row trains its own network with marglik_training and its posterior."""
    assert main(CAL + ["--out", str(tmp_path), "--methods", "map,lowrank_ggn_marglik"]) == 0
    err = capsys.readouterr().err
    assert "marglik training (lowrank_ggn, 1 epoch)" in err
    report = json.loads((tmp_path / "calibration.json").read_text())
    entry = report["methods"]["lowrank_ggn_marglik"]
    assert "error" not in entry, entry
    assert entry["posterior"]["residual"] == "spectral" and entry["posterior"]["rank"] == 100
    assert entry["posterior"]["prior_precision"] > 0 and entry["fit_s"] > 0
    # a network of its own: not the MAP's predictions
    assert entry["in_distribution"]["nll"] != report["methods"]["map"]["in_distribution"]["nll"]
SCHEMA_ID = {"accuracy", "nll", "ece", "mce", "brier", "confidence"}


@pytest.mark.slow
def test_calibrate_end_to_end(tmp_path, capsys):
    ckpt = tmp_path / "cnn.pt"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(CAL + ["--out", str(tmp_path), "--save-checkpoint", str(ckpt)]) == 0
    # the known third-party warnings are filtered: a clean table and short progress
    assert [str(w.message) for w in caught] == []
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    assert out.startswith("method ") and "lowrank_ggn_all" in out and "ECE under rotation" in out
    from lowrank_laplace.toolkit.calibration import default_methods

    count = len(default_methods("digits"))
    assert "training epoch 1/1" in err and f"[{count}/{count}] diag_all" in err
    assert len(err.splitlines()) <= count + 4 and "Warning" not in err
    assert "residual='spectral'" in out and "full_*" in out
    for plot in ("shift_ece.png", "shift_accuracy.png"):
        assert (tmp_path / plot).stat().st_size > 2000
    report = json.loads((tmp_path / "calibration.json").read_text())
    assert set(report["methods"]) == set(default_methods("digits"))  # with full_all
    for name, m in report["methods"].items():
        assert "error" not in m, (name, m)
        if name != "map":
            assert m["posterior"]["prior_precision"] > 0
        if name.startswith("lowrank_ggn"):
            info = m["posterior"]
            assert 0 < info["kept_fraction"] <= 1 + 1e-6 and info["rank"] <= 20
            assert info["residual"] == {"all": "spectral", "isotropic": "isotropic",
                                        "diag": "diagonal", "none": "none",
                                        "layer": "spectral"}[name.rsplit("_", 1)[1]]
        assert set(m["in_distribution"]) == SCHEMA_ID
        assert set(m["shift"]) == {"0", "45"}
        assert set(m["shift"]["45"]) == {"accuracy", "nll", "ece"}
        assert 0 <= m["ood_auroc"] <= 1 and m["fit_s"] >= 0 and m["predict_s"] > 0
        assert (tmp_path / f"reliability_{name}.png").stat().st_size > 2000
    assert report["config"]["n_train_used"] == 300
    assert report["machine"]["date"].startswith("20")
    assert report["machine"]["torch"] == torch.__version__
    # rotation by 0 degrees is the identity: shift "0" equals in-distribution
    m = report["methods"]["map"]
    assert m["shift"]["0"]["ece"] == pytest.approx(m["in_distribution"]["ece"])
    # loading the checkpoint reproduces the MAP predictions
    out2 = tmp_path / "again"
    assert main(CAL + ["--out", str(out2), "--checkpoint", str(ckpt), "--methods", "map"]) == 0
    again = json.loads((out2 / "calibration.json").read_text())
    assert again["methods"]["map"]["in_distribution"] == m["in_distribution"]
    # the opt-in sketch solver: same network, a posterior that keeps less of the trace
    out3 = tmp_path / "sketch"
    assert main(CAL + ["--out", str(out3), "--checkpoint", str(ckpt), "--methods",
                       "lowrank_ggn_all", "--solver", "sketch"]) == 0
    sketch = json.loads((out3 / "calibration.json").read_text())
    assert sketch["config"]["solver"] == "sketch"
    kept = sketch["methods"]["lowrank_ggn_all"]["posterior"]["kept_fraction"]
    assert 0 < kept <= report["methods"]["lowrank_ggn_all"]["posterior"]["kept_fraction"]


@pytest.mark.parametrize("args, message", [
    (["--dataset", "cifar10"], "unknown dataset 'cifar10'"),
    (["--checkpoint", "/nonexistent/cnn.pt"], "does not exist"),
    (["--methods", "map,swag"], "unknown method 'swag'"),
    (["--prior", "cv"], "unknown prior tuning 'cv'"),
    (["--save-checkpoint", "/nonexistent/cnn.pt"], "its folder does not exist"),
    (["--angles", "0,abc"], "argument --angles: expected comma-separated numbers"),
])
def test_calibrate_user_errors(args, message, capsys, tmp_path):
    assert main(CAL + ["--out", str(tmp_path)] + args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_calibrate_wrong_checkpoint_and_unwritable_out(tmp_path, capsys):
    ckpt = tmp_path / "other.pt"
    torch.save(torch.nn.Linear(3, 3).state_dict(), ckpt)
    assert main(CAL + ["--out", str(tmp_path), "--checkpoint", str(ckpt)]) == 2
    assert "does not fit the digits CNN" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(CAL + ["--out", str(blocker / "sub")]) == 2
    assert "is not writable" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_calibrate_cuda_absent(tmp_path, capsys):
    assert main(CAL + ["--out", str(tmp_path), "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.slow
def test_option_tables_match_the_studies():
    # repeated in options so that the checks need no torch
    from lowrank_laplace.toolkit import datasets, training

    assert tuple(options.CNN_PARAMETERS) == datasets.IMAGE_DATASETS
    for name, count in options.CNN_PARAMETERS.items():
        assert sum(p.numel() for p in training.make_cnn(name).parameters()) == count
        y = datasets.image_split(name).test[1]
        assert len(set(y.tolist())) == options.NUM_CLASSES
    assert len(datasets.load_images("digits")[1]) == options.DIGITS_SIZE


@pytest.fixture
def no_work(monkeypatch):
    """Make every command's work fail: a rejection must come before it."""
    def work(*args, **kwargs):
        raise AssertionError("work started before the options were checked")

    for module, name in [(calibration, "run"), (rank_study, "run"), (spectrum_demo, "run")]:
        monkeypatch.setattr(module, name, work)


def _garbage(path):
    path.write_bytes(b"not a checkpoint\n")
    return str(path)


def _folder(path):
    path.mkdir()
    return str(path)


def _empty(path):
    path.write_bytes(b"")
    return str(path)


# (command and options, a file to create for the run, expected part of the one error line)
REJECTED = [
    (["calibrate", "--device", "bogus"], None,
     "argument --device: expected cpu, cuda, cuda:N or mps, got 'bogus'"),
    (["calibrate", "--device", "meta"], None,
     "argument --device: 'meta' tensors have shapes but no values"),
    (["spectrum", "--device", "meta"], None, "'meta' tensors have shapes but no values"),
    (["rank-study", "--device", "cuda:x"], None, "expected cpu, cuda, cuda:N or mps"),
    (["calibrate", "--checkpoint", "{file}"], _garbage,
     "cannot load checkpoint '{file}' as a state_dict saved by torch.save: "),
    (["calibrate", "--checkpoint", "{file}"], _folder, "checkpoint '{file}' is not a file"),
    (["calibrate", "--checkpoint", "{file}"], _empty, "checkpoint '{file}' is an empty file"),
    (["calibrate", "--save-checkpoint", "{file}"], _folder,
     "cannot save the checkpoint to '{file}': it names a folder, not a file"),
    (["rank-study", "--save-checkpoint", "{file}/"], None,
     "cannot save the checkpoint to '{file}/': it names a folder"),
    (["calibrate", "--save-checkpoint", "{file}", "--checkpoint", "{file}"], _garbage,
     "nothing to save to '{file}': the network is loaded from '{file}', not trained"),
    (["calibrate", "--out="], None,
     "argument --out: an empty path, got '': use --out . for the current folder"),
    (["rank-study", "--out", " "], None, "use --out . for the current folder"),
    (["spectrum", "--out="], None, "use --out . for the current folder"),
    (["calibrate", "--methods", "map,full_all"], None,
     "method full_all cannot run on --dataset mnist: its dense D x D posterior is too large "
     "for the mnist CNN (D = 20,522); it runs on --dataset digits"),
    (["calibrate", "--methods", "map, kron_all,map"], None, "method 'map' is listed twice"),
    (["calibrate", "--rank", str(10**12)], None,
     "rank 1000000000000 is more than the 20,522 parameters of the mnist CNN"),
    (["calibrate", "--dataset", "digits", "--rank", "3659"], None,
     "rank 3659 is more than the 3,658 parameters of the digits CNN"),
    (["rank-study", "--dataset", "digits", "--ranks", "10,5000"], None,
     "rank 5000 is more than the 3,658 parameters"),
    (["calibrate", "--mc-samples", "1000"], None,
     "mc_samples 1000 is more than the 10 classes: the exact GGN (mc_samples 0)"),
    (["rank-study", "--mc-samples", "11"], None, "mc_samples 11 is more than the 10 classes"),
    (["calibrate", "--seed", str(2**32)], None,
     "argument --seed: expected an integer from 0 to 2**32 - 1"),
    (["rank-study", "--residuals", "spectral,bogus"], None, "unknown residual model 'bogus'"),
    (["rank-study", "--residuals", ","], None, "unknown residual model ','"),
    (["rank-study", "--train", "marglik", "--save-checkpoint", "{file}"], None,
     "--train marglik trains its own network: drop --checkpoint and --save-checkpoint"),
    (["calibrate", "--prior", "cv"], None, "unknown prior tuning 'cv'"),
]


@pytest.mark.parametrize("argv, make, message", REJECTED,
                         ids=[" ".join(a).replace("{file}", "F") for a, _, _ in REJECTED])
def test_rejected_in_one_line_before_any_work(argv, make, message, tmp_path, capsys, no_work):
    file = tmp_path / "given"
    if make is not None:
        make(file)
    argv = [a.replace("{file}", str(file)) for a in argv]
    if "--out" not in " ".join(argv):
        argv += ["--out", str(tmp_path / "out")]
    before = sorted(tmp_path.rglob("*"))
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("lowrank-laplace") and ": error: " in err
    assert message.replace("{file}", str(file)) in err
    assert sorted(tmp_path.rglob("*")) == before  # no output folder, no checkpoint


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["calibrate", "rank-study", "spectrum"])
def test_cuda_absent_before_any_work(command, tmp_path, capsys, no_work):
    assert main([command, "--device", "cuda:1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("lowrank-laplace: error: device 'cuda:1' was requested, but CUDA is not "
                   "available on this machine")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_index_beyond_the_devices(tmp_path, capsys, no_work):
    count = torch.cuda.device_count()
    assert main(["calibrate", "--device", f"cuda:{count}", "--out", str(tmp_path)]) == 2
    assert f"this machine has {count} CUDA device(s)" in capsys.readouterr().err


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="needs a machine without MPS")
def test_mps_absent(tmp_path, capsys, no_work):
    assert main(["calibrate", "--device", "mps", "--out", str(tmp_path / "out")]) == 2
    assert "MPS is not available" in capsys.readouterr().err


def test_wrong_checkpoint_refused_before_loading_data(tmp_path, capsys, monkeypatch, no_work):
    from lowrank_laplace.toolkit import datasets

    def no_data(*args, **kwargs):
        raise AssertionError("data loaded before the checkpoint was checked")

    monkeypatch.setattr(datasets, "image_split", no_data)
    ckpt = tmp_path / "mnist.pt"
    torch.save(calibration.make_cnn("mnist").state_dict(), ckpt)
    assert main(["calibrate", "--dataset", "digits", "--checkpoint", str(ckpt),
                 "--out", str(tmp_path / "out")]) == 2
    assert f"checkpoint '{ckpt}' does not fit the digits CNN" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [
    ["calibrate", "--dataset", "digits", "--methods", "full_all", "--rank", "3658",
     "--mc-samples", "10"],
    ["calibrate", "--device", "cpu", "--methods", "", "--save-checkpoint", "{tmp}/cnn.pt"],
    ["rank-study", "--dataset", "digits", "--ranks", "1,3658", "--residuals", "none"],
    ["spectrum", "--device", "cpu"],
])
def test_limits_accepted(argv, tmp_path, monkeypatch):
    # the largest values the checks take reach the command, with the options as given
    seen = []
    for name, command in cli.COMMANDS.items():
        monkeypatch.setitem(cli.COMMANDS, name, command._replace(
            run=lambda checked, name=name: seen.append((name, checked))))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--out", str(tmp_path / "o")]
    assert main(argv) == 0
    assert [name for name, _ in seen] == [argv[0]]
    if argv[0] == "calibrate":
        config = seen[0][1]
        assert config.methods == (["full_all"] if "full_all" in argv else None)
        assert config.out == str(tmp_path / "o") and (tmp_path / "o").is_dir()


def test_out_dot_is_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = []
    monkeypatch.setitem(cli.COMMANDS, "calibrate", cli.COMMANDS["calibrate"]._replace(
        run=seen.append))
    assert main(["calibrate", "--out", "."]) == 0
    assert seen[0].out == "."


def test_library_refuses_what_the_command_refuses(tmp_path):
    # calibration.run checks the same options (no silent "could not run" in the report)
    config = calibration.CalibrationConfig(methods=["full_all"], out=str(tmp_path / "out"))
    with pytest.raises(calibration.UserError, match="full_all cannot run on --dataset mnist"):
        calibration.run(config)
    assert not (tmp_path / "out").exists()
