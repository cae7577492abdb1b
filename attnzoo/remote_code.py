"""The custom code a checkpoint carries, so it loads with transformers alone (`trust_remote_code=True`).

`save_pretrained` writes beside the weights a flat copy of the modules the family's classes need (configuration,
backbone, attentions, caches, heads: torch and transformers are their only imports) plus two entry files,
`configuration_attnzoo.py` and `modeling_attnzoo.py`, and an `auto_map` in config.json naming the family's classes
in them. transformers then loads the checkpoint where attnzoo is not imported, or not installed at all:

    AutoModelForCausalLM.from_pretrained(path_or_hub_id, trust_remote_code=True)

The flat copy is made from the installed package's own source files: `from attnzoo.a.b import X` becomes
`from .a_b import X` (transformers follows relative imports when it copies remote code, and wants no sub-packages).
A model that was itself loaded as remote code re-saves the files it was loaded from.

The rule that makes flattening possible, for attnzoo's modules and for an attention module of the user's: import
attnzoo names as `from attnzoo.a.b import Name` (never `import attnzoo...` or a module object), and import nothing
else but the standard library, torch and transformers (what a checkpoint's code can rely on where it is loaded).
The attention modules a model's layers use travel with it, also when they are defined outside attnzoo
(`attention_modules`): the entry file imports them, which registers their names before the model is built.
docs/adding_an_attention.md walks through it.

Where attnzoo is imported, transformers builds a checkpoint from attnzoo's installed classes and never runs its code,
even with `trust_remote_code=True` (a registered local class wins). A user's attention that the checkpoint carries
is then found by `load_carried_attention` when the installed registry lacks its kind: with `trust_remote_code=True`
the checkpoint's copy of the module runs against the installed attnzoo (registering the kind); without it, the
error names the module to import.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import types
from pathlib import Path

from attnzoo.transformers_compat import trust_remote_code_given

PACKAGE = "attnzoo"
#: what a checkpoint's code may import besides the standard library (and attnzoo names, which it carries)
ALLOWED_IMPORT_ROOTS = ("__future__", "torch", "transformers", PACKAGE)
CONFIG_ENTRY = "configuration_attnzoo"
MODEL_ENTRY = "modeling_attnzoo"
#: head suffix -> the Auto class that loads it (the keys of `auto_map`)
AUTO_CLASS_BY_HEAD = {
    "Model": "AutoModel",
    "ForCausalLM": "AutoModelForCausalLM",
    "ForMaskedLM": "AutoModelForMaskedLM",
    "ForSequenceClassification": "AutoModelForSequenceClassification",
    "ForImageClassification": "AutoModelForImageClassification",
    "ForConditionalGeneration": "AutoModelForSeq2SeqLM",
}
_PACKAGE_IMPORT = re.compile(rf"^(\s*)from {PACKAGE}((?:\.\w+)+) import", flags=re.MULTILINE)
_RELATIVE_IMPORT = re.compile(r"^\s*from \.(\w+) import", flags=re.MULTILINE)
_FLAT_IMPORT = re.compile(r"^(\s*)from \.(\w+) import", flags=re.MULTILINE)
#: the entry file's line that imports a user's attention module it carries (the original module name: newer saves)
_USER_REGISTRATION = re.compile(r"^from \.(user_\w+) import \w+  # noqa: F401  \(registers its attention"
                                r"(?:; a copy of module ([\w.]+))?\)", flags=re.MULTILINE)
#: set on a module run from a checkpoint's copy of a user's attention module (`load_carried_attention`): (its file
#: stem in the checkpoint, the module it was saved from, its source with attnzoo imports), what a new save carries
CARRIED = "__attnzoo_carried__"


def flat_module_name(module: str) -> str:
    """`attnzoo.modeling.attention.lsh` -> `modeling_attention_lsh`; a part that already starts with its parent's
    name replaces it (`attnzoo.modeling.modeling_ra` -> `modeling_ra`)."""
    kept = []
    for part in module.split(".")[1:]:
        if kept and part.startswith(kept[-1] + "_"):
            kept[-1] = part
        else:
            kept.append(part)
    return "_".join(kept)


def _module_file(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"cannot find the source of {module}, which the checkpoint's code needs.")
    return Path(spec.origin)


def _package_imports(source: str, module: str) -> list[str]:
    """The attnzoo modules `source` imports from (top level or inside functions). Only `from attnzoo.x import Name`
    is allowed: the flat copy has no packages, so importing a module object or `import attnzoo...` cannot work."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == PACKAGE for a in node.names):
            raise ValueError(f"{module}: `import {PACKAGE}...` cannot be flattened; import names with "
                             f"`from {PACKAGE}.x import Name`.")
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == PACKAGE:
            if node.module == PACKAGE:
                raise ValueError(f"{module}: import from {PACKAGE}'s submodules, not from the package itself.")
            is_package = importlib.util.find_spec(node.module).submodule_search_locations is not None
            for alias in node.names:
                if is_package and importlib.util.find_spec(f"{node.module}.{alias.name}") is not None:
                    raise ValueError(f"{module} imports the module {node.module}.{alias.name}; import the names it "
                                     "defines instead, so the code can be flattened.")
            found.append(node.module)
    return found


def _package_closure(roots: list[str]) -> dict[str, str]:
    """module name -> source, for `roots` and every attnzoo module they import, recursively."""
    sources, pending = {}, list(roots)
    while pending:
        module = pending.pop()
        if module in sources:
            continue
        sources[module] = _module_file(module).read_text(encoding="utf-8")
        pending.extend(_package_imports(sources[module], module))
    return sources


def unguarded_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of `tree` outside `try` blocks (those inside are optional where the code is loaded)."""
    guarded = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.Try)
               for statement in node.body for inner in ast.walk(statement)}
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in guarded]


def _check_user_imports(source: str, module: str) -> None:
    """An attention module from outside attnzoo travels only if its imports will resolve where the checkpoint is
    loaded: the standard library, torch, transformers and attnzoo names (which the flat copy provides). An import
    inside a `try` block is optional (transformers' check of remote code skips it too)."""
    for node in unguarded_imports(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            raise ValueError(f"the attention module {module} uses a relative import (line {node.lineno}); a "
                             "checkpoint carries that one file only: import from the standard library, torch, "
                             "transformers or attnzoo, and save again.")
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        for name in names:
            root = name.split(".")[0]
            if root not in ALLOWED_IMPORT_ROOTS and root not in sys.stdlib_module_names:
                raise ValueError(f"the attention module {module} imports {name} (line {node.lineno}), which a "
                                 "checkpoint's code cannot carry: use only the standard library, torch, transformers "
                                 "and attnzoo in that file (see docs/adding_an_attention.md), and save again.")


def user_module_source(module: str) -> str:
    """The source of an attention module defined outside attnzoo, checked to travel with a checkpoint."""
    carried = getattr(sys.modules.get(module), CARRIED, None)
    if carried is not None:  # run from a checkpoint's copy: that copy travels again
        return carried[2]
    if module == "__main__":
        raise ValueError("the model uses an attention defined in __main__ (a script or a notebook), whose code a "
                         "checkpoint cannot carry: move the class into a module file (e.g. my_attention.py next to "
                         "your script), import it from there, and save again.")
    source_file = getattr(sys.modules.get(module), "__file__", None)
    if not source_file or not source_file.endswith(".py"):
        raise ValueError(f"the attention module {module} has no Python source file to copy into the checkpoint; "
                         "define the attention in a .py module, import it from there, and save again.")
    source = Path(source_file).read_text(encoding="utf-8")
    _package_imports(source, module)  # the attnzoo import rule
    _check_user_imports(source, module)
    return source


def _flatten(source: str) -> str:
    return _PACKAGE_IMPORT.sub(lambda m: f"{m.group(1)}from .{flat_module_name(PACKAGE + m.group(2))} import", source)


def _entry(import_from: str, names: list[str], what: str) -> str:
    lines = "".join(f"from .{import_from} import {name}  # noqa: F401\n" for name in names)
    return f'"""{what} of this checkpoint (attnzoo; loaded by transformers with trust_remote_code=True)."""\n\n{lines}'


def _files_from_package(config_class: type, model_classes: list[type], attention_classes: list[type]) -> dict:
    config_module, model_module = config_class.__module__, model_classes[0].__module__ if model_classes else None
    roots = [config_module] + ([model_module] if model_module else [])
    user_sources = {}  # flat name -> source, for attention modules defined outside attnzoo
    registering = []  # (flat module, class name, user module or None): entry-file imports that register the kinds
    for cls in attention_classes:
        module = cls.__module__
        if module.split(".")[0] == PACKAGE:
            roots.append(module)
            registering.append((flat_module_name(module), cls.__name__, None))
        else:
            source = user_module_source(module)
            carried = getattr(sys.modules.get(module), CARRIED, None)
            name, origin = carried[:2] if carried is not None else ("user_" + module.replace(".", "_"), module)
            user_sources[name] = source
            roots.extend(_package_imports(source, module))
            registering.append((name, cls.__name__, origin))
    files = {}
    for module, source in _package_closure(roots).items():
        name = flat_module_name(module)
        if name in files:
            raise ValueError(f"two modules flatten to {name}.py; rename one of them.")
        files[name] = _flatten(source)
    files.update({name: _flatten(source) for name, source in user_sources.items()})
    files[CONFIG_ENTRY] = _entry(flat_module_name(config_module), [config_class.__name__], "The configuration")
    if model_classes:
        registration = "".join(f"from .{module} import {name}  # noqa: F401  (registers its attention"
                               + (f"; a copy of module {origin})" if origin else ")") + "\n"
                               for module, name, origin in dict.fromkeys(registering))
        files[MODEL_ENTRY] = registration + _entry(flat_module_name(model_module),
                                                   [c.__name__ for c in model_classes], "The model classes")
    return files


def _files_from_flat_copy(entry_file: Path) -> dict[str, str]:
    """The entry file and every file it imports relatively, as they are (a model loaded as remote code)."""
    folder, files, pending = entry_file.parent, {}, [entry_file.stem]
    while pending:
        name = pending.pop()
        if name in files:
            continue
        files[name] = (folder / f"{name}.py").read_text(encoding="utf-8")
        pending.extend(_RELATIVE_IMPORT.findall(files[name]))
    return files


def family_model_classes(model_class: type) -> list[type]:
    """The classes of `model_class`'s family, one per head (those its module defines), in `AUTO_CLASS_BY_HEAD`
    order. A family's classes are named `{prefix}{head}` with the config class `{prefix}Config`."""
    prefix = model_class.config_class.__name__.removesuffix("Config")
    module = sys.modules[model_class.__module__]
    return [getattr(module, prefix + head) for head in AUTO_CLASS_BY_HEAD if hasattr(module, prefix + head)]


def auto_map(config_class: type, model_classes: list[type]) -> dict[str, str]:
    entries = {"AutoConfig": f"{CONFIG_ENTRY}.{config_class.__name__}"}
    prefix = config_class.__name__.removesuffix("Config")
    for cls in model_classes:
        entries[AUTO_CLASS_BY_HEAD[cls.__name__.removeprefix(prefix)]] = f"{MODEL_ENTRY}.{cls.__name__}"
    return entries


def remote_code_files(config_class: type, model_classes: list[type] = (), attention_classes: list[type] = ()
                      ) -> dict[str, str]:
    """file stem -> source of the code a checkpoint of `config_class` (and `model_classes`, whose layers use
    `attention_classes`) carries. Raises ValueError, before anything is written, when some of it cannot travel."""
    model_classes = list(model_classes)
    if config_class.__module__.split(".")[0] == PACKAGE:
        return _files_from_package(config_class, model_classes, list(attention_classes))
    # already a flat copy: the class was loaded as remote code
    anchor = model_classes[0] if model_classes else config_class
    entry = MODEL_ENTRY if model_classes else CONFIG_ENTRY
    return _files_from_flat_copy(Path(sys.modules[anchor.__module__].__file__).with_name(f"{entry}.py"))


def write_remote_code(folder: str | Path, config_class: type, model_classes: list[type] = (),
                      attention_classes: list[type] = ()) -> list[Path]:
    """Write the code files for `config_class` (and `model_classes`) into `folder`; returns their paths."""
    files = remote_code_files(config_class, model_classes, attention_classes)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, source in sorted(files.items()):
        path = folder / f"{name}.py"
        path.write_text(source, encoding="utf-8")
        written.append(path)
    return written


# -- a user's attention that a checkpoint carries, where attnzoo is imported -------------------------------------------
def load_carried_attention(kind: str, config) -> str:
    """For an attention kind the installed registry lacks, in a model built from a checkpoint folder
    (`config.name_or_path`) whose code carries the user's module that defines it: when the loading call passed
    `trust_remote_code=True`, run that copy against the installed attnzoo, which registers the kind, and return "";
    otherwise return a sentence for the error that names the module to import and the flag. "" also when the
    checkpoint carries no such module."""
    if __name__.split(".")[0] != PACKAGE:  # a checkpoint's flat copy: its entry file imported every module it carries
        return ""
    where = str(getattr(config, "name_or_path", "") or "")
    folder = Path(where) if where else None
    if folder is None or not folder.is_dir():
        if not where or not getattr(config, "auto_map", None):
            return ""
        return (f" If the code of {where} defines it, import the module it was saved from before loading: with "
                "attnzoo imported, transformers builds the model from attnzoo's installed classes, not the "
                "checkpoint's code.")
    found = _carried_module(folder, kind)
    if found is None:
        return ""
    stem, module = found
    if trust_remote_code_given():
        _run_carried(folder / f"{stem}.py", stem, module)
        return ""
    return (f" The checkpoint {where} carries it in {stem}.py, its copy of the module {module}; with attnzoo "
            "imported, transformers builds the model from attnzoo's installed classes, not the checkpoint's code. "
            f"Import {module} before loading, or pass trust_remote_code=True to run the checkpoint's copy.")


def _carried_module(folder: Path, kind: str) -> tuple[str, str] | None:
    """(file stem, the module it was saved from) of the user's attention module in the checkpoint `folder` whose
    source names `kind` (`@register_attention(kind)`, or `@register_far_part(name)` for kind `name_window`)."""
    entry = folder / f"{MODEL_ENTRY}.py"
    if not entry.is_file():
        return None
    names = {kind, kind.removesuffix("_window")}
    for match in _USER_REGISTRATION.finditer(entry.read_text(encoding="utf-8")):
        path = folder / f"{match.group(1)}.py"
        if path.is_file() and any(isinstance(node, ast.Constant) and node.value in names
                                  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))):
            return match.group(1), match.group(2) or match.group(1).removeprefix("user_")
    return None


def _package_modules_by_flat_name() -> dict[str, str]:
    """flat file stem -> module name, for every module of the installed package (read from its files: importing
    them all would import what the checkpoint does not need)."""
    root = Path(importlib.util.find_spec(PACKAGE).origin).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name != PACKAGE:
            found.setdefault(flat_module_name(name), name)
    return found


def _run_carried(path: Path, stem: str, module: str) -> None:
    """Run a checkpoint's copy of a user's attention module, its flat imports (`from .a_b import X`) pointed back
    at the installed attnzoo (`from attnzoo.a.b import X`), as the module `stem` (which registers its kinds)."""
    source, modules = path.read_text(encoding="utf-8"), _package_modules_by_flat_name()

    def package_import(match: re.Match) -> str:
        if match.group(2) not in modules:
            raise ValueError(f"{path} imports .{match.group(2)}, which the installed attnzoo does not have (the "
                             "checkpoint was saved with another version): import the module it was saved from, "
                             f"{module}, before loading, or load it where attnzoo is not imported.")
        return f"{match.group(1)}from {modules[match.group(2)]} import"

    rebased = _FLAT_IMPORT.sub(package_import, source)
    copy = types.ModuleType(stem, f"The checkpoint's copy of {module} ({path}), run against the installed attnzoo.")
    copy.__file__ = str(path)
    setattr(copy, CARRIED, (stem, module, rebased))
    sys.modules[stem] = copy  # register_far_part puts the layer class in the module: it must be importable by name
    try:
        exec(compile(rebased, str(path), "exec", dont_inherit=True), vars(copy))
    except BaseException:
        sys.modules.pop(stem, None)
        raise
