"""Study definitions: small declarative YAML files, validated on load with one clear error per bad field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from algorithms import ALGORITHMS, SharedKnobs, algorithm_entry
from algorithms.metrics import DRAFT_STEP_MS, REALIZED_ACCEPTED_LENGTH
from algorithms.registry import COMPONENT_FACTORS, with_design_point
from harness.config import RunConfig
from harness.design import DESIGN_TYPES, FACTORIAL, ONE_AT_A_TIME, Design, DesignError, design_from_spec
from harness.evaluate import EvalConfig

OBJECTIVES = {REALIZED_ACCEPTED_LENGTH: "maximize", DRAFT_STEP_MS: "minimize"}
SAMPLERS = ("tpe", "grid", "random")
DESIGN_SAMPLER = "design"  # a designed study's trials are its enqueued points, never sampled
PRUNERS = ("median", "hyperband", "none")
# A baseline runs a registered algorithm with the study's pinned shared knobs. `NAME` takes the base's
# algorithm knobs where NAME has them (a component ablation); `NAME_defaults` takes NAME's published ones.
PUBLISHED_SUFFIX = "_defaults"
BASELINES = (*ALGORITHMS, *(f"{name}{PUBLISHED_SUFFIX}" for name in ALGORITHMS))
DEFAULT_BASELINES = ("dflash", f"dflash2{PUBLISHED_SUFFIX}")
BUDGET_KEYS = ("n_trials", "timeout_s", "steps_per_trial")
SAMPLER_KEYS, PRUNER_KEYS = ("type", "seed"), ("type", "warmup_steps")
EVALUATE_KEYS = ("best_trials", "num_prompts", "max_new_tokens", "temperatures")
DESIGN_KEYS = ("type", "factors", "fraction", "generators", "centre", "interactions", "margin", "reference")
INTERACTIONS = ("auto", True, False)
# The equivalence margin of a `bounded` verdict, in accepted tokens per cycle: about 3% of the accepted
# lengths these drafts reach (1.1-1.5), below what a decoding benchmark's wall time resolves (README).
DEFAULT_MARGIN = 0.05


class StudyDefinitionError(ValueError):
    """A study file with a bad field; the message names the file, the field, its value and what is allowed."""


def _fail(path: str, field_name: str, value: Any, allowed: str) -> StudyDefinitionError:
    return StudyDefinitionError(f"{path}: invalid field {field_name}={value!r}: allowed {allowed}")


@dataclass
class Dimension:
    """One swept knob: categorical choices, or an int/float range (log scale allowed)."""

    knob: str
    kind: str  # categorical | int | float
    choices: list[Any] | None = None
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: int | None = None

    def grid_values(self) -> list[Any]:
        if self.kind == "categorical":
            return list(self.choices)
        if self.kind == "int" and not self.log:
            return list(range(int(self.low), int(self.high) + 1, self.step or 1))
        raise StudyDefinitionError(
            "grid sampler needs categorical or linear int dimensions; "
            f"{self.knob} is {self.kind}{' log' if self.log else ''}"
        )


@dataclass
class StudyDefinition:
    name: str
    base: RunConfig
    search_space: list[Dimension]
    sampler: str = "tpe"
    sampler_seed: int = 0
    pruner: str = "median"
    pruner_warmup_steps: int = 0
    objectives: list[str] = field(default_factory=lambda: [REALIZED_ACCEPTED_LENGTH])
    n_trials: int = 8
    timeout_s: float | None = None
    steps_per_trial: int = 100
    baselines: list[str] = field(default_factory=lambda: list(DEFAULT_BASELINES))
    seeds: list[int] = field(default_factory=lambda: [0])
    description: str = ""
    source_text: str = ""
    evaluate_best: int = 0  # opt-in: measured acceptance by real speculative decoding for the N best trials
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    # How each run is launched, not what it trains: >1 makes every trial and baseline a torchrun job.
    nproc_per_node: int = 1
    design: StudyDesign | None = None  # a designed study: its points are the trials, in a fixed order

    @property
    def directions(self) -> list[str]:
        return [OBJECTIVES[o] for o in self.objectives]


@dataclass
class StudyDesign:
    """A study file's `design:`: the points it runs, and how its report fits them."""

    spec: dict[str, Any]  # as written (normalised), logged to the parent run as `study.design`
    design: Design
    interactions: str | bool = "auto"  # fit the two-factor interactions the design resolves
    margin: float = DEFAULT_MARGIN
    reference: str | None = None  # a baseline whose runs join the fit as the reference arm

    @property
    def points(self) -> list[dict[str, Any]]:
        return self.design.points()


def _require_mapping(path: str, name: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise _fail(path, name, value, "a mapping")
    return value


def _dimension(path: str, knob: str, spec: Any, tuned: tuple[str, ...]) -> Dimension:
    where = f"search_space.{knob}"
    if knob not in tuned:
        raise _fail(path, "search_space", knob, f"knobs from {list(tuned)}")
    if isinstance(spec, list):
        spec = {"type": "categorical", "choices": spec}
    spec = _require_mapping(path, where, spec)
    kind = spec.get("type")
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise _fail(path, f"{where}.choices", choices, "a non-empty list")
        return Dimension(knob, kind, choices=choices)
    if kind in ("int", "float"):
        low, high = spec.get("low"), spec.get("high")
        if not isinstance(low, (int, float)) or not isinstance(high, (int, float)) or low > high:
            raise _fail(path, f"{where}.low/high", (low, high), "numbers with low <= high")
        log = bool(spec.get("log", False))
        if log and low <= 0:
            raise _fail(path, f"{where}.low", low, "> 0 on a log scale")
        return Dimension(knob, kind, low=low, high=high, log=log, step=spec.get("step"))
    raise _fail(path, f"{where}.type", kind, "categorical, int or float")


def parse_study(data: dict, path: str = "<study>") -> StudyDefinition:
    data = _require_mapping(path, "<top level>", data)
    known = {
        "name",
        "description",
        "target",
        "base",
        "search_space",
        "sampler",
        "pruner",
        "objective",
        "budget",
        "baselines",
        "seeds",
        "evaluate",
        "design",
    }
    for key in data:
        if key not in known:
            raise _fail(path, key, data[key], f"fields {sorted(known)}")
    name = data.get("name")
    if not isinstance(name, str) or not name.replace("-", "").replace("_", "").isalnum():
        raise _fail(path, "name", name, "a name of letters, digits, '-' and '_'")

    base = _require_mapping(path, "base", data.get("base"))
    algorithm = base.get("algorithm")
    if algorithm not in ALGORITHMS:
        raise _fail(path, "base.algorithm", algorithm, f"one of {list(ALGORITHMS)}")
    shared = _require_mapping(path, "base.shared", base.get("shared"))
    missing = [f.name for f in dataclasses.fields(SharedKnobs) if f.name not in shared]
    if missing:
        raise _fail(path, "base.shared", sorted(shared), f"every shared knob pinned explicitly; missing {missing}")
    train = dict(_require_mapping(path, "base.train", base.get("train", {})))
    nproc_per_node = train.pop("nproc_per_node", 1)
    if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise _fail(path, "base.train.nproc_per_node", nproc_per_node, "an integer >= 1 (ranks per run)")
    try:
        run = RunConfig.from_dict(
            {
                "target": data.get("target", "smollm2-135m"),
                "algorithm": algorithm,
                **{k: base.get(k, {}) for k in ("shared", "knobs", "data")},
                "train": train,
            }
        )
        run.validate()
    except (TypeError, ValueError) as error:
        raise StudyDefinitionError(f"{path}: base: {error}") from None

    space = _require_mapping(path, "search_space", data.get("search_space", {}))
    tuned = algorithm_entry(algorithm).tuned_knobs
    dimensions = [_dimension(path, knob, spec, tuned) for knob, spec in space.items()]

    sampler = _require_mapping(path, "sampler", data.get("sampler", {"type": "tpe"}))
    if sampler.get("type") not in SAMPLERS:
        raise _fail(path, "sampler.type", sampler.get("type"), f"one of {list(SAMPLERS)}")
    pruner = _require_mapping(path, "pruner", data.get("pruner", {"type": "median"}))
    if pruner.get("type") not in PRUNERS:
        raise _fail(path, "pruner.type", pruner.get("type"), f"one of {list(PRUNERS)}")

    design = None
    if "design" in data:
        for key in ("sampler", "pruner"):
            if key in data and not (key == "pruner" and data[key] == {"type": "none"}):
                raise _fail(
                    path,
                    key,
                    data[key],
                    "no sampler and no pruner in a design file (its points are fixed, and a pruned point would "
                    "bias its effect)",
                )
        if space:
            raise _fail(path, "search_space", space, "{} in a design file (the design lists its factors)")
        design = _design(path, data["design"], run, tuned)

    objective = data.get("objective", REALIZED_ACCEPTED_LENGTH)
    objectives = objective if isinstance(objective, list) else [objective]
    if not objectives or any(o not in OBJECTIVES for o in objectives) or len(set(objectives)) != len(objectives):
        raise _fail(path, "objective", objective, f"one or a list of distinct {sorted(OBJECTIVES)}")

    budget = _require_mapping(path, "budget", data.get("budget", {}))
    for section, mapping, allowed in (
        ("budget", budget, BUDGET_KEYS),
        ("sampler", sampler, SAMPLER_KEYS),
        ("pruner", pruner, PRUNER_KEYS),
    ):
        for key in mapping:
            if key not in allowed:
                raise _fail(path, f"{section}.{key}", mapping[key], f"keys {list(allowed)}")
    n_trials, timeout, steps = (
        budget.get("n_trials", 8),
        budget.get("timeout_s"),
        budget.get("steps_per_trial", run.train.max_steps),
    )
    if not isinstance(n_trials, int) or n_trials < 0:
        raise _fail(path, "budget.n_trials", n_trials, "an integer >= 0")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise _fail(path, "budget.timeout_s", timeout, "null or a number of seconds > 0")
    if not isinstance(steps, int) or steps < 1:
        raise _fail(path, "budget.steps_per_trial", steps, "an integer >= 1")

    baselines = data.get("baselines", list(DEFAULT_BASELINES))
    if not isinstance(baselines, list) or any(b not in BASELINES for b in baselines):
        raise _fail(path, "baselines", baselines, f"a list from {list(BASELINES)}")
    if design is not None and design.reference is not None and design.reference not in baselines:
        raise _fail(path, "design.reference", design.reference, f"one of the study's baselines {baselines}")
    if design is not None:
        n_trials = len(design.points)
    seeds = data.get("seeds", [run.train.seed])
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**32 for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise _fail(path, "seeds", seeds, "a non-empty list of distinct integers in [0, 2**32)")

    if sampler["type"] == "grid":
        for dimension in dimensions:
            dimension.grid_values()

    evaluate = _require_mapping(path, "evaluate", data.get("evaluate", {"best_trials": 0}))
    unknown = set(evaluate) - set(EVALUATE_KEYS)
    if unknown:
        raise _fail(path, "evaluate", sorted(unknown), f"keys {list(EVALUATE_KEYS)}")
    defaults = EvalConfig()
    for key in ("best_trials", "num_prompts", "max_new_tokens"):
        value = evaluate.get(key, 0 if key == "best_trials" else 1)
        if not isinstance(value, int) or value < (0 if key == "best_trials" else 1):
            raise _fail(
                path, f"evaluate.{key}", value, "a non-negative integer" if key == "best_trials" else "an integer >= 1"
            )
    temperatures = evaluate.get("temperatures", list(defaults.temperatures))
    if (
        not isinstance(temperatures, list)
        or not temperatures
        or any(not isinstance(t, (int, float)) or t < 0 for t in temperatures)
    ):
        raise _fail(path, "evaluate.temperatures", temperatures, "a non-empty list of numbers >= 0")

    return StudyDefinition(
        name=name,
        base=run,
        search_space=dimensions,
        sampler=sampler["type"] if design is None else DESIGN_SAMPLER,
        sampler_seed=int(sampler.get("seed", 0)),
        pruner=pruner["type"] if design is None else "none",
        pruner_warmup_steps=int(pruner.get("warmup_steps", 0)),
        objectives=objectives,
        n_trials=n_trials,
        timeout_s=timeout,
        steps_per_trial=steps,
        baselines=baselines,
        seeds=seeds,
        description=str(data.get("description", "")),
        evaluate_best=evaluate.get("best_trials", 0),
        evaluation=EvalConfig(
            num_prompts=evaluate.get("num_prompts", defaults.num_prompts),
            max_new_tokens=evaluate.get("max_new_tokens", defaults.max_new_tokens),
            temperatures=tuple(float(t) for t in temperatures),
        ),
        nproc_per_node=nproc_per_node,
        design=design,
    )


def _design(path: str, value: Any, run: RunConfig, tuned: tuple[str, ...]) -> StudyDesign:
    """`design:`: a factorial (two levels per factor, full or fractional) or a one-at-a-time design."""
    spec = dict(_require_mapping(path, "design", value))
    for key in spec:
        if key not in DESIGN_KEYS:
            raise _fail(path, f"design.{key}", spec[key], f"keys {list(DESIGN_KEYS)}")
    kind = spec.get("type")
    if kind not in DESIGN_TYPES:
        raise _fail(path, "design.type", kind, f"one of {list(DESIGN_TYPES)}")
    factors = _require_mapping(path, "design.factors", spec.get("factors"))
    allowed = [*tuned, *COMPONENT_FACTORS]
    if not factors:
        raise _fail(path, "design.factors", factors, f"a mapping of factors from {allowed} to their levels")
    for factor, levels in factors.items():
        where = f"design.factors.{factor}"
        if factor not in allowed:
            raise _fail(path, "design.factors", factor, f"factors from {allowed}")
        if not isinstance(levels, list) or len(set(map(str, levels))) != len(levels):
            raise _fail(path, where, levels, "a list of distinct levels")
        if kind == FACTORIAL and len(levels) != 2:
            raise _fail(path, where, levels, "exactly two levels, low and high, in a factorial")
        if factor in COMPONENT_FACTORS and any(not isinstance(level, bool) for level in levels):
            raise _fail(path, where, levels, "component levels [off, on]")
    for key, check, allowed_text in (
        ("fraction", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer p >= 0"),
        ("margin", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, "a number > 0"),
        ("interactions", lambda v: v in INTERACTIONS, f"one of {list(INTERACTIONS)}"),
        ("generators", lambda v: isinstance(v, dict), "a mapping of generated factor to a list of base factors"),
        ("centre", lambda v: isinstance(v, dict), "a mapping of factor to its centre level"),
    ):
        if key in spec and not check(spec[key]):
            raise _fail(path, f"design.{key}", spec[key], allowed_text)
    if kind == FACTORIAL and "centre" in spec:
        raise _fail(path, "design.centre", spec["centre"], "no centre in a factorial (one_at_a_time only)")
    if kind == ONE_AT_A_TIME:
        base = {**dataclasses.asdict(run.algorithm.shared), **dataclasses.asdict(run.algorithm.knobs)}
        base |= {"conv": run.algorithm.entry.has_conv, "selector": run.algorithm.entry.has_selector}
        spec["centre"] = {f: spec.get("centre", {}).get(f, base.get(f)) for f in factors}
    try:
        design = design_from_spec(spec)
    except DesignError as error:
        raise StudyDefinitionError(f"{path}: invalid field design: {error}") from None
    for point in design.points():  # every point must be a valid run, before anything trains
        try:
            with_design_point(run.algorithm, point).validate()
        except (TypeError, ValueError) as error:
            raise StudyDefinitionError(f"{path}: design point {point}: {error}") from None
    reference = spec.get("reference")
    if reference is not None and not isinstance(reference, str):
        raise _fail(path, "design.reference", reference, "a baseline name")
    return StudyDesign(
        spec, design, spec.get("interactions", "auto"), float(spec.get("margin", DEFAULT_MARGIN)), reference
    )


def load_study(path: Path) -> StudyDefinition:
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise StudyDefinitionError(f"{path}: not valid YAML: {error}") from None
    study = parse_study(data, str(path))
    study.source_text = text
    return study
