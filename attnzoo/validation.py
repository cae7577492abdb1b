"""Validators for configuration values: each raises `ValueError` naming the field, its value and what to change.
Configurations call them on their own fields; nothing here imports the rest of attnzoo."""

from __future__ import annotations

import math
from collections.abc import Iterable


def fail(field: str, value, fix: str):
    raise ValueError(f"{field}={value!r} is invalid: {fix}")


def check_int(config, field: str, minimum: int, fix: str, optional: bool = False) -> None:
    """Fail with `fix` unless `config.<field>` is an integer (a bool is not) >= `minimum`, or None if `optional`."""
    value = getattr(config, field)
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        fail(field, value, fix)


def check_positive_ints(config, fields: Iterable[str]) -> None:
    for field in fields:
        check_int(config, field, 1, "set a positive integer.")


def check_probability(config, field: str, optional: bool = False) -> None:
    """Fail unless `config.<field>` is a probability in [0, 1) (a dropout rate), or None if `optional`."""
    value = getattr(config, field)
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
        fail(field, value, "set a probability in [0, 1) or None." if optional else "set a probability in [0, 1).")


def check_choice(config, field: str, choices: Iterable) -> None:
    """Fail unless `config.<field>` is one of `choices`."""
    choices = tuple(choices)
    if getattr(config, field) not in choices:
        fail(field, getattr(config, field), f"use one of {choices}.")


def check_perfect_square(config, field: str, why: str) -> None:
    value = getattr(config, field)
    if math.isqrt(value) ** 2 != value:
        fail(field, value, f"it must be a perfect square {why}.")


def check_noise_std(config, field: str = "sample_noise_std") -> None:
    """The σ setting of RA's and LARA's sampling noise: "paper", "official" or a non-negative number."""
    value = getattr(config, field)
    if value in ("paper", "official"):
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        fail(field, value, "use 'paper' (1.0), 'official' (d**-0.25) or a non-negative number.")
