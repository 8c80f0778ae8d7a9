"""Study runner pieces that need no target: relaunches continue the search, and a changed file says what changed."""

from pathlib import Path

import pytest

from harness.design import design_from_spec
from studies.runner import BUDGET_PARAM, baseline_config, open_study, trial_config
from studies.schema import StudyDefinitionError, load_study, parse_study

ROOT = Path(__file__).parent.parent


def _first_suggestion(definition, url):
    study = open_study(definition, url)
    trial = study.ask()
    params = {
        "selector_rank": trial.suggest_int("selector_rank", 16, 128, log=True),
        "selector_loss_alpha": trial.suggest_float("selector_loss_alpha", 0.1, 2.0, log=True),
    }
    study.tell(trial, 1.0)
    return params


def test_a_relaunched_study_continues_the_search_instead_of_replaying_it(tmp_path):
    definition = load_study(ROOT / "studies" / "search.yaml")
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    suggestions = [_first_suggestion(definition, url) for _ in range(3)]
    assert len({tuple(sorted(s.items())) for s in suggestions}) == 3


def test_a_changed_study_file_names_the_first_difference(tmp_path):
    definition = load_study(ROOT / "studies" / "search.yaml")
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    open_study(definition, url)
    definition.source_text = definition.source_text.replace("n_trials: 5", "n_trials: 6")
    with pytest.raises(StudyDefinitionError, match=r"different definition \(line \d+: 'budget: \{n_trials: 5"):
        open_study(definition, url)


def test_unknown_budget_keys_are_errors():
    import yaml

    data = yaml.safe_load((ROOT / "studies" / "search.yaml").read_text())
    data["budget"]["n_trails"] = 3
    with pytest.raises(StudyDefinitionError, match=r"invalid field budget.n_trails=3: allowed keys \['n_trials'"):
        parse_study(data)


def test_component_baselines_pin_every_shared_knob_and_share_the_base_knobs():
    import yaml

    data = yaml.safe_load((ROOT / "studies" / "search.yaml").read_text())
    data["baselines"] = ["dflash", "dflash+conv", "dflash+selector", "dflash2"]
    definition = parse_study(data)
    base = definition.base.algorithm
    configs = {name: baseline_config(definition, name, seed=1) for name in definition.baselines}
    assert set(configs) == {"dflash", "dflash+conv", "dflash+selector", "dflash2"}
    for name, config in configs.items():
        assert config.algorithm.algorithm == name
        assert config.algorithm.shared == base.shared
        assert config.train.seed == 1 and config.train.max_steps == definition.steps_per_trial
    assert configs["dflash+conv"].algorithm.knobs.conv_group_size == base.knobs.conv_group_size
    assert configs["dflash+selector"].algorithm.knobs.selector_rank == base.knobs.selector_rank
    assert configs["dflash2"].algorithm == base


def test_published_default_baselines_take_the_published_knobs():
    definition = load_study(ROOT / "studies" / "search.yaml")
    published = baseline_config(definition, "dflash2_defaults", seed=0).algorithm
    assert published.knobs.selector_rank == 256 and published.shared == definition.base.algorithm.shared
    trial = trial_config(definition, {"selector_rank": 32, "candidate_top_k": 8}).algorithm
    assert (trial.knobs.selector_rank, trial.shared.candidate_top_k) == (32, 8)


@pytest.mark.parametrize(("section", "key"), [("sampler", "sede"), ("pruner", "warmup")])
def test_unknown_sampler_and_pruner_keys_are_errors(section, key):
    import yaml

    data = yaml.safe_load((ROOT / "studies" / "search.yaml").read_text())
    data[section][key] = 1
    with pytest.raises(StudyDefinitionError, match=rf"invalid field {section}.{key}=1: allowed keys \['type'"):
        parse_study(data)


def test_n_jobs_auto_picks_two_one_thread_workers_on_a_multicore_cpu():
    from studies.cli import resolve_n_jobs

    assert resolve_n_jobs("auto", "cpu", cores=2) == 2 and resolve_n_jobs("auto", "cpu", cores=16) == 2
    assert resolve_n_jobs("auto", "cpu", cores=1) == 1 and resolve_n_jobs("auto", "cuda", cores=16) == 1
    assert resolve_n_jobs("3", "cpu") == 3
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(SystemExit, match=rf"error: invalid --n-jobs={bad}: allowed an integer >= 1 or auto"):
            resolve_n_jobs(bad, "cpu")


def _design_data(**design):
    import yaml

    data = yaml.safe_load((ROOT / "studies" / "default.yaml").read_text())
    del data["design"]["transfer_measured"]  # it names the shipped factors, which these variations change
    data["design"].update(design)
    return data


def test_the_component_design_picks_each_variant_with_the_base_knobs():
    definition = load_study(ROOT / "studies" / "components.yaml")
    assert [p for p in definition.design.points] == [
        {"conv": False, "selector": False},
        {"conv": True, "selector": False},
        {"conv": False, "selector": True},
        {"conv": True, "selector": True},
    ]
    configs = [trial_config(definition, point).algorithm for point in definition.design.points]
    assert [c.algorithm for c in configs] == ["dflash", "dflash+conv", "dflash+selector", "dflash2"]
    base = definition.base.algorithm
    assert all(c.shared == base.shared for c in configs) and configs[3] == base
    assert configs[1].knobs.conv_kernel_size == base.knobs.conv_kernel_size
    assert configs[2].knobs.selector_rank == base.knobs.selector_rank
    assert definition.n_trials == 4 and definition.pruner == "none" and definition.seeds == [0, 1, 2]


def test_the_main_job_design_is_a_resolution_five_half_fraction_with_dflash_as_reference():
    definition = load_study(ROOT / "studies" / "default.yaml")
    design = definition.design.design
    assert design.resolution == 5 and len(design.points()) == 16 == definition.n_trials
    assert definition.design.reference == "dflash" and definition.baselines == ["dflash"]
    for point in design.points():
        config = trial_config(definition, point).algorithm
        assert config.knobs.conv_kernel_size == point["conv_kernel_size"]
        assert config.shared.candidate_top_k == point["candidate_top_k"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"pruner": {"type": "median"}}, "invalid field pruner={'type': 'median'}: allowed no sampler and no pruner"),
        ({"sampler": {"type": "tpe"}}, "invalid field sampler={'type': 'tpe'}: allowed no sampler and no pruner"),
        ({"search_space": {"selector_rank": [8, 16]}}, "invalid field search_space="),
        ({"seeds": [0, 0]}, "invalid field seeds=[0, 0]: allowed a non-empty list of distinct integers"),
        ({"seeds": [True]}, "invalid field seeds.0=True: allowed a valid integer"),
        ({"seeds": [-1]}, "invalid field seeds.0=-1: allowed greater than or equal to 0"),
        ({"seeds": [10**20]}, "invalid field seeds.0=100000000000000000000: allowed less than 4294967296"),
        ({"seeds": []}, "invalid field seeds=[]: allowed"),
    ],
)
def test_bad_design_files_get_one_line(change, message):
    data = _design_data()
    data.update(change)
    with pytest.raises(StudyDefinitionError) as error:
        parse_study(data, "default.yaml")
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("design", "message"),
    [
        ({"type": "latin"}, "invalid field design.type='latin': allowed 'factorial' or 'one_at_a_time'"),
        ({"fraction": 2}, "resolution 3 fraction (defining word I=candidate_top_k×conv_group_size×conv_kernel_size)"),
        ({"fraction": 3}, "invalid fraction=3 for 5 factors: allowed 0 or one of [1, 2]"),
        ({"factors": {"conv_kernel_size": [1, 2, 3]}}, "exactly two levels, low and high, in a factorial"),
        ({"factors": {"block_size": [4, 8]}}, "invalid field design.factors='block_size': allowed factors from"),
        ({"factors": {"conv": ["yes", "no"]}}, "allowed component levels [off, on]"),
        ({"reference": "dflash2"}, "invalid field design.reference='dflash2': allowed one of the study's baselines"),
        ({"margin": 0}, "invalid field design.margin=0: allowed greater than 0"),
        ({"centre": {"conv_kernel_size": 2}}, "no centre in a factorial"),
        ({"reference_seeds": [0]}, "invalid field design.reference_seeds=[0]: allowed at least two distinct seeds"),
        ({"reference_seeds": [1, 1]}, "invalid field design.reference_seeds=[1, 1]: allowed at least two distinct"),
        ({"longer_fraction": 4}, "invalid field design.longer_fraction: invalid fraction=4 for 5 factors"),
        ({"longer_fraction": 3}, "invalid field design.longer_fraction: invalid fraction=3 for 5 factors"),
        (
            {"transfer_measured": {"steps": 240, "source": "b.md", "labels": {"conv_kernel_size": "kept"}}},
            "invalid field design.transfer_measured.labels.conv_kernel_size='kept': allowed one of ['held', ",
        ),
        (
            {"transfer_measured": {"steps": 240, "source": "b.md", "labels": {"block_size": "held"}}},
            "invalid field design.transfer_measured.labels='block_size': allowed effects from ['conv_kernel_size'",
        ),
        (
            {"transfer_measured": {"steps": 240, "labels": {"arm": "held"}}},
            "invalid field design.transfer_measured.source=None: allowed a value",
        ),
    ],
)
def test_bad_design_sections_name_the_field(design, message):
    data = _design_data(**design)
    with pytest.raises(StudyDefinitionError) as error:
        parse_study(data, "default.yaml")
    assert message in str(error.value), str(error.value)


def test_a_one_at_a_time_design_centres_on_the_base_knobs():
    data = _design_data(type="one_at_a_time", factors={"conv_kernel_size": [1, 2, 3], "selector_rank": [32, 64]})
    del data["design"]["fraction"]
    definition = parse_study(data)
    points = definition.design.points
    assert points[0] == {"conv_kernel_size": 2, "selector_rank": 64} and len(points) == 4


def test_points_and_base_the_target_cannot_take_are_refused_at_launch(tmp_path):
    from studies.runner import check_against_target

    data = _design_data(factors={"conv_group_size": [16, 7]}, fraction=0)
    with pytest.raises(StudyDefinitionError, match=r"design point \{'conv_group_size': 7\}: .*conv_group_size"):
        check_against_target(parse_study(data), tmp_path)
    data = _design_data()
    data["base"]["shared"]["candidate_top_k"] = 10**6
    with pytest.raises(StudyDefinitionError, match=r"study 'default': base: .*candidate_top_k"):
        check_against_target(parse_study(data), tmp_path)
    check_against_target(load_study(ROOT / "studies" / "default.yaml"), tmp_path)  # the shipped one passes


def test_a_served_objective_refuses_at_launch_a_member_the_engine_cannot_serve(tmp_path):
    from studies.runner import check_against_target

    data = _design_data()
    del data["design"]
    data["base"].update(algorithm="domino", knobs={})
    data.update(objective="served_speedup", evaluate={"serve": "llama.cpp"})
    with pytest.raises(StudyDefinitionError, match=r"study 'default': base: .*cannot export a domino draft"):
        check_against_target(parse_study(data), tmp_path)
    data = _design_data(factors={"conv": [False, True], "selector": [False, True]}, fraction=0)
    data.update(objective="served_speedup", evaluate={"serve": "llama.cpp"})
    check_against_target(parse_study(data), tmp_path)  # every component variant is served as DFlash2


def test_the_main_job_runs_its_reference_arm_at_three_seeds_and_one_budget():
    definition = load_study(ROOT / "studies" / "default.yaml")
    assert definition.design.reference_seeds == [0, 1, 2] and definition.seeds == [0]
    cited = definition.design.spec["transfer_measured"]  # the report cites how these carried to 240 steps
    assert cited["steps"] == 240 and set(cited["labels"]) == {"arm", *definition.design.design.factors}
    assert (ROOT / cited["source"]).exists()
    assert definition.budgets == [60] and definition.baseline_budgets("dflash") == [60]
    assert definition.baseline_seeds("dflash") == [0, 1, 2]


def test_the_budget_transfer_study_runs_a_resolution_three_fraction_at_240_steps():
    definition = load_study(ROOT / "studies" / "budget-transfer.yaml")
    assert definition.budgets == [60, 240] and definition.steps_per_trial == 60
    assert len(definition.design.points) == 16 and len(definition.design.longer_points) == 8
    assert definition.n_trials == 24
    assert design_from_spec(definition.design.longer_spec).resolution == 3
    assert definition.baseline_budgets("dflash") == [60, 240]
    # The first budget is the main job's design, point for point.
    assert definition.design.points == load_study(ROOT / "studies" / "default.yaml").design.points
    point = {**definition.design.longer_points[0], BUDGET_PARAM: 240}
    assert trial_config(definition, point).train.max_steps == 240
    assert trial_config(definition, definition.design.points[0]).train.max_steps == 60


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"budgets": [240, 60]}, "invalid field budgets=[240, 60]: allowed step budgets in increasing order"),
        ({"budgets": [60, 60]}, "invalid field budgets=[60, 60]: allowed step budgets in increasing order"),
        ({"budgets": [0, 60]}, "invalid field budgets.0=0: allowed greater than or equal to 1"),
        ({"budgets": [30, 60]}, "invalid field budget.steps_per_trial=60: allowed absent, or the first of budgets"),
    ],
)
def test_bad_budgets_get_one_line(change, message):
    data = _design_data()
    data.update(change)
    with pytest.raises(StudyDefinitionError) as error:
        parse_study(data, "default.yaml")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_longer_budget_needs_a_design():
    import yaml

    data = yaml.safe_load((ROOT / "studies" / "search.yaml").read_text())
    data.pop("budget", None)
    data["budgets"] = [20, 80]
    with pytest.raises(StudyDefinitionError, match=r"invalid field budgets=\[20, 80\]: allowed one budget without"):
        parse_study(data, "search.yaml")


# ---- budgets as warmup-stable-decay branches -------------------------------------------------------------------

BRANCHES = Path(__file__).parent / "data" / "tiny_branches.yaml"


def _branches_data(**changes):
    import yaml

    data = yaml.safe_load(BRANCHES.read_text())
    data.update(changes)
    return data


def test_budgets_as_branches_make_the_longest_run_a_trunk_and_queue_it_first(tmp_path):
    from studies.claims import Claims
    from studies.runner import as_branch_of, enqueue_design, is_branch, with_budget
    from studies.storage import ATTR_DESIGN_POINT

    definition = parse_study(_branches_data())
    assert definition.branches and definition.budgets == [4, 8]
    trunk, branch = (
        with_budget(definition, definition.base.algorithm, 0, 8),
        with_budget(definition, definition.base.algorithm, 0, 4),
    )
    assert trunk.train.branches == [4] and branch.train.branches == [] and branch.train.branch_of is None
    assert is_branch(definition, 4) and not is_branch(definition, 8)
    assert as_branch_of(branch, "trunk-run").train.branch_of == "trunk-run"
    as_branch_of(branch, "trunk-run").validate()
    assert baseline_config(definition, "dflash", 1, 8).train.branches == [4]

    study = open_study(definition, f"sqlite:///{tmp_path / 'optuna.db'}")
    enqueue_design(definition, study, Claims(study._storage, definition.name, grace_s=60))
    queued = [(t.user_attrs[ATTR_DESIGN_POINT], t.system_attrs["fixed_params"]) for t in study.get_trials()]
    points = definition.design.points
    assert queued == [
        (i, {**p, BUDGET_PARAM: s}) for i, (s, p) in enumerate([(8, p) for p in points] + [(4, p) for p in points])
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"budgets": [8]}, "invalid field budgets_by='branches': allowed with two or more budgets"),
        ({"base": "linear"}, "invalid field base.train.schedule='linear': allowed wsd with budgets_by: branches"),
        ({"base": "branches"}, "invalid field base.train.branches=[100]: allowed [] with budgets_by: branches"),
        ({"budgets": [1, 8]}, "budgets [1, 8] as branches: invalid knob branches=[1]"),
        ({"budgets_by": "trunk"}, "invalid field budgets_by='trunk'"),
    ],
)
def test_bad_budgets_as_branches_get_one_line(change, message):
    data = _branches_data()
    if change.get("base") == "linear":
        data["base"]["train"]["schedule"] = "linear"
    elif change.get("base") == "branches":
        data["base"]["train"]["branches"] = [100]
    else:
        data.update(change)
    with pytest.raises(StudyDefinitionError) as error:
        parse_study(data, "tiny_branches.yaml")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_branch_trial_defers_behind_a_queued_trunk_waits_for_none_and_fails_with_a_failed_one(tmp_path):
    """A branch trial whose trunk went back into the queue (a retry, queued behind it) is requeued behind the
    trunk, counted interrupted, not failed; once the trunk's stable checkpoint exists it branches from the trunk's
    first trial's runs; a trunk that failed fails it with the trunk's reason."""
    from types import SimpleNamespace

    import optuna

    from harness.run import Run
    from studies.runner import StudyRunner, TrunkPending, failed_trials, trial_run_name
    from studies.storage import ATTR_DESIGN_POINT, ATTR_FAIL_REASON, ATTR_ORIGIN, requeue_interrupted

    definition = parse_study(_branches_data())
    study = open_study(definition, f"sqlite:///{tmp_path / 'optuna.db'}")
    point = definition.design.points[0]
    runner = StudyRunner(definition, SimpleNamespace(workdir=tmp_path), study, "parent", claims=None)
    study.enqueue_trial({**point, BUDGET_PARAM: 8}, user_attrs={ATTR_DESIGN_POINT: 0})
    study.enqueue_trial({**point, BUDGET_PARAM: 4}, user_attrs={ATTR_DESIGN_POINT: 2})
    trunk = study.ask()
    trunk.suggest_categorical(BUDGET_PARAM, [4, 8])
    requeue_interrupted(study, study._storage.get_trial(trunk._trial_id))  # its worker was killed
    study.tell(trunk, state=optuna.trial.TrialState.FAIL)

    branch = study.ask()
    assert branch.number == 1
    with pytest.raises(TrunkPending, match="deferred: its trunk, trial 0, has not trained to step 3 yet"):
        runner._await_trunk(branch, {**point, BUDGET_PARAM: 4})
    study.tell(branch, state=optuna.trial.TrialState.FAIL)
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [(t.number, t.user_attrs.get(ATTR_ORIGIN)) for t in waiting] == [(2, 0), (3, 1)]
    assert failed_trials(study) == {}, "a deferral is not a failure"

    retry = study.ask()  # the trunk's retry comes first and trains under the first trial's run name
    assert retry.number == 2
    stable = Run(tmp_path, trial_run_name(definition.name, 0)).stable_checkpoint_path(3)
    stable.parent.mkdir(parents=True)
    stable.write_bytes(b"checkpoint")
    study.tell(retry, 2.0)
    again = study.ask()
    assert again.number == 3 and runner._await_trunk(again, {**point, BUDGET_PARAM: 4}) == 0

    stable.unlink()  # now as if the trunk had ended without it
    with pytest.raises(RuntimeError, match="its trunk, trial 0, ended without a stable checkpoint at step 3"):
        runner._await_trunk(again, {**point, BUDGET_PARAM: 4})
    assert "ended without a stable checkpoint" in study._storage.get_trial(again._trial_id).user_attrs[ATTR_FAIL_REASON]


@pytest.mark.parametrize(
    ("space", "message"),
    [
        ({"seed": [0, 1]}, "invalid field search_space='seed': allowed knobs from"),
        ({"block_size": [4, 0]}, "search_space.block_size: invalid knob block_size=0"),
        ({"learning_rate": {"type": "float", "low": -1.0, "high": 0.01}}, "search_space.learning_rate: invalid knob"),
        ({"schedule": ["wsd", "step"]}, "search_space.schedule: invalid knob schedule='step'"),
    ],
)
def test_a_bad_shared_or_training_dimension_is_refused_at_launch(space, message):
    import yaml

    data = yaml.safe_load((ROOT / "studies" / "search.yaml").read_text())
    data["search_space"] = space
    with pytest.raises(StudyDefinitionError) as error:
        parse_study(data, "search.yaml")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_trial_takes_shared_and_training_knobs_from_its_params():
    import yaml

    data = yaml.safe_load((ROOT / "studies" / "search.yaml").read_text())
    data["search_space"] = {"block_size": [4, 8], "learning_rate": [0.001, 0.01], "selector_rank": [8, 16]}
    definition = parse_study(data, "search.yaml")
    config = trial_config(definition, {"block_size": 4, "learning_rate": 0.01, "selector_rank": 8})
    assert config.algorithm.shared.block_size == 4 and config.algorithm.knobs.selector_rank == 8
    assert config.train.learning_rate == 0.01 and config.train.max_steps == definition.steps_per_trial
    assert config.train.warmup_ratio == definition.base.train.warmup_ratio, "the other training knobs are the base's"


def test_importances_are_computed_for_a_searched_study_and_a_study_that_searches_nothing_says_so(recwarn):
    import dataclasses

    import optuna

    from studies.runner import param_importances

    definition = load_study(ROOT / "studies" / "search.yaml")
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(8):  # the objective follows selector_rank alone
        trial = study.ask()
        rank = trial.suggest_int("selector_rank", 16, 128, log=True)
        trial.suggest_int("conv_kernel_size", 1, 3)
        study.tell(trial, rank / 128)
    importances, note = param_importances(definition, study)
    assert note is None and max(importances, key=importances.get) == "selector_rank"

    unsearched = dataclasses.replace(definition, search_space=[])
    assert param_importances(unsearched, study) == ({}, "not computable: the study searches no knob")
    assert not [w for w in recwarn if "importance" in str(w.message).lower()]
