"""The package's shape, checked by reading its modules: the import rule that lets a checkpoint carry attnzoo's code
(docs/adding_an_attention.md, "The import rule"), no two modules importing each other, and every module importable
on its own. A wrong import fails here, at `pytest`, not at `save_pretrained`."""

from __future__ import annotations

import ast
import inspect
import json
import pkgutil
import subprocess
import sys
import textwrap

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
    order, e.g. on a registration another module makes, fails here). The modules are shared between two processes
    that run at once (each imports them one after the other, every attnzoo module forgotten before the next)."""
    def script(names: list[str]) -> str:
        return f"""
import importlib, json, sys
failed = {{}}
for name in {json.dumps(names)}:
    for loaded in [m for m in sys.modules if m == "attnzoo" or m.startswith("attnzoo.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as error:
        failed[name] = f"{{type(error).__name__}}: {{error}}"
print(json.dumps(failed))
"""
    shares = [MODULES[i::2] for i in range(2)]
    assert sorted(name for share in shares for name in share) == MODULES
    processes = [subprocess.Popen([sys.executable, "-c", script(share)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for share in shares]
    failed = {}
    for process in processes:
        stdout, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
        failed.update(json.loads(stdout.strip().splitlines()[-1]))
    assert failed == {}


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


def definitions(cls: type, name: str) -> dict[type, str]:
    """{the class whose definition of `name` a direct base of `cls` resolves to: that base's name}."""
    found = {}
    for base in cls.__bases__:
        owner = next((ancestor for ancestor in base.__mro__ if name in vars(ancestor)), None)
        if owner is not None:
            found.setdefault(owner, base.__name__)
    return found


def test_cooperative_methods_call_super_first():
    for cls in classes_with_several_bases():
        for ancestor in (c for c in cls.__mro__ if c.__module__.startswith("attnzoo")):
            for name in COOPERATIVE & set(vars(ancestor)):
                body = ast.parse(textwrap.dedent(inspect.getsource(vars(ancestor)[name]))).body[0].body
                first = body[1] if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else \
                    body[0]
                assert "super()." + name in ast.unparse(first), f"{ancestor.__qualname__}.{name} does not call super"


def classes_with_several_bases() -> list[type]:
    from attnzoo.configuration.base import ZooConfig
    from attnzoo.modeling.attention import FAR_PART_REGISTRY

    found, todo = set(), [*ATTENTION_REGISTRY.values(), *FAR_PART_REGISTRY.values(), ZooConfig]
    while todo:  # the registered classes, every config class, and their bases
        cls = todo.pop()
        if cls in found or not cls.__module__.startswith("attnzoo"):
            continue
        found.add(cls)
        todo.extend(cls.__bases__)
        if issubclass(cls, ZooConfig):
            todo.extend(cls.__subclasses__())
    return sorted((cls for cls in found if len(cls.__bases__) > 1), key=lambda cls: cls.__qualname__)


#: methods every definition of which calls super() first, so that all of them run whatever the order of the bases
COOPERATIVE = {"validate_architecture"}


@pytest.mark.parametrize("cls", classes_with_several_bases(), ids=lambda cls: cls.__qualname__)
def test_no_behaviour_depends_on_the_order_of_a_classs_bases(cls):
    """A name that two bases of a class resolve to different definitions must be defined by the class itself:
    otherwise which one wins depends on the order of the bases. Cooperative methods are the exception."""
    names = {name for base in cls.__bases__ for ancestor in base.__mro__ for name in vars(ancestor)}
    clashes = {name: sorted(definitions(cls, name).values()) for name in sorted(names)
               if not name.startswith("__") and name not in set(vars(cls)) | COOPERATIVE
               and len(definitions(cls, name)) > 1}
    assert not clashes, f"{cls.__qualname__}: {clashes}"
