"""Study definitions: small declarative YAML files, validated on load with one clear error per bad field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from algorithms import ALGORITHMS, SharedKnobs, algorithm_entry
from algorithms.metrics import DRAFT_STEP_MS, REALIZED_ACCEPTED_LENGTH
from harness.config import RunConfig
from harness.evaluate import EvalConfig

OBJECTIVES = {REALIZED_ACCEPTED_LENGTH: "maximize", DRAFT_STEP_MS: "minimize"}
SAMPLERS = ("tpe", "grid", "random")
PRUNERS = ("median", "hyperband", "none")
# A baseline runs a registered algorithm with the study's pinned shared knobs. `NAME` takes the base's
# algorithm knobs where NAME has them (a component ablation); `NAME_defaults` takes NAME's published ones.
PUBLISHED_SUFFIX = "_defaults"
BASELINES = (*ALGORITHMS, *(f"{name}{PUBLISHED_SUFFIX}" for name in ALGORITHMS))
DEFAULT_BASELINES = ("dflash", f"dflash2{PUBLISHED_SUFFIX}")
BUDGET_KEYS = ("n_trials", "timeout_s", "steps_per_trial")
SAMPLER_KEYS, PRUNER_KEYS = ("type", "seed"), ("type", "warmup_steps")
EVALUATE_KEYS = ("best_trials", "num_prompts", "max_new_tokens", "temperatures")


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

    @property
    def directions(self) -> list[str]:
        return [OBJECTIVES[o] for o in self.objectives]


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
    seeds = data.get("seeds", [run.train.seed])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise _fail(path, "seeds", seeds, "a non-empty list of integers")

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
        sampler=sampler["type"],
        sampler_seed=int(sampler.get("seed", 0)),
        pruner=pruner["type"],
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
