"""Markdown primitives every report section writes with: numbers, knob values, tables and verdict texts."""

from __future__ import annotations

import math

from harness.uncertainty import Estimate

NOISE = "not distinguishable from noise at this budget"
IDENTICAL = "identical runs (a zero-width interval: the same numbers on both sides)"


def fmt(value, digits: int = 3) -> str:
    """Plain numbers (counts, milliseconds) rounded to `digits`; blanks for missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value == "":
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def fmt_value(value) -> str:
    """A knob value as a reader writes it: 3, 0.154, 1e-04."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return str(int(number)) if number.is_integer() else f"{number:.3g}"


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(effect: Estimate, signed: bool = True) -> str:
    """The effect with its interval, and whether it is distinguishable from noise."""
    if math.isnan(effect.low):
        return f"{effect.text(signed)} (no interval)"
    if effect.identical:
        return f"{effect.text(signed)}: {IDENTICAL}"
    return effect.text(signed) + ("" if effect.excludes_zero else f": {NOISE}")


def plain_table(headers: list[str], rows: list[list]) -> str:
    """A table of cells already written as text, as they are."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])
