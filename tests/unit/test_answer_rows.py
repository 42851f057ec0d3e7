"""Rows of answers (preference pairs, KTO rows): every shape read into one checked row, bad rows said in one line,
and the check that keeps each objective on the data it reads."""

from __future__ import annotations

import pytest

from bigbatch.data import answers as data_answers
from bigbatch.data.answer_rows import EMPTY, IDENTICAL, MALFORMED, MISSING, answer_row
from bigbatch.data.answers import KTO, PAIRS, answer_kind, check_answers_for_objective
from bigbatch.engine import batch as engine_batch
from bigbatch.errors import DataError

USER = {"role": "user", "content": "What is 2 + 2?"}
SYSTEM = {"role": "system", "content": "Be brief."}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_the_prepare_command_offers_the_bad_row_policies() -> None:
    from bigbatch.cli.app import build_parser

    parser = build_parser()
    prepare = next(a for a in parser._actions if a.dest == "command").choices["prepare"]  # type: ignore[attr-defined]
    (action,) = [a for a in prepare._actions if "--bad-rows" in a.option_strings]
    assert tuple(action.choices) == data_answers.BAD_ROWS.values


def test_the_roles_are_the_engines() -> None:
    """Preparing data must not import torch, so the roles are repeated in data/answers.py: they must agree."""
    for name in ("ROLE_CHOSEN", "ROLE_REJECTED", "ROLE_DESIRABLE", "ROLE_UNDESIRABLE", "ROLE_KL"):
        assert getattr(data_answers, name) == getattr(engine_batch, name)


@pytest.mark.parametrize(
    ("record", "kind"),
    [
        ({"prompt": "p", "chosen": "a", "rejected": "b"}, PAIRS),
        ({"chosen": [USER, assistant("a")], "rejected": [USER, assistant("b")]}, PAIRS),
        ({"prompt": "p", "chosen": "a"}, PAIRS),  # of that kind, missing a field
        ({"prompt": "p", "completion": "c", "label": True}, KTO),
        ({"prompt": "p", "completion": "c"}, ""),  # prompt/completion: ordinary
        ({"text": "t", "label": 3}, ""),  # a classification row stays text
        ({"messages": [USER, assistant("a")]}, ""),
    ],
)
def test_answer_kind(record: dict, kind: str) -> None:
    assert answer_kind(record) == kind


def test_a_text_pair() -> None:
    row = answer_row({"prompt": "Q:", "chosen": " yes", "rejected": " no"}, "f.jsonl:1")
    assert row.bad is None and row.kind == PAIRS and not row.conversational
    assert (row.prompt, row.answers, row.roles) == ("Q:", (" yes", " no"), (0, 1))


def test_a_text_pair_without_prompt_shares_its_beginning_the_space_going_with_the_answer() -> None:
    """Anthropic HH's layout, read as TRL's extract_prompt reads it."""
    row = answer_row({"chosen": "Human: hi Assistant: hello", "rejected": "Human: hi Assistant: go away"}, "r")
    assert row.bad is None
    assert (row.prompt, row.answers) == ("Human: hi Assistant:", (" hello", " go away"))


def test_a_conversational_pair_with_and_without_prompt() -> None:
    explicit = answer_row(
        {"prompt": [SYSTEM, USER], "chosen": [assistant("4")], "rejected": [assistant("5")]}, "f.jsonl:1"
    )
    implicit = answer_row(
        {"chosen": [SYSTEM, USER, assistant("4")], "rejected": [SYSTEM, USER, assistant("5")]}, "f.jsonl:1"
    )
    for row in (explicit, implicit):
        assert row.bad is None and row.conversational
        assert list(row.prompt) == [SYSTEM, USER]
        assert row.answers == (assistant("4"), assistant("5"))
    # an answer given as one message object, or as a string, is one assistant message
    loose = answer_row({"prompt": [USER], "chosen": assistant("4"), "rejected": "5"}, "f.jsonl:1")
    assert loose.bad is None and loose.answers == (assistant("4"), assistant("5"))


def test_kto_rows_as_text_and_as_conversations() -> None:
    text = answer_row({"prompt": "Q:", "completion": " yes", "label": True}, "k:1")
    assert text.bad is None and text.kind == KTO and text.label is True and text.roles == (2,)
    chat = answer_row({"prompt": [USER], "completion": [assistant("4")], "label": 0}, "k:2")
    assert chat.bad is None and chat.conversational and chat.label is False and chat.roles == (3,)


@pytest.mark.parametrize(
    ("record", "kind", "words"),
    [
        ({"prompt": "p", "chosen": "a"}, MISSING, "missing field 'rejected' (fields: prompt, chosen)"),
        ({"prompt": "p", "chosen": "a", "rejected": None}, MISSING, "missing field 'rejected'"),
        ({"completion": "c", "label": True}, MISSING, "missing field 'prompt'"),
        ({"prompt": "p", "chosen": "same", "rejected": "same"}, IDENTICAL, "identical"),
        ({"chosen": [USER, assistant("a")], "rejected": [USER, assistant("a")]}, IDENTICAL, "identical"),
        ({"prompt": [USER], "chosen": "a", "rejected": assistant("a")}, IDENTICAL, "identical"),
        ({"prompt": "p", "chosen": "  ", "rejected": "b"}, EMPTY, "the chosen answer is empty"),
        ({"prompt": "", "chosen": "a", "rejected": "b"}, EMPTY, "the prompt is empty"),
        ({"chosen": "abc", "rejected": "xyz"}, EMPTY, "share no beginning"),
        ({"chosen": [USER, assistant("a")], "rejected": [SYSTEM, assistant("b")]}, EMPTY, "no leading message"),
        ({"prompt": [USER], "chosen": [assistant("")], "rejected": "b"}, EMPTY, "the chosen answer is empty"),
        ({"prompt": [USER], "chosen": ["a"], "rejected": ["b"]}, MALFORMED, ":7: 'chosen': message 1 is not an obj"),
        ({"prompt": "p", "chosen": [assistant("a")], "rejected": [assistant("b")]}, MALFORMED, "'prompt' is text"),
        ({"prompt": [USER], "chosen": [USER], "rejected": "b"}, MALFORMED, "one assistant message"),
        ({"prompt": [{"role": "bot", "content": "x"}], "chosen": "a", "rejected": "b"}, MALFORMED, "'prompt': mes"),
        ({"prompt": "p", "completion": "c", "label": "yes"}, MALFORMED, "'label' must be true or false"),
    ],
)
def test_bad_rows_say_what_is_wrong_in_one_line_naming_the_row(record: dict, kind: str, words: str) -> None:
    row = answer_row(record, "data/prefs.jsonl:7")
    assert row.bad is not None
    assert row.bad.kind == kind
    assert row.bad.message.startswith("data/prefs.jsonl:7")
    assert words in row.bad.message and "\n" not in row.bad.message


@pytest.mark.parametrize(
    ("answers", "objective"),
    [("", "lm"), ("pairs", "dpo"), ("pairs", "ipo"), ("pairs", "simpo"), ("pairs", "orpo"), ("kto", "kto")],
)
def test_each_objective_reads_its_data(answers: str, objective: str) -> None:
    check_answers_for_objective(answers, objective)


@pytest.mark.parametrize(
    ("answers", "objective", "fix"),
    [
        ("kto", "lm", "--objective kto"),  # once read silently as prompt/completion
        ("kto", "dpo", "--objective kto"),
        ("pairs", "lm", "--objective dpo"),
        ("pairs", "kto", "--objective dpo"),
        ("", "dpo", "--objective lm"),
        ("", "kto", "--objective lm"),
    ],
)
def test_a_mismatched_objective_is_refused_naming_the_fix(answers: str, objective: str, fix: str) -> None:
    with pytest.raises(DataError, match=fix) as caught:
        check_answers_for_objective(answers, objective)
    assert "\n" not in str(caught.value)


def test_ultrafeedback_binarized_rows_read_their_prompt_from_the_conversations() -> None:
    """UltraFeedback-binarized: 'prompt' as text beside answers that are whole conversations (the user turn
    included), and fields of its own: the prompt is the conversations' shared beginning, as TRL reads it."""
    record = {
        "prompt": USER["content"],
        "prompt_id": "0",
        "chosen": [USER, assistant("4")],
        "rejected": [USER, assistant("5")],
        "messages": [USER, assistant("4")],
        "score_chosen": 8.0,
        "score_rejected": 3.5,
    }
    row = answer_row(record, "uf.jsonl:1")
    assert row.bad is None and row.kind == PAIRS and row.conversational
    assert list(row.prompt) == [USER] and row.answers == (assistant("4"), assistant("5"))
