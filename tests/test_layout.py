"""The package's layout rules: short modules, classes and functions; no private names
crossing modules. Stated in the README's layout section; checked here on every run."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lowrank_laplace"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 500, 300, 80


def _tree(path):
    return ast.parse(path.read_text(), filename=str(path))


def _ids(paths):
    return [str(p.relative_to(PACKAGE)) for p in paths]


@pytest.mark.parametrize("path", MODULES, ids=_ids(MODULES))
def test_module_class_and_function_sizes(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE, f"{lines} lines"
    for node in ast.walk(_tree(path)):
        size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.ClassDef):
            assert size <= MAX_CLASS, f"class {node.name}: {size} lines"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert size <= MAX_FUNCTION, f"function {node.name}: {size} lines"


@pytest.mark.parametrize("path", MODULES, ids=_ids(MODULES))
def test_no_private_name_crosses_modules(path):
    """Neither ``from lowrank_laplace.x import _y`` nor ``module._y`` on a module of ours."""
    tree = _tree(path)
    ours = set()  # local names bound to modules of the package
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE.name):
            for alias in node.names:
                assert not alias.name.startswith("_"), f"imports {node.module}.{alias.name}"
                assert not any(part.startswith("_") for part in node.module.split(".")), \
                    f"imports from the private module {node.module}"
                if (PACKAGE / Path(*node.module.split(".")[1:], alias.name)).exists() or \
                        (PACKAGE / Path(*node.module.split(".")[1:], alias.name + ".py")).exists():
                    ours.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE.name) and alias.asname:
                    ours.add(alias.asname)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in ours:
            assert not node.attr.startswith("_"), \
                f"line {node.lineno}: {node.value.id}.{node.attr}"
