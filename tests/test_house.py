"""The package's shape (docs/design.rst, "Where each concept lives"),
measured by walking its syntax trees: no import cycles, no module
reaching into another object's private state, at most 12 modules in a
package, the environ keys named in one module, and no module, class or
function grown past what a newcomer reads at once; and the order the
test files run in (conftest.py's LONGEST_FIRST) names each as it is."""

from __future__ import annotations

import ast
import os
import re
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "zc_lb"
MAX_MODULES = 12  # in any one package: a newcomer finds a concept by its subpackage
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400
LONG_FUNCTION = 40  # lines; a few may be longer where cutting them would not read better
MAX_LONG_FUNCTIONS = 8


def modules():
    """Dotted name -> path, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = modules()
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def imported(name, tree):
    """The package's modules ``name`` imports, anywhere in it."""
    package = name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.update(t for t in [target] + ["%s.%s" % (target, a.name) for a in node.names]
                         if t in MODULES)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
    return found - {name}


def test_no_import_cycles():
    graph = {name: imported(name, tree) for name, tree in TREES.items()}
    # (a package imports its own __init__ on the way in: not a cycle of concepts)
    graph = {name: {t for t in targets if not name.startswith(t + ".")}
             for name, targets in graph.items()}
    state = {}
    cycles = []

    def visit(name, path):
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


def test_no_module_reaches_into_another_objects_private_state():
    # ``other._x``: not on self, cls or super(); argparse's internals count
    reached = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                value = node.value
                if isinstance(value, ast.Name) and value.id in ("self", "cls", "sys"):
                    continue
                if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                        and value.func.id == "super"):
                    continue
                reached.append("%s:%d %s" % (name, node.lineno, ast.unparse(node)))
    assert not reached, reached


def test_no_package_holds_more_than_a_dozen_modules():
    count = defaultdict(int)
    for name, path in MODULES.items():
        if path.name != "__init__.py":
            count[name.rsplit(".", 1)[0]] += 1
    assert max(count.values()) <= MAX_MODULES, dict(count)
    assert all(MODULES[package].read_text().startswith('"""') for package in count), \
        "every package says what it holds"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_environ_keys_are_named_only_in_zc_lb_environ(name):
    if name == "zc_lb.environ":
        return
    keys = set(re.findall(r'^\w+: Final = "(zc_lb\.\w+)"',
                          MODULES["zc_lb.environ"].read_text(), re.M))
    literals = [node.value for node in ast.walk(TREES[name])
                if isinstance(node, ast.Constant) and node.value in keys]
    assert not literals, literals


def _length(node):
    return node.end_lineno - node.lineno + 1


def test_no_module_or_class_outgrows_one_concept():
    long_modules = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    long_modules = {name: n for name, n in long_modules.items() if n > MAX_MODULE_LINES}
    long_classes = {"%s.%s" % (name, node.name): _length(node)
                    for name, tree in TREES.items() for node in ast.walk(tree)
                    if isinstance(node, ast.ClassDef) and _length(node) > MAX_CLASS_LINES}
    assert not long_modules and not long_classes, (long_modules, long_classes)


def test_few_functions_are_long():
    long_functions = {"%s.%s:%d" % (name, node.name, node.lineno): _length(node)
                      for name, tree in TREES.items() for node in ast.walk(tree)
                      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and _length(node) > LONG_FUNCTION}
    assert len(long_functions) <= MAX_LONG_FUNCTIONS, long_functions


def test_the_longest_first_order_names_each_test_file_as_it_is():
    # A test file renamed or removed dropped out of conftest.py's
    # LONGEST_FIRST without a word, and ran after the long ones; now no
    # run starts until the order names it as it is (pytest_configure).
    import conftest
    assert conftest.misnamed() == []
    assert conftest.misnamed(("test_house.py", "test_gone.py", "apps.py", "test_house.py")) == [
        "test_gone.py (no such test file)", "apps.py (no such test file)",
        "test_house.py (named twice)"]
