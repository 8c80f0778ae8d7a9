"""Study definitions: small declarative YAML files, validated on load with one clear error per bad field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from algorithms import ALGORITHMS, SharedKnobs, algorithm_entry
from algorithms.knobs import knob_names
from algorithms.metrics import REALIZED_ACCEPTED_LENGTH
from algorithms.registry import COMPONENT_FACTORS, MEMBER_FACTOR, with_design_point
from harness.config import EvalConfig, RunConfig, TrainConfig, parse_yaml
from harness.data import DataConfig, read_prompts
from harness.design import (
    FACTORIAL,
    ONE_AT_A_TIME,
    TRANSFER_MEANINGS,
    Design,
    DesignError,
    design_from_spec,
    longer_budget_spec,
)
from harness.serving import metrics as served_names
from harness.tracking import BUDGETS_AS_BRANCHES, BUDGETS_FROM_SCRATCH, OBJECTIVES

DESIGN_SAMPLER = "design"  # a designed study's trials are its enqueued points, never sampled
# A baseline runs a registered algorithm with the study's pinned shared knobs. `NAME` takes the base's
# algorithm knobs where NAME has them (a component ablation); `NAME_defaults` takes NAME's published ones.
PUBLISHED_SUFFIX = "_defaults"
BASELINES = (*ALGORITHMS, *(f"{name}{PUBLISHED_SUFFIX}" for name in ALGORITHMS))
DEFAULT_BASELINES = ("dflash", f"dflash2{PUBLISHED_SUFFIX}")
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
    serve: str | None = None  # opt-in: the engine that serves the best run and the reference arm at the end
    register: str | None = None  # opt-in: the registered model the best run's export becomes a version of
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    # How each run is launched, not what it trains: >1 makes every trial and baseline a torchrun job.
    nproc_per_node: int = 1
    design: StudyDesign | None = None  # a designed study: its points are the trials, in a fixed order
    # Step budgets, shortest first: the first is `steps_per_trial`; a design runs again at each longer one.
    budgets: list[int] = field(default_factory=list)
    budgets_by: str = BUDGETS_FROM_SCRATCH  # or BUDGETS_AS_BRANCHES: the shorter ones anneal the longest's run

    @property
    def branches(self) -> bool:
        """Each shorter budget's run is a WSD branch of the longest budget's run of the same point and seed."""
        return self.budgets_by == BUDGETS_AS_BRANCHES

    @property
    def prunes(self) -> bool:
        """Trials report the realized accepted length at each validation; a pruner acts on it only when it is the
        study's one objective (Optuna cannot prune multi-objective trials, and a served objective exists only
        once a run has finished)."""
        return self.pruner != "none" and self.objectives == [REALIZED_ACCEPTED_LENGTH]

    @property
    def served_objectives(self) -> bool:
        return any(o in served_names.OBJECTIVES for o in self.objectives)

    @property
    def directions(self) -> list[str]:
        return [OBJECTIVES[o] for o in self.objectives]

    @property
    def longer_budgets(self) -> list[int]:
        return self.budgets[1:]

    def baseline_seeds(self, baseline: str) -> list[int]:
        """The seeds a baseline runs: the reference arm's own (at least two), else the study's."""
        if self.design is not None and baseline == self.design.reference:
            return self.design.reference_seeds
        return self.seeds

    def data_variants(self) -> list[RunConfig]:
        """The base with each data value the search space sweeps (the base alone when it sweeps none): the
        workspaces a launcher prepares before any worker starts."""
        variants = {str(self.base.data): self.base}
        for dimension in self.search_space:
            if dimension.knob in DataConfig.SWEEPABLE:
                for value in dimension.choices:
                    config = self.base.with_knobs({dimension.knob: value})
                    variants.setdefault(str(config.data), config)
        return list(variants.values())

    def baseline_budgets(self, baseline: str) -> list[int]:
        """The budgets a baseline runs at: the reference arm at every budget, other baselines at the first."""
        if self.design is not None and baseline == self.design.reference:
            return self.budgets
        return self.budgets[:1]


@dataclass
class StudyDesign:
    """A study file's `design:`: the points it runs, and how its report fits them."""

    spec: dict[str, Any]  # as written (normalised), logged to the parent run as `study.design`
    design: Design
    interactions: str | bool = "auto"  # fit the two-factor interactions the design resolves
    margin: float = DEFAULT_MARGIN
    reference: str | None = None  # a baseline whose runs join the fit as the reference arm
    # A member design's knobs of members other than the base (its `base.knobs` that the base lacks)
    member_knobs: dict[str, Any] = field(default_factory=dict)
    reference_seeds: list[int] = field(default_factory=list)  # the reference arm's seeds (its own variance)
    longer_spec: dict[str, Any] = field(default_factory=dict)  # the design the longer budgets run

    @property
    def points(self) -> list[dict[str, Any]]:
        return self.design.points()

    @property
    def longer_points(self) -> list[dict[str, Any]]:
        return design_from_spec(self.longer_spec).points()


class Section(BaseModel):
    """A study-file mapping: unknown keys and values of the wrong type (a bool for an int) are errors."""

    model_config = ConfigDict(extra="forbid", strict=True)


class BaseSection(Section):
    algorithm: str = Field(description=f"the base algorithm, one of {list(ALGORITHMS)}")
    shared: dict[str, Any] = Field(description="every shared knob, pinned explicitly")
    knobs: dict[str, Any] = Field(default_factory=dict, description="the base algorithm's own knobs")
    train: dict[str, Any] = Field(default_factory=dict, description="training knobs (and nproc_per_node)")
    data: dict[str, Any] = Field(default_factory=dict, description="data knobs")


class SamplerSection(Section):
    type: Literal["tpe", "grid", "random"] = "tpe"
    seed: int = 0


class PrunerSection(Section):
    type: Literal["median", "hyperband", "none"] = "median"
    warmup_steps: int = Field(0, ge=0)


class BudgetSection(Section):
    n_trials: int = Field(8, ge=0)
    timeout_s: float | None = Field(None, gt=0)
    steps_per_trial: int | None = Field(None, ge=1, description="default: base.train.max_steps")


class EvaluateSection(Section):
    best_trials: int = Field(0, ge=0, description="speculative decoding for the N best trials (0: off)")
    num_prompts: int = Field(EvalConfig().num_prompts, ge=1)
    max_new_tokens: int = Field(EvalConfig().max_new_tokens, ge=1)
    temperatures: list[Annotated[float, Field(ge=0)]] = Field(
        default_factory=lambda: list(EvalConfig().temperatures), min_length=1
    )
    confidence_threshold: float = Field(
        EvalConfig().confidence_threshold,
        ge=0,
        le=1,
        description="a confidence head's scheduled verification cut (0: verify the whole block)",
    )
    prompts: str | None = Field(
        None,
        description='a JSONL file of {"prompt": "..."} decoded in place of MT-bench (its first num_prompts), '
        "by evaluation and serving",
    )
    registered_model: str | None = Field(
        None,
        alias="register",  # `register` itself would shadow the model class's ABC method
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        description="at the end, register the best run's export (export/ artifacts) as a version of this model "
        "in MLflow's model registry (one objective only)",
    )
    served_rounds: int = Field(
        EvalConfig().served_rounds,
        ge=1,
        description="a served objective's rounds per run: each a fresh launch with the draft and one without, so "
        "every run is served in its own launches (1: launch and seed noise together in a design's residual; 2 or more "
        "also measure the launch noise)",
    )
    served_vocabulary: int | None = Field(
        EvalConfig().served_vocabulary,
        ge=2,
        description="a served objective serves each run's draft over this many tokens, those its training replies "
        "use most (its own head and a d2t map); null: the whole vocabulary",
    )
    served_confidence_cut: float = Field(
        EvalConfig().served_confidence_cut,
        ge=0,
        lt=1,
        description="a served objective serves each run's draft with llama.cpp's confidence cut (--spec-draft-p-min): "
        "a cycle's draft ends at its first token less confident than this; 0: no cut",
    )
    served_draft_length: int | None = Field(
        EvalConfig().served_draft_length,
        ge=1,
        description="a served objective drafts at most this many tokens per cycle (llama.cpp's --spec-draft-n-max): "
        "a shorter draft decode and verify batch; below the base's block size; null: the block's",
    )
    ngram_peers: bool = Field(
        EvalConfig().ngram_peers,
        description="the serving step also serves llama.cpp's n-gram types on the same prompts, beside each run",
    )
    serve: Literal["llama.cpp"] | None = Field(
        None,
        description="at the end, serve the best run and the reference arm's first run in this engine on the "
        "same prompts and compare with the harness cycle by cycle (served/llama_cpp/*)",
    )


class TransferMeasuredSection(Section):
    """How this design's verdicts carried to a longer budget, measured by another study and published."""

    steps: int = Field(ge=1, description="the longer budget it was measured at")
    source: str = Field(min_length=1, description="where the measurement is published (a repository path)")
    labels: dict[str, str] = Field(
        min_length=1, description=f"effect (a factor, or `arm`) -> its transfer label, one of {list(TRANSFER_MEANINGS)}"
    )


class DesignSection(Section):
    type: Literal["factorial", "one_at_a_time"]
    factors: dict[str, list[Any]] = Field(min_length=1, description="factor -> its levels (two in a factorial)")
    fraction: int = Field(0, ge=0, description="p of a 2^(k-p) fraction with the standard generators")
    generators: dict[str, list[str]] | None = Field(None, description="generated factor -> base factors")
    centre: dict[str, Any] | None = Field(None, description="one_at_a_time: the centre (default: the base)")
    interactions: Literal["auto"] | bool = "auto"
    margin: float = Field(DEFAULT_MARGIN, gt=0, description="the bounded label's margin, accepted tokens")
    reference: str | None = Field(None, description="a baseline whose runs join the fit as the reference arm")
    reference_seeds: list[Annotated[int, Field(ge=0, lt=2**32)]] | None = Field(
        None, description="the reference arm's seeds, at least two (default: the study's seeds)"
    )
    longer_fraction: int | None = Field(
        None,
        ge=0,
        description="a factorial's p at the longer budgets: the standard 2^(k-p) fraction, resolution III allowed "
        "(default: the same points as the first budget)",
    )
    transfer_measured: TransferMeasuredSection | None = Field(
        None, description="a one-budget design's transfer to a longer budget, measured elsewhere; the report cites it"
    )


class StudyFile(Section):
    """A study file (studies/*.yaml); `dflash-lab study schema` prints this as JSON Schema."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,100}$", description="letters, digits, '-' and '_'")
    description: str = ""
    target: str = "smollm2-135m"
    base: BaseSection
    search_space: dict[str, Any] = Field(
        default_factory=dict, description="knob -> a list of choices, or {type: int|float, low, high, log, step}"
    )
    sampler: SamplerSection | None = None
    pruner: PrunerSection | None = None
    objective: str | list[str] = REALIZED_ACCEPTED_LENGTH
    budget: BudgetSection = Field(default_factory=BudgetSection)
    budgets: list[Annotated[int, Field(ge=1)]] | None = Field(
        None,
        min_length=1,
        description="step budgets, shortest first: the first is every run's; a design and its reference arm run "
        "again at each longer one, and the report labels how each verdict carried",
    )
    budgets_by: Literal["scratch", "branches"] = Field(
        BUDGETS_FROM_SCRATCH,
        description="scratch: each budget trains from step 0; branches: the longest budget's run is a "
        "warmup-stable-decay trunk and each shorter budget anneals its stable checkpoint (base.train.schedule wsd)",
    )
    baselines: list[str] = Field(default_factory=lambda: list(DEFAULT_BASELINES))
    seeds: list[Annotated[int, Field(ge=0, lt=2**32)]] | None = Field(None, min_length=1)
    evaluate: EvaluateSection = Field(default_factory=EvaluateSection)
    design: DesignSection | None = None


SECTIONS: dict[tuple, type[Section]] = {
    (): StudyFile,
    ("base",): BaseSection,
    ("sampler",): SamplerSection,
    ("pruner",): PrunerSection,
    ("budget",): BudgetSection,
    ("evaluate",): EvaluateSection,
    ("design",): DesignSection,
    ("design", "transfer_measured"): TransferMeasuredSection,
}


def study_json_schema() -> dict[str, Any]:
    return StudyFile.model_json_schema()


def _one_line(path: str, error: ValidationError) -> StudyDefinitionError:
    """The first validation error as `file: invalid field a.b=value: allowed ...`."""
    first = error.errors(include_url=False)[0]
    loc = tuple(part for part in first["loc"] if not (isinstance(part, str) and "[" in part))  # union tags
    where = ".".join(map(str, loc)) or "<top level>"
    if first["type"] == "extra_forbidden":
        section = SECTIONS.get(loc[:-1])
        allowed = (
            f"keys {[f.alias or name for name, f in section.model_fields.items()]}" if section else "no other keys"
        )
        return _fail(path, where, first["input"], allowed)
    if first["type"] == "missing":
        return _fail(path, where, None, "a value (this field is required)")
    message = first["msg"].removeprefix("Input should be ").removeprefix("Value error, ")
    value = first.get("input")
    return _fail(path, where, value, message[0].lower() + message[1:] if message else first["type"])


def _check_values(path: str, dimension: Dimension, run: RunConfig) -> None:
    """Each choice (or both ends of a range) must make a valid run: a bad value fails at launch, not as a trial."""
    values = dimension.choices if dimension.kind == "categorical" else [dimension.low, dimension.high]
    for value in values:
        try:
            run.with_knobs({dimension.knob: value}).validate()
        except (TypeError, ValueError) as error:
            raise StudyDefinitionError(f"{path}: search_space.{dimension.knob}: {error}") from None


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


def parse_study(data: Any, path: str = "<study>") -> StudyDefinition:
    if not isinstance(data, dict):
        raise _fail(path, "<top level>", data, "a mapping of study fields")
    try:
        file = StudyFile.model_validate(data)
    except ValidationError as error:
        raise _one_line(path, error) from None
    base = file.base
    if base.algorithm not in ALGORITHMS:
        raise _fail(path, "base.algorithm", base.algorithm, f"one of {list(ALGORITHMS)}")
    missing = [f.name for f in dataclasses.fields(SharedKnobs) if f.name not in base.shared]
    if missing:
        raise _fail(path, "base.shared", sorted(base.shared), f"every shared knob pinned explicitly; missing {missing}")
    own_knobs, member_knobs = _split_member_knobs(path, file)
    train = dict(base.train)
    nproc_per_node = train.pop("nproc_per_node", 1)
    if not isinstance(nproc_per_node, int) or isinstance(nproc_per_node, bool) or nproc_per_node < 1:
        raise _fail(path, "base.train.nproc_per_node", nproc_per_node, "an integer >= 1 (ranks per run)")
    try:
        run = RunConfig.from_dict(
            {
                "target": file.target,
                "algorithm": base.algorithm,
                "shared": base.shared,
                "knobs": own_knobs,
                "data": base.data,
                "train": train,
            }
        )
        run.validate()
    except (TypeError, ValueError) as error:
        raise StudyDefinitionError(f"{path}: base: {error}") from None

    tuned = algorithm_entry(base.algorithm).tuned_knobs
    sweepable = tuple(dict.fromkeys((*tuned, *SharedKnobs.SWEEPABLE, *TrainConfig.SWEEPABLE, *DataConfig.SWEEPABLE)))
    dimensions = [_dimension(path, knob, spec, sweepable) for knob, spec in file.search_space.items()]
    for dimension in dimensions:
        _check_values(path, dimension, run)
        if dimension.knob in DataConfig.SWEEPABLE and run.data.validation_data is None:
            # each mixture's own split would move the yardstick with the thing measured
            raise _fail(
                path,
                "base.data.validation_data",
                None,
                f"a source or mixture when search_space sweeps {dimension.knob}: the one validation set every "
                "value is measured on",
            )
    design = None
    if file.design is not None:
        for key in ("sampler", "pruner"):
            value = getattr(file, key)
            if value is not None and not (key == "pruner" and value.type == "none"):
                raise _fail(
                    path,
                    key,
                    value.model_dump(exclude_unset=True),
                    "no sampler and no pruner in a design file (its points are fixed, and a pruned point would "
                    "bias its effect)",
                )
        if file.search_space:
            raise _fail(path, "search_space", file.search_space, "{} in a design file (the design lists its factors)")
        design = _design(path, file.design, run, tuned, member_knobs)
    sampler, pruner = file.sampler or SamplerSection(), file.pruner or PrunerSection()

    objectives = file.objective if isinstance(file.objective, list) else [file.objective]
    if not objectives or any(o not in OBJECTIVES for o in objectives) or len(set(objectives)) != len(objectives):
        raise _fail(path, "objective", file.objective, f"one or a list of distinct {sorted(OBJECTIVES)}")
    if file.evaluate.registered_model is not None and len(objectives) > 1:
        raise _fail(
            path,
            "evaluate.register",
            file.evaluate.registered_model,
            "a model name with one objective (a Pareto study has no single best run)",
        )
    served = any(o in served_names.OBJECTIVES for o in objectives)
    if served and file.evaluate.serve is None:
        raise _fail(
            path,
            "objective",
            file.objective,
            "a served objective with evaluate.serve: llama.cpp (the engine it is served in)",
        )
    served_only = (  # what only a served objective's serving reads: (field, as set, unset, what it does)
        ("served_vocabulary", file.evaluate.served_vocabulary, None, "only its serving drafts over it"),
        ("served_confidence_cut", file.evaluate.served_confidence_cut, 0, "only its serving cuts the drafts"),
        ("served_draft_length", file.evaluate.served_draft_length, None, "only its serving shortens the drafts"),
    )
    for name, value, unset, what in served_only:
        if not served and value != unset:
            raise _fail(
                path,
                f"evaluate.{name}",
                value,
                f"{'null' if unset is None else unset} without a served objective {sorted(served_names.OBJECTIVES)} "
                f"({what})",
            )
    draft_length = file.evaluate.served_draft_length
    if draft_length is not None and draft_length >= run.algorithm.shared.block_size:
        raise _fail(
            path,
            "evaluate.served_draft_length",
            draft_length,
            f"an integer from 1 to {run.algorithm.shared.block_size - 1}, below the base's block size "
            f"{run.algorithm.shared.block_size}",
        )
    budget = file.budget
    steps = budget.steps_per_trial if budget.steps_per_trial is not None else run.train.max_steps
    budgets = _budgets(path, file, steps, design, run.train)
    if any(b not in BASELINES for b in file.baselines):
        raise _fail(path, "baselines", file.baselines, f"a list from {list(BASELINES)}")
    if design is not None and design.reference is not None and design.reference not in file.baselines:
        raise _fail(path, "design.reference", design.reference, f"one of the study's baselines {file.baselines}")
    seeds = file.seeds if file.seeds is not None else [run.train.seed]
    if len(set(seeds)) != len(seeds):
        raise _fail(path, "seeds", seeds, "a non-empty list of distinct integers in [0, 2**32)")
    if design is not None and design.reference is not None:
        design.reference_seeds = _reference_seeds(path, file.design.reference_seeds or seeds)
    if sampler.type == "grid":
        for dimension in dimensions:
            dimension.grid_values()
    evaluate = file.evaluate
    return StudyDefinition(
        name=file.name,
        base=run,
        search_space=dimensions,
        sampler=sampler.type if design is None else DESIGN_SAMPLER,
        sampler_seed=sampler.seed,
        pruner=pruner.type if design is None else "none",
        pruner_warmup_steps=pruner.warmup_steps,
        objectives=objectives,
        n_trials=budget.n_trials
        if design is None
        else len(design.points) + len(budgets[1:]) * len(design.longer_points),
        timeout_s=budget.timeout_s,
        steps_per_trial=budgets[0],
        baselines=file.baselines,
        seeds=seeds,
        description=file.description,
        evaluate_best=evaluate.best_trials,
        serve=evaluate.serve,
        register=evaluate.registered_model,
        evaluation=EvalConfig(
            num_prompts=evaluate.num_prompts,
            max_new_tokens=evaluate.max_new_tokens,
            temperatures=tuple(float(t) for t in evaluate.temperatures),
            confidence_threshold=evaluate.confidence_threshold,
            prompts=evaluate.prompts,
            served_rounds=evaluate.served_rounds,
            served_vocabulary=evaluate.served_vocabulary,
            served_confidence_cut=evaluate.served_confidence_cut,
            served_draft_length=evaluate.served_draft_length,
            ngram_peers=evaluate.ngram_peers,
        ),
        nproc_per_node=nproc_per_node,
        design=design,
        budgets=budgets,
        budgets_by=file.budgets_by,
    )


def _budgets(path: str, file: StudyFile, steps: int, design: StudyDesign | None, train: TrainConfig) -> list[int]:
    """`budgets:`, shortest first; its first is every run's budget, so `budget.steps_per_trial` may only agree."""
    if file.budgets is None:
        return [steps]
    budgets = file.budgets
    if any(later <= earlier for earlier, later in zip(budgets, budgets[1:], strict=False)):
        raise _fail(path, "budgets", budgets, "step budgets in increasing order, each once")
    if file.budget.steps_per_trial is not None and file.budget.steps_per_trial != budgets[0]:
        raise _fail(
            path, "budget.steps_per_trial", file.budget.steps_per_trial, f"absent, or the first of budgets {budgets}"
        )
    if len(budgets) > 1 and design is None:
        raise _fail(path, "budgets", budgets, "one budget without a design (a longer budget re-runs a design)")
    if file.budgets_by == BUDGETS_AS_BRANCHES:
        _check_branches(path, file, list(budgets), train)
    return list(budgets)


def _check_branches(path: str, file: StudyFile, budgets: list[int], train: TrainConfig) -> None:
    """Budgets as WSD branches: a trunk per point at the longest budget, so every budget runs the same points, and
    each shorter budget's decay must start inside the trunk's stable stretch."""
    if len(budgets) < 2:
        raise _fail(path, "budgets_by", BUDGETS_AS_BRANCHES, "with two or more budgets (the longest is the trunk)")
    if train.schedule != "wsd":
        raise _fail(path, "base.train.schedule", train.schedule, "wsd with budgets_by: branches")
    if train.branches:
        raise _fail(path, "base.train.branches", train.branches, "[] with budgets_by: branches (set from budgets)")
    if file.design is not None and file.design.longer_fraction is not None:
        raise _fail(
            path,
            "design.longer_fraction",
            file.design.longer_fraction,
            "absent with budgets_by: branches (a branch needs its point's trunk at the longest budget)",
        )
    try:
        dataclasses.replace(train, max_steps=budgets[-1], branches=budgets[:-1]).validate_wsd()
    except ValueError as error:
        raise StudyDefinitionError(f"{path}: budgets {budgets} as branches: {error}") from None


def _reference_seeds(path: str, seeds: list[int]) -> list[int]:
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        raise _fail(
            path,
            "design.reference_seeds",
            seeds,
            "at least two distinct seeds (the reference arm's own training noise; default: the study's seeds)",
        )
    return list(seeds)


def _split_member_knobs(path: str, file: StudyFile) -> tuple[dict[str, Any], dict[str, Any]]:
    """`base.knobs` as (the base algorithm's knobs, those of the other members a member design moves to)."""
    members = (file.design.factors.get(MEMBER_FACTOR) or []) if file.design is not None else []
    if not isinstance(members, list) or any(m not in ALGORITHMS for m in members):
        raise _fail(path, f"design.factors.{MEMBER_FACTOR}", members, f"a list of members from {list(ALGORITHMS)}")
    own_names = (
        knob_names(algorithm_entry(file.base.algorithm).knobs_class) if file.base.algorithm in ALGORITHMS else set()
    )
    member_names = set().union(*(knob_names(algorithm_entry(m).knobs_class) for m in members))
    own = {k: v for k, v in file.base.knobs.items() if k in own_names or k not in member_names}
    return own, {k: v for k, v in file.base.knobs.items() if k not in own}


def _design(
    path: str, section: DesignSection, run: RunConfig, tuned: tuple[str, ...], member_knobs: dict[str, Any]
) -> StudyDesign:
    """`design:`: a factorial (two levels per factor, full or fractional) or a one-at-a-time design."""
    allowed = [*tuned, *COMPONENT_FACTORS, MEMBER_FACTOR]
    for factor, levels in section.factors.items():
        where = f"design.factors.{factor}"
        if factor not in allowed:
            raise _fail(path, "design.factors", factor, f"factors from {allowed}")
        if factor == MEMBER_FACTOR and section.type != ONE_AT_A_TIME:
            raise _fail(path, where, levels, "members in a one_at_a_time design (each against the base's)")
        if len(set(map(str, levels))) != len(levels) or not levels:
            raise _fail(path, where, levels, "a list of distinct levels")
        if section.type == FACTORIAL and len(levels) != 2:
            raise _fail(path, where, levels, "exactly two levels, low and high, in a factorial")
        if factor in COMPONENT_FACTORS and any(not isinstance(level, bool) for level in levels):
            raise _fail(path, where, levels, "component levels [off, on]")
    spec = section.model_dump(exclude_none=True)
    if section.type == FACTORIAL and section.centre is not None:
        raise _fail(path, "design.centre", section.centre, "no centre in a factorial (one_at_a_time only)")
    if section.type == ONE_AT_A_TIME:
        base = {**dataclasses.asdict(run.algorithm.shared), **dataclasses.asdict(run.algorithm.knobs)}
        base |= {"conv": run.algorithm.entry.has_conv, "selector": run.algorithm.entry.has_selector}
        base[MEMBER_FACTOR] = run.algorithm.algorithm
        spec["centre"] = {f: (section.centre or {}).get(f, base.get(f)) for f in section.factors}
    try:
        design = design_from_spec(spec)
    except DesignError as error:
        raise StudyDefinitionError(f"{path}: invalid field design: {error}") from None
    for point in design.points():  # every point must be a valid run, before anything trains
        try:
            with_design_point(run.algorithm, point, member_knobs).validate()
        except (TypeError, ValueError) as error:
            raise StudyDefinitionError(f"{path}: design point {point}: {error}") from None
    if section.longer_fraction is not None and (section.type != FACTORIAL or section.generators):
        raise _fail(
            path, "design.longer_fraction", section.longer_fraction, "only with a factorial of standard generators"
        )
    if section.transfer_measured is not None:
        _check_transfer_labels(path, section)
    longer = longer_budget_spec(spec, section.longer_fraction)
    try:
        longer_points = design_from_spec(longer).points()
    except DesignError as error:
        raise StudyDefinitionError(f"{path}: invalid field design.longer_fraction: {error}") from None
    for point in longer_points:
        try:
            with_design_point(run.algorithm, point, member_knobs).validate()
        except (TypeError, ValueError) as error:
            raise StudyDefinitionError(f"{path}: longer-budget design point {point}: {error}") from None
    study_design = StudyDesign(spec, design, section.interactions, section.margin, section.reference, member_knobs)
    study_design.longer_spec = longer
    return study_design


def _check_transfer_labels(path: str, section: DesignSection) -> None:
    effects = [*section.factors, *(["arm"] if section.reference else [])]
    for effect, found in section.transfer_measured.labels.items():
        where = f"design.transfer_measured.labels.{effect}"
        if effect not in effects:
            raise _fail(path, "design.transfer_measured.labels", effect, f"effects from {effects}")
        if found not in TRANSFER_MEANINGS:
            raise _fail(path, where, found, f"one of {list(TRANSFER_MEANINGS)}")


def load_study(path: Path) -> StudyDefinition:
    text = Path(path).read_text()
    try:
        data = parse_yaml(text, path)
    except ValueError as error:
        raise StudyDefinitionError(str(error)) from None
    study = parse_study(data, str(path))
    if study.evaluation.prompts is not None:
        try:  # refused at launch, not at the first trial's evaluation
            read_prompts(Path(study.evaluation.prompts), name="field evaluate.prompts")
        except ValueError as error:
            raise StudyDefinitionError(f"{path}: {error}") from None
    study.source_text = text
    return study
