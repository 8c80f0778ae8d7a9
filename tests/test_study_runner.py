"""Study runner pieces that need no target: relaunches continue the search, and a changed file says what changed."""

from pathlib import Path

import pytest

from studies.runner import baseline_config, open_study, trial_config
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
    definition = load_study(ROOT / "studies" / "default.yaml")
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    suggestions = [_first_suggestion(definition, url) for _ in range(3)]
    assert len({tuple(sorted(s.items())) for s in suggestions}) == 3


def test_a_changed_study_file_names_the_first_difference(tmp_path):
    definition = load_study(ROOT / "studies" / "default.yaml")
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    open_study(definition, url)
    definition.source_text = definition.source_text.replace("n_trials: 5", "n_trials: 6")
    with pytest.raises(StudyDefinitionError, match=r"different definition \(line \d+: 'budget: \{n_trials: 5"):
        open_study(definition, url)


def test_unknown_budget_keys_are_errors():
    import yaml

    data = yaml.safe_load((ROOT / "studies" / "default.yaml").read_text())
    data["budget"]["n_trails"] = 3
    with pytest.raises(StudyDefinitionError, match=r"invalid field budget.n_trails=3: allowed keys \['n_trials'"):
        parse_study(data)


def test_component_baselines_pin_every_shared_knob_and_share_the_base_knobs():
    definition = load_study(ROOT / "studies" / "components.yaml")
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
    definition = load_study(ROOT / "studies" / "default.yaml")
    published = baseline_config(definition, "dflash2_defaults", seed=0).algorithm
    assert published.knobs.selector_rank == 256 and published.shared == definition.base.algorithm.shared
    trial = trial_config(definition, {"selector_rank": 32, "candidate_top_k": 8}).algorithm
    assert (trial.knobs.selector_rank, trial.shared.candidate_top_k) == (32, 8)


@pytest.mark.parametrize(("section", "key"), [("sampler", "sede"), ("pruner", "warmup")])
def test_unknown_sampler_and_pruner_keys_are_errors(section, key):
    import yaml

    data = yaml.safe_load((ROOT / "studies" / "default.yaml").read_text())
    data[section][key] = 1
    with pytest.raises(StudyDefinitionError, match=rf"invalid field {section}.{key}=1: allowed keys \['type'"):
        parse_study(data)
