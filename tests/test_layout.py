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


MAX_PARAMETERS = 8
#: The block classes, whose kind nothing outside ``factor/`` switches on.
BLOCK_CLASSES = {"DenseBlock", "KronBlock"}
#: Names of the residual models, which only ``posterior/`` compares.
RESIDUAL_NAMES = {"spectral", "isotropic", "diagonal", "none"}
#: Calls that build a mutable container at module level.
MUTABLE_FACTORIES = {"dict", "list", "set", "defaultdict", "OrderedDict", "WeakKeyDictionary",
                     "WeakValueDictionary", "WeakSet", "deque"}


def _in_package(path, folder):
    return path.relative_to(PACKAGE).parts[0] == folder


@pytest.mark.parametrize("path", MODULES, ids=_ids(MODULES))
def test_functions_take_few_parameters(path):
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs
                     if a.arg not in ("self", "cls")]
            count = len(names) + (args.vararg is not None) + (args.kwarg is not None)
            assert count <= MAX_PARAMETERS, f"{node.name}: {count} parameters"


@pytest.mark.parametrize("path", MODULES, ids=_ids(MODULES))
def test_only_factor_knows_the_block_classes(path):
    """Consumers use the ``Block`` interface; ``factor/`` alone tells the kinds apart."""
    if _in_package(path, "factor"):
        return
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            assert not names & BLOCK_CLASSES, f"line {node.lineno}: isinstance on a block"


@pytest.mark.parametrize("path", MODULES, ids=_ids(MODULES))
def test_only_the_posterior_compares_residual_names(path):
    """A residual model says what it needs; nobody else compares its name."""
    if _in_package(path, "posterior"):
        return
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Compare):
            constants = {c.value for c in [node.left, *node.comparators]
                         if isinstance(c, ast.Constant)}
            sources = ast.unparse(node)
            assert not (constants & RESIDUAL_NAMES and "residual" in sources), \
                f"line {node.lineno}: {sources}"


@pytest.mark.parametrize("path", MODULES, ids=_ids(MODULES))
def test_no_process_global_mutable_state(path):
    """No module-level container that functions change: a fit's answer never depends
    on other objects or earlier calls."""
    tree = _tree(path)
    mutable = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            value = node.value
            made = isinstance(value, (ast.Dict, ast.List, ast.Set)) or (
                isinstance(value, ast.Call) and
                getattr(value.func, "id", getattr(value.func, "attr", None)) in MUTABLE_FACTORIES)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if made:
                mutable |= {t.id for t in targets if isinstance(t, ast.Name)}
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            changed = None
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                for target in getattr(node, "targets", [getattr(node, "target", None)]):
                    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                        changed = target.value.id
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.attr in (
                        "append", "update", "add", "pop", "clear", "setdefault", "extend",
                        "insert", "remove", "discard", "popitem"):
                changed = node.func.value.id
            elif isinstance(node, ast.Global):
                changed = node.names[0]
            assert changed not in mutable, f"{func.name} changes the module-level {changed}"
            assert not isinstance(node, ast.Global), f"{func.name}: global {node.names}"
