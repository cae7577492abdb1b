"""The package's shape, checked by reading its modules: the import rule that lets a checkpoint carry attnzoo's code
(docs/adding_an_attention.md, "The import rule"), no two modules importing each other, and every module importable
on its own. A wrong import fails here, at `pytest`, not at `save_pretrained`."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys

import pytest

import attnzoo
from attnzoo.modeling.attention import ATTENTION_REGISTRY
from attnzoo.registration import FAMILY_CONFIGS
from attnzoo.remote_code import _package_closure, _package_imports, flat_module_name, unguarded_imports

MODULES = sorted(info.name for info in pkgutil.walk_packages(attnzoo.__path__, "attnzoo."))


def module_source(name: str) -> str:
    return sys.modules[name].__loader__.get_source(name) if name in sys.modules else \
        __import__("importlib.util").util.find_spec(name).loader.get_source(name)


def imported_package_modules(name: str) -> set[str]:
    """The attnzoo modules `name` imports, at the top or inside functions (a name imported from a package counts
    as its module when it is one)."""
    found = set()
    for node in ast.walk(ast.parse(module_source(name))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("attnzoo."):
            found.add(node.module)
    return found & set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_every_module_follows_the_flattening_import_rule(name):
    """`from attnzoo.a.b import Name` only: the flat copy in a checkpoint has no packages (remote_code.py)."""
    _package_imports(module_source(name), name)


def test_the_code_every_attention_carries_imports_only_what_travels():
    """Each registered attention and every family's model classes, with all the attnzoo modules they pull in, import
    nothing but the standard library, torch and transformers (and attnzoo names, which the copy carries)."""
    roots = {cls.__module__ for cls in ATTENTION_REGISTRY.values()} | {cls.__module__ for cls in
                                                                       FAMILY_CONFIGS.values()}
    roots |= {f"attnzoo.modeling.modeling_{family}" for family in FAMILY_CONFIGS}
    flat_names = {}
    for module, source in _package_closure(sorted(roots)).items():
        flat = flat_module_name(module)
        assert flat_names.setdefault(flat, module) == module, f"{module} and {flat_names[flat]} flatten to {flat}.py"
        for node in unguarded_imports(ast.parse(source)):  # imports inside `try` are optional (Triton)
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for imported in names:
                root = imported.split(".")[0]
                assert root in ("__future__", "torch", "transformers", "attnzoo") or root in \
                    sys.stdlib_module_names, f"{module} (line {node.lineno}) imports {imported}, which a checkpoint " \
                                             "cannot carry"


def test_no_two_modules_import_each_other():
    graph = {name: imported_package_modules(name) for name in MODULES}
    circles = []
    for start in MODULES:  # each module's reach; a module that reaches itself is on a circle
        seen, frontier = set(), set(graph[start])
        while frontier:
            seen |= frontier
            frontier = {m for f in frontier for m in graph.get(f, ())} - seen
        if start in seen:
            circles.append(start)
    assert circles == [], f"modules on an import circle: {circles}"


def test_every_module_imports_on_its_own():
    """Each module in a process where no other attnzoo module was imported before it (a hidden dependence on import
    order, e.g. on a registration another module makes, fails here)."""
    script = f"""
import importlib, json, sys
failed = {{}}
for name in {json.dumps(MODULES)}:
    for loaded in [m for m in sys.modules if m == "attnzoo" or m.startswith("attnzoo.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as error:
        failed[name] = f"{{type(error).__name__}}: {{error}}"
print(json.dumps(failed))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}


def test_every_flag_is_spelt_with_underscores():
    """One command-line vocabulary: the canonical (first) spelling of every flag of the scripts, benchmarks and
    converters uses underscores; an older hyphenated spelling may follow it as an alias."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    hyphenated = []
    for path in sorted([*root.glob("scripts/*.py"), *root.glob("benchmarks/*.py"), *root.glob("attnzoo/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str) and \
                        first.value.startswith("--") and "-" in first.value[2:]:
                    hyphenated.append(f"{path.relative_to(root)}:{node.lineno} {first.value}")
    assert hyphenated == []


def test_every_scripts_main_reads_on_one_screen():
    """A script's `main` names the steps it runs (functions of their own); 50 lines at most."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    long_mains = {}
    for path in sorted(root.glob("scripts/*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name == "main" and node.end_lineno - node.lineno >= 50:
                long_mains[path.name] = node.end_lineno - node.lineno + 1
    assert long_mains == {}
