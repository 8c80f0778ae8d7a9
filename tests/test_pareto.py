"""The Pareto front, hand-computed: the one definition the runner's tag and the report's section share."""

from harness.pareto import pareto_front


def test_the_front_keeps_the_points_no_other_beats_on_every_objective():
    # (accepted length: maximize, step ms: minimize)
    points = [("a", (1.30, 2.0)), ("b", (1.20, 1.5)), ("c", (1.25, 2.5)), ("d", (1.10, 1.5))]
    # c is beaten by a (longer and faster); d by b (same speed, longer); a and b trade off
    assert pareto_front(points, ["maximize", "minimize"]) == ["a", "b"]


def test_ties_stay_together_and_one_point_is_its_own_front():
    points = [("a", (1.0, 1.0)), ("b", (1.0, 1.0)), ("c", (0.5, 0.5))]
    assert pareto_front(points, ["maximize", "maximize"]) == ["a", "b"]
    assert pareto_front([("only", (3.0, 4.0))], ["minimize", "minimize"]) == ["only"]
    assert pareto_front([], ["maximize", "minimize"]) == []


def test_the_direction_decides_which_side_wins():
    points = [("low", (1.0, 1.0)), ("high", (2.0, 2.0))]
    assert pareto_front(points, ["maximize", "maximize"]) == ["high"]
    assert pareto_front(points, ["minimize", "minimize"]) == ["low"]
    assert pareto_front(points, ["maximize", "minimize"]) == ["low", "high"]
