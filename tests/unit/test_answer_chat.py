"""Conversational rows of answers rendered with real chat templates (byte copies: Qwen2.5's ChatML and Llama 3's):
only the final answer is trained, with its end-of-turn token, never an assistant turn of the prompt; an implicit
prompt is the explicit one; a long prompt loses its oldest rounds for every answer alike; a KTO row's KL document
is its prompt's tokens before the next row's answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from real_templates import real_chat_dir

from bigbatch.data.answers import ROLE_CHOSEN, ROLE_KL, ROLE_REJECTED
from bigbatch.data.chat import ChatSettings
from bigbatch.data.dataset import open_dataset
from bigbatch.data.loader import loader_for
from bigbatch.data.prepare import prepare_dataset
from bigbatch.data.tokenizers import get_tokenizer

END_OF_TURN = {"qwen2.5": "<|im_end|>", "llama3": "<|eot_id|>"}
SYSTEM = {"role": "system", "content": "Answer briefly."}
FIRST = {"role": "user", "content": "Name a colour."}
EARLIER = {"role": "assistant", "content": "Red is one."}
SECOND = {"role": "user", "content": "Another?"}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("answer-chat")
    return {family: real_chat_dir(root / family, family) for family in END_OF_TURN}


def prepare(tmp_path: Path, directory: Path, rows: list[dict], name: str = "out", **chat: object) -> Path:
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    out = tmp_path / name
    settings = ChatSettings(**chat)  # type: ignore[arg-type]
    prepare_dataset(str(data), out, f"file:{directory}", val_fraction=0.0, mode="auto", chat=settings)
    return out


def read(out: Path) -> list[tuple[list[int], list[int], int]]:
    shard = open_dataset(out).document_shards("train")[0]
    assert shard.mask is not None and shard.roles is not None
    bounds = shard.offsets.tolist()
    return [
        (shard.tokens[a:b].tolist(), shard.mask[a:b].tolist(), int(role))
        for a, b, role in zip(bounds[:-1], bounds[1:], shard.roles.tolist(), strict=True)
    ]


def decoder(directory: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_str(get_tokenizer(f"file:{directory}").to_str())  # type: ignore[attr-defined]


def trained(document: tuple[list[int], list[int], int], tokenizer: tokenizers.Tokenizer) -> str:
    ids, mask, _ = document
    run = [i for i, m in enumerate(mask) if m]
    assert run == list(range(run[0], run[-1] + 1))  # one trained run: the answer
    return str(tokenizer.decode([ids[i] for i in run], skip_special_tokens=False))


@pytest.mark.parametrize("family", list(END_OF_TURN))
def test_only_the_final_answer_and_its_end_of_turn_token_are_trained(
    tmp_path: Path, families: dict[str, Path], family: str
) -> None:
    directory = families[family]
    prompt = [SYSTEM, FIRST, EARLIER, SECOND]
    explicit = {"prompt": prompt, "chosen": [assistant("Blue.")], "rejected": [assistant("No.")]}
    implicit = {"chosen": [*prompt, assistant("Blue.")], "rejected": [*prompt, assistant("No.")]}
    documents = read(prepare(tmp_path, directory, [explicit], "explicit"))
    assert documents == read(prepare(tmp_path, directory, [implicit], "implicit"))
    tokenizer = decoder(directory)
    (chosen, rejected) = documents
    assert (chosen[2], rejected[2]) == (ROLE_CHOSEN, ROLE_REJECTED)
    end = END_OF_TURN[family]
    assert trained(chosen, tokenizer) == f"Blue.{end}"
    assert trained(rejected, tokenizer) == f"No.{end}"
    rendered = tokenizer.decode(chosen[0], skip_special_tokens=False)
    assert "Red is one." in rendered and "Answer briefly." in rendered  # the earlier reply: prompt, not trained
    first = chosen[1].index(1)
    assert chosen[0][:first] == rejected[0][: rejected[1].index(1)]  # both answers follow the same prompt


def test_a_long_prompt_loses_its_oldest_rounds_for_every_answer_and_keeps_the_system_prompt(
    tmp_path: Path, families: dict[str, Path]
) -> None:
    directory = families["qwen2.5"]
    prompt = [SYSTEM, FIRST, EARLIER, SECOND]
    row = {"prompt": prompt, "chosen": [assistant("Blue.")], "rejected": [assistant("Green, surely.")]}
    whole = read(prepare(tmp_path, directory, [row], "whole"))
    limit = max(len(ids) for ids, _, _ in whole) - 1  # one token short: the oldest round must go
    out = prepare(tmp_path, directory, [row], "short", max_tokens=limit)
    audit = open_dataset(out).meta.extra["answer_rows"]
    assert isinstance(audit, dict) and (audit["shortened"], audit["turns_cut"]) == (1, 2)
    tokenizer = decoder(directory)
    shortened = read(out)
    prompts = []
    for ids, mask, _ in shortened:
        text = tokenizer.decode(ids[: mask.index(1)], skip_special_tokens=False)
        assert "Answer briefly." in text and "Another?" in text
        assert "Name a colour." not in text and "Red is one." not in text
        prompts.append(ids[: mask.index(1)])
    assert prompts[0] == prompts[1]
    assert trained(shortened[1], tokenizer) == "Green, surely.<|im_end|>"


def test_a_conversational_kto_row_s_kl_document_is_its_prompt_before_the_next_row_s_answer(
    tmp_path: Path, families: dict[str, Path]
) -> None:
    directory = families["llama3"]
    rows = [
        {"prompt": [FIRST], "completion": [assistant("Blue.")], "label": True},
        {"prompt": [SECOND], "completion": [assistant("Nothing.")], "label": False},
    ]
    (own0, kl0, own1, kl1) = read(prepare(tmp_path, directory, rows))
    assert (kl0[2], kl1[2]) == (ROLE_KL, ROLE_KL)

    def split(document: tuple[list[int], list[int], int]) -> tuple[list[int], list[int]]:
        ids, mask, _ = document
        return ids[: mask.index(1)], ids[mask.index(1) :]

    assert kl0[0] == split(own0)[0] + split(own1)[1]
    assert kl1[0] == split(own1)[0] + split(own0)[1]
    assert trained(kl0, decoder(directory)) == "Nothing.<|eot_id|>"


def test_the_loader_marks_the_chosen_answer_s_targets_as_answer_0(tmp_path: Path, families: dict[str, Path]) -> None:
    """End to end: the targets a micro-batch's segment gives answer 0 decode to the chosen answer and its
    end-of-turn token, answer 1's to the rejected one."""
    directory = families["qwen2.5"]
    row = {"prompt": [SYSTEM, FIRST], "chosen": [assistant("Blue.")], "rejected": [assistant("Green.")]}
    loader = loader_for(open_dataset(prepare(tmp_path, directory, [row])), "train", 2, 64, pack=True)
    batch = loader.next_micro_batch()
    assert batch.answers is not None and batch.answers.role.tolist() == [ROLE_CHOSEN, ROLE_REJECTED]
    tokenizer = decoder(directory)
    for answer, text in enumerate(("Blue.<|im_end|>", "Green.<|im_end|>")):
        picked = batch.targets[batch.answers.segment == answer].tolist()
        assert tokenizer.decode(picked, skip_special_tokens=False) == text


def test_a_pair_the_template_renders_the_same_is_a_bad_row(families: dict[str, Path], tmp_path: Path) -> None:
    """Llama 3's template trims each message: answers differing only by trailing spaces render to the same tokens,
    a pair that prefers nothing (refused in one line; --bad-rows drop leaves it out, counted)."""
    from bigbatch.data.answers import AnswerSettings
    from bigbatch.errors import DataError

    rows = [
        {"prompt": [FIRST], "chosen": [assistant("Blue.  ")], "rejected": [assistant("Blue.")]},
        {"prompt": [FIRST], "chosen": [assistant("Green.")], "rejected": [assistant("Blue.")]},
    ]
    with pytest.raises(DataError, match=r"out\.jsonl:1: 'chosen' and 'rejected' are the same tokens once rendered"):
        prepare(tmp_path, families["llama3"], rows)
    assert not (tmp_path / "out").exists()
    data = tmp_path / "drop.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    out = tmp_path / "drop"
    prepare_dataset(
        str(data),
        out,
        f"file:{families['llama3']}",
        val_fraction=0.0,
        mode="auto",
        chat=ChatSettings(),
        answers=AnswerSettings(bad_rows="drop"),
    )
    assert len(read(out)) == 2  # one pair left: its two documents
