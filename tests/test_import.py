"""``import lowrank_laplace`` is cheap, and registers ``lowrank_ggn`` in either import order.

Each case runs in a fresh interpreter: what is imported, and in which order, is the test.
"""

import subprocess
import sys

import pytest

import lowrank_laplace

BUILD = ("import torch\n"
         "la = Laplace(torch.nn.Linear(3, 2), 'regression', subset_of_weights='all',\n"
         "             hessian_structure='lowrank_ggn')\n"
         "assert isinstance(la, lowrank_laplace.LowRankGGNLaplace), type(la)\n"
         "la = Laplace(torch.nn.Sequential(torch.nn.Linear(3, 2)), 'classification',\n"
         "             subset_of_weights='last_layer', hessian_structure='lowrank_ggn')\n"
         "assert isinstance(la, lowrank_laplace.LowRankGGNLLLaplace), type(la)\n")


def _run_python(code: str, *flags: str) -> str:
    """Run ``code`` in a fresh interpreter, check that it succeeds, return its stderr."""
    proc = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


@pytest.mark.parametrize("module", ["lowrank_laplace", "lowrank_laplace.toolkit.cli"])
def test_import_needs_no_torch(module):
    _run_python(f"import sys, {module}\n"
                "heavy = [m for m in ('torch', 'laplace', 'backpack', 'matplotlib')\n"
                "         if m in sys.modules]\n"
                "assert not heavy, heavy\n")


@pytest.mark.parametrize("imports", [
    "import lowrank_laplace\nfrom laplace import Laplace\n",
    "from laplace import Laplace\nimport lowrank_laplace\n",
    "import lowrank_laplace\nimport laplace.baselaplace\nfrom laplace import Laplace\n",
    "import lowrank_laplace\nfrom lowrank_laplace import LowRankGGNLaplace\n"
    "from laplace import Laplace\n",
], ids=["ours-first", "laplace-first", "laplace-submodule-first", "class-first"])
@pytest.mark.slow
def test_both_import_orders_register_lowrank_ggn(imports):
    _run_python(imports + BUILD)


@pytest.mark.slow
def test_registered_as_soon_as_laplace_is_imported():
    # no Laplace(...) call or attribute access needed: importing laplace is enough
    _run_python("import sys, lowrank_laplace, laplace\n"
                "assert 'lowrank_laplace.laplace_torch' in sys.modules\n"
                "from laplace.baselaplace import BaseLaplace\n"
                "keys = set()\n"
                "todo = [BaseLaplace]\n"
                "while todo:\n"
                "    cls = todo.pop()\n"
                "    todo += cls.__subclasses__()\n"
                "    keys.add(getattr(cls, '_key', None))\n"
                "assert ('all', 'lowrank_ggn') in keys and ('last_layer', 'lowrank_ggn') in keys\n"
                "hooks = [f for f in sys.meta_path if type(f).__name__ == 'LaplaceFinder']\n"
                "assert not hooks, hooks  # the hook removes itself once it has run\n")


@pytest.mark.slow
def test_laplace_import_through_us_is_quiet_and_keeps_filters():
    # laplace-torch's import-time FutureWarning (torch.jit.script) is hidden during the
    # import only; the user's filters, -W error included, are the same afterwards
    stderr = _run_python("import warnings, lowrank_laplace\n"
                         "before = list(warnings.filters)\n"
                         "import laplace\n"
                         "assert warnings.filters == before\n", "-W", "error")
    assert stderr == ""


def test_public_names():
    names = set(lowrank_laplace.__all__)
    assert names <= set(dir(lowrank_laplace))
    assert set(vars(lowrank_laplace)["_HOMES"]) == names
    for name in sorted(names):
        value = getattr(lowrank_laplace, name)
        assert value.__name__ == name
    from lowrank_laplace import LowRankGGNLaplace, ggn_eigh

    assert LowRankGGNLaplace.__module__ == "lowrank_laplace.laplace_torch.laplace"
    assert ggn_eigh is lowrank_laplace.spectrum.ggn_eigh


@pytest.mark.slow
def test_subpackages_as_attributes():
    _run_python("import lowrank_laplace as ll\n"
                "assert ll.posterior.LowRankPrecision is ll.LowRankPrecision\n"
                "assert ll.toolkit.__name__ == 'lowrank_laplace.toolkit'\n"
                "try:\n"
                "    ll.no_such_name\n"
                "except AttributeError as err:\n"
                "    assert 'no_such_name' in str(err)\n"
                "else:\n"
                "    raise AssertionError('no AttributeError')\n")
