"""Designed experiments: two-level (fractional) factorials and one-at-a-time designs over knobs.

A design is a list of points (knob -> level) and the terms of the linear model its runs estimate. Both
studies (which enqueue the points as Optuna trials) and reports (which fit the terms on the recorded runs)
read it from here.

A factorial codes each factor -1 (its first level) and +1 (its second). A 2^(k-p) fraction runs the full
factorial of its first k-p factors and sets each of the last p to the product of a word of them (its
generator). The generators span the defining relation; an effect is aliased with its product by every word
of it. Resolution IV or higher (every word at least four letters long) keeps main effects clear of other
main effects and of two-factor interactions, which is what a design here must guarantee.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

FACTORIAL, ONE_AT_A_TIME = "factorial", "one_at_a_time"
DESIGN_TYPES = (FACTORIAL, ONE_AT_A_TIME)
MIN_RESOLUTION = 4
# Minimum-aberration generators (Box, Hunter & Hunter, table 6.22) by (factors, fraction p): each generated
# factor, counted from the end, as the base-factor positions whose product sets it.
STANDARD_GENERATORS: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {
    (3, 1): ((0, 1),),
    (4, 1): ((0, 1, 2),),
    (5, 1): ((0, 1, 2, 3),),
    (5, 2): ((0, 1), (0, 2)),
    (6, 1): ((0, 1, 2, 3, 4),),
    (6, 2): ((0, 1, 2), (1, 2, 3)),
    (6, 3): ((0, 1), (0, 2), (1, 2)),
    (7, 2): ((0, 1, 2, 3), (0, 1, 3, 4)),
    (7, 3): ((0, 1, 2), (1, 2, 3), (0, 2, 3)),
    (8, 3): ((0, 1, 2), (0, 1, 3), (1, 2, 3, 4)),
    (8, 4): ((1, 2, 3), (0, 2, 3), (0, 1, 2), (0, 1, 3)),
}

Word = frozenset[str]  # a product of factors; the empty word is the identity I

HELD, REVERSED, GREW, SHRANK, APPEARED, INCONCLUSIVE = "held", "reversed", "grew", "shrank", "appeared", "inconclusive"
# How a design's verdict carried from a short step budget to a longer one (reports.effects.transfer_label),
# and what each label says; study files cite them for a transfer measured elsewhere.
TRANSFER_MEANINGS = {
    HELD: "the same verdict at both budgets: resolved with the same sign and no resolved change in size, or "
    "bounded at both",
    REVERSED: "resolved at both budgets with opposite signs",
    GREW: "resolved at both with the same sign, and larger at the longer budget by a resolved amount",
    SHRANK: "resolved at the short budget, and at the longer one smaller by a resolved amount or bounded",
    APPEARED: "not resolved at the short budget, resolved at the longer one",
    INCONCLUSIVE: "neither of the above can be told apart from noise at these run counts",
}


class DesignError(ValueError):
    """A design that cannot be built or that aliases what it must keep apart."""


def word_name(word: Word) -> str:
    return "I" if not word else "×".join(sorted(word))


@dataclass(frozen=True)
class Term:
    """One model term: a main effect (one factor) or a two-factor interaction, or a one-at-a-time move."""

    name: str
    factors: tuple[str, ...]
    level: Any = None  # one-at-a-time: the level the factor moves to from the centre


@dataclass
class FactorialDesign:
    """Two levels per factor; `generators` maps each generated factor to the base factors it multiplies."""

    levels: dict[str, tuple[Any, Any]]
    generators: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # 3 only for a longer budget's subset, whose main effects may alias two-factor interactions (it says so)
    min_resolution: int = MIN_RESOLUTION

    kind = FACTORIAL

    def __post_init__(self) -> None:
        for name, word in self.generators.items():
            if name not in self.levels or any(f not in self.base for f in word) or len(word) < 2:
                raise DesignError(
                    f"invalid generator {name}={'×'.join(word)}: allowed a generated factor set to the product "
                    f"of two or more base factors from {self.base}"
                )
        if self.words and self.resolution < self.min_resolution:
            short = min(self.words, key=len)
            raise DesignError(
                f"resolution {self.resolution} fraction (defining word I={word_name(short)}) aliases a main effect "
                f"with another main effect{' or a two-factor interaction' * (self.min_resolution > 3)}: allowed "
                f"resolution >= {self.min_resolution}; use a smaller fraction or more runs"
            )

    @classmethod
    def standard(
        cls, levels: dict[str, tuple[Any, Any]], fraction: int, min_resolution: int = MIN_RESOLUTION
    ) -> FactorialDesign:
        """The minimum-aberration 2^(k-p) fraction with the last `fraction` factors generated."""
        names, k = list(levels), len(levels)
        if fraction == 0:
            return cls(levels, min_resolution=min_resolution)
        if (k, fraction) not in STANDARD_GENERATORS:
            known = sorted(p for (factors, p) in STANDARD_GENERATORS if factors == k)
            raise DesignError(
                f"invalid fraction={fraction} for {k} factors: allowed 0 or one of {known}, or explicit generators"
            )
        base = names[: k - fraction]
        generated = names[k - fraction :]
        words = STANDARD_GENERATORS[(k, fraction)]
        generators = {g: tuple(base[i] for i in w) for g, w in zip(generated, words, strict=True)}
        return cls(levels, generators, min_resolution)

    @property
    def factors(self) -> list[str]:
        return list(self.levels)

    @property
    def base(self) -> list[str]:
        return [f for f in self.levels if f not in self.generators]

    @property
    def words(self) -> list[Word]:
        """The defining relation without I: every product of generator words."""
        generator_words = [frozenset(word) ^ {name} for name, word in self.generators.items()]
        found: set[Word] = set()
        for count in range(1, len(generator_words) + 1):
            for combination in itertools.combinations(generator_words, count):
                product: Word = frozenset()
                for word in combination:
                    product ^= word
                found.add(product)
        return sorted(found, key=lambda w: (len(w), sorted(w)))

    @property
    def resolution(self) -> int | None:
        """The length of the shortest defining word; None for a full factorial."""
        return min((len(w) for w in self.words), default=None)

    def aliases(self, effect: Word) -> list[Word]:
        """The effects confounded with `effect` in this fraction."""
        return sorted((effect ^ w for w in self.words), key=lambda w: (len(w), sorted(w)))

    def coded_points(self) -> list[dict[str, int]]:
        """Every run's coded levels (-1/+1), in standard order."""
        points = []
        for signs in itertools.product((-1, 1), repeat=len(self.base)):
            point = dict(zip(reversed(self.base), signs, strict=True))
            for name, word in self.generators.items():
                value = 1
                for factor in word:
                    value *= point[factor]
                point[name] = value
            points.append({f: point[f] for f in self.levels})
        return points

    def points(self) -> list[dict[str, Any]]:
        return [{f: self.levels[f][(c + 1) // 2] for f, c in coded.items()} for coded in self.coded_points()]

    def interactions(self) -> list[Term]:
        """Two-factor interactions this design resolves: aliased with no main effect and no other 2FI."""
        clear = []
        for pair in itertools.combinations(self.levels, 2):
            if all(len(alias) > 2 for alias in self.aliases(frozenset(pair))):
                clear.append(Term(word_name(frozenset(pair)), pair))
        return clear

    def terms(self, interactions: bool) -> list[Term]:
        mains = [Term(f, (f,)) for f in self.levels]
        return mains + (self.interactions() if interactions else [])

    def code(self, point: dict[str, Any], term: Term) -> float:
        """The term's column in the model for a run at `point` (a main effect: -1/+1; an interaction: the
        product)."""
        value = 1
        for factor in term.factors:
            value *= self.coded_level(factor, point[factor])
        return float(value)

    def coded_level(self, factor: str, level: Any) -> int:
        low, high = self.levels[factor]
        if same_level(level, high):
            return 1
        if same_level(level, low):
            return -1
        raise DesignError(f"level {level!r} of {factor} is not one of the design's {[low, high]}")

    def alias_lines(self) -> list[str]:
        """The alias structure as a reader checks it: the defining relation and each main effect's and
        resolved interaction's aliases up to three factors."""
        if not self.words:
            return [f"full 2^{len(self.levels)} factorial: no effect is aliased"]
        lines = [f"defining relation: I = {' = '.join(word_name(w) for w in self.words)}"]
        seen: set[Word] = set()
        effects = [frozenset([f]) for f in self.levels] + [frozenset(p) for p in itertools.combinations(self.levels, 2)]
        for effect in effects:
            if effect in seen:
                continue
            aliases = self.aliases(effect)
            seen.update(aliases)
            shown = " = ".join(word_name(a) for a in aliases if len(a) <= 3)
            lines.append(f"{word_name(effect)} = {shown or '(aliased only with interactions of four or more factors)'}")
        return lines

    def describe(self) -> str:
        k, p = len(self.levels), len(self.generators)
        fraction = f"2^({k}-{p}) fraction, resolution {self.resolution}" if p else f"full 2^{k} factorial"
        return f"{fraction}: {len(self.coded_points())} points"


@dataclass
class OneAtATimeDesign:
    """A centre point, and each factor moved to each of its other levels with the rest at the centre."""

    centre: dict[str, Any]
    levels: dict[str, tuple[Any, ...]]

    kind = ONE_AT_A_TIME

    def __post_init__(self) -> None:
        for factor, values in self.levels.items():
            if factor not in self.centre:
                raise DesignError(f"invalid one-at-a-time factor {factor}: it needs a centre value")
            if not self.moves(factor):
                raise DesignError(
                    f"invalid levels of {factor}={list(values)}: allowed at least one level other than its "
                    f"centre {self.centre[factor]!r}"
                )

    @property
    def factors(self) -> list[str]:
        return list(self.levels)

    def moves(self, factor: str) -> list[Any]:
        return [v for v in self.levels[factor] if not same_level(v, self.centre[factor])]

    def points(self) -> list[dict[str, Any]]:
        found = [dict(self.centre)]
        for factor in self.levels:
            found += [{**self.centre, factor: value} for value in self.moves(factor)]
        return found

    def terms(self, interactions: bool = False) -> list[Term]:
        return [Term(f"{f}={v}", (f,), v) for f in self.levels for v in self.moves(f)]

    def code(self, point: dict[str, Any], term: Term) -> float:
        """1 for the runs that moved the term's factor to its level, else 0 (the centre is the reference)."""
        return float(same_level(point[term.factors[0]], term.level))

    def alias_lines(self) -> list[str]:
        return ["one at a time: each move is measured against the centre, with every other factor at its centre"]

    def describe(self) -> str:
        return f"one-at-a-time design: centre + {len(self.points()) - 1} moves = {len(self.points())} points"


Design = FactorialDesign | OneAtATimeDesign


def same_level(a: Any, b: Any) -> bool:
    """Levels compare as numbers where both are numbers (MLflow records 2 as '2'), else as text."""
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)


def design_from_spec(spec: dict[str, Any]) -> Design:
    """The design a study file (or a parent run's `study.design` param) declares."""
    levels = {k: tuple(v) for k, v in spec["factors"].items()}
    if spec["type"] == ONE_AT_A_TIME:
        return OneAtATimeDesign(dict(spec["centre"]), levels)
    generators = spec.get("generators") or {}
    resolution = int(spec.get("min_resolution", MIN_RESOLUTION))
    if generators:
        return FactorialDesign(levels, {k: tuple(v) for k, v in generators.items()}, resolution)
    return FactorialDesign.standard(levels, int(spec.get("fraction", 0)), resolution)


def longer_budget_spec(spec: dict[str, Any], fraction: int | None) -> dict[str, Any]:
    """The design a longer budget runs: the same one, or (a factorial's `fraction`) the standard 2^(k-p)
    fraction, where resolution III is allowed: it keeps every main effect estimable, aliased only with
    two-factor interactions, which the short budget's fit measured or pooled."""
    if fraction is None or spec["type"] != FACTORIAL:
        return dict(spec)
    return {"type": FACTORIAL, "factors": spec["factors"], "fraction": fraction, "min_resolution": 3}
