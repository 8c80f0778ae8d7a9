"""The study schema (pydantic): every error is one line naming the file, the field, its value and what is
allowed, as the hand-written parser's were; its JSON Schema validates every shipped study file."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from studies.schema import StudyDefinitionError, load_study, parse_study, study_json_schema

ROOT = Path(__file__).parent.parent
SEARCH = yaml.safe_load((ROOT / "studies" / "search.yaml").read_text())


def _set(data: dict, dotted: str, value) -> dict:
    data = copy.deepcopy(data)
    *parents, last = dotted.split(".")
    node = data
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return data


DELETE = object()


# Each error the hand-written parser gave (issue 21), by the field it names.
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("sampel", {"type": "tpe"}, "invalid field sampel={'type': 'tpe'}: allowed keys ['name', 'description'"),
        ("name", "bad name!", "invalid field name='bad name!': allowed string should match pattern"),
        ("name", 7, "invalid field name=7: allowed a valid string"),
        ("base.algorithm", "dflash3", "invalid field base.algorithm='dflash3': allowed one of ['dflash'"),
        ("base.shared.block_size", DELETE, "invalid field base.shared=["),
        ("base.train", {"nproc_per_node": 0}, "invalid field base.train.nproc_per_node=0: allowed an integer >= 1"),
        ("base.train", {"max_steps": "ten"}, "base: "),
        ("base", "dflash2", "invalid field base='dflash2': allowed a valid dictionary"),
        ("search_space", {"max_steps": [4, 8]}, "invalid field search_space='max_steps': allowed knobs from"),
        ("search_space", {"selector_rank": []}, "invalid field search_space.selector_rank.choices=[]: allowed a non"),
        ("search_space", {"selector_rank": {"type": "int", "low": 9, "high": 2}}, "low/high=(9, 2): allowed numbers"),
        ("search_space", {"selector_loss_alpha": {"type": "float", "low": 0, "high": 1, "log": True}}, "> 0 on a log"),
        ("search_space", {"selector_rank": {"type": "normal"}}, "type='normal': allowed categorical, int or float"),
        ("sampler.type", "cmaes", "invalid field sampler.type='cmaes': allowed 'tpe', 'grid' or 'random'"),
        ("pruner.type", "sha", "invalid field pruner.type='sha': allowed 'median', 'hyperband' or 'none'"),
        ("sampler.sede", 1, "invalid field sampler.sede=1: allowed keys ['type', 'seed']"),
        ("pruner.warmup", 1, "invalid field pruner.warmup=1: allowed keys ['type', 'warmup_steps']"),
        ("objective", "speed", "invalid field objective='speed': allowed one or a list of distinct"),
        (
            "objective",
            "served_speedup",
            "invalid field objective='served_speedup': allowed a served objective with evaluate.serve: llama.cpp",
        ),
        ("budget.n_trails", 3, "invalid field budget.n_trails=3: allowed keys ['n_trials', 'timeout_s'"),
        ("budget.n_trials", -1, "invalid field budget.n_trials=-1: allowed greater than or equal to 0"),
        ("budget.n_trials", True, "invalid field budget.n_trials=True: allowed a valid integer"),
        ("budget.timeout_s", 0, "invalid field budget.timeout_s=0: allowed greater than 0"),
        ("budget.steps_per_trial", 0, "invalid field budget.steps_per_trial=0: allowed greater than or equal to 1"),
        ("baselines", ["dflash9"], "invalid field baselines=['dflash9']: allowed a list from"),
        ("seeds", [0, 0], "invalid field seeds=[0, 0]: allowed a non-empty list of distinct integers"),
        ("seeds", ["a"], "invalid field seeds.0='a': allowed a valid integer"),
        ("evaluate", {"best": 1}, "invalid field evaluate.best=1: allowed keys ['best_trials'"),
        ("evaluate", {"best_trials": -1}, "invalid field evaluate.best_trials=-1: allowed greater than or equal to 0"),
        ("evaluate", {"num_prompts": 0}, "invalid field evaluate.num_prompts=0: allowed greater than or equal to 1"),
        ("evaluate", {"temperatures": [-1]}, "invalid field evaluate.temperatures.0=-1: allowed greater than or equal"),
        ("evaluate", {"temperatures": []}, "invalid field evaluate.temperatures=[]: allowed"),
        ("evaluate", {"confidence_threshold": 2}, "invalid field evaluate.confidence_threshold=2: allowed less than"),
        ("evaluate", {"register": "a b"}, "invalid field evaluate.register='a b': allowed string should match pattern"),
    ],
)
def test_every_error_is_one_line_naming_field_value_and_what_is_allowed(field, value, message):
    with pytest.raises(StudyDefinitionError) as error:
        parse_study(_set(SEARCH, field, value), "search.yaml")
    text = str(error.value)
    assert text.startswith("search.yaml: ") and "\n" not in text
    assert message in text, text


@pytest.mark.parametrize(
    ("objective", "directions", "prunes"),
    [
        ("realized_accepted_length", ["maximize"], True),
        ("served_speedup", ["maximize"], False),  # exists once the run has finished: nothing to prune on
        (["served_tokens_per_s", "draft_step_ms"], ["maximize", "minimize"], False),
        ("draft_step_ms", ["minimize"], False),  # the validations report accepted length, not this
    ],
)
def test_served_and_cost_objectives_have_their_directions_and_only_the_realized_length_prunes(
    objective, directions, prunes
):
    data = _set(_set(SEARCH, "objective", objective), "evaluate", {"serve": "llama.cpp"})
    definition = parse_study(data, "search.yaml")
    assert definition.directions == directions and definition.prunes is prunes
    assert definition.served_objectives is ("served" in str(objective))


def test_a_pareto_study_has_no_best_run_to_register():
    data = _set(_set(SEARCH, "objective", ["realized_accepted_length", "draft_step_ms"]), "evaluate", {"register": "m"})
    with pytest.raises(
        StudyDefinitionError, match=r"invalid field evaluate.register='m': allowed a model name with one"
    ):
        parse_study(data, "search.yaml")
    assert parse_study(_set(SEARCH, "evaluate", {"register": "m"}), "search.yaml").register == "m"


def test_a_studys_own_prompt_file_is_refused_at_launch_in_one_line(tmp_path, monkeypatch):
    """Read when the study loads, relative to where it is launched: not at the first trial's evaluation."""
    monkeypatch.chdir(tmp_path)
    study_file = tmp_path / "own.yaml"
    study_file.write_text(yaml.safe_dump(_set(SEARCH, "evaluate", {"prompts": "mine.jsonl"})))
    with pytest.raises(StudyDefinitionError) as missing:
        load_study(study_file)
    assert str(missing.value) == (
        f"{study_file}: invalid field evaluate.prompts='mine.jsonl': no such file; "
        'allowed a JSONL file of {"prompt": "..."} per line'
    )
    (tmp_path / "mine.jsonl").write_text('{"prompt": "hi"}\n{"text": "no prompt"}\n')
    with pytest.raises(StudyDefinitionError, match=r"own.yaml: invalid field evaluate.prompts='mine.jsonl': line 2 "):
        load_study(study_file)
    (tmp_path / "mine.jsonl").write_text('{"prompt": "hi"}\n')
    assert load_study(study_file).evaluation.prompts == "mine.jsonl"


def test_a_grid_over_a_float_range_is_refused():
    data = _set(SEARCH, "sampler", {"type": "grid"})
    with pytest.raises(StudyDefinitionError, match="grid sampler needs categorical or linear int dimensions"):
        parse_study(data, "search.yaml")


def test_yaml_syntax_and_top_level_errors(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(StudyDefinitionError, match=r"broken.yaml: not valid YAML"):
        load_study(broken)
    with pytest.raises(StudyDefinitionError, match=r"x.yaml: invalid field <top level>="):
        parse_study(["a", "list"], "x.yaml")


@pytest.mark.parametrize("path", sorted((ROOT / "studies").glob("*.yaml")), ids=lambda p: p.name)
def test_the_json_schema_validates_every_shipped_study_file(path):
    data = yaml.safe_load(path.read_text())
    jsonschema.validate(data, study_json_schema())
    load_study(path)  # and the semantic checks pass too


def test_the_json_schema_rejects_what_the_parser_rejects():
    schema = study_json_schema()
    for field, value in (("budget.n_trails", 3), ("sampler.type", "cmaes"), ("budget.n_trials", -1)):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(_set(SEARCH, field, value), schema)


def test_study_schema_command_prints_the_json_schema():
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", "study", "schema"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == study_json_schema()


FAMILY = yaml.safe_load((ROOT / "studies" / "family.yaml").read_text())


def test_a_member_design_moves_the_algorithm_and_gives_each_member_its_knobs():
    from studies.runner import trial_config

    study = parse_study(FAMILY, "family.yaml")
    points = study.design.points
    assert points == [{"algorithm": name} for name in ("dflash", "dflash2", "jetspec", "domino", "dspark")]
    configs = {p["algorithm"]: trial_config(study, p).algorithm for p in points}
    assert configs["domino"].knobs.domino_rank == 64 and configs["dspark"].knobs.markov_rank == 64
    assert configs["dflash2"].knobs.selector_rank == 64
    # pinned shared knobs kept, defining ones applied
    assert {c.shared.block_size for c in configs.values()} == {8}
    assert configs["jetspec"].shared.block_attention == "causal" and configs["dflash"].shared.loss == "kl_div"
    assert configs["dspark"].shared.loss_weights == {"ce": 0.1, "tv": 1.8}
    assert configs["domino"].shared.loss == "kl_div"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("design.factors", {"algorithm": ["dflash", "eagle"]}, "design.factors.algorithm=['dflash', 'eagle']"),
        ("design.type", "factorial", "members in a one_at_a_time design"),
        ("base.knobs.bogus_knob", 3, "bogus_knob"),
    ],
)
def test_a_bad_member_design_is_refused_in_one_line(field, value, message):
    with pytest.raises(StudyDefinitionError) as error:
        parse_study(_set(FAMILY, field, value), "family.yaml")
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_a_reduced_served_vocabulary_needs_a_served_objective_and_at_least_two_tokens():
    served = _set(
        _set(SEARCH, "objective", "served_speedup"), "evaluate", {"serve": "llama.cpp", "served_vocabulary": 4096}
    )
    assert parse_study(served, "search.yaml").evaluation.served_vocabulary == 4096
    with pytest.raises(
        StudyDefinitionError, match=r"invalid field evaluate.served_vocabulary=4096: allowed null without"
    ):
        parse_study(_set(SEARCH, "evaluate", {"serve": "llama.cpp", "served_vocabulary": 4096}), "search.yaml")
    with pytest.raises(StudyDefinitionError, match=r"invalid field evaluate.served_vocabulary=1: allowed"):
        parse_study(_set(served, "evaluate.served_vocabulary", 1), "search.yaml")


def test_a_served_confidence_cut_needs_a_served_objective_and_a_probability_below_one():
    served = _set(
        _set(SEARCH, "objective", "served_speedup"), "evaluate", {"serve": "llama.cpp", "served_confidence_cut": 0.6}
    )
    assert parse_study(served, "search.yaml").evaluation.served_confidence_cut == 0.6
    assert parse_study(SEARCH, "search.yaml").evaluation.served_confidence_cut == 0.0  # no cut unless asked
    with pytest.raises(
        StudyDefinitionError, match=r"invalid field evaluate.served_confidence_cut=0.6: allowed 0 without"
    ):
        parse_study(_set(SEARCH, "evaluate", {"serve": "llama.cpp", "served_confidence_cut": 0.6}), "search.yaml")
    with pytest.raises(StudyDefinitionError, match=r"invalid field evaluate.served_confidence_cut=1"):
        parse_study(_set(served, "evaluate.served_confidence_cut", 1), "search.yaml")


def test_a_served_draft_length_needs_a_served_objective_and_lies_below_the_block():
    served = _set(
        _set(SEARCH, "objective", "served_speedup"), "evaluate", {"serve": "llama.cpp", "served_draft_length": 2}
    )
    assert parse_study(served, "search.yaml").evaluation.served_draft_length == 2
    assert parse_study(SEARCH, "search.yaml").evaluation.served_draft_length is None  # the whole block unless asked
    with pytest.raises(
        StudyDefinitionError, match=r"invalid field evaluate.served_draft_length=2: allowed null without"
    ):
        parse_study(_set(SEARCH, "evaluate", {"serve": "llama.cpp", "served_draft_length": 2}), "search.yaml")
    block = parse_study(SEARCH, "search.yaml").base.algorithm.shared.block_size
    with pytest.raises(
        StudyDefinitionError,
        match=rf"invalid field evaluate.served_draft_length={block}: allowed an integer from 1 to {block - 1}, below",
    ):
        parse_study(_set(served, "evaluate.served_draft_length", block), "search.yaml")
    with pytest.raises(StudyDefinitionError, match=r"invalid field evaluate.served_draft_length=0"):
        parse_study(_set(served, "evaluate.served_draft_length", 0), "search.yaml")


def test_a_sweep_over_the_data_needs_one_validation_set_and_prepares_each_mixture_once():
    data = yaml.safe_load((ROOT / "studies" / "data-mixture.yaml").read_text())
    definition = parse_study(data, "data-mixture.yaml")
    assert [c.data.dataset for c in definition.data_variants()] == ["chitchat", "sharegpt", "sharegpt:4+magpie:1"]
    assert {c.data.validation_data for c in definition.data_variants()} == {"sharegpt:1+chitchat:1"}
    without = _set(data, "base.data.validation_data", DELETE)
    with pytest.raises(StudyDefinitionError, match=r"invalid field base.data.validation_data=None: allowed a source"):
        parse_study(without, "data-mixture.yaml")
    with pytest.raises(StudyDefinitionError, match=r"search_space.dataset: invalid --data='sharegpt:0'"):
        parse_study(_set(data, "search_space.dataset", ["chitchat", "sharegpt:0"]), "data-mixture.yaml")
