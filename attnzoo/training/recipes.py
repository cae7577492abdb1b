"""Recipes: one YAML file per experiment holds a script's arguments; the command line overrides any of them."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml


def parse_with_recipe(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse `argv`, taking defaults from the YAML file named by `--recipe` (keys are argument names)."""
    parser.add_argument("--recipe", type=Path, default=None, help="YAML file of argument values (CLI overrides it)")
    known, _ = parser.parse_known_args(argv)
    if known.recipe is not None:
        values = yaml.safe_load(known.recipe.read_text()) or {}
        valid = {action.dest for action in parser._actions}
        unknown = sorted(set(values) - valid)
        if unknown:
            raise ValueError(f"recipe {known.recipe} has unknown keys {unknown}; valid keys are script arguments: "
                             f"{sorted(valid - {'help', 'recipe'})}")
        parser.set_defaults(**values)
    return parser.parse_args(argv)


def parse_model_overrides(pairs: list[str] | None) -> dict:
    """`["hidden_size=128", "attn_layers=[local,lsh]"]` -> {"hidden_size": 128, "attn_layers": ["local", "lsh"]}."""
    overrides = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ValueError(f"model override {pair!r} must look like name=value, e.g. hidden_size=128")
        key, value = pair.split("=", 1)
        overrides[key.strip()] = yaml.safe_load(value)
    return overrides
