"""Command-line flags for a frozen dataclass of limits (per-request limits, stored responses' bounds): one flag a
field, a positive integer defaulting to the field's default, and the dataclass read back from the parsed flags."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import fields
from typing import TypeVar

from shared.command_line import positive_int

Limits = TypeVar("Limits")


def add_limit_flags(
    parser: argparse.ArgumentParser,
    title: str,
    defaults: object,
    flags: Mapping[str, tuple[str, str]],
    dest_prefix: str = "",
) -> None:
    """A group of flags under title, one for each field of defaults' dataclass: flags maps a field's name to (its
    flag, what it bounds)."""
    group = parser.add_argument_group(title)
    for field in fields(defaults):
        flag, what = flags[field.name]
        default = getattr(defaults, field.name)
        group.add_argument(
            flag,
            dest=dest_prefix + field.name,
            type=positive_int,
            default=default,
            metavar="N",
            help=f"{what} (default: {default})",
        )


def read_limit_flags(limits: type[Limits], args: argparse.Namespace, dest_prefix: str = "") -> Limits:
    return limits(**{field.name: getattr(args, dest_prefix + field.name) for field in fields(limits)})
