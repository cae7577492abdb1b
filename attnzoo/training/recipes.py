"""Recipes: one YAML file per experiment holds a script's arguments; the command line overrides any of them."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml


def parse_with_recipe(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse `argv`, taking defaults from the YAML file named by `--recipe` (keys are argument names). A recipe's
    values get the checks the command line gets (types, choices, flags), with errors naming the file and key."""
    parser.add_argument("--recipe", type=Path, default=None, help="YAML file of argument values (CLI overrides it)")
    known, _ = parser.parse_known_args(argv)
    if known.recipe is not None:
        values = read_recipe(known.recipe)
        actions = {action.dest: action for action in parser._actions}
        unknown = sorted(set(values) - set(actions))
        if unknown:
            raise ValueError(f"recipe {known.recipe} has unknown keys {unknown}; valid keys are script arguments: "
                             f"{sorted(set(actions) - {'help', 'recipe'})}")
        parser.set_defaults(**{key: _checked(actions[key], value, key, known.recipe) for key, value in values.items()})
    return parser.parse_args(argv)


def read_recipe(path: Path) -> dict:
    """The mapping a recipe file holds, or a ValueError naming the file and what is wrong with it."""
    if not path.is_file():
        raise ValueError(f"--recipe {path}: {'is a folder' if path.is_dir() else 'does not exist'}; name a YAML file "
                         "(the recipes/ folder holds one per experiment).")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ValueError(f"recipe {path} is not valid YAML: {error}") from error
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"recipe {path} holds a {type(values).__name__}; a recipe is a mapping of argument names to "
                         "values (name: value, one per line).")
    return values


def _checked(action: argparse.Action, value, key: str, path: Path):
    """A recipe value as the command line would have parsed it, or a ValueError naming the key."""
    def refuse(reason: str):
        raise ValueError(f"recipe {path}: {key}: {value!r} is invalid: {reason}.")

    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            refuse("use true or false")
        return value
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        if not isinstance(value, list):
            refuse("give a list")
        return [_scalar(action, item, refuse) for item in value]
    return _scalar(action, value, refuse)


def _scalar(action: argparse.Action, value, refuse):
    if value is None:
        return value
    if action.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            refuse("use a whole number")
    elif action.type is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            refuse("use a number")
        value = float(value)
    elif action.type is not None and isinstance(value, str | int | float) and not isinstance(value, bool):
        try:
            value = action.type(str(value)) if action.type is not str else str(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as error:
            refuse(str(error))
    if action.choices is not None and value not in action.choices:
        refuse(f"use one of {list(action.choices)}")
    return value


def parse_model_overrides(pairs: list[str] | None) -> dict:
    """`["hidden_size=128", "attn_layers=[local,lsh]"]` -> {"hidden_size": 128, "attn_layers": ["local", "lsh"]}."""
    overrides = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ValueError(f"model override {pair!r} must look like name=value, e.g. hidden_size=128")
        key, value = pair.split("=", 1)
        overrides[key.strip()] = yaml.safe_load(value)
    return overrides
