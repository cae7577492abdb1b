"""The custom code a checkpoint carries, so it loads with transformers alone (`trust_remote_code=True`).

`save_pretrained` writes beside the weights a flat copy of the modules the family's classes need (configuration,
backbone, attentions, caches, heads: torch and transformers are their only imports) plus two entry files,
`configuration_attnzoo.py` and `modeling_attnzoo.py`, and an `auto_map` in config.json naming the family's classes
in them. transformers then loads the checkpoint where attnzoo is not imported, or not installed at all:

    AutoModelForCausalLM.from_pretrained(path_or_hub_id, trust_remote_code=True)

The flat copy is made from the installed package's own source files: `from attnzoo.a.b import X` becomes
`from .a_b import X` (transformers follows relative imports when it copies remote code, and wants no sub-packages).
A model that was itself loaded as remote code re-saves the files it was loaded from.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

PACKAGE = "attnzoo"
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


def _flatten(source: str) -> str:
    return _PACKAGE_IMPORT.sub(lambda m: f"{m.group(1)}from .{flat_module_name(PACKAGE + m.group(2))} import", source)


def _entry(import_from: str, names: list[str], what: str) -> str:
    lines = "".join(f"from .{import_from} import {name}  # noqa: F401\n" for name in names)
    return f'"""{what} of this checkpoint (attnzoo; loaded by transformers with trust_remote_code=True)."""\n\n{lines}'


def _files_from_package(config_class: type, model_classes: list[type]) -> dict[str, str]:
    config_module, model_module = config_class.__module__, model_classes[0].__module__ if model_classes else None
    roots = [config_module] + ([model_module] if model_module else [])
    files = {}
    for module, source in _package_closure(roots).items():
        name = flat_module_name(module)
        if name in files:
            raise ValueError(f"two modules flatten to {name}.py; rename one of them.")
        files[name] = _flatten(source)
    files[CONFIG_ENTRY] = _entry(flat_module_name(config_module), [config_class.__name__], "The configuration")
    if model_classes:
        files[MODEL_ENTRY] = _entry(flat_module_name(model_module), [c.__name__ for c in model_classes],
                                    "The model classes")
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


def write_remote_code(folder: str | Path, config_class: type, model_classes: list[type] = ()) -> list[Path]:
    """Write the code files for `config_class` (and `model_classes`) into `folder`; returns their paths."""
    model_classes = list(model_classes)
    if config_class.__module__.split(".")[0] == PACKAGE:
        files = _files_from_package(config_class, model_classes)
    else:  # already a flat copy: the class was loaded as remote code
        anchor = model_classes[0] if model_classes else config_class
        entry = MODEL_ENTRY if model_classes else CONFIG_ENTRY
        files = _files_from_flat_copy(Path(sys.modules[anchor.__module__].__file__).with_name(f"{entry}.py"))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, source in sorted(files.items()):
        path = folder / f"{name}.py"
        path.write_text(source, encoding="utf-8")
        written.append(path)
    return written
