"""Optuna study runner: a trial is one harness run with knobs the sampler chose; nothing more.

One MLflow parent run per study, one nested child run per trial and per baseline. Optuna's RDB
storage (SQLite by default, PostgreSQL for many workers) makes studies resumable and shareable.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlflow
import optuna
import torch

from algorithms import AlgorithmConfig
from algorithms.metrics import ACCEPTED_LENGTHS
from algorithms.registry import draft_config, with_design_point
from harness import tracking
from harness.config import RunConfig, TrainConfig, decay_steps
from harness.data import DataConfig
from harness.evaluate import evaluate, log_evaluation
from harness.files import file_lock
from harness.pareto import pareto_front
from harness.run import Run
from harness.serving import metrics as served_names
from harness.tracking import RunStatus
from harness.train import TrainedRun, Workspaces, train, with_target_defaults
from studies.claims import Claims, ClaimState
from studies.schema import DESIGN_SAMPLER, PUBLISHED_SUFFIX, StudyDefinition, StudyDefinitionError
from studies.storage import (
    ATTR_DEFINITION,
    ATTR_DESIGN_POINT,
    ATTR_EVALUATED,
    ATTR_FAIL_REASON,
    ATTR_INFEASIBLE,
    ATTR_INTERRUPTED,
    ATTR_ORIGIN,
    ATTR_PARENT_RUN,
    ATTR_PRUNED,
    ATTR_RUN_ID,
    ATTR_SEED_VALUES,
    ATTR_SERVED,
    ATTR_WORKER,
    heartbeat_grace_s,
    make_storage,
    pruning_hook,
    requeue_interrupted,
    storage_url,
)
from studies.torchrun_job import RunJob, TrialLink

log = logging.getLogger(__name__)
CLAIM_POLL_S = 2.0  # how often a launcher waiting on another's baseline or parent run looks again
PARENT_CLAIM = "parent-run"
DESIGN_CLAIM = "design-points"  # the one launcher that enqueues a design's points
NO_POINT_LEFT = "no design point left: another worker took the last one"
STUDY_FILES_DIR = "studies"  # in the work directory: one folder per study, named after it
SUMMARY_FILE = "summary.json"
DEFINITION_FILE = "study.yaml"  # the study file as launched, also on the parent run
FINALIZE_LOCK = ".finalize.lock"  # held by the one launcher writing the summary onto the parent run
BUDGET_PARAM = "budget"  # a design trial's step budget, among its Optuna params in a study with several budgets


class TrunkPending(Exception):
    """A branch trial met its trunk still queued: it went back into the queue behind it."""


def make_sampler(definition: StudyDefinition, trials_so_far: int = 0) -> optuna.samplers.BaseSampler:
    """The study's sampler. A random or TPE seed moves on with the trials already stored, so a relaunched
    study continues the search instead of replaying the first launch's suggestions. A grid keeps its seed:
    its stored cell ids index the seed's shuffled grid, and it never revisits a cell anyway."""
    if definition.sampler == "grid":
        grid = {d.knob: d.grid_values() for d in definition.search_space}
        return optuna.samplers.GridSampler(grid, seed=definition.sampler_seed)
    seed = definition.sampler_seed + trials_so_far
    if definition.sampler in ("random", DESIGN_SAMPLER):  # a design's trials are enqueued: nothing is sampled
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, multivariate=True)


def make_pruner(definition: StudyDefinition) -> optuna.pruners.BasePruner:
    if not definition.prunes:
        return optuna.pruners.NopPruner()
    if definition.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=max(1, definition.base.train.eval_every), max_resource=definition.steps_per_trial
        )
    return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=definition.pruner_warmup_steps)


def open_study(definition: StudyDefinition, url: str) -> optuna.Study:
    """Create or resume; a stored study with a different definition is an error, not a silent mix."""
    study = optuna.create_study(
        study_name=definition.name,
        storage=make_storage(url),
        directions=definition.directions,
        sampler=make_sampler(definition),
        pruner=make_pruner(definition),
        load_if_exists=True,
    )
    stored = study.user_attrs.get(ATTR_DEFINITION)
    if stored is None:
        study.set_user_attr(ATTR_DEFINITION, definition.source_text)
    elif stored != definition.source_text:
        raise StudyDefinitionError(
            f"study {definition.name!r} already exists in {url} with a different definition "
            f"({first_difference(stored, definition.source_text)}); rename the study or restore the file"
        )
    study.sampler = make_sampler(definition, len(study.get_trials(deepcopy=False)))
    return study


def first_difference(stored: str, current: str) -> str:
    """Where two study files first differ, as `line N: 'stored' -> 'current'`."""
    old, new = stored.splitlines(), current.splitlines()
    for number, (before, after) in enumerate(itertools.zip_longest(old, new, fillvalue=""), 1):
        if before != after:
            return f"line {number}: {before.strip()!r} -> {after.strip()!r}"
    return "whitespace only"


def study_files(workdir: Path, name: str) -> Path:
    """The work directory's folder for a study's own files (its definition as launched, its summary)."""
    return workdir / STUDY_FILES_DIR / name


def finished_count(study: optuna.Study) -> int:
    """Trials that used budget: complete, pruned, or failed for a reason other than an interruption."""
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
    interrupted = set(study.user_attrs.get(ATTR_INTERRUPTED, []))
    return sum(1 for t in study.get_trials(deepcopy=False, states=states) if t.number not in interrupted)


def failed_trials(study: optuna.Study) -> dict[int, str]:
    """Trials that failed for a reason other than an interruption (whose point runs again), with the reason."""
    interrupted = set(study.user_attrs.get(ATTR_INTERRUPTED, []))
    return {
        t.number: t.user_attrs.get(ATTR_FAIL_REASON, "no reason recorded")
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
        if t.number not in interrupted
    }


def with_budget(
    definition: StudyDefinition,
    algorithm: AlgorithmConfig,
    seed: int | None = None,
    steps: int | None = None,
    train: TrainConfig | None = None,
    data: DataConfig | None = None,
) -> RunConfig:
    """A run of the study: its data, target and training knobs (default: the base's) at `steps` (default: the
    study's first step budget) and `seed`. With budgets as branches, a run at the longest budget is a trunk that
    keeps a stable checkpoint for each shorter one."""
    base = definition.base
    steps = definition.steps_per_trial if steps is None else steps
    trunk = definition.branches and steps == definition.budgets[-1]
    train_config = dataclasses.replace(
        train or base.train,
        max_steps=steps,
        seed=base.train.seed if seed is None else seed,
        branches=definition.budgets[:-1] if trunk else [],
    )
    return RunConfig(algorithm, train_config, data or base.data, base.target)


def as_branch_of(config: RunConfig, trunk_run: str) -> RunConfig:
    """A shorter budget's run as a WSD branch of the trunk run of its point and seed."""
    return dataclasses.replace(config, train=dataclasses.replace(config.train, branch_of=trunk_run))


def is_branch(definition: StudyDefinition, steps: int) -> bool:
    return definition.branches and steps != definition.budgets[-1]


def design_point(params: dict) -> dict:
    """A design trial's point: its params without the budget."""
    return {k: v for k, v in params.items() if k != BUDGET_PARAM}


def trial_config(definition: StudyDefinition, params: dict) -> RunConfig:
    """The base config with the sampler's knob values, or at a design point (which may switch components)."""
    if definition.design is not None:
        algorithm = with_design_point(definition.base.algorithm, design_point(params), definition.design.member_knobs)
        return with_budget(definition, algorithm, steps=params.get(BUDGET_PARAM))
    run = definition.base.with_knobs(params)
    return with_budget(definition, run.algorithm, train=run.train, data=run.data)


def check_against_target(definition: StudyDefinition, workdir: Path) -> None:
    """The base, and every design point, against the target's config (no weights): a knob the target cannot
    take is refused at launch, before anything trains, instead of failing every trial."""
    from harness.serving.draft import check_served_format
    from harness.serving.engine import EngineError
    from harness.targets import target_config, target_spec

    spec = target_spec(target_config(definition.base.target, workdir), definition.base.target)
    points = definition.design.points if definition.design is not None else []
    for where, config in [("base", definition.base.algorithm)] + [
        (f"design point {point}", with_design_point(definition.base.algorithm, point, definition.design.member_knobs))
        for point in points
    ]:
        if config.shared.mask_token_id is None:  # the target picks one at train time
            config = config.replace(mask_token_id=0)
        try:
            draft_config(config, spec)
            if definition.served_objectives:  # every trial is served: a member the engine cannot serve is refused
                check_served_format(config.entry)
        except (ValueError, EngineError) as error:
            raise StudyDefinitionError(
                f"study {definition.name!r}: {where}: {error} (target {definition.base.target})"
            ) from None


def enqueue_design(definition: StudyDefinition, study: optuna.Study, claims: Claims) -> None:
    """Queue every design point once as a waiting trial; a relaunch or a second launcher adds none."""
    if definition.design is None or claims.state(DESIGN_CLAIM) == ClaimState.DONE:
        return
    with claims.hold(DESIGN_CLAIM) as mine:
        if not mine:
            return
        queued = [({}, definition.design.points)]
        if definition.longer_budgets:  # every point names its budget; the longer ones run the longer design
            queued = [({BUDGET_PARAM: definition.budgets[0]}, definition.design.points)]
            queued += [({BUDGET_PARAM: steps}, definition.design.longer_points) for steps in definition.longer_budgets]
            if definition.branches:  # the trunks first (the same points at every budget), then their branches
                queued.reverse()
        points = [{**point, **budget} for budget, group in queued for point in group]
        for index, point in enumerate(points):
            study.enqueue_trial(point, user_attrs={ATTR_DESIGN_POINT: index}, skip_if_exists=True)


def waiting_count(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)))


def baseline_config(definition: StudyDefinition, baseline: str, seed: int, steps: int | None = None) -> RunConfig:
    """`NAME`: the base's knobs where NAME has them; `NAME_defaults`: NAME's published knobs. Shared knobs pinned."""
    name = baseline.removesuffix(PUBLISHED_SUFFIX)
    algorithm = definition.base.algorithm.with_algorithm(name)
    if baseline.endswith(PUBLISHED_SUFFIX):
        algorithm = AlgorithmConfig(name, algorithm.shared, algorithm.entry.knobs_class())
    return with_budget(definition, algorithm, seed, steps)


def trial_run_name(study: str, number: int, seed: int | None = None) -> str:
    """`seed` is None in a one-seed study, whose trial runs keep the plain name."""
    return f"{study}-trial-{number}" + (f"-seed{seed}" if seed is not None else "")


def baseline_run_name(study: str, baseline: str, seed: int, longer_steps: int | None = None) -> str:
    """`longer_steps` names a run at a longer budget than the study's first."""
    return f"{study}-baseline-{baseline}-seed{seed}" + (f"-steps{longer_steps}" if longer_steps else "")


def param_importances(definition: StudyDefinition, study: optuna.Study) -> tuple[dict[str, float], str | None]:
    """Optuna's importance of each searched knob for the (first) objective, or none and why not."""
    if definition.design is not None:
        return {}, "not computable: a designed study reports fitted effects instead (see its report)"
    if not definition.search_space:  # asked anyway, Optuna warns that there are too few trials
        return {}, "not computable: the study searches no knob"
    target = (lambda t: t.values[0]) if len(definition.objectives) > 1 else None
    try:
        return optuna.importance.get_param_importances(study, target=target), None
    except (RuntimeError, ValueError, ZeroDivisionError) as error:
        return {}, f"not computable: {error}"


@dataclass
class StudyRunner:
    definition: StudyDefinition
    workspaces: Workspaces
    study: optuna.Study
    parent_run_id: str
    claims: Claims
    device: str = "cpu"
    system_metrics: bool = False
    storage_url: str = ""  # where a torchrun job's rank 0 finds the trial it reports to

    @property
    def workdir(self) -> Path:
        return self.workspaces.workdir

    def _run(self, config: RunConfig, run_name: str, tags: dict, trial: optuna.Trial | None = None):
        """One run of the study, in this process or, with `nproc_per_node` > 1, as a torchrun job; `trial`
        receives its validations (a one-objective study's) and may prune it."""
        options = dict(
            run_name=run_name,
            resume=Run(self.workdir, run_name).exists(),
            tags={tracking.TAG_STUDY: self.definition.name, **tags},
            parent_run_id=self.parent_run_id,
            experiment=tracking.experiment_name(self.definition.name),
            system_metrics=self.system_metrics,
        )
        prunes = self.definition.prunes
        if len(self.definition.objectives) > 1:
            trial = None  # Optuna keeps no intermediate values for a multi-objective trial
        if self.definition.nproc_per_node > 1:
            link = None if trial is None else TrialLink.of(trial, self.storage_url, self.definition.pruner, prunes)
            job = RunJob(config.to_dict(), str(self.workdir), self.device, options, link)
            return job.launch(self.definition.nproc_per_node)
        hook = None if trial is None else pruning_hook(trial, self.definition.pruner, prunes)
        return train(config, self.workspaces.of(config), device=self.device, on_validation=hook, **options)

    def run_baselines(self, wait: bool = False) -> None:
        """Each baseline with the study's pinned shared knobs, per seed, exactly once across every launcher.

        A baseline another live launcher holds is left to it; with `wait`, this launcher waits until each is
        done, and takes over one whose holder died.
        """
        definition = self.definition
        runs = [
            (baseline, seed, steps)
            for baseline in definition.baselines
            for steps in definition.baseline_budgets(baseline)
            for seed in definition.baseline_seeds(baseline)
        ]
        # The first budget first, seed by seed; with budgets as branches, each seed's trunk before its branches
        order = -1 if definition.branches else 1
        pending = sorted(runs, key=lambda run: (order * run[2], run[1]))
        while True:
            for baseline, seed, steps in list(pending):
                name = self.baseline_run(baseline, seed, steps)
                trunk = None
                if is_branch(definition, steps):
                    trunk = self.baseline_run(baseline, seed, definition.budgets[-1])
                if trunk is not None and self.claims.state(trunk) != ClaimState.DONE:
                    continue  # its trunk is another launcher's, still training
                with self.claims.hold(name) as mine:
                    if mine:
                        self._run_baseline(baseline, seed, steps, name, trunk)
                if self.claims.state(name) == ClaimState.DONE:
                    pending.remove((baseline, seed, steps))
            if not pending or not wait:
                return
            time.sleep(CLAIM_POLL_S)

    def baseline_run(self, baseline: str, seed: int, steps: int) -> str:
        longer = steps if steps != self.definition.steps_per_trial else None
        return baseline_run_name(self.definition.name, baseline, seed, longer)

    def _run_baseline(self, baseline: str, seed: int, steps: int, name: str, trunk: str | None) -> None:
        config = baseline_config(self.definition, baseline, seed, steps)
        if trunk is not None:
            config = as_branch_of(config, trunk)
        knobs = dataclasses.asdict(config.algorithm.knobs)
        print(f"[baseline] {baseline} seed {seed}, {steps} steps: {config.algorithm.algorithm} {knobs}", flush=True)
        tags = {tracking.TAG_BASELINE: baseline, tracking.TAG_ROLE: tracking.ROLE_BASELINE}
        result = self._run(config, name, tags)
        print(f"[baseline] {baseline} seed {seed}, {steps} steps: " + _summary(result.validation), flush=True)

    def suggest(self, trial: optuna.Trial) -> dict:
        """The sampler's values for every dimension of the search space; a design trial's enqueued point."""
        params = {}
        if self.definition.design is not None:
            if ATTR_DESIGN_POINT not in trial.user_attrs:
                trial.set_user_attr(ATTR_PRUNED, NO_POINT_LEFT)
                raise optuna.TrialPruned(NO_POINT_LEFT)
            for factor, levels in self.definition.design.design.levels.items():
                params[factor] = trial.suggest_categorical(factor, list(levels))
            if self.definition.longer_budgets:
                params[BUDGET_PARAM] = trial.suggest_categorical(BUDGET_PARAM, self.definition.budgets)
            return params
        for dim in self.definition.search_space:
            if dim.kind == "categorical":
                params[dim.knob] = trial.suggest_categorical(dim.knob, dim.choices)
            elif dim.kind == "int":
                step = dim.step or 1
                params[dim.knob] = trial.suggest_int(dim.knob, int(dim.low), int(dim.high), log=dim.log, step=step)
            else:
                params[dim.knob] = trial.suggest_float(dim.knob, float(dim.low), float(dim.high), log=dim.log)
        return params

    def objective(self, trial: optuna.Trial):
        params = self.suggest(trial)
        config = trial_config(self.definition, params)
        tags = {tracking.TAG_TRIAL: str(trial.number), tracking.TAG_ROLE: tracking.ROLE_TRIAL}
        if self.definition.design is not None:
            tags[tracking.TAG_DESIGN_POINT] = json.dumps(design_point(params), sort_keys=True)
        try:
            target = self.workspaces.of(config).target
            draft_config(with_target_defaults(config, target).algorithm, target.spec)
        except ValueError as error:
            self._record_infeasible(trial, config, tags, str(error))
            raise optuna.TrialPruned(f"infeasible: {error}") from None

        trial.set_user_attr(ATTR_WORKER, f"{socket.gethostname()}:{os.getpid()}")
        duplicate = self._duplicate_of(trial, params)
        if duplicate is not None:  # two workers raced for the last grid cell, or the sampler repeated itself
            reason = f"duplicate configuration, evaluated by trial {duplicate}"
            trial.set_user_attr(ATTR_PRUNED, reason)
            raise optuna.TrialPruned(reason)
        trunk = None
        if is_branch(self.definition, params.get(BUDGET_PARAM, self.definition.steps_per_trial)):
            trunk = self._await_trunk(trial, params)
        print(f"[trial {trial.number}] {params}{self._eta()}", flush=True)
        started = time.time()
        results = []
        try:
            for index, seed in enumerate(self.definition.seeds):
                result = self._run_trial_seed(trial, config, tags, seed, index == 0, trunk)
                if result.stopped_reason:
                    trial.set_user_attr(ATTR_PRUNED, result.stopped_reason)
                    print(f"[trial {trial.number}] {result.stopped_reason}", flush=True)
                    raise optuna.TrialPruned(result.stopped_reason)
                results.append(result)
        except KeyboardInterrupt as stop:  # its runs recorded themselves interrupted; the next launch resumes it
            trial.set_user_attr(ATTR_FAIL_REASON, f"interrupted: {stop or type(stop).__name__}")
            requeue_interrupted(self.study, self.study._storage.get_trial(trial._trial_id))
            raise
        try:
            per_seed = [
                self._objective_values(trial, seed, r) for seed, r in zip(self.definition.seeds, results, strict=True)
            ]
        except Exception as error:  # a served objective's serving failed: the trial fails with the reason
            trial.set_user_attr(ATTR_FAIL_REASON, f"serving: {type(error).__name__}: {error}")
            print(f"[trial {trial.number}] serving failed: {type(error).__name__}: {error}", flush=True)
            raise
        trial.set_user_attr(ATTR_SEED_VALUES, per_seed)
        values = [sum(column) / len(column) for column in zip(*per_seed, strict=True)]  # the mean over seeds
        # A seed's run that had finished before an interruption comes back from its checkpoint's history, whose
        # entries carry more keys than a fresh validation: average only what every seed reports.
        shared = [k for k in ACCEPTED_LENGTHS if all(k in r.validation for r in results)]
        summary = _summary({k: sum(r.validation[k] for r in results) / len(results) for k in shared})
        print(f"[trial {trial.number}] {summary} in {time.time() - started:.0f}s", flush=True)
        return values[0] if len(values) == 1 else values

    def completed_at_first_budget(self) -> list[optuna.trial.FrozenTrial]:
        """Completed trials at the study's first budget, among which the best is chosen: a longer budget's values
        are about other drafts."""
        first = self.definition.steps_per_trial
        done = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        return [t for t in done if t.params.get(BUDGET_PARAM, first) == first]

    def best_of(self, trials: list[optuna.trial.FrozenTrial]) -> optuna.trial.FrozenTrial:
        """The best of single-objective `trials` in the objective's direction."""
        pick = max if self.definition.directions[0] == "maximize" else min
        return pick(trials, key=lambda t: t.value)

    def trial_run(self, number: int, seed: int) -> str:
        return trial_run_name(self.definition.name, number, seed if len(self.definition.seeds) > 1 else None)

    def _run_trial_seed(
        self, trial: optuna.Trial, config: RunConfig, tags: dict, seed: int, first: bool, trunk: int | None
    ):
        """One seed of a trial, a branch of trial `trunk`'s run of that seed if given. Only the first seed reports
        to the pruner: Optuna keeps one value per step."""
        run_name = self.trial_run(trial.user_attrs.get(ATTR_ORIGIN, trial.number), seed)
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, seed=seed))
        if trunk is not None:
            config = as_branch_of(config, self.trial_run(trunk, seed))
        try:
            result = self._run(config, run_name, tags, trial if first else None)
        except Exception as error:
            trial.set_user_attr(ATTR_FAIL_REASON, f"{type(error).__name__}: {error}")
            print(f"[trial {trial.number}] failed: {type(error).__name__}: {error}", flush=True)
            raise
        if first:
            trial.set_user_attr(ATTR_RUN_ID, result.run_id)
        return result

    def _objective_values(self, trial: optuna.Trial, seed: int, result) -> list[float]:
        """One seed's objective values: validation metrics of its run, or, for a served objective, the run served
        now by the study's engine on its prompts (once: a run served before a kill is read back)."""
        served = {}
        if self.definition.served_objectives:
            name = self.trial_run(trial.user_attrs.get(ATTR_ORIGIN, trial.number), seed)
            served = self._served(name, f"served for the objective {self.definition.objectives}", speed_only=True)
        return [
            served[served_names.OBJECTIVES[o]] if o in served_names.OBJECTIVES else result.validation[o]
            for o in self.definition.objectives
        ]

    def _served(self, name: str, why: str, speed_only: bool = False) -> dict[str, float]:
        """The run's served/* metrics: the run served now by the study's engine on its prompts (for its speed alone,
        in rounds, or compared with the harness cycle by cycle), or read back when a serving of it finished before
        (served/* landed, but a kill came before the study noted it: served once is enough)."""
        from harness.serving.compare import serve_run, serve_speed_run, served_status
        from harness.serving.engine import find_engine

        run = Run(self.workdir, name, tracking.experiment_name(self.definition.name))
        trained = TrainedRun.load(run)  # and the run's MLflow id with it
        if served_status(run) is RunStatus.FINISHED:
            return run.metrics(served_names.PREFIX)
        workspace = self.workspaces.of(trained.config)
        draft = trained.draft(workspace.target, self.device)
        print(f"[serve] {name}: {why}", flush=True)
        evaluation, documents = self.definition.evaluation, workspace.data.validation
        if speed_only:
            replies = workspace.data.train  # a reduced draft vocabulary's tokens: those its replies use most
            return serve_speed_run(find_engine(), run, workspace.target, draft, documents, evaluation, replies)
        return serve_run(find_engine(), run, workspace.target, draft, documents, evaluation)

    def _await_trunk(self, trial: optuna.Trial, params: dict) -> int:
        """The trial whose runs a branch trial anneals (its point at the longest budget; a retry's runs carry the
        first trial's name), once every seed's stable checkpoint for this budget exists. A trunk another worker
        trains is waited for; one still queued defers this trial behind it; one that ended without the
        checkpoint fails this trial with the trunk's reason."""
        steps = params[BUDGET_PARAM]
        stable = steps - decay_steps(steps, self.definition.base.train.decay_ratio)
        point = self.definition.design.points.index(design_point(params))  # the trunks are queued first, in order
        while True:
            trunks = [t for t in self.study.get_trials(deepcopy=False) if t.user_attrs.get(ATTR_DESIGN_POINT) == point]
            origin = min(t.number for t in trunks)
            runs = [Run(self.workdir, self.trial_run(origin, seed)) for seed in self.definition.seeds]
            if all(run.stable_checkpoint_path(stable).is_file() for run in runs):
                return origin
            states = {t.state for t in trunks}
            if optuna.trial.TrialState.RUNNING in states:
                time.sleep(CLAIM_POLL_S)
                optuna.storages.fail_stale_trials(self.study)  # a dead worker's trunk goes back into the queue
                continue
            if optuna.trial.TrialState.WAITING in states:
                reason = f"deferred: its trunk, trial {origin}, has not trained to step {stable} yet"
                print(f"[trial {trial.number}] {reason}", flush=True)
                trial.set_user_attr(ATTR_FAIL_REASON, reason)
                requeue_interrupted(self.study, self.study._storage.get_trial(trial._trial_id))
                raise TrunkPending(reason)
            ended = max(trunks, key=lambda t: t.number)
            why = ended.user_attrs.get(ATTR_FAIL_REASON) or ended.user_attrs.get(ATTR_PRUNED) or ended.state.name
            reason = f"its trunk, trial {origin}, ended without a stable checkpoint at step {stable}: {why}"
            trial.set_user_attr(ATTR_FAIL_REASON, reason)
            print(f"[trial {trial.number}] failed: {reason}", flush=True)
            raise RuntimeError(reason)

    def _duplicate_of(self, trial: optuna.Trial, params: dict) -> int | None:
        busy = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING)
        for other in self.study.get_trials(deepcopy=False, states=busy):
            if (
                other.number < trial.number
                and other.params == params
                and other.number != trial.user_attrs.get(ATTR_ORIGIN)
            ):
                return other.number
        return None

    def _record_infeasible(self, trial: optuna.Trial, config: RunConfig, tags: dict, reason: str) -> None:
        trial.set_user_attr(ATTR_INFEASIBLE, reason)
        print(f"[trial {trial.number}] infeasible {trial.params}: {reason}", flush=True)
        run = Run(
            self.workdir,
            trial_run_name(self.definition.name, trial.number),
            tracking.experiment_name(self.definition.name),
        )
        run_id = run.record_without_training(
            {tracking.TAG_STUDY: self.definition.name, **tags},
            config.flat_params(),
            self.parent_run_id,
            RunStatus.INFEASIBLE,
            reason,
        )
        trial.set_user_attr(ATTR_RUN_ID, run_id)

    def _eta(self) -> str:
        durations = [
            (t.datetime_complete - t.datetime_start).total_seconds()
            for t in self.study.get_trials(deepcopy=False)
            if t.datetime_complete and t.datetime_start and t.state == optuna.trial.TrialState.COMPLETE
        ]
        remaining = max(0, self.definition.n_trials - finished_count(self.study))
        if not durations:
            return f" ({remaining} trials left)"
        return f" ({remaining} trials left, ETA {sum(durations) / len(durations) * remaining / 60:.1f} min)"

    def optimize(self) -> None:
        definition = self.definition

        def stop_when_budget_used(study: optuna.Study, _trial) -> None:
            if finished_count(study) >= definition.n_trials:
                study.stop()

        if definition.design is not None:  # every point runs once: work until the queue is empty
            optuna.storages.fail_stale_trials(self.study)  # a dead worker's point goes back into the queue
            if waiting_count(self.study):
                self.study.optimize(
                    self.objective,
                    callbacks=[lambda study, _trial: None if waiting_count(study) else study.stop()],
                    catch=(Exception,),
                    gc_after_trial=True,
                )
            return
        if finished_count(self.study) >= definition.n_trials:
            return
        if definition.sampler == "grid":  # stop a grid once every cell is tried, whatever n_trials says
            cells = 1
            for dim in definition.search_space:
                cells *= len(dim.grid_values())
            if finished_count(self.study) >= cells:
                return
        self.study.optimize(
            self.objective,
            timeout=definition.timeout_s,
            callbacks=[stop_when_budget_used],
            catch=(Exception,),
            gc_after_trial=True,
        )

    def evaluate_best(self) -> None:
        """Opt-in: real speculative decoding for the best N completed trials, logged into their runs."""
        if not self.definition.evaluate_best or len(self.definition.objectives) > 1:
            return
        done = sorted(self.completed_at_first_budget(), key=lambda t: -t.value)
        for trial in done[: self.definition.evaluate_best]:
            if trial.number in self.study.user_attrs.get(ATTR_EVALUATED, []):
                continue
            name = self.trial_run(trial.user_attrs.get(ATTR_ORIGIN, trial.number), self.definition.seeds[0])
            run = Run(self.workdir, name, tracking.experiment_name(self.definition.name))
            trained = TrainedRun.load(run)
            workspace = self.workspaces.of(trained.config)
            draft = trained.draft(workspace.target, self.device)
            print(
                f"[evaluate] trial {trial.number}: speculative decoding on MT-bench and held-out chat prompts",
                flush=True,
            )
            metrics, records = evaluate(workspace.target, draft, workspace.data.validation, self.definition.evaluation)
            log_evaluation(run, metrics, records)
            self.study.set_user_attr(ATTR_EVALUATED, [*self.study.user_attrs.get(ATTR_EVALUATED, []), trial.number])

    def serve_best(self) -> None:
        """Opt-in (`evaluate.serve`): the best run and the reference arm's first run served by the engine, on the
        study's prompts, compared with the harness cycle by cycle (once per run)."""
        if self.definition.serve is None:
            return
        done = self.completed_at_first_budget()
        names = []
        if done and len(self.definition.objectives) == 1:
            best = self.best_of(done)
            names.append(self.trial_run(best.user_attrs.get(ATTR_ORIGIN, best.number), self.definition.seeds[0]))
        reference = self.definition.design.reference if self.definition.design else None
        if reference:
            names.append(baseline_run_name(self.definition.name, reference, self.definition.seeds[0]))
        for name in names:
            if name in self.study.user_attrs.get(ATTR_SERVED, []):
                continue
            self._served(name, "llama.cpp against the harness on the same prompts")
            self.study.set_user_attr(ATTR_SERVED, [*self.study.user_attrs.get(ATTR_SERVED, []), name])

    def register(self, best: optuna.trial.FrozenTrial) -> str:
        """The best trial's first-seed run's export as a version of the study's registered model (`evaluate.register`),
        named on the parent run."""
        name = self.trial_run(best.user_attrs.get(ATTR_ORIGIN, best.number), self.definition.seeds[0])
        run = Run(self.workdir, name, tracking.experiment_name(self.definition.name))
        run.load_checkpoint()  # and the run's MLflow id with it
        registered = f"{self.definition.register} version {run.register_export(self.definition.register)}"
        tracking.client(self.workdir).set_tag(self.parent_run_id, tracking.TAG_REGISTERED_MODEL, registered)
        return registered

    def finalize(self) -> dict:
        """Best values and importances on the parent run; returns the summary printed to the user."""
        summary: dict = {"study": self.definition.name, "trials": {}}
        for state in optuna.trial.TrialState:
            count = len(self.study.get_trials(deepcopy=False, states=(state,)))
            if count:
                summary["trials"][state.name.lower()] = count
        if failed := failed_trials(self.study):
            summary["failed_trials"] = failed
        completed = self.completed_at_first_budget()
        client = tracking.client(self.workdir)
        logged = tracking.ChangedMetrics(client, self.parent_run_id)
        if completed:
            if len(self.definition.objectives) == 1:
                best = self.best_of(completed)
                summary["best"] = {
                    "trial": best.number,
                    "value": best.value,
                    "params": best.params,
                    "mlflow_run_id": best.user_attrs.get(ATTR_RUN_ID),
                }
                objective = self.definition.objectives[0]
                logged.log(f"{tracking.BEST_PREFIX}{objective}", best.value)
                client.set_tag(self.parent_run_id, tracking.TAG_BEST_TRIAL, f"trial {best.number}")
                client.set_tag(self.parent_run_id, tracking.TAG_BEST_RUN_ID, best.user_attrs.get(ATTR_RUN_ID, ""))
                client.set_tag(
                    self.parent_run_id,
                    tracking.TAG_NOTE,
                    f"best: trial {best.number}, {objective} {best.value:.3f} (seeds {self.definition.seeds})",
                )
                if self.definition.register is not None:
                    summary["registered"] = self.register(best)
            else:
                best = pareto_front([(t, t.values) for t in completed], self.definition.directions)
                summary["pareto_front"] = [{"trial": t.number, "values": t.values, "params": t.params} for t in best]
                front = ", ".join(f"trial {t.number}" for t in sorted(best, key=lambda t: t.number))
                client.set_tag(self.parent_run_id, tracking.TAG_PARETO_FRONT, front)
            importances, note = param_importances(self.definition, self.study)
            if note:
                summary["importance_note"] = note
            summary["importances"] = importances
            for knob, value in importances.items():
                logged.log(f"{tracking.IMPORTANCE_PREFIX}{knob}", value)
        client.set_tag(
            self.parent_run_id, tracking.TAG_TRIALS_USED, f"{finished_count(self.study)} of {self.definition.n_trials}"
        )
        path = study_files(self.workdir, self.definition.name) / SUMMARY_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2, default=str))
        client.log_artifact(self.parent_run_id, str(path))
        return summary


def _summary(values: dict[str, float]) -> str:
    return " ".join(f"{name.split('_accepted')[0]}={values[name]:.3f}" for name in ACCEPTED_LENGTHS if name in values)


def ensure_parent_run(definition: StudyDefinition, study: optuna.Study, workdir: Path, claims: Claims) -> str:
    """The study's MLflow parent run: created once by whichever launcher claims it first."""
    experiment_id = tracking.configure(workdir, tracking.experiment_name(definition.name))
    deadline = time.time() + claims.grace_s + 60
    while not study.user_attrs.get(ATTR_PARENT_RUN):
        with claims.hold(PARENT_CLAIM) as mine:
            if mine:
                study.set_user_attr(ATTR_PARENT_RUN, _create_parent_run(definition, workdir, experiment_id))
                break
        if time.time() > deadline:
            raise RuntimeError(f"study {definition.name!r}: no launcher created its MLflow parent run")
        time.sleep(CLAIM_POLL_S / 4)
    parent = study.user_attrs[ATTR_PARENT_RUN]
    try:
        stage = tracking.client(workdir).get_run(parent).info.lifecycle_stage
    except mlflow.exceptions.MlflowException:
        stage = "gone"
    if stage != "active":
        fix = "launch under another study name"
        if stage == "deleted":
            fix = f"restore it (`mlflow runs restore --run-id {parent}`) or {fix}"
        raise LookupError(
            f"study {definition.name!r}: its MLflow parent run {parent} was deleted"
            f"{'' if stage == 'deleted' else ' for good'}, and its trials' runs nest under it; {fix}"
        )
    return parent


def _create_parent_run(definition: StudyDefinition, workdir: Path, experiment_id: str) -> str:
    client = tracking.client(workdir)
    run = client.create_run(
        experiment_id,
        run_name=f"study-{definition.name}",
        tags={
            tracking.TAG_STUDY: definition.name,
            tracking.TAG_ROLE: tracking.ROLE_STUDY,
            tracking.TAG_OBJECTIVES: ",".join(definition.objectives),
            tracking.TAG_NOTE: definition.description or f"study {definition.name}",
            tracking.TAG_STATUS: RunStatus.RUNNING.value,
            **tracking.who_and_where(),
        },
    )
    pinned = with_budget(definition, definition.base.algorithm)  # the steps every run actually trains
    params = {
        **{f"{tracking.PINNED_PREFIX}{k}": v for k, v in pinned.flat_params().items()},
        f"{tracking.PINNED_PREFIX}target": definition.base.target,
        **{
            f"{tracking.STUDY_PREFIX}{k}": v
            for k, v in {
                "sampler": definition.sampler,
                "pruner": definition.pruner,
                "n_trials": definition.n_trials,
                "steps_per_trial": definition.steps_per_trial,
                "objectives": ",".join(definition.objectives),
                "search_space": json.dumps({d.knob: dataclasses.asdict(d) for d in definition.search_space}),
                "baselines": ",".join(definition.baselines),
                "seeds": ",".join(map(str, definition.seeds)),
                **(
                    {
                        "design": json.dumps(definition.design.spec, default=str),
                        "design_margin": definition.design.margin,
                        "design_interactions": definition.design.interactions,
                        "design_reference": definition.design.reference or "",
                        "reference_seeds": ",".join(map(str, definition.design.reference_seeds)),
                        "budgets": ",".join(map(str, definition.budgets)),
                        "budgets_by": definition.budgets_by,
                        "longer_design": json.dumps(definition.design.longer_spec, default=str),
                    }
                    if definition.design is not None
                    else {}
                ),
            }.items()
        },
    }
    for key, value in tracking.stringified(params).items():
        client.log_param(run.info.run_id, key, value)
    definition_path = study_files(workdir, definition.name) / DEFINITION_FILE
    definition_path.parent.mkdir(parents=True, exist_ok=True)
    definition_path.write_text(definition.source_text)
    client.log_artifact(run.info.run_id, str(definition_path))
    return run.info.run_id


def pinned(device: str) -> tuple[str, dict[str, str]]:
    """A worker's device inside its own process, and the environment that pins it there: `cuda:N` becomes
    `cuda` with CUDA_VISIBLE_DEVICES=N, so the worker sees one GPU and cannot touch another's."""
    if device.startswith("cuda"):
        return "cuda", {"CUDA_VISIBLE_DEVICES": device.partition(":")[2] or "0"}
    return device, {}


def worker_devices(device: str, n_jobs: int, devices: list[str] | None) -> tuple[str, list[str]]:
    """This process's device and one device per extra worker: `--devices` lists one per worker (this process
    takes the first, by explicit index); without it, `--n-jobs` workers share `--device` (CPU studies)."""
    if devices:
        return devices[0], devices[1:]
    return device, [device] * (n_jobs - 1)


def cpu_threads(workers: int) -> int:
    """Each of `workers` CPU processes' share of this machine's cores."""
    return max(1, (os.cpu_count() or 2) // workers)


def spawn_workers(
    study_file: Path, devices: list[str], workdir: Path, url: str, system_metrics: bool = False
) -> list[subprocess.Popen]:
    """Extra worker processes, one per device, that join the same study through the shared storage."""
    workers = []
    for number, device in enumerate(devices, 1):
        inside, environment = pinned(device)
        if inside == "cpu":  # CPU workers share the cores: one share each, like the launcher's own
            environment["OMP_NUM_THREADS"] = str(cpu_threads(len(devices) + 1))
        args = [sys.executable, "-m", "harness.cli", "study", "launch", str(study_file), "--worker"]
        args += ["--workdir", str(workdir), "--storage", url, "--device", inside, "--no-report"]
        args += ["--system-metrics"] if system_metrics else []
        workers.append(subprocess.Popen(args, env={**os.environ, **environment, "DFLASH_LAB_WORKER": str(number)}))
    return workers


class StackFreeStop(logging.Filter):
    """Optuna logs a trial stopped by SIGTERM or Ctrl-C as failed, with the whole stack: keep its one line (the
    trial and the stop), drop the stack. The command's own one-line message comes last."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt):
            record.exc_info, record.exc_text = None, None
        return True


OPTUNA_TRIAL_LOGGER = "optuna.study._optimize"  # the logger of Optuna's 'Trial N failed ...' lines


def quiet_stops_in_optuna_log() -> None:
    logger = logging.getLogger(OPTUNA_TRIAL_LOGGER)
    if not any(isinstance(f, StackFreeStop) for f in logger.filters):
        logger.addFilter(StackFreeStop())


def launch(
    definition: StudyDefinition,
    study_file: Path,
    workdir: Path,
    storage: str | None = None,
    device: str = "cpu",
    n_jobs: int = 1,
    worker: bool = False,
    system_metrics: bool = False,
    devices: list[str] | None = None,
) -> dict:
    """Create or resume the study, run baselines (launcher only) and trials, and summarise.

    With `devices`, one worker per listed device: this process on the first, a pinned subprocess on each other.
    """
    quiet_stops_in_optuna_log()
    device, others = worker_devices(device, n_jobs, devices)
    url = storage_url(workdir, storage)
    workdir.mkdir(parents=True, exist_ok=True)  # the default SQLite storage lives there
    check_against_target(definition, workdir)
    if definition.serve is not None and not worker:  # refused before any run trains, not after the last
        from harness.serving.engine import find_engine

        find_engine()
    study = open_study(definition, url)
    claims = Claims(study._storage, definition.name, heartbeat_grace_s())
    parent = ensure_parent_run(definition, study, workdir, claims)
    if not worker:  # a relaunch reopens a study that a SIGTERM or Ctrl-C stopped
        tracking.mark_status(tracking.client(workdir), parent, RunStatus.RUNNING)
    enqueue_design(definition, study, claims)
    if others and device == "cpu":
        torch.set_num_threads(cpu_threads(len(others) + 1))
    workspaces = Workspaces(workdir, device)  # built when a run needs one: a relaunch with nothing left loads nothing
    if others:  # prepared before the workers start, so that each finds every variant's data and features cached
        for config in definition.data_variants():
            workspaces.of(config)
    mlflow.set_experiment(tracking.experiment_name(definition.name))
    runner = StudyRunner(definition, workspaces, study, parent, claims, device, system_metrics, url)
    workers = spawn_workers(study_file, others, workdir, url, system_metrics) if others else []
    try:
        if not worker:
            runner.run_baselines()
        runner.optimize()
        for process in workers:
            process.wait()
        if not worker:
            runner.run_baselines(wait=True)  # those another launcher held, or a dead launcher left
            runner.evaluate_best()
            runner.serve_best()
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: the workers stop too, each recording its trial
        for process in workers:
            process.terminate()
        for process in workers:
            process.wait()
        if not worker:  # KILLED in MLflow until a relaunch reopens it
            reason = str(stop) or type(stop).__name__
            tracking.mark_status(tracking.client(workdir), parent, RunStatus.INTERRUPTED, reason)
        raise
    except Exception as error:  # a failed evaluation or serving step: the parent is not left running
        if not worker:
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            tracking.mark_status(tracking.client(workdir), parent, RunStatus.FAILED, reason)
        raise
    if worker:
        return {"study": definition.name, "worker": True}
    # Launchers that end together would otherwise create the parent's new tags at once (MLflow checks, then
    # inserts) and log its best values twice.
    with file_lock(study_files(workdir, definition.name) / FINALIZE_LOCK, f"summarising study {definition.name}"):
        summary = runner.finalize()
        tracking.mark_status(tracking.client(workdir), parent, RunStatus.FINISHED)
    return summary
