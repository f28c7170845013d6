"""The example notebooks run top to bottom; the docs render identical copies of them.

The notebooks live in ``examples/`` (stored with their outputs); ``docs/notebooks/`` holds
byte-identical copies for mkdocs-jupyter, which only renders files inside ``docs_dir``.
After editing a notebook: run it, save it with outputs, ``cp examples/*.ipynb docs/notebooks/``.
"""

import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DOCS = ROOT / "docs" / "notebooks"
EXPECTED = [
    "01_regression_1d.ipynb",
    "02_classification_2d.ipynb",
    "03_mnist_calibration.ipynb",
    "04_curvature_inside.ipynb",
    "05_lora_adapters.ipynb",
]
NOTEBOOKS = sorted(p.name for p in EXAMPLES.glob("*.ipynb"))
MAX_BYTES = 1_000_000


def test_expected_notebooks_exist():
    missing = [name for name in EXPECTED if name not in NOTEBOOKS]
    assert not missing, f"missing notebooks in examples/: {missing}"


def test_docs_copies_are_identical():
    docs = sorted(p.name for p in DOCS.glob("*.ipynb"))
    assert docs == NOTEBOOKS, (
        f"docs/notebooks/ has {docs}, examples/ has {NOTEBOOKS}: "
        "run `cp examples/*.ipynb docs/notebooks/`"
    )
    stale = [n for n in NOTEBOOKS if (EXAMPLES / n).read_bytes() != (DOCS / n).read_bytes()]
    assert not stale, f"docs/notebooks/ copies differ from examples/: {stale}; " \
        "run `cp examples/*.ipynb docs/notebooks/`"


def test_notebooks_are_in_the_docs_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [n for n in NOTEBOOKS if f"notebooks/{n}" not in nav]
    assert not missing, f"not in the mkdocs.yml nav: {missing}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_small_and_clean(name):
    nbformat = pytest.importorskip("nbformat")
    path = EXAMPLES / name
    assert path.stat().st_size < MAX_BYTES, f"{name} is {path.stat().st_size:,} bytes"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, f"{name} was saved with an error output"


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(EXAMPLES)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError with the failing cell and traceback
    print(f"{name}: {time.perf_counter() - start:.1f} s")
