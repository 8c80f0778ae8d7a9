"""The data loader says what it cannot use: bad rows are skipped and counted, unusable files are refused."""

import json
import logging

import pytest

from harness.data import DataConfig, conversation_problem, load_conversations, read_prompts

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
        loaded = load_conversations(DataConfig(dataset=str(data), num_conversations=4, num_validation=1), tmp_path)
    assert loaded == [GOOD] * 4
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
        loaded = load_conversations(DataConfig(dataset=str(data), num_conversations=3, num_validation=1), tmp_path)
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
