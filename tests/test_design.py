"""Design generation: points, coding, the alias structure of fractional factorials, one-at-a-time designs."""

import itertools

import numpy as np
import pytest

from harness.design import (
    DesignError,
    FactorialDesign,
    OneAtATimeDesign,
    design_from_spec,
    word_name,
)

FIVE = {name: (0, 1) for name in "ABCDE"}


def test_full_factorial_has_every_combination_once():
    design = FactorialDesign({"a": (1, 3), "b": ("off", "on"), "c": (16, 64)})
    points = design.points()
    assert len(points) == 8
    assert {tuple(p.values()) for p in points} == set(itertools.product((1, 3), ("off", "on"), (16, 64)))
    assert design.resolution is None and design.alias_lines() == ["full 2^3 factorial: no effect is aliased"]
    assert len(design.interactions()) == 3  # every 2FI is clear in a full factorial


def test_half_fraction_of_five_is_resolution_five_with_every_interaction_clear():
    design = FactorialDesign.standard(FIVE, fraction=1)
    assert len(design.points()) == 16
    assert design.generators == {"E": ("A", "B", "C", "D")}
    assert [word_name(w) for w in design.words] == ["A×B×C×D×E"]
    assert design.resolution == 5
    # E is aliased with ABCD, and AB with CDE: no main effect or 2FI shares a column with another.
    assert [word_name(w) for w in design.aliases(frozenset("E"))] == ["A×B×C×D"]
    assert [word_name(w) for w in design.aliases(frozenset("AB"))] == ["C×D×E"]
    assert len(design.interactions()) == 10
    # The generated column really is the product of its word, run by run.
    for coded in design.coded_points():
        assert coded["E"] == coded["A"] * coded["B"] * coded["C"] * coded["D"]


def test_resolution_four_fraction_keeps_mains_clear_and_names_the_aliased_interactions():
    design = FactorialDesign.standard({name: (0, 1) for name in "ABCDEF"}, fraction=2)
    assert design.resolution == 4 and len(design.points()) == 16
    assert [word_name(w) for w in design.words] == ["A×B×C×E", "A×D×E×F", "B×C×D×F"]
    for main in "ABCDEF":
        assert all(len(alias) >= 3 for alias in design.aliases(frozenset(main)))
    # In resolution IV two-factor interactions alias each other: AB = CE, so neither is resolved.
    assert "A×B" not in [t.name for t in design.interactions()]
    assert any("A×B = C×E" in line for line in design.alias_lines())


def test_every_main_effect_is_estimable_columns_orthogonal():
    for levels, fraction in ((FIVE, 1), ({n: (0, 1) for n in "ABCDEF"}, 2), ({n: (0, 1) for n in "ABCDEFG"}, 3)):
        design = FactorialDesign.standard(levels, fraction)
        terms = design.terms(interactions=True)
        matrix = np.array([[design.code(p, t) for t in terms] for p in design.points()])
        full = np.column_stack([np.ones(len(matrix)), matrix])
        assert np.linalg.matrix_rank(full) == full.shape[1]
        gram = full.T @ full
        assert np.allclose(gram, np.diag(np.diag(gram)))  # orthogonal: each effect estimated independently


@pytest.mark.parametrize("factors, fraction", [("ABC", 1), ("ABCDE", 2), ("ABCDEF", 3)])
def test_resolution_three_fractions_are_refused(factors, fraction):
    with pytest.raises(DesignError, match="resolution 3 .*allowed resolution >= 4"):
        FactorialDesign.standard({name: (0, 1) for name in factors}, fraction)


def test_explicit_generators_are_checked():
    with pytest.raises(DesignError, match="resolution 3"):
        FactorialDesign({n: (0, 1) for n in "ABCD"}, {"D": ("A", "B")})
    with pytest.raises(DesignError, match="invalid generator"):
        FactorialDesign({n: (0, 1) for n in "ABCD"}, {"D": ("X", "B")})
    assert FactorialDesign({n: (0, 1) for n in "ABCD"}, {"D": ("A", "B", "C")}).resolution == 4


def test_unknown_fraction_is_refused_in_one_line():
    with pytest.raises(DesignError, match=r"invalid fraction=3 for 4 factors: allowed 0 or one of \[1\]"):
        FactorialDesign.standard({n: (0, 1) for n in "ABCD"}, 3)


def test_levels_are_coded_as_numbers_or_text():
    design = FactorialDesign({"k": (1, 3), "alpha": (0.3, 1.0), "conv": ("off", "on")})
    assert design.coded_level("k", "3") == 1 and design.coded_level("alpha", "0.3") == -1
    assert design.coded_level("conv", "on") == 1
    with pytest.raises(DesignError, match="not one of"):
        design.coded_level("k", 2)


def test_one_at_a_time_moves_each_knob_from_the_centre():
    design = OneAtATimeDesign({"k": 2, "rank": 64}, {"k": (1, 2, 3), "rank": (16, 64)})
    assert design.points() == [{"k": 2, "rank": 64}, {"k": 1, "rank": 64}, {"k": 3, "rank": 64}, {"k": 2, "rank": 16}]
    assert [t.name for t in design.terms()] == ["k=1", "k=3", "rank=16"]
    with pytest.raises(DesignError, match="at least one level other than its centre"):
        OneAtATimeDesign({"k": 2}, {"k": (2,)})


def test_spec_round_trip():
    spec = {"type": "factorial", "factors": {n: [0, 1] for n in "ABCDE"}, "fraction": 1}
    assert design_from_spec(spec).generators == {"E": ("A", "B", "C", "D")}
    spec = {"type": "one_at_a_time", "factors": {"k": [1, 3]}, "centre": {"k": 2}}
    assert len(design_from_spec(spec).points()) == 3
