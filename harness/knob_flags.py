"""Command-line flags generated from the knob dataclasses: each flag's type, allowed values and help come
from its field, so a knob added to a dataclass is on the CLI without another line here.

Values are parsed after argparse, so a bad one fails with the usual `invalid knob NAME=VALUE: allowed ...`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

from algorithms import ALGORITHMS, SharedKnobs
from algorithms.knobs import knob_error
from harness.config import TrainConfig
from harness.data import DataConfig


@dataclass(frozen=True)
class KnobFlag:
    """One knob as a command-line flag."""

    section: str  # the RunConfig dict section: shared | knobs | train | data
    name: str
    flag: str
    kind: Any  # the field's resolved type
    help: str
    choices: tuple[str, ...] | None

    @property
    def dest(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def is_bool(self) -> bool:
        return self.kind is bool


def _section_flags(section: str, section_type: type) -> list[KnobFlag]:
    hints = typing.get_type_hints(section_type)
    return [
        KnobFlag(
            section,
            item.name,
            item.metadata.get("flag") or "--" + item.name.replace("_", "-"),
            hints[item.name],
            item.metadata.get("help", ""),
            item.metadata.get("choices"),
        )
        for item in dataclasses.fields(section_type)
    ]


def knob_flags() -> list[KnobFlag]:
    """Every knob of every section; algorithm knobs from all registered algorithms, once each."""
    algorithm_flags: dict[str, KnobFlag] = {}
    for entry in ALGORITHMS.values():
        for item in _section_flags("knobs", entry.knobs_class):
            algorithm_flags.setdefault(item.name, item)
    return [
        *_section_flags("shared", SharedKnobs),
        *algorithm_flags.values(),
        *_section_flags("train", TrainConfig),
        *_section_flags("data", DataConfig),
    ]


def _type_label(kind: Any) -> str:
    """The metavar --help shows: INT, FLOAT|none, INT,INT,...|none, NAME|JSON."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    optional = type(None) in typing.get_args(kind)
    base = args[0] if optional and len(args) == 1 else kind
    label = "INT,INT,..." if typing.get_origin(base) is list else getattr(base, "__name__", str(base)).upper()
    if isinstance(kind, types.UnionType) and not optional:
        label = "NAME|JSON"
    return f"{label}|none" if optional else label


def add_knob_flags(parser: argparse.ArgumentParser) -> None:
    groups = {
        "shared": parser.add_argument_group("shared knobs (pin them identically to compare algorithms)"),
        "knobs": parser.add_argument_group(
            "algorithm knobs (conv: {}; selector: {})".format(
                ", ".join(a.name for a in ALGORITHMS.values() if a.has_conv),
                ", ".join(a.name for a in ALGORITHMS.values() if a.has_selector),
            )
        ),
        "train": parser.add_argument_group("training knobs"),
        "data": parser.add_argument_group("data knobs"),
    }
    for item in knob_flags():
        group = groups[item.section]
        if item.is_bool:
            group.add_argument(
                item.flag, dest=item.dest, action=argparse.BooleanOptionalAction, default=None, help=item.help
            )
            continue
        allowed = f" (one of {', '.join(item.choices)})" if item.choices else ""
        metavar = "{" + ",".join(item.choices) + "}" if item.choices else _type_label(item.kind)
        group.add_argument(item.flag, dest=item.dest, default=None, metavar=metavar, help=item.help + allowed)


def parse_value(item: KnobFlag, text: str) -> Any:
    """The typed value of one flag; a bad one raises `invalid knob NAME=VALUE: allowed ...`."""
    kind, args = item.kind, typing.get_args(item.kind)
    if type(None) in args:
        if text.strip().lower() in ("none", "null"):
            return None
        kind = next(a for a in args if a is not type(None))
    if item.choices and text not in item.choices:
        raise knob_error(item.name, text, f"one of {list(item.choices)}")
    if typing.get_origin(kind) is list:
        parts = text.replace(",", " ").split()
        if not parts or not all(part.lstrip("-").isdigit() for part in parts):
            raise knob_error(item.name, text, "a comma-separated list of integers, or none")
        return [int(part) for part in parts]
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise knob_error(item.name, text, "an integer") from None
    if kind is float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise knob_error(item.name, text, "a finite number")
        return value
    return text


def flag_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """{section: {knob: value}} for the flags given on the command line."""
    overrides: dict[str, dict[str, Any]] = {"shared": {}, "knobs": {}, "train": {}, "data": {}}
    for item in knob_flags():
        value = getattr(args, item.dest, None)
        if value is not None:
            overrides[item.section][item.name] = value if item.is_bool else parse_value(item, value)
    return overrides
